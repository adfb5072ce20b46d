"""Real pretrain_gpt.py runs the suite shares. One memoised runner (SharedRuns, conftest's `shared_runs` fixture):
tests that need the same run (the same flags and ranks) get the same run folder, and the run starts once per
session, for the first test that asks. The flags of the saved-checkpoint run are here too, with the command its
fault and manifest tests start their own runs from, so that those runs repeat its losses."""
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from conftest import REPO_ROOT, free_port, test_env

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
    """pretrain_cmd runs memoised by (ranks, flags), each saving into a folder of its own under `root`. Tests must
    not change a shared folder: they copy what they damage or resume into."""

    def __init__(self, root: Path, data_dir: Path):
        self.root, self.data_dir = root, data_dir
        self._runs: dict[tuple, subprocess.CompletedProcess | SharedRun] = {}

    def get(self, *flags: str, ranks: int = 2) -> SharedRun:
        key = (ranks, *flags)
        if key not in self._runs:
            folder = self.root / f"run{len(self._runs)}"
            run = run_pretrain(self.data_dir, *flags, "--save", str(folder), ranks=ranks, expect=None)
            # a failed run is remembered too: the next test that asks fails at once with its log
            self._runs[key] = SharedRun(run.stdout, folder) if run.returncode == 0 else run
        found = self._runs[key]
        assert isinstance(found, SharedRun), f"{' '.join(flags)}:\n{found.stdout[-3000:]}\n{found.stderr[-3000:]}"
        return found
