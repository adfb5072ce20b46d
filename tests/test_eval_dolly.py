"""tools/eval_dolly.py on the suite's saved-checkpoint run (tests/runs.py: pretrain_gpt.py on 2 CPU ranks under
ZeRO-1, on the dolly sample): it prints the validation records with the model's and the expected responses, and its
validation loss equals the one the training run logged on the same samples (the ZeRO partitions' fp32 weights,
consolidated, are the run's)."""
import importlib.util
import json
import math
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import DOLLY_SAMPLE, REPO_ROOT, test_env, tool_in_process
from megatron.data.dataset_sidecar import sidecar_path, source_record, write_sidecar
from megatron.data.dataset_utils import parse_splits, split_boundaries
from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder
from runs import CHECKPOINT_ITERS

# the saved-checkpoint run keeps pretrain_gpt.py's default --split and --seed
SPLIT, SEED = "969, 30, 1", "1234"
VALIDATION = re.compile(r" validation loss at iteration (\d+) \| lm loss value: (\S+) \| lm loss PPL: (\S+) \|")


def dolly_records() -> list[dict]:
    return [json.loads(line) for line in DOLLY_SAMPLE.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.fixture(scope="module")
def trained(checkpoint_run):
    """The saved-checkpoint run, which validates 8 samples after its last iteration: (checkpoint, training log)."""
    return checkpoint_run.folder, checkpoint_run.stdout


def eval_dolly_in_process(capsys, *args):
    return tool_in_process(capsys, "eval_dolly.py", *args)


@pytest.mark.slow
def test_prints_records_and_the_training_runs_validation_loss(trained):
    checkpoint, training_log = trained
    result = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "eval_dolly.py"), "--load", str(checkpoint),
                             "--dolly-jsonl", str(DOLLY_SAMPLE), "--num-records", "2", "--max-new-tokens", "8",
                             "--eval-samples", "8", "--seed", SEED],
                            env=test_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    # DeepSpeed's zero_to_fp32 consolidated the two ranks' partitions without a word of its progress
    assert "zero checkpoint" not in out + result.stderr
    records = dolly_records()
    first, end = split_boundaries(parse_splits(SPLIT), len(records))[1:3]
    assert end - first >= 2  # two records to print
    for number, doc in enumerate((first, first + 1), start=1):
        assert f"===== validation record {number} of {end - first} (document {doc}," in out
        assert f"instruction: {records[doc]['instruction']}\n" in out
        assert f"expected response: {records[doc]['response']}\n" in out
    assert out.count("model response: ") == 2
    assert "===== validation record 3 of" not in out
    # data path, split and iteration come from the checkpoint; the loss is the run's own at its last iteration
    iteration, loss, ppl = VALIDATION.search(out).groups()
    logged = VALIDATION.search(training_log).groups()
    assert iteration == logged[0] == str(CHECKPOINT_ITERS)
    assert float(loss) == pytest.approx(float(logged[1]), rel=1e-5)
    assert float(ppl) == pytest.approx(math.exp(float(loss)), rel=1e-5)
    summary = re.search(r" dolly validation \| documents: (\d+) \| samples: (\d+) \| tokens: (\d+) \|", out)
    assert summary.groups() == (str(end - first), "8", str(8 * 64))


@pytest.mark.slow
def test_loss_over_the_whole_validation_split(trained, capsys):
    checkpoint, _ = trained
    code, out, err = eval_dolly_in_process(capsys, "--load", checkpoint, "--num-records", "0")
    assert code == 0, err
    assert "===== validation record" not in out
    samples = int(re.search(r"samples: (\d+)", out).group(1))
    assert samples > 8  # one pass over all validation tokens, not just what training evaluated
    assert math.isfinite(float(VALIDATION.search(out).group(2)))


@pytest.mark.slow
def test_records_that_do_not_belong_to_the_dataset_are_rejected(trained, tmp_path, capsys):
    checkpoint, _ = trained
    lines = [line for line in DOLLY_SAMPLE.read_text(encoding="utf-8").splitlines() if line.strip()]
    short = tmp_path / "short.jsonl"
    short.write_text("\n".join(lines[:-1]) + "\n", encoding="utf-8")
    code, _, err = eval_dolly_in_process(capsys, "--load", checkpoint, "--dolly-jsonl", short)
    assert code == 1
    assert err == (f"error: --dolly-jsonl {short} has {len(lines) - 1} records but the dataset has {len(lines)} "
                   "documents; give the jsonl the dataset was made from\n")
    shuffled = tmp_path / "shuffled.jsonl"
    shuffled.write_text("\n".join(lines[1:] + lines[:1]) + "\n", encoding="utf-8")
    code, _, err = eval_dolly_in_process(capsys, "--load", checkpoint, "--dolly-jsonl", shuffled)
    assert code == 1 and "is not document" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_bad_split_and_missing_checkpoint(trained, tmp_path, capsys):
    checkpoint, _ = trained
    code, _, err = eval_dolly_in_process(capsys, "--load", checkpoint, "--split", "100,0,0", "--num-records", "0")
    assert code == 1 and "--split '100,0,0' gives the validation split 0 of the 382 documents" in err
    code, _, err = eval_dolly_in_process(capsys, "--load", tmp_path / "none", "--dolly-jsonl", DOLLY_SAMPLE)
    assert (code, err) == (1, f"error: --load {tmp_path / 'none'}: no such checkpoint folder\n")


