"""Hugging Face GPT-2 conversion both ways, on real checkpoints of real 2-rank DeepSpeed runs (the suite's
driver runs and parallel layouts, conftest.py):
exports load in transformers offline with equal logits, every ZeRO stage in fp32 and in bf16 exports the weights
the run ended with, ZeRO-3 + offload exports equal ZeRO-0 exports, converted GPT-2 weights start a --finetune run under ZeRO-3, and bad inputs fail in one line."""
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from conftest import PARALLEL_ITERS, REPO_ROOT, save_random_hf_gpt2, test_env, tool_in_process
from megatron.saved_model.reader import (build_model, check_state_dict, load_checkpoint_weights,
                                           save_checkpoint_weights)
from megatron.inference.hf_folder import load_hf_folder
from megatron.inference.hf_gpt2 import from_hf_config, state_dict_from_hf
from megatron.model import MODEL_PRESETS
from megatron import accounting
from megatron.safe_load import load_file

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

GPT2_VOCAB = 50257


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pretrain(data_dir, *extra, nproc=2, iters=3):
    launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(free_port())]
    cmd = [sys.executable, *(launcher if nproc > 1 else []), str(REPO_ROOT / "pretrain_gpt.py"),
           "--model-size", "tiny", "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
           "--train-iters", str(iters), "--log-interval", "1", "--eval-iters", "0", "--seed", "7", "--split", "90,10,0",
           "--data-path", str(data_dir / "dolly_text_document"), "--vocab-file", str(data_dir / "gpt2-vocab.json"),
           "--merge-file", str(data_dir / "gpt2-merges.txt"), *map(str, extra)]
    return subprocess.run(cmd, env=test_env(MASTER_PORT=free_port()), capture_output=True, text=True, timeout=300)


def tool(name, *args):
    return subprocess.run([sys.executable, str(REPO_ROOT / "tools" / name), *map(str, args)], env=test_env(),
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)




def hf_logits(folder, tokens):
    model = transformers.GPT2LMHeadModel.from_pretrained(folder, local_files_only=True).eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits


def our_logits(checkpoint, tokens):
    loaded = load_checkpoint_weights(str(checkpoint))
    model = build_model(loaded.config, loaded.state_dict)
    with torch.no_grad():
        return model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens))[..., :GPT2_VOCAB]


def dolly_tokens(data_dir, batch=3, length=64):
    from megatron.data.indexed_dataset import MMapIndexedDataset
    data = MMapIndexedDataset(str(data_dir / "dolly_text_document"))
    stream = [int(t) for doc in range(len(data)) for t in data[doc]][:batch * length]
    return torch.tensor(stream).view(batch, length)


@pytest.fixture(scope="module")
def trained(six_driver_runs):
    """Checkpoints of the same seeded run under ZeRO-0 and under ZeRO-3 with optimizer+parameter offload: the
    DP and Z3_OL drivers of conftest.six_driver_runs (4 iterations), by name."""
    runs_dir, result = six_driver_runs
    assert result.returncode == 0, result.stderr[-3000:]
    return {"Z0": runs_dir / "gpt_tiny_DP" / "checkpoints", "Z3_OL": runs_dir / "gpt_tiny_Z3_OL" / "checkpoints"}


@pytest.mark.slow
def test_export_loads_in_transformers_offline_with_equal_logits(trained, dolly_data_dir, tmp_path):
    out = tmp_path / "hf"
    result = tool("checkpoint_to_hf.py", "--load", trained["Z0"], "--output", out)
    assert result.returncode == 0, result.stderr
    assert {"config.json", "merges.txt", "model.safetensors", "vocab.json"} <= {p.name for p in out.iterdir()}
    config = transformers.AutoConfig.from_pretrained(out, local_files_only=True)
    assert (config.n_layer, config.n_embd, config.n_head, config.vocab_size) == (2, 128, 4, GPT2_VOCAB)
    tokens = dolly_tokens(dolly_data_dir)
    theirs, ours = hf_logits(out, tokens), our_logits(trained["Z0"], tokens)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
    # the exported tokenizer is GPT-2's: the same ids as ours on a real record
    from megatron.tokenizer import TokenizerConfig, build_tokenizer
    text = "Which is a species of fish? Tope or Rope\nTope"
    ours_tok = build_tokenizer(TokenizerConfig(vocab_file=str(dolly_data_dir / "gpt2-vocab.json"),
                                               merge_file=str(dolly_data_dir / "gpt2-merges.txt")), verbose=False)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert hf_tok(text).input_ids == ours_tok.tokenize(text)


