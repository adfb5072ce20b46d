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


@pytest.mark.slow
def test_the_lever_mode_runs_a_column_at_its_longest_and_prints_its_host_tier(tmp_path):
    out = tmp_path / "result.json"
    run = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "bench_long_sequences.py"), "--ranks", "2",
                          "--cap-mb", "16", "--iters", "4", "--levers", "recompute + tiled + checkpoint-in-cpu",
                          "--json", str(out)], env=test_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    record = json.loads(out.read_text())
    (row,) = record["levers"]
    assert row["levers"] == "recompute + tiled + checkpoint-in-cpu" and row["ratio"] > 1.5
    assert row["run"]["peak_mb"] == pytest.approx(row["run"]["predicted_peak_mb"], rel=0.10)
    assert row["host_mb"] == pytest.approx(row["predicted_host_mb"], rel=0.10) and row["host_mb"] > 0
    assert f"| recompute + tiled + checkpoint-in-cpu | {row['seq_length']} |" in run.stdout
