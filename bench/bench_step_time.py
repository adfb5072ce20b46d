"""Step time measured against predicted: the six examples_zero drivers trained as users run them, each run's
time lines (docs/log-lines.md) read back, milliseconds per iteration measured beside what the start-up
probes predicted (megatron/accounting/predict/step_time.py).

Two parts, each one table:

  local:     one host, 2 CPU ranks over loopback (torchrun), DP, Z1, Z2, Z3, Z3_OL, Z3_NVMe;
  two hosts: tools/virtual_cluster.py's node0 and node1 joined by a tbf-shaped 200 Mbit/s link, one rank
             each (torchrun with NNODES=2, as tests/test_multi_node.py), Z1 and Z3. Needs root.

Every driver runs with its CPU defaults (tiny preset, seq 128, micro-batch 4, log interval 5) on the dolly
sample committed in data/samples/, prepared by tools/process_databricks_gpt2.sh as the tests prepare it;
other driver variables in the environment (MODEL_SIZE, SEQ_LEN, ...) are passed on. Measured ms/iter is the
mean over the logging intervals of the time line's measured total, the first interval (warm-up) left out;
predicted is the time line's predicted total; the error is (predicted - measured) / measured. Each row also
gives the steady intervals' spread (standard deviation over mean) and the cores that other work on the machine
used during the run (all CPU time in /proc/stat less the bench's own and its runs'): a row measured beside
other work shows it, and --quiet-wait waits for a quiet machine before each run. On the two
hosts each rank gets one OpenMP thread (OMP_NUM_THREADS=1): both virtual hosts share this machine's cores,
as two ranks on one host do, where torchrun gives each one thread.

The tiny preset at seq 128 suits the 200 Mbit/s link: stage 1 sends 26.1 MB per iteration per rank (comm
line), over a second at 25 MB/s, against about 0.4 s of compute, so communication dominates and a run of
60 iterations takes 4 to 5 minutes.

Targets: every run's prediction within 20% of its measured time; on two hosts, Z3 at least 1.1x Z1's
measured time (stage 3 sends 1.5x stage 1's bytes).

    python bench/bench_step_time.py                      # both parts
    python bench/bench_step_time.py --local --iters 60 --json step_time.json
    python bench/bench_step_time.py --two-hosts --runs-dir /tmp/step_runs   # keep the run folders
    python bench/bench_step_time.py --quiet-wait 10 --json step_time.json  # on a shared machine
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from common import REPO, BenchError, OtherWork, Stopped, free_port, machine, stop_on_sigterm

LOCAL_EXPERIMENTS = ("DP", "Z1", "Z2", "Z3", "Z3_OL", "Z3_NVMe")
TWO_HOST_EXPERIMENTS = ("Z1", "Z3")
HOSTS = ("node0", "node1")
BANDWIDTH = "200mbit"
CLUSTER_NAME = "zlsteptime"
TOLERANCE_PCT = 20.0
MIN_Z3_OVER_Z1 = 1.1
RATIO_TARGET = f"two hosts: measured Z3/Z1 time at least {MIN_Z3_OVER_Z1}x"
PARTS = ("compute", "communication", "offload")
# Driver variables the bench sets itself, or that would change what the run is (a resume, another length)
OWNED_VARIABLES = ("DATA_PATH", "VOCAB_FILE", "MERGE_FILE", "RUNS_DIR", "RUN_NAME", "TRAIN_ITERS", "TRAIN_EPOCHS",
                   "MASTER_PORT", "MASTER_ADDR", "NNODES", "NODE_RANK", "NGPUS", "FRESH", "DRY_RUN", "INIT_HF")

TIME_LINE = re.compile(r"^\[Rank (\d+)\] time at iteration +(\d+) \| measured: (.*?) \| predicted: (.*?) \|", re.M)
COMM_LINE = re.compile(r"^\[Rank (\d+)\] comm at iteration +(\d+) \|.* total=(\d+\.\d+)MB \|", re.M)
PART_VALUE = re.compile(r"(\w+)=(-?\d+(?:\.\d+)?)ms")
RUN_INFO = re.compile(r"^ > run info \| (.*)$", re.M)
PROBE_LINE = re.compile(r"^ > step time predicted \| (.*)$", re.M)
ERROR_LINE = re.compile(r"^error: .*$", re.M)


# ---- reading a training log ----

@dataclass(frozen=True)
class Interval:
    """One time line: milliseconds per iteration over a logging interval, by part."""
    iteration: int
    measured: dict[str, float]
    predicted: dict[str, float]


def time_lines(log: str) -> list[Interval]:
    """The lowest rank's time lines (rank 0's; the only ones a run's train.log holds), in log order."""
    found = [(int(rank), Interval(int(iteration), parse_parts(measured), parse_parts(predicted)))
             for rank, iteration, measured, predicted in TIME_LINE.findall(log)]
    first = min((rank for rank, _ in found), default=None)
    return [interval for rank, interval in found if rank == first]


