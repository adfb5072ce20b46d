"""The training settings every launch path shares, from the environment: each variable checked once (one line
naming it, its value and what is expected), given one default by one rule, and turned into the pretrain_gpt.py
flags, with the variable behind each flag (so that an error about the flag names the variable:
megatron/flag_sources.py). docs/environment.md lists the variables.

Part of the launch planner (megatron/launch/plan.py): the drivers' and ALCF's paths both read it. It imports no
torch. tests/test_planner_settings.py holds it to the flags and errors the shell's own rules gave before the planner
(tests/fixtures/launch_settings.json).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from megatron.core.layout import ParallelLayout
from megatron.deepspeed_json import DeepSpeedJSONError, refuse_unused_sections
from megatron.errors import ZeroLabError
from megatron.flag_sources import name_sources
from megatron.layout_check import batch_split
from megatron.model.presets import MODEL_PRESETS
from megatron.training_defaults import GPT3_PRESET

REPO = Path(__file__).resolve().parents[2]

_NUMBER = r"([0-9]+[.]?[0-9]*|[.][0-9]+)([eE][-+]?[0-9]+)?"
# kind: (pattern, what the message says is expected)
KINDS = {
    "int": (r"[1-9][0-9]*", "a positive integer"),
    "count": (r"[0-9]+", "an integer >= 0"),
    "number": (_NUMBER, "a number >= 0"),
    "fraction": (_NUMBER, "a number from 0 to 1"),
    "flag": (r"[01]", "0 or 1"),
    "port": (r"[1-9][0-9]{0,4}", "a TCP port, 1 to 65535"),
}

# the launch scripts' defaults: the gpt3 preset (megatron/training_defaults.py), by the variable that sets each;
# pretrain_gpt.py run alone keeps Megatron's own
GPT3_LR = GPT3_PRESET.lr_by_model_size
DEFAULTS = GPT3_PRESET.environment()
# the DeepSpeed JSON keys that take the place of a variable (docs/bad-input.md)
JSON_KEYS = ("train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps", "gradient_clipping")


class LaunchError(ZeroLabError):
    """A setting the launch refuses; the message is one line naming the variable."""


def check(env: Mapping[str, str], kind: str, *names: str) -> None:
    """Each variable that is set (not empty) must be of `kind` (a KINDS key, or choices "a|b|c")."""
    pattern, expected = KINDS.get(kind, (f"({kind})", f"one of {kind.replace('|', ', ')}"))
    for name in names:
        value = env.get(name, "")
        if not value:
            continue
        ok = re.fullmatch(pattern, value) is not None
        if ok and kind == "fraction":
            ok = float(value) <= 1
        if ok and kind == "port":
            ok = int(value) <= 65535
        if not ok:
            raise LaunchError(f"{name}={value}: expected {expected}")


@dataclass(frozen=True)
class TrainingSettings:
    """What the launch paths read back: the flags, their sources and the values the launch itself uses."""
    flags: list[str]
    sources: dict[str, str]  # flag -> the variable it came from
    values: dict[str, str]  # every variable with its default applied (SEQ_LEN, MICRO_BATCH, GAS, GLOBAL_BATCH, ...)

    def sources_text(self) -> str:
        """ZERO_LAB_FLAG_SOURCES's form."""
        return " ".join(f"{flag}={variable}" for flag, variable in self.sources.items())


def read_ds_config(path: str) -> dict:
    """A user's DeepSpeed JSON (DS_CONFIG); one line where it is not a JSON object, with the line and column where
    the JSON breaks."""
    try:
        text = Path(path).read_text()
    except (OSError, ValueError):
        raise LaunchError(f"DS_CONFIG={path}: not a readable JSON object") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise LaunchError(f"DS_CONFIG={path}: not a readable JSON object (line {error.lineno}, column "
                          f"{error.colno}: {error.msg})") from None
    if not isinstance(config, dict):
        raise LaunchError(f"DS_CONFIG={path}: not a readable JSON object")
    return config


def json_zero_stage(path: str):
    """The ZeRO stage a user's DeepSpeed JSON asks for (zero_optimization.stage), None when it names none."""
    section = read_ds_config(path).get("zero_optimization")
    return section.get("stage") if isinstance(section, dict) else None


