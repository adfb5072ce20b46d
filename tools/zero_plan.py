"""Which ZeRO stage fits my model on my GPUs, and how long is a step? Memory, traffic and time of every option.

    python tools/zero_plan.py --model-size 1.3B --seq-length 1024 --micro-batch-size 4 --gpus 8 --gpu-memory 40GB
    python tools/zero_plan.py --num-layers 24 --hidden-size 2048 --num-attention-heads 16 ... --nodes 2 --tp 2
    python tools/zero_plan.py --model-size 13B --gpus 8 --nodes 8 --gpu A100-80GB --inter-node-bandwidth 200Gbit \
        --tokens 300B

For plain data parallelism, ZeRO 1, 2, 3 and stage 3 with the optimizer, then everything, offloaded to
host memory (and to NVMe), it prints the predicted memory per GPU (model states, activations, the
output-layer buffer), the bytes each GPU sends per step, what offload moves over PCIe, whether it fits,
and which option to pick. With --gpu it also predicts each option's expected step time (compute, exposed
communication, offload transfers, the pipeline's bubble; the bound, every FLOP at the large-matmul rate and every
link at its nominal bandwidth, with what it leaves out, calibrated on the published runs of
tools/published_runs.json), the bound beside it, tokens/s, TFLOP/s per GPU and, with --tokens, the days to
train, and picks the fastest option that fits. With --storage-bandwidth and --mtbf-hours it prints
the checkpoint's size, its save time and the interval between saves that loses the least time (docs/faults.md).
The numbers come from megatron/accounting/predict/, the same functions whose predictions the training runs print
beside their measurements (docs/zero-tradeoff-reference.md, "Time per step: the model" and "Projecting a step onto GPUs").
"""

import argparse
import functools
import json
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from megatron.core.parallel_state import ParallelLayout  # noqa: E402
from megatron.errors import ZeroLabError  # noqa: E402
from megatron.layout_check import batch_split  # noqa: E402
from megatron import accounting  # noqa: E402
from megatron.model.config import GPTConfig, ModelConfigError, parallel_shape_problems  # noqa: E402
from megatron.checkpointing import interval  # noqa: E402
from megatron.accounting.predict.fit import HEADROOM, peak_memory, stage_config  # noqa: E402
from megatron.accounting.predict.memory import checkpoint_bytes  # noqa: E402
from megatron.accounting.predict.traffic import OWNER_REDUCTION  # noqa: E402
from megatron.accounting.predict.host_work import HOST_COEFFICIENTS, host_seconds  # noqa: E402
from megatron.accounting.predict.step_time import (  # noqa: E402
    ComputeRates,
    LinkCosts,
    StepTime,
    hierarchical_link_costs,
    messages_per_step,
    model_parallel_alone,
    predict_step_time,
    ulysses_seconds,
)
from megatron.model.presets import MODEL_PRESETS, PRESET_SEQ_LENGTH, PRESET_VOCABULARY  # noqa: E402

GB = float(2**30)
GPT2_VOCAB = 50257
# (label, ZeRO stage, offload optimizer, offload params, offload device), in the order they are tried
OPTIONS = [("DP", 0, False, False, "cpu"), ("Z1", 1, False, False, "cpu"), ("Z2", 2, False, False, "cpu"),
           ("Z3", 3, False, False, "cpu"), ("Z3 + optimizer offload", 3, True, False, "cpu"),
           ("Z3 + full offload", 3, True, True, "cpu"), ("Z3 + NVMe offload", 3, True, True, "nvme")]


class PlanError(ZeroLabError, ValueError):
    """A flag the planner cannot use; the message names it."""


@dataclass(frozen=True)
class GpuKind:
    """What --gpu NAME stands for (docs/zero-tradeoff-reference.md, "Projecting a step onto GPUs", gives the sources): its
    part in accounting.PEAK_TFLOPS, memory in GB (2**30 bytes, as --gpu-memory), the fraction of the dense peak
    large matmuls reach, HBM bytes/s (the optimizer step is bound by it), intra-node Gbit/s per GPU and
    direction, host <-> GPU bytes/s per direction (PCIe), and a reference node: GPUs and inter-node Gbit/s."""
    part: str
    memory_gb: float
    efficiency: float
    hbm_bytes_per_s: float
    intra_node_gbps: float
    pcie_bytes_per_s: float
    node_gpus: int
    inter_node_gbps: float


# Sources, per column (docs/zero-tradeoff-reference.md, "Projecting a step onto GPUs", has the table with each figure's source):
# - efficiency: S. Bekman, ml-engineering, compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS comparison
#   table" (github.com/stas00/ml-engineering; bf16): A100 SXM 271.2/312 = 86.9%, H100 SXM 794.5/989 = 80.3% ("H200
#   is the same", that row's note), MI250X 147.0/191.5 = 76.7% (one GCD, ROCm 6.2; the table's older v1 run, taken
#   off the page in Sept 2025); V100 and A40 have no published figure: 0.80, assumed
# - memory, HBM bytes/s: NVIDIA's A100 (40 GB 1555 GB/s, 80 GB SXM 2039 GB/s), H100 SXM (80 GB, 3.35 TB/s), H200 SXM
#   (141 GB, 4.8 TB/s), V100 SXM2 (32 GB, 900 GB/s), A40 (48 GB GDDR6, 696 GB/s) datasheets; MI250X: 128 GB and 3.28
#   TB/s per package of two GCDs (AMD: 3.2 TB/s), half each (ROCm docs, "MI250 microarchitecture": 1.6 TB/s per GCD)
# - intra-node, per GPU and direction: NVLink 600 (A100), 900 (H100, H200), 300 (V100) GB/s bidirectional, halved;
#   A40 has no NVSwitch (its NVLink bridge joins two cards): PCIe Gen4 x16, 32 GB/s; MI250X: 50 GB/s, one Infinity
#   Fabric link between GCDs of different packages (ROCm docs: 50 GB/s per link and direction; OLCF Frontier user
#   guide: 50-100 GB/s between GCDs of different MI250X, 200 GB/s only between a package's two GCDs), which a ring
#   over the node's 8 GCDs crosses
# - host <-> GPU per direction: PCIe Gen3 x16 16 GB/s (V100), Gen4 x16 32 GB/s (A100, A40, MI250X: one x16 link per
#   GCD, ROCm docs; Frontier's CPU-GCD Infinity Fabric gives 36), Gen5 x16 128 GB/s bidirectional, halved (H100, H200)
# - reference nodes: DGX-2 (16 V100 32GB, 8 x 100 Gbit/s EDR InfiniBand), DGX A100 (8 x 200 Gbit/s HDR ConnectX-6),
#   DGX H100/H200 (8 single-port ConnectX-7, 400 Gbit/s each; DGX BasePOD reference architecture), OLCF Frontier
#   (HPE Cray EX235a: 4 MI250X = 8 GCDs, 4 x 200 Gbit/s Slingshot NICs); the A40 has no reference node (8 per node,
#   PCIe between them, one 200 Gbit/s NIC, assumed)
GPU_KINDS: dict[str, GpuKind] = {
    "A100-40GB": GpuKind("A100", 40, 0.869, 1555e9, 2400, 32e9, 8, 1600),
    "A100-80GB": GpuKind("A100", 80, 0.869, 2039e9, 2400, 32e9, 8, 1600),
    "H100-SXM": GpuKind("H100 SXM", 80, 0.803, 3350e9, 3600, 64e9, 8, 3200),
    "H200": GpuKind("H200 SXM", 141, 0.803, 4800e9, 3600, 64e9, 8, 3200),
    "V100-32GB": GpuKind("V100 SXM2", 32, 0.80, 900e9, 1200, 16e9, 16, 800),
    "A40": GpuKind("A40", 48, 0.80, 696e9, 256, 32e9, 8, 200),
    "MI250X": GpuKind("MI250X die", 64, 0.767, 1638e9, 400, 32e9, 8, 800),
}
# Adam's step per element where it runs, bytes through memory: read the fp32 master, m, v and gradient (16),
# write master, m and v (12) and the 16-bit copy (2); it streams, so memory bandwidth bounds it
ADAM_BYTES_PER_ELEMENT = 30
HOST_MEMORY_BYTES_PER_S = 409.6e9  # two EPYC 7742 sockets of a DGX A100, 8 channels of DDR4-3200 each (AMD)
DEFAULT_LATENCY_US = 10.0  # per message and level crossed; assumed, no published figure used (see the docs)


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
    tokens_per_s: float | None = None
    tflops_per_gpu: float | None = None  # model FLOPs (the MFU numerator)
    hardware_tflops_per_gpu: float | None = None  # recomputation counted, as the published runs count
    days: float | None = None
    bound: dict | None = None  # the same fields from the bound: every FLOP at the large-matmul rate, ...


