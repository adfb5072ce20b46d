"""megatron/accounting/measure/memory.py reads private DeepSpeed attributes: each must exist in the installed DeepSpeed (this
test breaks when DeepSpeed renames one), and a missing one raises instead of measuring zero."""
import inspect
import os
import re
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from megatron.accounting.measure import memory


def _deepspeed_class(name):
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    return {cls.__name__: cls for cls in (BF16_Optimizer, DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3,
                                          FP16_UnfusedOptimizer)}[name]


def _assigned_attributes(cls) -> set[str]:
    return set(re.findall(r"self\.(\w+)\s*(?::[^=\n]*)?=[^=]", inspect.getsource(cls)))


@pytest.mark.parametrize("class_name", sorted(memory._FP32_MASTER))
def test_every_private_attribute_read_exists_in_deepspeed(class_name):
    assigned = _assigned_attributes(_deepspeed_class(class_name))
    wanted = {memory._FP32_MASTER[class_name], *memory._GRADIENT_BUFFERS.get(class_name, ()),
              *memory._HOST_GRADIENT_BUFFERS.get(class_name, ())}
    assert wanted <= assigned, wanted - assigned


def test_offloaded_stage_3_keeps_its_gradient_partition_on_the_host():
    """With the optimizer offloaded, stage 3's gradient accumulation buffer counts as host memory (offloaded), not
    as the accelerator's gradients; without offload, and at stages 1 and 2 either way, every buffer read is the
    accelerator's. DeepSpeed 0.19.8 allocates that buffer on the optimizer's device, the CPU under offload."""
    stage3 = "DeepSpeedZeroOptimizer_Stage3"
    assert memory.gradient_buffers(stage3, offload_optimizer=True) == {
        "accelerator": ("averaged_gradients",), "host": ("grad_partitions_flat_buffer",)}
    assert memory.gradient_buffers(stage3, offload_optimizer=False) == {
        "accelerator": ("averaged_gradients", "grad_partitions_flat_buffer"), "host": ()}
    for offload in (True, False):
        assert memory.gradient_buffers("DeepSpeedZeroOptimizer", offload) == {
            "accelerator": ("averaged_gradients", "all_grad_tensors"), "host": ()}
    assert memory.gradient_buffers("NoneType", True) == {"accelerator": (), "host": ()}
    source = inspect.getsource(_deepspeed_class(stage3))
    assert "self.device = get_accelerator().current_device_name() if not self.offload_optimizer else " \
           "OffloadDeviceEnum.cpu" in source
    assert re.search(r"self\.grad_partitions_flat_buffer: Tensor = torch\.zeros\([^\n]*\n\s*dtype=self\."
                     r"gradient_accumulation_dtype,\s*device=self\.device\)", source)


def test_a_missing_attribute_raises_naming_it():
    class Renamed:
        pass

    with pytest.raises(memory.DeepSpeedInternalsError, match=r"Renamed has no attribute 'averaged_gradients'"):
        memory._private(Renamed(), "averaged_gradients")


@pytest.mark.parametrize("dtype, recompute, dropout, attention_dropout", [
    ("fp32", False, 0.1, 0.1), ("bf16", False, 0.1, 0.1), ("fp32", True, 0.1, 0.1), ("fp32", False, 0.0, 0.0),
    ("bf16", False, 0.0, 0.0), ("fp32", False, 0.1, 0.0), ("bf16", False, 0.0, 0.1)])
def test_saved_activations_of_a_real_forward_are_the_prediction(dtype, recompute, dropout, attention_dropout):
    """saved_activation_bytes around one training forward of the real model on CPU (every tensor autograd
    keeps, weights aside) against megatron/accounting/predict/'s CPU activations, within 1%: with attention dropout
    SDPA's math kernel, without it the CPU flash kernel (accounting.fused_attention), whatever the hidden
    dropout."""
    import torch

    from megatron.model import GPTConfig, GPTModel
    from megatron.accounting import TrainingSetup, activation_bytes, fused_attention
    params_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    config = GPTConfig(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=64,
                       max_position_embeddings=64, padded_vocab_size=1024, params_dtype=params_dtype,
                       recompute_activations=recompute, hidden_dropout=dropout, attention_dropout=attention_dropout)
    torch.manual_seed(0)
    model = GPTModel(config).train()
    ids = torch.randint(0, 1000, (4, 64))
    with memory.saved_activation_bytes(model) as saved:
        loss = model(ids, torch.arange(64).expand(4, 64), ids)
    loss.float().mean().backward()  # the saved tensors were the ones the backward needs
    predicted = activation_bytes(config, TrainingSetup(world_size=1, micro_batch_size=4, precision=dtype,
                                                       activation_recompute=recompute, device="cpu"))
    assert saved[0] == pytest.approx(predicted, rel=0.01)
    assert saved[0] > (100_000 if recompute else 1_000_000)
    setup = TrainingSetup(world_size=1, micro_batch_size=4, device="cpu")
    assert fused_attention(config, setup) == (attention_dropout == 0)
    assert fused_attention(config, replace(setup, device="cuda"))  # flash, cuDNN or memory-efficient


