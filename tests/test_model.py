"""GPT model: shapes, loss, tying, causality, determinism, recompute, config errors,
parameter counts, and weight-for-weight agreement with Hugging Face's GPT2LMHeadModel."""
import pytest
import torch
import torch.nn.functional as F

from megatron.model import MODEL_PRESETS, GPTConfig, GPTModel, ModelConfigError
from megatron.accounting import count_parameters

VOCAB = 256
SEQ = 16


def tiny_config(**overrides) -> GPTConfig:
    fields = dict(MODEL_PRESETS["tiny"], seq_length=SEQ, max_position_embeddings=32, padded_vocab_size=VOCAB)
    fields.update(overrides)
    return GPTConfig(**fields)


def build(seed=1234, **overrides) -> GPTModel:
    torch.manual_seed(seed)
    return GPTModel(tiny_config(**overrides))


def batch(batch_size=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=gen)
    positions = torch.arange(SEQ).expand(batch_size, SEQ)
    return ids[:, :-1], positions, ids[:, 1:]


def test_shapes_and_dtypes():
    model = build()
    tokens, positions, labels = batch(batch_size=3)
    loss = model(tokens, positions, labels)
    logits = model(tokens, positions)
    assert loss.shape == (3, SEQ) and loss.dtype == torch.float32
    assert logits.shape == (3, SEQ, VOCAB)


def test_loss_equals_cross_entropy_of_logits():
    model = build(hidden_dropout=0.0, attention_dropout=0.0).eval()
    tokens, positions, labels = batch()
    loss = model(tokens, positions, labels)
    logits = model(tokens, positions)
    expected = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none").view_as(loss)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    # An untrained model predicts roughly uniformly: loss near ln(V).
    assert abs(loss.mean().item() - torch.log(torch.tensor(float(VOCAB))).item()) < 0.5


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fused_output_layer_loss_gives_the_gradients_of_the_logits_path(dtype, tolerance):
    model = build(hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype)
    tokens, positions, labels = batch()
    weights = torch.rand(labels.shape, generator=torch.Generator().manual_seed(3))
    fused = model(tokens, positions, labels)
    (fused * weights).sum().backward()
    fused_grads = {name: p.grad.float().clone() for name, p in model.named_parameters()}
    model.zero_grad()
    logits = model(tokens, positions).float()
    unfused = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none").view_as(labels)
    (unfused * weights).sum().backward()
    torch.testing.assert_close(fused, unfused, rtol=tolerance, atol=tolerance)
    for name, p in model.named_parameters():
        torch.testing.assert_close(fused_grads[name], p.grad.float(), rtol=tolerance, atol=tolerance, msg=name)


@pytest.mark.parametrize("dtype, buffers", [(torch.float32, 1), (torch.bfloat16, 2)])  # bf16: its logits, fp32 exps
def test_output_layer_buffers_are_reused_across_steps_and_by_eval(dtype, buffers):
    model = build(params_dtype=dtype)
    tokens, positions, labels = batch()
    model(tokens, positions, labels).sum().backward()
    kept = {tensor.data_ptr() for tensor in model.lm_loss_scratch._free.values()}
    model(tokens, positions, labels).sum().backward()
    with torch.no_grad():
        model(tokens, positions, labels)
    assert {tensor.data_ptr() for tensor in model.lm_loss_scratch._free.values()} == kept
    assert len(kept) == buffers
    loss = model(tokens, positions, labels).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(AssertionError, match="back-propagated twice"):
        loss.backward()


def test_output_layer_is_tied_to_word_embeddings():
    model = build()
    names = [name for name, _ in model.named_parameters()]
    assert sum("word_embeddings" in n for n in names) == 1
    assert not any("lm_head" in n or "output_layer" in n for n in names)
    model.eval()
    tokens, positions, labels = batch()
    model(tokens, positions, labels).sum().backward()
    # The embedding gets gradient from the output layer for ids that never appear as input.
    unused = sorted(set(range(VOCAB)) - set(tokens.flatten().tolist()))
    assert model.word_embeddings.weight.grad[unused].abs().sum() > 0


