"""Tensor parallelism on real 2-rank gloo groups (tests marked slow): layers, loss, RNG, the whole
GPT model, DeepSpeed with our mpu and the pipeline form against their serial counterparts;
the parallel layout's rank order and errors. The checks of one world size run in one spawn of its ranks
(the fixtures world_2, world_4); each test asserts on its check's result on every rank."""
import datetime
import faulthandler
import json
import os
import socket
import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from megatron.core.parallel_state import ParallelLayout, ParallelLayoutError, ParallelState
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    init_method_normal,
    model_parallel_tracker,
    reduce_scatter_to_sequence_parallel_region,
    vocab_parallel_lm_loss,
)
from megatron.core.scratch import ScratchBuffers
from megatron.model import GPTConfig, GPTModel, ModelConfigError

SEED = 4321


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A check that hangs in a collective (its peer failed before it) fails after this many seconds, not the suite's.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)


def start_rank() -> None:
    """A spawned rank that aborts in C++ prints every thread's Python stack first (faulthandler), so the test's
    captured output says where it was."""
    faulthandler.enable()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(1)


def leave_rank() -> None:
    """End a spawned rank whose work is done and whose process group is destroyed, without tearing the
    interpreter down. A backward that recomputes collectives (a checkpointed layer, DeepSpeed's TiledMLP) leaves
    a reference to the gloo group in torch, so its worker threads outlive destroy_process_group and still run
    while Python finalizes; once in CI that ended a finished rank with SIGABRT ("terminate called without an
    active exception") and failed its test. Nothing is left to finalize: results are files or raised errors."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _worker(rank, world_size, port, checks, results_dir):
    """Run each of `checks` (name -> fn(rank, world_size)) in order on this rank, writing {name: None, or the
    failure} to results_dir/rank<rank>.json. After the first failure on any rank the ranks may no longer agree
    on which collective comes next, so the rest are not run (recorded as such)."""
    start_rank()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=COLLECTIVE_TIMEOUT)
    results, failed = {}, None
    try:
        for name, fn in checks.items():
            if failed is not None:
                results[name] = f"not run: check {failed} failed before it"
                continue
            try:
                fn(rank, world_size)
                results[name] = None
            except BaseException:  # noqa: BLE001 - the test reports it, with its traceback
                results[name], failed = traceback.format_exc(), name
            ok = torch.tensor([0.0 if failed else 1.0])
            if failed is None:  # every rank's verdict, so a failure on one stops the others too
                dist.all_reduce(ok, op=dist.ReduceOp.MIN)
                if ok.item() == 0.0:
                    failed = f"{name} (on another rank)"
        if failed is None:
            dist.barrier()  # gloo's threads are torn down only once no rank still talks to them
    finally:
        (Path(results_dir) / f"rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()
    leave_rank()


def _single_worker(rank, world_size, port, fn):
    start_rank()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size)
        dist.barrier()  # gloo's threads are torn down only once no rank still talks to them
    finally:
        dist.destroy_process_group()
    leave_rank()


def run_ranks(fn, world_size=2):
    """Run fn(rank, world_size) on world_size real processes; a failing rank fails the caller (the other test
    files' multi-rank checks use this)."""
    mp.spawn(_single_worker, args=(world_size, _free_port(), fn), nprocs=world_size, join=True)


def run_checks(checks: dict, world_size: int, results_dir: Path) -> dict:
    """All of `checks` in one spawn of world_size real processes: {name: {rank: None or the failure}}."""
    try:
        mp.spawn(_worker, args=(world_size, _free_port(), checks, str(results_dir)), nprocs=world_size, join=True)
    except mp.ProcessRaisedException as error:  # a rank died outside the checks: every check reports it
        return {name: {0: f"the ranks failed: {error}"} for name in checks}
    per_rank = [json.loads((results_dir / f"rank{rank}.json").read_text()) for rank in range(world_size)]
    return {name: {rank: found[name] for rank, found in enumerate(per_rank)} for name in checks}


def assert_passed(results: dict, name: str) -> None:
    failures = {rank: failure for rank, failure in results[name].items() if failure is not None}
    assert not failures, "\n".join(f"{name} on rank {rank}:\n{failure}" for rank, failure in failures.items())


def _shard(full, dim, rank, world=2):
    return full.chunk(world, dim=dim)[rank]


def _check_linear_layers(rank, world):
    group = dist.group.WORLD
    init = init_method_normal(0.5)
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)

    torch.manual_seed(SEED)
    serial_col = ColumnParallelLinear(8, 12, group=None, init_method=init)
    serial_row = RowParallelLinear(12, 6, group=None, init_method=init)
    torch.manual_seed(SEED)
    col = ColumnParallelLinear(8, 12, group=group, init_method=init)
    row = RowParallelLinear(12, 6, group=group, init_method=init)

    # Each rank holds exactly its half of the serial weights.
    assert col.weight.shape == (6, 8) and row.weight.shape == (6, 6)
    assert torch.equal(col.weight, _shard(serial_col.weight, 0, rank))
    assert torch.equal(row.weight, _shard(serial_row.weight, 1, rank))
    with torch.no_grad():  # non-zero biases so their gradients and placement are tested too
        serial_col.bias.copy_(torch.arange(12.0) / 10)
        col.bias.copy_(_shard(serial_col.bias, 0, rank))
        serial_row.bias.fill_(0.3)
        row.bias.fill_(0.3)
    assert col.weight.tensor_model_parallel and not hasattr(row.bias, "tensor_model_parallel")

    x_serial = x.detach().clone().requires_grad_(True)
    expected = serial_row(F.gelu(serial_col(x_serial)))
    torch.testing.assert_close(expected, F.linear(F.gelu(F.linear(x_serial, serial_col.weight, serial_col.bias)),
                                                  serial_row.weight, serial_row.bias))
    out = row(F.gelu(col(x)))
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    weights = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1))
    (expected * weights).sum().backward()
    (out * weights).sum().backward()
    torch.testing.assert_close(x.grad, x_serial.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(col.weight.grad, _shard(serial_col.weight.grad, 0, rank), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(col.bias.grad, _shard(serial_col.bias.grad, 0, rank), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(row.weight.grad, _shard(serial_row.weight.grad, 1, rank), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(row.bias.grad, serial_row.bias.grad, rtol=1e-6, atol=1e-6)

    # gather_output / input_is_parallel=False: the same maths with full tensors at both ends.
    torch.manual_seed(SEED)
    gathered = ColumnParallelLinear(8, 12, group=group, init_method=init, gather_output=True)
    scattered = RowParallelLinear(12, 6, group=group, init_method=init, input_is_parallel=False)
    x2 = x.detach().clone().requires_grad_(True)
    with torch.no_grad():
        gathered.bias.copy_(col.bias)
        scattered.bias.fill_(0.3)
    out2 = scattered(F.gelu(gathered(x2)))
    torch.testing.assert_close(out2, expected, rtol=1e-6, atol=1e-6)
    (out2 * weights).sum().backward()
    torch.testing.assert_close(x2.grad, x_serial.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_column_and_row_parallel_linear_match_serial(world_2):
    assert_passed(world_2, "_check_linear_layers")


def _check_embedding(rank, world):
    group = dist.group.WORLD
    ids = torch.tensor([[0, 5, 9, 15], [8, 7, 1, 8]])  # ids from both halves of a 16-row table
    torch.manual_seed(SEED)
    serial = VocabParallelEmbedding(16, 4, group=None, init_method=init_method_normal(1.0))
    torch.manual_seed(SEED)
    parallel = VocabParallelEmbedding(16, 4, group=group, init_method=init_method_normal(1.0))
    assert parallel.weight.shape == (8, 4)
    assert torch.equal(parallel.weight, _shard(serial.weight, 0, rank))
    expected, out = serial(ids), parallel(ids)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(2))
    expected.backward(grad)
    out.backward(grad)
    torch.testing.assert_close(parallel.weight.grad, _shard(serial.weight.grad, 0, rank), rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_vocab_parallel_embedding_matches_serial(world_2):
    assert_passed(world_2, "_check_embedding")


def _check_fused_lm_loss(rank, world):
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 5, 8, generator=gen).requires_grad_(True)
    weight = torch.randn(12, 8, generator=gen).requires_grad_(True)
    target = torch.randint(0, 12, (2, 5), generator=gen)
    weights = torch.rand(2, 5, generator=gen)
    expected = F.cross_entropy(F.linear(hidden, weight).view(-1, 12), target.view(-1), reduction="none").view(2, 5)
    (expected * weights).sum().backward()

    local_weight = _shard(weight.detach(), 0, rank).clone().requires_grad_(True)
    local_hidden = hidden.detach().clone().requires_grad_(True)
    scratch = ScratchBuffers()
    for _ in range(2):  # the second step computes in the buffer the first one gave back
        local_hidden.grad = local_weight.grad = None
        loss = vocab_parallel_lm_loss(copy_to_tensor_model_parallel_region(local_hidden, group), local_weight,
                                      target, group, scratch)
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
        (loss * weights).sum().backward()
        torch.testing.assert_close(local_hidden.grad, hidden.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(local_weight.grad, _shard(weight.grad, 0, rank), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_fused_output_layer_loss_matches_torch_over_vocab_shards(world_2):
    assert_passed(world_2, "_check_fused_lm_loss")


def _check_sequence_parallel_mappings(rank, world):
    group = dist.group.WORLD
    full = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3)
    local = _shard(full, 1, rank).clone().requires_grad_(True)
    gathered = gather_from_sequence_parallel_region(local, group)
    assert torch.equal(gathered, full)
    # Backward of the gather is a reduce-scatter: each rank's grad is the sum over ranks of its slice.
    grad = full * (rank + 1)
    gathered.backward(grad)
    assert torch.equal(local.grad, _shard(full * 3, 1, rank))

    partial = (full * (rank + 1)).requires_grad_(True)
    scattered = reduce_scatter_to_sequence_parallel_region(partial, group)
    assert torch.equal(scattered, _shard(full * 3, 1, rank))
    scattered.backward(_shard(full, 1, rank))
    assert torch.equal(partial.grad, full)  # backward all-gathers


@pytest.mark.slow
def test_sequence_parallel_gather_and_reduce_scatter(world_2):
    assert_passed(world_2, "_check_sequence_parallel_mappings")


def _check_mappings_on_torch_before_2_13(rank, world):
    """torch 2.11 and 2.12 (which setup.py accepts) have no all_gather_single / reduce_scatter_single: played
    here by deleting them from torch.distributed in this rank's process (distributed_c10d keeps its own, which
    2.13's all_gather_into_tensor calls). The traffic counter still counts each collective once, by its name."""
    import warnings

    from megatron.accounting.measure import comm_counter

    removed = {name: getattr(dist, name) for name in ("all_gather_single", "reduce_scatter_single")}
    for name in removed:
        delattr(dist, name)
    counter = comm_counter.install()
    try:
        with counter.counting(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # 2.13 deprecates the older names
            _check_sequence_parallel_mappings(rank, world)
    finally:
        comm_counter.uninstall()
        for name, fn in removed.items():  # the checks after this one run on torch 2.13 again
            setattr(dist, name, fn)
    # forward gather + its backward reduce-scatter, forward reduce-scatter + its backward gather
    assert counter.calls == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}, counter.calls
    assert counter.sent["all_gather"] == counter.sent["reduce_scatter"] == 2 * (24 * 4 / 2)  # 24 fp32, half sent


@pytest.mark.slow
def test_sequence_parallel_mappings_without_the_torch_2_13_collectives(world_2):
    assert_passed(world_2, "_check_mappings_on_torch_before_2_13")


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_sequence_parallel_norms_share_one_forward_and_are_the_torch_norms(sequence_parallel):
    """Both norms are _SequenceParallelNorm over their torch class: one constructor and forward, and on one rank
    (group None) the torch norm's output, gradients and state dict keys, sequence parallel or not (two ranks:
    test_sequence_parallel_gpt_matches_serial_loss_and_gradients and test_llama's TP=2 check)."""
    from megatron.core.tensor_parallel import SequenceParallelLayerNorm, SequenceParallelRMSNorm

    assert SequenceParallelLayerNorm.forward is SequenceParallelRMSNorm.forward
    assert SequenceParallelLayerNorm.__init__ is SequenceParallelRMSNorm.__init__
    for ours, theirs in ((SequenceParallelLayerNorm, torch.nn.LayerNorm), (SequenceParallelRMSNorm, torch.nn.RMSNorm)):
        norm = ours(8, eps=1e-5, group=None, sequence_parallel=sequence_parallel)
        reference = theirs(8, eps=1e-5)
        with torch.no_grad():
            for mine, other in zip(norm.parameters(), reference.parameters()):
                mine.copy_(torch.randn_like(mine))
                other.copy_(mine)
        x = torch.randn(2, 3, 8)
        torch.testing.assert_close(norm(x), reference(x), rtol=0, atol=0)
        norm(x).square().sum().backward()
        reference(x).square().sum().backward()
        for mine, other in zip(norm.parameters(), reference.parameters()):
            torch.testing.assert_close(mine.grad, other.grad, rtol=0, atol=0)
        assert norm.state_dict().keys() == reference.state_dict().keys()


def _check_rng_tracker(rank, world):
    torch.manual_seed(SEED)
    tracker = model_parallel_tracker(SEED, tensor_parallel_rank=rank)
    with tracker.fork(torch.device("cpu")):
        inside = torch.rand(8)
    outside = torch.rand(8)
    with tracker.fork(torch.device("cpu")):
        inside_again = torch.rand(8)
    assert not torch.equal(inside, inside_again)  # the tracked stream advances
    everyone = [torch.empty(8) for _ in range(world)]
    dist.all_gather(everyone, inside)
    assert not torch.equal(everyone[0], everyone[1])
    dist.all_gather(everyone, outside)
    assert torch.equal(everyone[0], everyone[1])
    torch.manual_seed(SEED)
    assert torch.equal(torch.rand(8), outside)  # fork neither uses nor advances the default stream


@pytest.mark.slow
def test_rng_tracker_differs_inside_tensor_parallel_region_only(world_2):
    assert_passed(world_2, "_check_rng_tracker")


def _gpt_config(**overrides):
    fields = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, max_position_embeddings=16,
                  padded_vocab_size=64, hidden_dropout=0.0, attention_dropout=0.0)
    fields.update(overrides)
    return GPTConfig(**fields)


def _gpt_batch():
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 64, (2, 9), generator=gen)
    return ids[:, :-1], torch.arange(8).expand(2, 8), ids[:, 1:]


def _partition_dim(param):
    return param.partition_dim if getattr(param, "tensor_model_parallel", False) else None


def _check_gpt_tp2_matches_tp1(rank, world):
    state = ParallelState.build(ParallelLayout(world_size=2, tensor_model_parallel_size=2))
    group = state.get_tensor_model_parallel_group()
    config = _gpt_config()
    torch.manual_seed(SEED)
    serial = GPTModel(config)
    torch.manual_seed(SEED)
    parallel = GPTModel(config, tp_group=group)
    tokens, positions, labels = _gpt_batch()
    loss_serial = serial(tokens, positions, labels)
    loss_parallel = parallel(tokens, positions, labels)
    torch.testing.assert_close(loss_parallel, loss_serial, rtol=1e-5, atol=0)
    loss_serial.mean().backward()
    loss_parallel.mean().backward()

    serial_params = dict(serial.named_parameters())
    split = 0
    for name, param in parallel.named_parameters():
        full = serial_params[name]
        dim = _partition_dim(param)
        if dim is None:
            assert param.shape == full.shape, name
            expected_value, expected_grad = full, full.grad
        else:
            split += 1
            assert param.shape[dim] * 2 == full.shape[dim], name  # half of each parallel weight
            expected_value, expected_grad = _shard(full, dim, rank), _shard(full.grad, dim, rank)
        assert torch.equal(param, expected_value), name
        rel = (param.grad - expected_grad).norm() / expected_grad.norm()
        assert rel < 1e-5, f"{name}: relative gradient difference {rel:.3e}"
    assert split == 1 + 6 * config.num_layers  # embedding; per layer QKV w+b, fc1 w+b, attention-out and fc2 w
    # Full logits are gathered over the vocab shards when no labels are given.
    torch.testing.assert_close(parallel(tokens, positions), serial(tokens, positions), rtol=1e-5, atol=1e-6)

    heads_error = "--num-attention-heads 3 is not divisible by --tensor-model-parallel-size 2"
    with pytest.raises(ModelConfigError, match=heads_error):
        GPTModel(_gpt_config(hidden_size=24, num_attention_heads=3), tp_group=group)
    vocab_error = "padded vocab size 63 is not divisible by --tensor-model-parallel-size 2"
    with pytest.raises(ModelConfigError, match=vocab_error):
        GPTModel(_gpt_config(padded_vocab_size=63), tp_group=group)


@pytest.mark.slow
def test_gpt_tp2_matches_tp1_loss_and_gradients(world_2):
    assert_passed(world_2, "_check_gpt_tp2_matches_tp1")


def _check_gpt_tp2_dropout_and_recompute(rank, world):
    group = dist.group.WORLD
    tokens, positions, labels = _gpt_batch()
    grads = []
    for recompute in (False, True):
        torch.manual_seed(SEED)
        config = _gpt_config(hidden_dropout=0.2, attention_dropout=0.2, recompute_activations=recompute)
        model = GPTModel(config, tp_group=group)
        torch.manual_seed(11)
        model(tokens, positions, labels).mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
        # Replicated parameters see identical activations (and dropout masks) on both TP ranks.
        for name, param in model.named_parameters():
            if _partition_dim(param) is None:
                other = [torch.empty_like(param.grad) for _ in range(world)]
                dist.all_gather(other, param.grad.contiguous())
                assert torch.equal(other[0], other[1]), name
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.slow
def test_gpt_tp2_dropout_consistent_and_recompute_exact(world_2):
    assert_passed(world_2, "_check_gpt_tp2_dropout_and_recompute")


def test_layout_rank_order_matches_megatron_world_8_tp2_pp2():
    layout = ParallelLayout(world_size=8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    assert layout.data_parallel_size == 2
    assert layout.tensor_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.data_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.pipeline_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.model_groups() == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_layout_megatron_docstring_example_world_16_tp2_pp4():
    layout = ParallelLayout(world_size=16, tensor_model_parallel_size=2, pipeline_model_parallel_size=4)
    assert layout.data_groups() == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert layout.pipeline_groups() == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert layout.tensor_groups()[-1] == [14, 15]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(world_size=6, tensor_model_parallel_size=4),
         "world size 6 is not divisible by --tensor-model-parallel-size 4 x --pipeline-model-parallel-size 1"),
        (dict(world_size=8, tensor_model_parallel_size=2, pipeline_model_parallel_size=3),
         "world size 8 is not divisible by --tensor-model-parallel-size 2 x --pipeline-model-parallel-size 3"),
        (dict(world_size=4, tensor_model_parallel_size=0), "--tensor-model-parallel-size must be >= 1, got 0"),
    ],
)
def test_layout_errors(kwargs, message):
    with pytest.raises(ParallelLayoutError) as error:
        ParallelLayout(**kwargs)
    assert str(error.value) == message


def test_single_process_state_without_distributed():
    state = ParallelState.build(ParallelLayout(world_size=1))
    assert state.get_tensor_model_parallel_world_size() == 1 and state.get_data_parallel_world_size() == 1
    assert state.get_tensor_model_parallel_group() is None
    with pytest.raises(ParallelLayoutError, match="world size 2 needs torch.distributed to be initialized"):
        ParallelState.build(ParallelLayout(world_size=2))


def _check_state_groups(rank, world):
    state = ParallelState.build(ParallelLayout(world_size=4, tensor_model_parallel_size=2))
    assert state.get_tensor_model_parallel_rank() == rank % 2
    assert state.get_tensor_model_parallel_world_size() == 2
    assert state.get_data_parallel_rank() == rank // 2 and state.get_data_parallel_world_size() == 2
    assert state.get_data_parallel_group_ranks() == [rank % 2, rank % 2 + 2]
    assert state.get_pipe_parallel_world_size() == 1 and state.is_pipeline_last_stage()
    assert state.get_model_parallel_world_size() == 2
    assert state.get_tensor_model_parallel_src_rank() == rank - rank % 2
    # The groups are real: a sum over each group adds exactly its members' ranks.
    value = torch.tensor([float(rank)])
    dist.all_reduce(value, group=state.get_tensor_model_parallel_group())
    assert value.item() == {0: 1, 1: 1, 2: 5, 3: 5}[rank]
    value = torch.tensor([float(rank)])
    dist.all_reduce(value, group=state.get_data_parallel_group())
    assert value.item() == {0: 2, 1: 4, 2: 2, 3: 4}[rank]


@pytest.mark.slow
def test_parallel_state_builds_real_groups_world_4(world_4):
    assert_passed(world_4, "_check_state_groups")


def _check_deepspeed_zero_with_mpu(rank, world):
    import deepspeed  # imported here: only this check needs it, and it is slow to import

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    state = ParallelState.build(ParallelLayout(world_size=world, tensor_model_parallel_size=2))
    config = _gpt_config()
    torch.manual_seed(SEED)
    serial = GPTModel(config)
    torch.manual_seed(SEED)
    parallel = GPTModel(config, tp_group=state.get_tensor_model_parallel_group())
    ds_config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0, "torch_adam": True}},
        "gradient_clipping": 1.0,
    }
    engine, _, _, _ = deepspeed.initialize(model=parallel, model_parameters=parallel.parameters(),
                                           config=ds_config, mpu=state)
    # ZeRO partitions over data-parallel ranks only: the two TP ranks hold different shards.
    assert engine.dp_world_size == 1
    optimizer = torch.optim.AdamW(serial.parameters(), lr=1e-2, weight_decay=0.0)
    tokens, positions, labels = _gpt_batch()
    for _ in range(3):
        loss = engine(tokens, positions, labels).mean()
        engine.backward(loss)
        engine.step()
        expected = serial(tokens, positions, labels).mean()
        optimizer.zero_grad()
        expected.backward()
        # The gradient norm is over the whole model: gradient clipping (norm > 1 here) only
        # agrees with the serial run if replicated parameters are counted once.
        serial_norm = torch.nn.utils.clip_grad_norm_(serial.parameters(), 1.0)
        optimizer.step()
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)
        assert abs(engine.get_global_grad_norm() - serial_norm.item()) < 1e-4 * serial_norm.item()
    assert serial_norm > 1.0


