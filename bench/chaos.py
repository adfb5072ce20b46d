"""A run full of faults: two hosts train, faults hit them at random iterations, the run restarts itself each time.

    bash bench/chaos.sh --faults 10 --seed 1 [--out bench/results/chaos-seed1.md] [--kinds kill_rank,cut_link]
    bash bench/chaos.sh --async-save --faults 2 --kinds kill_rank_writing

Two hosts of tools/virtual_cluster.py (namespaces joined by a switch, one CPU rank each) run the Z1 driver under
torchrun (NNODES=2) with MAX_RESTARTS, the tiny model, dropout off, a save every SAVE_INTERVAL iterations (with
--async-save in the background, ASYNC_SAVE=1) and a loss line every iteration. The seed picks the faults' kinds and
iterations and where each lands:

    kill_rank         SIGKILL of one host's rank (the out-of-memory killer)
    kill_rank_saving  SIGKILL of one host's rank while a checkpoint is being written
    cut_link          node1's link goes down until the ranks have given each other up (a minute of silence)
    sigterm_job       SIGTERM to both hosts' jobs (a scheduler's preemption): they save and stop, and this
                      bench starts them again as a requeue would
    full_disk         the next save hits a file-size limit (RLIMIT_FSIZE of node1's rank, set while it runs)
    flip_byte         one byte flipped in a file of the newest checkpoint, then a rank killed: the resume must
                      find the damage and take the checkpoint before
    kill_rank_writing --async-save only: SIGKILL of one host's rank while its writer thread writes a checkpoint
                      in the background; when the job restarts, `latest` and the resume rule still name the
                      checkpoint before, which the restart loads, and the killed write committed nothing

Each fault waits until the run has made new progress since the last one. A fault-free run of the same seed comes
first. At the end a table: faults by kind, recoveries, iterations computed twice, seconds lost per fault,
checkpoints lost (a save reported done that is not intact at the end: must be 0) and whether every loss the
faulted run printed equals the fault-free run's (within 1e-5, relative). Exit status 0 when nothing was lost and
the losses are equal, 1 otherwise. SIGINT or SIGTERM ends it with everything it started taken down (processes,
namespaces, mounts). Needs root (namespaces), and the dolly data the README's set-up prepares.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from analysis.collect import collect
from chaos_faults import HOSTS, ChaosError, Fault, Injector, LogWatch, TwoHostJob
from megatron.checkpointing import protocol
from tools.vcluster import ClusterError, VirtualCluster

REPO = Path(__file__).resolve().parent.parent

KINDS = ("kill_rank", "kill_rank_saving", "cut_link", "sigterm_job", "full_disk", "flip_byte", "kill_rank_writing")
ASYNC_KINDS = ("kill_rank_writing",)  # only an --async-save run has a writer thread
SAVE_INTERVAL = 2
FIRST_FAULT = 3  # iterations before the first fault: the run has saved once
FAULT_GAP = 4  # iterations between two faults' planned iterations
MASTER_PORT = 29611  # inside the hosts' own network namespaces: no other program there (the faulted run: +1)
SUBNET = "10.251.0.0/24"  # not the suite's cluster's (10.250.0.0/24): both may be up at once
LOSS_TOLERANCE = 1e-5
RECOVERY_TIMEOUT_S = 400  # a fault not recovered from by then ends the bench


def plan(faults: int, seed: int, kinds: tuple[str, ...]) -> tuple[list[Fault], int]:
    """The faults the seed picks (every kind once before any twice) and the run's length in iterations."""
    rng = random.Random(seed)
    chosen: list[str] = []
    while len(chosen) < faults:
        chosen += rng.sample(kinds, len(kinds))
    chosen = chosen[:faults]
    planned, iteration = [], FIRST_FAULT
    for kind in chosen:
        iteration += rng.randint(0, 2)
        host = rng.choice(HOSTS) if kind in ("kill_rank", "kill_rank_saving", "flip_byte", "kill_rank_writing") \
            else "node1"
        planned.append(Fault(iteration, kind, "both" if kind == "sigterm_job" else host))
        iteration += FAULT_GAP
    return planned, iteration + 2


