"""Optimizer and learning-rate schedule handed to deepspeed.initialize."""
import copy
import math
import os
import re
import subprocess
import sys

import torch
from deepspeed.moe.utils import is_moe_param

from megatron.arguments import Args, OptimizerArgs
from megatron.core.grad_norm import model_parallel_grad_norm
from megatron.errors import ZeroLabError


class OptimizerBuildError(ZeroLabError, RuntimeError):
    """The optimizer's compiled op cannot be built on this machine."""


class ScheduleError(ZeroLabError, ValueError):
    """A checkpoint's learning-rate schedule cannot be resumed as the flags ask; the message names the flag."""


def nvcc_version_text(cuda_home: str | None) -> str | None:
    """What `<cuda_home>/bin/nvcc --version` prints (torch's and DeepSpeed's builds run that nvcc), else None."""
    if cuda_home is None:
        return None
    try:
        return subprocess.run([os.path.join(cuda_home, "bin", "nvcc"), "--version"], capture_output=True,
                              text=True, timeout=60).stdout
    except OSError:
        return None


def cuda_versions_match(nvcc: str, torch_cuda: str) -> bool:
    """DeepSpeed's rule for building an op (op_builder's assert_no_cuda_mismatch): nvcc's CUDA X.Y equals
    torch's, or both are in the versions its table marks compatible within one major (10.x to 12.x; 13.x has
    no entry, so 13.1 and 13.0 differ)."""
    from deepspeed.ops.op_builder.builder import cuda_minor_mismatch_ok

    nvcc, torch_cuda = ".".join(nvcc.split(".")[:2]), ".".join(torch_cuda.split(".")[:2])
    family = cuda_minor_mismatch_ok.get(int(nvcc.split(".")[0]), [])
    return nvcc == torch_cuda or (nvcc in family and torch_cuda in family)


def check_cpu_adam_buildable(accelerator: str, cuda_home: str | None, torch_cuda: str | None,
                             nvcc_version: str | None) -> None:
    """DeepSpeed compiles its CPU Adam at first use; for the CUDA accelerator that build links
    CUDA's curand and headers, so it needs the CUDA toolkit (torch finds it as CUDA_HOME), and
    DeepSpeed refuses an nvcc of another CUDA than torch's (cuda_versions_match; DS_SKIP_CUDA_CHECK=1
    overrides, as in DeepSpeed). torch_cuda: torch.version.cuda; nvcc_version: what `nvcc --version`
    printed, None if it did not run. Without this DeepSpeed fails deep in the build with a traceback;
    this says what is missing instead."""
    if accelerator != "cuda":
        return
    if cuda_home is None:
        raise OptimizerBuildError(
            "--zero-offload-optimizer on CUDA needs DeepSpeed's cpu_adam op, which compiles at first use against "
            f"the CUDA toolkit: none found (no CUDA_HOME, no nvcc on PATH); install the toolkit for CUDA "
            f"{torch_cuda} and set CUDA_HOME, or train without offload (not the Z3_OL driver)")
    release = re.search(r"release (\d+\.\d+)", nvcc_version or "")
    if (torch_cuda and release and not cuda_versions_match(release[1], torch_cuda)
            and os.environ.get("DS_SKIP_CUDA_CHECK", "0") != "1"):
        raise OptimizerBuildError(
            f"--zero-offload-optimizer on CUDA needs DeepSpeed's cpu_adam op, compiled at first use by "
            f"{os.path.join(cuda_home, 'bin', 'nvcc')}: that nvcc is CUDA {release[1]} but torch was built for "
            f"CUDA {torch_cuda}, and DeepSpeed builds only with a matching CUDA; install the CUDA {torch_cuda} "
            f"toolkit and set CUDA_HOME to it, or the torch build that matches this nvcc (scripts/setup.sh picks it; "
            "docs/gpu.md)")


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Biases and LayerNorm weights (every 1-D parameter) get no weight decay, as in Megatron. A parameter
    partitioned by ZeRO-3's zero.Init holds an empty 1-D tensor; its shape is in ds_shape (without it, every
    parameter of a stage-3 run went without weight decay)."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (no_decay if len(getattr(param, "ds_shape", param.shape)) < 2 else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
            {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]


