"""Long sequences under DeepSpeed-Ulysses on CPU ranks: the shape of ALCF's table (sequence length against
throughput and memory, per sequence-parallel size), measured beside what megatron/accounting/predict/ predicts.

A small model, on 4 CPU ranks (torchrun, ZeRO-1, fp32): the tiny preset's shape (2 layers, hidden 128, 4 heads)
with rotary positions, so that no position table grows with the sequence, and a byte-level vocabulary (the
committed dolly sample's UTF-8 bytes through NullTokenizer --vocab-size 256, padded to 384), so that the
activations, not the output layer's [tokens, vocab] buffer, grow with the sequence. Dropout is off, so CPU
attention runs SDPA's fused kernel, which keeps no s x s tensor (docs/long-sequences.md, "Memory").

For SP = 1, 2 and 4 the 4 ranks run DP = 4, 2 and 1: every layout partitions ZeRO's states over the same 4 ranks
(DeepSpeed's sequence-data-parallel group), so the model states per rank are equal and only the sequence split
differs. Tokens/s per rank (the iteration line's tgs: the step's tokens over ranks and seconds) is comparable
across the layouts: at SP=1 each rank trains whole sequences of its own samples, at SP=N 1/N of shared ones.

Per SP size the lengths run are 1024, 2048, ... while their predicted memory fits the cap, then the longest
length that fits the cap by prediction (a multiple of STEP tokens). Each run's own log lines give both sides:
  - tokens/s per rank: measured, the iteration lines' tgs; predicted, the step's tokens over the ranks and the
    time line's predicted total (start-up probes on: the time prediction needs them);
  - peak memory per rank: the model-state line (rank 0), measured params + grads + optim + activations +
    other, predicted total (model states) + activations + output_buffer, as memory_per_rank counts it.
The longest sequence is checked by running at it: "fits" when the measured peak is within the cap; the length
one STEP longer exceeds the cap by prediction (printed, not run).

    python bench/bench_long_sequences.py --json long_sequences.json         # about 10 minutes on 2 cores
    python bench/bench_long_sequences.py --sp-sizes 4 --ranks 4 --cap-mb 32  # one column
    python bench/bench_long_sequences.py --paper-only   # the planner against DeepSpeed-Ulysses' published figure
    python bench/bench_long_sequences.py --levers --iters 4  # SP=4 per lever combination (long_sequence_levers.py)
    python bench/bench_long_sequences.py --levers --layers 8 --iters 4  # the same at 8 layers
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from analysis.log_parser import parse_log
from common import (BYTE_PADDED_VOCAB, BYTE_VOCAB, REPO, BenchError, OtherWork, byte_data, end, end_of_bench,
                    exit_with, free_port, machine, stop_on_sigterm)
from megatron import accounting
from megatron.model.config import GPTConfig
from megatron.model.presets import MODEL_PRESETS

MiB = 2**20
GB = 2**30  # the log lines' GB
STEP = 128  # tokens: the longest-sequence search's step (divisible by every SP size run)
LOG_INTERVAL = 2
SHAPE = MODEL_PRESETS["tiny"]
# --tiled-logits-loss's tiles: ALST's default (tiles of about 1 GiB of fp32 logits) is one tile at this byte
# vocabulary, which would leave the output-layer buffer whole; 8 tiles cut it to an eighth
LOSS_TILES = 8


@dataclass(frozen=True)
class Levers:
    """The memory levers past Ulysses' N ranks (docs/long-sequences.md), as pretrain_gpt.py's flags."""
    name: str
    recompute: bool = False  # --checkpoint-activations
    tiled: bool = False  # --tiled-mlp-compute and --tiled-logits-loss (LOSS_TILES tiles)
    offload: bool = False  # --checkpoint-in-cpu (with recompute)

    def flags(self) -> list[str]:
        return ((["--checkpoint-activations"] if self.recompute else [])
                + (["--tiled-mlp-compute", "--tiled-logits-loss", "--tiled-logits-loss-shards", str(LOSS_TILES)]
                   if self.tiled else []) + (["--checkpoint-in-cpu"] if self.offload else []))


NO_LEVERS = Levers("none")
# in the order a user pulls them (--levers); tiling alone as a column too: it buys about what recomputation does
LEVER_COLUMNS = (NO_LEVERS, Levers("recompute", recompute=True), Levers("tiled MLP + loss", tiled=True),
                 Levers("recompute + tiled", recompute=True, tiled=True),
                 Levers("recompute + tiled + checkpoint-in-cpu", recompute=True, tiled=True, offload=True))


@dataclass
class Row:
    """One run: a sequence length at one SP size, measured beside predicted."""
    ranks: int
    sp: int
    seq_length: int
    longest: bool  # the longest length that fits the cap by prediction
    tokens_per_s: float  # per rank, mean of the steady intervals' tgs
    predicted_tokens_per_s: float
    step_ms: float
    predicted_step_ms: float
    peak_mb: float  # per rank, the model-state line's measured sum
    predicted_peak_mb: float
    activations_mb: float
    predicted_activations_mb: float
    intervals: int
    others_cores: float | None = None
    # the model-state line's step_peak (CPU ranks: the first micro-batch's peak beyond the model states) beside
    # its estimate, and the measured model states (params + grads + optim) it stands on
    step_peak_mb: float | None = None
    predicted_step_peak_mb: float | None = None
    model_states_mb: float = 0.0

    @property
    def dp(self) -> int:
        return self.ranks // self.sp

    @property
    def peak_error_pct(self) -> float:
        return 100.0 * (self.predicted_peak_mb - self.peak_mb) / self.peak_mb

    @property
    def time_error_pct(self) -> float:
        return 100.0 * (self.predicted_step_ms - self.step_ms) / self.step_ms


# ---- predictions before running ----

def model_config(seq_length: int, levers: Levers = NO_LEVERS, layers: int = SHAPE["num_layers"]) -> GPTConfig:
    """The tiny preset's shape at `layers` layers (--layers), byte vocabulary, rotary positions, dropout off."""
    return GPTConfig(**{**SHAPE, "num_layers": layers}, seq_length=seq_length, max_position_embeddings=seq_length,
                     padded_vocab_size=BYTE_PADDED_VOCAB, hidden_dropout=0.0, attention_dropout=0.0,
                     use_rotary_position_embeddings=True, tiled_mlp_compute=levers.tiled,
                     tiled_logits_loss=levers.tiled, tiled_logits_loss_shards=LOSS_TILES if levers.tiled else 0)


