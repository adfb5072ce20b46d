"""The benchmarks against Hugging Face and torch defaults run end to end (numbers are not asserted:
speed is the benchmark's business, not the tests')."""
import json
import re
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, free_port, test_env

ROW = re.compile(r"^\| (\d) \| (\d+\.\d) \| (\d+\.\d) \| (\d+\.\d\d)x \| (\d+\.\d{3}) \| n/a \|$", re.M)


@pytest.mark.slow
def test_gpt_vs_hf_bench_prints_a_row_per_stage_and_writes_json(tmp_path):
    out_json = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         str(REPO_ROOT / "bench" / "bench_gpt_vs_hf.py"), "--num-layers", "1", "--hidden-size", "64",
         "--num-attention-heads", "2", "--seq-length", "32", "--micro-batch-size", "2", "--stages", "0,3",
         "--warmup", "1", "--steps", "2", "--json", str(out_json)],
        env=test_env(OMP_NUM_THREADS=1), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "GPT L=1 h=64 heads=2 s=32 micro=2 accumulation=2 ranks=2 device=cpu dtype=fp32" in result.stdout
    rows = ROW.findall(result.stdout)
    assert [row[0] for row in rows] == ["0", "3"]
    recorded = json.loads(out_json.read_text())
    assert [entry["stage"] for entry in recorded] == [0, 3]
    for (_, ours, hf, ratio, _), entry in zip(rows, recorded):
        assert float(ours) > 0 and float(hf) > 0
        assert entry["ratio"] == pytest.approx(entry["ours_tokens_per_s"] / entry["hf_tokens_per_s"])
        assert float(ratio) == pytest.approx(entry["ratio"], abs=0.006)


@pytest.mark.slow
def test_cpu_step_parts_bench_prints_each_part_against_its_reference():
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / "bench_cpu_step_parts.py"), "--tokens", "64", "--batch", "2",
         "--hidden-size", "64", "--num-layers", "1", "--params", "10000", "--repeat", "1"],
        env=test_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = re.findall(r"^(.+?) +(\d+\.\d) +(.+?) +(\d+\.\d) +(\d+\.\d\d)x$", result.stdout, re.M)
    assert [row[0].split("  ")[0] for row in rows] == [
        "output-layer matmul", "output layer + loss", "AdamW step", "model fwd + bwd"]
    assert all(float(ratio) > 0 for *_, ratio in rows)