def driver_env(runs: Path, iterations: int, restarts: int, port: int, async_save: bool) -> dict:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "", "RUNS_DIR": str(runs),
           "ASYNC_SAVE": "1" if async_save else "0",
           "NNODES": "2", "NGPUS": "1", "MASTER_ADDR": HOSTS[0], "MASTER_PORT": str(port),
           "MODEL_SIZE": "tiny", "SEQ_LEN": "64", "MICRO_BATCH": "4", "TRAIN_ITERS": str(iterations),
           "LOG_INTERVAL": "1", "SAVE_INTERVAL": str(SAVE_INTERVAL), "EVAL_INTERVAL": str(iterations),
           "EVAL_ITERS": "1", "MAX_RESTARTS": str(restarts), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("FRESH", None)
    return env


NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]


def run_job(cluster: VirtualCluster, runs: Path, iterations: int, faults: list[Fault], seed: int,
            restarts: int, port: int, async_save: bool) -> tuple[LogWatch, int, float]:
    """One run to its end: (what its logs said, how many times it was launched, seconds it took)."""
    runs.mkdir(parents=True, exist_ok=True)
    watch = LogWatch(runs / "gpt_tiny_Z1")
    job = TwoHostJob(cluster, driver_env(runs, iterations, restarts, port, async_save), NO_DROPOUT, runs / "driver")
    inject = Injector(cluster, job, watch, random.Random(seed + 1))
    start = time.monotonic()
    job.start()
    pending = list(faults)
    try:
        while True:
            watch.poll()
            for fault in faults:
                if fault.injected_at is not None and fault.recovered_at is None:
                    recovery = watch.recovery(fault.injected_at)
                    if recovery is not None:
                        fault.progress_at_fault, fault.recovered_at = recovery
            recovered = all(f.recovered_at is not None for f in faults if f.injected_at is not None)
            if pending and recovered and watch.progress >= pending[0].iteration and job.running():
                fault = pending.pop(0)
                fault.injected_at = time.monotonic()
                fault.note = inject(fault)
                print(f"[chaos] {time.monotonic() - start:6.1f} s  iteration {watch.progress:3d}  "
                      f"{fault.kind}: {fault.note}", flush=True)
            if not job.running():
                codes = job.returncodes()
                watch.poll()
                if set(codes.values()) != {0}:
                    raise ChaosError(f"the job failed (exit status {codes}):\n{job.tail()}")
                if protocol.read_latest(str(watch.run_dir / "checkpoints")) == protocol.tag_name(iterations):
                    break
                job.start()  # stopped by SIGTERM with a checkpoint saved: a requeue starts it again
            stalled = [f for f in faults if f.injected_at and f.recovered_at is None
                       and time.monotonic() - f.injected_at > RECOVERY_TIMEOUT_S]
            if stalled:
                raise ChaosError(f"no progress {RECOVERY_TIMEOUT_S} s after {stalled[0].kind}:\n{job.tail()}")
            time.sleep(0.05)
    finally:
        job.end()
    return watch, job.launches, time.monotonic() - start


def checkpoints_lost(watch: LogWatch) -> list[str]:
    """Saves the run reported done whose checkpoint is not intact at the end (contents checked)."""
    folder = watch.run_dir / "checkpoints"
    return [f"{protocol.tag_name(i)}: {reason}" for i in sorted(watch.saved)
            if (reason := protocol.damage_reason(str(folder / protocol.tag_name(i))))]


def loss_differences(faulted: LogWatch, clean: LogWatch) -> tuple[bool, float, list[int]]:
    """(every loss the faulted run printed equals the clean run's, the largest relative difference, iterations
    the faulted run never printed)."""
    want = {i: float(loss) for _, i, loss in clean.iterations}
    worst = 0.0
    for _, i, loss in faulted.iterations:
        if i not in want:
            return False, float("inf"), []
        worst = max(worst, abs(float(loss) - want[i]) / max(abs(want[i]), 1e-12))
    missing = sorted(set(want) - {i for _, i, _ in faulted.iterations})
    return worst <= LOSS_TOLERANCE and not missing, worst, missing


