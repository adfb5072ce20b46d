"""megatron/accounting/measure/compute_probe.py on this CPU: a real transformer layer, optimizer, copies and swap file timed; the
rates positive, finite and in a CPU's range, a 4x wider layer taking longer per pass, the TP rank's layer
holding exactly its share of the parameters, each pass dividing by the FLOPs torch counts in it, the NVMe probe leaving
nothing behind."""
import math
import mmap
import os
import threading
import time
from dataclasses import replace

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron.accounting.measure import compute_probe
from megatron.accounting.measure.compute_probe import (
    COPY_BYTES,
    NVME_BLOCK,
    OPTIMIZER_ELEMENTS,
    _buffered_io_seconds,
    _direct_io_seconds,
    _sizes,
    layer_flops_per_s,
    layer_pass,
    optimizer_seconds,
    probe_compute,
    probe_layer,
)
from megatron.accounting import TrainingSetup, parameter_groups_on_rank
from megatron.accounting.predict.flops import layer_forward_flops, layer_hardware_flops
from megatron.model.config import GPTConfig
from test_flops import MatmulFlops, torchs_own_linear

CPU = torch.device("cpu")


def config(hidden: int, seq: int = 32, **kw) -> GPTConfig:
    return GPTConfig(num_layers=2, hidden_size=hidden, num_attention_heads=4, seq_length=seq,
                     max_position_embeddings=seq, padded_vocab_size=1024, **kw)


SETUP = TrainingSetup(world_size=2, micro_batch_size=2, zero_stage=1, device="cpu")


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-4, fused=True)


@pytest.mark.parametrize("t, overrides", [
    (1, dict(recompute_activations=True)),  # no dropout: the recompute stops before the MLP's output matmul
    (2, dict(recompute_activations=True)),
    (1, dict(recompute_activations=True, recompute_with_deepspeed=True, hidden_dropout=0.1)),
    (1, dict(recompute_activations=True, tiled_mlp_compute=True, tiled_mlp_shards=4)),
    (2, dict()),
])
def test_the_layer_probe_divides_by_the_flops_it_runs(t, overrides):
    """The probe's rate is layer_hardware_flops / t per pass: what the pass runs, counted by torch's FLOP counter.
    A DeepSpeed-checkpointed run's probe recomputes through zero-lab's checkpoint, and is counted so."""
    c = config(64, **{**dict(hidden_dropout=0.0, attention_dropout=0.0), **overrides})
    layer = probe_layer(c, t).train()
    x = torch.randn(2, 32, 64, requires_grad=True)
    counter = MatmulFlops()
    with sdpa_kernel(SDPBackend.MATH), torchs_own_linear(), counter:  # whatever a ZeRO-3 engine here patched
        layer_pass(c, layer, x, torch.randn(2, 32, 64))
    assert counter.total == layer_hardware_flops(replace(c, recompute_with_deepspeed=False), 2 * 32) / t


def test_rates_of_a_real_layer_on_this_cpu():
    # the tests' tiny preset's layer (h = 128, seq 64) at micro-batch 2: 163 MFLOP per forward and backward, large
    # enough that the CPU's rate shows through the per-op overheads even on a loaded machine
    start = time.perf_counter()
    rates = probe_compute(config(128, seq=64), SETUP, CPU, torch.float32, adamw)
    print(f"probe_compute: {time.perf_counter() - start:.2f} s, {rates}")
    for value in (rates.flops_per_s, rates.output_flops_per_s, rates.optimizer_s_per_element,
                  rates.host_copy_bytes_per_s):
        assert math.isfinite(value) and value > 0
    # on a CPU rank the accelerator's memory is the host's: the engine's gradient passes run at the copy rate
    assert rates.device_copy_bytes_per_s == rates.host_copy_bytes_per_s
    assert 1e8 <= rates.flops_per_s <= 1e13  # a CPU: from a slow core to a many-core server
    assert rates.optimizer_s_per_element < 1e-6 and rates.host_copy_bytes_per_s > 1e7
    assert rates.nvme_bytes_per_s is None


@pytest.mark.slow  # six layer probes: about 2 s
def test_the_probe_times_the_layer():
    # an 8x wider layer does 64x the matmul work: each pass (its FLOPs over the measured rate) takes longer. The
    # probes alternate and each size keeps its best, so that a busy machine slows both alike: on a loaded 2-core
    # machine (load 12) the best of three whole probes of a 4x wider layer (16x the work), one size after the other,
    # once read the small layer at 0.106 s a pass against the large one's 0.013
    best = {64: math.inf, 512: math.inf}
    for _ in range(3):
        for hidden in best:
            rate = layer_flops_per_s(config(hidden), SETUP, CPU, torch.float32)
            best[hidden] = min(best[hidden], 3 * layer_forward_flops(config(hidden), 2 * 32) / rate)
    assert best[512] > best[64]


