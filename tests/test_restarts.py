"""MAX_RESTARTS (issue 35 item 1, docs/faults.md): a run that loses a rank starts again by itself from its newest
intact checkpoint, on the drivers (torchrun), ALCF (mpiexec) and the Slurm script (srun); a failure that would fail
again, or a signal to the job, is not restarted.

The fault is real: rank 1 SIGKILLs itself (as the out-of-memory killer would) once the run's log shows
iteration 2, on the first attempt only (conftest.fault_env); the Slurm case is in test_slurm.py."""
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import (ITERATION_LOSS, RAISE_OOM_ON_RANK_0_AT_ITERATION_1, REPO_ROOT, driver_env, fault_env,
                      iteration_losses, test_env)
from megatron.launch.restart import (RESTART_STATUS, hosts_missing, recurring_failure,
                                     worth_restarting)

def summary_row(runs_dir: Path, out: Path) -> dict:
    result = subprocess.run([sys.executable, str(REPO_ROOT / "analysis" / "summarize.py"), str(runs_dir), "--out",
                             str(out), "--no-plots"], env=test_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    [row] = json.loads((out / "summary.json").read_text())["runs"]
    return row


# ---- which failures are restarted ----

@pytest.mark.parametrize("first_error, signalled, restart", [
    (None, None, True),  # a rank killed, a crash: no error line of its own
    ("error: lost rank 1 on node1 (10.250.0.2): no heartbeat for 60 s: ...", None, True),
    ("error: lost ranks 2, 3 on node1 (10.250.0.2): its connection closed: ...", None, True),
    ("error: --save /ckpt: writing checkpoint global_step8 failed on rank 0 (No space left on device); ...", None,
     True),
    ("error: --data-path d: d.bin does not exist", None, False),
    ("error: stopping at iteration 12: 5 iterations in a row had NaN or Inf losses", None, False),
    ("error: --load /ckpt: no intact checkpoint to resume: ...", None, False),
    (None, "SIGTERM", False),  # the scheduler stops the job
    ("error: lost rank 1 on node1 (10.250.0.2): ...", "SIGINT", False),
])
def test_what_is_restarted(first_error, signalled, restart):
    assert worth_restarting(first_error, signalled)[0] is restart


# What ranks print when they die of a failure the next attempt meets again: torchrun's "[rankN]: " prefixes and all.
CUDA_OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity of "
            "79.19 GiB of which 1.02 GiB is free. Including non-PyTorch memory, this process has 78.16 GiB memory in "
            "use. Of the allocated memory 75.31 GiB is allocated by PyTorch, and 1.29 GiB is reserved by PyTorch but "
            "unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
            "Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")
