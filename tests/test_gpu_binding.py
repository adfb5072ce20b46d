"""Which GPU a rank takes, and which failures of a collective are a lost host (issue "The first GPU run works").

- megatron/initialize.py: local rank i takes visible device i % count (every rank sees index 0 when the site
  gives each rank its own GPU), made current before the process group exists;
- megatron/runtime/dist_env.py: a task srun started takes SLURM_LOCALID when its launcher gives no local rank;
- megatron/runtime/lost_peer.py: only a closed or reset connection and a timeout are a lost peer, and the line
  keeps the first line of what torch said. The messages are real ones: gloo's as torch 2.13 raised them here
  (a peer killed, a peer silent for 3 s), NCCL's as torch prints them for NCCL 2.19-2.21 in reported issues
  (the InfiniBand one is NCCL's own warning, "NET/IB : Unable to open device", put under "Last error:").
"""
import re

import pytest
import torch
import torch.distributed as dist

from megatron.initialize import DeviceError, DistInfo, cuda_device_index
from megatron.runtime.dist_env import DistEnvError, LauncherEnv, resolve_launcher_env
from megatron.runtime.lost_peer import Peer, Peers, first_line

# ---- megatron/initialize.py: the device index ----


@pytest.mark.parametrize("device_count", [1, 4, 8])
@pytest.mark.parametrize("local_rank", range(8))
def test_local_rank_maps_onto_the_visible_devices(local_rank, device_count):
    index = cuda_device_index(local_rank, device_count)
    assert 0 <= index < device_count
    if device_count == 8:  # torchrun on an 8-GPU host: local rank i on GPU i, as before
        assert index == local_rank
    if device_count == 1:  # srun --gpus-per-task=1, --gpu-bind, ALCF's per-rank CUDA_VISIBLE_DEVICES
        assert index == 0


def test_four_ranks_on_four_visible_gpus_take_one_each():
    assert [cuda_device_index(rank, 4) for rank in range(4)] == [0, 1, 2, 3]


@pytest.mark.parametrize("visible, shown", [(None, "unset"), ("", "''"), ("GPU-none", "'GPU-none'")])
def test_a_rank_that_sees_no_gpu_says_what_cuda_visible_devices_held(visible, shown):
    with pytest.raises(DeviceError, match=re.escape(f"local rank 3 sees no CUDA device (CUDA_VISIBLE_DEVICES is "
                                                    f"{shown})")):
        cuda_device_index(3, 0, visible)


# ---- megatron/initialize.py: the device is bound before the process group exists ----

class _FakeCuda:
    """What initialize_distributed sees of a host where the site gave this rank one GPU."""

    def __init__(self, calls: list):
        self.calls = calls

    def device_name(self):
        return "cuda"


@pytest.mark.parametrize("local_rank", ["0", "1", "3"])
def test_initialize_sets_the_device_before_it_makes_the_group(monkeypatch, local_rank):
    """srun --gpus-per-task=1: rank 1 of 4 sees one device. The device (index 0) is made current before
    deepspeed.init_distributed, so NCCL's communicator is made on it, not on GPU 0 of a rank that sees eight."""
    import deepspeed
    import deepspeed.accelerator

    from megatron import initialize
    from megatron.runtime import network

    calls = []
    for name, value in {"RANK": local_rank, "LOCAL_RANK": local_rank, "WORLD_SIZE": "4",
                        "MASTER_ADDR": "localhost", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(network, "configure", lambda environ, one_host: ("[zero-lab] network: test", "127.0.0.1"))
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: _FakeCuda(calls))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(("set_device", index)))
    monkeypatch.setattr(deepspeed, "init_distributed", lambda **kwargs: calls.append(("init_distributed",
                                                                                      kwargs["dist_backend"])))
    monkeypatch.setattr(dist, "get_rank", lambda: int(local_rank))
    monkeypatch.setattr(dist, "get_world_size", lambda: 4)
    info = initialize.initialize_distributed(timeout_minutes=10)
    assert calls == [("set_device", 0), ("init_distributed", "nccl")]
    assert info.device == torch.device("cuda", 0) and info.local_rank == int(local_rank)


def test_the_cpu_accelerator_binds_nothing(monkeypatch):
    from megatron.initialize import bind_device
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: pytest.fail("set_device on the CPU accelerator"))
    assert bind_device("cpu", 5) == torch.device("cpu")


# ---- megatron/runtime/dist_env.py: the local rank of a task srun started ----

