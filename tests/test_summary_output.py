"""What analysis/summarize.py shows a reader: plots that stay readable with many long run names, the terminal's
compact table, and the count of files it says it wrote."""
import re
import shutil
import subprocess
import sys
from itertools import combinations

import matplotlib

matplotlib.use("Agg")
import pytest  # noqa: E402
from matplotlib.collections import PathCollection  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from conftest import REPO_ROOT, test_env  # noqa: E402
from analysis import plots, summarize  # noqa: E402

FIXTURES = REPO_ROOT / "tests" / "fixtures" / "logs"
SUMMARIZE = REPO_ROOT / "analysis" / "summarize.py"
PLOTS = ["throughput.png", "epoch_time.png", "accelerator_memory.png", "host_memory.png", "loss.png",
         "zero_tradeoff.png"]


def run_cli(*args):
    return subprocess.run([sys.executable, str(SUMMARIZE), *map(str, args)], env=test_env(), cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def twelve_long_names(tmp_path_factory):
    """12 run folders of 30-character names, copies of the three real zero-lab logs (Z1, Z3 with comm and time
    lines, Z3 with offload and a run shorter than an epoch), 4 of each."""
    runs = tmp_path_factory.mktemp("runs")
    sources = ["gpt_tiny_Z1", "gpt_tiny_Z3", "gpt_tiny_Z3_OL"]
    for i in range(12):
        name = f"{sources[i % 3]}_run{i:02d}_lr3e-4_warmup_steps"[:30]
        assert len(name) == 30
        shutil.copytree(FIXTURES / "ours" / sources[i % 3], runs / name)
    return runs


def _drawn_texts(fig):
    """(what, Text) for every non-empty text the figure draws: titles, axis labels, tick labels in view,
    annotations and bar values, legend entries and titles."""
    texts = [("figure text", t) for t in fig.texts]
    for ax in fig.axes:
        texts += [("title", ax.title), ("x label", ax.xaxis.label), ("y label", ax.yaxis.label)]
        for axis, (lo, hi) in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
            lo, hi = min(lo, hi), max(lo, hi)
            texts += [("tick label", label) for loc, label in zip(axis.get_majorticklocs(), axis.get_ticklabels())
                      if lo <= loc <= hi]
        texts += [("label in the axes", t) for t in ax.texts]
        legend = ax.get_legend()
        if legend is not None:
            texts += [("legend", t) for t in legend.get_texts()] + [("legend title", legend.get_title())]
    return [(what, t) for what, t in texts if t.get_visible() and t.get_text().strip()]


def _overlap(a, b) -> bool:
    # Boxes that only touch (one shared antialiased pixel) are not counted.
    return min(a.x1, b.x1) - max(a.x0, b.x0) > 1 and min(a.y1, b.y1) - max(a.y0, b.y0) > 1


def _inside(box, frame) -> bool:
    return frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1


def _marker_boxes(ax, renderer):
    """The window extent of each scatter marker and each bar with a height."""
    boxes = []
    for collection in ax.collections:
        if isinstance(collection, PathCollection):
            for (x, y), size in zip(collection.get_offsets(), collection.get_sizes()):
                cx, cy = ax.transData.transform((x, y))
                r = size ** 0.5 / 2 * ax.figure.dpi / 72  # s is the marker's area in points^2
                boxes.append(("marker", matplotlib.transforms.Bbox([[cx - r, cy - r], [cx + r, cy + r]])))
    boxes += [("bar", p.get_window_extent(renderer)) for p in ax.patches
              if isinstance(p, Rectangle) and p.get_height() > 0]
    return boxes


def layout_problems(fig) -> list[str]:
    """Labels that overlap each other (the title included), and labels, markers or bars that are not inside
    the axes or that the legend covers; [] for a readable plot."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    texts = [(f"{what} {t.get_text()!r}", t.get_window_extent(renderer)) for what, t in _drawn_texts(fig)]
    problems = [f"{a} overlaps {b}" for (a, box_a), (b, box_b) in combinations(texts, 2) if _overlap(box_a, box_b)]
    for ax in fig.axes:
        frame = ax.get_window_extent(renderer)
        inner = [(f"label {t.get_text()!r}", t.get_window_extent(renderer)) for t in ax.texts if t.get_text()]
        inner += _marker_boxes(ax, renderer)
        problems += [f"{what} is not inside the axes" for what, box in inner if not _inside(box, frame)]
        legend = ax.get_legend()
        if legend is not None:
            box = legend.get_window_extent(renderer)
            problems += [f"the legend covers {what}" for what, other in inner if _overlap(box, other)]
    return problems


def test_every_plot_stays_readable_with_12_runs_of_30_character_names(twelve_long_names, tmp_path, monkeypatch):
    found, legends, titles = {}, {}, {}
    save = plots._save

    def check_then_save(fig, path):
        found[path.name] = layout_problems(fig)
        titles[path.name] = fig.axes[0].get_title()
        legends[path.name] = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
        save(fig, path)

    monkeypatch.setattr(plots, "_save", check_then_save)
    assert summarize.main([str(twelve_long_names), "--out", str(tmp_path)]) == 0
    assert sorted(found) == sorted(PLOTS)
    problems = [f"{name}: {problem}" for name, found_there in found.items() for problem in found_there]
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems[:40])
    # MemAllocated (every tensor) is not what the ZeRO estimate counts: the measured model states stand beside it
    memory = legends["accelerator_memory.png"]
    assert memory[0].startswith("MemAllocated mean") and memory[2].startswith("model states measured")
    assert memory[3] == "model states: ZeRO estimate"
    # issue 56, item 7: the plot is named by the devices the memory lines name (the Z3 log's cuda, the others' cpu)
    assert titles["accelerator_memory.png"] == ("Memory per rank (cpu and cuda): all allocated, and the model states "
                                                "in it")
    assert legends["zero_tradeoff.png"][:2] == ["1: Z3 tiny gpt_tiny_Z3_run01_lr3e-4_warmu",
                                                "2: Z3 tiny gpt_tiny_Z3_run04_lr3e-4_warmu"]


TERMINAL_HEADER = ["run", "status", "ZeRO", "tokens/s", "epoch (s)", "accel. peak GB", "host RSS peak GB", "lm loss",
                   "ms/iter meas/pred", "MB/iter meas/pred"]


def test_the_terminal_shows_a_compact_table_and_the_files_every_column(tmp_path):
    result = run_cli(FIXTURES, "--out", tmp_path, "--no-plots")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.replace(str(tmp_path), "OUT").splitlines()  # the output folder's length is the user's
    assert max(len(line) for line in lines) <= 160, max(lines, key=len)
    assert re.split(r"\s{2,}", lines[0]) == TERMINAL_HEADER
    rows = {cells[0]: cells for line in lines[1:6] if (cells := re.split(r"\s{2,}", line.strip()))}
    assert set(rows) == {"Z1 tiny", "Z3", "Z3+offload", "Z2", "Z1 GPT1_3B"}
    # the real Z3 log: every column filled, equal to the CSV's figures at the table's precision
    assert rows["Z3"] == ["Z3", "finished", "3", "2,022.3", "7.2", "0.27", "1.88", "8.5200", "506.4/510.6",
                          "78.30/78.32"]
    assert rows["Z3+offload"][1:3] == ["INCOMPLETE", "3+offload"]
    assert rows["Z1 tiny"][-1] == "442.5/-"  # a log without time lines: no prediction to show
    assert "| HFU (%) |" not in result.stdout and "wrote summary.md (the full table, 28 columns)" in result.stdout
    header = (tmp_path / "summary.md").read_text().splitlines()[0]
    assert header.count(" | ") == 27 and "| mean lm loss per epoch |" in header and "epoch ends" not in header


@pytest.mark.parametrize("flags, plots_written", [([], 6), (["--no-plots"], 0)])
def test_the_plots_counted_are_the_plots_written(tmp_path, flags, plots_written):
    """The fixture runs have data for every plot, the ZeRO trade-off (the Z3 log's comm lines) included."""
    result = run_cli(FIXTURES, "--out", tmp_path, *flags)
    assert result.returncode == 0, result.stderr
    said = re.search(r"report\.md and (\d+) plots to ", result.stdout)
    assert said, result.stdout
    written = sorted(p.name for p in tmp_path.glob("*.png"))
    assert int(said.group(1)) == len(written) == plots_written, written


def _loss_runs(iterations: list[int]) -> list:
    """Summaries with only a label and a loss curve (8 x 128 tokens an iteration), one per length."""
    from dataclasses import MISSING, fields

    from analysis.run_summary import RunSummary
    required = {f.name: None for f in fields(RunSummary) if f.default is MISSING and f.default_factory is MISSING}
    return [RunSummary(**{**required, "label": f"run {i:02d}", "status": "finished", "complete": True,
                          "loss_curve": [(1024 * it, 10.0 - it / n) for it in range(1, n + 1)]})
            for i, n in enumerate(iterations)]


def _drawn(monkeypatch, draw, *args):
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig))
    draw(*args)
    return figures[0]


