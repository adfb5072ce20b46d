"""ALST's tiling along the sequence (--tiled-mlp-compute, --tiled-logits-loss; megatron/model/tiling.py,
docs/long-sequences.md): the tiled model gives the untiled losses and gradients in fp32 (1 rank, TP=2 with and
without --sequence-parallel, Ulysses SP=2, GQA and SwiGLU, and through pretrain_gpt.py at ZeRO 1 and 3 and PP=2);
the tile counts ALST picks; the refusals; the activations it keeps, one recomputed MLP tile and the loss's buffer
against megatron/accounting/predict/memory.py; the FLOPs it adds."""
import re
from dataclasses import replace
from functools import partial

import pytest
import torch
import torch.distributed as dist

from conftest import parallel_pretrain
from megatron.accounting import TrainingSetup, activation_bytes, hardware_flops_per_iteration, memory_per_rank
from megatron.accounting import output_layer_buffer_bytes
from megatron.accounting.measure import memory
from megatron.accounting.predict.memory import backward_gradient_bytes, tiled_mlp_peak_bytes
from megatron.arguments import parse_args
from megatron.core.layout import ParallelLayout
from megatron.core.parallel_state import ParallelState
from megatron.errors import ZeroLabError
from megatron.model import MODEL_PRESETS, GPTConfig, GPTModel
from megatron.model.tiling import chunk_count, loss_tiles, mlp_tiles
from megatron.training import get_batch, masked_mean_loss, sequence_mean_loss
from test_arguments import base
from test_parallel_training import losses
from test_tensor_parallel import SEED, run_ranks
from test_ulysses import grad_norms

LLAMA = dict(swiglu=True, normalization="rmsnorm", num_key_value_heads=2, untie_embeddings_and_output_weights=True,
             disable_bias_linear=True, use_rotary_position_embeddings=True)
SHAPES = {"gelu": {}, "llama-gqa": LLAMA, "squared-relu": dict(squared_relu=True),
          "gelu-recompute": dict(recompute_activations=True)}  # the tiled MLP inside a recomputed layer
TILED = dict(tiled_mlp_compute=True, tiled_mlp_shards=4, tiled_logits_loss=True, tiled_logits_loss_shards=5)


def _config(**overrides) -> GPTConfig:
    fields = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=24, max_position_embeddings=32,
                  padded_vocab_size=64, hidden_dropout=0.0, attention_dropout=0.0)
    return GPTConfig(**{**fields, **overrides})


def _loss_and_grads(model: GPTModel, tokens, positions, labels, weights):
    losses = model(tokens, positions, labels)
    (losses * weights).sum().backward()  # per-token gradient weights, as a loss mask gives the tiled loss
    return losses.detach(), {name: param.grad for name, param in model.named_parameters()}


def relative_difference(tiled: dict, untiled: dict) -> float:
    """The largest difference of a gradient, relative to that gradient's largest element: max |tiled - untiled| /
    max |untiled| over the elements of each tensor (sums over tiles round differently from one sum: an element
    near 0 can differ by more than 1e-6 of itself)."""
    return max(((tiled[name] - grad).abs().max() / grad.abs().max()).item() for name, grad in untiled.items())


def assert_same(tiled_loss, tiled_grads, loss, grads):
    torch.testing.assert_close(tiled_loss, loss, rtol=1e-6, atol=0)
    difference = relative_difference(tiled_grads, grads)
    print(f"largest relative gradient difference: {difference:.2e}")
    assert difference < 1e-6


def _assert_tiling_keeps_losses_and_grads(config, tp_group=None):
    """3 x 24 tokens through the model untiled and tiled, from one seed: the same losses and gradients."""
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 64, (3, 24), generator=gen)
    positions, labels, weights = torch.arange(24).expand(3, 24), tokens.roll(-1, 1), torch.rand(3, 24, generator=gen)
    results = []
    for tiled in (False, True):
        torch.manual_seed(SEED)
        model = GPTModel(replace(config, **TILED) if tiled else config, tp_group=tp_group)
        results.append(_loss_and_grads(model, tokens, positions, labels, weights))
    assert_same(*results[1], *results[0])


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_tiled_model_gives_the_untiled_losses_and_gradients(shape):
    """3 x 24 tokens: the MLP in 4 tiles of 18, the loss in 5 (4 of 15 and one of 12)."""
    config = _config(**SHAPES[shape])
    _assert_tiling_keeps_losses_and_grads(config)


