"""At start-up, before the model is built: is this run's model, and its precision, the checkpoint's?

A resume loads the checkpoint's tensors as they are: a model of another shape stops in DeepSpeed's loader with two
ranks' tracebacks (`size mismatch for position_embeddings.weight`), and another precision looks for optimizer files
of another name (`bf16_zero_pp_rank_0_...`: DeepSpeed names ZeRO's files by the precision). The checkpoint's marker
records both (`layout["model"]`, `layout["precision"]`, from `current_model` and the run's precision); these
functions compare them with this run's and say, in one line, which setting differs, its saved and its given value,
and what to do. Checkpoints from before the marker recorded them: DeepSpeed's own errors apply.
`--finetune` takes weights into another precision (and another layout) by design: it is not checked here.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from megatron.model.recipe import ARCHITECTURE_FIELDS

if TYPE_CHECKING:
    from megatron.arguments import Args

# what the tensors' shapes and names depend on, each with the flag that sets it (the layer recipe's choices of norm
# and MLP among them: two MLP activations may share their shapes, not their weights' meaning); dropout, recompute, the
# rotary angles, the epsilon and the routing's capacity are the run's to change on a resume
SHAPE_FLAGS = (("num_layers", "--num-layers"), ("hidden_size", "--hidden-size"),
               ("num_attention_heads", "--num-attention-heads"), ("num_key_value_heads", "--num-key-value-heads"),
               ("ffn_hidden_size", "--ffn-hidden-size"), ("max_position_embeddings", "--max-position-embeddings"),
               ("padded_vocab_size", "padded vocabulary"), *ARCHITECTURE_FIELDS,
               ("untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights"),
               ("disable_bias_linear", "--disable-bias-linear"), ("mlp_type", "--mlp-type"))
NEW_FOLDER = "give the run its own folder (RUN_NAME) or FRESH=1 to start this one afresh"
# --finetune reads the weights into a model of the same shape, in any precision (megatron/saved_model)
FINETUNE = "or take its weights with --finetune (iteration and optimizer start afresh)"
PRECISION_FLAGS = {"fp32": "no --bf16 or --fp16", "bf16": "--bf16", "fp16": "--fp16"}
# what the universal checkpoint was measured to carry over, both ways (ZeRO-1 on CPU ranks); fp16, which CPU ranks
# lack, is not offered it
UNIVERSAL_PRECISIONS = {"fp32", "bf16"}


def current_model(args: Args) -> dict:
    """The settings of SHAPE_FLAGS this run's model has (the vocabulary padded: the start-up step filled it in),
    and its --seq-length, which the line names beside --max-position-embeddings."""
    return {**{key: getattr(args.model, key) for key, _ in SHAPE_FLAGS}, "seq_length": args.model.seq_length}


def _differs(key: str, saved: dict, current: dict, learned_positions: bool) -> bool:
    if key not in saved:
        return False
    if key == "max_position_embeddings" and not learned_positions:
        return False  # rotary positions have no table: any length loads (positions_refusal checks the kind)
    return saved[key] != current[key]


def _setting(key: str, flag: str, model: dict, remedy: bool = False, run: bool = False) -> str:
    """How a setting of `model` reads in the line: the flag and its value, a switch by its presence. The run's
    table is named with its --seq-length, which the launch scripts give it from (SEQ_LEN): the line names the flag
    once, so that megatron/flag_sources.py can add the variable to it."""
    value = model[key]
    if isinstance(value, bool):
        return flag if value else f"{'without' if remedy else 'no'} {flag}"
    if key == "max_position_embeddings" and run:
        return f"{flag} {value} (--seq-length {model['seq_length']})"
    if key == "padded_vocab_size":
        return f"a {flag} of {value}"
    return f"{flag} {value}"


def model_refusal(saved: dict | None, current: dict, learned_positions: bool = True) -> str | None:
    """Why the weights of a model of shape `saved` (the marker's record) cannot go into this run's `current` one
    (None: the same shape, or a checkpoint that recorded none). With learned positions the table's rows
    (--max-position-embeddings, which the launch scripts give from SEQ_LEN as --seq-length) must match."""
    if saved is None:
        return None
    changed = [(key, flag) for key, flag in SHAPE_FLAGS if _differs(key, saved, current, learned_positions)]
    if not changed:
        return None
    was = ", ".join(_setting(key, flag, saved) for key, flag in changed)
    now = ", ".join(_setting(key, flag, current, run=True) for key, flag in changed)
    keep = [_setting(key, flag, saved, remedy=True) for key, flag in changed if key != "padded_vocab_size"]
    if any(key == "max_position_embeddings" for key, _ in changed):
        keep[-1] += " (a shorter sequence trains on the table)"
    if any(key == "padded_vocab_size" for key, _ in changed):
        keep.append("the tokenizer it was saved with (--tokenizer-type and its files, or --vocab-size; "
                    "--make-vocab-size-divisible-by)")
    return f"it was saved from a model with {was}, this run's has {now}: resume it with {' '.join(keep)}, or " \
        f"{NEW_FOLDER}"


def precision_refusal(saved: str | None, current: str, convertible: bool) -> str | None:
    """Why a checkpoint saved in precision `saved` cannot be resumed as it is in `current` (None: the same, or a
    checkpoint that recorded none). convertible: DeepSpeed's universal checkpoint can carry it over (it holds the
    fp32 weights and optimizer states, which any precision's ZeRO optimizer loads)."""
    if saved is None or saved == current:
        return None
    offered = convertible and {saved, current} <= UNIVERSAL_PRECISIONS
    convert = "resume it with --universal-checkpoint, which converts it (docs/checkpoints.md), or " if offered else ""
    return (f"it was saved in {saved}, this run is {current} ({PRECISION_FLAGS[current]}); DeepSpeed names and "
            f"shapes a checkpoint's optimizer files by its precision: {convert}resume it in {saved} "
            f"({PRECISION_FLAGS[saved]}), or {NEW_FOLDER}, {FINETUNE}")
