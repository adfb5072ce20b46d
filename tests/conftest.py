"""Fixtures shared by the whole suite: paths, the real dolly sample, a prepared dataset."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
DOLLY_SAMPLE = SHARED_DATA / "dolly-sample.jsonl"
DOLLY_SAMPLE_RECORDS = 382

# This interpreter's tools first on PATH, for the tests and every subprocess they start: torch
# builds DeepSpeed's C++ ops with the first `ninja` found, and two different ninjas (the venv's
# and Debian's) invalidate each other's builds, making every multi-rank start rebuild them.
os.environ["PATH"] = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")


def test_env(**overrides):
    """Environment for subprocesses: CPU accelerator, this repo importable, no hub access."""
    env = dict(os.environ)
    env.update(
        DS_ACCELERATOR="cpu",
        PYTHONPATH=str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        HF_HUB_OFFLINE="1",
        PYTHON=sys.executable,
        PATH=str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", ""),
    )
    env.update({k: str(v) for k, v in overrides.items()})
    return env


test_env.__test__ = False  # a helper, not a test, although its name starts with test_


@pytest.fixture(scope="session")
def repo_root():
    return REPO_ROOT


@pytest.fixture(scope="session")
def dolly_sample():
    assert DOLLY_SAMPLE.is_file(), f"missing test data {DOLLY_SAMPLE} (../shared must sit beside the checkout)"
    return DOLLY_SAMPLE


@pytest.fixture(scope="session")
def dolly_data_dir(tmp_path_factory, dolly_sample):
    """A data folder prepared by the real user command on the dolly sample:
    gpt2-vocab.json, gpt2-merges.txt and dolly_text_document.{bin,idx}."""
    data_dir = tmp_path_factory.mktemp("dolly_data")
    result = subprocess.run(
        ["bash", str(REPO_ROOT / "tools" / "process_databricks_gpt2.sh")],
        cwd=REPO_ROOT,
        env=test_env(DATA_DIR=data_dir, DOLLY_JSONL=dolly_sample),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return data_dir
