"""Rotary position embeddings (--use-rotary-position-embeddings, --rotary-percent): the flags and their
refusals, no learned position table (in the model and in the accounting), GPT-NeoX's rotation, relative
positions, and a loss that does not depend on how the sequence is split (the KV cache, generation)."""
import subprocess

import pytest
import torch

from conftest import REPO_ROOT, driver_env, iteration_losses, tool_in_process
from megatron.checkpointing.resume_check import positions_refusal
from megatron.arguments import parse_args
from megatron.errors import ZeroLabError
from megatron.inference.generation import SamplingConfig, generate
from megatron.model import GPTConfig, GPTModel, ModelConfigError
from megatron.accounting import count_parameters, parameter_groups_on_rank
from megatron.accounting.predict.step_time import _modules
from megatron.model.kv_cache import KVCache
from megatron.model.rotary import RotaryEmbedding
from megatron.saved_model.reader import load_checkpoint_weights, save_checkpoint_weights
from runs import run_pretrain

VOCAB, PADDED = 120, 128


def rotary_config(**overrides) -> GPTConfig:
    shape = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=48, max_position_embeddings=48,
                 padded_vocab_size=PADDED, init_method_std=0.5, hidden_dropout=0.0, attention_dropout=0.0,
                 use_rotary_position_embeddings=True)
    return GPTConfig(**{**shape, **overrides})


def rotary_model(seed: int = 3, **overrides) -> GPTModel:
    torch.manual_seed(seed)
    return GPTModel(rotary_config(**overrides)).eval()


def flags(*extra):
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "2", "--train-iters", "10", "--data-path", "unused",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", *extra]


def test_flags_parse_into_the_model_config():
    model = parse_args(flags("--use-rotary-position-embeddings", "--rotary-percent", "0.5")).model
    assert (model.use_rotary_position_embeddings, model.rotary_percent, model.rotary_dim) == (True, 0.5, 8)
    default = parse_args(flags()).model
    assert (default.use_rotary_position_embeddings, default.rotary_percent) == (False, 1.0)


@pytest.mark.parametrize("extra, message", [
    (["--rotary-percent", "0"], "--rotary-percent must be in (0, 1], got 0.0"),
    (["--rotary-percent", "1.5"], "--rotary-percent must be in (0, 1], got 1.5"),
    # int(16 x 0.2) = 3 dimensions: rotate-half needs an even number
    (["--use-rotary-position-embeddings", "--rotary-percent", "0.2"],
     "--rotary-percent 0.2 rotates 3 of each head's 16 dimensions; it must be an even number >= 2"),
])
def test_bad_rotary_percent_is_one_line_naming_the_flag(extra, message):
    with pytest.raises(ZeroLabError) as err:
        parse_args(flags(*extra))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_rotary_model_has_no_position_table_and_the_accounting_agrees():
    model = rotary_model()
    assert not any("position" in name for name, _ in model.named_parameters())
    assert "position_embeddings.weight" not in model.state_dict()
    config = model.config
    assert count_parameters(config) == sum(p.numel() for p in model.parameters())
    learned = GPTConfig(**{**config.to_dict(), "use_rotary_position_embeddings": False})
    assert count_parameters(learned) - count_parameters(config) == 48 * 64
    matrices, _ = parameter_groups_on_rank(config)
    assert sum(matrices) == sum(parameter_groups_on_rank(learned)[0]) - 48 * 64
    assert "positions" not in [module.kind for module in _modules(config, 1, 1, 0)]
    assert "positions" in [module.kind for module in _modules(learned, 1, 1, 0)]


def test_nothing_outlives_the_step():
    """The cos and sin are the chunk's own positions' and only the backward keeps them: after it the module holds
    no tensor (a cache would stay between steps, and one from position 0 on the last Ulysses rank would hold the
    whole sequence's angles in every layer)."""
    rotary = RotaryEmbedding(8)
    x = torch.randn(1, 2, 16, 8, requires_grad=True)
    rotary(x, 48).sum().backward()
    assert not [name for name, value in vars(rotary).items() if isinstance(value, torch.Tensor)]
    cos, _ = rotary._angles(48, 16, x.device)
    assert torch.equal(cos, rotary._angles(0, 64, x.device)[0][48:])  # positions 48..63, as a slice from 0 gives