@pytest.mark.slow
def test_zero3_offload_export_equals_zero0_export(trained, tmp_path, capsys):
    exports = {}
    for name in ("Z0", "Z3_OL"):
        code, _, err = tool_in_process(capsys, "checkpoint_to_hf.py", "--load", trained[name],
                                       "--output", tmp_path / name)
        assert code == 0, err
        exports[name] = safetensors_torch.load_file(tmp_path / name / "model.safetensors")
    assert exports["Z0"].keys() == exports["Z3_OL"].keys()
    for key, tensor in exports["Z0"].items():
        # same seed and data; only the order of floating-point reductions differs between the stages
        torch.testing.assert_close(exports["Z3_OL"][key], tensor, rtol=0, atol=1e-4, msg=key)
    # and the stage-3 weights really came out of the partitioned optimizer files (the module file holds none)
    module = torch.load(next(trained["Z3_OL"].glob("global_step4/zero_pp_rank_0_*model_states.pt")),
                        map_location="cpu", weights_only=False)["module"]
    assert all(t.numel() == 0 for t in module.values())


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2_sp_z3", "pp2_z1"])
def test_tensor_and_pipeline_parallel_exports_equal_the_serial_export(parallel_layout_runs, layout, tmp_path, capsys):
    """The same seeded run (conftest.PARALLEL_LAYOUTS) at TP=1, at TP=2 with sequence parallelism under ZeRO-3,
    and at PP=2 exports the same weights."""
    exports = {}
    for name in ("serial", layout):
        code, _, err = tool_in_process(capsys, "checkpoint_to_hf.py", "--load", parallel_layout_runs[name][1],
                                       "--output", tmp_path / name)
        assert code == 0, err
        exports[name] = safetensors_torch.load_file(tmp_path / name / "model.safetensors")
    for key, tensor in exports["serial"].items():
        torch.testing.assert_close(exports[layout][key], tensor, rtol=0, atol=1e-4, msg=key)
    files = {p.name for p in (parallel_layout_runs[layout][1] / f"global_step{PARALLEL_ITERS}").iterdir()}
    assert ("layer_03-model_00-model_states.pt" in files) == (layout == "pp2_z1")
    assert ("zero_pp_rank_0_mp_rank_01_model_states.pt" in files) == (layout == "tp2_sp_z3")


DRIVERS = {0: "DP", 1: "Z1", 2: "Z2", 3: "Z3"}


@pytest.fixture(scope="module")
def bf16_runs(bf16_driver_runs, tmp_path_factory):
    """The suite's bf16 runs of the drivers (conftest.bf16_driver_runs) at their first iteration, at each ZeRO
    stage: stage -> a checkpoint folder whose `latest` names global_step1, a link to the run's. One iteration, as
    stage 3's export is held against stage 2's to 1e-4. Stage 1 (fp32 gradient accumulation) runs DeepSpeed's
    BF16_Optimizer, whose files zero_to_fp32 does not read."""
    root = tmp_path_factory.mktemp("bf16_first_steps")
    for stage, name in DRIVERS.items():
        (root / f"z{stage}").mkdir()
        (root / f"z{stage}" / "global_step1").symlink_to(bf16_driver_runs(name) / "checkpoints" / "global_step1")
        (root / f"z{stage}" / "latest").write_text("global_step1")
    return {stage: root / f"z{stage}" for stage in DRIVERS}


def run_checkpoint(request, precision, stage):
    """fp32: the suite's driver run of that stage (4 iterations); bf16: bf16_runs."""
    if precision == "bf16":
        return request.getfixturevalue("bf16_runs")[stage]
    runs_dir, result = request.getfixturevalue("six_driver_runs")
    assert result.returncode == 0, result.stderr[-3000:]
    return runs_dir / f"gpt_tiny_{DRIVERS[stage]}" / "checkpoints"


