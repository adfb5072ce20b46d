"""bench/collective_costs.py end to end on 2 CPU ranks: a row per kind (the reduce, ZeRO 1-2's gradient
reduction, among them), every cost positive and finite, the all-reduce the unit of the ratios, p2p at the
broadcast's cost (the numbers themselves are the bench's business)."""
import json
import math
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, free_port, test_env


@pytest.mark.slow
def test_bench_prints_a_row_per_kind(tmp_path):
    out = tmp_path / "costs.json"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         str(REPO_ROOT / "bench" / "collective_costs.py"), "--bandwidth-gbps", "0.2", "--repeats", "3",
         "--json", str(out)],
        env=test_env(OMP_NUM_THREADS=1), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {row["kind"]: row for row in json.loads(out.read_text())}
    # reduce: ZeRO 1-2's gradient reduction (a dist.reduce per partition), which the probe prices on its own
    assert list(rows) == ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "p2p", "reduce"]
    for row in rows.values():
        assert all(math.isfinite(row[key]) and row[key] >= 0 for key in ("latency_us", "ns_per_byte", "factor"))
        assert row["ns_per_byte"] > 0 and f"| {row['kind']} | {row['latency_us']:.1f} |" in result.stdout
        # at 0.2 Gbit/s (25e6 bytes/s) the factor is the seconds per byte x 25e6
        assert row["factor"] == pytest.approx(row["ns_per_byte"] * 1e-9 * 25e6)
    assert rows["all_reduce"]["vs_all_reduce"] == 1.0
    assert rows["p2p"]["ns_per_byte"] == rows["broadcast"]["ns_per_byte"]
