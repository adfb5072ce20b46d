"""Write run summaries as summary.md / summary.csv / summary.json and the report.md page."""
from __future__ import annotations

import csv
import io
import json
import os
import textwrap
from dataclasses import asdict, fields
from pathlib import Path
from typing import Callable

from analysis.run_metadata import experts_text, has_layer_experts
from analysis.run_summary import RunSummary

# CSV/JSON carry every field at full precision; the curve goes to JSON and the plot only.
CSV_FIELDS = [f.name for f in fields(RunSummary) if f.name not in ("loss_curve", "moe_curve")]


def _num(digits: int) -> Callable[[float | None], str]:
    return lambda value: "" if value is None else f"{value:,.{digits}f}"


def _loss(value: float | None) -> str:
    return "" if value is None else f"{value:.4f}"


def _epoch_time(s: RunSummary) -> str:
    if s.epoch_time_s is None:
        return ""
    return ("~" if s.epoch_time_source == "estimated" else "") + f"{s.epoch_time_s:,.1f}"


def _batch(s: RunSummary) -> str:
    return f"{s.micro_batch or '?'}/{s.global_batch or '?'}"


def _duration(seconds: int | None) -> str:
    """The progress line's H:MM:SS; "unknown" for an ETA not yet known."""
    return "unknown" if seconds is None else f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _status(s: RunSummary) -> str:
    """The status; a run still running adds how far it got and its ETA (its last progress line)."""
    if s.progress_pct is None:
        return s.status
    return f"{s.status} ({s.progress_pct:.1f}%, ETA {_duration(s.eta_s)})"


def _iterations(s: RunSummary) -> str:
    return f"{s.last_iteration}/{s.train_iters}" if s.last_iteration is not None else ""


# (header, cell) for the markdown table; units in the header so cells stay numbers.
MARKDOWN_COLUMNS: list[tuple[str, Callable[[RunSummary], str]]] = [
    ("run", lambda s: s.label),
    ("status", _status),
    ("attempts", lambda s: str(s.attempts)),
    ("ZeRO", lambda s: "" if s.zero_stage is None else str(s.zero_stage)),
    ("offload", lambda s: s.offload or ""),
    ("model", lambda s: s.model or ""),
    ("ranks", lambda s: "" if s.world_size is None else str(s.world_size)),
    ("SP", lambda s: "" if s.sequence_parallel is None else str(s.sequence_parallel)),  # Ulysses
    ("micro/global batch", _batch),
    ("seq", lambda s: "" if s.seq_length is None else str(s.seq_length)),
    ("iters", _iterations),
    ("NaN iters", lambda s: "" if s.nan_iterations is None else str(s.nan_iterations)),
    ("tgs (tok/s/rank)", lambda s: _num(1)(s.tgs_mean)),
    ("tokens/s (all ranks)", lambda s: _num(1)(s.tokens_per_s)),
    ("ms/iter", lambda s: _num(1)(s.ms_per_iter_mean)),
    ("epoch time (s)", _epoch_time),
    ("MemAllocated mean/max (GB)", lambda s: "/".join(
        _num(2)(v) for v in (s.mem_alloc_mean_gb, s.mem_alloc_max_gb)) if s.mem_alloc_mean_gb is not None else ""),
    ("MaxMemAllocated peak (GB)", lambda s: _num(2)(s.max_mem_alloc_peak_gb)),
    ("sent MB/iter measured/predicted", lambda s: "/".join(
        _num(2)(v) for v in (s.traffic_mb, s.traffic_predicted_mb)) if s.traffic_mb is not None else ""),
    ("ms/iter measured/predicted", lambda s: "/".join(
        _num(1)(v) for v in (s.time_total_ms, s.time_total_predicted_ms)) if s.time_total_ms is not None else ""),
    ("model states measured/ZeRO estimate (GB)", lambda s: "/".join(
        _num(4)(v) for v in (s.model_state_measured_gb, s.zero_estimate_gb)) if s.zero_estimate_gb is not None else ""),
    ("host RSS mean/peak (GB)", lambda s: "/".join(
        _num(2)(v) for v in (s.host_rss_mean_gb, s.host_rss_peak_gb)) if s.host_rss_peak_gb is not None else ""),
    ("TFLOPs", lambda s: _num(2)(s.tflops_mean)),
    ("MFU (%)", lambda s: _num(1)(s.mfu_mean_pct)),
    ("HFU (%)", lambda s: _num(1)(s.hfu_mean_pct)),
    ("lm loss first→last", lambda s: f"{_loss(s.loss_first)}→{_loss(s.loss_last)}" if s.loss_last is not None else ""),
    ("mean lm loss per epoch", lambda s: ", ".join(_loss(v) for v in s.epoch_losses)),
    ("val loss", lambda s: _loss(s.val_loss_last)),
]


