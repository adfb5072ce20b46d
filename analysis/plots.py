"""PNG plots of run summaries (headless: matplotlib's Agg backend)."""
from __future__ import annotations

import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
from matplotlib.ticker import EngFormatter  # noqa: E402

from analysis.run_summary import RunSummary  # noqa: E402


def _save(fig, path: Path) -> None:
    # Same temp-then-rename rule as the tables; the suffix keeps matplotlib's format detection.
    tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}.png")
    fig.savefig(tmp, dpi=120, bbox_inches="tight")
    plt.close(fig)
    os.replace(tmp, path)


def _value_label(value: float | None) -> str:
    if value is None:
        return ""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def _tick_label(run: RunSummary, attr: str) -> str:
    notes = [] if run.complete else ["diverged" if run.status.startswith("diverged") else "incomplete"]
    if attr == "epoch_time_s" and run.epoch_time_source == "estimated":
        notes.append("estimated")
    return run.label + (f"\n({', '.join(notes)})" if notes else "")


def _bar_chart(runs: list[RunSummary], series: list[tuple[str, str]], title: str,
               ylabel: str, path: Path) -> None:
    """Grouped bars: one group per run, one bar per series, values written on the bars."""
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(runs) * max(1, len(series)) ** 0.5), 4.5))
    width = 0.8 / len(series)
    for i, (name, attr) in enumerate(series):
        values = [getattr(r, attr) for r in runs]
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(runs))]
        heights = [v if v is not None else 0.0 for v in values]
        bars = ax.bar(xs, heights, width, label=name)
        ax.bar_label(bars, labels=[_value_label(v) for v in values], fontsize=8, padding=2)
    ax.set_xticks(range(len(runs)), [_tick_label(r, series[0][1]) for r in runs])
    ax.set_xlim(-0.75, len(runs) - 0.25)  # a lone run gets a bar, not the whole width
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.set_xlabel("run")
    ax.margins(y=0.15)
    if len(series) > 1:
        ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    _save(fig, path)


def _loss_plot(runs: list[RunSummary], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for run in runs:
        tokens, losses = zip(*run.loss_curve)
        ax.plot(tokens, losses, marker="o", markersize=3, label=run.label)
    ax.set_title("Training loss (lm loss) vs consumed tokens")
    ax.set_xlabel("consumed tokens")
    ax.xaxis.set_major_formatter(EngFormatter())  # 400k, 1.2M rather than an offset exponent
    ax.set_ylabel("lm loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)


def tradeoff_plot(runs: list[RunSummary], out_dir: Path) -> str | None:
    """Model-state memory per rank against bytes sent per iteration, one point per run: measured
    filled, predicted hollow, joined by a line. Returns the file name, or None without data."""
    shown = [r for r in runs if r.traffic_mb is not None and r.model_state_measured_gb is not None]
    if not shown:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 5.0))
    for i, run in enumerate(shown):
        colour = f"C{i % 10}"
        ax.scatter([run.traffic_mb], [run.model_state_measured_gb], color=colour, s=50, zorder=3, label=run.label)
        if run.traffic_predicted_mb is not None and run.zero_estimate_gb is not None:
            ax.scatter([run.traffic_predicted_mb], [run.zero_estimate_gb], facecolors="none", edgecolors=colour,
                       s=110, zorder=2)
            ax.plot([run.traffic_mb, run.traffic_predicted_mb], [run.model_state_measured_gb, run.zero_estimate_gb],
                    color=colour, alpha=0.5, linewidth=1)
        ax.annotate(run.label, (run.traffic_mb, run.model_state_measured_gb), textcoords="offset points",
                    xytext=(6, 6 if i % 2 == 0 else -12), fontsize=8)  # alternate: equal points stay legible
    ax.set_title("ZeRO trade-off: model-state memory per rank vs traffic per iteration\n"
                 "(filled: measured, hollow: predicted)")
    ax.set_xlabel("MB sent per rank per iteration (2^20 bytes)")
    ax.set_ylabel("model states on the rank (GB, 2^30 bytes; offloaded apart)")
    right = max(max(r.traffic_mb, r.traffic_predicted_mb or 0.0) for r in shown)
    ax.set_xlim(0, 1.15 * right)  # room for the labels of the rightmost points
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, out_dir / "zero_tradeoff.png")
    return "zero_tradeoff.png"


def _with(runs: list[RunSummary], *attrs: str) -> list[RunSummary]:
    return [r for r in runs if any(getattr(r, a) is not None for a in attrs)]


def make_plots(runs: list[RunSummary], out_dir: Path) -> list[tuple[str, str]]:
    """Write the plots that have data; return (file name, caption) for each written."""
    written = []

    def bars(filename, caption, ylabel, series_spec):
        shown = _with(runs, *(attr for _, attr in series_spec))
        if shown:
            _bar_chart(shown, series_spec, caption, ylabel, out_dir / filename)
            written.append((filename, caption))

    bars("throughput.png", "Training throughput, all ranks together (warm-up excluded)", "tokens/s",
         [("tokens/s", "tokens_per_s")])
    bars("epoch_time.png", "Average training time per epoch", "seconds per epoch",
         [("time per epoch", "epoch_time_s")])
    bars("accelerator_memory.png", "Accelerator memory per rank", "GB (2^30 bytes) per rank",
         [("MemAllocated mean", "mem_alloc_mean_gb"), ("MaxMemAllocated peak", "max_mem_alloc_peak_gb"),
          ("ZeRO model-state estimate", "zero_estimate_gb")])
    bars("host_memory.png", "Host memory (RSS) per rank during training", "GB (2^30 bytes) per rank",
         [("HostRSS mean", "host_rss_mean_gb"), ("HostRSS peak", "host_rss_peak_gb")])
    with_curve = [r for r in runs if r.loss_curve]
    if with_curve:
        _loss_plot(with_curve, out_dir / "loss.png")
        written.append(("loss.png", "Training loss vs consumed tokens"))
    return written