def test_causal_later_tokens_do_not_change_earlier_logits():
    model = build().eval()
    tokens, positions, _ = batch()
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 7) % VOCAB
    before, after = model(tokens, positions), model(changed, positions)
    torch.testing.assert_close(before[:, :10], after[:, :10])
    assert not torch.allclose(before[:, 10:], after[:, 10:])


def test_dropout_off_is_deterministic_and_dropout_on_is_not():
    tokens, positions, labels = batch()
    no_dropout = build(hidden_dropout=0.0, attention_dropout=0.0).train()
    torch.testing.assert_close(no_dropout(tokens, positions, labels), no_dropout(tokens, positions, labels),
                               rtol=0, atol=0)
    with_dropout = build(hidden_dropout=0.1, attention_dropout=0.1).train()
    assert not torch.equal(with_dropout(tokens, positions, labels), with_dropout(tokens, positions, labels))
    with_dropout.eval()
    torch.testing.assert_close(with_dropout(tokens, positions, labels), with_dropout(tokens, positions, labels),
                               rtol=0, atol=0)


def _loss_and_grads(checkpoint_activations: bool):
    model = build(recompute_activations=checkpoint_activations, hidden_dropout=0.1, attention_dropout=0.1).train()
    tokens, positions, labels = batch()
    torch.manual_seed(99)  # same dropout masks for both runs
    loss = model(tokens, positions, labels).mean()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_checkpoint_activations_gives_same_loss_and_gradients():
    loss, grads = _loss_and_grads(False)
    loss_ckpt, grads_ckpt = _loss_and_grads(True)
    torch.testing.assert_close(loss_ckpt, loss, rtol=0, atol=0)
    assert grads.keys() == grads_ckpt.keys()
    for name in grads:
        # Recompute replays the same dropout masks (default and model-parallel RNG), so the
        # gradients match up to float summation order.
        torch.testing.assert_close(grads_ckpt[name], grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_checkpoint_activations_frees_layer_activations():
    tokens, positions, labels = batch(batch_size=4)

    def saved_bytes(checkpoint_activations: bool) -> int:
        model = build(recompute_activations=checkpoint_activations).train()
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(tokens, positions, labels).mean()
        return total

    assert saved_bytes(True) < saved_bytes(False) / 2


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(hidden_size=100, num_attention_heads=3), "--hidden-size 100 is not divisible by --num-attention-heads 3"),
        (dict(seq_length=64, max_position_embeddings=32), "--seq-length 64 exceeds --max-position-embeddings 32"),
        (dict(num_layers=0), "--num-layers must be a positive integer, got 0"),
        (dict(hidden_dropout=1.0), "--hidden-dropout must be in [0, 1), got 1.0"),
        (dict(params_dtype=torch.int64), "params dtype must be one of"),
    ],
)
def test_config_errors_name_the_flag(overrides, message):
    with pytest.raises(ModelConfigError) as error:
        tiny_config(**overrides)
    assert message in str(error.value)


def test_ffn_hidden_size_defaults_to_four_hidden():
    assert tiny_config().ffn_hidden_size == 4 * 128
    assert tiny_config(ffn_hidden_size=300).ffn_hidden_size == 300


# every preset's shape and parameter count against the published ones: tests/test_presets.py
def _preset_config(name: str, vocab: int = 50304) -> GPTConfig:
    return GPTConfig(**MODEL_PRESETS[name], seq_length=1024, max_position_embeddings=1024, padded_vocab_size=vocab)


@pytest.mark.parametrize("name", ["tiny", "125M"])
def test_count_parameters_equals_module(name):
    torch.manual_seed(0)
    config = _preset_config(name, vocab=50304 if name == "125M" else 512)
    model = GPTModel(config)
    assert count_parameters(config) == sum(p.numel() for p in model.parameters())


