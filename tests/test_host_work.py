"""What the host does between training steps: the loop waits for the device (synchronize, reading a loss,
the --exit-signal-handler all-reduce) only at its bookkeeping iterations, SIGTERM still saves, the data loader
reads in worker processes, and at TP=1 attention dropout does not swap generator states (which would break
the graph of every layer under --compile)."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import megatron.training as training
from conftest import REPO_ROOT, free_port
from megatron.arguments import parse_args
from megatron.core.parallel_state import ParallelLayout, ParallelState
from megatron.data.data_samplers import build_pretraining_data_loader, loader_workers
from megatron.exit_signal import ExitSignalHandler
from megatron.initialize import DistInfo
from megatron.model import MODEL_PRESETS, GPTConfig, GPTModel
from megatron.training import LoopState, Schedule, TrainingError, train, train_step

VOCAB, SEQ, MEGATRON = 64, 8, str(REPO_ROOT / "megatron")


@pytest.fixture(scope="module")
def dist_info():
    """One gloo rank in this process (the loop's collectives need a group)."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"),
                   parallel=ParallelState.build(ParallelLayout(world_size=1)))
    dist.destroy_process_group()


def flags(*extra, iters=12, log_interval=4):
    return parse_args(["--model-size", "tiny", "--data-path", "unused", "--train-iters", str(iters),
                       "--log-interval", str(log_interval), "--micro-batch-size", "2", "--global-batch-size", "4",
                       "--seq-length", str(SEQ), "--eval-iters", "0", *extra])


class Engine(torch.nn.Module):
    """The DeepSpeed engine's calls the loop and train_step make, around a bigram model."""

    def __init__(self, nan_from: int | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.module = torch.nn.Embedding(VOCAB, VOCAB)
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=0.1)
        self.steps, self.nan_from = 0, nan_from

    def forward(self, tokens, position_ids, labels):
        logits = self.module(tokens)
        if self.nan_from is not None and self.steps >= self.nan_from:
            logits = logits * float("nan")
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
        return loss.view_as(labels)

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.steps += 1

    def was_step_applied(self):
        return True

    def get_global_grad_norm(self):
        return 1.0

    def zero_use_cpu_optimizer(self):
        return False

    def get_lr(self):
        return [0.1]

    def train_batch_size(self):
        return 4  # flags()'s --global-batch-size

    def gradient_accumulation_steps(self):
        return 2

    def set_gradient_accumulation_boundary(self, is_boundary):
        """The loop's boundary; this engine steps on every micro-batch."""

    class lr_scheduler:  # noqa: N801 (DeepSpeed's attribute)
        @staticmethod
        def before_step(batch, consumed_tokens):
            """The loop announces each step's batch and tokens to the schedule."""

    def zero_optimization(self):
        return False


class Reporter:
    """The loop's reporter, recording what it was given."""

    def __init__(self, iters):
        self.schedule = Schedule(train_iters=iters, iters_per_epoch=1000, samples_per_epoch=4000, global_batch_size=4)
        self.logged, self.lines = [], []

    def counting(self):
        import contextlib
        return contextlib.nullcontext()

    def model_state(self, engine, probed, seq_length):
        """The tests read the iteration records only."""

    def iteration(self, state, engine):
        self.logged.append((state.iteration, list(state.interval_losses), state.interval_iterations,
                            state.nan_iterations))

    def epoch(self, state):
        """The tests read the iteration records only."""

    def print_line(self, line):
        self.lines.append(line)


def batches():
    generator = torch.Generator().manual_seed(1)
    while True:
        yield {"text": torch.randint(0, VOCAB, (2, SEQ + 1), generator=generator)}


