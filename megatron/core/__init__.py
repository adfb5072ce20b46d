"""Parallel state and tensor-parallel building blocks, in pure torch.

Nothing here imports megatron's training code, tools or tokenizers; process groups and
configs are passed in explicitly.
"""
