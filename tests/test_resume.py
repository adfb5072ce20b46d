"""Checkpoint and resume: 20 iterations == 10 + resume + 10, loss for loss and bit for bit on CPU
(dropout on), and the `latest` pointer only ever names a complete checkpoint."""
import re
import socket
import subprocess
import sys

import pytest
import torch

from conftest import REPO_ROOT, test_env

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pretrain(data_dir, *extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(REPO_ROOT / "pretrain_gpt.py"), "--model-size", "tiny", "--seq-length", "64",
           "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "20", "--log-interval", "1",
           "--eval-interval", "5", "--eval-iters", "1", "--lr", "1e-3", "--lr-warmup-iters", "3",
           "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--zero-stage", "1",
           "--data-path", str(data_dir / "dolly_text_document"), "--vocab-file", str(data_dir / "gpt2-vocab.json"),
           "--merge-file", str(data_dir / "gpt2-merges.txt"), *extra]
    run = subprocess.run(cmd, env=test_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


def loss_fields(log: str) -> list[str]:
    return re.findall(r"\| lm loss: (\S+) \| loss scale: \S+ \| grad norm: (\S+) \|", log)


def module_weights(checkpoint_dir):
    # our model-states files hold tensors and plain types only (docs/checkpoints.md)
    state = torch.load(checkpoint_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=True)
    return state["module"]


@pytest.fixture(scope="module")
def runs(dolly_data_dir, tmp_path_factory):
    straight, split = tmp_path_factory.mktemp("straight"), tmp_path_factory.mktemp("split")
    full = pretrain(dolly_data_dir, "--save", str(straight), "--save-interval", "20")
    first = pretrain(dolly_data_dir, "--save", str(split), "--exit-interval", "10")
    latest_after_first = (split / "latest").read_text().strip()
    second = pretrain(dolly_data_dir, "--save", str(split), "--load", str(split))
    return dict(full=full, first=first, second=second, straight=straight, split=split,
                latest_after_first=latest_after_first)


def test_resumed_run_repeats_the_losses(runs):
    full = loss_fields(runs["full"])
    assert len(full) == 20
    assert loss_fields(runs["first"]) == full[:10]
    assert "loaded checkpoint" in runs["second"] and " iteration       11/      20 |" in runs["second"]
    assert loss_fields(runs["second"]) == full[10:]
    validation = re.findall(r"validation loss at iteration (\d+) \| lm loss value: (\S+)", runs["full"])
    assert validation[2:] == re.findall(r"validation loss at iteration (\d+) \| lm loss value: (\S+)",
                                        runs["second"])


def test_resumed_weights_are_bitwise_equal(runs):
    straight = module_weights(runs["straight"] / "global_step20")
    resumed = module_weights(runs["split"] / "global_step20")
    assert straight.keys() == resumed.keys()
    for name, tensor in straight.items():
        assert torch.equal(tensor, resumed[name]), name


def test_latest_names_the_last_complete_checkpoint(runs):
    assert runs["latest_after_first"] == "global_step10"
    assert (runs["split"] / "latest").read_text().strip() == "global_step20"
    for step in ("global_step10", "global_step20"):
        files = sorted(p.name for p in (runs["split"] / step).iterdir())
        assert files == ["mp_rank_00_model_states.pt", "zero_lab_state.json",
                         "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert not list(runs["split"].rglob("*.tmp"))
