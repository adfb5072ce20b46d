"""Llama's architecture (docs/model.md): RMSNorm, SwiGLU, grouped-query attention, untied output layer, no linear
biases. Each piece against its definition on one process; the parameter count exact; the refusals one line; TP=2
(with and without sequence parallelism) and the two-stage pipeline against serial on real 2-rank gloo groups."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megatron.arguments import ConfigError, parse_args
from megatron.model import MODEL_PRESETS, GPTConfig, GPTModel, ModelConfigError
from megatron.accounting import count_parameters, parameter_groups_on_rank, parameters_on_rank

SEED = 4321


def llama_config(**overrides) -> GPTConfig:
    fields = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, seq_length=8,
                  max_position_embeddings=8, padded_vocab_size=64, ffn_hidden_size=48, hidden_dropout=0.0,
                  attention_dropout=0.0, use_rotary_position_embeddings=True, normalization="rmsnorm", swiglu=True,
                  untie_embeddings_and_output_weights=True, disable_bias_linear=True)
    fields.update(overrides)
    return GPTConfig(**fields)


def batch(size: int = 2, seq: int = 8, vocab: int = 64):
    ids = torch.randint(0, vocab, (size, seq + 1), generator=torch.Generator().manual_seed(7))
    return ids[:, :-1], torch.arange(seq).expand(size, seq), ids[:, 1:]


def build(config: GPTConfig, **kwargs) -> GPTModel:
    torch.manual_seed(SEED)
    return GPTModel(config, **kwargs)


def test_llama_layers_have_no_biases_rmsnorm_and_an_untied_output_layer():
    model = build(llama_config())
    names = dict(model.named_parameters())
    assert not [name for name in names if name.endswith(".bias")]
    assert names["output_layer.weight"].shape == names["word_embeddings.weight"].shape == (64, 32)
    assert not torch.equal(names["output_layer.weight"], names["word_embeddings.weight"])
    # QKV: 4 query heads and 2 K and 2 V heads of 8; SwiGLU's gate and up, 2 x 48
    assert names["layers.0.self_attention.query_key_value.weight"].shape == ((4 + 2 * 2) * 8, 32)
    assert names["layers.0.mlp.dense_h_to_4h.weight"].shape == (2 * 48, 32)
    assert names["layers.0.mlp.dense_4h_to_h.weight"].shape == (32, 48)


def test_rmsnorm_and_swiglu_are_their_definitions():
    model = build(llama_config())
    layer = model.layers[0]
    x = torch.randn(2, 8, 32)
    norm = layer.input_layernorm
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    torch.testing.assert_close(norm(x), expected)
    mlp = layer.mlp
    gate_weight, up_weight = mlp.dense_h_to_4h.weight.chunk(2)
    expected = (F.silu(x @ gate_weight.T) * (x @ up_weight.T)) @ mlp.dense_4h_to_h.weight.T
    torch.testing.assert_close(mlp(x), expected)


def test_grouped_query_attention_equals_attention_with_each_kv_head_repeated():
    """GQA (4 query heads over 2 K/V heads) gives the logits of full multi-head attention whose K/V heads are
    copies: query heads 0-1 read K/V head 0, heads 2-3 K/V head 1."""
    gqa_config = llama_config()
    gqa = build(gqa_config)
    mha = build(dataclasses.replace(gqa_config, num_key_value_heads=4))
    d = gqa_config.head_dim
    with torch.no_grad():
        for name, param in mha.named_parameters():
            source = dict(gqa.named_parameters())[name]
            if not name.endswith("query_key_value.weight"):
                param.copy_(source)
                continue
            groups = source.view(2, 4, d, 32)  # [kv head, (q, q, k, v), d, h]
            q, k, v = groups[:, :2], groups[:, 2:3], groups[:, 3:4]
            per_head = torch.cat([q.reshape(4, 1, d, 32), k.repeat_interleave(2, 0), v.repeat_interleave(2, 0)], 1)
            param.copy_(per_head.reshape(-1, 32))  # [head, (q, k, v), d, h]
    tokens, positions, _ = batch()
    torch.testing.assert_close(gqa(tokens, positions), mha(tokens, positions), rtol=1e-5, atol=1e-5)


def test_kv_cache_decoding_with_grouped_query_attention_equals_the_whole_sequence():
    from megatron.model.kv_cache import KVCache

    config = llama_config()
    model = build(config).eval()
    tokens, positions, _ = batch(size=1)
    whole = model(tokens, positions)
    cache = KVCache(config.num_layers, config.seq_length)
    steps = [model(tokens[:, :5], positions[:, :5], kv_cache=cache)]
    steps += [model(tokens[:, i:i + 1], positions[:, i:i + 1], kv_cache=cache) for i in range(5, 8)]
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=1e-5, atol=1e-5)
    assert cache._keys[0].shape[1] == 2  # the cache keeps the 2 K/V heads, not one per query head


@pytest.mark.parametrize("name", ["llama-tiny", "llama3-8b"])
@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_parameter_count_is_the_real_modules(name, tp, pp):
    """The accounting's count and its groups in module order (matrices; biases and norm weights) against the
    real model; each TP x PP rank's share adds up to the model (the untied output layer on the last stage)."""
    config = GPTConfig(**MODEL_PRESETS[name], seq_length=64, max_position_embeddings=64, padded_vocab_size=512)
    torch.manual_seed(0)
    with torch.device("meta" if name != "llama-tiny" else "cpu"):
        model = GPTModel(config)
    params = list(model.parameters())
    assert count_parameters(config) == sum(p.numel() for p in params)
    if (tp, pp) == (1, 1):
        matrices, vectors = parameter_groups_on_rank(config)
        assert matrices == [p.numel() for p in params if p.dim() == 2]
        assert vectors == [p.numel() for p in params if p.dim() == 1]
    # the word embeddings and the output layer split over TP, the norms whole on every TP rank
    norms = (2 * config.num_layers + 1) * config.hidden_size
    shares = sum(parameters_on_rank(config, tp, pp, stage) for stage in range(pp))
    assert shares * tp - norms * (tp - 1) == count_parameters(config)


