"""Which option to pick, and why, in one line (`choose`: the fastest that fits where steps are timed, else the
one that moves the least data), what would make one fit when none does (`remedies`), and the checkpoint interval
of the pick (`checkpoint_advice`, megatron/checkpointing/interval.py's Young/Daly rule)."""
from __future__ import annotations

from megatron import accounting
from megatron.accounting.plan.options import Plan, option_stage
from megatron.accounting.plan.request import PlanRequest
from megatron.accounting.predict.memory import checkpoint_bytes
from megatron.checkpointing import interval


def remedies(plans: list[Plan], request: PlanRequest) -> str:
    """What would make an option fit, for the "nothing fits" line: only the changes that shrink what overflows
    (a micro-batch already 1 cannot be lowered, recomputation already on cannot be added, and more GPUs shrink
    only the model states ZeRO-3 partitions, not the activations)."""
    steps = ["raise --tp or --pp"]
    if request.flags.micro_batch_size > 1:
        steps.append("lower --micro-batch-size")
    if not request.flags.recompute:
        steps.append("add --recompute")
    if any(p.activations_gb + p.output_buffer_gb < request.usable_gb for p in plans):
        steps.append("use more GPUs")  # the model states are what overflows: more ranks partition them finer
    return steps[0] if len(steps) == 1 else ", ".join(steps[:-1]) + ", or " + steps[-1]


def choose(plans: list[Plan], remedy: str) -> tuple[Plan | None, str]:
    """With step times (--gpu), the fastest option that fits (`choose_by_time`); without, by data moved.
    `remedy`: what the "nothing fits" line suggests (`remedies`)."""
    if any(p.step_ms is not None for p in plans):
        return choose_by_time(plans, remedy)
    return choose_by_traffic(plans, remedy)


def choose_by_time(plans: list[Plan], remedy: str) -> tuple[Plan | None, str]:
    """The option that fits with the shortest predicted step; of options as fast (to 0.1%), the one that
    leaves the most memory free. The reason names the step's largest part and the runner-up."""
    timed = [p for p in plans if p.fits and p.step_ms is not None]
    if not timed:
        return choose_by_traffic(plans, remedy)
    fastest = min(p.step_ms for p in timed)
    best = min((p for p in timed if p.step_ms <= fastest * 1.001), key=lambda p: p.total_gb)
    parts = {"compute": best.compute_ms, "communication": best.communication_ms, "offload": best.offload_ms,
             "bubble": best.bubble_ms}
    largest = max(parts, key=parts.get)
    why = (f"fits ({best.total_gb:.1f} GB per GPU) and has the shortest predicted step of those that fit, "
           f"{best.step_ms:.0f} ms ({largest} {parts[largest]:.0f} ms)")
    rest = sorted((p for p in timed if p is not best), key=lambda p: p.step_ms)
    if rest:
        why += f"; next {rest[0].option} {rest[0].step_ms:.0f} ms ({rest[0].step_ms / best.step_ms:.2f}x)"
    missing = [p.option for p in plans if not p.fits]
    if missing:
        why += f"; {', '.join(missing)} {'does' if len(missing) == 1 else 'do'} not fit"
    untimed = [p.option for p in plans if p.fits and p.step_ms is None]
    if untimed:
        why += f"; {', '.join(untimed)} not timed (give --nvme-bandwidth)"
    return best, why


def choose_by_traffic(plans: list[Plan], remedy: str) -> tuple[Plan | None, str]:
    """The option that fits with the least data moved per step (sent, plus PCIe and NVMe for offload);
    among those that move as little (DP, Z1 and Z2 without gradient accumulation; in bf16 DP and Z2, as
    stage 1's bf16 optimizer sends 1.5x), the one that leaves the most memory free, room for a larger
    micro-batch, the lower stage where two need as much (without accumulation DeepSpeed's fp32 and fp16
    stage 1 keeps the gradients stage 2 does)."""
    fitting = [p for p in plans if p.fits]
    if not fitting:
        return None, f"nothing fits: {remedy}"
    def moved(p: Plan) -> float:
        return round(p.traffic_gb + p.pcie_gb + p.nvme_gb, 6)
    least = min(moved(p) for p in fitting)
    best = min((p for p in fitting if moved(p) == least), key=lambda p: p.total_gb)
    alike = [p for p in fitting if moved(p) == least and p is not best]
    same = [p.option for p in alike if round(p.total_gb, 6) == round(best.total_gb, 6)]
    more = [p.option for p in alike if p.option not in same]
    why = f"fits ({best.total_gb:.1f} GB per GPU) and sends {best.traffic_gb:.2f} GB per GPU per step"
    why += f" plus {best.pcie_gb:.2f} GB over PCIe" if best.pcie_gb else ""
    why += ", the least of the options that fit"
    def verbs(options: list[str], one: str, many: str) -> str:
        return f"{', '.join(options)} {one if len(options) == 1 else many}"
    notes = [verbs(same, "needs as much and sends", "need as much and send") + " as much"] if same else []
    if more:
        notes.append(verbs(more, "sends as little but leaves", "send as little but leave") + " less memory free")
    if notes:
        why += f" ({'; '.join(notes)})"
    missing = [p.option for p in plans if not p.fits]
    if missing:
        why += f"; {', '.join(missing)} {'does' if len(missing) == 1 else 'do'} not fit"
    return best, why



def checkpoint_advice(request: PlanRequest, best: Plan | None) -> dict | None:
    """With --storage-bandwidth and --mtbf-hours: the checkpoint's size and predicted save time, and the
    Young/Daly interval (megatron/checkpointing/interval.py), in iterations of the picked option where its step
    is timed (--gpu)."""
    if request.storage_bytes_per_s is None:
        return None
    mtbf_hours = request.flags.mtbf_hours
    stage = 3 if best is None else option_stage(best.option)[1]
    size = checkpoint_bytes(accounting.count_parameters(request.config), request.flags.precision, stage)
    save_s = size / request.storage_bytes_per_s
    best_s = interval.optimal_interval_seconds(save_s, mtbf_hours * 3600)
    step_s = best.step_ms / 1e3 if best is not None and best.step_ms is not None else None
    return dict(bytes=size, save_s=save_s, mtbf_hours=mtbf_hours, interval_s=best_s,
                interval_iterations=None if step_s is None else max(1, round(best_s / step_s)),
                lost_fraction=interval.expected_loss_fraction(best_s, save_s, mtbf_hours * 3600))

