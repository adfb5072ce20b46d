"""Runs over two hosts: torchrun across nodes, ALCF's mpiexec over ssh, a lost host, an unshared save folder.

The hosts are the suite's virtual cluster (conftest.two_hosts: network, UTS and mount namespaces joined by
a switch, each host mapping its own name to 127.0.1.1 as Debian and Ubuntu do, each with its own /scratch).
Every rank binds and advertises the address that routes to the master (megatron/runtime/network.py), so
the runs below give the one-host run's losses. The Slurm jobs over both hosts are in test_slurm.py.
Without root these tests skip.
"""
import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO_ROOT, driver_env, free_port, iteration_losses
from conftest import test_env as subprocess_env  # aliased: pytest would collect test_env as a test

pytestmark = pytest.mark.slow

HOSTS = {"node0": "10.250.0.1", "node1": "10.250.0.2"}
Z1 = REPO_ROOT / "examples_zero" / "gpt_deepspeed_Z1.sh"
ALCF = REPO_ROOT / "ALCF" / "train-gpt3.sh"


@pytest.fixture(scope="module")
def cluster(two_hosts):
    return two_hosts


def same_losses(got: dict[int, str], want: dict[int, str]) -> bool:
    """The same iterations, each loss within 1e-5 (relative) of the other's."""
    return sorted(got) == sorted(want) and \
        [float(got[i]) for i in sorted(got)] == pytest.approx([float(want[i]) for i in sorted(got)], rel=1e-5)


class TwoHostRun:
    """The Z1 driver under torchrun on both hosts (NNODES=2, one rank each), output to files per host.
    Whatever is still running inside the hosts at the end is ended by PID."""

    def __init__(self, cluster, env: dict, tmp_path: Path, *args: str, ranks_per_host: int = 1):
        self.cluster, self.outputs = cluster, {host: tmp_path / f"{host}.out" for host in HOSTS}
        port = free_port()
        self.processes = {}
        for node_rank, host in enumerate(HOSTS):
            with open(self.outputs[host], "w") as output:
                self.processes[host] = cluster.popen(
                    host, ["bash", str(Z1), *args], cwd=REPO_ROOT, stdout=output, stderr=subprocess.STDOUT,
                    env={**env, "NNODES": "2", "NODE_RANK": str(node_rank), "NGPUS": str(ranks_per_host),
                         "MASTER_ADDR": "node0", "MASTER_PORT": str(port)})

    def wait(self, timeout: float) -> dict[str, float]:
        """{host: seconds until its driver ended}; fails after `timeout`."""
        start, ended = time.monotonic(), {}
        while len(ended) < len(self.processes):
            for host, process in self.processes.items():
                if host not in ended and process.poll() is not None:
                    ended[host] = time.monotonic() - start
            assert time.monotonic() - start < timeout, f"still running after {timeout} s: {self.tails()}"
            time.sleep(0.2)
        return ended

    def returncodes(self) -> dict[str, int]:
        return {host: process.returncode for host, process in self.processes.items()}

    def output(self, host: str) -> str:
        return self.outputs[host].read_text()

    def tails(self) -> str:
        return "\n".join(f"--- {host}:\n{self.output(host)[-2000:]}" for host in HOSTS)

    def end_what_is_left(self) -> None:
        for host in HOSTS:
            for pid in self.cluster.pids_in(host):
                with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                    os.kill(pid, signal.SIGKILL)
        for process in self.processes.values():
            process.wait(timeout=30)


@pytest.fixture
def two_host_runs(cluster):
    runs = []
    yield lambda *args, **kwargs: runs.append(TwoHostRun(cluster, *args, **kwargs)) or runs[-1]
    for run in runs:
        run.end_what_is_left()


def test_torchrun_over_two_hosts_trains_like_one_host(two_host_runs, dolly_data_dir, one_host_z1_losses, tmp_path):
    """NNODES=2 NODE_RANK=k MASTER_ADDR=node0 on each host: c10d rendezvous, one rank per host, the global
    batch of the one-host run; each host says which interface it uses, though its own name is 127.0.1.1."""
    run = two_host_runs(driver_env(dolly_data_dir, tmp_path), tmp_path)
    run.wait(timeout=300)
    assert run.returncodes() == {"node0": 0, "node1": 0}, run.tails()
    run_dir = tmp_path / "gpt_tiny_Z1"
    log, node1_log = (run_dir / "train.log").read_text(), (run_dir / "train.node1.log").read_text()
    assert " > run info | zero stage: 1 | offload: none | model: tiny | world size: 2 |" in log
    assert same_losses(iteration_losses(log), one_host_z1_losses), log[-3000:]
    assert ("[zero-lab] network on node0: the ranks use eth0 (10.250.0.1); the master node0 is this host, but its "
            "name resolves to 127.0.1.1 here") in log
    assert ("[zero-lab] network on node1: the ranks use eth0 (10.250.0.2); the route to the master node0 "
            "(10.250.0.1) leaves by it") in node1_log
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "global_step4"


