"""Set-up for GPU machines, checked without a GPU: which torch scripts/setup.sh installs (a fake
nvidia-smi on PATH, SETUP_DRY_RUN=1 so nothing is installed), the offline wheelhouse install
(slow: builds a wheelhouse from the package index, then installs from it with pip's network off),
and the commands of the GPU acceptance run (bench/gpu_suite.sh --dry-run)."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT, test_env

# every test here runs the set-up or suite scripts in a subprocess (about 3 s each): the full tier only
pytestmark = pytest.mark.slow

SETUP = REPO_ROOT / "scripts" / "setup.sh"
NVIDIA_SMI_HEADER = """#!/bin/sh
echo "+-----------------------------------------------------------------------------------------+"
echo "| NVIDIA-SMI 580.159.04             Driver Version: 580.159.04     CUDA Version: {cuda}     |"
"""


def fake_nvidia_smi(folder: Path, script: str) -> Path:
    folder.mkdir(exist_ok=True)
    tool = folder / "nvidia-smi"
    tool.write_text(script)
    tool.chmod(0o755)
    return folder


def dry_setup(tmp_path, path_prefix=None, **env):
    """scripts/setup.sh in dry-run mode for a venv that does not exist yet."""
    overrides = dict(SETUP_DRY_RUN=1, VENV_DIR=tmp_path / "venv", **env)
    environment = test_env(**overrides)
    if path_prefix is not None:
        environment["PATH"] = f"{path_prefix}{os.pathsep}{environment['PATH']}"
    result = subprocess.run(["bash", str(SETUP)], env=environment, capture_output=True, text=True, timeout=120)
    assert not (tmp_path / "venv").exists(), "a dry run created the venv"
    return result


def bare_python(tmp_path) -> Path:
    """An interpreter that imports no torch: a venv without pip (made in about a second)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True)
    return tmp_path / "bare" / "bin" / "python"


@pytest.mark.parametrize("driver_cuda, index", [("13.0", "cu130"), ("12.9", "cu128"), ("12.6", "cu126")])
def test_setup_installs_the_cuda_torch_the_driver_runs(tmp_path, driver_cuda, index):
    bin_dir = fake_nvidia_smi(tmp_path / "bin", NVIDIA_SMI_HEADER.format(cuda=driver_cuda))
    result = dry_setup(tmp_path, bin_dir)
    assert result.returncode == 0, result.stderr
    assert f"[setup] pip_install torch==2.13.0 --index-url https://download.pytorch.org/whl/{index}\n" in result.stdout
    assert "[setup] pip_install -c constraints.txt -e .[test]" in result.stdout


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has a real nvidia-smi")
def test_setup_without_a_gpu_installs_the_pinned_torch_as_today(tmp_path):
    result = dry_setup(tmp_path)
    assert result.returncode == 0, result.stderr
    assert "[setup] pip_install torch==2.13.0\n" in result.stdout
    assert "index-url" not in result.stdout


@pytest.mark.parametrize("driver_cuda", ["12.2", "12.4", "12.0"])  # R535, R550, R525
def test_setup_installs_the_oldest_12x_build_on_an_older_12x_driver(tmp_path, driver_cuda):
    bin_dir = fake_nvidia_smi(tmp_path / "bin", NVIDIA_SMI_HEADER.format(cuda=driver_cuda))
    fake_nvcc(bin_dir, "12.4")
    result = dry_setup(tmp_path, bin_dir, CUDA_HOME="", CUDA_PATH="")
    assert result.returncode == 0, result.stderr
    assert "[setup] pip_install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126\n" in result.stdout
    assert result.stderr.splitlines() == [
        f"[setup] the driver runs CUDA {driver_cuda}; torch's cu126 build runs on it through CUDA minor-version "
        "compatibility (driver >= 525)"]


def test_setup_stops_on_a_driver_older_than_every_cuda_build(tmp_path):
    bin_dir = fake_nvidia_smi(tmp_path / "bin", NVIDIA_SMI_HEADER.format(cuda="11.8"))
    result = dry_setup(tmp_path, bin_dir)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: the NVIDIA driver runs CUDA 11.8, older than every CUDA build of torch 2.13.0 (13.0, 12.8, 12.6): "
        "update the driver, or set TORCH_INDEX_URL"]
    assert "pip_install" not in result.stdout