def parse_memory(text: str) -> float:
    """'40GB', '80GiB', '40' (GB) -> GB of 2**30 bytes, as the memory log line prints them."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(GB|GiB|G)?\s*", text, re.I)
    if not match or float(match.group(1)) <= 0:
        raise PlanError(f"--gpu-memory {text!r}: expected a size such as 40GB or 80GiB")
    return float(match.group(1))


def parse_bandwidth(text: str, flag: str) -> float:
    """'200Gbit', '200Gbit/s', '200Gbps', '200Gb/s' (bits), '25GB/s', '25GB', '25' (bytes) -> Gbit/s."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(Gbit|Gbps|Gb|gbit|gbps|GB|G)?(/s)?\s*", text)
    if not match or float(match.group(1)) <= 0:
        raise PlanError(f"{flag} {text!r}: expected a bandwidth such as 200Gbit (Gbit/s) or 25GB/s")
    return float(match.group(1)) * (1 if match.group(2) in ("Gbit", "Gbps", "Gb", "gbit", "gbps") else 8)


def parse_latency(text: str) -> float:
    """'10us', '0.01ms', '10' (us) -> microseconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(us|ms)?\s*", text)
    if not match:
        raise PlanError(f"--latency {text!r}: expected a time such as 10us or 0.01ms")
    return float(match.group(1)) * (1000 if match.group(2) == "ms" else 1)


def parse_tokens(text: str) -> float:
    """'300B', '1.5T', '500M', '3e11' -> tokens."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([KMBT])?\s*", text, re.I)
    if not match or float(match.group(1)) <= 0:
        raise PlanError(f"--tokens {text!r}: expected a count such as 300B or 1.5T")
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}.get((match.group(2) or "").upper(), 1)
    return float(match.group(1)) * scale


