"""bench/bench_step_time.py's reading of a training log and its verdicts, on hand-written time lines (the runs
themselves are the bench's business)."""
import importlib.util
import os
import sys

import pytest

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "bench"))  # a bench imports its sibling bench/common.py
spec = importlib.util.spec_from_file_location("bench_step_time", REPO_ROOT / "bench" / "bench_step_time.py")
bench = sys.modules["bench_step_time"] = importlib.util.module_from_spec(spec)  # dataclasses look it up there
spec.loader.exec_module(bench)


def log_of(intervals, rank=0, comm_mb=26.139):
    """A train.log with the run info and probe lines and, per (iteration, measured, predicted), the comm and
    time lines as megatron/training_log.py prints them."""
    lines = [" > run info | zero stage: 1 | offload: none | model: tiny | world size: 2 | micro batch: 4 |",
             " > step time predicted | compute: 18.2 GFLOP/s | link (probe): all_gather 90us + 0.733 GB/s | "
             "compute=100.0ms communication=50.0ms offload=0.0ms overlap=0.0ms total=150.0ms"]
    for iteration, (compute, communication, offload), predicted in intervals:
        total = compute + communication + offload
        lines.append(f"[Rank {rank}] comm at iteration {iteration:8d} | all_reduce=0.000MB | total={comm_mb:.3f}MB | "
                     f"bytes/param=4.000 | predicted={comm_mb:.3f}MB |")
        lines.append(f"[Rank {rank}] time at iteration {iteration:8d} | measured: compute={compute:.1f}ms "
                     f"communication={communication:.1f}ms offload={offload:.1f}ms total={total:.1f}ms | predicted: "
                     f"compute={predicted[0]:.1f}ms communication={predicted[1]:.1f}ms offload=0.0ms overlap=0.0ms "
                     f"total={predicted[0] + predicted[1]:.1f}ms |")
    return "\n".join(lines) + "\n"


def test_the_first_interval_is_left_out_and_the_rest_averaged_by_part():
    log = log_of([(5, (500.0, 500.0, 0.0), (100.0, 50.0)),  # warm-up: left out
                  (10, (100.0, 40.0, 0.0), (100.0, 50.0)),
                  (15, (110.0, 60.0, 0.0), (100.0, 50.0))])
    result = bench.summarize("Z1", log)
    assert result.intervals == 2
    assert result.measured == pytest.approx(dict(compute=105.0, communication=50.0, offload=0.0, total=155.0))
    assert result.predicted["total"] == pytest.approx(150.0)
    assert result.error_pct == pytest.approx(100 * (150.0 - 155.0) / 155.0)
    assert result.spread_pct == pytest.approx(100 * 15.0 / 155.0)
    assert result.sent_mb_per_iter == pytest.approx(26.139)
    assert result.run_info.startswith("zero stage: 1 | offload: none | model: tiny")
    assert result.probes.startswith("compute: 18.2 GFLOP/s")
    result.others_cores = 0.031
    row = bench.table([result], {}).splitlines()[2]
    assert row == ("| Z1 | 155.0 | 150.0 | -3.2% | 105.0 / 100.0 | 50.0 / 50.0 | 0.0 / 0.0 | 0.0 | 26.139 | 2 | "
                   "9.7% | 0.03 cores |")
    assert bench.error_verdict(result)["verdict"] == "met (-3.2%)"


def test_a_miss_names_the_part_that_carries_the_gap():
    result = bench.summarize("Z3", log_of([(5, (100.0, 100.0, 0.0), (100.0, 50.0)),
                                           (10, (102.0, 98.0, 0.0), (100.0, 50.0))]))
    verdict = bench.error_verdict(result, "two hosts: ")
    assert verdict["target"] == "two hosts: Z3 predicted within 20% of measured" and verdict["met"] is False
    assert verdict["verdict"].startswith("missed by 25.0% (20% allowed; predicted 150.0 ms/iter, measured 200.0: "
                                         "under-predicted by 50.0 ms, of which communication -48.0 ms "
                                         "(predicted 50.0 ms, measured 98.0 ms); compute -2.0 ms, offload +0.0 ms")


def test_the_z3_over_z1_ratio_and_logs_without_time_lines():
    z1 = bench.summarize("Z1", log_of([(5, (1.0, 1.0, 0.0), (1.0, 1.0)), (10, (100.0, 100.0, 0.0), (100.0, 100.0))]))
    z3 = bench.summarize("Z3", log_of([(5, (1.0, 1.0, 0.0), (1.0, 1.0)), (10, (100.0, 150.0, 0.0), (100.0, 150.0))],
                                      comm_mb=39.2))
    assert bench.ratio_verdict(z1, z3)["verdict"].startswith("met (1.250x; Z3 sent 39.200 MB/iter, Z1 26.139 (1.50x)")
    assert bench.ratio_verdict(z1, z1)["verdict"].startswith("missed by 0.100 (1.000x, 1.1x wanted; ")
    with pytest.raises(bench.BenchError, match="no time lines"):
        bench.summarize("DP", "[Rank 0] comm at iteration        5 | total=1.000MB |\n")
    with pytest.raises(bench.BenchError, match="no interval after the first"):
        bench.summarize("DP", log_of([(5, (1.0, 1.0, 0.0), (1.0, 1.0))]))


def test_only_the_lowest_ranks_lines_count():
    log = log_of([(5, (1.0, 1.0, 0.0), (1.0, 1.0)), (10, (10.0, 10.0, 0.0), (10.0, 10.0))]) + \
        log_of([(5, (9.0, 9.0, 0.0), (1.0, 1.0)), (10, (90.0, 90.0, 0.0), (10.0, 10.0))], rank=1)
    assert bench.summarize("Z1", log).measured["total"] == pytest.approx(20.0)


def test_a_finished_childs_cpu_counts_as_the_benchs_own_not_as_other_work():
    import subprocess
    import common

    other, own = common.OtherWork().start(), common.own_seconds()
    subprocess.run([sys.executable, "-c", "import time; end = time.process_time() + 0.5\n"
                    "while time.process_time() < end: pass"], check=True)
    assert common.own_seconds() - own >= 0.5
    assert 0.0 <= other.cores() <= os.cpu_count()
