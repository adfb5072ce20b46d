"""Megatron-DeepSpeed's flags that zero-lab does not honour as ordinary flags (docs/megatron-flags.md).

Its example scripts pass 119 training flags. Most are ordinary flags of megatron/arguments.py's sections, honoured
with Megatron-DeepSpeed's meaning. The others are here, in two tables, so that none ends a run with argparse's
"unrecognized arguments":
- ACCEPTED: the flag only picks a path zero-lab chooses by itself (a CUDA kernel, a backend, a behaviour that is
  zero-lab's only one); the run goes on and prints one line at start-up saying what zero-lab does instead;
- REFUSED: zero-lab has no such feature; the run stops in one line naming the flag and what to use instead.
The recompute flags (--recompute-granularity, --recompute-method, --recompute-num-layers) are honoured where
they map onto zero-lab's per-layer activation checkpointing, and refused where they do not (`recompute_layers`).
`flags_table` writes the docs page's table from the parser and the scripts' flags, so that it cannot drift.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class UpstreamFlag:
    nargs: str | int  # as Megatron-DeepSpeed's parser takes it: 0 (a switch), None (one value), "+" (a list)
    line: str  # ACCEPTED: what zero-lab does instead; REFUSED: why not, and what to use instead
    choices: tuple[str, ...] | None = None


_SDPA = ("the attention runs torch's scaled_dot_product_attention, which picks the flash or memory-efficient "
         "kernel itself (docs/model.md)")
_FUSION = "zero-lab's layers run torch's own kernels; there is no fused kernel to turn off"

ACCEPTED = {
    "--use-flash-attn": UpstreamFlag(0, _SDPA),
    "--use-flash-attn-v2": UpstreamFlag(0, _SDPA),
    "--use-flash-attn-triton": UpstreamFlag(0, _SDPA),
    "--no-masked-softmax-fusion": UpstreamFlag(0, _SDPA),
    "--no-bias-gelu-fusion": UpstreamFlag(0, _FUSION),
    "--no-bias-dropout-fusion": UpstreamFlag(0, _FUSION),
    "--no-gradient-accumulation-fusion": UpstreamFlag(0, _FUSION),
    "--no-async-tensor-model-parallel-allreduce": UpstreamFlag(
        0, "the tensor-parallel all-reduce of the input gradient runs after the weight gradient (no overlap to "
           "turn off)"),
    "--distributed-backend": UpstreamFlag(
        None, "the backend follows the accelerator: nccl on CUDA ranks, gloo on CPU ranks",
        choices=("nccl", "gloo", "ccl", "hccl")),
    "--repeated-dataloader": UpstreamFlag(
        0, "the training data is built with as many epochs as the iterations need; it never runs out"),
}

_KD = ("Megatron-DeepSpeed's knowledge distillation (a teacher model beside the student, MoS) is not part of "
       "zero-lab: train the student alone, without the teacher flags")
# DeepSpeed 0.19.8's FPDT layer (deepspeed/sequence/fpdt_layer.py) calls flash-attn's CUDA kernels on CUDA streams:
# on CPU ranks it has no attention kernel at all (tests/test_upstream_flags.py), so it is refused everywhere
_FPDT = ("DeepSpeed's FPDT layer (chunked, offloaded Ulysses) runs its attention only through flash-attn's CUDA "
         "kernels, so it cannot run on CPU ranks and is not part of zero-lab: use --ds-sequence-parallel-size N with "
         "--tiled-mlp-compute, --tiled-logits-loss and --checkpoint-in-cpu (docs/long-sequences.md)")
_INDEX = ("zero-lab builds the dataset's index arrays itself and caches them next to the data: drop the flag "
          "(--data-cache-path picks another folder)")

REFUSED = {
    "--mos": UpstreamFlag(0, _KD),
    "--kd-beta-ce": UpstreamFlag(None, _KD),
    "--load-teacher": UpstreamFlag(None, _KD),
    "--num-layers-teacher": UpstreamFlag(None, _KD),
    "--hidden-size-teacher": UpstreamFlag(None, _KD),
    "--num-attention-heads-teacher": UpstreamFlag(None, _KD),
    "--num-experts-teacher": UpstreamFlag("+", _KD),
    "--ds-sequence-parallel-fpdt": UpstreamFlag(0, _FPDT),
    "--ds-sequence-parallel-fpdt-chunk-size": UpstreamFlag(None, _FPDT),
    "--ds-sequence-parallel-fpdt-offloading": UpstreamFlag(0, _FPDT),
    "--train-doc-idx-path": UpstreamFlag(None, _INDEX),
    "--train-sample-idx-path": UpstreamFlag(None, _INDEX),
    "--train-shuffle-idx-path": UpstreamFlag(None, _INDEX),
    "--random-ltd": UpstreamFlag(
        0, "DeepSpeed's random layerwise token dropping is not part of zero-lab: train without it"),
    "--data-efficiency-curriculum-learning": UpstreamFlag(
        0, "DeepSpeed's data-efficiency curriculum is not part of zero-lab: for a sequence-length curriculum use "
           "the JSON's curriculum_learning section, Megatron-DeepSpeed's legacy one (docs/curriculum.md)"),
}


def _dest(option: str) -> str:
    return "upstream_" + option.lstrip("-").replace("-", "_")


def add_upstream_flags(parser: argparse.ArgumentParser) -> None:
    """ACCEPTED's and REFUSED's flags, each taking its values as Megatron-DeepSpeed's parser does."""
    group = parser.add_argument_group("Megatron-DeepSpeed flags accepted with a line, or refused "
                                      "(docs/megatron-flags.md)")
    for option, spec in {**ACCEPTED, **REFUSED}.items():
        kind = "accepted: " if option in ACCEPTED else "refused: "
        if spec.nargs == 0:
            group.add_argument(option, dest=_dest(option), action="store_true", help=kind + spec.line)
        else:
            group.add_argument(option, dest=_dest(option), nargs=spec.nargs, choices=spec.choices, default=None,
                               help=kind + spec.line)


