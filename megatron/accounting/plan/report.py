"""What the planner prints: the memory and step-time tables, the longest sequences, the lines that say where
the step times come from, the notes the tables cannot say, the checkpoint line and the JSON."""
from __future__ import annotations

import json
from dataclasses import asdict

from megatron import accounting
from megatron.accounting.plan import calibration
from megatron.accounting.plan.hardware import Hardware
from megatron.accounting.plan.levers import Longest
from megatron.accounting.plan.options import Plan
from megatron.accounting.plan.request import PlanRequest
from megatron.accounting.predict.host_work import HOST_COEFFICIENTS


def header(request: PlanRequest) -> str:
    """The first line: the model, its size, the batch, the GPUs and their layout, the precision."""
    f, config = request.flags, request.config
    name = f.model_size or f"{config.num_layers} layers x {config.hidden_size}"
    layout = f"TP={f.tp}, PP={f.pp}" + (f", SP={f.sp}" if f.sp > 1 else "")
    return (f"{name}: {accounting.count_parameters(config) / 1e9:.2f}B parameters, seq {f.seq_length}, micro batch "
            f"{f.micro_batch_size}, {request.world_size} GPUs ({layout}), {f.precision}\n")


def step_time_header(request: PlanRequest) -> str:
    """What the step times assume: the GPUs, their peak and links, the micro-batches a step, the token budget."""
    f, hw, accumulation = request.flags, request.hardware, request.accumulation
    return (f"\nstep time on {f.nodes} x {f.gpus} {hw.gpu}: {hw.peak_tflops:g} TFLOP/s {f.precision} peak x "
            f"{hw.efficiency:g}, {hw.intra_node_gbps:g} Gbit/s inside a node, {hw.inter_node_gbps:g} Gbit/s per "
            f"node between nodes, {hw.latency_us:g} us per message; {accumulation} micro-batch"
            f"{'es' if accumulation > 1 else ''} per step" + (f", {f.tokens} tokens" if request.token_budget else "")
            + "\n" + expected_line(hw) + "\n")


def json_report(request: PlanRequest, plans: list[Plan], best: Plan | None, why: str, advice: dict | None,
                levers: list[Longest]) -> str:
    hw = request.hardware
    gpu = None if hw is None else dict(
        gpu=hw.gpu, peak_tflops=hw.peak_tflops, efficiency=hw.efficiency, intra_node_gbps=hw.intra_node_gbps,
        inter_node_gbps=hw.inter_node_gbps, latency_us=hw.latency_us, tokens=request.token_budget)
    return json.dumps({"plans": [asdict(p) for p in plans], "hardware": gpu, "choice": best.option if best else None,
                       "why": why, "checkpoint": advice, "notes": notes(request, plans),
                       "levers": [asdict(row) for row in levers]}, indent=2)


