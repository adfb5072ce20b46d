"""Tensor, pipeline and sequence parallelism through pretrain_gpt.py: real torchrun runs of 1, 2 and
4 CPU ranks on the dolly sample must give the serial run's losses (fp32, dropout off, same seed, so
the same full initial weights), and a TP=2 x PP=2 checkpoint must resume onto the same losses.

The padded vocabulary must be the same at every TP size for the full weights to match, so runs
with TP=t pass --make-vocab-size-divisible-by 128/t (50257 -> 50304 tokens throughout)."""
import re
import socket
import subprocess
import sys

import pytest
import torch

from conftest import REPO_ROOT, test_env

pytestmark = pytest.mark.slow

ITERS = 5
TP2 = ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"]
PP2 = ["--pipeline-model-parallel-size", "2"]
SP = ["--sequence-parallel"]
# name -> (ranks, flags); the serial run at ZeRO 0 is the reference
LAYOUTS = {
    "serial": (1, ["--zero-stage", "0"]),
    "tp2_z1": (2, [*TP2, "--zero-stage", "1"]),
    "tp2_sp_z3": (2, [*TP2, *SP, "--zero-stage", "3"]),
    "pp2_z1": (2, [*PP2, "--zero-stage", "1"]),
    "tp2_dp2_sp_z2": (4, [*TP2, *SP, "--zero-stage", "2"]),
}
# TP=2 x PP=2 runs as a checkpointed pair: iterations 1-3, save, exit; load, iterations 4-5
TP2_PP2 = [*TP2, *PP2, *SP, "--zero-stage", "0"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pretrain(data_dir, ranks: int, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
           "--master_port", str(free_port()), str(REPO_ROOT / "pretrain_gpt.py"),
           "--model-size", "tiny", "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
           "--train-iters", str(ITERS), "--log-interval", "1", "--eval-iters", "0", "--lr", "1e-3", "--seed", "7",
           "--hidden-dropout", "0", "--attention-dropout", "0",
           "--data-path", str(data_dir / "dolly_text_document"), "--vocab-file", str(data_dir / "gpt2-vocab.json"),
           "--merge-file", str(data_dir / "gpt2-merges.txt"), *extra]
    run = subprocess.run(cmd, env=test_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, f"{' '.join(extra)}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return run


def losses(log: str) -> list[float]:
    return [float(value) for value in re.findall(r"\| lm loss: (\S+) \|", log)]


@pytest.fixture(scope="module")
def layout_logs(dolly_data_dir):
    return {name: pretrain(dolly_data_dir, ranks, *flags).stdout for name, (ranks, flags) in LAYOUTS.items()}


def test_serial_reference_learns(layout_logs):
    reference = losses(layout_logs["serial"])
    assert len(reference) == ITERS and reference[-1] < reference[0] - 0.2


@pytest.mark.parametrize("name", [name for name in LAYOUTS if name != "serial"])
def test_parallel_layout_matches_serial_losses(layout_logs, name):
    log = layout_logs[name]
    world = LAYOUTS[name][0]
    assert f"| world size: {world} |" in log
    assert losses(log) == pytest.approx(losses(layout_logs["serial"]), rel=1e-5)


@pytest.fixture(scope="module")
def tp2_pp2_runs(dolly_data_dir, tmp_path_factory):
    save = tmp_path_factory.mktemp("tp2_pp2_checkpoints")
    first = pretrain(dolly_data_dir, 4, *TP2_PP2, "--save", str(save), "--exit-interval", "3").stdout
    resumed = pretrain(dolly_data_dir, 4, *TP2_PP2, "--load", str(save)).stdout
    return first, resumed, save


def test_tp2_pp2_matches_serial_and_resumes_onto_the_same_losses(layout_logs, tp2_pp2_runs):
    first, resumed, save = tp2_pp2_runs
    serial = losses(layout_logs["serial"])
    assert "| world size: 4 |" in first and " exiting program at iteration 3 " in first
    assert losses(first) == pytest.approx(serial[:3], rel=1e-5)
    assert "loaded checkpoint" in resumed
    assert re.findall(r" iteration\s+(\d+)/", resumed) == ["4", "5"]
    assert losses(resumed) == pytest.approx(serial[3:], rel=1e-5)
    assert (save / "latest").read_text().strip() == "global_step5"


def test_model_state_estimate_counts_the_parameters_rank_0_holds(layout_logs, tp2_pp2_runs):
    """Rank 0 of TP=2 x PP=2 holds half of the split matrices of stage 0 (embeddings + layer 1)."""
    measured = {}
    for name, log in (("serial", layout_logs["serial"]), ("tp2_pp2", tp2_pp2_runs[0])):
        match = re.search(r"measured: params=(\S+) .*? ZeRO estimate .*?: params=(\S+) ", log)
        assert match, name
        measured[name], estimate = map(float, match.groups())
        assert measured[name] == pytest.approx(estimate, abs=1e-4), name
    assert measured["tp2_pp2"] < 0.6 * measured["serial"]


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
