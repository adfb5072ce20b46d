"""Rank, world size and rendezvous address from whichever launcher started this process.

torch.distributed's env:// rendezvous (and deepspeed.init_distributed) reads RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT. torchrun and the deepspeed
launcher set them; mpiexec does not, it sets its own variables instead:

- MPICH (Hydra) and HPE PALS (ALCF Polaris/Aurora): PMI_RANK, PMI_SIZE, and the local
  rank as PMI_LOCAL_RANK / PALS_LOCAL_RANKID (PALS) or MPI_LOCALRANKID (Hydra);
- Open MPI: OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK;
- Slurm's srun: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, but only in a job step (SLURM_STEP_ID
  set): a batch script or salloc shell has SLURM_PROCID=0 and the allocation's SLURM_NTASKS too,
  and a process started there directly is one process, not rank 0 of a job that never starts.

A task srun starts through PMI (`srun --mpi=pmi2`: PMI_RANK and PMI_SIZE, no PMI_LOCAL_RANK) or with
RANK/WORLD_SIZE exported by a wrapper has no local rank of its launcher's own: SLURM_LOCALID, srun's
task index on its node, is its local rank then (only in a job step, as above).

Under PBS every rank sees the same $PBS_NODEFILE, so its first host is an address all
ranks agree on without talking to each other first. Under srun that host is the first of the
step's node list (task 0 runs there), and the port comes from the job id, so two jobs sharing
a node do not meet at the same port and a requeued job (same id) finds its own again.
"""
import os
import subprocess
from dataclasses import dataclass
from typing import Mapping, MutableMapping

from megatron.errors import ZeroLabError

DEFAULT_MASTER_PORT = 29500
# srun's port: SLURM_PORT_BASE + job id modulo SLURM_PORT_SPAN, below Linux's ephemeral ports (32768+).
SLURM_PORT_BASE, SLURM_PORT_SPAN = 20000, 10000

SLURM = "Slurm srun"
# (rank, world size, local rank candidates) per launcher family, in order of precedence:
# variables set by torchrun/deepspeed win, so an mpiexec wrapping torchrun still works.
_LAUNCHERS = (
    ("torchrun/deepspeed", "RANK", "WORLD_SIZE", ("LOCAL_RANK",)),
    ("MPICH/PALS", "PMI_RANK", "PMI_SIZE", ("PMI_LOCAL_RANK", "PALS_LOCAL_RANKID", "MPI_LOCALRANKID")),
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", ("OMPI_COMM_WORLD_LOCAL_RANK",)),
    (SLURM, "SLURM_PROCID", "SLURM_NTASKS", ("SLURM_LOCALID",)),
)


class DistEnvError(ZeroLabError, ValueError):
    """The launcher's environment is inconsistent; the message names the variable."""


@dataclass(frozen=True)
class LauncherEnv:
    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int
    launcher: str = "none"


def _int_var(environ: Mapping[str, str], name: str) -> int:
    value = environ[name]
    try:
        number = int(value)
    except ValueError:
        raise DistEnvError(f"environment variable {name}={value!r} is not an integer") from None
    if number < 0:
        raise DistEnvError(f"environment variable {name}={value!r} must be >= 0")
    return number


def _local_rank_names(environ: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, ...]:
    """Where this process's local rank may be read, in order: its launcher's own variables, then srun's
    SLURM_LOCALID in a Slurm job step (a task srun started, whatever else set its rank)."""
    if "SLURM_STEP_ID" in environ and "SLURM_LOCALID" not in names:
        return (*names, "SLURM_LOCALID")
    return names


def _local_rank(environ: Mapping[str, str], names: tuple[str, ...], rank: int, world_size: int) -> int:
    names = _local_rank_names(environ, names)
    for name in names:
        if name in environ:
            return _int_var(environ, name)
    if world_size == 1:
        return 0
    raise DistEnvError(
        f"rank {rank} of {world_size} was launched without a local rank: expected one of {', '.join(names)}"
    )


