"""The results page of bench/gpu_suite.sh: machine, versions, settings, the summary of the driver
runs and the GPT-vs-HF tables, in one Markdown file (written under a temporary name, then renamed).
Beside it, <name>-summary.csv and <name>-summary.json: copies of the runs' summary.

    python bench/gpu_suite_report.py --runs runs/gpu_suite --out bench/results/<gpu>.md --iters 60 \
        --log-interval 10 --models "125M 355M" --micro-batch 8 [--quick --plan ROW ...] [--failed STEP ...]

With --quick (bench/gpu_suite.sh --quick), the page also holds the plan beside what each step took: --plan
rows are "NAME<tab>MINUTES<tab>WHAT" (MINUTES "-" for a background step), RUNS/steps.tsv "NAME<tab>SECONDS".
"""
import argparse
import datetime
import shutil
import sys
from pathlib import Path

from common import REPO, bench_lines, machine_lines, step_lines, version_lines



def main(argv) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--iters", type=int, required=True)
    parser.add_argument("--models", required=True, help="the MODEL_SIZEs the drivers ran, space-separated")
    parser.add_argument("--micro-batch", type=int, required=True)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="the quick profile (bench/gpu_suite.sh --quick)")
    parser.add_argument("--plan", nargs="*", default=[], help="the quick profile's plan rows")
    parser.add_argument("--failed", nargs="*", default=[])
    opts = parser.parse_args(argv)

    summary = opts.runs / "summary.md"
    command = "bash bench/gpu_suite.sh" + (" --quick" if opts.quick else "")
    text = [f"# GPU acceptance run: {opts.out.stem}", "",
            f"`{command}`, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC.", "",
            "## Machine", "", *machine_lines(), "", "## Versions", "", *version_lines(), ""]
    if opts.quick:
        text += ["## Steps: planned and taken", "", *step_lines(opts.plan, opts.runs / "steps.tsv"), ""]
    text += ["## ZeRO drivers", "",
            f"GPT-2 {' and '.join(opts.models.split())}, seq 1024, bf16, micro-batch {opts.micro_batch}, "
            f"{opts.iters} iterations per driver "
            f"(log interval {opts.log_interval}; the summary's means leave out the first two intervals as warm-up). "
            f"Runs and plots: `{opts.runs.relative_to(REPO) if opts.runs.is_relative_to(REPO) else opts.runs}`.", "",
            summary.read_text().strip() if summary.is_file() else "(no summary.md: the summary did not run)", "",
            f"## Ours vs Hugging Face GPT-2 (bench/bench_gpt_vs_hf.py, GPT-2 125M shape, bf16, "
            f"micro-batch {opts.micro_batch})", "",
            "Without --compile:", "", *bench_lines(opts.runs / "bench_gpt_vs_hf.json"), "",
            *([] if opts.quick else ["With --compile (stage 1 only):", "",
                                     *bench_lines(opts.runs / "bench_gpt_vs_hf_compile.json"), ""])]
    if opts.failed:
        text += ["## Failed steps", "", *(f"- `{step}`" for step in opts.failed), ""]
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    for suffix in ("csv", "json"):
        source = opts.runs / f"summary.{suffix}"
        if source.is_file():
            shutil.copyfile(source, opts.out.with_name(f"{opts.out.stem}-summary.{suffix}"))
    partial = opts.out.with_name(opts.out.name + ".partial")
    partial.write_text("\n".join(text))
    partial.replace(opts.out)
    print(f"[gpu_suite] wrote {opts.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
