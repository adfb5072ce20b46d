"""The progress line (issue 33 item 1, docs/log-lines.md): what fraction of the run is done, the time since the
launch started and an ETA at the loop's recent wall-clock rate, a line of its own after the time line; and the
analysis showing a run still running with its progress and ETA."""
import csv
import json
import re
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, free_port, test_env
from analysis import log_parser
from megatron.accounting import report
from megatron.training_log import (IterationStats, comm_line, iteration_line, memory_line, progress_line,
                                   time_line, training_done_line)

DOCS = REPO_ROOT / "docs" / "log-lines.md"
SUMMARIZE = REPO_ROOT / "analysis" / "summarize.py"


# ---- the line -----------------------------------------------------------------------------------------------

def test_the_line_says_the_fraction_elapsed_and_eta():
    # 40 of 100 done, 83 s since launch, 2.0833 s per wall-clock iteration over 11..40: 60 x 2.0833 = 125 s left
    line = progress_line(0, 40, 100, 83.4, (125 / 60, 11))
    assert line == ("[Rank 0] progress at iteration       40 | 40/100 iterations (40.0%) | elapsed 0:01:23 since "
                    "launch | ETA 0:02:05 | wall clock 2.083 s/iteration over iterations 11-40 |")
    assert f"\n{line}\n" in DOCS.read_text()  # the docs' example is what the code prints
    match = log_parser.PROGRESS_RE.search(line)
    assert match.groups() == ("40", "40", "100", "40.0", "0:01:23", "0:02:05")


def test_the_first_interval_of_a_launch_has_no_eta_and_the_last_iteration_has_none_left():
    first = progress_line(0, 5, 100, 41.0, None)
    assert first == ("[Rank 0] progress at iteration        5 | 5/100 iterations (5.0%) | elapsed 0:00:41 since "
                     "launch | ETA unknown | wall clock: no interval timed yet in this launch |")
    assert f"\n{first}\n" in DOCS.read_text()
    assert log_parser.PROGRESS_RE.search(first).group(6) == "unknown"
    # a run of one interval: nothing timed, nothing left
    assert " | 4/4 iterations (100.0%) | elapsed 0:00:09 since launch | ETA 0:00:00 | wall clock: no interval " \
        in progress_line(1, 4, 4, 9.0, None)
    assert " | ETA 0:00:00 | wall clock 0.500 s/iteration over iterations 3-4 |" in progress_line(0, 4, 4, 9.0,
                                                                                                   (0.5, 3))


def test_percentages_are_truncated_and_hours_unbounded():
    assert "9999/10000 iterations (99.9%)" in progress_line(0, 9999, 10000, 0.0, None)
    assert "1/3 iterations (33.3%)" in progress_line(0, 1, 3, 0.0, None)
    line = progress_line(0, 10, 10**6, 5 * 86400 + 3600 + 61.4, (0.5, 1))  # 999990 x 0.5 s left
    assert " elapsed 121:01:01 since launch | ETA 138:53:15 |" in line
    assert log_parser.seconds_of("121:01:01") == 121 * 3600 + 61
    assert log_parser.PROGRESS_RE.pattern in DOCS.read_text()


def test_the_eta_uses_the_wall_clock_of_the_last_intervals(monkeypatch):
    """Between two progress lines counts everything the loop did (an evaluation, a save): the ETA is the
    iterations left at the wall-clock rate over the last PROGRESS_WINDOW intervals."""
    now = [1000.0]
    monkeypatch.setattr(report.time, "time", lambda: now[0])
    clock = report.ProgressClock(launch_started=990.0)

    def line_at(iteration, after):
        now[0] += after
        return log_parser.PROGRESS_RE.search(clock.line(0, iteration, 200)).groups()

    assert line_at(10, 0.0)[4:] == ("0:00:10", "unknown")
    assert line_at(20, 10.0)[4:] == ("0:00:20", "0:03:00")  # 1 s per iteration, 180 left
    assert line_at(30, 30.0)[4:] == ("0:00:50", "0:05:40")  # an evaluation: 40 s over 20 iterations, 170 left
    for iteration in range(40, 140, 10):  # 10 more intervals at 1 s per iteration: the slow one leaves the window
        fields = line_at(iteration, 10.0)
    assert fields[4:] == ("0:02:30", "0:01:10")
    assert clock.line(0, 140, 200).endswith("over iterations 41-140 |")