def first_host(hostfile: str, variable: str) -> str:
    """First host named in a PBS/MPI hostfile ("host", "host slots=4" or "host:4" lines)."""
    try:
        with open(hostfile, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except OSError as err:
        raise DistEnvError(f"{variable}={hostfile}: cannot read hostfile ({err.strerror})") from None
    for line in lines:
        entry = line.split("#", 1)[0].strip()
        if entry:
            return entry.split()[0].split(":")[0]
    raise DistEnvError(f"{variable}={hostfile}: hostfile names no host")


def first_slurm_host(nodelist: str, variable: str, environ: Mapping[str, str] = os.environ) -> str:
    """First host of a Slurm node list ("gpu[01-04],cpu7"), expanded by `scontrol show hostnames`
    (Slurm's own parser; the list syntax has ranges, padding and nested brackets), which reads
    the cluster's configuration through `environ` (SLURM_CONF)."""
    if not any(char in nodelist for char in ",[]"):
        return nodelist
    try:
        hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                               check=True, timeout=60, env={**os.environ, **environ}).stdout.split()
    except (OSError, subprocess.SubprocessError) as err:
        stderr = getattr(err, "stderr", None)
        detail = stderr.strip().splitlines()[-1] if stderr and stderr.strip() else str(err)
        raise DistEnvError(f"{variable}={nodelist}: `scontrol show hostnames` failed ({detail})") from None
    if not hosts:
        raise DistEnvError(f"{variable}={nodelist}: `scontrol show hostnames` names no host")
    return hosts[0]


def _master_addr(environ: Mapping[str, str], launcher: str) -> str:
    if environ.get("MASTER_ADDR"):
        return environ["MASTER_ADDR"]
    if launcher == SLURM:
        for variable in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"):
            if environ.get(variable):
                return first_slurm_host(environ[variable], variable, environ)
    for variable in ("PBS_NODEFILE", "HOSTFILE"):
        if environ.get(variable):
            return first_host(environ[variable], variable)
    return "localhost"


def _master_port(environ: Mapping[str, str], launcher: str) -> int:
    if environ.get("MASTER_PORT"):
        return _int_var(environ, "MASTER_PORT")
    if launcher == SLURM and environ.get("SLURM_JOB_ID"):
        return SLURM_PORT_BASE + _int_var(environ, "SLURM_JOB_ID") % SLURM_PORT_SPAN
    return DEFAULT_MASTER_PORT


def resolve_launcher_env(environ: Mapping[str, str] = os.environ) -> LauncherEnv:
    """Where this process sits in the job, from the first launcher whose variables are set.

    With no launcher variables at all this is a single process (rank 0 of 1)."""
    rank, local_rank, world_size, launcher = 0, 0, 1, "none"
    for name, rank_var, size_var, local_vars in _LAUNCHERS:
        if name == SLURM and "SLURM_STEP_ID" not in environ:
            continue  # a batch script or salloc shell, not a task srun started
        if rank_var in environ or size_var in environ:
            for required in (rank_var, size_var):
                if required not in environ:
                    raise DistEnvError(f"{name} launcher: {required} is not set (found only one of {rank_var}/{size_var})")
            rank, world_size = _int_var(environ, rank_var), _int_var(environ, size_var)
            if rank >= world_size:
                raise DistEnvError(f"{rank_var}={rank} is not below {size_var}={world_size}")
            local_rank, launcher = _local_rank(environ, local_vars, rank, world_size), name
            break
    return LauncherEnv(rank, local_rank, world_size, _master_addr(environ, launcher),
                       _master_port(environ, launcher), launcher)


# How many ranks each launcher says run on this host: torchrun, the deepspeed launcher, MPICH (Hydra), PALS,
# Open MPI.
_RANKS_ON_THIS_HOST = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MPI_LOCALNRANKS", "PALS_LOCAL_SIZE",
                       "OMPI_COMM_WORLD_LOCAL_SIZE")


def all_ranks_on_this_host(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the launcher says every rank of the job runs on this host (False when it does not say)."""
    world = int(environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return True
    for name in _RANKS_ON_THIS_HOST:
        if environ.get(name, "").isdigit():
            return int(environ[name]) == world
    return environ.get("SLURM_STEP_NUM_NODES") == "1"


def export_launcher_env(environ: MutableMapping[str, str] = os.environ) -> LauncherEnv:
    """Fill RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT for env:// rendezvous."""
    resolved = resolve_launcher_env(environ)
    environ["RANK"] = str(resolved.rank)
    environ["LOCAL_RANK"] = str(resolved.local_rank)
    environ["WORLD_SIZE"] = str(resolved.world_size)
    environ["MASTER_ADDR"] = resolved.master_addr
    environ["MASTER_PORT"] = str(resolved.master_port)
    return resolved
