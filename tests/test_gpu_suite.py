"""The GPU acceptance run without a GPU: what bench/gpu_suite.sh checks before its first run (one line
naming what is missing), the exact driver commands its dry run prints and what those commands become, and
the empty --save it passes (no checkpoints: parsed as no --save, and a real 2-rank CPU driver run)."""
import re
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


@pytest.mark.slow
def test_suite_without_gpu_or_data_offline_stops_in_one_line_before_any_run(tmp_path):
    data = tmp_path / "data"
    result = suite(SUITE_RUNS=tmp_path / "runs", DATA_DIR=data)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"error: the GPU suite cannot start: missing {NO_GPU}; the data {data}/dolly_text_document.bin "
        f"{data}/dolly_text_document.idx {data}/gpt2-vocab.json {data}/gpt2-merges.txt (no network to make it: "
        f"run bash tools/process_databricks_gpt2.sh where there is network and copy {data} here)"]
    assert commands(result) == [] and not (tmp_path / "runs").exists()


@pytest.mark.slow
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


@pytest.mark.slow
def test_suite_with_network_makes_missing_data_once_before_the_drivers(tmp_path):
    online = fake_tool(tmp_path / "bin", "curl", "#!/bin/sh\nexit 0\n")  # every URL answers
    data = tmp_path / "data"
    result = suite("--dry-run", "--only", "125M", path_prefix=online, HF_HUB_OFFLINE=0, DATA_DIR=data)
    assert result.returncode == 0, result.stderr
    assert f"[gpu_suite] dry run: a real run would stop here, missing {NO_GPU}\n" in result.stdout  # no data line
    steps = commands(result)
    assert steps[0] == f"env DATA_DIR={data} PYTHON={sys.executable} bash tools/process_databricks_gpt2.sh"
    assert len(steps) == 6 and all("examples_zero/gpt_deepspeed_" in step for step in steps[1:])


@pytest.mark.slow
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


# The quick profile (--quick): one short command on a GPU machine without network.
CARRY_FILES = ("dolly_text_document.bin", "dolly_text_document.idx", "gpt2-vocab.json", "gpt2-merges.txt")


def without_packages(folder: Path) -> Path:
    """A Python with torch whose `import deepspeed` fails: zero-lab is not installed there."""
    return fake_tool(folder, "python", f'#!/bin/sh\ncase "$*" in *"import deepspeed"*) exit 1;; esac\n'
                                       f'exec {sys.executable} "$@"\n') / "python"


def plan_rows(result: subprocess.CompletedProcess) -> dict[str, str]:
    rows = [line.split(None, 3)[1:3] for line in result.stdout.splitlines() if line.startswith("[gpu_suite]   ")]
    return {name_or_all: minutes for minutes, name_or_all in rows}


@pytest.mark.slow
def test_quick_dry_run_plans_at_most_seven_minutes_and_prints_each_command(tmp_path):
    """From a bare machine (zero-lab not installed): install from the carry folder, the CPU Adam build in the
    background, the five drivers at 125M for 25 iterations logged every 5 on the carried data, the bench once
    without --compile, the summary and the results page with the plan."""
    carry = tmp_path / "carry"
    (carry / "wheelhouse").mkdir(parents=True)
    data_folder(carry / "data")
    python = without_packages(tmp_path / "py")
    runs = tmp_path / "runs"
    result = suite("--quick", "--dry-run", SUITE_RUNS=runs, GPU_CARRY=carry, PYTHON=python)
    assert result.returncode == 0, result.stderr
    assert f"[gpu_suite] dry run: a real run would stop here, missing {NO_GPU.replace(sys.executable, str(python))}\n" \
        in result.stdout  # the GPU alone: the carry folder is there
    plan = plan_rows(result)
    assert list(plan) == ["install", "op_build", "DP", "Z1", "Z2", "Z3", "Z3_OL", "bench", "report", "in"]
    assert plan["op_build"] == "-"  # beside the drivers, not in the sum
    steps = sum(float(minutes) for name, minutes in plan.items() if name not in ("op_build", "in"))
    assert float(plan["in"]) == pytest.approx(steps) and steps <= 7

    steps = commands(result)
    venv_python = REPO_ROOT / ".venv" / "bin" / "python"
    assert steps[0] == f"rm -rf {runs}"
    assert steps[1] == f"env WHEELHOUSE={carry}/wheelhouse SETUP_EXTRAS= PYTHON={python} bash scripts/setup.sh"
    assert "CPUAdamBuilder" in steps[2] and steps[2].endswith(" &") and f" {venv_python} -c " in steps[2]
    drivers = re.findall(r"^env RUNS_DIR=(\S+) MODEL_SIZE=125M SEQ_LEN=1024 PRECISION=bf16 MICRO_BATCH=8 NGPUS=1 "
                         r"TRAIN_ITERS=25 LOG_INTERVAL=5 EVAL_INTERVAL=25 EVAL_ITERS=2 DATA_DIR=(\S+) PYTHON=(\S+) "
                         r"bash examples_zero/gpt_deepspeed_(\w+)\.sh --save ''$", "\n".join(steps[3:8]), re.M)
    assert drivers == [(str(runs), f"{carry}/data", str(venv_python), experiment)
                       for experiment in ("DP", "Z1", "Z2", "Z3", "Z3_OL")]
    assert "bench/bench_gpt_vs_hf.py" in steps[8] and "--compile" not in steps[8]
    assert steps[9] == f"{venv_python} analysis/summarize.py {runs}"
    assert re.match(rf"{venv_python} bench/gpu_suite_report\.py --runs {runs} --out \S+\.md --iters 25 "
                    r"--log-interval 5 --models 125M --micro-batch 8 --quick --plan ", steps[10])
    assert len(steps) == 11 and not runs.exists()