def test_llama_tiny_counted_by_hand():
    """llama-tiny (2 layers, hidden 128, 4 heads of 32 over 2 K/V heads, FFN 352) with a 512-token vocabulary:
    per layer QKV 128 x (128 + 2 x 64), attention out 128 x 128, SwiGLU 128 x 2 x 352 and 352 x 128, two RMSNorm
    weights of 128; then the word embeddings, the final RMSNorm and the untied output layer."""
    layer = 128 * 256 + 128 * 128 + 128 * 704 + 352 * 128 + 2 * 128
    config = GPTConfig(**MODEL_PRESETS["llama-tiny"], seq_length=64, max_position_embeddings=64,
                       padded_vocab_size=512)
    assert count_parameters(config) == 2 * layer + 512 * 128 + 128 + 512 * 128 == 500_352


def test_swiglu_default_ffn_width_is_megatrons():
    """Without --ffn-hidden-size SwiGLU takes 2/3 of 4h, down to a multiple of 64 (Megatron's rule)."""
    assert llama_config(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                        ffn_hidden_size=None).ffn_hidden_size == 10880  # 10922.7 down to 64s


ARGS = ["--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
        "--data-path", "x", "--vocab-file", "v", "--merge-file", "m"]


def test_model_size_preset_gives_the_architecture_and_flags_win_over_it():
    args = parse_args(["--model-size", "llama3-8b", *ARGS], 1)
    assert (args.model.num_key_value_heads, args.model.ffn_hidden_size, args.model.rope_theta) == (8, 14336, 5e5)
    assert args.model.swiglu and args.model.untie_embeddings_and_output_weights and args.model.disable_bias_linear
    assert args.model.normalization == "rmsnorm" and args.model.use_rotary_position_embeddings
    args = parse_args(["--model-size", "llama3-8b", "--num-key-value-heads", "4", "--ffn-hidden-size", "1024", *ARGS])
    assert (args.model.num_key_value_heads, args.model.ffn_hidden_size) == (4, 1024)
    # Megatron-DeepSpeed's Llama flags spelt out on a GPT shape; --no-query-key-layer-scaling is accepted
    args = parse_args(["--model-size", "tiny", "--normalization", "rmsnorm", "--swiglu", "--num-key-value-heads",
                       "2", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
                       "--no-query-key-layer-scaling", "--use-rotary-position-embeddings", "--rope-theta", "500000",
                       *ARGS])
    assert (args.model.normalization, args.model.num_key_value_heads, args.model.rope_theta) == ("rmsnorm", 2, 5e5)
    assert args.model.swiglu and args.model.untie_embeddings_and_output_weights and args.model.disable_bias_linear
    assert args.model.ffn_hidden_size == 320  # SwiGLU's default width for hidden 128


