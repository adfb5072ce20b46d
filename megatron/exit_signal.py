"""`--exit-signal-handler` (Megatron's flag): SIGTERM asks the run to save and stop after the current step.

A scheduler preempting or ending a job (Slurm, PBS) sends SIGTERM, then SIGKILL after a grace period.
The handler only sets a flag, since a signal can arrive in the middle of a collective or a write; the
training loop asks `stop_requested` every min(--log-interval, 10) steps (megatron/training.py's
EXIT_SIGNAL_POLL_STEPS: the question is a collective and a host sync, too costly after every step), and
the ranks agree through an all-reduce (a scheduler may signal some ranks before others), so all of them
save the same iteration and exit 0.

`--exit-duration-in-mins` (Megatron's flag too) stops the run the same way once that many minutes have passed since
the ranks started: `minutes_past` is asked after every step, as Megatron-DeepSpeed asks, and the ranks agree by the
same all-reduce.
"""
import signal
import time

import torch
import torch.distributed as dist


class ExitSignalHandler:
    def __init__(self, signum: int = signal.SIGTERM):
        self.signum = signum
        self.received = False
        signal.signal(signum, self._handle)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    def _handle(self, signum, frame):
        self.received = True

    def stop_requested(self, device: torch.device) -> bool:
        """True on every rank once any rank has received the signal (a collective: all ranks call it)."""
        flag = torch.tensor([int(self.received)], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def minutes_past(limit: float, started: float, device: torch.device) -> float | None:
    """The minutes since `started` (this rank's process start, time.time()'s clock) once any rank is past `limit`,
    else None (a collective: all ranks call it)."""
    minutes = (time.time() - started) / 60.0
    flag = torch.tensor([int(minutes > limit)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return minutes if flag.item() else None
