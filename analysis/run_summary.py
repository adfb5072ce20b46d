"""Turn one parsed log plus its metadata into the numbers the ZeRO comparison needs."""
from __future__ import annotations

from dataclasses import dataclass, field
from statistics import fmean

from analysis.log_parser import EpochRecord, IterationRecord, MemoryRecord, ParsedLog
from analysis.run_metadata import RunMetadata, moe_layout

# Our per-rank memory line carries host memory too, so it wins when present; upstream logs
# mix Megatron's report_memory (once, after the first iteration) and DeepSpeed's engine timer
# lines (every steps_per_print), which measure the same allocator counters, so both count.
_OWN_MEMORY_SOURCE = "zero-lab"


@dataclass
class RunSummary:
    run: str
    label: str
    log: str
    complete: bool
    incomplete_reason: str
    status: str  # finished, diverged at iteration N, stopped early at iteration N, INCOMPLETE
    # launches of the run joined here that logged training: attempt headers, else resumes seen as iterations going
    # back; a launch refused at start-up, or that found nothing to train, is not counted
    attempts: int
    nan_iterations: int | None
    zero_stage: int | None
    offload: str | None
    model: str | None
    world_size: int | None
    micro_batch: int | None
    global_batch: int | None
    seq_length: int | None
    last_iteration: int | None
    train_iters: int | None
    intervals_used: int
    tgs_mean: float | None
    tokens_per_s: float | None
    ms_per_iter_mean: float | None
    samples_per_s_mean: float | None
    tflops_mean: float | None
    mfu_mean_pct: float | None
    hfu_mean_pct: float | None  # hardware FLOPs (recomputed forwards counted) over the peak
    epochs_done: int  # distinct epochs ended, each counted once however many attempts printed it
    epoch_time_s: float | None  # mean over the epochs one attempt ran whole
    epoch_time_source: str  # measured, estimated, or "" when neither
    partial_epochs: list[int]  # epochs only logged by an attempt that resumed inside them (times not used)
    mem_alloc_mean_gb: float | None
    mem_alloc_max_gb: float | None
    max_mem_alloc_peak_gb: float | None
    memory_source: str
    host_rss_mean_gb: float | None
    host_rss_peak_gb: float | None
    model_state_measured_gb: float | None
    zero_estimate_gb: float | None
    loss_first: float | None
    loss_last: float | None
    epoch_losses: list[float]
    val_loss_last: float | None
    val_ppl_last: float | None
    # (consumed tokens, lm loss) per logged iteration; plotted, not tabulated.
    loss_curve: list[tuple[int, float]] = field(default_factory=list)
    # (iteration, moe loss, expert load max/mean, tokens dropped) per logged iteration of an MoE run; plotted
    moe_curve: list[tuple[int, float, float, float]] = field(default_factory=list)
    # The ZeRO trade-off (docs/zero-tradeoff.md): MB (2**20 bytes) the printing rank sent per iteration,
    # measured (mean over the comm lines) and predicted; the model-state line's offloaded states and one
    # micro-batch's activations, measured and predicted, and the predicted output-layer buffer (GB).
    traffic_mb: float | None = None
    traffic_predicted_mb: float | None = None
    traffic_bytes_per_param: float | None = None
    offloaded_gb: float | None = None
    offloaded_estimate_gb: float | None = None
    activations_gb: float | None = None
    activations_estimate_gb: float | None = None
    output_buffer_estimate_gb: float | None = None
    # ms per iteration by part from the time line (docs/log-lines.md), measured beside predicted, over the
    # same steady-state intervals as ms/iter; None for logs without time lines (upstream's)
    time_compute_ms: float | None = None
    time_communication_ms: float | None = None
    time_offload_ms: float | None = None
    time_total_ms: float | None = None
    time_compute_predicted_ms: float | None = None
    time_communication_predicted_ms: float | None = None
    time_offload_predicted_ms: float | None = None
    time_overlap_predicted_ms: float | None = None
    time_host_predicted_ms: float | None = None  # the engine's host work (logs before it: None)
    time_total_predicted_ms: float | None = None
    # a run still running (INCOMPLETE): its last attempt's last progress line (docs/log-lines.md): the iteration,
    # the percentage of the run done, the seconds since that launch started and the ETA (None: not yet known);
    # all None for a run that ended, and for logs without progress lines (upstream's)
    progress_iteration: int | None = None
    progress_pct: float | None = None
    progress_elapsed_s: int | None = None
    eta_s: int | None = None
    # mixture of experts (docs/moe.md): the layout (experts of each MoE layer, one value when all alike; EP;
    # top-k), the parameters line's total and active per token (any run that printed it, dense too), and the
    # iteration line's MoE fields over the run: the mean over the steady-state intervals, weighted by iterations
    # like ms/iter, and the last logged. None for a dense run, and for a log without the line.
    num_experts: list[int] | None = None
    expert_parallel: int | None = None
    topk: int | None = None
    params_total: int | None = None
    params_active: int | None = None
    moe_loss_mean: float | None = None
    moe_loss_last: float | None = None
    expert_load_mean: float | None = None
    expert_load_last: float | None = None
    tokens_dropped_mean: float | None = None
    tokens_dropped_last: float | None = None
    # DeepSpeed-Ulysses' sequence-parallel size (--ds-sequence-parallel-size): the run info line's SP (a zero-lab
    # line without it: 1), Megatron's argument dump, command.txt; None when no source names it
    sequence_parallel: int | None = None
    # the kind of device the memory lines name ("cpu", "cuda"; several joined by "+"); None: not named (upstream's)
    memory_device: str | None = None


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return fmean(values) if values else None


