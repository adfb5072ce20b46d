"""Fixtures shared by the whole suite: paths, the real dolly sample, a prepared dataset."""
import contextlib
import importlib.util
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from filelock import FileLock

from megatron.deepspeed_ops import use_environment_extensions

REPO_ROOT = Path(__file__).resolve().parent.parent
DOLLY_SAMPLE = REPO_ROOT / "data" / "samples" / "dolly-sample.jsonl"
DOLLY_SAMPLE_RECORDS = 382

# This interpreter's tools first on PATH, for the tests and every subprocess they start: torch
# builds DeepSpeed's C++ ops with the first `ninja` found, and two different ninjas (the venv's
# and Debian's) invalidate each other's builds, making every multi-rank start rebuild them.
os.environ["PATH"] = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")
# DeepSpeed's ops built and found where the ranks build them, the environment's own folder, also for the tests
# that load an op in-process and the processes they start (scripts/test.sh builds them all before the suite)
use_environment_extensions()


def test_env(**overrides):
    """Environment for subprocesses: CPU accelerator, this repo importable, no hub access, no start-up probes.
    The probes (2-3 s of every rank at each start) feed only the prediction and time lines (docs/log-lines.md):
    a run whose test reads those, or a summary column made from them, sets ZERO_LAB_SKIP_PROBES=0."""
    env = dict(os.environ)
    env.update(
        DS_ACCELERATOR="cpu",
        PYTHONPATH=str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        HF_HUB_OFFLINE="1",
        PYTHON=sys.executable,
        PATH=str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", ""),
        ZERO_LAB_SKIP_PROBES="1",
    )
    env.update({k: str(v) for k, v in overrides.items()})
    return env


test_env.__test__ = False  # a helper, not a test, although its name starts with test_


# scripts/test.sh runs the suite in two pytest-xdist workers, each a process of its own. Each test file runs in one
# worker (its module fixtures run once), the files that make network namespaces (the virtual cluster's fixed
# addresses, its /scratch, its Slurm) all in one, one after another; the longest start first, so that neither
# worker is left with a long file at the end: FILE_SECONDS is each file's time in a serial run of the suite (setup
# and teardown included; a file missing from it counts as 0 s). A run the suite shares (the session fixtures
# below) is made once, by the first worker that asks, under a file lock (made_once). TEST_WORKERS=0 runs the suite
# in one process: the same order, the same code.
NAMESPACE_FILES = {"test_virtual_cluster.py", "test_multi_node.py", "test_slurm.py", "test_chaos_bench.py"}
FILE_SECONDS = json.loads((Path(__file__).parent / "file_seconds.json").read_text())


def _file_group(name: str) -> str:
    return "namespaces" if name in NAMESPACE_FILES else name


def _group_seconds() -> dict[str, int]:
    seconds = {}
    for name, spent in FILE_SECONDS.items():
        seconds[_file_group(name)] = seconds.get(_file_group(name), 0) + spent
    return seconds


def pytest_collection_modifyitems(items):
    """The files' groups longest first (a stable sort: each file's tests keep their order)."""
    seconds = _group_seconds()
    items.sort(key=lambda item: -seconds.get(_file_group(item.path.name), 0))


@pytest.hookimpl(optionalhook=True)  # a hook of xdist's: unknown, and never called, where xdist is not installed
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class FileGroups(LoadScopeScheduling):
        """xdist's scheduling by scope, a scope being a file's group, in the collection's order."""

        def __init__(self, config, log=None):
            config.option.loadscopereorder = False  # the collection's order is already longest first
            super().__init__(config, log)

        def _split_scope(self, nodeid: str) -> str:
            return _file_group(Path(nodeid.split("::", 1)[0]).name)

    return FileGroups(config, log)


