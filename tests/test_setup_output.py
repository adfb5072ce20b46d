"""What scripts/setup.sh prints: one line per step, the tools' own output in build/setup.log, a failed step
in one error line naming that log, everything on the terminal with VERBOSE=1. The script runs from a copy
in an empty folder (its log goes there) with fake tools only on PATH: a Python whose pip, venv and op build
print a little and succeed or fail as the test says, apt-get, and id (root); no mpiexec, so the set-up
installs MPICH with the fake apt-get. Nothing is installed and nothing reaches the network (well under a
second a run)."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import REPO_ROOT

# the programs setup.sh and the fake tools call, linked into the fake PATH
TOOLS = ("cp", "date", "dirname", "env", "head", "mkdir", "sed", "sort", "tail", "wc")

FAKE_PYTHON = """#!/bin/sh
case "$*" in
    *"import torch"*) [ -n "$TORCH" ] || exit 1; echo "$TORCH cpu" ;;
    "-m venv "*) mkdir -p "$3/bin" && cp "$0" "$3/bin/python" ;;
    *"pip install"*) shift 2; echo "pip: $*"; echo "${PIP_ERROR:-pip: a warning}" >&2; exit "${PIP_EXIT:-0}" ;;
    -V) echo "Python 3.11.7" ;;
    "-m megatron.deepspeed_ops folder") echo "$TORCH_EXTENSIONS_DIR" ;;
    "-m megatron.deepspeed_ops build "*) echo "ninja: [1/3] c++ shm.cpp"; echo "ninja: [3/3] c++ -shared" ;;
    *) echo "fake python: unexpected $*" >&2; exit 99 ;;
esac
"""
FAKE_APT_GET = """#!/bin/sh
echo "apt-get $*" >> "$APT_CALLS"
case "$*" in *install*) echo "(Reading database ... 5%(Reading database ... 100%"; echo "Setting up mpich ..." ;; esac
"""


def tool(folder: Path, name: str, script: str) -> None:
    (folder / name).write_text(script)
    (folder / name).chmod(0o755)


def setup(tmp_path, *, venv_exists=True, **env):
    """Runs a copy of scripts/setup.sh in tmp_path/repo; returns the result and the log's path."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True, exist_ok=True)
    shutil.copy2(REPO_ROOT / "scripts" / "setup.sh", repo / "scripts" / "setup.sh")
    bin_dir = tmp_path / "bin"
    if not bin_dir.exists():
        bin_dir.mkdir()
        for name in TOOLS:
            (bin_dir / name).symlink_to(shutil.which(name))
        tool(bin_dir, "python3", FAKE_PYTHON)
        tool(bin_dir, "apt-get", FAKE_APT_GET)
        tool(bin_dir, "id", "#!/bin/sh\necho 0\n")
    venv = tmp_path / "venv"
    if venv_exists and not venv.exists():
        (venv / "bin").mkdir(parents=True)
        shutil.copy2(bin_dir / "python3", venv / "bin" / "python")
    environment = {"PATH": str(bin_dir), "HOME": str(tmp_path), "VENV_DIR": str(venv), "PYTHON": "python3",
                   "APT_CALLS": str(tmp_path / "apt-calls"), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"),
                   **{k: str(v) for k, v in env.items()}}
    result = subprocess.run([shutil.which("bash"), str(repo / "scripts" / "setup.sh")], env=environment,
                            capture_output=True, text=True, timeout=60)
    return result, repo / "build" / "setup.log"


STEP = r"\.\.\. done in \d+ s"


