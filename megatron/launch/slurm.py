"""examples_zero/slurm/train.sbatch's launch path: one examples_zero experiment (EXPERIMENT, default Z1) as a Slurm
batch job, one rank per task through srun (the drivers' path with LAUNCHER=srun).

The job's output continues in <run>/slurm-<job>.out. Before the time limit Slurm sends SIGTERM (--signal): the ranks
save a checkpoint and exit (--exit-signal-handler), and the job requeues itself when that checkpoint is new, so that
a run that cannot make progress does not loop; the requeued job resumes by the drivers' one resume rule (FRESH=1
applies to the job's first start only). docs/slurm.md.
"""
from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import time

from megatron.launch.drivers import EXPERIMENTS, DriverPlanner
from megatron.launch.plan import Supervisor, die, given, launch
from megatron.launch.settings import LaunchError


def _latest(run_dir: str) -> str:
    with contextlib.suppress(OSError):
        with open(f"{run_dir}/checkpoints/latest") as handle:
            return handle.read().strip()
    return ""


def _last_attempt(run_dir: str) -> str:
    """train.log holds every attempt of the run: this one starts at its last "[zero-lab] attempt" line."""
    with contextlib.suppress(OSError):
        with open(f"{run_dir}/train.log", errors="replace") as handle:
            text = handle.read()
        return text[text.rfind("\n[zero-lab] attempt ") + 1:]  # the whole log when it has one attempt
    return ""


def run(env: dict[str, str], args: list[str]) -> int:
    v = given(env)
    if "SLURM_JOB_ID" not in v:
        die("not inside a Slurm job (no SLURM_JOB_ID): submit with sbatch")
    experiment = v.get("EXPERIMENT", "Z1")
    if experiment not in EXPERIMENTS:
        die(f"EXPERIMENT={experiment}: no examples_zero/gpt_deepspeed_{experiment}.sh (known: "
            f"{' '.join(sorted(EXPERIMENTS))})")
    env = dict(env, LAUNCHER="srun")
    planner = DriverPlanner(experiment)
    if v.get("DRY_RUN") == "1":
        return launch(planner, env, args)
    said = io.StringIO()
    try:  # the run folder, as the driver names it; what the dry plan says is only shown when it refuses
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            run_dir = planner.plan(dict(env, DRY_RUN="1"), args, dry_run=True).run_dir
    except LaunchError:
        sys.stderr.write(said.getvalue())
        raise
    job, restarts, nodes = v["SLURM_JOB_ID"], v.get("SLURM_RESTART_COUNT", "0"), v.get("SLURM_JOB_NODELIST", "?")
    os.makedirs(run_dir, exist_ok=True)
    output = f"{run_dir}/slurm-{job}.out"
    print(f"[slurm] job {job} (restart {restarts}) on {nodes}: output continues in {output}", flush=True)
    sys.stderr.flush()
    with open(output, "a") as handle:
        os.dup2(handle.fileno(), 1)
        os.dup2(handle.fileno(), 2)
    print(f"[slurm] job {job} restart {restarts}: {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, "
          f"nodes {nodes}", flush=True)
    latest_before = _latest(run_dir)
    try:
        status = Supervisor(planner, env, args).run()
    except LaunchError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 1
    latest_after = _latest(run_dir)
    # The drivers pass --exit-signal-handler: on SIGTERM (--signal before the time limit, preemption, scancel) the
    # ranks save the current iteration and exit 0 before the end of the schedule (docs/log-lines.md)
    attempt = _last_attempt(run_dir)
    if status != 0 or "exiting program after receiving SIG" not in attempt or "[after training is done]" in attempt:
        return status
    if not latest_after or latest_after == latest_before:
        print(f"[slurm] stopped early without a new checkpoint (latest: {latest_after or 'none'}): not requeueing",
              flush=True)
        return 1
    print(f"[slurm] stopped early at checkpoint {latest_after}: requeueing job {job}", flush=True)
    try:
        requeued = subprocess.run(["scontrol", "requeue", job]).returncode == 0
    except OSError:
        requeued = False
    if not requeued:
        die(f"scontrol requeue {job} failed: submit the job again to continue (it resumes from {run_dir}/checkpoints)")
    return 0
