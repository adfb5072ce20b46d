"""Slurm: megatron/runtime/dist_env.py under srun, LAUNCHER=srun in the drivers, examples_zero/slurm/train.sbatch.

The dry runs fake an allocation with SLURM_* variables. Everything else runs on a real Slurm cluster: the
suite's two virtual hosts (conftest.two_hosts: tools/virtual_cluster.py with Debian's munged, slurmctld and
slurmd, installed when missing, each host mapping its own name to 127.0.1.1), jobs submitted from node0, and
compares against the same driver under torchrun on one host. Without root those tests skip.
"""
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import (ITERATION_LOSS, REPO_ROOT, driver_env, fault_env, iteration_losses, launch_script,
                      waiting_driver_launch)
from conftest import test_env as subprocess_env  # aliased: pytest would collect test_env as a test
from megatron.checkpointing import protocol
from megatron.runtime.dist_env import SLURM_PORT_BASE, DistEnvError, LauncherEnv, resolve_launcher_env

SBATCH = REPO_ROOT / "examples_zero" / "slurm" / "train.sbatch"

# A task srun started: what Slurm 22.05 sets for task 3 of an 8-task step over two nodes.
SRUN_TASK = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_NTASKS": "8",
             "SLURM_LOCALID": "3", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_STEP_NODELIST": "gpu07"}


# ---- megatron/runtime/dist_env.py ----

def test_dist_env_srun_task():
    assert resolve_launcher_env(SRUN_TASK) == LauncherEnv(3, 3, 8, "gpu07", SLURM_PORT_BASE + 4242, "Slurm srun")
    # MASTER_ADDR/MASTER_PORT from the user still win
    assert resolve_launcher_env({**SRUN_TASK, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "6000"}) == \
        LauncherEnv(3, 3, 8, "10.0.0.1", 6000, "Slurm srun")


def test_dist_env_batch_shell_is_one_process():
    """The batch script's own shell has SLURM_PROCID=0 and the allocation's SLURM_NTASKS but no step:
    a python started there directly is a single process, not rank 0 of 8 waiting for the others."""
    batch_shell = {key: value for key, value in SRUN_TASK.items() if key != "SLURM_STEP_ID"}
    assert resolve_launcher_env({**batch_shell, "SLURM_PROCID": "0"}) == \
        LauncherEnv(0, 0, 1, "localhost", 29500, "none")


def test_dist_env_mpi_and_torchrun_inside_slurm_win():
    # MPICH's mpiexec inside an allocation starts its proxies with srun: the ranks see both
    hydra = {**SRUN_TASK, "PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MASTER_ADDR": "gpu07"}
    assert resolve_launcher_env(hydra).launcher == "MPICH/PALS" and resolve_launcher_env(hydra).rank == 5
    # torchrun started by srun (one agent per node): torchrun's own variables describe the rank
    torchrun = {**SRUN_TASK, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "gpu07",
                "MASTER_PORT": "29400"}
    assert resolve_launcher_env(torchrun) == LauncherEnv(1, 1, 2, "gpu07", 29400, "torchrun/deepspeed")


@pytest.mark.parametrize("change, message", [
    ({"SLURM_PROCID": "8"}, "SLURM_PROCID=8 is not below SLURM_NTASKS=8"),
    ({"SLURM_LOCALID": "one"}, "SLURM_LOCALID='one' is not an integer"),
    ({"SLURM_JOB_ID": "job42"}, "SLURM_JOB_ID='job42' is not an integer"),
])
def test_dist_env_bad_slurm_environment(change, message):
    with pytest.raises(DistEnvError, match=re.escape(message)):
        resolve_launcher_env({**SRUN_TASK, **change})


@pytest.mark.skipif(shutil.which("scontrol", path=os.environ["PATH"] + ":/usr/sbin") is None,
                    reason="needs Slurm's scontrol (the Slurm fixture installs it as root)")
def test_dist_env_node_list_with_a_broken_slurm_configuration(tmp_path):
    """The first host of a bracketed list comes from `scontrol show hostnames`; when that fails (here: a
    slurm.conf it cannot parse) the error names the variable and scontrol's own last word."""
    (tmp_path / "slurm.conf").write_text("this is no slurm.conf\n")
    environ = {**SRUN_TASK, "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_CONF": str(tmp_path / "slurm.conf")}
    with pytest.raises(DistEnvError, match=re.escape("SLURM_STEP_NODELIST=gpu[07-08]: `scontrol show hostnames` "
                                                     "failed (scontrol: fatal: Unable to process configuration "
                                                     "file)")):
        resolve_launcher_env(environ)


