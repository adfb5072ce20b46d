"""Which ZeRO stage fits my model on my GPUs, and how long is a step? Memory, traffic and time of every option.

    python tools/zero_plan.py --model-size 1.3B --seq-length 1024 --micro-batch-size 4 --gpus 8 --gpu-memory 40GB
    python tools/zero_plan.py --num-layers 24 --hidden-size 2048 --num-attention-heads 16 ... --nodes 2 --tp 2
    python tools/zero_plan.py --model-size 13B --gpus 8 --nodes 8 --gpu A100-80GB --inter-node-bandwidth 200Gbit \
        --tokens 300B

For plain data parallelism, ZeRO 1, 2, 3 and stage 3 with the optimizer, then everything, offloaded to
host memory (and to NVMe), it prints the predicted memory per GPU (model states, activations, the
output-layer buffer), the bytes each GPU sends per step, what offload moves over PCIe, whether it fits,
and which option to pick. With --gpu it also predicts each option's expected step time (compute, exposed
communication, offload transfers, the pipeline's bubble; the bound, every FLOP at the large-matmul rate and every
link at its nominal bandwidth, with what it leaves out, calibrated on the published runs of
tools/published_runs.json), the bound beside it, tokens/s, TFLOP/s per GPU and, with --tokens, the days to
train, and picks the fastest option that fits. With --storage-bandwidth and --mtbf-hours it prints
the checkpoint's size, its save time and the interval between saves that loses the least time (docs/faults.md);
with --async-save, the host memory --async-save's copy of a GPU's checkpoint files takes (docs/checkpoints.md).
Under the longest sequence each option fits, it prints the longest each long-sequence lever combination fits
(recomputation, then --tiled-mlp-compute and --tiled-logits-loss, then --checkpoint-in-cpu; the trainer's flags,
which also plan every table when given) within the GPU and the host memory per node (--host-gb), and
`--alst-check` alone prints the planner beside ALST's published longest sequences (docs/long-sequences.md).
The numbers come from megatron/accounting/predict/, the same functions whose predictions the training runs print
beside their measurements (docs/zero-tradeoff-reference.md, "Time per step: the model" and "Projecting a step onto GPUs");
the planner itself is megatron/accounting/plan/, of which this is the command line.
"""

import sys

from megatron.accounting.plan import checkpoint_advice, choose, levers, parse_flags, plan, plan_request, remedies
from megatron.accounting.plan import alst, report
from megatron.errors import ZeroLabError


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--alst-check"]:
        print(alst.check_table(alst.check()))
        return 0
    flags = parse_flags(argv, description=__doc__.splitlines()[0])
    try:
        request = plan_request(flags)
        plans = plan(request)
        longest = levers(request)
        best, why = choose(plans, remedies(plans, request))
        advice = checkpoint_advice(request, best)
    except ZeroLabError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if flags.json:
        print(report.json_report(request, plans, best, why, advice, longest))
        return 0
    print(report.header(request))
    print(report.table(plans, request.usable_gb))
    print("\n" + report.longest_table(plans, request))
    print("\n" + report.lever_table(longest, request))
    if request.hardware is not None:
        print(report.step_time_header(request))
        print(report.time_table(plans, request.token_budget is not None, flags.pp > 1, flags.recompute))
    notes = report.notes(request, plans)
    if notes:
        print("\n" + "\n".join(notes))
    print(f"\npick: {best.option}: {why}" if best else f"\npick: none: {why}")
    if advice:
        print(report.checkpoint_line(advice, request))
    return 0


if __name__ == "__main__":
    sys.exit(main())
