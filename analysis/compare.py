"""A sweep beside a reference sweep (analysis/reference.py): loss, traffic and memory, reference vs new.

The experiments pair by ZeRO stage and offload. Each pair gets a table of the reference's figure, the new
one and the difference; settings that differ (model, ranks, batch, sequence length) are stated in one line
above it, and experiments only one side has are named. Losses compare at the logged points both runs reached
(the same consumed tokens), so a shorter new run compares over its prefix. Timings are never compared: they
depend on the machine.
"""
from __future__ import annotations

from analysis.reference import SETTINGS, Reference, RunFigures, run_figures
from analysis.run_summary import RunSummary

_SETTING_NAMES = {"model": "model", "world_size": "ranks", "micro_batch": "micro batch",
                  "global_batch": "global batch", "seq_length": "seq length"}
# (RunFigures.traffic key, row name, digits); the comm line prints MB with 3 decimals
_TRAFFIC_ROWS = [("traffic_mb", "sent per iteration, measured (MB)", 3),
                 ("traffic_predicted_mb", "sent per iteration, predicted (MB)", 3),
                 ("traffic_bytes_per_param", "bytes sent per parameter", 3)]
# the model-state line prints GB with 4 decimals
_MEMORY_ROWS = [("model_state_measured_gb", "model states per rank, measured (GB)", 4),
                ("zero_estimate_gb", "model states per rank, ZeRO estimate (GB)", 4),
                ("offloaded_gb", "offloaded per rank, measured (GB)", 4),
                ("offloaded_estimate_gb", "offloaded per rank, predicted (GB)", 4),
                ("activations_gb", "activations per micro-batch, measured (GB)", 4),
                ("activations_estimate_gb", "activations per micro-batch, predicted (GB)", 4)]


def _number(value: float | None, digits: int) -> str:
    return "" if value is None else f"{value:,.{digits}f}"


def _difference(reference: float | None, new: float | None, digits: int) -> str:
    """new - reference at the shown precision ("same" when that rounds to nothing), and relative to it."""
    if reference is None or new is None:
        return ""
    difference = round(new, digits) - round(reference, digits)
    if abs(difference) < 0.5 * 10 ** -digits:
        return "same"
    relative = f" ({difference / reference:+.1%})" if reference else ""
    return f"{difference:+,.{digits}f}{relative}"


def _row(name: str, reference: float | None, new: float | None, digits: int) -> str:
    return (f"| {name} | {_number(reference, digits)} | {_number(new, digits)} | "
            f"{_difference(reference, new, digits)} |")


def _iteration(figures: RunFigures, tokens: int) -> str:
    """The iteration that had consumed `tokens` (constant batch), for the reader; tokens where unknown."""
    per_iteration = (figures.settings.get("global_batch") or 0) * (figures.settings.get("seq_length") or 0)
    return f"iteration {tokens // per_iteration}" if per_iteration else f"{tokens:,} tokens"


def _loss_rows(reference: RunFigures, new: RunFigures) -> tuple[list[str], str]:
    """The loss rows, and a note when the runs logged different lengths."""
    ref_curve, new_curve = dict(reference.loss), dict(new.loss)
    common = sorted(set(ref_curve) & set(new_curve))
    if not common:
        return [], "no logged loss at the same consumed tokens: losses not compared"
    last = common[-1]
    rows = [_row(f"lm loss at {_iteration(reference, last)} (the last both logged)", ref_curve[last],
                 new_curve[last], 4),
            _row(f"lm loss, mean over the {len(common)} logged points both reached",
                 sum(ref_curve[t] for t in common) / len(common), sum(new_curve[t] for t in common) / len(common), 4)]
    note = ""
    if max(ref_curve) != max(new_curve):
        note = (f"lengths differ: the reference logged up to {_iteration(reference, max(ref_curve))}, the new run up "
                f"to {_iteration(new, max(new_curve))}; losses compared over what both logged; final lm loss "
                f"{ref_curve[max(ref_curve)]:.4f} (reference), {new_curve[max(new_curve)]:.4f} (new)")
    return rows, note


def _settings_line(reference: RunFigures, new: RunFigures) -> str:
    differ = [f"{_SETTING_NAMES[name]} {reference.settings.get(name)} (reference) vs {new.settings.get(name)} (new)"
              for name in SETTINGS if reference.settings.get(name) != new.settings.get(name)]
    return ("settings differ: " + ", ".join(differ) + "; the figures below are not like for like") if differ else ""


def experiment_table(reference: RunFigures, new: RunFigures, new_run: str) -> str:
    loss_rows, loss_note = _loss_rows(reference, new)
    lines = [f"### {reference.label} (new: {new_run}, {new.status})\n"]
    lines += [f"{line}\n" for line in (_settings_line(reference, new), loss_note) if line]
    lines += ["| figure | reference | new | new - reference |", "| --- | --- | --- | --- |"] + loss_rows
    for rows, ref_values, new_values in ((_TRAFFIC_ROWS, reference.traffic, new.traffic),
                                         (_MEMORY_ROWS, reference.memory, new.memory)):
        lines += [_row(name, ref_values.get(key), new_values.get(key), digits) for key, name, digits in rows
                  if ref_values.get(key) is not None or new_values.get(key) is not None]
    return "\n".join(lines) + "\n"


def _pick(reference: RunFigures, candidates: list[tuple[RunSummary, RunFigures]]) -> tuple[RunSummary, RunFigures]:
    """Of the new runs of one experiment, the first with the reference's settings, else the first."""
    return next((c for c in candidates if c[1].settings == reference.settings), candidates[0])


def compare_markdown(reference: Reference, folder: str, summaries: list[RunSummary], skip_first: int) -> str:
    """The comparison page: how the reference was made, the experiments missing on either side, one table per
    experiment both have."""
    made = reference.made_by
    lines = ["# Compared with the reference sweep\n",
             f"Reference: {folder}, made by `{made.get('command')}` at commit {made.get('commit')} "
             f"(python {made.get('python')}, torch {made.get('torch')}, deepspeed {made.get('deepspeed')}, "
             f"{made.get('accelerator')}). Loss, traffic and memory only: timings depend on the machine.\n"]
    if made.get("skip_first") is not None and made["skip_first"] != skip_first:
        lines.append(f"The reference's traffic means leave out the first {made['skip_first']} logged intervals, "
                     f"these the first {skip_first} (--skip-first).\n")
    new = [(s, run_figures(s)) for s in summaries]
    by_experiment: dict[tuple, list] = {}
    for pair in new:
        by_experiment.setdefault(pair[1].experiment, []).append(pair)
    missing_new = [r.label for r in reference.runs if r.experiment not in by_experiment]
    reference_experiments = {r.experiment for r in reference.runs}
    missing_reference = [s.label for s, f in new if f.experiment not in reference_experiments]
    if missing_new:
        lines.append(f"Not in the new sweep: {', '.join(missing_new)}.\n")
    if missing_reference:
        lines.append(f"Not in the reference: {', '.join(missing_reference)}.\n")
    for ref in reference.runs:
        if ref.experiment in by_experiment:
            summary, figures = _pick(ref, by_experiment[ref.experiment])
            lines.append(experiment_table(ref, figures, summary.run))
    return "\n".join(lines)