# ---- dry runs: a faked 2-node x 4-task allocation ----

def two_node_allocation(runs_dir, **extra):
    allocation = dict(SLURM_JOB_ID="777", SLURM_NTASKS="8", SLURM_JOB_NUM_NODES="2", SLURM_NTASKS_PER_NODE="4",
                      SLURM_JOB_NODELIST="node[01-02]", SLURM_SUBMIT_DIR=REPO_ROOT)
    env = subprocess_env(RUNS_DIR=runs_dir, DATA_PATH=runs_dir / "nowhere" / "data", DRY_RUN="1",
                         **{**allocation, **extra})
    for var in ("NGPUS", "LAUNCHER", "RUN_NAME", "SLURM_RESTART_COUNT", "FRESH", "PYTHON"):
        if var not in extra:
            env.pop(var, None)
    return env


def dry_run(env, *args):
    return launch_script(SBATCH, args, env)


def srun_line(result) -> str:
    lines = [line for line in result.stdout.splitlines() if line.startswith("[examples_zero] DRY_RUN=1")]
    assert len(lines) == 1, result.stdout + result.stderr
    return lines[0].split("not starting: ", 1)[1]


def test_dry_run_prints_the_srun_line(tmp_path):
    result = dry_run(two_node_allocation(tmp_path, EXPERIMENT="Z3", PYTHON=sys.executable), "--seed", "7")
    assert result.returncode == 0, result.stderr
    assert f"[examples_zero] gpt_tiny_Z3 -> {tmp_path / 'gpt_tiny_Z3'}\n" in result.stdout
    line = srun_line(result)
    assert line.startswith(f"srun --ntasks 8 --kill-on-bad-exit=1 {sys.executable} {REPO_ROOT / 'pretrain_gpt.py'} ")
    assert " --zero-stage 3 " in line and line.rstrip().endswith(" --seed 7")
    assert " --exit-signal-handler " in line  # SIGTERM saves and stops (the requeue test below)
    # all 8 tasks are ranks: the global batch follows them (micro batch 4 x 8 ranks, one micro-batch per step)
    assert " --global-batch-size 32 " in line
    assert f" --load {tmp_path / 'gpt_tiny_Z3' / 'checkpoints'} " in line  # always: a folder without one starts afresh
    assert f"[run] DRY_RUN=1, the run would be starting {tmp_path / 'gpt_tiny_Z3'} afresh" in result.stderr
    assert not any(tmp_path.iterdir())  # nothing written


def sbatch_headers() -> list[str]:
    """The options of train.sbatch's #SBATCH lines, those before its first command (as sbatch reads them)."""
    headers = []
    for line in SBATCH.read_text().splitlines()[1:]:
        if line and not line.startswith("#"):
            break
        if line.startswith("#SBATCH "):
            headers.append(line[len("#SBATCH "):])
    return headers


def test_sbatch_script_gives_each_rank_cpus():
    """Without --cpus-per-task a task gets one CPU, to which srun binds the rank's loader workers, OpenMP threads
    (the offloaded Adam's) and heartbeat."""
    [cpus] = [header for header in sbatch_headers() if header.startswith("--cpus-per-task=")]
    assert int(cpus.split("=")[1]) >= 4


def test_dry_run_passes_the_jobs_cpus_per_task_to_srun(tmp_path):
    """Since Slurm 22.05 srun no longer takes --cpus-per-task from the job (SLURM_CPUS_PER_TASK): the driver
    passes it on; a job without one runs srun as before."""
    line = srun_line(dry_run(two_node_allocation(tmp_path, SLURM_CPUS_PER_TASK="8")))
    assert line.startswith("srun --ntasks 8 --cpus-per-task 8 --kill-on-bad-exit=1 ")
    line = srun_line(dry_run(two_node_allocation(tmp_path, SLURM_CPUS_PER_TASK="")))
    assert line.startswith("srun --ntasks 8 --kill-on-bad-exit=1 ")