def _mean_last(mean: float | None, last: float | None, digits: int) -> str:
    return "" if last is None else f"{_num(digits)(mean)}/{_num(digits)(last)}"


def has_experts(s: RunSummary) -> bool:
    """An MoE run: its run info line names experts, or its iteration lines carry the MoE fields."""
    return has_layer_experts(s) or s.moe_loss_last is not None


# The full table's MoE columns, after the others, when any run has experts (a dense sweep's table is as before):
# the layout, the parameters line's counts, and the iteration line's MoE fields over the run. A dense run's
# cells are empty but for its parameters, the same count twice, which compares it with MoE runs of its
# active size.
MOE_COLUMNS: list[tuple[str, Callable[[RunSummary], str]]] = [
    ("experts", experts_text),
    ("EP", lambda s: "" if s.expert_parallel is None else str(s.expert_parallel)),
    ("top-k", lambda s: "" if s.topk is None else str(s.topk)),
    ("params total/active", lambda s: "" if s.params_total is None else f"{s.params_total:,}/{s.params_active:,}"),
    ("moe loss mean/last", lambda s: _mean_last(s.moe_loss_mean, s.moe_loss_last, 4)),
    ("expert load (max/mean) mean/last", lambda s: _mean_last(s.expert_load_mean, s.expert_load_last, 3)),
    ("tokens dropped mean/last", lambda s: _mean_last(s.tokens_dropped_mean, s.tokens_dropped_last, 4)),
]


def markdown_columns(summaries: list[RunSummary]) -> list[tuple[str, Callable[[RunSummary], str]]]:
    return MARKDOWN_COLUMNS + (MOE_COLUMNS if any(map(has_experts, summaries)) else [])


def _stage(s: RunSummary) -> str:
    if s.zero_stage is None:
        return ""
    return str(s.zero_stage) + {None: "", "none": "", "nvme": "+NVMe"}.get(s.offload, "+offload")


def _measured_of_predicted(measured: float | None, predicted: float | None, digits: int) -> str:
    """"506.4/510.6"; "442.5/-" for a log without the prediction (upstream's, older runs)."""
    if measured is None:
        return ""
    return f"{_num(digits)(measured)}/{'-' if predicted is None else _num(digits)(predicted)}"


# The terminal's table, a line per run that fits a terminal: what runs are compared by at a glance. The files
# (summary.md/.csv/.json, report.md) keep every column.
TERMINAL_COLUMNS: list[tuple[str, Callable[[RunSummary], str]]] = [
    ("run", lambda s: s.label),
    ("status", _status),
    ("ZeRO", _stage),
    ("tokens/s", lambda s: _num(1)(s.tokens_per_s)),
    ("epoch (s)", _epoch_time),
    ("accel. peak GB", lambda s: _num(2)(s.max_mem_alloc_peak_gb)),  # MaxMemAllocated
    ("host RSS peak GB", lambda s: _num(2)(s.host_rss_peak_gb)),
    ("lm loss", lambda s: _loss(s.loss_last)),  # the last logged
    ("ms/iter meas/pred", lambda s: _measured_of_predicted(s.ms_per_iter_mean, s.time_total_predicted_ms, 1)),
    ("MB/iter meas/pred", lambda s: _measured_of_predicted(s.traffic_mb, s.traffic_predicted_mb, 2)),
]
TEXT_COLUMNS = {"run", "status"}  # left-aligned; numbers right-aligned


def terminal_table(summaries: list[RunSummary]) -> str:
    rows = [[header for header, _ in TERMINAL_COLUMNS]]
    rows += [[cell(s) for _, cell in TERMINAL_COLUMNS] for s in summaries]
    widths = [max(len(row[i]) for row in rows) for i in range(len(TERMINAL_COLUMNS))]
    lines = ["  ".join(value.ljust(width) if header in TEXT_COLUMNS else value.rjust(width)
                       for (header, _), value, width in zip(TERMINAL_COLUMNS, row, widths)).rstrip()
             for row in rows]
    return "\n".join(lines) + "\n"


