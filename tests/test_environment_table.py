"""docs/environment.md lists every environment variable the launch scripts and the launch planner read, and nothing
else: the table cannot drift from them. A variable a script reads from its caller appears with a default or a test
(`${NAME:-...}`, `${NAME:+...}`, `${NAME-...}`, `${NAME+...}`); the planner (megatron/launch/) reads the environment
as `v`/`env` (`v.get("NAME")`, `v["NAME"]`, `"NAME" in v`, `setdefault`), and its settings list theirs in READ."""
import re

from conftest import REPO_ROOT, launch_script
from megatron.launch import settings
from megatron.training_defaults import GPT3_PRESET
from conftest import test_env as subprocess_env  # aliased: pytest would collect test_env as a test

SCRIPTS = [*sorted((REPO_ROOT / "examples_zero").glob("*.sh")), REPO_ROOT / "examples_zero" / "slurm" / "train.sbatch",
           *sorted((REPO_ROOT / "ALCF").glob("*.sh")), REPO_ROOT / "scripts" / "plan.sh",
           REPO_ROOT / "scripts" / "find_python.sh"]
PLANNER = [REPO_ROOT / "megatron" / "launch" / f"{name}.py" for name in ("plan", "drivers", "alcf", "slurm")]
READ_FROM_CALLER = re.compile(r"\$\{!?([A-Z][A-Z0-9_]*):?[-+]")
ANY_REFERENCE = re.compile(r"\$\{?!?([A-Z][A-Z0-9_]*)")
PLANNER_READS = re.compile(r"""\b(?:v|env)\.(?:get|setdefault)\(["']([A-Z][A-Z0-9_]*)["']"""
                           r"""|\b(?:v|env)\[["']([A-Z][A-Z0-9_]*)["']\]|"([A-Z][A-Z0-9_]*)" (?:not )?in (?:v|env)\b""")
CHECKED = re.compile(r'\bcheck\(v, "[^"]*", ([^)]*)\)')  # settings.check(env, kind, NAME, ...) reads each NAME


def table_variables() -> set[str]:
    """Every `NAME` in the first cell of a table row of docs/environment.md."""
    names = set()
    for line in (REPO_ROOT / "docs" / "environment.md").read_text().splitlines():
        if line.startswith("| `"):
            names.update(re.findall(r"`([A-Z][A-Z0-9_]*)`", line.split("|")[1]))
    return names


def planner_read() -> set[str]:
    """What the planner's paths read from the environment."""
    text = "\n".join(path.read_text() for path in PLANNER)
    # PATH: where the tools are found, not a setting
    read = {name for match in PLANNER_READS.findall(text) for name in match if name}
    read |= {name for names in CHECKED.findall(text) for name in re.findall(r'"([A-Z][A-Z0-9_]*)"', names)}
    return read - {"PATH"}


def settings_read() -> set[str]:
    """What the launch planner's settings (megatron/launch/settings.py) read from the environment: its READ, which must name every upper-case string of the module but its outputs."""
    source = (REPO_ROOT / "megatron" / "launch" / "settings.py").read_text()
    named = set(re.findall(r'"([A-Z][A-Z0-9_]+)"', source))
    assert sorted(named - set(settings.READ) - {"DPSIZE", "ZERO_LAB_FLAG_SOURCES", "MODEL_SIZE"}) == [], \
        "read by megatron/launch/settings.py, missing from its READ"
    return set(settings.READ)


def test_every_variable_the_scripts_read_is_in_the_table():
    text = "\n".join(path.read_text() for path in SCRIPTS)
    read = set(READ_FROM_CALLER.findall(text)) | planner_read() | settings_read()
    documented = table_variables()
    assert sorted(read - documented) == [], "read by the scripts or the planner, missing from docs/environment.md"
    referenced = set(ANY_REFERENCE.findall(text)) | planner_read() | settings_read()
    assert sorted(documented - referenced) == [], "in docs/environment.md, read by no script and not by the planner"


# The variables whose default is a flag value both launch paths pass, by the flag it becomes.
FLAG_OF = {"SEQ_LEN": "--seq-length", "MICRO_BATCH": "--micro-batch-size", "TRAIN_ITERS": "--train-iters",
           "TP": "--tensor-model-parallel-size", "PP": "--pipeline-model-parallel-size", "SPLIT": "--split",
           "LR_DECAY_STYLE": "--lr-decay-style", "LR_WARMUP_FRACTION": "--lr-warmup-fraction",
           "ADAM_BETA1": "--adam-beta1", "ADAM_BETA2": "--adam-beta2", "WEIGHT_DECAY": "--weight-decay",
           "CLIP_GRAD": "--clip-grad", "SEED": "--seed", "LOG_INTERVAL": "--log-interval",
           "EVAL_INTERVAL": "--eval-interval", "EVAL_ITERS": "--eval-iters", "SAVE_INTERVAL": "--save-interval",
           "DISTRIBUTED_TIMEOUT_MINUTES": "--distributed-timeout-minutes"}


