"""The batch arithmetic of a parallel layout, and the layouts that MoE and DeepSpeed-Ulysses cannot run, in one
place: pretrain_gpt.py's flag parsing (megatron/arguments.py) and the planner (megatron/accounting/plan/) refuse
them in the same words. Shell launchers that must refuse a bad layout before starting ranks (ALCF/args.sh) call it as

    python -m megatron.layout_check --world-size N --tensor-model-parallel-size T --pipeline-model-parallel-size P \
        --micro-batch-size M [--global-batch-size G]

which prints "data_parallel_size global_batch_size gradient_accumulation_steps", or one `error:` line.
"""
import argparse
import sys

from megatron.core.layout import ParallelLayout
from megatron.errors import ZeroLabError
from megatron.flag_sources import name_sources


class BatchError(ZeroLabError, ValueError):
    """A batch size that the layout cannot split; the message names the flag."""


def batch_split(layout: ParallelLayout, micro_batch_size: int, global_batch_size: int | None) -> tuple[int, int]:
    """(global batch, gradient accumulation steps); the global batch defaults to one micro-batch per DP rank."""
    if micro_batch_size < 1:
        raise BatchError(f"--micro-batch-size must be >= 1, got {micro_batch_size}")
    dp = layout.data_parallel_size
    global_batch = global_batch_size if global_batch_size is not None else micro_batch_size * dp
    if global_batch < 1 or global_batch % (micro_batch_size * dp):
        raise BatchError(f"--global-batch-size {global_batch} is not divisible by --micro-batch-size "
                         f"{micro_batch_size} x data-parallel size {dp}")
    return global_batch, global_batch // (micro_batch_size * dp)


def expert_parallel_problems(moe_layer_experts: list[int], expert_parallel_size: int,
                             data_parallel_size: int | None = None) -> list[str]:
    """Where --moe-expert-parallel-size cannot spread the MoE layers' experts (`moe_layer_experts`: each MoE layer's
    count): DeepSpeed's MoE layer splits a layer's experts evenly over the expert-parallel ranks, and each expert
    group is that many data-parallel ranks. The trainer (GPTConfig, megatron/arguments.py) and the launch planner
    (megatron/launch/settings.py, which names the variables behind the flags) refuse through it."""
    ep, flag = expert_parallel_size, f"--moe-expert-parallel-size {expert_parallel_size}"
    problems = [f"{flag} must divide {count}, an MoE layer's experts by --num-experts: each layer's experts are split "
                f"evenly over the expert-parallel ranks; use a multiple of {ep} experts, or a "
                f"--moe-expert-parallel-size that divides {count}" for count in sorted(set(moe_layer_experts))
                if count % ep]
    if data_parallel_size is not None and data_parallel_size % ep:
        problems.append(f"{flag} must divide the data-parallel size {data_parallel_size}: the experts are spread "
                        "over groups of data-parallel ranks")
    return problems


def ulysses_problems(sp: int, *, tensor: int, pipeline: int, sequence_parallel: bool, num_attention_heads: int,
                     seq_length: int) -> list[str]:
    """Why DeepSpeed-Ulysses (--ds-sequence-parallel-size `sp`) cannot run this layout, if it cannot
    (docs/long-sequences.md); [] when it can. `sequence_parallel`: Megatron's --sequence-parallel."""
    if sp == 1:
        return []
    heads = num_attention_heads // tensor
    per_tp = f" ({heads} per tensor-parallel rank)" if tensor > 1 else ""
    flag = f"--ds-sequence-parallel-size {sp}"
    return [message for refused, message in (
        (sequence_parallel, f"{flag} and --sequence-parallel (Megatron's, over the tensor-parallel group) are "
                            "exclusive; drop one"),
        (pipeline > 1, f"{flag} cannot be combined with pipeline parallelism; use --pipeline-model-parallel-size 1 "
                       "or --no-pipeline-parallel"),
        (heads % sp != 0, f"--num-attention-heads {num_attention_heads}{per_tp} is not divisible by {flag}: each "
                          "rank attends over whole heads"),
        (seq_length % sp != 0, f"--seq-length {seq_length} is not divisible by {flag}: each rank holds an equal "
                               "slice"),
    ) if refused]


def moe_problems(flag: str, *, tensor: int, pipeline: int, sequence: int, data: int, expert: int) -> list[str]:
    """Why an MoE model (`flag`: its --num-experts as given, GPTConfig.experts_setting) cannot run at these
    parallel sizes, if it cannot (docs/moe.md); [] when it can. That --moe-expert-parallel-size `expert` divides
    each layer's experts is GPTConfig's rule."""
    return [message for refused, message in (
        (pipeline > 1, f"{flag} cannot be combined with pipeline parallelism; use --pipeline-model-parallel-size 1 "
                       "or --no-pipeline-parallel"),
        (tensor > 1, f"{flag} cannot be combined with --tensor-model-parallel-size > 1 (the experts are not split "
                     "over tensor-parallel ranks here)"),
        (sequence > 1, f"{flag} cannot be combined with --ds-sequence-parallel-size > 1"),
    ) if refused] + expert_parallel_problems([], expert, data)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--micro-batch-size", type=int, required=True)
    parser.add_argument("--global-batch-size", type=int, default=None)
    ns = parser.parse_args(argv)
    try:
        layout = ParallelLayout(ns.world_size, ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size)
        global_batch, accumulation = batch_split(layout, ns.micro_batch_size, ns.global_batch_size)
    except ZeroLabError as err:
        print(f"error: {name_sources(str(err), argv)}", file=sys.stderr)
        return 1
    print(layout.data_parallel_size, global_batch, accumulation)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
