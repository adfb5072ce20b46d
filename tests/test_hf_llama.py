"""Hugging Face Llama both ways: a transformers-made random LlamaForCausalLM converts into a checkpoint whose logits
are transformers' and exports back to the same tensors; llama-tiny trained at TP=2 under ZeRO-3 exports what the
serial run exports and loads in transformers with our logits; a Llama run's tokenizer exports with our ids;
INIT_HF=<Llama folder> fine-tunes through a driver; what our model cannot express is refused in one line."""
import json
import subprocess
import sys

import pytest
import torch

from conftest import DOLLY_SAMPLE, REPO_ROOT, TP2, parallel_pretrain, test_env, tool_in_process
from megatron.model import MODEL_PRESETS
from megatron.saved_model.reader import build_model, load_checkpoint_weights, save_checkpoint_weights
from test_hf_conversion import GPT2_VOCAB, dolly_tokens, free_port
from tokenizer_files import train_sentencepiece, write_tiktoken_bpe

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

TINY = MODEL_PRESETS["llama-tiny"]


def save_random_hf_llama(folder, vocab_size, **overrides):
    """A transformers-made random LlamaForCausalLM of llama-tiny's shape, its RMSNorm weights random too (they
    start at one); returns the model."""
    torch.manual_seed(5)
    fields = dict(vocab_size=vocab_size, hidden_size=TINY["hidden_size"], intermediate_size=TINY["ffn_hidden_size"],
                  num_hidden_layers=TINY["num_layers"], num_attention_heads=TINY["num_attention_heads"],
                  num_key_value_heads=TINY["num_key_value_heads"], max_position_embeddings=64, rms_norm_eps=1e-5,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**fields, **overrides})).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.2)
    model.save_pretrained(folder)
    return model


def our_logits(checkpoint, tokens, vocab):
    loaded = load_checkpoint_weights(str(checkpoint))
    with torch.no_grad():
        return build_model(loaded.config, loaded.state_dict)(tokens, torch.arange(tokens.shape[1]).expand_as(tokens))[
            ..., :vocab]


@pytest.mark.parametrize("tied, theta", [(False, 500000.0), (True, 10000.0)])
def test_hf_llama_to_checkpoint_and_back_gives_equal_logits(tmp_path, capsys, tied, theta):
    hf = save_random_hf_llama(tmp_path / "hf", 1024, tie_word_embeddings=tied,
                              rope_parameters={"rope_type": "default", "rope_theta": theta})
    code, out, err = tool_in_process(capsys, "hf_to_checkpoint.py", "--hf", tmp_path / "hf", "--save", tmp_path / "ck")
    assert code == 0, err
    assert f"--num-key-value-heads 2 --ffn-hidden-size 352 --rope-theta {theta:g}" in out
    config = load_checkpoint_weights(str(tmp_path / "ck")).config
    assert (config.untie_embeddings_and_output_weights, config.rope_theta) == (not tied, theta)
    tokens = torch.randint(0, 1024, (3, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = hf(input_ids=tokens).logits
    torch.testing.assert_close(our_logits(tmp_path / "ck", tokens, 1024), theirs, rtol=0, atol=1e-4)
    code, _, err = tool_in_process(capsys, "checkpoint_to_hf.py", "--load", tmp_path / "ck", "--output",
                                   tmp_path / "back")
    assert code == 0, err
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", local_files_only=True).eval()
    assert type(again).__name__ == "LlamaForCausalLM" and again.config.tie_word_embeddings == tied
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=tokens).logits, theirs, rtol=0, atol=1e-4)
    original, exported = hf.state_dict(), again.state_dict()
    assert exported.keys() == original.keys()
    for key, tensor in original.items():
        assert torch.equal(exported[key], tensor), key


