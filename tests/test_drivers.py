"""Every examples_zero driver end to end on the dolly sample: exit 0, the run folder with its four
files, every docs/log-lines.md line, the same settings across the six, a falling loss; NVMe offload
trains as stage 3 does; traffic and model states measured against their predictions."""
import json
import re
import subprocess

import pytest

from conftest import REPO_ROOT, driver_env, test_env

pytestmark = pytest.mark.slow

EXPERIMENTS = {"DP": (0, "none"), "Z1": (1, "none"), "Z2": (2, "none"), "Z3": (3, "none"),
               "Z3_OL": (3, "optimizer+params"), "Z3_NVMe": (3, "nvme")}
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
    r"^\[Rank 0\] comm at iteration +\d+ \| all_reduce=\d+\.\d{3}MB \| reduce_scatter=\d+\.\d{3}MB \| "
    r"all_gather=\d+\.\d{3}MB \| broadcast=\d+\.\d{3}MB \| p2p=\d+\.\d{3}MB \| total=\d+\.\d{3}MB \| "
    r"bytes/param=\d+\.\d{3} \| predicted=\d+\.\d{3}MB \|$",
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
    assert ds_config["train_batch_size"] == 8 and ds_config["gradient_accumulation_steps"] == 1
    assert ("offload_param" in ds_config["zero_optimization"]) == (name in ("Z3_OL", "Z3_NVMe"))
    assert ("aio" in ds_config) == (name == "Z3_NVMe")
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
                "--save", "--zero-nvme-path"}
        kept, skip = [], False
        for flag in flags:
            if skip:
                skip = False
            elif flag in drop:
                skip = flag in ("--zero-stage", "--run-dir", "--tensorboard-dir", "--save", "--zero-nvme-path")
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


def sent_per_iteration(log: str) -> list[tuple[float, float]]:
    """(measured, predicted) MB per iteration from each comm line."""
    pairs = re.findall(r"comm at iteration .* total=(\S+)MB \| .* predicted=(\S+)MB", log)
    return [(float(measured), float(predicted)) for measured, predicted in pairs]


def test_nvme_offload_trains_as_stage_3_does(driver_runs):
    """ZeRO-Infinity through DeepSpeed's async I/O on the CPU ranks: the states went to files under
    <run>/nvme and the losses are stage 3's."""
    runs_dir, _ = driver_runs
    folder = runs_dir / "gpt_tiny_Z3_NVMe"
    ds_config = json.loads((folder / "ds_config.json").read_text())
    zero = ds_config["zero_optimization"]
    assert zero["offload_param"]["device"] == zero["offload_optimizer"]["device"] == "nvme"
    assert zero["offload_param"]["nvme_path"] == str(folder / "nvme")
    assert ds_config["aio"]["block_size"] == 1048576 and ds_config["aio"]["queue_depth"] == 8
    swapped = [p for p in (folder / "nvme").rglob("*") if p.is_file()]
    assert swapped and sum(p.stat().st_size for p in swapped) > 0
    nvme = iteration_losses((folder / "train.log").read_text())
    z3 = iteration_losses((runs_dir / "gpt_tiny_Z3" / "train.log").read_text())
    assert len(nvme) == len(z3) == 4
    assert nvme == pytest.approx(z3, rel=1e-4)


def test_nvme_path_that_cannot_be_made_is_one_error_line(dolly_data_dir, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    env = driver_env(dolly_data_dir, tmp_path / "runs", NVME_PATH=blocker / "nvme")
    result = subprocess.run(["bash", str(REPO_ROOT / "examples_zero" / "gpt_deepspeed_Z3_NVMe.sh")], cwd=REPO_ROOT,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if "error: " in line]
    assert errors == [f"error: --zero-nvme-path {blocker / 'nvme'}: cannot create the folder (Not a directory)"], output


def test_traffic_per_stage_measured_against_predicted(driver_runs):
    """Every run's bytes sent per iteration within 10% of the prediction once steady (the first stage-3
    step gathers a few parameters twice). One micro-batch per step (the drivers' default), so the stages
    send the ZeRO paper's volumes: stages 0-2 the same, stage 3 1.5x (tests/test_training.py covers
    gradient accumulation)."""
    runs_dir, _ = driver_runs
    steady = {}
    for name in EXPERIMENTS:
        sent = sent_per_iteration((runs_dir / f"gpt_tiny_{name}" / "train.log").read_text())
        assert len(sent) == 4, name
        for measured, predicted in sent[1:]:
            assert measured == pytest.approx(predicted, rel=0.10), name
        steady[name] = sent[-1][0]
    assert steady["Z1"] == pytest.approx(steady["DP"], rel=0.10)
    assert steady["Z2"] == pytest.approx(steady["DP"], rel=0.10)
    assert 1.4 <= steady["Z3"] / steady["Z1"] <= 1.6
    assert steady["Z3_OL"] == pytest.approx(steady["Z3"], rel=0.01) and steady["Z3_NVMe"] == pytest.approx(
        steady["Z3"], rel=0.01)


MODEL_STATE = re.compile(r"measured: (?P<measured>[^|]*)\| ZeRO estimate [^:]*: (?P<estimate>[^|]*)\|")


def model_state_gb(log: str) -> tuple[dict, dict]:
    """(measured, estimate) GB by name from the model-state line."""
    match = MODEL_STATE.search(log)
    return tuple({key: float(value) for key, value in re.findall(r"(\w+)=(\S+)", match.group(part))}
                 for part in ("measured", "estimate"))


@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_memory_measured_against_the_prediction(driver_runs, name):
    """Each measured figure of the model-state line within 10% of megatron/model/accounting.py's: params, grads
    (as DeepSpeed keeps them) and optimizer states on the rank, the states offloaded, the activations one
    micro-batch keeps; on CPU ranks what else is allocated is the output layer's kept buffer (NVMe offload
    adds DeepSpeed's swap buffers, not predicted)."""
    runs_dir, _ = driver_runs
    measured, estimate = model_state_gb((runs_dir / f"gpt_tiny_{name}" / "train.log").read_text())
    for key in ("params", "grads", "optim", "offloaded", "activations"):
        assert measured[key] == pytest.approx(estimate[key], rel=0.10, abs=1e-4), (name, key)
    if name != "Z3_NVMe":
        assert measured["other"] == pytest.approx(estimate["output_buffer"], rel=0.10), name


def test_memory_per_stage_shrinks_as_zero_says(driver_runs):
    """Model states on the rank: stage 3 holds a fraction of stage 1's, stage 1 of stage 0's; offload moves
    stage 3's optimizer states and parameters out (to host memory or NVMe files)."""
    runs_dir, _ = driver_runs
    gb = {name: model_state_gb((runs_dir / f"gpt_tiny_{name}" / "train.log").read_text())[0] for name in EXPERIMENTS}
    on_rank = {name: m["params"] + m["grads"] + m["optim"] for name, m in gb.items()}
    assert on_rank["Z3"] < 0.8 * on_rank["Z1"] < 0.8 * on_rank["DP"]
    assert on_rank["Z3_OL"] < 0.5 * on_rank["Z3"] and on_rank["Z3_NVMe"] < 0.5 * on_rank["Z3"]
    assert gb["Z3_OL"]["offloaded"] > 0 and gb["Z3_NVMe"]["offloaded"] > 0 and gb["Z3"]["offloaded"] == 0
