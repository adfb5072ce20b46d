"""Faults in the data path, caused for real: a tokenizer worker killed mid-run, an output folder
that cannot be written, SIGTERM/SIGINT to the dolly driver, a dataset made with another vocabulary,
stale data, and a run that diverged (docs/faults.md lists them with what the user sees)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from analysis.log_parser import parse_log
from conftest import REPO_ROOT, driver_env, free_port
from conftest import test_env as subprocess_env
from megatron.data.dataset_sidecar import (DataVocabularyError, check_data_against_model, read_sidecar,
                                           sidecar_path, staleness, tokenizer_record)
from megatron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder
from megatron.tokenizer import TokenizerConfig

PREPROCESS = REPO_ROOT / "tools" / "preprocess_data.py"
DOLLY_TO_TEXT = REPO_ROOT / "tools" / "dolly_to_text.py"
DRIVER = REPO_ROOT / "tools" / "process_databricks_gpt2.sh"
GPT2_PADDED = 50304  # 50257 rounded up to --make-vocab-size-divisible-by 128 x TP 1


@pytest.fixture(scope="module")
def gpt2(dolly_data_dir):
    return TokenizerConfig(vocab_file=str(dolly_data_dir / "gpt2-vocab.json"),
                           merge_file=str(dolly_data_dir / "gpt2-merges.txt"))


def gpt2_flags(cfg):
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", cfg.vocab_file, "--merge-file", cfg.merge_file]


@pytest.fixture(scope="module")
def big_dolly(tmp_path_factory, dolly_sample):
    """About 24 MB of dolly records (the sample repeated): long enough to stop a run mid-way."""
    path = tmp_path_factory.mktemp("big") / "dolly-big.jsonl"
    lines = dolly_sample.read_bytes()
    path.write_bytes(lines * (24_000_000 // len(lines) + 1))
    return path


@pytest.fixture(scope="module")
def big_text(tmp_path_factory, big_dolly):
    path = tmp_path_factory.mktemp("big_text") / "text.jsonl"
    subprocess.run([sys.executable, str(DOLLY_TO_TEXT), "--input", big_dolly, "--output", path],
                   env=subprocess_env(), check=True, capture_output=True, timeout=120)
    return path


def wait_for(condition, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def command_line(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:  # gone meanwhile
        return ""


# ---- preprocessing never hangs -------------------------------------------------------------------------

@pytest.mark.slow
def test_killed_worker_ends_the_run_with_one_line_and_no_output(tmp_path, big_text, gpt2):
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(PREPROCESS), "--input", big_text, "--output-prefix", out / "big",
                             *gpt2_flags(gpt2), "--workers", "2"], env=subprocess_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # mid-run: both workers forked and the .bin being written under its temporary name
        workers = wait_for(lambda: len(psutil.Process(proc.pid).children()) == 2
                           and list(out.glob("big_text_document.bin.tmp-*"))
                           and psutil.Process(proc.pid).children(), what="the workers and the temporary .bin")
        os.kill(workers[0].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        stdout, stderr = proc.communicate(timeout=60)  # a hang fails here
    finally:
        if proc.poll() is None:
            proc.kill()
    print(f"exit {time.monotonic() - killed_at:.2f} s after the SIGKILL")
    assert proc.returncode == 1, stderr
    assert stderr.strip() == ("error: a tokenizer worker process died abruptly (killed by a signal, e.g. the "
                              f"out-of-memory killer); stopped without writing --output-prefix {out / 'big'}")
    assert "Processed" not in stdout
    assert list(out.iterdir()) == []
    assert not alive(workers[1])


def test_output_under_a_file_is_one_line_before_any_work(tmp_path, dolly_sample, gpt2):
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    for prefix, message in ((afile / "ds", f"{afile} is a file, not a folder"),
                            (afile / "sub" / "ds", f"cannot write to {afile / 'sub'} (Not a directory)")):
        result = subprocess.run([sys.executable, str(PREPROCESS), "--input", dolly_sample, "--json-keys", "context",
                                 "--output-prefix", prefix, *gpt2_flags(gpt2), "--workers", "2"],
                                env=subprocess_env(), capture_output=True, text=True, timeout=120)
        assert result.returncode == 1
        assert result.stderr == f"error: --output-prefix {prefix}: {message}\n"
    result = subprocess.run([sys.executable, str(DOLLY_TO_TEXT), "--input", dolly_sample, "--output",
                             afile / "text.jsonl"], env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr == f"error: --output {afile / 'text.jsonl'}: cannot write (Not a directory)\n"
    result = subprocess.run(["bash", str(DRIVER)], cwd=REPO_ROOT, env=subprocess_env(DATA_DIR=afile / "data"),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr == f"error: DATA_DIR={afile / 'data'}: cannot create or write to this folder\n"
    assert afile.read_text() == "not a folder"


def read_only_mount_works(folder) -> bool:
    probe = subprocess.run(["unshare", "--mount", "sh", "-c", f"mount -t tmpfs -o ro tmpfs '{folder}'"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


def test_read_only_output_folder_is_one_line(tmp_path, dolly_sample, gpt2):
    """A read-only tmpfs, mounted in a private mount namespace: root cannot write there either."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if shutil.which("unshare") is None or not read_only_mount_works(folder):
        pytest.skip("cannot mount a read-only tmpfs here (needs unshare and mount privileges)")
    for command, message in (
            ([sys.executable, PREPROCESS, "--input", dolly_sample, "--output-prefix", folder / "ds", *gpt2_flags(gpt2)],
             f"error: --output-prefix {folder / 'ds'}: cannot write to {folder} (Read-only file system)"),
            ([sys.executable, DOLLY_TO_TEXT, "--input", dolly_sample, "--output", folder / "text.jsonl"],
             f"error: --output {folder / 'text.jsonl'}: cannot write (Read-only file system)"),
            (["bash", DRIVER], f"error: DATA_DIR={folder}: cannot create or write to this folder")):
        quoted = " ".join(f"'{part}'" for part in command)
        result = subprocess.run(["unshare", "--mount", "sh", "-c",
                                 f"mount -t tmpfs -o ro tmpfs '{folder}' && exec {quoted}"],
                                cwd=REPO_ROOT, env=subprocess_env(DATA_DIR=folder), capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 1 and result.stderr == message + "\n", result.stderr


def driver_while_tokenizing(data, big_dolly, gpt2):
    """process_databricks_gpt2.sh started on the big dolly file, once preprocess_data.py writes its
    .bin: (the driver process, its descendants then)."""
    env = subprocess_env(DATA_DIR=data, DOLLY_JSONL=big_dolly, VOCAB_FILE=gpt2.vocab_file, MERGE_FILE=gpt2.merge_file,
                         WORKERS=2)
    # SIGINT as a terminal delivers it: a suite started in the background of a shell inherits it ignored,
    # and a shell cannot trap a signal that was ignored when it started
    proc = subprocess.Popen(["bash", str(DRIVER)], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))

    def tokenizing():
        family = psutil.Process(proc.pid).children(recursive=True)
        busy = any("preprocess_data.py" in command_line(p) for p in family)
        return family if busy and list(data.glob("*.bin.tmp-*")) else None
    try:
        return proc, wait_for(tokenizing, what="preprocess_data.py writing its .bin")
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise


