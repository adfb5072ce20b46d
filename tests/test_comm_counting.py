"""megatron/accounting/measure/comm_counter.py on real 2-rank gloo groups: every collective form counted once, with the
documented bytes-sent rule, also when issued through deepspeed.comm; nothing outside counting();
uninstall puts torch's functions back. The comm log line's format."""
import time

import pytest
import torch
import torch.distributed as dist

from analysis import log_parser
from conftest import REPO_ROOT
from megatron.accounting.measure import comm_counter
from megatron.training_log import comm_line
from test_tensor_parallel import run_ranks

N = 1000  # fp32 elements: 4000 bytes
B = 4 * N


def _counted(counter, fn):
    """Bytes per kind and calls per op that fn() added."""
    before, calls_before = counter.snapshot(), dict(counter.calls)
    with counter.counting():
        fn()
    sent = {kind: value for kind, value in comm_counter.since(counter.snapshot(), before, 1).items() if value}
    calls = {op: n - calls_before.get(op, 0) for op, n in counter.calls.items() if n != calls_before.get(op, 0)}
    return sent, calls


def _check_every_form(rank, world):
    original_all_reduce = dist.all_reduce
    counter = comm_counter.install()
    try:
        ones = torch.ones(N)
        # 2 ranks: a ring reduce-scatter or all-gather sends half the buffer, an all-reduce the whole
        cases = [
            (lambda: dist.all_reduce(ones.clone()), {"all_reduce": B}, {"all_reduce": 1}),
            (lambda: dist.all_reduce_coalesced([ones.clone(), ones.clone()]), {"all_reduce": 2 * B},
             {"all_reduce_coalesced": 1}),
            (lambda: dist.all_gather_into_tensor(torch.empty(2 * N), ones), {"all_gather": B},
             {"all_gather_into_tensor": 1}),
            (lambda: dist.all_gather([torch.empty(N), torch.empty(N)], ones), {"all_gather": B}, {"all_gather": 1}),
            (lambda: dist.reduce_scatter_tensor(torch.empty(N // 2), ones.clone()), {"reduce_scatter": B / 2},
             {"reduce_scatter_tensor": 1}),
            (lambda: dist.reduce(ones.clone(), dst=0), {"reduce_scatter": B / 2}, {"reduce": 1}),
            (lambda: dist.broadcast(ones.clone(), src=0), {"broadcast": B / 2}, {"broadcast": 1}),
            # send calls isend inside torch: counted once, as send; a receive sends nothing
            (lambda: dist.send(ones, dst=1) if rank == 0 else dist.recv(torch.empty(N), src=0),
             {"p2p": B} if rank == 0 else {}, {"send": 1} if rank == 0 else {}),
            (lambda: (dist.isend(ones, dst=1) if rank == 0 else dist.irecv(torch.empty(N), src=0)).wait(),
             {"p2p": B} if rank == 0 else {}, {"isend": 1} if rank == 0 else {}),
            (lambda: [work.wait() for work in dist.batch_isend_irecv(
                [dist.P2POp(dist.isend, ones, 1 - rank), dist.P2POp(dist.irecv, torch.empty(N), 1 - rank)])],
             {"p2p": B}, {"isend": 1}),
        ]
        for fn, sent, calls in cases:
            assert _counted(counter, fn) == (sent, calls)
        # outside counting() nothing is added
        before = counter.snapshot()
        dist.all_reduce(ones.clone())
        assert counter.snapshot() == before
    finally:
        comm_counter.uninstall()
    assert dist.all_reduce is original_all_reduce
    assert not hasattr(torch.distributed.distributed_c10d.all_gather_into_tensor, "zero_lab_original")


def _check_through_deepspeed(rank, world):
    import deepspeed
    import deepspeed.comm as ds_dist

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)  # DeepSpeed caches torch's functions here
    counter = comm_counter.install()  # after DeepSpeed's start-up: its cached references follow
    try:
        ones = torch.ones(N)
        assert _counted(counter, lambda: ds_dist.allgather_fn(torch.empty(2 * N), ones)) == (
            {"all_gather": B}, {"all_gather_into_tensor": 1})
        assert _counted(counter, lambda: ds_dist.reduce_scatter_fn(torch.empty(N // 2), ones.clone())) == (
            {"reduce_scatter": B / 2}, {"reduce_scatter_tensor": 1})
        assert _counted(counter, lambda: ds_dist.all_reduce(ones.clone())) == ({"all_reduce": B}, {"all_reduce": 1})
    finally:
        comm_counter.uninstall()


def _check_blocked_time(rank, world):
    """The time a rank waits in a collective is added to its kind: in the call, and for an asynchronous op
    in its wait(). Rank 1 joins each op DELAY late, so rank 0 is blocked at least that long in it."""
    import time
    delay = 0.3
    counter = comm_counter.install()
    try:
        with counter.counting():
            if rank == 1:
                time.sleep(delay)
            dist.all_reduce(torch.ones(N))
            dist.barrier()  # not counted: starts the next op together
            if rank == 1:
                time.sleep(delay)
            work = dist.all_gather_into_tensor(torch.empty(2 * N), torch.ones(N), async_op=True)
            work.wait()
            assert work.is_completed()  # the rest of the handle is torch's
        seconds = counter.seconds()
        if rank == 0:
            assert seconds["all_reduce"] >= delay * 0.9 and seconds["all_gather"] >= delay * 0.9, seconds
        assert seconds["reduce_scatter"] == seconds["broadcast"] == seconds["p2p"] == 0.0
        before = counter.seconds()
        dist.all_reduce(torch.ones(N))  # outside counting(): no time added
        assert counter.seconds() == before
    finally:
        comm_counter.uninstall()


@pytest.mark.slow
def test_time_blocked_in_collectives_is_counted_per_kind():
    run_ranks(_check_blocked_time)


@pytest.mark.slow
def test_every_collective_form_counted_once():
    run_ranks(_check_every_form)


@pytest.mark.slow
def test_collectives_through_deepspeed_comm_counted_once():
    run_ranks(_check_through_deepspeed)


class FakeStream:
    """Stands in for torch.cuda.Stream (no GPU here): which stream is current, and a wait_stream that takes
    WAIT_S, as a compute stream waiting for a side stream's collective does."""
    current = None

    def wait_stream(self, stream):
        time.sleep(WAIT_S)


class FakeEvent:
    """Stands in for torch.cuda.Event: the host clock when recorded (a GPU's: when the stream reaches it)."""

    def __init__(self, enable_timing=False):
        self.at = None

    def record(self, stream=None):
        self.at = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return (end.at - self.at) * 1000


CALL_S, WAIT_S = 0.05, 0.02


def test_on_cuda_only_what_the_compute_stream_waits_for_is_timed(monkeypatch):
    compute, side = FakeStream(), FakeStream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream.current)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    counter = comm_counter.CommCounter(_group_sizes={None: 2})
    FakeStream.current = compute  # as training starts
    counter.time_on_cuda(compute)
    all_reduce = comm_counter.wrap(lambda tensor, group=None: time.sleep(CALL_S), comm_counter.OPS["all_reduce"],
                                   counter)
    with counter.counting():
        FakeStream.current = side  # overlap_comm's reduction stream: the reduction runs behind compute
        all_reduce(torch.ones(N))
        FakeStream.current = compute
    assert counter.sent["all_reduce"] == B and counter.seconds()["all_reduce"] == 0
    with counter.counting():
        compute.wait_stream(side)  # the compute stream waits for the reduction: that much was not hidden
        compute.wait_stream(side)  # nothing issued there since: not timed again
    assert WAIT_S <= counter.seconds()["all_reduce"] < 2 * WAIT_S
    with counter.counting():
        all_reduce(torch.ones(N))  # issued on the compute stream: it stalls for the whole call
    assert counter.sent["all_reduce"] == 2 * B and counter.seconds()["all_reduce"] >= WAIT_S + CALL_S


@pytest.mark.parametrize("size, factor, group, expected", [
    (800, "all_reduce", 4, 1200.0), (800, "ring", 4, 600.0), (800, "whole", 4, 800.0), (800, "ring", 1, 0.0)])
def test_bytes_sent_rule(size, factor, group, expected):
    assert comm_counter.bytes_sent(comm_counter._OpSpec("all_reduce", "tensor", factor), size, group) == expected


def test_every_wrapped_op_names_its_tensor_and_group():
    """The specs name parameters of torch's own signatures (install() would fail on a rename)."""
    import inspect
    for name, spec in comm_counter.OPS.items():
        function = getattr(torch.distributed.distributed_c10d, name, None)
        if function is not None:
            params = inspect.signature(function).parameters
            assert spec.tensors in params and "group" in params, name


def test_comm_line_matches_documented_regex():
    line = comm_line(0, 10, {"all_reduce": 0.0, "reduce_scatter": 2**20, "all_gather": 2 * 2**20, "broadcast": 0.0,
                             "p2p": 0.0}, num_params=2**20, predicted=3 * 2**20)
    assert line == ("[Rank 0] comm at iteration       10 | all_reduce=0.000MB | reduce_scatter=1.000MB | "
                    "all_gather=2.000MB | broadcast=0.000MB | p2p=0.000MB | total=3.000MB | bytes/param=3.000 | "
                    "predicted=3.000MB |")
    # the regex docs/log-lines.md gives is the one the analysis uses
    assert log_parser.COMM_RE.pattern in (REPO_ROOT / "docs" / "log-lines.md").read_text()
    assert log_parser.COMM_RE.search(line).groups() == ("10", "3.000", "3.000", "3.000")


@pytest.mark.slow
def test_bench_prints_each_mode_and_counts_what_it_predicts(tmp_path):
    """bench/bench_comm_counting.py end to end on 2 CPU ranks (its numbers are the bench's business;
    here: a row per stage, and the bytes it counted are the prediction)."""
    import json
    import subprocess
    import sys

    from conftest import free_port, test_env
    out_json = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         str(REPO_ROOT / "bench" / "bench_comm_counting.py"), "--num-layers", "1", "--hidden-size", "64",
         "--num-attention-heads", "2", "--seq-length", "32", "--micro-batch-size", "2", "--stages", "1,3",
         "--warmup", "1", "--steps", "2", "--json", str(out_json)],
        env=test_env(OMP_NUM_THREADS=1), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads(out_json.read_text())
    assert [row["stage"] for row in rows] == [1, 3]
    for row in rows:
        assert row["off_tokens_per_s"] > 0 and row["counter_tokens_per_s"] > 0 and row["logger_tokens_per_s"] > 0
        assert row["sent_mb_per_step"] == pytest.approx(row["predicted_mb_per_step"], rel=0.10)
        assert f"| {row['stage']} | {row['off_tokens_per_s']:.1f} | {row['counter_tokens_per_s']:.1f} |" \
            in result.stdout
