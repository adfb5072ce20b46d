"""Flag parsing into the typed sections, gradient accumulation, the DeepSpeed config, and every
bad-input error (text and exit code)."""
import json
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, free_port, test_env
from megatron.arguments import ConfigError, parse_args
from megatron.checkpointing.protocol import CheckpointError
from megatron.errors import ZeroLabError
from megatron.deepspeed_config import ALIGNMENT, deepspeed_config, generate_config, write_deepspeed_config
from megatron.flag_sources import name_sources
from megatron.optimizer import LRSchedule
from megatron.startup import StartupError, prepare_run


def base(prefix, *extra):
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "2", "--train-iters", "10", "--data-path", prefix,
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", *extra]


def test_flags_fill_the_sections(data_prefix):
    args = parse_args(base(data_prefix, "--global-batch-size", "16", "--lr", "3e-4", "--zero-stage", "2",
                           "--lr-decay-style", "linear", "--eod-mask-loss", "--clip-grad", "0.5"), world_size=2)
    assert (args.model.num_layers, args.model.hidden_size, args.model.max_position_embeddings) == (2, 64, 32)
    assert args.training.global_batch_size == 16
    assert args.training.gradient_accumulation_steps == 4  # 16 / (2 micro x 2 data-parallel ranks)
    assert args.optimizer.lr == 3e-4 and args.optimizer.lr_decay_style == "linear"
    assert args.optimizer.clip_grad == 0.5 and args.training.eod_mask_loss
    assert args.deepspeed.zero_stage == 2 and args.deepspeed.precision == "fp32"
    assert args.data.data_path == [data_prefix] and args.parallel.data_parallel_size == 2


def test_global_batch_defaults_to_one_micro_batch_per_rank(data_prefix):
    args = parse_args(base(data_prefix), world_size=4)
    assert args.training.global_batch_size == 8 and args.training.gradient_accumulation_steps == 1


def test_model_size_preset_with_explicit_override(data_prefix):
    without_shape = base(data_prefix)[6:]  # drop --num-layers/--hidden-size/--num-attention-heads
    args = parse_args(["--model-size", "125M", *without_shape, "--num-layers", "3"], world_size=1)
    assert (args.model.num_layers, args.model.hidden_size, args.model.num_attention_heads) == (3, 768, 12)


def test_offload_flags_and_json_stage(data_prefix, tmp_path):
    args = parse_args(base(data_prefix, "--zero-stage", "3", "--zero-offload-params"), world_size=2)
    assert args.deepspeed.offload_optimizer and args.deepspeed.offload_params
    assert args.deepspeed.offload == "optimizer+params"
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}))
    args = parse_args(base(data_prefix, "--deepspeed_config", str(user)), world_size=2)
    assert args.deepspeed.zero_stage == 1 and args.deepspeed.offload == "optimizer"


