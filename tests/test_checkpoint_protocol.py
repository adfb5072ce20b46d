"""megatron/checkpointing/protocol.py and run_folder.py on real folders: a staged save swapped into place, the
old checkpoint kept until the new one is complete, an interrupted commit undone, and the one resume rule."""
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, test_env
from megatron.checkpointing import protocol
from megatron.checkpointing.protocol import CheckpointError
from megatron.checkpointing.run_folder import decide


def staged_save(save_dir, tag, files: dict[str, bytes]):
    """What the ranks do before the commit: their files in <tag>.saving."""
    protocol.prepare_save(str(save_dir), tag)
    staging = save_dir / protocol.staging_tag(tag)
    staging.mkdir()
    for name, data in files.items():
        (staging / name).write_bytes(data)


def committed(save_dir, tag, files, exchange=True, iteration=2):
    staged_save(save_dir, tag, files)
    protocol.commit(str(save_dir), tag, {"iteration": iteration}, exchange=exchange)


@pytest.mark.parametrize("exchange", [True, False])
def test_an_overwrite_replaces_the_old_checkpoint_only_when_the_new_one_is_complete(tmp_path, exchange):
    committed(tmp_path, "global_step2", {"model.pt": b"old" * 10})
    (tmp_path / "global_step2_universal").mkdir()  # a conversion of the old checkpoint
    staged_save(tmp_path, "global_step2", {"model.pt": b"new"})
    # the new save is written but not committed: the old checkpoint is what `latest` names, whole
    assert protocol.check_resumable(str(tmp_path)) == "global_step2"
    assert (tmp_path / "global_step2" / "model.pt").read_bytes() == b"old" * 10
    protocol.commit(str(tmp_path), "global_step2", {"iteration": 2}, exchange=exchange)
    assert (tmp_path / "global_step2" / "model.pt").read_bytes() == b"new"
    assert protocol.read_marker(str(tmp_path / "global_step2"))["files"] == {"model.pt": 3}
    # the stale conversion too; Megatron's tracker names the iteration
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step2", "latest", protocol.TRACKER]
    assert (tmp_path / protocol.TRACKER).read_text() == "2"


def test_a_commit_killed_between_its_renames_is_undone(tmp_path):
    """Without RENAME_EXCHANGE the old folder is renamed away first; a kill before the new one takes the name
    leaves <tag>.replaced, which the next save (or resume rule) puts back."""
    committed(tmp_path, "global_step4", {"model.pt": b"old"}, iteration=4)
    staged_save(tmp_path, "global_step4", {"model.pt": b"new!"})
    os.rename(tmp_path / "global_step4", tmp_path / "global_step4.replaced")  # the first rename, then the kill
    protocol.recover_interrupted_commit(str(tmp_path))
    assert (tmp_path / "global_step4" / "model.pt").read_bytes() == b"old"
    assert protocol.check_resumable(str(tmp_path)) == "global_step4"
    protocol.prepare_save(str(tmp_path), "global_step6")  # the next save removes the interrupted staging folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step4", "latest", protocol.TRACKER]


def test_incomplete_checkpoint_named_by_latest_is_one_line_naming_the_intact_one(tmp_path):
    committed(tmp_path, "global_step2", {"model.pt": b"x" * 5})
    (tmp_path / "global_step4").mkdir()
    (tmp_path / "global_step4" / "optim.pt").write_bytes(b"")
    (tmp_path / "latest").write_text("global_step4")  # edited by hand: a save never leaves this
    with pytest.raises(CheckpointError) as err:
        protocol.check_resumable(str(tmp_path))
    assert str(err.value) == (
        f"--load {tmp_path}: checkpoint global_step4 named by 'latest' is incomplete: zero_lab_state.json is "
        "missing, so its save never finished (optim.pt is 0 bytes); the newest intact checkpoint is global_step2 "
        f"(to resume from it: echo global_step2 > {tmp_path / 'latest'})")
    (tmp_path / "global_step2" / "model.pt").write_bytes(b"x")  # truncated after the save
    assert protocol.incomplete_reason(str(tmp_path / "global_step2")) == "model.pt is 1 bytes, 5 when it was saved"


def test_resume_rule_resumes_an_intact_checkpoint_and_moves_everything_else_aside(tmp_path):
    run = tmp_path / "gpt_tiny_Z1"
    assert decide(str(run), fresh=False, environ={}) == (None, f"starting {run} afresh")  # nothing there
    run.mkdir()
    (run / "train.log").write_text(" iteration        1/      10 | lm loss: 1.082744E+01 |\n")  # trained, saved nothing
    (run / "slurm-77.out").write_text("the job that is running now\n")
    (run / "train.node1.log").write_text("host 1 of a torchrun run over two hosts, started before host 0\n")
    load, said = decide(str(run), fresh=False, environ={"SLURM_JOB_ID": "77"})
    archives = sorted(tmp_path.glob("gpt_tiny_Z1.old-*"))
    assert load is None and len(archives) == 1 and said.endswith(f"are now in {archives[0]}")
    assert [p.name for p in archives[0].iterdir()] == ["train.log"]
    # what others write for the attempt now starting stays: the running job's output, a further host's log
    assert sorted(p.name for p in run.iterdir()) == ["slurm-77.out", "train.node1.log"]

    committed(run / "checkpoints", "global_step4", {"model.pt": b"weights"}, iteration=4)
    (run / "train.log").write_text("attempt 1\n")
    assert decide(str(run), fresh=False, environ={})[0] == str(run / "checkpoints")
    assert decide(str(run), fresh=True, dry_run=True, environ={})[0] is None
    assert (run / "checkpoints").is_dir()  # a dry run moves nothing
    load, said = decide(str(run), fresh=True, environ={})
    assert load is None and "FRESH=1" in said and not (run / "checkpoints").exists()
    assert len(list(tmp_path.glob("gpt_tiny_Z1.old-*"))) == 2  # both earlier runs kept, apart


