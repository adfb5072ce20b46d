"""The on-disk protocol of training checkpoints: what makes a checkpoint complete, and how a save becomes one.

    <save>/latest                    the tag of the newest committed checkpoint
    <save>/latest_checkpointed_iteration.txt   its iteration (Megatron's tracker, which its launch scripts read)
    <save>/global_step<N>/           one checkpoint; complete when its marker lists every file at its size,
                                     intact when each file also has the CRC-32 the marker lists (the manifest)
    <save>/global_step<N>.saving/    a save in progress (never loaded; removed by the next save)

A save writes into `<tag>.saving`, the marker last, and only then takes the tag's name: by an atomic
exchange of the two folders when the tag exists already (an overwrite), so that at every instant
`global_step<N>` is a complete checkpoint, the old one or the new one; then `latest` is switched. An
interrupted save (a kill, a full disk) leaves the previous checkpoint and `latest` as they were.
Where the filesystem cannot exchange folders, the old one is renamed to `<tag>.replaced` first, and
`recover_interrupted_commit` puts it back if the save died between the two renames.

A resume (`resume_tag`) takes the checkpoint `latest` names when it is intact; one damaged after its save
(a file of another size or CRC-32 than the marker lists) is skipped for the newest intact one before it.

Standard library only: the launch scripts' resume rule reads this without importing torch.
"""
from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
from dataclasses import dataclass, field

from megatron.checkpointing.checksum import file_crc32, format_crc
from megatron.errors import ZeroLabError

MARKER = "zero_lab_state.json"
CHECKSUMS = "crc32"  # the marker's manifest of file contents: path -> CRC-32 as 8 hex digits
LATEST = "latest"
TRACKER = "latest_checkpointed_iteration.txt"
STAGING_SUFFIX = ".saving"
REPLACED_SUFFIX = ".replaced"
UNIVERSAL_SUFFIX = "_universal"
_TAG = re.compile(r"^global_step(\d+)$")


class CheckpointError(ZeroLabError, RuntimeError):
    """A checkpoint cannot be saved or resumed; the message names the file and what to do."""


def tag_name(iteration: int) -> str:
    return f"global_step{iteration}"


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, text: str) -> None:
    """`path` holds `text` or what it held before, never a part: a temporary name, fsync, rename."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_path(os.path.dirname(path) or ".")  # the rename itself is durable only once the folder is flushed


def read_latest(save_dir: str) -> str | None:
    path = os.path.join(save_dir, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path) as handle:
        return handle.read().strip() or None


def read_marker(folder: str) -> dict:
    with open(os.path.join(folder, MARKER)) as handle:
        return json.load(handle)


def listed_files(folder: str) -> dict[str, int]:
    """Every file under `folder` but the marker, by path relative to it, with its size."""
    files = {}
    for parent, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(parent, name)
            relative = os.path.relpath(path, folder)
            if relative != MARKER:
                files[relative] = os.path.getsize(path)
    return dict(sorted(files.items()))


def write_marker(folder: str, record: dict, checksums: dict[str, str] | None = None) -> None:
    """The completion marker: `record` plus every file of the folder with its size, and the CRC-32 of
    each file `checksums` has (computed as the files were written), written last."""
    files = listed_files(folder)
    manifest = {} if checksums is None else {CHECKSUMS: {name: checksums[name] for name in files if name in checksums}}
    write_atomic(os.path.join(folder, MARKER), json.dumps({**record, "files": files, **manifest}, indent=2))


def _unfinished_reason(folder: str) -> str | None:
    """Why `folder` is no finished save (no folder, or no marker: a save writes it last); None when it is one."""
    if not os.path.isdir(folder):
        return "its folder does not exist"
    if not os.path.isfile(os.path.join(folder, MARKER)):
        empty = [name for name in sorted(os.listdir(folder)) if os.path.isfile(os.path.join(folder, name))
                 and os.path.getsize(os.path.join(folder, name)) == 0]
        return f"{MARKER} is missing, so its save never finished" + (f" ({empty[0]} is 0 bytes)" if empty else "")
    return None


def incomplete_reason(folder: str) -> str | None:
    """Why the checkpoint in `folder` is not complete, naming the bad file; None when it is."""
    reason = _unfinished_reason(folder)
    if reason is not None:
        return reason
    try:
        files = read_marker(folder).get("files")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as err:
        return f"{MARKER} is unreadable ({err})"
    if files is None:
        return None  # written before markers listed the files: nothing to check against
    for name, size in files.items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return f"{name} is missing"
        if os.path.getsize(path) != size:
            return f"{name} is {os.path.getsize(path)} bytes, {size} when it was saved"
    return None


def checksum_reason(folder: str) -> str | None:
    """The first file of a complete checkpoint whose contents are not what was saved (read back whole),
    and its CRC-32 against the marker's; None when all match or the marker has no checksums."""
    for name, saved in sorted(read_marker(folder).get(CHECKSUMS, {}).items()):
        try:
            found = format_crc(file_crc32(os.path.join(folder, name)))
        except OSError as err:  # a disk's read error
            return f"{name} cannot be read ({err.strerror or err})"
        if found != saved:
            return f"{name} has CRC-32 {found}, {saved} when it was saved (its contents changed after the save)"
    return None


def damage_reason(folder: str, contents: bool = True) -> str | None:
    """Why the checkpoint in `folder` cannot be resumed as it was saved: incomplete, or (contents=True) a
    file whose CRC-32 is not the one saved; None when it is intact."""
    return incomplete_reason(folder) or (checksum_reason(folder) if contents else None)


def has_checksums(folder: str) -> bool:
    return CHECKSUMS in read_marker(folder)