@pytest.mark.slow  # a bf16 probe on a CPU without AMX: about 2-3 s
def test_recomputation_and_bf16_layers_probe():
    # recomputed (4 passes' FLOPs) and bf16 layers probe too; bf16 on a CPU without AMX tiles runs a tiny layer
    # at ~1e8 FLOP/s on this box, so the floor is lower for both
    for probed, dtype in ((config(64, recompute_activations=True), torch.float32), (config(64), torch.bfloat16)):
        rates = probe_compute(probed, SETUP, CPU, dtype, adamw)
        assert 1e7 <= rates.flops_per_s <= 1e13


class FixedCostOptimizer:
    """An optimizer whose step takes FIXED_S plus PER_ELEMENT_S per element of its parameters (a GPU's fused
    AdamW: launches and the synchronisation, then memory-bound work): what the probe should read is PER_ELEMENT_S.
    The costs are tens of milliseconds so that a sleep's late wake-up on a loaded machine (a few ms at a load of
    8 on 2 cores) stays small beside the 49 ms between the two sizes' steps."""
    FIXED_S, PER_ELEMENT_S = 2e-2, 5e-8

    def __init__(self, params):
        self.elements = sum(p.numel() for p in params)

    def step(self):
        time.sleep(self.FIXED_S + self.PER_ELEMENT_S * self.elements)


def test_the_optimizer_probe_tells_a_steps_fixed_cost_from_its_per_element_cost():
    # one size would read (20 ms + 52 ms) / 2^20 = 69 ns per element; the line through two sizes reads 50 ns and 20 ms
    fixed, per_element = optimizer_seconds(FixedCostOptimizer, CPU)
    assert per_element == pytest.approx(FixedCostOptimizer.PER_ELEMENT_S, rel=0.1)
    assert fixed == pytest.approx(FixedCostOptimizer.FIXED_S, rel=0.25)


def test_probe_sizes_pass_a_gpus_l2_cache_and_keep_a_cpus_probe_short():
    l2_bytes = 60e6  # an H200's, the larger of H100's and H200's
    cuda = torch.device("cuda")
    copies, elements = _sizes(COPY_BYTES, cuda), _sizes(OPTIMIZER_ELEMENTS, cuda)
    assert len(copies) == 2 and min(copies) > l2_bytes and max(copies) >= 256 * 2**20
    # the large step's fp32 parameter alone is larger than the L2 cache (its gradient and two moments 3x more)
    assert len(elements) == 2 and elements[-1] * 4 > l2_bytes
    assert _sizes(COPY_BYTES, CPU) == (32 * 2**20,)
    assert _sizes(OPTIMIZER_ELEMENTS, CPU)[-1] == 2**20  # the single size it had, in about the same time


LLAMA = dict(use_rotary_position_embeddings=True, normalization="rmsnorm", swiglu=True, num_key_value_heads=2,
             untie_embeddings_and_output_weights=True, disable_bias_linear=True, ffn_hidden_size=176)


@pytest.mark.parametrize("tp, shape", [(1, {}), (2, {}), (4, {}), (1, LLAMA), (2, LLAMA)],
                         ids=["gpt2-tp1", "gpt2-tp2", "gpt2-tp4", "llama-tp1", "llama-tp2"])
def test_probed_layer_holds_one_tp_ranks_share(tp, shape):
    """GPT-2's layer, and the run's own where it is Llama-shaped: grouped-query QKV, SwiGLU, RMSNorm, no biases."""
    layer = probe_layer(config(64, **shape), tp)
    matrices, vectors = parameter_groups_on_rank(config(64, **shape), tp)
    # one layer's matrices (QKV, attention out, MLP in, out) and vectors, after the embeddings (one: rotary)
    first = 1 if shape else 2
    assert [p.numel() for p in layer.parameters() if p.dim() == 2] == matrices[first:first + 4]
    layer_vectors = 2 if shape else 8  # the two norms' weights; GPT-2's biases and LayerNorm biases too
    assert [p.numel() for p in layer.parameters() if p.dim() == 1] == vectors[:layer_vectors]
    x = torch.randn(2, 32, 64)
    assert layer(x).shape == x.shape


