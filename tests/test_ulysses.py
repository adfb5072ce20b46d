"""DeepSpeed-Ulysses (--ds-sequence-parallel-size, SP_SIZE): the layout's groups, the refusals (one line each),
the model on 2 real gloo ranks against the serial model (losses and summed gradients, learned and rotary
positions, Llama's grouped-query attention), and real pretrain_gpt.py runs: SP=2 gives the serial run's losses at
ZeRO 1 and 3 (llama-tiny's too), a checkpoint saved at SP=2 resumes at SP=1, and the Z1 driver trains with
SP_SIZE=2 (docs/long-sequences.md, docs/model.md)."""
import re
import subprocess
from functools import partial

import pytest
import torch
import torch.distributed as dist

from conftest import REPO_ROOT, driver_env, parallel_pretrain
from megatron.arguments import ConfigError, parse_args
from megatron.core.layout import ParallelLayout, ParallelLayoutError
from megatron.core.parallel_state import ParallelState
from megatron.launch.settings import training_settings
from megatron.model import GPTConfig, GPTModel
from megatron.accounting import TrainingSetup, ulysses_all_to_all_per_step
from megatron.training_log import MB
from megatron.training import get_batch, masked_mean_loss, sequence_mean_loss
from test_arguments import base
from runs import run_pretrain
from test_parallel_training import losses
from test_tensor_parallel import SEED, _gpt_config, run_ranks

SP2 = ["--ds-sequence-parallel-size", "2"]
# the runs' model: the tiny preset at --seq-length 64
TINY_AT_64 = GPTConfig(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=64,
                       max_position_embeddings=64, padded_vocab_size=None)


def grad_norms(log: str) -> list[float]:
    return [float(norm) for norm in re.findall(r"\| grad norm: (\S+) ", log)]


