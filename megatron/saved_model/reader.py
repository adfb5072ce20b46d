"""Read a zero-lab checkpoint of any ZeRO stage into one full fp32 state dict, and write one.

A checkpoint folder holds `latest` (the tag) and `<tag>/`. Inside the tag, the rank-0 model-states
file carries our metadata (`args` from pretrain_gpt.py, or `model_config` from
tools/hf_to_checkpoint.py) and, below ZeRO-3, the module's weights. When ZeRO optimizer files
are present their fp32 master weights are consolidated with DeepSpeed's own zero_to_fp32
(under ZeRO-3 they are the only copy of the weights; DeepSpeed's BF16_Optimizer files, ZeRO-1 in
bf16, through its stage-2 reconstruction); at stage 0 in bf16 the fp32 masters are in the
model-states file. The module's own weights are taken only where there are no masters, and
LoadedCheckpoint.weights_from says which were taken. Tensor-parallel shards are merged and
pipeline layer files gathered by megatron.saved_model.layouts.
"""
from __future__ import annotations

import contextlib
import glob
import io
import os
import shutil
import tempfile
from dataclasses import dataclass, fields

import torch

from megatron.errors import ZeroLabError
from megatron.model import GPTConfig, GPTModel
from megatron.model.config import ModelConfigError
from megatron.model.recipe import mlp_part
from megatron.safe_load import restricted_unpickling
from megatron.saved_model.layouts import (
    gather_pipeline_layers,
    merge_tensor_parallel,
    pipeline_layer_files,
)
from megatron.tokenizer import TokenizerConfig


class SavedModelError(ZeroLabError, ValueError):
    """A missing, partial or foreign checkpoint; the message names the path and what was expected."""


@dataclass
class LoadedCheckpoint:
    path: str  # the tag folder
    iteration: int
    config: GPTConfig
    state_dict: dict[str, torch.Tensor]  # our parameter names, full (TP=1), fp32
    tokenizer: TokenizerConfig | None  # None when the checkpoint does not say (give --vocab-file/--merge-file)
    data_path: list[str] | None  # what the run trained on (eval_dolly's default)
    split: str | None
    weights_from: str = "the model-states file"  # which copy of the weights state_dict is, for the tools' output


def tag_folder(path: str, tag: str | None = None) -> str:
    """The folder holding the model-states files: `path/<tag or latest>`, or path itself."""
    if not os.path.isdir(path):
        raise SavedModelError(f"--load {path}: no such checkpoint folder")
    if tag is None and glob.glob(os.path.join(path, "*model_states.pt")):
        return path
    if tag is None:
        latest = os.path.join(path, "latest")
        if not os.path.isfile(latest):
            inside = os.path.join(path, "checkpoints")
            hint = f": a run folder? its checkpoints are in --load {inside}" if os.path.isfile(
                os.path.join(inside, "latest")) else ""
            raise SavedModelError(f"--load {path}: not a checkpoint (no 'latest' file and no *model_states.pt){hint}")
        with open(latest) as handle:
            tag = handle.read().strip()
    folder = os.path.join(path, tag)
    if not os.path.isdir(folder):
        raise SavedModelError(f"--load {path}: tag {tag!r} has no folder {folder}")
    return folder


def _model_states_file(folder: str) -> str:
    """The rank-0 model-states file, which carries our metadata in every layout."""
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if os.path.isfile(os.path.join(folder, name)):
            return os.path.join(folder, name)
    raise SavedModelError(f"{folder}: no mp_rank_00_model_states.pt or zero_pp_rank_0_mp_rank_00_model_states.pt")


def _torch_load(path: str) -> dict:
    try:
        # mmap: a stage-0 file also holds the optimizer state, which is never read here. weights_only=False
        # takes effect only with --trust-checkpoint: load_checkpoint_weights's restricted_unpickling forces
        # weights_only=True otherwise
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except (RuntimeError, OSError, EOFError, ValueError) as err:
        raise SavedModelError(f"{path}: unreadable checkpoint file ({err})") from None