def test_two_hosts_of_two_ranks_train_like_four_ranks_on_one_host(two_host_runs, dolly_data_dir, tmp_path):
    """2 x 2: ranks 0-1 on node0, 2-3 on node1 (micro-batch 2, global batch 8), against 4 ranks on one host."""
    one_host = subprocess.run(["bash", str(Z1)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                              env={**driver_env(dolly_data_dir, tmp_path / "one", NGPUS=4), "MICRO_BATCH": "2"})
    assert one_host.returncode == 0, one_host.stdout[-3000:] + one_host.stderr[-3000:]
    run = two_host_runs({**driver_env(dolly_data_dir, tmp_path / "two"), "MICRO_BATCH": "2"}, tmp_path, ranks_per_host=2)
    run.wait(timeout=300)
    assert run.returncodes() == {"node0": 0, "node1": 0}, run.tails()
    log = (tmp_path / "two" / "gpt_tiny_Z1" / "train.log").read_text()
    assert " > run info | zero stage: 1 | offload: none | model: tiny | world size: 4 | micro batch: 2 | " \
           "global batch: 8 |" in log
    want = iteration_losses((tmp_path / "one" / "gpt_tiny_Z1" / "train.log").read_text())
    assert sorted(want) == [1, 2, 3, 4] and same_losses(iteration_losses(log), want), log[-3000:]


def test_alcf_over_two_hosts_with_mpiexec_over_ssh(cluster, dolly_data_dir, one_host_z1_losses, tmp_path):
    """./ALCF/train-gpt3.sh on node0 with a PBS_NODEFILE of both hosts: MPICH's mpiexec starts node1's rank
    over ssh (the cluster's sshd and key); the settings of the one-host driver run, the same losses."""
    (tmp_path / "nodefile").write_text("node0\nnode1\n")
    env = subprocess_env(
        PBS_NODEFILE=tmp_path / "nodefile", NGPU_PER_HOST=1, CUDA_VISIBLE_DEVICES="", USER="tester",
        OUTPUT_ROOT=tmp_path / "outputs", LOGFILES=tmp_path / "logfiles",
        MPIEXEC_EXTRA_ARGS=f"-launcher ssh -launcher-exec {cluster.ssh_wrapper}",
        DATA_DIR=dolly_data_dir, MODEL_SIZE_KEY="GPT_TINY", SEQ_LEN=64, MICRO_BATCH=4, TRAIN_EPOCHS=2, LR="1e-3",
        MIN_LR="6e-5", SPLIT="2,97,1", EVAL_INTERVAL=2, EVAL_ITERS=1, LOG_INTERVAL=1, USE_ACTIVATION_CHECKPOINTING=0,
        SP_TYPE="none", ZERO_STAGE=1)
    for var in ("HOSTFILE", "PBS_JOBID", "RUN_NAME", "FRESH", "TRAIN_ITERS", "GLOBAL_BATCH"):
        env.pop(var, None)
    result = cluster.run("node0", ["bash", str(ALCF)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    [launch] = [line for line in result.stdout.splitlines() if line.startswith("[launch] mpiexec")]
    assert launch.startswith("[launch] mpiexec --envall -n 2 --ppn 1 --hostfile ")
    log = Path((tmp_path / "logfiles").read_text().splitlines()[-1]).read_text()
    assert re.search(r"tester-node0-nhosts2-ngpu2-", (tmp_path / "logfiles").read_text())
    for host, address in HOSTS.items():
        assert f"[zero-lab] network on {host}: the ranks use eth0 ({address})" in log
    assert same_losses(iteration_losses(log), one_host_z1_losses), log[-3000:]


def wait_for_iteration(run: TwoHostRun, log: Path, iteration: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not (log.exists() and re.search(rf"^ iteration +{iteration}/", log.read_text(), re.M)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in run.processes.values()), run.tails()
        time.sleep(0.05)


# dropout off: each rank draws its own dropout masks, so a run on fewer ranks would draw others
NO_DROPOUT = ("--hidden-dropout", "0", "--attention-dropout", "0")


def lost_host_run(two_host_runs, dolly_data_dir, tmp_path, **settings):
    """A 40-iteration run saving every 2 iterations, at the default --distributed-timeout-minutes (10),
    waited on until iteration 3 is logged; `settings`: more of its environment."""
    env = driver_env(dolly_data_dir, tmp_path, TRAIN_ITERS=40, SAVE_INTERVAL=2, **settings)
    env.pop("TRAIN_EPOCHS")
    run = two_host_runs(env, tmp_path, *NO_DROPOUT)
    wait_for_iteration(run, tmp_path / "gpt_tiny_Z1" / "train.log", 3)
    return run


def processes_left(cluster, grace: float = 10) -> dict[str, list[str]]:
    """{host: command lines of what still runs there}, once it is empty or after `grace` seconds (a process
    that was told to end may take a moment to go)."""
    deadline = time.monotonic() + grace
    while True:
        left = {host: [command_line(pid) for pid in cluster.pids_in(host)] for host in HOSTS}
        if not any(left.values()) or time.monotonic() > deadline:
            return {host: commands for host, commands in left.items() if commands}
        time.sleep(0.5)


def command_line(pid: int) -> str:
    try:
        return f"{pid}: " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return f"{pid}: gone"


def last_line(text: str) -> str:
    return text.rstrip("\n").splitlines()[-1]


def test_a_cut_link_ends_the_job_and_it_resumes_on_the_host_left(cluster, two_host_runs, dolly_data_dir, tmp_path):
    """node1's link goes down mid-run. A collective blocked on it would wait 10 minutes; the heartbeat ends
    both hosts' jobs after its silence (ZERO_LAB_HEARTBEAT_SECONDS=30 here, not to wait out the default minute),
    each naming the host it lost, leaving no process on either host.
    The last intact checkpoint then resumes on node0 alone: 1 rank, the same global batch (gradient
    accumulation 2), converted through the universal checkpoint; the loss carries on where it stopped."""
    run = lost_host_run(two_host_runs, dolly_data_dir, tmp_path, ZERO_LAB_HEARTBEAT_SECONDS=30)
    cluster.cut("node1")
    try:
        ended = run.wait(timeout=240)
    finally:
        cluster.heal("node1")
    assert run.returncodes() == {"node0": 1, "node1": 1}, run.tails()
    assert ended["node0"] < 60, ended  # 30 s of silence, and the launcher's teardown
    assert last_line(run.output("node0")).startswith(
        "error: lost rank 1 on node1 (10.250.0.2): no heartbeat for 30 s: its host is down or cut off; the last "
        "checkpoint resumes on the hosts left with --universal-checkpoint (docs/multi-node.md) (launcher's report: ")
    assert last_line(run.output("node1")).startswith("error: lost rank 0 on node0 (10.250.0.1): no heartbeat for 30 s")
    assert "Traceback" not in run.output("node0") + run.output("node1")
    assert processes_left(cluster) == {}

    run_dir = tmp_path / "gpt_tiny_Z1"
    two_hosts = iteration_losses((run_dir / "train.log").read_text())
    step = int((run_dir / "checkpoints" / "latest").read_text().strip().removeprefix("global_step"))
    assert step >= 2 and step + 1 in two_hosts
    env = driver_env(dolly_data_dir, tmp_path, TRAIN_ITERS=40, SAVE_INTERVAL=2, NGPUS=1, GLOBAL_BATCH=8)
    env.pop("TRAIN_EPOCHS")
    resumed = cluster.run("node0", ["bash", str(Z1), *NO_DROPOUT, "--universal-checkpoint",
                                     "--exit-interval", str(step + 2)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"[run] resuming from global_step{step} in {run_dir / 'checkpoints'}" in resumed.stderr
    losses = iteration_losses(resumed.stdout)
    assert sorted(losses) == [step + 1, step + 2]
    # the same samples in the same order, their gradients accumulated on one rank instead of averaged over two
    assert float(losses[step + 1]) == pytest.approx(float(two_hosts[step + 1]), rel=1e-5)


def test_a_killed_host_ends_the_job_at_once(cluster, two_host_runs, dolly_data_dir, tmp_path):
    """Every process on node1 is killed mid-run: node0's next collective finds the connection closed."""
    run = lost_host_run(two_host_runs, dolly_data_dir, tmp_path)
    for pid in cluster.pids_in("node1"):
        os.kill(pid, signal.SIGKILL)
    ended = run.wait(timeout=120)
    assert run.returncodes()["node0"] == 1, run.tails()
    assert ended["node0"] < 30, ended
    cause = last_line(run.output("node0"))
    assert cause.startswith(
        "error: lost rank 1 on node1 (10.250.0.2): its connection closed: its process or host is gone; the last "
        "checkpoint resumes on the hosts left with --universal-checkpoint (docs/multi-node.md); torch said: "), cause
    # torch's own first line: gloo reads an end of stream ("Connection closed by peer"), or a reset where the dead
    # process's socket still had data in flight ("Read error ...: Connection reset by peer"), as the kernel decides
    assert re.search(r"Connection (closed|reset) by peer", cause) and " (launcher's report: " in cause
    assert "Traceback" not in run.output("node0")
    assert processes_left(cluster) == {}


def test_a_save_folder_each_host_has_its_own_is_refused(two_host_runs, dolly_data_dir, tmp_path):
    """--save /scratch/checkpoints: /scratch is each host's own. node1's probe is not seen by rank 0."""
    run = two_host_runs(driver_env(dolly_data_dir, tmp_path), tmp_path, "--save", "/scratch/checkpoints")
    run.wait(timeout=240)
    assert run.returncodes() == {"node0": 1, "node1": 1}, run.tails()
    for host in HOSTS:  # rank 0 says it on node0, rank 1 on node1: each host's output ends with it
        cause = last_line(run.output(host))
        assert re.fullmatch(r"error: --save /scratch/checkpoints: host node1 wrote /scratch/checkpoints/"
                            r"\.zero-lab-probe-node1-\d+ there, but rank 0 on node0 does not see it: --save must be "
                            r"one folder every host shares \(a cluster filesystem\), not a folder local to each host "
                            r"\(launcher's report: .*\)", cause), cause
    assert "iteration " not in run.output("node0")


def test_a_host_gone_for_good_leaves_the_run_to_the_host_left(cluster, two_host_runs, dolly_data_dir, tmp_path):
    """MAX_RESTARTS=2 HOST_WAIT_SECONDS=20: every process of node1, its driver too, is killed mid-run for good.
    node0's run restarts, waits 20 s for node1 at the rendezvous, then goes on alone, saying so in one line: the
    newest intact checkpoint resumes through the universal checkpoint on 1 rank with the global batch kept
    (gradient accumulation 2), and the run finishes, each iteration's loss as the two hosts printed it."""
    env = driver_env(dolly_data_dir, tmp_path, TRAIN_ITERS=10, SAVE_INTERVAL=2, MAX_RESTARTS=2, HOST_WAIT_SECONDS=20)
    env.pop("TRAIN_EPOCHS")
    run = two_host_runs(env, tmp_path, *NO_DROPOUT)
    run_dir = tmp_path / "gpt_tiny_Z1"
    wait_for_iteration(run, run_dir / "train.log", 3)
    for pid in cluster.pids_in("node1"):
        os.kill(pid, signal.SIGKILL)
    run.wait(timeout=420)
    assert run.returncodes()["node0"] == 0, run.tails()
    output = run.output("node0")
    assert ("[run] the other hosts did not come back within HOST_WAIT_SECONDS=20 s: going on with this host alone "
            "(NNODES=1, NGPUS=1) from the newest intact checkpoint through --universal-checkpoint, the global batch "
            "kept at 8 (2 of 2, MAX_RESTARTS)") in output, output[-3000:]
    log = (run_dir / "train.log").read_text()
    assert re.findall(r"^\[zero-lab\] restarting after: (.*)$", log, re.M)[1] == \
        "the other hosts did not join the rendezvous within HOST_WAIT_SECONDS"
    attempts = re.split(r"^\[zero-lab\] attempt \d started .*$", log, flags=re.M)[1:]
    assert len(attempts) == 3 and not iteration_losses(attempts[1])  # the second never met node1
    two_hosts, alone = iteration_losses(attempts[0]), iteration_losses(attempts[2])
    assert " > run info | zero stage: 1 | offload: none | model: tiny | world size: 1 |" in attempts[2]
    assert max(alone) == 10 and set(two_hosts) | set(alone) == set(range(1, 11))
    resumed = min(alone) - 1
    assert resumed >= 2 and resumed % 2 == 0 and (run_dir / "checkpoints" / f"global_step{resumed}_universal").is_dir()
    # the same samples, their gradients accumulated on one rank instead of averaged over two
    assert same_losses({i: two_hosts[i] for i in alone if i in two_hosts},
                       {i: alone[i] for i in alone if i in two_hosts})
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "global_step10"
    assert processes_left(cluster) == {}
