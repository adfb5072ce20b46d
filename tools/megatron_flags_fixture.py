"""Write tests/fixtures/megatron_deepspeed_flags.tsv: the training flags Megatron-DeepSpeed's GPT example scripts
pass, read from a Megatron-DeepSpeed checkout (CI has none, so the list is committed).

    python tools/megatron_flags_fixture.py /path/to/Megatron-DeepSpeed

A flag is a word of a script's live lines that Megatron-DeepSpeed's own parser knows (its megatron/arguments.py is
imported from the checkout, with deepspeed.add_config_arguments), so launcher and converter flags are left out."""
import argparse
import collections
import importlib.abc
import importlib.machinery
import importlib.util
import itertools
import re
import sys
import types
from pathlib import Path

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "megatron_deepspeed_flags.tsv"
FOLDERS = ("MoE/", "curriculum_learning/", "sequence_parallel/", "universal_checkpointing/", "data_efficiency/gpt/",
           "rebase/", "finetune_hf_llama/", "pretrain_llama")
# the evaluation harness's scripts pass these two (the issue counts them); their other flags are evaluate.py's
FROM_EVAL_HARNESS = ("--no-load-optim", "--no-load-rng")
# values the scripts compute in shell arithmetic or take from the environment
FILLED = {"--train-samples": "292968750", "--moe-expert-parallel-size": "64",
          "--load-teacher": "checkpoint/gpt-1.3B-teacher", "--num-key-value-heads": "4"}
GROUPS = ("network_size", "regularization", "training", "initialization", "learning_rate", "checkpointing",
          "mixed_precision", "distributed", "validation", "data", "autoresume", "biencoder", "vision", "logging",
          "zero", "memoryopt", "activation_checkpoint", "distillation", "inference", "transformer_engine", "retro",
          "profiler")


class CheckoutPackages(importlib.abc.MetaPathFinder):
    """Finds the checkout's own top-level packages (its `megatron` and `tools`, which its arguments.py imports) in the
    checkout, ahead of zero-lab's installed packages of the same names; every other import is found as usual."""

    def __init__(self, checkout: Path):
        self.checkout = checkout

    def find_spec(self, name, path=None, target=None):
        if "." in name or not (self.checkout / name / "__init__.py").is_file():
            return None
        return importlib.machinery.PathFinder.find_spec(name, [str(self.checkout)])


def upstream_options(checkout: Path) -> dict:
    """Megatron-DeepSpeed's parser's actions by option string (its parse_args, without parsing)."""
    import deepspeed

    sys.modules.setdefault("six", types.ModuleType("six"))  # its BERT tokenizer's import, never used here
    sys.meta_path.insert(0, CheckoutPackages(checkout))
    spec = importlib.util.spec_from_file_location("mds_arguments", checkout / "megatron" / "arguments.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    parser = argparse.ArgumentParser(allow_abbrev=False)
    for group in GROUPS:
        parser = getattr(module, f"_add_{group}_args")(parser)
    parser = deepspeed.add_config_arguments(parser)
    return {option: action for action in parser._actions for option in action.option_strings}


def resolve(word: str, env: dict) -> str:
    for _ in range(4):
        word = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m.group(1) or m.group(2), m.group(0)), word)
    return word


def script_flags(text: str, options: dict) -> dict:
    """{flag: [values as passed, variables resolved]} of one script's live lines."""
    text = re.sub(r"(?m)^\s*#.*$", "", text)
    env = {}
    for name, value in re.findall(r"(?m)^\s*(\w+)=([^\s;#`$(][^\s;#`]*|\"[^\"$`]*\"|'[^']*')\s*$", text):
        env.setdefault(name, value.strip("\"'"))
    words = re.findall(r"[^\s\\\"']+", text)
    found = collections.defaultdict(list)
    for i, word in enumerate(words):
        flag = word.split("=", 1)[0]
        if not re.fullmatch(r"--[A-Za-z][\w-]*", flag) or flag not in options:
            continue
        found[flag]
        nargs = options[flag].nargs
        if nargs == 0:
            continue
        if "=" in word:
            found[flag].append(resolve(word.split("=", 1)[1], env))
            continue
        # the words after the flag up to the next flag: as many as its nargs (1 where it has none)
        following = list(itertools.takewhile(lambda w: not w.startswith("--"), words[i + 1:]))
        taken = following[:1] if nargs in (None, "?") else following[:nargs] if isinstance(nargs, int) else following
        if taken:
            found[flag].append(" ".join(resolve(value, env) for value in taken))
    return found


def main(checkout: Path) -> None:
    options = upstream_options(checkout)
    root = checkout / "examples_deepspeed"
    scripts = [p for p in sorted(root.glob("**/*.sh")) if str(p.relative_to(root)).startswith(FOLDERS)
               and re.search(r"pretrain_gpt\.py|finetune_llama\.py", p.read_text())]
    count, values = collections.Counter(), collections.defaultdict(collections.Counter)
    for script in scripts:
        for flag, passed in script_flags(script.read_text(), options).items():
            count[flag] += 1
            values[flag].update(passed)
    rows = []
    for flag, n in sorted(count.items(), key=lambda item: (-item[1], item[0])):
        literal = [v for v, _ in values[flag].most_common() if v and "$" not in v]
        rows.append((flag, n, FILLED.get(flag, literal[0] if literal else "")))
    rows += [(flag, 0, "") for flag in FROM_EVAL_HARNESS]
    header = [line for line in FIXTURE.read_text().splitlines() if line.startswith("#")]
    FIXTURE.write_text("\n".join(header + [f"{f}\t{n}\t{v}" for f, n, v in rows]) + "\n")
    print(f"{len(scripts)} scripts, {len(rows)} flags -> {FIXTURE}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkout", type=Path,
                        help="a Megatron-DeepSpeed checkout (its megatron/ and examples_deepspeed/)")
    main(parser.parse_args().checkout)