def _max(values) -> float | None:
    values = [v for v in values if v is not None]
    return max(values) if values else None


def unique_iterations(log: ParsedLog) -> list[IterationRecord]:
    """One record per iteration, in order. Ranks that all print, or a resumed run that
    repeats iterations, would count twice; the last print of an iteration wins."""
    by_iteration = {}
    for record in log.iterations:
        by_iteration[record.iteration] = record
    return sorted(by_iteration.values(), key=lambda r: r.iteration)


def _weighted_mean(pairs) -> float | None:
    """sum(value * weight) / sum(weight) over the pairs whose value is known."""
    pairs = [(v, w) for v, w in pairs if v is not None and w]
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total else None


def interval_weights(kept: list[IterationRecord], all_records: list[IterationRecord]) -> dict[int, tuple[int, float]]:
    """(iterations, milliseconds) each kept interval spans, by iteration. A logged rate is the interval's
    mean, so a mean over intervals weighted by their time is the work over the time (tokens over seconds);
    ms/iter is weighted by iterations. The first interval after a resume starts at the checkpoint, which
    the log does not name: it is taken to be as long as the run's most common interval (it is warm-up,
    left out unless --skip-first 0)."""
    known = [r.interval_iterations for r in all_records if r.interval_iterations]
    typical = max(set(known), key=known.count) if known else 1
    weights = {}
    for r in kept:
        n = r.interval_iterations or min(typical, r.iteration)
        weights[r.iteration] = (n, n * r.elapsed_ms)
    return weights


def steady_state(records: list[IterationRecord], skip_first: int) -> list[IterationRecord]:
    """Drop the first `skip_first` logged intervals of each attempt (every start warms up again),
    always keeping at least one interval."""
    timed = [r for r in records if r.elapsed_ms is not None]
    seen: dict[int, int] = {}
    kept = []
    for record in timed:
        seen[record.attempt] = seen.get(record.attempt, 0) + 1
        if seen[record.attempt] > skip_first:
            kept.append(record)
    return kept or timed[-1:]


def _tokens_per_iteration(record: IterationRecord, meta: RunMetadata) -> int | None:
    batch = record.global_batch_size or meta.global_batch
    return batch * meta.seq_length if batch and meta.seq_length else None


def collective_tokens_per_s(kept: list[IterationRecord], weights: dict, meta: RunMetadata) -> float | None:
    """All ranks together: tgs (over time) * world size when both are known, else tokens / time."""
    tgs = _weighted_mean((r.tgs, weights[r.iteration][1]) for r in kept)
    if tgs is not None and meta.world_size:
        return tgs * meta.world_size
    timed = [(n * tpi, ms) for r in kept if (tpi := _tokens_per_iteration(r, meta)) and r.elapsed_ms
             for n, ms in [weights[r.iteration]]]
    return sum(t for t, _ in timed) * 1000.0 / sum(ms for _, ms in timed) if timed else None


