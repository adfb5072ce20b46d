"""A llama-tiny checkpoint exported by tools/checkpoint_to_hf.py loads as a Hugging Face model folder does, whatever
tokenizer its run used (GPT-2's BPE files, a Llama-2 SentencePiece model, a Llama-3 tiktoken file): AutoTokenizer and
AutoModelForCausalLM load it offline with our ids, tools/generate_text.py --hf generates from it with no tokenizer
flag, and every file of the folder has the mode the umask gives (issue 56, item 5)."""
import os
import stat

import pytest
import torch

from conftest import tool_in_process
from megatron.tokenizer import TokenizerConfig, build_tokenizer
from test_hf_conversion import GPT2_VOCAB
from test_hf_llama import llama_tokenizer_files, save_random_hf_llama  # noqa: F401 (a fixture)

transformers = pytest.importorskip("transformers")

TEXT = "Which is a species of fish? Tope or Rope\n  Tope, 42 times."  # no special token spelled out: docs/model.md
# GPT-2's 50,257-row vocabulary makes its cases take 4 to 8 s
TOKENIZERS = [pytest.param("GPT2BPETokenizer", marks=pytest.mark.slow), "Llama2Tokenizer", "Llama3Tokenizer"]


@pytest.fixture
def run_tokenizer(request, dolly_data_dir, llama_tokenizer_files):  # noqa: F811
    """The TokenizerConfig a pretrain_gpt.py run of request.param records."""
    if request.param == "GPT2BPETokenizer":
        return TokenizerConfig(vocab_file=str(dolly_data_dir / "gpt2-vocab.json"),
                               merge_file=str(dolly_data_dir / "gpt2-merges.txt"))
    return TokenizerConfig(tokenizer_type=request.param, tokenizer_model=llama_tokenizer_files[request.param])


def export_llama_tiny(tmp_path, capsys, recorded: TokenizerConfig):
    """A llama-tiny checkpoint (made from a random LlamaForCausalLM by tools/hf_to_checkpoint.py) whose run recorded
    `recorded` as pretrain_gpt.py records it, exported by tools/checkpoint_to_hf.py: the export's folder."""
    gpt2_bpe = recorded.tokenizer_type == "GPT2BPETokenizer"
    vocab = GPT2_VOCAB if gpt2_bpe else build_tokenizer(recorded, verbose=False).vocab_size
    save_random_hf_llama(tmp_path / "random", vocab)
    code, _, err = tool_in_process(capsys, "hf_to_checkpoint.py", "--hf", tmp_path / "random", "--save",
                                   tmp_path / "ck")
    assert code == 0, err
    states_file = tmp_path / "ck" / "global_step0" / "mp_rank_00_model_states.pt"
    states = torch.load(states_file, weights_only=False)
    data = {key: getattr(recorded, key) for key in ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model")}
    states.pop("tokenizer", None)
    torch.save(dict(states, args={"data": data}), states_file)
    code, _, err = tool_in_process(capsys, "checkpoint_to_hf.py", "--load", tmp_path / "ck", "--output",
                                   tmp_path / "hf")
    assert code == 0, err
    return tmp_path / "hf"


@pytest.mark.parametrize("run_tokenizer", TOKENIZERS, indirect=True)
def test_llama_export_loads_with_auto_classes_and_our_ids(tmp_path, capsys, run_tokenizer, monkeypatch):
    folder = export_llama_tiny(tmp_path, capsys, run_tokenizer)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ours = build_tokenizer(run_tokenizer, verbose=False)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert hf_tokenizer(TEXT).input_ids == ours.tokenize(TEXT)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.vocab_size == ours.vocab_size


@pytest.mark.parametrize("run_tokenizer", TOKENIZERS, indirect=True)
def test_generate_text_reads_a_llama_export_with_no_tokenizer_flag(tmp_path, capsys, run_tokenizer):
    folder = export_llama_tiny(tmp_path, capsys, run_tokenizer)
    code, out, err = tool_in_process(capsys, "generate_text.py", "--hf", folder, "--prompt", TEXT, "--greedy",
                                     "--max-new-tokens", "4", "--device", "cpu")
    assert code == 0, err
    assert out.startswith(TEXT) and out.endswith("--- end of sample 1 ---\n")
    assert "generated tokens: " in err


def test_generate_text_help_names_llama(capsys):
    with pytest.raises(SystemExit):
        tool_in_process(capsys, "generate_text.py", "--help")
    out = capsys.readouterr().out
    assert "GPT-2 or Llama folder" in " ".join(out.split())


@pytest.mark.parametrize("run_tokenizer", ["GPT2BPETokenizer"], indirect=True)
def test_every_file_of_the_export_has_the_umasks_mode(tmp_path, capsys, run_tokenizer):
    umask = os.umask(0o022)
    try:
        folder = export_llama_tiny(tmp_path, capsys, run_tokenizer)
    finally:
        os.umask(umask)
    modes = {str(path.relative_to(folder)): stat.S_IMODE(path.stat().st_mode)
             for path in folder.rglob("*") if path.is_file()}
    assert "model.safetensors" in modes
    assert set(modes.values()) == {0o644}, {name: oct(mode) for name, mode in modes.items()}
    assert {"tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"} <= set(modes)
