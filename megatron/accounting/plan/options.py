"""Every ZeRO option the planner weighs, and for each (`plan`) the predicted memory per GPU, the bytes it sends
and moves over PCIe, whether it fits, the longest sequence that fits, and with --gpu its expected step by part
(`timing`), all from megatron/accounting/predict/."""
from __future__ import annotations

from dataclasses import dataclass, replace

from megatron import accounting
from megatron.accounting.plan import calibration
from megatron.accounting.plan.request import PlanRequest, expert_parallel_sizes
from megatron.accounting.predict.fit import peak_memory, stage_config
from megatron.accounting.predict.host_work import HOST_COEFFICIENTS, host_seconds
from megatron.accounting.predict.memory import async_save_copy_bytes
from megatron.accounting.predict.step_time import StepTime
from megatron.accounting.predict.traffic import OWNER_REDUCTION
from megatron.model.config import GPTConfig

GB = float(2**30)
# (label, ZeRO stage, offload optimizer, offload params, offload device), in the order they are tried
OPTIONS = [("DP", 0, False, False, "cpu"), ("Z1", 1, False, False, "cpu"), ("Z2", 2, False, False, "cpu"),
           ("Z3", 3, False, False, "cpu"), ("Z3 + optimizer offload", 3, True, False, "cpu"),
           ("Z3 + full offload", 3, True, True, "cpu"), ("Z3 + NVMe offload", 3, True, True, "nvme")]


@dataclass
class Plan:
    option: str
    params_gb: float
    grads_gb: float
    optim_gb: float
    model_states_gb: float
    activations_gb: float
    output_buffer_gb: float
    total_gb: float
    offloaded_gb: float
    traffic_gb: float
    bytes_per_param: float
    pcie_gb: float
    nvme_gb: float
    fits: bool
    longest_seq: int  # the longest --seq-length that fits at micro-batch 1 (`longest_sequence`); 0: none
    # with --gpu: the predicted step (ms) by part, exposed communication (less what overlaps), and its rates
    step_ms: float | None = None
    compute_ms: float | None = None
    communication_ms: float | None = None
    offload_ms: float | None = None
    bubble_ms: float | None = None
    host_ms: float | None = None  # the engine's host work, HOST_COEFFICIENTS["cuda"]'s (not in step_ms)
    # --async-save: the host copy of the checkpoint files of the GPU that writes most (data-parallel rank 0)
    async_save_copy_gb: float | None = None
    tokens_per_s: float | None = None
    tflops_per_gpu: float | None = None  # model FLOPs (the MFU numerator)
    hardware_tflops_per_gpu: float | None = None  # recomputation counted, as the published runs count
    days: float | None = None
    bound: dict | None = None  # the same fields from the bound: every FLOP at the large-matmul rate, ...


def option_stage(label: str) -> tuple:
    """OPTIONS' row of `label` (an MoE plan's "Z1 EP=2" is Z1's): (label, stage, offload optimizer, offload params,
    device)."""
    return next(option for option in OPTIONS if option[0] == label.split(" EP=")[0])


def training_setup(request: PlanRequest, stage: int, offload_optimizer: bool, offload_params: bool, device: str,
                   expert_parallel_size: int = 1) -> accounting.TrainingSetup:
    f = request.flags
    return accounting.TrainingSetup(
        world_size=request.world_size, micro_batch_size=f.micro_batch_size,
        gradient_accumulation_steps=request.accumulation, tensor_parallel_size=f.tp, pipeline_parallel_size=f.pp,
        sequence_parallel=f.sequence_parallel, sequence_parallel_size=f.sp, expert_parallel_size=expert_parallel_size,
        precision=f.precision, zero_stage=stage, offload_optimizer=offload_optimizer, offload_params=offload_params,
        offload_device=device, activation_recompute=f.recompute, activation_offload=f.checkpoint_in_cpu)


def layout_options(request: PlanRequest) -> list[tuple]:
    """OPTIONS, each at every expert-parallel size for an MoE model (without ZeRO-3, which DeepSpeed 0.19 cannot
    run with MoE: docs/moe.md): (label, stage, offload optimizer, offload params, device, EP)."""
    if not request.config.is_moe:
        return [(*option, 1) for option in OPTIONS]
    return [(f"{label} EP={ep}", stage, optimizer, params, device, ep)
            for ep in expert_parallel_sizes(request)
            for label, stage, optimizer, params, device in OPTIONS if stage < 3]


