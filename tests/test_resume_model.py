"""A resume of another model or precision (issue 56, item 2): each ended in two ranks' tracebacks (49 to 101 lines:
`size mismatch for position_embeddings.weight`, `FileNotFoundError: ...bf16_zero_pp_rank_1_...`); the start-up check
(megatron/checkpointing/resume_model.py) reads what the checkpoint's marker records and refuses in one line naming
the setting, its saved and its given value and the remedy. The marker here is written as a save writes it
(protocol.commit of current_layout); the real runs are at the end."""
import re
from dataclasses import replace

import pytest

from megatron.arguments import parse_args
from megatron.checkpointing import protocol
from megatron.checkpointing.resume_check import check_layout, current_layout
from megatron.startup import check_checkpoint_to_load

TAG = "global_step2"


def args_of(load, *extra, world_size=1):
    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
             "--micro-batch-size", "2", "--train-iters", "10", "--data-path", "x", "--tokenizer-type",
             "NullTokenizer", "--vocab-size", "1000", "--zero-stage", "1", "--load", str(load), *extra]
    args = parse_args(flags, world_size=world_size)
    # the start-up step fills the padded vocabulary in from the tokenizer before the check (megatron/startup.py)
    return replace(args, model=replace(args.model, padded_vocab_size=1024))


def saved_by(load, args, drop=()):
    """A checkpoint `args` saved, its marker as save_checkpoint writes it (`drop`: keys an older marker lacks)."""
    layout = {key: value for key, value in current_layout(args).items() if key not in drop}
    protocol.prepare_save(str(load), TAG)
    staging = load / protocol.staging_tag(TAG)
    staging.mkdir()
    (staging / "mp_rank_00_model_states.pt").write_bytes(b"")
    protocol.commit(str(load), TAG, {"iteration": 2, "layout": layout}, exchange=False)


def refusal(load, *resumed, world_size=1) -> str:
    with pytest.raises(protocol.CheckpointError) as refused:
        check_layout(args_of(load, *resumed, world_size=world_size), TAG)
    message = str(refused.value)
    assert "\n" not in message
    prefix = f"--load {load}: cannot resume {TAG}: "
    assert message.startswith(prefix), message
    return message[len(prefix):]


NEW_FOLDER = "give the run its own folder (RUN_NAME) or FRESH=1 to start this one afresh"
FINETUNE = "or take its weights with --finetune (iteration and optimizer start afresh)"


def test_a_shorter_sequence_on_a_learned_position_table_names_the_table(tmp_path):
    """SEQ_LEN=64 on a run saved at 128: the launch scripts give --max-position-embeddings from SEQ_LEN too."""
    saved_by(tmp_path, args_of(tmp_path))
    assert refusal(tmp_path, "--seq-length", "64", "--max-position-embeddings", "64") == (
        "it was saved from a model with --max-position-embeddings 128, this run's has "
        "--max-position-embeddings 64 (--seq-length 64): resume it with --max-position-embeddings 128 (a "
        f"shorter sequence trains on the table), or {NEW_FOLDER}")
    # the table's rows are what must match: a shorter sequence on the same table resumes
    check_layout(args_of(tmp_path, "--seq-length", "64", "--max-position-embeddings", "128"), TAG)


def test_rotary_positions_have_no_table_to_match(tmp_path):
    saved_by(tmp_path, args_of(tmp_path, "--use-rotary-position-embeddings"))
    check_layout(args_of(tmp_path, "--use-rotary-position-embeddings", "--seq-length", "64"), TAG)


def test_another_shape_names_each_setting_with_both_values(tmp_path):
    saved_by(tmp_path, args_of(tmp_path))
    assert refusal(tmp_path, "--hidden-size", "128", "--num-layers", "4", "--swiglu") == (
        "it was saved from a model with --num-layers 2, --hidden-size 64, --ffn-hidden-size 256, no --swiglu, this "
        "run's has --num-layers 4, --hidden-size 128, --ffn-hidden-size 320, --swiglu: resume it with --num-layers 2 "
        f"--hidden-size 64 --ffn-hidden-size 256 without --swiglu, or {NEW_FOLDER}")


