"""Step time, measured beside predicted (docs/zero-tradeoff-reference.md, "Time per step"): the start-up probes and
prediction, and the clock on the offloaded optimizer's step.

Communication is timed by megatron/accounting/measure/comm_counter.py; the loop's own clock gives each step's total;
what the
offloaded optimizer's step takes (host Adam, its copies, NVMe swaps) is timed here; compute is the rest.
"""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from megatron.arguments import Args
from megatron.accounting.measure.comm_counter import CommCounter
from megatron.errors import ZeroLabError
from megatron.initialize import DistInfo
from megatron.accounting import TrainingSetup
from megatron.accounting.predict.host_work import HostCoefficients, host_seconds
from megatron.accounting.predict.step_time import ComputeRates, LinkCosts, StepTime

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# 1: no start-up probes, so no prediction and no time lines (the suite's runs that do not test them, to start
# faster); docs/log-lines.md
SKIP_PROBES = "ZERO_LAB_SKIP_PROBES"
PROBES_SKIPPED_LINE = f" > step time not predicted: {SKIP_PROBES}=1 skips the start-up probes (no time lines)"


def probes_skipped(environ=os.environ) -> bool:
    """Whether SKIP_PROBES asks to skip the probes; a value other than 0 or 1 is refused in one line."""
    value = environ.get(SKIP_PROBES, "0")
    if value not in ("0", "1"):
        raise ZeroLabError(f"{SKIP_PROBES}={value}: expected 0 (probe, the default) or 1 (skip the probes)")
    return value == "1"


def _probe_optimizer(args: Args):
    """The optimizer the run steps with (megatron/optimizer.py), built over the probe's parameters."""
    from megatron.optimizer import build_optimizer

    return lambda params: build_optimizer(torch.nn.ParameterList(params), args)


def predict_at_startup(args: Args, dist_info: DistInfo, ds_config: dict, setup: TrainingSetup,
                       comm: CommCounter | None, steps
                       ) -> tuple[StepTime, ComputeRates, LinkCosts, HostCoefficients | None]:
    """Measure this rank's compute rates, the data-parallel link (unless --link-bandwidth-gbps and
    --link-latency-us describe it) and the engine's host work (megatron/accounting/measure/host_probe.py's skeleton
    engine; None
    under pipeline parallelism), then predict one step. `comm`: the run's comm counter, which the host probe
    puts back after counting its skeletons' collectives with its own; `steps`: the trainer's functions its skeletons
    run (megatron/accounting/measure/host_probe.py's TrainerSteps). Every rank calls this at the same time: the
    ranks share the host's cores and links in training, and so they do in the probes. The probes draw
    from forked generators, so the run's own random numbers are the ones it would draw without them."""
    from megatron.accounting.measure.comm_probe import probe_buffers, probe_link
    from megatron.accounting.measure.compute_probe import probe_compute
    from megatron.accounting.measure.host_probe import probe_host
    from megatron.accounting.predict.step_time import link_costs_from_flags, predict_step_time

    backend = "nccl" if dist_info.on_cuda else "gloo"
    # ZeRO's collectives run over the data-parallel group; without data parallelism (TP or PP only) the
    # traffic is the model-parallel ranks', so the whole world's link is the one measured
    data_group = dist_info.parallel.data.handle if dist_info.parallel.data.size > 1 else None
    devices = [dist_info.device] if dist_info.on_cuda else []
    zero = ds_config.get("zero_optimization", {})
    stage = args.parallel.pipeline_model_parallel_size - 1  # the logging rank's pipeline stage
    dist.barrier()
    with torch.random.fork_rng(devices=devices):
        rates = probe_compute(args.model, setup, dist_info.device, _DTYPES[args.deepspeed.precision],
                              _probe_optimizer(args), offload_device_path=args.deepspeed.nvme_path,
                              aio_section=ds_config.get("aio"))
        log = args.logging
        if log.link_bandwidth_gbps is not None:
            link = link_costs_from_flags(backend, log.link_bandwidth_gbps, log.link_latency_us)
        else:
            # each kind timed as the run issues it, at a buffer near the step's largest message of it
            link = probe_link(data_group, dist_info.device, backend,
                              buffers=probe_buffers(args.model, setup, stage, zero))
        host = probe_host(args, dist_info, setup, zero, comm, steps)
    predicted = predict_step_time(args.model, setup, stage, rates, link, zero,
                                  overlap_comm=bool(zero.get("overlap_comm", False)),
                                  host=host_seconds(args.model, setup, stage, zero, host))
    return predicted, rates, link, host


class OffloadStepClock:
    """Seconds spent in the engine's optimizer step when ZeRO offloads it (host Adam, the copies to and from
    the host, NVMe swaps), less the collectives inside it, which the comm counter already times. On CUDA it
    synchronises before and after the step; the step's first copy to the host waits for the backward anyway."""

    def __init__(self, counter: CommCounter | None, on_cuda: bool):
        self.counter, self.on_cuda, self.seconds = counter, on_cuda, 0.0

    def _communication(self) -> float:
        return sum(self.counter.seconds().values()) if self.counter is not None else 0.0

    def install(self, engine) -> None:
        """Time engine.step() (an instance attribute over DeepSpeed's method)."""
        step = engine.step

        def timed_step(*args, **kwargs):
            if self.on_cuda:
                torch.cuda.synchronize()
            communication, start = self._communication(), time.perf_counter()
            try:
                return step(*args, **kwargs)
            finally:
                if self.on_cuda:
                    torch.cuda.synchronize()
                self.seconds += time.perf_counter() - start - (self._communication() - communication)

        engine.step = timed_step
