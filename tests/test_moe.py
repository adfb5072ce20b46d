"""Mixture of experts (--num-experts, DeepSpeed's MoE layer; docs/moe.md): which layers get experts, the flags and
their refusals (one line each), expert gradients through DeepSpeed's reduction on 2 real gloo ranks at EP=1 and
EP=2, and real pretrain_gpt.py runs: EP=2 gives EP=1's losses without token dropping, ZeRO 1 and 2 give ZeRO 0's;
checkpoints: a resume at the same layout repeats the losses, another EP is refused in one line, generation and
evaluation read the experts' files."""
import math
import re
import shutil
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
from megatron.accounting import (AccountingError, TrainingSetup, active_parameters, count_parameters,
                                       memory_per_rank, model_flops_per_iteration, moe_all_to_all_per_step,
                                       moe_capacity, parameters_on_rank)
from megatron.model.config import ModelConfigError
from megatron.model.moe import expert_parallel_rank, moe_layers, routing_summary
from megatron.model.transformer import ParallelMLP
from megatron.training import get_batch, masked_mean_loss, with_moe_loss
from megatron.training_log import IterationStats, MoEStats, iteration_line
from runs import run_pretrain
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
    ([*MOE4, "--moe-expert-parallel-size", "4"], 2,
     "--moe-expert-parallel-size 4 must divide the data-parallel size 2"),
    ([*MOE4, "--moe-expert-parallel-size", "3"], 3, "--moe-expert-parallel-size 3 must divide 4, an MoE layer's "
                                                    "experts by --num-experts: each layer's experts are split evenly"),
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
        "optimizer": {"type": "Adam", "params": {"lr": 0.0, "torch_adam": True}}})
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
def moe_runs(dolly_data_dir, tmp_path_factory):
    """4 experts without token dropping on 2 CPU ranks: EP=1 and EP=2 at ZeRO 0, EP=2 at ZeRO 1 and 2; and top-2
    with token dropping at EP=2, ZeRO 2. EP=2 at ZeRO 1 saves at iteration 3 and at its end (5) into
    moe_runs["ep2_z1_checkpoint"], which the checkpoint tests read."""
    run = partial(parallel_pretrain, dolly_data_dir, 2, *MOE4)
    saved = tmp_path_factory.mktemp("moe_checkpoint")
    save = {1: ("--save", str(saved), "--save-interval", "3")}
    return {"ep1": run("--moe-expert-parallel-size", "1", "--zero-stage", "0").stdout,
            **{f"ep2_z{stage}": run("--moe-expert-parallel-size", "2", "--zero-stage", str(stage),
                                    *save.get(stage, ())).stdout
               for stage in (0, 1, 2)},
            "ep2_z1_checkpoint": saved,
            # capacity-bound all-to-alls: tokens dropped at the default capacity factor, top-2
            "ep2_z2_top2_dropping": parallel_pretrain(dolly_data_dir, 2, "--num-experts", "4", "--topk", "2",
                                                     "--moe-expert-parallel-size", "2", "--zero-stage", "2").stdout}


@pytest.mark.slow
def test_deepspeeds_lines_of_nothing_are_not_on_the_console(moe_runs):
    """Issue 56, item 10: every rank printed DeepSpeed's `No existing process group found, creating a new group
    named: ep_size_2` (the engine always creates the groups) and `deepspeed_shm_comm_op built successfully` (the
    op was loaded built); megatron/deepspeed_quiet.py drops them."""
    for name in ("ep1", "ep2_z1"):
        assert "No existing process group found" not in moe_runs[name]
        assert "built successfully" not in moe_runs[name]
        assert " > run info" in moe_runs[name]  # the rest of the output is there


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


