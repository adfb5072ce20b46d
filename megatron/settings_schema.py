"""The launch scripts' training variables, each spelled once: its name, the kind of value it takes, its other name
(ALCF's), and the pretrain_gpt.py flags it gives, whose argparse destination is the field of megatron/arguments.py's
section that receives it (SEQ_LEN -> --seq-length -> GPTConfig.seq_length). megatron/launch/settings.py checks
the variables, merges the two names of a setting and names the variable behind each flag from this table;
megatron/launch/given_flags.py reads the layout flags given after a script back as their variables;
tests/test_settings_schema.py holds every flag and kind to the parser. docs/environment.md lists the variables.

No torch here: the launch planner imports it and must start fast.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

_NUMBER = r"([0-9]+[.]?[0-9]*|[.][0-9]+)([eE][-+]?[0-9]+)?"
# kind: (pattern, what the message says is expected); a kind not here is its choices, "a|b|c"
KINDS = {
    "int": (r"[1-9][0-9]*", "a positive integer"),
    "count": (r"[0-9]+", "an integer >= 0"),
    "number": (_NUMBER, "a number >= 0"),
    "fraction": (_NUMBER, "a number from 0 to 1"),
    "flag": (r"[01]", "0 or 1"),
    "port": (r"[1-9][0-9]{0,4}", "a TCP port, 1 to 65535"),
    "ints": (r"[1-9][0-9]*( [1-9][0-9]*)*", "a positive integer, or one per MoE layer separated by spaces"),
    "weights": (r"[0-9.]+(,[0-9.]+){0,2}", "up to three comma-separated weights, e.g. 969,30,1"),
}
# any text; words, each a value of the flag; a file (megatron/launch/settings.py looks for it)
UNCHECKED = ("text", "words", "file")
SEVERAL = ("ints", "words")  # kinds whose words are the flag's values (argparse's nargs="*")


@dataclass(frozen=True)
class Variable:
    """One launch variable. `flags`: the pretrain_gpt.py flags an error names it behind (PRECISION: --bf16 and
    --fp16); `always_named`: named behind them even when they are not passed (the shells the planner replaced
    named these; the later ones are named only when given)."""
    name: str
    kind: str
    flags: tuple[str, ...] = ()
    alias: str | None = None
    always_named: bool = True

    @property
    def dests(self) -> tuple[str, ...]:
        """The argparse destinations of `flags`: each the field of megatron/arguments.py's section (or GPTConfig's,
        ParallelLayout's) that _section fills from it."""
        return tuple(flag.lstrip("-").replace("-", "_") for flag in self.flags)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, self.alias) if self.alias else (self.name,)


def _given_only(name: str, kind: str, flag: str, alias: str | None = None) -> Variable:
    return Variable(name, kind, (flag,), alias, always_named=False)


