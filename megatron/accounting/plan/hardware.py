"""The GPUs and links a plan is timed on: the --gpu kinds (their peaks, memory, links; each figure's source
below), the Hardware the flags make of one, and the projection of a step onto it (`project`: predict_step_time
at every FLOP's large-matmul rate and every link's nominal bandwidth, the bound)."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from megatron import accounting
from megatron.accounting.plan.units import PlanError, parse_bandwidth, parse_latency
from megatron.accounting.predict.step_time import (
    ComputeRates,
    LinkCosts,
    StepTime,
    hierarchical_link_costs,
    predict_step_time,
)
from megatron.accounting.predict.traffic import OWNER_REDUCTION
from megatron.model.config import GPTConfig

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
# host memory per node, GB (2**30 bytes): a DGX A100 320GB's 1 TB (NVIDIA's datasheet; the DGX A100 640GB and DGX
# H100 have 2 TB): what offloaded model states and --checkpoint-in-cpu's layer inputs may take, all of the node's GPUs'
DEFAULT_HOST_GB = 1024.0
DEFAULT_LATENCY_US = 10.0  # per message and level crossed; assumed, no published figure used (see the docs)


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



def hardware(gpu: str | None, precision: str, efficiency: float | None, intra_node_bandwidth: str | None,
             inter_node_bandwidth: str | None, latency: str, nvme_bandwidth: str | None) -> Hardware | None:
    """--gpu's kind with the flags that override its figures (each as given); None without --gpu."""
    if gpu is None:
        return None
    if gpu not in GPU_KINDS:
        raise PlanError(f"--gpu {gpu}: unknown kind (choose from {', '.join(GPU_KINDS)})")
    kind = GPU_KINDS[gpu]
    peak = accounting.PEAK_TFLOPS[kind.part].get(accounting.matmul_precision(precision, False))
    if peak is None:
        raise PlanError(f"--gpu {gpu} has no {precision} tensor cores: give --precision fp16")
    efficiency = kind.efficiency if efficiency is None else efficiency
    if not 0 < efficiency <= 1:
        raise PlanError(f"--efficiency must be in (0, 1], got {efficiency}")
    intra = kind.intra_node_gbps if intra_node_bandwidth is None else parse_bandwidth(
        intra_node_bandwidth, "--intra-node-bandwidth")
    inter = kind.inter_node_gbps if inter_node_bandwidth is None else parse_bandwidth(
        inter_node_bandwidth, "--inter-node-bandwidth")
    nvme = None if nvme_bandwidth is None else parse_bandwidth(nvme_bandwidth, "--nvme-bandwidth") * 1e9 / 8
    return Hardware(gpu, kind, peak, efficiency, intra, inter, parse_latency(latency), nvme)


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