OOM_OUTPUT = f"""[rank0]: Traceback (most recent call last):
[rank0]:   File "/work/zero-lab/pretrain_gpt.py", line 161, in <module>
[rank0]:     sys.exit(main(sys.argv[1:]))
[rank0]:   File "/work/zero-lab/megatron/training/step.py", line 88, in train_step
[rank0]:     loss = model(tokens, position_ids, labels=labels)
[rank0]:            ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
[rank0]: {CUDA_OOM}
"""
OLD_OOM_OUTPUT = """Traceback (most recent call last):
  File "/work/zero-lab/megatron/model/gpt.py", line 140, in forward
    raise torch.cuda.OutOfMemoryError(message)
torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity)
"""
NCCL_DUPLICATE_GPU_OUTPUT = """[rank1]: Traceback (most recent call last):
[rank1]:   File "/work/zero-lab/megatron/runtime/lost_peer.py", line 40, in gather
[rank1]:     torch.distributed.all_gather_object(addresses, address)
[rank1]:   File "/usr/lib/python3/dist-packages/torch/distributed/distributed_c10d.py", line 3041, in all_gather_object
[rank1]:     all_gather(object_size_list, local_size, group=group)
[rank1]: torch.distributed.DistBackendError: NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, \
invalid usage (run with NCCL_DEBUG=WARN for details), NCCL version 2.27.3
[rank1]: ncclInvalidUsage: This usually reflects invalid usage of NCCL library.
[rank1]: Last error:
[rank1]: Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1a000
"""
OP_BUILD_OUTPUT = """[1/3] /usr/local/cuda/bin/nvcc -ccbin gcc -DTORCH_EXTENSION_NAME=cpu_adam -c csrc/common/custom_cuda_kernel.cu
FAILED: custom_cuda_kernel.cuda.o
nvcc fatal   : Unsupported gpu architecture 'compute_100'
ninja: build stopped: subcommand failed.
Traceback (most recent call last):
  File "/usr/lib/python3/dist-packages/torch/utils/cpp_extension.py", line 2595, in _run_ninja_build
    subprocess.run(
subprocess.CalledProcessError: Command '['ninja', '-v']' returned non-zero exit status 1.

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "/usr/lib/python3/dist-packages/deepspeed/ops/op_builder/builder.py", line 560, in load
    return self.jit_load(verbose)
RuntimeError: Error building extension 'cpu_adam'
"""
RECURRING_CASES = [
    (OOM_OUTPUT, "ran out of GPU memory", CUDA_OOM),
    (OLD_OOM_OUTPUT, "ran out of GPU memory",
     "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity)"),
    (NCCL_DUPLICATE_GPU_OUTPUT, "shares its GPU with another rank",
     "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1a000"),
    (OP_BUILD_OUTPUT, "could not build a CUDA op", "RuntimeError: Error building extension 'cpu_adam'"),
    (OP_BUILD_OUTPUT.split("Traceback")[0], "could not build a CUDA op", "ninja: build stopped: subcommand failed."),
]