def exported_weights(capsys, checkpoint, out):
    """checkpoint_to_hf.py's export, in our names (the vocabulary's padding rows dropped), and its output."""
    code, stdout, err = tool_in_process(capsys, "checkpoint_to_hf.py", "--load", checkpoint, "--output", out)
    assert code == 0, err
    config = load_checkpoint_weights(str(checkpoint)).config
    weights = state_dict_from_hf(safetensors_torch.load_file(out / "model.safetensors"), config)
    weights["word_embeddings.weight"] = weights["word_embeddings.weight"][:GPT2_VOCAB]
    return weights, stdout


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", list(DRIVERS))
def test_export_from_every_zero_stage_and_precision_holds_the_trained_weights(request, capsys, tmp_path, stage,
                                                                             precision):
    """Below ZeRO-3 the model-states file holds the module's weights the run ended with: the export is them
    (in bf16, the fp32 master weights it takes round to them). Under ZeRO-3 that file holds none, so the export
    is held against stage 2's of the same seeded run (only the order of the gradient sums differs)."""
    checkpoint = run_checkpoint(request, precision, stage)
    exported, stdout = exported_weights(capsys, checkpoint, tmp_path / "hf")
    fp32_module = stage == 0 and precision == "fp32"  # no other fp32 copy than the module's
    source = "the module's float32 weights" if fp32_module else "the optimizer's fp32 master weights"
    assert stdout.rstrip().endswith(f"; weights: {source})"), stdout
    if stage == 3:
        reference, _ = exported_weights(capsys, run_checkpoint(request, precision, 2), tmp_path / "hf_z2")
        for key, tensor in reference.items():
            torch.testing.assert_close(exported[key], tensor, rtol=0, atol=1e-4, msg=key)
        return
    tag = (checkpoint / "latest").read_text()
    module = load_file(str(checkpoint / tag / "mp_rank_00_model_states.pt"))["module"]
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    for key, tensor in module.items():
        rows = slice(0, GPT2_VOCAB) if key == "word_embeddings.weight" else slice(None)
        assert tensor.dtype == dtype and torch.equal(exported[key].to(dtype), tensor[rows]), key


@pytest.mark.slow
def test_zero3_checkpoint_without_optimizer_files_is_an_error(trained, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(trained["Z3_OL"], broken)
    for path in broken.glob("global_step4/*optim_states.pt"):
        path.unlink()
    code, _, err = tool_in_process(capsys, "checkpoint_to_hf.py", "--load", broken, "--output", tmp_path / "out")
    assert code == 1
    assert err.startswith("error: ") and "no ZeRO optimizer files" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def hf_gpt2(tmp_path_factory, dolly_data_dir):
    """A transformers-created random GPT-2 of the `tiny` preset's shape (biases random too)."""
    torch.manual_seed(3)
    tiny = MODEL_PRESETS["tiny"]
    folder = tmp_path_factory.mktemp("hf_random") / "gpt2"
    save_random_hf_gpt2(folder, dolly_data_dir, 0.05, n_layer=tiny["num_layers"], n_embd=tiny["hidden_size"],
                        n_head=tiny["num_attention_heads"], n_positions=64, vocab_size=GPT2_VOCAB)
    return folder


@pytest.fixture(scope="module")
def converted(hf_gpt2, tmp_path_factory):
    """hf_gpt2 converted by tools/hf_to_checkpoint.py (in this process)."""
    folder = tmp_path_factory.mktemp("converted") / "init"
    loaded = load_hf_folder(str(hf_gpt2))
    save_checkpoint_weights(str(folder), loaded.config, loaded.state_dict,
                            {"vocab_file": loaded.tokenizer.vocab_file, "merge_file": loaded.tokenizer.merge_file},
                            source="test")
    return folder


@pytest.mark.slow
def test_hf_gpt2_to_checkpoint_gives_equal_logits(hf_gpt2, dolly_data_dir, tmp_path):
    result = tool("hf_to_checkpoint.py", "--hf", hf_gpt2, "--save", tmp_path / "ckpt")
    assert result.returncode == 0, result.stderr
    assert "--num-layers 2 --hidden-size 128 --num-attention-heads 4" in result.stdout
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step0"
    assert (tmp_path / "ckpt" / "vocab.json").is_file() and (tmp_path / "ckpt" / "merges.txt").is_file()
    loaded = load_checkpoint_weights(str(tmp_path / "ckpt"))
    assert loaded.iteration == 0 and loaded.config.padded_vocab_size == 50304
    tokens = dolly_tokens(dolly_data_dir)
    torch.testing.assert_close(our_logits(tmp_path / "ckpt", tokens), hf_logits(hf_gpt2, tokens), rtol=0, atol=1e-4)
    # and back: the round trip reproduces transformers' tensors exactly
    back = tool("checkpoint_to_hf.py", "--load", tmp_path / "ckpt", "--output", tmp_path / "back")
    assert back.returncode == 0, back.stderr
    original = safetensors_torch.load_file(hf_gpt2 / "model.safetensors")
    again = safetensors_torch.load_file(tmp_path / "back" / "model.safetensors")
    for key in original:
        assert torch.equal(again.get(key, again.get("transformer." + key)), original[key]), key


@pytest.mark.parametrize("name, shape", [("gpt2", (12, 768, 12)), ("gpt2-medium", (24, 1024, 16)),
                                         ("gpt2-large", (36, 1280, 20)), ("gpt2-xl", (48, 1600, 25))])
def test_published_gpt2_shapes_map_onto_our_model(name, shape):
    layers, hidden, heads = shape
    hf_config = transformers.GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, n_positions=1024,
                                        vocab_size=GPT2_VOCAB)
    with torch.device("meta"):  # shapes only: no memory for 1.5B parameters
        state = transformers.GPT2LMHeadModel(hf_config).state_dict()
        config = from_hf_config(hf_config, 50304)
        ours = state_dict_from_hf(state, config)
    check_state_dict(ours, config, name)
    assert accounting.count_parameters(config) == sum(t.numel() for t in ours.values())


