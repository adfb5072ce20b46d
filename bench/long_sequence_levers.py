"""bench_long_sequences.py --levers: the longest sequence at SP = --ranks within --cap-mb per rank, one column per
combination of the memory levers past Ulysses (none, recomputation, the tiled MLP and loss, --checkpoint-in-cpu),
each run at its longest length, measured beside predicted, at the tiny shape with --layers layers (default 2).

The cap holds memory_per_rank's total (the accelerator's peak: the backward's one recomputed layer, its input
copied back, one MLP tile and the backward's gradients included; --checkpoint-in-cpu's host tier beside it, not
counted). Each row measures that peak: the model-state line's measured params + grads + optim plus its step_peak
(on CPU ranks the live bytes the first micro-batch's forward and backward held beyond the model states at their
peak, megatron/accounting/measure/memory.py's step_peak_bytes), beside the cap's figure, and its error. It also
keeps the forward-kept sum as the SP table takes it (params + grads + optim + activations + other, after the first
step, against the estimate's total + activations + output_buffer). The no-lever column runs in the same invocation,
so a deeper shape gets its own measured baseline.

    python bench/bench_long_sequences.py --levers --iters 4 --json long_sequences_levers.json
    python bench/bench_long_sequences.py --levers --layers 8 --iters 4
"""
from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType

from common import BenchError, OtherWork, end_of_bench

# `bench` below is bench_long_sequences.py, which hands itself in: this file runs its columns through that file's
# run and summarize, and a bench imports no other bench (tests/test_import_structure.py)
GB, MiB = 2**30, 2**20


@dataclass
class LeverRow:
    """One lever column: its longest sequence by prediction, and the run at it (None if it failed)."""
    levers: str
    seq_length: int
    predicted_peak_mb: float  # memory_per_rank's total, which the cap holds
    one_step_longer_mb: float
    predicted_host_mb: float  # --checkpoint-in-cpu's host tier, not counted against the cap
    run: object | None = None  # bench_long_sequences.Row
    host_mb: float | None = None  # the model-state line's measured activations_offloaded

    def ratio(self, baseline: int) -> float:
        return self.seq_length / baseline if baseline else 0.0

    @property
    def peak_mb(self) -> float | None:
        """The measured peak the cap stands for: the model states plus the step's peak beyond them."""
        if self.run is None or self.run.step_peak_mb is None:
            return None
        return self.run.model_states_mb + self.run.step_peak_mb

    @property
    def peak_error_pct(self) -> float | None:
        peak = self.peak_mb
        return None if not peak else 100.0 * (self.predicted_peak_mb - peak) / peak


def plan(bench: ModuleType, ranks: int, cap_mb: float, columns: tuple | None = None,
         layers: int | None = None) -> list[LeverRow]:
    """Each column's longest sequence at SP = ranks within cap_mb by prediction, before any run; `layers`: the
    tiny shape's layer count (None: the bench's default)."""
    rows, layers = [], layers or bench.SHAPE["num_layers"]
    for levers in columns or bench.LEVER_COLUMNS:
        longest = bench.longest_fitting(ranks, ranks, cap_mb, levers, layers)
        memory = bench.predicted_memory_mb(ranks, ranks, longest, levers, layers)
        rows.append(LeverRow(levers.name, longest, memory["total"],
                             bench.predicted_memory_mb(ranks, ranks, longest + bench.STEP, levers, layers)["total"],
                             memory["activations_offloaded"]))
    return rows


def run_column(bench: ModuleType, data: Path, runs_dir: Path, opts, levers, row: LeverRow) -> str | None:
    """Runs `row`'s longest length with `levers`; the failure's words, or None."""
    started, other = time.monotonic(), OtherWork().start()
    name = levers.name.replace(' ', '').replace('+', '_')
    output = runs_dir / f"sp{opts.ranks}_l{opts.layers}_seq{row.seq_length}_{name}.log"
    try:
        bench.run(data, opts.ranks, opts.ranks, row.seq_length, opts.iters, output, opts.timeout, levers, opts.layers)
        row.run = bench.summarize(output, opts.ranks, opts.ranks, row.seq_length, True)
    except BenchError as error:
        print(f"[bench] {levers.name} seq {row.seq_length}: failed: {error}", file=sys.stderr, flush=True)
        return f"{levers.name} seq {row.seq_length}: {error}"
    row.run.others_cores = other.cores()
    row.host_mb = _measured_host_mb(output)
    print(f"[bench] {levers.name} seq {row.seq_length}: {time.monotonic() - started:.0f} s", file=sys.stderr,
          flush=True)
    return None


