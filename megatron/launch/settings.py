"""The training settings every launch path shares, from the environment: each variable checked once (one line
naming it, its value and what is expected), given one default by one rule, and turned into the pretrain_gpt.py
flags, with the variable behind each flag (so that an error about the flag names the variable:
megatron/flag_sources.py). Each variable's kind, other name and flags are megatron/settings_schema.py's;
docs/environment.md lists the variables.

Part of the launch planner (megatron/launch/plan.py): the drivers' and ALCF's paths both read it. It imports no
torch. tests/test_planner_settings.py holds it to the flags and errors the shell's own rules gave before the planner
(tests/fixtures/launch_settings.json).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from megatron.core.layout import ParallelLayout
from megatron.deepspeed_json import DeepSpeedJSONError, refuse_unused_sections
from megatron.errors import ZeroLabError
from megatron.flag_sources import ENV, name_sources
from megatron.layout_check import batch_split, expert_parallel_problems
from megatron.model.presets import MODEL_PRESETS, preset_experts
from megatron.settings_schema import BY_FLAG, EXPERT_PARALLEL, EXPERTS, MOE, PASSED, SEVERAL, VARIABLES, problem
from megatron.training_defaults import GPT3_PRESET

REPO = Path(__file__).resolve().parents[2]

# the launch scripts' defaults: the gpt3 preset (megatron/training_defaults.py), by the variable that sets each;
# pretrain_gpt.py run alone keeps Megatron's own
GPT3_LR = GPT3_PRESET.lr_by_model_size
DEFAULTS = GPT3_PRESET.environment()
# the DeepSpeed JSON keys that take the place of a variable (docs/bad-input.md)
JSON_KEYS = ("train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps", "gradient_clipping")


class LaunchError(ZeroLabError):
    """A setting the launch refuses; the message is one line naming the variable."""


def check(env: Mapping[str, str], kind: str, *names: str) -> None:
    """Each variable that is set (not empty) must be of `kind` (a settings_schema.KINDS key, or choices "a|b|c")."""
    for name in names:
        message = problem(kind, name, env[name]) if env.get(name) else None
        if message:
            raise LaunchError(message)


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
    for variable in VARIABLES:
        check(env, variable.kind, *variable.names)
    if env.get("DS_CONFIG") and not Path(env["DS_CONFIG"]).is_file():
        raise LaunchError(f"DS_CONFIG={env['DS_CONFIG']}: no such file (expected a DeepSpeed JSON)")


def _aliased(env: Mapping[str, str], alcf_names: bool) -> tuple[dict[str, str], dict[str, str]]:
    """Step 2: Megatron's and ALCF's names for one setting; both given must agree. Returns the variables with
    each pair merged under the first name, and for each pair the name a message about it uses: the one given,
    else the path's own (ALCF's, the second, with alcf_names)."""
    values = {name: value for name, value in env.items() if value}
    pairs = [(variable.name, variable.alias) for variable in VARIABLES if variable.alias]
    names = {name: name if name in values else other if other in values or alcf_names else name
             for name, other in pairs}
    for name, other in pairs:
        if name in values and other in values and values[name] != values[other]:
            raise LaunchError(f"{name}={values[name]} and {other}={values[other]} name the same setting: set one of them")
        if name not in values and other in values:
            values[name] = values[other]
    return values, names


def _named(message: str, argv: list[str], names: dict[str, str]) -> str:
    """One of the trainer's messages about the flags `argv` gives, with the variable behind each flag named (the
    name the user gave, of a setting's two: `names`)."""
    sources = " ".join(f"{word}={names.get(BY_FLAG[word].name, BY_FLAG[word].name)}" for word in argv
                       if word in BY_FLAG)
    return name_sources(message, argv, {ENV: sources})


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
    try:  # the trainer's own checks (megatron/arguments.py), its words with the variables named
        layout = ParallelLayout(world, int(v["TP"]), int(v["PP"]), int(v.get("SP_SIZE", "1")))
        global_batch, accumulation = batch_split(layout, micro, int(given_global) if given_global else None)
    except ZeroLabError as error:
        raise LaunchError(_named(str(error), argv, names)) from None
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
    for name, value in DEFAULTS.items():  # CLIP_GRAD's below: a DeepSpeed JSON may give it
        if name != "CLIP_GRAD":
            v.setdefault(name, value)

    ds_config = v.get("DS_CONFIG", "")
    json_keys = _json_keys(ds_config) if ds_config else set()
    if precision_set and v["PRECISION"] == "fp32":  # fp32 has no flag: a JSON's bf16 or fp16 would win silently
        for key in ("bf16.enabled", "fp16.enabled"):
            if key in json_keys:
                raise LaunchError(f"{names['PRECISION']}=fp32 disagrees with {key} true in DS_CONFIG={ds_config}: "
                                  "drop one of them or make them agree")
    batch_flags = _batch_flags(v, json_keys, world, names, micro_batch or micro_default)
    _experts_checked(v, model_size, world, names)

    size_lr = GPT3_LR.get(model_size, GPT3_LR["125M"])
    v.setdefault("LR", size_lr)
    v.setdefault("MIN_LR", f"{float(size_lr) / 10:.2e}")
    data_dir = v.setdefault("DATA_DIR", str(REPO / "data"))
    v.setdefault("DATA_PATH", f"{data_dir}/dolly_text_document")  # one prefix, or "weight prefix weight prefix ..."
    v.setdefault("VOCAB_FILE", f"{data_dir}/gpt2-vocab.json")
    v.setdefault("MERGE_FILE", f"{data_dir}/gpt2-merges.txt")
    if "gradient_clipping" not in json_keys:  # else the JSON's, unless CLIP_GRAD is set
        v.setdefault("CLIP_GRAD", DEFAULTS["CLIP_GRAD"])

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
    preset = ["--model-size", model_size] if model_size else []
    flags = [*preset, "--seq-length", v["SEQ_LEN"], "--max-position-embeddings", v["SEQ_LEN"],
             *positions, *batch_flags, *length, *precision, *parallel, *ulysses, *_passed(v, MOE), *_passed(v, PASSED)]
    return TrainingSettings(flags=flags, sources=_sources(flags, names, model_variable, sp_variable), values=v)