def test_the_parameter_count_holds_every_expert_and_a_token_goes_through_topk_of_them():
    for shape in ({"num_experts": [4]}, {"num_experts": [4], "mlp_type": "residual"}, {"num_experts": [4, 2],
                                                                                         "num_layers": 4}):
        config = _gpt_config(**shape)
        torch.manual_seed(SEED)
        assert count_parameters(config) == sum(p.numel() for p in GPTModel(config).parameters()), shape
    dense, h = _gpt_config(), _gpt_config().hidden_size
    expert = sum(p.numel() for p in ParallelMLP(dense, None).parameters())
    # the dense model's, the gate (h -> 4) of the one MoE layer, and topk - 1 experts more than the dense MLP
    assert active_parameters(_gpt_config(num_experts=[4])) == count_parameters(dense) + 4 * h
    assert active_parameters(_gpt_config(num_experts=[4], topk=2)) == count_parameters(dense) + 4 * h + expert
    assert active_parameters(dense) == count_parameters(dense)


def test_moe_flops_per_token_are_the_active_experts_and_the_gate():
    dense, moe = _gpt_config(), _gpt_config(num_experts=[4], topk=2)
    h, f, tokens = dense.hidden_size, dense.ffn_hidden_size, 8 * dense.seq_length
    # one MoE layer: a second expert's MLP (h -> f -> h) and the gate (h -> 4), forward and backward (x 3)
    extra = 3 * 2 * tokens * h * (2 * f + 4)
    assert model_flops_per_iteration(moe, 8) == model_flops_per_iteration(dense, 8) + extra


@pytest.mark.parametrize("topk, experts, factor, minimum, tokens", [
    (1, 4, 1.0, 4, 128), (2, 8, 1.25, 4, 100), (1, 8, 1.0, 4, 6), (3, 4, 1.5, 0, 30)])
def test_the_predicted_capacity_is_the_one_deepspeeds_gate_chooses(topk, experts, factor, minimum, tokens):
    from deepspeed.moe.sharded_moe import TopKGate

    config = _gpt_config(num_experts=[experts], topk=topk, moe_train_capacity_factor=factor, moe_min_capacity=minimum)
    gate = TopKGate(config.hidden_size, experts, topk, factor, factor, minimum).train()
    capacity = gate(torch.randn(tokens, config.hidden_size), None, True)[1]
    assert moe_capacity(config, experts, tokens) == int(capacity)


def test_the_experts_are_held_over_ep_and_partitioned_over_the_expert_data_parallel_ranks():
    config = _gpt_config(num_experts=[4], moe_expert_parallel_size=2)
    dense = parameters_on_rank(config)
    experts = 2 * sum(p.numel() for p in ParallelMLP(config, None).parameters())  # 4 experts over EP=2
    setup = TrainingSetup(world_size=4, micro_batch_size=1, zero_stage=1, expert_parallel_size=2)
    memory = memory_per_rank(config, setup)
    assert memory["params"] == 4 * (dense + experts)
    # fp32 at ZeRO-1: Adam's m and v and the fp32 master partition; the rest over DP=4, experts over DP/EP=2
    assert memory["optim"] == 12 * (math.ceil(dense / 4) + math.ceil(experts / 2))
    with pytest.raises(AccountingError, match="^--moe-expert-parallel-size 3 must divide the data-parallel size 4$"):
        TrainingSetup(world_size=4, micro_batch_size=1, expert_parallel_size=3)


def test_the_all_to_alls_are_four_per_moe_layer_and_micro_batch_sized_by_capacity():
    config = _gpt_config(num_experts=[4], moe_expert_parallel_size=2, moe_min_capacity=0)
    setup = TrainingSetup(world_size=2, micro_batch_size=2, gradient_accumulation_steps=3, expert_parallel_size=2)
    capacity = moe_capacity(config, 4, 2 * config.seq_length)
    sent = moe_all_to_all_per_step(config, setup)
    assert sent == {"all_to_all": 3 * 4 * (4 * capacity * config.hidden_size * 4) / 2, "all_reduce": 0.0}
    # without token dropping: the capacities the gates chose, and one int64 all-reduce (MAX) per forward
    routed = moe_all_to_all_per_step(replace(config, moe_token_dropping=False), setup, [30.0])
    assert routed == {"all_to_all": 4 * (4 * 30 * config.hidden_size * 4) / 2, "all_reduce": 3 * 2 * 8 / 2}
    assert moe_all_to_all_per_step(replace(config, moe_expert_parallel_size=1),
                                   replace(setup, expert_parallel_size=1))["all_to_all"] == 0