@pytest.mark.slow
def test_zero3_driver_fine_tunes_from_init_hf(hf_gpt2, dolly_data_dir, tmp_path):
    """INIT_HF through examples_zero: converted into the run folder, loaded with --finetune under ZeRO-3."""
    env = test_env(INIT_HF=hf_gpt2, SEQ_LEN=64, TRAIN_ITERS=1, LR=0, MIN_LR=0, DATA_DIR=dolly_data_dir,
                   RUNS_DIR=tmp_path / "runs", MASTER_PORT=free_port(), PYTHON=sys.executable)
    run = subprocess.run(["bash", str(REPO_ROOT / "examples_zero" / "gpt_deepspeed_Z3.sh"), "--save",
                          str(tmp_path / "after")], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    converted = tmp_path / "runs" / "gpt_tiny_Z3" / "hf_init_gpt2"
    assert (converted / "latest").is_file()
    assert "for fine-tuning (iteration and optimizer reset)" in run.stdout
    assert " iteration        1/       1 |" in run.stdout
    # lr 0: after one step the weights must still be GPT-2's, so they were loaded, not re-initialised
    after, original = load_checkpoint_weights(str(tmp_path / "after")), load_checkpoint_weights(str(converted))
    assert after.iteration == 1
    for key, tensor in original.state_dict.items():
        assert torch.equal(after.state_dict[key], tensor), key


@pytest.mark.slow
def test_finetune_under_tensor_and_pipeline_parallelism(converted, dolly_data_dir, tmp_path):
    """4 ranks, TP=2 x PP=2: each rank takes its TP shard of its stage's layers (the vocabulary padded
    to TP=2's size); with lr 0 the saved weights export back to the converted GPT-2's."""
    run = pretrain(dolly_data_dir, "--lr", "0", "--tensor-model-parallel-size", "2",
                   "--pipeline-model-parallel-size", "2", "--zero-stage", "1", "--load", converted, "--finetune",
                   "--save", tmp_path / "after", nproc=4, iters=1)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "for fine-tuning (iteration and optimizer reset)" in run.stdout
    after, original = load_checkpoint_weights(str(tmp_path / "after")), load_checkpoint_weights(str(converted))
    assert after.config.padded_vocab_size == 50432 and after.iteration == 1
    for key, tensor in original.state_dict.items():
        rows = slice(0, GPT2_VOCAB) if key == "word_embeddings.weight" else slice(None)
        assert torch.equal(after.state_dict[key][rows], tensor[rows]), key


@pytest.mark.slow
@pytest.mark.parametrize("flags, message", [
    (["--num-layers", "3"], "the checkpoint's weights do not fit this model (it has 2 layers, --num-layers is 3)"),
    (["--layernorm-epsilon", "1e-6"], "the checkpoint was trained with --layernorm-epsilon 1e-05, this run has "
                                      "1e-06: pass --layernorm-epsilon 1e-05"),
])
def test_finetune_with_mismatched_model_flags_is_a_one_line_error(converted, dolly_data_dir, flags, message):
    run = pretrain(dolly_data_dir, "--lr", "0", *flags, "--load", converted, "--finetune", nproc=1, iters=1)
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1] == f"error: --load {converted} --finetune: {message}"
    assert "Traceback" not in run.stderr