def _consolidated_zero_weights(folder: str, tp_rank: int, tp_size: int) -> dict[str, torch.Tensor]:
    """One TP rank's fp32 weights from its ZeRO partitions, by DeepSpeed's zero_to_fp32. That tool
    reads every *_optim_states.pt of a tag folder as one model, so with TP > 1 it is pointed at a
    folder of links to this rank's files only, named as a TP=1 checkpoint's."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with tempfile.TemporaryDirectory(prefix="zero_lab_tp") as tmp:
        root, tag = os.path.dirname(folder), os.path.basename(folder)
        if tp_size > 1:
            rank = f"mp_rank_{tp_rank:02d}"
            os.makedirs(os.path.join(tmp, tag))
            for path in glob.glob(os.path.join(folder, f"*{rank}_*.pt")):
                link = os.path.join(tmp, tag, os.path.basename(path).replace(rank, "mp_rank_00"))
                os.symlink(os.path.abspath(path), link)
            root = tmp
        # zero_to_fp32 reports its progress (prints on stdout, tqdm bars on stderr), seven lines a load: the
        # tools' output and their one-line errors (docs/bad-input.md) stay their own
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            try:
                if _bf16_optimizer_files(os.path.join(root, tag)):
                    return _bf16_optimizer_weights(os.path.join(root, tag))
                return get_fp32_state_dict_from_zero_checkpoint(root, tag=tag)
            except (FileNotFoundError, ValueError, KeyError, RuntimeError) as err:
                raise SavedModelError(f"{folder}: cannot consolidate the ZeRO checkpoint ({err})") from None


def _bf16_optimizer_files(folder: str) -> list[str]:
    """The optimizer files of DeepSpeed's BF16_Optimizer (ZeRO-1 in bf16 with fp32 gradient accumulation),
    which zero_to_fp32 refuses: they hold no ZeRO stage (DeepSpeed 0.19.8). Empty for any other checkpoint."""
    from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT, ZERO_STAGE
    files = sorted(glob.glob(os.path.join(folder, "bf16_zero_pp_rank_*_optim_states.pt")))
    if not files or ZERO_STAGE in _torch_load(files[0])[OPTIMIZER_STATE_DICT]:
        return []
    return files


def _bf16_optimizer_weights(folder: str) -> dict[str, torch.Tensor]:
    """The fp32 master weights of a BF16_Optimizer checkpoint. Each rank's file holds, per parameter
    group, its equal share of the group's flat fp32 copy (the group's parameters end to end, in the
    order of the model-states file's param_shapes, padded at the end only): ZeRO-1/2's layout, so
    zero_to_fp32's own stage-2 reconstruction puts them together, with its checks of the sizes."""
    from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT, PARTITION_COUNT, SINGLE_PARTITION_OF_FP32_GROUPS
    from deepspeed.utils import zero_to_fp32

    states = [_torch_load(path)[OPTIMIZER_STATE_DICT] for path in _bf16_optimizer_files(folder)]
    counts = states[0][PARTITION_COUNT]
    world_size = max(counts) if isinstance(counts, list) else counts
    if world_size != len(states):
        raise ValueError(f"expected {world_size} bf16_zero_pp_rank_*_optim_states.pt files, found {len(states)}")
    model_states = zero_to_fp32.parse_model_states(zero_to_fp32.get_model_state_files(folder))
    merged = zero_to_fp32._get_fp32_state_dict_from_zero2_checkpoint(
        world_size, [state[SINGLE_PARTITION_OF_FP32_GROUPS] for state in states], model_states,
        exclude_frozen_parameters=False)
    return zero_to_fp32.to_torch_tensor(merged)


def _stage0_master_weights(states: dict) -> dict[str, torch.Tensor] | None:
    """The fp32 copy of each parameter that DeepSpeed's bf16 optimizer keeps at ZeRO stage 0, in the
    model-states file: `fp32_groups`, per parameter group one tensor per parameter, without names. The
    groups are megatron.optimizer.param_groups': the matrices, then the 1-D parameters, each in the
    module's order. Taken only when every copy has its parameter's shape and rounds to exactly the
    module's 16-bit weight (DeepSpeed copies the masters into the module after each step); None
    otherwise, and where there are none (an fp32 run: its module weights are the fp32 ones)."""
    optimizer, module = states.get("optimizer"), states["module"]
    groups = optimizer.get("fp32_groups") if isinstance(optimizer, dict) else None
    if not isinstance(groups, list) or not all(isinstance(group, list) for group in groups):
        return None
    buffers = set(states.get("buffer_names") or ())
    params = [name for name in module if name not in buffers]
    names = [name for name in params if module[name].dim() >= 2] + [name for name in params if module[name].dim() < 2]
    masters = [tensor for group in groups for tensor in group]
    if len(masters) != len(names):
        return None
    for name, master in zip(names, masters):
        if master.shape != module[name].shape or not torch.equal(master.to(module[name].dtype), module[name]):
            return None
    weights = {name: module[name].float() for name in buffers if name in module}
    return weights | {name: master.detach().float() for name, master in zip(names, masters)}


