"""The gradient norm of an MoE run at ZeRO 0 in bf16 (docs/moe.md): DeepSpeed 0.19.8's FP16_UnfusedOptimizer left
every expert out of the norm it clips by and reports; megatron/stage0_optimizer.py's subclass counts them. Real
DeepSpeed engines from setup_engine on real gloo ranks, trained by train_step: the norm in the log is the norm of
the gradients the ranks hold, experts of every expert-parallel rank included, ZeRO 1's on the same inputs, and the
gradients AdamW steps are clipped by it; everything else is DeepSpeed's wrapper's. fp16 (GPUs only) on the wrapper
alone: the norm counts the experts and is the unscaled gradients'."""
import dataclasses
import os
from functools import partial

import pytest
import torch
import torch.distributed as dist
from deepspeed.moe.utils import is_moe_param

from megatron.accounting.measure import memory
from megatron.arguments import parse_args
from megatron.core.parallel_state import ParallelState
from megatron.initialize import DistInfo
from megatron.model import GPTModel
from megatron import accounting
from megatron.model.moe import expert_parallel_rank
from test_tensor_parallel import run_ranks

pytestmark = pytest.mark.slow

SEQ, VOCAB, MICRO = 32, 256, 2


def _engine(rank, world, *flags):
    """A tiny 4-expert model (no token dropping) in a DeepSpeed engine from setup_engine, as pretrain_gpt.py builds
    it; returns (engine, args, dist_info)."""
    from megatron.engine import setup_engine

    os.environ["LOCAL_RANK"] = str(rank)  # DeepSpeed's engine asks for it, as torchrun would set it
    args = parse_args(["--model-size", "tiny", "--data-path", "unused", "--train-iters", "4", "--micro-batch-size",
                       str(MICRO), "--global-batch-size", str(MICRO * world), "--seq-length", str(SEQ),
                       "--eval-iters", "0", "--lr", "1e-3", "--num-experts", "4", "--disable-moe-token-dropping",
                       *flags], world)
    args = dataclasses.replace(args, model=dataclasses.replace(args.model, padded_vocab_size=VOCAB,
                                                               max_position_embeddings=SEQ))
    state = ParallelState.build(args.parallel.layout)
    dist_info = DistInfo(rank=rank, local_rank=rank, world_size=world, device=torch.device("cpu"), parallel=state)
    ep = args.model.moe_expert_parallel_size
    torch.manual_seed(1234)
    builder = partial(GPTModel, args.model, expert_rank=expert_parallel_rank(state.data.rank, ep))
    engine, _ = setup_engine(builder, accounting.count_parameters(args.model), args, dist_info, train_iters=4)
    return engine, args, dist_info


def _batches(rank):
    generator = torch.Generator().manual_seed(100 + rank)  # each data-parallel rank its own samples
    return iter(lambda: {"text": torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=generator)}, None)


def _norms(pairs, ep: int) -> tuple[float, float]:
    """(the whole norm, the dense part's) of the gradients of `pairs` (a module parameter, the tensor whose gradient
    is read): the dense ones are the same on every rank; with EP > 1 (EP = the world here) each rank holds its own
    experts, summed over the ranks, else every rank holds them all."""
    dense = expert = 0.0
    for param, holder in pairs:
        square = holder.grad.double().square().sum().item()
        if is_moe_param(param):
            expert += square
        else:
            dense += square
    if ep > 1:
        total = torch.tensor([expert], dtype=torch.float64)
        dist.all_reduce(total)
        expert = total.item()
    return (dense + expert) ** 0.5, dense ** 0.5


def _train(engine, args, dist_info, steps=2, measure=True) -> list[tuple]:
    """`steps` train_step steps on the rank's samples; for each the logged grad norm and, with `measure`, read
    as AdamW's step starts: the true norm, the dense part's and the norm of the fp32 gradients AdamW steps."""
    from megatron.training import train_step

    seen = []

    def before_adamw(*_):
        ep, wrapper = args.model.moe_expert_parallel_size, engine.optimizer
        module = [(p, p) for p in engine.module.parameters()]
        masters = [pair for low, high in zip(wrapper.fp16_groups, wrapper.fp32_groups) for pair in zip(low, high)]
        seen.append((*_norms(module, ep), _norms(masters, ep)[0]))

    hook = engine.basic_optimizer.register_step_pre_hook(before_adamw) if measure else None
    batches, rows = _batches(dist_info.rank), []
    for _ in range(steps):
        result = train_step(engine, batches, args, dist_info, eod=VOCAB - 1)
        assert not result.skipped
        rows.append((result.grad_norm, *seen[-1]) if measure else (result.grad_norm,))
    if hook is not None:
        hook.remove()
    return rows


