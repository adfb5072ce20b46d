"""The long-sequence levers in the order a user pulls them (recomputation, the tiled MLP and loss, the layer inputs
in host memory: docs/long-sequences.md) and the longest sequence each combination fits at the plan's SP size, with
the ZeRO option that fits it longest. A sequence fits where the busiest GPU's predicted peak fits the usable memory
and the node's host memory (--host-gb) holds what its GPUs offload: the model states offload keeps there and the
layer inputs --checkpoint-in-cpu keeps there (megatron/accounting/predict/memory.py's `offloaded` and
`activations_offloaded`; DeepSpeed's pinned buffers and the optimizer's own host work are not counted)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from megatron import accounting
from megatron.accounting.plan.options import GB, at_length, layout_options, longest_length, training_setup
from megatron.accounting.plan.request import PlanRequest
from megatron.accounting.predict.fit import stage_config

# (label, the flags the row adds to the one above, recompute, tiled MLP and loss, layer inputs in host memory)
LEVERS = [("none", "", False, False, False),
          ("recompute", "--checkpoint-activations", True, False, False),
          ("+ tiled MLP and loss", "--tiled-mlp-compute --tiled-logits-loss", True, True, False),
          ("+ layer inputs in host memory", "--checkpoint-in-cpu", True, True, True)]


@dataclass(frozen=True)
class Longest:
    """The longest sequence one lever combination fits, and what stops one more slice of SP tokens."""
    levers: str
    flags: str
    longest_seq: int  # 0: not even SP tokens fit
    option: str | None  # the ZeRO option that fits it longest (of equals the first, the least traffic); None: none
    limit: str  # "GPU" or "host": what one more slice would overflow
    gpu_gb: float  # the busiest GPU's predicted peak at the longest
    host_gb: float  # the node's host memory taken at the longest: its GPUs' offloaded states and layer inputs


def memory_gb(busiest, setup: accounting.TrainingSetup, length: int, gpus_per_node: int) -> tuple[float, float]:
    """(the busiest GPU's predicted peak, the host memory the node's GPUs take) at `length` tokens, GB: on the host
    each GPU's offloaded model states (on NVMe with NVMe offload, not here) and layer inputs."""
    config = at_length(busiest, length)
    stages = [accounting.memory_per_rank(config, setup, stage) for stage in range(setup.pipeline_parallel_size)]
    states = 0 if setup.offload_device == "nvme" else 1
    host = max(states * memory["offloaded"] + memory["activations_offloaded"] for memory in stages)
    return max(memory["total"] for memory in stages) / GB, gpus_per_node * host / GB


def longest_within(busiest, setup: accounting.TrainingSetup, usable_gb: float, host_limit_gb: float,
                   gpus_per_node: int, at_least: int = 0) -> tuple[int, str]:
    """(the longest multiple of SP tokens that fits the GPU and the host at micro-batch 1, the limit one more
    slice of SP tokens overflows: "GPU" or "host"); (0, "shorter") where `at_least` tokens do not fit."""
    one = replace(setup, micro_batch_size=1)
    sp = setup.sequence_parallel_size

    def fits(length: int) -> tuple[bool, bool]:
        gpu, host = memory_gb(busiest, one, length, gpus_per_node)
        return gpu <= usable_gb, host <= host_limit_gb

    if at_least and not all(fits(at_least)):
        return 0, "shorter"
    longest = longest_length(lambda length: all(fits(length)), sp)
    return longest, "GPU" if not fits(longest + sp)[0] else "host"


def lever_setups(request: PlanRequest, recompute: bool, tiled: bool, offload: bool) -> tuple:
    """(the busiest stage's model, [(option label, TrainingSetup)]) of one lever combination: every option the
    plan weighs. An MoE model tiles only the loss (the training refuses --tiled-mlp-compute with MoE layers)."""
    config = replace(request.config, recompute_activations=recompute, recompute_offload=offload,
                     tiled_mlp_compute=tiled and not request.config.is_moe, tiled_logits_loss=tiled)
    setups = [(label, replace(training_setup(request, stage, optimizer, params, device, ep),
                              activation_recompute=recompute, activation_offload=offload))
              for label, stage, optimizer, params, device, ep in layout_options(request)
              if stage < 2 or request.flags.pp == 1]  # DeepSpeed's pipeline engine: ZeRO 0 and 1 only
    return stage_config(config, request.flags.pp), setups


def longest(request: PlanRequest, label: str, flags: str, recompute: bool, tiled: bool, offload: bool) -> Longest:
    """One lever combination's longest sequence over every option: searched from the last option (the most
    offloaded, mostly the longest), each earlier one only where it fits the longest so far, so that of equals the
    first (the least traffic) wins."""
    busiest, setups = lever_setups(request, recompute, tiled, offload)
    f = request.flags
    best = (None, None, 0, "GPU")
    for option, setup in reversed(setups):
        length, limit = longest_within(busiest, setup, request.usable_gb, f.host_gb, f.gpus, at_least=best[2])
        if length and length >= best[2]:
            best = (option, setup, length, limit)
    option, setup, length, limit = best
    if request.config.is_moe and tiled:
        label, flags = label.replace("MLP and loss", "loss"), flags.replace("--tiled-mlp-compute ", "")
    gpu, host = memory_gb(busiest, replace(setup, micro_batch_size=1), length, f.gpus) if length else (0.0, 0.0)
    return Longest(label, flags, length, option, limit, gpu, host)


def levers(request: PlanRequest) -> list[Longest]:
    """The longest sequence of each lever combination, in LEVERS' order: each adds its levers to the row above."""
    return [longest(request, *lever) for lever in LEVERS]
