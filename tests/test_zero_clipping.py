"""megatron/zero_clipping.py against DeepSpeed 0.19.8's DeepSpeedZeroOptimizer.unscale_and_clip_grads, on the
optimizer of a real ZeRO-2 engine from setup_engine: the same scaled gradients bit for bit for norms that clip, that
do not, and that are not valid (inf, nan, DeepSpeed's -1 sentinel), with no host read; a training run's losses are
the same with either."""
from functools import partial

import pytest
import torch
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from test_host_syncs import VOCAB, _engine, batches
from test_tensor_parallel import run_ranks

pytestmark = pytest.mark.slow

NORMS = [0.05, 0.3, 7.0, float("inf"), float("nan"), -1.0]


def _copies(grads: list) -> list:
    return [[g.clone() for g in grad] if isinstance(grad, list) else grad.clone() for grad in grads]


def _check_same_scaling(rank, world):
    engine, _, _ = _engine(2, 2, "bf16", "--clip-grad", "0.3")
    optimizer = engine.optimizer
    assert type(optimizer) is DeepSpeedZeroOptimizer and "unscale_and_clip_grads" in vars(optimizer)
    grads = [torch.randn(1000, generator=torch.Generator().manual_seed(1)), [torch.randn(10), torch.randn(3)]]
    reads = []
    original_bool = torch.Tensor.__bool__
    for norm in NORMS:
        ours, theirs = _copies(grads), _copies(grads)
        torch.Tensor.__bool__ = lambda tensor: reads.append(norm) or original_bool(tensor)
        try:
            optimizer.unscale_and_clip_grads(ours, torch.tensor(norm))
        finally:
            torch.Tensor.__bool__ = original_bool
        DeepSpeedZeroOptimizer.unscale_and_clip_grads(optimizer, theirs, torch.tensor(norm))
        assert torch.equal(ours[0], theirs[0]) and all(map(torch.equal, ours[1], theirs[1])), norm
        assert not torch.equal(ours[0], grads[0]) or norm <= 0.3  # the large and invalid norms scaled them
    assert reads == []
    engine.destroy()


def _losses(override: bool) -> list[float]:
    from megatron import zero_clipping
    from megatron.training import train_step

    keep = zero_clipping.clip_without_host_reads
    if not override:
        zero_clipping.clip_without_host_reads = lambda optimizer: None
    try:
        engine, args, dist_info = _engine(2, 2, "bf16", "--clip-grad", "0.3")
    finally:
        zero_clipping.clip_without_host_reads = keep
    data = batches()
    losses = [train_step(engine, data, args, dist_info, VOCAB - 1).loss.item() for _ in range(4)]
    engine.destroy()
    return losses


def _check_same_training(rank, world):
    ours, theirs = _losses(True), _losses(False)
    assert ours == theirs and len(set(ours)) == 4


@pytest.mark.parametrize("check", [_check_same_scaling, _check_same_training])
def test_zero_clipping_is_deepspeeds_without_host_reads(check):
    run_ranks(partial(check), world_size=1)