def intact_tags(save_dir: str) -> list[str]:
    """The complete checkpoints under save_dir, newest first."""
    if not os.path.isdir(save_dir):
        return []
    steps = sorted((int(m.group(1)) for m in map(_TAG.match, os.listdir(save_dir)) if m), reverse=True)
    return [tag_name(step) for step in steps if incomplete_reason(os.path.join(save_dir, tag_name(step))) is None]


def _step(tag: str) -> int | None:
    match = _TAG.match(tag)
    return int(match.group(1)) if match else None


@dataclass
class ResumeChoice:
    """The checkpoint a resume takes, and the newer ones it skipped, each with why."""
    load_dir: str
    tag: str
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def skip_lines(self) -> list[str]:
        return [f"warning: --load {self.load_dir}: skipped checkpoint {tag}: {why}; resuming from {self.tag}"
                for tag, why in self.skipped]


def resume_tag(load_dir: str, contents: bool = True) -> ResumeChoice:
    """The one resume rule: the checkpoint `latest` names if it is intact, else the newest intact one
    before it (checked with damage_reason; contents=False: sizes only, without reading the files). A
    CheckpointError (one line) when there is no `latest`, when the save `latest` names never finished (a
    save never leaves that: `latest` was edited by hand), or when no checkpoint is intact."""
    tag = read_latest(load_dir)
    if not tag:
        raise CheckpointError(f"--load {load_dir} holds no checkpoint (no 'latest' file there)")
    reason = _unfinished_reason(os.path.join(load_dir, tag))
    if reason is not None:
        _raise_unfinished(load_dir, tag, reason)
    step = _step(tag)
    steps = sorted((s for s in map(_step, os.listdir(load_dir)) if s is not None), reverse=True)
    older = [tag_name(s) for s in steps if step is None or s < step]  # a newer tag is another run's
    skipped = []
    for candidate in [tag, *older]:
        why = damage_reason(os.path.join(load_dir, candidate), contents)
        if why is None:
            return ResumeChoice(load_dir, candidate, skipped)
        skipped.append((candidate, why))
    raise CheckpointError(f"--load {load_dir}: no intact checkpoint to resume: "
                          + "; ".join(f"{other}: {why}" for other, why in skipped))


def check_resumable(load_dir: str) -> str:
    """The tag a resume takes, its files' sizes checked (resume_tag without reading the files)."""
    return resume_tag(load_dir, contents=False).tag


def _raise_unfinished(load_dir: str, tag: str, reason: str):
    intact = [other for other in intact_tags(load_dir) if other != tag]
    hint = (f"the newest intact checkpoint is {intact[0]} (to resume from it: echo {intact[0]} > "
            f"{os.path.join(load_dir, LATEST)})" if intact else
            "no intact checkpoint is left there (a tools/hf_to_checkpoint.py folder is loaded with --finetune)")
    raise CheckpointError(f"--load {load_dir}: checkpoint {tag} named by 'latest' is incomplete: {reason}; {hint}")


def staging_tag(tag: str) -> str:
    """The folder name a save of `tag` is written under until it is complete."""
    return tag + STAGING_SUFFIX


def recover_interrupted_commit(save_dir: str) -> None:
    """Undo what a save killed between the two renames of a commit without exchange left behind."""
    if not os.path.isdir(save_dir):
        return
    for name in os.listdir(save_dir):
        if not name.endswith(REPLACED_SUFFIX):
            continue
        replaced, tag = os.path.join(save_dir, name), os.path.join(save_dir, name[:-len(REPLACED_SUFFIX)])
        if os.path.exists(tag):
            shutil.rmtree(replaced)  # the new checkpoint took the name: the old one is no longer needed
        else:
            os.rename(replaced, tag)  # killed between the renames: the old checkpoint takes its name back


def prepare_save(save_dir: str, tag: str) -> None:
    """Before a save (rank 0): no earlier save's leftovers stay, and the staging folder is empty."""
    os.makedirs(save_dir, exist_ok=True)
    recover_interrupted_commit(save_dir)
    for name in os.listdir(save_dir):
        if name.endswith(STAGING_SUFFIX):
            shutil.rmtree(os.path.join(save_dir, name))  # an interrupted save: never complete, never loaded


def _exchange(first: str, second: str) -> bool:
    """Swap two folders' names atomically (Linux renameat2 with RENAME_EXCHANGE); False where the
    filesystem or the C library cannot."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(first), at_fdcwd, os.fsencode(second), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), first)


def commit(save_dir: str, tag: str, record: dict, exchange: bool = True,
           checksums: dict[str, str] | None = None) -> None:
    """Make the complete save in `<tag>.saving` the checkpoint `tag` and point `latest` at it, then Megatron's
    tracker at its iteration (rank 0, after every rank has written and flushed its files; `checksums`: every
    rank's files' CRC-32, by path relative to the folder). exchange=False takes the two-rename path that
    filesystems without RENAME_EXCHANGE use."""
    staging, final = os.path.join(save_dir, staging_tag(tag)), os.path.join(save_dir, tag)
    write_marker(staging, record, checksums)
    if not os.path.exists(final):
        os.rename(staging, final)
    elif exchange and _exchange(staging, final):
        shutil.rmtree(staging)  # the staging name now holds the replaced checkpoint
    else:
        replaced = final + REPLACED_SUFFIX
        os.rename(final, replaced)
        os.rename(staging, final)
        shutil.rmtree(replaced)
    # a conversion of the replaced checkpoint (--universal-checkpoint) no longer describes this tag
    shutil.rmtree(final + UNIVERSAL_SUFFIX, ignore_errors=True)
    fsync_path(save_dir)
    write_atomic(os.path.join(save_dir, LATEST), tag)
    write_atomic(os.path.join(save_dir, TRACKER), str(record["iteration"]))
