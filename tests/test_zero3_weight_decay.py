"""Weight decay under ZeRO-3: zero.Init leaves each parameter an empty 1-D tensor (its shape in ds_shape), and
the optimizer's groups must still put the matrices, not the biases and LayerNorms, under weight decay; before,
every parameter of a stage-3 run went without it, and its weights drifted from the ZeRO-0 run's."""
import torch
import torch.distributed as dist

from conftest import free_port
from megatron.model import MODEL_PRESETS, GPTConfig, GPTModel
from megatron.optimizer import param_groups


def names_per_group(model, groups):
    name = {id(param): name for name, param in model.named_parameters()}
    return [sorted(name[id(param)] for param in group["params"]) for group in groups]


def test_zero3_partitioned_parameters_get_the_weight_decay_groups_of_stage_0(monkeypatch):
    import deepspeed

    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1").items():
        monkeypatch.setenv(key, value)
    config = GPTConfig(**dict(MODEL_PRESETS["tiny"], seq_length=16, max_position_embeddings=16, padded_vocab_size=64))
    plain = GPTModel(config)
    linear = torch.nn.functional.linear  # zero.Init replaces it for the rest of the process; put back below
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with deepspeed.zero.Init(config_dict_or_path={"train_batch_size": 1, "zero_optimization": {"stage": 3}}):
            zero3 = GPTModel(config)
        assert all(param.ndim == 1 and param.numel() == 0 for param in zero3.parameters())  # partitioned away
        expected = names_per_group(plain, param_groups(plain, 0.1))
        assert expected[0] and expected[1]
        assert names_per_group(zero3, param_groups(zero3, 0.1)) == expected
    finally:
        torch.nn.functional.linear = linear
        dist.destroy_process_group()
