"""A step's host work: what the engine's Python does per parameter tensor, per stage-3 module hook, per bucket
flush and per host synchronisation, counted from the run's config (issue 55: on an H100 the step-time model,
without it, predicted 46/40/44/62 ms against 80/42/127/282 measured at ZeRO 0/1/2/3).

    host = tensors x per_tensor_s + module_hooks x per_module_s + flushes x per_flush_s + syncs x per_sync_s

The counts (`host_counts`) are per optimizer step; the coefficients (`HostCoefficients`) are measured at start-up
by megatron/accounting/measure/host_probe.py on a skeleton engine, the run's module tree at a tiny width, or for
tools/zero_plan.py
taken from HOST_COEFFICIENTS, a table per device class.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron.accounting.predict.memory import runs_bf16_optimizer
from megatron.accounting.predict.step_time import (_bucket_sizes, _engine_allreduces, _gradient_order, _modules,
                                                 _stage3_gathers, _stage3_reduce_scatters, _zero12_buckets)
from megatron.accounting.predict.training_setup import TrainingSetup
from megatron.model.config import GPTConfig

# Host reads (synchronisations with the accelerator) per step outside logging iterations, by ZeRO stage and
# whether DeepSpeed's loss-scaled (16-bit) path runs, as tests/test_host_syncs.py counts them on a real engine:
# stage 0 the gradient norm deciding a skip; stages 1-2 in 16 bits the overflow flag and that norm (fp32: the
# norm alone); stage 3 the norm's is_invalid_grad_norm
SYNCS: dict[tuple[int, bool], int] = {(0, False): 1, (0, True): 1, (1, False): 1, (1, True): 2, (2, False): 1,
                                      (2, True): 2, (3, False): 1, (3, True): 1}
# modules of a GPTModel besides its layers' (the model, word and position embeddings, the embedding dropout, the
# layers' ModuleList, the final LayerNorm), and of each layer (the layer, two LayerNorms, attention and MLP with two
# linears each, the hidden dropout); DeepSpeed's stage 3 hooks every one of them
_END_MODULES, _LAYER_MODULES = 6, 10


@dataclass(frozen=True)
class HostCounts:
    """What the engine's host work is counted in, per optimizer step of one rank."""
    tensors: int  # parameter tensors on the rank, times the micro-batches (their gradient hooks fire in each)
    module_hooks: int  # stage 3: modules hooked for gathering and releasing, times the micro-batches; 0 below
    flushes: int  # gradient buckets reduced, and at stage 3 parameter all-gathers, in a step
    syncs: int  # host reads of accelerator values per step (SYNCS)


@dataclass(frozen=True)
class HostCoefficients:
    """Seconds of host work per counted item (HostCounts); `source` says where they come from ("probe": the
    start-up skeleton; otherwise the HOST_COEFFICIENTS entry)."""
    per_tensor_s: float
    per_module_s: float
    per_flush_s: float
    per_sync_s: float
    source: str = "probe"
    seconds: float | None = None  # how long the start-up probe took

    def seconds_for(self, counts: HostCounts) -> float:
        return (counts.tensors * self.per_tensor_s + counts.module_hooks * self.per_module_s
                + counts.flushes * self.per_flush_s + counts.syncs * self.per_sync_s)


# Coefficients per device class for tools/zero_plan.py, which cannot probe the device it plans for. "cpu": what
# megatron/accounting/measure/host_probe.py measured for the tiny preset's ZeRO-3 on 2 gloo ranks of the loaded 2-core
# dev box (DP's
# probe: 109 us/tensor, 4 us/flush). "cuda": the first H100 run's gaps between measured and predicted step at ZeRO 2
# and 3 (docs/gpu-reference.md: 82 and 220 ms for GPT-2 125M, one GPU, bf16; 148 tensors, 126 hooked modules, 19
# flushes), put on the tensors (stage 2) and the module hooks (the rest at stage 3): fitted to the run it describes,
# until a GPU's own probe records its coefficients.
HOST_COEFFICIENTS: dict[str, HostCoefficients] = {
    "cpu": HostCoefficients(per_tensor_s=1.30e-3, per_module_s=0.59e-3, per_flush_s=1.11e-3, per_sync_s=6.3e-6,
                            source="table's cpu"),
    "cuda": HostCoefficients(per_tensor_s=0.55e-3, per_module_s=1.1e-3, per_flush_s=0.0, per_sync_s=0.0,
                             source="table's cuda (the first H100 run before the host fixes: an upper bound)"),
}


