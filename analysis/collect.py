"""Find the training logs under a path and summarize each run."""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from analysis.log_parser import parse_log
from analysis.run_metadata import collect_metadata
from analysis.run_summary import RunSummary, summarize_run
from megatron.errors import ZeroLabError


class SummarizeError(ZeroLabError):
    """A problem with the user's input path; the CLI prints it as one line."""


@dataclass
class Collection:
    runs: list[RunSummary] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # "<log>: why", for the report
    warnings: list[str] = field(default_factory=list)


LAUNCHER_REPORT = "launcher.log"  # megatron/launch/attempt.py's file of the launchers' own lines


def _attempt_logs(paths: list[Path]) -> bool:
    """Logs of one run written one file per attempt (ALCF's <run>/logs/): each begins with an attempt header."""
    def begins_with_header(path: Path) -> bool:
        with open(path, errors="replace") as handle:
            return handle.readline().startswith("[zero-lab] attempt ")
    return len(paths) > 1 and all(begins_with_header(p) for p in paths)


def find_logs(path: Path) -> list[list[Path]]:
    """The runs' logs, each run's as a list: a log file itself; under a folder every train.log (the drivers'
    log, every attempt appended), and *.log where no train.log sits (other .log files beside it are partial
    copies); the attempt logs of one folder (ALCF's <run>/logs/) together as one run."""
    if path.is_file():
        return [[path]]
    if not path.is_dir():
        raise SummarizeError(f"{path}: no such file or directory (expected a runs folder or a log file)")
    logs = []
    for folder, dirs, files in os.walk(path):
        dirs.sort()
        if "train.log" in files:
            logs.append([Path(folder) / "train.log"])
            continue
        found = [Path(folder) / name for name in sorted(files) if name.endswith(".log") and name != LAUNCHER_REPORT]
        logs.extend([found] if _attempt_logs(found) else [[log] for log in found])
    return logs


def _run_name(log: Path, folder: Path, root: Path, logs_in_folder: int) -> str:
    """The run's folder relative to the root; the log's own path is added only when the folder
    holds several logs (e.g. two ALCF attempts in <run>/<timestamp_host>/output.log)."""
    name = folder.relative_to(root).as_posix() if folder != root else root.name
    return name if logs_in_folder == 1 else f"{name}/{log.relative_to(folder).as_posix()}"


def _disambiguate(runs: list[RunSummary]) -> None:
    """Two Z1 runs of different models read Z1 125M / Z1 355M; otherwise the run name is added."""
    for attr in ("model", "run"):
        counts = Counter(r.label for r in runs)
        for run in runs:
            if counts[run.label] > 1 and getattr(run, attr):
                run.label = f"{run.label} {getattr(run, attr)}"


def collect(path: Path, skip_first: int) -> Collection:
    path = Path(path)
    logs = find_logs(path)
    root = path.parent if path.is_file() else path
    result = Collection()
    parsed = []
    for paths in logs:
        try:
            log = parse_log(*paths)
        except OSError as exc:
            result.skipped.append(f"{exc.filename or paths[-1]}: unreadable ({exc.strerror or exc})")
            continue
        if not log.has_training_lines:
            result.skipped.append(f"{', '.join(map(str, paths))}: no training lines")
            continue
        meta, folder, problems = collect_metadata(log, root)
        result.warnings += problems
        parsed.append((log, meta, folder))
    per_folder = Counter(folder for _, _, folder in parsed)
    for log, meta, folder in parsed:
        name = _run_name(log.path, folder, root, per_folder[folder])
        result.runs.append(summarize_run(log, meta, name, skip_first))
    _disambiguate(result.runs)
    return result