def test_saved_activations_leave_out_the_weights():
    import torch
    linear = torch.nn.Linear(256, 256)
    x = torch.randn(8, 256, requires_grad=True)
    with memory.saved_activation_bytes(linear) as saved:
        linear(x).sum()
    assert saved == [8 * 256 * 4]  # the input only, not the 256 x 256 weight


def _tiny(seq_length: int, dropout: float, rotary: bool = False):
    from megatron.model import GPTConfig
    return GPTConfig(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=seq_length,
                     max_position_embeddings=seq_length, padded_vocab_size=1024, hidden_dropout=dropout,
                     attention_dropout=dropout, use_rotary_position_embeddings=rotary)


def _measured_activations(config, sp_group=None, sequence=None) -> int:
    """saved_activation_bytes of one training forward of micro-batch 4 (this rank's slice under `sequence`)."""
    import torch

    from megatron.model import GPTModel
    from megatron.training import get_batch
    torch.manual_seed(0)
    model = GPTModel(config, sp_group=sp_group).train()
    text = torch.randint(0, 1000, (4, config.seq_length + 1), generator=torch.Generator().manual_seed(7))
    tokens, labels, positions, _ = get_batch({"text": text}, torch.device("cpu"), -1, False, sequence)
    with memory.saved_activation_bytes(model) as saved:
        loss = model(tokens, positions, labels)
    loss.float().mean().backward()
    return saved[0]


@pytest.mark.parametrize("seq_length", [64, 256, 1024])
def test_saved_activations_follow_the_sequence_length(seq_length):
    from megatron.accounting import TrainingSetup, activation_bytes
    config = _tiny(seq_length, dropout=0.0)
    predicted = activation_bytes(config, TrainingSetup(world_size=1, micro_batch_size=4, device="cpu"))
    assert _measured_activations(config) == pytest.approx(predicted, rel=0.01)


@pytest.mark.parametrize("dtype, recompute, dropout, kv_heads", [
    ("fp32", False, 0.0, 2), ("bf16", False, 0.0, 2), ("fp32", False, 0.1, 2), ("bf16", False, 0.1, 2),
    ("fp32", True, 0.0, 2), ("fp32", False, 0.0, 4), ("bf16", False, 0.0, 1)])
def test_saved_activations_of_a_llama_forward_are_the_prediction(dtype, recompute, dropout, kv_heads):
    """llama-tiny (RMSNorm, SwiGLU, rotary, untied output) with grouped-query (2 and 1 K/V heads) and multi-head
    attention (4): what RMSNorm keeps in fp32 on CPU, SwiGLU's gate, up, SiLU(gate) and product, the rotated or
    repeated q, k and v, and no position ids, within 1%."""
    import torch

    from megatron.model import MODEL_PRESETS, GPTConfig
    from megatron.accounting import TrainingSetup, activation_bytes
    shape = dict(MODEL_PRESETS["llama-tiny"], num_key_value_heads=kv_heads)
    config = GPTConfig(**shape, seq_length=64, max_position_embeddings=64, padded_vocab_size=1024,
                       params_dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[dtype],
                       recompute_activations=recompute, hidden_dropout=dropout, attention_dropout=dropout)
    predicted = activation_bytes(config, TrainingSetup(world_size=1, micro_batch_size=4, precision=dtype,
                                                       activation_recompute=recompute, device="cpu"))
    assert _measured_activations(config) == pytest.approx(predicted, rel=0.01)


@pytest.mark.parametrize("dtype, recompute, dropout", [
    ("fp32", False, 0.0), ("bf16", False, 0.0), ("fp32", True, 0.0), ("fp32", False, 0.1)])
