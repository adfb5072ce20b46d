"""MAX_RESTARTS (issue 35 item 1, docs/faults.md): a run that loses a rank starts again by itself from its newest
intact checkpoint, on the drivers (torchrun), ALCF (mpiexec) and the Slurm script (srun); a failure that would fail
again, or a signal to the job, is not restarted.

The fault is real: rank 1 SIGKILLs itself (as the out-of-memory killer would) once the run's log shows
iteration 2, on the first attempt only (conftest.fault_env); the Slurm case is in test_slurm.py."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ITERATION_LOSS, REPO_ROOT, driver_env, fault_env, iteration_losses, test_env
from megatron.launch.restart import HOSTS_MISSING_STATUS, RESTART_STATUS, hosts_missing, worth_restarting

def summary_row(runs_dir: Path, out: Path) -> dict:
    result = subprocess.run([sys.executable, str(REPO_ROOT / "analysis" / "summarize.py"), str(runs_dir), "--out",
                             str(out), "--no-plots"], env=test_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    [row] = json.loads((out / "summary.json").read_text())["runs"]
    return row


# ---- which failures are restarted ----

@pytest.mark.parametrize("first_error, signalled, restart", [
    (None, None, True),  # a rank killed, a crash: no error line of its own
    ("error: lost rank 1 on node1 (10.250.0.2): no heartbeat for 60 s: ...", None, True),
    ("error: lost ranks 2, 3 on node1 (10.250.0.2): its connection closed: ...", None, True),
    ("error: --save /ckpt: writing checkpoint global_step8 failed on rank 0 (No space left on device); ...", None,
     True),
    ("error: --data-path d: d.bin does not exist", None, False),
    ("error: stopping at iteration 12: 5 iterations in a row had NaN or Inf losses", None, False),
    ("error: --load /ckpt: no intact checkpoint to resume: ...", None, False),
    (None, "SIGTERM", False),  # the scheduler stops the job
    ("error: lost rank 1 on node1 (10.250.0.2): ...", "SIGINT", False),
])
def test_what_is_restarted(first_error, signalled, restart):
    assert worth_restarting(first_error, signalled)[0] is restart


def test_restart_status_is_the_one_the_scripts_read():
    script = (REPO_ROOT / "scripts" / "launch_common.sh").read_text()
    assert f"ZL_RESTART_STATUS={RESTART_STATUS}\n" in script
    assert f"ZL_HOSTS_MISSING_STATUS={HOSTS_MISSING_STATUS}\n" in script and HOSTS_MISSING_STATUS != RESTART_STATUS


def test_hosts_missing_is_torchruns_rendezvous_giving_up():
    # torchrun's report when a host did not join within join_timeout (tests/test_multi_node.py causes it for real)
    assert hosts_missing(["Traceback (most recent call last):", "torch.distributed.elastic.rendezvous.api."
                          "RendezvousTimeoutError"])
    assert not hosts_missing(["torch.distributed.elastic.multiprocessing.errors.ChildFailedError:"])


# ---- the three launch paths, for real ----

def check_restarted_run(run_dir: Path, log_text: str, expected_losses: dict, out: str, err: str):
    """One restart after the kill, every iteration's loss as the uninterrupted run printed it, and the summary's
    run of two attempts with each iteration once."""
    assert "[run] restarting the run from its newest intact checkpoint (1 of " in out, out[-3000:] + err[-3000:]
    assert len(re.findall(r"^\[zero-lab\] restarting after: ", log_text, re.M)) == 1
    headers = re.findall(r"^\[zero-lab\] attempt (\d+) started .*$", log_text, re.M)
    assert headers == ["1", "2"]
    assert re.search(r"^\[zero-lab\] attempt 2 started .*: restart 1 of \d+, resuming from ", log_text, re.M)
    # as printed, every digit: each iteration computed again after the restart repeats the loss it had
    printed = [(int(i), loss) for i, loss in ITERATION_LOSS.findall(log_text)]
    assert sorted(set(printed)) == sorted(expected_losses.items()) and len(printed) > len(expected_losses)
    assert not (run_dir / "checkpoints" / "latest").read_text().endswith(".saving")


@pytest.mark.slow
def test_drivers_restart_after_a_rank_is_killed(dolly_data_dir, one_host_z1_losses, tmp_path):
    env = fault_env(tmp_path, str(tmp_path / "runs" / "gpt_tiny_Z1" / "train.log"),
                    driver_env(dolly_data_dir, tmp_path / "runs", MAX_RESTARTS=2, SAVE_INTERVAL=1))
    run = subprocess.run(["bash", str(REPO_ROOT / "examples_zero" / "gpt_deepspeed_Z1.sh")], env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert (tmp_path / "fault-happened").exists()
    run_dir = tmp_path / "runs" / "gpt_tiny_Z1"
    check_restarted_run(run_dir, (run_dir / "train.log").read_text(), one_host_z1_losses, run.stdout, run.stderr)
    assert (run_dir / "command.txt").read_text().count("# attempt ") == 2
    row = summary_row(tmp_path / "runs", tmp_path / "summary")
    assert (row["status"], row["attempts"], row["last_iteration"]) == ("finished", 2, 4)


@pytest.mark.slow
def test_a_failure_that_would_fail_again_is_not_restarted(dolly_data_dir, tmp_path):
    """A flag the ranks refuse: one attempt, the reason said, the error line last, exit 1."""
    env = driver_env(dolly_data_dir, tmp_path / "runs", MAX_RESTARTS=3)
    run = subprocess.run(["bash", str(REPO_ROOT / "examples_zero" / "gpt_deepspeed_Z1.sh"), "--lr-decay-style",
                          "exp"], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 1
    assert "[run] not restarting (MAX_RESTARTS): a rank's own error line: the next attempt would fail the same way" \
        in run.stdout
    assert run.stderr.rstrip().splitlines()[-1].startswith("error: --lr-decay-style must be cosine, linear or constant")
    assert (tmp_path / "runs" / "gpt_tiny_Z1" / "command.txt").read_text().count("# attempt ") == 1


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec (scripts/setup.sh installs MPICH)")
def test_alcf_restarts_after_a_rank_is_killed(dolly_data_dir, tmp_path):
    """./ALCF/train-gpt3.sh through mpiexec, one log per attempt; the losses are the uninterrupted run's."""
    settings = dict(DATA_DIR=str(dolly_data_dir), MODEL_SIZE_KEY="GPT_TINY", SEQ_LEN="64", MICRO_BATCH="2",
                    TRAIN_ITERS="4", LOG_INTERVAL="1", EVAL_INTERVAL="2", EVAL_ITERS="1", SAVE_INTERVAL="1",
                    DATA_SPLIT="90,8,2", USER="tester", CUDA_VISIBLE_DEVICES="")

    def train(folder: Path, **extra):
        env = test_env(**settings, OUTPUT_ROOT=str(folder / "outputs"), LOGFILES=str(folder / "logfiles"), **extra)
        for var in ("PBS_NODEFILE", "HOSTFILE", "MASTER_PORT", "RUN_NAME", "PBS_JOBID", "OMP_NUM_THREADS"):
            env.pop(var, None)
        return subprocess.run(["bash", str(REPO_ROOT / "ALCF" / "train-gpt3.sh")], cwd=folder, env=env,
                              capture_output=True, text=True, timeout=900)

    clean = tmp_path / "clean"
    clean.mkdir()
    reference = train(clean)
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]
    expected = iteration_losses(reference.stdout)
    assert sorted(expected) == [1, 2, 3, 4]

    env = fault_env(tmp_path, str(tmp_path / "outputs" / "*" / "logs" / "*.log"), {})
    restarted = train(tmp_path, MAX_RESTARTS="1", **env)
    assert restarted.returncode == 0, restarted.stdout[-3000:] + restarted.stderr[-3000:]
    assert (tmp_path / "fault-happened").exists()
    [run_dir] = (tmp_path / "outputs").iterdir()
    logs = sorted((run_dir / "logs").iterdir())
    assert len(logs) == 2
    check_restarted_run(run_dir, "".join(log.read_text() for log in logs), expected, restarted.stdout,
                        restarted.stderr)
    row = summary_row(tmp_path / "outputs", tmp_path / "summary")
    assert (row["status"], row["attempts"], row["last_iteration"]) == ("finished", 2, 4)
