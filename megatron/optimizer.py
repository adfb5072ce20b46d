"""Optimizer and learning-rate schedule handed to deepspeed.initialize."""
import math

import torch

from megatron.arguments import Args, OptimizerArgs
from megatron.core.grad_norm import model_parallel_grad_norm
from megatron.errors import ZeroLabError


class OptimizerBuildError(ZeroLabError, RuntimeError):
    """The optimizer's compiled op cannot be built on this machine."""


def check_cpu_adam_buildable(accelerator: str, cuda_home: str | None) -> None:
    """DeepSpeed compiles its CPU Adam at first use; for the CUDA accelerator that build links
    CUDA's curand and headers, so it needs the CUDA toolkit (torch finds it as CUDA_HOME). Without
    one DeepSpeed fails deep in the build with a traceback; this says what is missing instead."""
    if accelerator == "cuda" and cuda_home is None:
        raise OptimizerBuildError(
            "--zero-offload-optimizer on CUDA needs DeepSpeed's cpu_adam op, which compiles at first use against "
            f"the CUDA toolkit: none found (no CUDA_HOME, no nvcc on PATH); install the toolkit for CUDA "
            f"{torch.version.cuda} and set CUDA_HOME, or train without offload (not the Z3_OL driver)")


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Biases and LayerNorm weights (every 1-D parameter) get no weight decay, as in Megatron."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


class NonFiniteSkippingAdamW(torch.optim.AdamW):
    """AdamW for ZeRO stage 0 in fp32, where DeepSpeed passes the step straight through:
    it clips by the global grad norm and skips the update when that norm is not finite,
    which is what DeepSpeed's ZeRO and mixed-precision optimizers already do.
    With model parallelism the norm covers the whole replica (norm_group: its TP x PP ranks).
    DeepSpeed's engine reads `overflow` (skipped step) and `_global_grad_norm`."""

    def __init__(self, params, clip_grad: float, norm_group=None, tensor_rank: int = 0, **kwargs):
        super().__init__(params, **kwargs)
        self.clip_grad = clip_grad
        self.norm_group, self.tensor_rank = norm_group, tensor_rank
        self.overflow = False
        self._global_grad_norm = None

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"]]
        norm = model_parallel_grad_norm(params, self.tensor_rank, self.norm_group)
        self._global_grad_norm = norm.item()
        self.overflow = not math.isfinite(self._global_grad_norm)
        if self.overflow:
            return None
        if self.clip_grad > 0:
            torch.nn.utils.clip_grads_with_norm_(
                [p for group in self.param_groups for p in group["params"]], self.clip_grad, norm)
        return super().step(closure)


def build_optimizer(model: torch.nn.Module, args: Args, state=None) -> torch.optim.Optimizer:
    """state: the ParallelState when the model is split over tensor/pipeline ranks.
    torch's fused AdamW on CUDA and on CPU alike: on one CPU core its single-pass kernel steps
    16M parameters about 4x faster than the default per-tensor loop (bench/bench_cpu_step_parts.py)."""
    opt = args.optimizer
    groups = param_groups(model, opt.weight_decay)
    kwargs = dict(lr=opt.lr, betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps, weight_decay=opt.weight_decay)
    if args.deepspeed.offload_optimizer:
        # the offloaded step runs on the CPU; DeepSpeed requires its own vectorised CPU Adam there
        from deepspeed.accelerator import get_accelerator
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from torch.utils.cpp_extension import CUDA_HOME
        check_cpu_adam_buildable(get_accelerator().device_name(), CUDA_HOME)
        return DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs)
    if args.deepspeed.zero_stage == 0 and args.deepspeed.precision == "fp32":
        split = state is not None and state.get_model_parallel_world_size() > 1
        return NonFiniteSkippingAdamW(groups, clip_grad=opt.clip_grad, fused=True,
                                      norm_group=state.get_model_parallel_group() if split else None,
                                      tensor_rank=state.get_tensor_model_parallel_rank() if split else 0, **kwargs)
    return torch.optim.AdamW(groups, fused=True, **kwargs)


class LRSchedule:
    """Megatron's schedule: linear warmup to --lr, then cosine/linear/constant decay to --min-lr
    at --lr-decay-iters (default: the whole run). DeepSpeed calls step() once per applied update."""

    def __init__(self, optimizer: torch.optim.Optimizer, opt: OptimizerArgs, train_iters: int):
        self.optimizer = optimizer
        self.max_lr, self.min_lr, self.style = opt.lr, opt.min_lr, opt.lr_decay_style
        self.decay_iters = opt.lr_decay_iters or train_iters
        fraction_warmup = int(opt.lr_warmup_fraction * self.decay_iters) if opt.lr_warmup_fraction else 0
        self.warmup_iters = opt.lr_warmup_iters or fraction_warmup
        self.num_steps = 0
        self._apply()

    def lr_at(self, step: int) -> float:
        if self.warmup_iters > 0 and step < self.warmup_iters:
            return self.max_lr * (step + 1) / self.warmup_iters
        if self.style == "constant" or step >= self.decay_iters:
            return self.max_lr if self.style == "constant" else self.min_lr
        progress = (step - self.warmup_iters) / max(1, self.decay_iters - self.warmup_iters)
        if self.style == "linear":
            coeff = 1.0 - progress
        else:
            coeff = 0.5 * (math.cos(math.pi * progress) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def _apply(self):
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.num_steps)

    def step(self, *_unused, **_unused_kwargs):
        self.num_steps += 1
        self._apply()

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state: dict):
        self.num_steps = state["num_steps"]
        self._apply()
