"""Each training default is written once: pretrain_gpt.py's flags are made from the typed sections' fields
(megatron/arguments.py), and the launch scripts' defaults are one named preset (megatron/training_defaults.py)."""
import ast
from dataclasses import MISSING, fields

from conftest import REPO_ROOT
from megatron import arguments
from megatron.arguments import build_parser
from megatron.core.layout import ParallelLayout
from megatron.model.config import GPTConfig
from megatron.tokenizer import TokenizerConfig

SECTIONS = (arguments.ParallelArgs, arguments.OptimizerArgs, arguments.TrainingArgs, arguments.DataArgs,
            arguments.LoggingArgs, arguments.CheckpointArgs, arguments.DeepSpeedArgs)
# flags whose default is a field of a class outside megatron/arguments.py, by argparse destination
FOREIGN = {"hidden_dropout": GPTConfig, "attention_dropout": GPTConfig, "init_method_std": GPTConfig,
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
    """Each add_argument default= that is a literal, and each number (other than 0 and 1) that is a flag field's
    default written anywhere but in that field."""
    tree = ast.parse(source)
    numbers = {spec.default for _, spec in flag_fields()
               if type(spec.default) in (int, float) and spec.default not in (0, 1)}
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
