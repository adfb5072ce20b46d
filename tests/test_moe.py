"""Mixture of experts (--num-experts, DeepSpeed's MoE layer; docs/moe.md): which layers get experts, the flags and
their refusals (one line each), expert gradients through DeepSpeed's reduction on 2 real gloo ranks at EP=1 and
EP=2, and real pretrain_gpt.py runs: EP=2 gives EP=1's losses without token dropping, ZeRO 1 and 2 give ZeRO 0's."""
import re
import subprocess
from dataclasses import replace
from functools import partial

import pytest
import torch
import torch.distributed as dist

from conftest import REPO_ROOT, driver_env, parallel_pretrain, tool_in_process
from megatron.arguments import ConfigError, parse_args
from megatron.core.layout import ParallelLayout
from megatron.core.parallel_state import ParallelState
from megatron.launch.settings import LaunchError, training_settings
from megatron.model import GPTModel
from megatron.model.config import ModelConfigError
from megatron.model.moe import expert_parallel_rank, moe_layers, routing_summary
from megatron.training import get_batch, masked_mean_loss, with_moe_loss
from megatron.training_log import IterationStats, MoEStats, comm_line, comm_scalars, iteration_line, model_state_line
from test_arguments import base
from test_parallel_training import losses
from test_tensor_parallel import SEED, _gpt_config, run_ranks

MOE4 = ["--num-experts", "4", "--disable-moe-token-dropping"]


def grad_norms(log: str) -> list[float]:
    return [float(norm) for norm in re.findall(r"\| grad norm: (\S+) ", log)]


def test_every_other_layer_gets_experts_as_in_megatron_deepspeed():
    assert _gpt_config(num_layers=4, num_experts=[8]).layer_experts == [1, 8, 1, 8]
    assert _gpt_config(num_layers=4, num_experts=[4, 8]).layer_experts == [1, 4, 1, 8]  # PR-MoE's pyramid
    assert _gpt_config(num_layers=3, num_experts=[4], expert_interval=1).layer_experts == [4, 4, 4]
    assert not _gpt_config().is_moe and _gpt_config().layer_experts == [1, 1]


def test_the_flags_fill_the_model_and_training_sections(data_prefix):
    args = parse_args(base(data_prefix, "--global-batch-size", "8", "--num-experts", "4", "--topk", "2",
                           "--moe-expert-parallel-size", "2", "--moe-train-capacity-factor", "1.5",
                           "--moe-min-capacity", "0", "--mlp-type", "residual", "--disable-moe-token-dropping",
                           "--moe-loss-coeff", "0.01", "--create-moe-param-group"), world_size=2)
    m = args.model
    assert (m.num_experts, m.topk, m.moe_expert_parallel_size, m.moe_train_capacity_factor, m.moe_min_capacity,
            m.mlp_type, m.moe_token_dropping) == ([4], 2, 2, 1.5, 0, "residual", False)
    assert args.training.moe_loss_coeff == 0.01 and args.training.create_moe_param_group
    # the checkpoint's shape leaves out the layout's expert-parallel size
    assert "moe_expert_parallel_size" not in m.to_dict() and m.to_dict()["num_experts"] == [4]


@pytest.mark.parametrize("extra, world, message", [
    ([*MOE4, "--zero-stage", "3"], 2, "--num-experts 4 cannot run at --zero-stage 3: DeepSpeed "),
    ([*MOE4, "--pipeline-model-parallel-size", "2"], 2,
     "--num-experts 4 cannot be combined with pipeline parallelism; use --pipeline-model-parallel-size 1"),
    ([*MOE4, "--tensor-model-parallel-size", "2"], 2,
     "--num-experts 4 cannot be combined with --tensor-model-parallel-size > 1"),
    ([*MOE4, "--ds-sequence-parallel-size", "2"], 2,
     "--num-experts 4 cannot be combined with --ds-sequence-parallel-size > 1"),
    ([*MOE4, "--checkpoint-activations"], 2, "--num-experts 4 cannot be combined with --checkpoint-activations"),
    ([*MOE4, "--moe-expert-parallel-size", "4"], 2,
     "--moe-expert-parallel-size 4 must divide the data-parallel size 2"),
    ([*MOE4, "--moe-expert-parallel-size", "3"], 3, "--moe-expert-parallel-size 3 must divide every layer's "
                                                    "--num-experts (4)"),
    ([*MOE4, "--topk", "5"], 2, "--topk 5 must be from 1 to the fewest experts of a layer (4)"),
    (["--num-experts", "4", "8", "2"], 2, "--num-experts gives 3 values: give one, or one per MoE layer"),
    ([*MOE4, "--mlp-type", "wide"], 2, "--mlp-type must be standard or residual, got 'wide'"),
])
def test_what_moe_cannot_run_is_refused_in_one_line(data_prefix, extra, world, message):
    with pytest.raises((ConfigError, ModelConfigError)) as error:
        parse_args(base(data_prefix, "--global-batch-size", "12" if world == 3 else "8", *extra), world_size=world)
    text = str(error.value)
    assert "\n" not in text and text.startswith(message), text