def _json_keys(path: str) -> set[str]:
    """Which of JSON_KEYS (and bf16.enabled, fp16.enabled) a user's DeepSpeed JSON gives; one line where it
    would lose a section to the flags or is not a JSON object."""
    config = read_ds_config(path)
    try:
        refuse_unused_sections(config, path)
    except DeepSpeedJSONError as error:
        raise LaunchError(f"DS_CONFIG={path}: {str(error).split(': ', 1)[1]}") from None
    keys = {key for key in JSON_KEYS if key in config}
    for precision in ("bf16", "fp16"):
        section = config.get(precision) or {}
        if not isinstance(section, dict):
            raise LaunchError(f"DS_CONFIG={path}: not a readable JSON object")
        if section.get("enabled") is True:
            keys.add(f"{precision}.enabled")
    return keys


def _checked(env: Mapping[str, str]) -> None:
    """Step 1: each variable as the user gave it, before any default or arithmetic reads it."""
    check(env, "int", "SEQ_LEN", "MICRO_BATCH", "GLOBAL_BATCH", "GAS", "TP", "PP", "MPSIZE", "PPSIZE", "SP_SIZE",
          "SPSIZE", "TRAIN_ITERS", "LOG_INTERVAL", "EVAL_INTERVAL", "SAVE_INTERVAL", "OMP_NUM_THREADS")
    check(env, "port", "MASTER_PORT")
    check(env, "count", "EVAL_ITERS", "SEED", "MAX_RESTARTS")
    check(env, "number", "LR", "MIN_LR", "WEIGHT_DECAY", "CLIP_GRAD", "TRAIN_EPOCHS", "DISTRIBUTED_TIMEOUT_MINUTES")
    check(env, "fraction", "LR_WARMUP_FRACTION", "LR_WARMUP_FRAC", "ADAM_BETA1", "ADAM_BETA2")
    check(env, "flag", "SP", "USE_ACTIVATION_CHECKPOINTING", "FRESH", "DRY_RUN", "COMPILE", "ASYNC_SAVE")
    check(env, "fp32|bf16|fp16", "PRECISION", "DTYPE")
    check(env, "cosine|linear|constant", "LR_DECAY_STYLE")
    check(env, "learned|rotary", "POSITION_EMBEDDING_TYPE")
    check(env, "int", "EP_SIZE", "TOPK")
    check(env, "number", "MOE_LOSS_COEFF")
    if env.get("NUM_EXPERTS") and not re.fullmatch(r"[1-9][0-9]*( [1-9][0-9]*)*", env["NUM_EXPERTS"]):
        raise LaunchError(f"NUM_EXPERTS={env['NUM_EXPERTS']}: expected a positive integer, or one per MoE layer "
                          "separated by spaces")
    if env.get("DS_CONFIG") and not Path(env["DS_CONFIG"]).is_file():
        raise LaunchError(f"DS_CONFIG={env['DS_CONFIG']}: no such file (expected a DeepSpeed JSON)")
    for name in ("SPLIT", "DATA_SPLIT"):
        if env.get(name) and not re.fullmatch(r"[0-9.]+(,[0-9.]+){0,2}", env[name]):
            raise LaunchError(f"{name}={env[name]}: expected up to three comma-separated weights, e.g. 969,30,1")


def _aliased(env: Mapping[str, str], alcf_names: bool) -> tuple[dict[str, str], dict[str, str]]:
    """Step 2: Megatron's and ALCF's names for one setting; both given must agree. Returns the variables with
    each pair merged under the first name, and for each pair the name a message about it uses: the one given,
    else the path's own (ALCF's, the second, with alcf_names)."""
    values = {name: value for name, value in env.items() if value}
    names = {}
    for name, other in (("TP", "MPSIZE"), ("PP", "PPSIZE"), ("PRECISION", "DTYPE"), ("SPLIT", "DATA_SPLIT"),
                        ("LR_WARMUP_FRACTION", "LR_WARMUP_FRAC"), ("SP_SIZE", "SPSIZE")):
        names[name] = name if name in values else other if other in values or alcf_names else name
    for name, other in (("TP", "MPSIZE"), ("PP", "PPSIZE"), ("PRECISION", "DTYPE"), ("SPLIT", "DATA_SPLIT"),
                        ("LR_WARMUP_FRACTION", "LR_WARMUP_FRAC"), ("SP_SIZE", "SPSIZE")):
        if name in values and other in values and values[name] != values[other]:
            raise LaunchError(f"{name}={values[name]} and {other}={values[other]} name the same setting: set one of them")
        if name not in values and other in values:
            values[name] = values[other]
    return values, names