@pytest.mark.parametrize("change, message", [
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
     "rope_parameters of type 'linear' (ours rotates with plain theta: rope_type 'default') cannot be expressed"),
    (dict(attention_bias=True), "attention_bias true (our Llama has no biases) cannot be expressed"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' (our SwiGLU gates with silu) cannot be expressed"),
])
def test_hf_llama_configs_we_cannot_express_are_one_line_refusals(tmp_path, capsys, change, message):
    save_random_hf_llama(tmp_path / "hf", 256, **change)
    code, out, err = tool_in_process(capsys, "hf_to_checkpoint.py", "--hf", tmp_path / "hf", "--save", tmp_path / "ck")
    assert (code, out) == (1, "")
    assert err.splitlines() == [f"error: --hf {tmp_path / 'hf'}: cannot load a Llama model ({message})"]
    assert not (tmp_path / "ck").exists()


@pytest.fixture(scope="module")
def llama_tokenizer_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama_tokenizers")
    text = "\n".join(json.loads(line)["response"] for line in open(DOLLY_SAMPLE, encoding="utf-8").readlines()[:60])
    return {"Llama3Tokenizer": write_tiktoken_bpe(text, folder / "tokenizer.model"),
            "Llama2Tokenizer": train_sentencepiece(text, folder / "sp")}


@pytest.mark.parametrize("tokenizer_type", ["Llama2Tokenizer", "Llama3Tokenizer"])
def test_llama_run_exports_its_tokenizer_with_our_ids(tmp_path, capsys, llama_tokenizer_files, tokenizer_type):
    """A checkpoint whose run recorded a Llama tokenizer (pretrain_gpt.py's args) exports tokenizer.json: the HF
    tokenizer gives our ids (BOS first), and the config's vocabulary, BOS and EOS are the tokenizer's."""
    from megatron.tokenizer import TokenizerConfig, build_tokenizer

    recorded = TokenizerConfig(tokenizer_type=tokenizer_type, tokenizer_model=llama_tokenizer_files[tokenizer_type])
    ours = build_tokenizer(recorded, verbose=False)
    hf = save_random_hf_llama(tmp_path / "hf", ours.vocab_size)
    assert tool_in_process(capsys, "hf_to_checkpoint.py", "--hf", tmp_path / "hf", "--save", tmp_path / "ck")[0] == 0
    states_file = tmp_path / "ck" / "global_step0" / "mp_rank_00_model_states.pt"
    states = torch.load(states_file, weights_only=False)
    data = {"tokenizer_type": tokenizer_type, "tokenizer_model": recorded.tokenizer_model}
    torch.save(dict(states, args={"data": data}), states_file)
    code, _, err = tool_in_process(capsys, "checkpoint_to_hf.py", "--load", tmp_path / "ck", "--output", tmp_path / "o")
    assert code == 0, err
    assert (tmp_path / "o" / "tokenizer.json").is_file()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "o", local_files_only=True)
    text = "Which is a species of fish? Tope or Rope\n  Tope, 42 times."  # no special token spelled out: docs/model.md
    assert hf_tokenizer(text).input_ids == ours.tokenize(text)
    config = transformers.AutoConfig.from_pretrained(tmp_path / "o", local_files_only=True)
    assert (config.vocab_size, config.bos_token_id, config.eos_token_id) == (ours.vocab_size, ours.bos, ours.eod)
    exported = safetensors_torch.load_file(tmp_path / "o" / "model.safetensors")
    assert torch.equal(exported["lm_head.weight"], hf.state_dict()["lm_head.weight"])


def test_export_refuses_a_model_neither_gpt2_nor_llama_in_one_line(tmp_path, capsys):
    from test_llama import build, llama_config

    model = build(llama_config(swiglu=False))
    save_checkpoint_weights(str(tmp_path / "ckpt"), model.config, model.state_dict(), {}, "test")
    code, out, err = tool_in_process(capsys, "checkpoint_to_hf.py", "--load", tmp_path / "ckpt",
                                     "--output", tmp_path / "hf")
    assert (code, out) == (1, "")
    assert err.splitlines() == [f"error: {tmp_path / 'ckpt' / 'global_step0'}: the model is neither GPT-2 nor Llama "
                                "shaped: Hugging Face Llama needs --swiglu"]
    assert not (tmp_path / "hf").exists()


LLAMA_RUNS = {"serial_z0": (1, ["--zero-stage", "0"]),
              "tp2_sp_z3": (2, [*TP2, "--sequence-parallel", "--zero-stage", "3"])}


