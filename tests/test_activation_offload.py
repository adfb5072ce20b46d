"""--checkpoint-in-cpu with zero-lab's recompute (megatron/core/tensor_parallel/activation_offload.py): each layer's
input waits in the host tier until its recompute. The same gradients and losses as without it; the accelerator keeps
what megatron/accounting/predict/memory.py says (nothing per layer) and the host tier the predicted layer inputs;
the memory measurement counts the host tier as host memory, on CPU ranks too (where it is an emulation)."""
from dataclasses import replace

import pytest
import torch

from megatron.accounting import TrainingSetup, activation_bytes, memory_per_rank, offloaded_activation_bytes
from megatron.accounting.measure import memory
from megatron.accounting.predict.traffic import offload_transfer_per_step
from megatron.arguments import ConfigError, parse_args
from megatron.core.tensor_parallel.activation_offload import HostTensor, to_host
from megatron.model import GPTConfig, GPTModel
from megatron.training import get_batch
from megatron.training_log import GB, model_state_line
from test_arguments import base
from analysis.log_parser import ParsedLog, parse_line

TINY = GPTConfig(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=512, max_position_embeddings=1024,
                 padded_vocab_size=1024, hidden_dropout=0.1, attention_dropout=0.0, recompute_activations=True)


def _step(config: GPTConfig) -> tuple[int, int, torch.Tensor, list[torch.Tensor]]:
    """(accelerator activations, host-tier bytes) of one training forward of micro-batch 2, its loss and the
    gradients of its backward."""
    torch.manual_seed(0)
    model = GPTModel(config).train()
    text = torch.randint(0, 1000, (2, config.seq_length + 1), generator=torch.Generator().manual_seed(7))
    tokens, labels, positions, _ = get_batch({"text": text}, torch.device("cpu"), -1, False, None)
    with memory.saved_activation_bytes(model) as saved:
        loss = model(tokens, positions, labels)
    host = memory.host_tier_bytes()
    loss.float().mean().backward()
    grads = [p.grad for p in model.parameters()]
    return saved[0], host, loss.detach(), grads


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_offloaded_inputs_give_the_same_gradients_and_the_predicted_memory(dropout):
    """Dropout too (the recompute draws the same masks): bit-identical loss and gradients. The accelerator keeps the
    layers' nothing (activation_bytes with the offload, within 1%: what lies outside the layers), the host tier
    exactly 2 layers x [512, 2, 128] fp32."""
    config = replace(TINY, hidden_dropout=dropout)
    device, host, loss, grads = _step(config)
    device_off, host_off, loss_off, grads_off = _step(replace(config, recompute_offload=True))
    assert torch.equal(loss, loss_off) and all(torch.equal(a, b) for a, b in zip(grads, grads_off))
    setup = TrainingSetup(world_size=1, micro_batch_size=2, device="cpu", activation_recompute=True)
    offload = replace(setup, activation_offload=True)
    assert host == 0 and host_off == offloaded_activation_bytes(config, offload) == 2 * 512 * 2 * 128 * 4
    assert device == pytest.approx(activation_bytes(config, setup), rel=0.01)
    assert device_off == pytest.approx(activation_bytes(config, offload), rel=0.01)
    assert device - device_off == host_off  # what left the accelerator is what the host tier holds
    assert memory.host_tier_bytes() == 0  # freed with the graph


def test_the_host_tier_is_host_memory_to_the_measurement():
    before = memory.live_tensor_bytes()
    host = to_host(torch.zeros(1 << 18))  # 1 MiB
    assert type(host) is HostTensor and memory.host_tier_bytes() == 1 << 20
    assert memory.live_tensor_bytes() == before  # MemAllocated on CPU ranks leaves it out
    assert type(host + 1) is torch.Tensor  # torch functions on it give plain tensors
    del host
    assert memory.host_tier_bytes() == 0


def test_the_prediction_moves_the_layer_inputs_to_the_host():
    """Per rank: the accelerator drops L x [s, b, h] and its peak gains the recomputed layer's input copied back;
    the host keeps L x the input per micro-batch in flight; each input crosses twice per micro-batch (PCIe)."""
    config = replace(TINY, num_layers=4, seq_length=1024)
    setup = TrainingSetup(world_size=2, micro_batch_size=2, gradient_accumulation_steps=3, device="cuda",
                          activation_recompute=True, sequence_parallel_size=2, precision="bf16")
    offload = replace(setup, activation_offload=True)
    layer_input = 512 * 2 * 128 * 2  # s/N tokens x b x h x 2 bytes
    before, after = memory_per_rank(config, setup), memory_per_rank(config, offload)
    assert before["activations"] - after["activations"] == 4 * layer_input
    assert after["activations_offloaded"] == 4 * layer_input and before["activations_offloaded"] == 0
    assert before["total"] - after["total"] == 3 * layer_input
    moved = offload_transfer_per_step(config, offload)["pcie"] - offload_transfer_per_step(config, setup)["pcie"]
    assert moved == 2 * 3 * 4 * layer_input
    with pytest.raises(ValueError, match="--checkpoint-in-cpu offloads the recomputed layers' inputs"):
        replace(setup, activation_recompute=False, activation_offload=True)


