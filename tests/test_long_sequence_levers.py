"""The long-sequence levers in every combination (docs/long-sequences.md "Memory"): DeepSpeed-Ulysses SP in {1, 2} x
full recomputation x --tiled-mlp-compute with --tiled-logits-loss x --checkpoint-in-cpu (only with recomputation), at
1,024 and 2,048 tokens on CPU ranks (2 gloo ranks for SP=2). Each cell runs the real model's training step and holds
megatron/accounting/predict/memory.py to what it measures: the activations autograd saves in the forward
(activation_bytes, within 1%), the host tier (offloaded_activation_bytes, exactly) and the peak of the accelerator's
live bytes over the forward and the backward (memory_per_rank's total less the model states, within 10%)."""
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from megatron.accounting import TrainingSetup, activation_bytes, memory_per_rank
from megatron.accounting.measure import memory
from megatron.core.scratch import ScratchBuffers
from megatron.model import GPTConfig, GPTModel
from megatron.training import get_batch

MIB = 2**20
TINY = GPTConfig(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=1024, max_position_embeddings=2048,
                 padded_vocab_size=1024, hidden_dropout=0.0, attention_dropout=0.0)
# (recompute, tiled MLP and loss, offload): offload only with recompute (refused without it)
CELLS = [(False, False, False), (False, True, False), (True, False, False), (True, True, False),
         (True, False, True), (True, True, True)]
TILED = dict(tiled_mlp_compute=True, tiled_mlp_shards=4, tiled_logits_loss=True, tiled_logits_loss_shards=4)


def _measure(config: GPTConfig, sp_group=None, sequence=None) -> dict[str, int]:
    """One training step of micro-batch 1 after a first one (the gradients exist, as in a run's later steps): the
    activations saved in the forward, the host tier after it, the peak live bytes."""
    torch.manual_seed(0)
    model = GPTModel(config, sp_group=sp_group).train()
    text = torch.randint(0, 1000, (1, config.seq_length + 1), generator=torch.Generator().manual_seed(7))
    tokens, labels, positions, _ = get_batch({"text": text}, torch.device("cpu"), -1, False, sequence)
    model(tokens, positions, labels).float().mean().backward()
    states = {tensor.untyped_storage().data_ptr() for param in model.parameters() for tensor in (param, param.grad)}
    # a new logits buffer, made inside and so counted: on CPU ranks the model keeps it from the loss's forward to
    # the step's end (megatron/core/scratch.py), and the predicted total holds it beside the recomputed layer
    model.lm_loss_scratch = ScratchBuffers()
    with memory.LiveBytes(states) as live:
        with memory.saved_activation_bytes(model) as saved:
            loss = model(tokens, positions, labels)
        host = memory.host_tier_bytes()
        loss.float().mean().backward()
    return dict(activations=saved[0], host=host, peak=live.peak)


def _predict(config: GPTConfig, setup: TrainingSetup) -> dict[str, int]:
    rank = memory_per_rank(config, setup)
    return dict(activations=activation_bytes(config, setup), host=rank["activations_offloaded"],
                peak=rank["total"] - rank["model_states"])


def _grid(sp: int, sp_group=None, sequence=None) -> list[str]:
    """Measure and predict every cell at 1,024 and 2,048 tokens; assert each; return the table's rows (MiB)."""
    rows, misses = [], []
    for seq_length in (1024, 2048):
        for recompute, tiled, offload in CELLS:
            config = replace(TINY, seq_length=seq_length, recompute_activations=recompute, recompute_offload=offload,
                             **(TILED if tiled else {}))
            setup = TrainingSetup(world_size=sp, micro_batch_size=1, device="cpu", sequence_parallel_size=sp,
                                  activation_recompute=recompute, activation_offload=offload)
            measured, predicted = _measure(config, sp_group, sequence), _predict(config, setup)
            rows.append(f"SP={sp} s={seq_length} recompute={recompute:d} tiled={tiled:d} offload={offload:d}: " +
                        " ".join(f"{key} {measured[key] / MIB:.3f}/{predicted[key] / MIB:.3f}" for key in measured))
            if not (measured["activations"] == pytest.approx(predicted["activations"], rel=0.01)
                    and measured["host"] == predicted["host"]
                    and measured["peak"] == pytest.approx(predicted["peak"], rel=0.1)):
                misses.append(rows[-1])
    assert not misses, "measured/predicted MiB off:\n" + "\n".join(misses)
    return rows


@pytest.mark.slow
def test_every_combination_on_one_rank_keeps_the_predicted_memory():
    """SP=1: measured/predicted MiB of each cell printed (pytest -s)."""
    print("\n" + "\n".join(_grid(1)))