@pytest.mark.parametrize("extra, world, message", [
    (["--hidden-size", "100", "--num-attention-heads", "3"], 1,
     "--hidden-size 100 is not divisible by --num-attention-heads 3"),
    (["--max-position-embeddings", "16"], 1, "--seq-length 32 exceeds --max-position-embeddings 16"),
    (["--global-batch-size", "10"], 2,
     "--global-batch-size 10 is not divisible by --micro-batch-size 2 x data-parallel size 2"),
    (["--zero-offload-optimizer"], 2, "--zero-offload-optimizer needs ZeRO; set --zero-stage 1, 2 or 3"),
    (["--zero-stage", "2", "--zero-offload-params"], 2, "--zero-offload-params needs --zero-stage 3"),
    (["--fp16", "--bf16"], 1, "--fp16 and --bf16 are exclusive"),
    (["--fp16"], 1, "--fp16 is not supported on the CPU accelerator"),
    (["--zero-stage", "2", "--pipeline-model-parallel-size", "2"], 2,
     "--zero-stage 2 cannot be combined with pipeline parallelism"),
    (["--tensor-model-parallel-size", "8"], 8, "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 8"),
    (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 2,
     "world size 2 is not divisible by --tensor-model-parallel-size 2 x --pipeline-model-parallel-size 2"),
    (["--num-layers", "3", "--pipeline-model-parallel-size", "2"], 2,
     "--num-layers 3 is not divisible by --pipeline-model-parallel-size 2"),
    (["--sequence-parallel"], 2, "--sequence-parallel needs --tensor-model-parallel-size > 1"),
    (["--sequence-parallel", "--tensor-model-parallel-size", "2", "--seq-length", "31"], 2,
     "--seq-length 31 is not divisible by --tensor-model-parallel-size 2 (needed by --sequence-parallel)"),
    (["--zero-stage", "5"], 1, "--zero-stage must be 0, 1, 2 or 3, got 5"),
    (["--lr-decay-style", "exp"], 1, "--lr-decay-style must be cosine, linear, constant or inverse-square-root"),
    (["--train-samples", "100"], 1, "give exactly one of --train-iters, --train-samples, --train-epochs"),
])
def test_bad_combinations_name_the_flag(data_prefix, extra, world, message):
    with pytest.raises(ZeroLabError) as err:
        parse_args(base(data_prefix, *extra), world_size=world)
    assert message in str(err.value)


def test_parsing_opens_no_file_the_start_up_step_checks_them(data_prefix, tmp_path):
    """parse_args parses values only; megatron/startup.py checks the files, one line each, and fills in
    the padded vocabulary from the tokenizer."""
    args = parse_args(base(str(tmp_path / "nowhere"), "--load", str(tmp_path)), world_size=1)
    assert args.model.padded_vocab_size is None  # the tokenizer has not been read yet
    with pytest.raises(StartupError, match=r"^--data-path: .*nowhere\.bin does not exist"):
        prepare_run(args, verbose=False)
    # a --load holding no checkpoint starts afresh (Megatron's behaviour; the launch scripts always pass one)
    prepare_run(parse_args(base(data_prefix, "--load", str(tmp_path)), world_size=1), verbose=False)
    (tmp_path / "latest").write_text("global_step3")
    with pytest.raises(CheckpointError, match=r"--load .*: checkpoint global_step3 named by 'latest' is incomplete"):
        prepare_run(parse_args(base(data_prefix, "--load", str(tmp_path)), world_size=1), verbose=False)
    with pytest.raises(StartupError, match=r"^--vocab-file None does not exist"):
        prepare_run(parse_args(base(data_prefix, "--tokenizer-type", "GPT2BPETokenizer"), world_size=1), verbose=False)
    args, tokenizer = prepare_run(parse_args(base(data_prefix), world_size=1), verbose=False)
    assert args.model.padded_vocab_size == tokenizer.padded_vocab_size == 1024


def test_zero_stage_flag_disagreeing_with_json(data_prefix, tmp_path):
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    with pytest.raises(ConfigError, match=r"--zero-stage 1 disagrees with zero_optimization.stage 3 in "):
        parse_args(base(data_prefix, "--zero-stage", "1", "--deepspeed_config", str(user)), world_size=2)
    user.write_text('{"zero_optimization": {"stage": 3},\n  "bf16": }')
    with pytest.raises(ConfigError, match=r"ds.json: line 2: not valid JSON"):
        parse_args(base(data_prefix, "--deepspeed_config", str(user)), world_size=2)


def test_generated_deepspeed_config(data_prefix, tmp_path):
    args = parse_args(base(data_prefix, "--global-batch-size", "16", "--zero-stage", "3",
                           "--zero-offload-params", "--clip-grad", "0.7"), world_size=2)
    config = generate_config(args, num_params=124_000_000, hidden_size=768, on_cuda=False)
    assert (config["train_batch_size"], config["train_micro_batch_size_per_gpu"],
            config["gradient_accumulation_steps"]) == (16, 2, 4)
    assert config["gradient_clipping"] == 0.7
    zero = config["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_param"]["device"] == "cpu"
    assert zero["offload_optimizer"]["device"] == "cpu"
    # sized from the model, far below DeepSpeed's 5e8 default, and aligned for ZeRO's assertion
    assert zero["reduce_bucket_size"] == 6_200_000 - 6_200_000 % ALIGNMENT
    assert zero["stage3_param_persistence_threshold"] == 7680
    path = write_deepspeed_config(config, str(tmp_path / "run"))
    assert json.loads(path.read_text()) == config and sorted(p.name for p in path.parent.iterdir()) == [
        "ds_config.json"]


