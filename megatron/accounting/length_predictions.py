"""What megatron/accounting/predict/ predicts for one training iteration at a sequence length: FLOPs, the printing
rank's memory, ZeRO traffic and the step time. A curriculum (megatron/curriculum.py) changes the length from step
to step, so the loop's Reporter asks at each step's length (docs/curriculum.md); each length is computed once."""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from statistics import fmean

from megatron import accounting
from megatron.accounting.predict.host_work import HostCoefficients, host_seconds
from megatron.accounting.predict.step_time import ComputeRates, LinkCosts, StepTime, predict_step_time
from megatron.model.config import GPTConfig


@dataclass(frozen=True)
class Predicted:
    model_flops: float  # per iteration, no recomputation: TFLOPs and MFU (docs/log-lines.md)
    hardware_flops: float  # per iteration, recomputed forwards included: HFU
    memory: dict  # accounting.memory_per_rank of the printing rank
    traffic: float  # bytes sent per iteration
    time: StepTime | None  # None: the start-up probes were skipped


@dataclass
class LengthPredictions:
    config: GPTConfig  # the run's, at --seq-length
    setup: accounting.TrainingSetup
    stage: int  # the printing rank's pipeline stage
    zero: dict  # the DeepSpeed config's zero_optimization section
    # the start-up probes' rates and link (megatron/accounting/measure/step_timing.py); None: no time predicted
    rates: ComputeRates | None = None
    link: LinkCosts | None = None
    host: HostCoefficients | None = None  # megatron/accounting/measure/host_probe.py's; None: no host part
    _known: dict = field(default_factory=dict)

    def at(self, seq_length: int) -> Predicted:
        if seq_length not in self._known:
            self._known[seq_length] = self._predict(replace(self.config, seq_length=seq_length))
        return self._known[seq_length]

    def _predict(self, config: GPTConfig) -> Predicted:
        setup = self.setup
        batch = setup.micro_batch_size * setup.gradient_accumulation_steps * setup.data_parallel_size
        time = None
        if self.rates is not None:
            time = predict_step_time(config, setup, self.stage, self.rates, self.link, self.zero,
                                     overlap_comm=bool(self.zero.get("overlap_comm", False)),
                                     host=host_seconds(config, setup, self.stage, self.zero, self.host))
        return Predicted(
            model_flops=accounting.model_flops_per_iteration(config, batch),
            hardware_flops=accounting.hardware_flops_per_iteration(config, batch),
            memory=accounting.memory_per_rank(config, setup, self.stage),
            traffic=sum(accounting.zero_traffic_per_step(config, setup, self.stage, self.zero).values())
            + accounting.ulysses_all_to_all_per_step(config, setup)
            + sum(accounting.moe_all_to_all_per_step(config, setup).values()),
            time=time)

    def over(self, lengths: list[int]) -> Predicted:
        """The mean per iteration over steps of these lengths (the memory: at the last one's)."""
        if len(set(lengths)) == 1:  # no curriculum, or a constant stretch of one: the figures as computed
            return self.at(lengths[0])
        each = [self.at(length) for length in lengths]
        time = None
        if each[0].time is not None:
            time = StepTime(**{part.name: fmean(getattr(p.time, part.name) for p in each)
                               for part in fields(StepTime)})
        return Predicted(model_flops=fmean(p.model_flops for p in each),
                         hardware_flops=fmean(p.hardware_flops for p in each), memory=each[-1].memory,
                         traffic=fmean(p.traffic for p in each), time=time)
