"""How long a launch script's dry run takes: this checkout beside an older one, measured in one run.

    python bench/bench_dry_run.py [--base COMMIT] [--rounds N] [--out FILE]

Runs every golden launch case (tests/golden/launch_cases.py: drivers, ALCF, Slurm, refused settings) with
DRY_RUN=1, as tests/golden/record_launch.py does, from a worktree of COMMIT (default b03faa0, where the golden
files were recorded from the bash launch layer) and from this checkout, the two interleaved case by case so that
both see the same load; N rounds (default 1). Prints, per launch path, the mean seconds per dry run of each and the ratio, and
whether each case's command line still equals its golden file.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "golden"))
import record_launch  # noqa: E402  (the golden cases' runner)
from launch_cases import CASES  # noqa: E402

BEFORE_THE_PLANNER = "b03faa0"


def timed(case, checkout: Path) -> tuple[float, bool]:
    """(seconds, whether the command line equals the golden file) of one dry run of `checkout`'s script."""
    record_launch.SCRIPTS_ROOT = checkout
    golden, seconds = record_launch.run_case(case)
    recorded = (record_launch.LAUNCH_DIR / f"{case.name}.txt").read_text()
    return seconds, record_launch.render(case, golden) == recorded


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=BEFORE_THE_PLANNER, help="the older commit (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, help="also write the table here")
    ns = parser.parse_args(argv)
    times: dict[tuple[str, str], list[float]] = defaultdict(list)
    differing: dict[str, list[str]] = defaultdict(list)
    with tempfile.TemporaryDirectory(prefix="zl-dry-run-") as folder:
        base = Path(folder) / "base"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--quiet", str(base), ns.base],
                       check=True)
        try:
            for _ in range(ns.rounds):
                for case in CASES:
                    for label, checkout in ((ns.base, base), ("this checkout", REPO)):
                        seconds, same = timed(case, checkout)
                        times[label, case.path].append(seconds)
                        if not same and case.name not in differing[label]:
                            differing[label].append(case.name)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], check=False)
    lines = [f"| path | cases | {ns.base} s/dry run | this checkout s/dry run | faster |",
             "| --- | --- | --- | --- | --- |"]
    for path in ("driver", "alcf", "slurm", "all"):
        before = [t for (label, p), ts in times.items() if label == ns.base and path in (p, "all") for t in ts]
        now = [t for (label, p), ts in times.items() if label == "this checkout" and path in (p, "all") for t in ts]
        mean_before, mean_now = statistics.mean(before), statistics.mean(now)
        lines.append(f"| {path} | {len(now) // ns.rounds} | {mean_before:.3f} | {mean_now:.3f} | "
                     f"{mean_before / mean_now:.1f}x |")
    for label in (ns.base, "this checkout"):
        lines.append(f"\n{label}: {len(differing[label])} cases differ from their golden files"
                     + (f" ({', '.join(differing[label])})" if differing[label] else ""))
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if ns.out:
        ns.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
