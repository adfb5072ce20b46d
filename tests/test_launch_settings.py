"""The launch paths (examples_zero drivers, ALCF/, Slurm through the drivers) alike: one lock per run folder, the
resume rule on every host, a user's own settings honoured or refused in one line (docs/environment.md)."""
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO_ROOT, free_port
from conftest import test_env as subprocess_env  # aliased: pytest would collect test_env as a test
from megatron.checkpointing import protocol

DRIVER = REPO_ROOT / "examples_zero" / "gpt_deepspeed_Z1.sh"
ALCF = REPO_ROOT / "ALCF" / "train-gpt3.sh"


def run(script: Path, *args, **env) -> subprocess.CompletedProcess:
    environment = subprocess_env(**{k: v for k, v in env.items() if v is not None})
    for name in [name for name, value in env.items() if value is None]:
        environment.pop(name, None)
    return subprocess.run(["bash", str(script), *args], cwd=REPO_ROOT, env=environment, capture_output=True,
                          text=True, timeout=180)


def command_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stdout.splitlines() if "DRY_RUN=1, not starting: " in line]
    assert len(lines) == 1, result.stdout + result.stderr
    return lines[0].split("not starting: ", 1)[1] + " "


def committed_checkpoint(checkpoints: Path, tag: str) -> None:
    protocol.prepare_save(str(checkpoints), tag)
    (checkpoints / protocol.staging_tag(tag)).mkdir()
    protocol.commit(str(checkpoints), tag, {"iteration": int(tag.removeprefix("global_step"))})


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} after {timeout} s"
        time.sleep(0.2)


@pytest.fixture
def waiting_launch(tmp_path):
    """A real first launch of the Z1 driver that holds its run folder: host 0 of a two-host torchrun run whose
    host 1 never comes, so its launcher waits in the rendezvous. Stopped (its process group) at the end."""
    runs = tmp_path / "runs"
    run_dir = runs / "gpt_tiny_Z1"
    env = subprocess_env(RUNS_DIR=runs, NNODES=2, NODE_RANK=0, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(),
                         DATA_PATH=tmp_path / "no_data_needed_before_the_ranks_meet")
    first = subprocess.Popen(["bash", str(DRIVER)], cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        lock = run_dir / ".zero-lab.lock"
        wait_for(lambda: lock.exists() and lock.read_text().startswith(f"pid {first.pid} "), 60,
                 "the first launch took no lock")
        wait_for(lambda: (run_dir / "command.txt").exists(), 60, "the first launch started no attempt")
        yield first, runs, run_dir
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=30)


@pytest.mark.slow
def test_a_second_launch_of_a_running_run_is_refused_on_every_path(waiting_launch):
    """One lock per run folder, taken before the resume rule: a second launch (a driver, with FRESH=1 too, or
    ALCF/ on the same folder) ends in one line naming the run folder and the process that holds it, and moves
    nothing of the live run."""
    first, runs, run_dir = waiting_launch
    before = sorted(p.name for p in run_dir.iterdir())
    holder = f"pid {first.pid} on {os.uname().nodename} since "
    for script, env in ((DRIVER, dict(RUNS_DIR=runs)), (DRIVER, dict(RUNS_DIR=runs, FRESH=1)),
                        (ALCF, dict(OUTPUT_ROOT=runs, RUN_NAME="gpt_tiny_Z1", MODEL_SIZE_KEY="GPT_TINY",
                                    CUDA_VISIBLE_DEVICES=""))):
        second = run(script, **env)
        assert second.returncode == 1, second.stderr
        [line] = second.stderr.splitlines()
        assert line.startswith(f"error: run folder {run_dir} is in use by another launch ({holder}"), line
        assert line.endswith("): wait for it to end or stop it; a second launch would mix its checkpoints and "
                             "logs with the first's")
    assert set(before) <= {p.name for p in run_dir.iterdir()}  # nothing moved (the first launch adds its own)
    assert not list(runs.glob("gpt_tiny_Z1.old-*"))
    assert first.poll() is None  # the first launch goes on


def test_host_k_of_a_torchrun_run_follows_host_0s_resume_decision(tmp_path):
    """NNODES=2: host 1 asks the resume rule without acting on it, so with INIT_HF both hosts pass the same
    --load: the run's checkpoint when it has one, else the converted model with --finetune (converted by host 0
    only)."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(dict(n_layer=2, n_embd=128, n_head=4, n_positions=1024)))
    runs = tmp_path / "runs"
    run_dir = runs / "gpt_tiny_Z1"
    (run_dir).mkdir(parents=True)
    (run_dir / "train.log").write_text("an earlier attempt that saved nothing\n")
    hosts = dict(RUNS_DIR=runs, INIT_HF=hf, NNODES=2, MASTER_ADDR="127.0.0.1", DRY_RUN=1)
    fresh = [command_line(run(DRIVER, NODE_RANK=rank, **hosts)) for rank in (0, 1)]
    init = f" --load {run_dir / 'hf_init_hf'} --finetune "
    assert all(init in line and f" --load {run_dir / 'checkpoints'} " not in line for line in fresh), fresh
    committed_checkpoint(run_dir / "checkpoints", "global_step3")
    resumed = [command_line(run(DRIVER, NODE_RANK=rank, **hosts)) for rank in (0, 1)]
    assert all(f" --load {run_dir / 'checkpoints'} " in line and " --finetune " not in line for line in resumed)
    fresh_again = run(DRIVER, NODE_RANK=1, FRESH=1, **hosts)
    assert init in command_line(fresh_again)  # FRESH=1 on every host: host 1 starts afresh as host 0 does
    assert (run_dir / "checkpoints" / "latest").is_file() and (run_dir / "train.log").is_file()  # host 1 moved nothing


@pytest.mark.slow
def test_host_k_does_not_convert_init_hf(tmp_path):
    """A real host 1 start with INIT_HF and no checkpoint: it passes host 0's --finetune flags, converts nothing
    (host 0 does, before its ranks meet host 1's) and waits for host 0 in the rendezvous."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(dict(n_layer=2, n_embd=128, n_head=4, n_positions=1024)))
    runs = tmp_path / "runs"
    run_dir = runs / "gpt_tiny_Z1"
    env = subprocess_env(RUNS_DIR=runs, INIT_HF=hf, NNODES=2, NODE_RANK=1, MASTER_ADDR="127.0.0.1",
                         MASTER_PORT=free_port(), DATA_PATH=tmp_path / "no_data_needed_before_the_ranks_meet")
    host1 = subprocess.Popen(["bash", str(DRIVER)], cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: (run_dir / "command.node1.txt").exists(), 60, "host 1 started no attempt")
        command = (run_dir / "command.node1.txt").read_text()
        assert f" --load {run_dir / 'hf_init_hf'} --finetune " in command
        assert not (run_dir / "hf_init_hf").exists()
        assert (run_dir / ".zero-lab.node1.lock").read_text().startswith(f"pid {host1.pid} ")
    finally:
        os.killpg(host1.pid, signal.SIGKILL)
        host1.wait(timeout=30)
