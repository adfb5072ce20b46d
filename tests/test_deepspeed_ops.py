"""Where DeepSpeed's C++ ops are built, and what a build at first use prints (megatron/deepspeed_ops.py): a real
rank's start (initialize_distributed, which loads the shared-memory op on the CPU accelerator) builds in the
environment's own folder unless TORCH_EXTENSIONS_DIR says otherwise, and says in one line that it compiles an op
that folder lacks before the build starts. The op is built once in the environment's folder (as the set-up
builds it: seconds when it is there) and copied where a test needs it built (torch then loads it without a
rebuild); the announced build is stopped once its line is read."""
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO_ROOT, free_port, test_env
from megatron.deepspeed_ops import STALE_AFTER_S

SHM = "deepspeed_shm_comm"
SHM_LINE = "compiling DeepSpeed's deepspeed_shm_comm for shared-memory collectives (first use, about 1 min)"
OWN_FOLDER = Path(sys.prefix) / "torch_extensions"
# one rank of a one-rank job, started as pretrain_gpt.py starts it; then the folder its ops were built in
RANK = ("import os; from megatron.initialize import initialize_distributed; initialize_distributed(1); "
        "print('built in', os.environ['TORCH_EXTENSIONS_DIR'], flush=True)")


def rank_env(tmp_path: Path, extensions: Path | None) -> dict:
    """A one-rank job's environment, HOME in tmp_path (torch's default folder would be its .cache)."""
    env = test_env(RANK=0, LOCAL_RANK=0, WORLD_SIZE=1, LOCAL_WORLD_SIZE=1, MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=free_port(), HOME=tmp_path)
    env.pop("TORCH_EXTENSIONS_DIR")
    if extensions is not None:
        env["TORCH_EXTENSIONS_DIR"] = str(extensions)
    return env


@pytest.fixture(scope="module")
def shm_built() -> Path:
    """The shared-memory op built in the environment's own folder, as scripts/setup.sh builds it."""
    env = test_env()
    env.pop("TORCH_EXTENSIONS_DIR")
    subprocess.run([sys.executable, "-m", "megatron.deepspeed_ops", "build", SHM], env=env, cwd=REPO_ROOT,
                   check=True, capture_output=True, timeout=900)
    return OWN_FOLDER / SHM


def test_the_ops_are_built_in_the_environments_own_folder(tmp_path, shm_built):
    result = subprocess.run([sys.executable, "-c", RANK], env=rank_env(tmp_path, None), cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert f"built in {OWN_FOLDER}\n" in result.stdout
    assert SHM_LINE not in result.stdout  # built there already: no line, no build
    assert not (tmp_path / ".cache" / "torch_extensions").exists()


def test_a_folder_the_user_set_is_kept(tmp_path, shm_built):
    shutil.copytree(shm_built, tmp_path / "ext" / SHM)
    result = subprocess.run([sys.executable, "-c", RANK], env=rank_env(tmp_path, tmp_path / "ext"), cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert f"built in {tmp_path / 'ext'}\n" in result.stdout and SHM_LINE not in result.stdout


def test_a_rank_says_in_one_line_that_it_compiles_an_op_before_the_build(tmp_path):
    """A folder without the op: the rank prints the line, then torch starts the build (its folder appears);
    the build is stopped there, before its library exists."""
    folder = tmp_path / "ext"
    rank = subprocess.Popen([sys.executable, "-c", RANK], env=rank_env(tmp_path, folder), cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        lines = []
        for line in rank.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith(("compiling", "built in")):
                break
        assert lines[-1] == SHM_LINE, lines
        assert not (folder / SHM / f"{SHM}.so").exists()  # said before the op was built, not after
        deadline = time.monotonic() + 60
        while not (folder / SHM).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (folder / SHM).is_dir(), "the build did not start in the folder asked for"
    finally:
        os.killpg(rank.pid, signal.SIGKILL)
        rank.wait()
    assert lines.count(SHM_LINE) == 1


@pytest.mark.slow
def test_a_build_killed_mid_way_does_not_stall_the_next_load(tmp_path, shm_built):
    """A rank killed while it compiles an op leaves torch's build lock in the op's folder, and torch's own wait for
    it has no end; the next load removes it, saying so in one line, and goes on (the op is copied in meanwhile,
    as if built, so that the second load is quick)."""
    folder, lock = tmp_path / "ext", tmp_path / "ext" / SHM / "lock"
    rank = subprocess.Popen([sys.executable, "-c", RANK], env=rank_env(tmp_path, folder), cwd=REPO_ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not lock.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert lock.exists(), "the build did not start"
    finally:
        os.killpg(rank.pid, signal.SIGKILL)
        rank.wait()
        # ninja runs each compiler in a process group of its own, which outlives the rank's by up to a minute (the
        # next load waits for them): ended here by PID, as those working in the op's folder
        for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/cwd") == str((folder / SHM).resolve()):
                    os.kill(int(pid), signal.SIGKILL)
    assert lock.exists()  # what the killed build left behind
    # a lock younger than STALE_AFTER_S may be a build that is just starting: the next load comes after that
    time.sleep(max(0.0, os.path.getmtime(lock) + STALE_AFTER_S + 1 - time.time()))
    shutil.copytree(shm_built, folder / SHM, dirs_exist_ok=True, ignore=shutil.ignore_patterns("lock"))
    result = subprocess.run([sys.executable, "-c", RANK], env=rank_env(tmp_path, folder), cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (f"removing {lock}: a build of DeepSpeed's {SHM} that ended without finishing left it\n"
            in result.stdout), result.stdout
    assert f"built in {folder}\n" in result.stdout and not lock.exists()


def test_the_build_command_refuses_an_unknown_op_in_one_line():
    result = subprocess.run([sys.executable, "-m", "megatron.deepspeed_ops", "build", "cpu_adamw"], env=test_env(),
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr == ("error: build cpu_adamw: usage: python -m megatron.deepspeed_ops folder | build OP... | "
                             "build all (OP: deepspeed_shm_comm, cpu_adam, async_io, pin_memory)\n")


def test_ops_are_compiled_without_debug_information():
    """DeepSpeed's own flags for the CPU Adam op carry -g; the build that zero-lab's loads run has every other flag
    (the -O3, the vector ISA) and not -g, and the op in the environment's folder was built that way."""
    from deepspeed.accelerator import get_accelerator

    from megatron.deepspeed_ops import without_debug_info

    builder = get_accelerator().create_op_builder("CPUAdamBuilder")
    deepspeeds = builder.cxx_args()
    assert "-g" in deepspeeds and "-O3" in deepspeeds
    without_debug_info(builder)
    without_debug_info(builder)  # a second load of the same builder
    assert builder.cxx_args() == [flag for flag in deepspeeds if flag != "-g"]
    if not (OWN_FOLDER / "cpu_adam" / "cpu_adam.so").exists():  # scripts/test.sh builds it before pytest starts
        subprocess.run([sys.executable, "-m", "megatron.deepspeed_ops", "build", "cpu_adam"], check=True,
                       env=test_env(), timeout=900)
    ninja = (OWN_FOLDER / "cpu_adam" / "build.ninja").read_text()
    cflags = next(line for line in ninja.splitlines() if line.startswith("cflags = "))
    assert " -O3 " in cflags and " -g " not in cflags + " "