def _tp_shard(folder: str, tp_rank: int, tp_size: int, layer_files: dict, zero: bool) -> tuple[dict, str]:
    """One TP rank's weights in GPTModel names, and which copy they are: from the pipeline's layer
    files, the ZeRO partitions (fp32 master weights), or the rank's model-states file."""
    if layer_files:
        try:
            return gather_pipeline_layers(layer_files, tp_rank), "the pipeline's layer files (the module's weights)"
        except ValueError as err:
            raise SavedModelError(f"{folder}: {err}") from None
    if zero:
        return _consolidated_zero_weights(folder, tp_rank, tp_size), "the optimizer's fp32 master weights"
    for name in (f"mp_rank_{tp_rank:02d}_model_states.pt", f"zero_pp_rank_0_mp_rank_{tp_rank:02d}_model_states.pt"):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            states = _torch_load(path)
            module = states["module"] or {}
            if not module or any(tensor.numel() == 0 for tensor in module.values()):
                raise SavedModelError(f"{folder}: the weights are not in the model-states file and no ZeRO optimizer "
                                      "files (*_optim_states.pt) are there to consolidate them from")
            masters = _stage0_master_weights(states)
            if masters is not None:
                return masters, "the optimizer's fp32 master weights"
            dtype = str(next(iter(module.values())).dtype).removeprefix("torch.")
            return {name: tensor.float() for name, tensor in module.items()}, f"the module's {dtype} weights"
    raise SavedModelError(f"{folder}: --tensor-model-parallel-size {tp_size} but no model-states file of "
                          f"TP rank {tp_rank} (mp_rank_{tp_rank:02d})")


def _moe_weights(folder: str, states: dict) -> tuple[dict[str, torch.Tensor], str]:
    """A mixture-of-experts checkpoint's weights: DeepSpeed keeps the experts out of the model-states file and
    writes each in a file of its own, layer_<moe layer>_expert_<global index>_mp_rank_00_model_states.pt, under
    the names of an EP=1 model (global indices) whatever EP the run used; the rest is the model-states file's
    module, whole at ZeRO 0-2 (MoE runs refuse ZeRO-3 and tensor parallelism). The module's weights are taken
    (in a 16-bit run, rounded: the fp32 masters of the expert optimizer groups are not merged here)."""
    module = states["module"] or {}
    if not module or any(tensor.numel() == 0 for tensor in module.values()):
        raise SavedModelError(f"{folder}: the weights are not in the model-states file (mp_rank_00_model_states.pt)")
    # none in a checkpoint save_checkpoint_weights wrote: its module holds the experts (check_state_dict checks)
    files = sorted(glob.glob(os.path.join(folder, "layer_*_expert_*_mp_rank_00_model_states.pt")))
    weights = {name: tensor.float() for name, tensor in module.items()}
    for path in files:
        experts = _torch_load(path)
        if not isinstance(experts, dict):
            raise SavedModelError(f"{path}: not an expert's state dict")
        weights.update({name: tensor.float() for name, tensor in experts.items()})
    dtype = str(next(iter(module.values())).dtype).removeprefix("torch.")
    return weights, f"the module's {dtype} weights" + (f" and the {len(files)} experts' files" if files else "")


def _config_from_metadata(states: dict, where: str) -> GPTConfig:
    """The model shape every zero-lab checkpoint stores (GPTConfig.to_dict(), written by pretrain_gpt.py
    and tools/hf_to_checkpoint.py alike)."""
    if "model_config" not in states:
        raise SavedModelError(f"{where}: no model description ('model_config'); not a zero-lab checkpoint")
    try:
        return GPTConfig.from_dict(states["model_config"])
    except (ModelConfigError, TypeError) as err:
        raise SavedModelError(f"{where}: bad model description ({err})") from None


def _tokenizer_from_metadata(states: dict, root: str) -> TokenizerConfig | None:
    if "tokenizer" in states:  # files copied next to a converted checkpoint
        info = dict(states["tokenizer"])
        for key in ("vocab_file", "merge_file"):
            if info.get(key):
                info[key] = os.path.join(root, info[key])
        return TokenizerConfig(**info)
    data = states.get("args", {}).get("data")
    if not data:
        return None
    keys = {f.name for f in fields(TokenizerConfig)}
    return TokenizerConfig(**{key: value for key, value in data.items() if key in keys})