def test_generated_config_sends_the_zero_papers_volumes(data_prefix):
    """docs/zero-tradeoff-reference.md: stages 1/2 reduce each gradient partition to its owner; stage 3 gathers
    a parameter again for its backward."""
    z1 = generate_config(parse_args(base(data_prefix, "--zero-stage", "1"), world_size=2), 1000, 64, on_cuda=False)
    assert z1["zero_optimization"]["use_multi_rank_bucket_allreduce"] is False
    z3 = generate_config(parse_args(base(data_prefix, "--zero-stage", "3"), world_size=2), 1000, 64, on_cuda=False)
    assert z3["zero_optimization"]["stage3_max_reuse_distance"] == 0


def test_one_rank_drops_what_only_serves_sharing(data_prefix):
    """docs/zero-tradeoff-reference.md: with one rank holding the parameters, no overlap_comm (a device synchronize per
    bucket, nothing to hide) and stage 3 keeps every parameter whole; with two, the paper's settings."""
    def zero(stage, world, *flags):
        args = parse_args(base(data_prefix, "--global-batch-size", str(2 * world), "--zero-stage", str(stage),
                               *flags), world_size=world)
        return generate_config(args, 1_000_000, 64, on_cuda=True)["zero_optimization"]
    assert zero(2, 1)["overlap_comm"] is False and zero(2, 2)["overlap_comm"] is True
    assert zero(3, 1)["stage3_param_persistence_threshold"] == 1_000_000 and zero(3, 1)["overlap_comm"] is False
    assert zero(3, 2)["stage3_param_persistence_threshold"] == 640
    assert zero(3, 1, "--zero-offload-params")["stage3_param_persistence_threshold"] == 640  # offload moves them


def test_generated_nvme_offload_config(data_prefix, tmp_path):
    nvme = tmp_path / "nvme"
    args = parse_args(base(data_prefix, "--zero-stage", "3", "--zero-nvme-path", str(nvme)), world_size=2)
    assert args.deepspeed.offload == "nvme"
    config = generate_config(args, num_params=6_843_904, hidden_size=128, on_cuda=False)
    zero = config["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "nvme", "nvme_path": str(nvme), "pin_memory": False,
                                         "buffer_count": 4}
    assert zero["offload_param"]["device"] == "nvme" and zero["offload_param"]["nvme_path"] == str(nvme)
    # a parameter buffer holds the largest partition (at most the model), aligned
    assert zero["offload_param"]["buffer_size"] == 6_843_904 + ALIGNMENT - 6_843_904 % ALIGNMENT
    # the keys DeepSpeed 0.19.8 reads (deepspeed/runtime/swap_tensor/aio_config.py): intra_op_parallelism, which
    # an earlier thread_count left at its default
    assert config["aio"] == {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1,
                             "single_submit": False, "overlap_events": True}
    from deepspeed.runtime.swap_tensor.aio_config import get_aio_config
    assert get_aio_config(config) == config["aio"] | {"use_gds": False}  # every key read, none left at default
    prepare_run(args, verbose=False)
    assert nvme.is_dir()  # made at start-up
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    args = parse_args(base(data_prefix, "--zero-stage", "3", "--zero-nvme-path", str(blocker / "nvme")), world_size=2)
    with pytest.raises(StartupError) as error:
        prepare_run(args, verbose=False)
    assert str(error.value) == f"--zero-nvme-path {blocker / 'nvme'}: cannot create the folder (Not a directory)"
    with pytest.raises(ConfigError, match=r"^--zero-nvme-path needs --zero-stage 3 \(got --zero-stage 2\)$"):
        parse_args(base(data_prefix, "--zero-stage", "2", "--zero-nvme-path", str(nvme)), world_size=2)