def training_setup(ranks: int, sp: int, levers: Levers = NO_LEVERS) -> accounting.TrainingSetup:
    return accounting.TrainingSetup(world_size=ranks, micro_batch_size=1, sequence_parallel_size=sp, zero_stage=1,
                                    precision="fp32", device="cpu", activation_recompute=levers.recompute,
                                    activation_offload=levers.offload)


def predicted_memory_mb(ranks: int, sp: int, seq_length: int, levers: Levers = NO_LEVERS,
                        layers: int = SHAPE["num_layers"]) -> dict[str, float]:
    memory = accounting.memory_per_rank(model_config(seq_length, levers, layers), training_setup(ranks, sp, levers))
    return {name: value / MiB for name, value in memory.items()}


def predicted_peak_mb(ranks: int, sp: int, seq_length: int, levers: Levers = NO_LEVERS,
                      layers: int = SHAPE["num_layers"]) -> float:
    """memory_per_rank's total: the accelerator's peak, the backward's recomputed layer and MLP tile included;
    --checkpoint-in-cpu's host tier is not in it."""
    return predicted_memory_mb(ranks, sp, seq_length, levers, layers)["total"]


def longest_fitting(ranks: int, sp: int, cap_mb: float, levers: Levers = NO_LEVERS,
                    layers: int = SHAPE["num_layers"]) -> int:
    """The longest multiple of STEP whose predicted peak per rank is within cap_mb (0: none); memory grows with
    the length, so a doubling search then a bisection."""
    def fits(steps: int) -> bool:
        return predicted_peak_mb(ranks, sp, steps * STEP, levers, layers) <= cap_mb

    if not fits(1):
        return 0
    high = 2
    while fits(high):
        high *= 2
    low = high // 2  # fits; high does not
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low * STEP