def _batch_flags(v: dict[str, str], json_keys: set[str], world: int, names: dict[str, str],
                 micro_default: str) -> list[str]:
    """MICRO_BATCH per rank, GAS micro-batches per step, global = MICRO_BATCH x GAS x data-parallel size
    (Megatron's rule); a user's DeepSpeed JSON gives what no variable sets (docs/bad-input.md)."""
    ds_config = v.get("DS_CONFIG", "")
    if "GAS" in v and "MICRO_BATCH" not in v and "train_micro_batch_size_per_gpu" in json_keys:
        raise LaunchError(f"GAS={v['GAS']}: DS_CONFIG={ds_config} gives the micro batch, so set "
                          "gradient_accumulation_steps there (or MICRO_BATCH here too)")
    flags = []
    if "MICRO_BATCH" in v or "train_micro_batch_size_per_gpu" not in json_keys:
        v.setdefault("MICRO_BATCH", micro_default)
        flags += ["--micro-batch-size", v["MICRO_BATCH"]]
    json_batch = json_keys & {"train_batch_size", "gradient_accumulation_steps", "train_micro_batch_size_per_gpu"}
    if "GLOBAL_BATCH" not in v and "GAS" not in v and json_batch:
        return flags
    v.setdefault("GAS", "1")
    if "MICRO_BATCH" not in v:  # GLOBAL_BATCH with the JSON's micro batch: pretrain_gpt.py checks the two
        return flags + ["--global-batch-size", v["GLOBAL_BATCH"]]
    micro, given_global = int(v["MICRO_BATCH"]), v.get("GLOBAL_BATCH")
    argv = ["--world-size", str(world), "--tensor-model-parallel-size", v["TP"], "--pipeline-model-parallel-size",
            v["PP"], "--ds-sequence-parallel-size", v.get("SP_SIZE", "1"), "--micro-batch-size", v["MICRO_BATCH"],
            *(["--global-batch-size", given_global] if given_global else [])]
    sources = {"ZERO_LAB_FLAG_SOURCES": f"--micro-batch-size=MICRO_BATCH --global-batch-size=GLOBAL_BATCH "
                                        f"--tensor-model-parallel-size={names['TP']} "
                                        f"--pipeline-model-parallel-size={names['PP']} "
                                        f"--ds-sequence-parallel-size={names['SP_SIZE']}"}
    try:
        layout = ParallelLayout(world, int(v["TP"]), int(v["PP"]), int(v.get("SP_SIZE", "1")))
        global_batch, accumulation = batch_split(layout, micro, int(given_global) if given_global else None)
    except ZeroLabError as error:
        raise LaunchError(name_sources(str(error), argv, sources)) from None
    v["DPSIZE"] = str(layout.data_parallel_size)
    if given_global:
        if v["GAS"] != "1" and v["GAS"] != str(accumulation):
            dp, gas = layout.data_parallel_size, int(v["GAS"])
            raise LaunchError(f"GLOBAL_BATCH={given_global} and GAS={v['GAS']} disagree: MICRO_BATCH {micro} x "
                              f"data-parallel size {dp} x GAS {gas} is {micro * dp * gas}: set one of them")
        v["GAS"] = str(accumulation)
    else:
        v["GLOBAL_BATCH"] = str(global_batch * int(v["GAS"]))
    return flags + ["--global-batch-size", v["GLOBAL_BATCH"]]


