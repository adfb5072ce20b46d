"""tools/preprocess_data.py: Megatron flags, output files and contents, identical output for
any worker count and for gzip input, and bad input (file:line errors, exit 1, no files left); Llama's
tokenizers (Llama3Tokenizer, Llama2Tokenizer) on small tokenizer files made offline."""
import gzip
import importlib.util
import json
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO_ROOT
from conftest import test_env as subprocess_env
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.tokenizer import TokenizerConfig, build_tokenizer
from tokenizer_files import train_sentencepiece, write_tiktoken_bpe

TOOL = REPO_ROOT / "tools" / "preprocess_data.py"


@pytest.fixture(scope="module")
def gpt2_flags(dolly_data_dir):
    return ["--vocab-file", str(dolly_data_dir / "gpt2-vocab.json"), "--merge-file", str(dolly_data_dir / "gpt2-merges.txt")]


@pytest.fixture(scope="module")
def gpt2(dolly_data_dir):
    return build_tokenizer(TokenizerConfig(vocab_file=str(dolly_data_dir / "gpt2-vocab.json"),
                                           merge_file=str(dolly_data_dir / "gpt2-merges.txt")), verbose=False)


def preprocess(*args):
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], env=subprocess_env(),
                          capture_output=True, text=True, timeout=120)


def write_jsonl(path, lines):
    path.write_bytes(b"".join(line if isinstance(line, bytes) else line.encode() + b"\n" for line in lines))
    return path


def test_two_keys_of_the_dolly_sample_with_eod(tmp_path, dolly_sample, gpt2_flags, gpt2):
    result = preprocess("--input", dolly_sample, "--json-keys", "instruction", "response", "--output-prefix",
                        tmp_path / "out" / "dolly", *gpt2_flags, "--append-eod", "--workers", "2", "--log-interval", "100")
    assert result.returncode == 0, result.stderr
    last = result.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"Processed 382 documents, \d+ tokens in [\d.]+ s \(\d+ docs/s, [\d.]+ MB/s\)", last), last
    records = [json.loads(line) for line in open(dolly_sample, encoding="utf-8")]
    tokens = 0
    for key in ("instruction", "response"):
        ds = MMapIndexedDataset(tmp_path / "out" / f"dolly_{key}_document")
        assert ds.dtype == np.uint16 and len(ds) == 382 and ds.doc_idx.tolist() == list(range(383))
        for i, record in enumerate(records):
            assert ds[i].tolist() == gpt2.tokenize(record[key]) + [50256]
        tokens += int(ds.sizes.sum())
    assert f"382 documents, {tokens} tokens" in last
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "dolly_instruction_document.bin", "dolly_instruction_document.idx", "dolly_instruction_document.meta.json",
        "dolly_response_document.bin", "dolly_response_document.idx", "dolly_response_document.meta.json"]


def test_output_is_identical_for_any_worker_count_and_gzip_input(tmp_path, dolly_sample, gpt2_flags):
    with gzip.open(tmp_path / "dolly.jsonl.gz", "wb") as packed:
        packed.write(open(dolly_sample, "rb").read())
    runs = {"w1": (dolly_sample, "1"), "w2": (dolly_sample, "2"), "gz": (tmp_path / "dolly.jsonl.gz", "2")}
    for name, (source, workers) in runs.items():
        result = preprocess("--input", source, "--json-keys", "context", "--output-prefix", tmp_path / name,
                            *gpt2_flags, "--workers", workers)
        assert result.returncode == 0, result.stderr
    for suffix in ("bin", "idx"):
        outputs = {(tmp_path / f"{name}_context_document.{suffix}").read_bytes() for name in runs}
        assert len(outputs) == 1
    # Without --append-eod no eod; records with an empty context are left out (no tokens).
    ds = MMapIndexedDataset(tmp_path / "w1_context_document")
    empty = sum(1 for line in open(dolly_sample, encoding="utf-8") if not json.loads(line)["context"])
    assert len(ds) == 382 - empty and all(ds[i][-1] != 50256 for i in range(len(ds)))