def test_fifteen_loss_curves_keep_their_own_colours_and_a_long_run_leaves_the_short_ones_readable(monkeypatch,
                                                                                                  tmp_path):
    """Issue 56, item 7: loss.png repeated a 10-colour cycle over 15 runs, and one 400-iteration run squeezed the
    60-iteration ones into the first 15% of the axis."""
    fig = _drawn(monkeypatch, plots._loss_plot, _loss_runs([60] * 14 + [400]), tmp_path / "loss.png")
    ax = fig.axes[0]
    styles = [(matplotlib.colors.to_hex(line.get_color()), line.get_linestyle(), line.get_marker())
              for line in ax.get_lines()]
    assert len(styles) == 15 and len({colour for colour, _, _ in styles}) == 15
    assert all(plots.run_style(i) != plots.run_style(j) for i, j in combinations(range(100), 2))
    assert len({matplotlib.colors.to_hex(plots.run_style(i)["color"]) for i in range(20)}) == 20
    # the last point of a 60-iteration run beside a 400-iteration one: past the middle of the axis
    assert ax.get_xscale() == "log" and "log scale" in ax.get_xlabel()
    frame = ax.get_window_extent(fig.canvas.get_renderer())
    short_end = ax.transData.transform((1024 * 60, 5.0))[0]
    assert (short_end - frame.x0) / frame.width > 0.6
    assert not layout_problems(fig)
    # runs of like lengths keep the linear axis
    fig = _drawn(monkeypatch, plots._loss_plot, _loss_runs([60, 30, 45]), tmp_path / "loss.png")
    assert fig.axes[0].get_xscale() == "linear" and fig.axes[0].get_xlabel() == "consumed tokens"


@pytest.mark.parametrize("devices, title", [
    (["cpu", "cpu"], "Tensor memory per CPU rank"), (["cuda"], "GPU memory per rank"),
    (["cpu", "cuda"], "Memory per rank (cpu and cuda)"), ([None], "Accelerator memory per rank")])
def test_the_memory_plot_is_named_by_the_device_the_runs_used(monkeypatch, tmp_path, devices, title):
    """Issue 56, item 7: accelerator_memory.png was titled "Accelerator memory" for runs on CPU ranks, whose
    MemAllocated is the live tensors in host memory. Upstream logs name no device: their lines are a GPU's."""
    runs = _loss_runs([4] * len(devices))
    for run, device in zip(runs, devices):
        run.memory_device, run.mem_alloc_mean_gb, run.max_mem_alloc_peak_gb = device, 0.1, 0.2
    written = plots.make_plots(runs, tmp_path)
    assert dict(written)["accelerator_memory.png"] == f"{title}: all allocated, and the model states in it"
