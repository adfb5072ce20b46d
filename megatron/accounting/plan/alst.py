"""The planner against ALST's published longest sequences (Arctic Long Sequence Training, Bekman et al. 2025, arXiv
2506.13996): Llama-3.1-8B trained at 500K tokens on one H100 80GB and 3.7M on 8. No coefficient is fitted to them:
`check` plans each run's setup with every lever it used and prints the planner's longest beside the published one.

The setups, from the paper and the recipes it points to (ArcticTraining, projects/sequence-parallelism:
run-h100-sp1-llama-8b.yml and run-h100-sp8-llama-8b.yml, and that README's "Environment used"): micro batch 1,
bf16, ZeRO-3 with the optimizer offloaded to the CPU (cpu_adam), on one GPU the parameters offloaded too, Ulysses
over the GPUs (sequence_parallel_size 1 and 8), tiled MLP (tiled_mlp_compute), Liger-Kernel's fused logits and loss
(tiled, as --tiled-logits-loss), activation checkpoints offloaded to the CPU (activation_checkpoint_cpu_offload),
flash_attention_2; H100 80GB nodes with 1.9 TB of CPU memory. The one-GPU recipe's max_length is 500,000 (its
note: 555,000 stopped on a Triton illegal memory access, not out of memory); the 8-GPU recipe's is 3,800,000, the
paper's figure 3.7M."""
from __future__ import annotations

from dataclasses import dataclass

from megatron.accounting.plan.flags import parse_flags
from megatron.accounting.plan.levers import longest_within
from megatron.accounting.plan.options import option_stage, training_setup
from megatron.accounting.plan.request import plan_request
from megatron.accounting.predict.fit import stage_config

HOST_GB = 1.9e12 / 2**30  # the README's 1.9 TB of CPU memory per node, in the planner's GB (2**30 bytes)
LEVER_FLAGS = ["--recompute", "--tiled-mlp-compute", "--tiled-logits-loss", "--checkpoint-in-cpu",
               "--use-flash-attn-v2"]
# (setup, published longest sequence, the ZeRO option the recipe ran, the planner's flags for it)
RUNS = [("Llama-3.1-8B, 1 x H100 80GB, SP=1", 500_000, "Z3 + full offload",
         ["--model-size", "llama3-8b", "--gpus", "1", "--gpu", "H100-SXM", "--seq-length", "500000"]),
        ("Llama-3.1-8B, 8 x H100 80GB, SP=8", 3_700_000, "Z3 + optimizer offload",
         ["--model-size", "llama3-8b", "--gpus", "8", "--gpu", "H100-SXM", "--seq-length", "3700000",
          "--ds-sequence-parallel-size", "8"])]


@dataclass(frozen=True)
class AlstCheck:
    setup: str
    option: str
    args: list[str]  # tools/zero_plan.py's flags for the run
    planned: int  # the planner's longest sequence at the run's option, every lever on
    published: int
    limit: str  # what one more slice overflows: "GPU" or "host"

    @property
    def ratio(self) -> float:
        return self.planned / self.published


def run_args(args: list[str]) -> list[str]:
    return [*args, *LEVER_FLAGS, "--host-gb", f"{HOST_GB:.1f}"]


def check() -> list[AlstCheck]:
    """Each published run planned: the longest sequence at its option, within the H100's memory less the
    planner's headroom and the node's 1.9 TB."""
    rows = []
    for setup, published, option, args in RUNS:
        request = plan_request(parse_flags(run_args(args)))
        _, stage, optimizer, params, device = option_stage(option)
        f = request.flags
        planned, limit = longest_within(stage_config(request.config, f.pp),
                                        training_setup(request, stage, optimizer, params, device),
                                        request.usable_gb, f.host_gb, f.gpus)
        rows.append(AlstCheck(setup, option, run_args(args), planned, published, limit))
    return rows


def check_table(rows: list[AlstCheck]) -> str:
    """What `tools/zero_plan.py --alst-check` prints: each run's planned and published longest, their ratio, the
    limit, and the command line that plans it."""
    header = ("setup", "option", "planned", "published", "planned / published", "limit")
    table = [header] + [(r.setup, r.option, f"{r.planned:,}", f"{r.published:,}", f"{r.ratio:.2f}", r.limit)
                        for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["ALST's published longest sequences (Bekman et al. 2025, arXiv 2506.13996) beside the planner's, at "
             "micro batch 1, bf16, with recomputation, the tiled MLP and loss and the layer inputs in host memory; "
             f"{HOST_GB:.1f} GB of host memory per node; nothing fitted to them:"]
    lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    lines += [f"  {r.setup}: python tools/zero_plan.py {' '.join(r.args)}" for r in rows]
    return "\n".join(lines)
