"""Parse Megatron-DeepSpeed training logs (ours and upstream's) into typed records.

A log is scanned for *records*, not lines: two ranks writing to one file can glue
records onto one line, and launchers put timestamps or rank tags in front, so each
record is found by the text that starts it and read up to where the next one starts.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

# The field regexes docs/log-lines.md promises to users' own scripts; they are used as-is below.
TGS_RE = re.compile(r"\(tgs\): (\d+\.\d+)")
ELAPSED_MS_RE = re.compile(r"elapsed time per iteration \(ms\): (\d+\.\d+)")
MEM_ALLOCATED_RE = re.compile(r", MemAllocated=(\d+\.\d+)GB")
MAX_MEM_ALLOCATED_RE = re.compile(r", MaxMemAllocated=(\d+\.\d+)GB")
LM_LOSS_RE = re.compile(r"lm loss: (\d+\.\d+E[+-]\d+)")
# zero-lab's comm line: bytes sent per iteration, measured, and the prediction (docs/zero-tradeoff.md)
COMM_RE = re.compile(r"comm at iteration +(\d+) \|.* total=(\d+\.\d+)MB \| bytes/param=(\d+\.\d+) \| "
                     r"predicted=(\d+\.\d+)MB \|")
# zero-lab's time line: ms per iteration by part, measured and predicted; the parts are name=value pairs
TIME_RE = re.compile(r"time at iteration +(\d+) \| measured: (.*?) \| predicted: (.*?) \|")
# zero-lab's progress line: iterations done of the run's, the time since the launch started and the ETA (H:MM:SS)
PROGRESS_RE = re.compile(r"progress at iteration +(\d+) \| (\d+)/(\d+) iterations \((\d+\.\d+)%\) \| "
                         r"elapsed (\d+:\d\d:\d\d) since launch \| ETA (\d+:\d\d:\d\d|unknown) \|")

# megatron/launch/attempt.py's header of each attempt of a run (a resumed run appends another)
_ATTEMPT_HEADER = r"\[zero-lab\] attempt (?P<anum>\d+) started (?P<atime>\S+ \S+) UTC"

# Old BigScience-era logs print seconds instead of milliseconds.
_ELAPSED_S_RE = re.compile(r"elapsed time per iteration \(s\): (\d+\.\d+)")
_ANSI_RE = re.compile(r"\x1b(?:\[[0-9;?]*[ -/]*[@-~]|[@-Z\\-_]|c)")

_RECORD_START_RE = re.compile(
    r"(?P<iteration>\biteration\s+(?P<it>\d+)\s*/\s*(?P<total>\d+)\s*\|)"
    r"|(?P<memory>\[Rank (?P<mrank>\d+)\] memory at iteration\s+(?P<mit>\d+)\s*\|)"
    r"|(?P<comm>\[Rank \d+\] comm at iteration\s+\d+\s*\|)"
    r"|(?P<time>\[Rank \d+\] time at iteration\s+\d+\s*\|)"
    r"|(?P<progress>\[Rank \d+\] progress at iteration\s+\d+\s*\|)"
    r"|(?P<megatron_memory>\[Rank (?P<grank>\d+)\] \(after (?P<git>\d+) iterations\) memory \(MB\))"
    r"|(?P<deepspeed>(?:epoch=\d+/micro_step=\d+/global_step=(?P<dsit>\d+),\s*)?RunningAvgSamplesPerSec=)"
    r"|(?P<validation>validation loss at (?:iteration\s+(?P<vit>\d+)|the end of training[^|]*?)\s*\|)"
    r"|(?P<epoch>\bepoch\s+(?P<ep>\d+) done\s*\|)"
    r"|(?P<model_state>model state memory per rank \(GB\)\s*\|)"
    r"|(?P<run_info>> run info\s*\|)"
    r"|(?P<parameters>> parameters\s*\|)"
    r"|(?P<saved>successfully saved checkpoint at iteration\s+(?P<svit>\d+) to )"
    r"|(?P<end>\[after training is done\])"  # Megatron's last line
    # megatron/training.py's TrainingError when too many iterations in a row were NaN/Inf
    r"|(?P<diverged>stopping at iteration\s+(?P<sit>\d+):)"
    # --exit-interval (ours and upstream), upstream's signal handler, or --exit-duration-in-mins (ours and upstream)
    r"|(?P<exited>exiting program (?:at iteration\s+(?P<eit>\d+)"
    r"|after receiving (?P<signal>SIG\w+)(?: at iteration\s+(?P<sigit>\d+))?"
    r"|after (?P<minutes>\d+(?:\.\d+)?(?:e-?\d+)?) minutes))"
    rf"|(?P<attempt>{_ATTEMPT_HEADER})"
)
# Megatron prints its parsed arguments as "  name ........ value" once at start-up.
_ARGUMENT_RE = re.compile(r"^\s*(?:\S+:\s+)?([a-z_0-9]+) \.{3,} (\S.*?)\s*$")


@dataclass
class IterationRecord:
    """One ` iteration N/M | ... |` line."""

    iteration: int
    train_iters: int
    consumed_samples: int | None = None
    consumed_tokens: int | None = None
    elapsed_ms: float | None = None
    lm_loss: float | None = None
    global_batch_size: int | None = None
    nan_iterations: int | None = None  # the run's count so far (Megatron's counter)
    samples_per_second: float | None = None
    tgs: float | None = None
    tflops: float | None = None
    curriculum_seqlen: int | None = None  # the sequence length of a curriculum's last step (docs/curriculum.md)
    # mixture of experts (docs/moe.md): the load-balancing loss added to the lm loss, the most loaded expert's
    # tokens over the mean, and the fraction of routes dropped by capacity, over the interval
    moe_loss: float | None = None
    expert_load: float | None = None
    tokens_dropped: float | None = None
    attempt: int = 0  # which start of training printed it: ParsedLog.starts' index
    # iterations the interval ending here spans (the last logged iteration of the same start to this one);
    # None for the first interval after a resume, whose start (the checkpoint's iteration) the log does not say
    interval_iterations: int | None = None


@dataclass
class MemoryRecord:
    """Accelerator/host memory of one rank at one logging step, in GB (2**30 bytes)."""

    source: str  # "zero-lab", "megatron" (report_memory) or "deepspeed" (engine timer)
    iteration: int | None
    rank: int | None
    allocated_gb: float | None = None
    max_allocated_gb: float | None = None
    host_rss_gb: float | None = None
    max_host_rss_gb: float | None = None
    mfu_pct: float | None = None
    hfu_pct: float | None = None
    attempt: int = 0  # ParsedLog.starts' index
    device: str | None = None  # zero-lab's line: the accelerator's kind (device=cpu, cuda); None in upstream lines


@dataclass
class CommRecord:
    """Bytes one rank sent per iteration in a logging interval, in MB (2**20 bytes): by kind of
    collective (all_reduce, reduce_scatter, all_gather, broadcast, p2p), total and predicted."""

    iteration: int
    by_kind_mb: dict[str, float]
    total_mb: float
    bytes_per_param: float
    predicted_mb: float
    attempt: int = 0  # ParsedLog.starts' index


@dataclass
class TimeRecord:
    """Milliseconds per iteration in a logging interval by part, measured (compute, communication, offload,
    total) and predicted (the same and overlap), each read by name: pairs added later are kept too."""

    iteration: int
    measured_ms: dict[str, float]
    predicted_ms: dict[str, float]
    attempt: int = 0  # ParsedLog.starts' index


@dataclass
class ProgressRecord:
    """One progress line: iterations done of the run's, the seconds since the launch that printed it started, and
    the seconds it expected the run still to take (None: unknown, the launch's first interval)."""

    iteration: int
    train_iters: int
    percent: float
    elapsed_s: int
    eta_s: int | None
    attempt: int = 0  # ParsedLog.starts' index


@dataclass
class ValidationRecord:
    iteration: int | None  # None: the end-of-training evaluation
    lm_loss: float | None
    ppl: float | None


@dataclass
class EpochRecord:
    epoch: int
    iteration: int | None
    consumed_samples: int | None
    epoch_time_s: float | None
    lm_loss: float | None
    attempt: int = 0  # ParsedLog.starts' index


@dataclass
class ModelStateRecord:
    """The once-printed measured model-state memory and the ZeRO paper's estimate (GB)."""

    measured: dict[str, float]
    estimate: dict[str, float]
    zero_stage: int | None
    dp_size: int | None
    dtype: str | None
    offload: str | None


@dataclass
class SaveRecord:
    """`successfully saved checkpoint at iteration N to DIR in S s (M MB)`, with --async-save also what training
    waited, the host copy and the background write (docs/log-lines.md, "The checkpoint lines")."""

    iteration: int
    seconds: float | None
    size_mb: float | None
    blocked_s: float | None = None  # --async-save's fields; None for a synchronous save (blocked: all of `seconds`)
    host_copy_mb: float | None = None
    background_s: float | None = None
    attempt: int = 0  # ParsedLog.starts' index


@dataclass
class AttemptRecord:
    """`[zero-lab] attempt N started <UTC time> ...`: one launch of the run (a resume appends another)."""

    number: int
    started: str
    resumed: bool = False  # "resuming from <checkpoint folder>", not "fresh start"


@dataclass
class ParsedLog:
    path: Path  # the log file; for a run logged one file per attempt (ALCF), the newest
    parts: list[Path] = field(default_factory=list)  # every file read, oldest attempt first
    iterations: list[IterationRecord] = field(default_factory=list)
    memory: list[MemoryRecord] = field(default_factory=list)
    comm: list[CommRecord] = field(default_factory=list)
    times: list[TimeRecord] = field(default_factory=list)
    progress: list[ProgressRecord] = field(default_factory=list)
    validations: list[ValidationRecord] = field(default_factory=list)
    epochs: list[EpochRecord] = field(default_factory=list)
    saves: list[SaveRecord] = field(default_factory=list)
    model_state: ModelStateRecord | None = None
    run_info: dict[str, str] = field(default_factory=dict)  # every start's run info line, the last winning
    run_infos: dict[int, dict[str, str]] = field(default_factory=dict)  # each start's own (starts' index)
    attempt_numbers: dict[int, int] = field(default_factory=dict)  # the attempt header's N, by the start it began
    parameters: dict[str, str] = field(default_factory=dict)  # the parameters line's: total, active per token, ...
    arguments: dict[str, str] = field(default_factory=dict)
    ended_mid_line: bool = False
    saw_end_marker: bool = False
    diverged_at: int | None = None  # the iteration of the "stopping at iteration N:" line
    exited_early: str | None = None  # why: "--exit-interval", "--exit-duration-in-mins" or the signal's name
    exited_at: int | None = None  # the iteration the exit line names, when it names one
    attempts: list[AttemptRecord] = field(default_factory=list)
    # One entry per start of training, True when it resumed from a checkpoint: each attempt header
    # starts one, and so does an iteration number going back within an attempt (upstream logs have
    # no headers: a resume appended to the same log shows only that way). Index 0 is the text before
    # any header, taken as a fresh start. Records carry the index of the start that printed them.
    starts: list[bool] = field(default_factory=lambda: [False])
    restarts_detected: int = 0  # starts found from iteration numbers going back
    _last_iteration: tuple[int, int] | None = None  # (iteration, its interval) last logged in this start

    @property
    def start(self) -> int:
        return len(self.starts) - 1

    @property
    def has_training_lines(self) -> bool:
        return bool(self.iterations or self.epochs)

    @property
    def trained_starts(self) -> list[int]:
        """The starts that logged training (iteration or epoch lines), in order: not those refused at start-up
        or that found nothing to train, which a run folder's log keeps too."""
        return sorted({r.attempt for r in self.iterations} | {e.attempt for e in self.epochs})

    @property
    def trained_run_info(self) -> dict[str, str]:
        """The run info line of the last start that trained: a later start refused after printing its own (at
        another batch size, say) did not run with it. In a log without attempt headers a start found from an
        iteration number going back printed its run info line before it was found: the latest start at or
        before it that printed one."""
        trained = self.trained_starts
        if not trained:
            return self.run_info
        printed = [start for start in self.run_infos if start <= trained[-1]]
        return self.run_infos[max(printed)] if printed else self.run_info

    @property
    def trained_attempt(self) -> int | None:
        """The attempt header's number (command.txt's `# attempt N`) of the last start that trained."""
        trained = self.trained_starts
        headed = [start for start in self.attempt_numbers if trained and start <= trained[-1]]
        return self.attempt_numbers[max(headed)] if headed else None


def _float(pattern: re.Pattern | str, text: str) -> float | None:
    match = re.search(pattern, text)
    return float(match.group(1)) if match else None


def _int(pattern: str, text: str) -> int | None:
    match = re.search(pattern, text)
    return int(match.group(1)) if match else None


def _parse_iteration(seg: str, it: int, total: int) -> IterationRecord:
    elapsed_ms = _float(ELAPSED_MS_RE, seg)
    if elapsed_ms is None:
        seconds = _float(_ELAPSED_S_RE, seg)
        elapsed_ms = seconds * 1000.0 if seconds is not None else None
    return IterationRecord(
        iteration=it,
        train_iters=total,
        consumed_samples=_int(r"consumed samples:\s*(\d+)", seg),
        consumed_tokens=_int(r"consumed tokens:\s*(\d+)", seg),
        elapsed_ms=elapsed_ms,
        lm_loss=_float(LM_LOSS_RE, seg),
        global_batch_size=_int(r"global batch size:\s*(\d+)", seg),
        nan_iterations=_int(r"number of nan iterations:\s*(\d+)", seg),
        samples_per_second=_float(r"samples per second:\s*(\d+\.\d+)", seg),
        tgs=_float(TGS_RE, seg),
        tflops=_float(r"TFLOPs:\s*(\d+\.\d+)", seg),
        curriculum_seqlen=_int(r"curriculum seqlen:\s*(\d+)", seg),
        moe_loss=_float(r"moe loss: (\S+) \|", seg),
        expert_load=_float(r"expert load max/mean: (\S+) \|", seg),
        tokens_dropped=_float(r"tokens dropped: (\S+) \|", seg),
    )


def _parse_memory(seg: str, source: str, iteration: int | None, rank: int | None) -> MemoryRecord:
    return MemoryRecord(
        source=source,
        iteration=iteration,
        rank=rank,
        allocated_gb=_float(MEM_ALLOCATED_RE, seg),
        max_allocated_gb=_float(MAX_MEM_ALLOCATED_RE, seg),
        host_rss_gb=_float(r"(?<![A-Za-z])HostRSS=(\d+\.\d+)GB", seg),
        max_host_rss_gb=_float(r"MaxHostRSS=(\d+\.\d+)GB", seg),
        mfu_pct=_float(r"MFU=(\d+\.\d+)%", seg),
        hfu_pct=_float(r"HFU=(\d+\.\d+)%", seg),
        device=(found.group(1) if (found := re.search(r"device=(\w+)", seg)) else None),
    )


def _parse_megatron_memory(seg: str, iteration: int, rank: int) -> MemoryRecord:
    """Upstream report_memory prints MB (2**20 bytes); convert to GB like the rest."""
    allocated = _float(r"(?<!max )allocated:\s*(\d+(?:\.\d+)?)", seg)
    max_allocated = _float(r"max allocated:\s*(\d+(?:\.\d+)?)", seg)
    return MemoryRecord(
        source="megatron",
        iteration=iteration,
        rank=rank,
        allocated_gb=allocated / 1024 if allocated is not None else None,
        max_allocated_gb=max_allocated / 1024 if max_allocated is not None else None,
    )


def _key_values(text: str) -> dict[str, float]:
    # signed: a measured compute time is the step's total less the rest, which rounding can take below 0
    return {k: float(v) for k, v in re.findall(r"(\w+)=(-?\d+(?:\.\d+)?)", text)}


def _parse_model_state(seg: str) -> ModelStateRecord:
    measured = re.search(r"measured:([^|]*)", seg)
    estimate = re.search(
        r"ZeRO estimate \(stage=(\d+), dp=(\d+), dtype=(\w+), offload=([\w+]+)\):([^|]*)", seg
    )
    return ModelStateRecord(
        measured=_key_values(measured.group(1)) if measured else {},
        estimate=_key_values(estimate.group(5)) if estimate else {},
        zero_stage=int(estimate.group(1)) if estimate else None,
        dp_size=int(estimate.group(2)) if estimate else None,
        dtype=estimate.group(3) if estimate else None,
        offload=estimate.group(4) if estimate else None,
    )


def _parse_comm(seg: str) -> CommRecord | None:
    match = COMM_RE.search(seg)
    if match is None:  # cut off before its last field
        return None
    kinds = {k: float(v) for k, v in re.findall(r" (\w+)=(\d+\.\d+)MB \|", seg) if k not in ("total", "predicted")}
    return CommRecord(iteration=int(match.group(1)), by_kind_mb=kinds, total_mb=float(match.group(2)),
                      bytes_per_param=float(match.group(3)), predicted_mb=float(match.group(4)))


def _parse_time(seg: str) -> TimeRecord | None:
    match = TIME_RE.search(seg)
    if match is None:  # cut off before its predicted part ended
        return None
    return TimeRecord(iteration=int(match.group(1)), measured_ms=_key_values(match.group(2)),
                      predicted_ms=_key_values(match.group(3)))


def seconds_of(duration: str) -> int:
    """H:MM:SS (the progress line's; hours unbounded) in seconds."""
    hours, minutes, seconds = (int(part) for part in duration.split(":"))
    return 3600 * hours + 60 * minutes + seconds


def _parse_progress(seg: str) -> ProgressRecord | None:
    match = PROGRESS_RE.search(seg)
    if match is None:  # cut off before its ETA
        return None
    eta = match.group(6)
    return ProgressRecord(iteration=int(match.group(1)), train_iters=int(match.group(3)),
                          percent=float(match.group(4)), elapsed_s=seconds_of(match.group(5)),
                          eta_s=None if eta == "unknown" else seconds_of(eta))


def _parse_run_info(seg: str) -> dict[str, str]:
    """The `key: value` fields of the run info or parameters line."""
    info = {}
    for part in seg.split("|")[1:]:
        key, sep, value = part.partition(":")
        if sep and key.strip():
            info[key.strip()] = value.strip()
    return info


def _new_start(log: ParsedLog, resumed: bool) -> None:
    # how the run ended is what its latest start says
    log.starts.append(resumed)
    log._last_iteration = None
    log.saw_end_marker, log.diverged_at, log.exited_early, log.exited_at = False, None, None, None


def _add_iteration(log: ParsedLog, record: IterationRecord) -> None:
    last = log._last_iteration
    if last is not None and record.iteration < last[0]:
        log.restarts_detected += 1  # a resume without a header: the iteration numbers went back
        _new_start(log, resumed=True)
        last = None
    if last is None:  # the first interval of a start: from iteration 0 only when it started fresh
        record.interval_iterations = None if log.starts[-1] else record.iteration
    elif record.iteration == last[0]:  # the same iteration printed again (another rank)
        record.interval_iterations = last[1]
    else:
        record.interval_iterations = record.iteration - last[0]
    record.attempt = log.start
    log._last_iteration = (record.iteration, record.interval_iterations)
    log.iterations.append(record)


def _add_record(log: ParsedLog, kind: str, match: re.Match, seg: str) -> None:
    if kind == "iteration":
        _add_iteration(log, _parse_iteration(seg, int(match["it"]), int(match["total"])))
    elif kind == "memory":
        log.memory.append(_parse_memory(seg, "zero-lab", int(match["mit"]), int(match["mrank"])))
        log.memory[-1].attempt = log.start
    elif kind == "comm":
        record = _parse_comm(seg)
        if record is not None:
            record.attempt = log.start
            log.comm.append(record)
    elif kind == "time":
        record = _parse_time(seg)
        if record is not None:
            record.attempt = log.start
            log.times.append(record)
    elif kind == "progress":
        record = _parse_progress(seg)
        if record is not None:
            record.attempt = log.start
            log.progress.append(record)
    elif kind == "megatron_memory":
        log.memory.append(_parse_megatron_memory(seg, int(match["git"]), int(match["grank"])))
    elif kind == "deepspeed":
        step = int(match["dsit"]) if match["dsit"] else None
        log.memory.append(_parse_memory(seg, "deepspeed", step, None))
    elif kind == "validation":
        iteration = int(match["vit"]) if match["vit"] else None
        log.validations.append(ValidationRecord(
            iteration,
            _float(r"lm loss value: (\d+\.\d+E[+-]\d+)", seg),
            _float(r"lm loss PPL: (\d+\.\d+E[+-]\d+)", seg),
        ))
    elif kind == "epoch":
        log.epochs.append(EpochRecord(
            epoch=int(match["ep"]),
            iteration=_int(r"iteration\s+(\d+)", seg),
            consumed_samples=_int(r"consumed samples:\s*(\d+)", seg),
            epoch_time_s=_float(r"epoch time \(s\):\s*(\d+\.\d+)", seg),
            lm_loss=_float(LM_LOSS_RE, seg),
            attempt=log.start,
        ))
    elif kind == "saved":
        log.saves.append(SaveRecord(
            int(match["svit"]), _float(r" in (\d+\.\d+) s \(", seg), _float(r"\((\d+\.\d+) MB\)", seg),
            _float(r"training blocked (\d+\.\d+) s", seg), _float(r"host copy (\d+\.\d+) MB", seg),
            _float(r"background (\d+\.\d+) s", seg), attempt=log.start))
    elif kind == "model_state":
        log.model_state = _parse_model_state(seg)
    elif kind == "run_info":
        log.run_info.update(_parse_run_info(seg))
        log.run_infos.setdefault(log.start, {}).update(_parse_run_info(seg))
    elif kind == "parameters":
        log.parameters.update(_parse_run_info(seg))
    elif kind == "end":
        log.saw_end_marker = True
    elif kind == "diverged":
        log.diverged_at = int(match["sit"])
    elif kind == "exited":
        log.exited_early = match["signal"] or ("--exit-duration-in-mins" if match["minutes"] else "--exit-interval")
        iteration = match["eit"] or match["sigit"]
        log.exited_at = int(iteration) if iteration else None
    elif kind == "attempt":
        resumed = "resuming from" in seg
        log.attempts.append(AttemptRecord(int(match["anum"]), match["atime"], resumed))
        _new_start(log, resumed)
        log.attempt_numbers[log.start] = int(match["anum"])


def parse_line(log: ParsedLog, line: str) -> None:
    """Add every record that starts in `line` to `log`."""
    matches = list(_RECORD_START_RE.finditer(line))
    if not matches:
        arg = _ARGUMENT_RE.match(line)
        if arg:
            log.arguments.setdefault(arg.group(1), arg.group(2))
        return
    for i, match in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
        # Each alternative is one outer named group that closes last, so lastgroup is its kind.
        _add_record(log, match.lastgroup, match, line[match.start():end])


def strip_ansi(text: str) -> str:
    return _ANSI_RE.sub("", text)


def _read(path: Path) -> str:
    """A log's text. Undecodable bytes are replaced: a log is evidence, not input to reject."""
    return strip_ansi(Path(path).read_bytes().decode("utf-8", errors="replace"))


def _started(path: Path) -> tuple[str, float]:
    """When a log's first attempt started (its header), else its modification time: the order of attempts."""
    match = re.search(_ATTEMPT_HEADER, _read(path))
    return (match["atime"] if match else "", Path(path).stat().st_mtime)


def parse_log(*paths: Path) -> ParsedLog:
    """Parse one log file, or the files of one run logged one file per attempt, oldest attempt first."""
    paths = sorted((Path(p) for p in paths), key=_started) if len(paths) > 1 else [Path(p) for p in paths]
    log = ParsedLog(path=paths[-1], parts=paths)
    for path in paths:
        text = _read(path)
        log.ended_mid_line = bool(text) and not text.endswith(("\n", "\r"))
        lines = text.splitlines()
        if log.ended_mid_line and lines:
            # Every field ends with " |"; a number cut off before its bar may be cut short
            # (7.1234E+0 for 7.1234E+01), so keep only the fields that were finished.
            lines[-1] = lines[-1][: lines[-1].rfind("|") + 1]
        for line in lines:
            parse_line(log, line)
    return log
