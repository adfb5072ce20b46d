"""The exact log lines users and analysis/summarize.py grep (docs/log-lines.md)."""
import math
from dataclasses import dataclass
from datetime import datetime

GB = float(2**30)
MB = float(2**20)


@dataclass
class IterationStats:
    iteration: int
    train_iters: int
    consumed_samples: int
    consumed_tokens: int
    elapsed_ms: float
    learning_rate: float
    global_batch_size: int
    lm_loss: float
    loss_scale: float
    grad_norm: float | None
    skipped_iterations: int
    nan_iterations: int
    samples_per_second: float
    tokens_per_gpu_per_second: float
    tflops: float
    curriculum_seqlen: int | None = None  # --curriculum-learning-legacy: the last step's sequence length
    moe: "MoEStats | None" = None  # an MoE model's: the interval's routing


@dataclass
class MoEStats:
    """An interval's routing over the MoE layers and the data-parallel ranks (megatron/model/moe.py)."""
    loss: float  # --moe-loss-coeff x the layers' load-balancing losses, what the loss adds to the lm loss
    imbalance: float  # the most loaded expert's tokens / the mean expert's, of the most unbalanced layer
    dropped: float  # the fraction of the routes (token, expert) dropped by the experts' capacity


def moe_fields(m: MoEStats | None) -> str:
    return "" if m is None else (f" moe loss: {m.loss:.6E} | expert load max/mean: {m.imbalance:.3f} |"
                                 f" tokens dropped: {m.dropped:.4f} |")


def iteration_line(s: IterationStats) -> str:
    grad_norm = "" if s.grad_norm is None else f" grad norm: {s.grad_norm:.3f} |"
    # where Megatron-DeepSpeed prints it, after the grad norm
    seqlen = "" if s.curriculum_seqlen is None else f" curriculum seqlen: {s.curriculum_seqlen:5d} |"
    return (f" iteration {s.iteration:8d}/{s.train_iters:8d} |"
            f" consumed samples: {s.consumed_samples:12d} |"
            f" consumed tokens: {s.consumed_tokens:12d} |"
            f" elapsed time per iteration (ms): {s.elapsed_ms:.1f} |"
            f" learning rate: {s.learning_rate:.3E} |"
            f" global batch size: {s.global_batch_size:5d} |"
            f" lm loss: {s.lm_loss:.6E} |{moe_fields(s.moe)}"
            f" loss scale: {s.loss_scale:.1f} |"
            f"{grad_norm}{seqlen}"
            f" number of skipped iterations: {s.skipped_iterations:3d} |"
            f" number of nan iterations: {s.nan_iterations:3d} |"
            f" samples per second: {s.samples_per_second:.3f} |"
            f" tokens per gpu per second (tgs): {s.tokens_per_gpu_per_second:.3f} |"
            f" TFLOPs: {s.tflops:.2f} |")


def memory_line(rank: int, device: str, iteration: int, mem: dict, mfu_percent: float | None,
                hfu_percent: float | None = None) -> str:
    """docs/log-lines.md's regexes expect ", MemAllocated=" (DeepSpeed's own spelling), hence the
    device field in front of it. HFU follows MFU here, not in the iteration line, whose fields are upstream's."""
    mfu = "" if mfu_percent is None else f", MFU={mfu_percent:.2f}%"
    if hfu_percent is not None:
        mfu += f", HFU={hfu_percent:.2f}%"
    return (f"[Rank {rank}] memory at iteration {iteration:8d} | device={device}, "
            f"MemAllocated={mem['allocated'] / GB:.2f}GB, "
            f"MaxMemAllocated={mem['max_allocated'] / GB:.2f}GB, HostRSS={mem['rss'] / GB:.2f}GB, "
            f"MaxHostRSS={mem['max_rss'] / GB:.2f}GB{mfu} |")


def parameters_line(total: int, active: int, on_rank: int, measured: int | None) -> str:
    """The model's parameters (every expert included), those one token goes through (--topk experts per MoE
    layer: megatron/accounting/predict/parameters.py) and the printing rank's, predicted beside measured."""
    held = "" if measured is None else f", measured {measured}"
    return (f" > parameters | total: {total} | active per token: {active} | on this rank: predicted {on_rank}"
            f"{held} |")