def documented_cpu_defaults(text: str | None = None) -> dict[str, str]:
    """NAME -> the default docs/environment.md (or `text`) gives it without a GPU (`X CPU / Y GPU` -> X; a row
    naming several variables gives one default each, comma-separated)."""
    defaults = {}
    text = (REPO_ROOT / "docs" / "environment.md").read_text() if text is None else text
    for line in text.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [cell.strip() for cell in line.split("|")[1:-1]]
        if len(cells) < 4:
            continue
        names = re.findall(r"`([A-Z][A-Z0-9_]*)`", cells[0])
        default = cells[2].replace("`", "").split(" / ")[0].removesuffix(" CPU")
        values = [default] if len(names) == 1 else default.split(", ")
        defaults.update(zip(names, values))
    return defaults


def printed_flags(script: str, **env) -> dict[str, str]:
    environment = subprocess_env(DRY_RUN=1, CUDA_VISIBLE_DEVICES="", **env)
    for name in FLAG_OF:
        environment.pop(name, None)
    result = launch_script(REPO_ROOT / script, (), environment)
    assert result.returncode == 0, result.stderr
    [line] = [line for line in result.stdout.splitlines() if "/pretrain_gpt.py " in line]
    words = line.split("/pretrain_gpt.py ", 1)[1].replace("\\,", ",").split()
    return {word: words[i + 1] for i, word in enumerate(words[:-1]) if word.startswith("--")}


def test_the_documented_defaults_are_what_both_paths_pass(tmp_path):
    """Each default docs/environment.md states for a flag-making variable is the value the drivers and ALCF/
    pass when the variable is not set (on CPU ranks)."""
    documented = documented_cpu_defaults()
    for script, env in (("examples_zero/gpt_deepspeed_Z1.sh", dict(RUNS_DIR=tmp_path)),
                        ("ALCF/train-gpt3.sh", dict(OUTPUT_ROOT=tmp_path))):
        flags = printed_flags(script, **env)
        passed = {name: flags[flag] for name, flag in FLAG_OF.items()}
        for name, value in passed.items():
            expected = documented[name]
            if re.fullmatch(r"[0-9.eE+-]+", value):
                assert float(value) == float(expected), (script, name, value, expected)
            else:
                assert value == expected, (script, name, value, expected)


def preset_disagreements(text: str) -> list[str]:
    """Where the table's default for a variable the gpt3 preset sets (megatron/training_defaults.py), or its
    GPT-3 learning rate by model size (`6.0e-4 at 125M, ...`), is not the preset's."""
    documented = documented_cpu_defaults(text)
    wrong = []
    for name, value in GPT3_PRESET.environment().items():
        stated = documented.get(name)
        same = stated is not None and (float(stated) == float(value) if re.fullmatch(r"[0-9.eE+-]+", value)
                                       else stated == value)
        wrong += [] if same else [f"{name}: table {stated}, preset {value}"]
    [lr_row] = [line for line in text.splitlines() if line.startswith("| `LR`, `MIN_LR`")]
    for lr, sizes in re.findall(r"([0-9.]+e-[0-9]+) at ([0-9A-Za-z./]+)", lr_row):
        wrong += [f"LR at {size}: table {lr}, preset {GPT3_PRESET.lr_by_model_size.get(size)}"
                  for size in sizes.split("/") if GPT3_PRESET.lr_by_model_size.get(size) != lr]
    return wrong


def test_the_table_states_the_gpt3_presets_defaults():
    assert preset_disagreements((REPO_ROOT / "docs" / "environment.md").read_text()) == []


def test_the_preset_check_finds_a_wrong_default():
    text = (REPO_ROOT / "docs" / "environment.md").read_text()
    text = text.replace("| D A | 0.9, 0.95 |", "| D A | 0.9, 0.999 |").replace("3.0e-4 at 355M", "3.5e-4 at 355M")
    assert preset_disagreements(text) == ["ADAM_BETA2: table 0.999, preset 0.95",
                                          "LR at 355M: table 3.5e-4, preset 3.0e-4"]