@pytest.mark.slow
def test_llama_tp2_zero3_export_equals_the_serial_export_and_loads_in_transformers(dolly_data_dir, tmp_path,
                                                                                   capsys):
    """The same seeded llama-tiny run serial at ZeRO-0 and at TP=2 with sequence parallelism under ZeRO-3 (K/V
    groups and SwiGLU's [gate_r; up_r] split over the ranks, the weights only in the optimizer's partitions)."""
    exports = {}
    for name, (ranks, flags) in LLAMA_RUNS.items():
        parallel_pretrain(dolly_data_dir, ranks, "--model-size", "llama-tiny", *flags, "--make-vocab-size-divisible-by",
                          "64", "--save", str(tmp_path / name))
        code, _, err = tool_in_process(capsys, "checkpoint_to_hf.py", "--load", tmp_path / name, "--output",
                                       tmp_path / f"hf_{name}")
        assert code == 0, err
        exports[name] = safetensors_torch.load_file(tmp_path / f"hf_{name}" / "model.safetensors")
    assert "model.layers.1.self_attn.k_proj.weight" in exports["serial_z0"]
    for key, tensor in exports["serial_z0"].items():
        torch.testing.assert_close(exports["tp2_sp_z3"][key], tensor, rtol=0, atol=1e-4, msg=key)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_tp2_sp_z3", local_files_only=True).eval()
    tokens = dolly_tokens(dolly_data_dir)
    with torch.no_grad():
        theirs = model(input_ids=tokens).logits
    torch.testing.assert_close(our_logits(tmp_path / "tp2_sp_z3", tokens, GPT2_VOCAB), theirs, rtol=0, atol=1e-4)


@pytest.mark.slow
def test_zero3_driver_fine_tunes_llama_tiny_from_init_hf(dolly_data_dir, tmp_path):
    """INIT_HF=<LlamaForCausalLM folder of llama-tiny's shape> picks MODEL_SIZE llama-tiny, converts, and loads it
    with --finetune under ZeRO-3; with lr 0 the weights after one step are still the HF model's."""
    save_random_hf_llama(tmp_path / "llama", GPT2_VOCAB)
    env = test_env(INIT_HF=tmp_path / "llama", SEQ_LEN=64, TRAIN_ITERS=1, LR=0, MIN_LR=0, DATA_DIR=dolly_data_dir,
                   RUNS_DIR=tmp_path / "runs", MASTER_PORT=free_port(), PYTHON=sys.executable)
    run = subprocess.run(["bash", str(REPO_ROOT / "examples_zero" / "gpt_deepspeed_Z3.sh"), "--save",
                          str(tmp_path / "after")], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "| model: llama-tiny |" in run.stdout
    assert "for fine-tuning (iteration and optimizer reset)" in run.stdout
    converted = load_checkpoint_weights(str(tmp_path / "runs" / "gpt_llama-tiny_Z3" / "hf_init_llama"))
    after = load_checkpoint_weights(str(tmp_path / "after"))
    assert after.iteration == 1 and after.config.untie_embeddings_and_output_weights
    for key, tensor in converted.state_dict.items():
        assert torch.equal(after.state_dict[key], tensor), key


def test_init_hf_llama_of_no_preset_is_a_one_line_error(tmp_path):
    transformers.LlamaConfig(num_hidden_layers=3, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=352).save_pretrained(tmp_path)
    run = subprocess.run(["bash", str(REPO_ROOT / "examples_zero" / "gpt_deepspeed_Z1.sh")],
                         env=test_env(INIT_HF=tmp_path, RUNS_DIR=tmp_path / "runs"), capture_output=True, text=True,
                         timeout=120)
    assert (run.returncode, run.stderr) == (1, f"error: INIT_HF={tmp_path}: its num_hidden_layers/hidden_size/"
                                               "num_attention_heads/num_key_value_heads/intermediate_size/rope_theta/"
                                               "tie_word_embeddings match no MODEL_SIZE preset\n")
    assert not (tmp_path / "runs").exists()