def test_the_model_state_line_shows_the_host_tier_only_where_it_is_used():
    measured = dict(params=GB, grads=GB, optim=GB, offloaded=0, activations=GB / 4, other=GB)
    estimate = dict(params=GB, grads=GB, optim=GB, model_states=3 * GB, offloaded=0, activations=GB / 4,
                    output_buffer=GB, activations_offloaded=0)
    plain = model_state_line(measured, estimate, 1, 2, "fp32", "none")
    assert "activations_offloaded" not in plain
    line = model_state_line({**measured, "activations_offloaded": GB / 2},
                            {**estimate, "activations_offloaded": GB / 2}, 1, 2, "fp32", "none")
    assert "activations=0.2500 activations_offloaded=0.5000 other=1.0000 |" in line
    assert "activations=0.2500 activations_offloaded=0.5000 output_buffer=1.0000 |" in line
    parsed = _parsed(line)
    assert parsed.measured["activations_offloaded"] == parsed.estimate["activations_offloaded"] == 0.5
    assert parsed.measured["other"] == 1.0
    assert "activations_offloaded" not in _parsed(plain).measured  # an older line parses as before


def _parsed(line: str):
    log = ParsedLog(path=None)
    parse_line(log, line)
    return log.model_state


def test_checkpoint_in_cpu_needs_recompute_and_offloads_zero_labs_own(data_prefix):
    def parse(*flags):
        return parse_args(base(data_prefix, "--global-batch-size", "4", *flags), world_size=2)

    with pytest.raises(ConfigError, match="^--checkpoint-in-cpu keeps each recomputed layer's input in host "
                                          "memory: add --checkpoint-activations"):
        parse("--checkpoint-in-cpu")
    assert parse("--checkpoint-activations", "--checkpoint-in-cpu").model.recompute_offload
    assert parse("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
                 "--checkpoint-in-cpu").model.recompute_offload
    # DeepSpeed's checkpoint keeps its inputs itself: its cpu_checkpointing, on CUDA (megatron/engine.py)
    ds = parse("--checkpoint-activations", "--checkpoint-in-cpu", "--deepspeed-activation-checkpointing")
    assert ds.model.recompute_with_deepspeed and not ds.model.recompute_offload and ds.deepspeed.checkpoint_in_cpu
    assert not parse("--checkpoint-activations").model.recompute_offload
    assert "recompute_offload" not in parse("--checkpoint-activations", "--checkpoint-in-cpu").model.to_dict()


# The trainer's runs: 2 CPU ranks under DeepSpeed-Ulysses SP=2, 4 tiny layers at 1024 tokens, micro-batch 4 (each
# rank's layer input [512, 4, 128] fp32, 1 MiB), 3 iterations, recomputing with and without --checkpoint-in-cpu
OFFLOAD_RUN = ("--ds-sequence-parallel-size", "2", "--checkpoint-activations", "--num-layers", "4", "--seq-length",
               "1024", "--micro-batch-size", "4", "--exit-interval", "3")


@pytest.fixture(scope="module")
def offload_runs(dolly_data_dir):
    from conftest import parallel_pretrain
    return {(stage, lever): parallel_pretrain(dolly_data_dir, 2, *OFFLOAD_RUN, "--zero-stage", str(stage),
                                              *(["--checkpoint-in-cpu"] if lever else [])).stdout
            for stage in (1, 3) for lever in (False, True)}


def _model_state(log: str):
    return _parsed(next(line for line in log.splitlines() if "model state memory per rank" in line))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_the_trainer_offloading_gives_the_same_losses_and_the_predicted_memory(offload_runs, stage):
    """The same losses to the last printed digit at ZeRO 1 and 3; the model-state line's measured accelerator
    activations and host tier within 10% of their estimates: 4 MiB in host memory, the accelerator's activations
    down by as much."""
    from test_parallel_training import losses
    plain, offloaded = offload_runs[stage, False], offload_runs[stage, True]
    assert len(losses(plain)) == 3 and losses(offloaded) == losses(plain)
    before, after = _model_state(plain), _model_state(offloaded)
    assert "activations_offloaded" not in before.measured and "activations_offloaded" not in before.estimate
    host = 4 * 512 * 4 * 128 * 4 / GB
    assert after.estimate["activations_offloaded"] == pytest.approx(host, abs=1e-4)
    assert after.measured["activations_offloaded"] == pytest.approx(after.estimate["activations_offloaded"], rel=0.1)
    assert after.measured["activations"] == pytest.approx(after.estimate["activations"], rel=0.1)
    assert before.measured["activations"] - after.measured["activations"] == pytest.approx(host, abs=2e-4)


def test_the_step_time_pays_the_copies_at_the_host_copy_rate():
    """The offload part grows by the layer inputs' two crossings per micro-batch at the probed host-copy rate; the
    rest of the step is unchanged."""
    from megatron.accounting.predict.step_time import ComputeRates, link_costs_from_flags, predict_step_time
    config = replace(TINY, num_layers=4, seq_length=1024)
    setup = TrainingSetup(world_size=2, micro_batch_size=2, gradient_accumulation_steps=3, device="cpu",
                          activation_recompute=True, sequence_parallel_size=2)
    rates, link = ComputeRates(1e9, 1e-8, host_copy_bytes_per_s=1e9), link_costs_from_flags("gloo", 10, 50)
    before, after = (predict_step_time(config, one, 0, rates, link, {}, overlap_comm=False)
                     for one in (setup, replace(setup, activation_offload=True)))
    assert after.offload - before.offload == pytest.approx(2 * 3 * 4 * 512 * 2 * 128 * 4 / 1e9)
    assert (after.compute, after.communication) == (before.compute, before.communication)