def test_count_parameters_ffn_override():
    torch.manual_seed(0)
    config = tiny_config(ffn_hidden_size=200)
    assert count_parameters(config) == sum(p.numel() for p in GPTModel(config).parameters())


def _hf_model(config: GPTConfig):
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.GPT2Config(
        vocab_size=config.padded_vocab_size, n_positions=config.max_position_embeddings,
        n_embd=config.hidden_size, n_layer=config.num_layers, n_head=config.num_attention_heads,
        n_inner=config.ffn_hidden_size, activation_function="gelu_new", layer_norm_epsilon=config.layernorm_epsilon,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
    )
    torch.manual_seed(5)
    return transformers.GPT2LMHeadModel(hf_config).eval()


def _qkv_from_hf(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """HF Conv1D c_attn is [in, (q|k|v) x heads x d]; ours is [(head, qkv, d), in]."""
    rows = weight.t() if weight.dim() == 2 else weight
    rest = rows.shape[1:]
    return rows.reshape(3, heads, -1, *rest).transpose(0, 1).reshape(-1, *rest)


def _copy_hf_weights(ours: GPTModel, hf) -> None:
    heads = ours.config.num_attention_heads
    hf_state = hf.transformer.state_dict()
    mapping = {"word_embeddings.weight": hf_state["wte.weight"], "position_embeddings.weight": hf_state["wpe.weight"],
               "final_layernorm.weight": hf_state["ln_f.weight"], "final_layernorm.bias": hf_state["ln_f.bias"]}
    for i in range(ours.config.num_layers):
        src, dst = f"h.{i}.", f"layers.{i}."
        mapping.update({
            dst + "input_layernorm.weight": hf_state[src + "ln_1.weight"],
            dst + "input_layernorm.bias": hf_state[src + "ln_1.bias"],
            dst + "self_attention.query_key_value.weight": _qkv_from_hf(hf_state[src + "attn.c_attn.weight"], heads),
            dst + "self_attention.query_key_value.bias": _qkv_from_hf(hf_state[src + "attn.c_attn.bias"], heads),
            dst + "self_attention.dense.weight": hf_state[src + "attn.c_proj.weight"].t(),
            dst + "self_attention.dense.bias": hf_state[src + "attn.c_proj.bias"],
            dst + "post_attention_layernorm.weight": hf_state[src + "ln_2.weight"],
            dst + "post_attention_layernorm.bias": hf_state[src + "ln_2.bias"],
            dst + "mlp.dense_h_to_4h.weight": hf_state[src + "mlp.c_fc.weight"].t(),
            dst + "mlp.dense_h_to_4h.bias": hf_state[src + "mlp.c_fc.bias"],
            dst + "mlp.dense_4h_to_h.weight": hf_state[src + "mlp.c_proj.weight"].t(),
            dst + "mlp.dense_4h_to_h.bias": hf_state[src + "mlp.c_proj.bias"],
        })
    ours.load_state_dict(mapping, strict=True)


def test_matches_huggingface_gpt2_logits_and_loss():
    config = tiny_config(num_layers=3, hidden_dropout=0.0, attention_dropout=0.0)
    hf = _hf_model(config)
    with torch.no_grad():  # HF's init leaves biases at zero; random ones exercise the QKV layout
        for name, param in hf.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.02)
    model = GPTModel(config).eval()
    _copy_hf_weights(model, hf)
    tokens, positions, labels = batch(batch_size=2)
    with torch.no_grad():
        ours = model(tokens, positions)
        theirs = hf(input_ids=tokens, position_ids=positions).logits
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
        hf_loss = F.cross_entropy(theirs.reshape(-1, VOCAB), labels.reshape(-1), reduction="none").view(labels.shape)
        torch.testing.assert_close(model(tokens, positions, labels), hf_loss, rtol=0, atol=1e-4)
