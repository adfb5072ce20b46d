"""Record the figures of the suite's shared driver sweep (conftest.six_driver_runs) as a reference.

    python tests/record_driver_sweep.py

prepares the dolly sample as the suite does, runs `examples_zero/run_all.sh` with the suite's driver settings
(conftest.driver_env: tiny model, 2 CPU ranks, seq 64, 2 epochs of 2 iterations) and writes
tests/fixtures/driver-sweep/reference.json with analysis/reference.py. tests/test_reference_run.py holds every
session's shared sweep to it: the same traffic and model states, and the same loss within fp32 rounding. Record it
again, at a clean commit, when a change is meant to move those figures (and remake runs/reference/cpu-2rank, whose
figures move with them: its README says how).
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import DOLLY_SAMPLE, REPO_ROOT, driver_env, test_env  # noqa: E402

OUT = REPO_ROOT / "tests" / "fixtures" / "driver-sweep"
COMMAND = "bash examples_zero/run_all.sh  # with tests/conftest.py driver_env's settings"


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        data_dir, runs_dir = Path(tmp) / "data", Path(tmp) / "runs"
        subprocess.run(["bash", str(REPO_ROOT / "tools" / "process_databricks_gpt2.sh")], cwd=REPO_ROOT, check=True,
                       env=test_env(DATA_DIR=data_dir, DOLLY_JSONL=DOLLY_SAMPLE), capture_output=True)
        subprocess.run(["bash", str(REPO_ROOT / "examples_zero" / "run_all.sh")], cwd=REPO_ROOT, check=True,
                       env=driver_env(data_dir, runs_dir))
        return subprocess.run([sys.executable, str(REPO_ROOT / "analysis" / "reference.py"), str(runs_dir),
                               "--out", str(OUT), "--command", COMMAND], cwd=REPO_ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
