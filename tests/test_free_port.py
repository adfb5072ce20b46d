"""Two single-host runs on one machine: without MASTER_PORT a driver's run takes a free port (torchrun's
--standalone), so a run started while another holds 29500 trains (docs/environment.md, MASTER_PORT)."""
import contextlib
import socket
import subprocess

import pytest

from conftest import REPO_ROOT, driver_env

pytestmark = pytest.mark.slow


def test_a_run_beside_one_holding_29500_trains(dolly_data_dir, tmp_path):
    env = driver_env(dolly_data_dir, tmp_path / "runs", TRAIN_ITERS=1, EVAL_ITERS=0, ZERO_LAB_SKIP_PROBES=1)
    del env["TRAIN_EPOCHS"], env["MASTER_PORT"]
    with socket.socket() as other_run:
        # the other run's rendezvous store; a port some process already holds is the same case
        with contextlib.suppress(OSError):
            other_run.bind(("", 29500))
            other_run.listen()
        result = subprocess.run(["bash", str(REPO_ROOT / "examples_zero" / "gpt_deepspeed_Z1.sh"), "--save", ""],
                                cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    command = (tmp_path / "runs" / "gpt_tiny_Z1" / "command.txt").read_text()
    assert "--standalone" in command and "--master_port" not in command