def _measured_host_mb(output: Path) -> float:
    from analysis.log_parser import parse_log

    return parse_log(output).model_state.measured.get("activations_offloaded", 0.0) * GB / MiB


def table(rows: list[LeverRow], baseline: int, cap_mb: float) -> str:
    lines = [f"| levers | longest within {cap_mb:g} MiB (predicted) | x {baseline} | peak MiB meas / pred (the cap's) "
             "| error | +128 tokens MiB | forward-kept MiB meas / pred | error | host tier MiB meas / pred "
             "| tokens/s per rank meas / pred | step ms meas / pred | time error | others' CPU |",
             "| --- |" + " ---: |" * 12]
    for x in rows:
        host = "-" if not x.predicted_host_mb else f"{x.host_mb or 0:.1f} / {x.predicted_host_mb:.1f}"
        peak = "-" if x.peak_mb is None else f"{x.peak_mb:.1f}"
        error = "-" if x.peak_error_pct is None else f"{x.peak_error_pct:+.1f}%"
        plan_cells = f"| {x.levers} | {x.seq_length} | {x.ratio(baseline):.2f}x |"
        r = x.run
        if r is None:
            lines.append(plan_cells + f" - / {x.predicted_peak_mb:.1f} | - | {x.one_step_longer_mb:.1f} | not run |"
                         + " |" * 6)
            continue
        others = "n/a" if r.others_cores is None else f"{r.others_cores:.2f} cores"
        lines.append(plan_cells + f" {peak} / {x.predicted_peak_mb:.1f} | {error} | {x.one_step_longer_mb:.1f} | "
                     f"{r.peak_mb:.1f} / {r.predicted_peak_mb:.1f} | {r.peak_error_pct:+.1f}% | {host} "
                     f"| {r.tokens_per_s:.0f} / {r.predicted_tokens_per_s:.0f} | {r.step_ms:.0f} / "
                     f"{r.predicted_step_ms:.0f} | {r.time_error_pct:+.0f}% | {others} |")
    return "\n".join(lines)


def lever_bench(opts, bench: ModuleType) -> int:
    names = opts.levers or [x.name for x in bench.LEVER_COLUMNS]
    columns = tuple(x for x in bench.LEVER_COLUMNS if x.name in names)
    baseline = bench.longest_fitting(opts.ranks, opts.ranks, opts.cap_mb, layers=opts.layers)
    rows, failures = plan(bench, opts.ranks, opts.cap_mb, columns, opts.layers), []
    with tempfile.TemporaryDirectory(prefix="bench_long_sequences.") as tmp:
        data, runs_dir, start, started = bench.start_runs(
            opts, tmp, f"; SP={opts.ranks} on {opts.ranks} ranks, {opts.layers} layers, no levers' longest "
                       f"{baseline}")
        for levers, row in zip(columns, rows):
            failure = run_column(bench, data, runs_dir, opts, levers, row)
            failures += [failure] if failure else []
        print(f"## {opts.ranks} CPU ranks, SP={opts.ranks}, ZeRO-1 fp32, tiny shape at {opts.layers} layers with "
              f"rotary positions, byte vocabulary, micro-batch 1, {opts.iters} iterations per run (the first of "
              f"{opts.iters // bench.LOG_INTERVAL} logging intervals left out)\n")
        print(table(rows, baseline, opts.cap_mb))
        for failure in failures:
            print(f"failed: {failure}")
        end_of_bench(started, start, opts.json, ranks=opts.ranks, cap_mb=opts.cap_mb, iters=opts.iters,
                     layers=opts.layers, baseline_seq_length=baseline, failures=failures,
                     levers=[{**asdict(x), "ratio": x.ratio(baseline), "peak_mb": x.peak_mb,
                              "peak_error_pct": x.peak_error_pct} for x in rows])
    return 1 if failures else 0
