"""The rank's own speeds, measured at start-up: what the step-time model (megatron/accounting/predict/step_time.py)
divides a step's work by.

`probe_compute` times one transformer layer's and the model's ends' (embeddings, final LayerNorm, output layer and
loss) forward and backward with the run's shapes, dtype, dropout and recomputation, the run's optimizer step and
copies between the accelerator and the host and within the accelerator (each at two sizes and fitted with a line, so
that a call's fixed cost stays out of the per-element rate), and, for ZeRO-Infinity, writes and reads of the swap
folder. Never the run's own steps: the prediction stays a prediction. Every rank of a run probes at the same time, sharing the machine as training does (two CPU ranks
share the cores): the caller puts a barrier before it so that they start together.
"""
from __future__ import annotations

import errno
import mmap
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    checkpoint,
    init_method_normal,
    model_parallel_tracker,
)
from megatron.core.scratch import ScratchBuffers
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_lm_loss
# the one place a layer's FLOPs are counted
from megatron.accounting.predict.flops import layer_hardware_flops, logit_forward_flops
from megatron.accounting.predict.step_time import ComputeRates
from megatron.accounting.predict.training_setup import TrainingSetup
from megatron.model.config import GPTConfig
from megatron.model.gpt_model import build_embeddings, embed
from megatron.model.transformer import ParallelTransformerLayer, layer_norm

LAYER_REPEATS = 5  # timed forward+backward passes after a warm-up, fewer when they take long
# The optimizer and copies are timed at two sizes and fitted with a line, fixed seconds a call + seconds per element
# (byte): a call pays a fixed cost (kernel launches, the synchronisation, Python, a CPU's threads waking: 8 ms on the
# loaded 2-core box), most of a fused AdamW step over 2^20 elements on a GPU, and a step over the run's hundreds of
# millions pays it once. A copy's fixed cost (us) is left out of its rate. On an accelerator the copies are larger
# than its L2 cache (50-60 MB on H100 and H200), so that they time its memory; on a CPU one 32 MiB size.
OPTIMIZER_ELEMENTS = {"cpu": (2**16, 2**20), "accelerator": (2**21, 2**25)}  # fp32 elements the optimizer steps
OPTIMIZER_REPEATS = 5
COPY_BYTES = {"cpu": (32 * 2**20,), "accelerator": (64 * 2**20, 256 * 2**20)}  # bytes copied, each way
COPY_REPEATS = 3
NVME_BYTES = 32 * 2**20  # the swap file written and read back
NVME_BLOCK = 2**20  # DeepSpeed's aio block_size default, the fallback's request size
BUDGET_S = 0.5  # a timing stops repeating after this long (at least 3 repeats): large layers on a CPU