def shared_folder(tmp_path_factory) -> Path:
    """The folder every worker of this session sees: the base temporary folder, or its parent under xdist (each
    worker's own is popen-gwN inside it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def made_once(tmp_path_factory, name: str, make):
    """make(folder) run once per session across the workers, in the shared folder `name`; its JSON result
    (written after it returns, so a half-made folder is never read as made) is what every caller gets."""
    root = shared_folder(tmp_path_factory)
    folder, result = root / name, root / f"{name}.json"
    with FileLock(str(root / f"{name}.lock")):
        if not result.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            result.write_text(json.dumps(make(folder)))
        return json.loads(result.read_text())


def process_result(run: subprocess.CompletedProcess) -> dict:
    """A finished subprocess as JSON (made_once's results)."""
    return {"args": [str(arg) for arg in run.args], "returncode": run.returncode, "stdout": run.stdout,
            "stderr": run.stderr}


def completed_process(saved: dict) -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess(saved["args"], saved["returncode"], saved["stdout"], saved["stderr"])


def _planner_argv(script: Path, args) -> list[str] | None:
    """The launch planner's arguments for a launch script (megatron/launch/plan.py), None for another script."""
    script = Path(script).resolve()
    if script.parent == REPO_ROOT / "examples_zero" and script.name.startswith("gpt_deepspeed_"):
        return ["driver", script.stem.removeprefix("gpt_deepspeed_"), "--", *map(str, args)]
    if script == REPO_ROOT / "ALCF" / "train-gpt3.sh":
        return ["alcf", "--", *map(str, args)]
    if script.parent == REPO_ROOT / "ALCF" and script.stem in ("models", "args", "launch"):
        return ["alcf", "--show", script.stem, "--", *map(str, args)]
    if script == REPO_ROOT / "examples_zero" / "slurm" / "train.sbatch":
        return ["slurm", "--", *map(str, args)]
    return None


def launch_script(script: Path, args=(), env: dict | None = None, cwd=REPO_ROOT) -> subprocess.CompletedProcess:
    """A launch script run as `bash SCRIPT ARGS` with `env`. A dry run (DRY_RUN=1) of a script that only hands over
    to the launch planner runs the planner in this process instead: what it prints and its exit status are the
    script's (the scripts' own few lines are run by tests/test_launch_golden.py and the real launches)."""
    env = test_env() if env is None else {key: str(value) for key, value in env.items()}
    argv = _planner_argv(script, args)
    another_python = env.get("PYTHON", sys.executable) != sys.executable  # e.g. one without torch, refused
    if env.get("DRY_RUN") != "1" or argv is None or env.get("VENV_DIR") or another_python:
        return subprocess.run(["bash", str(script), *map(str, args)], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=300)
    from megatron.launch import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main(argv, environ=env)
    return subprocess.CompletedProcess(["bash", str(script), *map(str, args)], status, out.getvalue(), err.getvalue())


@pytest.fixture(scope="session")
def repo_root():
    return REPO_ROOT


@pytest.fixture(scope="session")
def dolly_sample():
    assert DOLLY_SAMPLE.is_file(), f"missing test data {DOLLY_SAMPLE} (committed in data/samples/)"
    return DOLLY_SAMPLE


@pytest.fixture(scope="session")
def dolly_data_dir(tmp_path_factory, dolly_sample):
    """A data folder prepared by the real user command on the dolly sample:
    gpt2-vocab.json, gpt2-merges.txt and dolly_text_document.{bin,idx}."""
    def make(data_dir):
        result = subprocess.run(["bash", str(REPO_ROOT / "tools" / "process_databricks_gpt2.sh")], cwd=REPO_ROOT,
                                env=test_env(DATA_DIR=data_dir, DOLLY_JSONL=dolly_sample), capture_output=True,
                                text=True, timeout=600)
        return process_result(result)

    result = made_once(tmp_path_factory, "dolly_data", make)
    assert result["returncode"] == 0, result["stdout"] + result["stderr"]
    return shared_folder(tmp_path_factory) / "dolly_data"


# Under xdist each worker hands out ports from a range of its own, below the kernel's ephemeral range (32768 up):
# a port one worker picked and has not bound yet is then never the other's pick, nor a connection's local port.
WORKER_PORTS = 3000
_next_port = {}


def free_port() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]
    first = 10000 + WORKER_PORTS * int(worker.removeprefix("gw"))
    for _ in range(WORKER_PORTS):
        port = _next_port.get(worker, first)
        _next_port[worker] = first + (port + 1 - first) % WORKER_PORTS
        with socket.socket() as sock, contextlib.suppress(OSError):
            sock.bind(("127.0.0.1", port))
            return port
    raise RuntimeError(f"no free port in {first}-{first + WORKER_PORTS - 1}")


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} after {timeout} s"
        time.sleep(0.2)


