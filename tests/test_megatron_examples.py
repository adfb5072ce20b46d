"""Two of Megatron-DeepSpeed's example command lines train here with their flags unchanged: the MoE one
(examples_deepspeed/MoE/ds_pretrain_gpt_125M_MoE64.sh) and the curriculum one
(examples_deepspeed/rebase/ds_pretrain_gpt_1.3B_rope_slw.sh). Each list below is the script's option blocks in
its order, with its variables set as the script sets them, shrunk in shape only (layers, width, sequence, batch,
experts, ranks, tokens) to run on 2 CPU ranks, and its DeepSpeed JSON written from the script's template by the
script's substitutions. One change that is not a shape: CPU ranks have no fp16, so --fp16 (and the JSON's fp16
section) becomes bf16. The runs stop by --train-tokens, counted in consumed tokens as Megatron-DeepSpeed counts
them, long before --train-iters/--train-samples would stop them."""
import json
import re
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, free_port, test_env

pytestmark = pytest.mark.slow

ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+) \| consumed tokens:\s+(\d+) \|"
                       r".*?learning rate: (\S+) \|.*?lm loss: (\S+) \|")


def _data_options(data_dir) -> list[str]:
    return ["--vocab-file", str(data_dir / "gpt2-vocab.json"), "--merge-file", str(data_dir / "gpt2-merges.txt"),
            "--data-path", str(data_dir / "dolly_text_document"), "--data-impl", "mmap"]


def _bf16_for_cpu(config: dict) -> dict:
    """The template's fp16 section off and bf16 on: the one change that is not a shape (CPU ranks have no fp16)."""
    config["fp16"]["enabled"] = False
    config["bf16"] = {"enabled": True}
    return config