def model_state_line(measured: dict, estimate: dict, zero_stage: int, dp_size: int, precision: str,
                     offload: str) -> str:
    """Measured: params, grads and optimizer states on the accelerator, offloaded states, the activations
    of one micro-batch (when measured), the layer inputs --checkpoint-in-cpu moved to host memory (when it
    does), everything else allocated, on CPU ranks the first micro-batch's peak beyond the model states (step_peak,
    when measured) and --async-save's host copy (when saves are asynchronous); the estimate
    (megatron/accounting.memory_per_rank): the same, total = the model states on the accelerator, step_peak = its
    total less them."""
    m = {key: value / GB for key, value in measured.items()}
    e = {key: value / GB for key, value in estimate.items()}
    activations = f" activations={m['activations']:.4f}" if "activations" in m else ""
    # --checkpoint-in-cpu's layer inputs in host memory, on runs that offload them (measured: in zero-lab's host tier)
    host = f" activations_offloaded={m['activations_offloaded']:.4f}" if "activations_offloaded" in m else ""
    offloads = host or estimate.get("activations_offloaded", 0) > 0
    host_estimate = f" activations_offloaded={e.get('activations_offloaded', 0.0):.4f}" if offloads else ""
    # --async-save's host copy (megatron/checkpointing/async_save.py), on both sides where the run saves so
    copy = f" async_save_copy={m['async_save_copy']:.4f}" if "async_save_copy" in m else ""
    copy_estimate = f" async_save_copy={e['async_save_copy']:.4f}" if "async_save_copy" in e else ""
    # on CPU ranks the first micro-batch's peak beyond the model states, beside memory_per_rank's total less them
    peak = f" step_peak={m['step_peak']:.4f}" if "step_peak" in m else ""
    peak_estimate = f" step_peak={e['total'] - e['model_states']:.4f}" if "step_peak" in m else ""
    return (f" model state memory per rank (GB) | measured: params={m['params']:.4f} grads={m['grads']:.4f} "
            f"optim={m['optim']:.4f} offloaded={m['offloaded']:.4f}{activations}{host} other={m['other']:.4f}{peak}"
            f"{copy} | "
            f"ZeRO estimate (stage={zero_stage}, dp={dp_size}, dtype={precision}, offload={offload}): "
            f"params={e['params']:.4f} grads={e['grads']:.4f} optim={e['optim']:.4f} total={e['model_states']:.4f} "
            f"offloaded={e['offloaded']:.4f} activations={e['activations']:.4f}{host_estimate} "
            f"output_buffer={e['output_buffer']:.4f}{peak_estimate}{copy_estimate} |")


def comm_line(rank: int, iteration: int, sent_per_iteration: dict, num_params: int, predicted: float) -> str:
    """Bytes this rank sent per iteration through each kind of collective (megatron/accounting/measure/comm_counter.py),
    their total per model parameter, and the total megatron/accounting/predict/ predicts
    (docs/zero-tradeoff.md defines "sent")."""
    total = sum(sent_per_iteration.values())
    kinds = " | ".join(f"{kind}={sent / MB:.3f}MB" for kind, sent in sent_per_iteration.items())
    return (f"[Rank {rank}] comm at iteration {iteration:8d} | {kinds} | total={total / MB:.3f}MB | "
            f"bytes/param={total / num_params:.3f} | predicted={predicted / MB:.3f}MB |")


def time_line(rank: int, iteration: int, measured: dict, predicted) -> str:
    """Milliseconds per iteration by part: measured (total: the interval's mean step time; communication: time
    blocked in collectives, megatron/accounting/measure/comm_counter.py; offload: the offloaded optimizer's step;
    compute: the
    rest) beside megatron/accounting/predict/step_time.py's prediction (a StepTime, in seconds)."""
    def parts(values: dict) -> str:
        return " ".join(f"{name}={seconds * 1000.0:.1f}ms" for name, seconds in values.items())

    return (f"[Rank {rank}] time at iteration {iteration:8d} | measured: {parts(measured)} | "
            f"predicted: {parts(_predicted_parts(predicted))} |")


def _predicted_parts(predicted) -> dict[str, float]:
    return dict(compute=predicted.compute, communication=predicted.communication, offload=predicted.offload,
                host=predicted.host, overlap=predicted.overlap, total=predicted.total)


def progress_line(rank: int, iteration: int, train_iters: int, elapsed_s: float,
                  rate: tuple[float, int] | None) -> str:
    """How far the run is (iteration of train_iters), the wall-clock time since this launch started and the time
    left at the recent wall-clock rate. rate: (seconds per iteration, the first iteration it was measured over);
    None before this launch has timed a whole interval, when the ETA is unknown unless no iteration is left."""
    left = train_iters - iteration
    if rate is None:
        eta = "0:00:00" if left <= 0 else "unknown"
        clock = "wall clock: no interval timed yet in this launch"
    else:
        seconds, first = rate
        eta = duration(max(0, left) * seconds)
        clock = f"wall clock {seconds:.3f} s/iteration over iterations {first}-{iteration}"
    # truncated, not rounded: 99.96% of the run is not 100.0%
    percent = math.floor(1000 * iteration / train_iters) / 10
    return (f"[Rank {rank}] progress at iteration {iteration:8d} | {iteration}/{train_iters} iterations "
            f"({percent:.1f}%) | elapsed {duration(elapsed_s)} since launch | ETA {eta} | {clock} |")