# In the order the settings name them in ZERO_LAB_FLAG_SOURCES (--model-size's variable, MODEL_SIZE or INIT_HF, is
# the caller's, and comes first)
VARIABLES = (
    Variable("SEQ_LEN", "int", ("--seq-length",)),
    Variable("MICRO_BATCH", "int", ("--micro-batch-size",)),
    Variable("GLOBAL_BATCH", "int", ("--global-batch-size",)),
    Variable("TRAIN_ITERS", "int", ("--train-iters",)),
    Variable("TRAIN_EPOCHS", "number", ("--train-epochs",)),
    Variable("PRECISION", "fp32|bf16|fp16", ("--bf16", "--fp16"), alias="DTYPE"),
    Variable("TP", "int", ("--tensor-model-parallel-size",), alias="MPSIZE"),
    Variable("PP", "int", ("--pipeline-model-parallel-size",), alias="PPSIZE"),
    Variable("SP", "flag", ("--sequence-parallel",)),  # Megatron's sequence parallelism, over the TP group
    Variable("USE_ACTIVATION_CHECKPOINTING", "flag", ("--checkpoint-activations",)),
    Variable("DS_CONFIG", "file", ("--deepspeed_config",)),
    # from here to WANDB_PROJECT, and the MoE variables: the flag passes the value as it is, where set
    Variable("DATA_PATH", "words", ("--data-path",)),  # one prefix, or "weight prefix weight prefix ..."
    Variable("VOCAB_FILE", "text", ("--vocab-file",)),
    Variable("MERGE_FILE", "text", ("--merge-file",)),
    Variable("SPLIT", "weights", ("--split",), alias="DATA_SPLIT"),
    Variable("LR", "number", ("--lr",)),
    Variable("MIN_LR", "number", ("--min-lr",)),
    Variable("LR_DECAY_STYLE", "cosine|linear|constant", ("--lr-decay-style",)),
    Variable("LR_WARMUP_FRACTION", "fraction", ("--lr-warmup-fraction",), alias="LR_WARMUP_FRAC"),
    Variable("ADAM_BETA1", "fraction", ("--adam-beta1",)),
    Variable("ADAM_BETA2", "fraction", ("--adam-beta2",)),
    Variable("WEIGHT_DECAY", "number", ("--weight-decay",)),
    Variable("CLIP_GRAD", "number", ("--clip-grad",)),
    Variable("SEED", "count", ("--seed",)),
    Variable("DISTRIBUTED_TIMEOUT_MINUTES", "number", ("--distributed-timeout-minutes",)),
    Variable("LOG_INTERVAL", "int", ("--log-interval",)),
    Variable("EVAL_INTERVAL", "int", ("--eval-interval",)),
    Variable("EVAL_ITERS", "count", ("--eval-iters",)),
    Variable("SAVE_INTERVAL", "int", ("--save-interval",)),
    Variable("WANDB_PROJECT", "text", ("--wandb-project",)),
    _given_only("POSITION_EMBEDDING_TYPE", "learned|rotary", "--use-rotary-position-embeddings"),
    _given_only("SP_SIZE", "int", "--ds-sequence-parallel-size", alias="SPSIZE"),  # DeepSpeed-Ulysses
    _given_only("COMPILE", "flag", "--compile"),  # torch.compile (docs/gpu.md)
    _given_only("ASYNC_SAVE", "flag", "--async-save"),  # checkpoints written in the background (docs/checkpoints.md)
    # the mixture of experts (docs/moe.md): only set ones give flags
    _given_only("NUM_EXPERTS", "ints", "--num-experts"),
    _given_only("EP_SIZE", "int", "--moe-expert-parallel-size"),
    _given_only("TOPK", "int", "--topk"),
    _given_only("MOE_LOSS_COEFF", "number", "--moe-loss-coeff"),
    # read by the settings or the launch itself, no flag of their own
    Variable("GAS", "int"),  # micro-batches per step: GLOBAL_BATCH = MICRO_BATCH x GAS x data-parallel size
    Variable("DATA_DIR", "text"),  # where DATA_PATH, VOCAB_FILE and MERGE_FILE default to
    Variable("OMP_NUM_THREADS", "int"),
    Variable("MASTER_PORT", "port"),
    Variable("MAX_RESTARTS", "count"),
    Variable("FRESH", "flag"),
    Variable("DRY_RUN", "flag"),
)
BY_NAME = {variable.name: variable for variable in VARIABLES}
BY_FLAG = {flag: variable for variable in VARIABLES for flag in variable.flags}
PASSED = VARIABLES[VARIABLES.index(BY_NAME["DATA_PATH"]):VARIABLES.index(BY_NAME["WANDB_PROJECT"]) + 1]
MOE = tuple(BY_NAME[name] for name in ("NUM_EXPERTS", "EP_SIZE", "TOPK", "MOE_LOSS_COEFF"))
EXPERTS, EXPERT_PARALLEL = MOE[:2]
# the layout flags a user may give after a launch script (megatron/launch/given_flags.py), in the order it reads them
LAYOUT = tuple(BY_NAME[name] for name in ("TP", "PP", "SP_SIZE", "NUM_EXPERTS", "EP_SIZE", "SP"))


def problem(kind: str, name: str, value: str) -> str | None:
    """What is wrong with `value` given as the variable `name` of `kind` (a KINDS key, or choices "a|b|c"), in
    one line; None: nothing."""
    if kind in UNCHECKED:
        return None
    pattern, expected = KINDS.get(kind, (f"({kind})", f"one of {kind.replace('|', ', ')}"))
    ok = re.fullmatch(pattern, value) is not None
    if ok and kind == "fraction":
        ok = float(value) <= 1
    if ok and kind == "port":
        ok = int(value) <= 65535
    return None if ok else f"{name}={value}: expected {expected}"
