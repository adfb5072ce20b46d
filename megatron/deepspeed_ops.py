"""DeepSpeed's C++ ops, compiled by torch at their first use: in the environment's own folder, with one line
before each compilation. The one place that says where they are built, for the set-up, scripts/test.sh and
every rank (megatron/initialize.py). Imports no torch or DeepSpeed until an op is built.

    python -m megatron.deepspeed_ops folder          # the folder the ops are built in
    python -m megatron.deepspeed_ops build OP... | all   # builds the ops not built yet (names as in OPS)
"""
import contextlib
import fcntl
import functools
import os
import sys
import time

# The ops zero-lab's runs load on the CPU accelerator: name (torch's extension name, its folder and .so) ->
# (DeepSpeed's builder, what loads it, minutes to compile). The minutes are ninja's own logs of these builds
# on the 2-core machine, without debug information (without_debug_info): the four in 2 min 20 s, async_io's
# twelve files 1 min 50 s of it, plus a few seconds to import torch and DeepSpeed; two to three times that while
# other jobs load the machine (shm_comm with -g: 62 s, and 2 min 46 s at a load average of 10).
OPS = {
    "deepspeed_shm_comm": ("ShareMemCommBuilder", "shared-memory collectives", 1),  # every run: init_distributed
    "cpu_adam": ("CPUAdamBuilder", "CPU offload", 1),  # ZeRO-Offload, Z3_OL
    "async_io": ("AsyncIOBuilder", "NVMe offload", 2),  # Z3_NVMe
    "pin_memory": ("PinMemoryBuilder", "pinned host memory", 1),  # DS_PIN_MEMORY_BACKEND=native
}


def extensions_dir(environ=os.environ) -> str:
    """TORCH_EXTENSIONS_DIR where the user set it, else this environment's own folder: torch's default
    (~/.cache/torch_extensions) is shared by every environment of the user, and each rebuilds the ops the
    other built, against its own torch."""
    return environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(sys.prefix, "torch_extensions")


def use_environment_extensions(environ=os.environ) -> str:
    """Sets TORCH_EXTENSIONS_DIR (which torch.utils.cpp_extension reads at each build) to extensions_dir(),
    for this process and the ones it starts; returns the folder."""
    environ["TORCH_EXTENSIONS_DIR"] = extensions_dir(environ)
    return environ["TORCH_EXTENSIONS_DIR"]


def is_built(name: str, folder: str) -> bool:
    """Whether `folder` holds the op's library, where torch's loader puts it: <folder>/<name>/<name>.so."""
    return os.path.isfile(os.path.join(folder, name, name + ".so"))


def build_line(name: str) -> str:
    if name not in OPS:
        return f"compiling DeepSpeed's {name} (first use, may take minutes)"
    _, use, minutes = OPS[name]
    return f"compiling DeepSpeed's {name} for {use} (first use, about {minutes} min)"


# A build's lock older than this, with no process working in its folder, is a dead build's: torch takes the lock
# and starts ninja in that folder within milliseconds, and releases it as soon as ninja is done.
STALE_AFTER_S = 10


def _working_in(folder: str) -> bool:
    """Whether a live process has `folder` as its working directory: torch runs ninja there, and ninja the
    compiler (Linux's /proc; elsewhere every lock counts as live)."""
    if not os.path.isdir("/proc"):
        return True
    folder = os.path.realpath(folder)
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/cwd") == folder:
                    return True
    return False


def _is_stale(lock: str) -> bool:
    try:
        age = time.time() - os.path.getmtime(lock)
    except FileNotFoundError:
        return False
    return age > STALE_AFTER_S and not _working_in(os.path.dirname(lock))


@contextlib.contextmanager
def build_guard(name: str, folder: str):
    """Held around each load of an op. torch marks a build in progress with a file, <folder>/<name>/lock, that it
    removes at the end; a process killed mid-build (Ctrl-C, the OOM killer) leaves it behind, and every later load
    of the op waits for it forever. Loads here hold an flock on <name>/zero-lab.build, which the kernel releases
    when its process dies, so no other load of ours is building while it is held; a torch lock found then is
    waited for while a live process builds under it (a build of another program's, or a killed build's last
    compilers), and once none does it is a dead build's, removed with one line (the build then starts again)."""
    op_folder = os.path.join(folder, name)
    os.makedirs(op_folder, exist_ok=True)
    with open(os.path.join(op_folder, "zero-lab.build"), "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # another rank's load (or build) of this op first
        lock = os.path.join(op_folder, "lock")
        # torch's own wait for the lock has no end: wait here instead, until the build that holds it ends (the lock
        # goes) or is found dead (a killed build's compilers may outlive it by a minute: until they end, it is live)
        while os.path.exists(lock):
            if _is_stale(lock):
                print(f"removing {lock}: a build of DeepSpeed's {name} that ended without finishing left it",
                      flush=True)
                with contextlib.suppress(FileNotFoundError):
                    os.remove(lock)
                break
            time.sleep(1)
        yield


def without_debug_info(builder) -> None:
    """DeepSpeed compiles its C++ ops with -g: debug information for every torch template the op instantiates,
    a quarter of each file's compile time (20 s -> 15 s for one of async_io's twelve on the 2-core machine) and
    most of the library (async_io 28 -> 3.3 MB), which no run reads. This builder's host-compiler flags go
    without it."""
    cxx_args = builder.cxx_args
    if getattr(cxx_args, "without_debug_info", False):
        return

    def flags():
        return [flag for flag in cxx_args() if flag != "-g"]

    flags.without_debug_info = True
    builder.cxx_args = flags


def announce_builds(quiet: bool = False) -> None:
    """From now on, one line before DeepSpeed compiles an op that this environment has not built yet (a run
    would otherwise sit silent for the minutes it takes), and every load under build_guard. Quiet on all but one
    rank per host: the others wait for that rank's build. DeepSpeed compiles every op through OpBuilder.jit_load,
    so that is where the line goes; an op installed prebuilt never reaches it."""
    from deepspeed.ops.op_builder.builder import OpBuilder
    jit_load = OpBuilder.jit_load
    if getattr(jit_load, "announces_builds", False):
        return

    @functools.wraps(jit_load)
    def announcing_jit_load(builder, *args, **kwargs):
        folder = extensions_dir()
        without_debug_info(builder)
        with build_guard(builder.name, folder):
            if not quiet and not is_built(builder.name, folder):
                print(build_line(builder.name), flush=True)
            return jit_load(builder, *args, **kwargs)

    announcing_jit_load.announces_builds = True
    OpBuilder.jit_load = announcing_jit_load


def build(names) -> None:
    """Loads each op in `names` (building those not built yet, each announced) that this machine can build:
    async_io needs libaio's headers, which the set-up installs where it can."""
    from deepspeed.accelerator import get_accelerator
    use_environment_extensions()
    announce_builds()
    for name in names:
        builder = get_accelerator().create_op_builder(OPS[name][0])
        if builder is not None and builder.is_compatible(verbose=False):
            builder.load(verbose=False)


def main(argv: list[str]) -> int:
    usage = f"usage: python -m megatron.deepspeed_ops folder | build OP... | build all (OP: {', '.join(OPS)})"
    if argv == ["folder"]:
        print(extensions_dir())
        return 0
    names = list(OPS) if argv[1:] == ["all"] else argv[1:]
    if argv[:1] != ["build"] or not names or any(name not in OPS for name in names):
        print(f"error: {' '.join(argv) or 'no arguments'}: {usage}", file=sys.stderr)
        return 2
    build(names)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