def plan(request: PlanRequest) -> list[Plan]:
    config, pp = request.config, request.flags.pp
    total_params = accounting.count_parameters(config)
    busiest = stage_config(config, pp)
    plans = []
    for label, stage, offload_optimizer, offload_params, device, ep in layout_options(request):
        if stage >= 2 and pp > 1:
            continue  # DeepSpeed's pipeline engine supports ZeRO 0 and 1 only
        setup = training_setup(request, stage, offload_optimizer, offload_params, device, ep)
        memory = peak_memory(config, setup)  # every pipeline stage; the busiest one decides
        traffic = max(sum(accounting.zero_traffic_per_step(busiest, setup, s).values()) for s in range(pp)) \
            + sum(accounting.moe_all_to_all_per_step(busiest, setup).values())
        moved = accounting.offload_transfer_per_step(busiest, setup, 0)
        plans.append(Plan(option=label, params_gb=memory["params"] / GB, grads_gb=memory["grads"] / GB,
                          optim_gb=memory["optim"] / GB, model_states_gb=memory["model_states"] / GB,
                          activations_gb=memory["activations"] / GB, output_buffer_gb=memory["output_buffer"] / GB,
                          total_gb=memory["total"] / GB, offloaded_gb=memory["offloaded"] / GB,
                          traffic_gb=traffic / GB, bytes_per_param=traffic / total_params,
                          pcie_gb=moved["pcie"] / GB, nvme_gb=moved["nvme"] / GB,
                          fits=memory["total"] / GB <= request.usable_gb,
                          longest_seq=longest_sequence(busiest, setup, request.usable_gb),
                          async_save_copy_gb=async_save_copy_gb(request, setup),
                          **timing(request, busiest, setup)))
    return plans


def async_save_copy_gb(request: PlanRequest, setup: accounting.TrainingSetup) -> float | None:
    """With --async-save, the largest host copy a GPU keeps (megatron/accounting/predict/memory.py's
    async_save_copy_bytes on data-parallel rank 0 of each pipeline stage), GB; None without."""
    if not request.flags.async_save:
        return None
    return max(async_save_copy_bytes(request.config, setup, stage)
               for stage in range(request.flags.pp)) / GB


def longest_sequence(busiest: GPTConfig, setup: accounting.TrainingSetup, usable_gb: float) -> int:
    """The longest sequence whose predicted memory fits `usable_gb` on every GPU of the option `setup`, at
    micro-batch 1 and the plan's recomputation: a multiple of the DeepSpeed-Ulysses size (`longest_length`).
    0: none fits."""
    one = replace(setup, micro_batch_size=1)
    return longest_length(lambda length: gpu_gb(busiest, one, length) <= usable_gb, setup.sequence_parallel_size)


def at_length(config: GPTConfig, length: int) -> GPTConfig:
    """`config` at `length` tokens (learned positions grow the table with it)."""
    return replace(config, seq_length=length, max_position_embeddings=length)


def gpu_gb(busiest: GPTConfig, setup: accounting.TrainingSetup, length: int) -> float:
    """The predicted peak of the busiest GPU at `length` tokens, GB: the largest over the pipeline's stages."""
    config = at_length(busiest, length)
    return max(accounting.memory_per_rank(config, setup, stage)["total"]
               for stage in range(setup.pipeline_parallel_size)) / GB


def longest_length(fits, sp: int) -> int:
    """The longest multiple of `sp` tokens for which `fits(length)` holds, found by doubling and then halving the
    step (what fits grows shorter only as the length grows). 0: not even `sp` tokens fit."""
    if not fits(sp):
        return 0
    low = 1
    while low < 2**40 and fits(2 * low * sp):
        low *= 2
    step = low // 2
    while step:  # low fits, 2 low does not: add the largest steps that still fit
        low += step if fits((low + step) * sp) else 0
        step //= 2
    return low * sp


def timing(request: PlanRequest, busiest: GPTConfig, setup: accounting.TrainingSetup) -> dict:
    """The Plan's time fields of one option: the expected step by part in ms (StepParts.expected with the GPU
    kind's `calibration_for`), tokens/s, TFLOP/s per GPU, model FLOPs (the MFU numerator) and hardware FLOPs
    (recomputation counted, as the published runs count them), with --tokens the days to train; and `bound`,
    the same from the bound (`project`). `busiest`: the busiest pipeline stage's model (stage_config)."""
    hw, f = request.hardware, request.flags
    projected = calibration.step_parts(busiest, setup, hw, f.gpus, f.nodes, f.flash_attn) if hw else None
    if projected is None:
        return {}
    bound, parts = projected
    sequences = setup.micro_batch_size * setup.gradient_accumulation_steps * setup.data_parallel_size
    config = request.config

    def figures(step: StepTime) -> dict:
        tokens_per_s = sequences * config.seq_length / step.total
        flops = {f"{name}_per_gpu": count(config, sequences) / step.total / setup.world_size / 1e12
                 for name, count in (("tflops", accounting.model_flops_per_iteration),
                                     ("hardware_tflops", accounting.hardware_flops_per_iteration))}
        return dict(step_ms=step.total * 1e3, compute_ms=step.compute * 1e3,
                    communication_ms=(step.communication - step.overlap) * 1e3, offload_ms=step.offload * 1e3,
                    bubble_ms=step.bubble * 1e3, tokens_per_s=tokens_per_s, **flops,
                    days=request.token_budget / tokens_per_s / 86400 if request.token_budget else None)
    # the host work from the table's GPU coefficients: this machine cannot probe the GPU it plans for
    host = host_seconds(busiest, setup, setup.pipeline_parallel_size - 1, dict(OWNER_REDUCTION),
                        HOST_COEFFICIENTS["cuda"])
    return dict(**figures(parts.expected(calibration.calibration_for(hw))), host_ms=host * 1e3, bound=figures(bound))