def terminal_notes(note_text: str, width: int = 120) -> str:
    """The notes under the table, wrapped for a terminal (the files keep a line per note)."""
    return "\n".join(textwrap.fill(line, width, subsequent_indent="  " if line.startswith("- ") else "")
                     for line in note_text.splitlines()) + "\n"


def markdown_table(summaries: list[RunSummary]) -> str:
    def row(cells):
        return "| " + " | ".join(c.replace("|", "/") for c in cells) + " |"

    columns = markdown_columns(summaries)
    lines = [row(h for h, _ in columns), row("---" for _ in columns)]
    lines += [row(cell(s) for _, cell in columns) for s in summaries]
    return "\n".join(lines) + "\n"


def _epochs(numbers: list[int]) -> str:
    return ("epoch " if len(numbers) == 1 else "epochs ") + ", ".join(map(str, numbers))


def notes(summaries: list[RunSummary], skipped: list[str], skip_first: int) -> str:
    lines = [
        "Throughput, both ms/iter columns, TFLOPs, MFU, HFU and MB sent are means over logged intervals after "
        f"the first {skip_first} of each attempt (warm-up; a resumed run is one run of several attempts, every "
        "iteration counted once); "
        "memory and loss use every logged step. Memory is per rank, GB = 2**30 bytes. "
        "`~` marks an epoch time estimated from iteration time (the run did not finish an epoch).",
    ]
    if any(map(has_experts, summaries)):
        lines[0] += (" The MoE columns' mean is over the same intervals (weighted by iterations), beside the last "
                     "logged value; expert load is the busiest expert's tokens over the mean expert's, tokens dropped "
                     "the fraction of routes over capacity (docs/log-lines.md).")
    lines += [f"- {s.label}: {s.status} ({s.incomplete_reason}), summarized as far as the log goes{_progress(s)}"
              for s in summaries if not s.complete]
    lines += [f"- {s.label}: {_epochs(s.partial_epochs)} partial (logged only by an attempt that resumed inside "
              f"{'it' if len(s.partial_epochs) == 1 else 'them'}), left out of the epoch time"
              for s in summaries if s.partial_epochs]
    lines += [f"- skipped {entry}" for entry in skipped]
    return "\n".join(lines) + "\n"


def _progress(s: RunSummary) -> str:
    if s.progress_pct is None:
        return ""
    return (f"; its last progress line, at iteration {s.progress_iteration}: {s.progress_pct:.1f}% done, "
            f"{_duration(s.progress_elapsed_s)} since its launch started, ETA {_duration(s.eta_s)} (if still running)")


def _csv_value(value) -> str:
    if value is None:
        return ""
    if isinstance(value, list):
        return ";".join(repr(v) for v in value)
    return repr(value) if isinstance(value, float) else str(value)