def _memory_samples(log: ParsedLog) -> tuple[str, list[MemoryRecord]]:
    own = [m for m in log.memory if m.source == _OWN_MEMORY_SOURCE]
    if own:
        return _OWN_MEMORY_SOURCE, own
    return "+".join(sorted({m.source for m in log.memory})), log.memory


def _consumed_tokens(record: IterationRecord, meta: RunMetadata) -> int | None:
    if record.consumed_tokens is not None:
        return record.consumed_tokens
    if record.consumed_samples is not None and meta.seq_length:
        return record.consumed_samples * meta.seq_length
    return None


def completeness(log: ParsedLog, records: list[IterationRecord]) -> str:
    """Why the run looks unfinished, or "" when it finished."""
    if log.ended_mid_line:
        return "log ends mid-line"
    reached_end = bool(records) and records[-1].iteration >= records[-1].train_iters
    if not (log.saw_end_marker or reached_end):
        last = records[-1].iteration if records else 0
        total = records[-1].train_iters if records else "?"
        return f"no end-of-training marker (last iteration {last}/{total})"
    return ""


def diverged_at(log: ParsedLog, records: list[IterationRecord]) -> int | None:
    """The iteration a run diverged at: the one its NaN stop names, else the first of the trailing
    logged intervals in which every iteration was NaN/Inf (Megatron's nan counter grew by the whole
    interval up to the last logged iteration); None when it did not diverge."""
    if log.diverged_at is not None:
        return log.diverged_at
    first_nan = None
    for previous, record in zip([None] + records[:-1], records):
        before = (0, 0) if previous is None else (previous.iteration, previous.nan_iterations)
        if record.nan_iterations is None or before[1] is None:
            first_nan = None
        elif record.nan_iterations - before[1] == record.iteration - before[0]:
            first_nan = first_nan or before[0] + 1
        else:
            first_nan = None
    return first_nan


def run_status(log: ParsedLog, records: list[IterationRecord]) -> tuple[str, str]:
    """(status, why it is not "finished"): diverged beats stopped early beats the completeness check."""
    diverged = diverged_at(log, records)
    if diverged is not None:
        why = ("stopped on NaN/Inf losses" if log.diverged_at is not None
               else "NaN/Inf losses to the last logged iteration")
        return f"diverged at iteration {diverged}", why
    if log.exited_early and not log.saw_end_marker:
        last = log.exited_at if log.exited_at is not None else records[-1].iteration if records else 0
        return f"stopped early at iteration {last}", f"exited on {log.exited_early}"
    reason = completeness(log, records)
    return ("INCOMPLETE", reason) if reason else ("finished", "")


def epochs_once(log: ParsedLog) -> list[tuple[EpochRecord, bool]]:
    """(the epoch's line, whether it is partial) per epoch, in order. The training times an epoch from
    its process's start or the previous epoch's end, so a line is whole when its start began fresh or
    printed the epoch before; a resumed start's first epoch line times only part of the epoch, and a
    resume from before an epoch's end prints that epoch again. A whole line wins, else the last."""
    chosen: dict[int, tuple[EpochRecord, bool]] = {}
    previous: EpochRecord | None = None
    for e in log.epochs:
        same_start = previous is not None and previous.attempt == e.attempt
        whole = same_start or not log.starts[e.attempt]
        if e.epoch not in chosen or whole or chosen[e.epoch][1]:
            chosen[e.epoch] = (e, not whole)
        previous = e
    return [chosen[k] for k in sorted(chosen)]


def _epoch_time(epochs: list[tuple[EpochRecord, bool]], meta: RunMetadata,
                ms_per_iter: float | None) -> tuple[float | None, str]:
    measured = _mean(e.epoch_time_s for e, partial in epochs if not partial)
    if measured is not None:
        return measured, "measured"
    # Runs shorter than an epoch: iterations per epoch times the steady-state iteration time.
    if meta.train_samples_per_epoch and meta.global_batch and ms_per_iter:
        return meta.train_samples_per_epoch / meta.global_batch * ms_per_iter / 1000.0, "estimated"
    return None, ""