def assert_nothing_left(data, family):
    assert not [p.name for p in data.iterdir() if ".tmp-" in p.name]
    assert not list(data.glob("dolly_text_document.*"))
    assert [p.pid for p in family if alive(p)] == []


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_driver_stops_its_children_and_removes_temporary_files(tmp_path, big_dolly, gpt2, signum):
    proc, family = driver_while_tokenizing(tmp_path / "data", big_dolly, gpt2)
    try:
        os.kill(proc.pid, signum)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signum, stderr
    assert f"error: stopped by {signal.Signals(signum).name}; temporary files removed" in stderr
    assert "Traceback" not in stderr
    assert_nothing_left(tmp_path / "data", family)


@pytest.mark.slow
def test_killed_preprocessing_under_the_driver_is_named_and_cleaned_up(tmp_path, big_dolly, gpt2):
    """SIGKILL to preprocess_data.py's main process (as the out-of-memory killer may choose it): it
    cannot clean up, so its workers die with it (PR_SET_PDEATHSIG) and the driver removes its files."""
    proc, family = driver_while_tokenizing(tmp_path / "data", big_dolly, gpt2)
    (main,) = [p for p in family if "preprocess_data.py" in command_line(p) and p.ppid() == proc.pid]
    try:
        main.kill()
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 137
    assert stderr.strip().splitlines()[-1] == "error: preprocess_data.py was killed by SIGKILL"
    time.sleep(0.5)  # the kernel delivers the workers' parent-death signal asynchronously
    assert_nothing_left(tmp_path / "data", family)


