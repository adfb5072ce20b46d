"""Which ZeRO stage fits my model on my GPUs? Per-GPU memory and traffic per step of every option.

    python tools/zero_plan.py --model-size 1.3B --seq-length 1024 --micro-batch-size 4 --gpus 8 --gpu-memory 40GB
    python tools/zero_plan.py --num-layers 24 --hidden-size 2048 --num-attention-heads 16 ... --nodes 2 --tp 2

For plain data parallelism, ZeRO 1, 2, 3 and stage 3 with the optimizer, then everything, offloaded to
host memory (and to NVMe), it prints the predicted memory per GPU (model states, activations, the
output-layer buffer), the bytes each GPU sends per step, what offload moves over PCIe, whether it fits,
and which option to pick. The numbers come from megatron/model/accounting/, the same functions whose
predictions the training runs print beside their measurements (docs/zero-tradeoff.md).
"""

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from megatron.core.parallel_state import ParallelLayout  # noqa: E402
from megatron.errors import ZeroLabError  # noqa: E402
from megatron.layout_check import batch_split  # noqa: E402
from megatron.model import accounting  # noqa: E402
from megatron.model.config import GPTConfig, check_parallel_shape  # noqa: E402
from megatron.model.presets import MODEL_PRESETS  # noqa: E402

GB = float(2**30)
GPT2_VOCAB = 50257
# (label, ZeRO stage, offload optimizer, offload params, offload device), in the order they are tried
OPTIONS = [("DP", 0, False, False, "cpu"), ("Z1", 1, False, False, "cpu"), ("Z2", 2, False, False, "cpu"),
           ("Z3", 3, False, False, "cpu"), ("Z3 + optimizer offload", 3, True, False, "cpu"),
           ("Z3 + full offload", 3, True, True, "cpu"), ("Z3 + NVMe offload", 3, True, True, "nvme")]


class PlanError(ZeroLabError, ValueError):
    """A flag the planner cannot use; the message names it."""


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