def check_state_dict(state_dict: dict[str, torch.Tensor], config: GPTConfig, where: str) -> None:
    """Every parameter of GPTModel(config) present with its shape, nothing else."""
    with torch.device("meta"):
        expected = {name: tuple(p.shape) for name, p in GPTModel(config).state_dict().items()}
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    if missing or unexpected:
        raise SavedModelError(f"{where}: weights do not match a GPT with {config.num_layers} layers "
                              f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    for name, shape in expected.items():
        if tuple(state_dict[name].shape) != shape:
            raise SavedModelError(f"{where}: {name} has shape {tuple(state_dict[name].shape)}, "
                                  f"the model description gives {shape}")


def load_checkpoint_weights(path: str, tag: str | None = None, trust: bool = False) -> LoadedCheckpoint:
    """Every file is read with no code run from it (megatron/safe_load.py) unless trust (--trust-checkpoint)."""
    folder = tag_folder(path, tag)
    with restricted_unpickling(trust, folder):
        return _load_weights(folder)


def _load_weights(folder: str) -> LoadedCheckpoint:
    states_file = _model_states_file(folder)
    states = _torch_load(states_file)
    if not isinstance(states, dict) or "module" not in states:
        raise SavedModelError(f"{states_file}: not a DeepSpeed model-states file (no 'module')")
    config = _config_from_metadata(states, states_file)
    if config.is_moe:
        weights, weights_from = _moe_weights(folder, states)
    else:
        tp_size = int(states.get("tensor_model_parallel_size", 1))
        layer_files = pipeline_layer_files(folder)
        zero = bool(glob.glob(os.path.join(folder, "*zero_pp_rank_*_optim_states.pt")))
        shards = [_tp_shard(folder, rank, tp_size, layer_files, zero) for rank in range(tp_size)]
        weights = merge_tensor_parallel([shard for shard, _ in shards], mlp_part(config).strides)
        weights_from = shards[0][1]
    if "word_embeddings.weight" not in weights:
        raise SavedModelError(f"{folder}: no word_embeddings.weight among the weights (not a GPT checkpoint)")
    check_state_dict(weights, config, folder)
    args = states.get("args", {})
    return LoadedCheckpoint(path=folder, iteration=int(states.get("iteration", 0)), config=config,
                            state_dict=weights, tokenizer=_tokenizer_from_metadata(states, os.path.dirname(folder)),
                            data_path=args.get("data", {}).get("data_path"), split=args.get("data", {}).get("split"),
                            weights_from=weights_from)


def build_model(config: GPTConfig, state_dict: dict[str, torch.Tensor], device: str = "cpu") -> GPTModel:
    """GPTModel in eval mode holding `state_dict` (fp32)."""
    with torch.device("meta"):
        model = GPTModel(config)
    model.load_state_dict(state_dict, strict=True, assign=True)
    return model.to(device).eval()


def save_checkpoint_weights(save_dir: str, config: GPTConfig, state_dict: dict[str, torch.Tensor],
                            tokenizer_files: dict[str, str], source: str) -> str:
    """Write a checkpoint that `pretrain_gpt.py --load DIR --finetune` and these tools read: iteration 0,
    no optimizer. tokenizer_files maps vocab_file/merge_file to files copied next to `latest`.
    Built under a temporary name and renamed, so a failed write leaves no checkpoint behind."""
    import deepspeed

    check_state_dict(state_dict, config, source)
    if os.path.exists(save_dir) and os.listdir(save_dir):
        raise SavedModelError(f"--save {save_dir}: folder exists and is not empty (refusing to overwrite)")
    tmp = f"{save_dir.rstrip(os.sep)}.tmp-{os.getpid()}"
    tag = "global_step0"
    try:
        os.makedirs(os.path.join(tmp, tag))
        tokenizer = {"tokenizer_type": "GPT2BPETokenizer"} if tokenizer_files else None
        for key, src in tokenizer_files.items():
            shutil.copyfile(src, os.path.join(tmp, os.path.basename(src)))
            tokenizer[key] = os.path.basename(src)
        payload = {"module": state_dict, "model_config": config.to_dict(), "iteration": 0, "consumed_samples": 0,
                   "dp_world_size": 1, "mp_world_size": 1, "ds_version": deepspeed.__version__, "source": source}
        if tokenizer:
            payload["tokenizer"] = tokenizer
        torch.save(payload, os.path.join(tmp, tag, "mp_rank_00_model_states.pt"))
        with open(os.path.join(tmp, "latest"), "w") as handle:
            handle.write(tag)
        if os.path.isdir(save_dir):
            os.rmdir(save_dir)  # empty, checked above
        os.rename(tmp, save_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return save_dir
