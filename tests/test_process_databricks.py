"""tools/process_databricks_gpt2.sh end to end on the real dolly sample, offline (vocabulary via
the PyPI path of tools/gpt2_vocab.py): one document per record ending with eod, the training
text of each record, idempotence, rebuild on newer input, and the offline messages."""
import json
import os
import subprocess

import numpy as np
import pytest

from conftest import REPO_ROOT
from conftest import test_env as subprocess_env
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.tokenizer import TokenizerConfig, build_tokenizer

SCRIPT = REPO_ROOT / "tools" / "process_databricks_gpt2.sh"


def run_script(**env):
    return subprocess.run(["bash", str(SCRIPT)], cwd=REPO_ROOT, env=subprocess_env(**env),
                          capture_output=True, text=True, timeout=300)


def dolly_text(record):
    parts = [record["context"], record["instruction"], record["response"]]
    return "\n".join(parts if record["context"] else parts[1:])


def test_one_document_per_record_each_ending_with_eod(dolly_data_dir, dolly_sample):
    ds = MMapIndexedDataset(dolly_data_dir / "dolly_text_document")
    assert len(ds.doc_idx) - 1 == 382 and len(ds) == 382 and ds.dtype == np.uint16
    tokenizer = build_tokenizer(TokenizerConfig(vocab_file=str(dolly_data_dir / "gpt2-vocab.json"),
                                                merge_file=str(dolly_data_dir / "gpt2-merges.txt")), verbose=False)
    records = [json.loads(line) for line in open(dolly_sample, encoding="utf-8")]
    for i, record in enumerate(records):
        tokens = ds[i]
        assert tokens[-1] == 50256 and 50256 not in tokens[:-1]
        assert tokens.tolist() == tokenizer.tokenize(dolly_text(record)) + [50256]
    # Other tests add index caches to this shared folder, so check only for what the script writes.
    written = {"dolly_text.jsonl", "dolly_text_document.bin", "dolly_text_document.idx", "gpt2-merges.txt", "gpt2-vocab.json"}
    assert written <= {p.name for p in dolly_data_dir.iterdir()}
    assert not [p.name for p in dolly_data_dir.iterdir() if ".tmp-" in p.name]


def test_second_run_is_a_no_op(dolly_data_dir, dolly_sample):
    outputs = [dolly_data_dir / "dolly_text_document.bin", dolly_data_dir / "dolly_text_document.idx"]
    before = [os.stat(path).st_mtime_ns for path in outputs]
    result = run_script(DATA_DIR=dolly_data_dir, DOLLY_JSONL=dolly_sample)
    assert result.returncode == 0, result.stderr
    assert "[dolly] up to date:" in result.stdout
    assert "382 documents" in result.stdout.splitlines()[-1]
    assert [os.stat(path).st_mtime_ns for path in outputs] == before


@pytest.mark.slow
def test_newer_input_is_rebuilt_with_given_vocab_files(tmp_path, dolly_data_dir, dolly_sample):
    source = tmp_path / "dolly.jsonl"
    source.write_bytes(b"".join(open(dolly_sample, "rb").readlines()[:10]))
    env = dict(DATA_DIR=tmp_path / "data", DOLLY_JSONL=source,
               VOCAB_FILE=dolly_data_dir / "gpt2-vocab.json", MERGE_FILE=dolly_data_dir / "gpt2-merges.txt")
    first = run_script(**env)
    assert first.returncode == 0, first.stderr
    assert "Processed 10 documents" in first.stdout and "gpt2_vocab" not in first.stdout
    assert "up to date" in run_script(**env).stdout
    later = os.stat(tmp_path / "data" / "dolly_text_document.idx").st_mtime + 10
    os.utime(source, (later, later))
    rebuilt = run_script(**env)
    assert rebuilt.returncode == 0 and "up to date" not in rebuilt.stdout and "Processed 10 documents" in rebuilt.stdout