def killed_writes(faults: list[Fault], watch: LogWatch) -> tuple[str, bool]:
    """kill_rank_writing's judgement: (the table's cell, whether every killed write left `latest` on the checkpoint
    before, committed nothing, and the restart after it resumed that checkpoint)."""
    cells, good = [], 0
    for fault in faults:
        if fault.kind != "kill_rank_writing" or fault.injected_at is None:
            continue
        resumed = next((tag for t, tag in watch.loaded if t >= fault.injected_at), None)
        problems = fault.problems + ([] if resumed == fault.resume_from else
                                     [f"the restart resumed {resumed}, not {fault.resume_from}"])
        good += not problems
        cells.append(f"'latest' kept on {fault.resume_from}, resumed {resumed}" if not problems
                     else "; ".join(problems))
    total = sum(f.kind == "kill_rank_writing" for f in faults)
    return f"{good} of {total} ({'; '.join(cells)})", good == total


def summary_check(run_dir: Path, iterations: int) -> str:
    """What analysis/summarize.py makes of the faulted run: attempts, and each iteration's loss once."""
    found = collect(run_dir, 0)
    if len(found.runs) != 1:
        return f"the summary found {len(found.runs)} runs"
    run = found.runs[0]
    points = len(run.loss_curve)
    once = points == iterations and len({tokens for tokens, _ in run.loss_curve}) == points
    return (f"{run.attempts} attempts, status {run.status}, {points} loss points for {iterations} iterations"
            f" ({'each once' if once else 'NOT each once'})")