def _check_ulysses_grid(rank, world):
    import deepspeed

    from megatron.core.layout import ParallelLayout
    from megatron.core.parallel_state import ParallelState
    deepspeed.init_distributed(dist_backend="gloo")  # DistributedAttention's all-to-alls go through deepspeed.comm
    state = ParallelState.build(ParallelLayout(world_size=world, sequence_parallel_size=2))
    rows = _grid(2, state.get_sequence_parallel_group(), state.sequence)
    if dist.get_rank() == 0:
        print("\n" + "\n".join(rows), flush=True)


@pytest.mark.slow
def test_every_combination_on_two_ulysses_ranks_keeps_the_predicted_memory():
    """SP=2 on 2 gloo ranks: each rank's s/2 tokens, both ranks asserting."""
    from test_tensor_parallel import run_ranks
    run_ranks(_check_ulysses_grid)


def test_offload_without_recompute_is_refused_in_one_line():
    with pytest.raises(ValueError, match="^--checkpoint-in-cpu offloads the recomputed layers' inputs"):
        TrainingSetup(world_size=1, micro_batch_size=1, activation_offload=True)


LEVER_FLAGS = ("--checkpoint-activations", "--tiled-mlp-compute", "--tiled-logits-loss", "--checkpoint-in-cpu")


def _check_the_probed_step_alone_measures_its_peak(rank, world):
    """A real engine (setup_engine, ZeRO-1 fp32, one gloo rank, 2 micro-batches of 2 a step) at 1,024 tokens with
    every lever: the probed step's step_peak_bytes within 10% of memory_per_rank's total less the model states (15.5
    MiB measured, 16.1 predicted); only its first micro-batch's forward runs under the dispatch mode, the second's
    and a later step's under none, and a later step measures nothing."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    import test_host_syncs as syncs
    from megatron.accounting.run_setup import training_setup
    from megatron.training import train_step

    syncs.SEQ = 1024
    engine, args, dist_info = syncs._engine(2, 1, "fp32", *LEVER_FLAGS, "--hidden-dropout", "0",
                                            "--attention-dropout", "0")
    data, modes = syncs.batches(), []
    engine.module.register_forward_hook(lambda *_: modes.append(len(_get_current_dispatch_mode_stack())))
    probed = train_step(engine, data, args, dist_info, syncs.VOCAB - 1, probe_memory=True)
    later = train_step(engine, data, args, dist_info, syncs.VOCAB - 1)
    predicted = memory_per_rank(args.model, training_setup(args, dist_info))
    assert probed.step_peak_bytes == pytest.approx(predicted["total"] - predicted["model_states"], rel=0.1)
    assert later.step_peak_bytes is None and modes == [1, 0, 0, 0]


@pytest.mark.slow
def test_the_probed_step_alone_measures_its_peak():
    from test_tensor_parallel import run_ranks
    run_ranks(_check_the_probed_step_alone_measures_its_peak, world_size=1)


@pytest.mark.slow
def test_the_model_state_line_holds_the_step_peak_at_sp2_with_every_lever(tmp_path):
    """pretrain_gpt.py on 2 CPU ranks at SP=2, 1,024 tokens of the byte vocabulary (bench/common.py's byte_data: a
    small output layer, as the long-sequence bench runs), recompute + tiled MLP and loss + --checkpoint-in-cpu: the
    model-state line's measured step_peak within 10% of its estimate, memory_per_rank's total less the model
    states; no other line carries one."""
    import subprocess
    import sys

    from conftest import REPO_ROOT, free_port, test_env
    from analysis.log_parser import parse_log

    sys.path.insert(0, str(REPO_ROOT / "bench"))
    from common import BYTE_VOCAB, byte_data

    data = byte_data(tmp_path / "data")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(free_port()), str(REPO_ROOT / "pretrain_gpt.py"), "--model-size", "tiny",
                          "--use-rotary-position-embeddings", "--seq-length", "1024", "--micro-batch-size", "1",
                          "--global-batch-size", "1", "--ds-sequence-parallel-size", "2", "--zero-stage", "1",
                          "--train-iters", "2", "--log-interval", "1", "--eval-interval", "3", "--eval-iters", "0",
                          "--lr", "1e-3", "--hidden-dropout", "0", "--attention-dropout", "0", "--data-path",
                          str(data), "--tokenizer-type", "NullTokenizer", "--vocab-size", str(BYTE_VOCAB),
                          *LEVER_FLAGS], env=test_env(OMP_NUM_THREADS="1"), capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    log = tmp_path / "train.log"
    log.write_text(run.stdout)
    state = parse_log(log).model_state
    assert state.measured["step_peak"] > 0, run.stdout[-3000:]
    assert state.measured["step_peak"] == pytest.approx(state.estimate["step_peak"], rel=0.1)
    assert run.stdout.count("step_peak=") == 2  # the model-state line's two halves, once: no other step measures
