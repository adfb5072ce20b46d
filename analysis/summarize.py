"""Summarize ZeRO experiment runs: training logs in, comparison tables and plots out.

    python analysis/summarize.py runs/                 # every run folder under runs/
    python analysis/summarize.py runs/gpt_tiny_Z3_OL   # one run
    python analysis/summarize.py path/to/train.log --out /tmp/report
    python analysis/summarize.py runs/ --compare runs/reference/cpu-2rank   # beside the committed reference
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from analysis.collect import SummarizeError, collect
from analysis.compare import compare_markdown
from analysis.plots import make_plots, tradeoff_plot
from analysis.report import (csv_text, json_text, markdown_columns, markdown_table, notes,
                             report_markdown, terminal_notes, terminal_table, tradeoff_section, write_atomic)
from analysis.reference import read_reference

DEFAULT_SKIP_FIRST = 2

DESCRIPTION = """\
Turn the logs of Megatron-DeepSpeed / zero-lab training runs into a side-by-side comparison.

PATH is a runs folder (searched recursively: train.log in each run folder, else any *.log; the
attempt logs of one folder, ALCF's <run>/logs/, are one run), one run folder, or one log file. A
resumed run is one run of several attempts (the "[zero-lab] attempt N started" lines; those that logged
no training, refused at start-up or with nothing to train, are not counted, nor are their settings).
Per run it reads the iteration lines (consumed samples and
tokens, elapsed time per iteration, lm loss, tgs, TFLOPs), memory lines (zero-lab's
"memory at iteration" line, Megatron's report_memory, DeepSpeed's MemAllocated lines),
epoch-end, validation, ZeRO-estimate, comm (MB sent), time (ms per iteration by part) and progress
lines, and run-info lines; run metadata comes from that run info line, ds_config.json, command.txt,
env.json and Megatron's argument dump, else the folder name (gpt_tiny_Z3_OL, ALCF's
..._z1_seqlen1024_..._gb1_mb1). Timestamps, rank prefixes, ANSI colours
and interleaved ranks are tolerated. Each run gets a status: "diverged at iteration N" (the
training stopped on NaN/Inf losses, or they lasted to the last logged iteration), "stopped early
at iteration N" (--exit-interval or a signal), INCOMPLETE (a log cut off mid-line, or one that
neither logs its last iteration N/N nor prints "[after training is done]": still running or
killed; one still running shows its last progress line's percentage and ETA beside the status) or
"finished"; it is summarized as far as the log goes. Logs with no training lines are
listed as skipped.

Prints a compact table (a line per run: status, ZeRO stage, tokens/s, epoch time, memory peaks, last lm loss,
ms and MB per iteration measured/predicted) and writes the full one to OUT: summary.md, summary.csv,
summary.json (one row per run: status, attempts and NaN iterations, ZeRO stage, offload, model, ranks, SP (Ulysses),
batch sizes, sequence length, mean tokens/s per rank (tgs) and for all ranks,
ms/iteration, time per epoch, mean/max MemAllocated and peak MaxMemAllocated per rank in GB
(2**30 bytes), the ZeRO model-state estimate, host RSS, TFLOPs, MFU, HFU, first/last lm loss, the mean lm
loss per epoch, last validation loss, MB sent and ms per iteration measured and predicted, a running run's
progress and ETA, and for runs with experts the MoE layout (experts, EP, top-k), parameters total/active and the
moe loss, expert load max/mean and tokens dropped, each mean/last), PNG plots
(throughput, epoch time, accelerator (or CPU ranks' tensor) memory, host memory, loss vs consumed tokens, the ZeRO
trade-off: model-state memory against traffic) and report.md showing the table, a "ZeRO trade-off"
section (with each run's compute, communication and offload time, measured beside predicted) and
the plots.
--compare REFERENCE (a reference sweep's folder, runs/reference/cpu-2rank: analysis/reference.py) also writes
compare.md: per experiment, the reference's lm loss, traffic per iteration and model-state memory beside these
runs' and the difference (timings are left out: they depend on the machine).
Exit status: 0 when at least one run was summarized, 1 when none was (or PATH is missing, or REFERENCE
holds no reference), 2 for bad command-line flags.
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path, help="runs folder, run folder, or log file")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default: PATH itself, or a log file's folder)")
    parser.add_argument("--skip-first", type=int, default=DEFAULT_SKIP_FIRST, metavar="N",
                        help="logged intervals left out of throughput/time means as warm-up: the first holds "
                             "one-time costs (op builds, allocator growth), the second often their tail "
                             f"(default: {DEFAULT_SKIP_FIRST}; at least one interval is always kept)")
    parser.add_argument("--no-plots", action="store_true", help="write the tables only")
    parser.add_argument("--compare", type=Path, default=None, metavar="REFERENCE",
                        help="a reference sweep's folder (runs/reference/cpu-2rank): compare.md puts these runs' "
                             "loss, traffic and memory beside it")
    args = parser.parse_args(argv)
    if args.skip_first < 0:
        parser.error(f"--skip-first {args.skip_first}: expected a count >= 0")
    return args


def run(args: argparse.Namespace) -> int:
    reference = read_reference(args.compare) if args.compare else None
    found = collect(args.path, args.skip_first)
    for warning in found.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    for entry in found.skipped:
        print(f"skipped {entry}", file=sys.stderr)
    if not found.runs:
        hint = ""
        if (args.path / "reference.json").is_file():  # a reference sweep keeps its summary, not its logs
            hint = (f"; it is a reference sweep: compare runs with it by python analysis/summarize.py runs/ --compare "
                    f"{args.path}")
        raise SummarizeError(f"{args.path}: no training runs found (no log with iteration lines){hint}")
    out = args.out or (args.path.parent if args.path.is_file() else args.path)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(found.runs)
    note_text = notes(found.runs, found.skipped, args.skip_first)
    write_atomic(out / "summary.md", table + "\n" + note_text)
    write_atomic(out / "summary.csv", csv_text(found.runs))
    write_atomic(out / "summary.json", json_text(found.runs, found.skipped, args.skip_first))
    plots = [] if args.no_plots else make_plots(found.runs, out)
    tradeoff_png = None if args.no_plots else tradeoff_plot(found.runs, out)
    tradeoff = tradeoff_section(found.runs, tradeoff_png)
    write_atomic(out / "report.md", report_markdown(table, note_text, plots, tradeoff))
    pngs = [name for name, _ in plots] + ([tradeoff_png] if tradeoff_png else [])  # the count is of what was written
    print(terminal_table(found.runs))
    print(terminal_notes(note_text))
    print(f"wrote summary.md (the full table, {len(markdown_columns(found.runs))} columns), summary.csv, "
          f"summary.json, report.md and {len(pngs)} plots to {out}")
    if reference is not None:
        comparison = compare_markdown(reference, str(args.compare), found.runs, args.skip_first)
        write_atomic(out / "compare.md", comparison)
        print(comparison)
        print(f"wrote {out / 'compare.md'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except (SummarizeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