@pytest.mark.parametrize("flags, world, message", [
    (["--num-key-value-heads", "3"], 1,
     "--num-attention-heads 4 is not divisible by --num-key-value-heads 3: each K/V head serves a whole group of "
     "query heads"),
    (["--num-key-value-heads", "1", "--tensor-model-parallel-size", "2"], 2,
     "--num-key-value-heads 1 is not divisible by --tensor-model-parallel-size 2"),
    (["--normalization", "batchnorm"], 1, "--normalization must be one of layernorm, rmsnorm, got 'batchnorm'"),
    (["--num-key-value-heads", "0"], 1, "--num-key-value-heads must be a positive integer, got 0"),
    (["--rope-theta", "0"], 1, "--rope-theta must be > 0, got 0.0"),
])
def test_llama_refusals_are_one_line(flags, world, message):
    with pytest.raises((ConfigError, ModelConfigError)) as error:
        parse_args(["--model-size", "tiny", *flags, *ARGS], world)
    assert str(error.value) == message


def test_old_checkpoint_config_without_the_llama_keys_loads_as_gpt2():
    saved = {k: v for k, v in llama_config().to_dict().items()
             if k not in ("normalization", "swiglu", "num_key_value_heads", "untie_embeddings_and_output_weights",
                          "disable_bias_linear", "rope_theta")}
    config = GPTConfig.from_dict(saved)
    assert config.is_gpt2_shaped and config.num_key_value_heads == config.num_attention_heads
    assert GPTConfig.from_dict(llama_config().to_dict()) == llama_config()


# --- TP=2 and PP=2 against serial on real 2-rank gloo groups (tests/test_tensor_parallel.py's spawn helpers) ---