def training_settings(env: Mapping[str, str], *, accelerator: str, world: int, model_size: str | None,
                      model_variable: str = "MODEL_SIZE", alcf_names: bool = False,
                      sp_variable: str = "SP", micro_batch: str | None = None) -> TrainingSettings:
    """The shared rules: `env` is the environment (empty values count as unset), `accelerator`
    cuda or cpu (the defaults follow it), `world` every rank of the job, `model_size` the preset (None: the
    caller's flags give the shape, INIT_HF's) and `model_variable` the variable it came from. `micro_batch`: the
    micro-batch where MICRO_BATCH is unset (the drivers' memory plan on a GPU); None: the accelerator's default."""
    _checked(env)
    v, names = _aliased(env, alcf_names)
    v.setdefault("TP", "1")
    v.setdefault("PP", "1")
    v.setdefault("SP", "0")
    precision_set = "PRECISION" in v  # with DS_CONFIG, an unset PRECISION leaves the precision to the JSON
    if accelerator == "cuda":
        v.setdefault("SEQ_LEN", "1024")
        v.setdefault("PRECISION", "bf16")
        micro_default = "8"
    else:
        v.setdefault("SEQ_LEN", "128")
        v.setdefault("PRECISION", "fp32")
        micro_default = "4"
        if v["PRECISION"] == "fp16":
            raise LaunchError("PRECISION=fp16: DeepSpeed's CPU accelerator has no fp16; expected fp32 or bf16 "
                              "without a GPU")
    if "TRAIN_ITERS" in v and "TRAIN_EPOCHS" in v:
        raise LaunchError(f"TRAIN_ITERS={v['TRAIN_ITERS']} and TRAIN_EPOCHS={v['TRAIN_EPOCHS']} both set the run's "
                          "length: set one of them")
    if "TRAIN_ITERS" not in v and "TRAIN_EPOCHS" not in v:  # one pass over dolly on GPUs, 60 iterations on CPU ranks
        v["TRAIN_EPOCHS" if accelerator == "cuda" else "TRAIN_ITERS"] = "1" if accelerator == "cuda" else "60"
    for name in ("USE_ACTIVATION_CHECKPOINTING", "LOG_INTERVAL", "EVAL_INTERVAL", "EVAL_ITERS", "SAVE_INTERVAL"):
        v.setdefault(name, DEFAULTS[name])

    ds_config = v.get("DS_CONFIG", "")
    json_keys = _json_keys(ds_config) if ds_config else set()
    if precision_set and v["PRECISION"] == "fp32":  # fp32 has no flag: a JSON's bf16 or fp16 would win silently
        for key in ("bf16.enabled", "fp16.enabled"):
            if key in json_keys:
                raise LaunchError(f"{names['PRECISION']}=fp32 disagrees with {key} true in DS_CONFIG={ds_config}: "
                                  "drop one of them or make them agree")
    batch_flags = _batch_flags(v, json_keys, world, names, micro_batch or micro_default)
    _experts_checked(v, model_size, world)

    size_lr = GPT3_LR.get(model_size, GPT3_LR["125M"])
    v.setdefault("LR", size_lr)
    v.setdefault("MIN_LR", f"{float(size_lr) / 10:.2e}")
    data_dir = v.setdefault("DATA_DIR", str(REPO / "data"))
    v.setdefault("DATA_PATH", f"{data_dir}/dolly_text_document")  # one prefix, or "weight prefix weight prefix ..."
    v.setdefault("VOCAB_FILE", f"{data_dir}/gpt2-vocab.json")
    v.setdefault("MERGE_FILE", f"{data_dir}/gpt2-merges.txt")
    for name in ("SPLIT", "LR_DECAY_STYLE", "LR_WARMUP_FRACTION", "ADAM_BETA1", "ADAM_BETA2", "WEIGHT_DECAY", "SEED",
                 "DISTRIBUTED_TIMEOUT_MINUTES"):
        v.setdefault(name, DEFAULTS[name])
    clip_flags = []
    if "CLIP_GRAD" in v or "gradient_clipping" not in json_keys:
        clip_flags = ["--clip-grad", v.setdefault("CLIP_GRAD", DEFAULTS["CLIP_GRAD"])]

    length = ["--train-iters", v["TRAIN_ITERS"]] if "TRAIN_ITERS" in v else ["--train-epochs", v["TRAIN_EPOCHS"]]
    precision = [] if v["PRECISION"] == "fp32" or (ds_config and not precision_set) else [f"--{v['PRECISION']}"]
    parallel = ["--tensor-model-parallel-size", v["TP"], "--pipeline-model-parallel-size", v["PP"]]
    parallel += ["--no-pipeline-parallel"] if int(v["PP"]) == 1 else []
    parallel += ["--sequence-parallel"] if v["SP"] == "1" else []
    parallel += ["--checkpoint-activations"] if v["USE_ACTIVATION_CHECKPOINTING"] == "1" else []
    parallel += ["--compile"] if v.get("COMPILE") == "1" else []  # torch.compile (docs/gpu.md)
    parallel += ["--async-save"] if v.get("ASYNC_SAVE") == "1" else []  # docs/checkpoints.md
    parallel += ["--deepspeed_config", ds_config] if ds_config else []
    positions = ["--use-rotary-position-embeddings"] if v.get("POSITION_EMBEDDING_TYPE") == "rotary" else []
    # DeepSpeed-Ulysses (docs/long-sequences.md); SP is Megatron's --sequence-parallel
    ulysses = ["--ds-sequence-parallel-size", v["SP_SIZE"]] if v.get("SP_SIZE", "1") != "1" else []
    wandb = ["--wandb-project", v["WANDB_PROJECT"]] if v.get("WANDB_PROJECT") else []
    moe = _moe_flags(v)
    preset = ["--model-size", model_size] if model_size else []
    flags = [*preset, "--seq-length", v["SEQ_LEN"], "--max-position-embeddings", v["SEQ_LEN"],
             *positions, *batch_flags, *length, *precision, *parallel, *ulysses, *moe,
             "--data-path", *v["DATA_PATH"].split(), "--vocab-file", v["VOCAB_FILE"], "--merge-file", v["MERGE_FILE"],
             "--split", v["SPLIT"], "--lr", v["LR"], "--min-lr", v["MIN_LR"], "--lr-decay-style", v["LR_DECAY_STYLE"],
             "--lr-warmup-fraction", v["LR_WARMUP_FRACTION"], "--adam-beta1", v["ADAM_BETA1"],
             "--adam-beta2", v["ADAM_BETA2"], "--weight-decay", v["WEIGHT_DECAY"], *clip_flags,
             "--seed", v["SEED"], "--distributed-timeout-minutes", v["DISTRIBUTED_TIMEOUT_MINUTES"],
             "--log-interval", v["LOG_INTERVAL"], "--eval-interval", v["EVAL_INTERVAL"],
             "--eval-iters", v["EVAL_ITERS"], "--save-interval", v["SAVE_INTERVAL"], *wandb]
    sources = {"--model-size": model_variable, "--seq-length": "SEQ_LEN", "--micro-batch-size": "MICRO_BATCH",
               "--global-batch-size": "GLOBAL_BATCH", "--train-iters": "TRAIN_ITERS", "--train-epochs": "TRAIN_EPOCHS",
               "--bf16": names["PRECISION"], "--fp16": names["PRECISION"],
               "--tensor-model-parallel-size": names["TP"], "--pipeline-model-parallel-size": names["PP"],
               "--sequence-parallel": sp_variable, "--checkpoint-activations": "USE_ACTIVATION_CHECKPOINTING",
               "--deepspeed_config": "DS_CONFIG", "--data-path": "DATA_PATH", "--vocab-file": "VOCAB_FILE",
               "--merge-file": "MERGE_FILE", "--split": names["SPLIT"], "--lr": "LR", "--min-lr": "MIN_LR",
               "--lr-decay-style": "LR_DECAY_STYLE", "--lr-warmup-fraction": names["LR_WARMUP_FRACTION"],
               "--adam-beta1": "ADAM_BETA1", "--adam-beta2": "ADAM_BETA2", "--weight-decay": "WEIGHT_DECAY",
               "--clip-grad": "CLIP_GRAD", "--seed": "SEED",
               "--distributed-timeout-minutes": "DISTRIBUTED_TIMEOUT_MINUTES", "--log-interval": "LOG_INTERVAL",
               "--eval-interval": "EVAL_INTERVAL", "--eval-iters": "EVAL_ITERS", "--save-interval": "SAVE_INTERVAL",
               "--wandb-project": "WANDB_PROJECT"}
    if positions:  # named only when given: the recorded shells (tests/fixtures/launch_settings.json) had no such flag
        sources["--use-rotary-position-embeddings"] = "POSITION_EMBEDDING_TYPE"
    if ulysses:  # the same
        sources["--ds-sequence-parallel-size"] = names["SP_SIZE"]
    if v.get("COMPILE") == "1":  # the same
        sources["--compile"] = "COMPILE"
    if v.get("ASYNC_SAVE") == "1":  # the same
        sources["--async-save"] = "ASYNC_SAVE"
    sources |= {flag: variable for flag, variable in MOE_VARIABLES.items() if flag in moe}
    return TrainingSettings(flags=flags, sources=sources, values=v)


