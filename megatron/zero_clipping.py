"""ZeRO 1-2's gradient clipping without a host read per optimizer group (issue 55, docs/gpu-reference.md).

DeepSpeed 0.19.8's DeepSpeedZeroOptimizer.unscale_and_clip_grads, called once per optimizer group in its step, asks
`is_invalid_grad_norm(norm)` of the norm tensor, a bool() that waits for the device, to replace a non-finite norm
by infinity (which scales the gradients to zero). Its step has already skipped non-finite norms, so the check only
serves direct callers; `clip_without_host_reads` gives one optimizer a version that makes the same replacement on
the device (torch.where). Everything else is DeepSpeed's; tests/test_zero_clipping.py holds the two equal.
"""
import types

import torch
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer


def _unscale_and_clip_grads(self, grad_groups_flat, total_norm):
    """DeepSpeedZeroOptimizer.unscale_and_clip_grads with its validity check of a norm tensor made on the device."""
    if self.clip_grad == 0.0 and self.loss_scale == 1.0:
        return
    combined_scale = self.loss_scale
    if self.clip_grad > 0.0:
        if torch.is_tensor(total_norm):
            invalid = ~torch.isfinite(total_norm) | (total_norm < 0)
            clip_norm = torch.where(invalid, torch.full_like(total_norm, float("inf")), total_norm)
        else:
            clip_norm = total_norm if total_norm >= 0 and total_norm == total_norm else float("inf")
        clip = torch.clamp(torch.as_tensor((clip_norm / self.loss_scale + 1e-6) / self.clip_grad), min=1.0)
        combined_scale = clip * self.loss_scale
    for grad in grad_groups_flat:
        for part in (grad if isinstance(grad, list) else [grad]):
            part.data.mul_(1.0 / combined_scale)


def clip_without_host_reads(optimizer) -> None:
    """Give a ZeRO 1-2 optimizer (DeepSpeedZeroOptimizer) the clipping above; any other is left as it is."""
    if isinstance(optimizer, DeepSpeedZeroOptimizer):
        optimizer.unscale_and_clip_grads = types.MethodType(_unscale_and_clip_grads, optimizer)