def test_layout_puts_sequence_ranks_between_tensor_and_data():
    layout = ParallelLayout(world_size=8, tensor_model_parallel_size=2, sequence_parallel_size=2)
    assert layout.data_parallel_size == 2
    assert layout.tensor_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.sequence_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.data_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # ZeRO partitions over the ranks holding the same parameters; a model replica is one TP group
    assert layout.sequence_data_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.model_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [layout.data_parallel_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [layout.sequence_parallel_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


def test_layout_without_ulysses_is_unchanged():
    layout = ParallelLayout(world_size=8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    assert layout.data_groups() == layout.sequence_data_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.model_groups() == [[0, 1, 4, 5], [2, 3, 6, 7]]


@pytest.mark.parametrize("extra, world, message", [
    (["--num-attention-heads", "6", "--hidden-size", "60", *SP2[:1], "4"], 4,
     "--num-attention-heads 6 is not divisible by --ds-sequence-parallel-size 4: each rank attends over whole heads"),
    ([*SP2[:1], "4", "--tensor-model-parallel-size", "2"], 8,
     "--num-attention-heads 4 (2 per tensor-parallel rank) is not divisible by --ds-sequence-parallel-size 4"),
    ([*SP2[:1], "3"], 4, "world size 4 is not divisible by --tensor-model-parallel-size 1 x "
                         "--pipeline-model-parallel-size 1 x --ds-sequence-parallel-size 3"),
    ([*SP2, "--sequence-parallel", "--tensor-model-parallel-size", "2"], 4,
     "--ds-sequence-parallel-size 2 and --sequence-parallel (Megatron's, over the tensor-parallel group) are "
     "exclusive; drop one"),
    ([*SP2, "--pipeline-model-parallel-size", "2"], 4,
     "--ds-sequence-parallel-size 2 cannot be combined with pipeline parallelism; use "
     "--pipeline-model-parallel-size 1 or --no-pipeline-parallel"),
    ([*SP2, "--seq-length", "33"], 2, "--seq-length 33 is not divisible by --ds-sequence-parallel-size 2"),
])
def test_what_ulysses_cannot_run_is_refused_in_one_line(data_prefix, extra, world, message):
    with pytest.raises((ConfigError, ParallelLayoutError)) as error:
        parse_args(base(data_prefix, "--global-batch-size", "8", *extra), world_size=world)
    text = str(error.value)
    assert "\n" not in text and text.startswith(message)


def test_zero3_without_its_reduce_scatter_is_refused_in_one_line(data_prefix, tmp_path):
    config = tmp_path / "ds.json"
    config.write_text('{"zero_optimization": {"stage": 3, "reduce_scatter": false}}')
    with pytest.raises(ConfigError) as error:
        parse_args(base(data_prefix, "--global-batch-size", "8", *SP2, "--deepspeed_config", str(config)),
                   world_size=2)
    assert str(error.value) == (f"--ds-sequence-parallel-size 2 at ZeRO stage 3 needs zero_optimization.reduce_scatter "
                                f"on (--deepspeed_config {config} turns it off): DeepSpeed averages the gradients "
                                "another way there")


def test_two_heads_per_tensor_rank_split_over_two_sequence_ranks_fit(data_prefix):
    args = parse_args(base(data_prefix, "--global-batch-size", "8", *SP2, "--tensor-model-parallel-size", "2"),
                      world_size=4)
    assert args.parallel.sequence_parallel_size == 2 and args.parallel.data_parallel_size == 1
    assert args.training.gradient_accumulation_steps == 4  # 8 samples = micro batch 2 x 4 on the one replica


def test_sp_size_gives_the_flag_and_the_data_parallel_size():
    settings = training_settings({"SP_SIZE": "2", "MICRO_BATCH": "2"}, accelerator="cpu", world=2,
                                 model_size="tiny")
    flags = settings.flags
    assert flags[flags.index("--ds-sequence-parallel-size") + 1] == "2"
    assert settings.sources["--ds-sequence-parallel-size"] == "SP_SIZE"
    assert settings.values["DPSIZE"] == "1" and settings.values["GLOBAL_BATCH"] == "2"
    assert "--ds-sequence-parallel-size" not in training_settings({}, accelerator="cpu", world=2,
                                                                  model_size="tiny").flags


def test_each_sequence_rank_gets_its_slice_at_its_positions():
    text = torch.arange(2 * 9).view(2, 9)
    group = type("Group", (), {"rank": 1, "size": 2})
    tokens, labels, positions, mask = get_batch({"text": text}, torch.device("cpu"), eod=-1, eod_mask_loss=False,
                                                sequence=group)
    assert torch.equal(tokens, text[:, 4:8]) and torch.equal(labels, text[:, 5:9])
    assert positions.tolist() == [[4, 5, 6, 7]] * 2 and mask.shape == (2, 4)


@pytest.mark.parametrize("micro_batch", [1, 2])
def test_a_sequence_rank_keeps_only_its_slice_of_the_sample(micro_batch):
    """The token and position ids the embedding saves for its backward hold the rank's s/N ids, not the whole
    sample's: a slice of one sample is contiguous, so .contiguous() kept it a view of the whole sample's storage,
    8 bytes per token of the whole sequence more than activation_bytes predicts (tests/test_long_sequence_levers.py
    measured them at micro-batch 1)."""
    text = torch.arange(micro_batch * 9).view(micro_batch, 9)
    group = type("Group", (), {"rank": 1, "size": 2})
    for kept in get_batch({"text": text}, torch.device("cpu"), eod=-1, eod_mask_loss=False, sequence=group):
        assert kept.shape == (micro_batch, 4)
        held = kept.untyped_storage().nbytes()
        assert held == micro_batch * 4 * kept.element_size(), f"{held} bytes held for {kept.tolist()}"


# llama-tiny's architecture at the tests' small width: grouped-query attention (4 query heads over 2 K/V heads),
# RMSNorm, SwiGLU, untied output, no biases, rotary positions (docs/model.md)
LLAMA_SHAPE = dict(use_rotary_position_embeddings=True, num_key_value_heads=2, normalization="rmsnorm", swiglu=True,
                   ffn_hidden_size=64, untie_embeddings_and_output_weights=True, disable_bias_linear=True)
SHAPES = {"learned": {}, "rotary": dict(use_rotary_position_embeddings=True), "llama-gqa": LLAMA_SHAPE}


def _check_model_matches_serial(rank, world, shape):
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # DistributedAttention's all-to-alls go through deepspeed.comm
    state = ParallelState.build(ParallelLayout(world_size=world, sequence_parallel_size=2))
    config = _gpt_config(**SHAPES[shape])
    torch.manual_seed(SEED)
    serial = GPTModel(config)
    torch.manual_seed(SEED)
    split = GPTModel(config, sp_group=state.get_sequence_parallel_group())
    text = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(7))
    tokens, labels, positions, mask = get_batch({"text": text}, torch.device("cpu"), -1, False)
    expected = masked_mean_loss(serial(tokens, positions, labels), mask)
    expected.backward()
    tokens, labels, positions, mask = get_batch({"text": text}, torch.device("cpu"), -1, False, state.sequence)
    share, whole = sequence_mean_loss(split(tokens, positions, labels), mask, state.sequence)
    share.backward()
    torch.testing.assert_close(whole, expected.detach(), rtol=1e-6, atol=0)
    for (name, param), reference in zip(split.named_parameters(), serial.parameters()):
        grad = param.grad.clone()
        dist.all_reduce(grad, group=state.get_sequence_parallel_group())  # what DeepSpeed's reduction sums
        torch.testing.assert_close(grad, reference.grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("shape", list(SHAPES))
def test_two_sequence_ranks_give_the_serial_loss_and_gradients(shape):
    run_ranks(partial(_check_model_matches_serial, shape=shape))


def _check_dropout_masks_differ_per_sequence_rank(rank, world):
    """Hidden dropout 0.5 and attention dropout 0.5 on 2 SP ranks from one seed: the embedding's and each layer's
    residual masks (read from the dropout modules' inputs and outputs) and the stream the attention's SDPA draws
    its mask from (read in DistributedAttention's local attention, after the all-to-all) differ between the ranks;
    a recomputed layer (--checkpoint-activations) draws its masks again."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    state = ParallelState.build(ParallelLayout(world_size=world, sequence_parallel_size=2))
    group = state.get_sequence_parallel_group()
    for recompute in (False, True):
        config = _gpt_config(hidden_dropout=0.5, attention_dropout=0.5, recompute_activations=recompute)
        torch.manual_seed(SEED)
        model = GPTModel(config, sp_group=group).train()
        masks, attention = [], []

        def residual_mask(module, inputs, output):
            masks.append((output == 0) & (inputs[0] != 0))

        def attention_stream(module, inputs):  # the next draws of the generator SDPA's dropout reads
            generator = torch.Generator()
            generator.set_state(torch.get_rng_state())
            attention.append(torch.rand(64, generator=generator))

        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.register_forward_hook(residual_mask)
        for layer in model.layers:
            layer.self_attention.ulysses.attention.local_attn.register_forward_pre_hook(attention_stream)
        text = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(7))
        tokens, labels, positions, mask = get_batch({"text": text}, torch.device("cpu"), -1, False, state.sequence)
        sequence_mean_loss(model(tokens, positions, labels), mask, state.sequence)[0].backward()
        # the embedding's and the 2 layers' 2 residual masks, the 2 layers' attentions; a recomputed layer stops
        # once it has what its backward needs (torch's non-reentrant checkpoint), before its MLP's residual dropout
        assert (len(masks), len(attention)) == ((5, 2) if not recompute else (7, 4)), (len(masks), len(attention))
        for first, again in ((masks[:5], masks[5:]), (attention[:2], attention[2:])):  # the same masks drawn again
            assert all(any(torch.equal(mask, drawn) for drawn in first) for mask in again)
        for mine in masks + attention:
            mine = mine.float()
            both = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(both, mine, group=group)
            assert not torch.equal(both[0], both[1])


@pytest.mark.slow
def test_sequence_ranks_draw_different_dropout_masks():
    run_ranks(_check_dropout_masks_differ_per_sequence_rank)


@pytest.fixture(scope="module")
def ulysses_runs(dolly_data_dir, tmp_path_factory):
    """The serial run, SP=2 at ZeRO 1 (3 iterations, saved, then resumed at SP=1 on one rank) and at ZeRO 3."""
    save = tmp_path_factory.mktemp("sp2_checkpoints")
    serial = parallel_pretrain(dolly_data_dir, 1, "--zero-stage", "1").stdout
    first = parallel_pretrain(dolly_data_dir, 2, *SP2, "--zero-stage", "1", "--save", str(save),
                              "--exit-interval", "3").stdout
    resumed = parallel_pretrain(dolly_data_dir, 1, "--zero-stage", "1", "--load", str(save),
                                "--universal-checkpoint").stdout
    zero3 = parallel_pretrain(dolly_data_dir, 2, *SP2, "--zero-stage", "3").stdout
    return dict(serial=serial, first=first, resumed=resumed, zero3=zero3, save=save)


@pytest.mark.slow
def test_sp2_gives_the_serial_losses_at_zero_1_and_3(ulysses_runs):
    serial = losses(ulysses_runs["serial"])
    assert len(serial) == 6 and serial[4] < serial[0] - 0.2
    assert "| world size: 2 |" in ulysses_runs["zero3"]
    assert losses(ulysses_runs["zero3"]) == pytest.approx(serial, rel=1e-5)
    assert losses(ulysses_runs["first"]) == pytest.approx(serial[:3], rel=1e-5)
    # the gradients themselves (ZeRO-3's reduce-scatter averages over SP x DP: megatron/training.py scales for it)
    assert grad_norms(ulysses_runs["zero3"]) == pytest.approx(grad_norms(ulysses_runs["serial"]), rel=1e-3)
    assert grad_norms(ulysses_runs["first"]) == pytest.approx(grad_norms(ulysses_runs["serial"])[:3], rel=1e-3)


@pytest.mark.slow
def test_the_comm_line_counts_the_all_to_alls_as_predicted(ulysses_runs):
    """4 all-to-alls per layer and pass of the [2, 32, 128] fp32 slice, half of it sent: 2 layers x 8 x 16 KiB x 4
    micro-batches = 1 MiB a step; the serial run has none."""
    setup = TrainingSetup(world_size=2, micro_batch_size=2, gradient_accumulation_steps=4, sequence_parallel_size=2)
    predicted = ulysses_all_to_all_per_step(TINY_AT_64, setup)
    assert predicted == 2 * 8 * 2 * 32 * 128 * 4 / 2 * 4 == 2**20
    for name in ("first", "zero3"):
        measured = [float(value) * MB for value in re.findall(r"\| all_to_all=(\S+)MB \|", ulysses_runs[name])]
        assert len(measured) >= 3 and measured == pytest.approx([predicted] * len(measured), abs=0.001 * MB), name
    assert "all_to_all=" not in ulysses_runs["serial"]


@pytest.mark.slow
def test_the_model_state_line_predicts_the_ulysses_activations(ulysses_runs):
    """Each SP=2 rank keeps half a sequence's activations (and the attention's whole sequence for half the heads):
    the model-state line's measured activations beside the estimate, which partitions ZeRO over both ranks."""
    for name in ("first", "zero3"):
        line = next(line for line in ulysses_runs[name].splitlines() if "model state memory per rank" in line)
        measured, predicted = (float(value) for value in re.findall(r" activations=(\S+)", line))
        assert measured == pytest.approx(predicted, rel=0.15), line
        assert "dp=2," in line
    serial = next(line for line in ulysses_runs["serial"].splitlines() if "model state memory per rank" in line)
    assert float(re.findall(r" activations=(\S+)", serial)[0]) > 1.6 * measured


@pytest.mark.slow
def test_a_checkpoint_saved_at_sp2_resumes_at_sp1(ulysses_runs):
    resumed = ulysses_runs["resumed"]
    assert re.findall(r" iteration\s+(\d+)/", resumed) == ["4", "5"]
    assert losses(resumed) == pytest.approx(losses(ulysses_runs["serial"])[3:], rel=1e-5)


@pytest.mark.slow
def test_resuming_at_sp1_without_universal_checkpoint_is_refused_in_one_line(dolly_data_dir, ulysses_runs):
    run = run_pretrain(dolly_data_dir, "--zero-stage", "1", "--load", str(ulysses_runs["save"]), ranks=1, expect=1)
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: --load {ulysses_runs['save']}: checkpoint global_step3 was saved with data-parallel "
                      "size 1 x --ds-sequence-parallel-size 2 at ZeRO stage 1, this run has data-parallel size 1 at "
                      "ZeRO stage 1: resume it with --universal-checkpoint (docs/checkpoints.md)"]


@pytest.mark.slow
def test_the_z1_driver_trains_with_sp_size_2(dolly_data_dir, tmp_path):
    env = driver_env(dolly_data_dir, tmp_path, SP_SIZE=2, TRAIN_EPOCHS="", TRAIN_ITERS=3, EVAL_ITERS=0,
                     ZERO_LAB_SKIP_PROBES=1)
    run = subprocess.run(["bash", str(REPO_ROOT / "examples_zero" / "gpt_deepspeed_Z1.sh")], cwd=REPO_ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    log = (tmp_path / "gpt_tiny_Z1_ulysses2" / "train.log").read_text()
    assert "--ds-sequence-parallel-size 2" in (tmp_path / "gpt_tiny_Z1_ulysses2" / "command.txt").read_text()
    # 2 ranks, one replica: the global batch is MICRO_BATCH x 1, ZeRO partitions over both ranks
    assert "| world size: 2 | micro batch: 4 | global batch: 4 |" in log
    assert "ZeRO estimate (stage=1, dp=2," in log
    assert len(re.findall(r"\| lm loss: (\S+) \|", log)) == 3


@pytest.mark.slow
def test_llama_tiny_at_sp2_gives_the_sp1_losses(dolly_data_dir):
    """Grouped-query attention under Ulysses through pretrain_gpt.py: llama-tiny (4 query heads over 2 K/V heads,
    each sequence rank attends with 2 query heads and their K/V repeated) at SP=2, ZeRO-1, against one rank."""
    llama = ("--model-size", "llama-tiny", "--zero-stage", "1")
    serial = parallel_pretrain(dolly_data_dir, 1, *llama).stdout
    split = parallel_pretrain(dolly_data_dir, 2, *SP2, *llama).stdout
    assert "| model: llama-tiny | world size: 2 |" in split and "| world size: 1 |" in serial
    assert len(losses(serial)) == 6 and losses(split) == pytest.approx(losses(serial), rel=1e-5)
    assert grad_norms(split) == pytest.approx(grad_norms(serial), rel=1e-3)