# ---- data checked against the model ---------------------------------------------------------------------

def write_dataset(prefix, documents, dtype=np.uint16):
    builder = MMapIndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for ids in documents:
        builder.add_item(np.asarray(ids))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def foreign_documents(top_id, count=64, length=200, seed=0):
    """Documents of GPT-2-range ids with one id `top_id` in the middle (another vocabulary's data)."""
    rng = np.random.default_rng(seed)
    documents = [rng.integers(0, 50257, size=length) for _ in range(count)]
    documents[count // 2][length // 2] = top_id
    return documents


def test_foreign_ids_are_an_error_naming_file_id_and_vocabulary(tmp_path, dolly_data_dir, gpt2):
    good = str(dolly_data_dir / "dolly_text_document")
    bad = write_dataset(tmp_path / "foreign", foreign_documents(60000))
    assert not os.path.exists(sidecar_path(bad))  # built by the builder alone: scanned with numpy
    with pytest.raises(DataVocabularyError) as raised:
        check_data_against_model(["0.7", good, "0.3", bad], gpt2, 50257, GPT2_PADDED)
    message = str(raised.value)
    files = tokenizer_record(gpt2, 50257)["files"]
    assert message == (f"--data-path {bad}: {bad}.bin holds token id 60000 but the model's padded vocabulary has "
                       f"50304 ids [GPT2BPETokenizer, 50257 ids, gpt2-vocab.json "
                       f"sha256:{files['vocab_file']['sha256'][:12]}, gpt2-merges.txt "
                       f"sha256:{files['merge_file']['sha256'][:12]}]; the data was made with another tokenizer: "
                       "rebuild it with tools/preprocess_data.py and this run's tokenizer flags")
    assert "\n" not in message
    # ids within the padding: a warning, not an error
    padded_only = write_dataset(tmp_path / "padded", foreign_documents(50300))
    warnings = check_data_against_model([padded_only], gpt2, 50257, GPT2_PADDED)
    assert warnings == [f"--data-path {padded_only}: {padded_only}.bin holds token id 50300, beyond the tokenizer's "
                        "50257 ids (within the padded vocabulary): was it made with another tokenizer?"]
    assert check_data_against_model([good], gpt2, 50257, GPT2_PADDED) == []


def test_sidecar_records_the_max_id_and_a_stale_one_is_not_trusted(tmp_path, dolly_data_dir):
    prefix = dolly_data_dir / "dolly_text_document"
    record = read_sidecar(prefix)
    tokens = np.fromfile(f"{prefix}.bin", dtype=np.uint16)
    assert record["max_token_id"] == int(tokens.max()) == 50256
    assert record["bin_bytes"] == tokens.nbytes and record["tokenizer"]["vocab_size"] == 50257
    # a sidecar beside a .bin it does not describe (here: rebuilt without one) is ignored, and the data scanned
    copy = tmp_path / "copy"
    write_dataset(copy, foreign_documents(60000))
    shutil.copyfile(sidecar_path(prefix), sidecar_path(copy))
    assert read_sidecar(copy) is None
    with pytest.raises(DataVocabularyError, match="holds token id 60000"):
        check_data_against_model([str(copy)], TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=50256),
                                 50257, GPT2_PADDED)