def _sources(flags: list[str], names: dict[str, str], model_variable: str, sp_variable: str) -> dict[str, str]:
    """Each flag by the variable behind it, as the user named it: the recorded shells' list whatever was passed
    (tests/fixtures/launch_settings.json), the later variables' flags where passed."""
    sources = {"--model-size": model_variable}
    for variable in VARIABLES:
        sources |= {flag: names.get(variable.name, variable.name) for flag in variable.flags
                    if variable.always_named or flag in flags}
    return sources | {"--sequence-parallel": sp_variable}


def _experts_checked(v: dict[str, str], model_size: str | None, world: int, names: dict[str, str]) -> None:
    """EP_SIZE > 1 refused before any rank starts where the run would ignore it (no experts: it would train dense)
    or where the run would refuse it once the ranks had started (megatron/layout_check.py's
    expert_parallel_problems, in the trainer's words with the variables named)."""
    ep = int(v.get(EXPERT_PARALLEL.name, "1"))
    if ep == 1:
        return
    experts, unset = v.get(EXPERTS.name, preset_experts(model_size)), EXPERTS.name not in v
    moe_layers = [int(n) for n in experts.split() if int(n) > 1]
    if not moe_layers:
        given = f"{EXPERTS.name} unset" if unset else f"{EXPERTS.name}={experts}"
        raise LaunchError(f"EP_SIZE={ep}: the model has no experts to spread ({given}), so the run would train dense; "
                          f"set {EXPERTS.name} too (e.g. {EXPERTS.name}=4 EP_SIZE=2, docs/moe.md), or leave EP_SIZE "
                          "unset")
    split = int(v["TP"]) * int(v["PP"]) * int(v.get("SP_SIZE", "1"))
    problems = expert_parallel_problems(moe_layers, ep, world // split if world % split == 0 else None)
    if problems:
        argv = [*EXPERT_PARALLEL.flags, str(ep), *([*EXPERTS.flags, *experts.split()] if not unset else [])]
        raise LaunchError(_named(problems[0], argv, names))


def model_tags(s: dict[str, str], model_size: str | None) -> str:
    """What the settings `s` change in the preset's model beyond its name, for a default run name
    (e.g. "_moe4_ep2_rotary"): the experts per MoE layer, their spread (EP_SIZE) and positions other than the
    preset's, so that such a run does not resume the preset's own run folder (issue 56)."""
    experts = s.get(EXPERTS.name, "1").split()
    tags = "_moe" + "-".join(experts) if any(count != "1" for count in experts) else ""
    tags += f"_ep{s['EP_SIZE']}" if s.get("EP_SIZE", "1") != "1" else ""
    rotary = MODEL_PRESETS.get(model_size or "", {}).get("use_rotary_position_embeddings", False)
    positions = s.get("POSITION_EMBEDDING_TYPE")
    if positions and positions != ("rotary" if rotary else "learned"):
        tags += f"_{positions}"
    return tags


def _passed(v: dict[str, str], variables) -> list[str]:
    """The flag of each of `variables` that is set, with its value as it is (a value of several words, its words)."""
    flags = []
    for variable in variables:
        if variable.name in v:
            [flag] = variable.flags
            flags += [flag, *(v[variable.name].split() if variable.kind in SEVERAL else [v[variable.name]])]
    return flags


# every variable the settings read from the caller (megatron/settings_schema.py's): docs/environment.md lists each
# (tests/test_environment_table.py); TrainingSettings.values gives them back with DPSIZE, the data-parallel size
READ = tuple(name for variable in VARIABLES for name in variable.names)
