"""DeepSpeed's console lines that tell a zero-lab user nothing, dropped where DeepSpeed prints them.

DeepSpeed 0.19.8 prints these unconditionally (print(), or a warning with no setting to turn it off):
- `Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.`, at the
  import of deepspeed, by every tool and rank when DS_ACCELERATOR is unset and no GPU is found. It is dropped
  only where the machine has no GPU device (no NVIDIA driver, /dev/kfd or /dev/accel): there it says nothing,
  and where a GPU is installed but not found it is the one sign of a broken driver, and stays.
- `DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully`, by every rank at init_distributed on
  the CPU accelerator, whether the op was compiled then or loaded already built (deepspeed/comm/torch.py). A
  compilation is announced before it starts by megatron/deepspeed_ops.py, once per host.
- `No existing process group found, creating a new group named: ep_size_N`, by every rank as the engine creates
  the expert-parallel groups of an MoE model (deepspeed/moe/layer.py): it always creates them, once per size.
Every other line passes as it comes, errors included. Imports no torch or DeepSpeed.
"""
from __future__ import annotations

import contextlib
import glob
import logging
import os
import sys
from typing import TextIO

CPU_FALLBACK = "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
SHM_OP_LOADED = "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully"  # absolute_name()
EXPERT_GROUP_CREATED = "No existing process group found, creating a new group named: "


def gpu_installed() -> bool:
    """Whether the machine has a GPU device DeepSpeed could have found: NVIDIA's driver, AMD's (ROCm) or an
    accelerator device node."""
    return (os.path.isdir("/proc/driver/nvidia/gpus") or bool(glob.glob("/dev/nvidia[0-9]*"))
            or os.path.exists("/dev/kfd") or bool(glob.glob("/dev/accel*")))


class _NoCpuFallbackWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != CPU_FALLBACK


def drop_cpu_fallback_warning() -> None:
    """On a machine without a GPU device, DeepSpeed's logger drops its warning that it chose the CPU (its
    logger is this one object, whether DeepSpeed was imported yet or not)."""
    if not gpu_installed():
        logging.getLogger("DeepSpeed").addFilter(_NoCpuFallbackWarning())


class _LineFilter:
    """A text stream that passes on every line but those starting with one of `dropped`."""

    def __init__(self, stream: TextIO, dropped: tuple[str, ...]):
        self.stream, self.dropped, self.pending = stream, dropped, ""

    def write(self, text: str) -> int:
        self.pending += text
        while "\n" in self.pending:
            line, self.pending = self.pending.split("\n", 1)
            if not line.startswith(self.dropped):
                self.stream.write(line + "\n")
        return len(text)

    def drain(self) -> None:
        if self.pending:
            self.stream.write(self.pending)
        self.pending = ""
        self.stream.flush()

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


@contextlib.contextmanager
def without_lines(*dropped: str):
    """Inside, what Python prints on stdout passes line by line, but for the lines that start with `dropped`."""
    original = sys.stdout
    filtered = sys.stdout = _LineFilter(original, dropped)
    try:
        yield
    finally:
        sys.stdout = original
        filtered.drain()