def test_the_tiled_model_trains_in_bf16():
    """bf16 logits tile by tile into the fp32 buffer, the weight's gradient summed over the tiles in fp32."""
    config = _config(params_dtype=torch.bfloat16, **TILED)
    torch.manual_seed(SEED)
    model = GPTModel(config)
    tokens = torch.randint(0, 64, (3, 24), generator=torch.Generator().manual_seed(2))
    losses = model(tokens, torch.arange(24).expand(3, 24), tokens.roll(-1, 1))
    losses.mean().backward()
    assert losses.dtype == torch.float32 and torch.isfinite(losses).all()
    assert all(torch.isfinite(param.grad).all() and param.grad.dtype == torch.bfloat16
               for param in model.parameters())


def test_the_tile_counts_are_alsts():
    assert chunk_count(6, 4) == 3 and chunk_count(10, 4) == 4 and chunk_count(3, 8) == 3
    config = replace(_config(seq_length=2048, max_position_embeddings=2048), tiled_mlp_compute=True,
                     tiled_logits_loss=True)
    assert mlp_tiles(config, 2, 2048) == 2048 // 32  # ceil(seq / hidden), DeepSpeed's TiledMLP example
    assert mlp_tiles(replace(config, tiled_mlp_shards=3), 2, 2048) == 3
    assert mlp_tiles(replace(config, tiled_mlp_compute=False), 2, 2048) == 1
    assert loss_tiles(config, 4096, 64) == 1  # 1 MiB of fp32 logits: one tile (ALST's tiles hold about 1 GiB)
    assert loss_tiles(config, 128 * 1024, 50304) == 25  # 25.1 GiB: 25 tiles of 5,243 rows
    assert loss_tiles(replace(config, tiled_logits_loss_shards=7), 4096, 64) == 7


@pytest.mark.parametrize("extra, message", [
    (["--num-experts", "2", "--tiled-mlp-compute"],
     "--tiled-mlp-compute cannot be combined with MoE layers (--num-experts 2): the experts' capacity depends on "
     "the tokens of each call; drop one of them"),
    (["--tiled-mlp-compute", "--tiled-mlp-shards", "-1"], "--tiled-mlp-shards must be an integer >= 0 (0: as ALST "
                                                           "picks), got -1"),
])
def test_what_tiling_cannot_run_is_refused_in_one_line(data_prefix, extra, message):
    with pytest.raises(ZeroLabError) as error:
        parse_args(base(data_prefix, *extra))
    assert str(error.value) == message


def test_the_flags_reach_the_model_and_stay_out_of_checkpoints(data_prefix):
    flags = ("--tiled-mlp-compute", "--tiled-mlp-shards", "8", "--tiled-logits-loss")
    config = parse_args(base(data_prefix, *flags)).model
    assert (config.tiled_mlp_compute, config.tiled_mlp_shards, config.tiled_logits_loss,
            config.tiled_logits_loss_shards) == (True, 8, True, 0)
    assert not any(name.startswith("tiled") for name in config.to_dict())  # a run's choice, not the model's


def _tiny_2048(**overrides) -> GPTConfig:
    return GPTConfig(**MODEL_PRESETS["tiny"], seq_length=2048, max_position_embeddings=2048, padded_vocab_size=1024,
                     hidden_dropout=0.0, attention_dropout=0.0, **overrides)