def parse_memory(text: str) -> float:
    """'40GB', '80GiB', '40' (GB) -> GB of 2**30 bytes, as the memory log line prints them."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(GB|GiB|G)?\s*", text, re.I)
    if not match or float(match.group(1)) <= 0:
        raise PlanError(f"--gpu-memory {text!r}: expected a size such as 40GB or 80GiB")
    return float(match.group(1))


def model_config(ns: argparse.Namespace) -> GPTConfig:
    if ns.model_size is not None:
        if ns.model_size not in MODEL_PRESETS:
            raise PlanError(f"--model-size {ns.model_size}: unknown preset (choose from {', '.join(MODEL_PRESETS)})")
        shape = dict(MODEL_PRESETS[ns.model_size])
    else:
        shape = {}
    for name in ("num_layers", "hidden_size", "num_attention_heads"):
        if getattr(ns, name) is not None:
            shape[name] = getattr(ns, name)
        elif name not in shape:
            raise PlanError(f"--{name.replace('_', '-')} is required without --model-size")
    multiple = 128 * ns.tp  # Megatron's --make-vocab-size-divisible-by 128 x TP
    padded = -(-ns.vocab_size // multiple) * multiple
    config = GPTConfig(**shape, seq_length=ns.seq_length, max_position_embeddings=ns.seq_length,
                       padded_vocab_size=padded, recompute_activations=ns.recompute,
                       sequence_parallel=ns.sequence_parallel)
    check_parallel_shape(config, ns.tp, ns.pp)
    return config


def plan(config: GPTConfig, ns: argparse.Namespace) -> list[Plan]:
    world = ns.gpus * ns.nodes
    layout = ParallelLayout(world, ns.tp, ns.pp)
    _, accumulation = batch_split(layout, ns.micro_batch_size, ns.global_batch_size)
    total_params = accounting.count_parameters(config)
    plans = []
    for label, stage, offload_optimizer, offload_params, device in OPTIONS:
        if stage >= 2 and ns.pp > 1:
            continue  # DeepSpeed's pipeline engine supports ZeRO 0 and 1 only
        setup = accounting.TrainingSetup(
            world_size=world, micro_batch_size=ns.micro_batch_size, gradient_accumulation_steps=accumulation,
            tensor_parallel_size=ns.tp, pipeline_parallel_size=ns.pp, sequence_parallel=ns.sequence_parallel,
            precision=ns.precision, zero_stage=stage, offload_optimizer=offload_optimizer,
            offload_params=offload_params, offload_device=device, activation_recompute=ns.recompute)
        # every pipeline stage; the busiest one decides
        memory = max((accounting.memory_per_rank(config, setup, s) for s in range(ns.pp)), key=lambda m: m["total"])
        traffic = max(sum(accounting.zero_traffic_per_step(config, setup, s).values()) for s in range(ns.pp))
        moved = accounting.offload_transfer_per_step(config, setup, 0)
        plans.append(Plan(option=label, params_gb=memory["params"] / GB, grads_gb=memory["grads"] / GB,
                          optim_gb=memory["optim"] / GB, model_states_gb=memory["model_states"] / GB,
                          activations_gb=memory["activations"] / GB, output_buffer_gb=memory["output_buffer"] / GB,
                          total_gb=memory["total"] / GB, offloaded_gb=memory["offloaded"] / GB,
                          traffic_gb=traffic / GB, bytes_per_param=traffic / total_params,
                          pcie_gb=moved["pcie"] / GB, nvme_gb=moved["nvme"] / GB,
                          fits=memory["total"] / GB <= ns.usable_gb))
    return plans


def choose(plans: list[Plan]) -> tuple[Plan | None, str]:
    """The option that fits with the least data moved per step (sent, plus PCIe and NVMe for offload);
    among those that move as little (DP, Z1 and Z2 without gradient accumulation; in bf16 DP and Z2, as
    stage 1's bf16 optimizer sends 1.5x), the one that leaves the most memory free, room for a larger
    micro-batch, the lower stage where two need as much (without accumulation DeepSpeed's fp32 and fp16
    stage 1 keeps the gradients stage 2 does)."""
    fitting = [p for p in plans if p.fits]
    if not fitting:
        return None, ("nothing fits: raise --tp or --pp, lower --micro-batch-size, add --recompute, "
                      "or use more GPUs")
    def moved(p: Plan) -> float:
        return round(p.traffic_gb + p.pcie_gb + p.nvme_gb, 6)
    least = min(moved(p) for p in fitting)
    best = min((p for p in fitting if moved(p) == least), key=lambda p: p.total_gb)
    alike = [p for p in fitting if moved(p) == least and p is not best]
    same = [p.option for p in alike if round(p.total_gb, 6) == round(best.total_gb, 6)]
    more = [p.option for p in alike if p.option not in same]
    why = f"fits ({best.total_gb:.1f} GB per GPU) and sends {best.traffic_gb:.2f} GB per GPU per step"
    why += f" plus {best.pcie_gb:.2f} GB over PCIe" if best.pcie_gb else ""
    why += ", the least of the options that fit"
    def verbs(options: list[str], one: str, many: str) -> str:
        return f"{', '.join(options)} {one if len(options) == 1 else many}"
    notes = [verbs(same, "needs as much and sends", "need as much and send") + " as much"] if same else []
    if more:
        notes.append(verbs(more, "sends as little but leaves", "send as little but leave") + " less memory free")
    if notes:
        why += f" ({'; '.join(notes)})"
    missing = [p.option for p in plans if not p.fits]
    if missing:
        why += f"; {', '.join(missing)} {'does' if len(missing) == 1 else 'do'} not fit"
    return best, why


def table(plans: list[Plan], usable_gb: float) -> str:
    header = ("option", "model states GB", "activations GB", "output buffer GB", "total GB/GPU",
              f"fits {usable_gb:.1f} GB", "sent GB/step", "bytes/param", "PCIe GB/step", "offloaded GB/GPU")
    rows = [header] + [(p.option, f"{p.model_states_gb:.2f}", f"{p.activations_gb:.2f}", f"{p.output_buffer_gb:.2f}",
                        f"{p.total_gb:.2f}", "yes" if p.fits else "no", f"{p.traffic_gb:.2f}",
                        f"{p.bytes_per_param:.2f}", f"{p.pcie_gb:.2f}",
                        f"{p.offloaded_gb:.2f}" + (" (NVMe)" if "NVMe" in p.option else ""))
                       for p in plans]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-size", help=f"a preset: {', '.join(MODEL_PRESETS)}")
    parser.add_argument("--num-layers", type=int)
    parser.add_argument("--hidden-size", type=int)
    parser.add_argument("--num-attention-heads", type=int)
    parser.add_argument("--vocab-size", type=int, default=GPT2_VOCAB, help="before padding (default: GPT-2's)")
    parser.add_argument("--seq-length", type=int, required=True)
    parser.add_argument("--micro-batch-size", type=int, required=True)
    parser.add_argument("--global-batch-size", type=int, help="default: one micro-batch per data-parallel rank")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs per node")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpu-memory", required=True, help="per GPU, e.g. 40GB")
    parser.add_argument("--headroom", type=float, default=0.1,
                        help="fraction of GPU memory kept for the CUDA context, communication buckets and "
                             "fragmentation (default: 0.1)")
    parser.add_argument("--tp", "--tensor-model-parallel-size", dest="tp", type=int, default=1)
    parser.add_argument("--pp", "--pipeline-model-parallel-size", dest="pp", type=int, default=1)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    parser.add_argument("--recompute", "--checkpoint-activations", dest="recompute", action="store_true",
                        help="full activation recomputation")
    parser.add_argument("--json", action="store_true", help="print the plans and the choice as JSON")
    ns = parser.parse_args(argv)
    if ns.model_size is None and ns.num_layers is None:
        parser.error("give --model-size or --num-layers/--hidden-size/--num-attention-heads")
    return ns


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        for flag, value in (("--gpus", ns.gpus), ("--nodes", ns.nodes), ("--seq-length", ns.seq_length),
                            ("--vocab-size", ns.vocab_size)):
            if value < 1:
                raise PlanError(f"{flag} must be >= 1, got {value}")
        if not 0.0 <= ns.headroom < 1.0:
            raise PlanError(f"--headroom must be in [0, 1), got {ns.headroom}")
        ns.usable_gb = parse_memory(ns.gpu_memory) * (1.0 - ns.headroom)
        config = model_config(ns)
        plans = plan(config, ns)
    except ZeroLabError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    best, why = choose(plans)
    if ns.json:
        print(json.dumps({"plans": [vars(p) for p in plans], "choice": best.option if best else None, "why": why},
                         indent=2))
        return 0
    name = ns.model_size or f"{config.num_layers} layers x {config.hidden_size}"
    print(f"{name}: {accounting.count_parameters(config) / 1e9:.2f}B parameters, seq {ns.seq_length}, micro batch "
          f"{ns.micro_batch_size}, {ns.gpus * ns.nodes} GPUs (TP={ns.tp}, PP={ns.pp}), {ns.precision}\n")
    print(table(plans, ns.usable_gb))
    print(f"\npick: {best.option}: {why}" if best else f"\npick: none: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