# the mixture-of-experts variables (docs/moe.md), by the flag each gives; only set ones give flags
MOE_VARIABLES = {"--num-experts": "NUM_EXPERTS", "--moe-expert-parallel-size": "EP_SIZE", "--topk": "TOPK",
                 "--moe-loss-coeff": "MOE_LOSS_COEFF"}


def _experts_checked(v: dict[str, str], model_size: str | None, world: int) -> None:
    """EP_SIZE > 1 refused before any rank starts where the run would ignore it (no experts: it would train dense)
    or where DeepSpeed's MoE layer (each layer's experts split evenly over EP_SIZE ranks) or the expert groups
    (EP_SIZE data-parallel ranks each) would refuse it once the ranks had started."""
    ep = int(v.get("EP_SIZE", "1"))
    if ep == 1:
        return
    preset = MODEL_PRESETS.get(model_size or "", {}).get("num_experts", 1)
    experts = v.get("NUM_EXPERTS", str(preset))
    given = f"NUM_EXPERTS={experts}" if "NUM_EXPERTS" in v else f"the {model_size} preset's {experts} experts"
    unset = "NUM_EXPERTS" not in v
    moe_layers = [int(n) for n in experts.split() if int(n) > 1]
    if not moe_layers:
        raise LaunchError(f"EP_SIZE={ep}: the model has no experts to spread ({'NUM_EXPERTS unset' if unset else given}), so the run would train dense; "
                          "set NUM_EXPERTS too (e.g. NUM_EXPERTS=4 EP_SIZE=2, docs/moe.md), or leave EP_SIZE unset")
    for count in moe_layers:
        if count % ep:
            raise LaunchError(f"{given} and EP_SIZE={ep}: each MoE layer's experts are split evenly over EP_SIZE "
                              f"ranks, and {ep} does not divide {count}; use a multiple of {ep} experts, or an EP_SIZE "
                              f"that divides {count}")
    split = int(v["TP"]) * int(v["PP"]) * int(v.get("SP_SIZE", "1"))
    data_parallel = world // split
    if world % split == 0 and data_parallel % ep:
        raise LaunchError(f"EP_SIZE={ep} does not divide the data-parallel size {data_parallel}: the experts are "
                          "spread over groups of EP_SIZE data-parallel ranks; use an EP_SIZE that divides it")


