"""Generation: KV-cache decoding equals full recomputation, sampling filters, eod stop, and
tools/generate_text.py against transformers' own greedy generate on the same GPT-2 weights."""
import subprocess
import sys

import pytest
import torch

from conftest import REPO_ROOT, save_random_hf_gpt2, test_env
from megatron.saved_model.reader import save_checkpoint_weights
from megatron.inference.generation import GenerationError, SamplingConfig, generate, next_token
from megatron.model import GPTConfig, GPTModel
from megatron.inference.hf_folder import load_hf_folder
from megatron.model.kv_cache import KVCache

VOCAB, PADDED = 120, 128


def tiny_model(seed: int = 3, **overrides) -> GPTModel:
    torch.manual_seed(seed)
    # a large init spreads the logits, so greedy continuations vary from token to token
    config = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=48,
                       max_position_embeddings=48, padded_vocab_size=PADDED, init_method_std=0.5, **overrides)
    model = GPTModel(config).eval()
    with torch.no_grad():  # random biases and LayerNorms, so every term of the layer matters
        for name, param in model.named_parameters():
            if name.startswith("layers.") and (name.endswith("bias") or "layernorm" in name):
                param.add_(torch.randn_like(param) * 0.2)
    return model


def test_cached_logits_equal_full_forward_for_any_chunking():
    model = tiny_model()
    ids = torch.randint(0, VOCAB, (2, 30))
    positions = torch.arange(30).unsqueeze(0).expand(2, -1)
    with torch.no_grad():
        full = model(ids, positions)
        cache = KVCache(model.config.num_layers, 30)
        chunks = [(0, 11), (11, 12), (12, 17)] + [(i, i + 1) for i in range(17, 30)]
        pieces = [model(ids[:, a:b], positions[:, a:b], kv_cache=cache) for a, b in chunks]
    assert cache.length == 30
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-4)


def test_greedy_with_cache_equals_recomputing_the_prefix():
    model = tiny_model()
    prompt = torch.randint(0, VOCAB, (9,)).tolist()
    greedy = SamplingConfig(greedy=True)
    cached = generate(model, prompt, 35, greedy, eod=VOCAB - 1, vocab_size=VOCAB, use_cache=True)
    full = generate(model, prompt, 35, greedy, eod=VOCAB - 1, vocab_size=VOCAB, use_cache=False)
    assert cached.tokens == full.tokens
    assert len(set(cached.tokens)) > 3  # a real continuation, not one repeated id
    assert cached.tokens_per_second > 0


def test_sampling_with_cache_equals_recomputing_for_the_same_seed():
    model = tiny_model()
    sampling = SamplingConfig(temperature=0.9, top_k=20, top_p=0.95)
    runs = [generate(model, [5, 6, 7], 30, sampling, eod=VOCAB - 1, vocab_size=VOCAB, use_cache=cache,
                     generator=torch.Generator().manual_seed(11)).tokens for cache in (True, False)]
    assert runs[0] == runs[1]
    other = generate(model, [5, 6, 7], 30, sampling, eod=VOCAB - 1, vocab_size=VOCAB,
                     generator=torch.Generator().manual_seed(12)).tokens
    assert other != runs[0]


def test_filters_reduce_to_greedy_and_padded_ids_are_never_produced():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    generator = torch.Generator().manual_seed(0)
    assert all(next_token(logits, SamplingConfig(top_k=1), generator) == 1 for _ in range(20))
    assert all(next_token(logits, SamplingConfig(top_p=0.01), generator) == 1 for _ in range(20))
    # top-k 2 keeps ids 1 and 2 only; both show up
    drawn = {next_token(logits, SamplingConfig(top_k=2, temperature=5.0), generator) for _ in range(200)}
    assert drawn == {1, 2}
    model = tiny_model()
    with torch.no_grad():  # make the padded rows win every argmax: they must still never be chosen
        model.word_embeddings.weight[VOCAB:] = 50.0 * model.word_embeddings.weight[:1]
    result = generate(model, [1, 2], 20, SamplingConfig(), eod=VOCAB - 1, vocab_size=VOCAB,
                      generator=torch.Generator().manual_seed(0))
    assert result.tokens and max(result.tokens) < VOCAB


def test_stops_after_end_of_document_and_fits_long_prompts():
    model = tiny_model()
    eod = 7
    with torch.no_grad():  # the final hidden state is always the LayerNorm bias, and the eod row points along it
        model.final_layernorm.weight.zero_()
        model.final_layernorm.bias.copy_(torch.randn(64))
        model.word_embeddings.weight[eod] = 10.0 * model.final_layernorm.bias
    result = generate(model, [1, 2, 3], 10, SamplingConfig(greedy=True), eod=eod, vocab_size=VOCAB)
    assert result.tokens == [eod] and result.stopped_at_eod
    long_prompt = list(range(60))
    result = generate(tiny_model(), long_prompt, 10, SamplingConfig(greedy=True), eod=VOCAB - 1, vocab_size=VOCAB)
    assert result.prompt_tokens_dropped == 60 - (48 - 10)
    with pytest.raises(GenerationError, match="--max-new-tokens 48"):
        generate(model, [1], 48, SamplingConfig(greedy=True), eod=eod, vocab_size=VOCAB)