def _check_the_logged_norm(rank, world, clip, flags=()):
    """At ZeRO 0 in bf16 the logged norm is the whole model's, AdamW steps gradients clipped by it, and ZeRO 1 logs
    the same norm on the same samples from the same initial weights (the first's: tests/test_stage0_optimizer.py
    holds the two stages' first steps equal)."""
    z0, args, dist_info = _engine(rank, world, "--bf16", "--zero-stage", "0", "--clip-grad", str(clip), *flags)
    rows = _train(z0, args, dist_info)
    for logged, true, dense, stepped in rows:
        assert true > dense * 1.001, "the experts' gradients are too small for the test to tell"
        assert logged == pytest.approx(true, rel=1e-5)
        assert stepped == pytest.approx(min(true, clip), rel=1e-5)  # clipped by the whole norm
    assert any(true > clip for _, true, _, _ in rows), "nothing was clipped: the test would prove less"
    assert type(z0.optimizer).__name__ == "WholeNormUnfusedOptimizer"
    # the memory measurement still finds DeepSpeed's fp32 masters: 4 bytes a parameter, and AdamW's m and v 8
    num_params = sum(p.numel() for p in z0.module.parameters())
    assert memory.optimizer_bytes(z0) == pytest.approx(12 * num_params, rel=0.01)
    z1, args, dist_info = _engine(rank, world, "--bf16", "--zero-stage", "1", "--clip-grad", str(clip), *flags)
    assert type(z1.optimizer).__name__ == "BF16_Optimizer"
    [(z1_logged,)] = _train(z1, args, dist_info, steps=1, measure=False)
    assert z1_logged == pytest.approx(rows[0][0], rel=1e-5)


def test_the_zero_0_bf16_norm_counts_the_experts_and_clips_by_it():
    run_ranks(partial(_check_the_logged_norm, clip=1.0), world_size=1)


def test_with_expert_parallelism_the_norm_counts_the_experts_of_every_rank():
    """2 ranks, EP=2: each rank holds 2 of the 4 experts; the norm sums both ranks' experts."""
    run_ranks(partial(_check_the_logged_norm, clip=1.0, flags=("--moe-expert-parallel-size", "2")), world_size=2)