# ---- the analysis: a run still running, and one that finished ------------------------------------------------

RUN_INFO = (" > run info | zero stage: 1 | offload: none | model: tiny | world size: 2 | micro batch: 4 | "
            "global batch: 8 | seq length: 64 | train samples per epoch: 3200 |")
PREDICTED = type("Predicted", (), dict(compute=0.3, communication=0.1, offload=0.0, host=0.0, overlap=0.0, total=0.4))()


def interval_lines(iteration: int, total: int, elapsed: float, rate) -> list[str]:
    """One logging interval of the printing rank as megatron/accounting/report.py prints it: 0.5 s per iteration."""
    stats = IterationStats(
        iteration=iteration, train_iters=total, consumed_samples=8 * iteration, consumed_tokens=512 * iteration,
        elapsed_ms=500.0, learning_rate=1e-4, global_batch_size=8, lm_loss=10.0 - iteration / 100, loss_scale=1.0,
        grad_norm=1.0, skipped_iterations=0, nan_iterations=0, samples_per_second=16.0,
        tokens_per_gpu_per_second=512.0, tflops=0.01)
    mem = {"allocated": 2**30, "max_allocated": 2**30, "rss": 2**30, "max_rss": 2**30}
    return [iteration_line(stats), memory_line(0, "cpu", iteration, mem, None),
            comm_line(0, iteration, {"reduce_scatter": 2**20}, 10**6, 2**20),
            time_line(0, iteration, dict(compute=0.4, communication=0.1, offload=0.0, total=0.5), PREDICTED),
            progress_line(0, iteration, total, elapsed, rate)]


def run_log(last: int, total: int = 100, resumed_at: int | None = None) -> list[str]:
    """A run logging every 10 iterations to `last`: 30 s of start-up, then 0.6 s per wall-clock iteration; with
    resumed_at, a second attempt from that iteration's checkpoint."""
    lines = ["[zero-lab] attempt 1 started 2026-11-23 20:00:00 UTC on node01: fresh start", RUN_INFO]
    for it in range(10, min(last, resumed_at or last) + 1, 10):
        lines += interval_lines(it, total, 30 + 0.6 * it, None if it == 10 else (0.6, 11))
    if resumed_at is not None:
        lines += ["[zero-lab] attempt 2 started 2026-11-23 21:00:00 UTC on node01: resuming from runs/r/checkpoints",
                  RUN_INFO]
        for it in range(resumed_at + 10, last + 1, 10):
            lines += interval_lines(it, total, 20 + 0.6 * (it - resumed_at),
                                    None if it == resumed_at + 10 else (0.6, resumed_at + 11))
    return lines