class HostWaits:
    """Per training step: the loop's device syncs, and the .item()/.tolist() reads made by megatron/ code
    (DeepSpeed's own are not ours to count), attributed to the iteration that the step before them ended."""

    def __init__(self, monkeypatch):
        self.iteration, self.syncs, self.reads, self.polls = 0, {}, {}, {}
        sync = training._synchronize
        monkeypatch.setattr(training, "_synchronize", lambda info: (self._count(self.syncs), sync(info)))
        for name in ("item", "tolist"):
            original = getattr(torch.Tensor, name)

            def read(tensor, *args, _original=original, **kwargs):
                if sys._getframe(1).f_code.co_filename.startswith(MEGATRON):
                    self._count(self.reads)
                return _original(tensor, *args, **kwargs)
            monkeypatch.setattr(torch.Tensor, name, read)
        poll = ExitSignalHandler.stop_requested
        monkeypatch.setattr(ExitSignalHandler, "stop_requested",
                            lambda handler, device: (self._count(self.polls), poll(handler, device))[1])

    def _count(self, counts):
        counts[self.iteration] = counts.get(self.iteration, 0) + 1

    def step_fn(self, engine, *args, **kwargs):
        result = train_step(engine, *args, **kwargs)
        self.iteration += 1
        return result


def run(args, dist_info, engine=None, waits=None, state=None):
    reporter = Reporter(args.training.train_iters)
    step = waits.step_fn if waits else train_step
    state = train(engine or Engine(), batches(), None, args, dist_info, reporter, VOCAB - 1, state or LoopState(),
                  step_fn=step)
    return state, reporter


def test_steps_between_bookkeeping_iterations_do_not_wait_on_the_host(dist_info, monkeypatch):
    waits = HostWaits(monkeypatch)
    state, reporter = run(flags(iters=12, log_interval=4), dist_info, waits=waits)
    assert state.iteration == 12
    # synchronize, and the losses read, only after the first step (its memory probe) and at the log lines
    # (and once before the first step, where the clock starts)
    assert set(waits.syncs) == {0, 1, 4, 8, 12} and set(waits.reads) == {1, 4, 8, 12}
    # one read of all the interval's losses, whatever its length
    assert all(count == 1 for count in waits.reads.values())
    assert [(it, len(losses), n) for it, losses, n, _ in reporter.logged] == [(4, 4, 4), (8, 4, 4), (12, 4, 4)]
    assert all(isinstance(loss, float) for _, losses, _, _ in reporter.logged for loss in losses)


def test_the_losses_logged_are_the_steps_losses_read_one_by_one(dist_info):
    """Reading the losses late changes no number: every log interval gives the losses of 1-by-1 logging."""
    late = [loss for _, losses, _, _ in run(flags(iters=8, log_interval=4), dist_info)[1].logged for loss in losses]
    each = [loss for _, losses, _, _ in run(flags(iters=8, log_interval=1), dist_info)[1].logged for loss in losses]
    assert len(each) == 8 and late == each


def test_nan_limit_names_the_iteration_that_reached_it(dist_info):
    # iterations 3.. (micro-batches 4..; 2 per step) have NaN losses: the third in a row is iteration 5, found
    # when iteration 8's losses are read
    with pytest.raises(TrainingError, match=r"^stopping at iteration 5: 3 iterations in a row had a non-finite "
                                            r"loss or gradient \(--max-nan-iterations 3\)$"):
        run(flags("--max-nan-iterations", "3", iters=12, log_interval=4), dist_info, engine=Engine(nan_from=4))


@pytest.mark.parametrize("log_interval, polled", [(4, {4, 8, 12}), (1, set(range(1, 13))),
                                                  (20, {10})])
def test_exit_flag_is_polled_every_min_of_log_interval_and_10(dist_info, monkeypatch, log_interval, polled):
    waits = HostWaits(monkeypatch)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        run(flags("--exit-signal-handler", iters=12, log_interval=log_interval), dist_info, waits=waits)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert training.EXIT_SIGNAL_POLL_STEPS == 10
    assert set(waits.polls) == polled and all(count == 1 for count in waits.polls.values())


