"""The calibration's published runs (tools/published_runs.json) as the planner's command lines, their published
steps, and the fits of the Calibration to them (`fit_calibration` on the A100 runs, `fit_matmul` on the H100 runs;
tests/test_published_runs.py checks that the shipped values are these fits)."""
from __future__ import annotations

from dataclasses import replace

from megatron import accounting
from megatron.accounting.plan.calibration import Calibration, StepParts, step_parts
from megatron.accounting.plan.flags import parse_flags
from megatron.accounting.plan.options import OPTIONS, option_stage, training_setup
from megatron.accounting.plan.request import model_config, plan_request
from megatron.accounting.predict.fit import stage_config
from megatron.model.presets import LLAMA_FLAGS


def published_run_args(run: dict) -> list[str]:
    """The planner's flags for one run of tools/published_runs.json."""
    flags = dict(num_layers=run["num_layers"], hidden_size=run["hidden_size"],
                 num_attention_heads=run["num_attention_heads"], vocab_size=run["vocab_size"],
                 seq_length=run["seq_length"], micro_batch_size=run["micro_batch_size"],
                 global_batch_size=run["global_batch_size"], gpus=run["gpus_per_node"], nodes=run["nodes"],
                 tp=run["tp"], pp=run["pp"], gpu=run["gpu"], precision=run["precision"],
                 inter_node_bandwidth=run["inter_node_bandwidth"])
    flags.update({name: run[name] for name in LLAMA_FLAGS if name in run and not isinstance(run[name], bool)})
    switches = [name for name in (*LLAMA_FLAGS, "use_rotary_position_embeddings", "recompute") if run.get(name) is True]
    args = [item for name, value in flags.items() for item in (f"--{name.replace('_', '-')}", str(value))]
    return args + [f"--{name.replace('_', '-')}" for name in switches] + (
        ["--use-flash-attn-v2"] if run.get("use_flash_attn") else [])


def published_run_option(run: dict) -> str:
    """The planner's option a published run trained with: DP (ZeRO 0) or Z1."""
    return next(label for label, stage, offload, *_ in OPTIONS if stage == run["zero_stage"] and not offload)


def published_step_seconds(run: dict) -> float:
    """The run's seconds per step: from its published tokens/s per GPU where it gives those (torchtitan does),
    from its model TFLOP/s per GPU (the MFU's numerator: Llama 3's), else from its hardware TFLOP/s per GPU."""
    gpus = run["gpus_per_node"] * run["nodes"]
    if "published_tokens_per_s_per_gpu" in run:
        return run["global_batch_size"] * run["seq_length"] / (run["published_tokens_per_s_per_gpu"] * gpus)
    config = model_config(parse_flags(published_run_args(run)))
    if "published_model_tflops_per_gpu" in run:
        flops = accounting.model_flops_per_iteration(config, run["global_batch_size"])
        return flops / (run["published_model_tflops_per_gpu"] * 1e12 * gpus)
    flops = accounting.hardware_flops_per_iteration(config, run["global_batch_size"])
    return flops / (run["published_tflops_per_gpu"] * 1e12 * gpus)


def published_tflops_per_gpu(run: dict) -> float:
    """The run's hardware TFLOP/s per GPU: as published, or its published step (published_step_seconds) counted by
    our FLOPs."""
    if "published_tflops_per_gpu" in run:
        return run["published_tflops_per_gpu"]
    config = model_config(parse_flags(published_run_args(run)))
    flops = accounting.hardware_flops_per_iteration(config, run["global_batch_size"])
    return flops / published_step_seconds(run) / (run["gpus_per_node"] * run["nodes"]) / 1e12


def published_run_parts(run: dict) -> StepParts:
    """The run's step on its GPUs, split by what the calibration scales (calibration.step_parts)."""
    request = plan_request(parse_flags(published_run_args(run)))
    _, stage, offload_optimizer, offload_params, device = option_stage(published_run_option(run))
    setup = training_setup(request, stage, offload_optimizer, offload_params, device)
    f = request.flags
    return step_parts(stage_config(request.config, f.pp), setup, request.hardware, f.gpus, f.nodes, f.flash_attn)[1]


def fit_calibration(runs: list[dict]) -> Calibration:
    """The Calibration that brings StepParts.expected closest to the runs' published steps: least squares of the
    relative errors, linear in 1/matmul, memory_passes and 1/link."""
    import numpy  # only the fit needs it

    rows, targets = [], []
    for run in runs:
        parts, seconds = published_run_parts(run), published_step_seconds(run)
        rows.append([parts.stretch * parts.matmul / seconds, parts.stretch * parts.memory / seconds,
                     (parts.stretch * parts.model_parallel + parts.data_parallel) / seconds])
        targets.append(1 - (parts.other + parts.offload) / seconds)
    inverse_matmul, memory_passes, inverse_link = numpy.linalg.lstsq(numpy.array(rows), numpy.array(targets),
                                                                     rcond=None)[0]
    return Calibration(matmul=float(1 / inverse_matmul), memory_passes=float(memory_passes),
                       link=float(1 / inverse_link))


def fit_matmul(runs: list[dict], held: Calibration) -> Calibration:
    """`held` with the matmul fraction that brings StepParts.expected closest to the runs' published steps (least
    squares of the relative errors, linear in 1/matmul), its memory passes and link kept: the H100 runs are too
    few to fit all three, and the fraction of the large-matmul rate a layer reaches is what differs between GPU
    generations, where the memory-bound kernels' passes and NCCL's share of a link are the software's."""
    rows, targets = [], []
    for run in runs:
        parts, seconds = published_run_parts(run), published_step_seconds(run)
        rest = held.memory_passes * parts.stretch * parts.memory + (
            parts.stretch * parts.model_parallel + parts.data_parallel) / held.link + parts.other + parts.offload
        rows.append(parts.stretch * parts.matmul / seconds)
        targets.append(1 - rest / seconds)
    inverse_matmul = sum(r * t for r, t in zip(rows, targets)) / sum(r * r for r in rows)
    return replace(held, matmul=1 / inverse_matmul)


def leave_one_out_error(runs: list[dict], fit) -> float:
    """The largest |published step / expected step - 1| of a run when `fit` (runs -> Calibration) leaves it out."""
    return max(abs(published_step_seconds(run) / published_run_parts(run).expected(
        fit([other for other in runs if other is not run])).total - 1) for run in runs)

