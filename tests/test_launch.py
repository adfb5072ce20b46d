"""megatron/launch/attempt.py, the way every launch path runs its launcher: the ranks' output appended to the
run's log, the launcher's own lines set aside, the cause of a failure as the last line, every attempt's command
kept, and a SIGTERM to the whole process group ending in the ranks' clean stop. And what the launch scripts
share (the launch planner, megatron/launch/plan.py): one way to find Python, a user's DeepSpeed JSON. The launcher
here is a small shell script printing what torchrun prints; the real launchers are run in tests/test_drivers.py,
tests/test_alcf.py and tests/test_slurm.py."""
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO_ROOT, launch_script, test_env

# what torchrun prints when rank 0 fails with zero-lab's one-line error (captured from torch 2.13)
TORCHRUN_FAILURE = r'''
echo "*****************************************" >&2
echo "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default" >&2
echo " > run info | zero stage: 1 |"
echo "error: --data-path: /x.bin does not exist" >&2
echo "error: --data-path: /x.bin does not exist" >&2
cat >&2 <<'REPORT'
E1123 21:40:20.544000 8547 /v/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] failed
Traceback (most recent call last):
  File "/v/lib/python3.11/site-packages/torch/distributed/run.py", line 1032, in <module>
    main()
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
============================================================
pretrain_gpt.py FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 8550)
============================================================
REPORT
exit 1
'''


def attempt(tmp_path, script, note="fresh start", **popen):
    command = [sys.executable, "-m", "megatron.launch.attempt", "--run-dir", str(tmp_path), "--log",
               str(tmp_path / "train.log"), "--launcher", "torchrun", "--note", note, "--", "bash", "-c", script]
    return subprocess.Popen(command, cwd=REPO_ROOT, env=test_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **popen)


def test_a_failed_launch_ends_with_its_cause_once_and_sets_the_launchers_report_aside(tmp_path):
    process = attempt(tmp_path, TORCHRUN_FAILURE)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 1
    assert err.splitlines() == [f"error: --data-path: /x.bin does not exist (launcher's report: "
                                f"{tmp_path / 'launcher.log'})"]
    assert out == " > run info | zero stage: 1 |\n"
    log = (tmp_path / "train.log").read_text().splitlines()
    assert log[0].startswith("[zero-lab] attempt 1 started ") and log[0].endswith(": fresh start")
    assert log[1:] == [" > run info | zero stage: 1 |"] + ["error: --data-path: /x.bin does not exist"] * 2
    report = (tmp_path / "launcher.log").read_text()
    assert "ChildFailedError" in report and "Setting OMP_NUM_THREADS" in report and "run info" not in report
    command = (tmp_path / "command.txt").read_text().splitlines()
    assert command[0].startswith("# attempt 1 | ") and command[1].startswith("bash -c ")

    again = attempt(tmp_path, "echo resumed; exit 0", note="resuming from x")
    assert again.communicate(timeout=60)[0] == "resumed\n" and again.returncode == 0
    assert "[zero-lab] attempt 2 started " in (tmp_path / "train.log").read_text()
    assert (tmp_path / "train.log").read_text().splitlines()[-1] == "resumed"  # appended, the first kept
    assert [line.split(" | ")[0] for line in (tmp_path / "command.txt").read_text().splitlines()
            if line.startswith("#")] == ["# attempt 1", "# attempt 2"]


def test_a_rank_killed_without_an_error_line_is_named_from_the_launchers_report(tmp_path):
    script = TORCHRUN_FAILURE.replace('echo "error: --data-path: /x.bin does not exist" >&2\n', "").replace(
        "exitcode  : 1 (pid: 8550)", "exitcode  : -9 (pid: 8550)")
    process = attempt(tmp_path, script)
    _, err = process.communicate(timeout=60)
    assert err.splitlines() == [f"error: rank 0 was killed by SIGKILL (launcher's report: {tmp_path / 'launcher.log'})"]


def test_sigterm_to_the_process_group_ends_in_the_ranks_clean_stop(tmp_path):
    """As torchrun does under a group SIGTERM: the ranks save and print their stop line, the launcher exits 1."""
    script = r'''
trap 'echo " exiting program after receiving SIGTERM at iteration 3 (checkpoint saved to /c)"; exit 1' TERM
echo " iteration        1/      10 |"
while true; do sleep 0.1; done
'''
    process = attempt(tmp_path, script, start_new_session=True)
    log, deadline = tmp_path / "train.log", time.monotonic() + 60
    while not (log.exists() and "iteration        1/" in log.read_text()):
        assert time.monotonic() < deadline, "the launcher printed no iteration line"
        time.sleep(0.1)
    os.killpg(process.pid, signal.SIGTERM)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    assert " exiting program after receiving SIGTERM at iteration 3 (checkpoint saved to /c)" in out
    assert "this attempt ends with 0" in out and err == ""