def test_sigterm_saves_at_the_next_poll_and_stops(dist_info, monkeypatch, tmp_path):
    saved = []
    monkeypatch.setattr(training, "save_checkpoint",
                        lambda engine, args, iteration, consumed, rank, **tokens: saved.append(iteration))
    args = flags("--exit-signal-handler", "--save", str(tmp_path), iters=12, log_interval=4)

    def step_then_sigterm(engine, *rest, **kwargs):
        result = train_step(engine, *rest, **kwargs)
        if engine.steps == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # what a scheduler sends; the handler only sets a flag
        return result
    previous = signal.getsignal(signal.SIGTERM)
    try:
        reporter = Reporter(12)
        state = train(Engine(), batches(), None, args, dist_info, reporter, VOCAB - 1, LoopState(),
                      step_fn=step_then_sigterm)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert state.iteration == 4 and saved == [4]
    assert reporter.lines == [f" exiting program after receiving SIGTERM at iteration 4 (checkpoint saved to "
                              f"{tmp_path})"]


class Samples(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, index):
        return {"text": torch.full((SEQ + 1,), index)}


@pytest.mark.filterwarnings("ignore:.pin_memory. argument is set as true but no accelerator")
def test_loader_workers_pinning_and_order():
    serial = build_pretraining_data_loader(Samples(), 8, 4, 1, 2)
    loader = build_pretraining_data_loader(Samples(), 8, 4, 1, 2, num_workers=2, pin_memory=True)
    assert (serial.num_workers, serial.pin_memory) == (0, False)
    assert (loader.num_workers, loader.pin_memory, loader.persistent_workers) == (2, True, True)
    assert [b["text"][:, 0].tolist() for b in loader] == [b["text"][:, 0].tolist() for b in serial]


def test_a_sigterm_from_the_scheduler_leaves_the_loader_working():
    """PBS and Slurm signal every process of the job: a loader worker killed by it would make the rank raise
    at its next batch instead of saving (--exit-signal-handler). The signal comes from another process, as the
    scheduler's does, right after the workers started."""
    batches = iter(build_pretraining_data_loader(Samples(), 0, 2, 0, 1, num_workers=2))
    for worker in batches._workers:
        subprocess.run(["kill", "-TERM", str(worker.pid)], check=True)
    first, rest = next(batches), list(batches)
    assert first["text"][:, 0].tolist() == [0, 1] and len(rest) == 31
    assert rest[-1]["text"][:, 0].tolist() == [62, 63]


FAILING_RANK = """
import torch
from megatron.data.data_samplers import build_pretraining_data_loader

class Samples(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, index):
        return {"text": torch.full((9,), index)}

batches = iter(build_pretraining_data_loader(Samples(), 0, 2, 0, 1, num_workers=2))
next(batches)
print("workers", *(worker.pid for worker in batches._workers), flush=True)
raise RuntimeError("the rank fails with its loader's workers running")
"""