def test_another_vocabulary_names_the_tokenizer(tmp_path):
    saved_by(tmp_path, args_of(tmp_path))
    saved = args_of(tmp_path)
    with pytest.raises(protocol.CheckpointError) as refused:
        check_layout(replace(saved, model=replace(saved.model, padded_vocab_size=50304)), TAG)
    assert str(refused.value).endswith(
        "it was saved from a model with a padded vocabulary of 1024, this run's has a padded vocabulary of 50304: "
        "resume it with the tokenizer it was saved with (--tokenizer-type and its files, or --vocab-size; "
        f"--make-vocab-size-divisible-by), or {NEW_FOLDER}")


def test_fp32_resumed_in_bf16_offers_the_universal_conversion(tmp_path):
    saved_by(tmp_path, args_of(tmp_path, world_size=2))
    assert refusal(tmp_path, "--bf16", world_size=2) == (
        "it was saved in fp32, this run is bf16 (--bf16); DeepSpeed names and shapes a checkpoint's optimizer files by "
        "its precision: resume it with --universal-checkpoint, which converts it (docs/checkpoints.md), or resume it "
        f"in fp32 (no --bf16 or --fp16), or {NEW_FOLDER}, {FINETUNE}")
    check_layout(args_of(tmp_path, "--bf16", "--universal-checkpoint", world_size=2), TAG)


def test_at_zero_stage_0_no_conversion_is_offered(tmp_path):
    """ds_to_universal reads ZeRO's optimizer files, which stage 0 does not write."""
    saved_by(tmp_path, args_of(tmp_path, "--bf16", "--zero-stage", "0"))
    assert refusal(tmp_path, "--zero-stage", "0") == (
        "it was saved in bf16, this run is fp32 (no --bf16 or --fp16); DeepSpeed names and shapes a "
        f"checkpoint's optimizer files by its precision: resume it in bf16 (--bf16), or {NEW_FOLDER}, {FINETUNE}")


def test_fp16_is_not_offered_the_conversion():
    """Measured both ways between fp32 and bf16 (tests below; the Z1 driver bf16 -> fp32 on 2 ranks); fp16 not."""
    from megatron.checkpointing.resume_model import precision_refusal

    assert "--universal-checkpoint" in precision_refusal("bf16", "fp32", convertible=True)
    assert "--universal-checkpoint" not in precision_refusal("fp16", "bf16", convertible=True)
    assert "--universal-checkpoint" not in precision_refusal("fp32", "bf16", convertible=False)


def test_other_experts_per_layer_are_refused(tmp_path):
    saved_by(tmp_path, args_of(tmp_path, "--num-experts", "4", world_size=2))
    assert refusal(tmp_path, "--num-experts", "8", world_size=2) == (
        "it was saved with --num-experts 4 in 1 of 2 layers, this run has --num-experts 8 in 1 of 2 layers: resume it "
        f"with --num-experts 4 and the --expert-interval it was saved with, or {NEW_FOLDER}")


def test_a_run_setting_that_is_not_the_models_resumes(tmp_path):
    """Dropout, recompute and the routing's capacity are the run's to change on a resume."""
    saved_by(tmp_path, args_of(tmp_path))
    check_layout(args_of(tmp_path, "--hidden-dropout", "0", "--checkpoint-activations"), TAG)


def test_a_marker_from_before_the_records_leaves_it_to_deepspeed(tmp_path):
    saved_by(tmp_path, args_of(tmp_path), drop=("model", "precision"))
    check_layout(args_of(tmp_path, "--hidden-size", "128", "--bf16"), TAG)


def test_finetune_takes_weights_into_another_model_and_precision(tmp_path):
    """--finetune (and INIT_HF, which converts to a checkpoint loaded so) is how weights go into another shape."""
    saved_by(tmp_path, args_of(tmp_path))
    check_checkpoint_to_load(args_of(tmp_path, "--finetune", "--seq-length", "64", "--max-position-embeddings", "64",
                                     "--bf16"))


@pytest.fixture(scope="module")
def saved_run(checkpoint_run, tmp_path_factory):
    """global_step8 of tests/runs.py's saved-checkpoint run (2 CPU ranks, ZeRO-1, fp32, 8 iterations of 8 samples,
    --lr 1e-3 with a cosine decay to 0), copied: the resumes below write into it."""
    import shutil

    folder = tmp_path_factory.mktemp("resume_model") / "ckpt"
    shutil.copytree(checkpoint_run.folder / "global_step8", folder / "global_step8")
    (folder / "latest").write_text("global_step8")
    return folder


