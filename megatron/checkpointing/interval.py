"""How often to save: the checkpoint interval that loses the least time in expectation (Young 1974; Daly 2006).

A run saves after every `interval` seconds of training, and a save takes `save` seconds. A failure strikes at a
uniformly random moment of a cycle (interval + save) and throws away, on average, half a cycle of work; failures
come every `mtbf` seconds on average. The expected fraction of time lost is then

    save / (interval + save)  +  (interval + save) / (2 mtbf)

(the saves themselves, and the recomputation after a failure; the restart's own start-up is left out: no interval
changes it). It is least where interval + save = sqrt(2 save mtbf): Young's sqrt(2 x save time x MTBF), less the
save itself as in Daly's first-order form. When a save takes longer than half the MTBF the formula stops holding
(most cycles fail before they end) and Daly's advice is to save every MTBF.

Stdlib only: the training loop (megatron/training.py) and tools/zero_plan.py both use it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


def optimal_interval_seconds(save_seconds: float, mtbf_seconds: float) -> float:
    """Seconds of training between saves that lose the least time in expectation."""
    if save_seconds <= 0 or mtbf_seconds <= 0:
        raise ValueError(f"save time and MTBF must be > 0 (got {save_seconds} s and {mtbf_seconds} s)")
    if save_seconds >= 2 * mtbf_seconds:
        return mtbf_seconds
    return math.sqrt(2 * save_seconds * mtbf_seconds) - save_seconds


def expected_loss_fraction(interval_seconds: float, save_seconds: float, mtbf_seconds: float) -> float:
    """The fraction of wall-clock time spent saving or recomputing lost work, to first order."""
    cycle = interval_seconds + save_seconds
    return save_seconds / cycle + cycle / (2 * mtbf_seconds)


@dataclass(frozen=True)
class IntervalAdvice:
    """The interval that fits beside the one a run uses, in iterations and seconds of training."""
    save_seconds: float
    mtbf_hours: float
    seconds_per_iteration: float
    best_iterations: int
    best_loss: float  # expected fraction of time lost at best_iterations
    used_iterations: int | None  # --save-interval; None: saves only at the end
    used_loss: float | None

    def line(self) -> str:
        best = (f"the interval that loses the least time in expectation is {self.best_iterations} iterations "
                f"({_duration(self.best_iterations * self.seconds_per_iteration)}; "
                f"{100 * self.best_loss:.1f}% of the time lost)")
        if self.used_iterations is None:
            used = "this run saves only at its end (no --save-interval)"
        else:
            used = (f"this run saves every {self.used_iterations} iterations "
                    f"({100 * self.used_loss:.1f}% lost; --save-interval)")
        return (f" > checkpoint interval: a save took {self.save_seconds:.2f} s and an iteration "
                f"{self.seconds_per_iteration:.3f} s; with --mtbf-hours {self.mtbf_hours:g} {best}; {used}")


def advise(save_seconds: float, seconds_per_iteration: float, mtbf_hours: float,
           used_iterations: int | None) -> IntervalAdvice:
    """The Young/Daly interval in whole iterations (at least 1) beside the run's own --save-interval."""
    mtbf = mtbf_hours * 3600.0
    best = max(1, round(optimal_interval_seconds(save_seconds, mtbf) / seconds_per_iteration))

    def loss(iterations: int) -> float:
        return expected_loss_fraction(iterations * seconds_per_iteration, save_seconds, mtbf)

    return IntervalAdvice(save_seconds, mtbf_hours, seconds_per_iteration, best, loss(best),
                          used_iterations, None if used_iterations is None else loss(used_iterations))


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
