"""bench/bench_long_sequences.py: the lengths it picks from the memory model, and its smallest case run for real
(2 CPU ranks at SP=2, one length), its printed table and JSON read back."""
import json
import re
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, test_env

sys.path.insert(0, str(REPO_ROOT / "bench"))  # a bench imports its sibling bench/common.py
import bench_long_sequences as bench  # noqa: E402


@pytest.mark.parametrize("sp", [1, 2, 4])
def test_the_longest_sequence_fits_the_cap_and_one_step_longer_does_not(sp):
    longest = bench.longest_fitting(4, sp, 64.0)
    assert longest % bench.STEP == 0
    assert bench.predicted_peak_mb(4, sp, longest) <= 64.0 < bench.predicted_peak_mb(4, sp, longest + bench.STEP)
    assert bench.lengths_to_run(longest)[0] == 1024 and bench.lengths_to_run(longest)[-1] == longest


def test_sequence_parallelism_lengthens_the_longest_sequence_about_n_times():
    one, two, four = (bench.longest_fitting(4, sp, 64.0) for sp in (1, 2, 4))
    # 4.6x, not 4x: at SP=1 rotary's rotated q and k and the projection input's copy are kept too (memory.py)
    assert 1.75 * one < two and 1.9 * two < four < 5 * one
    assert bench.lengths_to_run(2048) == [1024, 2048] and bench.lengths_to_run(1536) == [1024, 1536]
    assert bench.longest_fitting(4, 1, 1.0) == 0 and bench.lengths_to_run(0) == []


@pytest.mark.slow
def test_the_smallest_case_prints_measured_beside_predicted(tmp_path):
    out = tmp_path / "result.json"
    run = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "bench_long_sequences.py"), "--ranks", "2",
                          "--sp-sizes", "2", "--cap-mb", "16", "--iters", "4", "--json", str(out)],
                         env=test_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    longest = bench.longest_fitting(2, 2, 16.0)  # 896 tokens: the backward's peak is in the cap too
    assert bench.lengths_to_run(longest) == [longest]
    row = re.search(rf"^\| 2 \| 1 \| {longest} \(longest\) \| (\d+) / (\d+) \| (\d+) / (\d+) \| [+-]\d+% \| "
                    r"(\d+\.\d) / (\d+\.\d) \| [+-]\d+\.\d% \| (\d+\.\d) / (\d+\.\d) \| \d+\.\d\d cores \|$",
                    run.stdout, re.M)
    assert row, run.stdout
    tokens, predicted_tokens, _, _, peak, predicted_peak, activations, predicted_activations = map(float, row.groups())
    assert tokens > 0 and predicted_tokens > 0
    assert peak == pytest.approx(predicted_peak, rel=0.05)  # the model-state line's sums, both sides
    assert activations == pytest.approx(predicted_activations, rel=0.02)
    assert re.search(rf"^\| 2 \| {longest} \| \d+\.\d \| \d+\.\d \| fits \(\d+\.\d MiB measured\) \|$", run.stdout, re.M)
    # the planner beside the paper: its one stated figure is a bound, and the ratios say so
    assert "No throughput figure of the paper can be read exactly" in run.stdout
    assert re.search(r"^\| 1\.3B GPT, 32K tokens, SP=4, 8 x A100-40GB .* \| Z\d[^|]* \| \d+ \| \d\.\d\d \| \d+ \| "
                     r"\d\.\d\d \|$", run.stdout, re.M), run.stdout
    record = json.loads(out.read_text())
    assert record["ranks"] == 2 and record["cap_mb"] == 16.0 and record["failures"] == []
    assert [(r["sp"], r["dp"], r["seq_length"], r["longest"]) for r in record["rows"]] == [(2, 1, longest, True)]
    assert record["longest"][0]["one_step_longer_mb"] > 16.0 >= record["longest"][0]["predicted_mb"]
    assert [r["published_bound_tflops"] for r in record["paper"]] == [175.0, 175.0]


