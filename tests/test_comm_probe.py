"""megatron/accounting/measure/comm_probe.py: the two-point fit against hand-computed lines, the bandwidth point's buffer for a run,
and the probe on a real 2-rank gloo group: costs positive, finite and the same on both ranks, a third buffer
size's all-reduce near what the fit predicts, the reduce probed where the run issues it, nothing counted as
training traffic, nothing run on a group of one rank."""
import functools
import math
import time

import pytest
import torch
import torch.distributed as dist

from megatron.accounting.measure import comm_counter
from megatron.accounting.measure.comm_probe import LARGE, LARGEST, fastest_seconds, fit, probe_buffers, probe_link
from megatron.deepspeed_config import bucket_sizes
from megatron.accounting import TrainingSetup, count_parameters
from megatron.accounting.predict.step_time import CollectiveCost
from megatron.accounting.predict.traffic import OWNER_REDUCTION
from megatron.model.config import GPTConfig
from test_tensor_parallel import run_ranks

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "p2p")


def test_fit_is_the_line_through_the_two_medians():
    # 100 us + 10 ns per byte: 1 kB in 110 us, 1 MB in 10.1 ms
    cost = fit((1e3, 1.1e-4), (1e6, 1.01e-2))
    assert cost.latency_s == pytest.approx(1e-4) and cost.seconds_per_byte == pytest.approx(1e-8)
    assert cost.seconds(1e3, 1) == pytest.approx(1.1e-4) and cost.seconds(1e6, 1) == pytest.approx(1.01e-2)


def test_fit_stays_physical_under_noise():
    # the small buffer took longer than the large one: no slope to trust, the large one's rate and no latency
    cost = fit((1e3, 2e-3), (1e6, 1e-3))
    assert cost.latency_s == 0.0 and cost.seconds_per_byte == pytest.approx(1e-9)
    # a line through negative latency: zero latency, the slope kept
    cost = fit((1e3, 1e-6), (1.001e6, 1.0001e-2))  # 10 ns per byte, intercept -9 us
    assert cost.latency_s == 0.0 and cost.seconds_per_byte == pytest.approx(1e-8)


def test_bandwidth_point_is_the_steps_largest_message():
    # the tiny preset's shape: h 128, vocabulary 50304; the word embedding (6,438,912 elements) is larger than
    # the generated bucket (1/20 of the model), so DeepSpeed reduces and gathers it alone: the largest message
    tiny = GPTConfig(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=128,
                     max_position_embeddings=128, padded_vocab_size=50304)
    two = TrainingSetup(world_size=2, micro_batch_size=4, device="cpu", zero_stage=1)
    zero = {"stage": 1, **OWNER_REDUCTION, **bucket_sizes(count_parameters(tiny), 128)}
    assert zero["reduce_bucket_size"] < 6_438_912
    # ZeRO-1 reduces (the reduce-scatter kind, probed as reduce) and all-gathers; nothing else sends bytes
    assert probe_buffers(tiny, two, 0, zero) == dict(all_reduce=LARGE, reduce_scatter=LARGE, all_gather=6_438_912,
                                                     broadcast=LARGE, reduce=6_438_912)
    # ZeRO-3 reduce-scatters: no reduce probed
    three = TrainingSetup(world_size=2, micro_batch_size=4, device="cpu", zero_stage=3)
    assert probe_buffers(tiny, three, 0, {**zero, "stage": 3}) == dict(all_reduce=LARGE, reduce_scatter=6_438_912,
                                                               all_gather=6_438_912, broadcast=LARGE)
    # stage 0 all-reduces the whole gradient (DeepSpeed's 5e8-element chunks): all of the rank's parameters
    zero0 = TrainingSetup(world_size=2, micro_batch_size=4, device="cpu", zero_stage=0)
    assert probe_buffers(tiny, zero0, 0, {"stage": 0})["all_reduce"] == count_parameters(tiny)
    # a larger model's embedding is capped at LARGEST (32 MiB); a model smaller than LARGE is probed at LARGE
    big = GPTConfig(num_layers=2, hidden_size=768, num_attention_heads=12, seq_length=128,
                    max_position_embeddings=128, padded_vocab_size=50304)
    assert probe_buffers(big, two, 0, zero)["reduce"] == LARGEST
    small = GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8, max_position_embeddings=8,
                      padded_vocab_size=64)
    assert probe_buffers(small, two, 0, {"reduce_bucket_size": 1500, **OWNER_REDUCTION})["reduce"] == LARGE


