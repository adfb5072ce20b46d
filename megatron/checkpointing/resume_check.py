"""At start-up, before the model is built: can this run resume `--load` as its flags ask?

The checkpoint the resume rule takes must be complete (protocol.check_resumable), and its layout one this run
can load: DeepSpeed's own loader takes the files only into the same ZeRO stage and (ZeRO 1-3)
data-parallel size (the ZeRO partitions are over data x DeepSpeed-Ulysses sequence-parallel ranks: a checkpoint
saved with --ds-sequence-parallel-size 2 x DP 1 has two, as one of DP 2); `--universal-checkpoint` converts across
those (megatron/checkpointing/universal.py). A mixture-of-experts checkpoint resumes only in the ZeRO stage,
data-parallel and expert-parallel sizes it was saved with (moe_layout_refusal).
A model of another shape or precision is refused (megatron/checkpointing/resume_model.py; another precision is
offered --universal-checkpoint where it converts). A tensor- or pipeline-parallel size other than the checkpoint's
is refused either way: the model declares none of the parameter patterns DeepSpeed's ds_to_universal needs to
merge or split TP slices, and no such conversion is tested here. `--finetune` takes the weights of any layout
(megatron/saved_model merges them).
Each refusal is one line naming the flags to change.
"""
from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

from megatron.checkpointing.protocol import CheckpointError, check_resumable, read_marker
from megatron.checkpointing.resume_model import NEW_FOLDER, current_model, model_refusal, precision_refusal

if TYPE_CHECKING:
    from megatron.arguments import Args

_MODEL_PARALLEL = (("tensor_model_parallel_size", "--tensor-model-parallel-size", "tensor-parallel"),
                   ("pipeline_model_parallel_size", "--pipeline-model-parallel-size", "pipeline-parallel"))


def current_layout(args: Args) -> dict:
    """What a resume must match to load the files as they are (stored in the marker as `layout`)."""
    par = args.parallel
    return {"zero_stage": args.deepspeed.zero_stage, "data_parallel_size": par.data_parallel_size,
            "sequence_parallel_size": par.sequence_parallel_size,
            "tensor_model_parallel_size": par.tensor_model_parallel_size,
            "pipeline_model_parallel_size": par.pipeline_model_parallel_size,
            "positions": "rotary" if args.model.use_rotary_position_embeddings else "learned",
            "expert_parallel_size": args.model.moe_expert_parallel_size,
            "num_experts": list(args.model.layer_experts),
            "model": current_model(args), "precision": args.deepspeed.precision}


def positions_refusal(saved: str, current: str) -> str | None:
    """Why weights with `saved` positions ("learned": a position table, "rotary": none) cannot go into a model
    with `current` ones (None: the same kind). Checkpoints from before rotary recorded none: learned."""
    if saved == current:
        return None
    flag = "add --use-rotary-position-embeddings" if saved == "rotary" else "drop --use-rotary-position-embeddings"
    return f"it was saved with {saved} positions, this model has {current} positions: {flag}"


def _describe(layout: dict) -> str:
    sequence = layout.get("sequence_parallel_size", 1)
    ulysses = f" x --ds-sequence-parallel-size {sequence}" if sequence > 1 else ""
    return f"data-parallel size {layout['data_parallel_size']}{ulysses} at ZeRO stage {layout['zero_stage']}"


def _zero_partitions(layout: dict) -> int:
    """How many ranks share the ZeRO partitions: data- times sequence-parallel (checkpoints from before
    DeepSpeed-Ulysses recorded no sequence size: 1)."""
    return layout["data_parallel_size"] * layout.get("sequence_parallel_size", 1)


def needs_universal(saved: dict, current: dict) -> bool:
    """DeepSpeed's own loader takes the files as they are only into the same partitioning."""
    if saved["zero_stage"] != current["zero_stage"]:
        return True
    return saved["zero_stage"] > 0 and _zero_partitions(saved) != _zero_partitions(current)