def parse_parts(text: str) -> dict[str, float]:
    """'compute=1.0ms communication=2.0ms' -> {'compute': 1.0, 'communication': 2.0}; read by name."""
    return {name: float(value) for name, value in PART_VALUE.findall(text)}


def sent_mb(log: str) -> dict[int, float]:
    """{iteration: MB the lowest rank sent per iteration} from its comm lines."""
    found = [(int(rank), int(iteration), float(total)) for rank, iteration, total in COMM_LINE.findall(log)]
    first = min((rank for rank, _, _ in found), default=None)
    return {iteration: total for rank, iteration, total in found if rank == first}


@dataclass
class Result:
    """One driver's run, reduced to the steady intervals (all but the first)."""
    experiment: str
    measured: dict[str, float]  # mean ms/iter per part, and total
    predicted: dict[str, float]  # mean ms/iter per part, overlap and total
    intervals: int  # steady intervals averaged
    spread_pct: float  # standard deviation of the intervals' measured totals over their mean
    sent_mb_per_iter: float | None  # from the comm lines, same intervals
    run_info: str = ""
    probes: str = ""
    others_cores: float | None = None  # CPU the machine spent on anything but this run, in cores, during the run

    @property
    def error_pct(self) -> float:
        return 100.0 * (self.predicted["total"] - self.measured["total"]) / self.measured["total"]

    def gap_ms(self, part: str) -> float:
        """Predicted minus measured for one part; predicted communication net of the overlap it expects
        (measured communication is the time blocked, which is what overlap leaves)."""
        predicted = self.predicted.get(part, 0.0)
        if part == "communication":
            predicted -= self.predicted.get("overlap", 0.0)
        return predicted - self.measured.get(part, 0.0)


def summarize(experiment: str, log: str) -> Result:
    """Means over the steady intervals of the run's time lines; fails (naming what is missing) without them."""
    intervals = time_lines(log)
    if not intervals:
        raise BenchError("no time lines in its log: this checkout's training loop prints none (issue 32)")
    if len(intervals) < 2:
        raise BenchError(f"{len(intervals)} time line in its log: no interval after the first (more --iters)")
    steady = intervals[1:]
    measured = _means([interval.measured for interval in steady])
    predicted = _means([interval.predicted for interval in steady])
    totals = [interval.measured["total"] for interval in steady]
    spread = 100.0 * statistics.pstdev(totals) / statistics.fmean(totals)
    sent = sent_mb(log)
    steady_sent = [sent[interval.iteration] for interval in steady if interval.iteration in sent]
    info, probes = RUN_INFO.search(log), PROBE_LINE.search(log)
    return Result(experiment, measured, predicted, len(steady), spread,
                  statistics.fmean(steady_sent) if steady_sent else None,
                  run_info=info.group(1).strip(" |") if info else "", probes=probes.group(1) if probes else "")


def _means(dicts: list[dict[str, float]]) -> dict[str, float]:
    names = [name for name in dicts[0] if all(name in d for d in dicts)]
    return {name: statistics.fmean(d[name] for d in dicts) for name in names}


# ---- printing ----