def test_nvme_probe_leaves_no_file(tmp_path):
    offload = TrainingSetup(world_size=2, micro_batch_size=2, zero_stage=3, offload_optimizer=True,
                            offload_params=True, offload_device="nvme", device="cpu")
    rates = probe_compute(config(64), offload, CPU, torch.float32, adamw, offload_device_path=str(tmp_path))
    assert math.isfinite(rates.nvme_bytes_per_s) and rates.nvme_bytes_per_s > 0
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("io", [lambda path, buffer: _direct_io_seconds(path, buffer, 4), _buffered_io_seconds])
def test_nvme_probe_writes_and_reads_the_whole_file(tmp_path, io):
    # the swap probe's two ways without DeepSpeed's op, O_DIRECT in DeepSpeed's 1 MiB aio blocks (ext4 and tmpfs
    # take it on this kernel) and buffered with fsync: the file holds every byte written, and both took time
    buffer = mmap.mmap(-1, 4 * NVME_BLOCK)
    buffer.write(os.urandom(len(buffer)))
    seconds = io(str(tmp_path / "swap"), buffer)
    assert seconds is not None and all(s > 0 for s in seconds)
    assert (tmp_path / "swap").read_bytes() == buffer[:]


def test_direct_io_keeps_the_queue_depth_in_flight(tmp_path, monkeypatch):
    # each request held 20 ms on its way to the real pwrite / preadv: 8 requests in flight at the peak, as
    # DeepSpeed's aio handle keeps queue_depth of them, not one at a time
    in_flight, peak, lock = 0, 0, threading.Lock()

    def held(call):
        def request(*args):
            nonlocal in_flight, peak
            with lock:
                in_flight += 1
                peak = max(peak, in_flight)
            time.sleep(0.02)
            try:
                return call(*args)
            finally:
                with lock:
                    in_flight -= 1
        return request

    monkeypatch.setattr(os, "pwrite", held(os.pwrite))
    monkeypatch.setattr(os, "preadv", held(os.preadv))
    buffer = mmap.mmap(-1, 16 * NVME_BLOCK)
    buffer.write(os.urandom(len(buffer)))
    seconds = _direct_io_seconds(str(tmp_path / "swap"), buffer, 8)
    assert seconds is not None and peak == 8
    assert (tmp_path / "swap").read_bytes() == buffer[:]


@pytest.mark.slow
def test_nvme_probe_goes_through_deepspeeds_aio_handle_when_the_engine_loaded_it(tmp_path, monkeypatch):
    # a ZeRO-Infinity engine loads the aio op before the probe runs: the probe then swaps with the handle the run's
    # aio section describes (its queue depth and threads), as the run will
    from deepspeed.ops.op_builder import AsyncIOBuilder
    builder = AsyncIOBuilder()
    if not builder.is_compatible(verbose=False):
        pytest.skip("DeepSpeed's async I/O op cannot be built here (no libaio)")
    op, handles = builder.load(verbose=False), []

    class RecordingOp:  # the real op, noting the arguments each handle is built with
        def aio_handle(self, *args):
            handles.append(args)
            return op.aio_handle(*args)

    monkeypatch.setattr(compute_probe, "_aio_op", RecordingOp)
    aio = {"queue_depth": 4, "intra_op_parallelism": 2}
    assert compute_probe.nvme_bytes_per_s(str(tmp_path), aio) > 0
    assert handles == [(2**20, 4, False, True, 2)]  # block size, queue depth, single submit, overlap, threads
    assert list(tmp_path.iterdir()) == []


def _timed_calls_on_each_rank(rank, world):
    """Rank 0's calls take 0.25 s, so it alone would stop after 3 (BUDGET_S); rank 1's take 10 ms and would go on
    to LAYER_REPEATS."""
    calls = []

    def call():
        calls.append(rank)
        time.sleep(0.25 if rank == 0 else 0.01)

    compute_probe._median_seconds(call, CPU, compute_probe.LAYER_REPEATS)
    counts = [None] * world
    torch.distributed.all_gather_object(counts, len(calls))
    assert counts == [1 + compute_probe.LAYER_REPEATS] * world  # the warm-up, then as many as the rank going on


@pytest.mark.slow
def test_the_ranks_time_their_calls_together_and_make_as_many():
    """Every rank of a run probes at once: a rank whose calls are quick does not go on alone (nor wait at a
    collective of the step the other has left), and the slow one makes as many calls."""
    from test_tensor_parallel import run_ranks
    run_ranks(_timed_calls_on_each_rank)