def model_parallel_refusal(saved: dict, current: dict) -> str | None:
    """Why a checkpoint of another tensor- or pipeline-parallel size cannot be resumed (None: same sizes)."""
    changed = [(key, flag, what) for key, flag, what in _MODEL_PARALLEL if saved.get(key, 1) != current[key]]
    if not changed:
        return None
    saved_sizes = " and ".join(f"{what} size {saved.get(key, 1)}" for key, _, what in changed)
    current_sizes = " and ".join(f"{current[key]}" for key, _, _ in changed)
    keep = " ".join(f"{flag} {saved.get(key, 1)}" for key, flag, _ in changed)
    return (f"it was saved with {saved_sizes}, this run has {current_sizes}; zero-lab resumes only on the tensor- "
            f"and pipeline-parallel sizes a checkpoint was saved with: resume with {keep}, or start from its "
            "weights on any layout with --finetune (iteration and optimizer start afresh)")


def universal_refusal(saved: dict, current: dict) -> str | None:
    """Why DeepSpeed cannot resume `saved` in the `current` layout even through a universal checkpoint."""
    if saved["zero_stage"] == 0:
        return ("it was saved at ZeRO stage 0, which DeepSpeed cannot convert to a universal checkpoint (it has "
                "no ZeRO optimizer files); resume it with the same --zero-stage 0")
    if current["zero_stage"] == 0:
        return "DeepSpeed loads a universal checkpoint only into a ZeRO optimizer; give --zero-stage 1, 2 or 3"
    if saved["zero_stage"] == 3 and current["zero_stage"] != 3:
        return ("DeepSpeed 0.19.8 converts a ZeRO-3 checkpoint into files its ZeRO-1/2 loader cannot read; "
                "resume it at --zero-stage 3 (any data-parallel size)")
    return None


def moe_layout_refusal(saved: dict, current: dict) -> str | None:
    """Why a mixture-of-experts checkpoint cannot be resumed in `current` (None: the layout it was saved with).
    DeepSpeed 0.19.8 partitions the experts' optimizer states over the expert-data-parallel ranks (DP / EP) and
    loads them only into that partitioning (at another EP it stops on a parameter-alignment mismatch), and its
    universal checkpoint converts none of deepspeed.moe's experts. Checkpoints from before the marker recorded
    the expert-parallel size: DeepSpeed's own errors apply."""
    if "expert_parallel_size" not in saved:
        return None
    keys = ("zero_stage", "data_parallel_size", "expert_parallel_size")
    if all(saved[key] == current[key] for key in keys):
        return None
    return (f"it was saved with {_describe_moe(saved)}, this run has {_describe_moe(current)}; DeepSpeed 0.19.8 "
            "resumes a mixture-of-experts checkpoint only in the layout it was saved with (no universal "
            f"checkpoint of its experts): resume with --zero-stage {saved['zero_stage']} and "
            f"--moe-expert-parallel-size {saved['expert_parallel_size']} on data-parallel size "
            f"{saved['data_parallel_size']}")


def saved_experts(saved: dict, tag_dir: str) -> list[int] | None:
    """The experts of each MoE layer in the checkpoint ([1]: dense); checkpoints from before the marker recorded
    them are read from the names of DeepSpeed's expert files (layer_<i>_expert_<j>_mp_rank_..., j over every
    expert of layer i), None where the folder cannot be read."""
    if "num_experts" in saved:
        return saved["num_experts"]
    try:
        names = os.listdir(tag_dir)
    except OSError:
        return None
    experts: dict[str, set[str]] = {}
    for name in names:
        found = re.match(r"layer_(\d+)_expert_(\d+)_", name)
        if found:
            experts.setdefault(found.group(1), set()).add(found.group(2))
    return [len(ids) for ids in experts.values()] or [1]


def _experts_value(layers: list[int]) -> str:
    """The MoE layers' experts in --num-experts's form: one value when all alike, else one per MoE layer."""
    moe = [count for count in layers if count > 1]
    return str(moe[0]) if len(set(moe)) == 1 else " ".join(map(str, moe))


