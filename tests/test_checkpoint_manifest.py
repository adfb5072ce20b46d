"""The checkpoint manifest (issue 35 item 3): each file's size and CRC-32, taken while the save writes it
and kept in the completion marker; at a resume a file that does not match is named in one line and the
newest intact checkpoint before it is resumed instead.

Real 2-rank runs (ZeRO-1, dropout off): tests/runs.py's saved-checkpoint run saves global_step2, 4, 6 and 8; a
byte flipped in a shard of global_step8 and a truncated shard of global_step6 make the resumed run skip both,
resume global_step4 and repeat the first run's losses; a checkpoint saved before manifests existed loads as
before, with a note."""
import json
import os
import re
import shutil
import zlib

import pytest
import torch

from runs import CHECKPOINT_ITERS, CHECKPOINT_RUN, run_pretrain
from megatron.checkpointing import protocol
from megatron.checkpointing.checksum import StreamCRC, crc32_combine, file_crc32, format_crc
from megatron.checkpointing.protocol import CheckpointError, resume_tag
from megatron.checkpointing.run_folder import decide

LOSS = re.compile(r" iteration +(\d+)/ +\d+ \|.*?\| lm loss: (\S+) \|")
SHARD = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
TAGS = ("global_step2", "global_step4", "global_step6", "global_step8")  # what the saved-checkpoint run saves


def flip_byte(path, offset=None):
    data = bytearray(path.read_bytes())
    offset = len(data) // 2 if offset is None else offset
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


# ---- the save side: CRC-32 while writing, equal to the file's read back ----

def test_crc32_combine_is_zlibs():
    for first, second in ((b"", b""), (b"a", b""), (b"", b"b"), (os.urandom(1000), os.urandom(300_001))):
        assert crc32_combine(zlib.crc32(first), zlib.crc32(second), len(second)) == zlib.crc32(first + second)


@pytest.mark.parametrize("zipfile, torch_crc", [(True, True), (True, False), (False, True)])
def test_checksum_taken_while_writing_is_the_files(tmp_path, zipfile, torch_crc):
    """Through DeepSpeed's checkpoint engine API, for torch's zip format (tensor records' CRC-32 reused from
    the zip), the zip written without torch's CRC-32s, and DeepSpeed's legacy serialization."""
    from megatron.checkpointing.writer import FlushingCheckpointEngine
    engine = FlushingCheckpointEngine(None)
    engine.zipfile_serialization = zipfile
    state = {"big": torch.randn(300, 1000), "small": torch.arange(5), "nested": {"x": torch.ones(40_000)},
             "step": 3}
    torch.serialization.set_crc32_options(torch_crc)
    try:
        engine.start_manifest()
        engine.save(state, str(tmp_path / "a.pt"))
        engine.save({"only": torch.zeros(3)}, str(tmp_path / "b.pt"))
    finally:
        torch.serialization.set_crc32_options(True)
    for name in ("a.pt", "b.pt"):
        path = tmp_path / name
        assert engine.written[str(path)] == (path.stat().st_size, format_crc(file_crc32(str(path))))
    # with torch's CRC-32s in the zip, the tensors' bytes are not hashed a second time
    crc = StreamCRC(reuse_zip_crcs=zipfile and torch_crc)
    with open(tmp_path / "d.pt", "wb") as handle:
        torch.save(state, _Feeding(handle, crc), _use_new_zipfile_serialization=zipfile)
    assert crc.finish(str(tmp_path / "d.pt")) == file_crc32(str(tmp_path / "d.pt"))
    if zipfile and torch_crc:
        assert crc.hashed < 0.01 * crc.size
    else:
        assert crc.hashed == crc.size
    assert torch.equal(torch.load(tmp_path / "a.pt", weights_only=True)["big"], state["big"])
    unhashed = FlushingCheckpointEngine(None, checksums=False)
    unhashed.save(state, str(tmp_path / "c.pt"))
    assert unhashed.written[str(tmp_path / "c.pt")] == ((tmp_path / "c.pt").stat().st_size, None)


class _Feeding:
    def __init__(self, handle, crc):
        self.handle, self.crc = handle, crc

    def write(self, data):
        self.crc.update(data)
        return self.handle.write(data)

    def flush(self):
        self.handle.flush()


def test_a_flipped_byte_loads_silently_without_the_manifest(tmp_path):
    """Why the manifest: torch.load does not check the zip's CRC-32s, so a damaged tensor loads as numbers."""
    path = tmp_path / "w.pt"
    weights = torch.ones(100_000)
    torch.save({"w": weights}, path)
    flip_byte(path)
    loaded = torch.load(path, weights_only=True)["w"]
    assert loaded.shape == weights.shape and not torch.equal(loaded, weights)


# ---- the resume rule on folders ----

