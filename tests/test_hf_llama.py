"""Hugging Face Llama both ways: a transformers-made random LlamaForCausalLM converts into a checkpoint whose logits
are transformers' and exports back to the same tensors; llama-tiny trained at TP=2 under ZeRO-3 exports what the
serial run exports and loads in transformers with our logits; a Llama run's tokenizer exports with our ids;
INIT_HF=<Llama folder> fine-tunes through a driver; what our model cannot express is refused in one line."""
import json
import shlex
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from conftest import DOLLY_SAMPLE, REPO_ROOT, TP2, launch_script, parallel_pretrain, test_env, tool_in_process
from megatron.arguments import parse_args
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


def as_transformers4_wrote_it(folder):
    """config.json as transformers 4 wrote it (most published Llama folders): rope_theta and rope_scaling at the
    top level, no rope_parameters."""
    config = json.loads((folder / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.update(rope_theta=rope["rope_theta"], rope_scaling=None, transformers_version="4.46.0")
    (folder / "config.json").write_text(json.dumps(config, indent=2))


ARGS = ["--seq-length", "64", "--micro-batch-size", "1", "--train-iters", "1", "--data-path", "x", "--vocab-file",
        "v", "--merge-file", "m"]


def test_megatron_deepspeeds_names_of_the_epsilon_and_theta_flags():
    """Megatron-DeepSpeed's Llama scripts pass --rotary-position-embeddings-theta and --layernorm-epsilon."""
    model = parse_args(["--model-size", "llama-tiny", "--rotary-position-embeddings-theta", "500000",
                        "--layernorm-epsilon", "1e-6", *ARGS]).model
    assert (model.rope_theta, model.layernorm_epsilon) == (5e5, 1e-6)
    assert (parse_args(["--model-size", "llama-tiny", *ARGS]).model.layernorm_epsilon) == 1e-5


@pytest.mark.parametrize("written_by", ["transformers5", "transformers4"])
def test_hf_llama_norm_epsilon_and_rope_theta_reach_the_printed_flags_and_our_logits(tmp_path, capsys, written_by):
    """A Llama trained with rms_norm_eps 1e-6 and rope theta 1e6 (config.json in transformers 5's form or 4's):
    the model pretrain_gpt.py builds from the flags hf_to_checkpoint.py prints, holding the converted weights,
    gives transformers' logits (5e-7 apart); with our defaults (1e-5, 10000) it would not (2.8e-2 apart; the epsilon
    alone 1.3e-2, the theta alone 2.3e-2)."""
    hf = save_random_hf_llama(tmp_path / "hf", 1024, rms_norm_eps=1e-6,
                              rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if written_by == "transformers4":
        as_transformers4_wrote_it(tmp_path / "hf")
    code, out, err = tool_in_process(capsys, "hf_to_checkpoint.py", "--hf", tmp_path / "hf", "--save", tmp_path / "ck")
    assert code == 0, err
    printed = out.split(": ", 1)[1].split(" (padded vocab")[0].split()
    assert " --rope-theta 1e+06 " in out and " --layernorm-epsilon 1e-06 " in out
    loaded = load_checkpoint_weights(str(tmp_path / "ck"))
    assert (loaded.config.layernorm_epsilon, loaded.config.rope_theta) == (1e-6, 1e6)
    model = parse_args([*printed, *ARGS]).model
    tokens = torch.randint(0, 1024, (3, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = hf(input_ids=tokens).logits
        positions = torch.arange(64).expand_as(tokens)
        ours = {eps_theta: build_model(replace(model, padded_vocab_size=loaded.config.padded_vocab_size,
                                               hidden_dropout=0.0, attention_dropout=0.0,
                                               layernorm_epsilon=eps_theta[0], rope_theta=eps_theta[1]),
                                       loaded.state_dict)(tokens, positions)[..., :1024]
                for eps_theta in ((model.layernorm_epsilon, model.rope_theta), (1e-5, 10000.0))}
    torch.testing.assert_close(ours[(1e-6, 1e6)], theirs, rtol=0, atol=1e-5)
    assert (ours[(1e-5, 10000.0)] - theirs).abs().max() > 1e-3
    code, _, err = tool_in_process(capsys, "checkpoint_to_hf.py", "--load", tmp_path / "ck", "--output",
                                   tmp_path / "back")
    assert code == 0, err
    exported = transformers.AutoConfig.from_pretrained(tmp_path / "back", local_files_only=True)
    assert (exported.rms_norm_eps, exported.rope_parameters["rope_theta"]) == (1e-6, 1e6)


def test_finetune_refuses_another_norm_epsilon_and_notes_another_rope_theta(tmp_path):
    """--finetune compares what the weights' shapes cannot show: another --layernorm-epsilon is refused in one line
    before the engine is touched; another --rope-theta is a note (raising it to fine-tune longer is a recipe)."""
    from test_llama import build, llama_config

    from megatron.checkpointing.finetune import load_finetune_weights, settings_check
    from megatron.saved_model.reader import SavedModelError

    saved = llama_config(layernorm_epsilon=1e-6, rope_theta=1e6)
    save_checkpoint_weights(str(tmp_path / "ckpt"), saved, build(saved).state_dict(), {}, "test")
    with pytest.raises(SavedModelError) as error:
        load_finetune_weights(None, str(tmp_path / "ckpt"), config=replace(saved, layernorm_epsilon=1e-5))
    assert str(error.value) == (f"--load {tmp_path / 'ckpt'} --finetune: the checkpoint was trained with "
                                "--layernorm-epsilon 1e-06, this run has 1e-05: pass --layernorm-epsilon 1e-06")
    assert settings_check(saved, replace(saved, rope_theta=5e5), "ck") == [
        "note: --load ck --finetune: the checkpoint was trained with --rope-theta 1000000.0, this run rotates with "
        "500000.0 (pass --rope-theta 1000000.0 to keep its angles)"]
    assert settings_check(saved, saved, "ck") == []


@pytest.mark.parametrize("change, message", [
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
     "rope_scaling/rope_parameters of type 'linear' (ours rotates with plain theta: rope_type 'default') cannot be "
     "expressed"),
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
    """INIT_HF=<LlamaForCausalLM folder of llama-tiny's shape, rms_norm_eps 1e-6, rope theta 1e6> picks MODEL_SIZE
    llama-tiny, converts, and loads it with --finetune under ZeRO-3, the run at the model's epsilon and theta; with
    lr 0 the weights after one step are still the HF model's."""
    save_random_hf_llama(tmp_path / "llama", GPT2_VOCAB, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6})
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
    assert (after.config.layernorm_epsilon, after.config.rope_theta) == (1e-6, 1e6)  # INIT_HF's, not the preset's
    for key, tensor in converted.state_dict.items():
        assert torch.equal(after.state_dict[key], tensor), key


# Meta-Llama-3-8B's config.json as published (written by transformers 4: rope_theta at the top level)
LLAMA3_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 8192, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.0.dev0", "use_cache": True, "vocab_size": 128256}


def init_hf_dry_run(folder, tmp_path, **env):
    """The Z1 driver's dry run with INIT_HF=folder: (exit status, the command's arguments, stderr)."""
    run = launch_script(REPO_ROOT / "examples_zero" / "gpt_deepspeed_Z1.sh", (),
                        test_env(INIT_HF=folder, RUNS_DIR=tmp_path / "runs", DRY_RUN=1, **env))
    lines = [line for line in run.stdout.splitlines() if "DRY_RUN=1, not starting: " in line]
    command = shlex.split(lines[0].split("not starting: ", 1)[1]) if lines else []
    return run.returncode, command, run.stderr


def pretrain_args(command):
    """pretrain_gpt.py's parsed flags of a dry run's command (the 2 CPU ranks' world)."""
    return parse_args(command[command.index(str(REPO_ROOT / "pretrain_gpt.py")) + 1:], world_size=2)


@pytest.mark.slow
@pytest.mark.parametrize("written_by", ["transformers5", "transformers4"])
def test_init_hf_passes_the_llamas_norm_epsilon_and_rope_theta(tmp_path, written_by):
    """INIT_HF=<llama-tiny shaped Llama of rms_norm_eps 1e-6, rope theta 1e6>, its config.json in either form:
    MODEL_SIZE llama-tiny, and the flags pretrain_gpt.py reads give the model's epsilon and theta (about 5 s: the
    planner reads config.json through transformers in the ranks' Python)."""
    transformers.LlamaConfig(
        vocab_size=1024, hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}).save_pretrained(tmp_path / "hf")
    if written_by == "transformers4":
        as_transformers4_wrote_it(tmp_path / "hf")
    code, command, err = init_hf_dry_run(tmp_path / "hf", tmp_path, SEQ_LEN=64)
    assert code == 0, err
    run_dir = tmp_path / "runs" / "gpt_llama-tiny_Z1"
    assert shlex.join(command).endswith(
        "--max-position-embeddings 64 --num-layers 2 --hidden-size 128 --num-attention-heads 4 --num-key-value-heads 2 "
        "--ffn-hidden-size 352 --rope-theta 1e+06 --normalization rmsnorm --swiglu --use-rotary-position-embeddings "
        f"--disable-bias-linear --untie-embeddings-and-output-weights --layernorm-epsilon 1e-06 --load "
        f"{run_dir}/hf_init_hf --finetune --tensorboard-dir {run_dir}/tensorboard --run-dir {run_dir} "
        "--exit-signal-handler")
    model = pretrain_args(command).model
    assert (model.layernorm_epsilon, model.rope_theta, model.num_key_value_heads) == (1e-6, 1e6, 2)


@pytest.mark.slow
def test_init_hf_reads_llama3_8bs_published_config_and_refuses_rope_scaling(tmp_path):
    """Meta-Llama-3-8B's config.json (rope_theta 500000 at the top level) is the llama3-8b preset with its theta;
    Llama 3.1's (rope_scaling of type llama3) is refused naming rope_scaling, before anything starts."""
    (tmp_path / "llama3").mkdir()
    (tmp_path / "llama3" / "config.json").write_text(json.dumps(LLAMA3_8B_CONFIG))
    code, command, err = init_hf_dry_run(tmp_path / "llama3", tmp_path)
    assert code == 0, err
    assert command[command.index("--model-size") + 1] == "llama3-8b"
    model = pretrain_args(command).model
    assert (model.rope_theta, model.layernorm_epsilon, model.max_position_embeddings) == (5e5, 1e-5, 8192)
    (tmp_path / "llama31").mkdir()
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_type": "llama3"}
    (tmp_path / "llama31" / "config.json").write_text(json.dumps(
        dict(LLAMA3_8B_CONFIG, rope_scaling=scaling, max_position_embeddings=131072)))
    code, command, err = init_hf_dry_run(tmp_path / "llama31", tmp_path)
    assert (code, command, err.splitlines()[-1]) == (1, [], (
        f"error: INIT_HF={tmp_path / 'llama31'}: rope_scaling/rope_parameters of type 'llama3' (ours rotates with "
        "plain theta: rope_type 'default') cannot be expressed"))
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_init_hf_llama_of_no_preset_passes_its_shape_and_a_model_size_it_is_not_is_refused(tmp_path):
    """A Llama of no preset's shape (TinyLlama-1.1B's: 22 layers of 2048, 32 heads over 4 K/V heads, FFN 5632) runs
    with its shape as flags, named after its folder; MODEL_SIZE of another shape is refused naming what differs."""
    folder = tmp_path / "TinyLlama-1.1B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(dict(
        LLAMA3_8B_CONFIG, num_hidden_layers=22, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
        intermediate_size=5632, rope_theta=10000.0, max_position_embeddings=2048, vocab_size=32000)))
    code, command, err = init_hf_dry_run(folder, tmp_path)
    assert code == 0, err
    assert "--model-size" not in command and f"{tmp_path}/runs/gpt_TinyLlama-1.1B_Z1/checkpoints" in command
    model = pretrain_args(command).model
    assert (model.num_layers, model.hidden_size, model.num_attention_heads, model.num_key_value_heads,
            model.ffn_hidden_size, model.rope_theta, model.layernorm_epsilon) == (22, 2048, 32, 4, 5632, 1e4, 1e-5)
    assert model.swiglu and model.normalization == "rmsnorm" and model.untie_embeddings_and_output_weights
    code, command, err = init_hf_dry_run(folder, tmp_path, MODEL_SIZE="llama2-7b")
    assert (code, command, err) == (1, [], (
        f"error: INIT_HF={folder} is not a MODEL_SIZE=llama2-7b model: its num_hidden_layers 22 (the preset's: 32), "
        "hidden_size 2048 (the preset's: 4096), num_key_value_heads 4 (the preset's: 32), intermediate_size 5632 "
        "(the preset's: 11008); leave MODEL_SIZE out, INIT_HF's config.json gives the shape\n"))