# ---- the launch scripts: one way to find Python, a user's DeepSpeed JSON ----

def dry_run_line(script, **env) -> subprocess.CompletedProcess:
    environment = test_env(DRY_RUN=1, **env)
    for name in [name for name, value in env.items() if value is None]:
        environment.pop(name)
    return launch_script(REPO_ROOT / script, (), environment)


def test_a_dry_run_says_what_the_run_would_do_not_that_it_starts(tmp_path):
    """Issue 56, item 10: DRY_RUN=1 printed "not starting" and "[run] starting ... afresh" together."""
    result = dry_run_line("examples_zero/gpt_deepspeed_Z1.sh", RUNS_DIR=tmp_path)
    assert result.returncode == 0, result.stderr
    run = tmp_path / "gpt_tiny_Z1"
    assert result.stderr.splitlines() == [f"[run] DRY_RUN=1, the run would be starting {run} afresh"]
    assert "DRY_RUN=1, not starting: " in result.stdout and not run.exists()


def test_every_launch_script_finds_the_repositorys_venv_and_says_how_to_get_torch(tmp_path):
    """scripts/find_python.sh: PYTHON, else the repository's .venv, else python3 on PATH; without torch, one
    line saying how to set up and activate .venv (drivers, ALCF, the data script alike)."""
    venv_python = REPO_ROOT / ".venv" / "bin" / "python"
    if not venv_python.exists():
        pytest.skip("no .venv in the repository (scripts/setup.sh makes it)")
    result = dry_run_line("examples_zero/gpt_deepspeed_Z1.sh", PYTHON=None, RUNS_DIR=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"not starting: {venv_python} -m torch.distributed.run " in result.stdout
    no_torch = os.path.join(sys.base_prefix, "bin", "python3")  # the interpreter the venv was made from
    for script in ("examples_zero/gpt_deepspeed_Z1.sh", "ALCF/train-gpt3.sh", "tools/process_databricks_gpt2.sh"):
        result = dry_run_line(script, PYTHON=no_torch, RUNS_DIR=tmp_path, OUTPUT_ROOT=tmp_path, DATA_DIR=tmp_path)
        assert result.returncode == 1, script
        assert result.stderr.splitlines() == [
            f"error: PYTHON={no_torch} cannot import torch: run 'bash scripts/setup.sh' (it makes {REPO_ROOT}/.venv), "
            f"then 'source {REPO_ROOT}/.venv/bin/activate'; or set PYTHON to a Python that has torch"], script


def test_a_users_deepspeed_json_decides_what_no_variable_set(tmp_path):
    """DS_CONFIG: ALCF passes no --zero-stage (nor a precision) of its own defaults, only the ones set; the
    drivers pass the JSON on."""
    user = tmp_path / "ds.json"
    user.write_text('{"zero_optimization": {"stage": 3}}')
    alcf = dry_run_line("ALCF/train-gpt3.sh", DS_CONFIG=user, MODEL_SIZE_KEY="GPT_TINY", OUTPUT_ROOT=tmp_path,
                        CUDA_VISIBLE_DEVICES="", ZERO_STAGE=None, DTYPE=None)
    assert alcf.returncode == 0, alcf.stderr
    line = next(line for line in alcf.stdout.splitlines() if line.startswith("[launch] "))
    assert f" --deepspeed_config {user}" in line and " --zero-stage " not in line
    assert "| zero from DS_CONFIG |" in alcf.stdout
    given = dry_run_line("ALCF/train-gpt3.sh", DS_CONFIG=user, ZERO_STAGE=3, MODEL_SIZE_KEY="GPT_TINY",
                         OUTPUT_ROOT=tmp_path, CUDA_VISIBLE_DEVICES="")
    assert " --zero-stage 3 " in next(line for line in given.stdout.splitlines() if line.startswith("[launch] "))
    driver = dry_run_line("examples_zero/gpt_deepspeed_Z3.sh", DS_CONFIG=user, RUNS_DIR=tmp_path)
    assert driver.returncode == 0 and f" --deepspeed_config {user} " in driver.stdout
