"""Turn one parsed log plus its metadata into the numbers the ZeRO comparison needs."""
from __future__ import annotations

from dataclasses import dataclass, field
from statistics import fmean

from analysis.log_parser import IterationRecord, MemoryRecord, ParsedLog
from analysis.run_metadata import RunMetadata

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
    attempts: int  # launches of the run joined here (a resumed run has several); 1 for a log without headers
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
    epochs_done: int
    epoch_time_s: float | None
    epoch_time_source: str
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


def collective_tokens_per_s(kept: list[IterationRecord], meta: RunMetadata) -> float | None:
    """All ranks together: tgs * world size when both are known, else tokens per iteration / time."""
    tgs = _mean(r.tgs for r in kept)
    if tgs is not None and meta.world_size:
        return tgs * meta.world_size
    rates = [tpi * 1000.0 / r.elapsed_ms for r in kept
             if (tpi := _tokens_per_iteration(r, meta)) and r.elapsed_ms]
    return fmean(rates) if rates else None


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


def _epoch_time(log: ParsedLog, meta: RunMetadata, ms_per_iter: float | None) -> tuple[float | None, str]:
    measured = _mean(e.epoch_time_s for e in log.epochs)
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


def _traffic(log: ParsedLog, kept_iterations: set[int]) -> dict:
    """Bytes sent over the steady-state intervals, like throughput: the first step gathers some
    parameters more often (ZeRO-3 records its fetch order then)."""
    comm = [c for c in log.comm if c.iteration in kept_iterations] or log.comm
    measured, estimate = (log.model_state.measured, log.model_state.estimate) if log.model_state else ({}, {})
    return dict(traffic_mb=_mean(c.total_mb for c in comm), traffic_predicted_mb=_mean(c.predicted_mb for c in comm),
                traffic_bytes_per_param=_mean(c.bytes_per_param for c in comm),
                offloaded_gb=measured.get("offloaded"), offloaded_estimate_gb=estimate.get("offloaded"),
                activations_gb=measured.get("activations"), activations_estimate_gb=estimate.get("activations"),
                output_buffer_estimate_gb=estimate.get("output_buffer"))


def summarize_run(log: ParsedLog, meta: RunMetadata, run: str, skip_first: int) -> RunSummary:
    records = unique_iterations(log)
    kept = steady_state(records, skip_first)
    kept_iterations = {r.iteration for r in kept}
    source, memory = _memory_samples(log)
    ms_per_iter = _mean(r.elapsed_ms for r in kept)
    epoch_time, epoch_source = _epoch_time(log, meta, ms_per_iter)
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
        attempts=max(1, len(log.attempts)),
        nan_iterations=records[-1].nan_iterations if records else None,
        zero_stage=meta.zero_stage,
        offload=meta.offload,
        model=meta.model,
        world_size=meta.world_size,
        micro_batch=meta.micro_batch,
        global_batch=meta.global_batch,
        seq_length=meta.seq_length,
        last_iteration=records[-1].iteration if records else None,
        train_iters=records[-1].train_iters if records else None,
        intervals_used=len(kept),
        tgs_mean=_mean(r.tgs for r in kept),
        tokens_per_s=collective_tokens_per_s(kept, meta),
        ms_per_iter_mean=ms_per_iter,
        samples_per_s_mean=_mean(r.samples_per_second for r in kept),
        tflops_mean=_mean(r.tflops for r in kept),
        mfu_mean_pct=_mean(m.mfu_pct for m in memory if m.iteration in kept_iterations),
        epochs_done=len(log.epochs),
        epoch_time_s=epoch_time,
        epoch_time_source=epoch_source,
        mem_alloc_mean_gb=_mean(m.allocated_gb for m in memory),
        mem_alloc_max_gb=_max(m.allocated_gb for m in memory),
        max_mem_alloc_peak_gb=_max(m.max_allocated_gb for m in memory),
        memory_source=source,
        host_rss_mean_gb=_mean(m.host_rss_gb for m in memory),
        host_rss_peak_gb=_max([m.max_host_rss_gb for m in memory] + [m.host_rss_gb for m in memory]),
        model_state_measured_gb=measured_state,
        zero_estimate_gb=estimate,
        loss_first=losses[0] if losses else None,
        loss_last=losses[-1] if losses else None,
        epoch_losses=[e.lm_loss for e in log.epochs if e.lm_loss is not None],
        val_loss_last=validations[-1].lm_loss if validations else None,
        val_ppl_last=validations[-1].ppl if validations else None,
        loss_curve=[(tokens, r.lm_loss) for r in records
                    if r.lm_loss is not None and (tokens := _consumed_tokens(r, meta)) is not None],
        **_traffic(log, kept_iterations),
    )