def _saved_bytes(config: GPTConfig, batch: int = 1, tp_group=None) -> tuple[int, int]:
    """(saved_activation_bytes of one training forward, the most one recomputed MLP tile saves in the backward on
    top of them: the storages saved between one tile's first matmul and the next's)."""
    torch.manual_seed(0)
    model = GPTModel(config, tp_group).train()
    mlp_inputs = set()  # the tiled MLP's whole inputs, kept from the forward: its tiles are views of them
    for layer in model.layers:
        layer.post_attention_layernorm.register_forward_hook(
            lambda _, __, out: mlp_inputs.add(out.untyped_storage().data_ptr()))
    text = torch.randint(0, 1000, (batch, config.seq_length + 1), generator=torch.Generator().manual_seed(7))
    tokens, labels, positions, _ = get_batch({"text": text}, torch.device("cpu"), -1, False)
    with memory.saved_activation_bytes(model) as saved:
        loss = model(tokens, positions, labels)
    tiles: list[dict] = []
    for layer in model.layers:
        layer.mlp.dense_h_to_4h.register_forward_pre_hook(lambda *_: tiles.append({}))

    kept = mlp_inputs | {param.untyped_storage().data_ptr() for param in model.parameters()}  # not the weights

    def pack(tensor):
        storage = tensor.untyped_storage()
        if tiles and storage.data_ptr() not in kept:
            tiles[-1][storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss.float().mean().backward()
    return saved[0], max((sum(tile.values()) for tile in tiles), default=0)


@pytest.mark.slow
def test_tiling_keeps_the_predicted_activations_at_2048_tokens():
    """The tiny preset at 2,048 tokens on one rank: the tiled MLP keeps only its input (no [tokens, ffn] tensors),
    the tiled loss one more fp32 per token; measured against activation_bytes within 1%, the recomputed MLP tile
    (2048 / 16 tiles: 128 tokens of GELU's two [tokens, 512] tensors) against tiled_mlp_peak_bytes, and the
    loss's buffer shrinks to one tile's rows."""
    setup = TrainingSetup(world_size=1, micro_batch_size=1, device="cpu")
    untiled, tiled = _tiny_2048(), _tiny_2048(tiled_mlp_compute=True, tiled_logits_loss=True,
                                              tiled_logits_loss_shards=4)
    measured, _ = _saved_bytes(untiled)
    measured_tiled, tile = _saved_bytes(tiled)
    assert measured == pytest.approx(activation_bytes(untiled, setup), rel=0.01)
    assert measured_tiled == pytest.approx(activation_bytes(tiled, setup), rel=0.01)
    assert measured - measured_tiled == pytest.approx(2 * 2048 * 2 * 512 * 4 - 2048 * 4, rel=0.01)
    assert tile == pytest.approx(tiled_mlp_peak_bytes(tiled, setup), rel=0.01) == 128 * 2 * 512 * 4
    assert output_layer_buffer_bytes(tiled, setup) == output_layer_buffer_bytes(untiled, setup) / 4
    assert memory_per_rank(tiled, setup)["total"] == memory_per_rank(tiled, setup)["model_states"] + \
        activation_bytes(tiled, setup) + output_layer_buffer_bytes(tiled, setup) + tile + \
        backward_gradient_bytes(tiled, setup)
    print(f"activations at 2048 tokens: untiled measured {measured / 2**20:.2f} MiB, predicted "
          f"{activation_bytes(untiled, setup) / 2**20:.2f}; tiled measured {measured_tiled / 2**20:.2f} MiB, "
          f"predicted {activation_bytes(tiled, setup) / 2**20:.2f}; one MLP tile {tile / 2**20:.3f} MiB")


def _check_sequence_parallel_tile(rank, world):
    setup = TrainingSetup(world_size=2, micro_batch_size=2, tensor_parallel_size=2, sequence_parallel=True,
                          device="cpu")
    config = replace(_tiny_2048(sequence_parallel=True, tiled_mlp_compute=True, tiled_logits_loss=True),
                     seq_length=512, max_position_embeddings=512)
    measured, tile = _saved_bytes(config, batch=2, tp_group=dist.group.WORLD)
    assert measured == pytest.approx(activation_bytes(config, setup), rel=0.01)
    # 2 x 256 tokens on each rank in 2 tiles of 256, gathered to 512: the [512, 256] input, GELU's two [512, 256]
    assert tile == pytest.approx(tiled_mlp_peak_bytes(config, setup), rel=0.01) == 512 * (128 + 2 * 256) * 4


@pytest.mark.slow
def test_a_sequence_parallel_tile_keeps_the_predicted_bytes():
    """TP=2 with --sequence-parallel: each MLP tile gathers its tokens from both ranks, and keeps them."""
    run_ranks(_check_sequence_parallel_tile)


def test_tiling_adds_the_recomputed_forwards_to_the_hardware_flops():
    """One more forward of every MLP (2 h x 2 f per token) and of the logit layer (2 h V per token)."""
    config = _config()
    tokens = 4 * 24
    extra = config.num_layers * 2 * tokens * 32 * (128 + 128) + 2 * tokens * 32 * 64
    assert hardware_flops_per_iteration(replace(config, **TILED), 4) == \
        hardware_flops_per_iteration(config, 4) + extra


def _check_tensor_parallel_tiling(rank, world, sequence_parallel, shape):
    group = dist.group.WORLD
    config = _config(sequence_parallel=sequence_parallel, **SHAPES[shape])
    _assert_tiling_keeps_losses_and_grads(config, group)


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel, shape", [(False, "gelu"), (True, "gelu"), (False, "llama-gqa")])
def test_two_tensor_ranks_tiled_give_the_untiled_losses_and_gradients(sequence_parallel, shape):
    """TP=2: each MLP tile all-reduces (or, sequence parallel, gathers and reduce-scatters) its own tokens; the loss
    keeps the vocabulary split, its tiles' statistics crossing the ranks tile by tile."""
    run_ranks(partial(_check_tensor_parallel_tiling, sequence_parallel=sequence_parallel, shape=shape))


def _check_ulysses_tiling(rank, world):
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    state = ParallelState.build(ParallelLayout(world_size=world, sequence_parallel_size=2))
    config = _config(**LLAMA)
    torch.manual_seed(SEED)
    serial = GPTModel(config)
    torch.manual_seed(SEED)
    split = GPTModel(replace(config, **TILED), sp_group=state.get_sequence_parallel_group())
    text = torch.randint(0, 64, (2, 25), generator=torch.Generator().manual_seed(7))
    tokens, labels, positions, mask = get_batch({"text": text}, torch.device("cpu"), -1, False)
    expected = masked_mean_loss(serial(tokens, positions, labels), mask)
    expected.backward()
    tokens, labels, positions, mask = get_batch({"text": text}, torch.device("cpu"), -1, False, state.sequence)
    share, whole = sequence_mean_loss(split(tokens, positions, labels), mask, state.sequence)
    share.backward()
    torch.testing.assert_close(whole, expected.detach(), rtol=1e-6, atol=0)
    grads = {}
    for name, param in split.named_parameters():
        grads[name] = param.grad.clone()
        dist.all_reduce(grads[name], group=state.get_sequence_parallel_group())
    assert relative_difference(grads, {name: param.grad for name, param in serial.named_parameters()}) < 1e-6


@pytest.mark.slow
def test_two_sequence_ranks_tiled_give_the_serial_loss_and_gradients():
    """Ulysses SP=2 with Llama's GQA and SwiGLU, tiled, against the untiled serial model."""
    run_ranks(_check_ulysses_tiling)


TILED_FLAGS = ("--tiled-mlp-compute", "--tiled-mlp-shards", "3", "--tiled-logits-loss",
               "--tiled-logits-loss-shards", "3")


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    ("--tensor-model-parallel-size", "2", "--zero-stage", "1"),
    ("--model-size", "llama-tiny", "--ds-sequence-parallel-size", "2", "--zero-stage", "3"),
    ("--pipeline-model-parallel-size", "2", "--zero-stage", "1"),
], ids=["tp2-zero1", "sp2-llama-zero3", "pp2-zero1"])
def test_pretrain_tiled_gives_the_untiled_losses_and_gradient_norms(dolly_data_dir, layout):
    """Through pretrain_gpt.py on 2 ranks: ZeRO-1's gradient reduction at TP=2, ZeRO-3's gathered parameters and
    deferred reduce-scatters (DeepSpeed's ds_grad_is_ready) at SP=2, and the pipeline's last stage."""
    untiled = parallel_pretrain(dolly_data_dir, 2, *layout).stdout
    tiled = parallel_pretrain(dolly_data_dir, 2, *layout, *TILED_FLAGS).stdout
    assert len(losses(untiled)) == 6 and losses(tiled) == pytest.approx(losses(untiled), rel=1e-6)
    assert grad_norms(tiled) == pytest.approx(grad_norms(untiled), rel=1e-5)
    if "--pipeline-model-parallel-size" in layout:
        return  # the pipeline's engine runs the forwards: no measured activations
    # the model-state line (docs/log-lines.md): the tiled run's activations measured as predicted (GB, 4 decimals),
    # and fewer than the untiled run's
    measured, predicted = model_state_activations(tiled)
    assert measured == pytest.approx(predicted, abs=1.5e-4) and measured < model_state_activations(untiled)[0]


def model_state_activations(log: str) -> tuple[float, float]:
    line = next(line for line in log.splitlines() if "model state memory per rank" in line)
    measured, predicted = (float(value) for value in re.findall(r" activations=(\S+)", line))
    return measured, predicted
