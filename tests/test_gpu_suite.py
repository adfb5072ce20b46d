"""The GPU acceptance run without a GPU: what bench/gpu_suite.sh checks before its first run (one line
naming what is missing), the exact driver commands its dry run prints and what those commands become, and
the empty --save it passes (no checkpoints: parsed as no --save, and a real 2-rank CPU driver run)."""
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT, driver_env, test_env
from megatron.arguments import parse_args

SUITE = REPO_ROOT / "bench" / "gpu_suite.sh"
NO_GPU = f"a CUDA GPU (torch.cuda.device_count() is 0 for PYTHON={sys.executable})"


def data_folder(folder: Path) -> Path:
    """Stand-ins for the four files the drivers read (the suite only checks they are there)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("dolly_text_document.bin", "dolly_text_document.idx", "gpt2-vocab.json", "gpt2-merges.txt"):
        (folder / name).write_text("")
    return folder


def fake_tool(folder: Path, name: str, script: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(script)
    (folder / name).chmod(0o755)
    return folder


def suite(*args, path_prefix: Path | None = None, **env) -> subprocess.CompletedProcess:
    environment = test_env(**env)  # HF_HUB_OFFLINE=1: no network, unless a test says otherwise
    if path_prefix is not None:
        environment["PATH"] = f"{path_prefix}:{environment['PATH']}"
    return subprocess.run(["bash", str(SUITE), *args], cwd=REPO_ROOT, env=environment, capture_output=True,
                          text=True, timeout=120)


def commands(result: subprocess.CompletedProcess) -> list[str]:
    return [line[2:] for line in result.stdout.splitlines() if line.startswith("+ ")]


def test_empty_save_means_no_saving():
    """The drivers pass --save RUN/checkpoints and the suite's --save '' comes after it: no checkpoints."""
    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
             "--micro-batch-size", "2", "--train-iters", "10", "--tokenizer-type", "NullTokenizer",
             "--vocab-size", "1000", "--data-path", "unused_until_start_up"]
    assert parse_args([*flags, "--save", "runs/x/checkpoints", "--save", ""]).checkpoint.save is None
    assert parse_args([*flags, "--save", "runs/x/checkpoints"]).checkpoint.save == "runs/x/checkpoints"


def test_suite_without_gpu_or_data_offline_stops_in_one_line_before_any_run(tmp_path):
    data = tmp_path / "data"
    result = suite(SUITE_RUNS=tmp_path / "runs", DATA_DIR=data)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"error: the GPU suite cannot start: missing {NO_GPU}; the data {data}/dolly_text_document.bin "
        f"{data}/dolly_text_document.idx {data}/gpt2-vocab.json {data}/gpt2-merges.txt (no network to make it: "
        f"run bash tools/process_databricks_gpt2.sh where there is network and copy {data} here)"]
    assert commands(result) == [] and not (tmp_path / "runs").exists()


def test_suite_without_packages_offline_names_the_wheelhouse(tmp_path):
    """A Python with torch but not zero-lab's packages, no network, no wheelhouse: the line says how to get one."""
    real = sys.executable
    python = fake_tool(tmp_path / "py", "python", f'#!/bin/sh\ncase "$*" in *"import deepspeed"*) exit 1;; esac\n'
                                                   f'exec {real} "$@"\n') / "python"
    result = suite("--only", "bench", PYTHON=python, WHEELHOUSE=tmp_path / "wheelhouse", PIP_NO_INDEX=1)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"error: the GPU suite cannot start: missing a CUDA GPU (torch.cuda.device_count() is 0 for PYTHON={python}); "
        f"zero-lab's packages for PYTHON={python}, and with no network a wheelhouse to install them from "
        f"({tmp_path}/wheelhouse: build it with scripts/wheelhouse.sh where there is network, docs/gpu.md)"]
    (tmp_path / "wheelhouse").mkdir()
    result = suite("--only", "bench", PYTHON=python, WHEELHOUSE=tmp_path / "wheelhouse", PIP_NO_INDEX=1)
    assert (f"no network: run WHEELHOUSE={tmp_path}/wheelhouse bash scripts/setup.sh"
            in result.stderr.strip().splitlines()[-1])


def test_suite_with_network_makes_missing_data_once_before_the_drivers(tmp_path):
    online = fake_tool(tmp_path / "bin", "curl", "#!/bin/sh\nexit 0\n")  # every URL answers
    data = tmp_path / "data"
    result = suite("--dry-run", "--only", "125M", path_prefix=online, HF_HUB_OFFLINE=0, DATA_DIR=data)
    assert result.returncode == 0, result.stderr
    assert f"[gpu_suite] dry run: a real run would stop here, missing {NO_GPU}\n" in result.stdout  # no data line
    steps = commands(result)
    assert steps[0] == f"env DATA_DIR={data} PYTHON={sys.executable} bash tools/process_databricks_gpt2.sh"
    assert len(steps) == 6 and all("examples_zero/gpt_deepspeed_" in step for step in steps[1:])


def test_dry_run_driver_commands_end_in_empty_save_and_use_the_visible_gpus(tmp_path):
    """What the suite prints is what a driver runs: its pretrain command ends with --save '' after the run's
    own --save (so no checkpoint), and with the deepspeed launcher it trains on the GPUs CUDA_VISIBLE_DEVICES
    names (--include, not --num_gpus, which would take GPUs 0..N-1)."""
    result = suite("--dry-run", "--only", "125M", SUITE_RUNS=tmp_path / "runs", DATA_DIR=data_folder(tmp_path / "d"))
    assert result.returncode == 0, result.stderr
    z3_ol = [step for step in commands(result) if step.endswith("gpt_deepspeed_Z3_OL.sh --save ''")]
    assert len(z3_ol) == 1
    driver = subprocess.run(["bash", "-c", z3_ol[0]], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                            env=test_env(DRY_RUN=1, LAUNCHER="deepspeed", CUDA_VISIBLE_DEVICES="4,5"))
    assert driver.returncode == 0, driver.stderr
    line = [line for line in driver.stdout.splitlines() if "DRY_RUN=1, not starting: " in line]
    assert len(line) == 1, driver.stdout
    argv = shlex.split(line[0].split("not starting: ", 1)[1])
    assert argv[argv.index("deepspeed.launcher.runner") + 1:][:2] == ["--include", "localhost:4"]
    assert "--num_gpus" not in argv
    saves = [argv[i + 1] for i, flag in enumerate(argv) if flag == "--save"]
    assert saves == [f"{tmp_path}/runs/gpt_125M_Z3_OL/checkpoints", ""] and argv[-2:] == ["--save", ""]
    assert "--zero-offload-optimizer" in argv and "--bf16" in argv


@pytest.mark.slow
def test_a_driver_with_empty_save_trains_on_two_ranks_and_writes_no_checkpoint(dolly_data_dir, tmp_path):
    """Before: local rank 0 ran os.makedirs('') and the run failed (on GPUs the other ranks waited for it)."""
    result = subprocess.run(["bash", str(REPO_ROOT / "examples_zero" / "gpt_deepspeed_Z1.sh"), "--save", ""],
                            cwd=REPO_ROOT, env=driver_env(dolly_data_dir, tmp_path),
                            capture_output=True, text=True, timeout=600)
    run_dir = tmp_path / "gpt_tiny_Z1"
    log = (run_dir / "train.log").read_text() if (run_dir / "train.log").exists() else ""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:] + log[-3000:]
    assert " iteration        4/       4 |" in log
    assert not list(run_dir.rglob("latest")) and not list(run_dir.rglob("*model_states.pt"))
