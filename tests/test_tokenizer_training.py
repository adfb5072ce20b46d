"""Training with Llama's tokenizers: pretrain_gpt.py takes the flags tools/preprocess_data.py took,
pads the vocabulary (x TP), checks the data against it, refuses bad tokenizer flags in one line,
and a 1-rank run trains on the Llama3Tokenizer dataset."""
import json
import re
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, free_port, test_env
from megatron.arguments import parse_args
from megatron.data.dataset_sidecar import DataVocabularyError, check_data_against_model
from megatron.startup import prepare_run
from tokenizer_files import train_sentencepiece, write_tiktoken_bpe


@pytest.fixture(scope="module")
def llama3_data(tmp_path_factory, dolly_sample):
    """(Llama-3 style tokenizer.model with 812 ids, the dolly responses preprocessed with it, a Llama-2 style model)."""
    folder = tmp_path_factory.mktemp("llama3_data")
    text = "\n".join(json.loads(line)["response"] for line in open(dolly_sample, encoding="utf-8").readlines()[:60])
    model = write_tiktoken_bpe(text, folder / "tokenizer.model")
    result = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "preprocess_data.py"), "--input", str(dolly_sample),
                             "--json-keys", "response", "--output-prefix", str(folder / "dolly"), "--tokenizer-type",
                             "Llama3Tokenizer", "--tokenizer-model", model, "--append-eod"],
                            env=test_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return model, str(folder / "dolly_response_document"), train_sentencepiece(text, folder / "sp")


def flags(prefix, *extra):
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "2", "--train-iters", "3", "--data-path", prefix, *extra]


@pytest.mark.parametrize("tp, padded", [(1, 896), (2, 1024)])
def test_training_pads_the_llama3_vocabulary_and_the_data_agrees(llama3_data, tp, padded):
    model, prefix, sp_model = llama3_data
    argv = flags(prefix, "--tokenizer-type", "Llama3Tokenizer", "--tokenizer-model", model,
                 "--tensor-model-parallel-size", str(tp))
    args, tokenizer = prepare_run(parse_args(argv, world_size=tp), verbose=False)
    assert tokenizer.vocab_size == 812 and args.model.padded_vocab_size == tokenizer.padded_vocab_size == padded
    assert check_data_against_model(args.data.data_path, args.data, tokenizer.vocab_size, padded) == []
    # the same data under Llama-2's tokenizer: refused, naming both, unless --allow-tokenizer-mismatch
    args, tokenizer = prepare_run(parse_args(flags(prefix, "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model",
                                                   sp_model), world_size=1), verbose=False)
    with pytest.raises(DataVocabularyError, match=r"was built with \[Llama3Tokenizer, 812 ids.*this run uses "
                                                  r"\[Llama2Tokenizer, 600 ids.*--allow-tokenizer-mismatch"):
        check_data_against_model(args.data.data_path, args.data, tokenizer.vocab_size, 1024)
    warnings = check_data_against_model(args.data.data_path, args.data, tokenizer.vocab_size, 1024,
                                        allow_tokenizer_mismatch=True)
    assert any("was built with [Llama3Tokenizer, 812 ids" in w and "this run uses [Llama2Tokenizer, 600 ids" in w
               for w in warnings), warnings


@pytest.mark.parametrize("extra, message", [
    (["--tokenizer-type", "Llama3Tokenizer"], "error: --tokenizer-type Llama3Tokenizer needs --tokenizer-model"),
    (["--tokenizer-type", "Llama3", "--tokenizer-model", "x"], "error: --tokenizer-type Llama3: unknown (expected one of"),
    (["--tokenizer-type", "Llama3Tokenizer", "--tokenizer-model", "meta-llama/Meta-Llama-3-8B"],
     "error: --tokenizer-model meta-llama/Meta-Llama-3-8B: file not found (a local file: zero-lab downloads no"),
])
def test_pretrain_gpt_refuses_bad_tokenizer_flags_in_one_line(llama3_data, extra, message):
    result = subprocess.run([sys.executable, str(REPO_ROOT / "pretrain_gpt.py"), *flags(llama3_data[1], *extra)],
                            env=test_env(MASTER_PORT=free_port()), capture_output=True, text=True, timeout=120)
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert result.returncode == 1 and errors == [errors[0]] and errors[0].startswith(message), result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_one_rank_run_trains_on_llama3_tokenized_data(llama3_data, tmp_path):
    model, prefix, _ = llama3_data
    cmd = [sys.executable, str(REPO_ROOT / "pretrain_gpt.py"), "--model-size", "tiny", "--seq-length", "64",
           "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "3", "--log-interval", "1",
           "--eval-iters", "0", "--lr", "1e-3", "--data-path", prefix, "--tokenizer-type", "Llama3Tokenizer",
           "--tokenizer-model", model]
    # one process, no launcher: its rendezvous would be at 29500, which a test in the other worker may hold
    run = subprocess.run(cmd, env=test_env(OMP_NUM_THREADS="1", ZERO_LAB_SKIP_PROBES="1", MASTER_PORT=free_port()),
                         cwd=tmp_path,
                         capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "> padded vocab (size: 812) with 84 dummy tokens (new size: 896)" in run.stdout
    losses = [float(x) for x in re.findall(r"lm loss: (\S+) \|", run.stdout)]
    # a fresh model's loss is about ln(896) = 6.80 over the padded vocabulary
    assert len(losses) == 3 and all(5.5 < loss < 7.5 for loss in losses), losses
    assert "built with" not in run.stdout + run.stderr


@pytest.mark.slow
def test_data_from_another_tokenizer_is_refused_in_one_line_unless_allowed(llama3_data, dolly_sample, tmp_path):
    """Data a 600-piece SentencePiece model wrote, trained under the 812-id Llama-3 tokenizer: every id fits the
    vocabulary, so only the sidecar tells; the run stops before any step in one line naming both tokenizers and the
    flag, or with the flag trains, warned."""
    model, _, sp_model = llama3_data
    made = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "preprocess_data.py"), "--input", str(dolly_sample),
                           "--json-keys", "response", "--output-prefix", str(tmp_path / "sp"), "--tokenizer-type",
                           "Llama2Tokenizer", "--tokenizer-model", sp_model, "--append-eod"],
                          env=test_env(), capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    cmd = [sys.executable, str(REPO_ROOT / "pretrain_gpt.py"), "--model-size", "tiny", "--seq-length", "64",
           "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2", "--log-interval", "1",
           "--eval-iters", "0", "--data-path", str(tmp_path / "sp_response_document"), "--tokenizer-type",
           "Llama3Tokenizer", "--tokenizer-model", model]
    env = test_env(OMP_NUM_THREADS="1", ZERO_LAB_SKIP_PROBES="1", MASTER_PORT=free_port())
    run = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=400)
    out = run.stdout + run.stderr
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert run.returncode != 0 and len(errors) == 1, out[-3000:]
    assert "was built with [Llama2Tokenizer, 600 ids" in errors[0] and "this run uses [Llama3Tokenizer, 812 ids" in \
        errors[0] and "--allow-tokenizer-mismatch" in errors[0], errors
    assert " iteration " not in out and "Traceback" not in out
    allowed = subprocess.run([*cmd, "--allow-tokenizer-mismatch"], env=env, cwd=tmp_path, capture_output=True,
                             text=True, timeout=400)
    assert allowed.returncode == 0, allowed.stdout[-3000:] + allowed.stderr[-3000:]
    assert "warning: --data-path" in allowed.stdout and "was built with [Llama2Tokenizer" in allowed.stdout
