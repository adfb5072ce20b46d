"""Tensor, pipeline and sequence parallelism through pretrain_gpt.py: real torchrun runs of 1, 2 and
4 CPU ranks on the dolly sample must give the serial run's losses (fp32, dropout off, same seed, so
the same full initial weights), and a TP=2 x PP=2 checkpoint must resume onto the same losses; a resume
on another tensor- or pipeline-parallel size is refused at start-up in one line.

The padded vocabulary must be the same at every TP size for the full weights to match, so runs
with TP=t pass --make-vocab-size-divisible-by 128/t (50257 -> 50304 tokens throughout)."""
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import PARALLEL_ITERS, PARALLEL_LAYOUTS, REPO_ROOT, TP2, free_port, parallel_pretrain, test_env
from megatron.model import GPTConfig, GPTModel, ModelConfigError
from megatron.accounting import count_parameters, parameters_on_rank
from test_tensor_parallel import _single_worker

pytestmark = pytest.mark.slow

# TP=2 x PP=2 runs as a checkpointed pair: iterations 1-3, save, exit; load, iterations 4-5
TP2_PP2 = [*TP2, "--pipeline-model-parallel-size", "2", "--sequence-parallel", "--zero-stage", "0"]


def losses(log: str) -> list[float]:
    """Training losses per iteration, then the validation loss of the last iteration."""
    train = re.findall(r"\| lm loss: (\S+) \|", log)
    return [float(value) for value in train + re.findall(r"\| lm loss value: (\S+) \|", log)]


@pytest.fixture(scope="module")
def layout_logs(parallel_layout_runs):
    return {name: log for name, (log, _) in parallel_layout_runs.items()}


def test_serial_reference_learns(layout_logs):
    reference = losses(layout_logs["serial"])
    assert len(reference) == PARALLEL_ITERS + 1 and reference[PARALLEL_ITERS - 1] < reference[0] - 0.2


@pytest.mark.parametrize("name", [name for name in PARALLEL_LAYOUTS if name != "serial"])
def test_parallel_layout_matches_serial_losses(layout_logs, name):
    log = layout_logs[name]
    world = PARALLEL_LAYOUTS[name][0]
    assert f"| world size: {world} |" in log
    assert losses(log) == pytest.approx(losses(layout_logs["serial"]), rel=1e-5)


@pytest.fixture(scope="module")
def tp2_pp2_runs(dolly_data_dir, tmp_path_factory):
    save = tmp_path_factory.mktemp("tp2_pp2_checkpoints")
    first = parallel_pretrain(dolly_data_dir, 4, *TP2_PP2, "--save", str(save), "--exit-interval", "3").stdout
    resumed = parallel_pretrain(dolly_data_dir, 4, *TP2_PP2, "--load", str(save)).stdout
    return first, resumed, save


def test_tp2_pp2_matches_serial_and_resumes_onto_the_same_losses(layout_logs, tp2_pp2_runs):
    first, resumed, _ = tp2_pp2_runs
    serial = losses(layout_logs["serial"])
    assert "| world size: 4 |" in first and " exiting program at iteration 3 " in first
    assert losses(first) == pytest.approx(serial[:3], rel=1e-5)
    assert "loaded checkpoint" in resumed
    assert re.findall(r" iteration\s+(\d+)/", resumed) == ["4", "5"]
    assert losses(resumed) == pytest.approx(serial[3:], rel=1e-5)


def test_model_state_estimate_counts_the_parameters_rank_0_holds(layout_logs, tp2_pp2_runs):
    """The printing rank of TP=2 x PP=2 (rank 2: tensor rank 0 of the last stage) holds half of the
    split matrices of layer 2 and of its copy of the tied word embedding, and the final LayerNorm."""
    measured = {}
    for name, log in (("serial", layout_logs["serial"]), ("tp2_pp2", tp2_pp2_runs[0])):
        match = re.search(r"measured: params=(\S+) .*? ZeRO estimate .*?: params=(\S+) ", log)
        assert match, name
        measured[name], estimate = map(float, match.groups())
        assert measured[name] == pytest.approx(estimate, abs=1e-4), name
    assert measured["tp2_pp2"] < 0.6 * measured["serial"]
    assert "[Rank 2] memory at iteration" in tp2_pp2_runs[0] and "[Rank 0] memory" not in tp2_pp2_runs[0]


