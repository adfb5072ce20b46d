"""The one resume rule, asked by every launch path (the examples_zero drivers, ALCF/train-gpt3.sh and through
the drivers examples_zero/slurm/train.sbatch) before it starts a run (docs/checkpoints.md):

- a run whose run folder holds an intact checkpoint (`<run>/checkpoints/latest` naming a complete one)
  resumes from it; one damaged after its save (a file of another size than its marker lists) is skipped
  for the newest intact one before it, and the run itself, loading, checks the files' CRC-32 the same way;
- a fresh start is asked for explicitly (FRESH=1, `--fresh` here); the run folder's old files are then
  moved, whole, to `<run>.old-<UTC time>/`, so the new run never mixes with them and nothing is lost.
  It applies to a Slurm job's first start only: sbatch hands the submitting environment, FRESH=1 included, to
  every requeue (SLURM_RESTART_COUNT > 0), which resumes the checkpoint the job itself saved;
- a run folder with files but no checkpoint (an attempt that saved nothing) is moved aside the same way, unless
  nothing was trained there: the files of failed starts (no checkpoint, no iteration line in any log) stay where
  they are, the new attempt's log following theirs after its `[zero-lab] attempt N` line, so that a start refused
  at start-up leaves no `<run>.old-<time>` folder behind for the next start to make;
- `latest` naming an incomplete checkpoint (edited by hand: saves never leave one) stops the launch with
  one line saying which checkpoint is intact.

A Slurm job's own output file in the run folder (`slurm-<SLURM_JOB_ID>.out`) is the job's, still being
written: it stays where it is. So do the files of a run's further hosts under torchrun (`train.node<k>.log`,
`launcher.node<k>.log`, `command.node<k>.txt`): those hosts start on their own and may be writing them
already when host 0 asks the rule.

    python -m megatron.checkpointing.run_folder RUN_DIR [--fresh] [--dry-run]

prints the checkpoint folder to pass as --load (an empty line for a fresh start) on stdout, and what it
decided on stderr. Standard library only: the launch scripts call it before any rank starts.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time

from megatron.checkpointing.protocol import CheckpointError, read_latest, resume_tag
from megatron.errors import ZeroLabError

CHECKPOINTS = "checkpoints"


_FURTHER_HOSTS_FILES = re.compile(r"^(?:(?:train|launcher)\.node\d+\.log|command\.node\d+\.txt)$")
# the launch lock (megatron/launch/plan.py), held by the launch asking the rule: never moved from under it
LOCK_FILES = re.compile(r"^\.zero-lab(?:\.node\d+)?\.lock$")


def _kept(name: str, environ) -> bool:
    """Files of the attempt that is starting, written by others than this launch script."""
    job = environ.get("SLURM_JOB_ID")
    return ((job is not None and name == f"slurm-{job}.out") or _FURTHER_HOSTS_FILES.match(name) is not None
            or LOCK_FILES.match(name) is not None)


def _run_files(run_dir: str, environ) -> list[str]:
    if not os.path.isdir(run_dir):
        return []
    return sorted(name for name in os.listdir(run_dir) if not _kept(name, environ))


# zero-lab's iteration line (docs/log-lines.md), Megatron's too: a log holding one comes from an attempt that trained
_ITERATION_LINE = re.compile(rb" iteration +\d+/ *\d+ \|")


def _log_trained(path: str) -> bool:
    try:
        with open(path, "rb") as handle:
            return any(_ITERATION_LINE.search(line) for line in handle)
    except OSError:
        return True  # unreadable: kept apart, as any run's files


def trained_here(run_dir: str, names: list[str]) -> bool:
    """Whether `names` of run_dir hold what an attempt trained: a checkpoints folder with anything in it, or a log
    (*.log, ALCF's logs/ too) with an iteration line. Failed starts leave neither."""
    checkpoints = os.path.join(run_dir, CHECKPOINTS)
    if CHECKPOINTS in names and (not os.path.isdir(checkpoints) or os.listdir(checkpoints)):
        return True
    for name in names:
        path = os.path.join(run_dir, name)
        if os.path.isdir(path) and name != CHECKPOINTS:
            logs = [os.path.join(folder, file) for folder, _, files in os.walk(path) for file in files]
        else:
            logs = [path]
        if any(log.endswith(".log") and _log_trained(log) for log in logs):
            return True
    return False


def _archive_name(run_dir: str) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target, n = f"{run_dir.rstrip(os.sep)}.old-{stamp}", 1
    while os.path.exists(target):
        n += 1
        target = f"{run_dir.rstrip(os.sep)}.old-{stamp}-{n}"
    return target


def move_aside(run_dir: str, names: list[str]) -> str:
    """Move `names` of run_dir into a new `<run>.old-<time>` folder; returns that folder."""
    target = _archive_name(run_dir)
    os.makedirs(target)
    for name in names:
        os.rename(os.path.join(run_dir, name), os.path.join(target, name))
    return target


def _slurm_requeue(environ) -> str:
    """'requeue N of Slurm job J' when this is a requeued start of a Slurm job, else ''."""
    restarts = environ.get("SLURM_RESTART_COUNT", "0")
    if not restarts.isdigit() or int(restarts) == 0:
        return ""
    return f"requeue {restarts} of Slurm job {environ.get('SLURM_JOB_ID', '?')}"


def decide(run_dir: str, fresh: bool, dry_run: bool = False, environ=os.environ) -> tuple[str | None, str]:
    """(the checkpoint folder to resume, or None for a fresh start; one line saying what was decided)."""
    checkpoints = os.path.join(run_dir, CHECKPOINTS)
    names = _run_files(run_dir, environ)
    requeue = _slurm_requeue(environ) if fresh else ""
    if (not fresh or requeue) and read_latest(checkpoints) is not None:
        try:
            choice = resume_tag(checkpoints, contents=False)  # the run reads the files back when it loads them
        except CheckpointError as err:
            raise CheckpointError(f"{err}; or FRESH=1 to start the run afresh (its old files are kept in "
                                  f"{run_dir}.old-<time>)") from None
        tag = choice.tag
        skipped = "".join(f"; skipped {other}: {why}" for other, why in choice.skipped)
        if requeue:
            return checkpoints, (f"resuming from {tag} in {checkpoints}: FRESH=1 applies to the job's first start "
                                 f"only, and this is {requeue}{skipped}")
        return checkpoints, f"resuming from {tag} in {checkpoints} (FRESH=1 starts the run afresh instead){skipped}"
    if not names:
        return None, f"starting {run_dir} afresh"
    why = "FRESH=1" if fresh else "no checkpoint to resume there"
    if not trained_here(run_dir, names):
        return None, (f"starting afresh ({why}): the files of {run_dir} stay there, what failed starts left (no "
                      "checkpoint, no iteration trained); this attempt's log follows theirs")
    if dry_run:
        return None, f"starting afresh ({why}): would move the old files of {run_dir} to {run_dir}.old-<time>"
    return None, f"starting afresh ({why}): the old files of {run_dir} are now in {move_aside(run_dir, names)}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="The resume rule of the launch scripts: resume or start afresh.")
    parser.add_argument("run_dir")
    parser.add_argument("--fresh", action="store_true", help="start afresh even when a checkpoint is there")
    parser.add_argument("--dry-run", action="store_true", help="say what would happen; move nothing")
    ns = parser.parse_args(argv)
    try:
        load, said = decide(os.path.abspath(ns.run_dir), ns.fresh, ns.dry_run)
    except (ZeroLabError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"[run] {said}", file=sys.stderr)
    print(load or "")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