def report(args, faults: list[Fault], iterations: int, faulted: LogWatch, launches: int, seconds: float,
           clean_seconds: float, clean: LogWatch) -> tuple[str, bool]:
    equal, worst, missing = loss_differences(faulted, clean)
    lost = checkpoints_lost(faulted)
    recovered = [f for f in faults if f.recovered_at is not None]
    printed = len(faulted.iterations)
    lines = [f"## Chaos bench: {len(faults)} faults, seed {args.seed}", "",
             f"Two hosts (tools/virtual_cluster.py), one CPU rank each, Z1 driver under torchrun, tiny model, "
             f"{iterations} iterations, a save every {SAVE_INTERVAL}"
             f"{' in the background (--async-save)' if args.async_save else ''}, dropout off, "
             f"MAX_RESTARTS={args.restarts} per host. Fault-free run: {clean_seconds:.0f} s; faulted run: "
             f"{seconds:.0f} s.", "",
             "| planned at iteration | fault | where | what was done | furthest iteration before the restart | seconds "
             "from the fault to an iteration past it |", "| --- | --- | --- | --- | --- | --- |"]
    for f in faults:
        lost_s = f"{f.recovered_at - f.injected_at:.1f}" if f.recovered_at else "not recovered"
        lines.append(f"| {f.iteration} | {f.kind} | {f.host} | {f.note} | {f.progress_at_fault} | {lost_s} |")
    by_kind = {kind: sum(f.kind == kind for f in faults) for kind in KINDS if any(f.kind == kind for f in faults)}
    restarts = {host: len(causes) for host, causes in faulted.restarts.items()}
    mean_lost = (seconds - clean_seconds) / len(faults) if faults else 0.0
    lines += ["", "| figure | value |", "| --- | --- |",
              f"| faults injected, by kind | {len(faults)}: " + ", ".join(f"{k} {n}" for k, n in by_kind.items())
              + " |",
              f"| recoveries (new progress after the fault) | {len(recovered)} of {len(faults)} |",
              f"| restarts by MAX_RESTARTS | node0 {restarts['node0']}, node1 {restarts['node1']} |",
              f"| launches (the first, and requeues after SIGTERM) | {launches} |",
              f"| iterations computed twice | {printed - len({i for _, i, _ in faulted.iterations})} "
              f"({printed} iteration lines for {iterations} iterations) |",
              f"| seconds lost per fault (faulted less fault-free run, over the faults) | {mean_lost:.1f} |",
              f"| damaged checkpoints skipped at resume | {', '.join(faulted.skipped) or 'none'} |",
              f"| checkpoints lost | {len(lost)}" + (f": {'; '.join(lost)}" if lost else "") + " |",
              f"| losses equal to the fault-free run (1e-5) | {'yes' if equal else 'NO'} (largest relative "
              f"difference {worst:.1e}" + (f"; never printed: {missing}" if missing else "") + ") |",
              f"| summary (analysis/summarize.py) | {summary_check(faulted.run_dir, iterations)} |"]
    writes, writes_ok = killed_writes(faults, faulted)
    if any(f.kind == "kill_rank_writing" for f in faults):
        lines.insert(-3, f"| background writes killed: nothing committed, the checkpoint before resumed | {writes} |")
    ok = equal and not lost and len(recovered) == len(faults) and writes_ok
    return "\n".join(lines) + "\n", ok


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/chaos.sh", description=__doc__.split("\n")[0])
    parser.add_argument("--faults", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--kinds", default=None, help=f"comma-separated, of: {', '.join(KINDS)} (default: all "
                        f"that the run's saves allow; {', '.join(ASYNC_KINDS)} with --async-save only)")
    parser.add_argument("--async-save", action="store_true", help="both runs save in the background (ASYNC_SAVE=1)")
    parser.add_argument("--restarts", type=int, default=None, help="MAX_RESTARTS per host (default: 2 x faults)")
    parser.add_argument("--work", type=Path, default=None, help="run folders (default: a temporary folder, removed)")
    parser.add_argument("--out", type=Path, default=None, help="also write the table (markdown) here")
    parser.add_argument("--name", default="chaos", help="the virtual cluster's name (default chaos)")
    args = parser.parse_args(argv)
    if args.kinds is None:
        args.kinds = ",".join(k for k in KINDS if args.async_save or k not in ASYNC_KINDS)
    kinds = tuple(args.kinds.split(","))
    unknown = [kind for kind in kinds if kind not in KINDS]
    synchronous = [kind for kind in kinds if kind in ASYNC_KINDS and not args.async_save]
    if unknown or args.faults < 1:
        parser.error(f"--kinds {args.kinds}: unknown {unknown}" if unknown else f"--faults {args.faults}: expected >= 1")
    if synchronous:
        parser.error(f"--kinds {args.kinds}: {', '.join(synchronous)} needs --async-save (a writer thread to "
                     "kill)")
    args.kinds = kinds
    args.restarts = 2 * args.faults if args.restarts is None else args.restarts
    return args


def prepare_data() -> None:
    """The driver's default dataset, made once here: two hosts making it at once would write the same files."""
    if "DATA_PATH" in os.environ or (REPO / "data" / "dolly_text_document.bin").exists():
        return
    made = subprocess.run(["bash", str(REPO / "tools" / "process_databricks_gpt2.sh")], cwd=REPO, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if made.returncode != 0:
        raise ChaosError(f"tools/process_databricks_gpt2.sh failed:\n{made.stdout[-2000:]}")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("error: bench/chaos.sh makes namespaces (tools/virtual_cluster.py): run it as root", file=sys.stderr)
        return 1
    faults, iterations = plan(args.faults, args.seed, args.kinds)
    work = args.work or Path(tempfile.mkdtemp(prefix="zero-lab-chaos."))
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a SIGTERM takes everything down, as Ctrl-C does
    cluster = None
    try:
        prepare_data()
        cluster = VirtualCluster.up(hosts=2, name=args.name, subnet=SUBNET, loopback_hostname=True)
        print(f"[chaos] fault-free run: {iterations} iterations on two hosts ({work})", flush=True)
        clean, _, clean_seconds = run_job(cluster, work / "clean", iterations, [], args.seed, 0,
                                          MASTER_PORT, args.async_save)
        print(f"[chaos] faulted run: {len(faults)} faults (seed {args.seed})", flush=True)
        faulted, launches, seconds = run_job(cluster, work / "faulted", iterations, faults, args.seed,
                                            args.restarts, MASTER_PORT + 1, args.async_save)
        table, ok = report(args, faults, iterations, faulted, launches, seconds, clean_seconds, clean)
    except KeyboardInterrupt:
        print("[chaos] interrupted: taking the hosts down", file=sys.stderr)
        return 130
    except (ChaosError, ClusterError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    finally:
        if cluster is not None:
            cluster.down()
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(table)
    if args.out:
        args.out.write_text(table)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