def hooked_modules(config: GPTConfig, setup: TrainingSetup) -> int:
    """Modules of the rank's GPTModel (every one of which DeepSpeed's stage 3 hooks): the ends and each layer's."""
    return _END_MODULES + _LAYER_MODULES * (config.num_layers // setup.pipeline_parallel_size)


def parameter_tensors(config: GPTConfig, setup: TrainingSetup, stage: int) -> int:
    """Parameter tensors of pipeline `stage` on one rank (the tied word embedding once on a single stage)."""
    modules = _modules(config, setup.tensor_parallel_size, setup.pipeline_parallel_size, stage)
    return sum(len(module.sizes) for module in modules)


def bucket_flushes(config: GPTConfig, setup: TrainingSetup, stage: int, buckets: dict | None) -> int:
    """Buckets the engine flushes in a step: stage 0 (and the bf16 optimizer) its all-reduce chunks of the
    gradients when data-parallel; stages 1-2 the reduce buckets of each gradient reduction (at every micro-batch at
    stage 2, at the last at stage 1; the optimizer's order on CPU, the gradients' with CUDA's overlap_comm), also
    on one rank; stage 3 at every micro-batch its reduce-scatter buckets and, data-parallel, its parameter
    all-gathers (step_time.messages_per_step's replays of DeepSpeed 0.19.8)."""
    sizes = _bucket_sizes(buckets)
    modules = _modules(config, setup.tensor_parallel_size, setup.pipeline_parallel_size, stage)
    g, dp = setup.gradient_accumulation_steps, setup.zero_partitions
    if setup.zero_stage == 0 or runs_bf16_optimizer(setup):
        return _engine_allreduces(modules) if dp > 1 else 0
    if setup.zero_stage in (1, 2):
        order = _gradient_order(modules, stage3=False) if setup.zero_stage == 2 or setup.device == "cuda" else [
            (m, i) for group in (0, 1) for m, module in enumerate(modules)
            for i in range(len(module.sizes)) if module.group(i) == group]
        reductions = g if setup.zero_stage == 2 else 1
        return reductions * _zero12_buckets(modules, order, sizes["reduce_bucket_size"])
    gathers = _stage3_gathers(modules, sizes) if dp > 1 else 0  # one rank keeps every parameter whole
    return g * (_stage3_reduce_scatters(modules, sizes["reduce_bucket_size"]) + gathers)


def host_counts(config: GPTConfig, setup: TrainingSetup, stage: int, buckets: dict | None) -> HostCounts:
    """The step's HostCounts for one rank of pipeline `stage`; `buckets` the DeepSpeed config's
    zero_optimization section (keys it leaves out take DeepSpeed's defaults)."""
    g = setup.gradient_accumulation_steps
    return HostCounts(
        tensors=g * parameter_tensors(config, setup, stage),
        module_hooks=g * hooked_modules(config, setup) if setup.zero_stage == 3 else 0,
        flushes=bucket_flushes(config, setup, stage, buckets),
        syncs=SYNCS[setup.zero_stage, setup.precision != "fp32"])


def host_seconds(config: GPTConfig, setup: TrainingSetup, stage: int, buckets: dict | None,
                 coefficients: HostCoefficients | None) -> float:
    """Predicted seconds of the step's host work; 0 without coefficients (not probed)."""
    if coefficients is None:
        return 0.0
    return coefficients.seconds_for(host_counts(config, setup, stage, buckets))