@pytest.mark.parametrize("kwargs, flag", [(dict(temperature=0.0), "--temperature"), (dict(top_k=-1), "--top-k"),
                                          (dict(top_p=0.0), "--top-p"), (dict(top_p=1.5), "--top-p")])
def test_bad_sampling_flags_are_named(kwargs, flag):
    with pytest.raises(GenerationError, match=flag):
        SamplingConfig(**kwargs)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, dolly_data_dir):
    """A random GPT-2 (12 heads would be slow; 2 layers x 64) saved by transformers with the real vocab."""
    torch.manual_seed(21)
    folder = tmp_path_factory.mktemp("hf_gen") / "gpt2_tiny"
    model = save_random_hf_gpt2(folder, dolly_data_dir, 0.1, n_layer=2, n_embd=64, n_head=4, n_positions=64,
                                vocab_size=50257)
    # the same weights as a zero-lab checkpoint: the tool then starts without importing transformers
    loaded = load_hf_folder(str(folder))
    checkpoint = folder.parent / "checkpoint"
    save_checkpoint_weights(str(checkpoint), loaded.config, loaded.state_dict,
                            {"vocab_file": loaded.tokenizer.vocab_file, "merge_file": loaded.tokenizer.merge_file},
                            source="test")
    return folder, model, checkpoint


def run_tool(*args, stdin=None):
    return subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "generate_text.py"), *map(str, args)],
                          env=test_env(), cwd=REPO_ROOT, capture_output=True, text=True, input=stdin, timeout=300)


@pytest.mark.slow
def test_cli_greedy_matches_transformers_generate_with_and_without_cache(hf_folder):
    folder, hf_model, checkpoint = hf_folder
    prompt = "Databricks is a company that"
    outputs = [run_tool(*source, "--prompt", prompt, "--greedy", "--max-new-tokens", 24)
               for source in (("--hf", folder), ("--load", checkpoint, "--no-kv-cache"))]
    for result in outputs:
        assert result.returncode == 0, result.stderr
        assert "tokens/s:" in result.stderr
    assert outputs[0].stdout == outputs[1].stdout
    import transformers
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        expected = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                                     pad_token_id=50256)
    text = tokenizer.decode(expected[0][ids.shape[1]:].tolist())
    assert outputs[0].stdout == prompt + text + "\n--- end of sample 1 ---\n"


@pytest.mark.slow
def test_cli_prompt_file_and_stdin(hf_folder, tmp_path):
    checkpoint = hf_folder[2]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("First prompt\n\nSecond prompt\n")
    result = run_tool("--load", checkpoint, "--prompt-file", prompts, "--max-new-tokens", 5, "--top-k", 10)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("First prompt")
    assert "--- end of sample 2 ---" in result.stdout and "Second prompt" in result.stdout
    result = run_tool("--load", checkpoint, "--max-new-tokens", 5, "--top-p", 0.8, stdin="Piped prompt\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Piped prompt") and result.stdout.count("--- end of sample") == 1


@pytest.mark.parametrize("args, message", [
    (("--load", "/nonexistent/ckpt"), "error: --load /nonexistent/ckpt: no such checkpoint folder"),
    (("--hf", "/nonexistent/hf"), "error: --hf /nonexistent/hf: not a Hugging Face model folder (no config.json)"),
])
def test_cli_missing_model_is_a_one_line_error(args, message):
    result = run_tool(*args, "--prompt", "x")
    assert result.returncode == 1
    assert result.stderr.strip() == message


@pytest.mark.slow
def test_cli_bad_flags_and_empty_prompt_file(hf_folder, tmp_path):
    checkpoint = hf_folder[2]
    result = run_tool("--load", checkpoint, "--prompt", "x", "--temperature", "0")
    assert result.returncode == 1 and result.stderr.startswith("error: --temperature must be > 0")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    result = run_tool("--load", checkpoint, "--prompt-file", empty)
    assert result.returncode == 1 and "no prompts" in result.stderr and "Traceback" not in result.stderr
    result = run_tool("--load", checkpoint, "--prompt", "x", "--max-new-tokens", 64)
    assert result.returncode == 1 and "--max-new-tokens 64 leaves no room" in result.stderr


def test_generate_text_given_a_run_folder_points_to_its_checkpoints(tmp_path):
    """--load <run folder> (which holds checkpoints/latest): the one line names the folder to load instead."""
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("global_step60")
    result = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "generate_text.py"), "--load", str(tmp_path),
                             "--prompt", "Hello"], env=test_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: --load {tmp_path}: not a checkpoint (no 'latest' file and no *model_states.pt): a run folder? its "
        f"checkpoints are in --load {tmp_path / 'checkpoints'}")