def duration(seconds: float) -> str:
    """H:MM:SS, the hours unbounded (a long run's ETA reads 131:05:00, not 5 days, 11:05:00)."""
    whole = max(0, round(seconds))
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


def probe_line(rates, link, predicted, host=None) -> str:
    """What the start-up probes measured (megatron/accounting/measure/compute_probe.py, megatron/accounting/measure/comm_probe.py, or the link the
    flags describe, megatron/accounting/measure/host_probe.py's host work; None: not probed) and the step time predicted from it."""
    costs = ", ".join(f"{kind} {cost.latency_s * 1e6:.0f}us + {_rate(cost.seconds_per_byte)}"
                      for kind, cost in link.costs.items())
    copies = "" if rates.device_copy_bytes_per_s in (None, rates.host_copy_bytes_per_s) else (
        f", device copies {rates.device_copy_bytes_per_s / 1e9:.2f} GB/s")  # a GPU's own memory
    copies += "" if rates.nvme_bytes_per_s is None else f", NVMe {rates.nvme_bytes_per_s / 1e9:.2f} GB/s"
    output = rates.output_flops_per_s or rates.flops_per_s
    costs += "" if link.seconds is None else f" (probed in {link.seconds:.2f} s)"
    return (f" > step time predicted | compute: layers {rates.flops_per_s / 1e9:.1f} GFLOP/s, output layer "
            f"{output / 1e9:.1f} GFLOP/s, optimizer {rates.optimizer_step_s * 1e6:.0f}us + "
            f"{rates.optimizer_s_per_element * 1e9:.2f} ns/element, host copies "
            f"{rates.host_copy_bytes_per_s / 1e9:.2f} GB/s{copies} | link ({link.source}): {costs} | "
            f"{_host(host)} | "
            f"compute={predicted.compute * 1e3:.1f}ms communication={predicted.communication * 1e3:.1f}ms "
            f"offload={predicted.offload * 1e3:.1f}ms host={predicted.host * 1e3:.1f}ms "
            f"overlap={predicted.overlap * 1e3:.1f}ms "
            f"total={predicted.total * 1e3:.1f}ms")


def _host(host) -> str:
    """The host work's coefficients (HostCoefficients), in microseconds per counted item."""
    if host is None:
        return "host: not probed (pipeline parallelism)"
    probed = "" if host.seconds is None else f" (probed in {host.seconds:.2f} s)"
    return (f"host ({host.source}): {host.per_tensor_s * 1e6:.1f}us/tensor, {host.per_module_s * 1e6:.1f}us/module "
            f"hook, {host.per_flush_s * 1e6:.1f}us/flush, {host.per_sync_s * 1e6:.1f}us/sync{probed}")


def _rate(seconds_per_byte: float) -> str:
    """Bytes sent (comm_counter's measure) per second."""
    return "free" if seconds_per_byte <= 0 else f"{1 / seconds_per_byte / 1e9:.3f} GB/s"


def tuned_keys_line(path: str, added: list[str]) -> str:
    """Once at start-up, with a user's DeepSpeed JSON: the keys zero-lab's tuned settings filled in."""
    return (f" > --deepspeed_config {path} leaves out {len(added)} key(s) zero-lab tunes; added: {', '.join(added)} "
            "(set a key in the JSON to keep your own value)")


def training_done_line() -> str:
    """Megatron's end-of-training marker: analysis tells finished runs from cut-off ones by it."""
    return f"[after training is done] datetime: {datetime.now():%Y-%m-%d %H:%M:%S} "


def exit_duration_line(minutes: float) -> str:
    """Megatron's line when --exit-duration-in-mins stops the run (its print_datetime)."""
    return f"[exiting program after {minutes} minutes] datetime: {datetime.now():%Y-%m-%d %H:%M:%S} "


def validation_line(iteration: int, loss: float) -> str:
    ppl = math.exp(min(20.0, loss)) if math.isfinite(loss) else float("nan")
    return f" validation loss at iteration {iteration} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | "


def epoch_line(epoch: int, iteration: int, consumed_samples: int, seconds: float, loss: float) -> str:
    return (f" epoch {epoch:4d} done | iteration {iteration:8d} | consumed samples: {consumed_samples:12d} | "
            f"epoch time (s): {seconds:.3f} | lm loss: {loss:.6E} |")


def peak_line(device_name: str, part: str | None, matmul_precision: str, peak_tflops: float | None) -> str:
    """Once at start-up: the peak MFU and HFU are over, or why they are not printed."""
    if peak_tflops is None:
        what = "no part known" if part is None else f"{part}, no {matmul_precision} peak known"
        return f" > MFU and HFU not reported: {device_name!r} ({what}; megatron/accounting/predict/flops.py PEAK_TFLOPS)"
    return f" > MFU and HFU over the dense {matmul_precision} peak of {part} ({device_name}): {peak_tflops:g} TFLOPs"