@pytest.mark.parametrize("name", list(PARALLEL_LAYOUTS))
def test_memory_and_traffic_of_each_layout_are_predicted(layout_logs, name):
    """Under TP, SP and PP too, each measured figure of the model-state line (activations: not under PP,
    whose engine runs the forwards) and the bytes sent per iteration within 10% of the prediction."""
    log = layout_logs[name]
    measured, estimate = (dict(re.findall(r"(\w+)=(\d+\.\d+)", part)) for part in
                          re.search(r"measured: ([^|]*)\| ZeRO estimate [^:]*: ([^|]*)\|", log).groups())
    for key in ("params", "grads", "optim", "offloaded", "activations"):
        if key == "activations" and "--pipeline-model-parallel-size" in PARALLEL_LAYOUTS[name][1]:
            assert key not in measured
            continue
        assert float(measured[key]) == pytest.approx(float(estimate[key]), rel=0.10, abs=1e-4), key
    sent = re.findall(r"comm at iteration +\d+ \| .* total=(\S+)MB \| .* predicted=(\S+)MB", log)
    assert len(sent) == PARALLEL_ITERS
    measured_mb, predicted_mb = map(float, sent[-1])
    assert measured_mb == pytest.approx(predicted_mb, rel=0.10)


def test_tp2_pp2_checkpoint_holds_each_tp_rank_s_half(tp2_pp2_runs):
    step = tp2_pp2_runs[2] / "global_step3"
    # DeepSpeed's pipeline layout: one file per (layer, TP rank), and one per model-parallel rank
    # (TP x PP) with the optimizer and our client state
    qkv = {}
    for tp_rank in range(2):
        layer = torch.load(step / f"layer_01-model_0{tp_rank}-model_states.pt", weights_only=False)
        qkv[tp_rank] = layer["self_attention.query_key_value.weight"]
    assert qkv[0].shape == qkv[1].shape == (3 * 128 // 2, 128)  # each TP rank: half of the rows
    assert not torch.equal(qkv[0], qkv[1])
    assert len(list(step.glob("mp_rank_0[0-3]_model_states.pt"))) == 4
    client = torch.load(step / "mp_rank_03_model_states.pt", weights_only=False)
    assert (client["iteration"], client["consumed_samples"]) == (3, 24)
    assert "model_parallel_tracker" in client["rng_state"]


# --- sequence parallelism inside the model, on 2 real gloo ranks (seconds, no DeepSpeed) ---

def _spawned(rank, world, port, fn):
    """test_tensor_parallel's rank, for a check that takes its rank only."""
    _single_worker(rank, world, port, lambda rank, _: fn(rank))


def _sp_config(**overrides):
    fields = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, max_position_embeddings=16,
                  padded_vocab_size=64, hidden_dropout=0.0, attention_dropout=0.0)
    return GPTConfig(**{**fields, **overrides})


def _batch():
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    return ids[:, :-1], torch.arange(8).expand(2, 8), ids[:, 1:]


