"""What several benches share; each bench imports this file and nothing from another bench.

A bench runs as a script (`python bench/NAME.py`, or under torchrun), its folder first on sys.path: it imports this
file as `common`, and megatron, analysis and tools as the packages scripts/setup.sh installs. DeepSpeed (which the
training functions need) is imported where they run, so that the benches that only read logs or write reports
start without it.

- a bench's start and end: the machine it ran on, other work on it, SIGTERM, the last line and the --json record;
- the dolly sample as bytes and a torchrun ended (the benches that run pretrain_gpt.py: long sequences, MoE);
- training in this process through setup_engine and train_step (the ranks, each ZeRO stage's Args, random batches,
  timed steps, the host reads counted): bench_gpt_vs_hf, bench_comm_counting, bench_checkpoint_manifest, bench_syncs;
- the GPU suite's report lines: the machine, the versions, bench_gpt_vs_hf's table, the steps' times.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from importlib import metadata
from pathlib import Path

import numpy as np
import psutil
import torch
import torch.nn.functional as F

from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder
from megatron.initialize import DistInfo, initialize_distributed, silence_known_warnings

REPO = Path(__file__).resolve().parent.parent


# ---- a bench's start and end ----

class BenchError(Exception):
    """A run that gave nothing to compare; the message says why."""


class Stopped(Exception):
    """SIGTERM: the runs and the virtual cluster are taken down on the way out (finally clauses)."""


def stop_on_sigterm() -> None:
    def stop(signum, frame):
        raise Stopped(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, stop)


def exit_with(main) -> None:
    """sys.exit(main(sys.argv[1:])) for a bench that calls stop_on_sigterm(): a SIGTERM ends it in one line, once the
    finally clauses on the way out have ended the running torchrun."""
    try:
        sys.exit(main(sys.argv[1:]))
    except Stopped as stopped:
        sys.exit(f"[bench] {stopped}: the running torchrun and its ranks were ended")


def end_of_bench(started: float, start: dict, json_path: str | None, **record) -> None:
    """A bench's last line (the load average at the end and its wall time) and, with --json, its record: the machine
    at the start (machine()) and at the end, and `record`."""
    load_end = round(os.getloadavg()[0], 2)
    print(f"load average at the end: {load_end}; bench wall time {time.monotonic() - started:.0f} s")
    if json_path:
        record = dict(machine={**start, "load_average_end": load_end}, **record)
        Path(json_path).write_text(json.dumps(record, indent=2) + "\n")


def machine() -> dict:
    import deepspeed

    return dict(cpus=os.cpu_count(), load_average=round(os.getloadavg()[0], 2), torch=torch.__version__,
                deepspeed=deepspeed.__version__, commit=commit(), date=time.strftime("%Y-%m-%d %H:%M"))


def commit() -> str:
    """HEAD's short hash, and which tracked files differ from it (a shared checkout may hold others' edits)."""
    def git(*args):
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown (not a git checkout)"
    changed = git("diff", "--name-only", "HEAD")
    return head if not changed else f"{head} with uncommitted changes to {', '.join(changed.splitlines())}"


def busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (/proc/stat: user, nice, system, irq, softirq;
    not idle, iowait or the hypervisor's steal)."""
    with open("/proc/stat") as stat:
        user, nice, system, _idle, _iowait, irq, softirq = map(int, stat.readline().split()[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def own_seconds() -> float:
    """CPU seconds of this process and of every descendant that has ended (each waited for by its parent)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


class OtherWork:
    """Cores the machine spent on anything but this bench and its runs between start() and cores()."""

    def start(self) -> "OtherWork":
        self.wall, self.busy, self.own = time.monotonic(), busy_seconds(), own_seconds()
        return self

    def cores(self) -> float:
        wall = time.monotonic() - self.wall
        return max(0.0, (busy_seconds() - self.busy) - (own_seconds() - self.own)) / wall


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---- pretrain_gpt.py runs on the dolly sample as bytes ----

BYTE_VOCAB = 256  # bytes; NullTokenizer adds the end-of-document id (257), padded to 384
BYTE_PADDED_VOCAB = 384


def byte_data(folder: Path) -> Path:
    """The committed dolly sample as UTF-8 bytes, one id per byte, through tools/preprocess_data.py."""
    folder.mkdir(parents=True, exist_ok=True)
    corpus = folder / "dolly_bytes.jsonl"
    with open(REPO / "data" / "samples" / "dolly-sample.jsonl") as source, open(corpus, "w") as out:
        for line in source:
            record = json.loads(line)
            text = "\n".join(value for value in record.values() if isinstance(value, str) and value)
            out.write(json.dumps({"text": " ".join(str(byte) for byte in text.encode())}) + "\n")
    done = subprocess.run([sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input", str(corpus),
                           "--output-prefix", str(folder / "dolly_bytes"), "--tokenizer-type", "NullTokenizer",
                           "--vocab-size", str(BYTE_VOCAB), "--append-eod"], capture_output=True, text=True,
                          timeout=300)
    if done.returncode != 0:
        raise SystemExit(f"error: tools/preprocess_data.py failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return folder / "dolly_bytes_text_document"


def end(process: subprocess.Popen) -> None:
    """torchrun passes SIGTERM on to its ranks (each in a session of its own, out of reach of a killpg) and waits
    for them; SIGKILL to its group only if that takes over 30 s."""
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


# ---- training in this process ----

VOCAB = 50257  # GPT-2's vocabulary: the random batches' ids are below it


class HFAdapter(torch.nn.Module):
    """GPT2LMHeadModel behind our model's call: (input_ids, position_ids, labels) -> per-token loss."""

    def __init__(self, config):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel
        hf_config = GPT2Config(vocab_size=config.padded_vocab_size, n_positions=config.max_position_embeddings,
                               n_embd=config.hidden_size, n_layer=config.num_layers, n_head=config.num_attention_heads,
                               n_inner=config.ffn_hidden_size, resid_pdrop=config.hidden_dropout,
                               embd_pdrop=config.hidden_dropout, attn_pdrop=config.attention_dropout,
                               layer_norm_epsilon=config.layernorm_epsilon, initializer_range=config.init_method_std)
        hf_config._attn_implementation = "sdpa"
        self.model = GPT2LMHeadModel(hf_config).to(config.params_dtype)

    def forward(self, input_ids, position_ids, labels):
        logits = self.model(input_ids=input_ids, position_ids=position_ids).logits
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)


def training_bench_parser(description: str, stages: str, steps: int, steps_help: str) -> argparse.ArgumentParser:
    """The options of the benches that train through setup_engine and train_step (bench_gpt_vs_hf.py,
    bench_comm_counting.py, bench_checkpoint_manifest.py, bench_syncs.py): model shape, batch, ZeRO stages, warm-up
    and timed steps, dtype, output."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--gradient-accumulation", type=int, default=2,
                        help="micro-batches per step (global batch = micro x ranks x this)")
    parser.add_argument("--stages", default=stages)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=steps, help=steps_help)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--json", default=None, help="also write the results here (rank 0)")
    parser.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher")
    return parser


def toy_dataset(folder: Path) -> str:
    """prepare_run checks --data-path exists; the bench feeds random batches instead of reading it."""
    prefix = str(folder / "bench_text_document")
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", np.uint16)
    builder.add_item(np.arange(4096) % VOCAB)
    builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def random_batches(opts, device_seed: int):
    generator = torch.Generator().manual_seed(device_seed)
    while True:
        yield {"text": torch.randint(0, VOCAB, (opts.micro_batch_size, opts.seq_length + 1), generator=generator)}


def timed_steps(engine, batches, args, opts, dist_info: DistInfo) -> list[float]:
    """Seconds of each of opts.steps training steps after opts.warmup, the device synchronized around each."""
    from megatron.training import train_step

    seconds = []
    for step in range(opts.warmup + opts.steps):
        synchronize(dist_info)
        start = time.perf_counter()
        train_step(engine, batches, args, dist_info, eod=VOCAB - 1)
        synchronize(dist_info)
        if step >= opts.warmup:
            seconds.append(time.perf_counter() - start)
    return seconds


def synchronize(dist_info: DistInfo) -> None:
    if dist_info.on_cuda:
        torch.cuda.synchronize()
    torch.distributed.barrier()


def flags(opts, stage: str, prefix: str, world_size: int) -> list[str]:
    return ["--num-layers", str(opts.num_layers), "--hidden-size", str(opts.hidden_size),
            "--num-attention-heads", str(opts.num_attention_heads), "--seq-length", str(opts.seq_length),
            "--micro-batch-size", str(opts.micro_batch_size),
            "--global-batch-size", str(opts.micro_batch_size * world_size * opts.gradient_accumulation),
            "--train-iters", str(opts.warmup + opts.steps),
            "--zero-stage", stage, "--data-path", prefix, "--tokenizer-type", "NullTokenizer",
            "--vocab-size", str(VOCAB), "--lr", "1e-4", *(["--bf16"] if opts.bf16 else []),
            *(["--compile"] if opts.compile else [])]


def start_ranks() -> DistInfo:
    """This process's rank of a data-parallel bench, started as pretrain_gpt.py starts one."""
    from megatron.core.parallel_state import ParallelLayout, ParallelState

    silence_known_warnings()  # as pretrain_gpt.py: torch 2.13 deprecates the collectives DeepSpeed calls
    dist_info = initialize_distributed(timeout_minutes=10.0)
    return replace(dist_info, parallel=ParallelState.build(ParallelLayout(dist_info.world_size)))


def stage_args(opts, stage: str, prefix: str, dist_info: DistInfo, *more_flags: str):
    """The run's Args at one ZeRO stage (flags() and `more_flags`), prepared as pretrain_gpt.py prepares them."""
    from deepspeed.accelerator import get_accelerator

    from megatron.arguments import parse_args
    from megatron.startup import prepare_run

    args, _ = prepare_run(parse_args([*flags(opts, stage, prefix, dist_info.world_size), *more_flags],
                                     dist_info.world_size, get_accelerator().device_name()), verbose=False)
    return args


# The host reads a step can make: each waits for the device to finish the work queued before it
HOST_READS = (("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy"), ("synchronize",))


@contextlib.contextmanager
def counting_host_reads(counts: dict, roots: tuple[str, ...], names: tuple = HOST_READS):
    """Count, in counts[(method, file, line)], the host reads made by code in files under `roots`: the torch.Tensor
    methods names[0] (a .cpu()/.numpy() of a tensor already on the host is counted too: on CPU ranks every tensor
    is) and the accelerator's methods names[1] (its synchronize). The methods are wrapped, not replaced: the
    engine runs as it would."""
    from deepspeed.accelerator import get_accelerator

    owners = [(torch.Tensor, name) for name in names[0]] + [(type(get_accelerator()), name) for name in names[1]]
    originals = [(owner, name, owner.__dict__[name] if name in owner.__dict__ else None) for owner, name in owners]

    def wrap(name, original):
        def read(*args, **kwargs):
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(roots):
                key = (name, caller.f_code.co_filename, caller.f_lineno)
                counts[key] = counts.get(key, 0) + 1
            return original(*args, **kwargs)
        return read
    for owner, name in owners:
        setattr(owner, name, wrap(name, getattr(owner, name)))
    try:
        yield
    finally:
        for owner, name, original in originals:
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


# ---- the GPU suite's report lines ----

def machine_lines() -> list[str]:
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        memory = torch.cuda.get_device_properties(0).total_memory / 2**30
        gpus = f"{len(names)} x {names[0]} ({memory:.0f} GiB)"
    else:
        gpus = "none visible to torch"
    driver = "n/a"
    if shutil.which("nvidia-smi"):
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True).stdout.split("\n")[0]
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return [f"- GPUs: {gpus}, driver {driver or 'n/a'}",
            f"- CPU: {os.cpu_count()} x {cpu}, {psutil.virtual_memory().total / 2**30:.0f} GiB memory",
            f"- {platform.platform()}"]