@contextmanager
def waiting_driver_launch(tmp_path):
    """A real launch of the Z1 driver that holds its run folder (runs/gpt_tiny_Z1 under tmp_path): host 0 of a
    two-host torchrun run whose host 1 never comes, so its launcher waits in the rendezvous. Yields (process,
    runs folder, run folder) once it holds the lock and started its attempt; stops its process group after."""
    runs = tmp_path / "runs"
    run_dir = runs / "gpt_tiny_Z1"
    env = test_env(RUNS_DIR=runs, NNODES=2, NODE_RANK=0, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(),
                   DATA_PATH=tmp_path / "no_data_needed_before_the_ranks_meet")
    first = subprocess.Popen(["bash", str(REPO_ROOT / "examples_zero" / "gpt_deepspeed_Z1.sh")], cwd=REPO_ROOT,
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        lock = run_dir / ".zero-lab.lock"
        wait_for(lambda: lock.exists() and lock.read_text().startswith(f"pid {first.pid} "), 60,
                 "the first launch took no lock")
        wait_for(lambda: (run_dir / "command.txt").exists(), 60, "the first launch started no attempt")
        yield first, runs, run_dir
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=30)


@pytest.fixture(scope="session")
def six_driver_runs(dolly_data_dir, tmp_path_factory):
    """`examples_zero/run_all.sh` once for the whole suite: the six ZeRO drivers (tiny model, 2 CPU
    ranks, 2 epochs of 2 iterations on a 2% train split of the dolly sample), then the analysis.
    Returns (runs folder, completed process). With the start-up probes: tests/test_drivers.py reads the prediction
    and time lines, and the summary's time columns come from them."""
    def make(runs_dir):
        env = driver_env(dolly_data_dir, runs_dir, ZERO_LAB_SKIP_PROBES=0)
        return process_result(subprocess.run(["bash", str(REPO_ROOT / "examples_zero" / "run_all.sh")],
                                             cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1200))

    result = made_once(tmp_path_factory, "six_driver_runs", make)
    return shared_folder(tmp_path_factory) / "six_driver_runs", completed_process(result)


@pytest.fixture(scope="session")
def shared_runs(dolly_data_dir, tmp_path_factory):
    """tests/runs.py's memoised runner: a run asked for twice (same flags) runs once per session."""
    from runs import SharedRuns
    return SharedRuns(tmp_path_factory, dolly_data_dir)


@pytest.fixture(scope="session")
def checkpoint_run(shared_runs):
    """tests/runs.py's saved-checkpoint run, which the fault and manifest tests share: its log and checkpoint
    folder (global_step2, 4, 6, 8)."""
    from runs import CHECKPOINT_RUN
    return shared_runs.get(*CHECKPOINT_RUN)


# Tensor, pipeline and sequence parallel layouts of one seeded run (fp32, dropout off: its streams differ per
# TP rank), name -> (ranks, flags); the serial run at ZeRO 0 is the reference. TP=t pads the vocabulary to
# 128/t x t, so every layout has the serial run's 50304 rows and the same initial weights.
PARALLEL_ITERS = 5
TP2 = ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"]
PARALLEL_LAYOUTS = {
    "serial": (1, ["--zero-stage", "0"]),
    "tp2_z1": (2, [*TP2, "--zero-stage", "1"]),
    "tp2_sp_z3": (2, [*TP2, "--sequence-parallel", "--zero-stage", "3"]),
    "pp2_z1": (2, ["--pipeline-model-parallel-size", "2", "--zero-stage", "1"]),
    "tp2_dp2_sp_z2": (4, [*TP2, "--sequence-parallel", "--zero-stage", "2"]),
}