def eval_dolly_module():
    spec = importlib.util.spec_from_file_location("eval_dolly", REPO_ROOT / "tools" / "eval_dolly.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_dataset(prefix, source=None) -> str:
    """A two-document dataset; with `source`, a sidecar naming it as what the dataset was made from."""
    builder = MMapIndexedDatasetBuilder(f"{prefix}.bin", np.uint16)
    for doc in range(2):
        builder.add_item(np.arange(doc, doc + 5, dtype=np.int64))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    if source is not None:
        write_sidecar(prefix, 5, source_record(source), {"type": "NullTokenizer", "vocab_size": 8, "files": {}})
    return str(prefix)


def test_without_dolly_jsonl_the_records_the_sidecar_names_are_used(tmp_path, capsys):
    """The sidecar's source when it holds dolly records (not databricks-dolly-15k.jsonl); when it is the text jsonl
    tools/process_databricks_gpt2.sh tokenizes, the dolly file whose texts it holds, here the committed sample
    (the main job's case). Else one line names what was looked for."""
    eval_dolly = eval_dolly_module()
    records = tmp_path / "elsewhere" / "my-records.jsonl"
    records.parent.mkdir()
    lines = DOLLY_SAMPLE.read_text(encoding="utf-8").splitlines()[:2]
    records.write_text("\n".join(lines) + "\n", encoding="utf-8")
    prefix = tiny_dataset(tmp_path / "my_text_document", records)
    capsys.readouterr()
    assert eval_dolly.default_jsonl(prefix) == str(records)
    assert capsys.readouterr().out == f"--dolly-jsonl not given: using {records}, the source {prefix}.meta.json names\n"
    records.unlink()
    conventional = tmp_path / "databricks-dolly-15k.jsonl"
    with pytest.raises(eval_dolly.DollyEvalError) as err:
        eval_dolly.default_jsonl(prefix)
    assert str(err.value) == (f"--dolly-jsonl is needed: {prefix}.meta.json names {records}, which is missing, and "
                              f"there is no {conventional}; give the dolly records the dataset was made from")
    # the main job's data: the sidecar names dolly_text.jsonl, made from the committed sample
    texts = tmp_path / "dolly_text.jsonl"
    subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "dolly_to_text.py"), "--input", str(DOLLY_SAMPLE),
                    "--output", str(texts)], env=test_env(), check=True, capture_output=True)
    prefix = tiny_dataset(tmp_path / "dolly_text_document", texts)
    assert eval_dolly.default_jsonl(prefix) == str(DOLLY_SAMPLE.resolve())
    assert capsys.readouterr().out == (f"--dolly-jsonl not given: using {DOLLY_SAMPLE.resolve()}, whose records are "
                                       f"the texts of {texts}, the source {prefix}.meta.json names\n")
    texts.write_text('{"text": "not from any dolly file"}\n', encoding="utf-8")
    prefix = tiny_dataset(tmp_path / "dolly_text_document", texts)
    with pytest.raises(eval_dolly.DollyEvalError) as err:
        eval_dolly.default_jsonl(prefix)
    assert str(err.value) == (f"--dolly-jsonl is needed: {prefix}.meta.json names {texts}, a text jsonl, and neither "
                              f"{conventional} nor {DOLLY_SAMPLE.resolve()} holds the dolly records it was made from; "
                              "give the dolly records the dataset was made from")
    (tmp_path / "bare").mkdir()
    bare = tiny_dataset(tmp_path / "bare" / "text_document")  # no sidecar: built by upstream Megatron, say
    with pytest.raises(eval_dolly.DollyEvalError) as err:
        eval_dolly.default_jsonl(bare)
    assert str(err.value) == (f"--dolly-jsonl is needed: no {sidecar_path(bare)} names a source (missing, or not "
                              f"describing this dataset), and there is no {bare.replace('text_document', '')}"
                              "databricks-dolly-15k.jsonl; give the dolly records the dataset was made from")


@pytest.mark.slow
def test_the_runs_dataset_finds_its_records_without_dolly_jsonl(trained, capsys):
    """The committed sample's dataset, made by tools/process_databricks_gpt2.sh, whose sidecar names the text jsonl
    it tokenized, and no databricks-dolly-15k.jsonl beside it: the main job's data."""
    checkpoint, _ = trained
    code, out, err = eval_dolly_in_process(capsys, "--load", checkpoint, "--num-records", "1", "--max-new-tokens", "2",
                                           "--eval-samples", "2")
    assert code == 0, err
    assert f"--dolly-jsonl not given: using {DOLLY_SAMPLE.resolve()}, whose records are the texts of " in out
    records = dolly_records()
    first = split_boundaries(parse_splits(SPLIT), len(records))[1]
    assert f"expected response: {records[first]['response']}\n" in out