def committed(save_dir, tag, files: dict[str, bytes], checksums=True):
    protocol.prepare_save(str(save_dir), tag)
    staging = save_dir / protocol.staging_tag(tag)
    staging.mkdir()
    for name, data in files.items():
        (staging / name).write_bytes(data)
    crcs = {name: format_crc(zlib.crc32(data)) for name, data in files.items()} if checksums else None
    protocol.commit(str(save_dir), tag, {"iteration": int(tag[len("global_step"):])}, checksums=crcs)


def test_resume_rule_skips_a_damaged_checkpoint_for_the_newest_intact_one(tmp_path):
    for step in (2, 4, 6):
        committed(tmp_path, f"global_step{step}", {"model.pt": b"w" * 100, "optim.pt": b"o" * 50})
    assert protocol.read_marker(str(tmp_path / "global_step6"))["crc32"] == {
        "model.pt": format_crc(zlib.crc32(b"w" * 100)), "optim.pt": format_crc(zlib.crc32(b"o" * 50))}
    assert resume_tag(str(tmp_path)).tag == "global_step6"

    flip_byte(tmp_path / "global_step6" / "optim.pt", 7)
    (tmp_path / "global_step4" / "model.pt").write_bytes(b"w" * 60)  # truncated
    choice = resume_tag(str(tmp_path))
    assert choice.tag == "global_step2"
    crc = format_crc(file_crc32(str(tmp_path / "global_step6" / "optim.pt")))
    assert choice.skip_lines() == [
        f"warning: --load {tmp_path}: skipped checkpoint global_step6: optim.pt has CRC-32 {crc}, "
        f"{format_crc(zlib.crc32(b'o' * 50))} when it was saved (its contents changed after the save); "
        "resuming from global_step2",
        f"warning: --load {tmp_path}: skipped checkpoint global_step4: model.pt is 60 bytes, 100 when it was "
        "saved; resuming from global_step2"]
    # without reading the files (the launch scripts' rule, the start-up check) only the truncation shows
    assert resume_tag(str(tmp_path), contents=False).tag == "global_step6"

    (tmp_path / "global_step2" / "optim.pt").unlink()
    with pytest.raises(CheckpointError) as err:
        resume_tag(str(tmp_path))
    assert str(err.value) == (f"--load {tmp_path}: no intact checkpoint to resume: global_step6: optim.pt has "
                              f"CRC-32 {crc}, {format_crc(zlib.crc32(b'o' * 50))} when it was saved (its contents "
                              "changed after the save); global_step4: model.pt is 60 bytes, 100 when it was saved; "
                              "global_step2: optim.pt is missing")


def test_resume_rule_never_takes_a_newer_checkpoint_of_another_run(tmp_path):
    """A re-used folder: global_step8 is an old run's; `latest` names this run's global_step4."""
    for step in (2, 8, 4):
        committed(tmp_path, f"global_step{step}", {"model.pt": bytes([step]) * 10})
    flip_byte(tmp_path / "global_step4" / "model.pt", 0)
    assert resume_tag(str(tmp_path)).tag == "global_step2"


def test_a_checkpoint_without_checksums_is_checked_by_size(tmp_path):
    committed(tmp_path, "global_step2", {"model.pt": b"w" * 10}, checksums=False)
    assert "crc32" not in protocol.read_marker(str(tmp_path / "global_step2"))
    flip_byte(tmp_path / "global_step2" / "model.pt", 3)
    assert resume_tag(str(tmp_path)).tag == "global_step2"
    assert not protocol.has_checksums(str(tmp_path / "global_step2"))


def test_launch_rule_says_what_it_skipped(tmp_path):
    checkpoints = tmp_path / "run" / "checkpoints"
    committed(checkpoints, "global_step2", {"model.pt": b"w" * 10})
    committed(checkpoints, "global_step4", {"model.pt": b"w" * 10})
    (checkpoints / "global_step4" / "model.pt").write_bytes(b"w")
    load, said = decide(str(tmp_path / "run"), fresh=False, environ={})
    assert load == str(checkpoints)
    assert said == (f"resuming from global_step2 in {checkpoints} (FRESH=1 starts the run afresh instead); "
                    "skipped global_step4: model.pt is 1 bytes, 10 when it was saved")


# ---- real 2-rank runs ----

def pretrain(data_dir, *extra, expect=0):
    """A run from the saved-checkpoint run's flags (tests/runs.py), which it resumes."""
    return run_pretrain(data_dir, *CHECKPOINT_RUN[:2], *extra, expect=expect)


def losses(log: str) -> dict[int, float]:
    return {int(step): float(loss) for step, loss in LOSS.findall(log)}


