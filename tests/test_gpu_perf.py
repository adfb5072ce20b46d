"""bench/gpu_suite.sh --perf without a GPU (issue 55, docs/gpu.md): its dry run's plan and commands, the results page
bench/gpu_perf_report.py writes from real tiny CPU runs' logs, the "before" settings of
megatron/deepspeed_defaults.py, and bench/bench_syncs.py's counts on a CPU rank."""
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT, test_env
from megatron.arguments import parse_args
from megatron.deepspeed_config import deepspeed_config
from megatron.deepspeed_defaults import restore_deepspeed_defaults
from test_gpu_suite import commands, data_folder, plan_rows, suite, without_packages

FIXTURE_RUNS = REPO_ROOT / "tests" / "fixtures" / "logs" / "ours"


def _config(stage: int) -> dict:
    args = parse_args(["--model-size", "tiny", "--data-path", "unused", "--train-iters", "8", "--micro-batch-size", "2",
                       "--seq-length", "16", "--lr", "1e-3", "--zero-stage", str(stage), "--bf16"], 1)
    return deepspeed_config(args, num_params=1_000_000, hidden_size=args.model.hidden_size, on_cuda=True)


def test_deepspeed_defaults_put_back_the_timer_overlap_and_stage3_release():
    """One CUDA rank: zero-lab's config turns off the timer and overlap_comm and keeps stage 3's parameters whole;
    the "before" config has DeepSpeed's timer, overlap_comm on CUDA and bucket_sizes' threshold (10 x hidden)."""
    changes = [set(), {"overlap_comm"}, {"overlap_comm"}, {"overlap_comm", "stage3_param_persistence_threshold"}]
    for stage in range(4):
        ours = _config(stage)
        before = restore_deepspeed_defaults(ours, hidden_size=128, num_params=1_000_000, on_cuda=True)
        assert ours["timers"] == {"throughput": {"enabled": False}} and "timers" not in before
        zero, zero_before = ours["zero_optimization"], before["zero_optimization"]
        assert {key for key in zero_before if zero_before[key] != zero.get(key)} == changes[stage]
        if stage:
            assert zero["overlap_comm"] is False and zero_before["overlap_comm"] is True
        if stage == 3:
            assert (zero["stage3_param_persistence_threshold"], zero_before["stage3_param_persistence_threshold"]) \
                == (1_000_000, 1280)
        assert {key: value for key, value in before.items() if key not in ("timers", "zero_optimization")} \
            == {key: value for key, value in ours.items() if key not in ("timers", "zero_optimization")}


@pytest.mark.slow
def test_perf_dry_run_plans_under_nine_minutes_and_prints_each_command(tmp_path):
    """From a bare machine: install from the carry folder, the four 125M drivers at micro-batch 8, the two benches,
    355M Z1 with MICRO_BATCH unset without and with --compile (a folder of its own), the summary and the page."""
    carry = tmp_path / "carry"
    (carry / "wheelhouse").mkdir(parents=True)
    data_folder(carry / "data")
    python = without_packages(tmp_path / "py")
    runs = tmp_path / "runs"
    result = suite("--perf", "--dry-run", SUITE_RUNS=runs, GPU_CARRY=carry, PYTHON=python, MICRO_BATCH=16)
    assert result.returncode == 0, result.stderr
    plan = plan_rows(result)
    assert list(plan) == ["install", "DP", "Z1", "Z2", "Z3", "syncs", "bench", "355M", "355M_compile", "report", "in"]
    minutes = sum(float(value) for name, value in plan.items() if name != "in")
    assert float(plan["in"]) == pytest.approx(minutes) and minutes < 9
    assert "[gpu_suite]   8.8    in all (at most 9)" in result.stdout

    steps = commands(result)
    venv_python = REPO_ROOT / ".venv" / "bin" / "python"
    assert steps[0] == f"rm -rf {runs}"
    assert steps[1] == f"env WHEELHOUSE={carry}/wheelhouse SETUP_EXTRAS= PYTHON={python} bash scripts/setup.sh"
    drivers = re.findall(r"^env RUNS_DIR=\S+ MODEL_SIZE=125M SEQ_LEN=1024 PRECISION=bf16 MICRO_BATCH=16 NGPUS=1 "
                         r"TRAIN_ITERS=20 LOG_INTERVAL=5 EVAL_INTERVAL=20 EVAL_ITERS=2 DATA_DIR=\S+ PYTHON=\S+ "
                         r"bash examples_zero/gpt_deepspeed_(\w+)\.sh --save ''$", "\n".join(steps[2:6]), re.M)
    assert drivers == ["DP", "Z1", "Z2", "Z3"]  # MICRO_BATCH from outside sets 125M's (default 8), not 355M's
    shape = ("--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 --micro-batch-size 16 "
             "--gradient-accumulation 1 --bf16")
    assert steps[6].endswith(f"bench/bench_syncs.py {shape} --json {runs}/bench_syncs.json")
    assert steps[7].endswith(f"bench/bench_gpt_vs_hf.py {shape} --json {runs}/bench_gpt_vs_hf.json")
    z1_355m = (f"env -u MICRO_BATCH RUNS_DIR={runs} MODEL_SIZE=355M SEQ_LEN=1024 PRECISION=bf16 NGPUS=1 TRAIN_ITERS=20 "
               f"LOG_INTERVAL=5 EVAL_INTERVAL=20 EVAL_ITERS=2 DATA_DIR={carry}/data PYTHON={venv_python}")
    assert steps[8] == f"{z1_355m} bash examples_zero/gpt_deepspeed_Z1.sh --save ''"
    assert steps[9] == (f"{z1_355m} RUN_NAME=gpt_355M_Z1_compile bash examples_zero/gpt_deepspeed_Z1.sh --save '' "
                        "--compile")
    assert steps[10] == f"{venv_python} analysis/summarize.py {runs}"
    assert re.match(rf"{venv_python} bench/gpu_perf_report\.py --runs {runs} --out \S+/bench/results/"
                    rf"no-gpu-dry-run\.md --iters 20 --log-interval 5 --micro-batch 16 --baseline "
                    rf"{REPO_ROOT}/bench/results/nvidia-h100-80gb-hbm3-summary\.json --plan ", steps[11])
    assert len(steps) == 12 and not runs.exists()

    for args, message in ((["--perf", "--quick"], "--quick and --perf are two profiles: choose one"),
                          (["--perf", "--only", "125M"], "--quick and --perf run their own parts: leave out --only")):
        refused = suite(*args, "--dry-run")
        assert refused.returncode == 1 and message in refused.stderr