def table(results: list[Result], failures: dict[str, str]) -> str:
    """One markdown table: a row per run, measured beside predicted, by part."""
    lines = ["| driver | measured ms/iter | predicted ms/iter | error | compute meas / pred | communication meas / pred"
             " | offload meas / pred | overlap pred | sent MB/iter | intervals | spread | others' CPU |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        parts = " | ".join(f"{r.measured.get(part, 0.0):.1f} / {r.predicted.get(part, 0.0):.1f}" for part in PARTS)
        sent = "n/a" if r.sent_mb_per_iter is None else f"{r.sent_mb_per_iter:.3f}"
        lines.append(f"| {r.experiment} | {r.measured['total']:.1f} | {r.predicted['total']:.1f} | "
                     f"{r.error_pct:+.1f}% | {parts} | {r.predicted.get('overlap', 0.0):.1f} | {sent} | "
                     f"{r.intervals} | {r.spread_pct:.1f}% | {_cores(r.others_cores)} |")
    for experiment, why in failures.items():
        lines.append(f"| {experiment} | failed: {why} |" + " |" * 11)
    return "\n".join(lines)


def host_line(r: Result) -> str:
    """The predicted total's error with the host part (the time line's host=) and without it."""
    host, measured = r.predicted["host"], r.measured["total"]
    without = 100.0 * (r.predicted["total"] - host - measured) / measured
    return (f"host {r.experiment}: predicted host={host:.1f} ms/iter; error {r.error_pct:+.1f}% with it, "
            f"{without:+.1f}% without")


def _cores(cores: float | None) -> str:
    return "n/a" if cores is None else f"{cores:.2f} cores"


def diagnosis(r: Result) -> str:
    """Which part carries the gap between predicted and measured, from the split."""
    gap = r.predicted["total"] - r.measured["total"]
    part = max(PARTS, key=lambda name: abs(r.gap_ms(name)))
    predicted = r.predicted.get(part, 0.0) - (r.predicted.get("overlap", 0.0) if part == "communication" else 0.0)
    direction = "over" if gap > 0 else "under"
    return (f"predicted {r.predicted['total']:.1f} ms/iter, measured {r.measured['total']:.1f}: "
            f"{direction}-predicted by {abs(gap):.1f} ms, of which {part} {r.gap_ms(part):+.1f} ms "
            f"(predicted {predicted:.1f} ms, measured {r.measured.get(part, 0.0):.1f} ms); "
            + ", ".join(f"{name} {r.gap_ms(name):+.1f} ms" for name in PARTS if name != part))


def error_target(experiment: str, where: str = "") -> str:
    return f"{where}{experiment} predicted within {TOLERANCE_PCT:.0f}% of measured"


def error_verdict(r: Result, where: str = "") -> dict:
    met = abs(r.error_pct) <= TOLERANCE_PCT
    text = (f"met ({r.error_pct:+.1f}%)" if met else
            f"missed by {abs(r.error_pct):.1f}% ({TOLERANCE_PCT:.0f}% allowed; {diagnosis(r)})")
    return dict(target=error_target(r.experiment, where), met=met, verdict=text, error_pct=r.error_pct)


def ratio_verdict(z1: Result, z3: Result) -> dict:
    ratio = z3.measured["total"] / z1.measured["total"]
    met = ratio >= MIN_Z3_OVER_Z1
    sent = ("" if z1.sent_mb_per_iter is None or z3.sent_mb_per_iter is None else
            f"Z3 sent {z3.sent_mb_per_iter:.3f} MB/iter, Z1 {z1.sent_mb_per_iter:.3f} "
            f"({z3.sent_mb_per_iter / z1.sent_mb_per_iter:.2f}x); ")
    why = (f"{sent}communication measured Z3 {z3.measured.get('communication', 0.0):.1f} ms, "
           f"Z1 {z1.measured.get('communication', 0.0):.1f} ms; compute Z3 {z3.measured.get('compute', 0.0):.1f} ms, "
           f"Z1 {z1.measured.get('compute', 0.0):.1f} ms")
    text = (f"met ({ratio:.3f}x; {why})" if met else
            f"missed by {MIN_Z3_OVER_Z1 - ratio:.3f} ({ratio:.3f}x, {MIN_Z3_OVER_Z1}x wanted; {why})")
    return dict(target=RATIO_TARGET, met=met, verdict=text, ratio=ratio)


def not_measured(target: str, why: str) -> dict:
    return dict(target=target, met=None, verdict=f"not measured ({why})")


def settings(results: list[Result]) -> list[str]:
    """The run info lines' fields that every run shares (the stage and offload are the rows' own)."""
    fields = [[f for f in r.run_info.split(" | ") if not f.startswith(("zero stage:", "offload:"))]
              for r in results if r.run_info]
    return [f for f in fields[0] if all(f in other for other in fields)] if fields else []


def report(title: str, results: list[Result], failures: dict[str, str], targets: list[dict]) -> str:
    lines = [f"## {title}", ""]
    if results:
        lines.append(f"settings (run info): {' | '.join(settings(results))}")
    lines += ["", table(results, failures), ""]
    lines += [f"probes {r.experiment}: {r.probes}" for r in results if r.probes]
    lines += [host_line(r) for r in results if "host" in r.predicted]
    lines += [""] + [f"target: {t['target']}: {t['verdict']}" for t in targets]
    return "\n".join(lines) + "\n"


# ---- what else the machine does ----


def wait_for_quiet(minutes: float, threshold: float = 0.25, window: float = 15.0) -> None:
    """Wait (at most `minutes`) until other work uses under `threshold` cores over `window` seconds."""
    deadline = time.monotonic() + 60.0 * minutes
    while True:
        other = OtherWork().start()
        time.sleep(window)
        cores = other.cores()
        if cores < threshold or time.monotonic() > deadline:
            return
        print(f"[bench] other work uses {cores:.2f} cores: waiting for a quiet machine", file=sys.stderr, flush=True)


# ---- running the drivers ----

def driver_env(data_dir: Path, runs_dir: Path, iters: int, **overrides) -> dict:
    """The environment a user's shell would give a driver, with the bench's data, runs folder and length."""
    env = {name: value for name, value in os.environ.items() if name not in OWNED_VARIABLES}
    env.update(DS_ACCELERATOR=env.get("DS_ACCELERATOR", "cpu"), HF_HUB_OFFLINE="1", PYTHON=sys.executable,
               PATH=str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", ""),
               DATA_PATH=str(data_dir / "dolly_text_document"), VOCAB_FILE=str(data_dir / "gpt2-vocab.json"),
               MERGE_FILE=str(data_dir / "gpt2-merges.txt"), RUNS_DIR=str(runs_dir), TRAIN_ITERS=str(iters))
    env.update({name: str(value) for name, value in overrides.items()})
    return env


def prepare_data(folder: Path) -> Path:
    """The committed dolly sample, prepared by the user's command (as tests/conftest.py's dolly_data_dir)."""
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, DATA_DIR=str(folder), DOLLY_JSONL=str(REPO / "data" / "samples" / "dolly-sample.jsonl"),
               HF_HUB_OFFLINE="1", PYTHON=sys.executable)
    env.pop("VOCAB_FILE", None), env.pop("MERGE_FILE", None)
    done = subprocess.run(["bash", str(REPO / "tools" / "process_databricks_gpt2.sh")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"error: tools/process_databricks_gpt2.sh failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return folder


def driver(experiment: str) -> str:
    return str(REPO / "examples_zero" / f"gpt_deepspeed_{experiment}.sh")


def failure_reason(output: str, returncode: int) -> str:
    last = ERROR_LINE.findall(output) or output.strip().splitlines() or ["no output"]
    return f"exit {returncode}: {last[-1]}"


def run_local(experiment: str, env: dict, runs_dir: Path, timeout: float) -> str:
    """One driver on this host (2 ranks under torchrun, the drivers' CPU default); returns its train.log."""
    output = runs_dir / f"{experiment}.out"
    with open(output, "w") as out:
        process = subprocess.Popen(["bash", driver(experiment)], cwd=REPO, env={**env, "MASTER_PORT": str(free_port())},
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise BenchError(f"still running after {timeout:.0f} s (output: {output})")
        finally:
            if process.poll() is None:  # timed out, or the bench was stopped: end the driver's session
                os.killpg(process.pid, signal.SIGKILL)  # its own session: torchrun and its ranks
                process.wait()
    if process.returncode != 0:
        raise BenchError(f"{failure_reason(output.read_text(), process.returncode)} (output: {output})")
    return (runs_dir / run_name(experiment) / "train.log").read_text()


def run_name(experiment: str) -> str:
    return f"gpt_{os.environ.get('MODEL_SIZE', 'tiny')}_{experiment}"


def run_two_hosts(cluster, experiment: str, env: dict, runs_dir: Path, timeout: float) -> str:
    """One driver on both hosts, NNODES=2 and one rank each, rank 0 on node0; returns node0's train.log."""
    port, processes, outputs = free_port(), {}, {}
    try:
        for node_rank, host in enumerate(HOSTS):
            outputs[host] = runs_dir / f"{experiment}.{host}.out"
            with open(outputs[host], "w") as out:
                processes[host] = cluster.popen(
                    host, ["bash", driver(experiment)], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                    env={**env, "NNODES": "2", "NODE_RANK": str(node_rank), "NGPUS": "1", "MASTER_ADDR": HOSTS[0],
                         "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
        deadline = time.monotonic() + timeout
        for host, process in processes.items():
            try:
                process.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise BenchError(f"still running after {timeout:.0f} s (output: {outputs[host]})")
        for host, process in processes.items():
            if process.returncode != 0:
                raise BenchError(f"{host}: {failure_reason(outputs[host].read_text(), process.returncode)} "
                                 f"(output: {outputs[host]})")
    finally:
        _end_processes_in(cluster, processes)
    return (runs_dir / run_name(experiment) / "train.log").read_text()


def _end_processes_in(cluster, processes: dict) -> None:
    """Whatever a failed run left inside the hosts, ended by PID (the hosts' own processes only)."""
    if all(process.poll() is not None for process in processes.values()):
        return
    for host in HOSTS:
        for pid in cluster.pids_in(host):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for process in processes.values():
        process.wait(timeout=30)


# ---- the two parts ----

def measure(experiments, run, quiet_wait: float) -> tuple[list[Result], dict[str, str]]:
    results, failures = [], {}
    for experiment in experiments:
        if quiet_wait:
            wait_for_quiet(quiet_wait)
        started, other = time.monotonic(), OtherWork().start()
        try:
            log = run(experiment)
            others = other.cores()
            results.append(summarize(experiment, log))
            results[-1].others_cores = others
            print(f"[bench] {experiment}: done in {time.monotonic() - started:.0f} s, other work "
                  f"{_cores(others)}", file=sys.stderr, flush=True)
        except BenchError as error:
            failures[experiment] = str(error)
            print(f"[bench] {experiment}: failed: {error}", file=sys.stderr, flush=True)
    return results, failures


def error_targets(experiments, results: list[Result], failures: dict[str, str], where: str = "") -> list[dict]:
    by_name = {r.experiment: r for r in results}
    return [error_verdict(by_name[e], where) if e in by_name else not_measured(error_target(e, where), failures[e])
            for e in experiments]


def local_part(data_dir: Path, runs_dir: Path, opts) -> dict:
    runs = runs_dir / "local"
    runs.mkdir(parents=True, exist_ok=True)
    env = driver_env(data_dir, runs, opts.iters)
    results, failures = measure(LOCAL_EXPERIMENTS, lambda e: run_local(e, env, runs, opts.timeout), opts.quiet_wait)
    targets = error_targets(LOCAL_EXPERIMENTS, results, failures)
    return dict(title="One host, 2 CPU ranks over loopback", results=results, failures=failures, targets=targets)


def two_host_part(data_dir: Path, runs_dir: Path, opts) -> dict:
    title = f"Two hosts (tools/virtual_cluster.py), {BANDWIDTH} link, one rank each"
    runs = runs_dir / "two_hosts"
    runs.mkdir(parents=True, exist_ok=True)
    from tools.vcluster import ClusterError, VirtualCluster

    try:
        cluster = VirtualCluster.up(hosts=len(HOSTS), name=CLUSTER_NAME, bandwidth=BANDWIDTH)
    except ClusterError as error:
        why = f"no virtual cluster: {error}"
        targets = [not_measured(error_target(e, "two hosts: "), why) for e in TWO_HOST_EXPERIMENTS]
        targets.append(not_measured(RATIO_TARGET, why))
        return dict(title=title, results=[], failures={}, targets=targets)
    try:
        env = driver_env(data_dir, runs, opts.iters)
        results, failures = measure(TWO_HOST_EXPERIMENTS,
                                    lambda e: run_two_hosts(cluster, e, env, runs, opts.timeout), opts.quiet_wait)
    finally:
        cluster.down()
    targets = error_targets(TWO_HOST_EXPERIMENTS, results, failures, where="two hosts: ")
    by_name = {r.experiment: r for r in results}
    if "Z1" in by_name and "Z3" in by_name:
        targets.append(ratio_verdict(by_name["Z1"], by_name["Z3"]))
    else:
        targets.append(not_measured(RATIO_TARGET, "a run failed"))
    return dict(title=title, results=results, failures=failures, targets=targets)


# ---- the bench ----


def options(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local", action="store_true", help="run the one-host part only")
    parser.add_argument("--two-hosts", action="store_true", help="run the two-host part only (root)")
    parser.add_argument("--iters", type=int, default=60,
                        help="training iterations per run (default 60: 12 intervals at the drivers' LOG_INTERVAL 5)")
    parser.add_argument("--json", help="write the figures and verdicts to this file")
    parser.add_argument("--data-dir", help="a prepared data folder (dolly_text_document.{bin,idx}, gpt2-vocab.json,"
                                           " gpt2-merges.txt); default: the committed sample, prepared in a temporary"
                                           " one")
    parser.add_argument("--runs-dir", help="keep the run folders and outputs here (default: a temporary folder)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one driver run may take (default 900)")
    parser.add_argument("--quiet-wait", type=float, default=0, metavar="MINUTES",
                        help="before each run, wait up to MINUTES for other work to use under a quarter of a core "
                             "(default 0: start at once); each row gives the cores other work used during its run")
    opts = parser.parse_args(argv)
    interval = int(os.environ.get("LOG_INTERVAL", "5"))
    if opts.iters < 3 * interval:
        parser.error(f"--iters {opts.iters}: expected at least 3 logging intervals of LOG_INTERVAL {interval} "
                     f"({3 * interval}): the first is warm-up, and the rest are averaged")
    if not opts.local and not opts.two_hosts:
        opts.local = opts.two_hosts = True
    return opts


def main(argv) -> int:
    opts = options(argv)
    stop_on_sigterm()
    with tempfile.TemporaryDirectory(prefix="bench_step_time.") as tmp:
        data_dir = Path(opts.data_dir) if opts.data_dir else prepare_data(Path(tmp) / "data")
        runs_dir = Path(opts.runs_dir or Path(tmp) / "runs").resolve()
        start = machine()
        print(f"machine: {start['cpus']} CPUs, load average {start['load_average']} at start; torch {start['torch']}, "
              f"deepspeed {start['deepspeed']}; commit {start['commit']}; {start['date']}; {opts.iters} iterations "
              f"per run, the first logging interval left out\n")
        parts = []
        if opts.local:
            parts.append(local_part(data_dir, runs_dir, opts))
            print(report(parts[-1]["title"], parts[-1]["results"], parts[-1]["failures"], parts[-1]["targets"]),
                  flush=True)
        if opts.two_hosts:
            parts.append(two_host_part(data_dir, runs_dir, opts))
            print(report(parts[-1]["title"], parts[-1]["results"], parts[-1]["failures"], parts[-1]["targets"]),
                  flush=True)
        load_end = round(os.getloadavg()[0], 2)
        print(f"load average at the end: {load_end}")
        if opts.json:
            record = dict(machine={**start, "load_average_end": load_end}, iters=opts.iters,
                          parts=[dict(title=p["title"], failures=p["failures"], targets=p["targets"],
                                      results=[{**asdict(r), "error_pct": r.error_pct} for r in p["results"]])
                                 for p in parts])
            Path(opts.json).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except Stopped as stopped:
        sys.exit(f"[bench] {stopped}: the running driver and any virtual cluster were taken down")