def parallel_pretrain(data_dir, ranks: int, *extra: str) -> subprocess.CompletedProcess:
    """pretrain_gpt.py under torchrun with the layouts' common settings."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
           "--master_port", str(free_port()), str(REPO_ROOT / "pretrain_gpt.py"),
           "--model-size", "tiny", "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
           "--train-iters", str(PARALLEL_ITERS), "--log-interval", "1", "--eval-interval", str(PARALLEL_ITERS),
           "--eval-iters", "1", "--lr", "1e-3", "--seed", "7", "--hidden-dropout", "0", "--attention-dropout", "0",
           "--data-path", str(data_dir / "dolly_text_document"), "--vocab-file", str(data_dir / "gpt2-vocab.json"),
           "--merge-file", str(data_dir / "gpt2-merges.txt"), *extra]
    # no start-up probes: the layouts' tests read the memory, traffic and loss lines, not the time lines
    run = subprocess.run(cmd, env=test_env(OMP_NUM_THREADS="1", ZERO_LAB_SKIP_PROBES="1"), capture_output=True,
                         text=True, timeout=400)
    assert run.returncode == 0, f"{' '.join(extra)}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return run


@pytest.fixture(scope="session")
def parallel_layout_runs(dolly_data_dir, tmp_path_factory):
    """Each of PARALLEL_LAYOUTS run once for the whole suite, saving its last iteration: name -> (stdout,
    checkpoint folder). The parallel-training, conversion and resume tests all read these."""
    def make(root):
        return {name: parallel_pretrain(dolly_data_dir, ranks, *flags, "--save", str(root / name)).stdout
                for name, (ranks, flags) in PARALLEL_LAYOUTS.items()}

    root = shared_folder(tmp_path_factory) / "layouts"
    return {name: (stdout, root / name) for name, stdout in made_once(tmp_path_factory, "layouts", make).items()}


@pytest.fixture(scope="session")
def two_hosts():
    """tools/virtual_cluster.py's cluster for the suite: two hosts (node0, node1) made of namespaces, each
    mapping its own name to 127.0.1.1 as Debian and Ubuntu do, a per-host /scratch, a real Slurm (slurmctld on
    node0, a slurmd on each) and sshd on each (for MPICH's mpiexec). Taken down at the end, also after failures;
    without root the tests that need it skip with the tool's reason."""
    from tools.vcluster import ClusterError, VirtualCluster
    try:
        cluster = VirtualCluster.up(hosts=2, name="zltest", loopback_hostname=True, scratch="/scratch", slurm=True,
                                    ssh=True)
    except ClusterError as err:
        pytest.skip(f"no virtual cluster here: {err}")
    try:
        yield cluster
    finally:
        cluster.down()


# an iteration line's loss; not anchored at a line start: mpiexec may forward a rank's line behind another's
ITERATION_LOSS = re.compile(r" iteration +(\d+)/ +\d+ \|.*?\| lm loss: (\S+) \|")


def iteration_losses(text: str) -> dict[int, str]:
    """{iteration: loss as printed}; compared as text, i.e. to the last printed digit."""
    return {int(i): loss for i, loss in ITERATION_LOSS.findall(text)}


@pytest.fixture(scope="session")
def one_host_z1_losses(six_driver_runs):
    """The Z1 driver on one host, 2 ranks under torchrun, with driver_env's settings (4 iterations): the
    losses every multi-rank path of the same run must print."""
    runs, result = six_driver_runs
    assert result.returncode == 0, result.stderr[-3000:]
    losses = iteration_losses((runs / "gpt_tiny_Z1" / "train.log").read_text())
    assert sorted(losses) == [1, 2, 3, 4]
    return losses


# The bf16 runs the suite shares (bf16_driver_runs): each driver with PRECISION=bf16 on driver_env's run, two
# micro-batches of 2 a step (the same 8 samples a step as the fp32 runs' one micro-batch of 4, so their losses track
# those), a checkpoint every iteration; under a launcher the fp32 drivers' torchrun runs do not use where one is
BF16_LAUNCHERS = {"DP": "torchrun", "Z1": "deepspeed", "Z2": "torchrun", "Z3": "mpiexec"}


@pytest.fixture(scope="session")
def bf16_driver_runs(dolly_data_dir, tmp_path_factory):
    """A function: driver name (BF16_LAUNCHERS) -> the folder of its bf16 run, which runs once per session for the
    first test that asks (mpiexec missing: torchrun). Tests must not change the folder."""
    def run(name: str) -> Path:
        def make(root):
            launcher = BF16_LAUNCHERS[name]
            launcher = "torchrun" if launcher == "mpiexec" and shutil.which("mpiexec") is None else launcher
            # no start-up probes: their tests read the comm, loss and checkpoint files, not the time lines
            env = driver_env(dolly_data_dir, root, PRECISION="bf16", MICRO_BATCH=2, GLOBAL_BATCH=8,
                             SAVE_INTERVAL=1, LAUNCHER=launcher, ZERO_LAB_SKIP_PROBES=1)
            return process_result(subprocess.run(
                ["bash", str(REPO_ROOT / "examples_zero" / f"gpt_deepspeed_{name}.sh")], cwd=REPO_ROOT, env=env,
                capture_output=True, text=True, timeout=600))

        result = made_once(tmp_path_factory, f"bf16_{name}", make)
        assert result["returncode"] == 0, f"{name} in bf16:\n{result['stdout'][-3000:]}\n{result['stderr'][-3000:]}"
        return shared_folder(tmp_path_factory) / f"bf16_{name}" / f"gpt_tiny_{name}"
    return run


def driver_env(dolly_data_dir, runs_dir, **overrides):
    """The drivers' settings in the tests: tiny model, 2 CPU ranks, 2 epochs of 2 iterations; `overrides`
    replace any of them (tests/test_gpu.py's SEQ_LEN and MICRO_BATCH, say)."""
    settings = dict(DATA_PATH=dolly_data_dir / "dolly_text_document", VOCAB_FILE=dolly_data_dir / "gpt2-vocab.json",
                    MERGE_FILE=dolly_data_dir / "gpt2-merges.txt", RUNS_DIR=runs_dir, TRAIN_EPOCHS=2,
                    SEQ_LEN=64, MICRO_BATCH=4, LOG_INTERVAL=1, EVAL_INTERVAL=2, EVAL_ITERS=1,
                    MASTER_PORT=free_port(), LR="1e-3", SPLIT="2,97,1")
    return test_env(**{**settings, **overrides})


def tool_in_process(capsys, name, *args):
    """Run tools/<name>'s main() in this process (no interpreter start-up): (exit code, stdout, stderr)."""
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), REPO_ROOT / "tools" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    capsys.readouterr()
    code = module.main([str(arg) for arg in args])
    out, err = capsys.readouterr()
    return code, out, err


