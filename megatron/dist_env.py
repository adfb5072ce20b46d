"""Rank, world size and rendezvous address from whichever launcher started this process.

torch.distributed's env:// rendezvous (and deepspeed.init_distributed) reads RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT. torchrun and the deepspeed
launcher set them; mpiexec does not, it sets its own variables instead:

- MPICH (Hydra) and HPE PALS (ALCF Polaris/Aurora): PMI_RANK, PMI_SIZE, and the local
  rank as PMI_LOCAL_RANK / PALS_LOCAL_RANKID (PALS) or MPI_LOCALRANKID (Hydra);
- Open MPI: OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK.

Under PBS every rank sees the same $PBS_NODEFILE, so its first host is an address all
ranks agree on without talking to each other first.
"""
import os
from dataclasses import dataclass
from typing import Mapping, MutableMapping

DEFAULT_MASTER_PORT = 29500

# (rank, world size, local rank candidates) per launcher family, in order of precedence:
# variables set by torchrun/deepspeed win, so an mpiexec wrapping torchrun still works.
_LAUNCHERS = (
    ("torchrun/deepspeed", "RANK", "WORLD_SIZE", ("LOCAL_RANK",)),
    ("MPICH/PALS", "PMI_RANK", "PMI_SIZE", ("PMI_LOCAL_RANK", "PALS_LOCAL_RANKID", "MPI_LOCALRANKID")),
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", ("OMPI_COMM_WORLD_LOCAL_RANK",)),
)


class DistEnvError(ValueError):
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


def _local_rank(environ: Mapping[str, str], names: tuple[str, ...], rank: int, world_size: int) -> int:
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


def _master_addr(environ: Mapping[str, str]) -> str:
    if environ.get("MASTER_ADDR"):
        return environ["MASTER_ADDR"]
    for variable in ("PBS_NODEFILE", "HOSTFILE"):
        if environ.get(variable):
            return first_host(environ[variable], variable)
    return "localhost"


def resolve_launcher_env(environ: Mapping[str, str] = os.environ) -> LauncherEnv:
    """Where this process sits in the job, from the first launcher whose variables are set.

    With no launcher variables at all this is a single process (rank 0 of 1)."""
    rank, local_rank, world_size, launcher = 0, 0, 1, "none"
    for name, rank_var, size_var, local_vars in _LAUNCHERS:
        if rank_var in environ or size_var in environ:
            for required in (rank_var, size_var):
                if required not in environ:
                    raise DistEnvError(f"{name} launcher: {required} is not set (found only one of {rank_var}/{size_var})")
            rank, world_size = _int_var(environ, rank_var), _int_var(environ, size_var)
            if rank >= world_size:
                raise DistEnvError(f"{rank_var}={rank} is not below {size_var}={world_size}")
            local_rank, launcher = _local_rank(environ, local_vars, rank, world_size), name
            break
    port = _int_var(environ, "MASTER_PORT") if environ.get("MASTER_PORT") else DEFAULT_MASTER_PORT
    return LauncherEnv(rank, local_rank, world_size, _master_addr(environ), port, launcher)


def export_launcher_env(environ: MutableMapping[str, str] = os.environ) -> LauncherEnv:
    """Fill RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT for env:// rendezvous."""
    resolved = resolve_launcher_env(environ)
    environ["RANK"] = str(resolved.rank)
    environ["LOCAL_RANK"] = str(resolved.local_rank)
    environ["WORLD_SIZE"] = str(resolved.world_size)
    environ["MASTER_ADDR"] = resolved.master_addr
    environ["MASTER_PORT"] = str(resolved.master_port)
    return resolved