def test_dry_run_of_a_job_whose_run_folder_has_a_checkpoint_resumes(tmp_path):
    """The drivers' one resume rule: a requeued job or a new one resumes an intact checkpoint; FRESH=1 does not."""
    checkpoints = tmp_path / "gpt_tiny_Z1" / "checkpoints"
    protocol.prepare_save(str(checkpoints), "global_step4")
    (checkpoints / protocol.staging_tag("global_step4")).mkdir()
    protocol.commit(str(checkpoints), "global_step4", {"iteration": 4})
    for restarts in ("1", "0"):
        result = dry_run(two_node_allocation(tmp_path, SLURM_RESTART_COUNT=restarts))
        assert f"[run] DRY_RUN=1, the run would be resuming from global_step4 in {checkpoints} (FRESH=1 starts" \
            in result.stderr
    fresh = dry_run(two_node_allocation(tmp_path, FRESH="1"))
    assert "[run] DRY_RUN=1, the run would be starting afresh (FRESH=1): would move the old files" in fresh.stderr
    # sbatch hands FRESH=1 to every requeue too: there it resumes what the job saved
    requeued = dry_run(two_node_allocation(tmp_path, FRESH="1", SLURM_RESTART_COUNT="1"))
    assert (f"[run] DRY_RUN=1, the run would be resuming from global_step4 in {checkpoints}: FRESH=1 applies to the "
            "job's first start only, and this is requeue 1 of Slurm job") in requeued.stderr
    assert (checkpoints / "latest").is_file()  # a dry run moves nothing


def test_sbatch_script_unknown_experiment_lists_the_drivers(tmp_path):
    result = dry_run(two_node_allocation(tmp_path, EXPERIMENT="Z4"))
    assert result.returncode == 1
    match = re.fullmatch(r"error: EXPERIMENT=Z4: no examples_zero/gpt_deepspeed_Z4\.sh \(known: (.*)\)\n",
                         result.stderr)
    assert match, result.stderr
    drivers = {path.name[len("gpt_deepspeed_"):-len(".sh")]
               for path in (REPO_ROOT / "examples_zero").glob("gpt_deepspeed_*.sh")}
    assert set(match.group(1).split()) == drivers and {"DP", "Z1", "Z2", "Z3", "Z3_OL"} <= drivers


def test_sbatch_script_outside_a_job(tmp_path):
    result = dry_run(two_node_allocation(tmp_path, SLURM_JOB_ID=""))
    assert (result.returncode, result.stderr) == \
        (1, "error: not inside a Slurm job (no SLURM_JOB_ID): submit with sbatch\n")


def test_driver_with_srun_outside_an_allocation(tmp_path):
    env = subprocess_env(RUNS_DIR=tmp_path, LAUNCHER="srun", DATA_PATH=tmp_path / "data")
    env.pop("SLURM_JOB_ID", None)
    result = subprocess.run(["bash", str(REPO_ROOT / "examples_zero" / "gpt_deepspeed_Z1.sh")], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip() == ("error: LAUNCHER=srun: not inside a Slurm allocation (no SLURM_JOB_ID): "
                                     "use sbatch or salloc")


# ---- the real Slurm of the suite's two virtual hosts ----

@pytest.fixture(scope="module")
def slurm(two_hosts):
    """The Slurm of the suite's virtual cluster (its client commands run in node0)."""
    return two_hosts.slurm


@pytest.mark.slow  # starts the cluster (and installs Slurm on a fresh machine)
def test_dist_env_expands_node_lists_with_scontrol(slurm):
    environ = {**SRUN_TASK, "SLURM_STEP_NODELIST": "node[09-10],gpu7", "SLURM_CONF": str(slurm.conf)}
    assert resolve_launcher_env(environ).master_addr == "node09"


def job_env(slurm, dolly_data_dir, runs_dir, **extra):
    """The driver settings of the torchrun run, for a job: the port is left to dist_env (from the job id)."""
    env = slurm.env(driver_env(dolly_data_dir, runs_dir, **extra))
    env.pop("MASTER_PORT")
    return env


def submit(slurm, env, *args) -> str:
    """sbatch from node0 (where slurmctld is), in the repository. One CPU per task unless args say: the virtual hosts
    have this machine's CPUs each, fewer than train.sbatch's --cpus-per-task=8 for its 2 tasks."""
    if not any(arg.startswith("--cpus-per-task") for arg in args):
        args = ("--cpus-per-task=1", *args)
    result = slurm.cluster.run(slurm.host, ["sbatch", "--parsable", *args], cwd=REPO_ROOT, env=env,
                               capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().split(";")[0]


@pytest.mark.slow
def test_a_job_passes_its_cpus_per_task_to_srun(slurm, tmp_path):
    """`DRY_RUN=1 sbatch --ntasks-per-node=1 --cpus-per-task=2 train.sbatch`: the srun line the job would run asks for the job's
    2 CPUs per task (Slurm 22.05's srun does not take them from the job)."""
    env = slurm.env(subprocess_env(RUNS_DIR=tmp_path, DATA_PATH=tmp_path / "nowhere", DRY_RUN="1", EXPERIMENT="Z1"))
    job = submit(slurm, env, "--ntasks-per-node=1", "--cpus-per-task=2", f"--output={tmp_path}/slurm-%j.out",
                 str(SBATCH))
    info = slurm.wait(job, timeout=120)
    output = (tmp_path / f"slurm-{job}.out").read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), output
    assert "not starting: srun --ntasks 1 --cpus-per-task 2 --kill-on-bad-exit=1 " in output, output


@pytest.mark.slow
def test_sbatch_wrap_of_a_driver_trains_like_torchrun(slurm, dolly_data_dir, one_host_z1_losses, tmp_path):
    """`sbatch -n 2 --wrap "LAUNCHER=srun bash examples_zero/gpt_deepspeed_Z1.sh"`."""
    job = submit(slurm, job_env(slurm, dolly_data_dir, tmp_path), "-n", "2", f"--output={tmp_path}/slurm-%j.out",
                 "--wrap", "LAUNCHER=srun bash examples_zero/gpt_deepspeed_Z1.sh")
    info = slurm.wait(job, timeout=300)
    output = (tmp_path / f"slurm-{job}.out").read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), output[-3000:]
    assert iteration_losses(output) == one_host_z1_losses


