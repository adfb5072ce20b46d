"""Write docs/megatron-flags.md: the table of Megatron-DeepSpeed's flags (honoured, accepted with a line, refused),
made from the parser (megatron/arguments.py, megatron/upstream_flags.py) and the scripts' flags
(tests/fixtures/megatron_deepspeed_flags.tsv), so that it cannot drift; tests/test_upstream_flags.py checks that
the committed page is this text.

    python tools/megatron_flags_doc.py"""
import argparse
from pathlib import Path

from megatron.arguments import build_parser
from megatron.upstream_flags import flags_table

ROOT = Path(__file__).resolve().parent.parent

FIXTURE = ROOT / "tests" / "fixtures" / "megatron_deepspeed_flags.tsv"
PAGE = ROOT / "docs" / "megatron-flags.md"

INTRO = """# Megatron-DeepSpeed's flags

`pretrain_gpt.py` takes Megatron-DeepSpeed's flag names. This table lists every training flag of
Megatron-DeepSpeed's GPT example scripts (`examples_deepspeed/`: MoE, curriculum learning, sequence parallel,
Llama, universal checkpointing, data efficiency, rebase; `tests/fixtures/megatron_deepspeed_flags.tsv` says how it
was read from them) and what zero-lab does with each. None ends a run with argparse's "unrecognized arguments":

- **honoured**: an ordinary flag, with Megatron-DeepSpeed's meaning (the text is its `--help`);
- **accepted with a line**: the flag picks a path zero-lab chooses by itself (a CUDA kernel, the backend, a
  behaviour that is zero-lab's only one); the run prints `note: <flag> accepted: <what zero-lab does>` once at
  start-up, on the rank that prints, and goes on;
- **refused**: zero-lab has no such feature; the run stops before it starts, with `error: <flag> is not supported:
  <what to use instead>` and exit status 1.

Where a flag is honoured only in some combinations, the others are refused in one line naming the flags:
`--recompute-granularity full` maps onto zero-lab's activation checkpointing, which recomputes every layer of a
pipeline stage one layer at a time, so `--recompute-method uniform` needs `--recompute-num-layers 1` and
`--recompute-method block` all of a stage's layers (or 0, no recompute); `--recompute-granularity selective` is
accepted with a line. `--checkpoint-in-cpu` needs recompute (`--checkpoint-activations` or
`--recompute-granularity full`): each layer's input then waits in host memory until its recompute (zero-lab's host
tier, emulated on CPU ranks; with `--deepspeed-activation-checkpointing` DeepSpeed's cpu_checkpointing, on CUDA
only: docs/long-sequences.md). `--loss-scale` and
`--hysteresis` are the fp16 section's `loss_scale` and `hysteresis` of the DeepSpeed JSON, under the rule every
setting shared with a `--deepspeed_config` JSON follows (they must agree with the JSON's). `--no-load-optim`
resumes without the optimizer states and without the learning-rate schedule's step (Megatron's meaning: the
schedule starts again), and cannot be combined with `--universal-checkpoint`. `--optimizer sgd` cannot be combined
with `--zero-offload-optimizer`; `--log-optimizer-states-to-tensorboard` cannot be combined with MoE layers
(docs/moe.md).

Regenerate after changing a flag: `python tools/megatron_flags_doc.py`. "scripts" counts the 34 scripts that pass
the flag (0: a flag of the two tables that no script passes, or one the evaluation harness's scripts pass).

"""


def script_flags() -> list[tuple[str, int]]:
    rows = [line.split("\t") for line in FIXTURE.read_text().splitlines() if line and not line.startswith("#")]
    return [(flag, int(count)) for flag, count, _ in rows]


def page_text() -> str:
    return INTRO + flags_table(build_parser(), script_flags())


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    PAGE.write_text(page_text())
    print(f"wrote {PAGE}")
