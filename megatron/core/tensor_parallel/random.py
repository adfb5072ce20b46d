"""Model-parallel RNG and activation checkpointing that replays it.

Dropout on activations that are split across tensor-parallel ranks (attention heads)
must differ between ranks, or every shard drops the same positions; dropout on
replicated activations must match across ranks, or the replicas diverge. The default
generator (seeded identically on all TP ranks) serves the replicated case; the tracker
holds a second, per-rank generator state that `fork()` swaps in for the split case.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from megatron.core.tensor_parallel.activation_offload import offload_to_host

MODEL_PARALLEL_RNG = "model-parallel-rng"
# Megatron's offset between the data-parallel seed and the tensor-parallel seeds.
TENSOR_PARALLEL_SEED_OFFSET = 2718
# DeepSpeed-Ulysses: each rank of a sequence-parallel group holds its own slice of every sequence, so its dropout
# outside the attention draws from a stream of its own (the same on the ranks of its TP group), seeded this far
# from the tensor-parallel seeds
SEQUENCE_PARALLEL_RNG = "sequence-parallel-rng"
SEQUENCE_PARALLEL_SEED_OFFSET = 2**20


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return torch.default_generator


@dataclass
class RNGStatesTracker:
    """Named generator states, one per (name, device type), created lazily from a seed."""

    seeds: dict[str, int] = field(default_factory=dict)
    states: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)

    def add(self, name: str, seed: int) -> None:
        if name in self.seeds:
            raise ValueError(f"RNG state {name!r} already exists")
        if seed in self.seeds.values():
            raise ValueError(f"seed {seed} is already used by another RNG state")
        self.seeds[name] = seed

    def _state(self, name: str, device: torch.device) -> torch.Tensor:
        key = (name, device.type)
        if key not in self.states:
            if name not in self.seeds:
                raise ValueError(f"RNG state {name!r} was never added")
            generator = torch.Generator(device=device)
            generator.manual_seed(self.seeds[name])
            self.states[key] = generator.get_state()
        return self.states[key]

    @contextlib.contextmanager
    def fork(self, device: torch.device, name: str = MODEL_PARALLEL_RNG):
        """Run the body with the tracked state in the device's default generator, then put
        the default state back and keep the advanced tracked state for next time."""
        generator = _default_generator(device)
        saved = generator.get_state()
        generator.set_state(self._state(name, device))
        try:
            yield
        finally:
            self.states[(name, device.type)] = generator.get_state()
            generator.set_state(saved)

    def get_states(self) -> dict[tuple[str, str], torch.Tensor]:
        return {key: state.clone() for key, state in self.states.items()}

    def set_states(self, states: dict[tuple[str, str], torch.Tensor]) -> None:
        self.states = {key: state.clone() for key, state in states.items()}


def model_parallel_tracker(seed: int, tensor_parallel_rank: int, sequence_parallel_rank: int = 0,
                           tensor_parallel_size: int = 1) -> RNGStatesTracker:
    """A tracker of two states derived from `seed`: the model-parallel one differs on each TP rank and, under
    DeepSpeed-Ulysses, on each sequence-parallel rank (split heads: TP's, and Ulysses' heads of the whole sequence
    after the all-to-all); the sequence-parallel one differs per SP rank only (Ulysses' sequence slices, replicated
    over TP). At SP rank 0 the model-parallel seed is Megatron's, seed + 2718 + TP rank."""
    tracker = RNGStatesTracker()
    tracker.add(MODEL_PARALLEL_RNG, seed + TENSOR_PARALLEL_SEED_OFFSET + tensor_parallel_rank
                + tensor_parallel_size * sequence_parallel_rank)
    tracker.add(SEQUENCE_PARALLEL_RNG, seed + SEQUENCE_PARALLEL_SEED_OFFSET + sequence_parallel_rank)
    return tracker


def checkpoint(function, tracker: RNGStatesTracker, *args, with_deepspeed: bool = False, offload: bool = False):
    """Activation checkpointing: drop `function`'s activations, recompute them in backward.

    torch restores the default generators for the recompute; the context pair below also
    rewinds the tracker, so dropout inside forked regions draws the same masks again.
    with_deepspeed: DeepSpeed's implementation instead (`deepspeed_checkpoint`).
    offload: --checkpoint-in-cpu, the inputs kept in the host tier until the recompute (activation_offload.py).
    """
    if with_deepspeed:
        return deepspeed_checkpoint(function, tracker, *args)

    def contexts():
        saved = tracker.get_states()

        @contextlib.contextmanager
        def replay():
            current = tracker.get_states()
            tracker.set_states(saved)
            try:
                yield
            finally:
                tracker.set_states(current)

        return contextlib.nullcontext(), replay()

    with offload_to_host() if offload else contextlib.nullcontext():
        return torch_checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True, context_fn=contexts)


def deepspeed_checkpoint(function, tracker: RNGStatesTracker, *args):
    """Megatron-DeepSpeed's --deepspeed-activation-checkpointing: deepspeed.checkpointing's checkpoint, as
    `configure_deepspeed_checkpointing` set it up (the JSON's activation_checkpointing section: partitioned,
    contiguous or CPU checkpoints). DeepSpeed restores the default generators for the recompute, and its own
    tracker, which zero-lab's layers do not draw from: the recompute rewinds ours here."""
    from deepspeed.runtime.activation_checkpointing.checkpointing import checkpoint as ds_checkpoint

    saved, calls = tracker.get_states(), []

    def run(*inputs):
        if not calls:  # the forward
            calls.append(1)
            return function(*inputs)
        current = tracker.get_states()
        tracker.set_states(saved)
        try:
            return function(*inputs)
        finally:
            tracker.set_states(current)

    return ds_checkpoint(run, *args)


def configure_deepspeed_checkpointing(mpu, ds_config: dict, num_layers: int, in_cpu: bool) -> None:
    """deepspeed.checkpointing from the run's DeepSpeed config (its activation_checkpointing section) with
    --checkpoint-in-cpu, as Megatron-DeepSpeed's initialize does; mpu: the tensor-parallel groups that partitioned
    activations are split over."""
    import deepspeed

    deepspeed.checkpointing.configure(mpu, deepspeed_config=ds_config, num_checkpoints=num_layers,
                                      checkpoint_in_cpu=in_cpu or None)
