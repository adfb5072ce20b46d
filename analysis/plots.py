"""PNG plots of run summaries (headless: matplotlib's Agg backend).

Run names are the user's: a plot must stay readable with a dozen runs of long names, so each one measures
its labels once drawn (matplotlib's text extents) and turns or moves those that would overlap."""
from __future__ import annotations

import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
from matplotlib.ticker import EngFormatter  # noqa: E402

from analysis.run_summary import RunSummary  # noqa: E402

OUTSIDE_RIGHT = dict(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)  # legends: never over data


def _save(fig, path: Path) -> None:
    # Same temp-then-rename rule as the tables; the suffix keeps matplotlib's format detection.
    tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}.png")
    fig.savefig(tmp, dpi=120, bbox_inches="tight")
    plt.close(fig)
    os.replace(tmp, path)


def _renderer(fig):
    fig.canvas.draw()  # text extents are known only once drawn
    return fig.canvas.get_renderer()


def _overlap(a, b) -> bool:
    # Boxes that only touch (one shared antialiased pixel) do not count.
    return min(a.x1, b.x1) - max(a.x0, b.x0) > 1 and min(a.y1, b.y1) - max(a.y0, b.y0) > 1


def _crowded(texts, renderer) -> bool:
    boxes = [t.get_window_extent(renderer) for t in texts if t.get_text()]
    return any(_overlap(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:])


def _value_label(value: float | None) -> str:
    if value is None:
        return ""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def _tick_label(run: RunSummary, attr: str) -> str:
    notes = [] if run.complete else ["diverged" if run.status.startswith("diverged") else "incomplete"]
    if attr == "epoch_time_s" and run.epoch_time_source == "estimated":
        notes.append("estimated")
    return run.label + (f"\n({', '.join(notes)})" if notes else "")


def _fit_bar_labels(fig, ax, values) -> None:
    """Run names, then the values on the bars, turn upright when side by side they would overlap; the y axis
    then grows until every value sits inside the axes."""
    for texts in (ax.get_xticklabels(), values):
        if _crowded(texts, _renderer(fig)):
            plt.setp(texts, rotation=90)
    for _ in range(20):
        renderer = _renderer(fig)
        top = ax.get_window_extent(renderer).y1
        if all(t.get_window_extent(renderer).y1 < top for t in values if t.get_text()):
            return
        ax.set_ylim(top=ax.get_ylim()[1] * 1.1)


def _bar_chart(runs: list[RunSummary], series: list[tuple[str, str]], title: str,
               ylabel: str, path: Path, legend_title: str | None = None) -> None:
    """Grouped bars: one group per run, one bar per series, values written on the bars."""
    fig, ax = plt.subplots(figsize=(max(6.0, 1.0 + 0.3 * len(runs) * (len(series) + 0.5)), 4.5))
    width = 0.8 / len(series)
    values = []
    for i, (name, attr) in enumerate(series):
        numbers = [getattr(r, attr) for r in runs]
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(runs))]
        bars = ax.bar(xs, [v if v is not None else 0.0 for v in numbers], width, label=name)
        values += ax.bar_label(bars, labels=[_value_label(v) for v in numbers], fontsize=8, padding=2)
    ax.set_xticks(range(len(runs)), [_tick_label(r, series[0][1]) for r in runs])
    ax.set_xlim(-0.75, len(runs) - 0.25)  # a lone run gets a bar, not the whole width
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.set_xlabel("run")
    ax.margins(y=0.15)
    if len(series) > 1:
        ax.legend(fontsize=8, title=legend_title, title_fontsize=8, alignment="left", **OUTSIDE_RIGHT)
    ax.grid(axis="y", alpha=0.3)
    _fit_bar_labels(fig, ax, values)
    _save(fig, path)


def _legend_columns(entries: int) -> int:
    return 1 + (entries - 1) // 20  # at most 20 names a column: the legend stays within the figure's height


# 20 colours that do not repeat: tab10's, then tab20's lighter partner of each. The lines of runs 11-20 are also
# dashed (a light colour beside its dark partner stays told apart by more than its shade), 21-30 dash-dotted, ...
RUN_COLOURS = [plt.get_cmap("tab20")(i) for i in range(0, 20, 2)] + [plt.get_cmap("tab20")(i) for i in range(1, 20, 2)]
RUN_LINESTYLES = ["-", "--", "-.", ":"]
RUN_MARKERS = ["o", "s", "^", "D", "v"]