# GPTConfig's Llama fields, each behind its Megatron-DeepSpeed flag (--num-key-value-heads, --swiglu, ...)
LLAMA_FLAGS = ("num_key_value_heads", "ffn_hidden_size", "swiglu", "normalization",
               "untie_embeddings_and_output_weights", "disable_bias_linear", "rope_theta")


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
    # Llama's architecture flags (docs/model.md) add to a preset's own
    shape.update({name: getattr(ns, name) for name in LLAMA_FLAGS if getattr(ns, name) not in (None, False)})
    if ns.num_experts is not None:
        shape["num_experts"] = ns.num_experts
    if isinstance(shape.get("num_experts"), int):  # a preset's one value (megatron/model/presets.py)
        shape["num_experts"] = [shape["num_experts"]]
    multiple = 128 * ns.tp  # Megatron's --make-vocab-size-divisible-by 128 x TP
    padded = -(-ns.vocab_size // multiple) * multiple
    # --use-rotary-position-embeddings adds rotary to a preset without it (the Llama presets have it already)
    shape["use_rotary_position_embeddings"] = ns.rotary or shape.get("use_rotary_position_embeddings", False)
    config = GPTConfig(**shape, seq_length=ns.seq_length, max_position_embeddings=ns.seq_length,
                       padded_vocab_size=padded, recompute_activations=ns.recompute,
                       sequence_parallel=ns.sequence_parallel, topk=ns.topk)
    # layers that do not divide into the stages are split unevenly (stage_config), as Megatron-DeepSpeed does
    problems = [p for p in parallel_shape_problems(config, ns.tp, ns.pp) if not p.startswith("--num-layers")]
    if config.num_layers < ns.pp:
        problems.append(f"--num-layers {config.num_layers} is fewer than --pipeline-model-parallel-size {ns.pp}: "
                        "every stage needs a layer")
    if problems:
        raise ModelConfigError(problems[0])
    ulysses_problem(config, ns)
    moe_problem(config, ns)
    return config


def moe_problem(config: GPTConfig, ns: argparse.Namespace) -> None:
    """Refuse, in one line, an MoE layout the training refuses (docs/moe.md): experts only beside data parallelism."""
    if not config.is_moe:
        if ns.ep is not None:
            raise PlanError("--moe-expert-parallel-size needs --num-experts (or an MoE --model-size)")
        return
    experts = f"--num-experts {' '.join(map(str, config.num_experts))}"
    for flag, size in (("--tensor-model-parallel-size", ns.tp), ("--pipeline-model-parallel-size", ns.pp),
                       ("--ds-sequence-parallel-size", ns.sp)):
        if size > 1:
            raise PlanError(f"{experts} cannot be combined with {flag} > 1")
    if ns.recompute:
        raise PlanError(f"{experts} cannot be combined with --checkpoint-activations")
    world, moe = ns.gpus * ns.nodes, [n for n in config.layer_experts if n > 1]
    if ns.ep is not None and (ns.ep < 1 or world % ns.ep or any(n % ns.ep for n in moe)):
        raise PlanError(f"--moe-expert-parallel-size {ns.ep} must divide the data-parallel size {world} and every "
                        f"layer's --num-experts ({', '.join(map(str, sorted(set(moe))))})")


def expert_parallel_sizes(config: GPTConfig, ns: argparse.Namespace) -> list[int]:
    """The EP sizes to plan: the one asked for, else every one that divides the GPUs and each layer's experts."""
    if not config.is_moe:
        return [1]
    if ns.ep is not None:
        return [ns.ep]
    world, moe = ns.gpus * ns.nodes, [n for n in config.layer_experts if n > 1]
    return [ep for ep in range(1, world + 1) if not world % ep and not any(n % ep for n in moe)]


def ulysses_problem(config: GPTConfig, ns: argparse.Namespace) -> None:
    """Refuse, in one line, a DeepSpeed-Ulysses size the training would refuse (docs/long-sequences.md)."""
    sp, heads = ns.sp, config.num_attention_heads // ns.tp
    flag = f"--ds-sequence-parallel-size {sp}"
    if sp < 1:
        raise PlanError(f"--ds-sequence-parallel-size must be >= 1, got {sp}")
    if heads % sp:
        raise PlanError(f"--num-attention-heads {config.num_attention_heads} ({heads} per tensor-parallel rank) is "
                        f"not divisible by {flag}: each rank attends over whole heads")
    if ns.seq_length % sp:
        raise PlanError(f"--seq-length {ns.seq_length} is not divisible by {flag}: each rank holds an equal slice")
    if sp > 1 and ns.pp > 1:
        raise PlanError(f"{flag} cannot be combined with pipeline parallelism (--pp {ns.pp})")
    if sp > 1 and ns.sequence_parallel:
        raise PlanError(f"{flag} and --sequence-parallel (Megatron's, over the tensor-parallel group) are exclusive")


@dataclass(frozen=True)
class Hardware:
    """The GPUs and links a projection runs on: --gpu's kind with the flags that override its defaults."""
    gpu: str
    kind: GpuKind
    peak_tflops: float  # dense, in the run's precision
    efficiency: float
    intra_node_gbps: float
    inter_node_gbps: float
    latency_us: float
    nvme_bytes_per_s: float | None  # per node; None: NVMe offload is not timed


def hardware(ns: argparse.Namespace) -> Hardware | None:
    if ns.gpu is None:
        return None
    if ns.gpu not in GPU_KINDS:
        raise PlanError(f"--gpu {ns.gpu}: unknown kind (choose from {', '.join(GPU_KINDS)})")
    kind = GPU_KINDS[ns.gpu]
    peak = accounting.PEAK_TFLOPS[kind.part].get(accounting.matmul_precision(ns.precision, False))
    if peak is None:
        raise PlanError(f"--gpu {ns.gpu} has no {ns.precision} tensor cores: give --precision fp16")
    efficiency = kind.efficiency if ns.efficiency is None else ns.efficiency
    if not 0 < efficiency <= 1:
        raise PlanError(f"--efficiency must be in (0, 1], got {efficiency}")
    intra = kind.intra_node_gbps if ns.intra_node_bandwidth is None else parse_bandwidth(
        ns.intra_node_bandwidth, "--intra-node-bandwidth")
    inter = kind.inter_node_gbps if ns.inter_node_bandwidth is None else parse_bandwidth(
        ns.inter_node_bandwidth, "--inter-node-bandwidth")
    nvme = None if ns.nvme_bandwidth is None else parse_bandwidth(ns.nvme_bandwidth, "--nvme-bandwidth") * 1e9 / 8
    return Hardware(ns.gpu, kind, peak, efficiency, intra, inter, parse_latency(ns.latency), nvme)


def links(setup: accounting.TrainingSetup, hw: Hardware, gpus_per_node: int, nodes: int) -> tuple[LinkCosts, LinkCosts]:
    """(the data-parallel group's link, the model-parallel one: TP's collectives, PP's sends) on `hw`: the
    data-parallel group's collectives hierarchically over NVLink and the node's link (NCCL's ring factors), TP's
    inside the node, a pipeline's sends across nodes once a stage fills a node. Megatron's rank order: TP ranks
    adjacent, then DeepSpeed-Ulysses' sequence ranks (their all-to-alls on that group), then DP, then PP; ZeRO's
    collectives span the sequence and data-parallel ranks."""
    tp, dp, sp = setup.tensor_parallel_size, setup.zero_partitions, setup.sequence_parallel_size
    link = functools.partial(hierarchical_link_costs, "nccl", gpus_per_node=gpus_per_node,
                             intra_node_gbps=hw.intra_node_gbps, inter_node_gbps=hw.inter_node_gbps,
                             latency_us=hw.latency_us)
    data = link(dp, dp if tp * dp <= gpus_per_node else max(1, gpus_per_node // tp))
    tensor = link(tp, min(tp, gpus_per_node))
    pipe = link(2, 1 if nodes > 1 and tp * dp >= gpus_per_node else min(2, gpus_per_node))
    sequence = link(sp, sp if tp * sp <= gpus_per_node else max(1, gpus_per_node // tp))
    return data, LinkCosts({**tensor.costs, "p2p": pipe.costs["p2p"], "broadcast": pipe.costs["broadcast"],
                            "all_to_all": sequence.costs["all_gather"]}, "flags")


def rates(setup: accounting.TrainingSetup, hw: Hardware, gpus_per_node: int) -> ComputeRates:
    """Compute at the peak x efficiency, the optimizer at HBM (or, offloaded, the host's memory) speed."""
    optimizer_bytes_per_s = (HOST_MEMORY_BYTES_PER_S / gpus_per_node if setup.offload_optimizer
                             else hw.kind.hbm_bytes_per_s)
    return ComputeRates(flops_per_s=hw.peak_tflops * 1e12 * hw.efficiency,
                        optimizer_s_per_element=ADAM_BYTES_PER_ELEMENT / optimizer_bytes_per_s,
                        host_copy_bytes_per_s=hw.kind.pcie_bytes_per_s,
                        device_copy_bytes_per_s=hw.kind.hbm_bytes_per_s / 2,  # a copy reads and writes
                        nvme_bytes_per_s=hw.nvme_bytes_per_s / gpus_per_node if hw.nvme_bytes_per_s else None)


def project(config: GPTConfig, setup: accounting.TrainingSetup, hw: Hardware, gpus_per_node: int,
            nodes: int) -> tuple[int, StepTime] | None:
    """(the busiest pipeline stage, its step): predict_step_time on the GPUs and links `hw` describes, with the
    bubble. The bound: every FLOP at the large-matmul rate, every link at its nominal bandwidth. `config`: the
    busiest stage's (stage_config). None: NVMe offload without --nvme-bandwidth."""
    if setup.offload_device == "nvme" and hw.nvme_bytes_per_s is None:
        return None
    data, model = links(setup, hw, gpus_per_node, nodes)
    # DeepSpeed's default buckets: the generated config's (megatron/deepspeed_config.py) import DeepSpeed, and
    # they change only the message count, the latency term; its gradient reduction to each partition's owner
    steps = [predict_step_time(config, setup, stage, rates(setup, hw, gpus_per_node), data, dict(OWNER_REDUCTION),
                               overlap_comm=True,
                               model_parallel_link=model, with_bubble=True)
             for stage in range(setup.pipeline_parallel_size)]
    stage = max(range(len(steps)), key=lambda s: steps[s].total)
    return stage, steps[stage]


@dataclass(frozen=True)
class Calibration:
    """What the bound leaves out, as few numbers fitted to published runs (`fit_calibration`; the fitted values
    are tools/published_runs.json's "calibration")."""
    matmul: float  # the fraction of --gpu's large-matmul rate that a layer's FLOPs run at
    memory_passes: float  # the layer's activation bytes (Korthikanti's count) through HBM per forward-equivalent
    link: float  # the fraction of a link's nominal bandwidth that NCCL's collectives reach


PUBLISHED_RUNS = Path(__file__).resolve().with_name("published_runs.json")
PUBLISHED = json.loads(PUBLISHED_RUNS.read_text())
CALIBRATION = Calibration(**PUBLISHED["calibration"]["values"])  # fitted on the A100 runs
# fitted on the H100 runs: their matmul fraction alone (fit_matmul), the A100 fit's memory passes and link kept
H100_CALIBRATION = replace(CALIBRATION, **PUBLISHED["h100_calibration"]["values"])
H100_PARTS = ("H100 SXM", "H200 SXM")  # the GPU kinds H100_CALIBRATION times; the others take the A100 runs'


def calibration(hw: Hardware) -> Calibration:
    """The calibration that times `hw`: the H100 runs' on H100 and H200 (the same tensor cores), else the A100
    runs' (on V100, A40 and MI250X unchecked)."""
    return H100_CALIBRATION if hw.kind.part in H100_PARTS else CALIBRATION


@dataclass(frozen=True)
class StepParts:
    """The busiest stage's step, in seconds, split by what the calibration scales. Per micro-batch, and so
    stretched by the pipeline's fill and drain (`stretch`, 1 + (p-1)/m for p stages and m micro-batches): the
    layers' hardware FLOPs at the large-matmul rate, the memory-bound kernels' bytes at HBM speed (softmax,
    LayerNorm, GeLU, dropout, bias adds, the loss-scale checks), the model-parallel collectives (TP's
    all-reduces, recomputation's forward's too; PP's sends). Once a step: the data-parallel collectives left
    exposed, the engine's passes over the gradients and the optimizer (`other`), offload."""
    matmul: float
    memory: float
    model_parallel: float
    data_parallel: float
    other: float
    offload: float
    stretch: float

    def expected(self, c: Calibration) -> StepTime:
        per_micro_batch = self.matmul / c.matmul + c.memory_passes * self.memory + self.model_parallel / c.link
        return StepTime(compute=self.matmul / c.matmul + c.memory_passes * self.memory + self.other,
                        communication=(self.model_parallel + self.data_parallel) / c.link, offload=self.offload,
                        bubble=(self.stretch - 1) * per_micro_batch)


def layer_memory_bytes(config: GPTConfig, setup: accounting.TrainingSetup, flash_attn: bool = False) -> float:
    """Bytes one layer's forward writes on a TP rank for one micro-batch, Korthikanti et al. 2022's count with
    unfused attention (as the 2021-2022 codebases of the published runs ran it): s b h (10 + 24/t) + 5 a s^2 b / t
    in 16-bit, the 10 split over TP too under sequence parallelism; under DeepSpeed-Ulysses (N) s/N tokens, and
    the a s^2 scores for a/N heads. `flash_attn` (--use-flash-attn-v2; zero-lab's SDPA on a GPU): a fused kernel
    writes no scores, only its fp32 log-sum-exp, 4 a s b / t bytes. The memory-bound kernels read and write about
    these bytes; `Calibration.memory_passes` says how many times."""
    s, b, h, a = config.seq_length, setup.micro_batch_size, config.hidden_size, config.num_attention_heads
    t, n = setup.tensor_parallel_size, setup.sequence_parallel_size
    replicated = 10 / t if setup.sequence_parallel else 10
    outside = s / n * b * h * (replicated + 24 / t) * setup.element_bytes / 2
    if flash_attn:
        return outside + 4 * a * s * b / t / n
    return outside + 5 * a * s * s * b / t / n * setup.element_bytes / 2


def step_parts(config: GPTConfig, setup: accounting.TrainingSetup, hw: Hardware, gpus_per_node: int,
               nodes: int, flash_attn: bool = False) -> tuple[StepTime, StepParts] | None:
    """(the bound, `project`'s step, and the same step split into StepParts). `config`: the busiest stage's;
    `flash_attn`: attention runs a fused kernel (layer_memory_bytes)."""
    projected = project(config, setup, hw, gpus_per_node, nodes)
    if projected is None:
        return None
    stage, bound = projected
    tp, pp, g = setup.tensor_parallel_size, setup.pipeline_parallel_size, setup.gradient_accumulation_steps
    _, model = links(setup, hw, gpus_per_node, nodes)
    sequences = setup.micro_batch_size * g * setup.data_parallel_size
    matmul = accounting.hardware_flops_per_iteration(config, sequences) / setup.world_size / (
        hw.peak_tflops * 1e12 * hw.efficiency)
    config_alone, alone = model_parallel_alone(config, setup)  # what the layout sends without data parallelism
    traffic = accounting.zero_traffic_per_step(config_alone, alone, stage)
    messages = messages_per_step(config_alone, alone, stage, {})
    bound_model_parallel = sum(model.costs[kind].seconds(traffic[kind], messages[kind])
                               for kind in accounting.TRAFFIC_KINDS) + ulysses_seconds(config, setup, model)
    layers = config.num_layers // pp
    recomputed = 2 * layers * g if setup.activation_recompute and tp > 1 else 0  # the recomputed forward's two
    activation = setup.micro_batch_size * config_alone.seq_length * config.hidden_size * setup.element_bytes
    model_parallel = bound_model_parallel + model.costs["all_reduce"].seconds(
        recomputed * 2 * (tp - 1) / tp * activation, recomputed)
    layer_bytes = layer_memory_bytes(config, setup, flash_attn)
    memory = (3 + setup.activation_recompute) * layers * g * layer_bytes / hw.kind.hbm_bytes_per_s
    return bound, StepParts(matmul=matmul, memory=memory, model_parallel=model_parallel,
                            data_parallel=bound.communication - bound.overlap - bound_model_parallel,
                            other=bound.compute - matmul, offload=bound.offload, stretch=1 + (pp - 1) / g)


def training_setup(ns: argparse.Namespace, accumulation: int, stage: int, offload_optimizer: bool,
                   offload_params: bool, device: str, expert_parallel_size: int = 1) -> accounting.TrainingSetup:
    return accounting.TrainingSetup(
        world_size=ns.gpus * ns.nodes, micro_batch_size=ns.micro_batch_size, gradient_accumulation_steps=accumulation,
        tensor_parallel_size=ns.tp, pipeline_parallel_size=ns.pp, sequence_parallel=ns.sequence_parallel,
        sequence_parallel_size=ns.sp, expert_parallel_size=expert_parallel_size, precision=ns.precision,
        zero_stage=stage, offload_optimizer=offload_optimizer, offload_params=offload_params, offload_device=device,
        activation_recompute=ns.recompute)


def layout_options(config: GPTConfig, ns: argparse.Namespace) -> list[tuple]:
    """OPTIONS, each at every expert-parallel size for an MoE model (without ZeRO-3, which DeepSpeed 0.19 cannot
    run with MoE: docs/moe.md): (label, stage, offload optimizer, offload params, device, EP)."""
    if not config.is_moe:
        return [(*option, 1) for option in OPTIONS]
    return [(f"{label} EP={ep}", stage, optimizer, params, device, ep)
            for ep in expert_parallel_sizes(config, ns)
            for label, stage, optimizer, params, device in OPTIONS if stage < 3]


def plan(config: GPTConfig, ns: argparse.Namespace) -> list[Plan]:
    world = ns.gpus * ns.nodes
    layout = ParallelLayout(world, ns.tp, ns.pp, ns.sp)
    _, accumulation = batch_split(layout, ns.micro_batch_size, ns.global_batch_size)
    total_params = accounting.count_parameters(config)
    busiest = stage_config(config, ns.pp)
    plans = []
    for label, stage, offload_optimizer, offload_params, device, ep in layout_options(config, ns):
        if stage >= 2 and ns.pp > 1:
            continue  # DeepSpeed's pipeline engine supports ZeRO 0 and 1 only
        setup = training_setup(ns, accumulation, stage, offload_optimizer, offload_params, device, ep)
        memory = peak_memory(config, setup)  # every pipeline stage; the busiest one decides
        traffic = max(sum(accounting.zero_traffic_per_step(busiest, setup, s).values()) for s in range(ns.pp)) \
            + sum(accounting.moe_all_to_all_per_step(busiest, setup).values())
        moved = accounting.offload_transfer_per_step(busiest, setup, 0)
        plans.append(Plan(option=label, params_gb=memory["params"] / GB, grads_gb=memory["grads"] / GB,
                          optim_gb=memory["optim"] / GB, model_states_gb=memory["model_states"] / GB,
                          activations_gb=memory["activations"] / GB, output_buffer_gb=memory["output_buffer"] / GB,
                          total_gb=memory["total"] / GB, offloaded_gb=memory["offloaded"] / GB,
                          traffic_gb=traffic / GB, bytes_per_param=traffic / total_params,
                          pcie_gb=moved["pcie"] / GB, nvme_gb=moved["nvme"] / GB,
                          fits=memory["total"] / GB <= ns.usable_gb, longest_seq=longest_sequence(busiest, setup, ns),
                          **timing(config, busiest, setup, ns)))
    return plans


def longest_sequence(busiest: GPTConfig, setup: accounting.TrainingSetup, ns: argparse.Namespace) -> int:
    """The longest sequence whose predicted memory fits ns.usable_gb on every GPU of the option `setup`, at
    micro-batch 1 and the plan's recomputation: a multiple of the DeepSpeed-Ulysses size, found by doubling and
    then halving the step (memory grows with the length; learned positions grow the table too). 0: none fits."""
    one = replace(setup, micro_batch_size=1)
    sp = setup.sequence_parallel_size

    def fits(slices: int) -> bool:
        length = slices * sp
        config = replace(busiest, seq_length=length, max_position_embeddings=length)
        return all(accounting.memory_per_rank(config, one, stage)["total"] / GB <= ns.usable_gb
                   for stage in range(setup.pipeline_parallel_size))

    if not fits(1):
        return 0
    low = 1
    while low < 2**40 and fits(2 * low):
        low *= 2
    step = low // 2
    while step:  # low fits, 2 low does not: add the largest steps that still fit
        low += step if fits(low + step) else 0
        step //= 2
    return low * sp


def longest_table(plans: list[Plan], config: GPTConfig, ns: argparse.Namespace) -> str:
    """How long a sequence fits per GPU, option by option; the positions are the model's (a Llama preset's rotary
    ones without --use-rotary-position-embeddings)."""
    positions = "rotary positions" if config.use_rotary_position_embeddings else "learned positions"
    lines = [f"longest sequence that fits {ns.usable_gb:.1f} GB per GPU (micro batch 1, "
             f"{'with' if ns.recompute else 'without'} recomputation, {positions}, SP={ns.sp}):"]
    width = max(len(p.option) for p in plans)
    lines += [f"  {p.option.ljust(width)}  {f'{p.longest_seq:,}' if p.longest_seq else 'none'}" for p in plans]
    return "\n".join(lines)


def timing(config: GPTConfig, busiest: GPTConfig, setup: accounting.TrainingSetup, ns: argparse.Namespace) -> dict:
    """The Plan's time fields of one option: the expected step by part in ms (StepParts.expected with the GPU
    kind's `calibration`), tokens/s, TFLOP/s per GPU, model FLOPs (the MFU numerator) and hardware FLOPs
    (recomputation counted, as the published runs count them), with --tokens the days to train; and `bound`,
    the same from the bound (`project`). `busiest`: the busiest pipeline stage's model (stage_config)."""
    projected = step_parts(busiest, setup, ns.hardware, ns.gpus, ns.nodes, ns.flash_attn) if ns.hardware else None
    if projected is None:
        return {}
    bound, parts = projected
    sequences = setup.micro_batch_size * setup.gradient_accumulation_steps * setup.data_parallel_size

    def figures(step: StepTime) -> dict:
        tokens_per_s = sequences * config.seq_length / step.total
        flops = {f"{name}_per_gpu": count(config, sequences) / step.total / setup.world_size / 1e12
                 for name, count in (("tflops", accounting.model_flops_per_iteration),
                                     ("hardware_tflops", accounting.hardware_flops_per_iteration))}
        return dict(step_ms=step.total * 1e3, compute_ms=step.compute * 1e3,
                    communication_ms=(step.communication - step.overlap) * 1e3, offload_ms=step.offload * 1e3,
                    bubble_ms=step.bubble * 1e3, tokens_per_s=tokens_per_s, **flops,
                    days=ns.token_budget / tokens_per_s / 86400 if ns.token_budget else None)
    # the host work from the table's GPU coefficients: this machine cannot probe the GPU it plans for
    host = host_seconds(busiest, setup, setup.pipeline_parallel_size - 1, dict(OWNER_REDUCTION),
                        HOST_COEFFICIENTS["cuda"])
    return dict(**figures(parts.expected(calibration(ns.hardware))), host_ms=host * 1e3, bound=figures(bound))


# --- the calibration: published runs as the planner's command lines, and the fit --------------------------------
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
    config = model_config(parse_args(published_run_args(run)))
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
    config = model_config(parse_args(published_run_args(run)))
    flops = accounting.hardware_flops_per_iteration(config, run["global_batch_size"])
    return flops / published_step_seconds(run) / (run["gpus_per_node"] * run["nodes"]) / 1e12


def published_run_parts(run: dict) -> StepParts:
    ns = parse_args(published_run_args(run))
    ns.hardware = hardware(ns)
    config = model_config(ns)
    _, accumulation = batch_split(ParallelLayout(ns.gpus * ns.nodes, ns.tp, ns.pp, ns.sp), ns.micro_batch_size,
                                  ns.global_batch_size)
    _, stage, offload_optimizer, offload_params, device = next(o for o in OPTIONS if o[0] == published_run_option(run))
    setup = training_setup(ns, accumulation, stage, offload_optimizer, offload_params, device)
    return step_parts(stage_config(config, ns.pp), setup, ns.hardware, ns.gpus, ns.nodes, ns.flash_attn)[1]


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


def remedies(plans: list[Plan], ns: argparse.Namespace) -> str:
    """What would make an option fit, for the "nothing fits" line: only the changes that shrink what overflows
    (a micro-batch already 1 cannot be lowered, recomputation already on cannot be added, and more GPUs shrink
    only the model states ZeRO-3 partitions, not the activations)."""
    steps = ["raise --tp or --pp"]
    if ns.micro_batch_size > 1:
        steps.append("lower --micro-batch-size")
    if not ns.recompute:
        steps.append("add --recompute")
    if any(p.activations_gb + p.output_buffer_gb < ns.usable_gb for p in plans):
        steps.append("use more GPUs")  # the model states are what overflows: more ranks partition them finer
    return steps[0] if len(steps) == 1 else ", ".join(steps[:-1]) + ", or " + steps[-1]


def choose(plans: list[Plan], remedy: str) -> tuple[Plan | None, str]:
    """With step times (--gpu), the fastest option that fits (`choose_by_time`); without, by data moved.
    `remedy`: what the "nothing fits" line suggests (`remedies`)."""
    if any(p.step_ms is not None for p in plans):
        return choose_by_time(plans, remedy)
    return choose_by_traffic(plans, remedy)


def choose_by_time(plans: list[Plan], remedy: str) -> tuple[Plan | None, str]:
    """The option that fits with the shortest predicted step; of options as fast (to 0.1%), the one that
    leaves the most memory free. The reason names the step's largest part and the runner-up."""
    timed = [p for p in plans if p.fits and p.step_ms is not None]
    if not timed:
        return choose_by_traffic(plans, remedy)
    fastest = min(p.step_ms for p in timed)
    best = min((p for p in timed if p.step_ms <= fastest * 1.001), key=lambda p: p.total_gb)
    parts = {"compute": best.compute_ms, "communication": best.communication_ms, "offload": best.offload_ms,
             "bubble": best.bubble_ms}
    largest = max(parts, key=parts.get)
    why = (f"fits ({best.total_gb:.1f} GB per GPU) and has the shortest predicted step of those that fit, "
           f"{best.step_ms:.0f} ms ({largest} {parts[largest]:.0f} ms)")
    rest = sorted((p for p in timed if p is not best), key=lambda p: p.step_ms)
    if rest:
        why += f"; next {rest[0].option} {rest[0].step_ms:.0f} ms ({rest[0].step_ms / best.step_ms:.2f}x)"
    missing = [p.option for p in plans if not p.fits]
    if missing:
        why += f"; {', '.join(missing)} {'does' if len(missing) == 1 else 'do'} not fit"
    untimed = [p.option for p in plans if p.fits and p.step_ms is None]
    if untimed:
        why += f"; {', '.join(untimed)} not timed (give --nvme-bandwidth)"
    return best, why


def choose_by_traffic(plans: list[Plan], remedy: str) -> tuple[Plan | None, str]:
    """The option that fits with the least data moved per step (sent, plus PCIe and NVMe for offload);
    among those that move as little (DP, Z1 and Z2 without gradient accumulation; in bf16 DP and Z2, as
    stage 1's bf16 optimizer sends 1.5x), the one that leaves the most memory free, room for a larger
    micro-batch, the lower stage where two need as much (without accumulation DeepSpeed's fp32 and fp16
    stage 1 keeps the gradients stage 2 does)."""
    fitting = [p for p in plans if p.fits]
    if not fitting:
        return None, f"nothing fits: {remedy}"
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


def calibration_summary() -> str:
    """Which published runs the calibration covers and how far each lands when left out of the fit (the README
    quotes this phrase; tests/test_published_runs.py holds it to it)."""
    a100, h100 = PUBLISHED["calibration"], PUBLISHED["h100_calibration"]
    return (f"calibrated on {len(PUBLISHED['runs'])} published A100 runs: each within "
            f"{100 * a100['leave_one_out_error']:.0f}%; on {len(PUBLISHED['h100_runs'])} published H100 runs: each "
            f"within {100 * h100['leave_one_out_error']:.0f}%")


def expected_line(hw: Hardware) -> str:
    c = calibration(hw)
    runs = "H100 runs' matmul fraction" if c is H100_CALIBRATION else "A100 runs'"
    return (f"step ms: the expected step, the bound (bound ms: every FLOP at {hw.efficiency:g} of the peak, every "
            f"link at its nominal bandwidth) with matmuls at {c.matmul:.3g} of that rate, memory-bound kernels "
            f"reading and writing each layer's activations {c.memory_passes:.3g} times, collectives at {c.link:.3g} "
            f"of the bandwidth and recomputation's all-reduces; {calibration_summary()} of its published "
            f"throughput when left out of the fit (tools/published_runs.json); {hw.gpu} takes the {runs}\n"
            f"host ms: the engine's host work at the {HOST_COEFFICIENTS['cuda'].source} coefficients "
            f"(megatron/accounting/predict/host_work.py; not probed, not in step ms)")


def notes(config: GPTConfig, ns: argparse.Namespace, plans: list[Plan]) -> list[str]:
    """What the user should know about the plans that the table cannot say."""
    lines = []
    layers, pp = config.num_layers, ns.pp
    if layers % pp:
        lines.append(f"note: {layers} layers over {pp} pipeline stages: {layers % pp} stages of {-(-layers // pp)} "
                     f"and {pp - layers % pp} of {layers // pp}, as Megatron-DeepSpeed's type:transformer partition "
                     f"balances them; the stages of {-(-layers // pp)} set the memory and the step")
    if ns.precision == "bf16" and any(p.option == "Z1" for p in plans):
        lines.append("note: Z1 in bf16 is DeepSpeed's BF16_Optimizer, not the ZeRO paper's stage 1: it accumulates "
                     "the gradients in fp32 (6 bytes per parameter, bf16 and fp32 copies of every gradient) and "
                     "all-reduces them before gathering the parameters, 1.5x stage 1's bytes (docs/zero-tradeoff.md)")
    lines += bubble_note(ns)
    return lines


def bubble_note(ns: argparse.Namespace) -> list[str]:
    """A pipeline with few micro-batches a step idles most of it ((p-1)/m of its compute, 1F1B's fill and drain):
    say so, and the --global-batch-size that keeps the bubble to a quarter, m >= 4 (p-1) micro-batches."""
    dp = ns.gpus * ns.nodes // (ns.tp * ns.pp * ns.sp)
    _, micro_batches = batch_split(ParallelLayout(ns.gpus * ns.nodes, ns.tp, ns.pp, ns.sp), ns.micro_batch_size,
                                   ns.global_batch_size)
    if ns.pp == 1 or (ns.pp - 1) / micro_batches <= 0.25:
        return []
    batch = 4 * (ns.pp - 1) * ns.micro_batch_size * dp
    return [f"note: {micro_batches} micro-batch{'es' if micro_batches > 1 else ''} a step over {ns.pp} pipeline "
            f"stages: the pipeline idles (p-1)/m = {(ns.pp - 1) / micro_batches:.2g}x each GPU's compute while it "
            f"fills and drains; --global-batch-size {batch} ({4 * (ns.pp - 1)} micro-batches) keeps that to 0.25x"]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-size", help=f"a preset: {', '.join(MODEL_PRESETS)}")
    parser.add_argument("--num-layers", type=int)
    parser.add_argument("--hidden-size", type=int)
    parser.add_argument("--num-attention-heads", type=int)
    parser.add_argument("--vocab-size", type=int,
                        help="before padding (default: the preset's tokenizer's, llama3-8b's 128256, say; else "
                             "GPT-2's)")
    parser.add_argument("--seq-length", type=int,
                        help="default: the preset's context (llama3-8b's 8192, say; else GPT-3's 2048)")
    parser.add_argument("--micro-batch-size", type=int, default=1, help="default: 1")
    parser.add_argument("--global-batch-size", type=int, help="default: one micro-batch per data-parallel rank")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs per node")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpu-memory", help="per GPU, e.g. 40GB (default: --gpu's)")
    parser.add_argument("--gpu", help=f"the GPU kind, for step times: {', '.join(GPU_KINDS)}")
    parser.add_argument("--efficiency", type=float,
                        help="fraction of the dense peak that large matmuls reach (default: --gpu's, measured)")
    parser.add_argument("--intra-node-bandwidth",
                        help="per GPU and direction inside a node, e.g. 2400Gbit or 300GB/s (default: --gpu's)")
    parser.add_argument("--inter-node-bandwidth",
                        help="per node, all its NICs, e.g. 200Gbit or 25GB/s (default: --gpu's reference node)")
    parser.add_argument("--latency", default=f"{DEFAULT_LATENCY_US:g}us",
                        help=f"per collective and level it crosses (default: {DEFAULT_LATENCY_US:g}us)")
    parser.add_argument("--nvme-bandwidth", help="per node, e.g. 25GB/s; without it NVMe offload is not timed")
    parser.add_argument("--tokens", help="a token budget, e.g. 300B: prints the days to train it")
    parser.add_argument("--storage-bandwidth",
                        help="the checkpoint filesystem's write bandwidth for the whole job, e.g. 20GB/s: with "
                             "--mtbf-hours, prints the checkpoint interval that fits")
    parser.add_argument("--mtbf-hours", type=float,
                        help="the cluster's mean time between failures for a job this size, in hours")
    parser.add_argument("--headroom", type=float, default=HEADROOM,
                        help="fraction of GPU memory kept for the CUDA context, communication buckets and "
                             f"fragmentation (default: {HEADROOM:g})")
    parser.add_argument("--tp", "--tensor-model-parallel-size", dest="tp", type=int, default=1)
    parser.add_argument("--pp", "--pipeline-model-parallel-size", dest="pp", type=int, default=1)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--ds-sequence-parallel-size", dest="sp", type=int, default=1,
                        help="DeepSpeed-Ulysses: split each sequence over this many GPUs (default: 1)")
    parser.add_argument("--use-rotary-position-embeddings", dest="rotary", action="store_true",
                        help="rotary positions: no learned position table, which would grow with --seq-length")
    parser.add_argument("--num-key-value-heads", type=int, help="grouped-query attention (default: the preset's, "
                        "else one per query head)")
    parser.add_argument("--ffn-hidden-size", type=int, help="default: the preset's, else 4 x hidden (2/3 of it with "
                        "--swiglu)")
    parser.add_argument("--swiglu", action="store_true", help="SwiGLU's three-matrix MLP (Llama)")
    parser.add_argument("--normalization", choices=("layernorm", "rmsnorm"))
    parser.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    parser.add_argument("--disable-bias-linear", action="store_true")
    parser.add_argument("--rope-theta", type=float)
    parser.add_argument("--use-flash-attn-v2", "--use-flash-attn", dest="flash_attn", action="store_true",
                        help="time attention as a fused kernel that writes no s x s scores (FlashAttention; "
                             "zero-lab's SDPA on a GPU); default: unfused, as the calibration's published runs")
    parser.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    parser.add_argument("--recompute", "--checkpoint-activations", dest="recompute", action="store_true",
                        help="full activation recomputation")
    parser.add_argument("--num-experts", type=int, nargs="+",
                        help="experts of every other layer, one value or one per MoE layer (an MoE --model-size, "
                             "gpt-125m-moe8 say, has its own)")
    parser.add_argument("--moe-expert-parallel-size", dest="ep", type=int,
                        help="default: every size that divides the GPUs and each layer's experts")
    parser.add_argument("--topk", type=int, default=1, help="experts per token (default: 1)")
    parser.add_argument("--json", action="store_true", help="print the plans and the choice as JSON")
    ns = parser.parse_args(argv)
    if ns.model_size is None and ns.num_layers is None:
        parser.error("give --model-size or --num-layers/--hidden-size/--num-attention-heads")
    if ns.vocab_size is None:
        ns.vocab_size = PRESET_VOCABULARY.get(ns.model_size, GPT2_VOCAB)
    if ns.seq_length is None:
        ns.seq_length = PRESET_SEQ_LENGTH.get(ns.model_size, 2048)
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
        ns.hardware = hardware(ns)
        if ns.gpu_memory is None and ns.hardware is None:
            raise PlanError("give --gpu-memory or --gpu")
        memory = parse_memory(ns.gpu_memory) if ns.gpu_memory else ns.hardware.kind.memory_gb
        ns.usable_gb = memory * (1.0 - ns.headroom)
        if ns.tokens and ns.hardware is None:
            raise PlanError("--tokens needs --gpu: the days to train come from the step time on a GPU kind")
        ns.token_budget = parse_tokens(ns.tokens) if ns.tokens else None
        config = model_config(ns)
        plans = plan(config, ns)
        best, why = choose(plans, remedies(plans, ns))
        checkpointing = checkpoint_advice(config, ns, best)
    except ZeroLabError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    hw = ns.hardware
    if ns.json:
        gpu = None if hw is None else dict(
            gpu=hw.gpu, peak_tflops=hw.peak_tflops, efficiency=hw.efficiency, intra_node_gbps=hw.intra_node_gbps,
            inter_node_gbps=hw.inter_node_gbps, latency_us=hw.latency_us, tokens=ns.token_budget)
        print(json.dumps({"plans": [vars(p) for p in plans], "hardware": gpu, "choice": best.option if best else None,
                          "why": why, "checkpoint": checkpointing, "notes": notes(config, ns, plans)}, indent=2))
        return 0
    name = ns.model_size or f"{config.num_layers} layers x {config.hidden_size}"
    layout = f"TP={ns.tp}, PP={ns.pp}" + (f", SP={ns.sp}" if ns.sp > 1 else "")
    print(f"{name}: {accounting.count_parameters(config) / 1e9:.2f}B parameters, seq {ns.seq_length}, micro batch "
          f"{ns.micro_batch_size}, {ns.gpus * ns.nodes} GPUs ({layout}), {ns.precision}\n")
    print(table(plans, ns.usable_gb))
    print("\n" + longest_table(plans, config, ns))
    if hw is not None:
        _, accumulation = batch_split(ParallelLayout(ns.gpus * ns.nodes, ns.tp, ns.pp, ns.sp), ns.micro_batch_size,
                                      ns.global_batch_size)
        print(f"\nstep time on {ns.nodes} x {ns.gpus} {hw.gpu}: {hw.peak_tflops:g} TFLOP/s {ns.precision} peak x "
              f"{hw.efficiency:g}, {hw.intra_node_gbps:g} Gbit/s inside a node, {hw.inter_node_gbps:g} Gbit/s per "
              f"node between nodes, {hw.latency_us:g} us per message; {accumulation} micro-batch"
              f"{'es' if accumulation > 1 else ''} per step" + (f", {ns.tokens} tokens" if ns.token_budget else "")
              + "\n" + expected_line(hw) + "\n")
        print(time_table(plans, ns.token_budget is not None, ns.pp > 1, ns.recompute))
    if notes(config, ns, plans):
        print("\n" + "\n".join(notes(config, ns, plans)))
    print(f"\npick: {best.option}: {why}" if best else f"\npick: none: {why}")
    if checkpointing:
        print(checkpoint_line(checkpointing, ns))
    return 0


def checkpoint_advice(config: GPTConfig, ns: argparse.Namespace, best: Plan | None) -> dict | None:
    """With --storage-bandwidth and --mtbf-hours: the checkpoint's size and predicted save time, and the
    Young/Daly interval (megatron/checkpointing/interval.py), in iterations of the picked option where its step
    is timed (--gpu)."""
    if ns.storage_bandwidth is None and ns.mtbf_hours is None:
        return None
    if ns.storage_bandwidth is None or ns.mtbf_hours is None:
        raise PlanError("--storage-bandwidth and --mtbf-hours go together: the interval needs the save time and the MTBF")
    if ns.mtbf_hours <= 0:
        raise PlanError(f"--mtbf-hours must be > 0, got {ns.mtbf_hours:g}")
    stage = 3 if best is None else next(o[1] for o in OPTIONS if o[0] == best.option)
    size = checkpoint_bytes(accounting.count_parameters(config), ns.precision, stage)
    save_s = size / (parse_bandwidth(ns.storage_bandwidth, "--storage-bandwidth") * 1e9 / 8)
    best_s = interval.optimal_interval_seconds(save_s, ns.mtbf_hours * 3600)
    step_s = best.step_ms / 1e3 if best is not None and best.step_ms is not None else None
    return dict(bytes=size, save_s=save_s, mtbf_hours=ns.mtbf_hours, interval_s=best_s,
                interval_iterations=None if step_s is None else max(1, round(best_s / step_s)),
                lost_fraction=interval.expected_loss_fraction(best_s, save_s, ns.mtbf_hours * 3600))


def checkpoint_line(advice: dict, ns: argparse.Namespace) -> str:
    every = f"every {advice['interval_s']:,.0f} s of training"
    if advice["interval_iterations"] is not None:
        every += f" (--save-interval {advice['interval_iterations']} at the picked option's step)"
    size = f"{advice['bytes'] / 1e12:.2f} TB" if advice["bytes"] >= 1e12 else f"{advice['bytes'] / 1e9:.1f} GB"
    return (f"checkpoint: {size} per save (parameters and optimizer states), "
            f"{advice['save_s']:,.0f} s at {ns.storage_bandwidth}; with --mtbf-hours {ns.mtbf_hours:g} save {every}, "
            f"{100 * advice['lost_fraction']:.1f}% of the time lost in expectation (Young/Daly)")


if __name__ == "__main__":
    sys.exit(main())
