"""A reference sweep's machine-independent figures, kept in reference.json beside its summary and plots.

    python analysis/reference.py RUNS --out runs/reference/cpu-2rank --command "bash examples_zero/run_all.sh"

writes OUT/reference.json from the runs under RUNS: per run its settings, the lm loss at every logged iteration
(keyed by consumed tokens), traffic per iteration measured and predicted, and the model-state memory measured
and estimated, with how the sweep was made (the command, the commit, python/torch/deepspeed from the runs'
env.json). Timings (ms/iter, tokens/s, TFLOPs) and the allocator's and host's memory are left out: they depend
on the machine and its load. `analysis/summarize.py RUNS --compare OUT` compares a sweep with it
(analysis/compare.py).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from analysis.collect import SummarizeError, collect
from analysis.report import write_atomic
from analysis.run_summary import RunSummary

REFERENCE_FILE = "reference.json"
FORMAT = "zero-lab reference sweep"
VERSION = 1
# what must agree for two runs' figures to compare; a difference is stated, not compared silently
SETTINGS = ("model", "world_size", "micro_batch", "global_batch", "seq_length")
TRAFFIC = ("traffic_mb", "traffic_predicted_mb", "traffic_bytes_per_param")
MEMORY = ("model_state_measured_gb", "zero_estimate_gb", "offloaded_gb", "offloaded_estimate_gb",
          "activations_gb", "activations_estimate_gb")


class ReferenceError(SummarizeError):
    """A --compare folder that holds no readable reference; the CLI prints it as one line."""


@dataclass
class RunFigures:
    """One run's figures that another machine reproduces: its experiment, settings, loss, traffic, memory."""
    label: str  # Z0..Z3, Z3+offload, Z3+NVMe (analysis/run_metadata.py)
    zero_stage: int | None
    offload: str | None
    settings: dict  # SETTINGS -> value
    status: str
    last_iteration: int | None
    train_iters: int | None
    loss: list  # [consumed tokens, lm loss] per logged iteration
    traffic: dict  # TRAFFIC -> value (MB per iteration over the steady-state intervals, bytes per parameter)
    memory: dict  # MEMORY -> value (GB per rank)

    @property
    def experiment(self) -> tuple:
        return self.zero_stage, self.offload


@dataclass
class Reference:
    made_by: dict  # command, commit, versions, skip_first
    runs: list[RunFigures]


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def run_figures(summary: RunSummary) -> RunFigures:
    """The figures at the precision the log lines print them (MB with 3 decimals, GB with 4), so that a mean of
    equal values over more intervals, or a sum of the parts, compares equal."""
    return RunFigures(
        label=summary.label, zero_stage=summary.zero_stage, offload=summary.offload,
        settings={name: getattr(summary, name) for name in SETTINGS},
        status=summary.status, last_iteration=summary.last_iteration, train_iters=summary.train_iters,
        loss=[[tokens, loss] for tokens, loss in summary.loss_curve],
        traffic={name: _rounded(getattr(summary, name), 3) for name in TRAFFIC},
        memory={name: _rounded(getattr(summary, name), 4) for name in MEMORY})


def _recorded(summaries: list[RunSummary], commit: str | None) -> dict:
    """The commit, python, torch, deepspeed and the accelerator as the runs' env.json recorded them
    (docs/layout.md); `commit` (--commit) wins, and this checkout's HEAD stands in where neither names one."""
    recorded: dict = {}
    for s in summaries:
        env = Path(s.log).parent / "env.json"
        if env.is_file():
            values = json.loads(env.read_text())
            for key in ("git_commit", "python", "torch", "deepspeed", "accelerator"):
                if recorded.get(key) is None:
                    recorded[key] = values.get(key)
    recorded_commit = recorded.pop("git_commit", None)
    return {"commit": commit or recorded_commit or _checkout_commit(), **recorded}


def _checkout_commit() -> str | None:
    repo = Path(__file__).resolve().parent.parent
    done = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def reference_json(reference: Reference) -> str:
    return json.dumps({"format": FORMAT, "version": VERSION, "made_by": reference.made_by,
                       "runs": [asdict(r) for r in reference.runs]}, indent=1) + "\n"


def read_reference(folder: Path) -> Reference:
    """The reference in `folder`; ReferenceError (one line) for a folder that holds none."""
    path = Path(folder) / REFERENCE_FILE
    if not Path(folder).is_dir():
        raise ReferenceError(f"--compare {folder}: no such folder (expected a reference sweep such as "
                             "runs/reference/cpu-2rank)")
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ReferenceError(f"--compare {folder}: not a reference sweep (no {REFERENCE_FILE}; expected a folder "
                             "such as runs/reference/cpu-2rank, made by analysis/reference.py)") from None
    except (OSError, ValueError) as exc:
        raise ReferenceError(f"--compare {folder}: {path} is unreadable ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
        raise ReferenceError(f"--compare {folder}: {path} is not a {FORMAT} of version {VERSION}")
    try:
        runs = [RunFigures(**run) for run in data["runs"]]
    except (KeyError, TypeError) as exc:
        raise ReferenceError(f"--compare {folder}: {path} has no runs as analysis/reference.py writes them "
                             f"({exc})") from None
    return Reference(made_by=data.get("made_by", {}), runs=runs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path, help="the sweep's runs folder")
    parser.add_argument("--out", type=Path, required=True, help="the reference folder (reference.json goes there)")
    parser.add_argument("--command", required=True, help="the command that made the sweep, as a user would type it")
    parser.add_argument("--commit", default=None,
                        help="the commit the sweep ran at (default: the runs' env.json, else this checkout's HEAD; "
                             "give it for a sweep run from an exported tree, whose env.json names none)")
    parser.add_argument("--skip-first", type=int, default=2, metavar="N",
                        help="warm-up intervals left out of the traffic means, as analysis/summarize.py's")
    args = parser.parse_args(argv)
    try:
        found = collect(args.runs, args.skip_first)
        if not found.runs:
            raise SummarizeError(f"{args.runs}: no training runs found (no log with iteration lines)")
        made_by = {"command": args.command, **_recorded(found.runs, args.commit),
                   "skip_first": args.skip_first}
        args.out.mkdir(parents=True, exist_ok=True)
        reference = Reference(made_by, [run_figures(s) for s in found.runs])
        write_atomic(args.out / REFERENCE_FILE, reference_json(reference))
    except (SummarizeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.out / REFERENCE_FILE}: {len(found.runs)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
