"""Each training default is written once: pretrain_gpt.py's flags are made from the typed sections' fields
(megatron/arguments.py), and the launch scripts' defaults are one named preset (megatron/training_defaults.py)."""
import ast
import re
import subprocess
import sys
from dataclasses import MISSING, fields

from conftest import REPO_ROOT
from conftest import test_env as subprocess_env  # aliased: pytest would collect test_env as a test
from megatron import arguments
from megatron.arguments import build_parser
from megatron.core.layout import ParallelLayout
from megatron.launch import settings
from megatron.model.config import GPTConfig
from megatron.tokenizer import TokenizerConfig
from megatron.training_defaults import GPT3_PRESET, PRESETS

SECTIONS = (arguments.ParallelArgs, arguments.OptimizerArgs, arguments.TrainingArgs, arguments.DataArgs,
            arguments.LoggingArgs, arguments.CheckpointArgs, arguments.DeepSpeedArgs)
# flags whose default is a field of a class outside megatron/arguments.py, by argparse destination
FOREIGN = {"hidden_dropout": GPTConfig, "attention_dropout": GPTConfig, "init_method_std": GPTConfig,
           "layernorm_epsilon": GPTConfig,
           "use_rotary_position_embeddings": GPTConfig, "rotary_percent": GPTConfig, "rope_theta": GPTConfig,
           "normalization": GPTConfig, "swiglu": GPTConfig, "num_key_value_heads": GPTConfig,
           "untie_embeddings_and_output_weights": GPTConfig, "disable_bias_linear": GPTConfig,
           "tensor_model_parallel_size": ParallelLayout, "pipeline_model_parallel_size": ParallelLayout,
           "tokenizer_type": TokenizerConfig, "make_vocab_size_divisible_by": TokenizerConfig}


def flag_fields():
    """(argparse destination, the field) for every section field that is a flag."""
    for section in SECTIONS:
        for spec in fields(section):
            if spec.metadata.get("flag"):
                option = (spec.metadata["names"] or (spec.name,))[0]
                yield option.lstrip("-").replace("-", "_"), spec


def test_every_flag_default_is_its_field_default():
    defaults = {action.dest: action.default for action in build_parser()._actions}
    made = dict(flag_fields())
    # the settings the launch presets override are among them (the check cannot pass by finding no fields)
    assert {"adam_beta2", "weight_decay", "log_interval", "eval_interval", "seed", "split", "clip_grad"} <= set(made)
    for dest, spec in made.items():
        from_json = spec.metadata["from_json"] or spec.default is MISSING  # the JSON or a computation gives it
        assert defaults[dest] == (None if from_json else spec.default), dest
    for dest, section in FOREIGN.items():
        assert defaults[dest] == {spec.name: spec.default for spec in fields(section)}[dest], dest


def test_megatron_defaults_are_pretrain_gpts():
    """pretrain_gpt.py alone keeps Megatron's defaults (the launch scripts pass the gpt3 preset's)."""
    ns = build_parser().parse_args([])
    assert (ns.adam_beta1, ns.adam_beta2, ns.weight_decay, ns.log_interval, ns.eval_interval, ns.eval_iters) == \
        (0.9, 0.999, 0.01, 100, 1000, 10)
    assert (ns.lr, ns.seed, ns.split, ns.clip_grad, ns.zero_stage) == (1.0e-4, 1234, "969, 30, 1", None, None)


def literal_defaults_written_twice(source: str) -> list[str]:
    """Each add_argument default= that is a literal, and each number (other than 0, 1 and 2, which checks use for
    other things: pairs, ZeRO stage 2) that is a flag field's default written anywhere but in that field."""
    tree = ast.parse(source)
    numbers = {spec.default for _, spec in flag_fields()
               if type(spec.default) in (int, float) and spec.default not in (0, 1, 2)}
    in_fields = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "flag" and node.args:
            in_fields.add(id(node.args[0]))
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            found += [f"line {node.lineno}: add_argument(default={ast.unparse(keyword.value)})"
                      for keyword in node.keywords
                      if keyword.arg == "default" and isinstance(keyword.value, ast.Constant)
                      and keyword.value.value is not None]
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and type(node.value) in (int, float) and node.value in numbers
                and id(node) not in in_fields):
            found.append(f"line {node.lineno}: {node.value!r}")
    return found


def test_arguments_py_writes_each_default_once():
    assert literal_defaults_written_twice((REPO_ROOT / "megatron" / "arguments.py").read_text()) == []


def test_the_check_finds_a_default_written_twice():
    source = (REPO_ROOT / "megatron" / "arguments.py").read_text()
    again = source.replace('"fp32": torch.float32', '"fp32": torch.float32, "x": parser.add_argument("--x", '
                                                     'default=0.01)', 1)
    again = again.replace('_value(shared, "clip_grad", _default(OptimizerArgs, "clip_grad"))',
                          '_value(shared, "clip_grad", 0.999)', 1)
    assert sorted(line.split(": ", 1)[1] for line in literal_defaults_written_twice(again)) == \
        ["0.01", "0.999", "add_argument(default=0.01)"]


def test_the_gpt3_preset_sets_pretrain_gpt_flags():
    """Each preset field is a pretrain_gpt.py flag, and its value parses to itself."""
    assert PRESETS["gpt3"] is GPT3_PRESET
    parser = build_parser()
    for name, value in GPT3_PRESET.flag_values().items():
        option = "--" + name.replace("_", "-")
        argv = ([option] if value else []) if isinstance(value, bool) else [option, str(value)]
        assert getattr(parser.parse_args(argv), name) == value, name
    assert (GPT3_PRESET.adam_beta1, GPT3_PRESET.adam_beta2, GPT3_PRESET.weight_decay) == (0.9, 0.95, 0.1)
    for size, lr in GPT3_PRESET.lr_by_model_size.items():
        assert parser.parse_args(["--model-size", size, "--lr", lr]).lr == float(lr)


def test_the_launch_settings_take_the_preset():
    """megatron/launch/settings.py defines no default of its own for what the preset sets."""
    assert settings.DEFAULTS == GPT3_PRESET.environment()
    assert settings.GPT3_LR is GPT3_PRESET.lr_by_model_size
    flags = settings.training_settings({}, accelerator="cpu", world=2, model_size="175B").flags
    passed = {flags[i]: flags[i + 1] for i, word in enumerate(flags[:-1]) if word.startswith("--")}
    assert (passed["--adam-beta2"], passed["--weight-decay"], passed["--log-interval"], passed["--lr"],
            passed["--min-lr"]) == ("0.95", "0.1", "5", "0.6e-4", "6.00e-06")
    source = (REPO_ROOT / "megatron" / "launch" / "settings.py").read_text()
    assert '"0.95"' not in source and '"6.0e-4"' not in source


def test_the_launch_planner_imports_no_torch():
    code = "import sys, megatron.launch.settings; assert 'torch' not in sys.modules, 'torch imported'"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=subprocess_env(), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_the_docs_state_pretrain_gpts_own_defaults():
    """docs/environment.md's "Which defaults apply where" gives Megatron's defaults as --help has them."""
    text = (REPO_ROOT / "docs" / "environment.md").read_text()
    paragraph = text.split("**Which defaults apply where.**", 1)[1].split("\n\n", 1)[0]
    stated = re.findall(r"`(--[a-z0-9-]+)` ([0-9][0-9.e-]*[0-9])", paragraph)
    assert len(stated) >= 7
    defaults = {option: action.default for action in build_parser()._actions for option in action.option_strings}
    assert [(option, float(value)) for option, value in stated] == [(option, defaults[option]) for option, _ in stated]
