"""The long-sequence levers in every combination (docs/long-sequences.md "Memory"): DeepSpeed-Ulysses SP in {1, 2} x
full recomputation x --tiled-mlp-compute with --tiled-logits-loss x --checkpoint-in-cpu (only with recomputation), at
1,024 and 2,048 tokens on CPU ranks (2 gloo ranks for SP=2). Each cell runs the real model's training step and holds
megatron/accounting/predict/memory.py to what it measures: the activations autograd saves in the forward
(activation_bytes, within 1%), the host tier (offloaded_activation_bytes, exactly) and the peak of the accelerator's
live bytes over the forward and the backward (memory_per_rank's total less the model states, within 10%)."""
import weakref
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megatron.accounting import TrainingSetup, activation_bytes, memory_per_rank
from megatron.accounting.measure import memory
from megatron.core.scratch import ScratchBuffers
from megatron.core.tensor_parallel.activation_offload import HostTensor
from megatron.model import GPTConfig, GPTModel
from megatron.training import get_batch

MIB = 2**20
TINY = GPTConfig(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=1024, max_position_embeddings=2048,
                 padded_vocab_size=1024, hidden_dropout=0.0, attention_dropout=0.0)
# (recompute, tiled MLP and loss, offload): offload only with recompute (refused without it)
CELLS = [(False, False, False), (False, True, False), (True, False, False), (True, True, False),
         (True, False, True), (True, True, True)]
TILED = dict(tiled_mlp_compute=True, tiled_mlp_shards=4, tiled_logits_loss=True, tiled_logits_loss_shards=4)


class LiveBytes(TorchDispatchMode):
    """The bytes of the live storages of every tensor an op makes inside (views count their storage once), and
    their peak, sampled after each op of the forward and the backward. A tensor autograd keeps from C++ keeps its
    Python object, so its storage stays counted while it lives. The host tier (HostTensor) and the storages in
    `excluded` (the weights and their gradients: the model states) are left out."""

    def __init__(self, excluded: set[int]):
        super().__init__()
        self.excluded, self.tensors, self.storages, self.live, self.peak = excluded, {}, {}, 0, 0

    def _forget(self, ident: int, key: int) -> None:
        self.tensors.pop(ident, None)
        nbytes, count = self.storages[key]
        self.storages[key] = (nbytes, count - 1)
        if count == 1:
            del self.storages[key]
            self.live -= nbytes

    def _track(self, tensor: torch.Tensor) -> None:
        if id(tensor) in self.tensors or isinstance(tensor, HostTensor) or tensor.numel() == 0:
            return
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.excluded:
            return
        nbytes, count = self.storages.get(key, (storage.nbytes(), 0))
        self.live += nbytes if count == 0 else 0
        self.storages[key] = (nbytes, count + 1)
        self.tensors[id(tensor)] = weakref.ref(tensor, lambda _, ident=id(tensor), key=key: self._forget(ident, key))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._track(tensor)
        self.peak = max(self.peak, self.live)
        return out


def _measure(config: GPTConfig, sp_group=None, sequence=None) -> dict[str, int]:
    """One training step of micro-batch 1 after a first one (the gradients exist, as in a run's later steps): the
    activations saved in the forward, the host tier after it, the peak live bytes."""
    torch.manual_seed(0)
    model = GPTModel(config, sp_group=sp_group).train()
    text = torch.randint(0, 1000, (1, config.seq_length + 1), generator=torch.Generator().manual_seed(7))
    tokens, labels, positions, _ = get_batch({"text": text}, torch.device("cpu"), -1, False, sequence)
    model(tokens, positions, labels).float().mean().backward()
    states = {tensor.untyped_storage().data_ptr() for param in model.parameters() for tensor in (param, param.grad)}
    # a new logits buffer, made inside and so counted: on CPU ranks the model keeps it from the loss's forward to
    # the step's end (megatron/core/scratch.py), and the predicted total holds it beside the recomputed layer
    model.lm_loss_scratch = ScratchBuffers()
    with LiveBytes(states) as live:
        with memory.saved_activation_bytes(model) as saved:
            loss = model(tokens, positions, labels)
        host = memory.host_tier_bytes()
        loss.float().mean().backward()
    return dict(activations=saved[0], host=host, peak=live.peak)


def _predict(config: GPTConfig, setup: TrainingSetup) -> dict[str, int]:
    rank = memory_per_rank(config, setup)
    return dict(activations=activation_bytes(config, setup), host=rank["activations_offloaded"],
                peak=rank["total"] - rank["model_states"])


def _grid(sp: int, sp_group=None, sequence=None) -> list[str]:
    """Measure and predict every cell at 1,024 and 2,048 tokens; assert each; return the table's rows (MiB)."""
    rows, misses = [], []
    for seq_length in (1024, 2048):
        for recompute, tiled, offload in CELLS:
            config = replace(TINY, seq_length=seq_length, recompute_activations=recompute, recompute_offload=offload,
                             **(TILED if tiled else {}))
            setup = TrainingSetup(world_size=sp, micro_batch_size=1, device="cpu", sequence_parallel_size=sp,
                                  activation_recompute=recompute, activation_offload=offload)
            measured, predicted = _measure(config, sp_group, sequence), _predict(config, setup)
            rows.append(f"SP={sp} s={seq_length} recompute={recompute:d} tiled={tiled:d} offload={offload:d}: " +
                        " ".join(f"{key} {measured[key] / MIB:.3f}/{predicted[key] / MIB:.3f}" for key in measured))
            if not (measured["activations"] == pytest.approx(predicted["activations"], rel=0.01)
                    and measured["host"] == predicted["host"]
                    and measured["peak"] == pytest.approx(predicted["peak"], rel=0.1)):
                misses.append(rows[-1])
    assert not misses, "measured/predicted MiB off:\n" + "\n".join(misses)
    return rows


@pytest.mark.slow
def test_every_combination_on_one_rank_keeps_the_predicted_memory():
    """SP=1: measured/predicted MiB of each cell printed (pytest -s)."""
    print("\n" + "\n".join(_grid(1)))


def _check_ulysses_grid(rank, world):
    import deepspeed

    from megatron.core.layout import ParallelLayout
    from megatron.core.parallel_state import ParallelState
    deepspeed.init_distributed(dist_backend="gloo")  # DistributedAttention's all-to-alls go through deepspeed.comm
    state = ParallelState.build(ParallelLayout(world_size=world, sequence_parallel_size=2))
    rows = _grid(2, state.get_sequence_parallel_group(), state.sequence)
    if dist.get_rank() == 0:
        print("\n" + "\n".join(rows), flush=True)


@pytest.mark.slow
def test_every_combination_on_two_ulysses_ranks_keeps_the_predicted_memory():
    """SP=2 on 2 gloo ranks: each rank's s/2 tokens, both ranks asserting."""
    from test_tensor_parallel import run_ranks
    run_ranks(_check_ulysses_grid)


def test_offload_without_recompute_is_refused_in_one_line():
    with pytest.raises(ValueError, match="^--checkpoint-in-cpu offloads the recomputed layers' inputs"):
        TrainingSetup(world_size=1, micro_batch_size=1, activation_offload=True)