@pytest.mark.slow
def test_jobs_over_two_nodes_train_like_one_host(slurm, dolly_data_dir, one_host_z1_losses, tmp_path):
    """`sbatch -N 2 --wrap "LAUNCHER=srun bash examples_zero/gpt_deepspeed_Z1.sh"` and `EXPERIMENT=Z1 sbatch -N 2
    examples_zero/slurm/train.sbatch`, one task per node, submitted together: each rank on its own host (whose
    name maps to 127.0.1.1 there), the losses of the one-host run with the same global batch."""
    wrapped, script = tmp_path / "wrap", tmp_path / "sbatch"
    wrapped.mkdir(), script.mkdir()  # Slurm writes --output into an existing folder only
    jobs = {
        wrapped: submit(slurm, job_env(slurm, dolly_data_dir, wrapped), "-N", "2", "--ntasks-per-node", "1",
                        f"--output={wrapped}/slurm-%j.out", "--wrap",
                        "LAUNCHER=srun bash examples_zero/gpt_deepspeed_Z1.sh"),
        script: submit(slurm, job_env(slurm, dolly_data_dir, script, EXPERIMENT="Z1"), "-N", "2",
                       "--ntasks-per-node", "1", f"--output={script}/slurm-%j.out", str(SBATCH)),
    }
    for runs, job in jobs.items():
        info = slurm.wait(job, timeout=400)
        log = (runs / "gpt_tiny_Z1" / "train.log").read_text()
        assert (info["JobState"], info["ExitCode"], info["NumNodes"]) == ("COMPLETED", "0:0", "2"), log[-3000:]
        assert " > run info | zero stage: 1 | offload: none | model: tiny | world size: 2 |" in log
        for host, address in (("node0", "10.250.0.1"), ("node1", "10.250.0.2")):
            assert f"[zero-lab] network on {host}: the ranks use eth0 ({address})" in log
        losses = iteration_losses(log)
        assert sorted(losses) == sorted(one_host_z1_losses)
        assert [float(losses[i]) for i in losses] == pytest.approx(
            [float(one_host_z1_losses[i]) for i in losses], rel=1e-5)


def wait_for_text(path: Path, pattern: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and re.search(pattern, path.read_text(), re.M)):
        assert time.monotonic() < deadline, f"no {pattern!r} in {path} after {timeout} s"
        time.sleep(0.2)


