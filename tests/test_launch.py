"""megatron/launch/attempt.py, the way every launch path runs its launcher: the ranks' output appended to the
run's log, the launcher's own lines set aside, the cause of a failure as the last line, every attempt's command
kept, and a SIGTERM to the whole process group ending in the ranks' clean stop. The launcher here is a small
shell script printing what torchrun prints; the real launchers are run in tests/test_drivers.py,
tests/test_alcf.py and tests/test_slurm.py."""
import os
import signal
import subprocess
import sys
import time

from conftest import REPO_ROOT, test_env

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
