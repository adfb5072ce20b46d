"""What the Megatron-DeepSpeed flags zero-lab honours do (docs/megatron-flags.md): the fp16 JSON fields of
--loss-scale and --hysteresis, --data-impl, --optimizer sgd stepping torch's SGD, --deepspeed-activation-checkpointing
recomputing through deepspeed.checkpointing with the same gradients (and a real run's losses), --no-load-optim and
--no-load-rng resuming without those states, and the TensorBoard flags writing the scalars they name in a real run."""
import json
import math
import re
from dataclasses import replace
from functools import partial

import pytest
import torch

from conftest import free_port
from runs import run_pretrain
from megatron.arguments import ConfigError, parse_args
from megatron.deepspeed_config import deepspeed_config
from megatron.model import GPTConfig, GPTModel

ARGV = ["--model-size", "tiny", "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "4",
        "--data-path", "unread", "--vocab-file", "unread", "--merge-file", "unread"]


def test_loss_scale_and_hysteresis_are_the_fp16_sections_fields():
    args = parse_args(ARGV + ["--fp16", "--loss-scale", "12", "--hysteresis", "4"], device_type="cuda")
    fp16 = deepspeed_config(args, 1000, 64, on_cuda=True)["fp16"]
    assert (fp16["enabled"], fp16["loss_scale"], fp16["hysteresis"]) == (True, 12.0, 4)
    default = deepspeed_config(parse_args(ARGV + ["--fp16"], device_type="cuda"), 1000, 64, on_cuda=True)["fp16"]
    assert (default["loss_scale"], default["hysteresis"]) == (0.0, 2)  # dynamic, Megatron's hysteresis


def test_loss_scale_and_hysteresis_merge_with_a_users_json(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"fp16": {"enabled": True, "loss_scale": 0, "hysteresis": 2}}))
    args = parse_args(ARGV + ["--deepspeed_config", str(path), "--hysteresis", "2"], device_type="cuda")
    assert (args.deepspeed.fp16, args.deepspeed.loss_scale, args.deepspeed.hysteresis) == (True, 0, 2)
    path.write_text(json.dumps({"fp16": {"enabled": True}}))
    args = parse_args(ARGV + ["--deepspeed_config", str(path), "--loss-scale", "12"], device_type="cuda")
    assert deepspeed_config(args, 1000, 64, on_cuda=True)["fp16"]["loss_scale"] == 12.0
    path.write_text(json.dumps({"fp16": {"enabled": True, "loss_scale": 0}}))
    with pytest.raises(ConfigError, match=r"^--loss-scale 12.0 disagrees with fp16.loss_scale 0 in --deepspeed_config"):
        parse_args(ARGV + ["--deepspeed_config", str(path), "--loss-scale", "12"], device_type="cuda")


@pytest.mark.parametrize("impl", ["lazy", "cached"])
def test_data_impl_lazy_and_cached_are_refused(impl):
    with pytest.raises(ConfigError, match=f"^--data-impl {impl}: zero-lab reads only the mmap indexed format; give "
                                          "--data-impl mmap"):
        parse_args(ARGV + ["--data-impl", impl])


@pytest.mark.parametrize("impl", ["mmap", "infer"])
def test_data_impl_mmap_and_infer_are_the_format_zero_lab_reads(impl):
    assert parse_args(ARGV + ["--data-impl", impl]).data.data_impl == impl


def test_optimizer_sgd_steps_torchs_sgd_with_momentum_and_skips_non_finite_steps():
    from megatron.optimizer import NonFiniteSkippingSGD, build_optimizer

    args = parse_args(ARGV + ["--optimizer", "sgd", "--sgd-momentum", "0.5", "--lr", "0.1", "--weight-decay", "0",
                              "--clip-grad", "0"])
    model = torch.nn.Linear(3, 2)
    optimizer = build_optimizer(model, args)
    assert isinstance(optimizer, NonFiniteSkippingSGD) and optimizer.param_groups[0]["momentum"] == 0.5
    before = model.weight.detach().clone()
    model.weight.grad, model.bias.grad = torch.ones(2, 3), torch.zeros(2)
    optimizer.step()
    torch.testing.assert_close(model.weight.detach(), before - 0.1)  # first step: the buffer is the gradient
    optimizer.step()
    torch.testing.assert_close(model.weight.detach(), before - 0.1 - 0.1 * 1.5)  # buffer 0.5 x 1 + 1
    model.weight.grad[0, 0] = float("inf")
    after = model.weight.detach().clone()
    optimizer.step()
    assert optimizer.overflow and torch.equal(model.weight.detach(), after)
    with pytest.raises(ConfigError, match="^--optimizer sgd cannot run with --zero-offload-optimizer"):
        parse_args(ARGV + ["--optimizer", "sgd", "--zero-stage", "1", "--zero-offload-optimizer"])