def kind_refusal(saved: list[int] | None, current: list[int]) -> str | None:
    """Why a dense checkpoint cannot be resumed as a mixture of experts, or the other way (None: the same kind):
    the experts' weights and optimizer states are in the one and not the other."""
    if saved is None or (max(saved) > 1) == (max(current) > 1):
        return None
    experts = _experts_value(saved if max(saved) > 1 else current)
    other = "give the run its own folder (RUN_NAME, or leave RUN_NAME unset: the drivers' default name names the " \
            "experts), or FRESH=1 to start this one afresh"
    if max(saved) == 1:
        return (f"this is a dense checkpoint (no experts) and this run has experts (--num-experts {experts}): resume "
                f"it without --num-experts, or {other}")
    return (f"this is a mixture-of-experts checkpoint (--num-experts {experts} when saved) and this run is dense: "
            f"resume it with --num-experts {experts}, or {other}")


def experts_refusal(saved: list[int] | None, current: list[int]) -> str | None:
    """Why a mixture-of-experts checkpoint cannot be resumed with other experts per layer (None: the same; a dense
    and an MoE model are told apart first, by kind_refusal)."""
    if saved is None or saved == current or max(saved) == 1 or max(current) == 1:
        return None

    def where(layers: list[int]) -> str:
        return f"--num-experts {_experts_value(layers)} in {sum(n > 1 for n in layers)} of {len(layers)} layers"

    return (f"it was saved with {where(saved)}, this run has {where(current)}: resume it with --num-experts "
            f"{_experts_value(saved)} and the --expert-interval it was saved with, or {NEW_FOLDER}")


def _describe_moe(layout: dict) -> str:
    return f"{_describe(layout)} and --moe-expert-parallel-size {layout['expert_parallel_size']}"


def check_resume(args: Args) -> str:
    """The tag this run will resume (by the resume rule, files' sizes checked: the load reads their
    contents back); a CheckpointError (one line) when it cannot."""
    tag = check_resumable(args.checkpoint.load)
    check_layout(args, tag)
    return tag


def check_layout(args: Args, tag: str) -> None:
    """A CheckpointError (one line) when this run cannot load checkpoint `tag` of --load as it is laid out."""
    load_dir = args.checkpoint.load
    saved = read_marker(os.path.join(load_dir, tag)).get("layout")
    if saved is None:  # saved before markers recorded the layout: DeepSpeed's own errors apply
        return
    current = current_layout(args)
    experts = saved_experts(saved, os.path.join(load_dir, tag))
    refusal = positions_refusal(saved.get("positions", "learned"), current["positions"]) or \
        kind_refusal(experts, current["num_experts"]) or model_parallel_refusal(saved, current) or \
        model_refusal(saved.get("model"), current["model"], current["positions"] == "learned") or \
        experts_refusal(experts, current["num_experts"])
    if refusal:
        raise CheckpointError(f"--load {load_dir}: cannot resume {tag}: {refusal}")
    if not args.checkpoint.universal_checkpoint:
        convertible = not args.model.is_moe and universal_refusal(saved, current) is None
        refusal = precision_refusal(saved.get("precision"), current["precision"], convertible)
        if refusal:
            raise CheckpointError(f"--load {load_dir}: cannot resume {tag}: {refusal}")
    if args.model.is_moe:
        refusal = moe_layout_refusal(saved, current)
        if refusal:
            raise CheckpointError(f"--load {load_dir}: cannot resume {tag}: {refusal}")
        if args.checkpoint.universal_checkpoint:
            raise CheckpointError(f"--load {load_dir} --universal-checkpoint: cannot resume {tag}: DeepSpeed 0.19.8's "
                                  "universal checkpoint does not convert mixture-of-experts layers; resume without "
                                  "--universal-checkpoint in the layout it was saved with")
        return
    if args.checkpoint.universal_checkpoint:
        refusal = universal_refusal(saved, current)
        if refusal:
            raise CheckpointError(f"--load {load_dir} --universal-checkpoint: cannot resume {tag}: {refusal}")
    elif needs_universal(saved, current):
        raise CheckpointError(f"--load {load_dir}: checkpoint {tag} was saved with {_describe(saved)}, this run has "
                              f"{_describe(current)}: resume it with --universal-checkpoint (docs/checkpoints.md)")
