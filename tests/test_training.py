"""Real 2-rank DeepSpeed runs on the dolly sample with gradient accumulation (2 micro-batches per step; the
drivers' runs in tests/test_drivers.py have none): ZeRO stages 1-3 agree on the losses, stages 2 and 3
communicate at every micro-batch and stage 1 holds every gradient until the last; and NaN iterations are
skipped, counted and stop the run."""
import re
import socket
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, test_env
from runs import SKIP_PROBES

pytestmark = pytest.mark.slow

STAGES = {"Z1": ["--zero-stage", "1"], "Z2": ["--zero-stage", "2"], "Z3": ["--zero-stage", "3"]}
# CPU ranks add step_peak= after other= (docs/log-lines.md)
MEMORY = re.compile(r"measured: params=(\S+) grads=(\S+) optim=(\S+) offloaded=\S+ activations=\S+ other=(\S+)"
                    r"(?: step_peak=\S+)? \| "
                    r"ZeRO estimate .*?: params=(\S+) grads=(\S+) optim=(\S+) total=(\S+)(?: \w+=\S+)* \|")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pretrain(data_dir, *extra, iters=4):
    """Launch pretrain_gpt.py on 2 CPU ranks with torchrun, without the start-up probes (no test here reads the
    time lines); returns the CompletedProcess."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(REPO_ROOT / "pretrain_gpt.py"), "--model-size", "tiny", "--seq-length", "64",
           "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(iters),
           "--log-interval", "1", "--eval-iters", "0", "--lr", "1e-3", "--seed", "7",
           "--data-path", str(data_dir / "dolly_text_document"), "--vocab-file", str(data_dir / "gpt2-vocab.json"),
           "--merge-file", str(data_dir / "gpt2-merges.txt"), *extra]
    return subprocess.run(cmd, env=test_env(**SKIP_PROBES), capture_output=True, text=True, timeout=300)


def losses(log: str) -> list[float]:
    return [float(value) for value in re.findall(r"\| lm loss: (\S+) \|", log)]


def memory_gb(log: str) -> dict:
    values = [float(v) for v in MEMORY.search(log).groups()]
    keys = ["params", "grads", "optim", "other", "est_params", "est_grads", "est_optim", "est_total"]
    return dict(zip(keys, values))


@pytest.fixture(scope="module")
def stage_runs(dolly_data_dir):
    runs = {name: pretrain(dolly_data_dir, *flags) for name, flags in STAGES.items()}
    for name, run in runs.items():
        assert run.returncode == 0, f"{name}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return {name: run.stdout for name, run in runs.items()}


def test_all_stages_give_the_same_losses(stage_runs):
    reference = losses(stage_runs["Z1"])
    assert len(reference) == 4 and reference[-1] < reference[0]
    for name, log in stage_runs.items():
        assert losses(log) == pytest.approx(reference, rel=1e-5), name


def test_gradient_accumulation_traffic_and_gradients(stage_runs):
    """2 micro-batches per step: stage 2 reduce-scatters at each micro-batch (1.5x stage 1's traffic) and stage 3
    gathers and reduces at each (3x); stage 1 holds every gradient until the last micro-batch, stage 2 only
    its partition's parameters' (as predicted: megatron/accounting.gradient_elements_held)."""
    sent = {}
    for name in ("Z1", "Z2", "Z3"):
        pairs = re.findall(r"comm at iteration +\d+ \| .* total=(\S+)MB \| .* predicted=(\S+)MB", stage_runs[name])
        measured, predicted = map(float, pairs[-1])
        assert measured == pytest.approx(predicted, rel=0.10), name
        sent[name] = measured
    assert sent["Z2"] == pytest.approx(1.5 * sent["Z1"], rel=0.05)
    assert sent["Z3"] == pytest.approx(3.0 * sent["Z1"], rel=0.05)
    z1, z2 = memory_gb(stage_runs["Z1"]), memory_gb(stage_runs["Z2"])
    assert z1["grads"] == pytest.approx(z1["est_grads"], rel=0.02) and z1["grads"] == pytest.approx(z1["params"])
    assert z2["grads"] == pytest.approx(z2["est_grads"], rel=0.02) and z2["grads"] < z1["grads"]


@pytest.mark.parametrize("stage", ["0", "2"])
def test_nan_iterations_are_skipped_counted_and_stop_the_run(dolly_data_dir, stage):
    # lr 1e30: the first update sends the weights to ~1e30, every later forward overflows to inf/nan
    run = pretrain(dolly_data_dir, "--zero-stage", stage, "--lr", "1e30", "--lr-warmup-iters", "0",
                   "--max-nan-iterations", "3", iters=10)
    assert run.returncode != 0
    assert "error: stopping at iteration 4: 3 iterations in a row had a non-finite loss or gradient " \
           "(--max-nan-iterations 3)" in run.stderr
    # torchrun prints its own launcher traceback for a failed child; ours must print none
    assert 'pretrain_gpt.py", line' not in run.stderr and str(REPO_ROOT / "megatron") not in run.stderr
    counts = re.findall(r"number of skipped iterations:\s+(\d+) \| number of nan iterations:\s+(\d+)", run.stdout)
    assert counts == [("0", "0"), ("1", "1"), ("2", "2")]
    assert " iteration        4/" not in run.stdout