def _full_shard(param, full: torch.Tensor, rank: int) -> torch.Tensor:
    """This TP rank's part of the serial model's `full` tensor, as the parameter holds it (SwiGLU's gate/up
    strided: each rank [gate_r; up_r])."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    blocks = full.chunk(param.partition_stride, dim=param.partition_dim)
    return torch.cat([block.chunk(2, dim=param.partition_dim)[rank] for block in blocks], dim=param.partition_dim)


def _check_llama_tp2_matches_tp1(rank, world):
    from megatron.core.parallel_state import ParallelLayout, ParallelState

    state = ParallelState.build(ParallelLayout(world_size=2, tensor_model_parallel_size=2))
    group = state.get_tensor_model_parallel_group()
    for sequence_parallel in (False, True):
        config = llama_config(sequence_parallel=sequence_parallel)
        serial = build(dataclasses.replace(config, sequence_parallel=False))
        parallel = build(config, tp_group=group)
        tokens, positions, labels = batch()
        loss_serial, loss_parallel = serial(tokens, positions, labels), parallel(tokens, positions, labels)
        torch.testing.assert_close(loss_parallel, loss_serial, rtol=1e-5, atol=0)
        loss_serial.mean().backward()
        loss_parallel.mean().backward()
        serial_params = dict(serial.named_parameters())
        for name, param in parallel.named_parameters():
            full = serial_params[name]
            assert torch.equal(param, _full_shard(param, full, rank)), name
            expected = _full_shard(param, full.grad, rank)
            rel = (param.grad - expected).norm() / expected.norm()
            assert rel < 1e-5, f"sequence_parallel={sequence_parallel} {name}: relative gradient difference {rel:.3e}"
    # each rank holds one of the 2 K/V heads and its 2 query heads
    assert parallel.layers[0].self_attention.local_kv_heads == 1
    with pytest.raises(ModelConfigError, match="--num-key-value-heads 1 is not divisible by "
                                               "--tensor-model-parallel-size 2"):
        GPTModel(llama_config(num_key_value_heads=1), tp_group=group)


def _pipe_to_serial_name(name: str, num_layers: int) -> str:
    """PipelineModule names ("<layer index>.X": 0 embeddings, 1..L layers, L + 1 final norm, L + 2 output layer)."""
    index, rest = name.split(".", 1)
    index = int(index)
    if index == 0:
        return rest
    return f"layers.{index - 1}.{rest}" if index <= num_layers else \
        f"final_layernorm.{rest}" if index == num_layers + 1 else rest


def _check_llama_pipeline_matches_serial(rank, world):
    import os

    import deepspeed

    from megatron.core.parallel_state import ParallelLayout, ParallelState
    from megatron.model.gpt_model_pipe import build_gpt_pipe

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    deepspeed.init_distributed(dist_backend="gloo")
    state = ParallelState.build(ParallelLayout(world_size=world, pipeline_model_parallel_size=2))
    config = llama_config()
    serial = build(config)
    torch.manual_seed(SEED)
    pipe = build_gpt_pipe(config, state)
    serial_params = dict(serial.named_parameters())
    names = set()
    for name, param in pipe.named_parameters():  # the same initial weights, by the per-layer seeds
        assert torch.equal(param, serial_params[_pipe_to_serial_name(name, config.num_layers)]), name
        names.add(_pipe_to_serial_name(name, config.num_layers))
    # the untied output layer on the last stage only, nothing tied between the stages
    assert ("output_layer.weight" in names) == (rank == 1) and ("word_embeddings.weight" in names) == (rank == 0)
    ds_config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                 "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0, "steps_per_print": 1000,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0, "torch_adam": True}}}
    engine, _, _, _ = deepspeed.initialize(model=pipe, model_parameters=pipe.parameters(), config=ds_config)
    ids = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(7))
    mask = torch.ones(4, 8)
    positions = torch.arange(8).expand(2, 8)
    micro_batches = [((ids[i:i + 2, :-1], positions), (ids[i:i + 2, 1:], mask[i:i + 2])) for i in (0, 2)]
    optimizer = torch.optim.AdamW(serial.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(3):
        pipe_loss = engine.train_batch(iter(micro_batches))
        optimizer.zero_grad()
        serial_loss = 0.0
        for (tokens, pos), (labels, m) in micro_batches:
            loss = (serial(tokens, pos, labels) * m).sum() / m.sum() / len(micro_batches)
            loss.backward()
            serial_loss += loss.item()
        torch.nn.utils.clip_grad_norm_(serial.parameters(), 1.0)
        optimizer.step()
        assert abs(float(pipe_loss) - serial_loss) < 1e-5 * serial_loss, (float(pipe_loss), serial_loss)


@pytest.fixture(scope="module")
def llama_world_2(tmp_path_factory):
    from test_tensor_parallel import run_checks

    checks = [_check_llama_tp2_matches_tp1, _check_llama_pipeline_matches_serial]  # the pipeline last (deepspeed.comm)
    return run_checks({fn.__name__: fn for fn in checks}, 2, tmp_path_factory.mktemp("llama_world_2"))


@pytest.mark.slow
def test_llama_gqa_tp2_with_and_without_sequence_parallel_matches_tp1(llama_world_2):
    from test_tensor_parallel import assert_passed

    assert_passed(llama_world_2, "_check_llama_tp2_matches_tp1")


@pytest.mark.slow
def test_llama_pipeline_two_stages_with_untied_output_matches_serial_training(llama_world_2):
    from test_tensor_parallel import assert_passed

    assert_passed(llama_world_2, "_check_llama_pipeline_matches_serial")


def test_tensor_parallel_shards_merge_into_the_serial_weights():
    """TP=2 shards (SwiGLU's [gate_r; up_r] each, K/V groups, the untied output layer's vocabulary rows) merge into
    the TP=1 state dict, and --finetune's slicing (strided_shard) gives each rank its shard back."""
    from megatron.core.tensor_parallel.layers import strided_shard
    from megatron.saved_model.layouts import merge_tensor_parallel, partition_dim

    full = build(llama_config()).state_dict()

    def shard(name, tensor, rank):
        dim = partition_dim(name)
        if dim is None:
            return tensor
        stride = 2 if name.endswith("dense_h_to_4h.weight") else 1
        blocks = tensor.chunk(stride, dim=dim)
        return torch.cat([block.chunk(2, dim=dim)[rank] for block in blocks], dim=dim)

    shards = [{name: shard(name, tensor, rank) for name, tensor in full.items()} for rank in (0, 1)]
    merged = merge_tensor_parallel(shards, swiglu=True)
    assert merged.keys() == full.keys()
    for name in full:
        assert torch.equal(merged[name], full[name]), name
    gate_up = full["layers.0.mlp.dense_h_to_4h.weight"]
    assert torch.equal(strided_shard(gate_up, 0, None, 2), gate_up)  # serial: the whole tensor