def moe_param_groups(groups: list[dict]) -> list[dict]:
    """Each group split into its dense parameters and, per expert-parallel size, its expert ones (marked 'moe'):
    DeepSpeed's ZeRO 1-2 partitions and reduces those over the expert-data-parallel group instead (deepspeed.moe.
    utils; Megatron-DeepSpeed's --create-moe-param-group). Groups left empty are dropped."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    return [group for group in split_params_into_different_moe_groups_for_optimizer(groups) if group["params"]]


def expert_grad_square(params) -> torch.Tensor:
    """The squared gradient norm of the expert parameters of every rank of their expert-parallel groups: each
    rank holds other experts, and an expert's gradient is the same on its expert-data-parallel ranks."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    total = torch.zeros((), dtype=torch.float32, device=params[0].device)
    for name in sorted({p.group_name for p in params}):
        grads = [p.grad.detach().float() for p in params if p.group_name == name and p.grad is not None]
        square = torch.stack([g.norm() for g in grads]).square().sum() if grads else torch.zeros_like(total)
        dist.all_reduce(square, group=groups._get_expert_parallel_group(name))
        total = total + square
    return total


def replica_grad_norm(params, tensor_rank: int = 0, norm_group=None) -> torch.Tensor:
    """The L2 norm of the gradients of the whole model `params` belong to: the dense ones over the model-parallel
    group (norm_group: the replica's TP x PP ranks), the experts' over their expert-parallel groups. Computed on
    the parameters' device; nothing is read to the host."""
    experts = [p for p in params if is_moe_param(p)]
    norm = model_parallel_grad_norm([p for p in params if not is_moe_param(p)], tensor_rank, norm_group)
    if experts:  # MoE runs have no tensor or pipeline parallelism (megatron/arguments.py)
        norm = (norm.square() + expert_grad_square(experts)).sqrt()
    return norm


class NonFiniteSkipping:
    """A torch optimizer for ZeRO stage 0 in fp32, where DeepSpeed passes the step straight through:
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
        norm = replica_grad_norm(params, self.tensor_rank, self.norm_group)
        self._global_grad_norm = norm.item()
        self.overflow = not math.isfinite(self._global_grad_norm)
        if self.overflow:
            return None
        if self.clip_grad > 0:
            torch.nn.utils.clip_grads_with_norm_(
                [p for group in self.param_groups for p in group["params"]], self.clip_grad, norm)
        return super().step(closure)


class NonFiniteSkippingAdamW(NonFiniteSkipping, torch.optim.AdamW):
    """--optimizer adam (the default) at ZeRO stage 0 in fp32."""


class NonFiniteSkippingSGD(NonFiniteSkipping, torch.optim.SGD):
    """--optimizer sgd at ZeRO stage 0 in fp32."""


MUON_MODULE = "deepspeed.runtime.zero.muon.original_muon"


def import_muon_uncompiled() -> None:
    """DeepSpeed 0.19.8's ZeRO and bf16 optimizers import its Muon module as they are built, and that module's
    decorators call torch.compile, which imports torch's inductor compiler: 0.7 s of CPU on each rank, for an
    optimizer zero-lab never steps (it builds its own AdamW, and refuses a JSON "optimizer" section). Imported
    here first, with torch.compile standing for the identity while it loads, Muon's functions stay uncompiled."""
    if MUON_MODULE in sys.modules:
        return
    compile_ = torch.compile

    def identity(model=None, **_):
        return model if model is not None else (lambda fn: fn)

    torch.compile = identity
    try:
        __import__(MUON_MODULE)
    finally:
        torch.compile = compile_


def build_optimizer(model: torch.nn.Module, args: Args, state=None) -> torch.optim.Optimizer:
    """state: the ParallelState when the model is split over tensor/pipeline ranks.
    torch's fused AdamW on CUDA and on CPU alike: on one CPU core its single-pass kernel steps
    16M parameters about 4x faster than the default per-tensor loop (bench/bench_cpu_step_parts.py)."""
    opt = args.optimizer
    groups = param_groups(model, opt.weight_decay)
    if args.model.is_moe and (args.deepspeed.zero_stage > 0 or args.training.create_moe_param_group):
        groups = moe_param_groups(groups)
    kwargs = dict(lr=opt.lr, betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps, weight_decay=opt.weight_decay)
    if opt.optimizer == "sgd":  # Megatron's torch SGD; DeepSpeed's ZeRO and bf16/fp16 wrappers clip and skip for it
        return _sgd(groups, args, state)
    if args.deepspeed.offload_optimizer:
        # the offloaded step runs on the CPU; DeepSpeed requires its own vectorised CPU Adam there
        from deepspeed.accelerator import get_accelerator
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from torch.utils.cpp_extension import CUDA_HOME
        accelerator = get_accelerator().device_name()
        check_cpu_adam_buildable(accelerator, CUDA_HOME, torch.version.cuda,
                                 nvcc_version_text(CUDA_HOME) if accelerator == "cuda" else None)
        return DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs)
    if args.deepspeed.zero_stage == 0 and args.deepspeed.precision == "fp32":
        split = state is not None and state.get_model_parallel_world_size() > 1
        return NonFiniteSkippingAdamW(groups, clip_grad=opt.clip_grad, fused=True,
                                      norm_group=state.get_model_parallel_group() if split else None,
                                      tensor_rank=state.get_tensor_model_parallel_rank() if split else 0, **kwargs)
    return torch.optim.AdamW(groups, fused=True, **kwargs)


