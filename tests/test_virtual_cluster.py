"""tools/virtual_cluster.py: hosts made of namespaces, their network, cut and heal, shaping, down, Slurm, ssh.

Every cluster here is brought down in a finalizer, also when its test fails, and then checked to have
left nothing: no namespace named with its prefix, no keeper alive, no process in one of its network
namespaces, no state folder. All traffic goes between the namespaces made here, on addresses that
exist only inside them. Without root (or without namespaces) every test skips with the tool's reason.
"""
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import REPO_ROOT

from tools.vcluster import ClusterError, VirtualCluster, down_by_name
from tools.vcluster.procs import pids_in_netns
from tools.vcluster.state import netns_prefix, state_dir
from tools.vcluster.system import apt_install, has_tool, require_root_and_namespaces

TOOL = REPO_ROOT / "tools" / "virtual_cluster.py"
PYTHON = sys.executable
PORT = 5000


def _refusal() -> str | None:
    try:
        require_root_and_namespaces()
    except ClusterError as error:
        return str(error)
    return None


REFUSAL = _refusal()
pytestmark = pytest.mark.skipif(REFUSAL is not None, reason=f"virtual_cluster refuses here: {REFUSAL}")

# A TCP server inside a host: answers b"ok" to each connection, for at most `seconds`.
SERVE = """
import socket, sys, time
server = socket.create_server(("0.0.0.0", int(sys.argv[1])), reuse_port=True)
server.settimeout(0.2)
print("listening", flush=True)
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    try:
        conn, _ = server.accept()
    except TimeoutError:
        continue
    conn.sendall(b"ok")
    conn.close()
"""

# Connect to argv[1]:argv[2] within argv[3] seconds; prints 'ok' or the error, and the seconds it took.
CONNECT = """
import socket, sys, time
start = time.monotonic()
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as conn:
        print(conn.recv(2).decode(), round(time.monotonic() - start, 3))
except OSError as error:
    print(type(error).__name__, round(time.monotonic() - start, 3))
"""


def cluster_name(tag: str) -> str:
    """Unique per test run, within the tool's 10 characters, so a user's own cluster is never touched."""
    return f"t{os.getpid() % 100000}{tag}"


def our_namespaces(name: str) -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    return [line.split()[0] for line in listed if line.startswith(netns_prefix(name))]


def assert_nothing_left(name: str, keepers: list, inodes: set[int]) -> None:
    assert our_namespaces(name) == [], f"namespaces left: {our_namespaces(name)}"
    assert [keeper for keeper in keepers if keeper.alive()] == []
    assert pids_in_netns(inodes) == [], "processes left in the cluster's network namespaces"
    assert not state_dir(name).exists()


def down_and_check(cluster: VirtualCluster) -> None:
    keepers, inodes = cluster.keepers(), cluster.netns_inodes()
    assert keepers and inodes
    cluster.down()
    assert_nothing_left(cluster.name, keepers, inodes)


@pytest.fixture
def make_cluster():
    """VirtualCluster.up(...) for one test; down (and checked) afterwards, also when the test fails."""
    made = []

    def make(tag: str, **options) -> VirtualCluster:
        made.append(VirtualCluster.up(name=cluster_name(tag), **options))
        return made[-1]

    yield make
    for cluster in made:
        down_and_check(cluster)


@pytest.fixture
def cli_name():
    """Cluster names for a test that drives the CLI; whatever it leaves is taken down afterwards, and checked."""
    names = []

    def make(tag: str) -> str:
        names.append(cluster_name(tag))
        return names[-1]

    yield make
    for name in names:
        down_by_name(name)
        assert our_namespaces(name) == [] and not state_dir(name).exists()


def root_network() -> tuple[str, str, str]:
    """The root namespace's links, addresses and routes: a cluster must leave them as they are."""
    show = [subprocess.run(["ip", "-o", *what], capture_output=True, text=True).stdout
            for what in (["link"], ["addr"], ["route"])]
    return show[0], show[1], show[2]


@pytest.fixture(scope="module")
def before_pair():
    return {"hosts": Path("/etc/hosts").read_bytes(), "hostname": socket.gethostname(), "network": root_network()}


@pytest.fixture(scope="module")
def pair(before_pair):
    """Two plain hosts shared by the quick tests (each test leaves them as it found them)."""
    cluster = VirtualCluster.up(hosts=2, name=cluster_name("p"))
    yield cluster
    down_and_check(cluster)