def test_setup_falls_back_to_the_cpu_build_when_nvidia_smi_fails(tmp_path):
    bin_dir = fake_nvidia_smi(tmp_path / "bin", "#!/bin/sh\necho \"NVIDIA-SMI has failed because it couldn't "
                                                "communicate with the NVIDIA driver.\"\nexit 9\n")
    result = dry_setup(tmp_path, bin_dir)
    assert result.returncode == 0, result.stderr
    assert "warning: nvidia-smi failed (NVIDIA-SMI has failed because" in result.stderr
    assert "[setup] pip_install torch==2.13.0\n" in result.stdout


def test_setup_from_a_wheelhouse_keeps_the_torch_of_python_and_installs_offline(tmp_path):
    wheelhouse = tmp_path / "wheels"
    wheelhouse.mkdir()
    base_site = subprocess.run([sys.executable, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip()
    result = dry_setup(tmp_path, WHEELHOUSE=wheelhouse)  # PYTHON is this test's interpreter, which has torch
    assert result.returncode == 0, result.stderr
    assert re.search(r"^\[setup\] keeping torch 2\.\d+\.\d+\S* of PYTHON=", result.stdout, re.M)
    assert re.search(rf"^\[setup\] link_site_packages {tmp_path}/venv/lib/python3\.\d+/site-packages/"
                     rf"zero_lab_base\.pth "
                     rf"{re.escape(base_site)}$", result.stdout, re.M)
    assert f"[setup] pip_install --no-index --find-links {wheelhouse} -e .[test]" in result.stdout
    assert "torch==" not in result.stdout  # never a torch download


def test_setup_from_a_wheelhouse_without_any_torch_is_one_line(tmp_path):
    wheelhouse = tmp_path / "wheels"
    wheelhouse.mkdir()
    result = dry_setup(tmp_path, WHEELHOUSE=wheelhouse, PYTHON=bare_python(tmp_path))
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: WHEELHOUSE={wheelhouse}: neither ")
    assert "install torch >= 2.11, < 2.14 first" in lines[0]


def test_setup_with_a_missing_wheelhouse_folder_is_one_line(tmp_path):
    result = dry_setup(tmp_path, WHEELHOUSE=tmp_path / "nowhere")
    assert result.returncode == 1
    assert result.stderr.strip() == (f"error: WHEELHOUSE={tmp_path}/nowhere: no such folder "
                                     "(make one with scripts/wheelhouse.sh)")


WHEELHOUSE_USAGE = "usage: scripts/wheelhouse.sh DIR [--python-version X.Y] [--present FILE] [--no-test]"


@pytest.mark.parametrize("args, message", [
    ([], f"error: no folder given ({WHEELHOUSE_USAGE})"),
    (["wh", "--python-version", "3"], "error: --python-version 3: expected 3.N, such as 3.12"),
    (["wh", "--platform", "x"], f"error: unknown option --platform ({WHEELHOUSE_USAGE})"),
    (["wh", "--present", "nowhere.txt"], f"error: --present nowhere.txt: no such file ({WHEELHOUSE_USAGE})"),
])
def test_wheelhouse_rejects_bad_arguments_in_one_line(tmp_path, args, message):
    result = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "wheelhouse.sh"), *args], cwd=tmp_path,
                            env=test_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip() == message
    assert list(tmp_path.iterdir()) == []