@pytest.mark.slow
def test_a_rank_that_fails_with_loader_workers_exits(tmp_path):
    """Python's exit terminates and joins the rank's daemonic children: workers that ignored that SIGTERM
    would hang the failed rank forever (and so the job)."""
    script = tmp_path / "failing_rank.py"
    script.write_text(FAILING_RANK)
    done = subprocess.run([sys.executable, str(script)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert "RuntimeError: the rank fails with its loader's workers running" in done.stderr
    workers = [int(pid) for pid in done.stdout.split()[1:]]
    assert len(workers) == 2 and not any(Path(f"/proc/{pid}").exists() for pid in workers)


def test_num_workers_flag(monkeypatch):
    assert flags().data.num_workers is None  # 2 on CUDA (Megatron's default), 0 on CPU ranks
    assert (loader_workers(None, on_cuda=True), loader_workers(None, on_cuda=False)) == (2, 0)
    assert loader_workers(flags("--num-workers", "3").data.num_workers, on_cuda=False) == 3
    assert flags("--num-workers", "0").data.num_workers == 0
    with pytest.raises(ValueError, match="--num-workers must be >= 0, got -1"):
        flags("--num-workers", "-1")


@pytest.mark.parametrize("on_cuda", [False, True])
def test_pretrain_builds_its_loaders_with_the_flag_and_pins_on_cuda(monkeypatch, on_cuda):
    import megatron.data.data_samplers as samplers
    import megatron.data.gpt_dataset as gpt_dataset
    sys.path.insert(0, str(REPO_ROOT))
    from pretrain_gpt import build_data_iterators

    built = []
    monkeypatch.setattr(gpt_dataset, "build_train_valid_test_datasets",
                        lambda *args, **kwargs: (Samples(), Samples(), None))
    monkeypatch.setattr(samplers, "build_pretraining_data_loader",
                        lambda *args, **kwargs: built.append(kwargs) or [])
    info = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cuda" if on_cuda else "cpu"),
                    parallel=ParallelState.build(ParallelLayout(world_size=1)))
    build_data_iterators(flags("--num-workers", "3", "--eval-iters", "1"), info, 12, 0, 0)
    assert built == [dict(num_workers=3, pin_memory=on_cuda)] * 2


# --- the tensor-parallel RNG fork at TP=1 (--compile) ---

def tiny_model(tp_group=None, **overrides) -> GPTModel:
    fields = dict(MODEL_PRESETS["tiny"], seq_length=SEQ, max_position_embeddings=SEQ, padded_vocab_size=VOCAB)
    fields.update(overrides)
    torch.manual_seed(3)
    return GPTModel(GPTConfig(**fields), tp_group)


def count_forks(model, monkeypatch) -> list:
    entered = []
    fork = type(model.rng_tracker).fork
    monkeypatch.setattr(type(model.rng_tracker), "fork",
                        lambda tracker, device, *args: entered.append(device) or fork(tracker, device, *args))
    return entered


def forward_loss(model, seed=5):
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(seed)
    return model(tokens, torch.arange(SEQ).expand(2, SEQ), tokens).mean()


def test_tp1_attention_dropout_draws_from_the_default_generator_without_a_swap(monkeypatch):
    """At TP=1 attention dropout draws from the default generator (whole heads, like the replicated hidden
    dropout), so a seed gives the same masks and nothing is swapped; the ZeRO stages draw the same masks from it
    (tests/test_hf_conversion.py's stage-0 and stage-3-offload exports agree)."""
    model = tiny_model(hidden_dropout=0.0).train()  # attention dropout alone
    entered = count_forks(model, monkeypatch)
    assert torch.equal(forward_loss(model, seed=5), forward_loss(model, seed=5))
    assert not torch.equal(forward_loss(model, seed=5), forward_loss(model, seed=6))
    forward_loss(model.eval())
    assert entered == []


def test_a_tp1_layer_in_training_has_no_graph_break():
    """--compile: the generator swap would be a graph break in every layer."""
    model = tiny_model().train()
    assert model.config.attention_dropout > 0 and model.config.hidden_dropout > 0
    explained = torch._dynamo.explain(model.layers[0])(torch.randn(2, SEQ, model.config.hidden_size))
    assert explained.graph_break_count == 0, explained.break_reasons


def _check_tp2_forks(rank, world):
    model = tiny_model(dist.group.WORLD).train()
    entered = []
    fork = type(model.rng_tracker).fork
    type(model.rng_tracker).fork = lambda tracker, device, *args: entered.append(device) or fork(tracker, device,
                                                                                                   *args)
    forward_loss(model)
    assert len(entered) == model.config.num_layers  # each layer's split heads draw from the per-rank stream
    entered.clear()
    forward_loss(model.eval())
    assert entered == []  # no dropout in eval: nothing to draw, no swap


@pytest.mark.slow
def test_tp2_attention_dropout_forks_in_every_layer():
    from test_tensor_parallel import run_ranks
    run_ranks(_check_tp2_forks)