def run_info_line(zero_stage: int, offload: str, model: str, world_size: int, micro_batch: int,
                  global_batch: int, seq_length: int, samples_per_epoch: int, experts: list[int] = (),
                  ep: int = 1, topk: int = 1, sp: int = 1) -> str:
    """`experts`: each MoE layer's experts (printed once when they are all alike); a dense model has none and
    its line no MoE fields. `sp`: DeepSpeed-Ulysses' sequence-parallel size, named when above 1 (a line
    without it is SP 1)."""
    shown = experts[:1] if len(set(experts)) == 1 else experts
    ulysses = f" SP: {sp} |" if sp > 1 else ""
    moe = f" experts: {' '.join(map(str, shown))} | EP: {ep} | top-k: {topk} |" if experts else ""
    return (f" > run info | zero stage: {zero_stage} | offload: {offload} | model: {model} | "
            f"world size: {world_size} | micro batch: {micro_batch} | global batch: {global_batch} | "
            f"seq length: {seq_length} | train samples per epoch: {samples_per_epoch} |{ulysses}{moe}")


# The scalars of one logging interval, for the writers (TensorBoard, wandb: megatron/wandb_writer.py): the
# iteration line's under Megatron's TensorBoard names, then the memory, comm and time lines' in their units.

def iteration_scalars(s: IterationStats) -> dict[str, float]:
    values = {"lm loss": s.lm_loss, "learning-rate": s.learning_rate, "loss-scale": s.loss_scale,
              "iteration-time": s.elapsed_ms / 1000.0, "samples per second": s.samples_per_second,
              "TFLOPs": s.tflops, "tgs": s.tokens_per_gpu_per_second}
    if s.grad_norm is not None:
        values["grad-norm"] = s.grad_norm
    if s.curriculum_seqlen is not None:
        values["seqlen/curriculum_seqlen"] = s.curriculum_seqlen  # Megatron-DeepSpeed's TensorBoard name
    if s.moe is not None:
        values |= {"moe loss": s.moe.loss, "moe/expert-load-max-over-mean": s.moe.imbalance,
                   "moe/tokens-dropped": s.moe.dropped}
    return values


def memory_scalars(mem: dict, mfu_percent: float | None, hfu_percent: float | None) -> dict[str, float]:
    values = {"memory/allocated-GB": mem["allocated"] / GB, "memory/max-allocated-GB": mem["max_allocated"] / GB,
              "memory/host-rss-GB": mem["rss"] / GB, "memory/max-host-rss-GB": mem["max_rss"] / GB}
    if mfu_percent is not None:
        values["MFU"] = mfu_percent
    if hfu_percent is not None:
        values["HFU"] = hfu_percent
    return values


def comm_scalars(sent_per_iteration: dict, num_params: int, predicted: float) -> dict[str, float]:
    total = sum(sent_per_iteration.values())
    values = {f"traffic/{kind}-MB": sent / MB for kind, sent in sent_per_iteration.items()}
    values |= {"traffic/total-MB": total / MB, "traffic/bytes-per-param": total / num_params}
    return values | {"traffic/predicted-MB": predicted / MB}


def time_scalars(measured: dict, predicted) -> dict[str, float]:
    values = {f"step-time/measured-{name}-ms": seconds * 1000.0 for name, seconds in measured.items()}
    return values | {f"step-time/predicted-{name}-ms": seconds * 1000.0
                     for name, seconds in _predicted_parts(predicted).items()}


def timer_scalars(measured: dict) -> dict[str, float]:
    """--log-timers-to-tensorboard: the interval's step split into its parts, seconds per iteration, as Megatron's
    <timer>-time scalars (the whole step is iteration-time)."""
    return {f"{name}-time": seconds for name, seconds in measured.items() if name != "total"}


def validation_scalars(loss: float, perplexity: bool) -> dict[str, float]:
    """The validation loss; with --log-validation-ppl-to-tensorboard its perplexity too, under Megatron's name and
    capped as Megatron caps it (exp of at most 20)."""
    values = {"validation lm loss": loss}
    if perplexity:
        values["lm-loss-validation/lm loss validation ppl"] = math.exp(min(20.0, loss))
    return values


class TensorBoardWriter:
    """One of the Reporter's writers (megatron/wandb_writer.py's is the other): each interval's scalars, by name;
    a no-op object is never created - leave it out instead. queue_size: --tensorboard-queue-size, the events held
    before a write to disk."""

    def __init__(self, log_dir: str, queue_size: int = 1000):
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(log_dir=log_dir, max_queue=queue_size)

    def scalars(self, values: dict[str, float], iteration: int):
        for name, value in values.items():
            self.writer.add_scalar(name, value, iteration)

    def close(self):
        self.writer.close()