def perf_runs(folder: Path) -> Path:
    """A --perf runs folder from real logs of tiny CPU driver runs (tests/fixtures/logs/ours), named as the suite
    names its runs, summarized by analysis/summarize.py; the benches' JSON as they write it (CPU figures)."""
    for fixture, run in (("gpt_tiny_Z1", "gpt_125M_Z1"), ("gpt_tiny_Z3", "gpt_125M_Z3"),
                         ("gpt_tiny_Z3", "gpt_355M_Z1")):
        shutil.copytree(FIXTURE_RUNS / fixture, folder / run)
    summarized = subprocess.run([sys.executable, str(REPO_ROOT / "analysis" / "summarize.py"), str(folder)],
                                env=test_env(), capture_output=True, text=True, timeout=300)
    assert summarized.returncode == 0, summarized.stderr
    # bench_syncs.py's counts measured on one CPU rank (L=2 h=128 s=128, bf16), its step times rounded
    rows = [(0, "before", 2000.0, 37.0), (0, "after", 2000.0, 1.0), (1, "before", 2000.0, 6.0),
            (1, "after", 1000.0, 2.0), (2, "before", 2000.0, 8.0), (2, "after", 1000.0, 2.0)]
    (folder / "bench_syncs.json").write_text(json.dumps({"device": "cpu", "shape": "L=2 h=128 s=128", "rows": [
        {"stage": stage, "side": side, "ms_per_step": ms, "tokens_per_s": 1024 / (ms / 1000), "host_reads": reads,
         "host_reads_by_kind": {"item": reads}} for stage, side, ms, reads in rows]}))
    (folder / "bench_gpt_vs_hf.json").write_text(json.dumps([
        {"stage": stage, "ours_tokens_per_s": 1000.0 * ratio, "hf_tokens_per_s": 1000.0, "ratio": ratio,
         "ours_tflops_per_rank": 0.1, "ours_mfu": None, "attention_kernels": [], "loss_peak_mib": None}
        for stage, ratio in ((0, 1.31), (1, 1.29), (2, 1.5), (3, 1.3))]))
    (folder / "steps.tsv").write_text("DP\t40\nsyncs\t70\n")
    return folder


