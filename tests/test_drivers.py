"""Every examples_zero driver end to end on the dolly sample: exit 0, the run folder with its four
files, every docs/log-lines.md line, the same settings across the six, a falling loss; NVMe offload
trains as stage 3 does; traffic and model states measured against their predictions."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import BF16_LAUNCHERS, REPO_ROOT, driver_env, free_port, test_env

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
    r"^\[Rank 0\] time at iteration +\d+ \| measured: compute=\d+\.\dms communication=\d+\.\dms offload=\d+\.\dms "
    r"total=\d+\.\dms \| predicted: compute=\d+\.\dms communication=\d+\.\dms offload=\d+\.\dms host=\d+\.\dms "
    r"overlap=\d+\.\dms total=\d+\.\dms \|$",
    r"^ > step time predicted \| compute: layers \d+\.\d GFLOP/s, output layer \d+\.\d GFLOP/s, optimizer "
    r"\d+us \+ \d+\.\d\d ns/element, host copies \d+\.\d\d GB/s"
    r"(, NVMe \d+\.\d\d GB/s)? \| link \(probe\): all_reduce \d+us \+ \d+\.\d{3} GB/s, .* \| host \(probe\): "
    r"\d+\.\dus/tensor, \d+\.\dus/module hook, \d+\.\dus/flush, \d+\.\dus/sync \(probed in \d+\.\d\d s\) \| "
    r"compute=\d+\.\dms ",
    r"^\[Rank 0\] progress at iteration +4 \| 4/4 iterations \(100\.0%\) \| elapsed \d+:\d\d:\d\d since launch \| "
    r"ETA 0:00:00 \|",
]


@pytest.fixture(scope="module")
def driver_runs(six_driver_runs):
    """The six drivers as run_all.sh ran them (conftest.six_driver_runs, shared with the analysis test)."""
    runs_dir, result = six_driver_runs
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
def test_driver_in_bf16_follows_the_fp32_run(driver_runs, bf16_driver_runs, name):
    """PRECISION=bf16 on the CPU ranks: DeepSpeed's bf16 optimizer, bf16 weights (gathered at stage 3)
    through the fused output-layer loss; same data and init as the fp32 run, so the losses track it. Under
    the two launchers the six drivers' torchrun runs do not use: the deepspeed launcher (which passes
    --local_rank=N) and MPICH's mpiexec (ranks from PMI_RANK/PMI_SIZE). The runs are the suite's shared bf16 runs
    (conftest.bf16_driver_runs: two micro-batches of 2 a step, the fp32 run's 8 samples)."""
    launcher = BF16_LAUNCHERS[name]
    if launcher == "mpiexec" and shutil.which("mpiexec") is None:
        pytest.skip("needs mpiexec")
    runs_dir, _ = driver_runs
    folder = bf16_driver_runs(name)
    assert json.loads((folder / "ds_config.json").read_text())["bf16"]["enabled"] is True
    command = (folder / "command.txt").read_text()
    assert ("deepspeed.launcher.runner" if launcher == "deepspeed" else "mpiexec -n 2 ") in command
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
                "--save", "--load", "--zero-nvme-path"}
        kept, skip = [], False
        for flag in flags:
            if skip:
                skip = False
            elif flag in drop:
                skip = flag in ("--zero-stage", "--run-dir", "--tensorboard-dir", "--save", "--load", "--zero-nvme-path")
            else:
                kept.append(flag)
        return kept
    reference = settings("DP")
    assert "--micro-batch-size" in reference
    for name in EXPERIMENTS:
        assert settings(name) == reference, name


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed", "mpiexec"])
def test_a_failed_run_ends_with_its_cause_under_every_launcher(tmp_path, launcher):
    """docs/bad-input.md: one error line, printed once, no traceback, under every launcher; the launcher's own
    report (torchrun's ChildFailedError, the deepspeed launcher's records) goes to <run>/launcher.log, which
    the last line names. srun: tests/test_slurm.py; ALCF's mpiexec: tests/test_alcf.py."""
    if launcher == "mpiexec" and shutil.which("mpiexec") is None:
        pytest.skip("needs mpiexec (scripts/setup.sh installs MPICH)")
    env = test_env(DATA_PATH=tmp_path / "nothing_here", RUNS_DIR=tmp_path / "runs", LAUNCHER=launcher,
                   MASTER_PORT=free_port())
    result = subprocess.run(["bash", str(REPO_ROOT / "examples_zero" / "gpt_deepspeed_Z1.sh")], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    report = tmp_path / "runs" / "gpt_tiny_Z1" / "launcher.log"
    cause = (f"error: --data-path (from DATA_PATH): {tmp_path / 'nothing_here'}.bin does not exist "
             "(expected a prefix with .bin/.idx files from tools/preprocess_data.py)")
    named = f" (launcher's report: {report})" if launcher != "mpiexec" else ""  # MPICH reports nothing for exit 1
    assert result.stderr.splitlines()[-1] == cause + named
    output = result.stdout + result.stderr
    assert [line for line in output.splitlines() if "error: " in line] == [cause + named], output
    assert "Traceback" not in output and "ChildFailedError" not in output
    if launcher == "torchrun":
        assert "ChildFailedError" in report.read_text()
    assert (report.parent / "train.log").read_text().count(cause) >= 1  # the ranks' output is all in the log


def test_a_start_refused_twice_leaves_no_old_folder(tmp_path):
    """Issue 56, item 8: the second of two refused starts moved the first's files to <run>.old-<UTC>, a folder of
    no training that analysis/summarize.py then listed as skipped. What failed starts leave stays in the run folder,
    each attempt's log after the other's."""
    env = test_env(DATA_PATH=tmp_path / "nothing_here", RUNS_DIR=tmp_path / "runs", MASTER_PORT=free_port())
    runs = []
    for _ in range(2):
        runs.append(subprocess.run(["bash", str(REPO_ROOT / "examples_zero" / "gpt_deepspeed_Z1.sh")], env=env,
                                   capture_output=True, text=True, timeout=300))
        assert runs[-1].returncode == 1, runs[-1].stdout[-2000:] + runs[-1].stderr[-2000:]
    run_dir = tmp_path / "runs" / "gpt_tiny_Z1"
    assert f"[run] starting afresh (no checkpoint to resume there): the files of {run_dir} stay there, what failed " \
           "starts left (no checkpoint, no iteration trained); this attempt's log follows theirs" \
           in runs[1].stderr.splitlines()
    assert [path.name for path in (tmp_path / "runs").iterdir()] == ["gpt_tiny_Z1"]
    log = (run_dir / "train.log").read_text()
    assert [line.split(" started ")[0] for line in log.splitlines() if line.startswith("[zero-lab] attempt ")] == [
        "[zero-lab] attempt 1", "[zero-lab] attempt 2"]
    assert log.count(f"error: --data-path (from DATA_PATH): {tmp_path / 'nothing_here'}.bin does not exist") >= 2


def wait_for(path, pattern: str, timeout: float = 300) -> str:
    deadline = time.monotonic() + timeout
    while not (path.exists() and re.search(pattern, path.read_text(), re.M)):
        assert time.monotonic() < deadline, f"no {pattern!r} in {path} after {timeout} s"
        time.sleep(0.2)
    return path.read_text()


def test_sigterm_to_the_job_saves_and_running_the_driver_again_resumes(driver_runs, dolly_data_dir, tmp_path):
    """What PBS at walltime and Slurm's --signal do: SIGTERM to the driver's whole process group (the launcher
    and its log writer too). The ranks save and stop, the driver exits 0; running it again resumes from that
    checkpoint (the one resume rule) and ends with the uninterrupted Z1 run's losses; train.log and
    command.txt keep both attempts, and the summary shows one run of two attempts."""
    runs_dir, _ = driver_runs
    env = driver_env(dolly_data_dir, tmp_path)
    driver = ["bash", str(REPO_ROOT / "examples_zero" / "gpt_deepspeed_Z1.sh")]
    first = subprocess.Popen(driver, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    folder = tmp_path / "gpt_tiny_Z1"
    wait_for(folder / "train.log", r"^ iteration +1/ +4 \|")
    os.killpg(first.pid, signal.SIGTERM)
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, out[-3000:] + err[-3000:]
    stopped = re.search(r"^ exiting program after receiving SIGTERM at iteration (\d+) \(checkpoint saved to (.+)\)$",
                        out, re.M)
    assert stopped and stopped.group(2) == str(folder / "checkpoints"), out[-3000:]
    step = int(stopped.group(1))
    assert 1 <= step < 4 and (folder / "checkpoints" / "latest").read_text() == f"global_step{step}"

    second = subprocess.run(driver, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert f"[run] resuming from global_step{step} in {folder / 'checkpoints'}" in second.stderr
    log = (folder / "train.log").read_text()
    attempts = re.split(r"^\[zero-lab\] attempt \d started .*$", log, flags=re.M)
    assert len(attempts) == 3 and attempts[0] == ""
    assert [len(iteration_losses(part)) for part in attempts[1:]] == [step, 4 - step]
    reference = iteration_losses((runs_dir / "gpt_tiny_Z1" / "train.log").read_text())
    assert iteration_losses(log) == reference  # as printed: every digit of the uninterrupted run's
    commands = (folder / "command.txt").read_text()
    assert commands.count("# attempt ") == 2 and commands.count(f"--load {folder / 'checkpoints'}") == 2

    summary = subprocess.run([sys.executable, str(REPO_ROOT / "analysis" / "summarize.py"), str(tmp_path),
                              "--no-plots"], env=test_env(), capture_output=True, text=True, timeout=120)
    assert summary.returncode == 0, summary.stderr
    [row] = json.loads((tmp_path / "summary.json").read_text())["runs"]
    assert (row["status"], row["attempts"], row["last_iteration"]) == ("finished", 2, 4)
    assert row["loss_first"] == pytest.approx(reference[0]) and row["loss_last"] == pytest.approx(reference[-1])


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
    report = tmp_path / "runs" / "gpt_tiny_Z3_NVMe" / "launcher.log"
    assert errors == [f"error: --zero-nvme-path {blocker / 'nvme'} (from NVME_PATH): cannot create the folder (Not a "
                      f"directory) (launcher's report: {report})"], output
    assert result.returncode == 1 and result.stderr.splitlines()[-1] == errors[0]


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


def step_times(log: str) -> list[tuple[dict, dict]]:
    """(measured, predicted) milliseconds by part from each time line."""
    lines = re.findall(r"time at iteration +\d+ \| measured: ([^|]*)\| predicted: ([^|]*)\|", log)
    return [tuple({name: float(value) for name, value in re.findall(r"(\w+)=(\S+)ms", part)} for part in line)
            for line in lines]


def test_step_time_measured_beside_predicted(driver_runs):
    """Every interval of every driver logs its step time split into compute, communication and offload,
    measured and predicted (the numbers' agreement is bench/bench_step_time.py's business: a test does not
    assert timings). The parts add up; 2 ranks communicate; only the offload drivers offload."""
    runs_dir, _ = driver_runs
    for name in EXPERIMENTS:
        log = (runs_dir / f"gpt_tiny_{name}" / "train.log").read_text()
        times = step_times(log)
        elapsed = [float(v) for v in re.findall(r"elapsed time per iteration \(ms\): (\S+)", log)]
        assert len(times) == len(elapsed) == 4, name
        for (measured, predicted), iteration_ms in zip(times, elapsed):
            assert measured["total"] == pytest.approx(iteration_ms, abs=0.11), name
            assert measured["compute"] + measured["communication"] + measured["offload"] == pytest.approx(
                measured["total"], abs=0.2), name
            assert predicted["compute"] + predicted["communication"] + predicted["offload"] + predicted["host"] \
                - predicted["overlap"] == pytest.approx(predicted["total"], abs=0.2), name
            assert measured["communication"] > 0 and predicted["communication"] > 0 and predicted["compute"] > 0
            assert predicted["host"] > 0, name  # every stage reads the host at least once a step
            assert predicted["overlap"] == 0.0  # nothing overlaps on gloo
            offloads = name in ("Z3_OL", "Z3_NVMe")
            assert (measured["offload"] > 0, predicted["offload"] > 0) == (offloads, offloads), name


MODEL_STATE = re.compile(r"measured: (?P<measured>[^|]*)\| ZeRO estimate [^:]*: (?P<estimate>[^|]*)\|")


def model_state_gb(log: str) -> tuple[dict, dict]:
    """(measured, estimate) GB by name from the model-state line."""
    match = MODEL_STATE.search(log)
    return tuple({key: float(value) for key, value in re.findall(r"(\w+)=(\S+)", match.group(part))}
                 for part in ("measured", "estimate"))


@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_memory_measured_against_the_prediction(driver_runs, name):
    """Each measured figure of the model-state line within 10% of megatron/accounting/predict/'s: params, grads
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


def test_the_six_drivers_give_the_same_losses(driver_runs):
    """Same seed, data and dropout at every stage: only the order of floating-point sums differs."""
    runs_dir, _ = driver_runs
    reference = iteration_losses((runs_dir / "gpt_tiny_DP" / "train.log").read_text())
    assert len(reference) == 4 and reference[-1] < reference[0]
    for name in EXPERIMENTS:
        assert iteration_losses((runs_dir / f"gpt_tiny_{name}" / "train.log").read_text()) == pytest.approx(
            reference, rel=1e-4), name


def test_each_stage_partitions_what_zero_says(driver_runs):
    """fp32 + Adam, 2 ranks: stage 0 holds 4 bytes of parameters, 4 of gradients and 8 of moments per parameter
    whole on each rank; stage 1 half the moments plus the fp32 master copy of its half of the parameters (which
    DeepSpeed's ZeRO optimizers keep even in fp32 training); stage 3 half the parameters too."""
    runs_dir, _ = driver_runs
    gb = {name: model_state_gb((runs_dir / f"gpt_tiny_{name}" / "train.log").read_text())[0]
          for name in ("DP", "Z1", "Z3")}
    dp, z1, z3 = gb["DP"], gb["Z1"], gb["Z3"]
    assert dp["optim"] == pytest.approx(2 * dp["params"], rel=0.01) and dp["grads"] == pytest.approx(dp["params"])
    assert z1["optim"] == pytest.approx(dp["optim"] / 2 + dp["params"] / 2, rel=0.02)
    assert z1["params"] == pytest.approx(dp["params"], rel=0.01)
    assert z3["params"] == pytest.approx(dp["params"] / 2, rel=0.03)


def test_run_info_and_exact_log_lines(driver_runs):
    log = (driver_runs[0] / "gpt_tiny_Z3_OL" / "train.log").read_text()
    assert (" > run info | zero stage: 3 | offload: optimizer+params | model: tiny | world size: 2 | "
            "micro batch: 4 | global batch: 8 | seq length: 64 | train samples per epoch: ") in log
    line = re.search(r"^ iteration        4/       4 \|.*$", log, re.M).group(0)
    assert re.fullmatch(
        r" iteration        4/       4 \| consumed samples:           32 \| consumed tokens:         2048 \| "
        r"elapsed time per iteration \(ms\): \d+\.\d \| learning rate: \d\.\d{3}E[+-]\d\d \| "
        r"global batch size:     8 \| lm loss: \d\.\d{6}E\+\d\d \| loss scale: 1\.0 \| grad norm: \d+\.\d{3} \| "
        r"number of skipped iterations:   0 \| number of nan iterations:   0 \| samples per second: \d+\.\d{3} \| "
        r"tokens per gpu per second \(tgs\): \d+\.\d{3} \| TFLOPs: \d+\.\d\d \|", line)
    assert re.search(r"^\[Rank 0\] memory at iteration        4 \| device=cpu, MemAllocated=\d+\.\d\dGB, "
                     r"MaxMemAllocated=\d+\.\d\dGB, HostRSS=\d+\.\d\dGB, MaxHostRSS=\d+\.\d\dGB \|$", log, re.M)