def _model_state(log: ParsedLog) -> tuple[float | None, float | None]:
    state = log.model_state
    if state is None:
        return None, None
    measured = sum(state.measured.get(k, 0.0) for k in ("params", "grads", "optim")) if state.measured else None
    return measured, state.estimate.get("total")


def kept_interval_lines(lines: list, kept: dict[tuple[int, int], int]) -> list[tuple]:
    """(line, its interval's iterations) for the per-interval lines (comm, time) printed with the kept
    iteration lines; every line, weighing one, when none was. `kept`: (iteration, start) of the kept
    iteration lines -> iterations in the interval."""
    chosen = [(line, kept[key]) for line in lines if (key := (line.iteration, line.attempt)) in kept]
    return chosen or [(line, 1) for line in lines]


def _traffic(log: ParsedLog, kept: dict[tuple[int, int], int]) -> dict:
    """Bytes sent per iteration over the steady-state intervals, like throughput (the first step gathers
    some parameters more often: ZeRO-3 records its fetch order then), each interval weighted by its
    iterations."""
    comm = kept_interval_lines(log.comm, kept)
    measured, estimate = (log.model_state.measured, log.model_state.estimate) if log.model_state else ({}, {})

    def mean(name):
        return _weighted_mean((getattr(c, name), n) for c, n in comm)

    return dict(traffic_mb=mean("total_mb"), traffic_predicted_mb=mean("predicted_mb"),
                traffic_bytes_per_param=mean("bytes_per_param"),
                offloaded_gb=measured.get("offloaded"), offloaded_estimate_gb=estimate.get("offloaded"),
                activations_gb=measured.get("activations"), activations_estimate_gb=estimate.get("activations"),
                output_buffer_estimate_gb=estimate.get("output_buffer"))


def _step_time(log: ParsedLog, kept: dict[tuple[int, int], int]) -> dict:
    """ms per iteration by part over the steady-state intervals, weighted by iterations like ms/iter:
    time_<part>_ms measured, time_<part>_predicted_ms predicted (overlap is only predicted)."""
    times = kept_interval_lines(log.times, kept)
    measured = {f"time_{part}_ms": _weighted_mean((t.measured_ms.get(part), n) for t, n in times)
                for part in ("compute", "communication", "offload", "total")}
    predicted = {f"time_{part}_predicted_ms": _weighted_mean((t.predicted_ms.get(part), n) for t, n in times)
                 for part in ("compute", "communication", "offload", "host", "overlap", "total")}
    return measured | predicted


def _progress(log: ParsedLog, status: str) -> dict:
    """How far a run still running (INCOMPLETE) got, from the last progress line its last start printed; {} for
    a run that ended, and when that start printed none (still starting, or an upstream log)."""
    lines = [p for p in log.progress if p.attempt == log.start]
    if status != "INCOMPLETE" or not lines:
        return {}
    last = lines[-1]
    return dict(progress_iteration=last.iteration, progress_pct=last.percent, progress_elapsed_s=last.elapsed_s,
                eta_s=last.eta_s)


def _count(value: str | None) -> int | None:
    return int(value) if value and value.isdigit() else None


def _moe(log: ParsedLog, meta: RunMetadata, records: list[IterationRecord], kept: list[IterationRecord],
         weights: dict) -> dict:
    """The MoE layout, the parameters line's counts, and each MoE field of the iteration line as the mean over
    the kept intervals (each value is its interval's mean, so weighted by iterations) and the last logged."""
    values = moe_layout(meta)
    total, active = (_count(log.parameters.get(key)) for key in ("total", "active per token"))
    if None not in (total, active):  # both or neither: a log cut inside the line keeps only its first fields
        values |= dict(params_total=total, params_active=active)
    for name in ("moe_loss", "expert_load", "tokens_dropped"):
        logged = [getattr(r, name) for r in records if getattr(r, name) is not None]
        if logged:
            values[f"{name}_mean"] = _weighted_mean((getattr(r, name), weights[r.iteration][0]) for r in kept)
            values[f"{name}_last"] = logged[-1]
    return values


