"""llama-tiny (RMSNorm, SwiGLU, 4 query heads over 2 K/V heads, untied output, no biases, rotary) through
pretrain_gpt.py on CPU ranks: ZeRO 0-3, TP=2 with sequence parallelism and PP=2 give the serial run's losses, and
each run's model-state memory and traffic are its predictions (tests/test_parallel_training.py's runs, for GPT-2)."""
import re

import pytest

from conftest import PARALLEL_ITERS, TP2, parallel_pretrain
from test_parallel_training import losses

pytestmark = pytest.mark.slow

LLAMA = ["--model-size", "llama-tiny"]
# name -> (ranks, flags): ZeRO 0 serial, 1 and 3 over DP=2, 2 under TP=2 with sequence parallelism, PP=2 at ZeRO 1
LLAMA_LAYOUTS = {
    "serial_z0": (1, ["--zero-stage", "0"]),
    "dp2_z1": (2, ["--zero-stage", "1"]),
    "tp2_sp_z2": (2, [*TP2, "--sequence-parallel", "--zero-stage", "2"]),
    "dp2_z3": (2, ["--zero-stage", "3"]),
    "pp2_z1": (2, ["--pipeline-model-parallel-size", "2", "--zero-stage", "1"]),
}


@pytest.fixture(scope="module")
def llama_logs(dolly_data_dir):
    # TP2's --make-vocab-size-divisible-by 64 on every run: the same padded vocabulary (50304), the same weights
    return {name: parallel_pretrain(dolly_data_dir, ranks, *LLAMA, *flags, "--make-vocab-size-divisible-by", "64"
                                    ).stdout for name, (ranks, flags) in LLAMA_LAYOUTS.items()}


def test_llama_serial_learns(llama_logs):
    reference = losses(llama_logs["serial_z0"])
    assert len(reference) == PARALLEL_ITERS + 1 and reference[PARALLEL_ITERS - 1] < reference[0] - 0.2


@pytest.mark.parametrize("name", [name for name in LLAMA_LAYOUTS if name != "serial_z0"])
def test_llama_layout_matches_serial_losses(llama_logs, name):
    log = llama_logs[name]
    assert f"| world size: {LLAMA_LAYOUTS[name][0]} |" in log
    assert losses(log) == pytest.approx(losses(llama_logs["serial_z0"]), rel=1e-5)


@pytest.mark.parametrize("name", list(LLAMA_LAYOUTS))
def test_llama_model_states_and_traffic_are_predicted(llama_logs, name):
    """The parameters, gradients and optimizer states each rank holds are the exact Llama count's share; the bytes
    sent per iteration within 10% of the prediction (no tied embedding to sync between the pipeline stages)."""
    log = llama_logs[name]
    measured, estimate = (dict(re.findall(r"(\w+)=(\d+\.\d+)", part)) for part in
                          re.search(r"measured: ([^|]*)\| ZeRO estimate [^:]*: ([^|]*)\|", log).groups())
    for key in ("params", "grads", "optim", "offloaded"):
        assert float(measured[key]) == pytest.approx(float(estimate[key]), rel=0.02, abs=1e-4), key
    sent = re.findall(r"comm at iteration +\d+ \| .* total=(\S+)MB \| .* predicted=(\S+)MB", log)
    assert len(sent) == PARALLEL_ITERS
    measured_mb, predicted_mb = map(float, sent[-1])
    assert measured_mb == pytest.approx(predicted_mb, rel=0.10)


def test_llama_tiny_trains_through_the_z1_driver_with_the_gpt_paths_log_lines(dolly_data_dir, tmp_path):
    """`MODEL_SIZE=llama-tiny bash examples_zero/gpt_deepspeed_Z1.sh` on 2 CPU ranks (2 epochs of the 2% train split):
    the preset's architecture reaches pretrain_gpt.py, and every line kind a GPT-2 run prints is there."""
    import subprocess

    from conftest import REPO_ROOT, driver_env

    result = subprocess.run(["bash", str(REPO_ROOT / "examples_zero" / "gpt_deepspeed_Z1.sh")], cwd=REPO_ROOT,
                            env=driver_env(dolly_data_dir, tmp_path, MODEL_SIZE="llama-tiny"), capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    log = result.stdout
    assert "| model: llama-tiny | world size: 2 |" in log
    for kind in (" model state memory per rank (GB) | measured:", "comm at iteration", "memory at iteration",
                 "progress at iteration", " validation loss at iteration", "| TFLOPs:", "predicted="):
        assert kind in log, kind
    train = [float(value) for value in re.findall(r"\| lm loss: (\S+) \|", log)]
    assert len(train) >= 4 and train[-1] < train[0]