@pytest.mark.slow
def test_signalled_job_requeues_and_resumes_without_losing_a_step(slurm, dolly_data_dir, one_host_z1_losses,
                                                                  tmp_path):
    """`FRESH=1 EXPERIMENT=Z1 sbatch examples_zero/slurm/train.sbatch`, 2 tasks, over an earlier run's checkpoint,
    and SIGTERM mid-run (what --signal sends before the time limit, and preemption): the first start puts the
    earlier run aside, the ranks save and exit 0, the script requeues the job, and the requeued job (which sbatch
    gives FRESH=1 again) resumes from the job's own checkpoint; iterations 1-4 each run once, with torchrun's
    losses."""
    run_dir = tmp_path / "gpt_tiny_Z1"
    earlier = run_dir / "checkpoints"
    protocol.prepare_save(str(earlier), "global_step9")
    (earlier / protocol.staging_tag("global_step9")).mkdir()
    protocol.commit(str(earlier), "global_step9", {"iteration": 9})
    job = submit(slurm, job_env(slurm, dolly_data_dir, tmp_path, EXPERIMENT="Z1", FRESH="1"),
                 f"--output={tmp_path}/slurm-%j.out", str(SBATCH))
    wait_for_text(run_dir / "train.log", r"^ iteration +1/ +4 \|", timeout=300)
    slurm.command("scancel", "--signal=TERM", job)
    info = slurm.wait(job, timeout=400)
    output = (run_dir / f"slurm-{job}.out").read_text()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), output[-4000:]
    # the job's own output file names the run folder, where the rest went
    assert f"output continues in {run_dir}/slurm-{job}.out" in (tmp_path / f"slurm-{job}.out").read_text()
    assert " > run info | zero stage: 1 | offload: none | model: tiny | world size: 2 |" in output
    commands = [line for line in (run_dir / "command.txt").read_text().splitlines() if not line.startswith("#")]
    assert len(commands) == 2  # both attempts (each passes --load: what each resumed is the rule's line, below)
    srun = "srun --ntasks 2 --cpus-per-task 1 --kill-on-bad-exit=1 "  # submit() asks for one CPU per task
    assert all(c.startswith(srun) and " --exit-signal-handler" in c for c in commands)

    stopped = re.search(r"^\[slurm\] stopped early at checkpoint global_step(\d+): requeueing job", output, re.M)
    assert stopped, output[-4000:]
    stop = int(stopped.group(1))
    assert 1 <= stop < 4
    attempts = re.split(r"^\[slurm\] job \d+ restart 1: .*$", output, flags=re.M)
    assert len(attempts) == 2, output[-4000:]
    assert sorted(iteration_losses(attempts[0])) == list(range(1, stop + 1))
    assert sorted(iteration_losses(attempts[1])) == list(range(stop + 1, 5))
    assert "[run] starting afresh (FRESH=1): the old files of" in attempts[0]
    [archive] = tmp_path.glob("gpt_tiny_Z1.old-*")
    assert (archive / "checkpoints" / "latest").read_text().strip() == "global_step9"
    assert (f"[run] resuming from global_step{stop} in {run_dir / 'checkpoints'}: FRESH=1 applies to the job's "
            f"first start only, and this is requeue 1 of Slurm job {job}") in attempts[1]
    # every step exactly once, loss for loss what the uninterrupted torchrun run printed
    assert {**iteration_losses(attempts[0]), **iteration_losses(attempts[1])} == one_host_z1_losses
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "global_step4"


@pytest.mark.slow
def test_signalled_job_without_a_checkpoint_to_resume_is_not_requeued(slurm, dolly_data_dir, tmp_path):
    """A run that saves elsewhere (a --save of the user's own) leaves nothing in <run>/checkpoints for the
    requeued job to resume from: requeueing would start it afresh at every signal, so the job ends instead."""
    elsewhere = tmp_path / "elsewhere"
    job = submit(slurm, job_env(slurm, dolly_data_dir, tmp_path, EXPERIMENT="Z1"),
                 f"--output={tmp_path}/slurm-%j.out", str(SBATCH), "--save", str(elsewhere))
    run_dir = tmp_path / "gpt_tiny_Z1"
    wait_for_text(run_dir / "train.log", r"^ iteration +1/ +4 \|", timeout=300)
    slurm.command("scancel", "--signal=TERM", job)
    info = slurm.wait(job, timeout=300)
    output = (run_dir / f"slurm-{job}.out").read_text()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("FAILED", "1:0", "0"), output[-4000:]
    assert "exiting program after receiving SIGTERM" in output and (elsewhere / "latest").is_file()
    assert "[slurm] stopped early without a new checkpoint (latest: none): not requeueing" in output
    assert not (run_dir / "checkpoints").exists()


