"""The checkpoint interval that fits (issue 35 item 4): every save's time in its line, and with --mtbf-hours the
Young/Daly interval printed once beside --save-interval; tools/zero_plan.py's from a predicted save time."""
import json
import math
import re
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, free_port, test_env, tool_in_process
from megatron.arguments import parse_args
from megatron.checkpointing.interval import advise, expected_loss_fraction, optimal_interval_seconds
from megatron.errors import ZeroLabError
from megatron.accounting.predict.memory import checkpoint_bytes

SAVED = re.compile(r"successfully saved checkpoint at iteration +(\d+) to \S+ in ([\d.]+) s \(([\d.]+) MB\)")
ADVICE = re.compile(r" > checkpoint interval: a save took ([\d.]+) s and an iteration ([\d.]+) s; with --mtbf-hours "
                    r"(\S+) the interval that loses the least time in expectation is (\d+) iterations \([^;]+; "
                    r"([\d.]+)% of the time lost\); this run saves every (\d+) iterations \(([\d.]+)% lost; "
                    r"--save-interval\)")


def test_the_interval_minimises_the_expected_loss():
    """By hand: a 10 s save and a 3 h MTBF give sqrt(2 x 10 x 10800) - 10 = 454.76 s of training per cycle,
    where the two losses are equal and add up to sqrt(2 x 10 / 10800) = 4.30%; a brute-force scan of the
    expected loss finds the same minimum."""
    best = optimal_interval_seconds(10.0, 10800.0)
    assert best == pytest.approx(454.758, abs=1e-3)
    assert expected_loss_fraction(best, 10.0, 10800.0) == pytest.approx(math.sqrt(20 / 10800), rel=1e-9)
    scanned = min(range(1, 5000), key=lambda seconds: expected_loss_fraction(seconds, 10.0, 10800.0))
    assert abs(scanned - best) <= 1


def test_a_save_longer_than_half_the_mtbf_saves_every_mtbf():
    assert optimal_interval_seconds(100.0, 40.0) == 40.0


def test_the_advice_in_iterations_beside_the_run_s_own():
    # 2 s per save, 0.5 s per iteration, MTBF 1 h: sqrt(2 x 2 x 3600) - 2 = 118 s = 236 iterations
    advice = advise(2.0, 0.5, 1.0, used_iterations=1000)
    assert advice.best_iterations == 236
    assert advice.best_loss == pytest.approx(2 / 120 + 120 / 7200, rel=1e-3)
    assert advice.used_loss == pytest.approx(2 / 502 + 502 / 7200, rel=1e-9)
    assert advice.line() == (" > checkpoint interval: a save took 2.00 s and an iteration 0.500 s; with --mtbf-hours 1 "
                             "the interval that loses the least time in expectation is 236 iterations (118 s; 3.3% of "
                             "the time lost); this run saves every 1000 iterations (7.4% lost; --save-interval)")
    assert "saves only at its end" in advise(2.0, 0.5, 1.0, used_iterations=None).line()
    assert advise(0.01, 60.0, 1.0, used_iterations=None).best_iterations == 1  # never less than every iteration


def test_a_bad_mtbf_names_the_flag(tmp_path):
    with pytest.raises(ZeroLabError, match=r"--mtbf-hours must be > 0, got -2.0"):
        parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                    "--micro-batch-size", "2", "--train-iters", "10", "--data-path", str(tmp_path / "x"),
                    "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--mtbf-hours", "-2"], world_size=1)