def _sgd(groups: list[dict], args: Args, state) -> torch.optim.Optimizer:
    opt = args.optimizer
    kwargs = dict(lr=opt.lr, momentum=opt.sgd_momentum, weight_decay=opt.weight_decay)
    if args.deepspeed.zero_stage == 0 and args.deepspeed.precision == "fp32":
        split = state is not None and state.get_model_parallel_world_size() > 1
        return NonFiniteSkippingSGD(groups, clip_grad=opt.clip_grad,
                                    norm_group=state.get_model_parallel_group() if split else None,
                                    tensor_rank=state.get_tensor_model_parallel_rank() if split else 0, **kwargs)
    return torch.optim.SGD(groups, **kwargs)


class LRSchedule:
    """Megatron-DeepSpeed's OptimizerParamScheduler (megatron/optimizer_param_scheduler.py), counted as it counts:
    steps are samples (--lr-warmup-iters and --lr-decay-iters times the global batch; --train-samples runs use
    --lr-warmup-samples and --lr-decay-samples), and --lr-warmup-tokens / --lr-decay-tokens count consumed tokens
    instead. The rate is set at 0 when it is built (Megatron-DeepSpeed steps its scheduler by 0 then: the first
    iteration of a warm-up trains at rate 0), and DeepSpeed calls step() after each applied update (not after a
    skipped one), which moves it on by that update's global batch: an iteration trains at the rate the step before
    it left, and the log line shows the rate after its own step, as Megatron-DeepSpeed's does (docs/log-lines.md).
    The tokens the scheduler sees at a step are those consumed before that iteration: Megatron-DeepSpeed counts an
    iteration's tokens after its train_step, where DeepSpeed has stepped the scheduler already."""

    def __init__(self, optimizer: torch.optim.Optimizer, opt: OptimizerArgs, train_iters: int,
                 global_batch_size: int = 1, train_samples: int | None = None):
        """train_samples: a --train-samples run's (sample-based: warm-up and decay by samples); None: by
        iterations (--train-iters, --train-epochs) of global_batch_size samples."""
        self.optimizer = optimizer
        self.max_lr, self.min_lr, self.style = opt.lr, opt.min_lr, opt.lr_decay_style
        if train_samples is None:
            self.decay_steps = (opt.lr_decay_iters or train_iters) * global_batch_size
            warmup = opt.lr_warmup_iters * global_batch_size
        else:
            self.decay_steps = opt.lr_decay_samples or train_samples
            warmup = opt.lr_warmup_samples
        self.warmup_steps = warmup if opt.lr_warmup_fraction is None else opt.lr_warmup_fraction * self.decay_steps
        self.warmup_tokens, self.decay_tokens = opt.lr_warmup_tokens, opt.lr_decay_tokens
        self.given_warmup_tokens = opt.lr_warmup_tokens  # warmup_tokens may be found by steps later (get_rate)
        self.keep_saved, self.quiet = opt.use_checkpoint_opt_param_scheduler, opt.override_opt_param_scheduler
        self.resume_note: str | None = None  # set by a resume whose flags change the schedule; rank 0 prints it
        self.num_steps, self.num_tokens = 0, 0
        # what the next step() adds and the tokens it sees, as the loop announces them (before_step)
        self.increment, self.tokens_before = global_batch_size, 0
        self._apply()

    def get_rate(self) -> float:
        """Megatron-DeepSpeed's get_lr at (num_steps, num_tokens), its quirk included: a warm-up by steps before a
        decay by tokens ends at the tokens consumed when the warm-up's last step is taken."""
        if self.warmup_tokens is None:
            if 0 < self.warmup_steps and self.num_steps <= self.warmup_steps:
                if self.num_steps == self.warmup_steps and self.decay_tokens is not None:
                    self.warmup_tokens = self.num_tokens
                return self.max_lr * self.num_steps / self.warmup_steps
        elif 0 < self.warmup_tokens and self.num_tokens <= self.warmup_tokens:
            return self.max_lr * self.num_tokens / self.warmup_tokens
        if self.style == "constant":
            return self.max_lr
        done, end = ((self.num_steps, self.decay_steps) if self.decay_tokens is None
                     else (self.num_tokens, self.decay_tokens))
        if done > end:
            return self.min_lr
        if self.style == "inverse-square-root":
            warmup = self.warmup_steps if self.warmup_tokens is None else self.warmup_tokens
            return max(self.min_lr, self.max_lr * max(warmup, 1) ** 0.5 / max(
                self.num_steps if self.warmup_tokens is None else self.num_tokens, 1) ** 0.5)
        # Megatron-DeepSpeed fails here on a fractional warm-up that no step lands on before a decay by tokens
        # (no warm-up tokens yet): taken as 0
        start = self.warmup_steps if self.decay_tokens is None else (self.warmup_tokens or 0)
        ratio = (done - start) / (end - start)
        coeff = 1.0 - ratio if self.style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def _apply(self):
        rate = self.get_rate()
        for group in self.optimizer.param_groups:
            group["lr"] = rate

    def before_step(self, global_batch_size: int, consumed_tokens: int):
        """The next update's global batch (what its step adds) and the tokens consumed before its iteration (what
        Megatron-DeepSpeed's scheduler reads from args.consumed_train_tokens when DeepSpeed steps it)."""
        self.increment, self.tokens_before = global_batch_size, consumed_tokens

    def step(self, increment: int | None = None, token_num: int | None = None):
        """DeepSpeed's engine calls it with no arguments (the pipeline engine's too): the loop's before_step."""
        self.num_tokens = self.tokens_before if token_num is None else token_num
        self.num_steps += self.increment if increment is None else increment
        self._apply()

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def settings(self) -> dict:
        """What the flags made of the schedule (Megatron-DeepSpeed's class values), saved to be compared on a resume."""
        return {"max_lr": self.max_lr, "min_lr": self.min_lr, "style": self.style, "warmup_steps": self.warmup_steps,
                "decay_steps": self.decay_steps, "warmup_tokens": self.given_warmup_tokens,
                "decay_tokens": self.decay_tokens}

    def _take(self, settings: dict):
        self.max_lr, self.min_lr, self.style = settings["max_lr"], settings["min_lr"], settings["style"]
        self.warmup_steps, self.decay_steps = settings["warmup_steps"], settings["decay_steps"]
        self.given_warmup_tokens = self.warmup_tokens = settings["warmup_tokens"]
        self.decay_tokens = settings["decay_tokens"]

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "num_tokens": self.num_tokens, "warmup_tokens": self.warmup_tokens,
                "settings": self.settings()}

    def load_state_dict(self, state: dict):
        """A checkpoint of zero-lab before the schedule counted samples has num_steps in iterations (and no
        num_tokens): taken as iterations of the global batch. The schedule is the flags' (Megatron-DeepSpeed's
        --override-opt_param-scheduler), with resume_note saying how it differs from the saved one, or with
        --use-checkpoint-opt_param-scheduler the saved one."""
        saved = state.get("settings")
        if self.keep_saved:
            if saved is None:
                raise ScheduleError("--use-checkpoint-opt_param-scheduler: the checkpoint was saved before zero-lab "
                                    "recorded its learning-rate schedule: give the schedule's flags as they were")
            self._take(saved)
        if "num_tokens" not in state:
            state = {"num_steps": state["num_steps"] * self.increment, "num_tokens": 0, "warmup_tokens": None}
        self.num_steps, self.num_tokens = state["num_steps"], state["num_tokens"]
        self.tokens_before = self.num_tokens
        if self.warmup_tokens is None and self.decay_tokens is not None:  # the warm-up's end, found by steps
            self.warmup_tokens = state["warmup_tokens"]
        if saved is not None and saved != self.settings() and not self.quiet:
            before = copy.copy(self)
            before._take(saved)
            before.warmup_tokens = state["warmup_tokens"] if before.warmup_tokens is None else before.warmup_tokens
            self.resume_note = schedule_change_line(saved, self.settings(), before.get_rate(), self.get_rate())
        self._apply()