def error_lines(run) -> list[str]:
    return [line for line in (run.stdout + run.stderr).splitlines() if "error: " in line]


@pytest.mark.slow
def test_a_real_resume_in_bf16_or_on_a_shorter_table_is_one_line_and_bf16_converts(dolly_data_dir, saved_run):
    """The issue's cases on a real checkpoint, each refused before the ranks meet (one rank here: the check runs
    before the layout's own). Then bf16 through --universal-checkpoint, as the line offers, trains on; its longer
    --train-iters changes the schedule, which one line says (item 9)."""
    from runs import run_pretrain

    load = ["--zero-stage", "1", "--load", str(saved_run)]
    bf16 = run_pretrain(dolly_data_dir, *load, "--bf16", ranks=1, expect=1)
    assert error_lines(bf16) == [
        f"error: --load {saved_run}: cannot resume global_step8: it was saved in fp32, this run is bf16 (--bf16); "
        "DeepSpeed names and shapes a checkpoint's optimizer files by its precision: resume it with "
        "--universal-checkpoint, which converts it (docs/checkpoints.md), or resume it in fp32 (no --bf16 or --fp16), "
        f"or {NEW_FOLDER}, {FINETUNE}"], bf16.stdout[-2000:] + bf16.stderr[-2000:]
    # torchrun's own report follows (ChildFailedError); the rank stopped before DeepSpeed's loader looked for files
    assert "FileNotFoundError" not in bf16.stdout + bf16.stderr and "size mismatch" not in bf16.stdout + bf16.stderr
    shorter = run_pretrain(dolly_data_dir, *load, "--seq-length", "32", ranks=1, expect=1)
    assert error_lines(shorter) == [
        f"error: --load {saved_run}: cannot resume global_step8: it was saved from a model with "
        "--max-position-embeddings 64, this run's has --max-position-embeddings 32 (--seq-length "
        "32): resume it with --max-position-embeddings 64 (a shorter sequence trains on the table), or "
        f"{NEW_FOLDER}"]

    converted = run_pretrain(dolly_data_dir, *load, "--bf16", "--universal-checkpoint", "--train-iters", "10",
                             ranks=1)
    assert f"loaded checkpoint {saved_run / 'global_step8_universal'}" in converted.stdout
    assert re.findall(r"^ iteration +(\d+)/ +10 \|", converted.stdout, re.M) == ["9", "10"]
    note = ("note: the flags change the learning-rate schedule the checkpoint was saved with (decay samples "
            "(--lr-decay-iters, else --train-iters, x the global batch; or --lr-decay-samples) 64 -> 80): the rate "
            "goes on at 1.46E-04 where the saved schedule gives 0.00E+00; --use-checkpoint-opt_param-scheduler keeps "
            "the saved schedule")
    assert converted.stdout.splitlines().count(note) == 1, converted.stdout[-3000:]


@pytest.mark.slow
def test_a_real_extended_run_keeps_its_saved_schedule_with_the_flag(dolly_data_dir, saved_run, tmp_path):
    """Item 9 on 2 ranks: 8 iterations extended to 10 with --use-checkpoint-opt_param-scheduler train on at the
    saved schedule's rate past its end (--min-lr, 0 here), without the line."""
    import shutil

    from runs import run_pretrain

    folder = tmp_path / "ckpt"
    shutil.copytree(saved_run / "global_step8", folder / "global_step8")
    (folder / "latest").write_text("global_step8")
    kept = run_pretrain(dolly_data_dir, "--zero-stage", "1", "--load", str(folder), "--train-iters", "10",
                        "--use-checkpoint-opt_param-scheduler")
    rates = re.findall(r"^ iteration +(\d+)/ +10 \|.*\| learning rate: (\S+) \|", kept.stdout, re.M)
    assert rates == [("9", "0.000E+00"), ("10", "0.000E+00")], kept.stdout[-3000:]
    assert "learning-rate schedule" not in kept.stdout