@pytest.mark.slow
def test_deepspeed_zero_accepts_parallel_state_as_mpu(world_2):
    assert_passed(world_2, "_check_deepspeed_zero_with_mpu")


def _pipe_to_serial_name(name: str, num_layers: int) -> str:
    """PipelineModule names ("tied_modules.embed.X", "<layer index>.X") -> GPTModel names."""
    if name.startswith("tied_modules.embed."):
        return name[len("tied_modules.embed."):]
    index, rest = name.split(".", 1)
    return f"layers.{int(index) - 1}.{rest}" if int(index) <= num_layers else f"final_layernorm.{rest}"


def _check_pipeline_matches_serial(rank, world):
    import deepspeed

    from megatron.model.gpt_model_pipe import build_gpt_pipe

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    deepspeed.init_distributed(dist_backend="gloo")  # PipelineModule talks through deepspeed.comm
    state = ParallelState.build(ParallelLayout(world_size=world, pipeline_model_parallel_size=2))
    config = _gpt_config()
    with pytest.raises(ModelConfigError, match="--num-layers 3 is not divisible by --pipeline-model-parallel-size 2"):
        build_gpt_pipe(_gpt_config(num_layers=3), state)
    torch.manual_seed(SEED)
    serial = GPTModel(config)
    pipe = build_gpt_pipe(config, state)
    serial_params = dict(serial.named_parameters())
    local_layers = set()
    with torch.no_grad():
        for name, param in pipe.named_parameters():
            param.copy_(serial_params[_pipe_to_serial_name(name, config.num_layers)])
            local_layers.add(name.split(".")[0])
    # Stage 0 holds the embedding and layer 1, stage 1 layer 2, the final LayerNorm and the tied embedding.
    assert local_layers == ({"tied_modules", "1"} if rank == 0 else {"tied_modules", "2", "3"})
    ds_config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0, "torch_adam": True}},
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
    }
    engine, _, _, _ = deepspeed.initialize(model=pipe, model_parameters=pipe.parameters(), config=ds_config)
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 64, (4, 9), generator=gen)
    loss_mask = torch.ones(4, 8)
    loss_mask[0, :3] = 0  # masked tokens must drop out of the mean
    positions = torch.arange(8).expand(2, 8)
    micro_batches = [((ids[i:i + 2, :-1], positions), (ids[i:i + 2, 1:], loss_mask[i:i + 2])) for i in (0, 2)]
    optimizer = torch.optim.AdamW(serial.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(3):
        pipe_loss = engine.train_batch(iter(micro_batches))
        optimizer.zero_grad()
        serial_loss = 0.0
        for (tokens, pos), (labels, mask) in micro_batches:
            loss = (serial(tokens, pos, labels) * mask).sum() / mask.sum() / len(micro_batches)
            loss.backward()
            serial_loss += loss.item()
        torch.nn.utils.clip_grad_norm_(serial.parameters(), 1.0)
        optimizer.step()
        assert abs(float(pipe_loss) - serial_loss) < 1e-5 * serial_loss, (float(pipe_loss), serial_loss)


@pytest.mark.slow
def test_pipeline_form_two_stages_matches_serial_training(world_2):
    assert_passed(world_2, "_check_pipeline_matches_serial")


# One spawn per world size runs every check of that size (each spawn costs an interpreter, torch and gloo
# start-up per rank); each test asserts on its own check's result. The pipeline check goes last: it
# initializes deepspeed.comm over the group.
CHECKS_WORLD_2 = [_check_linear_layers, _check_embedding, _check_fused_lm_loss, _check_sequence_parallel_mappings,
                  _check_mappings_on_torch_before_2_13, _check_rng_tracker, _check_gpt_tp2_matches_tp1,
                  _check_gpt_tp2_dropout_and_recompute, _check_deepspeed_zero_with_mpu, _check_pipeline_matches_serial]


@pytest.fixture(scope="module")
def world_2(tmp_path_factory):
    return run_checks({fn.__name__: fn for fn in CHECKS_WORLD_2}, 2, tmp_path_factory.mktemp("tp_world_2"))


@pytest.fixture(scope="module")
def world_4(tmp_path_factory):
    return run_checks({_check_state_groups.__name__: _check_state_groups}, 4, tmp_path_factory.mktemp("tp_world_4"))