def run_text(cluster: VirtualCluster, host: str, argv: list[str], timeout: float = 30) -> str:
    result = cluster.run(host, argv, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{argv} on {host}: {result.stderr}"
    return result.stdout


def serve(cluster: VirtualCluster, host: str, seconds: float = 20, port: int = PORT) -> subprocess.Popen:
    server = cluster.popen(host, [PYTHON, "-c", SERVE, str(port), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "listening"
    return server


def connect(cluster: VirtualCluster, host: str, target: str, timeout: float = 2, port: int = PORT) -> tuple[str, float]:
    word, seconds = run_text(cluster, host, [PYTHON, "-c", CONNECT, target, str(port), str(timeout)]).split()
    return word, float(seconds)


# An echo server, and a client that checks an open connection: echoed before the cut, silent during it,
# and the held-back bytes arrive after the heal (TCP retransmits them). The test cuts and heals on cue.
ECHO = """
import socket, sys
server = socket.create_server(("0.0.0.0", int(sys.argv[1])), reuse_port=True)
server.settimeout(20)
print("listening", flush=True)
conn, _ = server.accept()
conn.settimeout(30)
while data := conn.recv(100):
    conn.sendall(data)
"""
HELD_CONNECTION = """
import socket, sys, time
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
conn.sendall(b"a"); print(conn.recv(1).decode(), flush=True)
sys.stdin.readline()  # cut now
conn.settimeout(1)
conn.sendall(b"b")
try:
    print("got", conn.recv(1).decode(), flush=True)
except TimeoutError:
    print("silent", flush=True)
sys.stdin.readline()  # healed now
conn.settimeout(15)
start = time.monotonic()
print(conn.recv(1).decode(), round(time.monotonic() - start, 1), flush=True)
"""


def cli(*args: str, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, str(TOOL), *args], capture_output=True, text=True, timeout=timeout, **kwargs)


# ---- the quick tests ----

def test_hosts_reach_each_other_by_name_and_address(pair):
    for here, there in (("node0", "node1"), ("node1", "node0")):
        server = serve(pair, there)
        try:
            assert connect(pair, here, there)[0] == "ok"
            assert connect(pair, here, pair.address(there))[0] == "ok"
        finally:
            server.terminate()
            server.wait()
    assert pair.address("node0") == "10.250.0.1" and pair.address(1) == "10.250.0.2"


def test_hostnames_and_etc_hosts(pair, before_pair):
    assert [run_text(pair, host, ["hostname"]).strip() for host in pair.hosts] == ["node0", "node1"]
    for host in pair.hosts:
        inside = run_text(pair, host, ["cat", "/etc/hosts"])
        assert inside == Path(pair.host(host).hosts_file).read_text()
        assert "127.0.0.1\tlocalhost\n10.250.0.1\tnode0\n10.250.0.2\tnode1\n" in inside
    assert socket.gethostname() == before_pair["hostname"]
    assert Path("/etc/hosts").read_bytes() == before_pair["hosts"]


def test_no_route_out_and_root_network_untouched(pair, before_pair):
    for host in pair.hosts:
        result = pair.run(host, ["ip", "route", "get", "8.8.8.8"], capture_output=True, text=True)
        assert result.returncode != 0 and "unreachable" in result.stderr
        assert run_text(pair, host, ["ip", "route"]).split()[0] == "10.250.0.0/24"  # the subnet, nothing else
    assert root_network() == before_pair["network"]


def test_run_keeps_stdio_exit_code_folder_and_environment(pair, tmp_path):
    result = pair.run("node1", ["sh", "-c", 'cat; echo "$VC_PROBE $(pwd)"; echo err >&2; exit 7'], cwd=tmp_path,
                      input="from stdin\n", env=dict(os.environ, VC_PROBE="kept"), capture_output=True, text=True)
    assert (result.returncode, result.stdout, result.stderr) == (7, f"from stdin\nkept {tmp_path}\n", "err\n")
    # the CLI the same way, and /sys as it is outside (slurmd's cgroup set-up needs it)
    result = cli("--name", pair.name, "run", "node1", "--", "sh", "-c", "cat; hostname; exit 3", input="in\n",
                 cwd=tmp_path)
    assert (result.returncode, result.stdout) == (3, "in\nnode1\n")
    assert run_text(pair, "node0", ["stat", "-c", "%i", "/sys/fs/cgroup"]) == \
        subprocess.run(["stat", "-c", "%i", "/sys/fs/cgroup"], capture_output=True, text=True).stdout


def test_cut_stops_traffic_and_heal_restores_it(pair):
    server = serve(pair, "node1")
    try:
        assert connect(pair, "node0", "node1")[0] == "ok"
        assert cli("--name", pair.name, "cut", "node1").returncode == 0
        assert pair.is_cut("node1")
        assert "link CUT" in cli("--name", pair.name, "status").stdout
        word, seconds = connect(pair, "node0", "node1", timeout=1)
        assert word != "ok" and seconds < 1.5
        word, seconds = connect(pair, "node1", "node0", timeout=1)  # and from the cut host outwards
        assert word != "ok" and seconds < 1.5
        # inside the cut host the interface is still up, only silent (no carrier): not an error to see
        assert "NO-CARRIER" in run_text(pair, "node1", ["ip", "link", "show", "eth0"])
        pair.heal("node1")
        assert not pair.is_cut("node1")
        assert connect(pair, "node0", "node1")[0] == "ok"
    finally:
        pair.heal("node1")
        server.terminate()
        server.wait()


def test_cut_silences_an_open_connection_until_heal(pair):
    server = pair.popen("node1", [PYTHON, "-c", ECHO, str(PORT + 2)], stdout=subprocess.PIPE, text=True)
    client = None
    try:
        assert server.stdout.readline().strip() == "listening"
        client = pair.popen("node0", [PYTHON, "-c", HELD_CONNECTION, "node1", str(PORT + 2)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert client.stdout.readline().strip() == "a"
        pair.cut("node1")
        client.stdin.write("cut\n")
        client.stdin.flush()
        assert client.stdout.readline().strip() == "silent"
        pair.heal("node1")
        client.stdin.write("healed\n")
        client.stdin.flush()
        word, seconds = client.stdout.readline().split()
        assert word == "b" and float(seconds) < 10  # at TCP's next retransmission
    finally:
        pair.heal("node1")
        for process in (client, server):
            if process:
                process.kill()
                process.wait()


def test_loopback_hostname_and_scratch(make_cluster, tmp_path):
    scratch = tmp_path / "scratch"
    cluster = make_cluster("l", hosts=2, loopback_hostname=True, scratch=str(scratch))
    resolve = "import socket, sys; print(*[socket.gethostbyname(name) for name in sys.argv[1:]])"
    assert run_text(cluster, "node0", [PYTHON, "-c", resolve, "node0", "node1"]).split() == ["127.0.1.1", "10.250.0.2"]
    assert run_text(cluster, "node1", [PYTHON, "-c", resolve, "node0", "node1"]).split() == ["10.250.0.1", "127.0.1.1"]
    run_text(cluster, "node0", ["touch", str(scratch / "mine")])
    assert run_text(cluster, "node0", ["ls", str(scratch)]).split() == ["mine"]
    assert run_text(cluster, "node1", ["ls", str(scratch)]).split() == []
    assert list(scratch.iterdir()) == []  # outside the hosts it is the empty mount point


def test_refuses_without_root(cli_name):
    """As nobody: the tool (standard library only) is copied where nobody may read it, since the checkout may
    sit in a folder only root can enter (CI's clone in a mktemp folder), and run by the system's python."""
    name = cli_name("n")
    readable = Path(tempfile.mkdtemp(prefix="zl-vcluster-", dir="/tmp"))
    try:
        shutil.copy(TOOL, readable / TOOL.name)
        shutil.copytree(TOOL.parent / "vcluster", readable / "vcluster", ignore=shutil.ignore_patterns("__pycache__"))
        for path in [readable, *readable.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        python = shutil.which("python3", path="/usr/bin:/bin") or PYTHON
        result = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", python,
                                 str(readable / TOOL.name), "--name", name, "up", "--hosts", "2"],
                                capture_output=True, text=True)
    finally:
        shutil.rmtree(readable)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "error: virtual_cluster needs root to make and enter namespaces, links and mounts (running as uid 65534)"]
    assert our_namespaces(name) == []


def test_failed_up_removes_what_it_made(cli_name):
    """The scratch mount point cannot be made (under a file), after the switch and a host exist."""
    name = cli_name("f")
    result = cli("up", "--name", name, "--hosts", "2", "--scratch", "--scratch-path", "/etc/hostname/scratch")
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "error: up failed, everything it made is removed again: [Errno 20] Not a directory: '/etc/hostname/scratch'"]
    assert our_namespaces(name) == [] and not state_dir(name).exists()


def test_down_after_a_failing_test_removes_everything(tmp_path):
    """A test dies with servers, sleepers and a CLI `run` still going inside the hosts; down ends them all."""
    cluster = VirtualCluster.up(hosts=2, name=cluster_name("d"))
    keepers, inodes = cluster.keepers(), cluster.netns_inodes()
    started = []
    try:
        try:
            started.append(serve(cluster, "node1", seconds=600))
            started.append(cluster.popen("node0", ["sleep", "600"]))
            started.append(subprocess.Popen([PYTHON, str(TOOL), "--name", cluster.name, "run", "node0", "--",
                                             "sh", "-c", "sleep 600 & sleep 600"]))
            time.sleep(0.3)
            assert len(cluster.processes()) >= 6  # 2 keepers, the server, 3 sleeps
            raise AssertionError("the test fails here")
        except AssertionError:
            pass
        assert "stopped" in cli("down", "--name", cluster.name).stdout
    finally:
        cluster.down()  # a second down finds nothing left and succeeds
    for process in started:
        assert process.wait(timeout=10) is not None
    assert_nothing_left(cluster.name, keepers, inodes)


def test_up_interrupted_removes_what_it_made(cli_name):
    """SIGTERM (as Ctrl-C) while up is making hosts: it takes them apart again and says so in one line."""
    name = cli_name("i")
    up = subprocess.Popen([PYTHON, str(TOOL), "up", "--name", name, "--hosts", "40"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while len(our_namespaces(name)) < 4 and time.monotonic() < deadline and up.poll() is None:
        time.sleep(0.01)
    up.send_signal(signal.SIGTERM)
    out, err = up.communicate(timeout=60)
    assert (up.returncode, out, err.splitlines()) == (
        1, "", ["error: up was interrupted; everything it made is removed again"])
    assert our_namespaces(name) == [] and not state_dir(name).exists()


def test_down_after_up_was_killed(cli_name):
    """`up` killed outright (SIGKILL: no clean-up of its own) while making hosts: down removes the rest."""
    name = cli_name("k")
    up = subprocess.Popen([PYTHON, str(TOOL), "up", "--name", name, "--hosts", "40"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while len(our_namespaces(name)) < 4 and time.monotonic() < deadline and up.poll() is None:
        time.sleep(0.01)
    up.send_signal(signal.SIGKILL)
    up.wait()
    left = our_namespaces(name)
    assert len(left) >= 4, "up finished before it could be killed"
    state = VirtualCluster.attach(name)
    inodes, keepers = state.netns_inodes(), state.keepers()
    result = cli("down", "--name", name)
    assert result.returncode == 0, result.stderr
    assert_nothing_left(name, keepers, inodes)
    assert cli("down", "--name", name).stdout.strip() == f"cluster {name}: nothing to take down"


def test_latency_or_its_refusal(make_cluster):
    """--latency needs the kernel's netem qdisc; without it up refuses with that reason and leaves nothing."""
    try:
        cluster = make_cluster("m", hosts=2, latency_ms=20)
    except ClusterError as error:
        assert "no netem qdisc" in str(error)
        assert our_namespaces(cluster_name("m")) == []
        pytest.skip(str(error))
    server = serve(cluster, "node1")
    try:
        connect(cluster, "node0", "node1")  # the first one also waits for the neighbour (ARP) lookup
        word, seconds = connect(cluster, "node0", "node1")
        assert word == "ok" and 0.035 < seconds < 0.2  # the handshake is one round trip: 2 x 20 ms
    finally:
        server.terminate()
        server.wait()


# ---- the slow ones: real data rates, Slurm, ssh and mpiexec ----

# Receive argv[2] bytes on port argv[1]; print the rate in bits per second from the first byte to the last.
RECEIVE = """
import socket, sys, time
server = socket.create_server(("0.0.0.0", int(sys.argv[1])), reuse_port=True)
server.settimeout(20)
print("listening", flush=True)
conn, _ = server.accept()
conn.settimeout(20)
total, need, first = 0, int(sys.argv[2]), None
while total < need:
    chunk = conn.recv(1 << 20)
    if not chunk:
        break
    first = first or time.monotonic()
    total += len(chunk)
print(total * 8 / (time.monotonic() - first))
"""
SEND = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=20) as conn:
    conn.sendall(b"x" * int(sys.argv[3]))
"""


def measure_rate(cluster: VirtualCluster, sender: str, receiver: str, nbytes: int) -> float:
    server = cluster.popen(receiver, [PYTHON, "-c", RECEIVE, str(PORT + 1), str(nbytes)], stdout=subprocess.PIPE,
                           text=True)
    try:
        assert server.stdout.readline().strip() == "listening"
        run_text(cluster, sender, [PYTHON, "-c", SEND, receiver, str(PORT + 1), str(nbytes)])
        out, _ = server.communicate(timeout=30)
    finally:
        server.kill()
        server.wait()
    return float(out)


@pytest.mark.slow
def test_bandwidth_is_shaped_both_ways(make_cluster):
    """200mbit each way, measured with 20 MB over TCP (under a second each way). TCP's payload is about 95%
    of what tbf counts (headers), so the measured rate sits a little below the configured one."""
    cluster = make_cluster("b", hosts=2, bandwidth="200mbit")
    rates = {(sender, receiver): measure_rate(cluster, sender, receiver, 20_000_000)
             for sender, receiver in (("node0", "node1"), ("node1", "node0"))}
    print("measured bits/s:", rates)
    for rate in rates.values():
        assert 0.85 * 200e6 < rate < 1.02 * 200e6
    # both ends of each host's link have the shaping: its eth0 (out) and its switch port (in)
    for host in cluster.state.hosts:
        for netns, dev in ((host.netns, "eth0"), (cluster.state.switch_netns, host.link)):
            shown = subprocess.run(["tc", "-s", "-n", netns, "qdisc", "show", "dev", dev], capture_output=True,
                                   text=True).stdout
            assert "rate 200Mbit" in shown
            sent = int(shown.split("Sent ")[1].split()[0])
            assert sent > 20_000_000, f"{dev} in {netns} passed only {sent} bytes"


@pytest.mark.slow
def test_slurm_runs_two_node_jobs(make_cluster, tmp_path):
    cluster = make_cluster("s", hosts=2, slurm=True)
    slurm = cluster.slurm
    assert slurm.node_states() == {"node0": "idle", "node1": "idle"}
    assert slurm.command("sinfo", "--noheader", "--format=%D %t").stdout.split() == ["2", "idle"]
    assert sorted(slurm.command("srun", "-N", "2", "hostname").stdout.split()) == ["node0", "node1"]
    tasks = slurm.command("srun", "-N", "2", "--ntasks-per-node=2", "hostname").stdout.split()
    assert sorted(tasks) == ["node0", "node0", "node1", "node1"]
    out = tmp_path / "job.out"
    submitted = slurm.command("sbatch", "-N", "2", f"--output={out}", "--wrap", "srun hostname", cwd=tmp_path)
    job_id = submitted.stdout.split()[-1]
    info = slurm.wait(job_id, timeout=60)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), slurm.log_tail()
    assert sorted(out.read_text().split()) == ["node0", "node1"]
    assert "SlurmctldHost=node0(10.250.0.1)" in slurm.conf.read_text()
    assert slurm.env({"PATH": "/bin"}) == {"PATH": "/bin:/usr/sbin", "SLURM_CONF": str(slurm.conf)}


@pytest.mark.slow
def test_ssh_between_hosts_and_mpiexec(make_cluster):
    before = {path: path.exists() and path.stat().st_mtime for path in (Path("/root/.ssh"), Path("/etc/ssh"))}
    cluster = make_cluster("h", hosts=2, ssh=True)
    wrapper = str(cluster.ssh_wrapper)
    assert run_text(cluster, "node0", [wrapper, "node1", "hostname"]).strip() == "node1"
    assert run_text(cluster, "node1", [wrapper, "node0", "hostname"]).strip() == "node0"
    apt_install(("mpich",), ("mpiexec",))
    if has_tool("mpiexec"):
        out = run_text(cluster, "node0", ["mpiexec", "-launcher", "ssh", "-launcher-exec", wrapper,
                                          "-hosts", "node0,node1", "-n", "2", "hostname"], timeout=60)
        assert sorted(out.split()) == ["node0", "node1"]
    after = {path: path.exists() and path.stat().st_mtime for path in before}
    assert after == before