def test_rotation_is_gpt_neoxs():
    from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, 10, 16), torch.randn(2, 3, 10, 16)
    rotary = RotaryEmbedding(8)  # half of each head, as --rotary-percent 0.5
    inverse = 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8)
    angles = torch.outer(torch.arange(4, 14).float(), inverse).repeat(1, 2)
    expected_q, expected_k = apply_rotary_pos_emb(q[..., :8], k[..., :8], angles.cos()[None], angles.sin()[None])
    torch.testing.assert_close(rotary(q, 4), torch.cat((expected_q, q[..., 8:]), -1))
    torch.testing.assert_close(rotary(k, 4), torch.cat((expected_k, k[..., 8:]), -1))


def test_attention_scores_depend_on_the_distance_only():
    torch.manual_seed(1)
    rotary = RotaryEmbedding(16)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    scores = [(rotary(q, m) * rotary(k, m - 5)).sum().item() for m in (5, 20, 300)]
    assert scores[0] == pytest.approx(scores[1], abs=1e-4) and scores[0] == pytest.approx(scores[2], abs=1e-4)
    assert (rotary(q, 5) * rotary(k, 5)).sum().item() != pytest.approx(scores[0], abs=1e-3)


def test_positions_matter():
    """No position table, yet the order of the tokens changes the logits (a bag of words would not)."""
    model = rotary_model()
    ids = torch.randint(0, VOCAB, (1, 20))
    positions = torch.arange(20).unsqueeze(0)
    swapped = ids.clone()
    swapped[0, [3, 7]] = ids[0, [7, 3]]
    with torch.no_grad():
        assert not torch.allclose(model(ids, positions)[0, -1], model(swapped, positions)[0, -1], atol=1e-3)


@pytest.mark.parametrize("percent", [1.0, 0.5])
def test_loss_does_not_depend_on_how_the_sequence_is_split(percent):
    """The full sequence at once, or a prefix and then the rest through the KV cache (in chunks and one
    token at a time): the same logits and losses. Decoding step t rotates by position t's angles."""
    model = rotary_model(rotary_percent=percent)
    ids = torch.randint(0, VOCAB, (2, 31), generator=torch.Generator().manual_seed(5))
    tokens, labels = ids[:, :-1], ids[:, 1:]
    positions = torch.arange(30).unsqueeze(0).expand(2, -1)
    with torch.no_grad():
        full_logits, full_loss = model(tokens, positions), model(tokens, positions, labels)
        cache = KVCache(model.config.num_layers, 30)
        chunks = [(0, 11), (11, 12), (12, 20)] + [(i, i + 1) for i in range(20, 30)]
        logits = torch.cat([model(tokens[:, a:b], positions[:, a:b], kv_cache=cache) for a, b in chunks], dim=1)
        cache = KVCache(model.config.num_layers, 30)
        loss = torch.cat([model(tokens[:, a:b], positions[:, a:b], labels[:, a:b], kv_cache=cache)
                          for a, b in ((0, 13), (13, 30))], dim=1)
    torch.testing.assert_close(logits, full_logits, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(loss, full_loss, rtol=1e-5, atol=1e-5)


def test_generation_with_the_cache_equals_recomputing_the_prefix():
    model = rotary_model()
    greedy = SamplingConfig(greedy=True)
    prompt = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(2)).tolist()
    cached = generate(model, prompt, 30, greedy, eod=VOCAB - 1, vocab_size=VOCAB, use_cache=True)
    full = generate(model, prompt, 30, greedy, eod=VOCAB - 1, vocab_size=VOCAB, use_cache=False)
    assert cached.tokens == full.tokens
    assert len(set(cached.tokens)) > 3