def copy_of_repo(destination: Path) -> Path:
    """The repository's files (tracked and not ignored) without its .venv or build outputs."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO_ROOT,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, files):
        source = REPO_ROOT / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)
    return destination


def offline_env(**overrides):
    """pip with no index and no configuration (so no find-links of this machine either)."""
    env = test_env(PIP_NO_INDEX="1", PIP_CONFIG_FILE=os.devnull, **overrides)
    for name in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_INDEX_URL", "PYTHONPATH", "VIRTUAL_ENV"):
        env.pop(name, None)
    return env


@pytest.mark.network  # pip downloads every wheel and a torch from the package index
def test_wheelhouse_installs_offline_next_to_a_preinstalled_torch(tmp_path):
    wheelhouse = tmp_path / "wheelhouse"
    built = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "wheelhouse.sh"), str(wheelhouse)],
                           env=test_env(), capture_output=True, text=True, timeout=1200)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    names = sorted(path.name for path in wheelhouse.iterdir())
    assert not [name for name in names if name.startswith("torch-")]
    for needed in ("deepspeed-0.19.8-py3-none-any.whl", "pybind11-3.1.0-", "setuptools-", "wheel-", "pytest-9.2.0-"):
        assert any(name.startswith(needed) for name in names), (needed, names)
    assert not list(tmp_path.glob("wheelhouse.partial.*"))

    # The GPU image's torch, played by torch 2.13.0 (CPU) in a venv of its own, from pip's normal source.
    base = tmp_path / "base"
    subprocess.run([sys.executable, "-m", "venv", str(base)], check=True)
    subprocess.run([str(base / "bin" / "python"), "-m", "pip", "install", "--quiet", "torch==2.13.0"], check=True,
                   env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}, timeout=900)
    repo = copy_of_repo(tmp_path / "repo")
    setup = repo / "scripts" / "setup.sh"

    # --present leaves out a pin present at its version (tqdm) and an unpinned dependency present at
    # any version (pyyaml); it keeps a pin present at another version (numpy) and the build
    # requirements (setuptools). On a target without them, the install names a missing wheel.
    present = tmp_path / "present.txt"
    present.write_text("tqdm==4.70.1\nPyYAML==1.0\nnumpy==1.0\nsetuptools==1.0\n")
    short = tmp_path / "short"
    built = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "wheelhouse.sh"), str(short), "--present",
                            str(present)], env=test_env(), capture_output=True, text=True, timeout=1200)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    assert ("[wheelhouse] left out, present on the target: pyyaml (target has 1.0), tqdm (target has 4.70.1)"
            in built.stdout)
    short_names = sorted(path.name for path in short.iterdir())
    assert short_names == [name for name in names if not name.startswith(("tqdm-", "pyyaml-", "PyYAML-"))]
    failed = subprocess.run(["bash", str(setup)], capture_output=True, text=True, timeout=900,
                            env=offline_env(WHEELHOUSE=short, VENV_DIR=tmp_path / "v1", PYTHON=base / "bin" / "python"))
    assert failed.returncode == 1
    last = failed.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"error: WHEELHOUSE={short} has no wheel for (?i:tqdm|pyyaml)\S* "
                        r"for Python 3\.\d+\.\d+: rebuild it "
                        r"with 'bash scripts/wheelhouse.sh DIR --python-version X.Y' on a machine with package access",
                        last), last

    venv = tmp_path / "v2"
    result = subprocess.run(["bash", str(setup)], capture_output=True, text=True, timeout=1200,
                            env=offline_env(WHEELHOUSE=wheelhouse, VENV_DIR=venv, PYTHON=base / "bin" / "python"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "keeping torch 2.13.0" in result.stdout
    check = subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "import torch, deepspeed, transformers, megatron.data.helpers, megatron.model; "
         "print(torch.__file__); print(deepspeed.__version__); print(megatron.data.helpers.__file__)"],
        cwd=tmp_path, capture_output=True, text=True, env=offline_env(DS_ACCELERATOR="cpu"), timeout=300)
    assert check.returncode == 0, check.stderr[-3000:]
    torch_file, ds_version, helpers_file = check.stdout.split()
    assert torch_file.startswith(str(base))  # the preinstalled torch, not a second copy
    assert ds_version == "0.19.8"
    assert helpers_file.startswith(str(repo))  # compiled at install time from the copy's source


def test_gpu_suite_dry_run_prints_every_command_and_runs_none(tmp_path):
    runs = tmp_path / "runs"
    result = subprocess.run(["bash", str(REPO_ROOT / "bench" / "gpu_suite.sh"), "--dry-run"],
                            env=test_env(SUITE_RUNS=runs), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    commands = [line[2:] for line in result.stdout.splitlines() if line.startswith("+ ")]
    drivers = re.findall(r"MODEL_SIZE=(\S+) SEQ_LEN=1024 PRECISION=bf16 .*TRAIN_ITERS=60 .* "
                         r"bash examples_zero/gpt_deepspeed_(\w+)\.sh --save ''$", "\n".join(commands), re.M)
    assert drivers == [(model, experiment) for model in ("125M", "355M")
                       for experiment in ("DP", "Z1", "Z2", "Z3", "Z3_OL")]
    assert commands[0] == f"rm -rf {runs}"
    assert "bench/bench_gpt_vs_hf.py" in commands[11] and "--bf16" in commands[11] and "--compile" not in commands[11]
    assert "--compile" in commands[12]
    assert commands[13].endswith(f"analysis/summarize.py {runs}")
    assert re.search(r"bench/gpu_suite_report\.py --runs \S+ --out \S+/bench/results/\S+\.md --iters 60", commands[14])
    assert len(commands) == 15
    assert not runs.exists()


def test_gpu_suite_runs_only_the_parts_asked_for_and_keeps_earlier_runs(tmp_path):
    result = subprocess.run(["bash", str(REPO_ROOT / "bench" / "gpu_suite.sh"), "--dry-run", "--only", "355M,report"],
                            env=test_env(SUITE_RUNS=tmp_path), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    commands = [line[2:] for line in result.stdout.splitlines() if line.startswith("+ ")]
    assert len(commands) == 7 and not any(command.startswith("rm ") for command in commands)
    assert all("MODEL_SIZE=355M" in command for command in commands[:5])
    assert "summarize.py" in commands[5] and "gpu_suite_report.py" in commands[6]


SUITE_USAGE = "usage: bench/gpu_suite.sh [--dry-run] [--only PARTS | --quick | --perf]"


@pytest.mark.parametrize("args, message", [
    (["--fast"], f"error: unknown argument --fast ({SUITE_USAGE})"),
    (["--quick", "--only", "bench"],
     f"error: --quick and --perf run their own parts: leave out --only ({SUITE_USAGE})"),
    (["--only", "125M,1.3B"], "error: --only 125M,1.3B: unknown part 1.3B (expected: 125M, 355M, bench, report)"),
])
def test_gpu_suite_rejects_bad_arguments_in_one_line(args, message):
    result = subprocess.run(["bash", str(REPO_ROOT / "bench" / "gpu_suite.sh"), *args], env=test_env(),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip() == message


def test_gpu_suite_report_says_what_did_not_run(tmp_path):
    out = tmp_path / "results" / "some-gpu.md"
    (tmp_path / "runs").mkdir()
    result = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "gpu_suite_report.py"), "--runs",
                             str(tmp_path / "runs"), "--out", str(out), "--iters", "60", "--models", "125M",
                             "--micro-batch", "4", "--failed", "bash x.sh"],
                            env=test_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    text = out.read_text()
    for heading in ("# GPU acceptance run: some-gpu", "## Machine", "## Versions", "## ZeRO drivers",
                    "## Failed steps"):
        assert heading in text
    assert "GPT-2 125M, seq 1024, bf16, micro-batch 4, 60 iterations per driver" in text
    assert "(no summary.md: the summary did not run)" in text
    assert "(no bench_gpt_vs_hf.json: the bench did not finish)" in text
    assert "- `bash x.sh`" in text
    assert sorted(p.name for p in out.parent.iterdir()) == ["some-gpu.md"]


def test_offload_on_cuda_without_the_cuda_toolkit_is_one_line_naming_it():
    from megatron.optimizer import OptimizerBuildError, check_cpu_adam_buildable

    check_cpu_adam_buildable("cpu", None, None, None)  # the CPU accelerator's build needs no toolkit
    check_cpu_adam_buildable("cuda", "/usr/local/cuda", "13.0", nvcc_output("13.0"))
    with pytest.raises(OptimizerBuildError) as error:
        check_cpu_adam_buildable("cuda", None, "13.0", None)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("--zero-offload-optimizer on CUDA needs DeepSpeed's cpu_adam op")
    assert "install the toolkit for CUDA 13.0" in message and "set CUDA_HOME" in message


def nvcc_output(release: str) -> str:
    """`nvcc --version` as CUDA 13.0's prints it (this machine's /usr/local/cuda-13.0), at another release."""
    return ("nvcc: NVIDIA (R) Cuda compiler driver\nCopyright (c) 2005-2025 NVIDIA Corporation\n"
            "Built on Wed_Aug_20_01:58:59_PM_PDT_2025\n"
            f"Cuda compilation tools, release {release}, V{release}.88\nBuild cuda_{release}.r{release}/compiler.36424714_0\n")


@pytest.mark.parametrize("nvcc, torch_cuda, refused", [
    ("13.0", "13.0", False), ("12.4", "12.8", False), ("12.9", "12.6", False),  # DeepSpeed accepts 12.x with 12.y
    ("12.8", "13.0", True), ("13.0", "12.8", True), ("11.8", "12.6", True),
    ("13.1", "13.0", True),  # DeepSpeed 0.19.8's table has no 13.x: minors must match
])
def test_offload_refuses_an_nvcc_of_another_cuda_than_torch_in_one_line(nvcc, torch_cuda, refused):
    from megatron.optimizer import OptimizerBuildError, check_cpu_adam_buildable

    if not refused:
        check_cpu_adam_buildable("cuda", "/opt/cuda", torch_cuda, nvcc_output(nvcc))
        return
    with pytest.raises(OptimizerBuildError) as error:
        check_cpu_adam_buildable("cuda", "/opt/cuda", torch_cuda, nvcc_output(nvcc))
    assert str(error.value) == (
        "--zero-offload-optimizer on CUDA needs DeepSpeed's cpu_adam op, compiled at first use by /opt/cuda/bin/nvcc: "
        f"that nvcc is CUDA {nvcc} but torch was built for CUDA {torch_cuda}, and DeepSpeed builds only with a "
        f"matching CUDA; install the CUDA {torch_cuda} toolkit and set CUDA_HOME to it, or the torch build that "
        "matches this nvcc (scripts/setup.sh picks it; docs/gpu.md)")


def test_offload_check_reads_nvcc_of_cuda_home_and_agrees_with_deepspeed(tmp_path, monkeypatch):
    from deepspeed.ops.op_builder import builder

    from megatron.optimizer import OptimizerBuildError, check_cpu_adam_buildable, nvcc_version_text

    fake_nvcc(tmp_path / "cuda" / "bin", "12.8")
    text = nvcc_version_text(str(tmp_path / "cuda"))
    assert "release 12.8, V12.8.88" in text
    assert nvcc_version_text(str(tmp_path / "nowhere")) is None
    with pytest.raises(OptimizerBuildError):
        check_cpu_adam_buildable("cuda", str(tmp_path / "cuda"), "13.0", text)
    monkeypatch.setenv("DS_SKIP_CUDA_CHECK", "1")  # DeepSpeed's own override is honoured
    check_cpu_adam_buildable("cuda", str(tmp_path / "cuda"), "13.0", text)
    # DeepSpeed's own check, with its nvcc and torch's CUDA played by these versions, refuses the same pairs
    monkeypatch.delenv("DS_SKIP_CUDA_CHECK")
    for nvcc, torch_cuda, refused in (("12.8", "13.0", True), ("13.1", "13.0", True), ("12.4", "12.8", False)):
        monkeypatch.setattr(builder, "installed_cuda_version", lambda name="", v=nvcc: tuple(map(int, v.split("."))))
        monkeypatch.setattr(builder.torch.version, "cuda", torch_cuda)
        if refused:
            with pytest.raises(builder.CUDAMismatchException):
                builder.assert_no_cuda_mismatch()
        else:
            assert builder.assert_no_cuda_mismatch()


def fake_nvcc(folder: Path, release: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tool = folder / "nvcc"
    tool.write_text(f"#!/bin/sh\ncat <<'EOF'\n{nvcc_output(release)}EOF\n")
    tool.chmod(0o755)
    return folder


@pytest.mark.parametrize("driver_cuda, nvcc, index, warning", [
    ("13.0", "12.8", "cu128", None),  # the toolkit's major, not the driver's newest: CPU Adam builds
    ("13.0", "13.0", "cu130", None),
    ("12.9", "12.4", "cu128", None),  # DeepSpeed builds with any 12.x for a 12.y torch
    ("13.0", "11.8", "cu130", "[setup] warning: nvcc is CUDA 11.8 but torch is built for CUDA 13.0: offload (the "
                              "Z3_OL driver) compiles DeepSpeed's CPU Adam with nvcc and needs the CUDA 13.0 toolkit "
                              "as CUDA_HOME"),
    ("13.0", None, "cu130", "[setup] warning: no CUDA toolkit (nvcc) found: offload (the Z3_OL driver) compiles "
                            "DeepSpeed's CPU Adam with nvcc and needs the CUDA 13.0 toolkit, as CUDA_HOME or nvcc "
                            "on PATH"),
])
def test_setup_picks_the_cuda_build_that_nvcc_matches(tmp_path, driver_cuda, nvcc, index, warning):
    bin_dir = fake_nvidia_smi(tmp_path / "bin", NVIDIA_SMI_HEADER.format(cuda=driver_cuda))
    if nvcc is None:  # CUDA_HOME names where torch looks first: a folder without nvcc
        result = dry_setup(tmp_path, bin_dir, CUDA_HOME=tmp_path / "no-toolkit")
    else:  # nvcc on PATH, as torch finds it without CUDA_HOME
        fake_nvcc(bin_dir, nvcc)
        environment_without_cuda_home = {"CUDA_HOME": "", "CUDA_PATH": ""}
        result = dry_setup(tmp_path, bin_dir, **environment_without_cuda_home)
    assert result.returncode == 0, result.stderr
    assert f"[setup] pip_install torch==2.13.0 --index-url https://download.pytorch.org/whl/{index}\n" in result.stdout
    assert [line for line in result.stderr.splitlines() if "nvcc" in line] == ([warning] if warning else [])


def python_without_ensurepip(folder: Path) -> Path:
    """This interpreter's binary and standard library, less ensurepip: what Debian and Ubuntu
    install without python3-venv, so `-m venv` fails for real."""
    import sysconfig

    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    binary = Path(sys._base_executable).resolve()
    (folder / "bin").mkdir(parents=True)
    shutil.copy2(binary, folder / "bin" / version)
    shutil.copytree(sysconfig.get_paths()["stdlib"], folder / "lib" / version,
                    ignore=shutil.ignore_patterns("ensurepip", "site-packages", "dist-packages", "__pycache__"))
    python = folder / "bin" / version
    probe = subprocess.run([str(python), "-c", "import ensurepip"], capture_output=True, text=True)
    if "No module named 'ensurepip'" not in probe.stderr:
        pytest.skip(f"a copy of {binary} does not start from its copied standard library: {probe.stderr[-300:]}")
    return python


@pytest.mark.slow
def test_setup_makes_a_venv_with_pip_where_python_has_no_ensurepip(tmp_path):
    python = python_without_ensurepip(tmp_path / "python")
    wheelhouse = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "-d",
                    str(wheelhouse), "pip"], check=True, timeout=300)
    venv = tmp_path / "venv"
    result = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=300,
                            env=offline_env(WHEELHOUSE=wheelhouse, VENV_DIR=venv, PYTHON=python))
    assert f"[setup] {python} -m venv failed (The virtual environment was not created successfully" in result.stdout \
        or f"[setup] {python} -m venv failed (Error: " in result.stdout, result.stdout
    pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "--version"], capture_output=True, text=True)
    assert pip.returncode == 0 and str(venv) in pip.stdout, pip.stdout + pip.stderr
    # then the set-up stops where it must: this Python has no torch and the wheelhouse none
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: WHEELHOUSE={wheelhouse}: neither ")