def save_random_hf_gpt2(folder, vocab_dir, bias_std, **shape):
    """A transformers-created random GPT2LMHeadModel of `shape` (GPT2Config fields), biases random
    too (they start at zero), saved with the real GPT-2 vocab from `vocab_dir`; returns the model.
    Seed the RNG first."""
    import transformers
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**shape)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, bias_std)
    model.save_pretrained(folder)
    shutil.copyfile(vocab_dir / "gpt2-vocab.json", folder / "vocab.json")
    shutil.copyfile(vocab_dir / "gpt2-merges.txt", folder / "merges.txt")
    return model


# rank 1 of any launcher: torchrun's RANK, MPICH's PMI_RANK, Open MPI's, srun's SLURM_PROCID
KILL_RANK_1_AT_ITERATION_2 = '''
import glob, os, re, signal, threading, time
_rank = next((os.environ[name] for name in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")
              if name in os.environ), None)
if _rank == "1" and "ZL_FAULT_LOG" in os.environ:
    def _kill_once():
        while True:
            for path in glob.glob(os.environ["ZL_FAULT_LOG"]):
                if re.search(r"^ iteration +2/", open(path, errors="replace").read(), re.M):
                    try:
                        os.close(os.open(os.environ["ZL_FAULT_FLAG"], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                    except FileExistsError:
                        return  # a restarted attempt: the fault happened already
                    os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.05)
    threading.Thread(target=_kill_once, daemon=True).start()
'''


# Rank 0 raises torch.OutOfMemoryError in its main thread, wherever the training loop is, once the log shows
# iteration 1, on every attempt (a GPU's memory too small for the run: the next attempt meets it again)
RAISE_OOM_ON_RANK_0_AT_ITERATION_1 = '''
import glob, os, re, signal, threading, time
if os.environ.get("RANK") == "0" and "ZL_FAULT_LOG" in os.environ:
    def _raise(signum, frame):
        import torch
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (the test's fault hook)")
    signal.signal(signal.SIGUSR1, _raise)
    def _signal_at_iteration_1():
        while not any(re.search(r"^ iteration +1/", open(path, errors="replace").read(), re.M)
                      for path in glob.glob(os.environ["ZL_FAULT_LOG"])):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGUSR1)
    threading.Thread(target=_signal_at_iteration_1, daemon=True).start()
'''


def fault_env(tmp_path: Path, log_glob: str, env: dict, hook_code: str = KILL_RANK_1_AT_ITERATION_2) -> dict:
    """env with a real fault for MAX_RESTARTS (tests/test_restarts.py): by default rank 1 SIGKILLs itself, as the
    out-of-memory killer would, once a log matching log_glob shows iteration 2, on the first attempt only (the flag
    file tmp_path/fault-happened says it happened), from a sitecustomize.py put first on the ranks' PYTHONPATH;
    hook_code: another such sitecustomize.py."""
    hook = tmp_path / "fault-hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(hook_code)
    return {**env, "PYTHONPATH": f"{hook}{os.pathsep}{env.get('PYTHONPATH', '')}", "ZL_FAULT_LOG": log_glob,
            "ZL_FAULT_FLAG": str(tmp_path / "fault-happened")}


@pytest.fixture(scope="session")
def data_prefix(tmp_path_factory):
    """A real (small) mmap dataset of 4 documents of 50 tokens: the start-up step checks that the .bin/.idx
    exist (the argument and curriculum tests parse flags against it)."""
    import numpy as np

    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder

    prefix = str(tmp_path_factory.mktemp("toy_data") / "toy_text_document")
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for doc in range(4):
        builder.add_item(np.arange(doc, doc + 50, dtype=np.int64))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix
