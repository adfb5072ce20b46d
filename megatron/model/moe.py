"""Mixture of experts in the GPT MLP through DeepSpeed's own MoE layer (deepspeed.moe.layer.MoE, top-k gating),
as Megatron-DeepSpeed builds it: each expert is the dense MLP, at its full width (no tensor parallelism).

DeepSpeed owns the expert-parallel groups: the engine creates them (deepspeed.utils.groups) and hands each MoE
layer its group, so this file has no collective calls. What it adds to DeepSpeed's layer:
- each expert's initial weights come from its global index, so that an expert starts the same whatever the
  expert-parallel size (DeepSpeed deep-copies one expert into every local slot);
- the gate's routing statistics (tokens per expert, tokens dropped by capacity, the load-balancing loss),
  summed on the device between log lines, without a host sync per step.
"""
from __future__ import annotations

import torch
from deepspeed.moe.layer import MoE
from torch import nn

from megatron.model.config import GPTConfig


def expert_parallel_rank(data_parallel_rank: int, ep_size: int) -> int:
    """This rank's place in its expert-parallel group. DeepSpeed (groups._create_expert_and_data_parallel, without
    tensor or pipeline parallelism) groups consecutive data-parallel ranks: [0..ep), [ep..2 ep), ..."""
    return data_parallel_rank % ep_size


def expert_rank(config: GPTConfig, data_parallel_rank: int) -> int:
    """This rank's place in its expert-parallel group, at the run's expert-parallel size (the GPTModel's
    expert_rank: which experts of each MoE layer it holds)."""
    return expert_parallel_rank(data_parallel_rank, config.expert_parallel_size)


class RoutingStats:
    """One MoE layer's routing, summed over the forwards in training mode since the last read."""

    def __init__(self, num_experts: int):
        self.tokens_per_expert = torch.zeros(num_experts)  # routes chosen by the gate, before capacity
        self.routes = torch.zeros(2)  # (routes chosen, routes dropped by capacity)
        self.aux_loss = torch.zeros(2)  # (sum of l_aux, forwards)
        # token slots per expert summed over the forwards: what the all-to-alls carried (read apart, by this rank)
        self.capacity = torch.zeros(())

    def add(self, gate_output: tuple) -> None:
        l_aux, capacity, _, indices, _, _, exp_counts = gate_output  # sparse routes: a negative index: dropped
        if self.routes.device != indices.device:
            self.tokens_per_expert, self.routes, self.aux_loss, self.capacity = (
                t.to(indices.device) for t in (self.tokens_per_expert, self.routes, self.aux_loss, self.capacity))
        self.capacity += capacity
        self.tokens_per_expert += exp_counts.float()
        self.routes += torch.stack([torch.tensor(indices.numel(), device=indices.device, dtype=torch.float32),
                                    (indices < 0).sum().float()])
        self.aux_loss += torch.stack([l_aux.detach().float(), torch.ones((), device=l_aux.device)])

    def take_capacity(self) -> float:
        """The capacities summed since the last call, and start again from zero."""
        total = float(self.capacity)
        self.capacity.zero_()
        return total

    def take(self) -> torch.Tensor:
        """[tokens per expert..., routes, dropped, l_aux sum, forwards], and start again from zero."""
        flat = torch.cat([self.tokens_per_expert, self.routes, self.aux_loss])
        for t in (self.tokens_per_expert, self.routes, self.aux_loss):
            t.zero_()
        return flat


class MoEMLP(nn.Module):
    """DeepSpeed's MoE layer around `num_experts` copies of `expert_factory()`'s MLP; forward returns the output
    only, and keeps the gate's load-balancing loss (l_aux) of the last forward for the loss function."""

    def __init__(self, config: GPTConfig, num_experts: int, expert_factory, expert_rank: int = 0):
        super().__init__()
        ep = config.moe_expert_parallel_size
        self.moe = MoE(config.hidden_size, expert_factory(), num_experts=num_experts, ep_size=ep, k=config.topk,
                       capacity_factor=config.moe_train_capacity_factor,
                       eval_capacity_factor=config.moe_eval_capacity_factor, min_capacity=config.moe_min_capacity,
                       use_residual=config.mlp_type == "residual", drop_tokens=config.moe_token_dropping)
        self.expert_rank = expert_rank
        local = self.moe.deepspeed_moe.experts.deepspeed_experts
        seed = torch.initial_seed()  # the layer's own (megatron/model/gpt_model.py's layer_init_seed)
        for i, slot in enumerate(local):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed((seed * 1000003 + expert_rank * len(local) + i + 1) % 2**63)
                fresh = expert_factory()
            with torch.no_grad():
                for mine, new in zip(slot.parameters(), fresh.parameters()):
                    mine.copy_(new)  # in place: DeepSpeed marked these parameters as expert ones
        self.min_capacity = config.moe_min_capacity
        self.stats = RoutingStats(num_experts)
        self.moe.deepspeed_moe.gate.register_forward_hook(self._record)
        self.aux_loss: torch.Tensor | None = None

    def _record(self, gate, _inputs, output):
        # a forward that activation checkpointing (--checkpoint-activations) recomputes runs inside the backward:
        # its routing is the first forward's again (the same inputs and random state), so it is not counted twice
        if gate.training and torch._C._current_graph_task_id() == -1:
            self.stats.add(output)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # DeepSpeed's top-1 gate refuses fewer tokens than --moe-min-capacity (a generation step with a KV cache
        # has one): an expert's capacity of at least the token count drops none of them, as the minimum would not
        tokens = x.numel() // x.shape[-1]
        self.moe.deepspeed_moe.gate.min_capacity = min(self.min_capacity, tokens)
        out, self.aux_loss, _ = self.moe(x)
        return out


def moe_layers(model: nn.Module) -> list[MoEMLP]:
    return [module for module in model.modules() if isinstance(module, MoEMLP)]


def aux_loss(model: nn.Module) -> torch.Tensor | None:
    """The sum of the MoE layers' load-balancing losses from the last forward (None: no MoE layers), what
    Megatron-DeepSpeed adds to the lm loss times --moe-loss-coeff."""
    losses = [layer.aux_loss for layer in moe_layers(model) if layer.aux_loss is not None]
    return torch.stack([loss.float() for loss in losses]).sum() if losses else None


def routing_summary(per_layer: list[torch.Tensor], coeff: float) -> tuple[float, float, float]:
    """(moe loss, expert load max/mean, fraction dropped) from each layer's RoutingStats.take() summed over the
    data-parallel ranks: the loss as the loss function adds it (coeff x the layers' l_aux, each the mean
    over the interval's forwards and the ranks), the load of the most unbalanced layer, the drops of all."""
    loss, imbalance, routes, dropped = 0.0, 0.0, 0.0, 0.0
    for flat in per_layer:
        counts, (chosen, lost, aux, forwards) = flat[:-4], flat[-4:].tolist()
        loss += aux / max(forwards, 1.0)
        imbalance = max(imbalance, float(counts.max() / counts.mean().clamp(min=1e-12)))
        routes, dropped = routes + chosen, dropped + lost
    return coeff * loss, imbalance, dropped / max(routes, 1.0)