def _train(argv: list[str], config: dict, tmp_path) -> tuple[subprocess.CompletedProcess, list[tuple]]:
    config_json = tmp_path / "ds_config.json"
    config_json.write_text(json.dumps(config, indent=2))
    argv = ["--bf16" if flag == "--fp16" else flag for flag in argv]
    argv = [str(config_json) if flag == "CONFIG_JSON" else flag for flag in argv]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(REPO_ROOT / "pretrain_gpt.py"), *argv]
    run = subprocess.run(cmd, env=test_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    lines = [(int(it), int(samples), int(tokens), float(lr), float(loss))
             for it, samples, tokens, lr, loss in ITERATION.findall(run.stdout)]
    assert lines, run.stdout[-3000:]
    return run, lines


def _stopped_by_tokens(lines: list[tuple], train_tokens: int) -> None:
    """The run ends at the first iteration whose consumed tokens reach --train-tokens (Megatron-DeepSpeed's loop
    condition), every earlier one below it."""
    tokens = [line[2] for line in lines]
    assert tokens[-1] >= train_tokens and all(t < train_tokens for t in tokens[:-1]), tokens


def test_the_moe_example_script_trains_with_its_flags(dolly_data_dir, tmp_path):
    # ds_pretrain_gpt_125M_MoE64.sh's variables, shrunk in shape
    seq_len, num_layers, hidden_size, num_attn_heads, global_batch_size, batch_size = 64, 2, 64, 4, 8, 2
    train_tokens = 6 * global_batch_size * seq_len  # 6 iterations
    train_iters = train_tokens * 3 // global_batch_size // seq_len
    warmup_tokens, lr_decay_tokens = 2 * global_batch_size * seq_len, train_tokens
    ep_size, ep_parallel_size, mp_size, pp_size = 4, 2, 1, 1
    lr, min_lr, mlc = 4.5e-4, 4.5e-06, 0.01
    log_interval, eval_iters, eval_interval, save_interval, init_std = 1, 10, 100, 10000, 0.014
    checkpoint_path, tensorboard_dir = tmp_path / "checkpoint", tmp_path / "tensorboard"
    megatron_options = [
        "--override-opt_param-scheduler", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--tensor-model-parallel-size", mp_size, "--moe-expert-parallel-size", ep_parallel_size,
        "--num-experts", ep_size, "--moe-loss-coeff", mlc, "--moe-train-capacity-factor", "1.0",
        "--moe-eval-capacity-factor", "1.0", "--moe-min-capacity", "4", "--init-method-std", init_std,
        "--lr-decay-tokens", lr_decay_tokens, "--lr-warmup-tokens", warmup_tokens, "--micro-batch-size", batch_size,
        "--exit-duration-in-mins", "30000000", "--global-batch-size", global_batch_size, "--num-layers", num_layers,
        "--hidden-size", hidden_size, "--num-attention-heads", num_attn_heads, "--seq-length", seq_len,
        "--max-position-embeddings", seq_len, "--train-tokens", train_tokens, "--train-iters", train_iters,
        "--lr", lr, "--min-lr", min_lr, "--lr-decay-style", "cosine", "--split", "98,2,0",
        "--log-interval", log_interval, "--eval-interval", eval_interval, "--eval-iters", eval_iters,
        "--save-interval", save_interval, "--weight-decay", "0.1", "--clip-grad", "1.0", "--hysteresis", "2",
        "--num-workers", "0", "--fp16", "--load", checkpoint_path, "--save", checkpoint_path,
        "--tensorboard-queue-size", "1", "--log-timers-to-tensorboard", "--log-batch-size-to-tensorboard",
        "--log-validation-ppl-to-tensorboard", "--tensorboard-dir", tensorboard_dir,
        "--checkpoint-activations",  # ACTIVATION_CHECKPOINT="true"
        "--create-moe-param-group",  # EP_SIZE > 1
    ]
    config = {  # ds_config_gpt_TEMPLATE.json as the script fills it in (ZERO_STAGE 0, PRESCALE_GRAD true, CL off)
        "train_batch_size": global_batch_size, "train_micro_batch_size_per_gpu": batch_size,
        "steps_per_print": log_interval, "zero_optimization": {"stage": 0}, "gradient_clipping": 1.0,
        "prescale_gradients": True,
        "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1,
                 "initial_scale_power": 11},
        "bf16": {"enabled": False},
        "curriculum_learning": {"enabled": False, "curriculum_type": "seqlen", "min_difficulty": 80,
                                "max_difficulty": seq_len, "schedule_type": "fixed_linear",
                                "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8}},
        "wall_clock_breakdown": False,
    }
    deepspeed_options = ["--deepspeed", "--deepspeed_config", "CONFIG_JSON", "--pipeline-model-parallel-size", pp_size,
                         "--no-pipeline-parallel",  # EP_SIZE > 1
                         "--deepspeed-activation-checkpointing"]  # ACTIVATION_CHECKPOINT="true"
    argv = [str(flag) for flag in megatron_options + _data_options(dolly_data_dir) + deepspeed_options]
    run, lines = _train(argv, _bf16_for_cpu(config), tmp_path)
    _stopped_by_tokens(lines, train_tokens)
    assert [line[0] for line in lines] == list(range(1, 7))
    # warm-up by tokens, as Megatron-DeepSpeed's scheduler steps it: after iteration k it is set from the tokens
    # consumed before it, so the lines show 0, then 512/1024 of --lr, then --lr (docs/schedule.md)
    assert [line[3] for line in lines[:3]] == pytest.approx([0.0, lr * 0.5, lr], rel=1e-3)
    assert " moe loss: " in run.stdout
    assert (checkpoint_path / "latest").read_text().strip() == "global_step6"
    # the tracker the example scripts read to find the iteration to resume (their "iteration_file")
    assert (checkpoint_path / "latest_checkpointed_iteration.txt").read_text() == "6"
    assert list(tensorboard_dir.glob("events.out.tfevents.*"))


def test_the_curriculum_example_script_trains_with_its_flags(dolly_data_dir, tmp_path):
    # ds_pretrain_gpt_1.3B_rope_slw.sh's variables, shrunk in shape (TP 2, PP 1 on the 2 ranks)
    seq_len, num_layers, hidden_size, num_attn_heads, global_batch_size, batch_size = 128, 2, 64, 4, 8, 2
    lr, min_lr, init_std = 2.0e-4, 1.0e-6, 0.013
    train_tokens = 6000
    train_samples = train_tokens * 2 // seq_len
    lr_warmup_tokens = 3 * 2 * global_batch_size * seq_len
    lr_decay_tokens = train_tokens
    mp_size, pp_size, zero_stage = 2, 1, 1
    cl_step, cl_min = lr_warmup_tokens // 3 // global_batch_size // seq_len, 64
    log_interval, eval_iters, eval_interval, save_interval, seed, num_workers = 1, 10, 100, 100, 1234, 0
    checkpoint_path, tensorboard_path = tmp_path / "checkpoint", tmp_path / "tensorboard"
    data_options = _data_options(dolly_data_dir)
    megatron_options = [
        "--override-opt_param-scheduler", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--tensor-model-parallel-size", mp_size, "--init-method-std", init_std, "--lr-decay-tokens", lr_decay_tokens,
        "--lr-warmup-tokens", lr_warmup_tokens, "--micro-batch-size", batch_size, "--exit-duration-in-mins",
        "30000000", "--global-batch-size", global_batch_size, "--num-layers", num_layers, "--hidden-size",
        hidden_size, "--num-attention-heads", num_attn_heads, "--seq-length", seq_len, "--max-position-embeddings",
        seq_len, "--train-tokens", train_tokens, "--train-samples", train_samples, "--lr", lr, "--min-lr", min_lr,
        "--lr-decay-style", "cosine", "--split", "949,50,1", "--log-interval", log_interval, "--eval-interval",
        eval_interval, "--eval-iters", eval_iters, "--save-interval", save_interval, "--weight-decay", "0.1",
        "--clip-grad", "1.0", "--hysteresis", "2", "--num-workers", num_workers, "--fp16", "--seed", seed,
        "--load", checkpoint_path, "--save", checkpoint_path, "--no-async-tensor-model-parallel-allreduce",
        "--use-rotary-position-embeddings", "--rotary-percent", "0.25", "--tensorboard-queue-size", "1",
        "--log-timers-to-tensorboard", "--log-batch-size-to-tensorboard", "--log-validation-ppl-to-tensorboard",
        "--tensorboard-dir", tensorboard_path,
        "--checkpoint-activations",  # activation_checkpoint="true"
        "--log-optimizer-states-to-tensorboard",  # log_optimizer_state="true"
    ]
    config = {  # ds_config_gpt_slw_TEMPLATE.json as the script fills it in (prescale_grad false at ZeRO > 0)
        "train_batch_size": global_batch_size, "train_micro_batch_size_per_gpu": batch_size,
        "steps_per_print": log_interval, "zero_optimization": {"stage": zero_stage}, "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1,
                 "initial_scale_power": 11},
        "wall_clock_breakdown": False,
        "curriculum_learning": {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": cl_min,
                                "max_difficulty": seq_len, "schedule_type": "fixed_linear",
                                "schedule_config": {"total_curriculum_step": cl_step, "difficulty_step": 8}},
    }
    deepspeed_options = ["--deepspeed", "--deepspeed_config", "CONFIG_JSON", "--zero-stage", zero_stage,
                         "--pipeline-model-parallel-size", pp_size,
                         "--deepspeed-activation-checkpointing"]  # activation_checkpoint="true"
    argv = [str(flag) for flag in megatron_options + data_options + deepspeed_options]
    run, lines = _train(argv, _bf16_for_cpu(config), tmp_path)
    _stopped_by_tokens(lines, train_tokens)
    # the curriculum's shorter sequences early on: the first iterations consume fewer than a full batch's tokens
    steps = [b[2] - a[2] for a, b in zip([(0, 0, 0)] + lines, lines)]
    assert steps[0] < global_batch_size * seq_len and steps[-1] == global_batch_size * seq_len, steps
    assert (checkpoint_path / "latest").read_text().strip() == f"global_step{lines[-1][0]}"
    assert list(tensorboard_path.glob("events.out.tfevents.*"))
