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
import json
import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import psutil
import torch

REPO = Path(__file__).resolve().parent.parent


def machine_lines() -> list[str]:
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        memory = torch.cuda.get_device_properties(0).total_memory / 2**30
        gpus = f"{len(names)} x {names[0]} ({memory:.0f} GiB)"
    else:
        gpus = "none visible to torch"
    driver = "n/a"
    if shutil.which("nvidia-smi"):
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True).stdout.split("\n")[0]
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return [f"- GPUs: {gpus}, driver {driver or 'n/a'}",
            f"- CPU: {os.cpu_count()} x {cpu}, {psutil.virtual_memory().total / 2**30:.0f} GiB memory",
            f"- {platform.platform()}"]


def version_lines() -> list[str]:
    def version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    changed = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=normal"],
                             capture_output=True, text=True).stdout.strip()
    if changed:  # what ran is not that commit alone
        commit += f" with {len(changed.splitlines())} changed or new files not committed"
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return [f"- Python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}, "
            f"cuDNN {cudnn}), deepspeed {version('deepspeed')}, transformers {version('transformers')}",
            f"- zero-lab commit {commit}"]


def bench_lines(path: Path) -> list[str]:
    if not path.is_file():
        return [f"(no {path.name}: the bench did not finish)"]
    rows = json.loads(path.read_text())
    lines = ["| ZeRO stage | ours tokens/s | HF tokens/s | ours/HF | ours TFLOPs/GPU | ours MFU |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        mfu = "n/a" if row["ours_mfu"] is None else f"{100 * row['ours_mfu']:.1f}%"
        lines.append(f"| {row['stage']} | {row['ours_tokens_per_s']:.0f} | {row['hf_tokens_per_s']:.0f} | "
                     f"{row['ratio']:.2f}x | {row['ours_tflops_per_rank']:.1f} | {mfu} |")
    first = rows[0]
    lines.append("")
    lines.append(f"Attention: SDPA ran {', '.join(first['attention_kernels']) or 'no SDPA kernel'}.")
    if first["loss_peak_mib"]:
        lines.append("Output layer + loss, one micro-batch forward + backward, peak allocator memory: " +
                     ", ".join(f"{name} {mib:.0f} MiB" for name, mib in first["loss_peak_mib"].items()) + ".")
    return lines


def step_lines(plan: list[str], steps_file: Path) -> list[str]:
    """The quick profile's plan beside what each step took (steps.tsv, written as each step ended)."""
    took = {}
    if steps_file.is_file():
        for line in steps_file.read_text().splitlines():
            name, seconds = line.split("\t")
            took[name] = int(seconds)
    lines = ["| step | expected min | took min | what |", "| --- | ---: | ---: | --- |"]
    planned_total = 0.0
    for row in plan:
        name, minutes, what = row.split("\t")
        planned_total += 0.0 if minutes == "-" else float(minutes)
        spent = f"{took[name] / 60:.1f}" if name in took else "n/a"
        lines.append(f"| {name} | {minutes} | {spent} | {what} |")
    measured = sum(seconds for name, seconds in took.items() if name != "op_build")  # it ran beside the drivers
    lines.append(f"| in all | {planned_total:.1f} | {measured / 60:.1f} | the steps in line (the report's own "
                 f"last seconds not counted) |")
    return lines


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
