"""What a GPU run computes differently from the CPU ranks, checked where the CPU can reach the mechanism: ZeRO-3's
initial weights under deepspeed.zero.Init, fp32 gradient accumulation in bf16, and the bf16 model-state memory
(stage 0's fp32 master copies) measured on a real one-rank DeepSpeed engine against megatron/accounting/predict/."""
import dataclasses
import json

import pytest
import torch
import torch.distributed as dist

from conftest import free_port
from megatron.accounting.measure import memory
from megatron.arguments import parse_args
from megatron.core.parallel_state import ParallelLayout, ParallelState
from megatron.deepspeed_config import deepspeed_config, tuned_keys_added
from megatron.initialize import DistInfo
from megatron.model import GPTModel

from megatron import accounting
SEQ, VOCAB = 32, 512


@pytest.fixture(scope="module")
def dist_info():
    """One gloo rank in this process (zero.Init and the engine need a group, and read the launcher's variables)."""
    assert not dist.is_initialized()
    patch = pytest.MonkeyPatch()
    for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1").items():
        patch.setenv(name, value)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"),
                   parallel=ParallelState.build(ParallelLayout(world_size=1)))
    dist.destroy_process_group()
    patch.undo()


def flags(*extra):
    return parse_args(["--model-size", "tiny", "--data-path", "unused", "--train-iters", "6", "--micro-batch-size",
                       "2", "--global-batch-size", "4", "--seq-length", str(SEQ), "--eval-iters", "0", "--lr", "1e-3",
                       *extra])


def model_config(args, dtype=None):
    return dataclasses.replace(args.model, padded_vocab_size=VOCAB, max_position_embeddings=SEQ,
                               params_dtype=dtype or args.model.params_dtype)


@pytest.mark.slow
def test_zero3_init_draws_the_fp32_weights_the_other_stages_draw(dist_info, monkeypatch):
    """A bf16 model built under a zero.Init that turns new tensors into bf16 (on a GPU it also puts them on the
    GPU, whose generator draws other values): every initial value is drawn in fp32 on the CPU generator, and the
    gathered weights are the plain fp32 model's, cast. On the CPU the values alone cannot show the bug: a bf16
    draw there equals the fp32 draw cast (zero.Init refuses fp64, and there is no other device to override to),
    so the dtype and device each draw gets are what is checked."""
    import deepspeed

    config = model_config(flags("--bf16"))
    drawn = []
    normal = torch.nn.init.normal_
    monkeypatch.setattr(torch.nn.init, "normal_", lambda t, **kw: drawn.append((t.dtype, t.device.type)) or normal(
        t, **kw))
    torch.manual_seed(5)
    with deepspeed.zero.Init(config_dict_or_path={"train_batch_size": 1, "zero_optimization": {"stage": 3}},
                             dtype=torch.bfloat16):
        zero3 = GPTModel(config)
    assert drawn and set(drawn) == {(torch.float32, "cpu")}
    monkeypatch.setattr(torch.nn.init, "normal_", normal)
    torch.manual_seed(5)
    plain = GPTModel(dataclasses.replace(config, params_dtype=torch.float32))
    with deepspeed.zero.GatheredParameters(list(zero3.parameters())):
        for (name, gathered), (_, reference) in zip(zero3.named_parameters(), plain.named_parameters()):
            assert gathered.dtype == torch.bfloat16, name
            assert torch.equal(gathered, reference.to(torch.bfloat16)), name


@pytest.mark.parametrize("stage, accumulation", [(0, None), (1, "fp32"), (2, "fp32"), (3, "fp32")])
def test_bf16_gradients_accumulate_in_fp32_where_deepspeed_allows(stage, accumulation):
    """The generated config asks for fp32 accumulation in bf16 at stages 1-3 (DeepSpeed 0.19.8 refuses it at
    stage 0); fp32 runs need nothing."""
    config = deepspeed_config(flags("--bf16", "--zero-stage", str(stage)), 1000, 64, on_cuda=False)
    assert config.get("data_types", {}).get("grad_accum_dtype") == accumulation
    assert "data_types" not in deepspeed_config(flags("--zero-stage", str(stage)), 1000, 64, on_cuda=False)


def test_a_users_json_keeps_its_accumulation_dtype(tmp_path):
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True},
                                "data_types": {"grad_accum_dtype": "bf16"}}))
    config = deepspeed_config(flags("--deepspeed_config", str(user)), 1000, 64, on_cuda=False)
    assert config["data_types"] == {"grad_accum_dtype": "bf16"}
    # a JSON that leaves it out gets the generated config's fp32 accumulation, which the accounting assumes,
    # named in the start-up line of the keys added (megatron/deepspeed_config.py's tuned_keys_added)
    user.write_text(json.dumps({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}))
    args = flags("--deepspeed_config", str(user))
    config = deepspeed_config(args, 1000, 64, on_cuda=False)
    assert config["data_types"] == {"grad_accum_dtype": "fp32"}
    assert "data_types" in tuned_keys_added(args.deepspeed.user_config, config)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_engine_trains_and_holds_the_predicted_model_states(dist_info, stage):
    """A real one-rank engine from setup_engine in bf16, 2 micro-batches per step: DeepSpeed accumulates in the
    dtype the config asks for, the loss falls, and the parameters, gradients (after a backward) and optimizer
    states (fp32 master copies included: stage 0's too) measured on the rank are accounting's prediction."""
    from megatron.accounting.run_setup import training_setup
    from megatron.engine import setup_engine

    args = flags("--bf16", "--zero-stage", str(stage))
    config = model_config(args)
    num_params = accounting.count_parameters(config)
    torch.manual_seed(3)
    engine, ds_config = setup_engine(lambda: GPTModel(config), num_params, args, dist_info, train_iters=6)
    assert engine.get_data_types() == (torch.bfloat16, torch.bfloat16 if stage == 0 else torch.float32)
    ids = torch.randint(0, VOCAB, (2, SEQ))
    positions = torch.arange(SEQ).expand(2, SEQ)
    losses, grads = [], 0
    for _ in range(6):
        for _ in range(2):
            loss = engine(ids, positions, ids).float().mean()
            engine.backward(loss)
            grads = max(grads, memory.grad_bytes(engine))
            engine.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses
    predicted = accounting.memory_per_rank(config, training_setup(args, dist_info))
    measured = dict(params=memory.param_bytes(engine), grads=grads, optim=memory.optimizer_bytes(engine))
    assert measured["optim"] == pytest.approx(predicted["optim"], rel=0.01)
    assert measured["grads"] == pytest.approx(predicted["grads"], rel=0.01)
    assert measured["params"] == pytest.approx(predicted["params"], rel=0.01)
    if stage == 0:  # fp32 master copy + Adam m and v
        assert measured["optim"] == pytest.approx(12 * num_params, rel=0.01)