def _batch():
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    return ids[:, :-1], torch.arange(8).expand(2, 8), ids[:, 1:]


def _grads(config: GPTConfig):
    torch.manual_seed(5)
    model = GPTModel(config)
    torch.manual_seed(7)
    loss = model(*_batch()).mean()
    loss.backward()
    return loss, [p.grad for p in model.parameters()]


def _graph_nodes(loss) -> set[str]:
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node.name() not in seen:
            seen.add(node.name())
            stack.extend(fn for fn, _ in node.next_functions)
    return seen


def _deepspeed_recompute(rank):
    from megatron.core.tensor_parallel.random import configure_deepspeed_checkpointing

    config = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, max_position_embeddings=16,
                       padded_vocab_size=64, hidden_dropout=0.3, attention_dropout=0.3)
    configure_deepspeed_checkpointing(None, {"train_micro_batch_size_per_gpu": 2}, 2, in_cpu=False)
    loss, reference = _grads(config)
    ds_loss, recomputed = _grads(replace(config, recompute_activations=True, recompute_with_deepspeed=True))
    assert "CheckpointFunctionBackward" in _graph_nodes(ds_loss)  # DeepSpeed's, not torch's
    assert "CheckpointFunctionBackward" not in _graph_nodes(loss)
    torch.testing.assert_close(ds_loss, loss, rtol=0, atol=0)
    for got, want in zip(recomputed, reference):  # dropout on: the recompute drew the same masks
        torch.testing.assert_close(got, want)
    _check_tracker_replay()


def _check_tracker_replay():
    """Dropout drawn from the tensor-parallel tracker (split activations) draws the same mask in the recompute."""
    from megatron.core.tensor_parallel.random import deepspeed_checkpoint, model_parallel_tracker

    def dropped(x, tracker):
        with tracker.fork(x.device):
            return torch.nn.functional.dropout(x, 0.5) * torch.arange(8.0)

    x = torch.randn(4, 8, requires_grad=True)
    dropped(x, model_parallel_tracker(1234, 0)).sum().backward()
    want, x.grad = x.grad.clone(), None
    tracker = model_parallel_tracker(1234, 0)
    deepspeed_checkpoint(lambda t: dropped(t, tracker), tracker, x).sum().backward()
    torch.testing.assert_close(x.grad, want, rtol=0, atol=0)


@pytest.mark.slow  # DeepSpeed's checkpointing asks its communication backend for the rank: one spawned rank
def test_deepspeed_activation_checkpointing_recomputes_through_deepspeed_with_the_same_gradients():
    from test_parallel_training import _spawned
    torch.multiprocessing.spawn(_spawned, args=(1, free_port(), _with_deepspeed_comm(_deepspeed_recompute)),
                                nprocs=1, join=True)


def _with_deepspeed_comm(fn):
    return partial(_call_with_deepspeed_comm, fn=fn)


def _call_with_deepspeed_comm(rank, fn):
    import os

    import deepspeed
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    deepspeed.init_distributed("gloo")
    fn(rank)