@pytest.mark.parametrize("fresh", [False, True])
def test_what_failed_starts_left_stays_in_the_run_folder(tmp_path, fresh):
    """Issue 56, item 8: each start refused at start-up (a bad flag, a checkpoint of another model) left its log and
    command behind, and the next start moved them to <run>.old-<UTC>, a folder of no training the summary then listed
    as skipped. Files that trained nothing (no checkpoint, no iteration line in any log) stay; a log with an
    iteration line, or anything in checkpoints/, is still moved aside."""
    run = tmp_path / "gpt_tiny_Z1"
    (run / "logs").mkdir(parents=True)
    (run / "train.log").write_text("[zero-lab] attempt 1 started\nerror: --seq-length 0 must be a positive integer\n")
    (run / "command.txt").write_text("# attempt 1 | 2026-12-06 10:00:00 UTC | host\ntorchrun ...\n")
    (run / "logs" / "user-host-ngpu2.log").write_text("[zero-lab] attempt 1 started\n")
    (run / "checkpoints").mkdir()  # empty: nothing was saved
    load, said = decide(str(run), fresh=fresh, environ={})
    why = "FRESH=1" if fresh else "no checkpoint to resume there"
    assert load is None and said == (f"starting afresh ({why}): the files of {run} stay there, what failed starts "
                                     "left (no checkpoint, no iteration trained); this attempt's log follows theirs")
    assert not list(tmp_path.glob("gpt_tiny_Z1.old-*"))
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "command.txt", "logs", "train.log"]

    (run / "logs" / "user-host-ngpu2.log").write_text(" iteration        1/      10 | lm loss: 1.082744E+01 |\n")
    load, said = decide(str(run), fresh=fresh, environ={})
    [archive] = tmp_path.glob("gpt_tiny_Z1.old-*")
    assert said.endswith(f"are now in {archive}") and not list(run.iterdir())


def test_fresh_applies_to_a_slurm_jobs_first_start_only(tmp_path):
    """sbatch gives every requeue the submitting environment, FRESH=1 included: a requeue resumes what the job
    saved; the job's first start (SLURM_RESTART_COUNT 0 or unset) starts afresh."""
    run = tmp_path / "gpt_tiny_Z1"
    committed(run / "checkpoints", "global_step3", {"model.pt": b"weights"}, iteration=3)
    (run / ".zero-lab.lock").write_text("pid 1 on node0\n")  # the lock of the launch asking: never moved
    requeued = {"SLURM_JOB_ID": "88", "SLURM_RESTART_COUNT": "2"}
    load, said = decide(str(run), fresh=True, environ=requeued)
    assert load == str(run / "checkpoints")
    assert said == (f"resuming from global_step3 in {run / 'checkpoints'}: FRESH=1 applies to the job's first start "
                    "only, and this is requeue 2 of Slurm job 88")
    assert not list(tmp_path.glob("gpt_tiny_Z1.old-*"))
    load, said = decide(str(run), fresh=True, environ={"SLURM_JOB_ID": "88", "SLURM_RESTART_COUNT": "0"})
    assert load is None and said.startswith("starting afresh (FRESH=1): the old files")
    [archive] = tmp_path.glob("gpt_tiny_Z1.old-*")
    assert (archive / "checkpoints" / "latest").is_file()
    assert [p.name for p in run.iterdir()] == [".zero-lab.lock"]


def test_resume_rule_refuses_a_broken_latest_in_one_line(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("global_step9")
    result = subprocess.run([sys.executable, "-m", "megatron.checkpointing.run_folder", str(run)],
                            cwd=REPO_ROOT, env=test_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == (f"error: --load {run / 'checkpoints'}: checkpoint global_step9 named by 'latest' is "
                             "incomplete: its folder does not exist; no intact checkpoint is left there (a "
                             "tools/hf_to_checkpoint.py folder is loaded with --finetune); or FRESH=1 to start the "
                             f"run afresh (its old files are kept in {run}.old-<time>)\n")
    fresh = subprocess.run([sys.executable, "-m", "megatron.checkpointing.run_folder", str(run), "--fresh"],
                           cwd=REPO_ROOT, env=test_env(), capture_output=True, text=True, timeout=60)
    assert fresh.returncode == 0 and fresh.stdout == "\n" and fresh.stderr.startswith("[run] starting afresh (FRESH=1)")
    [archive] = tmp_path.glob("run.old-*")
    assert (archive / "checkpoints" / "latest").read_text() == "global_step9" and not (run / "checkpoints").exists()