_SETTING_NAMES = {"max_lr": "--lr", "min_lr": "--min-lr", "style": "--lr-decay-style",
                  "warmup_steps": "warm-up samples", "decay_steps": "decay samples (--lr-decay-iters, else "
                  "--train-iters, x the global batch; or --lr-decay-samples)",
                  "warmup_tokens": "--lr-warmup-tokens", "decay_tokens": "--lr-decay-tokens"}


def schedule_change_line(saved: dict, flags: dict, saved_rate: float, rate: float) -> str:
    """The one line a resume prints where the flags' schedule is not the checkpoint's: what changed, the rate the
    run goes on at against the saved schedule's, and the flag that keeps the saved one."""
    def value(number) -> str:
        if not isinstance(number, (int, float)) or isinstance(number, bool):
            return str(number)
        return f"{number:.10g}"

    changes = ", ".join(f"{_SETTING_NAMES[key]} {value(saved[key])} -> {value(flags[key])}"
                        for key in _SETTING_NAMES if saved.get(key) != flags[key])
    return (f"note: the flags change the learning-rate schedule the checkpoint was saved with ({changes}): the rate "
            f"goes on at {rate:.2E} where the saved schedule gives {saved_rate:.2E}; "
            "--use-checkpoint-opt_param-scheduler keeps the saved schedule")