def attempt_of(tmp_path, output: str, status: int = 1):
    """megatron.launch.attempt --restartable over a command that prints `output` and exits `status`."""
    (tmp_path / "output.txt").write_text(output)
    command = [sys.executable, "-c", f"import sys; sys.stderr.write(open({str(tmp_path / 'output.txt')!r}).read()); "
                                     f"sys.exit({status})"]
    return subprocess.run([sys.executable, "-m", "megatron.launch.attempt", "--run-dir", str(tmp_path / "run"),
                           "--log", str(tmp_path / "train.log"), "--launcher", "torchrun", "--restartable", "--",
                           *command], env=test_env(), capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("output, what, line", RECURRING_CASES)
def test_a_rank_that_dies_of_a_recurring_failure_is_not_restarted(tmp_path, output, what, line):
    """Out of GPU memory, two ranks on one GPU, a CUDA op that does not build: a traceback and no error line, which
    the next attempt would print again. The attempt ends with the line naming it, not with RESTART_STATUS."""
    lines = output.splitlines()
    assert recurring_failure(None, [re.sub(r"^\[rank\d+\]: ", "", text) for text in lines]) == (what, line)
    # the ranks left say they lost the one that died of it: still not restarted
    assert recurring_failure("error: lost rank 0 on node0 (10.0.0.1): its connection closed", lines) == (what, line)
    assert not worth_restarting("error: lost rank 0 on node0 (10.0.0.1): its connection closed", None,
                                (what, line))[0]
    result = attempt_of(tmp_path, output)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"[run] not restarting (MAX_RESTARTS): a rank {what}: the next attempt would fail the same way" \
        in result.stdout
    assert result.stderr.splitlines()[-1] == f"error: a rank {what}: {line} (its traceback is in the log)"


def test_a_crash_or_a_users_error_line_is_not_taken_for_a_recurring_failure(tmp_path):
    crash = "Traceback (most recent call last):\n  File \"x.py\", line 1, in f\nRuntimeError: CUDA error: an illegal " \
            "memory access was encountered\n"
    assert recurring_failure(None, crash.splitlines()) is None
    result = attempt_of(tmp_path, crash)
    assert result.returncode == RESTART_STATUS, result.stdout + result.stderr
    # a rank's own error line about the input says more than the exception that followed it
    assert recurring_failure("error: --data-path d: d.bin does not exist", OOM_OUTPUT.splitlines()) is None


def test_hosts_missing_is_torchruns_rendezvous_giving_up():
    # torchrun's report when a host did not join within join_timeout (tests/test_multi_node.py causes it for real)
    assert hosts_missing(["Traceback (most recent call last):", "torch.distributed.elastic.rendezvous.api."
                          "RendezvousTimeoutError"])
    assert not hosts_missing(["torch.distributed.elastic.multiprocessing.errors.ChildFailedError:"])


# ---- the three launch paths, for real ----

def check_restarted_run(run_dir: Path, log_text: str, expected_losses: dict, out: str, err: str):
    """One restart after the kill, every iteration's loss as the uninterrupted run printed it, and the summary's
    run of two attempts with each iteration once."""
    assert "[run] restarting the run from its newest intact checkpoint (1 of " in out, out[-3000:] + err[-3000:]
    assert len(re.findall(r"^\[zero-lab\] restarting after: ", log_text, re.M)) == 1
    headers = re.findall(r"^\[zero-lab\] attempt (\d+) started .*$", log_text, re.M)
    assert headers == ["1", "2"]
    assert re.search(r"^\[zero-lab\] attempt 2 started .*: restart 1 of \d+, resuming from ", log_text, re.M)
    # as printed, every digit: each iteration computed again after the restart repeats the loss it had
    printed = [(int(i), loss) for i, loss in ITERATION_LOSS.findall(log_text)]
    assert sorted(set(printed)) == sorted(expected_losses.items()) and len(printed) > len(expected_losses)
    assert not (run_dir / "checkpoints" / "latest").read_text().endswith(".saving")


@pytest.mark.slow
def test_drivers_restart_after_a_rank_is_killed(dolly_data_dir, one_host_z1_losses, tmp_path):
    env = fault_env(tmp_path, str(tmp_path / "runs" / "gpt_tiny_Z1" / "train.log"),
                    driver_env(dolly_data_dir, tmp_path / "runs", MAX_RESTARTS=2, SAVE_INTERVAL=1))
    run = subprocess.run(["bash", str(REPO_ROOT / "examples_zero" / "gpt_deepspeed_Z1.sh")], env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert (tmp_path / "fault-happened").exists()
    run_dir = tmp_path / "runs" / "gpt_tiny_Z1"
    check_restarted_run(run_dir, (run_dir / "train.log").read_text(), one_host_z1_losses, run.stdout, run.stderr)
    assert (run_dir / "command.txt").read_text().count("# attempt ") == 2
    row = summary_row(tmp_path / "runs", tmp_path / "summary")
    assert (row["status"], row["attempts"], row["last_iteration"]) == ("finished", 2, 4)


@pytest.mark.slow
def test_a_failure_that_would_fail_again_is_not_restarted(dolly_data_dir, tmp_path):
    """A flag the ranks refuse: one attempt, the reason said, the error line last, exit 1."""
    env = driver_env(dolly_data_dir, tmp_path / "runs", MAX_RESTARTS=3)
    run = subprocess.run(["bash", str(REPO_ROOT / "examples_zero" / "gpt_deepspeed_Z1.sh"), "--lr-decay-style",
                          "exp"], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 1
    assert "[run] not restarting (MAX_RESTARTS): a rank's own error line: the next attempt would fail the same way" \
        in run.stdout
    assert run.stderr.rstrip().splitlines()[-1].startswith("error: --lr-decay-style must be cosine, linear, constant or inverse-square-root")
    assert (tmp_path / "runs" / "gpt_tiny_Z1" / "command.txt").read_text().count("# attempt ") == 1


@pytest.mark.slow
def test_a_rank_out_of_gpu_memory_ends_the_run_at_once(dolly_data_dir, tmp_path):
    """One rank that raises torch.OutOfMemoryError at iteration 1 for real: MAX_RESTARTS=2 starts no second attempt,
    and the run ends with the exception's line."""
    env = fault_env(tmp_path, str(tmp_path / "runs" / "gpt_tiny_Z1" / "train.log"),
                    driver_env(dolly_data_dir, tmp_path / "runs", MAX_RESTARTS=2, NGPUS=1),
                    RAISE_OOM_ON_RANK_0_AT_ITERATION_1)
    run = subprocess.run(["bash", str(REPO_ROOT / "examples_zero" / "gpt_deepspeed_Z1.sh")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    assert "[run] not restarting (MAX_RESTARTS): a rank ran out of GPU memory: the next attempt would fail the same " \
           "way" in run.stdout
    assert run.stderr.rstrip().splitlines()[-1].startswith(
        "error: a rank ran out of GPU memory: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB "
        "(the test's fault hook) (its traceback is in the log)")
    # a restart without a checkpoint would start afresh, moving the first attempt's files aside
    assert "[run] restarting the run" not in run.stdout
    assert [path.name for path in (tmp_path / "runs").iterdir()] == ["gpt_tiny_Z1"]
    run_dir = tmp_path / "runs" / "gpt_tiny_Z1"
    assert (run_dir / "command.txt").read_text().count("# attempt ") == 1
    assert "[zero-lab] restarting after" not in (run_dir / "train.log").read_text()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec (scripts/setup.sh installs MPICH)")
def test_alcf_restarts_after_a_rank_is_killed(dolly_data_dir, tmp_path):
    """./ALCF/train-gpt3.sh through mpiexec, one log per attempt; the losses are the uninterrupted run's."""
    settings = dict(DATA_DIR=str(dolly_data_dir), MODEL_SIZE_KEY="GPT_TINY", SEQ_LEN="64", MICRO_BATCH="2",
                    TRAIN_ITERS="4", LOG_INTERVAL="1", EVAL_INTERVAL="2", EVAL_ITERS="1", SAVE_INTERVAL="1",
                    DATA_SPLIT="90,8,2", USER="tester", CUDA_VISIBLE_DEVICES="")

    def train(folder: Path, **extra):
        env = test_env(**settings, OUTPUT_ROOT=str(folder / "outputs"), LOGFILES=str(folder / "logfiles"), **extra)
        for var in ("PBS_NODEFILE", "HOSTFILE", "MASTER_PORT", "RUN_NAME", "PBS_JOBID", "OMP_NUM_THREADS"):
            env.pop(var, None)
        return subprocess.run(["bash", str(REPO_ROOT / "ALCF" / "train-gpt3.sh")], cwd=folder, env=env,
                              capture_output=True, text=True, timeout=900)

    clean = tmp_path / "clean"
    clean.mkdir()
    reference = train(clean)
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]
    expected = iteration_losses(reference.stdout)
    assert sorted(expected) == [1, 2, 3, 4]

    env = fault_env(tmp_path, str(tmp_path / "outputs" / "*" / "logs" / "*.log"), {})
    restarted = train(tmp_path, MAX_RESTARTS="1", **env)
    assert restarted.returncode == 0, restarted.stdout[-3000:] + restarted.stderr[-3000:]
    assert (tmp_path / "fault-happened").exists()
    [run_dir] = (tmp_path / "outputs").iterdir()
    logs = sorted((run_dir / "logs").iterdir())
    assert len(logs) == 2
    check_restarted_run(run_dir, "".join(log.read_text() for log in logs), expected, restarted.stdout,
                        restarted.stderr)
    row = summary_row(tmp_path / "outputs", tmp_path / "summary")
    assert (row["status"], row["attempts"], row["last_iteration"]) == ("finished", 2, 4)