def test_bf16_model_keeps_the_angles_fp32():
    model = rotary_model(params_dtype=torch.bfloat16)
    ids = torch.randint(0, VOCAB, (1, 40))
    with torch.no_grad():
        logits = model(ids, torch.arange(40).unsqueeze(0))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()
    cos, _ = model.layers[0].self_attention.rotary._angles(0, 40, torch.device("cpu"))
    assert cos.dtype == torch.float32


def test_config_error_without_the_flag_is_not_raised_for_odd_rotary_dims():
    """--rotary-percent alone (no rotary) only needs to be in (0, 1]: its width matters with rotary on."""
    assert GPTConfig(**{**rotary_config().to_dict(), "use_rotary_position_embeddings": False,
                        "rotary_percent": 0.2}).rotary_dim == 3
    with pytest.raises(ModelConfigError):
        rotary_config(rotary_percent=0.2)


def test_hf_gpt2_export_refuses_a_rotary_model_in_one_line(tmp_path, capsys):
    model = rotary_model()
    save_checkpoint_weights(str(tmp_path / "ckpt"), model.config, model.state_dict(), {}, "test")
    code, out, err = tool_in_process(capsys, "checkpoint_to_hf.py", "--load", tmp_path / "ckpt",
                                     "--output", tmp_path / "hf")
    assert code == 1 and out == ""
    assert err.strip().splitlines() == [
        f"error: {tmp_path / 'ckpt' / 'global_step0'}: the model has rotary positions "
        "(--use-rotary-position-embeddings), which GPT-2 has not (it learns a position table): no Hugging Face "
        "GPT-2 export"]
    assert not (tmp_path / "hf").exists()


def test_a_checkpoints_positions_must_be_the_runs():
    """The start-up check (megatron/checkpointing/resume_check.py) and --finetune say which flag to change;
    a checkpoint saved before rotary existed recorded no positions: it has a learned table."""
    assert positions_refusal("learned", "learned") is None and positions_refusal("rotary", "rotary") is None
    assert positions_refusal("rotary", "learned") == ("it was saved with rotary positions, this model has learned "
                                                      "positions: add --use-rotary-position-embeddings")
    assert positions_refusal("learned", "rotary").endswith(": drop --use-rotary-position-embeddings")


@pytest.mark.slow
def test_the_z1_driver_trains_a_rotary_model_and_a_learned_run_refuses_its_checkpoint(dolly_data_dir, tmp_path):
    """POSITION_EMBEDDING_TYPE=rotary through examples_zero/gpt_deepspeed_Z1.sh on 2 CPU ranks: the loss falls,
    the checkpoint has no position table, and resuming it (or fine-tuning from it) with learned positions is one
    line naming the flag."""
    env = driver_env(dolly_data_dir, tmp_path, POSITION_EMBEDDING_TYPE="rotary", TRAIN_EPOCHS="", TRAIN_ITERS=8,
                     SPLIT="90,9,1", EVAL_INTERVAL=8)
    run = subprocess.run(["bash", str(REPO_ROOT / "examples_zero" / "gpt_deepspeed_Z1.sh")], cwd=REPO_ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    log = (tmp_path / "gpt_tiny_Z1_rotary" / "train.log").read_text()
    losses = {i: float(loss) for i, loss in iteration_losses(log).items()}
    assert sorted(losses) == list(range(1, 9)) and losses[8] < losses[1] - 0.3, losses  # 10.83 -> 10.33 seen
    checkpoints = tmp_path / "gpt_tiny_Z1_rotary" / "checkpoints"
    loaded = load_checkpoint_weights(str(checkpoints))
    assert loaded.config.use_rotary_position_embeddings
    assert not any("position" in name for name in loaded.state_dict)
    for extra in ([], ["--finetune"]):
        learned = run_pretrain(dolly_data_dir, "--zero-stage", "1", "--load", str(checkpoints), *extra, expect=1,
                               timeout=300)
        errors = [line for line in learned.stderr.splitlines() if line.startswith("error:")]
        # every rank says the same one line (torchrun then adds its own report of the failed ranks)
        assert len(set(errors)) == 1, learned.stderr[-3000:]
        assert errors[0].endswith("it was saved with rotary positions, this model has learned positions: add "
                                  "--use-rotary-position-embeddings"), errors
