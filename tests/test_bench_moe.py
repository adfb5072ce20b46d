"""bench/bench_moe.py: its rows hold the active FLOPs per token equal, its quick mode runs for real on 2 CPU ranks
(dense and 4 experts top-2, EP=2, ZeRO-1) and prints the table with traffic measured equal to predicted, and bad
arguments are refused in one line."""
import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from conftest import REPO_ROOT, test_env

sys.path.insert(0, str(REPO_ROOT / "bench"))  # a bench imports its sibling bench/common.py
import bench_moe as bench  # noqa: E402
from megatron.arguments import parse_args  # noqa: E402
from megatron.model import GPTModel  # noqa: E402
from megatron import accounting  # noqa: E402
from megatron.model.moe import moe_layers  # noqa: E402
from megatron.optimizer import LRSchedule, build_optimizer  # noqa: E402
from megatron.training import with_moe_loss  # noqa: E402

BENCH = str(REPO_ROOT / "bench" / "bench_moe.py")


def test_every_row_runs_the_dense_models_flops_per_token_but_the_gates():
    def per_token(config):
        return accounting.model_flops_per_iteration(config, 1) / bench.SEQ

    dense = per_token(bench.ROWS["dense"].config())
    for variant in bench.ROWS.values():
        config = variant.config()
        # the gate: h -> experts per MoE layer (both here), forward and backward (x 3), 2 FLOPs a multiply-add
        gates = 3 * 2 * config.hidden_size * variant.experts * config.num_layers if variant.experts > 1 else 0
        assert per_token(config) == dense + gates
        assert variant.ffn * variant.topk == bench.DENSE_FFN


def _dolly_bytes() -> torch.Tensor:
    lines = (REPO_ROOT / "data" / "samples" / "dolly-sample.jsonl").read_text().splitlines()
    text = "\n".join("\n".join(v for v in json.loads(line).values() if isinstance(v, str) and v) for line in lines)
    return torch.tensor(list(text.encode()), dtype=torch.long)


@pytest.mark.slow  # 60 training steps in one process: about 5 s
def test_the_benchs_schedule_keeps_a_top1_gate_from_sending_every_token_to_one_expert():
    """The 4 experts top-1 row's model, flags and optimizer in one process (EP=1, the bench's micro-batches of 4
    on each of its 2 ranks as one batch of 8): over iterations 41-60 the gates drop under 35% of the routes to
    capacity (10-30%) and the lm loss is below the unigram plateau (about 3.2). At --lr 2e-3 without
    warm-up every token of a batch went to one expert from iteration 3 on (about 70% dropped, 3.25)."""
    variant = bench.ROWS["e4k1"]
    flags = bench.command(Path("unused"), variant, 500, 50)
    args = parse_args(flags[flags.index(str(bench.REPO / "pretrain_gpt.py")) + 1:], world_size=bench.RANKS)
    torch.manual_seed(variant.seed)
    model = GPTModel(replace(variant.config(), moe_expert_parallel_size=1)).train()
    optimizer = build_optimizer(model, args)
    schedule = LRSchedule(optimizer, args.optimizer, args.training.train_iters)
    data, batches = _dolly_bytes(), torch.Generator().manual_seed(0)
    positions = torch.arange(bench.SEQ).expand(bench.GLOBAL, bench.SEQ)
    losses = []
    for iteration in range(1, 61):
        if iteration == 41:
            [layer.stats.take() for layer in moe_layers(model)]  # count iterations 41-60 only
        starts = torch.randint(0, len(data) - bench.SEQ - 1, (bench.GLOBAL,), generator=batches)
        batch = torch.stack([data[start:start + bench.SEQ + 1] for start in starts])
        lm = model(batch[:, :-1], positions, batch[:, 1:]).mean()
        losses.append(lm.item())
        optimizer.zero_grad()
        with_moe_loss(lm, model, args.training.moe_loss_coeff).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.optimizer.clip_grad)
        optimizer.step()
        schedule.step()
    for index, layer in enumerate(moe_layers(model)):
        routes, dropped = layer.stats.take()[-4:-2].tolist()
        assert dropped / routes < 0.35, f"layer {index}: {dropped / routes:.2f} of the routes dropped"
    assert sum(losses[40:]) / 20 < 3.1, losses[40:]


@pytest.mark.parametrize("argv, message", [
    (["--rows", "dense", "e3k1"], "error: --rows e3k1: expected one of dense, dense-seed2, e4k1, e4k2, e8k1, e8k2, "
                                    "e4k1-nodrop, e8k1-nodrop"),
    (["--iters", "30", "--log-interval", "20"], "error: --iters 30: expected at least 2 logging intervals of "
                                                 "--log-interval 20 (the first is warm-up)"),
])
def test_bad_arguments_are_refused_in_one_line(argv, message):
    run = subprocess.run([sys.executable, BENCH, *argv], env=test_env(), capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and run.stdout == "" and run.stderr == message + "\n", run.stderr


@pytest.mark.slow
def test_the_quick_mode_prints_each_row_measured_beside_predicted(tmp_path):
    out = tmp_path / "result.json"
    run = subprocess.run([sys.executable, BENCH, "--quick", "--json", str(out)], env=test_env(),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("| ")]
    assert lines[0] == "| " + " | ".join(bench.COLUMNS) + " |"
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]
    assert [row[0] for row in rows] == ["dense", "4 experts top-2"]
    assert all(len(row) == len(bench.COLUMNS) for row in rows)
    dense, moe = rows
    assert dense[1] == "445,952 / 445,952" and moe[1] == "710,912 / 447,232"  # total / active parameters
    assert dense[2] == "3.441 M" and moe[2] == "3.447 M"  # the gate's 6 h E per token and layer apart
    assert dense[3] == moe[3] == "20,480"  # the same tokens
    for row in rows:
        states, predicted_states = map(float, row[7].split(" / "))
        assert states == pytest.approx(predicted_states, rel=0.05)
        all_to_all, traffic = row[9].split(" / "), row[10].split(" / ")
        assert all_to_all[0] == all_to_all[1] and traffic[0] == traffic[1], row  # exactly, as printed
    assert moe[9] == "4.000 / 4.000" and dense[9] == "0.000 / 0.000"
    assert re.search(r"^Verdict: at equal active FLOPs per token and after the same 20,480 tokens, the best MoE row "
                     r"\(4 experts top-2\) reached a (lower|higher) validation loss than dense: ", run.stdout, re.M)
    record = json.loads(out.read_text())
    assert record["failures"] == [] and record["iters"] == 10
    assert all(r["traffic_exact"] and r["validation_loss"] is not None for r in record["rows"])