def test_stage0_fp32_clips_in_the_optimizer(data_prefix):
    config = generate_config(parse_args(base(data_prefix), world_size=1), 1000, 64, on_cuda=False)
    assert config["gradient_clipping"] == 0.0 and config["zero_optimization"] == {"stage": 0}


@pytest.mark.parametrize("flags, json_config, message", [
    (["--global-batch-size", "16"], {"train_batch_size": 32},
     "--global-batch-size 16 disagrees with train_batch_size 32 in --deepspeed_config"),
    (["--zero-stage", "3", "--zero-offload-optimizer"], {"zero_optimization": {"offload_optimizer": {"device": "none"}}},
     "--zero-offload-optimizer disagrees with zero_optimization.offload_optimizer.device 'none' in"),
    (["--zero-stage", "3", "--zero-nvme-path", "/nvme"],
     {"zero_optimization": {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}},
     "--zero-nvme-path /nvme disagrees with zero_optimization.offload_param.device 'cpu' in"),
    (["--bf16"], {"bf16": {"enabled": False}}, "--bf16 disagrees with bf16.enabled False in"),
    (["--clip-grad", "0.5"], {"gradient_clipping": 1.0}, "--clip-grad 0.5 disagrees with gradient_clipping 1.0 in"),
])
def test_a_flag_that_disagrees_with_the_users_json_is_refused(data_prefix, tmp_path, flags, json_config, message):
    user = tmp_path / "ds.json"
    user.write_text(json.dumps(json_config))
    with pytest.raises(ConfigError) as err:
        parse_args(base(data_prefix, *flags, "--deepspeed_config", str(user)), world_size=2)
    assert message in str(err.value) and str(user) in str(err.value)


def test_flags_are_merged_into_the_users_json_the_same_way_for_every_key(data_prefix, tmp_path):
    """megatron/deepspeed_json.py's rule: what only the flags say is written into the JSON the run uses; what
    only the JSON says is the run's; the user's file is never changed."""
    user = tmp_path / "ds.json"
    original = {"zero_optimization": {"stage": 3}, "gradient_clipping": 0.3, "steps_per_print": 7}
    user.write_text(json.dumps(original))
    args = parse_args(base(data_prefix, "--zero-nvme-path", str(tmp_path / "nvme"), "--bf16", "--global-batch-size",
                           "8", "--deepspeed_config", str(user)), world_size=2)
    assert (args.deepspeed.zero_stage, args.deepspeed.offload, args.deepspeed.precision) == (3, "nvme", "bf16")
    assert args.optimizer.clip_grad == 0.3
    config = deepspeed_config(args, 1000, 64, on_cuda=False)
    zero = config["zero_optimization"]
    for section in ("offload_optimizer", "offload_param"):
        assert zero[section] == {"device": "nvme", "nvme_path": str(tmp_path / "nvme")}
    assert config["bf16"] == {"enabled": True} and config["steps_per_print"] == 7
    assert (config["train_batch_size"], config["train_micro_batch_size_per_gpu"],
            config["gradient_accumulation_steps"]) == (8, 2, 2)
    assert json.loads(user.read_text()) == original
    # the JSON alone: its offload and precision are the run's
    user.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
                                "fp16": {"enabled": True}, "train_batch_size": 16}))
    args = parse_args(base(data_prefix, "--deepspeed_config", str(user)), world_size=2, device_type="cuda")
    assert (args.deepspeed.offload, args.deepspeed.precision, args.training.global_batch_size) == \
        ("optimizer+params", "fp16", 16)
    user.write_text(json.dumps({"gradient_accumulation_steps": 3}))
    with pytest.raises(ConfigError, match=r"--global-batch-size 16 is not --micro-batch-size 2 x "
                                          r"gradient_accumulation_steps 3 x data-parallel size 2 \(= 12, "):
        parse_args(base(data_prefix, "--global-batch-size", "16", "--deepspeed_config", str(user)), world_size=2)