def table(plans: list[Plan], usable_gb: float) -> str:
    header = ("option", "model states GB", "activations GB", "output buffer GB", "total GB/GPU",
              f"fits {usable_gb:.1f} GB", "sent GB/step", "bytes/param", "PCIe GB/step", "offloaded GB/GPU")
    rows = [header] + [(p.option, f"{p.model_states_gb:.2f}", f"{p.activations_gb:.2f}", f"{p.output_buffer_gb:.2f}",
                        f"{p.total_gb:.2f}", "yes" if p.fits else "no", f"{p.traffic_gb:.2f}",
                        f"{p.bytes_per_param:.2f}", f"{p.pcie_gb:.2f}",
                        f"{p.offloaded_gb:.2f}" + (" (NVMe)" if "NVMe" in p.option else ""))
                       for p in plans]
    if plans and plans[0].async_save_copy_gb is not None:  # --async-save: host memory beside the offloaded states
        header += ("async-save copy GB/GPU (host)",)
        rows = [header] + [(*row, f"{p.async_save_copy_gb:.2f}") for row, p in zip(rows[1:], plans)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def time_table(plans: list[Plan], tokens: bool, bubble: bool, recompute: bool) -> str:
    header = ["option", "fits", "step ms", "bound ms", "compute ms", "communication ms", "offload ms", "host ms"] + (
        ["bubble ms"] if bubble else []) + ["tokens/s", "TFLOP/s/GPU"] + (["hw TFLOP/s/GPU"] if recompute else []) + (
        ["days", "bound days"] if tokens else [])
    rows = [header]
    for p in plans:
        if p.step_ms is None:
            rows.append([p.option, "yes" if p.fits else "no"] + ["-"] * (len(header) - 2))
            continue
        rows.append([p.option, "yes" if p.fits else "no", f"{p.step_ms:.0f}", f"{p.bound['step_ms']:.0f}",
                     f"{p.compute_ms:.0f}", f"{p.communication_ms:.0f}", f"{p.offload_ms:.0f}", f"{p.host_ms:.0f}"]
                    + ([f"{p.bubble_ms:.0f}"] if bubble else []) + [f"{p.tokens_per_s:,.0f}", f"{p.tflops_per_gpu:.0f}"]
                    + ([f"{p.hardware_tflops_per_gpu:.0f}"] if recompute else [])
                    + ([f"{p.days:.1f}", f"{p.bound['days']:.1f}"] if tokens else []))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)



def longest_table(plans: list[Plan], request: PlanRequest) -> str:
    """How long a sequence fits per GPU, option by option; the positions are the model's (a Llama preset's rotary
    ones without --use-rotary-position-embeddings)."""
    f = request.flags
    positions = "rotary positions" if request.config.use_rotary_position_embeddings else "learned positions"
    given = [words for flag, words in ((f.tiled_mlp_compute, "tiled MLP"), (f.tiled_logits_loss, "tiled loss"),
                                       (f.checkpoint_in_cpu, "layer inputs in host memory")) if flag]
    lines = [f"longest sequence that fits {request.usable_gb:.1f} GB per GPU (micro batch 1, "
             f"{'with' if f.recompute else 'without'} recomputation, {''.join(w + ', ' for w in given)}{positions}, "
             f"SP={f.sp}):"]
    width = max(len(p.option) for p in plans)
    lines += [f"  {p.option.ljust(width)}  {f'{p.longest_seq:,}' if p.longest_seq else 'none'}" for p in plans]
    return "\n".join(lines)



def lever_table(rows: list[Longest], request: PlanRequest) -> str:
    """The longest sequence of each lever combination (levers.py), each row adding its flags to the row above, with
    the option that fits it longest, the GPU and host memory it takes there and which of the two one more slice
    of SP tokens would overflow."""
    f = request.flags
    header = ("levers", "adds", "longest", "option", "GPU GB", "host GB/node", "limit")
    table = [header] + [(r.levers, r.flags or "-", f"{r.longest_seq:,}" if r.longest_seq else "none", r.option or "-",
                         f"{r.gpu_gb:.1f}", f"{r.host_gb:.1f}", r.limit) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = [f"longest sequence per lever, each row adding to the one above (micro batch 1, SP={f.sp}, the option "
             f"that fits it longest; limits: {request.usable_gb:.1f} GB per GPU, {f.host_gb:g} GB of host memory "
             f"per node for the offloaded states and layer inputs, --host-gb):"]
    return "\n".join(lines + ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                              for row in table])


def calibration_summary() -> str:
    """Which published runs the calibration covers and how far each lands when left out of the fit (the README
    quotes this phrase; tests/test_published_runs.py holds it to it)."""
    published = calibration.PUBLISHED
    a100, h100 = published["calibration"], published["h100_calibration"]
    return (f"calibrated on {len(published['runs'])} published A100 runs: each within "
            f"{100 * a100['leave_one_out_error']:.0f}%; on {len(published['h100_runs'])} published H100 runs: each "
            f"within {100 * h100['leave_one_out_error']:.0f}%")