def _check_the_rest_is_deepspeeds(rank, world):
    """Without clipping, WholeNormUnfusedOptimizer and DeepSpeed's FP16_UnfusedOptimizer (its initial AdamW step
    undone as ours undoes it) train the same bf16 and fp32 master weights bit for bit; only the logged norm differs
    (DeepSpeed's: the dense part alone)."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    from megatron import stage0_optimizer

    class DeepSpeeds(FP16_UnfusedOptimizer):
        def initialize_optimizer_states(self):
            with stage0_optimizer.states_without_a_step(self):
                super().initialize_optimizer_states()

    ours, args, dist_info = _engine(rank, world, "--bf16", "--zero-stage", "0", "--clip-grad", "0")
    ours_rows = _train(ours, args, dist_info, steps=3)
    stage0_optimizer.WholeNormUnfusedOptimizer = DeepSpeeds  # the engine builds DeepSpeed's own
    theirs, args, dist_info = _engine(rank, world, "--bf16", "--zero-stage", "0", "--clip-grad", "0")
    assert type(theirs.optimizer) is DeepSpeeds
    theirs_rows = _train(theirs, args, dist_info, steps=3)
    for (name, mine), (_, reference) in zip(ours.module.named_parameters(), theirs.module.named_parameters()):
        assert mine.dtype == torch.bfloat16 and torch.equal(mine, reference), name
    for mine, reference in zip(ours.optimizer.fp32_groups, theirs.optimizer.fp32_groups):
        assert all(torch.equal(a, b) for a, b in zip(mine, reference))
    for (logged, true, dense, _), (their_logged, *_) in zip(ours_rows, theirs_rows):
        assert logged == pytest.approx(true, rel=1e-5) and their_logged == pytest.approx(dense, rel=1e-5)


def test_everything_but_the_norm_is_deepspeeds_unfused_optimizer():
    run_ranks(_check_the_rest_is_deepspeeds, world_size=1)


def _fp16_wrapper(cls, clip: float, dynamic: bool):
    """`cls` (DeepSpeed's wrapper or ours) around SGD at lr 1 (its update is minus the gradient it is given) for a
    dense fp16 parameter and an expert one, at loss scale 1024 (dynamic: doubled after every step without overflow),
    as the engine builds it at stage 0 in fp16."""
    from deepspeed.runtime.fp16.loss_scaler import INITIAL_LOSS_SCALE, MIN_LOSS_SCALE, SCALE_WINDOW

    dense = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
    expert = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
    expert.allreduce, expert.group_name = False, "ep_size_1"  # what DeepSpeed's MoE layer marks its experts with
    scaling = {INITIAL_LOSS_SCALE: 1024.0, SCALE_WINDOW: 1, MIN_LOSS_SCALE: 1.0}
    wrapper = cls(torch.optim.SGD([dense, expert], lr=1.0), low_precision_dtype=torch.float16, clip_grad=clip,
                  static_loss_scale=1024.0, dynamic_loss_scale=dynamic, dynamic_loss_args=scaling, verbose=False)
    return wrapper, dense, expert


def _step(wrapper, dense, expert, scale: float) -> list[float]:
    """One step on the gradients (3, 0) dense and (0, 4) expert (norm 5), loss-scaled by `scale` as a backward
    leaves them; returns the fp32 masters after it."""
    dense.grad = torch.tensor([3.0 * scale, 0.0], dtype=torch.float16)
    expert.grad = torch.tensor([0.0, 4.0 * scale], dtype=torch.float16)
    wrapper.step()
    return [x for group in wrapper.fp32_groups for p in group for x in p.tolist()]


def _check_fp16(rank, world):
    """fp16 runs on GPUs only; its wrapper runs on the CPU. The norm counts the expert and is the gradients' norm,
    not the loss-scaled one (DeepSpeed's reported 3 x 1024); the gradients are unscaled by the scale they carry
    (DeepSpeed doubled a growing dynamic scale first and halved that step's update)."""
    import deepspeed
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.utils import groups

    from megatron.stage0_optimizer import WholeNormUnfusedOptimizer

    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed.init_distributed(dist_backend="gloo")  # deepspeed.comm over the process's gloo group
    groups._create_expert_and_data_parallel(1)  # the group "ep_size_1" the engine makes for EP 1
    ours = _fp16_wrapper(WholeNormUnfusedOptimizer, clip=1.0, dynamic=False)
    assert _step(*ours, scale=1024.0) == pytest.approx([-0.6, 0.0, 0.0, -0.8], rel=1e-5)  # clipped by 5
    assert ours[0]._global_grad_norm == pytest.approx(5.0, rel=1e-6)
    theirs = _fp16_wrapper(FP16_UnfusedOptimizer, clip=1.0, dynamic=False)
    assert _step(*theirs, scale=1024.0) == pytest.approx([-1.0, 0.0, 0.0, -4 / 3], rel=1e-5)  # clipped by 3
    assert theirs[0]._global_grad_norm == pytest.approx(3.0 * 1024)
    ours = _fp16_wrapper(WholeNormUnfusedOptimizer, clip=0.0, dynamic=True)
    assert _step(*ours, scale=1024.0) == pytest.approx([-3.0, 0.0, 0.0, -4.0])
    # the second step grows the scale to 2048 (window 1) after unscaling the gradients made at 1024
    assert _step(*ours, scale=1024.0) == pytest.approx([-6.0, 0.0, 0.0, -8.0])
    assert ours[0].loss_scale == 2048.0 and ours[0]._global_grad_norm == pytest.approx(5.0)
    overflowed = _fp16_wrapper(WholeNormUnfusedOptimizer, clip=1.0, dynamic=True)
    assert _step(*overflowed, scale=float("inf")) == [0.0] * 4 and overflowed[0].overflow
    assert overflowed[0].loss_scale == 512.0


def test_in_fp16_the_norm_counts_the_experts_and_is_not_loss_scaled():
    run_ranks(_check_fp16, world_size=1)
