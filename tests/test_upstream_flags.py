"""Every training flag of Megatron-DeepSpeed's GPT example scripts (tests/fixtures/megatron_deepspeed_flags.tsv) is
honoured, accepted with a start-up line, or refused in one line (megatron/upstream_flags.py, docs/megatron-flags.md),
and docs/megatron-flags.md is the table generated from the parser."""
import importlib.util
import json
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, test_env as subprocess_env  # aliased: pytest would collect test_env as a test
from megatron.arguments import ConfigError, build_parser, parse_args
from megatron.upstream_flags import ACCEPTED, REFUSED, SELECTIVE_LINE, flag_status, recompute_layers

FIXTURE = REPO_ROOT / "tests" / "fixtures" / "megatron_deepspeed_flags.tsv"
WORLD = 8  # the scripts' tensor-parallel sizes (up to 8) divide it
BASE = ["--num-layers", "24", "--hidden-size", "64", "--num-attention-heads", "8", "--seq-length", "64",
        "--micro-batch-size", "2", "--data-path", "corpus_text_document", "--vocab-file", "vocab.json",
        "--merge-file", "merges.txt"]
LENGTH = ["--train-iters", "2"]
# what a flag needs beside it to mean anything (as the scripts pass them together)
COMPANIONS = {"--recompute-method": ["--recompute-granularity", "full"],
              "--checkpoint-in-cpu": ["--deepspeed-activation-checkpointing", "--checkpoint-activations"],
              "--universal-checkpoint": ["--load", "checkpoint"],
              # a ramp is sample-based (Megatron's rule), to the scripts' global batch of 512
              "--rampup-batch-size": ["--train-samples", "4000000", "--global-batch-size", "512"]}


def script_flags() -> list[tuple[str, int, list[str]]]:
    rows = [line.split("\t") for line in FIXTURE.read_text().splitlines() if line and not line.startswith("#")]
    return [(flag, int(count), value.split()) for flag, count, value in rows]


def argv_of(flag: str, values: list[str], tmp_path) -> list[str]:
    if flag == "--deepspeed_config":  # the scripts' JSON files are written by the scripts; an empty one here
        path = tmp_path / "ds_config.json"
        path.write_text(json.dumps({}))
        values = [str(path)]
    length = [] if flag in ("--train-iters", "--train-samples", "--rampup-batch-size") else LENGTH
    return BASE + length + COMPANIONS.get(flag, []) + [flag, *values]


def test_the_fixture_holds_the_scripts_flags():
    """119 flags: 117 of the 34 training scripts, and the evaluation harness's --no-load-optim and --no-load-rng."""
    rows = script_flags()
    assert len(rows) == len({flag for flag, _, _ in rows}) == 119
    counts = dict((flag, count) for flag, count, _ in rows)
    assert counts["--deepspeed-activation-checkpointing"] == 32 and counts["--data-impl"] == 29


def test_every_flag_of_the_scripts_is_known_to_the_parser():
    known = {option: action for action in build_parser()._actions for option in action.option_strings}
    unknown = {flag for flag, _, _ in script_flags() if flag_status(flag, known)[0] == "unrecognized"}
    assert not unknown, f"unrecognized: {sorted(unknown)}"


@pytest.mark.parametrize("flag,values", [(flag, values) for flag, _, values in script_flags()
                                         if flag not in REFUSED])
def test_each_flag_parses_as_the_scripts_pass_it(flag, values, tmp_path):
    args = parse_args(argv_of(flag, values, tmp_path), world_size=WORLD, device_type="cuda")
    lines = [line for line in args.notes if line.startswith(f"note: {flag} accepted: ")]
    assert len(lines) == (1 if flag in ACCEPTED else 0), args.notes


@pytest.mark.parametrize("flag,values", [(flag, values) for flag, _, values in script_flags() if flag in REFUSED])
def test_each_refused_flag_stops_in_one_line_saying_what_to_use_instead(flag, values, tmp_path):
    with pytest.raises(ConfigError) as err:
        parse_args(argv_of(flag, values, tmp_path), world_size=WORLD, device_type="cuda")
    assert str(err.value) == f"{flag} is not supported: {REFUSED[flag].line}"
    assert "\n" not in str(err.value)