@pytest.mark.slow  # three driver runs
def test_stale_data_warns_and_the_driver_rebuilds(tmp_path, dolly_data_dir, dolly_sample, gpt2):
    source = tmp_path / "dolly.jsonl"
    lines = dolly_sample.read_bytes().splitlines(keepends=True)
    source.write_bytes(b"".join(lines[:20]))
    env = dict(DATA_DIR=tmp_path / "data", DOLLY_JSONL=source, VOCAB_FILE=gpt2.vocab_file, MERGE_FILE=gpt2.merge_file)
    run = subprocess.run(["bash", str(DRIVER)], cwd=REPO_ROOT, env=subprocess_env(**env), capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    prefix, text = str(tmp_path / "data" / "dolly_text_document"), tmp_path / "data" / "dolly_text.jsonl"
    assert check_data_against_model([prefix], gpt2, 50257, GPT2_PADDED) == []

    # another vocabulary file (same ids, reformatted JSON): the run is warned, the driver rebuilds
    other = tmp_path / "vocab-reformatted.json"
    other.write_text(json.dumps(json.loads(open(gpt2.vocab_file, encoding="utf-8").read()), indent=0))
    other_cfg = TokenizerConfig(vocab_file=str(other), merge_file=gpt2.merge_file)
    (warning,) = check_data_against_model([prefix], other_cfg, 50257, GPT2_PADDED)
    assert warning.startswith(f"--data-path {prefix}: {prefix}.bin was built with [GPT2BPETokenizer, 50257 ids, "
                              "gpt2-vocab.json sha256:") and "but this run uses [GPT2BPETokenizer, 50257 ids, " \
                              "vocab-reformatted.json sha256:" in warning
    rebuilt = subprocess.run(["bash", str(DRIVER)], cwd=REPO_ROOT, env=subprocess_env(**dict(env, VOCAB_FILE=other)),
                             capture_output=True, text=True, timeout=300)
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert "[dolly] rebuilding: " in rebuilt.stdout and "Processed 20 documents" in rebuilt.stdout
    assert staleness(prefix, text, tokenizer_record(other_cfg, 50257)) == ""

    # the source replaced by other records with an OLDER mtime (make's rule alone would keep the data)
    source.write_bytes(b"".join(lines[20:30]))
    os.utime(source, (1_000_000_000, 1_000_000_000))
    text_before = text.stat()
    again = subprocess.run(["bash", str(DRIVER)], cwd=REPO_ROOT, env=subprocess_env(**dict(env, VOCAB_FILE=other)),
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "Processed 10 documents" in again.stdout
    assert len(MMapIndexedDataset(prefix)) == 10 and text.stat().st_mtime_ns != text_before.st_mtime_ns

    # data older than its source: the text changed after the data was built
    text.write_text(text.read_text() + json.dumps({"text": "one more"}) + "\n")
    (warning,) = check_data_against_model([prefix], other_cfg, 50257, GPT2_PADDED)
    assert warning.startswith(f"--data-path {prefix}: {prefix}.bin is older than its source: {text} changed since "
                              "the data was built (")


# ---- the same checks at training start-up, and a diverged run's summary ----------------------------------

def pretrain(data_prefix, data_dir, *extra, ranks=1, iters=2, output=None):
    """pretrain_gpt.py on `ranks` CPU ranks under torchrun (stdout and stderr together, as the drivers' train.log)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
           str(free_port()), str(REPO_ROOT / "pretrain_gpt.py"), "--model-size", "tiny", "--seq-length", "64",
           "--micro-batch-size", "2", "--global-batch-size", str(2 * ranks), "--train-iters", str(iters),
           "--log-interval", "1", "--eval-iters", "0", "--lr", "1e-3", "--seed", "7", "--data-path", str(data_prefix),
           "--vocab-file", str(data_dir / "gpt2-vocab.json"), "--merge-file", str(data_dir / "gpt2-merges.txt"),
           *map(str, extra)]
    return subprocess.run(cmd, env=subprocess_env(), stdout=output or subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("tp, padded", [(1, 50304), (2, 50432)])  # 50257 rounded up to a multiple of 128 x TP
def test_pretrain_stops_on_foreign_ids_for_every_tp(tmp_path, dolly_data_dir, tp, padded):
    bad = write_dataset(tmp_path / "foreign", foreign_documents(60000))
    run = pretrain(bad, dolly_data_dir, "--tensor-model-parallel-size", tp, ranks=tp)
    assert run.returncode != 0
    errors = {line for line in run.stdout.splitlines() if line.startswith("error: ")}
    assert len(errors) == 1, run.stdout[-3000:]
    assert errors.pop().startswith(f"error: --data-path {bad}: {bad}.bin holds token id 60000 but the model's padded "
                                   f"vocabulary has {padded} ids [GPT2BPETokenizer, 50257 ids, ")
    assert "IndexError" not in run.stdout and 'pretrain_gpt.py", line' not in run.stdout
    assert " iteration " not in run.stdout


@pytest.mark.slow
def test_pretrain_warns_once_about_stale_data(tmp_path, dolly_data_dir):
    data = tmp_path / "data"
    shutil.copytree(dolly_data_dir, data, ignore=shutil.ignore_patterns("*.npy"))
    vocab = data / "gpt2-vocab.json"
    vocab.write_text(json.dumps(json.loads(vocab.read_text(encoding="utf-8")), indent=0))  # another file, same ids
    text = data / "dolly_text.jsonl"
    record = read_sidecar(data / "dolly_text_document")
    record["source"] = dict(record["source"], path=str(text))  # the copy's source is the copied text
    with open(sidecar_path(data / "dolly_text_document"), "w") as handle:
        json.dump(record, handle)
    text.write_text(text.read_text() + json.dumps({"text": "one more"}) + "\n")
    run = pretrain(data / "dolly_text_document", data, ranks=2)
    assert run.returncode == 0, run.stdout[-3000:]
    warnings = [line for line in run.stdout.splitlines() if line.startswith("warning: --data-path")]
    assert len(warnings) == 2, warnings
    assert "was built with [GPT2BPETokenizer" in warnings[0] and "is older than its source" in warnings[1]


@pytest.mark.slow
def test_diverged_run_is_summarized_as_diverged(tmp_path, dolly_data_dir):
    run_dir = tmp_path / "runs" / "gpt_tiny_nan"
    run_dir.mkdir(parents=True)
    with open(run_dir / "train.log", "w") as log:
        # lr 1e30: the first update sends the weights to ~1e30, every later forward overflows to inf/nan
        run = pretrain(dolly_data_dir / "dolly_text_document", dolly_data_dir, "--lr", "1e30",
                       "--lr-warmup-iters", "0", "--max-nan-iterations", "3", iters=10, output=log)
    assert run.returncode != 0
    result = subprocess.run([sys.executable, str(REPO_ROOT / "analysis" / "summarize.py"), tmp_path / "runs",
                             "--no-plots"], env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    (row,) = json.loads((tmp_path / "runs" / "summary.json").read_text())["runs"]
    assert (row["status"], row["nan_iterations"], row["complete"]) == ("diverged at iteration 4", 2, False)
    assert f"| {row['label']} | diverged at iteration 4 |" in (tmp_path / "runs" / "summary.md").read_text()
    assert parse_log(run_dir / "train.log").diverged_at == 4


@pytest.mark.slow
def test_a_read_only_data_folder_puts_the_index_caches_in_the_run_folder(tmp_path, dolly_data_dir):
    """A cluster's shared datasets are read-only: the Z1 driver, inside a private mount namespace where the
    data folder is bind-mounted read-only, trains and writes the dataset index caches into its run folder."""
    data = tmp_path / "data"
    shutil.copytree(dolly_data_dir, data, ignore=shutil.ignore_patterns("*.npy"))
    if shutil.which("unshare") is None or not read_only_mount_works(tmp_path / "data"):
        pytest.skip("cannot mount a read-only folder here (needs unshare and mount privileges)")
    env = {**driver_env(dolly_data_dir, tmp_path / "runs"), "DATA_PATH": str(data / "dolly_text_document")}
    result = subprocess.run(["unshare", "--mount", "sh", "-c",
                             f"mount --bind '{data}' '{data}' && mount -o remount,bind,ro '{data}' && "
                             f"exec bash '{REPO_ROOT / 'examples_zero' / 'gpt_deepspeed_Z1.sh'}'"],
                            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = tmp_path / "runs" / "gpt_tiny_Z1"
    cache = run_dir / "index-cache"
    assert (f"note: {data} is not writable: the dataset index caches go to {cache} (--data-cache-path)"
            in (run_dir / "train.log").read_text())
    assert sorted(path.name.split("_indexmap_")[0] for path in cache.glob("*.npy")) == \
        ["dolly_text_document_train"] * 3 + ["dolly_text_document_valid"] * 3  # doc, sample and shuffle index
    assert not list(data.glob("*.npy"))