@pytest.mark.slow
def test_perf_page_puts_each_figure_beside_its_target(tmp_path):
    runs = perf_runs(tmp_path / "runs")
    summary = {run["run"]: run for run in json.loads((runs / "summary.json").read_text())["runs"]}
    z1, z3 = summary["gpt_125M_Z1"], summary["gpt_125M_Z3"]
    out = tmp_path / "results" / "some-gpu.md"
    result = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "gpu_perf_report.py"), "--runs", str(runs),
                             "--out", str(out), "--iters", "20", "--log-interval", "5", "--micro-batch", "8",
                             "--baseline", str(REPO_ROOT / "bench" / "results" / "nvidia-h100-80gb-hbm3-summary.json"),
                             "--plan", "DP\t0.7\tDP driver", "syncs\t1.2\tthe syncs", "355M\t0.9\t355M driver",
                             "--failed", "skipped, PERF_BUDGET spent: bash examples_zero/gpt_deepspeed_Z1.sh"],
                            env=test_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    text = out.read_text()
    share = z3["tokens_per_s"] / z1["tokens_per_s"]
    assert (f"| 125M Z3 tokens/s within 20% of Z1's | {z3['tokens_per_s']:,.0f} / {z1['tokens_per_s']:,.0f} tokens/s "
            f"= {share:.2f} | >= 0.80 | {'met' if share >= 0.8 else 'not met'} |") in text
    assert "| 125M DP tokens/s within 10% of Z1's | no figure | >= 0.90 | not met |" in text  # DP did not run
    z355 = summary["gpt_355M_Z1"]
    assert (f"| GPT-2 355M Z1, seq 1024, bf16: MFU | {z355['mfu_mean_pct']:.1f}% (micro-batch {z355['micro_batch']}) "
            "| >= 45% (goal 50%) | not met |") in text
    assert "| GPT-2 355M Z1 --compile, seq 1024, bf16: MFU | no figure | >= 45% (goal 50%) | not met |" in text
    hf = [line for line in text.splitlines() if line.startswith("| ours / Hugging Face GPT-2 tokens/s, ZeRO ")]
    assert [line.rsplit("|", 2)[1].strip() for line in hf] == ["met", "not met", "met", "met"]
    measured, predicted = z3["ms_per_iter_mean"], z3["time_total_predicted_ms"]
    error = abs(predicted - measured) / measured
    assert (f"| 125M Z3: step time predicted / measured | {predicted:.1f} / {measured:.1f} ms: {100 * error:.0f}% off "
            f"| within 15% | {'met' if error <= 0.15 else 'not met'} |") in text
    assert "| 125M ZeRO 1: host reads per step (bench_syncs.py) | 2.0 | <= 2 | met |" in text
    assert "| 125M ZeRO 3: host reads per step (bench_syncs.py) | no figure | <= 2 | not met |" in text
    baseline_z1 = 195_040  # the first H100 run's Z1 driver (bench/results/nvidia-h100-80gb-hbm3.md)
    assert (f"| 1 | 512 | 1,024 | 2.00x | 6.0 -> 2.0 | n/a -> n/a | n/a -> n/a | {z1['tokens_per_s']:,.0f} | "
            f"{baseline_z1:,} |") in text
    assert f"| 355M Z1 | {z355['micro_batch']} | {z355['tokens_per_s']:,.0f} |" in text
    assert "| 0 | 1310 | 1000 | 1.31x |" in text  # the HF bench's own table
    assert "| DP | 0.7 | 0.7 | DP driver |" in text and "| 355M | 0.9 | n/a | 355M driver |" in text
    assert "- `skipped, PERF_BUDGET spent: bash examples_zero/gpt_deepspeed_Z1.sh`" in text
    met = len(re.findall(r"\| met \|$", text, re.M))
    assert f"{met} of 19 targets met." in text
    assert (out.parent / "some-gpu-perf-summary.json").is_file() and not (out.parent / "some-gpu-summary.json").exists()


@pytest.mark.slow
def test_bench_syncs_counts_fewer_host_reads_after_than_before_on_a_cpu_rank(tmp_path):
    """DeepSpeed's defaults at ZeRO 1 in bf16: its throughput timer synchronizes at the start and end of every
    forward and step (4), on top of the 2 reads BF16_Optimizer's step keeps (tests/test_host_syncs.py)."""
    out = tmp_path / "syncs.json"
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port",
                             "29537", str(REPO_ROOT / "bench" / "bench_syncs.py"), "--bf16", "--stages", "1",
                             "--warmup", "1", "--steps", "1", "--count-steps", "2", "--json", str(out)],
                            cwd=REPO_ROOT, env=test_env(OMP_NUM_THREADS=1), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {row["side"]: row for row in json.loads(out.read_text())["rows"]}
    assert rows["after"]["host_reads"] == 2.0
    assert rows["before"]["host_reads"] == 6.0
    assert rows["before"]["host_reads_by_kind"] == {"synchronize": 4.0, "__bool__": 2.0}
    assert "cuda_syncs" not in rows["after"]  # no profiler counts off CUDA
