"""bf16 gradients accumulated in fp32 reach the optimizer unrounded (issue 55, cause 5): real DeepSpeed engines from
setup_engine on gloo ranks, two micro-batches a step. DeepSpeed's communication dtype defaulted to the model's, so
the engine cast the fp32 sums to bf16 for its all-reduce and back, even on one rank; the gradient AdamW steps must
equal the fp32 sum of the micro-batches' bf16 gradients, taken here on a copy of the model outside DeepSpeed."""
import copy
from functools import partial

import pytest
import torch

from test_host_syncs import MICRO, VOCAB, _engine, batches
from test_tensor_parallel import run_ranks

pytestmark = pytest.mark.slow

NO_DROPOUT = ("--hidden-dropout", "0", "--attention-dropout", "0", "--clip-grad", "0")


def _reference_grads(model, micro_batches, args, dist_info) -> list[torch.Tensor]:
    """The fp32 sum of each micro-batch's bf16 gradients of (its loss / the micro-batches), as the engine scales it."""
    from megatron.training import get_batch, sequence_mean_loss

    total = [torch.zeros(p.shape, dtype=torch.float32) for p in model.parameters()]
    for batch in micro_batches:
        tokens, labels, position_ids, loss_mask = get_batch(batch, dist_info.device, VOCAB - 1, False, None)
        loss, _ = sequence_mean_loss(model(tokens, position_ids, labels), loss_mask, None)
        model.zero_grad(set_to_none=True)
        (loss / len(micro_batches)).backward()
        for sum_, param in zip(total, model.parameters()):
            assert param.grad.dtype == torch.bfloat16
            sum_ += param.grad.float()
    return total


def _check_stage(rank, world, stage):
    from megatron.training import train_step

    engine, args, dist_info = _engine(2, stage, "bf16", "--global-batch-size", str(2 * MICRO), *NO_DROPOUT)
    assert args.training.gradient_accumulation_steps == 2
    data = batches()
    micro_batches = [next(data) for _ in range(2)]
    expected = _reference_grads(copy.deepcopy(engine.module), micro_batches, args, dist_info)
    stepped = []
    wrapper = engine.optimizer

    def before_adamw(*_):
        stepped.extend(g.clone() for group in wrapper.fp32_groups_gradients for g in group)
    engine.basic_optimizer.register_step_pre_hook(before_adamw)
    train_step(engine, iter(micro_batches), args, dist_info, VOCAB - 1)
    order = {id(p): i for i, p in enumerate(engine.module.parameters())}
    params = [p for group in wrapper.bf16_groups for p in group]
    assert len(stepped) == len(params) == len(expected)
    rounded = 0
    for param, grad in zip(params, stepped):
        want = expected[order[id(param)]]
        rounded += not torch.equal(grad.view(want.shape), want)
    assert rounded == 0, f"{rounded} of {len(params)} gradients differ from the fp32 sum"


def test_zero_1_bf16_steps_the_fp32_sum_of_the_micro_batches_gradients():
    run_ranks(partial(_check_stage, stage=1), world_size=1)