def test_each_lever_lengthens_the_longest_sequence_and_the_cap_holds_its_peak():
    import long_sequence_levers as levers

    rows = {row.levers: row for row in levers.plan(bench, 4, 64.0)}
    none, recompute, tiled, both, offload = (rows[x.name] for x in bench.LEVER_COLUMNS)
    assert none.seq_length == bench.longest_fitting(4, 4, 64.0)  # the SP table's SP=4 longest
    assert none.seq_length < recompute.seq_length < both.seq_length < offload.seq_length
    assert none.seq_length < tiled.seq_length < both.seq_length
    for row in rows.values():
        assert row.seq_length % bench.STEP == 0 and row.predicted_peak_mb <= 64.0 < row.one_step_longer_mb
    # the host tier is beside the cap, not in it: only --checkpoint-in-cpu has one
    assert offload.predicted_host_mb > 0 and all(not r.predicted_host_mb for r in (none, recompute, tiled, both))
    flags = bench.command(REPO_ROOT, 4, 4, 1024, 4, bench.LEVER_COLUMNS[-1])
    assert flags[-6:] == ["--checkpoint-activations", "--tiled-mlp-compute", "--tiled-logits-loss",
                          "--tiled-logits-loss-shards", str(bench.LOSS_TILES), "--checkpoint-in-cpu"]


def test_the_lever_columns_run_at_a_deeper_shape_by_layers():
    """--layers N: the tiny shape at N layers in the plan and the runs' flags; the SP table refuses it."""
    import long_sequence_levers as levers

    two, four = (levers.plan(bench, 4, 64.0, (bench.NO_LEVERS,), layers)[0] for layers in (2, 4))
    assert four.seq_length == bench.longest_fitting(4, 4, 64.0, layers=4) < two.seq_length
    assert bench.predicted_peak_mb(4, 4, four.seq_length, layers=4) <= 64.0
    flags = bench.command(REPO_ROOT, 4, 4, 1024, 4, bench.NO_LEVERS, 4)
    assert flags[flags.index("--num-layers") + 1] == "4"
    assert bench.options(["--levers", "--layers", "4"]).layers == 4
    assert bench.options(["--levers"]).layers == 2
    run = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "bench_long_sequences.py"), "--layers", "4"],
                         env=test_env(), capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stderr.strip().splitlines()[-1].endswith(
        "error: --layers 4: expected a positive layer count, with --levers (the SP table runs the tiny shape's 2)")


@pytest.mark.slow
def test_the_lever_mode_runs_its_columns_at_their_longest_with_the_measured_peak(tmp_path):
    """The no-lever column and every lever's, each run at its longest length in one invocation: the measured peak
    (the model states plus the model-state line's step_peak) within 10% of the cap's figure, the host tier too."""
    out = tmp_path / "result.json"
    run = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "bench_long_sequences.py"), "--ranks", "2",
                          "--cap-mb", "16", "--iters", "4", "--levers", "none",
                          "recompute + tiled + checkpoint-in-cpu", "--json", str(out)], env=test_env(),
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    record = json.loads(out.read_text())
    none, row = record["levers"]
    assert none["levers"] == "none" and none["seq_length"] == record["baseline_seq_length"] and none["ratio"] == 1.0
    assert row["levers"] == "recompute + tiled + checkpoint-in-cpu" and row["ratio"] > 1.5
    assert record["layers"] == 2 and "tiny shape at 2 layers" in run.stdout
    for column in (none, row):
        assert column["run"]["step_peak_mb"] > 0
        assert column["peak_mb"] == pytest.approx(column["predicted_peak_mb"], rel=0.10), column
        assert column["run"]["peak_mb"] == pytest.approx(column["run"]["predicted_peak_mb"], rel=0.10)
        measured = re.search(rf"^\| {re.escape(column['levers'])} \| {column['seq_length']} \| \d\.\d\dx \| "
                             r"(\d+\.\d) / (\d+\.\d) \| ([+-]\d+\.\d)% \|", run.stdout, re.M)
        assert measured and float(measured.group(1)) == pytest.approx(column["peak_mb"], abs=0.05), run.stdout
        assert abs(float(measured.group(3))) < 10
    assert row["host_mb"] == pytest.approx(row["predicted_host_mb"], rel=0.10) and row["host_mb"] > 0
