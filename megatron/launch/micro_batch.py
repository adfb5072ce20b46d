"""The examples_zero drivers' micro-batch on a GPU when MICRO_BATCH is not given: the largest that the memory model
predicts fits the GPU's memory less a headroom (megatron/accounting/predict/fit.py, as tools/zero_plan.py's fit), for
the run's own flags: its model, stage, offload, precision, sequence, layout and GLOBAL_BATCH or GAS (docs/gpu.md).
The launch planner (which imports no torch, and the model's config does) runs it in the ranks' Python,

    python -m megatron.launch.micro_batch WORLD DEVICE_BYTES GLOBAL_BATCH|- -- PRETRAIN_FLAGS...

and reads one JSON line: the micro-batch, its accumulation, the predicted bytes and the line the launch prints;
or one `error:` line, exit 1.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, replace

from megatron.errors import ZeroLabError
from megatron.accounting.predict.fit import MicroBatchPlan, largest_micro_batch

# the drivers tokenize with GPT-2's BPE (VOCAB_FILE, MERGE_FILE): its vocabulary where the files are not made yet
GPT2_VOCABULARY = 50257


def _vocabulary(data) -> int:
    """The vocabulary the run's tokenizer will have: built from the run's files where they are there."""
    from megatron.tokenizer.tokenizer import build_tokenizer

    if all(path is None or os.path.isfile(path) for path in (data.vocab_file, data.merge_file, data.tokenizer_model)):
        try:
            return build_tokenizer(data, verbose=False).vocab_size
        except (ZeroLabError, OSError, ValueError):
            # a tokenizer file that does not load is the run's own one-line error at start-up: plan as for GPT-2
            return GPT2_VOCABULARY
    return GPT2_VOCABULARY


def plan_for_flags(argv: list[str], world: int, device_bytes: int, global_batch: int | None) -> MicroBatchPlan:
    """The pure part: pretrain_gpt.py's flags `argv` (any micro-batch) as a run of `world` GPU ranks with
    `device_bytes` each parses them; GLOBAL_BATCH when the user gave one, else the flags' accumulation stays."""
    import torch

    from megatron.arguments import parse_args
    from megatron.accounting.run_setup import training_setup
    from megatron.initialize import DistInfo
    from megatron.tokenizer.tokenizer import padded_vocab_size

    args = parse_args(argv, world, "cuda")
    vocabulary = padded_vocab_size(_vocabulary(args.data), args.data.make_vocab_size_divisible_by,
                                   args.parallel.tensor_model_parallel_size)
    config = replace(args.model, padded_vocab_size=vocabulary)
    setup = training_setup(args, DistInfo(rank=0, local_rank=0, world_size=world, device=torch.device("cuda")))
    return largest_micro_batch(config, setup, device_bytes, global_batch)


def main(argv: list[str]) -> int:
    world, device_bytes, global_batch = int(argv[0]), int(argv[1]), None if argv[2] == "-" else int(argv[2])
    flags = argv[argv.index("--") + 1:]
    try:
        plan = plan_for_flags(flags, world, device_bytes, global_batch)
    except ZeroLabError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(json.dumps(dict(asdict(plan), line=plan.line())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