def _engine(argv: list[str]):
    """A real DeepSpeed engine of the tiny model as pretrain_gpt.py builds it (megatron/engine.py's setup_engine)."""
    from megatron.core.parallel_state import ParallelState
    from megatron.initialize import DistInfo
    from megatron.accounting import count_parameters
    from megatron.engine import setup_engine

    args = parse_args(ARGV + argv)
    args = replace(args, model=replace(args.model, padded_vocab_size=64, hidden_dropout=0.0, attention_dropout=0.0))
    dist_info = DistInfo(0, 0, 1, torch.device("cpu"), ParallelState.build(args.parallel.layout))
    builder = partial(GPTModel, args.model)
    engine, _ = setup_engine(builder, count_parameters(args.model), args, dist_info, train_iters=4)
    return engine, args


def _step(engine):
    tokens, positions, labels = _batch()
    engine.backward(engine(tokens, positions, labels).mean())
    engine.step()


def _moments(engine) -> list[torch.Tensor]:
    from megatron.optimizer_states import base_optimizer
    optimizer = base_optimizer(engine)
    return [optimizer.state[p]["exp_avg"].clone() for g in optimizer.param_groups for p in g["params"]
            if "exp_avg" in optimizer.state.get(p, {})]


def _save_and_resume(rank, folder):
    from megatron.checkpointing.save_load import load_checkpoint, save_checkpoint

    flags = ["--zero-stage", "1", "--lr", "1e-3", "--lr-warmup-iters", "2", "--save", folder, "--load", folder]
    engine, args = _engine(flags)
    for _ in range(2):
        _step(engine)
    saved_moments, saved_weights = _moments(engine), [p.detach().clone() for p in engine.module.parameters()]
    assert saved_moments and all(m.abs().sum() > 0 for m in saved_moments)
    saved_steps = engine.lr_scheduler.num_steps  # the schedule counts samples, as Megatron-DeepSpeed's
    assert saved_steps > 0
    save_checkpoint(engine, args, 2, 4, rank)
    for extra in ([], ["--no-load-optim"], ["--no-load-rng"]):
        torch.manual_seed(99)  # fresh weights unlike the saved ones
        resumed, resumed_args = _engine(flags + extra)
        iteration, _, _, generators = load_checkpoint(resumed, resumed_args)
        assert iteration == 2
        for got, want in zip(resumed.module.parameters(), saved_weights):  # the weights, always
            torch.testing.assert_close(got.detach(), want, rtol=0, atol=0)
        moments = _moments(resumed)
        if extra == ["--no-load-optim"]:  # Adam's moments and the schedule's step start afresh
            assert not moments and resumed.lr_scheduler.num_steps == 0, extra
        else:
            assert len(moments) == len(saved_moments) and resumed.lr_scheduler.num_steps == saved_steps, extra
            for got, want in zip(moments, saved_moments):
                torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert (generators is None) == (extra == ["--no-load-rng"]), extra


@pytest.mark.slow  # three DeepSpeed engines on one spawned rank
def test_no_load_optim_and_no_load_rng_resume_without_those_states(tmp_path):
    from test_parallel_training import _spawned
    torch.multiprocessing.spawn(_spawned, args=(1, free_port(), _with_deepspeed_comm(
        partial(_save_and_resume, folder=str(tmp_path / "ckpt")))), nprocs=1, join=True)