PREDICTION_LINES = re.compile(
    r" > parameters \| total: (\d+) \| active per token: (\d+) \| on this rank: predicted (\d+), measured (\d+) \|")


@pytest.mark.slow
@pytest.mark.parametrize("run", ["ep1", "ep2_z0", "ep2_z1", "ep2_z2", "ep2_z2_top2_dropping"])
def test_an_moe_runs_parameters_memory_and_traffic_are_predicted(moe_runs, run, tmp_path):
    """Parameters on the rank and all-to-all traffic exactly (without token dropping the all-to-alls are sized by
    the capacities the gates chose; with it by the predicted capacity), the model states within 5%."""
    from analysis.log_parser import parse_log

    log = moe_runs[run]
    total, active, predicted, measured = map(int, PREDICTION_LINES.search(log).groups())
    assert predicted == measured and total > active
    numbers = re.search(r"measured: params=(\S+) grads=(\S+) optim=(\S+) .* ZeRO estimate \([^)]*\): "
                        r"params=(\S+) grads=(\S+) optim=(\S+) ", log).groups()
    assert [float(x) for x in numbers[3:]] == pytest.approx([float(x) for x in numbers[:3]], rel=0.05)
    sent = re.findall(r"\| (?:all_to_all=(\S+)MB \| )?total=(\S+)MB \| bytes/param=\S+ \| predicted=(\S+)MB \|", log)
    assert len(sent) == len(losses(log)) - 1
    for all_to_all, total_mb, predicted_mb in sent:
        assert total_mb == predicted_mb and (float(all_to_all or 0) > 0) == (run != "ep1")
    (tmp_path / "run.log").write_text(log)
    assert parse_log(tmp_path / "run.log").model_state.estimate["params"] == pytest.approx(float(numbers[3]))


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
    # the start-up probes on (the suite skips them): this test reads the time lines
    env = driver_env(dolly_data_dir, tmp_path, NUM_EXPERTS=4, EP_SIZE=2, TRAIN_EPOCHS="", TRAIN_ITERS=3,
                     ZERO_LAB_SKIP_PROBES=0,
                     EVAL_ITERS=0)
    run = subprocess.run(["bash", str(REPO_ROOT / "examples_zero" / "gpt_deepspeed_Z1.sh")], cwd=REPO_ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "--num-experts 4 --moe-expert-parallel-size 2" in (tmp_path / "gpt_tiny_Z1_moe4_ep2" / "command.txt").read_text()
    log = (tmp_path / "gpt_tiny_Z1_moe4_ep2" / "train.log").read_text()
    assert "| zero stage: 1 |" in log and "| world size: 2 |" in log and "| experts: 4 | EP: 2 | top-k: 1 |" in log
    assert len(re.findall(r"\| lm loss: \S+ \| moe loss: \S+ \| expert load max/mean: \S+ \| tokens dropped: \S+ \|",
                          log)) == 3
    # the step-time model prices the all-to-alls: the probes run and every interval has its time line
    assert " > step time predicted |" in log and "not predicted" not in log
    times = re.findall(r"\[Rank 0\] time at iteration +\d+ \| measured: .* \| predicted: .* total=\S+ms \|", log)
    assert len(times) == 3


def test_the_hugging_face_export_refuses_an_moe_checkpoint_in_one_line(capsys, tmp_path):
    from megatron.saved_model.reader import save_checkpoint_weights

    config = _gpt_config(num_experts=[4])
    torch.manual_seed(SEED)
    save_checkpoint_weights(str(tmp_path / "ckpt"), config, GPTModel(config).state_dict(), {}, "test")
    code, _, err = tool_in_process(capsys, "checkpoint_to_hf.py", "--load", tmp_path / "ckpt",
                                   "--output", tmp_path / "hf")
    assert code == 1 and err.count("\n") == 1 and not (tmp_path / "hf").exists()
    assert err.startswith("error: ") and ": a mixture-of-experts checkpoint (--num-experts 4): Hugging Face's GPT-2 " \
        "and Llama have no experts to hold its expert weights: no Hugging Face export (docs/moe.md)" in err


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


# --- checkpoints (docs/moe.md, "Checkpoints") ---

def _from_iteration_3(moe_runs, target):
    """A copy of the EP=2, ZeRO-1 run's checkpoint of iteration 3, `latest` naming it."""
    target.mkdir()
    shutil.copytree(moe_runs["ep2_z1_checkpoint"] / "global_step3", target / "global_step3")
    (target / "latest").write_text("global_step3")
    return target


@pytest.mark.slow
def test_an_moe_run_resumed_at_its_layout_gives_the_uninterrupted_runs_losses(moe_runs, dolly_data_dir, tmp_path):
    saved = moe_runs["ep2_z1_checkpoint"]
    assert sorted(path.name for path in (saved / "global_step3").glob("layer_*_expert_*")) == [
        f"layer_0_expert_{expert}_mp_rank_00_model_states.pt" for expert in range(4)]  # one file per expert
    resumed = parallel_pretrain(dolly_data_dir, 2, *MOE4, "--moe-expert-parallel-size", "2", "--zero-stage", "1",
                                "--load", str(_from_iteration_3(moe_runs, tmp_path / "ckpt"))).stdout
    assert "loaded checkpoint" in resumed and re.findall(r" iteration\s+(\d+)/", resumed) == ["4", "5"]
    # iterations 4 and 5 and the validation loss: as printed by the run that never stopped
    assert losses(resumed) == losses(moe_runs["ep2_z1"])[3:]
    assert grad_norms(resumed) == grad_norms(moe_runs["ep2_z1"])[3:]


@pytest.mark.slow
def test_a_resume_at_another_expert_parallel_size_is_refused_in_one_line(moe_runs, dolly_data_dir, tmp_path):
    """EP=2 -> EP=1 on the same 2 ranks: DeepSpeed 0.19.8 would stop in its ZeRO loader with a traceback."""
    load = _from_iteration_3(moe_runs, tmp_path / "ckpt")
    run = run_pretrain(dolly_data_dir, *MOE4, "--moe-expert-parallel-size", "1", "--zero-stage", "1", "--load",
                       str(load), ranks=2, expect=1)
    assert "[rank0]: Traceback" not in run.stderr, run.stderr[-3000:]  # torchrun's own report of the exit stays
    assert [line for line in run.stderr.splitlines() if line.startswith("error: ")] == [
        f"error: --load {load}: cannot resume global_step3: it was saved with data-parallel size 2 at ZeRO stage 1 "
        "and --moe-expert-parallel-size 2, this run has data-parallel size 2 at ZeRO stage 1 and "
        "--moe-expert-parallel-size 1; DeepSpeed 0.19.8 resumes a mixture-of-experts checkpoint only in the layout "
        "it was saved with (no universal checkpoint of its experts): resume with --zero-stage 1 and "
        "--moe-expert-parallel-size 2 on data-parallel size 2"]
    assert " > run info" not in run.stdout  # refused before anything was built


def _save_and_compute_at_ep2(rank, world, folder):
    """A 4-expert model trained one step at EP=2, ZeRO 1 (Adam, so the weights moved), saved by DeepSpeed's engine
    (each expert in a file of its own); rank 0 keeps what the trained EP=2 model computes in eval mode: the logits
    of a batch and greedy tokens with a KV cache. Top-1 and an eval capacity that drops nothing: DeepSpeed draws
    top-2's second expert and, over capacity, the tokens it keeps at random, in eval mode too."""
    import os

    import deepspeed

    from megatron.inference.generation import SamplingConfig, generate

    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed.init_distributed(dist_backend="gloo")
    state = ParallelState.build(ParallelLayout(world_size=world))
    config = _gpt_config(num_experts=[4], moe_expert_parallel_size=2, moe_eval_capacity_factor=4.0)
    torch.manual_seed(SEED)
    model = GPTModel(config, expert_rank=expert_parallel_rank(rank, 2))
    engine, *_ = deepspeed.initialize(model=model, mpu=state, dist_init_required=False, config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 1},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}})
    text = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(7 + rank))
    tokens, labels, positions, mask = get_batch({"text": text}, torch.device("cpu"), -1, False)
    engine.backward(with_moe_loss(masked_mean_loss(engine(tokens, positions, labels), mask), engine.module, 0.1))
    engine.step()
    engine.save_checkpoint(folder, tag="global_step1", client_state={"model_config": config.to_dict(),
                                                                     "iteration": 1})
    model.eval()
    batch = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(11))  # the same on both ranks
    with torch.no_grad():
        logits = model(batch, torch.arange(8).expand(2, 8))
    greedy = generate(model, [5, 9, 2], 6, SamplingConfig(greedy=True), eod=63, vocab_size=64)
    if rank == 0:
        torch.save({"batch": batch, "logits": logits, "greedy": greedy.tokens}, f"{folder}/expected.pt")


