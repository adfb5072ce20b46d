"""ZeRO stage 0 in bf16 or fp16: DeepSpeed's wrapper with one host read a step and a norm that counts the experts.

At stage 0 in 16-bit DeepSpeed 0.19.8 wraps our AdamW in its FP16_UnfusedOptimizer (engine.py,
_configure_fp16_optimizer): fp32 master copies of the 16-bit parameters (fp32_groups), which AdamW steps and
which are copied back; the loss scale in fp16 (bf16's is 1). Its step leaves every expert's gradient out of the
norm it clips by and reports (split_params_grads_into_shared_and_expert_params), so an MoE run clipped by, and
logged, the dense part alone; it reads the host once per parameter for its overflow check and per group for its
norm (on a GPU each read waits for the device: issue 55, docs/gpu-reference.md); and as it is built it steps AdamW once
with zero gradients, so the first real update was Adam's second step (0.74 x the rate) and decayed weights shrank once
by lr x wd. WholeNormUnfusedOptimizer is that wrapper with the step taking the norm of the whole model, experts over
their expert-parallel groups, as the fp32 step and ZeRO 1-2 take it, read to the host once, and with AdamW's states
made as Adam's first step finds them; the rest is DeepSpeed's. `whole_norm_unfused_optimizer` makes the engine
build it, for every model at stage 0 in 16-bit.
"""
import contextlib
import math

import torch
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
from deepspeed.utils.bwc import bwc_tensor_model_parallel_rank

from megatron.optimizer import replica_grad_norm


class WholeNormUnfusedOptimizer(FP16_UnfusedOptimizer):
    """FP16_UnfusedOptimizer whose step clips by, and reports, the norm of every gradient of the replica, experts
    included. It reads one value to the host per step (the norm, which decides a skip); DeepSpeed's read one per
    parameter for its overflow check and one per parameter for its norm. A non-finite norm skips the step as
    DeepSpeed's overflow check did: the norm is summed over the model- and expert-parallel groups, so every rank
    that shares the step skips it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        assert not self.fused_lamb_legacy, "zero-lab steps AdamW, never DeepSpeed's LAMB"
        self.norm_group = self.mpu.get_model_parallel_group() if self.mpu is not None else None
        self.tensor_rank = bwc_tensor_model_parallel_rank(self.mpu)

    def initialize_optimizer_states(self):
        with states_without_a_step(self):
            super().initialize_optimizer_states()

    def step(self, closure=None):
        params = [p for group in self.fp16_groups for p in group]
        scaled = replica_grad_norm(params, self.tensor_rank, self.norm_group).item()  # of the loss-scaled gradients
        if not math.isfinite(scaled):
            return self._skip_invalid_grad_norm()
        self.overflow = False
        scale = self.loss_scale_config.cur_scale
        self._global_grad_norm = scaled / scale  # the gradients' norm, as the fp32 step and ZeRO report it
        for fp32_group, fp16_group in zip(self.fp32_groups, self.fp16_groups):
            for fp32_param, fp16_param in zip(fp32_group, fp16_group):
                fp32_param.grad = (torch.zeros_like(fp32_param) if fp16_param.grad is None
                                   else fp16_param.grad.to(fp32_param.dtype))
        # unscale by the scale the gradients carry, then let the dynamic scale grow (DeepSpeed grows it first)
        self.unscale_and_clip_grads(scaled)
        self._update_scale(False)
        self.optimizer.step()
        for fp32_group, fp16_group in zip(self.fp32_groups, self.fp16_groups):
            for fp32_param, fp16_param in zip(fp32_group, fp16_group):
                fp32_param.grad = None
                fp16_param.data.copy_(fp32_param.data)
        return self.overflow


@contextlib.contextmanager
def states_without_a_step(wrapper: FP16_UnfusedOptimizer):
    """Around DeepSpeed's initialize_optimizer_states, which makes AdamW's states by stepping it with zero gradients
    (a step counted, the weights decayed): undo both, so that the first real step is Adam's first, as at ZeRO 1
    (the states stay allocated)."""
    masters = [p for group in wrapper.fp32_groups for p in group]
    before = [p.detach().clone() for p in masters]
    yield
    for param, value in zip(masters, before):
        param.data.copy_(value)
    for state in wrapper.optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value):
                value.zero_()  # the step count, and the moments (zero after zero gradients)
            elif key == "step":
                state[key] = 0


@contextlib.contextmanager
def whole_norm_unfused_optimizer(enabled: bool = True):
    """Inside, with `enabled`, the DeepSpeed engines built wrap a stage-0 16-bit optimizer
    in WholeNormUnfusedOptimizer: the engine looks FP16_UnfusedOptimizer up in its module when it builds it."""
    import deepspeed.runtime.engine as engine_module

    if not enabled:
        yield
        return
    engine_module.FP16_UnfusedOptimizer = WholeNormUnfusedOptimizer
    try:
        yield
    finally:
        engine_module.FP16_UnfusedOptimizer = FP16_UnfusedOptimizer