def version_lines() -> list[str]:
    def version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip() or "unknown"
    changed = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=normal"],
                             capture_output=True, text=True).stdout.strip()
    if changed:  # what ran is not that commit alone
        head += f" with {len(changed.splitlines())} changed or new files not committed"
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return [f"- Python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}, "
            f"cuDNN {cudnn}), deepspeed {version('deepspeed')}, transformers {version('transformers')}",
            f"- zero-lab commit {head}"]


def bench_lines(path: Path) -> list[str]:
    if not path.is_file():
        return [f"(no {path.name}: the bench did not finish)"]
    rows = json.loads(path.read_text())
    lines = ["| ZeRO stage | ours tokens/s | HF tokens/s | ours/HF | ours TFLOPs/GPU | ours MFU |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        mfu = "n/a" if row["ours_mfu"] is None else f"{100 * row['ours_mfu']:.1f}%"
        lines.append(f"| {row['stage']} | {row['ours_tokens_per_s']:.0f} | {row['hf_tokens_per_s']:.0f} | "
                     f"{row['ratio']:.2f}x | {row['ours_tflops_per_rank']:.1f} | {mfu} |")
    first = rows[0]
    lines.append("")
    lines.append(f"Attention: SDPA ran {', '.join(first['attention_kernels']) or 'no SDPA kernel'}.")
    if first["loss_peak_mib"]:
        lines.append("Output layer + loss, one micro-batch forward + backward, peak allocator memory: " +
                     ", ".join(f"{name} {mib:.0f} MiB" for name, mib in first["loss_peak_mib"].items()) + ".")
    return lines


def step_lines(plan: list[str], steps_file: Path) -> list[str]:
    """The quick profile's plan beside what each step took (steps.tsv, written as each step ended)."""
    took = {}
    if steps_file.is_file():
        for line in steps_file.read_text().splitlines():
            name, seconds = line.split("\t")
            took[name] = int(seconds)
    lines = ["| step | expected min | took min | what |", "| --- | ---: | ---: | --- |"]
    planned_total = 0.0
    for row in plan:
        name, minutes, what = row.split("\t")
        planned_total += 0.0 if minutes == "-" else float(minutes)
        spent = f"{took[name] / 60:.1f}" if name in took else "n/a"
        lines.append(f"| {name} | {minutes} | {spent} | {what} |")
    measured = sum(seconds for name, seconds in took.items() if name != "op_build")  # it ran beside the drivers
    lines.append(f"| in all | {planned_total:.1f} | {measured / 60:.1f} | the steps in line (the report's own "
                 f"last seconds not counted) |")
    return lines