def test_deepspeeds_fpdt_layer_has_no_attention_kernel_on_cpu_ranks():
    # the reason the FPDT flags are refused: its attention is flash-attn's CUDA kernel or nothing
    pytest.importorskip("einops")
    from deepspeed.sequence import fpdt_layer

    assert importlib.util.find_spec("flash_attn") is None
    assert fpdt_layer._flash_attn_forward is None and fpdt_layer._flash_attn_backward is None
    assert "flash-attn's CUDA kernels" in REFUSED["--ds-sequence-parallel-fpdt"].line


def test_refused_messages_name_what_to_use_instead():
    assert "--ds-sequence-parallel-size" in REFUSED["--ds-sequence-parallel-fpdt"].line
    assert "curriculum_learning section" in REFUSED["--data-efficiency-curriculum-learning"].line
    assert "--data-cache-path" in REFUSED["--train-doc-idx-path"].line
    assert "without the teacher flags" in REFUSED["--load-teacher"].line


def test_a_refused_flag_ends_pretrain_gpt_with_one_error_line_and_status_1():
    run = subprocess.run([sys.executable, str(REPO_ROOT / "pretrain_gpt.py"), *BASE, *LENGTH, "--random-ltd"],
                         env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: --random-ltd is not supported: {REFUSED['--random-ltd'].line}"]


def test_the_docs_page_is_the_table_generated_from_the_parser():
    from tools.megatron_flags_doc import PAGE, page_text
    assert PAGE.read_text() == page_text(), "docs/megatron-flags.md is stale: run python tools/megatron_flags_doc.py"


def test_the_docs_index_lists_the_page():
    assert "[megatron-flags.md](megatron-flags.md)" in (REPO_ROOT / "docs" / "README.md").read_text()


# --recompute-*: Megatron's recompute mapped onto zero-lab's (every layer of a stage, one at a time), or refused

@pytest.mark.parametrize("granularity,method,layers,recompute", [
    (None, None, 1, False), ("full", None, 1, True), ("full", "uniform", 1, True), ("full", "block", 12, True),
    ("full", "block", 30, True), ("full", "block", 0, False)])
def test_recompute_flags_map_onto_per_layer_recompute(granularity, method, layers, recompute):
    assert recompute_layers(granularity, method, layers, layers_per_stage=12) == (recompute, None, None)


@pytest.mark.parametrize("argv,message", [
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"],
     "--recompute-method uniform --recompute-num-layers 2: zero-lab recomputes one layer at a time"),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "6"],
     "--recompute-method block --recompute-num-layers 6: zero-lab recomputes every layer of a pipeline stage or "
     "none; use --recompute-num-layers 12"),
    (["--recompute-method", "uniform"], "--recompute-method uniform recomputes nothing without "
                                        "--recompute-granularity full"),
    (["--recompute-granularity", "selective", "--recompute-method", "uniform"],
     "--recompute-method is for --recompute-granularity full only"),
    (["--checkpoint-in-cpu"], "--checkpoint-in-cpu keeps each recomputed layer's input in host memory: add "
                              "--checkpoint-activations"),
])
def test_recompute_combinations_zero_lab_lacks_are_refused(argv, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        # 24 layers over 2 pipeline stages: 12 a stage
        parse_args(BASE + LENGTH + ["--pipeline-model-parallel-size", "2", *argv], world_size=2)


def test_recompute_flags_set_the_models_recompute():
    def model(*argv):
        return parse_args(BASE + LENGTH + list(argv)).model
    assert model("--recompute-granularity", "full", "--recompute-method", "uniform").recompute_activations
    assert model("--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "24",
                 "--deepspeed-activation-checkpointing").recompute_with_deepspeed
    assert not model("--recompute-granularity", "full", "--recompute-method", "block",
                     "--recompute-num-layers", "0").recompute_activations
    selective = parse_args(BASE + LENGTH + ["--recompute-granularity", "selective"])
    assert not selective.model.recompute_activations and selective.notes == [SELECTIVE_LINE]
    assert "recompute_with_deepspeed" not in model("--deepspeed-activation-checkpointing").to_dict()
