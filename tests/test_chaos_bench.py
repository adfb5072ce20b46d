"""bench/chaos.sh: the faults a seed picks, and, on two hosts of namespaces, a run hit by a SIGTERM to the job, a full
disk during a save and a rank SIGKILLed while it saves: each time the run starts again by itself (or, after the
SIGTERM, as a requeue), loses no checkpoint and prints the fault-free run's losses; the summary has each
iteration's loss once. An --async-save run whose rank is SIGKILLed while its writer thread writes keeps `latest` on
the checkpoint before and resumes it. Interrupted, the bench leaves no namespace or process behind. (The bench's
ten-fault run, with a cut link and a flipped byte too, is in bench/results/.)"""
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO_ROOT, test_env
from tools.vcluster.state import netns_prefix

sys.path.insert(0, str(REPO_ROOT / "bench"))  # run as a script, bench/chaos.py has its folder first on sys.path
spec = importlib.util.spec_from_file_location("chaos", REPO_ROOT / "bench" / "chaos.py")
chaos = sys.modules["chaos"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(chaos)

CHAOS = REPO_ROOT / "bench" / "chaos.sh"
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the bench makes namespaces: root only")


def test_the_seed_picks_every_kind_once_before_any_twice():
    faults, iterations = chaos.plan(10, 7, chaos.KINDS)
    kinds = [fault.kind for fault in faults]
    assert sorted(kinds[:len(chaos.KINDS)]) == sorted(chaos.KINDS) and len(kinds) == 10
    planned = [fault.iteration for fault in faults]
    assert planned[0] >= chaos.FIRST_FAULT and iterations > planned[-1]
    assert all(b - a >= chaos.FAULT_GAP for a, b in zip(planned, planned[1:]))
    assert {fault.host for fault in faults if fault.kind == "sigterm_job"} == {"both"}
    assert {fault.host for fault in faults if fault.kind in ("cut_link", "full_disk")} <= {"node1"}
    again, _ = chaos.plan(10, 7, chaos.KINDS)
    assert [(f.iteration, f.kind, f.host) for f in again] == [(f.iteration, f.kind, f.host) for f in faults]
    other, _ = chaos.plan(10, 8, chaos.KINDS)
    assert [(f.iteration, f.kind, f.host) for f in other] != [(f.iteration, f.kind, f.host) for f in faults]


@pytest.mark.parametrize("args, message", [(["--kinds", "kill_rank,melt"], "--kinds kill_rank,melt: unknown ['melt']"),
                                           (["--faults", "0"], "--faults 0: expected >= 1"),
                                           (["--kinds", "kill_rank_writing"], "--kinds kill_rank_writing: "
                                            "kill_rank_writing needs --async-save (a writer thread to kill)")])
def test_bad_flags_are_one_line(args, message):
    result = subprocess.run(["bash", str(CHAOS), *args], env=test_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.splitlines()[-1] == f"bench/chaos.sh: error: {message}"


def bench_env(dolly_data_dir):
    return test_env(DATA_PATH=dolly_data_dir / "dolly_text_document", VOCAB_FILE=dolly_data_dir / "gpt2-vocab.json",
                    MERGE_FILE=dolly_data_dir / "gpt2-merges.txt")


def namespaces_left(name: str) -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith(netns_prefix(name))]


def processes_under(folder) -> list[str]:
    """Command lines of the processes that name `folder` (the bench's runs)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(folder) in argv:
            found.append(argv)
    return found


@needs_root
@pytest.mark.slow
def test_a_run_hit_by_three_kinds_of_fault_restarts_and_loses_nothing(dolly_data_dir, tmp_path):
    name = f"zlch{os.getpid() % 100000}"
    result = subprocess.run(["bash", str(CHAOS), "--faults", "3", "--seed", "2", "--kinds",
                             "sigterm_job,full_disk,kill_rank_saving", "--work", str(tmp_path / "work"), "--name", name,
                             "--out", str(tmp_path / "chaos.md")],
                            env=bench_env(dolly_data_dir), capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    table = (tmp_path / "chaos.md").read_text()
    assert table in result.stdout
    figures = dict(re.findall(r"^\| ([^|]+?) \| ([^|]+?) \|$", table, re.M))
    assert figures["faults injected, by kind"] == "3: kill_rank_saving 1, sigterm_job 1, full_disk 1"
    assert figures["recoveries (new progress after the fault)"] == "3 of 3"
    assert figures["checkpoints lost"] == "0"
    assert figures["losses equal to the fault-free run (1e-5)"].startswith("yes ")
    # two restarts on each host (full disk, kill while saving), one requeue after the SIGTERM
    assert figures["restarts by MAX_RESTARTS"] == "node0 2, node1 2"
    assert figures["launches (the first, and requeues after SIGTERM)"] == "2"
    iterations = chaos.plan(3, 2, ("sigterm_job", "full_disk", "kill_rank_saving"))[1]
    assert figures["summary (analysis/summarize.py)"] == (f"4 attempts, status finished, {iterations} loss points for "
                                                           f"{iterations} iterations (each once)")
    # the hosts' logs say what happened: the SIGTERM stop on both, the save the file-size limit refused on node1
    run_dir = tmp_path / "work" / "faulted" / "gpt_tiny_Z1"
    log, node1_log = (run_dir / "train.log").read_text(), (run_dir / "train.node1.log").read_text()
    stopped = r"^ exiting program after receiving SIGTERM at iteration \d+ \(checkpoint saved to "
    assert re.search(stopped, log, re.M) and re.search(stopped, node1_log, re.M)
    assert re.search(r"^\[zero-lab\] restarting after: --save \S+: writing checkpoint global_step\d+ failed on rank 1 "
                     r"\(File too large\)", node1_log, re.M)
    assert re.search(r"^\[zero-lab\] restarting after: lost rank 1 on node1 ", log, re.M)
    assert not namespaces_left(name) and not processes_under(tmp_path / "work")


def test_the_kinds_by_default_are_those_the_saves_allow():
    assert chaos.parse_args([]).kinds == tuple(k for k in chaos.KINDS if k != "kill_rank_writing")
    assert chaos.parse_args(["--async-save"]).kinds == chaos.KINDS


@needs_root
@pytest.mark.slow
def test_a_rank_killed_while_its_writer_thread_writes_leaves_the_checkpoint_before(dolly_data_dir, tmp_path):
    """--async-save: the SIGKILL lands once the rank's writer thread has opened its optimizer-state file of a
    background save; the killed write commits nothing, `latest` stays on the checkpoint before, the restart
    resumes it and the run finishes with the fault-free run's losses."""
    name = f"zlcw{os.getpid() % 100000}"
    result = subprocess.run(["bash", str(CHAOS), "--async-save", "--faults", "1", "--seed", "1", "--kinds",
                             "kill_rank_writing", "--work", str(tmp_path / "work"), "--name", name,
                             "--out", str(tmp_path / "chaos.md")],
                            env=bench_env(dolly_data_dir), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    table = (tmp_path / "chaos.md").read_text()
    figures = dict(re.findall(r"^\| ([^|]+?) \| ([^|]+?) \|$", table, re.M))
    killed = re.search(r"while its writer thread wrote (global_step(\d+))\.saving/zero_pp_rank_\d_mp_rank_00_optim_"
                       r"states\.pt \(\d+ bytes of it on disk\); 'latest' named (global_step(\d+))", table)
    assert killed and int(killed.group(4)) == int(killed.group(2)) - chaos.SAVE_INTERVAL, table
    assert figures["background writes killed: nothing committed, the checkpoint before resumed"] == (
        f"1 of 1 ('latest' kept on {killed.group(3)}, resumed {killed.group(3)})")
    assert figures["checkpoints lost"] == "0" and figures["recoveries (new progress after the fault)"] == "1 of 1"
    assert figures["losses equal to the fault-free run (1e-5)"].startswith("yes ")
    run_dir = tmp_path / "work" / "faulted" / "gpt_tiny_Z1"
    log = (run_dir / "train.log").read_text()
    assert figures["restarts by MAX_RESTARTS"] == "node0 1, node1 1"
    assert re.search(r"^  successfully saved checkpoint at iteration +\d+ .*, async: training blocked ", log, re.M)
    assert not (run_dir / "checkpoints" / f"{killed.group(1)}.saving").exists()  # the re-save cleared it
    assert not namespaces_left(name) and not processes_under(tmp_path / "work")


@needs_root
@pytest.mark.slow
def test_an_interrupted_bench_leaves_nothing_behind(dolly_data_dir, tmp_path):
    name = f"zlci{os.getpid() % 100000}"
    work = tmp_path / "work"
    bench = subprocess.Popen(["bash", str(CHAOS), "--faults", "1", "--work", str(work), "--name", name],
                             env=bench_env(dolly_data_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        log = work / "clean" / "gpt_tiny_Z1" / "train.log"
        deadline = time.monotonic() + 300
        while not (log.exists() and re.search(r"^ iteration +1/", log.read_text(), re.M)):
            assert bench.poll() is None and time.monotonic() < deadline, bench.communicate()
            time.sleep(0.5)
        assert namespaces_left(name)
        bench.send_signal(signal.SIGTERM)  # the bench alone, as `kill PID` would
        out, err = bench.communicate(timeout=120)
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
    assert bench.returncode == 130, out[-3000:] + err[-3000:]
    assert err.splitlines()[-1] == "[chaos] interrupted: taking the hosts down"
    assert not namespaces_left(name)
    assert not processes_under(work)