@pytest.mark.slow
def test_a_saved_moe_checkpoint_generates_what_the_trained_model_computes(tmp_path):
    """megatron/saved_model merges the experts' files of an EP=2 run into one EP=1 model on one process, no process
    group: its logits and greedy tokens are the trained model's."""
    from megatron.inference.generation import SamplingConfig, generate
    from megatron.saved_model.reader import build_model, load_checkpoint_weights

    run_ranks(partial(_save_and_compute_at_ep2, folder=str(tmp_path)))
    expected = torch.load(tmp_path / "expected.pt")
    loaded = load_checkpoint_weights(str(tmp_path))
    assert loaded.iteration == 1 and loaded.config.num_experts == [4] and loaded.config.moe_expert_parallel_size == 1
    assert loaded.config.moe_eval_capacity_factor == 4.0  # the run's, which the loaded gates use in eval mode
    assert loaded.weights_from == "the module's float32 weights and the 4 experts' files"
    model = build_model(loaded.config, loaded.state_dict)
    with torch.no_grad():
        logits = model(expected["batch"], torch.arange(8).expand(2, 8))
    torch.testing.assert_close(logits, expected["logits"], rtol=1e-5, atol=1e-6)
    greedy = generate(model, [5, 9, 2], 6, SamplingConfig(greedy=True), eod=63, vocab_size=64)
    assert greedy.tokens == expected["greedy"] and len(greedy.tokens) >= 1