def _given(ns: argparse.Namespace, option: str) -> bool:
    value = getattr(ns, _dest(option))
    return value is not None and value is not False


def refused_message(ns: argparse.Namespace) -> str | None:
    """The one-line error for the first refused flag given; None when none is."""
    for option, spec in REFUSED.items():
        if _given(ns, option):
            return f"{option} is not supported: {spec.line}"
    return None


def accepted_lines(ns: argparse.Namespace) -> list[str]:
    """One start-up line for each accepted flag given: what zero-lab does instead."""
    return [f"note: {option} accepted: {spec.line}" for option, spec in ACCEPTED.items() if _given(ns, option)]


RECOMPUTE_NUM_LAYERS = 1  # Megatron's --recompute-num-layers default

SELECTIVE_LINE = ("note: --recompute-granularity selective accepted: the attention runs torch's "
                  "scaled_dot_product_attention, whose flash and memory-efficient kernels keep no attention scores "
                  "for the backward, which is what selective recompute saves; nothing else is recomputed")


def recompute_layers(granularity: str | None, method: str | None, num_layers: int,
                     layers_per_stage: int) -> tuple[bool, str | None, str | None]:
    """Megatron's --recompute-granularity/--recompute-method/--recompute-num-layers mapped onto zero-lab's
    activation checkpointing, which recomputes every layer of the stage, one layer at a time (GPTConfig.
    recompute_activations): (recompute, the one-line refusal of a combination it lacks or None, a start-up
    line or None). Megatron's meaning: full + uniform recomputes chunks of N layers, full + block the first N
    layers of each pipeline stage; selective recomputes the core attention alone."""
    method_flags = f"--recompute-method {method} --recompute-num-layers {num_layers}"
    if granularity is None:
        if method is not None:
            return False, (f"--recompute-method {method} recomputes nothing without --recompute-granularity full "
                           "(Megatron ignores it there): add --recompute-granularity full, or drop it"), None
        return False, None, None
    if granularity == "selective":
        if method is not None:
            return False, ("--recompute-method is for --recompute-granularity full only (Megatron refuses it with "
                           "selective): drop it"), None
        return False, None, SELECTIVE_LINE
    if method in (None, "uniform") and num_layers == 1:
        return True, None, None
    if method == "uniform":
        return False, (f"{method_flags}: zero-lab recomputes one layer at a time (it keeps each "
                       "layer's input, not each chunk's); use --recompute-num-layers 1"), None
    if num_layers == 0:
        return False, None, None
    if num_layers >= layers_per_stage:
        return True, None, None
    return False, (f"{method_flags}: zero-lab recomputes every layer of a pipeline stage or none; use "
                   f"--recompute-num-layers {layers_per_stage} (all {layers_per_stage} layers of a stage) or drop "
                   "the recompute flags"), None


# The docs page's table (docs/megatron-flags.md): every flag of the scripts, and every flag of the two tables
def flag_status(option: str, known: dict[str, argparse.Action]) -> tuple[str, str]:
    """(status, what zero-lab does) of one Megatron-DeepSpeed flag, from the parser's actions by option string."""
    if option in ACCEPTED:
        return "accepted with a line", ACCEPTED[option].line
    if option in REFUSED:
        return "refused", REFUSED[option].line
    if option not in known:
        return "unrecognized", "argparse stops the run"
    help_text = (known[option].help or "").replace("|", "\\|")
    if help_text == argparse.SUPPRESS:
        help_text = ""
    return "honoured", help_text or "Megatron-DeepSpeed's meaning"


def flags_table(parser: argparse.ArgumentParser, script_flags: list[tuple[str, int]]) -> str:
    """The markdown table: (flag, scripts passing it) of the fixture, then ACCEPTED's and REFUSED's flags the
    scripts do not pass."""
    known = {option: action for action in parser._actions for option in action.option_strings}
    rows = list(script_flags) + [(option, 0) for option in {**ACCEPTED, **REFUSED}
                                 if option not in dict(script_flags)]
    lines = ["| flag | scripts | in zero-lab | what zero-lab does |", "| --- | ---: | --- | --- |"]
    for option, scripts in rows:
        status, what = flag_status(option, known)
        lines.append(f"| `{option}` | {scripts} | {status} | {what} |")
    return "\n".join(lines) + "\n"
