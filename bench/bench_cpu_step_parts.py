"""Where one CPU core's training step goes: the measurements behind the fused output-layer loss,
the kept logits buffer and fused AdamW, each against the alternative, in one run, one thread.

  output-layer matmul   logits = hidden @ W.T into a fresh tensor vs into a kept one
  output layer + loss   our vocab_parallel_lm_loss vs F.linear + F.cross_entropy (HF's path), fwd + bwd
  AdamW step            torch AdamW fused=True vs its default per-tensor loop, --params parameters
  model fwd + bwd       our GPTModel vs HF GPT2LMHeadModel (sdpa), same shape, dropout on

    python bench/bench_cpu_step_parts.py [--tokens 1024] [--hidden-size 256] [--num-layers 4]
"""
import argparse
import sys
import time

import torch
import torch.nn.functional as F

from common import HFAdapter
from megatron.core.scratch import ScratchBuffers
from megatron.core.tensor_parallel import vocab_parallel_lm_loss
from megatron.model import GPTConfig, GPTModel

VOCAB = 50304  # GPT-2's 50257 padded to a multiple of 128


def milliseconds(step, repeat: int) -> float:
    """Fastest of `repeat` timed calls after two untimed ones."""
    step(), step()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return 1000 * best


def output_layer_rows(opts):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(opts.tokens, opts.hidden_size, generator=generator).requires_grad_(True)
    weight = (0.02 * torch.randn(VOCAB, opts.hidden_size, generator=generator)).requires_grad_(True)
    target = torch.randint(0, VOCAB, (opts.tokens,), generator=generator)
    kept = torch.empty(opts.tokens, VOCAB)
    scratch = ScratchBuffers()

    def fused():
        vocab_parallel_lm_loss(hidden, weight, target, None, scratch).mean().backward()

    def unfused():
        F.cross_entropy(F.linear(hidden, weight), target, reduction="none").mean().backward()

    with torch.no_grad():
        fresh = milliseconds(lambda: hidden @ weight.t(), opts.repeat)
        reused = milliseconds(lambda: torch.mm(hidden, weight.t(), out=kept), opts.repeat)
    return [("output-layer matmul", "kept output", reused, "fresh output", fresh),
            ("output layer + loss", "fused", milliseconds(fused, opts.repeat),
             "linear + cross_entropy", milliseconds(unfused, opts.repeat))]


def adamw_row(opts):
    def stepper(fused):
        params = [torch.nn.Parameter(torch.randn(opts.params // 2)) for _ in range(2)]
        for param in params:
            param.grad = torch.randn_like(param)
        return torch.optim.AdamW(params, lr=1e-4, fused=fused).step

    return [("AdamW step", "fused", milliseconds(stepper(True), opts.repeat),
             "per-tensor loop", milliseconds(stepper(None), opts.repeat))]


def model_row(opts):
    seq = opts.tokens // opts.batch
    config = GPTConfig(num_layers=opts.num_layers, hidden_size=opts.hidden_size,
                       num_attention_heads=opts.hidden_size // 32, seq_length=seq, max_position_embeddings=seq,
                       padded_vocab_size=VOCAB)
    torch.manual_seed(0)
    ours, theirs = GPTModel(config), HFAdapter(config)
    ids = torch.randint(0, 50257, (opts.batch, seq + 1), generator=torch.Generator().manual_seed(1))
    tokens, labels, positions = ids[:, :-1], ids[:, 1:], torch.arange(seq).expand(opts.batch, seq)

    def step(model):
        return lambda: model(tokens, positions, labels).mean().backward()

    return [("model fwd + bwd", "ours", milliseconds(step(ours), opts.repeat),
             "HF GPT2LMHeadModel", milliseconds(step(theirs), opts.repeat))]


def main(argv) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per step (batch x seq)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--params", type=int, default=16_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    opts = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = output_layer_rows(opts) + adamw_row(opts) + model_row(opts)
    print(f"one thread; {opts.tokens} tokens, hidden {opts.hidden_size}, vocab {VOCAB}, "
          f"{opts.num_layers} layers; fastest of {opts.repeat}")
    print(f"{'part':22} {'ours':>24} {'ms':>9}   {'reference':>24} {'ms':>9}  ours faster")
    for part, ours_name, ours_ms, ref_name, ref_ms in rows:
        print(f"{part:22} {ours_name:>24} {ours_ms:9.1f}   {ref_name:>24} {ref_ms:9.1f}  {ref_ms / ours_ms:6.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
