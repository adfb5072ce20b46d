"""megatron/settings_schema.py, the launch variables spelled once: each variable's flags are pretrain_gpt.py's, of the
kind the variable is checked as; the launch settings (megatron/launch/settings.py) name the variables behind the
flags from it, in the order the shells did; and the launch planner refuses a layout the trainer would refuse through
the trainer's own function, in its words with the variables named."""
import re

import pytest

from megatron.arguments import OptimizerArgs, build_parser, parse_args
from megatron.errors import ZeroLabError
from megatron.launch.given_flags import LAYOUT_FLAGS
from megatron.launch.settings import READ, LaunchError, check, training_settings
from megatron.settings_schema import KINDS, SEVERAL, UNCHECKED, VARIABLES, problem
from test_arguments import base

ACTIONS = {option: action for action in build_parser()._actions for option in action.option_strings}
# the kinds a flag's argparse type takes
TYPES = {"int": {int}, "count": {int}, "port": {int}, "ints": {int}, "number": {float}, "fraction": {float},
         "weights": {None}, "text": {None}, "words": {None}, "file": {None, str}}


def test_each_variable_is_spelled_once_and_its_flags_are_pretrain_gpts():
    names = [name for variable in VARIABLES for name in variable.names]
    assert len(names) == len(set(names)) and sorted(READ) == sorted(names)
    for variable in VARIABLES:
        assert variable.kind in (*KINDS, *UNCHECKED) or "|" in variable.kind, variable
        for flag, dest in zip(variable.flags, variable.dests):
            assert flag in ACTIONS, f"{variable.name}: {flag} is no pretrain_gpt.py flag"
            assert ACTIONS[flag].dest == dest


@pytest.mark.parametrize("variable", [v for v in VARIABLES if v.flags], ids=lambda v: v.name)
def test_each_variable_is_of_its_flags_kind(variable):
    """A 0-or-1 variable, or a choice among switches (PRECISION: --bf16, --fp16), gives switches; a number flag's
    variable is checked as a number, a choice's values are the trainer's."""
    actions = [ACTIONS[flag] for flag in variable.flags]
    switches = all(action.nargs == 0 for action in actions)
    if variable.kind == "flag":
        assert switches
    elif "|" in variable.kind:
        choices = variable.kind.split("|")
        if switches:  # each switch is one choice: --bf16 is PRECISION=bf16, --use-rotary-... POSITION_EMBEDDING_TYPE=rotary
            assert all(any(choice in flag for choice in choices) for flag in variable.flags)
        else:
            [action] = actions
            assert action.type is None
            for choice in choices:
                OptimizerArgs(**{action.dest: choice})  # the trainer takes each choice
    else:
        assert not switches and {action.type for action in actions} <= TYPES[variable.kind]
        assert (variable.kind in SEVERAL) == (actions[0].nargs == "*")  # the launch passes the value's words


def test_a_kind_refuses_in_one_line_naming_the_variable():
    assert problem("fraction", "ADAM_BETA2", "1.5") == "ADAM_BETA2=1.5: expected a number from 0 to 1"
    assert problem("ints", "NUM_EXPERTS", "4 0") == ("NUM_EXPERTS=4 0: expected a positive integer, or one per MoE "
                                                     "layer separated by spaces")
    assert problem("a|b", "X", "c") == "X=c: expected one of a, b" and problem("a|b", "X", "b") is None
    assert problem("text", "DATA_PATH", "0.3 a\n0.7 b") is None
    with pytest.raises(LaunchError, match="^MASTER_PORT=70000: expected a TCP port, 1 to 65535$"):
        check({"MASTER_PORT": "70000"}, "port", "MASTER_PORT")


def test_the_layout_flags_after_a_script_are_read_as_the_schemas_variables():
    assert LAYOUT_FLAGS == {"--tensor-model-parallel-size": ("TP", "MPSIZE"),
                            "--pipeline-model-parallel-size": ("PP", "PPSIZE"),
                            "--ds-sequence-parallel-size": ("SP_SIZE", "SPSIZE"),
                            "--num-experts": ("NUM_EXPERTS", None), "--moe-expert-parallel-size": ("EP_SIZE", None),
                            "--sequence-parallel": ("SP", None)}