@pytest.fixture(scope="module")
def saved(checkpoint_run):
    """The uninterrupted run, 8 iterations saving global_step2, 4, 6 and 8 (tests/runs.py's saved-checkpoint run,
    shared with the fault tests): its losses and folder. Tests damage copies of it."""
    found = losses(checkpoint_run.stdout)
    assert sorted(found) == list(range(1, CHECKPOINT_ITERS + 1))
    return found, checkpoint_run.folder


def copy_of(folder, target):
    shutil.copytree(folder, target)
    return target


@pytest.mark.slow
def test_a_real_save_lists_every_file_with_its_checksum(saved):
    _, folder = saved
    for tag in TAGS:
        marker = json.loads((folder / tag / "zero_lab_state.json").read_text())
        assert SHARD in marker["files"] and "mp_rank_00_model_states.pt" in marker["files"]
        assert sorted(marker["crc32"]) == sorted(marker["files"])  # every rank's files, each with its CRC-32
        for name, crc in marker["crc32"].items():
            assert format_crc(file_crc32(str(folder / tag / name))) == crc, name


@pytest.mark.slow
def test_damaged_newest_checkpoints_are_skipped_and_the_run_resumes_the_newest_intact_one(dolly_data_dir, saved,
                                                                                          tmp_path):
    """Both kinds of damage in one resumed run: a byte flipped in global_step8's shard and global_step6's shard
    truncated; the run skips both, each in its line, and resumes global_step4."""
    ref_losses, ref_folder = saved
    folder = copy_of(ref_folder, tmp_path / "ckpt")
    flipped, truncated = folder / "global_step8" / SHARD, folder / "global_step6" / SHARD
    flip_byte(flipped)
    crc = format_crc(file_crc32(str(flipped)))
    saved_crc = json.loads((folder / "global_step8" / "zero_lab_state.json").read_text())["crc32"][SHARD]
    size = truncated.stat().st_size
    with open(truncated, "r+b") as handle:
        handle.truncate(size - 1000)
    resumed = pretrain(dolly_data_dir, "--load", str(folder), "--save", str(folder), "--save-interval", "2")
    assert [line for line in resumed.stdout.splitlines() if "skipped checkpoint" in line] == [
        f"warning: --load {folder}: skipped checkpoint global_step8: {SHARD} has CRC-32 {crc}, {saved_crc} when it "
        "was saved (its contents changed after the save); resuming from global_step4",
        f"warning: --load {folder}: skipped checkpoint global_step6: {SHARD} is {size - 1000} bytes, {size} when it "
        "was saved; resuming from global_step4"]
    assert re.search(rf"loaded checkpoint {re.escape(str(folder / 'global_step4'))}\S* at iteration 4$", resumed.stdout,
                     re.M)
    assert losses(resumed.stdout) == {it: ref_losses[it] for it in range(5, CHECKPOINT_ITERS + 1)}
    # the resumed run's own saves of global_step6 and 8 replaced the damaged ones
    assert resume_tag(str(folder)).tag == "global_step8" and resume_tag(str(folder)).skipped == []


@pytest.mark.slow
def test_no_intact_checkpoint_is_one_line_and_a_non_zero_exit(dolly_data_dir, saved, tmp_path):
    _, ref_folder = saved
    folder = copy_of(ref_folder, tmp_path / "ckpt")
    for tag in TAGS:
        flip_byte(folder / tag / SHARD)
    run = pretrain(dolly_data_dir, "--load", str(folder), expect=None)
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert errors and set(errors) == {errors[0]}
    assert re.fullmatch(rf"error: --load {re.escape(str(folder))}: no intact checkpoint to resume: global_step8: "
                        rf"{SHARD} has CRC-32 \w{{8}}, \w{{8}} when it was saved \(its contents changed after the "
                        rf"save\); global_step6: {SHARD} has CRC-32 .*", errors[0]), errors


@pytest.mark.slow
def test_a_checkpoint_saved_before_manifests_loads_with_a_note(dolly_data_dir, saved, tmp_path):
    ref_losses, ref_folder = saved
    folder = copy_of(ref_folder, tmp_path / "ckpt")
    for tag in TAGS:
        marker = folder / tag / "zero_lab_state.json"
        record = json.loads(marker.read_text())
        del record["crc32"]
        marker.write_text(json.dumps(record))
    resumed = pretrain(dolly_data_dir, "--load", str(folder), "--train-iters", str(CHECKPOINT_ITERS + 1))
    note = (f"note: --load {folder}: global_step8 has no checksums (saved before zero-lab wrote them, or through "
            "another checkpoint engine): its files' sizes were checked, their contents cannot be")
    assert note in resumed.stdout.splitlines()
    assert re.search(rf"loaded checkpoint {re.escape(str(folder / 'global_step8'))}\S* at iteration 8$", resumed.stdout,
                     re.M)
    assert sorted(losses(resumed.stdout)) == [CHECKPOINT_ITERS + 1]