def _expert_grads(model) -> list[torch.Tensor]:
    """Every expert's flat gradient, in global expert order, from whichever rank holds it."""
    [layer] = moe_layers(model)
    local = [torch.cat([p.grad.flatten() for p in expert.parameters()])
             for expert in layer.moe.deepspeed_moe.experts.deepspeed_experts]
    ep = layer.moe.ep_size
    if ep == 1:
        return local
    gathered = [torch.zeros(len(local), local[0].numel()) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, torch.stack(local))
    return [row for rank in range(ep) for row in gathered[rank]]  # the first expert-parallel group's experts


def _train_one_step(rank, world, ep):
    """One forward and backward of a 4-expert model through a DeepSpeed engine (its gradient reduction), each rank
    on its own batch; returns (the step's loss averaged over ranks, every expert's gradient, the dense ones)."""
    import deepspeed

    state = ParallelState.build(ParallelLayout(world_size=world))
    config = _gpt_config(num_experts=[4], moe_expert_parallel_size=ep, moe_token_dropping=False, moe_min_capacity=0)
    torch.manual_seed(SEED)
    model = GPTModel(config, expert_rank=expert_parallel_rank(rank, ep))
    engine, *_ = deepspeed.initialize(model=model, mpu=state, dist_init_required=False, config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 0},
        "optimizer": {"type": "Adam", "params": {"lr": 0.0}}})
    text = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(7 + rank))
    tokens, labels, positions, mask = get_batch({"text": text}, torch.device("cpu"), -1, False)
    lm = masked_mean_loss(engine(tokens, positions, labels), mask)
    engine.backward(with_moe_loss(lm, engine.module, 0.1))
    loss = lm.detach().clone()
    dist.all_reduce(loss)
    dense = [p.grad.clone() for name, p in model.named_parameters() if "deepspeed_experts" not in name]
    return loss / world, _expert_grads(model), dense


def _check_expert_gradients_equal_across_ep_sizes(rank, world):
    import os

    import deepspeed

    os.environ["LOCAL_RANK"] = str(rank)  # what a launcher sets; DeepSpeed's engine asks for it
    deepspeed.init_distributed(dist_backend="gloo")
    loss1, experts1, dense1 = _train_one_step(rank, world, ep=1)
    loss2, experts2, dense2 = _train_one_step(rank, world, ep=2)
    torch.testing.assert_close(loss2, loss1, rtol=1e-6, atol=0)
    assert len(experts1) == len(experts2) == 4
    for index, (one, two) in enumerate(zip(experts1, experts2)):
        assert one.abs().sum() > 0, f"expert {index} got no tokens: the test would prove nothing"
        torch.testing.assert_close(two, one, rtol=1e-5, atol=1e-8, msg=f"expert {index}")
    for one, two in zip(dense1, dense2):
        torch.testing.assert_close(two, one, rtol=1e-5, atol=1e-8)


@pytest.mark.slow
def test_expert_gradients_do_not_change_with_the_expert_parallel_size():
    run_ranks(_check_expert_gradients_equal_across_ep_sizes)