# What Slurm sets for task 5 of an 8-task step, 4 tasks per node: the second task on the second node.
SRUN_TASK = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_NTASKS": "8",
             "SLURM_LOCALID": "1", "SLURM_STEP_NODELIST": "gpu07", "MASTER_ADDR": "gpu07"}


@pytest.mark.parametrize("local_id", range(8))
def test_srun_task_takes_slurm_localid(local_id):
    environ = {**SRUN_TASK, "SLURM_PROCID": str(local_id), "SLURM_LOCALID": str(local_id)}
    assert resolve_launcher_env(environ).local_rank == local_id


def test_srun_with_pmi2_takes_slurm_localid():
    """srun --mpi=pmi2 gives PMI_RANK and PMI_SIZE but no PMI_LOCAL_RANK: SLURM_LOCALID is the local rank
    (before, rank 5 of 8 failed with "launched without a local rank")."""
    pmi2 = {**SRUN_TASK, "PMI_RANK": "5", "PMI_SIZE": "8", "MASTER_PORT": "6000"}
    assert resolve_launcher_env(pmi2) == LauncherEnv(5, 1, 8, "gpu07", 6000, "MPICH/PALS")


def test_a_wrapper_exporting_rank_under_srun_takes_slurm_localid():
    wrapped = {**SRUN_TASK, "RANK": "5", "WORLD_SIZE": "8", "MASTER_PORT": "6000"}
    assert resolve_launcher_env(wrapped) == LauncherEnv(5, 1, 8, "gpu07", 6000, "torchrun/deepspeed")


def test_the_launchers_own_local_rank_wins_over_slurm_localid():
    # MPICH's mpiexec inside an allocation: its proxies are srun tasks (SLURM_LOCALID 0), its ranks are not
    hydra = {**SRUN_TASK, "SLURM_LOCALID": "0", "PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1"}
    assert resolve_launcher_env(hydra).local_rank == 1
    torchrun = {**SRUN_TASK, "SLURM_LOCALID": "0", "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "3"}
    assert resolve_launcher_env(torchrun).local_rank == 3


def test_outside_a_job_step_slurm_localid_is_not_read():
    """A batch script's shell is no srun task: mpiexec's rank without its local rank is still an error,
    and the message lists every variable looked at."""
    batch_shell = {key: value for key, value in SRUN_TASK.items() if key != "SLURM_STEP_ID"}
    with pytest.raises(DistEnvError, match=re.escape("rank 5 of 8 was launched without a local rank: expected one "
                                                     "of PMI_LOCAL_RANK, PALS_LOCAL_RANKID, MPI_LOCALRANKID")):
        resolve_launcher_env({**batch_shell, "PMI_RANK": "5", "PMI_SIZE": "8"})


# ---- megatron/runtime/lost_peer.py: only a closed connection or a timeout is a lost peer ----

GLOO_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
               "[10.250.0.2]:40879. This is typically caused by a remote worker crashing. Check the logs of the "
               "remote worker before reporting an error. GLHF! \N{BEACH WITH UMBRELLA}\N{VARIATION SELECTOR-16}")
GLOO_RESET = "[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection reset by peer [10.250.0.2]:52136"
GLOO_TIMEOUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
                "waiting 3000ms for recv operation to complete")
NCCL_REMOTE = ("NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.hpp:268, remote process exited or "
               "there was a network error, NCCL version 2.21.5\n"
               "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting "
               "prematurely.\nLast error:\n"
               "socketProgressOpt: Call to recv from 10.250.0.2<33759> failed : Connection reset by peer")
NCCL_WATCHDOG = ("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1204, OpType=ALLREDUCE, "
                 "NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600041 milliseconds before timing out.")

NCCL_SHM = ("NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:317, unhandled system error (run with "
            "NCCL_DEBUG=INFO for details), NCCL version 2.21.5\n"
            "ncclSystemError: System call (e.g. socket, malloc) or external library call failed or device error. \n"
            "Last error:\n"
            "Error while creating shared memory segment /dev/shm/nccl-EoOvZr (size 7340384), error: No space left "
            "on device (28)")
NCCL_DUPLICATE_GPU = ("NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1691, invalid usage "
                      "(run with NCCL_DEBUG=WARN for details), NCCL version 2.19.3\n"
                      "ncclInvalidUsage: This usually reflects invalid usage of NCCL library.\n"
                      "Last error:\n"
                      "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 2000")
