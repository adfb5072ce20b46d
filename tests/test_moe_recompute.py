"""MoE layers under activation checkpointing (--num-experts with --checkpoint-activations, as Megatron-DeepSpeed's MoE
example scripts pass them): on 2 real gloo ranks at EP 1 and EP 2, the recomputed forward gives the same loss,
load-balancing loss and gradients (dense and expert) as the forward that keeps its activations, and the routing
statistics count each forward once, not again when the backward recomputes it."""
import os

import pytest
import torch

from megatron.core.layout import ParallelLayout
from megatron.core.parallel_state import ParallelState
from megatron.model import GPTModel
from megatron.model.moe import expert_parallel_rank, moe_layers
from megatron.training import get_batch, masked_mean_loss, with_moe_loss
from test_moe import _expert_grads
from test_tensor_parallel import SEED, _gpt_config, run_ranks


def _one_step(rank, world, ep, recompute):
    """One forward and backward of a 4-expert model through DeepSpeed's engine (top-2, token dropping on, so that
    the capacity and the gate's noise matter): (loss with the MoE loss, the MoE loss, expert grads, dense grads,
    the routing statistics taken after the backward)."""
    import deepspeed

    state = ParallelState.build(ParallelLayout(world_size=world))
    config = _gpt_config(num_experts=[4], moe_expert_parallel_size=ep, topk=2, recompute_activations=recompute)
    torch.manual_seed(SEED)
    model = GPTModel(config, expert_rank=expert_parallel_rank(rank, ep))
    engine, *_ = deepspeed.initialize(model=model, mpu=state, dist_init_required=False, config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 0},
        "optimizer": {"type": "Adam", "params": {"lr": 0.0, "torch_adam": True}}})
    engine.train()
    text = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(7 + rank))
    tokens, labels, positions, mask = get_batch({"text": text}, torch.device("cpu"), -1, False)
    torch.manual_seed(SEED + rank)  # the gates' noise
    lm = masked_mean_loss(engine(tokens, positions, labels), mask)
    aux_loss = sum(layer.aux_loss for layer in moe_layers(engine.module)).detach().clone()
    loss = with_moe_loss(lm, engine.module, 0.1)
    engine.backward(loss)
    dense = [p.grad.clone() for name, p in model.named_parameters() if "deepspeed_experts" not in name]
    stats = torch.stack([layer.stats.take() for layer in moe_layers(engine.module)])
    return loss.detach(), aux_loss, _expert_grads(model), dense, stats


def _check_recompute_matches(rank, world):
    import deepspeed

    os.environ["LOCAL_RANK"] = str(rank)  # what a launcher sets; DeepSpeed's engine asks for it
    deepspeed.init_distributed(dist_backend="gloo")
    for ep in (1, 2):
        kept = _one_step(rank, world, ep, recompute=False)
        recomputed = _one_step(rank, world, ep, recompute=True)
        loss, aux, experts, dense, stats = kept
        assert aux > 0 and all(grad.abs().sum() > 0 for grad in experts), "no MoE loss or an idle expert: the " \
                                                                            "test would prove nothing"
        torch.testing.assert_close(recomputed[0], loss, rtol=0, atol=0)
        torch.testing.assert_close(recomputed[1], aux, rtol=0, atol=0)
        for one, two in zip(experts, recomputed[2]):
            torch.testing.assert_close(two, one, rtol=1e-6, atol=1e-9, msg=f"expert gradients at EP {ep}")
        for one, two in zip(dense, recomputed[3]):
            torch.testing.assert_close(two, one, rtol=1e-6, atol=1e-9, msg=f"dense gradients at EP {ep}")
        # one forward per layer counted (the last column), the same tokens per expert and drops
        assert stats[:, -1].tolist() == [1.0] * stats.shape[0]
        torch.testing.assert_close(recomputed[4], stats, rtol=0, atol=0)


@pytest.mark.slow
def test_recomputed_moe_layers_give_the_same_loss_gradients_and_routing_counts():
    run_ranks(_check_recompute_matches)