@pytest.mark.slow
def test_a_failed_run_under_srun_ends_with_its_cause(slurm, tmp_path):
    """docs/bad-input.md under srun: the job's output ends with the one cause line, srun's own report
    ("srun: error: ... Exited with exit code 1") in <run>/launcher.log, no traceback."""
    env = slurm.env(subprocess_env(DATA_PATH=tmp_path / "nothing_here", RUNS_DIR=tmp_path))
    job = submit(slurm, env, "-n", "2", f"--output={tmp_path}/slurm-%j.out", "--wrap",
                 "LAUNCHER=srun bash examples_zero/gpt_deepspeed_Z1.sh")
    info = slurm.wait(job, timeout=300)
    output = (tmp_path / f"slurm-{job}.out").read_text()
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "1:0"), output[-3000:]
    report = tmp_path / "gpt_tiny_Z1" / "launcher.log"
    cause = (f"error: --data-path (from DATA_PATH): {tmp_path / 'nothing_here'}.bin does not exist (expected a prefix "
             f"with .bin/.idx files from tools/preprocess_data.py) (launcher's report: {report})")
    assert output.splitlines()[-1] == cause
    assert [line for line in output.splitlines() if "error" in line] == [cause] and "Traceback" not in output
    assert "srun: error: " in report.read_text()


@pytest.mark.slow
def test_a_job_of_a_run_that_is_running_is_refused(slurm, tmp_path):
    """Two launches of one run: a driver running it and `FRESH=1 EXPERIMENT=Z1 sbatch train.sbatch` of the same
    run folder. The job ends at once with the lock's one line, naming the run folder and the process that holds
    it, and moves none of the live run's files."""
    with waiting_driver_launch(tmp_path) as (first, runs, run_dir):
        before = sorted(p.name for p in run_dir.iterdir())
        env = slurm.env(subprocess_env(RUNS_DIR=runs, EXPERIMENT="Z1", FRESH=1))
        job = submit(slurm, env, f"--output={tmp_path}/slurm-%j.out", str(SBATCH))
        info = slurm.wait(job, timeout=300)
        output = (run_dir / f"slurm-{job}.out").read_text()
        assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("FAILED", "1:0", "0"), output
        assert f"error: run folder {run_dir} is in use by another launch (pid {first.pid} on " in output
        assert set(before) <= {p.name for p in run_dir.iterdir()} and not list(runs.glob("gpt_tiny_Z1.old-*"))
        assert first.poll() is None


@pytest.mark.slow
def test_max_restarts_restarts_a_job_whose_rank_was_killed(slurm, dolly_data_dir, one_host_z1_losses, tmp_path):
    """`MAX_RESTARTS=1 EXPERIMENT=Z1 sbatch examples_zero/slurm/train.sbatch`, 2 tasks: rank 1 is SIGKILLed at
    iteration 2 (conftest.fault_env); the driver starts the run again inside the same job, which resumes its
    newest checkpoint and completes with the uninterrupted run's losses, without a requeue."""
    run_dir = tmp_path / "gpt_tiny_Z1"
    env = fault_env(tmp_path, str(run_dir / "train.log"),
                    job_env(slurm, dolly_data_dir, tmp_path, EXPERIMENT="Z1", MAX_RESTARTS="1", SAVE_INTERVAL="1"))
    job = submit(slurm, env, f"--output={tmp_path}/slurm-%j.out", str(SBATCH))
    info = slurm.wait(job, timeout=600)
    output = (run_dir / f"slurm-{job}.out").read_text()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), output[-4000:]
    assert (tmp_path / "fault-happened").exists()
    assert "[run] restarting the run from its newest intact checkpoint (1 of 1, MAX_RESTARTS)" in output
    log = (run_dir / "train.log").read_text()
    assert re.findall(r"^\[zero-lab\] attempt (\d) started .*$", log, re.M) == ["1", "2"]
    assert re.search(r"^\[zero-lab\] attempt 2 started .*: restart 1 of 1, resuming from ", log, re.M)
    printed = [(int(i), loss) for i, loss in ITERATION_LOSS.findall(log)]
    assert sorted(set(printed)) == sorted(one_host_z1_losses.items())
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "global_step4"
