"""Real pretrain_gpt.py runs the suite shares. One memoised runner (SharedRuns, conftest's `shared_runs` fixture):
tests that need the same run (the same flags and ranks) get the same run folder, and the run starts once per
session, for the first test that asks. The flags of the saved-checkpoint run are here too, with the command its
fault and manifest tests start their own runs from, so that those runs repeat its losses."""
import hashlib
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from conftest import REPO_ROOT, free_port, made_once, process_result, shared_folder, test_env

# The saved-checkpoint run: 2 CPU ranks, ZeRO-1, dropout off, CHECKPOINT_ITERS iterations with a checkpoint every
# 2 (global_step2, 4, 6, 8), one evaluation of 8 samples after the last iteration (tests/test_eval_dolly.py holds
# tools/eval_dolly.py's loss on the checkpoint to it; after the last step, it changes none of the run's losses)
CHECKPOINT_ITERS = 8
CHECKPOINT_RUN = ("--zero-stage", "1", "--save-interval", "2", "--eval-interval", str(CHECKPOINT_ITERS),
                  "--eval-iters", "1")
# The start-up probes only feed the time lines, which these runs' tests do not read (docs/log-lines.md)
SKIP_PROBES = {"ZERO_LAB_SKIP_PROBES": "1"}


def pretrain_cmd(data_dir: Path, ranks: int, *extra: str) -> list[str]:
    """torchrun of pretrain_gpt.py with the saved-checkpoint run's settings; `extra` adds or overrides flags."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
            "--master_port", str(free_port()), str(REPO_ROOT / "pretrain_gpt.py"), "--model-size", "tiny",
            "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
            "--train-iters", str(CHECKPOINT_ITERS), "--log-interval", "1", "--eval-interval", "100",
            "--eval-iters", "0", "--lr", "1e-3", "--lr-warmup-iters", "2",
            "--hidden-dropout", "0", "--attention-dropout", "0",
            "--data-path", str(data_dir / "dolly_text_document"), "--vocab-file", str(data_dir / "gpt2-vocab.json"),
            "--merge-file", str(data_dir / "gpt2-merges.txt"), *extra]


def run_pretrain(data_dir: Path, *extra: str, ranks: int = 2, env: dict | None = None, expect: int | None = 0,
                 timeout: int = 600) -> subprocess.CompletedProcess:
    """pretrain_cmd run to its end, without the start-up probes; with `expect`, its exit status is asserted (the
    log's tail if not)."""
    run = subprocess.run(pretrain_cmd(data_dir, ranks, *extra), env={**(env or test_env()), **SKIP_PROBES},
                         capture_output=True, text=True, timeout=timeout)
    if expect is not None:
        assert run.returncode == expect, run.stdout[-3000:] + run.stderr[-3000:]
    return run


@dataclass
class SharedRun:
    stdout: str
    folder: Path  # its --save folder


class SharedRuns:
    """pretrain_cmd runs memoised by (ranks, flags) across the session's workers (conftest.made_once), each saving
    into a folder of its own in the workers' shared folder. Tests must not change a shared folder: they copy what
    they damage or resume into."""

    def __init__(self, tmp_path_factory, data_dir: Path):
        self.tmp_path_factory, self.data_dir = tmp_path_factory, data_dir

    def get(self, *flags: str, ranks: int = 2) -> SharedRun:
        key = (ranks, *flags)
        name = "shared_run_" + hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]

        def make(folder):
            run = run_pretrain(self.data_dir, *flags, "--save", str(folder), ranks=ranks, expect=None)
            return process_result(run)

        # a failed run is remembered too: the next test that asks fails at once with its log
        found = made_once(self.tmp_path_factory, name, make)
        assert found["returncode"] == 0, f"{' '.join(flags)}:\n{found['stdout'][-3000:]}\n{found['stderr'][-3000:]}"
        return SharedRun(found["stdout"], shared_folder(self.tmp_path_factory) / name)