def _fastest_of_stretched_runs(rank, world):
    # a warm-up, then 9 runs of which 6 are stretched by 48 ms, as a rank pre-empted on shared cores stretches a
    # collective: the point is an unstretched run's 2 ms (the median would be a stretched one)
    runs = iter([0.002] + [0.05] * 6 + [0.002] * 3)
    seconds = fastest_seconds(lambda: time.sleep(next(runs)), dist.group.WORLD, torch.device("cpu"), repeats=9)
    assert 0.002 <= seconds < 0.02, seconds
    assert next(runs, None) is None, "not every run was timed"


@pytest.mark.slow  # two spawned ranks: about 6 s
def test_a_point_is_its_fastest_run():
    run_ranks(_fastest_of_stretched_runs)


def _all_reduce_near_the_fit(link, world) -> float:
    """measured / predicted time of the all-reduce of a size between the two probed (1 MiB of float32), timed as
    the probe times its points."""
    buffer = torch.ones(256 * 1024)
    measured = fastest_seconds(lambda: dist.all_reduce(buffer), dist.group.WORLD, torch.device("cpu"))
    sent = comm_counter.bytes_sent(comm_counter.OPS["all_reduce"], buffer.numel() * 4, world)
    return measured / link.costs["all_reduce"].seconds(sent, 1)


def _probe_on_two_ranks(rank, world, results):
    counter = comm_counter.install()
    try:
        start = time.perf_counter()
        link = probe_link(dist.group.WORLD, torch.device("cpu"), "gloo")
        seconds = time.perf_counter() - start
        assert not counter.calls, "the probe's collectives were counted as training traffic"
        # a group of one rank runs nothing, even while counting
        singles = [dist.new_group([0]), dist.new_group([1])]
        with counter.counting():
            alone = probe_link(singles[rank], torch.device("cpu"), "gloo")
        assert not counter.calls
    finally:
        comm_counter.uninstall()
    assert alone.source == "probe" and all(c == CollectiveCost(0.0, 0.0) for c in alone.costs.values())
    assert link.source == "probe" and set(link.costs) == {*KINDS, "reduce"} and 0 < link.seconds < seconds + 1e-6
    for kind, cost in link.costs.items():
        assert math.isfinite(cost.latency_s) and cost.latency_s >= 0, (kind, cost)
        assert math.isfinite(cost.seconds_per_byte) and cost.seconds_per_byte > 0, (kind, cost)
    assert link.costs["p2p"] == link.costs["broadcast"]
    everyone = [None, None]
    dist.all_gather_object(everyone, link.costs)
    assert everyone[0] == everyone[1], everyone
    # The fit is sane if a third size costs within 3x of its prediction. The 2-core box is shared with other
    # processes, whose bursts can stretch one round of medians: a fit in the wrong units or bytes is off in every
    # round, so up to three rounds (probe and check, both ranks deciding together) are allowed.
    ratios = [_all_reduce_near_the_fit(link, world)]
    while len(ratios) < 3 and not all(1 / 3 < r < 3 for r in _everyones(ratios[-1])):
        ratios.append(_all_reduce_near_the_fit(probe_link(dist.group.WORLD, torch.device("cpu"), "gloo"), world))
    # a run that issues no reduce gets none probed; one bandwidth point at a larger buffer (8 MiB)
    buffers = dict(all_gather=2 * LARGE)
    start = time.perf_counter()
    issued = probe_link(dist.group.WORLD, torch.device("cpu"), "gloo", buffers=buffers)
    sized = time.perf_counter() - start
    assert set(issued.costs) == set(KINDS) and issued.costs["all_gather"].seconds_per_byte > 0
    results.put((rank, seconds, sized, ratios))
    assert all(1 / 3 < r < 3 for r in _everyones(ratios[-1])), ratios


def _everyones(value) -> list:
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


@pytest.mark.slow
def test_probe_on_a_real_gloo_group():
    import torch.multiprocessing as mp

    results = mp.get_context("spawn").SimpleQueue()
    run_ranks(functools.partial(_probe_on_two_ranks, results=results))
    probed = sorted(results.get() for _ in range(2))
    print("probe seconds (default, with an 8 MiB all-gather point) and 1 MiB all-reduce measured/predicted (each "
          "round) per rank:", probed)