def summarize(tmp_path, logs: dict[str, str]) -> tuple[dict, str]:
    for name, text in logs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "train.log").write_text(text)
    result = subprocess.run([sys.executable, str(SUMMARIZE), str(tmp_path), "--no-plots"], env=test_env(),
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    with open(tmp_path / "summary.csv", newline="") as f:
        rows = {row["run"]: row for row in csv.DictReader(f)}
    return rows, (tmp_path / "summary.md").read_text()


def test_a_run_still_running_shows_its_progress_and_eta_and_a_finished_one_does_not(tmp_path):
    live = run_log(40)
    # the live log as a reader finds it: cut mid-line, in the iteration line of iteration 50
    cut = "\n".join(live) + "\n" + run_log(50)[len(live)][:120]
    done = "\n".join(run_log(100)) + "\n" + training_done_line() + "\n"
    rows, table = summarize(tmp_path, {"gpt_tiny_live": cut, "gpt_tiny_done": done})
    live_row, done_row = rows["gpt_tiny_live"], rows["gpt_tiny_done"]
    # iteration 40 of 100: 54 s since launch, 60 left at 0.6 s: 36 s
    assert (live_row["status"], live_row["progress_iteration"], live_row["progress_pct"]) == ("INCOMPLETE", "40",
                                                                                              "40.0")
    assert (live_row["progress_elapsed_s"], live_row["eta_s"]) == ("54", "36")
    assert " gpt_tiny_live | INCOMPLETE (40.0%, ETA 0:00:36) |" in table
    assert (" gpt_tiny_live: INCOMPLETE (log ends mid-line), summarized as far as the log goes; its last progress "
            "line, at iteration 40: 40.0% done, 0:00:54 since its launch started, ETA 0:00:36 (if still running)"
            ) in table
    assert done_row["status"] == "finished" and done_row["progress_pct"] == done_row["eta_s"] == ""
    assert " gpt_tiny_done | finished |" in table and "gpt_tiny_done: " not in table
    runs = {run["run"]: run for run in json.loads((tmp_path / "summary.json").read_text())["runs"]}
    assert (runs["gpt_tiny_live"]["eta_s"], runs["gpt_tiny_done"]["eta_s"]) == (36, None)


def test_a_resumed_run_shows_its_last_launchs_progress(tmp_path):
    # attempt 2 resumed at 30 and logged 40 only: its first interval, whose ETA is unknown; attempt 1's
    # older ETA is not shown. A third attempt that has logged nothing yet shows no progress at all.
    resumed = run_log(40, resumed_at=30)
    starting = resumed + ["[zero-lab] attempt 3 started 2026-11-23 22:00:00 UTC on node01: resuming from x", RUN_INFO]
    rows, table = summarize(tmp_path, {"gpt_tiny_resumed": "\n".join(resumed) + "\n",
                                       "gpt_tiny_starting": "\n".join(starting) + "\n"})
    assert (rows["gpt_tiny_resumed"]["progress_pct"], rows["gpt_tiny_resumed"]["eta_s"]) == ("40.0", "")
    assert rows["gpt_tiny_resumed"]["progress_elapsed_s"] == "26"
    assert " gpt_tiny_resumed | INCOMPLETE (40.0%, ETA unknown) |" in table
    assert rows["gpt_tiny_starting"]["progress_pct"] == ""
    assert " gpt_tiny_starting | INCOMPLETE |" in table


# ---- a real run -------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_real_run_prints_the_progress_line_every_interval(dolly_data_dir):
    """2 CPU ranks, 6 iterations logged every 2, an evaluation at 4: one progress line per interval, last of the
    interval's lines, the fraction exactly the iteration's, the ETA at the printed rate, 0:00:00 at the end."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(REPO_ROOT / "pretrain_gpt.py"), "--model-size", "tiny", "--seq-length", "64",
           "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "6", "--log-interval", "2",
           "--eval-interval", "4", "--eval-iters", "1", "--lr", "1e-3", "--seed", "7", "--zero-stage", "1",
           "--data-path", str(dolly_data_dir / "dolly_text_document"),
           "--vocab-file", str(dolly_data_dir / "gpt2-vocab.json"),
           "--merge-file", str(dolly_data_dir / "gpt2-merges.txt")]
    # with the start-up probes: the progress line follows the time line, which they make
    run = subprocess.run(cmd, env=test_env(ZERO_LAB_SKIP_PROBES=0), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = run.stdout.splitlines()
    progress = [(i, line) for i, line in enumerate(lines) if " progress at iteration " in line]
    assert [line.split(" | ")[1] for _, line in progress] == ["2/6 iterations (33.3%)", "4/6 iterations (66.6%)",
                                                              "6/6 iterations (100.0%)"]
    for index, line in progress:  # the rank that prints, right after the interval's time line
        assert line.startswith("[Rank 0] progress at iteration ") and " time at iteration " in lines[index - 1]
    records = [log_parser._parse_progress(line) for _, line in progress]
    elapsed = [r.elapsed_s for r in records]
    assert 0 < elapsed[0] <= elapsed[1] <= elapsed[2] < 600
    assert [r.eta_s for r in records][::2] == [None, 0]
    assert progress[0][1].endswith(" | wall clock: no interval timed yet in this launch |")
    rate = float(re.search(r"wall clock (\d+\.\d+) s/iteration over iterations 3-4 \|", progress[1][1]).group(1))
    assert 0 < rate < 60 and abs(records[1].eta_s - 2 * rate) <= 1  # 2 iterations left
    assert re.search(r"over iterations 3-6 \|$", progress[2][1])
    assert sum(" progress at iteration " in line for line in run.stderr.splitlines()) == 0