@pytest.mark.slow
def test_a_real_run_logs_each_save_s_time_and_the_advice_once(dolly_data_dir, tmp_path):
    """2 ranks, ZeRO-1, saves at iterations 2, 4 and 6; MTBF 36 s so the advice is a few iterations."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(REPO_ROOT / "pretrain_gpt.py"), "--model-size", "tiny", "--seq-length", "64", "--micro-batch-size", "2",
           "--global-batch-size", "8", "--train-iters", "6", "--log-interval", "2", "--eval-iters", "0",
           "--lr", "1e-3", "--zero-stage", "1", "--data-path", str(dolly_data_dir / "dolly_text_document"),
           "--vocab-file", str(dolly_data_dir / "gpt2-vocab.json"),
           "--merge-file", str(dolly_data_dir / "gpt2-merges.txt"),
           "--save", str(tmp_path / "ckpt"), "--save-interval", "2", "--mtbf-hours", "0.01"]
    run = subprocess.run(cmd, env=test_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    saves = SAVED.findall(run.stdout)
    assert [int(it) for it, _, _ in saves] == [2, 4, 6]
    # tiny at seq 64 by hand: 2 x (12 x 128^2 + 13 x 128) + (50304 + 64) x 128 + 2 x 128 parameters, 16 bytes each
    # in fp32 under ZeRO-1 (accounting's checkpoint_bytes); the files' pickling adds a few tens of kB
    expected_mb = checkpoint_bytes(2 * (12 * 128**2 + 13 * 128) + (50304 + 64) * 128 + 2 * 128, "fp32", 1) / 1e6
    assert all(float(seconds) > 0 and float(mb) == pytest.approx(expected_mb, rel=0.005) for _, seconds, mb in saves)
    advice = ADVICE.findall(run.stdout)
    assert len(advice) == 1, run.stdout[-3000:]
    save_s, iteration_s, mtbf, best, best_pct, used, used_pct = advice[0]
    assert float(save_s) == pytest.approx(float(saves[0][1]), abs=0.006)  # the first save's own time
    assert mtbf == "0.01" and used == "2" and float(iteration_s) > 0
    # recomputed from the printed figures (rounded to what the line shows)
    expected = optimal_interval_seconds(float(save_s), 36.0) / float(iteration_s)
    assert abs(int(best) - max(1, round(expected))) <= 1
    # the line rounds the save to 0.01 s and the iteration to 0.001 s: a 0.08 s save may be 0.075 s, so the
    # percentage lies between the losses at the corners of those ranges (and is itself rounded to 0.1)
    corners = [100 * expected_loss_fraction(2 * (float(iteration_s) + di), float(save_s) + ds, 36.0)
               for di in (-0.0005, 0.0005) for ds in (-0.005, 0.005)]
    assert min(corners) - 0.05 <= float(used_pct) <= max(corners) + 0.05, (used_pct, corners)
    assert float(best_pct) <= float(used_pct) + 0.05


# ---- tools/zero_plan.py: the same advice from a predicted save time ----

def test_zero_plan_prints_the_interval_from_the_checkpoint_size_and_storage_bandwidth(capsys):
    """13B in bf16 on 64 A100s: parameters (2 bytes) and optimizer states (12) of the hand-counted parameters, at
    20 GB/s (10**9 bytes); the interval by hand from Young/Daly, in steps of the picked option."""
    shape = ["--num-layers", "40", "--hidden-size", "5120", "--num-attention-heads", "40", "--seq-length", "2048"]
    hardware = ["--gpus", "8", "--nodes", "8", "--gpu", "A100-80GB", "--inter-node-bandwidth", "200Gbit"]
    flags = [*shape, *hardware, "--storage-bandwidth", "20GB/s", "--mtbf-hours", "12"]
    code, out, err = tool_in_process(capsys, "zero_plan.py", *flags, "--json")
    assert code == 0, err
    data = json.loads(out)
    params = 40 * (12 * 5120 * 5120 + 13 * 5120) + (50304 + 2048) * 5120 + 2 * 5120  # a GPT-2 block by hand
    advice = data["checkpoint"]
    assert advice["bytes"] == 14 * params
    assert advice["save_s"] == pytest.approx(14 * params / 20e9)
    save = 14 * params / 20e9
    assert advice["interval_s"] == pytest.approx(math.sqrt(2 * save * 43200) - save)
    step_s = next(p for p in data["plans"] if p["option"] == data["choice"])["step_ms"] / 1e3
    assert advice["interval_iterations"] == round((math.sqrt(2 * save * 43200) - save) / step_s)
    code, out, err = tool_in_process(capsys, "zero_plan.py", *flags)
    assert code == 0 and err == ""
    assert out.rstrip().splitlines()[-1] == (
        f"checkpoint: {14 * params / 1e9:.1f} GB per save (parameters and optimizer states), {save:,.0f} s at 20GB/s; "
        f"with --mtbf-hours 12 save every {advice['interval_s']:,.0f} s of training (--save-interval "
        f"{advice['interval_iterations']} at the picked option's step), {100 * advice['lost_fraction']:.1f}% of the "
        f"time lost in expectation (Young/Daly)")


def test_checkpoint_bytes_by_precision_and_stage():
    """Per parameter: fp32 at stage 0 keeps no master copy (the parameters are it), 4 + 8 (Adam's m and v); fp32
    under ZeRO 4 + 4 + 8 (DeepSpeed clones an fp32 master); bf16 2 + 12 at any stage (a real save: below)."""
    assert checkpoint_bytes(1000, "fp32", 0) == 12_000
    assert checkpoint_bytes(1000, "fp32", 1) == checkpoint_bytes(1000, "fp32", 3) == 16_000
    assert checkpoint_bytes(1000, "bf16", 0) == checkpoint_bytes(1000, "bf16", 3) == 14_000


@pytest.mark.parametrize("extra, message", [
    (["--mtbf-hours", "3"], "error: --storage-bandwidth and --mtbf-hours go together"),
    (["--storage-bandwidth", "10GB/s"], "error: --storage-bandwidth and --mtbf-hours go together"),
    (["--storage-bandwidth", "fast", "--mtbf-hours", "3"], "error: --storage-bandwidth 'fast': expected a bandwidth"),
    (["--storage-bandwidth", "10GB/s", "--mtbf-hours", "0"], "error: --mtbf-hours must be > 0, got 0"),
])
def test_zero_plan_refuses_a_half_given_or_bad_interval_flag_in_one_line(capsys, extra, message):
    code, out, err = tool_in_process(capsys, "zero_plan.py", "--model-size", "1.3B", "--gpus", "8",
                                     "--gpu-memory", "40GB", *extra)
    assert code == 1 and out == ""
    assert err.startswith(message) and err.count("\n") == 1
