"""Every examples_zero driver end to end on the dolly sample: exit 0, the run folder with its four
files, every docs/log-lines.md line, the same settings across the five, and a falling loss."""
import json
import re
import subprocess

import pytest

from conftest import REPO_ROOT, driver_env, test_env

pytestmark = pytest.mark.slow

EXPERIMENTS = {"DP": (0, "none"), "Z1": (1, "none"), "Z2": (2, "none"), "Z3": (3, "none"),
               "Z3_OL": (3, "optimizer+params")}
REQUIRED_LINES = [
    r"^ > run info \| zero stage: \d \| offload: \S+ \| model: tiny \| world size: 2 \|",
    r"^ model state memory per rank \(GB\) \| measured: params=\d+\.\d{4} grads=\d+\.\d{4}",
    r"^ iteration +\d+/ +\d+ \| consumed samples: +\d+ \| consumed tokens: +\d+ \|",
    r"\(tgs\): (\d+\.\d+)",
    r"elapsed time per iteration \(ms\): (\d+\.\d+)",
    r", MemAllocated=(\d+\.\d+)GB",
    r"^\[after training is done\] datetime: ",
    r", MaxMemAllocated=(\d+\.\d+)GB",
    r"HostRSS=\d+\.\d\dGB",
    r"lm loss: (\d+\.\d+E[+-]\d+)",
    r"^ validation loss at iteration \d+ \| lm loss value: \d\.\d{6}E\+\d\d \| lm loss PPL: \S+ \| $",
    r"^ epoch    2 done \| iteration +\d+ \| consumed samples: +\d+ \| epoch time \(s\): \d+\.\d{3} \| "
    r"lm loss: \d\.\d{6}E\+\d\d \|$",
]


@pytest.fixture(scope="module")
def driver_runs(five_driver_runs):
    """The five drivers as run_all.sh ran them (conftest.five_driver_runs, shared with the analysis test)."""
    runs_dir, result = five_driver_runs
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return runs_dir, result


@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_driver_run_folder_and_log(driver_runs, name):
    runs_dir, _ = driver_runs
    folder = runs_dir / f"gpt_tiny_{name}"
    assert {"train.log", "ds_config.json", "command.txt", "env.json"} <= {p.name for p in folder.iterdir()}
    # the final checkpoint of the run, through DeepSpeed (4 iterations: 2 epochs of 2)
    assert (folder / "checkpoints" / "latest").read_text().strip() == "global_step4"
    log = (folder / "train.log").read_text()
    for pattern in REQUIRED_LINES:
        assert re.search(pattern, log, re.M), f"{name}: no line matches {pattern!r}"
    stage, offload = EXPERIMENTS[name]
    assert f" > run info | zero stage: {stage} | offload: {offload} |" in log
    # no warning repeats per step (torch's deprecation warnings for DeepSpeed's collectives are silenced)
    warnings = [line for line in log.splitlines() if "Warning" in line]
    assert len(warnings) == len(set(warnings)) and len(warnings) <= 2, warnings[:4]
    ds_config = json.loads((folder / "ds_config.json").read_text())
    assert ds_config["zero_optimization"]["stage"] == stage
    assert ds_config["train_batch_size"] == 8 and ds_config["gradient_accumulation_steps"] == 2
    assert ("offload_param" in ds_config["zero_optimization"]) == (name == "Z3_OL")
    env = json.loads((folder / "env.json").read_text())
    assert env["world_size"] == 2 and env["accelerator"] == "cpu" and env["deepspeed"]
    command = (folder / "command.txt").read_text()
    assert "pretrain_gpt.py" in command and f"--zero-stage {stage}" in command
    losses = iteration_losses(log)
    assert len(losses) >= 3 and losses[-1] < losses[0]


def iteration_losses(log: str) -> list[float]:
    return [float(v) for v in re.findall(r"^ iteration .*\| lm loss: (\S+) \|", log, re.M)]


@pytest.mark.parametrize("name", ["Z1", "Z3"])
def test_driver_in_bf16_follows_the_fp32_run(driver_runs, dolly_data_dir, tmp_path, name):
    """PRECISION=bf16 on the CPU ranks: DeepSpeed's bf16 optimizer, bf16 weights (gathered at stage 3)
    through the fused output-layer loss; same data and init as the fp32 run, so the losses track it."""
    runs_dir, _ = driver_runs
    result = subprocess.run(["bash", str(REPO_ROOT / "examples_zero" / f"gpt_deepspeed_{name}.sh")], cwd=REPO_ROOT,
                            env=driver_env(dolly_data_dir, tmp_path, PRECISION="bf16"),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    folder = tmp_path / f"gpt_tiny_{name}"
    assert json.loads((folder / "ds_config.json").read_text())["bf16"]["enabled"] is True
    bf16 = iteration_losses((folder / "train.log").read_text())
    fp32 = iteration_losses((runs_dir / f"gpt_tiny_{name}" / "train.log").read_text())
    assert len(bf16) == len(fp32) == 4
    for low, full in zip(bf16, fp32):
        assert abs(low - full) < 0.02 * full, (bf16, fp32)
    assert bf16[-1] < bf16[0]


def test_drivers_share_their_settings(driver_runs):
    runs_dir, _ = driver_runs
    def settings(name):
        flags = (runs_dir / f"gpt_tiny_{name}" / "command.txt").read_text().split()
        flags = flags[flags.index(next(f for f in flags if f.endswith("pretrain_gpt.py"))) + 1:]
        # everything except the experiment's own ZeRO/offload flags and its run folder
        drop = {"--zero-stage", "--zero-offload-optimizer", "--zero-offload-params", "--run-dir", "--tensorboard-dir",
                "--save"}
        kept, skip = [], False
        for flag in flags:
            if skip:
                skip = False
            elif flag in drop:
                skip = flag in ("--zero-stage", "--run-dir", "--tensorboard-dir", "--save")
            else:
                kept.append(flag)
        return kept
    reference = settings("DP")
    assert "--micro-batch-size" in reference
    for name in EXPERIMENTS:
        assert settings(name) == reference, name


@pytest.mark.slow
def test_driver_missing_dataset_says_what_to_run(tmp_path):
    env = test_env(DATA_PATH=tmp_path / "nothing_here", RUNS_DIR=tmp_path / "runs")
    result = subprocess.run(["bash", str(REPO_ROOT / "examples_zero" / "gpt_deepspeed_Z1.sh")], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    # pretrain_gpt.py's start-up check, printed once for the two ranks
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if "error: " in line]
    assert errors == [f"error: --data-path: {tmp_path / 'nothing_here'}.bin does not exist "
                      "(expected a prefix with .bin/.idx files from tools/preprocess_data.py)"], output
    # torchrun prints its own report of the failed child; no traceback comes from our code
    assert 'pretrain_gpt.py", line' not in output and str(REPO_ROOT / "megatron") not in output
