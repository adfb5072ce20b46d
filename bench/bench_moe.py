"""The mixture-of-experts trade-off on dolly (docs/moe-reference.md): a tiny dense GPT against MoE models of the same active
FLOPs per token, trained on the same tokens on 2 CPU ranks, each row's figures measured beside what
megatron/accounting/predict/ predicts.

Every run: pretrain_gpt.py on 2 CPU ranks (torchrun, gloo), ZeRO-1, fp32, the tiny preset's shape (2 layers,
hidden 128, 4 heads) with rotary positions, dropout off, sequences of 256, micro-batch 4, global batch 8 (DP=2,
no accumulation), the same learning-rate schedule (2e-3, warmed up over the first 20% of the iterations, then
cosine decay) and iterations, on the committed dolly sample as UTF-8 bytes
(NullTokenizer --vocab-size 256, padded to 384; common.byte_data). Bytes, not GPT-2's 50k
vocabulary: with GPT-2's the tiny model's output layer holds 6.4M of its 7M parameters and most of its FLOPs, so
the MLPs that MoE changes would hardly show in the loss. Split 90/10: the validation loss is the evaluation at the
last iteration on the held-out 10% (EVAL_ITERS batches of 8 sequences).

MoE rows put experts in both layers (--expert-interval 1) at --moe-expert-parallel-size 2, with the MoE flags'
defaults (capacity factor 1, minimum capacity 4, token dropping on, --moe-loss-coeff 0.1); the -nodrop rows turn
token dropping off. What is held equal is the active FLOPs per token: a top-1 row's experts are the dense MLP at
its full width (512), a top-2 row's at half (256), so each token goes through 512 MLP columns per layer in every
row; the gate (h -> experts) adds 2 h E FLOPs per token and layer forward (0.2-0.4% of the step here), which the
FLOPs column shows. The closing line compares the validation losses, and a repeat of the dense row with another
seed (which changes the weights and the data order) gives the run-to-run spread the difference is judged against.

    python bench/bench_moe.py --json moe_cpu.json     # 6 runs, about 10 minutes on 2 loaded cores
    python bench/bench_moe.py --quick                 # dense and 4 experts top-2, 10 iterations: a smoke test
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from analysis.log_parser import parse_log
from common import (BYTE_PADDED_VOCAB, BYTE_VOCAB, REPO, BenchError, byte_data, end, end_of_bench, exit_with,
                    free_port, machine, stop_on_sigterm)
from megatron import accounting
from megatron.model.config import GPTConfig
from megatron.model.presets import MODEL_PRESETS

MiB = 2**20
GB = 2**30  # the log lines' GB
SHAPE = MODEL_PRESETS["tiny"]
RANKS, EP, SEQ, MICRO, GLOBAL = 2, 2, 256, 4, 8
DENSE_FFN = 4 * SHAPE["hidden_size"]
EVAL_ITERS = 8
SEEDS = (1234, 4321)
# Warm-up: at the full rate from step 1, Adam's first steps fill the residual stream with one vector every token
# shares (the post-attention LayerNorm's outputs 0.99 cosine to their mean by iteration 3, dense or MoE), so each
# gate sends every token to one expert, capacity drops 70% of them, and the MoE rows sat at the unigram loss (3.2)
# for 150-250 iterations. A warm-up over the first 20% keeps the routing spread (10% still let the 8-expert top-1
# row collapse for its first 150 iterations; docs/moe.md).
LR, WARMUP_FRACTION = 2e-3, 0.2
# The comm line prints MB per iteration to 3 decimals: without token dropping its predicted side averages the
# interval's capacities, and the two sides may round apart by the last digit (seen once in 10 intervals).
TRAFFIC_DIGIT = 0.0011


@dataclass(frozen=True)
class Variant:
    """One row's model: experts per layer (1: dense), experts per token, each expert's FFN width, the seed."""
    experts: int
    topk: int
    seed: int = SEEDS[0]
    dropping: bool = True  # token dropping by capacity (Megatron-DeepSpeed's examples); off: every token routed

    @property
    def ffn(self) -> int:
        return DENSE_FFN // self.topk  # top-k experts of width f/k: the dense MLP's FLOPs per token

    @property
    def name(self) -> str:
        model = "dense" if self.experts == 1 else f"{self.experts} experts top-{self.topk}"
        model += "" if self.dropping else ", no token dropping"
        return model if self.seed == SEEDS[0] else f"{model}, seed {self.seed}"

    def flags(self) -> list[str]:
        flags = ["--ffn-hidden-size", str(self.ffn), "--seed", str(self.seed)]
        if self.experts > 1:
            flags += ["--num-experts", str(self.experts), "--expert-interval", "1", "--topk", str(self.topk),
                      "--moe-expert-parallel-size", str(EP)]
        return flags + ([] if self.dropping else ["--disable-moe-token-dropping"])

    def config(self) -> GPTConfig:
        return GPTConfig(**SHAPE, seq_length=SEQ, max_position_embeddings=SEQ, padded_vocab_size=BYTE_PADDED_VOCAB,
                         ffn_hidden_size=self.ffn, hidden_dropout=0.0, attention_dropout=0.0,
                         use_rotary_position_embeddings=True, num_experts=[self.experts], expert_interval=1,
                         topk=self.topk, moe_expert_parallel_size=EP if self.experts > 1 else 1,
                         moe_token_dropping=self.dropping)


ROWS = {"dense": Variant(1, 1), "dense-seed2": Variant(1, 1, SEEDS[1]), "e4k1": Variant(4, 1),
        "e4k2": Variant(4, 2), "e8k1": Variant(8, 1), "e8k2": Variant(8, 2),
        "e4k1-nodrop": Variant(4, 1, dropping=False), "e8k1-nodrop": Variant(8, 1, dropping=False)}
DEFAULT_ROWS = ("dense", "dense-seed2", "e4k1", "e4k2", "e8k1", "e8k2")
QUICK_ROWS = ("dense", "e4k2")


@dataclass
class Row:
    """One run: its loss after the same tokens, speed, memory and traffic, measured beside predicted."""
    name: str
    total_params: int
    active_params: int
    flops_per_token: float  # forward and backward, the accounting's active FLOPs (MoE: topk experts and the gate)
    tokens: int  # trained on
    lm_loss: float  # the last logging interval's mean
    validation_loss: float | None
    tokens_per_s: float  # per rank, mean of the steady intervals' tgs
    states_mb: float  # per rank: params + grads + optimizer states
    predicted_states_mb: float
    peak_mb: float  # per rank: the states + activations + other
    predicted_peak_mb: float
    all_to_all_mb: float  # per step and rank
    predicted_all_to_all_mb: float
    traffic_mb: float  # per step and rank, every collective
    predicted_traffic_mb: float
    traffic_exact: bool  # every interval's comm line: measured == predicted, to the line's last digit (1 kB)
    tokens_dropped: float | None
    expert_load: float | None
    dropping: bool = True  # without, the all-to-all's prediction before the run is a balanced gate's, its least


def command(data: Path, variant: Variant, iters: int, log_interval: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(RANKS),
            "--master_port", str(free_port()), str(REPO / "pretrain_gpt.py"),
            "--num-layers", str(SHAPE["num_layers"]), "--hidden-size", str(SHAPE["hidden_size"]),
            "--num-attention-heads", str(SHAPE["num_attention_heads"]), "--use-rotary-position-embeddings",
            "--seq-length", str(SEQ), "--micro-batch-size", str(MICRO), "--global-batch-size", str(GLOBAL),
            "--zero-stage", "1", "--train-iters", str(iters), "--log-interval", str(log_interval),
            "--eval-interval", str(iters), "--eval-iters", str(EVAL_ITERS), "--split", "90,10,0",
            "--lr", str(LR), "--lr-warmup-fraction", str(WARMUP_FRACTION), "--hidden-dropout", "0", "--attention-dropout", "0", "--data-path", str(data),
            "--tokenizer-type", "NullTokenizer", "--vocab-size", str(BYTE_VOCAB), *variant.flags()]


def run(data: Path, variant: Variant, opts, output: Path) -> Path:
    """pretrain_gpt.py on 2 CPU ranks; its output (rank 0 prints the log lines) goes to `output`."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1", ZERO_LAB_SKIP_PROBES="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(output, "w") as out:
        process = subprocess.Popen(command(data, variant, opts.iters, opts.log_interval), cwd=REPO, env=env,
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            process.wait(timeout=opts.timeout)
        except subprocess.TimeoutExpired:
            raise BenchError(f"still running after {opts.timeout:.0f} s (output: {output})")
        finally:
            if process.poll() is None:
                end(process)
    if process.returncode != 0:
        tail = output.read_text().strip().splitlines()[-1:] or ["no output"]
        raise BenchError(f"exit {process.returncode}: {tail[0]} (output: {output})")
    return output


def predicted_all_to_all_mb(variant: Variant) -> float:
    setup = accounting.TrainingSetup(world_size=RANKS, micro_batch_size=MICRO, expert_parallel_size=
                                     EP if variant.experts > 1 else 1, zero_stage=1, device="cpu")
    return accounting.moe_all_to_all_per_step(variant.config(), setup)["all_to_all"] / MiB


def summarize(path: Path, variant: Variant) -> Row:
    """The run's log lines (rank 0), the first logging interval (warm-up) left out of the speed."""
    log = parse_log(path)
    state, iterations, comm = log.model_state, log.iterations, log.comm
    if state is None or len(iterations) < 2 or not comm or iterations[-1].lm_loss is None:
        raise BenchError(f"no model-state line, comm line or fewer than 2 logging intervals in {path}")
    measured, estimate = state.measured, state.estimate
    states = sum(measured.get(name, 0.0) for name in ("params", "grads", "optim"))
    peak = states + measured.get("activations", 0.0) + measured.get("other", 0.0)
    config, last = variant.config(), comm[-1]
    validation = log.validations[-1].lm_loss if log.validations else None
    return Row(variant.name, accounting.count_parameters(config), accounting.active_parameters(config),
               accounting.model_flops_per_iteration(config, 1) / SEQ, iterations[-1].consumed_tokens or 0,
               iterations[-1].lm_loss, validation, statistics.fmean(i.tgs for i in iterations[1:]),
               states * GB / MiB, estimate["total"] * GB / MiB, peak * GB / MiB,
               (estimate["total"] + estimate["activations"] + estimate["output_buffer"]) * GB / MiB,
               last.by_kind_mb.get("all_to_all", 0.0), predicted_all_to_all_mb(variant), last.total_mb,
               last.predicted_mb, all(abs(c.total_mb - c.predicted_mb) <= TRAFFIC_DIGIT for c in comm), iterations[-1].tokens_dropped,
               iterations[-1].expert_load, variant.dropping)


# ---- printing ----

COLUMNS = ("model", "params total / active", "active FLOPs per token", "tokens", "train lm loss",
           "validation loss", "tokens/s per rank", "model states MiB per rank meas / pred",
           "peak MiB per rank meas / pred", "all-to-all MB per step meas / pred", "traffic MB per step meas / pred",
           "tokens dropped", "expert load max/mean")


def table(rows: list[Row], failures: list[str]) -> str:
    def maybe(value, spec):
        return "n/a" if value is None else format(value, spec)

    lines = ["| " + " | ".join(COLUMNS) + " |", "| --- |" + " ---: |" * (len(COLUMNS) - 1)]
    for r in rows:
        traffic = f"{r.traffic_mb:.3f} / {r.predicted_traffic_mb:.3f}" + ("" if r.traffic_exact else " (differs)")
        least = "" if r.dropping else " (least)"
        lines.append(f"| {r.name} | {r.total_params:,} / {r.active_params:,} | {r.flops_per_token / 1e6:.3f} M | "
                     f"{r.tokens:,} | {r.lm_loss:.4f} | {maybe(r.validation_loss, '.4f')} | {r.tokens_per_s:.0f} | "
                     f"{r.states_mb:.2f} / {r.predicted_states_mb:.2f} | {r.peak_mb:.1f} / {r.predicted_peak_mb:.1f} | "
                     f"{r.all_to_all_mb:.3f} / {r.predicted_all_to_all_mb:.3f}{least} | {traffic} | "
                     f"{maybe(r.tokens_dropped, '.3f')} | {maybe(r.expert_load, '.3f')} |")
    lines += [f"| failed: {why} |" + " |" * (len(COLUMNS) - 1) for why in failures]
    return "\n".join(lines)


def loss_of(row: Row) -> float:
    return row.validation_loss if row.validation_loss is not None else row.lm_loss


def verdict(rows: list[Row]) -> str:
    """Whether the best MoE row reached a lower loss than dense after the same tokens, by how much, against the
    dense rows' spread over seeds (the run-to-run noise)."""
    dense = [r for r in rows if r.name.startswith("dense")]
    moe = [r for r in rows if not r.name.startswith("dense")]
    if not dense or not moe:
        return "Verdict: no comparison (a dense and an MoE row are both needed)."
    kind = "validation" if all(r.validation_loss is not None for r in rows) else "train lm"
    base, best = dense[0], min(moe, key=loss_of)
    gain = loss_of(base) - loss_of(best)
    noise = max(loss_of(r) for r in dense) - min(loss_of(r) for r in dense) if len(dense) > 1 else None
    noise_text = "no repeated row to judge the noise" if noise is None else (
        f"the dense rows' spread over seeds is {noise:.4f}, so the difference is "
        + ("larger than the noise" if abs(gain) > noise else "within the noise"))
    direction = "lower" if gain > 0 else "higher"
    return (f"Verdict: at equal active FLOPs per token and after the same {base.tokens:,} tokens, the best MoE row "
            f"({best.name}) reached a {direction} {kind} loss than dense: {loss_of(best):.4f} against "
            f"{loss_of(base):.4f}, {abs(gain):.4f} ({100 * abs(gain) / loss_of(base):.1f}%) {direction}; "
            f"{noise_text}.")


# ---- the bench ----

def options(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", default=list(DEFAULT_ROWS),
                        help=f"which rows, of {' '.join(ROWS)} (default {' '.join(DEFAULT_ROWS)})")
    parser.add_argument("--iters", type=int, default=500, help="iterations per run (default 500)")
    parser.add_argument("--log-interval", type=int, default=50, help="iterations per logging interval (default 50)")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke test: rows {' '.join(QUICK_ROWS)}, 10 iterations, logging every 5")
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument("--runs-dir", help="keep the runs' outputs here (default: a temporary folder)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one run may take (default 600)")
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.rows, opts.iters, opts.log_interval = list(QUICK_ROWS), 10, 5
    unknown = [name for name in opts.rows if name not in ROWS]
    if unknown:
        refuse(f"--rows {unknown[0]}: expected one of {', '.join(ROWS)}")
    if opts.log_interval < 1 or opts.iters < 2 * opts.log_interval:
        refuse(f"--iters {opts.iters}: expected at least 2 logging intervals of --log-interval {opts.log_interval} "
               "(the first is warm-up)")
    return opts


def refuse(message: str):
    sys.exit(f"error: {message}")  # one line, exit status 1


def main(argv) -> int:
    opts = options(argv)
    stop_on_sigterm()  # the running torchrun is ended on the way out (run's finally)
    with tempfile.TemporaryDirectory(prefix="bench_moe.") as tmp:
        data = byte_data(Path(tmp) / "data")
        runs_dir = Path(opts.runs_dir or Path(tmp) / "runs").resolve()
        runs_dir.mkdir(parents=True, exist_ok=True)
        start, started = machine(), time.monotonic()
        print(f"machine: {start['cpus']} CPUs, load average {start['load_average']} at start; torch {start['torch']}, "
              f"deepspeed {start['deepspeed']}; commit {start['commit']}; {start['date']}\n", flush=True)
        rows, failures = [], []
        for name in opts.rows:
            variant, begun = ROWS[name], time.monotonic()
            try:
                rows.append(summarize(run(data, variant, opts, runs_dir / f"{name}.log"), variant))
            except BenchError as error:
                failures.append(f"{variant.name}: {error}")
            print(f"[bench] {variant.name}: {time.monotonic() - begun:.0f} s, load average "
                  f"{os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
        print(f"## {RANKS} CPU ranks, EP={EP}, ZeRO-1 fp32, tiny shape (2 layers, hidden 128) with rotary positions, "
              f"dolly bytes, sequences of {SEQ}, global batch {GLOBAL}, {opts.iters} iterations per run\n")
        print(table(rows, failures) + "\n")
        print(verdict(rows) + "\n")
        end_of_bench(started, start, opts.json, iters=opts.iters, failures=failures, rows=[asdict(r) for r in rows],
                     verdict=verdict(rows))
    return 1 if failures else 0


if __name__ == "__main__":
    exit_with(main)