@pytest.mark.slow
def test_bad_inputs_are_one_line_errors(hf_gpt2, tmp_path, capsys):
    missing = tool("checkpoint_to_hf.py", "--load", tmp_path / "nothing", "--output", tmp_path / "o1")
    assert (missing.returncode, missing.stderr) == (
        1, f"error: --load {tmp_path / 'nothing'}: no such checkpoint folder\n")
    converted = tmp_path / "ckpt"
    assert tool_in_process(capsys, "hf_to_checkpoint.py", "--hf", hf_gpt2, "--save", converted)[0] == 0
    code, _, err = tool_in_process(capsys, "hf_to_checkpoint.py", "--hf", hf_gpt2, "--save", converted)
    assert code == 1 and "folder exists and is not empty" in err
    # a model description that does not fit the weights (one layer too many, or another MLP width)
    states_file = converted / "global_step0" / "mp_rank_00_model_states.pt"
    states = torch.load(states_file, weights_only=False)
    for change, message in ((dict(num_layers=3), "weights do not match a GPT with 3 layers (missing ['layers.2."),
                            (dict(ffn_hidden_size=256), "layers.0.mlp.dense_h_to_4h.weight has shape (512, 128), "
                                                        "the model description gives (256, 128)")):
        torch.save(dict(states, model_config=dict(states["model_config"], **change)), states_file)
        code, _, err = tool_in_process(capsys, "checkpoint_to_hf.py", "--load", converted, "--output", tmp_path / "o2")
        assert code == 1 and err.startswith("error: ") and message in err, err
        assert len(err.strip().splitlines()) == 1 and not (tmp_path / "o2").exists()
    states_file.write_bytes(states_file.read_bytes()[:100_000])  # a save cut short
    code, _, err = tool_in_process(capsys, "checkpoint_to_hf.py", "--load", converted, "--output", tmp_path / "o2")
    assert code == 1 and err.startswith(f"error: {states_file}: unreadable checkpoint file (")
    (converted / "latest").write_text("global_step9")
    code, _, err = tool_in_process(capsys, "checkpoint_to_hf.py", "--load", converted, "--output", tmp_path / "o3")
    assert code == 1 and "tag 'global_step9' has no folder" in err
    bert = tmp_path / "bert"
    transformers.BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                            intermediate_size=64).save_pretrained(bert)
    code, _, err = tool_in_process(capsys, "hf_to_checkpoint.py", "--hf", bert, "--save", tmp_path / "o4")
    assert code == 1 and "expected a GPT-2 config (model_type 'gpt2'), got 'bert'" in err
    assert not (tmp_path / "o4").exists()


@pytest.mark.slow
def test_init_hf_errors_name_the_variable(tmp_path):
    """No config.json; a GPT-2 of another shape than MODEL_SIZE's, which names what differs (about 5 s: the planner
    reads config.json through transformers in the ranks' Python)."""
    driver = str(REPO_ROOT / "examples_zero" / "gpt_deepspeed_Z1.sh")
    run = subprocess.run(["bash", driver], env=test_env(INIT_HF=tmp_path, RUNS_DIR=tmp_path / "runs"),
                         capture_output=True, text=True, timeout=120)
    assert (run.returncode, run.stderr) == (1, f"error: INIT_HF={tmp_path}: not a Hugging Face model folder "
                                               "(no config.json)\n")
    transformers.GPT2Config(n_layer=3, n_embd=96, n_head=4).save_pretrained(tmp_path)
    run = subprocess.run(["bash", driver], env=test_env(INIT_HF=tmp_path, RUNS_DIR=tmp_path / "runs",
                                                        MODEL_SIZE="tiny"), capture_output=True, text=True, timeout=120)
    assert (run.returncode, run.stderr) == (1, f"error: INIT_HF={tmp_path} is not a MODEL_SIZE=tiny model: its n_layer "
                                               "3 (the preset's: 2), n_embd 96 (the preset's: 128); leave MODEL_SIZE "
                                               "out, INIT_HF's config.json gives the shape\n")
    assert not (tmp_path / "runs").exists()