@pytest.mark.slow
def test_eval_and_generation_read_the_moe_runs_checkpoint(moe_runs, capsys):
    """tools/eval_dolly.py on the EP=2, ZeRO-1 run's last checkpoint: the run's own validation loss on the same 8
    samples (parallel_pretrain's --seed 7); tools/generate_text.py generates from it."""
    checkpoint = moe_runs["ep2_z1_checkpoint"]
    code, out, err = tool_in_process(capsys, "eval_dolly.py", "--load", checkpoint, "--num-records", "1",
                                     "--max-new-tokens", "4", "--eval-samples", "8", "--seed", "7")
    assert code == 0, err
    validation = r" validation loss at iteration (\d+) \| lm loss value: (\S+) \|"
    iteration, loss = re.search(validation, out).groups()
    logged = re.search(validation, moe_runs["ep2_z1"]).groups()
    assert iteration == logged[0] == "5" and math.isfinite(float(loss))
    assert float(loss) == pytest.approx(float(logged[1]), rel=1e-5)
    code, out, err = tool_in_process(capsys, "generate_text.py", "--load", checkpoint, "--prompt", "Hello",
                                     "--greedy", "--max-new-tokens", "3")
    assert code == 0 and out.startswith("Hello") and " sample 1 | generated tokens: 3 |" in err, err