def run_style(index: int) -> dict:
    """A run's colour, line style and marker for the line plots: no two of the first 100 runs alike."""
    return dict(color=RUN_COLOURS[index % 20], linestyle=RUN_LINESTYLES[index // 10 % 4],
                marker=RUN_MARKERS[index // 20 % 5])


# One run this many times longer than the shortest (in tokens) would squeeze the short runs into the first few
# per cent of a linear axis (60 iterations beside 400: the first 15%); the axis is then logarithmic.
LOG_AXIS_SPAN = 4.0


def _loss_plot(runs: list[RunSummary], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for index, run in enumerate(runs):
        tokens, losses = zip(*run.loss_curve)
        ax.plot(tokens, losses, markersize=3, label=run.label, **run_style(index))
    ends = [max(tokens for tokens, _ in run.loss_curve) for run in runs]
    spread = min(ends) > 0 and max(ends) / min(ends) >= LOG_AXIS_SPAN
    ax.set_title("Training loss (lm loss) vs consumed tokens")
    ax.set_xlabel("consumed tokens" + (" (log scale: the runs' lengths differ)" if spread else ""))
    if spread:
        ax.set_xscale("log")
    ax.xaxis.set_major_formatter(EngFormatter())  # 400k, 1.2M rather than an offset exponent
    ax.set_ylabel("lm loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncols=_legend_columns(len(runs)), **OUTSIDE_RIGHT)
    _save(fig, path)


def _number_ranges(numbers: list[int]) -> str:
    """[1, 2, 3, 5] -> "1-3, 5"."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _pad_limits(ax, xs: list[float], ys: list[float]) -> None:
    """Room on every side, so that no point sits on the frame (an offloaded run's model states are 0) and
    the number labels fit inside the axes; zero stays in view, so that lengths compare."""
    for values, set_limits, room_above in ((xs, ax.set_xlim, 0.15), (ys, ax.set_ylim, 0.2)):
        low, high = min(0.0, min(values)), max(values)
        span = (high - low) or 1.0
        set_limits(low - 0.08 * span, high + room_above * span)


def _coincident(ax, points: list[tuple[float, float]], within_px: float) -> list[tuple[tuple[float, float], list[int]]]:
    """(point, run numbers) per place: points closer than a marker on the page are one place."""
    groups: list[tuple[tuple[float, float], list[int]]] = []
    for number, point in enumerate(points, 1):
        px, py = ax.transData.transform(point)
        for (gx, gy), numbers in groups:
            if abs(px - gx) < within_px and abs(py - gy) < within_px:
                numbers.append(number)
                break
        else:
            groups.append(((px, py), [number]))
    return [(tuple(ax.transData.inverted().transform(at)), numbers) for at, numbers in groups]


# Where a point's number may go, in points from it (x, y, then the text's alignment): the first that stays
# inside the axes and clear of the title, the markers and the numbers already placed wins.
_NUMBER_PLACES = [(7, 7, "left", "bottom"), (7, -7, "left", "top"), (-7, 7, "right", "bottom"),
                  (-7, -7, "right", "top"), (0, 11, "center", "bottom"), (0, -11, "center", "top")]


def _number_points(fig, ax, points: list[tuple[float, float]], markers) -> None:
    """Write each run's number beside its measured point; runs at one place share one label ("1-4"), as
    their markers hide each other."""
    renderer = _renderer(fig)
    frame = ax.get_window_extent(renderer)
    taken = [ax.title.get_window_extent(renderer)] + [m.get_window_extent(renderer) for m in markers]
    for point, numbers in _coincident(ax, points, within_px=8 * fig.dpi / 72):
        for dx, dy, ha, va in _NUMBER_PLACES:
            label = ax.annotate(_number_ranges(numbers), point, textcoords="offset points", xytext=(dx, dy),
                                ha=ha, va=va, fontsize=8)
            box = label.get_window_extent(renderer)
            if frame.contains(box.x0, box.y0) and frame.contains(box.x1, box.y1) and \
                    not any(_overlap(box, other) for other in taken):
                break
            if (dx, dy) != _NUMBER_PLACES[-1][:2]:
                label.remove()  # the last place stays when none is clear: a number hidden is worse
        taken.append(box)


def tradeoff_plot(runs: list[RunSummary], out_dir: Path) -> str | None:
    """Model-state memory per rank against bytes sent per iteration, one point per run: measured
    filled, predicted hollow, joined by a line; each run numbered, its name in the legend. Returns the
    file name, or None without data."""
    shown = [r for r in runs if r.traffic_mb is not None and r.model_state_measured_gb is not None]
    if not shown:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 5.0))
    xs, ys, markers = [], [], []
    for number, run in enumerate(shown, 1):
        colour = RUN_COLOURS[(number - 1) % 20]
        point = (run.traffic_mb, run.model_state_measured_gb)
        markers.append(ax.scatter(*point, color=colour, s=50, zorder=3, label=f"{number}: {run.label}"))
        xs.append(point[0])
        ys.append(point[1])
        if run.traffic_predicted_mb is not None and run.zero_estimate_gb is not None:
            predicted = (run.traffic_predicted_mb, run.zero_estimate_gb)
            markers.append(ax.scatter(*predicted, facecolors="none", edgecolors=colour, s=110, zorder=2))
            ax.plot(*zip(point, predicted), color=colour, alpha=0.5, linewidth=1)
            xs.append(predicted[0])
            ys.append(predicted[1])
    ax.set_title("ZeRO trade-off: model-state memory per rank vs traffic per iteration")
    ax.set_xlabel("MB sent per rank per iteration (2^20 bytes)")
    ax.set_ylabel("model states on the rank (GB, 2^30 bytes; offloaded apart)")
    _pad_limits(ax, xs, ys)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, title="filled: measured, hollow: predicted;\nruns at one place share a number",
              title_fontsize=8, alignment="left", ncols=_legend_columns(len(shown)), **OUTSIDE_RIGHT)
    _number_points(fig, ax, [(r.traffic_mb, r.model_state_measured_gb) for r in shown], markers)
    _save(fig, out_dir / "zero_tradeoff.png")
    return "zero_tradeoff.png"


# the MoE fields of the iteration line (docs/moe.md), one panel each
MOE_PANELS = (("moe loss (coeff x load-balancing loss)", 1), ("expert load max/mean", 2),
              ("tokens dropped (fraction of routes)", 3))


def _moe_plot(runs: list[RunSummary], path: Path) -> None:
    fig, axes = plt.subplots(len(MOE_PANELS), 1, figsize=(7.5, 7.5), sharex=True)
    for ax, (label, column) in zip(axes, MOE_PANELS):
        for index, run in enumerate(runs):
            ax.plot([row[0] for row in run.moe_curve], [row[column] for row in run.moe_curve], markersize=3,
                    label=run.label, **run_style(index))
        ax.set_ylabel(label, fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].set_title("Mixture of experts: routing over iterations")
    axes[-1].set_xlabel("iteration")
    axes[0].legend(fontsize=8, ncols=_legend_columns(len(runs)), **OUTSIDE_RIGHT)
    _save(fig, path)


def _with(runs: list[RunSummary], *attrs: str) -> list[RunSummary]:
    return [r for r in runs if any(getattr(r, a) is not None for a in attrs)]


# MemAllocated counts every tensor the allocator holds (activations, communication buffers, workspace), the
# model states only the parameters, gradients and optimizer states: the states are compared with each other.
MEMORY_SERIES = [("MemAllocated mean: all allocated", "mem_alloc_mean_gb"),
                 ("MaxMemAllocated peak: all allocated", "max_mem_alloc_peak_gb"),
                 ("model states measured (part of MemAllocated)", "model_state_measured_gb"),
                 ("model states: ZeRO estimate", "zero_estimate_gb")]
MEMORY_LEGEND = ("MemAllocated: every tensor (activations,\nbuffers too). Model states: parameters,\n"
                 "gradients, optimizer states only;\ncompare the estimate with the measured\nmodel states, "
                 "not with MemAllocated")


def memory_kind(runs: list[RunSummary]) -> str:
    """What MemAllocated measured, by the device the memory lines name: on CPU ranks the live tensors in host
    memory, not an accelerator's. Upstream logs name no device (their lines are the GPU allocator's)."""
    devices = {r.memory_device for r in runs if r.memory_device}
    if devices == {"cpu"}:
        return "Tensor memory per CPU rank"
    if devices == {"cuda"}:
        return "GPU memory per rank"
    if len(devices) == 1:
        return f"{devices.pop().upper()} memory per rank"
    return "Accelerator memory per rank" if not devices else f"Memory per rank ({' and '.join(sorted(devices))})"


def make_plots(runs: list[RunSummary], out_dir: Path) -> list[tuple[str, str]]:
    """Write the plots that have data; return (file name, caption) for each written."""
    written = []

    def bars(filename, caption, ylabel, series_spec, legend_title=None):
        shown = _with(runs, *(attr for _, attr in series_spec))
        if shown:
            _bar_chart(shown, series_spec, caption, ylabel, out_dir / filename, legend_title)
            written.append((filename, caption))

    bars("throughput.png", "Training throughput, all ranks together (warm-up excluded)", "tokens/s",
         [("tokens/s", "tokens_per_s")])
    bars("epoch_time.png", "Average training time per epoch", "seconds per epoch",
         [("time per epoch", "epoch_time_s")])
    bars("accelerator_memory.png", f"{memory_kind(runs)}: all allocated, and the model states in it",
         "GB (2^30 bytes) per rank", MEMORY_SERIES, MEMORY_LEGEND)
    bars("host_memory.png", "Host memory (RSS) per rank during training", "GB (2^30 bytes) per rank",
         [("HostRSS mean", "host_rss_mean_gb"), ("HostRSS peak", "host_rss_peak_gb")])
    with_curve = [r for r in runs if r.loss_curve]
    if with_curve:
        _loss_plot(with_curve, out_dir / "loss.png")
        written.append(("loss.png", "Training loss vs consumed tokens"))
    with_moe = [r for r in runs if r.moe_curve]
    if with_moe:
        _moe_plot(with_moe, out_dir / "moe.png")
        written.append(("moe.png", "Mixture of experts: moe loss, expert load max/mean and tokens dropped"))
    return written