def _sgd_under_zero(rank):
    """ZeRO-1 hands the step to torch's SGD: a first step with a constant --lr moves each weight by -lr x its
    gradient (the momentum buffer starts as the gradient), the gradient a plain copy of the model computes."""
    import copy

    from megatron.optimizer_states import base_optimizer

    engine, _ = _engine(["--zero-stage", "1", "--optimizer", "sgd", "--sgd-momentum", "0.5", "--lr", "0.1",
                         "--lr-decay-style", "constant", "--weight-decay", "0", "--clip-grad", "0"])
    assert type(base_optimizer(engine)) is torch.optim.SGD
    plain = copy.deepcopy(engine.module)
    plain(*_batch()).mean().backward()
    _step(engine)
    for got, reference in zip(engine.module.parameters(), plain.parameters()):
        torch.testing.assert_close(got.detach(), reference.detach() - 0.1 * reference.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.slow  # a DeepSpeed engine on one spawned rank
def test_optimizer_sgd_under_zero_steps_torchs_sgd():
    from test_parallel_training import _spawned
    torch.multiprocessing.spawn(_spawned, args=(1, free_port(), _with_deepspeed_comm(_sgd_under_zero)),
                                nprocs=1, join=True)


@pytest.fixture(scope="module")
def tensorboard_run(dolly_data_dir, tmp_path_factory):
    """A real 2-rank ZeRO-1 run of 4 iterations (logged and evaluated every 2) with the TensorBoard flags of the
    scripts, a checkpoint at the end, and an accepted flag."""
    folder = tmp_path_factory.mktemp("tensorboard_run")
    run = run_pretrain(dolly_data_dir, "--zero-stage", "1", "--train-iters", "4", "--log-interval", "2",
                       "--eval-interval", "2", "--eval-iters", "1", "--save", str(folder / "ckpt"),
                       "--save-interval", "4", "--tensorboard-dir", str(folder / "tb"), "--tensorboard-queue-size", "1",
                       "--log-timers-to-tensorboard", "--log-batch-size-to-tensorboard",
                       "--log-validation-ppl-to-tensorboard", "--log-optimizer-states-to-tensorboard",
                       "--use-flash-attn")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(folder / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    scalars = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    return run.stdout, scalars, folder / "ckpt"


@pytest.mark.slow
def test_tensorboard_flags_write_the_scalars_they_name(tensorboard_run):
    stdout, scalars, _ = tensorboard_run
    assert scalars["batch-size/batch-size"] == {2: 8.0, 4: 8.0}
    for step in (2, 4):
        loss = scalars["validation lm loss"][step]
        assert scalars["lm-loss-validation/lm loss validation ppl"][step] == pytest.approx(math.exp(loss), rel=1e-6)
    for name in ("compute", "communication", "offload"):
        assert set(scalars[f"{name}-time"]) == {2, 4}
    assert scalars["compute-time"][4] > 0 and scalars["offload-time"][4] == 0.0
    for name in ("variance", "variance_sqrt", "momentum", "weight"):
        for kind in ("l2", "l1", "abs_max"):
            assert scalars[f"optimizer/{name}_{kind}"][4] > 0, (name, kind)


@pytest.mark.slow
def test_optimizer_states_are_the_whole_models_over_the_zero_partitions(tensorboard_run):
    """ZeRO-1 splits the fp32 weights over the 2 ranks: optimizer/weight_l2 is the norm of the whole model's weights
    at iteration 4, as the checkpoint saved there holds them."""
    _, scalars, ckpt = tensorboard_run
    state = torch.load(ckpt / "global_step4" / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    weights = [t.float() for t in state["module"].values() if t.is_floating_point()]
    norm = math.sqrt(sum(t.square().sum().item() for t in weights))
    assert scalars["optimizer/weight_l2"][4] == pytest.approx(norm, rel=1e-5)
    assert scalars["optimizer/weight_abs_max"][4] == pytest.approx(max(t.abs().max().item() for t in weights))


@pytest.mark.slow
def test_an_accepted_flag_prints_its_line_once(tensorboard_run):
    stdout, _, _ = tensorboard_run
    lines = [line for line in stdout.splitlines() if line.startswith("note: --use-flash-attn accepted: ")]
    assert len(lines) == 1, stdout[-2000:]


LOSS = re.compile(r" iteration +(\d+)/ +\d+ \|.*?\| lm loss: (\S+) \|")


@pytest.mark.slow
def test_a_run_recomputing_through_deepspeed_repeats_the_runs_losses(dolly_data_dir, checkpoint_run):
    """Megatron-DeepSpeed's recompute flags on a real 2-rank ZeRO-1 run (DeepSpeed's checkpointing, its checkpoints
    in host memory) give the losses of the same run without recompute (tests/runs.py's saved-checkpoint run)."""
    reference = dict(LOSS.findall(checkpoint_run.stdout))
    run = run_pretrain(dolly_data_dir, "--zero-stage", "1", "--exit-interval", "3", "--recompute-granularity", "full",
                       "--recompute-method", "uniform", "--deepspeed-activation-checkpointing", "--checkpoint-in-cpu")
    got = dict(LOSS.findall(run.stdout))
    assert got == {step: reference[step] for step in ("1", "2", "3")}