def test_a_fresh_setup_prints_one_line_per_step_and_logs_the_tools_output(tmp_path):
    result, log = setup(tmp_path, venv_exists=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    expected = [
        rf"\[setup\] the tools' own output goes to {re.escape(str(log))} \(VERBOSE=1 prints it here\)",
        rf"\[setup\] making the virtual environment {tmp_path}/venv {STEP} \(kept: skipped next time\)",
        rf"\[setup\] installing torch 2\.13\.0 {STEP} \(kept in {tmp_path}/venv: skipped next time\)",
        rf"\[setup\] installing zero-lab \(pip install -e \.\[test\], builds megatron\.data\.helpers\) {STEP} "
        r"\(checked again next time: seconds\)",
        # no mpiexec on this PATH; libaio's headers as this machine has them
        rf"\[setup\] installing mpich \(mpiexec\)(, libaio-dev \(NVMe offload\))? from Debian {STEP} "
        r"\(installed: skipped next time\)",
        rf"\[setup\] building DeepSpeed's deepspeed_shm_comm, the one op the main job loads \(the others at first "
        rf"use\) {STEP} \(cached in {tmp_path}/ext: seconds next time\)",
        rf"\[setup\] done in \d+ s: activate with 'source {tmp_path}/venv/bin/activate'",
    ]
    assert len(lines) == len(expected), result.stdout
    for line, pattern in zip(lines, expected):
        assert re.fullmatch(pattern, line), (line, pattern)
    text = log.read_text()
    for tools_output in ("pip: install --quiet --disable-pip-version-check torch==2.13.0",
                         "pip: a warning", "(Reading database ... 5%", "ninja: [3/3] c++ -shared"):
        assert tools_output in text and tools_output not in result.stdout
    assert re.search(r"^===== scripts/setup\.sh, \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC, VENV_DIR=", text, re.M)
    assert f"PATH={tmp_path}/bin" not in result.stdout  # the op build's environment stays in the log
    assert "--- building DeepSpeed's deepspeed_shm_comm, the one op the main job loads (the others at first use): " \
           "env DS_ACCELERATOR=cpu PATH=" in text
    assert (tmp_path / "apt-calls").read_text().splitlines()[0] == "apt-get update -qq"


def test_a_second_run_appends_to_the_log(tmp_path):
    first, log = setup(tmp_path, TORCH="2.13.0")
    first_log = log.read_text()
    second, _ = setup(tmp_path, TORCH="2.13.0")
    assert first.returncode == second.returncode == 0
    assert log.read_text().startswith(first_log) and log.read_text().count("===== scripts/setup.sh, ") == 2
    assert "[setup] torch 2.13.0 (cpu) is already installed" in second.stdout.splitlines()


def test_a_failed_step_names_the_log_in_one_error_line_after_the_end_of_its_output(tmp_path):
    result, log = setup(tmp_path, TORCH="2.13.0", PIP_EXIT=3)
    assert result.returncode == 1
    step = "installing zero-lab (pip install -e .[test], builds megatron.data.helpers)"
    assert re.fullmatch(rf"\[setup\] {re.escape(step)} \.\.\. failed after \d+ s", result.stdout.splitlines()[-1])
    errors = result.stderr.splitlines()
    assert errors[-1] == f"error: {step} failed (exit 3); its output: {log}"
    assert errors[:-1] == ["    pip: install --quiet --disable-pip-version-check -c constraints.txt -e .[test]",
                           "    pip: a warning"]  # the failed step's output, none of the log's earlier lines
    assert log.read_text().endswith(f"--- {step}: pip_install -c constraints.txt -e .[test]\n"
                                    "pip: install --quiet --disable-pip-version-check -c constraints.txt -e .[test]\n"
                                    "pip: a warning\n")


@pytest.mark.parametrize("pip_error, last_line", [
    ("ERROR: No matching distribution found for tqdm==4.67.1",
     "error: WHEELHOUSE={wheelhouse} has no wheel for tqdm==4.67.1 for Python 3.11.7: rebuild it with 'bash "
     "scripts/wheelhouse.sh DIR --python-version X.Y' on a machine with package access"),
    ("ERROR: disk full",
     "error: installing zero-lab (pip install -e .[test], builds megatron.data.helpers) from WHEELHOUSE failed "
     "(exit 1); its output: {log}"),
])
def test_a_failed_install_from_a_wheelhouse_names_the_missing_wheel_or_the_log(tmp_path, pip_error, last_line):
    wheelhouse = tmp_path / "wheels"
    wheelhouse.mkdir()
    result, log = setup(tmp_path, TORCH="2.13.0", WHEELHOUSE=wheelhouse, PIP_EXIT=1, PIP_ERROR=pip_error)
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == last_line.format(wheelhouse=wheelhouse, log=log)
    assert ("    " + pip_error in result.stderr.splitlines()) == ("disk" in pip_error)


@pytest.mark.parametrize("pip_exit", [0, 3])
def test_verbose_shows_every_command_and_its_output(tmp_path, pip_exit):
    result, log = setup(tmp_path, venv_exists=False, VERBOSE=1, PIP_EXIT=pip_exit)
    assert "[setup] installing torch 2.13.0: pip_install torch==2.13.0\n" in result.stdout
    assert "pip: install --quiet --disable-pip-version-check torch==2.13.0\n" in result.stdout
    assert "pip: a warning\n" in result.stderr
    assert not log.exists()
    if pip_exit:
        assert result.returncode == 1
        assert result.stderr.splitlines()[-1] == "error: installing torch 2.13.0 failed (exit 3); its output is above"
    else:
        assert result.returncode == 0, result.stderr
        assert f"PATH={tmp_path}/venv/bin:{tmp_path}/bin " in result.stdout  # the op build's whole command
        assert "ninja: [3/3] c++ -shared\n" in result.stdout
        assert re.search(r"^\[setup\] building DeepSpeed's deepspeed_shm_comm, the one op the main job loads "
                         r"\(the others at first use\): done in \d+ s", result.stdout, re.M)


NO_ENSUREPIP_PYTHON = """#!/bin/sh
case "$*" in
    "-m venv --clear --without-pip "*) exit 0 ;;
    "-m venv "*) echo "Error: Command '-Im ensurepip' returned non-zero exit status 1." >&2; exit 1 ;;
    *) echo "pip: no network" >&2; exit 1 ;;
esac
"""


def test_a_note_from_inside_a_step_gets_a_line_of_its_own(tmp_path):
    """Debian's Python without python3-venv: `-m venv` fails, and here its pip cannot add pip either."""
    python = tmp_path / "no-ensurepip" / "python3"
    python.parent.mkdir()
    tool(python.parent, "python3", NO_ENSUREPIP_PYTHON)
    result, _ = setup(tmp_path, venv_exists=False, PYTHON=python)
    assert result.returncode == 1
    assert result.stdout.splitlines()[1:] == [
        f"[setup] making the virtual environment {tmp_path}/venv ... ",
        f"[setup] {python} -m venv failed (Error: Command '-Im ensurepip' returned non-zero exit status 1.): "
        f"adding pip to {tmp_path}/venv by hand"]
    assert result.stderr.splitlines() == [f"error: PYTHON={python} has no ensurepip and its pip cannot install pip "
                                          f"into {tmp_path}/venv: install python3-venv"]


def test_the_setup_builds_only_the_op_the_main_job_loads(tmp_path):
    """The main job (ZeRO-1, fp32, no offload, on the CPU accelerator) loads one DeepSpeed op, the shared-memory
    collectives of deepspeed.init_distributed: the set-up builds that one; cpu_adam, async_io and pin_memory
    are built at their first use (megatron/deepspeed_ops.py)."""
    result, _ = setup(tmp_path, venv_exists=False, SETUP_DRY_RUN=1)
    assert result.returncode == 0, result.stderr
    venv = tmp_path / "venv"
    *_, build, done = result.stdout.splitlines()
    assert build == (f"[setup] env DS_ACCELERATOR=cpu PATH={venv}/bin:{tmp_path}/bin {venv}/bin/python -m "
                     "megatron.deepspeed_ops build deepspeed_shm_comm")
    assert done.startswith("[setup] done in ")
    for other in ("cpu_adam", "CPUAdam", "async_io", "AsyncIO", "pin_memory", "PinMemory"):
        assert other not in result.stdout
