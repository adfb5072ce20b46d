"""Autoregressive generation from a GPTModel: greedy, temperature, top-k and top-p sampling.

With the KV cache (default) the prompt is run once and every new token costs one position;
without it each step recomputes the whole prefix (kept as the reference the cache must match).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from megatron.errors import ZeroLabError
from megatron.model import GPTModel
from megatron.model.kv_cache import KVCache


class GenerationError(ZeroLabError, ValueError):
    """Bad sampling flags or a request the model cannot serve; the message names the flag."""


@dataclass(frozen=True)
class SamplingConfig:
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1.0: no nucleus filter

    def __post_init__(self):
        if not self.temperature > 0:
            raise GenerationError(f"--temperature must be > 0, got {self.temperature} (use --greedy for argmax)")
        if self.top_k < 0:
            raise GenerationError(f"--top-k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise GenerationError(f"--top-p must be in (0, 1], got {self.top_p}")


@dataclass
class GenerationResult:
    tokens: list[int]  # the new tokens, without the prompt (an end-of-document token included)
    prompt_tokens_dropped: int  # prompt tokens cut from the left to fit the position embeddings
    stopped_at_eod: bool
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else float("inf")


def next_token(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> int:
    """Pick a token from one position's logits [vocab] (padded vocabulary ids already masked)."""
    logits = logits.float()
    if sampling.greedy:
        return int(logits.argmax())
    logits = logits / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(logits, min(sampling.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the more likely ones already reach top_p; the first always stays
        outside = probs.cumsum(dim=-1) - probs >= sampling.top_p
        logits = logits.index_fill(0, order[outside], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def _fit_prompt(prompt: list[int], max_new_tokens: int, max_positions: int, eod: int) -> list[int]:
    if max_new_tokens < 1:
        raise GenerationError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if max_new_tokens >= max_positions:
        raise GenerationError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt: the model has "
                              f"{max_positions} positions (--max-position-embeddings)")
    prompt = list(prompt) or [eod]  # an empty prompt starts a new document, as GPT-2 was trained
    return prompt[-(max_positions - max_new_tokens):]


@torch.no_grad()
def generate(model: GPTModel, prompt: list[int], max_new_tokens: int, sampling: SamplingConfig, eod: int,
             vocab_size: int, use_cache: bool = True, generator: torch.Generator | None = None) -> GenerationResult:
    """Generate up to max_new_tokens after `prompt` (stopping after an end-of-document token).
    Ids >= vocab_size (the padded rows of the embedding) are never produced."""
    fitted = _fit_prompt(prompt, max_new_tokens, model.config.max_position_embeddings, eod)
    device = next(model.parameters()).device
    tokens = torch.tensor([fitted], dtype=torch.long, device=device)
    cache = KVCache(model.config.num_layers, tokens.shape[1] + max_new_tokens) if use_cache else None
    new: list[int] = []
    start = time.perf_counter()
    step_input, first_position = tokens, 0
    while len(new) < max_new_tokens:
        positions = torch.arange(first_position, first_position + step_input.shape[1], device=device).unsqueeze(0)
        logits = model(step_input, positions, kv_cache=cache)[0, -1]
        token = next_token(logits[:vocab_size], sampling, generator)
        new.append(token)
        if token == eod:
            break
        token_tensor = torch.tensor([[token]], dtype=torch.long, device=device)
        tokens = torch.cat([tokens, token_tensor], dim=1)
        if use_cache:
            step_input, first_position = token_tensor, tokens.shape[1] - 1
        else:
            step_input = tokens
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return GenerationResult(tokens=new, prompt_tokens_dropped=len(prompt) - len(fitted) if prompt else 0,
                            stopped_at_eod=bool(new) and new[-1] == eod, seconds=time.perf_counter() - start)