SHELL_SOURCES = ("--model-size={model} --seq-length=SEQ_LEN --micro-batch-size=MICRO_BATCH "
                 "--global-batch-size=GLOBAL_BATCH --train-iters=TRAIN_ITERS --train-epochs=TRAIN_EPOCHS "
                 "--bf16={precision} --fp16={precision} --tensor-model-parallel-size={tp} "
                 "--pipeline-model-parallel-size={pp} --sequence-parallel={sp} "
                 "--checkpoint-activations=USE_ACTIVATION_CHECKPOINTING --deepspeed_config=DS_CONFIG "
                 "--data-path=DATA_PATH --vocab-file=VOCAB_FILE --merge-file=MERGE_FILE --split={split} --lr=LR "
                 "--min-lr=MIN_LR --lr-decay-style=LR_DECAY_STYLE --lr-warmup-fraction={warmup} "
                 "--adam-beta1=ADAM_BETA1 --adam-beta2=ADAM_BETA2 --weight-decay=WEIGHT_DECAY --clip-grad=CLIP_GRAD "
                 "--seed=SEED --distributed-timeout-minutes=DISTRIBUTED_TIMEOUT_MINUTES --log-interval=LOG_INTERVAL "
                 "--eval-interval=EVAL_INTERVAL --eval-iters=EVAL_ITERS --save-interval=SAVE_INTERVAL "
                 "--wandb-project=WANDB_PROJECT")


def test_the_flag_sources_are_the_shells_in_their_order_then_the_flags_given():
    """ZERO_LAB_FLAG_SOURCES as the settings built it by hand before the schema, byte for byte."""
    plain = training_settings({}, accelerator="cpu", world=2, model_size="tiny")
    assert plain.sources_text() == SHELL_SOURCES.format(model="MODEL_SIZE", precision="PRECISION", tp="TP", pp="PP",
                                                        sp="SP", split="SPLIT", warmup="LR_WARMUP_FRACTION")
    alcf = training_settings({"MPSIZE": "2", "DTYPE": "bf16", "SPSIZE": "2", "NUM_EXPERTS": "4", "TOPK": "2",
                              "POSITION_EMBEDDING_TYPE": "rotary", "COMPILE": "1"},
                             accelerator="cpu", world=4, model_size=None, model_variable="INIT_HF",
                             alcf_names=True, sp_variable="SP_TYPE")
    assert alcf.sources_text() == SHELL_SOURCES.format(
        model="INIT_HF", precision="DTYPE", tp="MPSIZE", pp="PPSIZE", sp="SP_TYPE", split="DATA_SPLIT",
        warmup="LR_WARMUP_FRAC") + (" --use-rotary-position-embeddings=POSITION_EMBEDDING_TYPE "
                                    "--ds-sequence-parallel-size=SPSIZE --compile=COMPILE --num-experts=NUM_EXPERTS "
                                    "--topk=TOPK")


@pytest.mark.parametrize("env, world, flags", [
    ({"TP": "4"}, 2, ["--tensor-model-parallel-size", "4"]),
    ({"SP_SIZE": "3"}, 4, ["--ds-sequence-parallel-size", "3"]),
    ({"GLOBAL_BATCH": "15"}, 2, ["--micro-batch-size", "4", "--global-batch-size", "15"]),
    ({"NUM_EXPERTS": "3", "EP_SIZE": "2"}, 2, ["--num-experts", "3", "--moe-expert-parallel-size", "2"]),
    ({"NUM_EXPERTS": "4", "EP_SIZE": "4"}, 2, ["--num-experts", "4", "--moe-expert-parallel-size", "4"]),
], ids=["world by TP", "world by Ulysses", "batch split", "experts by EP", "data parallel by EP"])
def test_the_planner_refuses_a_layout_in_the_trainers_words(data_prefix, env, world, flags):
    """The same layout, set by variables before the ranks start and by flags at the trainer's start-up, is refused
    in the same line, the planner's naming the variable behind each flag."""
    with pytest.raises(LaunchError) as planned:
        training_settings(env, accelerator="cpu", world=world, model_size="tiny")
    with pytest.raises(ZeroLabError) as started:
        parse_args(base(data_prefix, "--global-batch-size", "8", *flags), world_size=world)
    assert "(from " in str(planned.value)
    assert re.sub(r" \(from [A-Z_]+\)", "", str(planned.value)) == str(started.value)
