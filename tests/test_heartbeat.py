"""The heartbeat's threads end before the rank's process does (megatron/runtime/heartbeat.py).

A daemon thread still inside a store call when Python shuts down is ended by pthread_exit, and its unwinding
through torch's C++ frames aborted the rank: SIGABRT after "[after training is done]", seen once in CI on a
Z3_OL driver run. Here a rank-1 heartbeat beats without pause against a real TCPStore, so its thread is in a
store call nearly all the time, and the process exits right after stop().
"""
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, test_env

RANK_1_THAT_EXITS = """
import os, sys, time
import torch.distributed as dist
from megatron.runtime.heartbeat import Heartbeat
from megatron.runtime.lost_peer import Peer, Peers

store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port))
peers = Peers([Peer(0, "node0", "127.0.0.1"), Peer(1, "node0", "127.0.0.1")], rank=1)
heartbeat = Heartbeat(peers, beat_seconds=0.0).start()
time.sleep(0.3)
heartbeat.stop(finished=sys.argv[1] == "finished")
print("beats", int(store.add("zero-lab/heartbeat/1", 0)) > 0, "done", store.check(["zero-lab/heartbeat/done/1"]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("attempt", range(3))
def test_a_rank_that_finished_exits_cleanly_while_its_heartbeat_was_in_a_store_call(attempt):
    result = subprocess.run([sys.executable, "-c", RANK_1_THAT_EXITS, "finished"], cwd=REPO_ROOT, env=test_env(),
                            capture_output=True, text=True, timeout=120)
    assert "terminate called" not in result.stderr
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["beats", "True", "done", "True"]


@pytest.mark.slow
def test_a_rank_that_failed_stops_beating_without_marking_itself_done():
    result = subprocess.run([sys.executable, "-c", RANK_1_THAT_EXITS, "failed"], cwd=REPO_ROOT, env=test_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["beats", "True", "done", "False"]


def test_the_silence_a_host_is_given_is_a_minute_unless_the_environment_says():
    from megatron.runtime.heartbeat import SILENT_SECONDS, silent_seconds
    assert silent_seconds({}) == SILENT_SECONDS == 60.0
    assert silent_seconds({"ZERO_LAB_HEARTBEAT_SECONDS": "30"}) == 30.0


@pytest.mark.parametrize("value", ["10", "thirty", "nan", "-30"])
def test_a_silence_shorter_than_three_beats_or_not_a_number_is_one_line(value):
    from megatron.errors import ZeroLabError
    from megatron.runtime.heartbeat import silent_seconds
    with pytest.raises(ZeroLabError) as error:
        silent_seconds({"ZERO_LAB_HEARTBEAT_SECONDS": value})
    assert str(error.value) == (f"ZERO_LAB_HEARTBEAT_SECONDS={value}: expected seconds >= 15 (three beats of 5 s; "
                                "default 60)")