def lengths_to_run(longest: int) -> list[int]:
    """1024, 2048, ... up to the longest that fits, and that longest one."""
    lengths, length = [], 1024
    while length < longest:
        lengths.append(length)
        length *= 2
    return lengths + [longest] if longest else []


# ---- one run ----


def command(data: Path, ranks: int, sp: int, seq_length: int, iters: int, levers: Levers = NO_LEVERS,
            layers: int = SHAPE["num_layers"]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
            "--master_port", str(free_port()), str(REPO / "pretrain_gpt.py"),
            "--num-layers", str(layers), "--hidden-size", str(SHAPE["hidden_size"]),
            "--num-attention-heads", str(SHAPE["num_attention_heads"]), "--use-rotary-position-embeddings",
            "--seq-length", str(seq_length), "--micro-batch-size", "1", "--global-batch-size", str(ranks // sp),
            "--ds-sequence-parallel-size", str(sp), "--zero-stage", "1", "--train-iters", str(iters),
            "--log-interval", str(LOG_INTERVAL), "--eval-interval", str(iters + 1), "--eval-iters", "0",
            "--lr", "1e-3", "--hidden-dropout", "0", "--attention-dropout", "0", "--data-path", str(data),
            "--tokenizer-type", "NullTokenizer", "--vocab-size", str(BYTE_VOCAB)] + levers.flags()


def run(data: Path, ranks: int, sp: int, seq_length: int, iters: int, output: Path, timeout: float,
        levers: Levers = NO_LEVERS, layers: int = SHAPE["num_layers"]) -> Path:
    """pretrain_gpt.py on `ranks` CPU ranks; its output (rank 0 prints the log lines) goes to `output`."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("ZERO_LAB_SKIP_PROBES", None)  # the time prediction needs the probes
    with open(output, "w") as out:
        process = subprocess.Popen(command(data, ranks, sp, seq_length, iters, levers, layers), cwd=REPO, env=env,
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise BenchError(f"still running after {timeout:.0f} s (output: {output})")
        finally:
            if process.poll() is None:  # timed out, or the bench was stopped: end torchrun and its ranks
                end(process)
    if process.returncode != 0:
        tail = output.read_text().strip().splitlines()[-1:] or ["no output"]
        raise BenchError(f"exit {process.returncode}: {tail[0]} (output: {output})")
    return output


def summarize(path: Path, ranks: int, sp: int, seq_length: int, longest: bool) -> Row:
    """The run's log lines, the first logging interval (warm-up) left out."""
    log = parse_log(path)
    state, times, iterations = log.model_state, log.times[1:], log.iterations[1:]
    if state is None or not times or not iterations:
        raise BenchError(f"no model-state line or fewer than 2 logging intervals in {path}")
    measured, estimate = state.measured, state.estimate
    peak = sum(measured.get(name, 0.0) for name in ("params", "grads", "optim", "activations", "other"))
    predicted_peak = estimate["total"] + estimate["activations"] + estimate["output_buffer"]
    step_ms = statistics.fmean(t.measured_ms["total"] for t in times)
    predicted_ms = statistics.fmean(t.predicted_ms["total"] for t in times)
    tokens_per_rank_step = (ranks // sp) * seq_length / ranks
    step_peak = measured.get("step_peak")
    return Row(ranks, sp, seq_length, longest, statistics.fmean(i.tgs for i in iterations),
               tokens_per_rank_step / (predicted_ms / 1000), step_ms, predicted_ms, peak * GB / MiB,
               predicted_peak * GB / MiB, measured["activations"] * GB / MiB, estimate["activations"] * GB / MiB,
               len(times), step_peak_mb=None if step_peak is None else step_peak * GB / MiB,
               predicted_step_peak_mb=estimate.get("step_peak", 0.0) * GB / MiB,
               model_states_mb=sum(measured[name] for name in ("params", "grads", "optim")) * GB / MiB)


# ---- printing ----

def table(rows: list[Row], failures: list[str]) -> str:
    lines = ["| SP | DP | seq length | tokens/s per rank meas / pred | step ms meas / pred | time error "
             "| peak MiB per rank meas / pred | peak error | activations MiB meas / pred | others' CPU |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        others = "n/a" if r.others_cores is None else f"{r.others_cores:.2f} cores"
        lines.append(f"| {r.sp} | {r.dp} | "
                     f"{r.seq_length}{' (longest)' if r.longest else ''} | "
                     f"{r.tokens_per_s:.0f} / {r.predicted_tokens_per_s:.0f} | {r.step_ms:.0f} / "
                     f"{r.predicted_step_ms:.0f} | {r.time_error_pct:+.0f}% | {r.peak_mb:.1f} / "
                     f"{r.predicted_peak_mb:.1f} | {r.peak_error_pct:+.1f}% | {r.activations_mb:.1f} / "
                     f"{r.predicted_activations_mb:.1f} | {others} |")
    lines += [f"| failed: {why} |" + " |" * 9 for why in failures]
    return "\n".join(lines)


@dataclass
class Longest:
    """The longest sequence that fits the cap at one SP size: predicted, and checked by the run at it."""
    sp: int
    seq_length: int
    predicted_mb: float
    one_step_longer_mb: float  # predicted at seq_length + STEP: over the cap
    measured_mb: float | None  # the run at seq_length; None if it failed
    cap_mb: float

    @property
    def verdict(self) -> str:
        if self.measured_mb is None:
            return "not checked (the run failed)"
        if self.measured_mb <= self.cap_mb:
            return f"fits ({self.measured_mb:.1f} MiB measured)"
        return f"does not fit: {self.measured_mb:.1f} MiB measured, {self.measured_mb - self.cap_mb:.1f} over"


def longest_table(longest: list[Longest], cap_mb: float) -> str:
    lines = [f"| SP | longest sequence within {cap_mb:g} MiB per rank (predicted) | predicted MiB | "
             f"+{STEP} tokens predicted MiB | run at the longest |", "| ---: | ---: | ---: | ---: | --- |"]
    lines += [f"| {x.sp} | {x.seq_length} | {x.predicted_mb:.1f} | {x.one_step_longer_mb:.1f} | {x.verdict} |"
              for x in longest]
    return "\n".join(lines)


# ---- the planner against DeepSpeed-Ulysses' published throughput ----

# Jacobs et al. 2023 (arXiv 2309.14509) and its blog (microsoft/DeepSpeed blogs/deepspeed-ulysses/README.md) give
# their throughput per GPU and sequence lengths as bar charts (Figures 2-4): no value can be read exactly. The
# one figure in their text is a bound whose setup is not named: the A100 runs (up to 64 A100s of 40 GB) sustain
PUBLISHED_BOUND = 175.0  # "over 175 TFlops/GPU (over 54% of hardware peak)"
# Setups their text names: a 1.3B GPT at 32K tokens on 8 A100s with SP=4 (the convergence study, Figure 5);
# and the setup item 4 measured the planner at (1.3B, 64K tokens, SP=8). Their 1.2B GPT's shape (Figure 2) and
# their 30B runs' SP degree and micro-batch (Figure 3) are not given, so they cannot be planned.
PAPER_SETUPS = (("1.3B GPT, 32K tokens, SP=4, 8 x A100-40GB (the paper's convergence setup)", 32768, 4),
                ("1.3B GPT, 64K tokens, SP=8, 8 x A100-40GB", 65536, 8))


def planned_tflops(seq_length: int, sp: int, fused: bool) -> tuple[str, float]:
    """tools/zero_plan.py's pick (megatron/accounting/plan/) and its expected TFLOP/s per GPU; `fused`: with
    --use-flash-attn-v2, the memory-bound term of a fused kernel that writes no a s^2 scores, as zero-lab's SDPA runs
    on a GPU (by default the planner counts them: its calibration's published runs ran unfused attention)."""
    from megatron.accounting.plan import choose, parse_flags, plan, plan_request, remedies

    request = plan_request(parse_flags(
        ["--model-size", "1.3B", "--gpus", "8", "--gpu", "A100-40GB", "--seq-length", str(seq_length),
         "--ds-sequence-parallel-size", str(sp), "--use-rotary-position-embeddings"]
        + (["--use-flash-attn-v2"] if fused else [])))
    plans = plan(request)
    chosen, _ = choose(plans, remedies(plans, request))
    return chosen.option, chosen.tflops_per_gpu


def paper_check() -> tuple[str, list[dict]]:
    rows = []
    for name, seq_length, sp in PAPER_SETUPS:
        option, tflops = planned_tflops(seq_length, sp, fused=False)
        _, fused = planned_tflops(seq_length, sp, fused=True)
        rows.append(dict(setup=name, option=option, planned_tflops=tflops, planned_fused_tflops=fused,
                         published_bound_tflops=PUBLISHED_BOUND))
    lines = ["| setup | planner's pick | planned TFLOP/s per GPU | / published bound | with --use-flash-attn-v2 "
             "| / published bound |", "| --- | --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['setup']} | {r['option']} | {r['planned_tflops']:.0f} | {r['planned_tflops'] / PUBLISHED_BOUND:.2f} "
              f"| {r['planned_fused_tflops']:.0f} | {r['planned_fused_tflops'] / PUBLISHED_BOUND:.2f} |" for r in rows]
    text = ("## tools/zero_plan.py against DeepSpeed-Ulysses (Jacobs et al. 2023)\n\n"
            "No throughput figure of the paper can be read exactly: its sequence lengths and TFLOP/s per GPU are "
            "bar charts (Figures 2-4). Its text states one bound without naming the setup: A100 runs sustaining "
            f"over {PUBLISHED_BOUND:.0f} TFLOP/s per GPU (over 54% of peak). The ratios below are to that bound, "
            "not to a measurement of the same setup.\n\n" + "\n".join(lines) + "\n")
    return text, rows


# ---- the bench ----

def column(data: Path, runs_dir: Path, opts, sp: int) -> tuple[list[Row], list[str], Longest]:
    """Every length of one SP size, shortest first; a run that fails ends the column (longer ones would too)."""
    longest = longest_fitting(opts.ranks, sp, opts.cap_mb)
    rows, failures, measured_at_longest = [], [], None
    for length in lengths_to_run(longest):
        started, other = time.monotonic(), OtherWork().start()
        output = runs_dir / f"sp{sp}_seq{length}.log"
        try:
            run(data, opts.ranks, sp, length, opts.iters, output, opts.timeout)
            rows.append(summarize(output, opts.ranks, sp, length, length == longest))
        except BenchError as error:
            failures.append(f"SP={sp} seq {length}: {error}")
            print(f"[bench] SP={sp} seq {length}: failed: {error}", file=sys.stderr, flush=True)
            break
        rows[-1].others_cores = other.cores()
        measured_at_longest = rows[-1].peak_mb if length == longest else None
        print(f"[bench] SP={sp} seq {length}: {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return rows, failures, Longest(sp, longest, predicted_peak_mb(opts.ranks, sp, longest),
                                   predicted_peak_mb(opts.ranks, sp, longest + STEP), measured_at_longest,
                                   opts.cap_mb)


def report(rows: list[Row], failures: list[str], longest: list[Longest], opts) -> str:
    return "\n".join([
        f"## {opts.ranks} CPU ranks, ZeRO-1 fp32, tiny shape with rotary positions, byte vocabulary, micro-batch 1, "
        f"{opts.iters} iterations per run (the first of {opts.iters // LOG_INTERVAL} logging intervals left out)",
        "", table(rows, failures), "", longest_table(longest, opts.cap_mb), ""])


def options(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4, help="CPU ranks per run (default 4)")
    parser.add_argument("--sp-sizes", type=int, nargs="+", default=[1, 2, 4],
                        help="DeepSpeed-Ulysses sizes, each dividing --ranks and the 4 heads (default 1 2 4)")
    parser.add_argument("--cap-mb", type=float, default=64.0,
                        help="memory cap per rank in MiB, for the longest sequence (default 64)")
    parser.add_argument("--iters", type=int, default=6, help=f"iterations per run (default 6: {6 // LOG_INTERVAL} "
                                                             f"logging intervals of {LOG_INTERVAL})")
    parser.add_argument("--json", help="write the rows and the longest sequences to this file")
    parser.add_argument("--runs-dir", help="keep the runs' outputs here (default: a temporary folder)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one run may take (default 600)")
    parser.add_argument("--levers", nargs="*", choices=[x.name for x in LEVER_COLUMNS],
                        help="the lever columns at SP = --ranks: per lever combination the longest sequence that "
                             "fits --cap-mb by prediction, run at it (no names: every column, none included; "
                             "bench/long_sequence_levers.py)")
    parser.add_argument("--layers", type=int, default=SHAPE["num_layers"],
                        help=f"with --levers: the tiny shape at this many layers (default {SHAPE['num_layers']})")
    parser.add_argument("--paper-only", action="store_true",
                        help="print only tools/zero_plan.py against DeepSpeed-Ulysses' published throughput (no runs)")
    opts = parser.parse_args(argv)
    for sp in [opts.ranks] if opts.levers is not None else opts.sp_sizes:  # the lever columns run SP = --ranks
        if sp < 1 or opts.ranks % sp or SHAPE["num_attention_heads"] % sp or STEP % sp:
            flag = f"--levers at SP = --ranks {sp}" if opts.levers is not None else f"--sp-sizes {sp}"
            parser.error(f"{flag}: must divide --ranks {opts.ranks}, the model's "
                         f"{SHAPE['num_attention_heads']} heads and the {STEP}-token step")
    if opts.layers < 1 or (opts.levers is None and opts.layers != SHAPE["num_layers"]):
        parser.error(f"--layers {opts.layers}: expected a positive layer count, with --levers (the SP table runs the "
                     f"tiny shape's {SHAPE['num_layers']})")
    if opts.iters < 2 * LOG_INTERVAL:
        parser.error(f"--iters {opts.iters}: expected at least 2 logging intervals of {LOG_INTERVAL} (the first is "
                     "warm-up)")
    return opts


def start_runs(opts, tmp: str, header: str = "") -> tuple[Path, Path, dict, float]:
    """The byte data and the runs' folder under `tmp`, the machine at the start and its header line (`header` added
    to it), the start time: what the SP table's runs and the lever columns (long_sequence_levers.py) begin with."""
    data = byte_data(Path(tmp) / "data")
    runs_dir = Path(opts.runs_dir or Path(tmp) / "runs").resolve()
    runs_dir.mkdir(parents=True, exist_ok=True)
    start, started = machine(), time.monotonic()
    print(f"machine: {start['cpus']} CPUs, load average {start['load_average']} at start; torch {start['torch']}, "
          f"deepspeed {start['deepspeed']}; commit {start['commit']}; {start['date']}; cap {opts.cap_mb:g} MiB "
          f"per rank{header}\n", flush=True)
    return data, runs_dir, start, started


def main(argv) -> int:
    opts = options(argv)
    stop_on_sigterm()  # the running torchrun is ended on the way out (run's finally)
    if opts.paper_only:
        print(paper_check()[0])
        return 0
    if opts.levers is not None:
        from long_sequence_levers import lever_bench  # this bench's own second part: bench/long_sequence_levers.py
        return lever_bench(opts, sys.modules[__name__])
    with tempfile.TemporaryDirectory(prefix="bench_long_sequences.") as tmp:
        data, runs_dir, start, started = start_runs(opts, tmp)
        rows, failures, longest = [], [], []
        for sp in opts.sp_sizes:
            sp_rows, sp_failures, sp_longest = column(data, runs_dir, opts, sp)
            rows, failures, longest = rows + sp_rows, failures + sp_failures, longest + [sp_longest]
        print(report(rows, failures, longest, opts))
        paper, paper_rows = paper_check()
        print(paper)
        end_of_bench(started, start, opts.json, ranks=opts.ranks, cap_mb=opts.cap_mb, iters=opts.iters,
                     step_tokens=STEP, failures=failures,
                     rows=[{**asdict(r), "dp": r.dp, "peak_error_pct": r.peak_error_pct,
                            "time_error_pct": r.time_error_pct} for r in rows],
                     longest=[{**asdict(x), "verdict": x.verdict} for x in longest], paper=paper_rows)
    return 1 if failures else 0


if __name__ == "__main__":
    exit_with(main)