def expected_line(hw: Hardware) -> str:
    c = calibration.calibration_for(hw)
    runs = "H100 runs' matmul fraction" if hw.kind.part in calibration.H100_PARTS else "A100 runs'"
    return (f"step ms: the expected step, the bound (bound ms: every FLOP at {hw.efficiency:g} of the peak, every "
            f"link at its nominal bandwidth) with matmuls at {c.matmul:.3g} of that rate, memory-bound kernels "
            f"reading and writing each layer's activations {c.memory_passes:.3g} times, collectives at {c.link:.3g} "
            f"of the bandwidth and recomputation's all-reduces; {calibration_summary()} of its published "
            f"throughput when left out of the fit (tools/published_runs.json); {hw.gpu} takes the {runs}\n"
            f"host ms: the engine's host work at the {HOST_COEFFICIENTS['cuda'].source} coefficients "
            f"(megatron/accounting/predict/host_work.py; not probed, not in step ms)")



def notes(request: PlanRequest, plans: list[Plan]) -> list[str]:
    """What the user should know about the plans that the table cannot say."""
    lines = []
    layers, pp = request.config.num_layers, request.flags.pp
    if layers % pp:
        lines.append(f"note: {layers} layers over {pp} pipeline stages: {layers % pp} stages of {-(-layers // pp)} "
                     f"and {pp - layers % pp} of {layers // pp}, as Megatron-DeepSpeed's type:transformer partition "
                     f"balances them; the stages of {-(-layers // pp)} set the memory and the step")
    if request.flags.precision == "bf16" and any(p.option == "Z1" for p in plans):
        lines.append("note: Z1 in bf16 is DeepSpeed's BF16_Optimizer, not the ZeRO paper's stage 1: it accumulates "
                     "the gradients in fp32 (6 bytes per parameter, bf16 and fp32 copies of every gradient) and "
                     "all-reduces them before gathering the parameters, 1.5x stage 1's bytes (docs/zero-tradeoff.md)")
    lines += bubble_note(request)
    return lines


def bubble_note(request: PlanRequest) -> list[str]:
    """A pipeline with few micro-batches a step idles most of it ((p-1)/m of its compute, 1F1B's fill and drain):
    say so, and the --global-batch-size that keeps the bubble to a quarter, m >= 4 (p-1) micro-batches."""
    f = request.flags
    dp = request.world_size // (f.tp * f.pp * f.sp)
    micro_batches = request.accumulation
    if f.pp == 1 or (f.pp - 1) / micro_batches <= 0.25:
        return []
    batch = 4 * (f.pp - 1) * f.micro_batch_size * dp
    return [f"note: {micro_batches} micro-batch{'es' if micro_batches > 1 else ''} a step over {f.pp} pipeline "
            f"stages: the pipeline idles (p-1)/m = {(f.pp - 1) / micro_batches:.2g}x each GPU's compute while it "
            f"fills and drains; --global-batch-size {batch} ({4 * (f.pp - 1)} micro-batches) keeps that to 0.25x"]


def checkpoint_line(advice: dict, request: PlanRequest) -> str:
    every = f"every {advice['interval_s']:,.0f} s of training"
    if advice["interval_iterations"] is not None:
        every += f" (--save-interval {advice['interval_iterations']} at the picked option's step)"
    size = f"{advice['bytes'] / 1e12:.2f} TB" if advice["bytes"] >= 1e12 else f"{advice['bytes'] / 1e9:.1f} GB"
    f = request.flags
    return (f"checkpoint: {size} per save (parameters and optimizer states), "
            f"{advice['save_s']:,.0f} s at {f.storage_bandwidth}; with --mtbf-hours {f.mtbf_hours:g} save {every}, "
            f"{100 * advice['lost_fraction']:.1f}% of the time lost in expectation (Young/Daly)")