@pytest.fixture(scope="module")
def moe_runs(dolly_data_dir):
    """4 experts without token dropping on 2 CPU ranks: EP=1 and EP=2 at ZeRO 0, EP=2 at ZeRO 1 and 2."""
    run = partial(parallel_pretrain, dolly_data_dir, 2, *MOE4)
    return {"ep1": run("--moe-expert-parallel-size", "1", "--zero-stage", "0").stdout,
            **{f"ep2_z{stage}": run("--moe-expert-parallel-size", "2", "--zero-stage", str(stage)).stdout
               for stage in (0, 1, 2)}}


@pytest.mark.slow
def test_ep2_gives_ep1s_losses_without_token_dropping(moe_runs):
    reference = losses(moe_runs["ep1"])
    assert len(reference) >= 3 and reference[-2] < reference[0]
    assert losses(moe_runs["ep2_z0"]) == pytest.approx(reference, rel=1e-5)
    assert grad_norms(moe_runs["ep2_z0"]) == pytest.approx(grad_norms(moe_runs["ep1"]), rel=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_1_and_2_with_moe_give_zero_0s_losses(moe_runs, stage):
    assert losses(moe_runs[f"ep2_z{stage}"]) == pytest.approx(losses(moe_runs["ep2_z0"]), rel=1e-5)
    assert grad_norms(moe_runs[f"ep2_z{stage}"]) == pytest.approx(grad_norms(moe_runs["ep2_z0"]), rel=1e-3)


def test_routing_summary_takes_the_worst_layer_and_all_drops():
    # layer 1: 4 experts got 6, 2, 2, 2 routes (12, 3 dropped), l_aux 2.4 over 2 forwards; layer 2: even, none dropped
    layers = [torch.tensor([6.0, 2, 2, 2, 12, 3, 2.4, 2]), torch.tensor([3.0, 3, 3, 3, 12, 0, 2.0, 2])]
    loss, imbalance, dropped = routing_summary(layers, coeff=0.1)
    assert loss == pytest.approx(0.1 * (1.2 + 1.0)) and imbalance == pytest.approx(2.0)
    assert dropped == pytest.approx(3 / 24)


def test_the_iteration_line_shows_the_moe_fields_after_the_lm_loss():
    stats = IterationStats(iteration=1, train_iters=2, consumed_samples=8, consumed_tokens=512, elapsed_ms=1.0,
                           learning_rate=1e-3, global_batch_size=8, lm_loss=10.0, loss_scale=1.0, grad_norm=1.0,
                           skipped_iterations=0, nan_iterations=0, samples_per_second=1.0,
                           tokens_per_gpu_per_second=1.0, tflops=0.0, moe=MoEStats(0.1, 1.25, 0.0125))
    assert (" lm loss: 1.000000E+01 | moe loss: 1.000000E-01 | expert load max/mean: 1.250 | tokens dropped: "
            "0.0125 | loss scale: 1.0 |") in iteration_line(stats)
    assert "moe" not in iteration_line(replace(stats, moe=None))


@pytest.mark.slow
def test_the_log_shows_the_moe_loss_load_and_drops(moe_runs):
    fields = re.findall(r"\| moe loss: (\S+) \| expert load max/mean: (\S+) \| tokens dropped: (\S+) \|",
                        moe_runs["ep2_z1"])
    assert len(fields) == len(losses(moe_runs["ep2_z1"])) - 1  # every iteration line; not the validation one
    for loss, load, dropped in fields:
        # l_aux is about 1 per layer for a balanced gate, weighted 0.1 by default; nothing dropped without dropping
        assert 0.05 < float(loss) < 0.3 and float(load) >= 1.0 and float(dropped) == 0.0


def test_the_predictions_without_experts_are_not_printed_for_moe():
    """megatron/model/accounting/ counts no experts yet: the lines say so rather than print a dense model's figure."""
    measured = dict(params=2**30, grads=2**30, optim=2**31, offloaded=0, other=0)
    assert model_state_line(measured, None, 1, 2, "fp32", "none").endswith(
        "ZeRO estimate (stage=1, dp=2, dtype=fp32, offload=none): not predicted for MoE |")
    line = comm_line(0, 3, {"all_reduce": 2**20}, 2**18, None)
    assert line.endswith("| bytes/param=4.000 | predicted=not predicted for MoE |")
    assert "traffic/predicted-MB" not in comm_scalars({"all_reduce": 2**20}, 2**18, None)


@pytest.mark.slow
def test_an_moe_runs_prediction_lines_say_not_predicted_and_parse(moe_runs, tmp_path):
    from analysis.log_parser import parse_log

    log = moe_runs["ep2_z1"]
    assert "predicted=not predicted for MoE |" in log and "offload=none): not predicted for MoE |" in log
    (tmp_path / "run.log").write_text(log)
    parsed = parse_log(tmp_path / "run.log")
    assert [record.lm_loss for record in parsed.iterations] == pytest.approx(losses(log)[:-1], rel=1e-6)
    assert parsed.model_state.estimate == {}


def test_the_driver_variables_give_the_moe_flags():
    settings = training_settings({"NUM_EXPERTS": "4 8", "EP_SIZE": "2", "TOPK": "2", "MOE_LOSS_COEFF": "0.01"},
                                 accelerator="cpu", world=2, model_size="tiny")
    flags = " ".join(settings.flags)
    assert "--num-experts 4 8 --moe-expert-parallel-size 2 --topk 2 --moe-loss-coeff 0.01" in flags
    assert settings.sources["--num-experts"] == "NUM_EXPERTS" and settings.sources["--topk"] == "TOPK"
    assert "--num-experts" not in training_settings({}, accelerator="cpu", world=2, model_size="tiny").flags
    with pytest.raises(LaunchError, match=r"^NUM_EXPERTS=4,8: expected a positive integer, or one per MoE layer"):
        training_settings({"NUM_EXPERTS": "4,8"}, accelerator="cpu", world=2, model_size="tiny")


@pytest.mark.slow
def test_the_z1_driver_trains_with_num_experts_4_and_ep_size_2(dolly_data_dir, tmp_path):
    env = driver_env(dolly_data_dir, tmp_path, NUM_EXPERTS=4, EP_SIZE=2, TRAIN_EPOCHS="", TRAIN_ITERS=3,
                     EVAL_ITERS=0, ZERO_LAB_SKIP_PROBES=1)
    run = subprocess.run(["bash", str(REPO_ROOT / "examples_zero" / "gpt_deepspeed_Z1.sh")], cwd=REPO_ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "--num-experts 4 --moe-expert-parallel-size 2" in (tmp_path / "gpt_tiny_Z1" / "command.txt").read_text()
    log = (tmp_path / "gpt_tiny_Z1" / "train.log").read_text()
    assert "| zero stage: 1 |" in log and "| world size: 2 |" in log
    assert len(re.findall(r"\| lm loss: \S+ \| moe loss: \S+ \| expert load max/mean: \S+ \| tokens dropped: \S+ \|",
                          log)) == 3


def test_the_hugging_face_export_refuses_an_moe_checkpoint_in_one_line(capsys, tmp_path):
    from megatron.saved_model.reader import save_checkpoint_weights

    config = _gpt_config(num_experts=[4])
    torch.manual_seed(SEED)
    save_checkpoint_weights(str(tmp_path / "ckpt"), config, GPTModel(config).state_dict(), {}, "test")
    code, _, err = tool_in_process(capsys, "checkpoint_to_hf.py", "--load", tmp_path / "ckpt",
                                   "--output", tmp_path / "hf")
    assert code == 1 and err.count("\n") == 1 and not (tmp_path / "hf").exists()
    assert err.startswith("error: ") and ": a mixture-of-experts checkpoint (--num-experts 4): reading its expert " \
        "weights (Hugging Face export, generation, evaluation) is not supported yet (docs/moe.md)" in err


def test_each_expert_starts_from_its_global_index_whatever_the_ep_size():
    """DeepSpeed deep-copies one expert into every slot; here expert g's weights come from g's own seed."""
    def experts(ep, rank):
        torch.manual_seed(SEED)
        model = GPTModel(_gpt_config(num_experts=[4], moe_expert_parallel_size=ep), expert_rank=rank)
        [layer] = moe_layers(model)
        return [torch.cat([p.detach().flatten() for p in expert.parameters()])
                for expert in layer.moe.deepspeed_moe.experts.deepspeed_experts]

    whole = experts(1, 0)
    assert not torch.equal(whole[0], whole[1])
    for rank in (0, 1):
        for local, weights in enumerate(experts(2, rank)):
            assert torch.equal(weights, whole[2 * rank + local])