NCCL_IB = ("NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, unhandled system error (run "
           "with NCCL_DEBUG=INFO for details), NCCL version 2.20.5\n"
           "ncclSystemError: System call (e.g. socket, malloc) or external library call failed or device error. \n"
           "Last error:\n"
           "NET/IB : Unable to open device mlx5_0")
CUDA_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB of which "
            "1.06 GiB is free.")
CUDA_ORDINAL = ("CUDA error: invalid device ordinal\nCUDA kernel errors might be asynchronously reported at some "
                "other API call, so the stacktrace below might be incorrect.")

PEERS = Peers([Peer(0, "node0", "10.250.0.1"), Peer(1, "node1", "10.250.0.2")], rank=0)


@pytest.mark.parametrize("error, how", [
    (RuntimeError(GLOO_CLOSED), "its connection closed"),
    (RuntimeError(GLOO_RESET), "its connection closed"),
    (RuntimeError(GLOO_TIMEOUT), "no answer within --distributed-timeout-minutes 10"),
    (dist.DistBackendError(NCCL_REMOTE), "its connection closed"),
    (dist.DistBackendError(NCCL_WATCHDOG), "no answer within --distributed-timeout-minutes 10"),
], ids=["gloo-closed", "gloo-reset", "gloo-timeout", "nccl-remote-reset", "nccl-watchdog"])
def test_a_closed_connection_or_a_timeout_is_a_lost_peer_and_says_what_torch_said(error, how):
    assert Peers.is_lost_peer(error)
    said = str(error).splitlines()[0]
    line = PEERS.describe(error, timeout_minutes=10)
    assert line.startswith(f"lost rank 1 on node1 (10.250.0.2): {how}")
    assert line.endswith(f"(docs/multi-node.md); torch said: {first_line(error)}")
    assert said in line and "\n" not in line


@pytest.mark.parametrize("error", [
    dist.DistBackendError(NCCL_SHM), dist.DistBackendError(NCCL_DUPLICATE_GPU), dist.DistBackendError(NCCL_IB),
    torch.OutOfMemoryError(CUDA_OOM), dist.DistError(CUDA_ORDINAL), RuntimeError(CUDA_ORDINAL),
    RuntimeError("NCCL error: invalid argument"),
], ids=["nccl-shm", "nccl-invalid-usage", "nccl-ib-device", "cuda-oom", "disterror-ordinal", "cuda-ordinal",
        "nccl-word"])
def test_a_hosts_own_cuda_or_nccl_error_is_not_a_lost_peer(error):
    """These went up as "lost rank ...: its connection closed" before (any DistError, any RuntimeError naming
    NCCL): now the error itself goes up, with its message."""
    assert not Peers.is_lost_peer(error)


def test_nccls_first_line_comes_with_its_last_error():
    assert first_line(dist.DistBackendError(NCCL_REMOTE)) == (
        "NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.hpp:268, remote process exited or there "
        "was a network error, NCCL version 2.21.5 (last error: socketProgressOpt: Call to recv from "
        "10.250.0.2<33759> failed : Connection reset by peer)")
    assert first_line(RuntimeError(GLOO_TIMEOUT)) == GLOO_TIMEOUT
    assert first_line(RuntimeError("")) == "RuntimeError"


def test_the_heartbeats_line_is_unchanged():
    """heartbeat.py says a silent host in its own words, with no error of torch's to quote."""
    assert PEERS.lost([PEERS.peers[1]], "no heartbeat for 60 s: its host is down or cut off") == (
        "lost rank 1 on node1 (10.250.0.2): no heartbeat for 60 s: its host is down or cut off; the last "
        "checkpoint resumes on the hosts left with --universal-checkpoint (docs/multi-node.md)")


def test_deepspeeds_engine_is_given_the_ranks_gpu():
    """DeepSpeed's engine sets the device again, to LOCAL_RANK unless `args.device_rank` says otherwise: on a site
    that gives each rank its own GPU, local rank 3 sees its GPU as index 0 and the engine must be told so."""
    from megatron.engine import engine_device_args

    own_gpu = DistInfo(rank=3, local_rank=3, world_size=4, device=torch.device("cuda", 0))
    assert engine_device_args(own_gpu).device_rank == 0
    all_gpus = DistInfo(rank=3, local_rank=3, world_size=4, device=torch.device("cuda", 3))
    assert engine_device_args(all_gpus).device_rank == 3
    assert engine_device_args(DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))) is None