def summarize_run(log: ParsedLog, meta: RunMetadata, run: str, skip_first: int) -> RunSummary:
    records = unique_iterations(log)
    kept = steady_state(records, skip_first)
    # every steady-state mean uses these intervals and weights, and the memory/comm lines the same
    # start printed with them (an iteration run again after a resume was printed by two starts)
    weights = interval_weights(kept, log.iterations)
    by_key = {(r.iteration, r.attempt): r for r in kept}
    source, memory = _memory_samples(log)
    ms_per_iter = _weighted_mean((r.elapsed_ms, weights[r.iteration][0]) for r in kept)

    def over_time(values):
        return _weighted_mean((v, weights[r.iteration][1]) for r, v in values)

    def over_memory_lines(name):  # MFU, HFU: the memory lines printed with the kept iteration lines
        return over_time((by_key[key], getattr(m, name)) for m in memory
                         if (key := (m.iteration, m.attempt)) in by_key)

    kept_intervals = {key: weights[r.iteration][0] for key, r in by_key.items()}
    epochs = epochs_once(log)
    epoch_time, epoch_source = _epoch_time(epochs, meta, ms_per_iter)
    measured_state, estimate = _model_state(log)
    losses = [r.lm_loss for r in records if r.lm_loss is not None]
    validations = [v for v in log.validations if v.lm_loss is not None]
    status, reason = run_status(log, records)
    return RunSummary(
        run=run,
        label=meta.label or run,
        log=str(log.path),
        complete=status == "finished",
        incomplete_reason=reason,
        status=status,
        attempts=max(1, len(log.trained_starts)),  # the refused and the empty are not attempts of its training
        nan_iterations=records[-1].nan_iterations if records else None,
        zero_stage=meta.zero_stage,
        offload=meta.offload,
        model=meta.model,
        world_size=meta.world_size,
        sequence_parallel=meta.sequence_parallel,
        micro_batch=meta.micro_batch,
        global_batch=meta.global_batch,
        seq_length=meta.seq_length,
        last_iteration=records[-1].iteration if records else None,
        train_iters=records[-1].train_iters if records else None,
        intervals_used=len(kept),
        tgs_mean=over_time((r, r.tgs) for r in kept),
        tokens_per_s=collective_tokens_per_s(kept, weights, meta),
        ms_per_iter_mean=ms_per_iter,
        samples_per_s_mean=over_time((r, r.samples_per_second) for r in kept),
        tflops_mean=over_time((r, r.tflops) for r in kept),
        mfu_mean_pct=over_memory_lines("mfu_pct"),
        hfu_mean_pct=over_memory_lines("hfu_pct"),
        epochs_done=len(epochs),
        epoch_time_s=epoch_time,
        epoch_time_source=epoch_source,
        partial_epochs=[e.epoch for e, partial in epochs if partial],
        mem_alloc_mean_gb=_mean(m.allocated_gb for m in memory),
        mem_alloc_max_gb=_max(m.allocated_gb for m in memory),
        max_mem_alloc_peak_gb=_max(m.max_allocated_gb for m in memory),
        memory_source=source,
        memory_device="+".join(sorted({m.device for m in memory if m.device})) or None,
        host_rss_mean_gb=_mean(m.host_rss_gb for m in memory),
        host_rss_peak_gb=_max([m.max_host_rss_gb for m in memory] + [m.host_rss_gb for m in memory]),
        model_state_measured_gb=measured_state,
        zero_estimate_gb=estimate,
        loss_first=losses[0] if losses else None,
        loss_last=losses[-1] if losses else None,
        epoch_losses=[e.lm_loss for e, _ in epochs if e.lm_loss is not None],
        val_loss_last=validations[-1].lm_loss if validations else None,
        val_ppl_last=validations[-1].ppl if validations else None,
        loss_curve=[(tokens, r.lm_loss) for r in records
                    if r.lm_loss is not None and (tokens := _consumed_tokens(r, meta)) is not None],
        moe_curve=[(r.iteration, r.moe_loss, r.expert_load, r.tokens_dropped) for r in records
                   if None not in (r.moe_loss, r.expert_load, r.tokens_dropped)],
        **_traffic(log, kept_intervals),
        **_step_time(log, kept_intervals),
        **_progress(log, status),
        **_moe(log, meta, records, kept, weights),
    )