def without_micro(prefix, *extra):
    flags = base(prefix, *extra)
    at = flags.index("--micro-batch-size")
    return flags[:at] + flags[at + 2:]


def write_json(tmp_path, config) -> str:
    user = tmp_path / "ds.json"
    user.write_text(json.dumps(config))
    return str(user)


def batches(args):
    train = args.training
    return train.micro_batch_size, train.global_batch_size, train.gradient_accumulation_steps


def test_micro_batch_from_the_json_or_the_flag_and_one_line_without_either(data_prefix, tmp_path):
    user = write_json(tmp_path, {"train_micro_batch_size_per_gpu": 4})
    args = parse_args(without_micro(data_prefix, "--deepspeed_config", user), world_size=2)
    assert batches(args) == (4, 8, 1)
    config = deepspeed_config(args, 1000, 64, on_cuda=False)
    assert (config["train_micro_batch_size_per_gpu"], config["train_batch_size"]) == (4, 8)
    with pytest.raises(ConfigError) as err:
        parse_args(without_micro(data_prefix), world_size=2)
    assert str(err.value) == "--micro-batch-size is required (or train_micro_batch_size_per_gpu in a " \
                             "--deepspeed_config JSON)"
    user = write_json(tmp_path, {"zero_optimization": {"stage": 1}})
    with pytest.raises(ConfigError) as err:
        parse_args(without_micro(data_prefix, "--deepspeed_config", user), world_size=2)
    assert str(err.value) == f"--micro-batch-size is required (or train_micro_batch_size_per_gpu in " \
                             f"--deepspeed_config {user})"


@pytest.mark.parametrize("json_config, with_micro_flag, expected", [
    ({"train_batch_size": 16}, True, (2, 16, 4)),
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}, False, (4, 16, 2)),
    ({"gradient_accumulation_steps": 3}, True, (2, 12, 3)),
    ({"gradient_accumulation_steps": 3, "train_micro_batch_size_per_gpu": 4}, False, (4, 24, 3)),
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, False,
     (2, 16, 4)),
    ({"train_batch_size": 16, "gradient_accumulation_steps": 4}, True, (2, 16, 4)),
])
def test_the_jsons_batch_keys_give_global_batch_and_accumulation(data_prefix, tmp_path, json_config,
                                                                  with_micro_flag, expected):
    """DeepSpeed's rule, train_batch_size = micro x gradient_accumulation_steps x data-parallel size, on 2 ranks."""
    flags = base if with_micro_flag else without_micro
    args = parse_args(flags(data_prefix, "--deepspeed_config", write_json(tmp_path, json_config)), world_size=2)
    assert batches(args) == expected
    config = deepspeed_config(args, 1000, 64, on_cuda=False)
    assert (config["train_micro_batch_size_per_gpu"], config["train_batch_size"],
            config["gradient_accumulation_steps"]) == expected


@pytest.mark.parametrize("json_config, world, message", [
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, 2,
     "train_batch_size 16 is not train_micro_batch_size_per_gpu 2 x gradient_accumulation_steps 3 x data-parallel "
     "size 2 (= 12, DeepSpeed's rule): make them agree, or give only two of them"),
    # agrees on 2 ranks, not on the 4 of this layout
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, 4,
     "train_batch_size 16 is not train_micro_batch_size_per_gpu 2 x gradient_accumulation_steps 4 x data-parallel "
     "size 4 (= 32, DeepSpeed's rule): make them agree, or give only two of them"),
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2}, 2,
     "train_batch_size 10 is not divisible by train_micro_batch_size_per_gpu 2 x data-parallel size 2"),
    ({"gradient_accumulation_steps": 0, "train_micro_batch_size_per_gpu": 2}, 2,
     "gradient_accumulation_steps must be an integer >= 1, got 0"),
    ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2}, 2,
     "train_batch_size must be an integer >= 1, got 'auto'"),
])
def test_batch_keys_that_contradict_each_other_or_the_layout_are_refused(data_prefix, tmp_path, json_config, world,
                                                                         message):
    user = write_json(tmp_path, json_config)
    with pytest.raises(ConfigError) as err:
        parse_args(without_micro(data_prefix, "--deepspeed_config", user), world_size=world)
    assert str(err.value) == f"--deepspeed_config {user}: {message}"