def _median_seconds(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of `fn` over up to `repeats` calls after one warm-up (which takes the first call's
    one-time costs: kernels chosen, buffers allocated). With a process group every rank starts each call together
    and all make as many calls (_in_step), so each call is timed while every rank runs the same work, as the
    ranks of a step do between its collectives."""
    cuda = device.type == "cuda"
    fn()
    seconds = []
    while len(seconds) < repeats and _in_step(len(seconds) < 3 or sum(seconds) < BUDGET_S):
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def _in_step(go_on: bool) -> bool:
    """Whether every rank goes on (any rank's wish to go on is every rank's), the ranks leaving together: a
    rank that ran ahead would otherwise time its calls on cores the others no longer share with it (the 2-core
    box's 4 ranks probed the same layer at 44 to 72 GFLOP/s from one run to the next)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return go_on
    on_cuda = dist.get_backend() == "nccl"
    flag = torch.tensor([float(go_on)], device=torch.device("cuda", torch.cuda.current_device()) if on_cuda else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _sizes(sizes: dict[str, tuple[int, ...]], device: torch.device) -> tuple[int, ...]:
    return sizes["cpu" if device.type == "cpu" else "accelerator"]


def fit_line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(fixed seconds a call, seconds per element or byte) of the line through the smallest and the largest of
    (size, seconds) `points`, kept physical when noise tilts it (as comm_probe.fit): a slope that is not positive
    becomes the largest point's seconds per unit with no fixed cost, a negative intercept no fixed cost. A single
    point: its seconds per unit, no fixed cost."""
    (small, t_small), (large, t_large) = points[0], points[-1]
    slope = (t_large - t_small) / (large - small) if large > small else 0.0
    if not slope > 0:
        return 0.0, t_large / large
    return max(0.0, t_small - slope * small), slope


def probe_layer(config: GPTConfig, tensor_parallel_size: int) -> ParallelTransformerLayer:
    """One transformer layer as one TP rank holds it, serial (no process group, so no collectives timed): at
    TP = t its QKV and MLP-in layers keep (h + 2 kv)/t and f/t output features, its attention-out layer h/t input
    features, and it runs num_heads/t heads; LayerNorms stay whole. Sequence parallelism is left out: its
    matmuls see the whole sequence all the same."""
    t = tensor_parallel_size
    local = replace(config, ffn_hidden_size=config.ffn_hidden_size // t, sequence_parallel=False)
    layer = ParallelTransformerLayer(local, None, model_parallel_tracker(1234, 0))
    if t > 1:
        h, attention = config.hidden_size, layer.self_attention
        init, bias = init_method_normal(config.init_method_std), not config.disable_bias_linear
        # the queries and this rank's K/V heads (grouped-query attention keeps fewer of them)
        attention.query_key_value = ColumnParallelLinear(h, (h + 2 * config.kv_channels) // t, group=None,
                                                         init_method=init, params_dtype=config.params_dtype, bias=bias)
        attention.dense = RowParallelLinear(h // t, h, group=None, init_method=init, params_dtype=config.params_dtype,
                                            bias=bias)
        attention.local_heads = config.num_attention_heads // t
        attention.local_kv_heads = config.num_key_value_heads // t
    return layer


def layer_pass(config: GPTConfig, layer: ParallelTransformerLayer, x: torch.Tensor, grad: torch.Tensor) -> None:
    """One timed pass of the layer probe: forward and backward, through zero-lab's checkpoint under
    --checkpoint-activations."""
    out = checkpoint(layer, layer.rng_tracker, x) if config.recompute_activations else layer(x)
    out.backward(grad)


def layer_flops_per_s(config: GPTConfig, setup: TrainingSetup, device: torch.device, dtype: torch.dtype) -> float:
    """Hardware FLOPs per second of one layer's forward and backward on a [micro batch, seq, hidden] input in
    training mode (the run's dropout), recomputing the forward in the backward under --checkpoint-activations:
    layer_hardware_flops over the rank's 1/tp of them, per median pass. The probe recomputes through zero-lab's
    checkpoint even for a DeepSpeed-checkpointed run, so its FLOPs are counted as that recompute runs them."""
    t = setup.tensor_parallel_size
    layer = probe_layer(replace(config, params_dtype=dtype), t).to(device).train()
    shape = (setup.micro_batch_size, config.seq_length, config.hidden_size)
    x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(shape, device=device, dtype=dtype)

    seconds = _median_seconds(lambda: layer_pass(config, layer, x, grad), device, LAYER_REPEATS)
    probed = replace(config, recompute_with_deepspeed=False)
    return layer_hardware_flops(probed, setup.micro_batch_size * config.seq_length) / t / seconds


def output_flops_per_s(config: GPTConfig, setup: TrainingSetup, device: torch.device, dtype: torch.dtype) -> float:
    """Hardware FLOPs per second of the model's ends, forward and backward, per output-layer FLOP: the word and
    position embeddings with their dropout, the final LayerNorm and the output layer's fused logits and
    cross-entropy (megatron/core/tensor_parallel/cross_entropy.py) over this TP rank's vocabulary slice, its
    weight the word embedding's as in GPTModel, so the backward adds the embedding's dense gradient to the
    logits' one, as training does. 3 x the logits' forward FLOPs over 1/tp of them, per median pass: the ends'
    other work has next to no FLOPs but a tiny model's step spends 20-25 ms on it (2 layers, h = 128, 2 CPU
    ranks: 296 ms for the ends where the output layer alone takes 275)."""
    t = setup.tensor_parallel_size
    local = replace(config, padded_vocab_size=config.padded_vocab_size // t, sequence_parallel=False,
                    params_dtype=dtype)
    tracker = model_parallel_tracker(1234, 0)
    words, positions = (None if module is None else module.to(device) for module in build_embeddings(local, None))
    dropout = torch.nn.Dropout(config.hidden_dropout)
    final_layernorm = layer_norm(local, None).to(device)
    shape = (setup.micro_batch_size, config.seq_length)
    tokens = torch.randint(0, local.padded_vocab_size, shape, device=device)
    position_ids = torch.arange(config.seq_length, device=device).expand(shape)
    scratch = ScratchBuffers()

    def forward_backward():
        x = final_layernorm(embed(words, positions, dropout, tokens, position_ids, local, None, tracker))
        vocab_parallel_lm_loss(x, words.weight, tokens, None, scratch).mean().backward()

    seconds = _median_seconds(forward_backward, device, LAYER_REPEATS)
    return 3 * logit_forward_flops(config, setup.micro_batch_size * config.seq_length) / t / seconds


def optimizer_seconds(optimizer_factory, device: torch.device) -> tuple[float, float]:
    """(fixed seconds a step, seconds per element) of the optimizer's step over fp32 elements with a gradient
    (DeepSpeed's optimizers step fp32 master weights whatever the run's dtype): the line through
    OPTIMIZER_ELEMENTS' two sizes."""
    def step_seconds(elements: int) -> float:
        param = torch.nn.Parameter(torch.randn(elements, device=device))
        param.grad = torch.randn_like(param)
        return _median_seconds(optimizer_factory([param]).step, device, OPTIMIZER_REPEATS)

    return fit_line([(n, step_seconds(n)) for n in _sizes(OPTIMIZER_ELEMENTS, device)])


def device_copy_bytes_per_s(device: torch.device) -> float:
    """Bytes per second copied within the accelerator's memory at COPY_BYTES' sizes, as the engine's passes over
    the gradients copy them; on a CPU rank that is host memory."""
    sizes = _sizes(COPY_BYTES, device)
    source = torch.ones(sizes[-1] // 4, device=device)
    target = torch.empty_like(source)

    def copy_seconds(size: int) -> float:
        return _median_seconds(lambda: target[:size // 4].copy_(source[:size // 4]), device, COPY_REPEATS)

    return 1 / fit_line([(size, copy_seconds(size)) for size in sizes])[1]


def host_copy_bytes_per_s(device: torch.device) -> float:
    """Bytes per second copied accelerator -> host and back at COPY_BYTES' sizes, into pinned host memory as
    DeepSpeed's offload does on CUDA; on a CPU rank host memory is the accelerator's: its copy rate."""
    if device.type != "cuda":
        return device_copy_bytes_per_s(device)
    sizes = _sizes(COPY_BYTES, device)
    source = torch.ones(sizes[-1] // 4, device=device)
    host = torch.empty(source.numel(), pin_memory=True)

    def round_trip_seconds(size: int) -> float:
        n = size // 4
        down = _median_seconds(lambda: host[:n].copy_(source[:n], non_blocking=True), device, COPY_REPEATS)
        return down + _median_seconds(lambda: source[:n].copy_(host[:n], non_blocking=True), device, COPY_REPEATS)

    return 1 / fit_line([(2 * size, round_trip_seconds(size)) for size in sizes])[1]


def _direct_io_seconds(path: str, buffer: mmap.mmap, in_flight: int) -> tuple[float, float] | None:
    """Seconds to write `buffer` to `path` and read it back with O_DIRECT in NVME_BLOCK blocks, `in_flight`
    requests at a time (threads, each a pwrite or pread of its block), as DeepSpeed's aio op keeps its queue
    depth of requests in flight (no page cache, no fsync); None where the file system refuses O_DIRECT."""
    offsets = range(0, len(buffer), NVME_BLOCK)
    view = memoryview(buffer)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError as error:
        if error.errno == errno.EINVAL:
            return None
        raise
    try:
        with ThreadPoolExecutor(max_workers=in_flight) as pool:
            start = time.perf_counter()
            list(pool.map(lambda at: os.pwrite(fd, view[at:at + NVME_BLOCK], at), offsets))
            written = time.perf_counter() - start
            start = time.perf_counter()
            list(pool.map(lambda at: os.preadv(fd, [view[at:at + NVME_BLOCK]], at), offsets))
            read = time.perf_counter() - start
    except OSError as error:
        if error.errno == errno.EINVAL:  # opened, but the file system does not do direct I/O
            return None
        raise
    finally:
        os.close(fd)
    return written, read


def _aio_op():
    """DeepSpeed's async I/O op where this process can have it at once: loaded already (a ZeRO-Infinity engine
    loads it to swap, before the probe runs) or installed prebuilt; None otherwise, since building it takes
    minutes."""
    from deepspeed.git_version_info import installed_ops
    from deepspeed.ops.op_builder import AsyncIOBuilder
    from deepspeed.ops.op_builder.builder import OpBuilder
    name = AsyncIOBuilder.NAME
    if name in OpBuilder._loaded_ops or installed_ops.get(name, False):  # DeepSpeed's own cache of loaded ops
        return AsyncIOBuilder().load(verbose=False)
    return None


def _aio_seconds(op, path: str, aio: dict) -> tuple[float, float] | None:
    """Seconds to write NVME_BYTES to `path` and read them back through DeepSpeed's aio handle built as the run's
    swapper builds it from the config's aio section `aio`; None where the handle does not complete them."""
    handle = op.aio_handle(aio["block_size"], aio["queue_depth"], aio["single_submit"], aio["overlap_events"],
                           aio["intra_op_parallelism"])
    buffer = handle.new_cpu_locked_tensor(NVME_BYTES, torch.empty(0, dtype=torch.uint8))
    try:
        buffer.copy_(torch.frombuffer(bytearray(os.urandom(NVME_BYTES)), dtype=torch.uint8))
        start = time.perf_counter()
        done = handle.sync_pwrite(buffer, path)
        written = time.perf_counter() - start
        start = time.perf_counter()
        done += handle.sync_pread(buffer, path)
        read = time.perf_counter() - start
    finally:
        handle.free_cpu_locked_tensor(buffer)
    return (written, read) if done == 2 else None


def _buffered_io_seconds(path: str, buffer: mmap.mmap) -> tuple[float, float]:
    """Seconds to write `buffer` to `path`, flushed to the device with fsync, and read it back with the page
    cache dropped first: the nearest to direct I/O a file system without O_DIRECT allows."""
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        f.write(buffer)
        os.fsync(f.fileno())
    written = time.perf_counter() - start
    view, done = memoryview(buffer), 0
    with open(path, "rb", buffering=0) as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        start = time.perf_counter()
        while done < len(buffer):
            done += f.readinto(view[done:])
        read = time.perf_counter() - start
    return written, read


def nvme_bytes_per_s(folder: str, aio_section: dict | None = None) -> float:
    """Bytes per second of writing NVME_BYTES to a file in `folder` and reading them back as ZeRO-Infinity swaps,
    with the DeepSpeed config's aio section `aio_section` (None: DeepSpeed's defaults): through DeepSpeed's aio
    handle where its op is at hand (`_aio_op`), else with O_DIRECT in NVME_BLOCK blocks, queue_depth x
    intra_op_parallelism requests in flight as the handle keeps them, else (a file system without O_DIRECT)
    buffered with fsync and the page cache dropped. The file is removed."""
    from deepspeed.runtime.swap_tensor.aio_config import get_aio_config  # the keys and defaults DeepSpeed reads
    aio = get_aio_config({"aio": aio_section} if aio_section else {})
    path = os.path.join(folder, f".zero_lab_nvme_probe_{os.getpid()}")
    buffer = mmap.mmap(-1, NVME_BYTES)  # page-aligned, as O_DIRECT needs
    buffer.write(os.urandom(NVME_BYTES))
    op = _aio_op()
    try:
        seconds = (op is not None and _aio_seconds(op, path, aio)
                   or _direct_io_seconds(path, buffer, aio["queue_depth"] * aio["intra_op_parallelism"])
                   or _buffered_io_seconds(path, buffer))
    finally:
        buffer.close()
        if os.path.exists(path):
            os.remove(path)
    return 2 * NVME_BYTES / sum(seconds)


def probe_compute(config: GPTConfig, setup: TrainingSetup, device: torch.device, dtype: torch.dtype,
                  optimizer_factory, offload_device_path: str | None = None,
                  aio_section: dict | None = None) -> ComputeRates:
    """The rank's ComputeRates for the run described by config and setup: a layer's FLOPs per second
    (`layer_flops_per_s`) and the model ends' per output-layer FLOP (`output_flops_per_s`), the optimizer built by
    `optimizer_factory(params)` (the run's own: fused AdamW, DeepSpeedCPUAdam, ...) a step and per element where it
    runs (the host when the optimizer is offloaded), host copies, copies within the accelerator's memory (on a CPU
    rank the same) and, given the NVMe swap folder, its read and write rate with the DeepSpeed config's aio
    section `aio_section`. All ranks call it together after a
    barrier."""
    optimizer_device = torch.device("cpu") if setup.offload_optimizer else device
    layers = layer_flops_per_s(config, setup, device, dtype)
    ends = output_flops_per_s(config, setup, device, dtype)
    optimizer_fixed, optimizer = optimizer_seconds(optimizer_factory, optimizer_device)
    host_copies = host_copy_bytes_per_s(device)
    device_copies = device_copy_bytes_per_s(device) if device.type == "cuda" else host_copies
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the largest sizes' buffers (about 1 GiB) go back before the model needs them
    return ComputeRates(
        flops_per_s=layers, output_flops_per_s=ends, optimizer_s_per_element=optimizer,
        optimizer_step_s=optimizer_fixed,
        host_copy_bytes_per_s=host_copies, device_copy_bytes_per_s=device_copies,
        nvme_bytes_per_s=None if offload_device_path is None else nvme_bytes_per_s(offload_device_path, aio_section))