def test_offline_without_dolly_file_uses_the_committed_sample(tmp_path, dolly_data_dir):
    result = run_script(DATA_DIR=tmp_path / "data", HF_HUB_OFFLINE=1, DOLLY_JSONL="",
                        VOCAB_FILE=dolly_data_dir / "gpt2-vocab.json", MERGE_FILE=dolly_data_dir / "gpt2-merges.txt")
    assert result.returncode == 0, result.stderr
    sample = REPO_ROOT / "data" / "samples" / "dolly-sample.jsonl"
    assert f"using the committed dolly sample {sample}" in result.stdout
    assert "DOLLY_JSONL=/path/to/databricks-dolly-15k.jsonl" in result.stdout  # how to give the full corpus
    ds = MMapIndexedDataset(tmp_path / "data" / "dolly_text_document")
    assert len(ds.doc_idx) - 1 == 382


def test_a_hub_out_of_reach_is_one_line_naming_curls_reason(tmp_path, dolly_data_dir):
    """Issue 56, item 10: curl printed `curl: (6) Could not resolve host` of its own before the line that says what
    happens instead; its reason is now in that line, once. The curl here fails as curl does without DNS (the
    machine running the test may have network)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "curl").write_text("#!/bin/sh\necho 'curl: (6) Could not resolve host: huggingface.co' >&2\nexit 6\n")
    (bin_dir / "curl").chmod(0o755)
    result = run_script(DATA_DIR=tmp_path / "data", HF_HUB_OFFLINE=0, DOLLY_JSONL="",
                        PATH=f"{bin_dir}{os.pathsep}{subprocess_env()['PATH']}",
                        VOCAB_FILE=dolly_data_dir / "gpt2-vocab.json", MERGE_FILE=dolly_data_dir / "gpt2-merges.txt")
    assert result.returncode == 0, result.stderr
    output = (result.stdout + result.stderr).splitlines()
    assert not [line for line in output if line.startswith("curl:")], output
    assert [line for line in output if "Could not resolve host" in line] == [
        "[dolly] the Hugging Face hub is out of reach (curl: (6) Could not resolve host: huggingface.co): using the "
        f"committed dolly sample {REPO_ROOT / 'data' / 'samples' / 'dolly-sample.jsonl'} (382 records; for the full "
        f"corpus give DOLLY_JSONL=/path/to/databricks-dolly-15k.jsonl or put it at "
        f"{tmp_path / 'data' / 'databricks-dolly-15k.jsonl'})"]
    assert not list((tmp_path / "data").glob("*.tmp-*"))


@pytest.mark.parametrize("bad_line, message", [
    ('{"instruction": "q", "response": "a"}', "missing key 'context'"),
    ('{"instruction": "q", "context": "", "response": 3}', "non-string value for key 'response'"),
    ('{"instruction": ', "malformed JSON"),
])
def test_bad_dolly_record_names_the_line_and_writes_nothing(tmp_path, dolly_data_dir, dolly_sample, bad_line, message):
    source = tmp_path / "dolly.jsonl"
    source.write_bytes(b"".join(open(dolly_sample, "rb").readlines()[:3]) + bad_line.encode() + b"\n")
    result = run_script(DATA_DIR=tmp_path / "data", DOLLY_JSONL=source,
                        VOCAB_FILE=dolly_data_dir / "gpt2-vocab.json", MERGE_FILE=dolly_data_dir / "gpt2-merges.txt")
    assert result.returncode == 1
    assert f"error: {source}:4: {message}" in result.stderr and "Traceback" not in result.stderr
    assert list((tmp_path / "data").iterdir()) == []


def test_missing_vocab_file_is_named(tmp_path, dolly_sample):
    result = run_script(DATA_DIR=tmp_path / "data", DOLLY_JSONL=dolly_sample, VOCAB_FILE=tmp_path / "nope.json",
                        MERGE_FILE=tmp_path / "nope.txt")
    assert result.returncode == 1 and f"error: VOCAB_FILE={tmp_path / 'nope.json'}: file not found" in result.stderr