def _check_sequence_parallel_gpt(rank):
    group = dist.group.WORLD
    tokens, positions, labels = _batch()
    torch.manual_seed(5)
    serial = GPTModel(_sp_config())
    torch.manual_seed(5)
    model = GPTModel(_sp_config(sequence_parallel=True), tp_group=group)
    loss = model(tokens, positions, labels)
    torch.testing.assert_close(loss, serial(tokens, positions, labels), rtol=1e-5, atol=0)
    loss.mean().backward()
    serial(tokens, positions, labels).mean().backward()
    full = dict(serial.named_parameters())
    for name, param in model.named_parameters():
        expected = full[name].grad
        if getattr(param, "tensor_model_parallel", False):
            expected = expected.chunk(2, dim=param.partition_dim)[rank]
        # LayerNorms and row biases see only this rank's half of the sequence: their grads must be summed
        torch.testing.assert_close(param.grad, expected, rtol=1e-4, atol=1e-6, msg=name)

    # with dropout, activation recomputation replays the per-rank masks of the sequence slices exactly
    grads = []
    for recompute in (False, True):
        torch.manual_seed(5)
        model = GPTModel(_sp_config(sequence_parallel=True, hidden_dropout=0.3, attention_dropout=0.3,
                                    recompute_activations=recompute), tp_group=group)
        torch.manual_seed(9)
        model(tokens, positions, labels).mean().backward()
        grads.append({name: param.grad for name, param in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)

    with pytest.raises(ModelConfigError, match="--seq-length 7 is not divisible by --tensor-model-parallel-size 2"):
        GPTModel(_sp_config(seq_length=7, sequence_parallel=True), tp_group=group)


def test_sequence_parallel_gpt_matches_serial_loss_and_gradients():
    mp.spawn(_spawned, args=(2, free_port(), _check_sequence_parallel_gpt), nprocs=2, join=True)


def test_parameters_on_rank_add_up_to_the_model():
    config = _sp_config(num_layers=4)
    assert parameters_on_rank(config) == count_parameters(config) == sum(p.numel() for p in GPTModel(config).parameters())
    h, vocab = config.hidden_size, config.padded_vocab_size
    # PP=2: the last stage also holds its copy of the tied embedding, whose position table it does not use
    # (test_the_printing_ranks_parameters_are_predicted_exactly counts the real stages)
    tied_copy = (vocab + config.learned_positions) * h
    assert parameters_on_rank(config, 1, 2, 0) + parameters_on_rank(config, 1, 2, 1) == count_parameters(config) + tied_copy
    # TP=2: everything but LayerNorms, row-parallel biases and position embeddings is halved
    replicated = config.num_layers * (2 * h + 4 * h) + 2 * h + config.max_position_embeddings * h
    assert 2 * parameters_on_rank(config, 2, 1, 0) == count_parameters(config) + replicated


@pytest.mark.parametrize("name, saved", [("tp2_z1", "tensor-parallel size 2"), ("pp2_z1", "pipeline-parallel size 2")])
def test_resume_on_another_tensor_or_pipeline_parallel_size_is_refused_in_one_line(
        parallel_layout_runs, dolly_data_dir, name, saved):
    """TP=2 -> TP=1 and PP=2 -> PP=1: refused at start-up, before the model is built, naming the sizes and what
    to do instead (megatron/checkpointing/resume_check.py); DeepSpeed's own loader would fail with a traceback."""
    _, checkpoint = parallel_layout_runs[name]
    flag = "--tensor-model-parallel-size" if name.startswith("tp") else "--pipeline-model-parallel-size"
    run = subprocess.run([sys.executable, str(REPO_ROOT / "pretrain_gpt.py"), "--model-size", "tiny", "--seq-length",
                          "64", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "6",
                          "--zero-stage", "1", "--load", str(checkpoint),
                          "--data-path", str(dolly_data_dir / "dolly_text_document"),
                          "--vocab-file", str(dolly_data_dir / "gpt2-vocab.json"),
                          "--merge-file", str(dolly_data_dir / "gpt2-merges.txt")],
                         env=test_env(MASTER_PORT=free_port()), capture_output=True, text=True, timeout=300)
    assert run.returncode == 1
    assert run.stderr.splitlines()[-1] == (
        f"error: --load {checkpoint}: cannot resume global_step{PARALLEL_ITERS}: it was saved with {saved}, this "
        f"run has 1; zero-lab resumes only on the tensor- and pipeline-parallel sizes a checkpoint was saved with: "
        f"resume with {flag} 2, or start from its weights on any layout with --finetune (iteration and optimizer "
        "start afresh)")
    assert "Traceback" not in run.stderr and " > run info" not in run.stdout  # nothing built, nothing trained


@pytest.mark.parametrize("name", list(PARALLEL_LAYOUTS))
def test_the_printing_ranks_parameters_are_predicted_exactly(layout_logs, name):
    """TP splits, ZeRO-3 (the whole shapes) and the last pipeline stage's copy of the tied embedding, whose
    EmbeddingPipe holds the (unused) position table too."""
    predicted, measured = re.search(r" > parameters \| total: \d+ \| active per token: \d+ \| on this rank: "
                                    r"predicted (\d+), measured (\d+) \|", layout_logs[name]).groups()
    assert predicted == measured