def csv_text(summaries: list[RunSummary]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(CSV_FIELDS)
    for s in summaries:
        writer.writerow(_csv_value(getattr(s, name)) for name in CSV_FIELDS)
    return buffer.getvalue()


def json_text(summaries: list[RunSummary], skipped: list[str], skip_first: int) -> str:
    return json.dumps({"skip_first": skip_first, "runs": [asdict(s) for s in summaries],
                       "skipped": skipped}, indent=2) + "\n"


def write_atomic(path: Path, text: str) -> None:
    """Write next to the target and rename, so a crash never leaves a half table that looks whole."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _ratio(value: float | None, base: float | None) -> str:
    return f"{value / base:.2f}x" if value is not None and base else ""


def _pair(measured: float | None, predicted: float | None, digits: int) -> str:
    return "" if measured is None and predicted is None else f"{_num(digits)(measured)}/{_num(digits)(predicted)}"


def _memory_and_traffic(summaries: list[RunSummary], plot: str | None) -> list[str]:
    """Memory per rank against traffic per step for the runs that logged both, measured beside predicted,
    each relative to the lowest ZeRO stage among them (docs/zero-tradeoff.md); [] when none did."""
    runs = [s for s in summaries if s.traffic_mb is not None and s.model_state_measured_gb is not None]
    if not runs:
        return []
    base = min(runs, key=lambda s: (s.zero_stage if s.zero_stage is not None else 9, s.offload != "none"))
    lines = ["What each rank holds in model states (params, grads, optimizer states) against what it sends per "
             "iteration, measured by the run beside megatron/accounting/predict/'s prediction "
             f"(docs/zero-tradeoff.md); ratios are to {base.label}'s measurements. Offloaded states (host memory, "
             "or this rank's NVMe files) are apart from the model states; on CPU ranks host memory is the "
             "accelerator's, so they are told apart by where DeepSpeed keeps them. Activations are what one "
             "micro-batch's forward keeps for the backward. With one micro-batch per step stages 0-2 send the same "
             "and stage 3 1.5x; with gradient accumulation stages 2 and 3 communicate at every micro-batch.\n",
             "| run | micro/global batch | model states measured/predicted (GB) | offloaded measured/predicted (GB) | "
             "activations measured/predicted (GB) | sent per iteration measured/predicted (MB) | bytes sent/param | "
             f"model states vs {base.label} | traffic vs {base.label} |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for s in runs:
        lines.append(f"| {s.label} | {_batch(s)} | {_pair(s.model_state_measured_gb, s.zero_estimate_gb, 4)} | "
                     f"{_pair(s.offloaded_gb, s.offloaded_estimate_gb, 4)} | "
                     f"{_pair(s.activations_gb, s.activations_estimate_gb, 4)} | "
                     f"{_pair(s.traffic_mb, s.traffic_predicted_mb, 2)} | {_num(2)(s.traffic_bytes_per_param)} | "
                     f"{_ratio(s.model_state_measured_gb, base.model_state_measured_gb)} | "
                     f"{_ratio(s.traffic_mb, base.traffic_mb)} |")
    if plot:
        lines.append(f"\n![Memory per rank against traffic per iteration]({plot})")
    return lines


def _time_split(summaries: list[RunSummary]) -> list[str]:
    """Each run's ms per iteration split into compute, communication and offload, measured beside predicted,
    for the runs that logged time lines; [] when none did."""
    runs = [s for s in summaries if s.time_total_ms is not None]
    if not runs:
        return []
    lines = ["\n### Time per iteration: compute, communication, offload\n",
             "Milliseconds per iteration over the same steady-state intervals as ms/iter, measured by the run "
             "(`communication`: blocked in collectives; `offload`: the offloaded optimizer's step; `compute`: the "
             "rest) beside megatron/accounting/predict/step_time.py's prediction, whose `overlap` is the "
             "communication it expects hidden behind compute (total = compute + communication + offload - "
             "overlap; docs/log-lines.md, the time line).\n",
             "| run | compute measured/predicted (ms) | communication measured/predicted (ms) | "
             "offload measured/predicted (ms) | overlap predicted (ms) | total measured/predicted (ms) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for s in runs:
        lines.append(f"| {s.label} | {_pair(s.time_compute_ms, s.time_compute_predicted_ms, 1)} | "
                     f"{_pair(s.time_communication_ms, s.time_communication_predicted_ms, 1)} | "
                     f"{_pair(s.time_offload_ms, s.time_offload_predicted_ms, 1)} | "
                     f"{_num(1)(s.time_overlap_predicted_ms)} | "
                     f"{_pair(s.time_total_ms, s.time_total_predicted_ms, 1)} |")
    return lines


def tradeoff_section(summaries: list[RunSummary], plot: str | None) -> str:
    """report.md's "ZeRO trade-off": memory against traffic, then time per iteration by part, each measured
    beside predicted for the runs that logged them; "" when no run logged either."""
    parts = _memory_and_traffic(summaries, plot) + _time_split(summaries)
    return "\n".join(["## ZeRO trade-off\n"] + parts) + "\n" if parts else ""


def report_markdown(table: str, note_text: str, plots: list[tuple[str, str]], tradeoff: str = "") -> str:
    parts = ["# ZeRO experiment summary\n", table, note_text] + ([tradeoff] if tradeoff else [])
    parts += [f"## {caption}\n\n![{caption}]({filename})\n" for filename, caption in plots]
    return "\n".join(parts)