def test_finetuning_from_an_moe_checkpoint_is_refused_in_one_line(tmp_path):
    from megatron.checkpointing.finetune import load_finetune_weights
    from megatron.saved_model.reader import SavedModelError, save_checkpoint_weights

    config = _gpt_config(num_experts=[4])
    torch.manual_seed(SEED)
    save_checkpoint_weights(str(tmp_path / "ckpt"), config, GPTModel(config).state_dict(), {}, "test")
    with pytest.raises(SavedModelError) as error:
        load_finetune_weights(None, str(tmp_path / "ckpt"))  # refused before the engine is touched
    assert str(error.value) == (
        f"--load {tmp_path / 'ckpt'} --finetune: a mixture-of-experts checkpoint (--num-experts 4): fine-tuning from "
        "it is not supported; resume it with --load at its layout (docs/moe.md)")


def test_an_moe_checkpoint_resumes_only_in_the_layout_it_was_saved_with():
    from megatron.checkpointing.resume_check import moe_layout_refusal

    saved = {"zero_stage": 1, "data_parallel_size": 2, "sequence_parallel_size": 1, "expert_parallel_size": 2}
    assert moe_layout_refusal(saved, dict(saved)) is None
    old = {key: value for key, value in saved.items() if key != "expert_parallel_size"}
    assert moe_layout_refusal(old, {**saved, "expert_parallel_size": 1}) is None  # DeepSpeed's own errors apply
    for change in ({"zero_stage": 2}, {"data_parallel_size": 4}, {"expert_parallel_size": 1}):
        refusal = moe_layout_refusal(saved, {**saved, **change})
        assert refusal.startswith("it was saved with data-parallel size 2 at ZeRO stage 1 and "
                                  "--moe-expert-parallel-size 2, this run has ") and "\n" not in refusal
        assert refusal.endswith("resume with --zero-stage 1 and --moe-expert-parallel-size 2 on data-parallel size 2")


@pytest.mark.parametrize("saved_kind, resumed, error", [
    ([], ["--num-experts", "4"], "this is a dense checkpoint (no experts) and this run has experts (--num-experts 4): "
                                 "resume it without --num-experts, or give the run its own folder"),
    (["--num-experts", "4"], [], "this is a mixture-of-experts checkpoint (--num-experts 4 when saved) and this run "
                                 "is dense: resume it with --num-experts 4, or give the run its own folder"),
])
@pytest.mark.parametrize("marker_has_experts", [True, False])
def test_a_resume_of_a_checkpoint_of_the_other_kind_names_its_kind(tmp_path, saved_kind, resumed, error,
                                                                   marker_has_experts):
    """Issue 56, item 1: a dense checkpoint resumed with experts was refused with advice to resume at EP 1, which
    ended in KeyError: 'num_experts'; the line names the checkpoint's kind. Checkpoints whose marker predates the
    experts' record are told apart by DeepSpeed's expert files (layer_<i>_expert_<j>_...)."""
    from megatron.arguments import parse_args
    from megatron.checkpointing import protocol
    from megatron.checkpointing.resume_check import check_layout, current_layout

    def flags(*extra):
        return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                "--micro-batch-size", "2", "--train-iters", "10", "--data-path", "x", "--tokenizer-type",
                "NullTokenizer", "--vocab-size", "1000", "--load", str(tmp_path), *extra]

    layout = current_layout(parse_args(flags(*saved_kind), world_size=2))
    if not marker_has_experts:
        del layout["num_experts"]
    protocol.prepare_save(str(tmp_path), "global_step2")
    staging = tmp_path / protocol.staging_tag("global_step2")
    staging.mkdir()
    (staging / "mp_rank_00_model_states.pt").write_bytes(b"")
    if saved_kind:
        for expert in range(4):  # EP 2: rank 0 wrote experts 0 and 1, rank 1 experts 2 and 3
            (staging / f"layer_1_expert_{expert}_mp_rank_00_model_states.pt").write_bytes(b"")
    protocol.commit(str(tmp_path), "global_step2", {"iteration": 2, "layout": layout}, exchange=False)
    with pytest.raises(protocol.CheckpointError) as refused:
        check_layout(parse_args(flags(*resumed, "--moe-expert-parallel-size", "2" if resumed else "1"),
                                world_size=2), "global_step2")
    assert str(refused.value).startswith(f"--load {tmp_path}: cannot resume global_step2: {error}"), refused.value
    assert "\n" not in str(refused.value)