def model_tags(s: dict[str, str], model_size: str | None) -> str:
    """What the settings `s` change in the preset's model beyond its name, for a default run name
    (e.g. "_moe4_ep2_rotary"): the experts (NUM_EXPERTS), their spread (EP_SIZE) and positions other than the
    preset's, so that such a run does not resume the preset's own run folder (issue 56)."""
    experts = s.get("NUM_EXPERTS", "1").split()
    tags = "_moe" + "-".join(experts) if any(count != "1" for count in experts) else ""
    tags += f"_ep{s['EP_SIZE']}" if s.get("EP_SIZE", "1") != "1" else ""
    rotary = MODEL_PRESETS.get(model_size or "", {}).get("use_rotary_position_embeddings", False)
    positions = s.get("POSITION_EMBEDDING_TYPE")
    if positions and positions != ("rotary" if rotary else "learned"):
        tags += f"_{positions}"
    return tags


def _moe_flags(v: dict[str, str]) -> list[str]:
    flags = []
    for flag, variable in MOE_VARIABLES.items():
        if variable in v:
            flags += [flag, *v[variable].split()]
    return flags


# The variables the settings read, and give back with their defaults applied (TrainingSettings.values)
VARIABLES = ("SEQ_LEN", "MICRO_BATCH", "GLOBAL_BATCH", "GAS", "DPSIZE", "TP", "PP", "MPSIZE", "PPSIZE", "SP",
             "PRECISION", "DTYPE", "TRAIN_ITERS", "TRAIN_EPOCHS", "USE_ACTIVATION_CHECKPOINTING", "LOG_INTERVAL",
             "EVAL_INTERVAL", "EVAL_ITERS", "SAVE_INTERVAL", "DS_CONFIG", "LR", "MIN_LR", "DATA_DIR", "DATA_PATH",
             "VOCAB_FILE", "MERGE_FILE", "SPLIT", "DATA_SPLIT", "LR_DECAY_STYLE", "LR_WARMUP_FRACTION",
             "LR_WARMUP_FRAC", "ADAM_BETA1", "ADAM_BETA2", "WEIGHT_DECAY", "SEED", "DISTRIBUTED_TIMEOUT_MINUTES",
             "CLIP_GRAD", "WANDB_PROJECT", "POSITION_EMBEDDING_TYPE", "SP_SIZE", "SPSIZE", "NUM_EXPERTS", "EP_SIZE",
             "TOPK", "MOE_LOSS_COEFF", "COMPILE", "ASYNC_SAVE")
# every variable the settings read from the caller: docs/environment.md lists each (tests/test_environment_table.py)
READ = tuple(name for name in VARIABLES if name != "DPSIZE") + ("OMP_NUM_THREADS", "MASTER_PORT", "MAX_RESTARTS",
                                                                 "FRESH", "DRY_RUN")