def test_the_jsons_gradient_clipping_when_no_clip_grad(data_prefix, tmp_path):
    """It reaches the config DeepSpeed gets under ZeRO, and our own optimizer at stage 0 in fp32 (DeepSpeed then
    gets 0, or it would clip a second time); a JSON without it gets --clip-grad's default, 1.0."""
    import torch

    from megatron.optimizer import build_optimizer
    user = write_json(tmp_path, {"gradient_clipping": 0.3})
    args = parse_args(base(data_prefix, "--zero-stage", "1", "--deepspeed_config", user), world_size=2)
    assert args.optimizer.clip_grad == 0.3
    assert deepspeed_config(args, 1000, 64, on_cuda=False)["gradient_clipping"] == 0.3
    args = parse_args(base(data_prefix, "--deepspeed_config", user), world_size=1)
    assert deepspeed_config(args, 1000, 64, on_cuda=False)["gradient_clipping"] == 0.0
    assert build_optimizer(torch.nn.Linear(2, 2), args).clip_grad == 0.3
    user = write_json(tmp_path, {"zero_optimization": {"stage": 2}})
    args = parse_args(base(data_prefix, "--deepspeed_config", user), world_size=2)
    assert args.optimizer.clip_grad == 1.0
    assert deepspeed_config(args, 1000, 64, on_cuda=False)["gradient_clipping"] == 1.0


@pytest.mark.parametrize("section, message", [
    ({"optimizer": {"type": "AdamW", "params": {"lr": 0.0003, "betas": [0.9, 0.95]}}},
     '"optimizer" section (AdamW, lr 0.0003) is not used: zero-lab builds AdamW from --lr, --adam-beta1, '
     "--adam-beta2, --adam-eps, --weight-decay (the drivers' LR, ADAM_BETA1, ADAM_BETA2, WEIGHT_DECAY): remove the "
     "section and set those"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 0.001, "warmup_num_steps": 100}}},
     '"scheduler" section (WarmupDecayLR, warmup_max_lr 0.001) is not used: zero-lab\'s LR schedule comes from '
     "--lr, --lr-decay-style, --lr-warmup-fraction/--lr-warmup-iters, --min-lr (the drivers' LR, LR_DECAY_STYLE, "
     "LR_WARMUP_FRACTION, MIN_LR): remove the section and set those"),
])
def test_the_jsons_optimizer_and_scheduler_sections_are_refused(data_prefix, tmp_path, section, message):
    """deepspeed.initialize gets our optimizer and schedule, which win: the JSON's learning rate would be ignored."""
    user = write_json(tmp_path, {"train_batch_size": 8, **section})
    with pytest.raises(ConfigError) as err:
        parse_args(base(data_prefix, "--deepspeed_config", user), world_size=2)
    assert str(err.value) == f"--deepspeed_config {user}: its {message}"


def test_errors_name_the_variable_a_launch_script_set():
    """megatron/flag_sources.py: "(from VAR)" after each flag a launch script derived from VAR, unless the
    user's own extra argument gave the flag again."""
    environ = {"ZERO_LAB_FLAG_SOURCES": "--global-batch-size=GLOBAL_BATCH --micro-batch-size=MICRO_BATCH\n"
                                        "    --sequence-parallel=SP --tensor-model-parallel-size=TP"}
    argv = ["--global-batch-size", "12", "--micro-batch-size", "4", "--sequence-parallel",
            "--tensor-model-parallel-size", "1"]
    assert name_sources("--global-batch-size 12 is not divisible by --micro-batch-size 4 x data-parallel size 2",
                        argv, environ) == ("--global-batch-size 12 (from GLOBAL_BATCH) is not divisible by "
                                           "--micro-batch-size 4 (from MICRO_BATCH) x data-parallel size 2")
    assert name_sources("--sequence-parallel needs --tensor-model-parallel-size > 1", argv, environ) == \
        "--sequence-parallel (from SP) needs --tensor-model-parallel-size (from TP) > 1"
    assert name_sources("--global-batch-size 16 bad", [*argv, "--global-batch-size", "16"], environ) == \
        "--global-batch-size 16 bad"
    assert name_sources("--global-batch-size 12 bad", argv, {}) == "--global-batch-size 12 bad"