@pytest.mark.slow
def test_quick_without_the_carry_folder_stops_in_one_line(tmp_path):
    carry = tmp_path / "nowhere"
    python = without_packages(tmp_path / "py")
    result = suite("--quick", SUITE_RUNS=tmp_path / "runs", GPU_CARRY=carry, PYTHON=python)
    assert result.returncode == 1
    get = "build the carry folder with bash scripts/gpu_carry.sh where there is network and bring"
    assert result.stderr.strip().splitlines() == [
        f"error: the GPU suite cannot start: missing a CUDA GPU (torch.cuda.device_count() is 0 for PYTHON={python}); "
        f"the wheelhouse {carry}/wheelhouse to install zero-lab's packages from ({get} {carry} here, docs/gpu.md); "
        f"the data {' '.join(str(carry / 'data' / name) for name in CARRY_FILES)} ({get} {carry} here)"]
    assert commands(result) == [] and not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_quick_report_puts_each_step_beside_its_plan(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "steps.tsv").write_text("install\t50\nDP\t42\nop_build\t95\n")
    out = tmp_path / "some-gpu.md"
    result = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "gpu_suite_report.py"), "--runs", str(runs),
                             "--out", str(out), "--iters", "25", "--log-interval", "5", "--models", "125M",
                             "--micro-batch", "8", "--quick", "--plan", "install\t1.0\tinstall it",
                             "op_build\t-\tbuild it", "DP\t0.5\tDP driver", "bench\t1.3\tthe bench"],
                            env=test_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    text = out.read_text()
    assert "`bash bench/gpu_suite.sh --quick`" in text and "(log interval 5;" in text
    assert ("| install | 1.0 | 0.8 | install it |\n| op_build | - | 1.6 | build it |\n| DP | 0.5 | 0.7 | DP driver |\n"
            "| bench | 1.3 | n/a | the bench |\n| in all | 2.8 | 1.5 |") in text  # op_build ran beside: not added
    assert "With --compile" not in text


@pytest.mark.slow
def test_carry_folder_is_one_command_and_at_most_48_mib(tmp_path):
    """Built from the package index (wheels for CPython 3.12, less a CUDA image's packages) and the committed
    dolly sample: the wheels the image lacks, never torch or the test extra, and the four data files."""
    carry = tmp_path / "gpu_carry"
    result = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "gpu_carry.sh"), str(carry), "--present",
                             str(REPO_ROOT / "tests" / "fixtures" / "cuda-image-packages.txt")],
                            env=test_env(), capture_output=True, text=True, timeout=1500)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    size = sum(path.stat().st_size for path in carry.rglob("*") if path.is_file())
    assert size <= 48 * 2**20
    assert re.search(rf"^\[gpu_carry\] {carry}: \d+ MiB \(\d+ wheels, data ", result.stdout, re.M)
    wheels = sorted(path.name for path in (carry / "wheelhouse").iterdir())
    for needed in ("deepspeed-0.19.8-py3-none-any.whl", "pydantic_core-", "hjson-", "pybind11-3.1.0-", "setuptools-",
                   "wheel-", "pip-"):
        assert any(name.startswith(needed) for name in wheels), (needed, wheels)
    assert [name for name in wheels if "cp3" in name and "cp312" not in name and "abi3" not in name] == []
    for absent in ("torch-", "numpy-", "transformers-", "pytest-", "wandb-"):  # present there, or tests only
        assert not any(name.startswith(absent) for name in wheels), (absent, wheels)
    data = sorted(path.name for path in (carry / "data").iterdir())
    assert data == sorted([*CARRY_FILES, "dolly_text_document.meta.json"])
    assert not list(tmp_path.glob("gpu_carry.partial.*"))