def test_rotary_activations_are_the_prediction(dtype, recompute, dropout):
    """Rotary positions keep the rotated q and k and a copy of the output projection's input (the fused kernel
    fed a contiguous q) and each layer's fp32 cos and sin, and no position ids: within 1% at 1024 tokens."""
    import torch
    from dataclasses import replace

    from megatron.accounting import TrainingSetup, activation_bytes
    config = replace(_tiny(1024, dropout, rotary=True), recompute_activations=recompute,
                     params_dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
    predicted = activation_bytes(config, TrainingSetup(world_size=1, micro_batch_size=4, precision=dtype,
                                                       activation_recompute=recompute, device="cpu"))
    assert _measured_activations(config) == pytest.approx(predicted, rel=0.01)


def _check_ulysses_activations(rank, world):
    import deepspeed

    from megatron.core.layout import ParallelLayout
    from megatron.core.parallel_state import ParallelState
    from megatron.accounting import TrainingSetup, activation_bytes
    deepspeed.init_distributed(dist_backend="gloo")  # DistributedAttention's all-to-alls go through deepspeed.comm
    state = ParallelState.build(ParallelLayout(world_size=world, sequence_parallel_size=2))
    setup = TrainingSetup(world_size=world, micro_batch_size=4, device="cpu", sequence_parallel_size=2)
    measured = {}
    for seq_length, dropout, rotary in ((64, 0.0, False), (256, 0.0, False), (1024, 0.0, False), (256, 0.1, False),
                                        (1024, 0.0, True), (256, 0.1, True)):
        config = _tiny(seq_length, dropout, rotary)
        measured[seq_length, dropout, rotary] = _measured_activations(config, state.get_sequence_parallel_group(),
                                                                      state.sequence)
        whole = activation_bytes(config, TrainingSetup(world_size=world, micro_batch_size=4, device="cpu"))
        assert measured[seq_length, dropout, rotary] == pytest.approx(activation_bytes(config, setup), rel=0.01)
        assert measured[seq_length, dropout, rotary] < 0.55 * whole  # about half of what one rank keeps for all s
    # what rotary adds, on every rank: the last one's cos and sin are its own slice's, not positions 0 on
    added = measured[1024, 0.0, True] - measured[1024, 0.0, False]
    assert added == pytest.approx(activation_bytes(_tiny(1024, 0.0, True), setup)
                                  - activation_bytes(_tiny(1024, 0.0, False), setup), rel=0.01)


@pytest.mark.slow
def test_ulysses_ranks_keep_the_predicted_activations():
    """SP=2 on 2 real gloo ranks: each keeps s/2 tokens of every activation outside attention and the whole
    sequence for half the heads inside it (with the fused kernel also its output before the reverse all-to-all),
    within 1% of megatron/accounting/predict/'s prediction at 64, 256 and 1024 tokens, with attention dropout, and
    with rotary positions (each rank's cos and sin for its s/2 positions only)."""
    from test_tensor_parallel import run_ranks
    run_ranks(_check_ulysses_activations)


def test_live_tensor_bytes_counts_each_storage_once_and_sees_parameters():
    before = memory.live_tensor_bytes()
    flat = torch.zeros(1 << 20)  # 4 MiB, and two views of it
    views = [flat[:10], flat.view(1024, 1024)]
    weight = torch.nn.Parameter(torch.zeros(1 << 18))  # 1 MiB, a Tensor subclass
    assert memory.live_tensor_bytes() - before == 5 << 20
    del flat, views, weight
    assert memory.live_tensor_bytes() == before


def test_deepspeeds_muon_is_imported_without_compiling():
    """megatron.optimizer.import_muon_uncompiled: Muon's functions stay plain, torch.compile is torch's own again,
    and torch's inductor compiler was not imported (in a fresh process: this one may have imported it)."""
    check = ("import sys, torch; compile_ = torch.compile; from megatron.optimizer import import_muon_uncompiled; "
             "import_muon_uncompiled(); from deepspeed.runtime.zero.muon import original_muon as m; "
             "assert torch.compile is compile_; "
             "assert m.muon_update.__code__.co_filename == m.__file__, m.muon_update.__code__; "
             "assert 'torch._inductor.compile_fx' not in sys.modules; print('ok')")
    run = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert run.stdout.strip() == "ok", run.stderr[-2000:]


def test_live_bytes_tracks_what_ops_make_and_leaves_out_excluded_storages_over_their_life():
    """1 MiB tensors: the peak of the ops' outputs alive at once; a storage handed to exclude() after it was made
    (as a first backward's gradients are) leaves every sample, those taken before included; close() ends the peak."""
    weight = torch.ones(1 << 18)  # made outside: not counted
    with memory.LiveBytes() as live:
        a = weight * 2
        b = a + 1  # 2 MiB live
        del a
        c = b * 3  # 2 MiB live (b, c)
        live.exclude([b])
        live.close()
        d = c + b  # 3 MiB live, after close()
    assert len(live.samples) == 4 and live.samples == [1 << 20, 2 << 20, 2 << 20, 3 << 20]
    assert live.peak == 1 << 20  # b left out from its birth; d after close()
    views = memory.LiveBytes()
    with views:
        e = weight + 0
        f, g = e[:10], e.view(2, -1)  # views of e's storage: counted once
    assert views.peak == 1 << 20 and f.numel() == 10 and g.shape[0] == 2 and d.numel() == 1 << 18


def test_the_model_state_line_adds_the_step_peak_where_it_is_measured():
    from analysis.log_parser import ParsedLog, parse_line
    from megatron.training_log import GB, model_state_line

    measured = dict(params=GB, grads=GB, optim=GB, offloaded=0, activations=GB / 4, other=GB)
    estimate = dict(params=GB, grads=GB, optim=GB, model_states=3 * GB, offloaded=0, activations=GB / 4,
                    output_buffer=GB, total=4.5 * GB)
    plain = model_state_line(measured, estimate, 1, 2, "fp32", "none")
    assert "step_peak" not in plain  # CUDA, the pipeline engine: as before
    line = model_state_line({**measured, "step_peak": 1.25 * GB}, estimate, 1, 2, "fp32", "none")
    assert line == plain.replace("other=1.0000 |", "other=1.0000 step_peak=1.2500 |").replace(
        "output_buffer=1.0000 |", "output_buffer=1.0000 step_peak=1.5000 |")
    log = ParsedLog(path=None)
    parse_line(log, line)
    assert log.model_state.measured["step_peak"] == 1.25 and log.model_state.estimate["step_peak"] == 1.5