def test_null_tokenizer_and_dtype_by_vocab_size(tmp_path):
    source = write_jsonl(tmp_path / "ids.jsonl", ['{"text": "1 2 3"}', "", '{"text": "70000 5"}'])
    result = preprocess("--input", source, "--output-prefix", tmp_path / "big", "--tokenizer-type", "NullTokenizer",
                        "--vocab-size", "100000", "--append-eod")
    assert result.returncode == 0, result.stderr
    ds = MMapIndexedDataset(tmp_path / "big_text_document")
    assert ds.dtype == np.int32 and [ds[i].tolist() for i in range(2)] == [[1, 2, 3, 100000], [70000, 5, 100000]]
    source = write_jsonl(tmp_path / "small.jsonl", ['{"text": "7 8"}'])
    result = preprocess("--input", source, "--output-prefix", tmp_path / "small", "--tokenizer-type", "NullTokenizer",
                        "--vocab-size", "1000", "--dataset-impl", "mmap")
    assert result.returncode == 0, result.stderr
    assert MMapIndexedDataset(tmp_path / "small_text_document").dtype == np.uint16


GOOD = '{"text": "Hello world"}'
BAD_INPUTS = {
    "malformed JSON": ([GOOD, GOOD, '{"text": "unterminated}'], r"data\.jsonl:3: malformed JSON \(Unterminated string starting at: column 10\)"),
    "missing key": ([GOOD, '{"body": "x", "id": 1}'], r"data\.jsonl:2: missing key 'text' \(--json-keys; the line has: body, id\)"),
    "undecodable bytes": ([GOOD, GOOD, GOOD, b'{"text": "caf\xe9"}\n'], r"data\.jsonl:4: undecodable bytes \(not UTF-8: byte 0xe9 at column 14\)"),
    "non-string value": (['{"text": ["a", "b"]}'], r"data\.jsonl:1: key 'text' holds list, expected a string"),
    "not an object": (["[1, 2]"], r"data\.jsonl:1: expected a JSON object, got list"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_names_file_and_line_and_leaves_no_output(tmp_path, gpt2_flags, case):
    lines, message = BAD_INPUTS[case]
    source = write_jsonl(tmp_path / "data.jsonl", lines)
    result = preprocess("--input", source, "--output-prefix", tmp_path / "out" / "ds", *gpt2_flags)
    assert result.returncode == 1
    assert re.match(r"error: \S*" + message, result.stderr), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert list((tmp_path / "out").iterdir()) == []


def test_skip_bad_lines_counts_and_reports(tmp_path, gpt2_flags, gpt2):
    lines = [GOOD, "{oops", '{"other": 1}', b"\xff\xfe\n", '{"text": "Goodbye"}']
    source = write_jsonl(tmp_path / "data.jsonl", lines)
    result = preprocess("--input", source, "--output-prefix", tmp_path / "ds", *gpt2_flags, "--skip-bad-lines")
    assert result.returncode == 0, result.stderr
    assert "skipped 3 bad lines (--skip-bad-lines)" in result.stderr
    assert "data.jsonl:2: malformed JSON" in result.stderr and "data.jsonl:4: undecodable bytes" in result.stderr
    assert "Processed 2 documents" in result.stdout
    ds = MMapIndexedDataset(tmp_path / "ds_text_document")
    assert [ds[0].tolist(), ds[1].tolist()] == [gpt2.tokenize("Hello world"), gpt2.tokenize("Goodbye")]
    source = write_jsonl(tmp_path / "all_bad.jsonl", ["{oops", "[]"])
    result = preprocess("--input", source, "--output-prefix", tmp_path / "none", *gpt2_flags, "--skip-bad-lines")
    assert result.returncode == 1 and "all_bad.jsonl: no documents (2 bad lines skipped)" in result.stderr
    assert not list(tmp_path.glob("none*"))


@pytest.mark.parametrize("args, message", [
    (["--tokenizer-type", "GPT2BPETokenizer"], "error: --tokenizer-type GPT2BPETokenizer needs --vocab-file"),
    (["--tokenizer-type", "NullTokenizer"], "error: --tokenizer-type NullTokenizer needs --vocab-size"),
    (["--tokenizer-type", "NullTokenizer", "--vocab-size", "10", "--workers", "0"], "error: --workers 0: must be >= 1"),
])
def test_flag_errors(tmp_path, args, message):
    source = write_jsonl(tmp_path / "data.jsonl", ['{"text": "1 2"}'])
    result = preprocess("--input", source, "--output-prefix", tmp_path / "ds", *args)
    assert result.returncode == 1 and result.stderr.startswith(message), result.stderr
    assert not list(tmp_path.glob("ds*"))


def test_missing_input_file(tmp_path):
    result = preprocess("--input", tmp_path / "nope.jsonl", "--output-prefix", tmp_path / "ds",
                        "--tokenizer-type", "NullTokenizer", "--vocab-size", "10")
    assert result.returncode == 1 and result.stderr.startswith("error: --input ") and "nope.jsonl: file not found" in result.stderr


def load_tool():
    spec = importlib.util.spec_from_file_location("preprocess_data", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_small_chunks_give_identical_output_and_true_line_numbers(tmp_path, dolly_sample, gpt2_flags):
    tool = load_tool()
    vocab, merges = gpt2_flags[1], gpt2_flags[3]
    outputs = []
    for name, chunk_bytes in (("one", tool.CHUNK_BYTES), ("many", 4096)):
        cfg = tool.PreprocessConfig(input=str(dolly_sample), output_prefix=str(tmp_path / name), json_keys=["response"],
                                    vocab_file=vocab, merge_file=merges, append_eod=True, workers=2, chunk_bytes=chunk_bytes)
        totals = tool.run(cfg)
        assert totals.documents == 382 and totals.empty == 0
        outputs.append([(tmp_path / f"{name}_response_document.{s}").read_bytes() for s in ("bin", "idx")])
    assert outputs[0] == outputs[1]
    lines = open(dolly_sample, "rb").readlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"".join(lines[:300]) + b"{broken\n" + b"".join(lines[300:]))
    cfg = tool.PreprocessConfig(input=str(bad), output_prefix=str(tmp_path / "bad"), json_keys=["response"],
                                vocab_file=vocab, merge_file=merges, chunk_bytes=4096)
    with pytest.raises(tool.PreprocessError, match=r"bad\.jsonl:301: malformed JSON"):
        tool.run(cfg)
    assert not list(tmp_path.glob("bad_*"))


@pytest.mark.parametrize("workers", ["1", "2"])
def test_tokenizer_rejection_names_the_line(tmp_path, workers):
    source = write_jsonl(tmp_path / "ids.jsonl", ['{"text": "1 2"}', '{"text": "3 x"}', '{"text": "4"}'])
    args = ["--input", source, "--tokenizer-type", "NullTokenizer", "--vocab-size", "10", "--workers", workers]
    result = preprocess(*args, "--output-prefix", tmp_path / "stop")
    assert result.returncode == 1 and "ids.jsonl:2: NullTokenizer: text must be whitespace-separated" in result.stderr
    assert not list(tmp_path.glob("stop*"))
    result = preprocess(*args, "--output-prefix", tmp_path / "skip", "--skip-bad-lines")
    assert result.returncode == 0 and "skipped 1 bad lines" in result.stderr
    ds = MMapIndexedDataset(tmp_path / "skip_text_document")
    assert [ds[0].tolist(), ds[1].tolist()] == [[1, 2], [4]]


def test_tool_does_not_import_torch():
    """torch costs about a second of start-up; the data tools must not pull it in."""
    code = ("import sys; from tools import preprocess_data, merge_datasets, gpt2_vocab; "
            "print(sorted(m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=subprocess_env(),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.fixture(scope="module")
def llama_tokenizers(tmp_path_factory, dolly_sample):
    """{--tokenizer-type: --tokenizer-model} for Llama-3's tiktoken format and Llama-2's SentencePiece,
    both made here from the first 60 dolly responses."""
    folder = tmp_path_factory.mktemp("llama_tokenizers")
    text = "\n".join(json.loads(line)["response"] for line in open(dolly_sample, encoding="utf-8").readlines()[:60])
    return {"Llama3Tokenizer": write_tiktoken_bpe(text, folder / "tokenizer.model"),
            "Llama2Tokenizer": train_sentencepiece(text, folder / "sp")}


@pytest.mark.parametrize("tokenizer_type", ["Llama3Tokenizer", "Llama2Tokenizer"])
def test_llama_tokenizers_bos_text_eod_for_every_document(tmp_path, dolly_sample, llama_tokenizers, tokenizer_type):
    model = llama_tokenizers[tokenizer_type]
    result = preprocess("--input", dolly_sample, "--json-keys", "response", "--output-prefix", tmp_path / "dolly",
                        "--tokenizer-type", tokenizer_type, "--tokenizer-model", model, "--append-eod", "--workers", "2")
    assert result.returncode == 0, result.stderr
    tok = build_tokenizer(TokenizerConfig(tokenizer_type=tokenizer_type, tokenizer_model=model), verbose=False)
    texts = [json.loads(line)["response"] for line in open(dolly_sample, encoding="utf-8")]
    ds = MMapIndexedDataset(tmp_path / "dolly_response_document")
    assert len(ds) == len(texts) == 382 and ds[0].dtype == np.uint16  # 812 or 600 ids
    for doc, text in zip(ds, texts):
        ids = doc.tolist()
        assert ids[0] == tok.bos and ids[-1] == tok.eod and tok.eod not in ids[:-1]  # BOS text EOD, as documented
        assert tok.detokenize(ids[1:-1]) == text
    sidecar = json.loads((tmp_path / "dolly_response_document.meta.json").read_text())
    assert sidecar["tokenizer"]["type"] == tokenizer_type and sidecar["tokenizer"]["vocab_size"] == tok.vocab_size
    assert list(sidecar["tokenizer"]["files"]) == ["tokenizer_model"]


def test_llama_tokenizer_bad_input_is_one_line_and_writes_nothing(tmp_path, llama_tokenizers):
    source = write_jsonl(tmp_path / "data.jsonl", ['{"text": "hello"}'])
    lines = open(llama_tokenizers["Llama3Tokenizer"], encoding="ascii").read().splitlines()
    corrupt = tmp_path / "corrupt.model"
    corrupt.write_text("\n".join(lines[:99] + ["not-base64! 99"] + lines[100:]) + "\n", encoding="ascii")
    cases = [
        (["--tokenizer-type", "Llama3Tokenizer", "--tokenizer-model", corrupt], 1,
         f"error: --tokenizer-model {corrupt}:100: expected '<base64 token> <rank>', got 'not-base64! 99'"),
        (["--tokenizer-type", "Llama3Tokenizer", "--tokenizer-model", tmp_path / "nope.model"], 1,
         f"error: --tokenizer-model {tmp_path / 'nope.model'}: file not found (a local file: zero-lab downloads"),
        (["--tokenizer-type", "Llama2Tokenizer"], 1, "error: --tokenizer-type Llama2Tokenizer needs --tokenizer-model"),
        # argparse's own usage error: its usage lines, then one error line, exit 2
        (["--tokenizer-type", "Llama3", "--tokenizer-model", corrupt], 2,
         "preprocess_data.py: error: argument --tokenizer-type: invalid choice: 'Llama3'"),
    ]
    for args, code, message in cases:
        result = preprocess("--input", source, "--output-prefix", tmp_path / "out" / "ds", *args)
        errors = [line for line in result.stderr.splitlines() if "error:" in line]
        assert result.returncode == code and len(errors) == 1 and errors[0].startswith(message), result.stderr
        assert "Traceback" not in result.stderr and not list(tmp_path.glob("out/ds*"))