def test_the_variable_is_named_beside_the_given_value_not_the_checkpoints():
    """Issue 56, item 11: the refusal of a resume at another expert-parallel size named the checkpoint's value
    first, and "(from EP_SIZE)" went on it; it belongs to the value this run was given."""
    from megatron.checkpointing.resume_check import moe_layout_refusal

    saved = {"zero_stage": 1, "data_parallel_size": 2, "sequence_parallel_size": 1, "expert_parallel_size": 1}
    refusal = moe_layout_refusal(saved, {**saved, "expert_parallel_size": 2})
    named = name_sources(refusal, ["--moe-expert-parallel-size", "2", "--zero-stage", "1"],
                         {"ZERO_LAB_FLAG_SOURCES": "--moe-expert-parallel-size=EP_SIZE"})
    assert named.count("(from EP_SIZE)") == 1
    assert "--moe-expert-parallel-size 1 (from" not in named
    assert "this run has data-parallel size 2 at ZeRO stage 1 and --moe-expert-parallel-size 2 (from EP_SIZE);" in named
    # a message that gives the flag only another value (the saved one) names no variable
    assert name_sources("resume with --moe-expert-parallel-size 1", ["--moe-expert-parallel-size", "2"],
                        {"ZERO_LAB_FLAG_SOURCES": "--moe-expert-parallel-size=EP_SIZE"}) == \
        "resume with --moe-expert-parallel-size 1"


def test_lr_schedule_warmup_then_cosine_to_min(data_prefix):
    import torch
    args = parse_args(base(data_prefix, "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "4",
                           "--lr-decay-iters", "14"), world_size=1)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    schedule = LRSchedule(optimizer, args.optimizer, train_iters=20)
    lrs = []
    for _ in range(16):
        lrs.append(schedule.get_lr()[0])
        schedule.step()
    assert lrs[:5] == pytest.approx([0.0, 2.5e-4, 5e-4, 7.5e-4, 1e-3])  # Megatron-DeepSpeed's (test_lr_schedule.py)
    assert lrs[9] == pytest.approx(1e-4 + 0.5 * 9e-4)  # halfway through the cosine
    assert lrs[14:] == pytest.approx([1e-4, 1e-4])
    state = schedule.state_dict()
    resumed = LRSchedule(optimizer, args.optimizer, train_iters=20)
    resumed.load_state_dict(state)
    assert resumed.get_lr() == schedule.get_lr()


@pytest.mark.parametrize("extra, message", [
    (["--hidden-size", "100", "--num-attention-heads", "3"],
     "error: --hidden-size 100 is not divisible by --num-attention-heads 3"),
    (["--data-path", "/nonexistent/prefix"], "error: --data-path: /nonexistent/prefix.bin does not exist"),
    # a parallel layout the world cannot hold (ParallelLayoutError) is one line too, not a traceback
    (["--tensor-model-parallel-size", "3"],
     "error: world size 1 is not divisible by --tensor-model-parallel-size 3 x --pipeline-model-parallel-size 1"),
])
def test_pretrain_gpt_reports_one_line_and_exits_1(data_prefix, extra, message):
    result = subprocess.run([sys.executable, str(REPO_ROOT / "pretrain_gpt.py"), *base(data_prefix, *extra)],
                            env=test_env(MASTER_PORT=free_port()), capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [
        line for line in result.stderr.splitlines() if line.strip() and "error" in line]
