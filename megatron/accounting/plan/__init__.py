"""The planner's library: which ZeRO option fits a model on given GPUs, and how long its step is
(tools/zero_plan.py is its command line; bench/bench_long_sequences.py calls it too).

flags.py parses the command line into PlanFlags; request.py resolves them once into a PlanRequest (the model, by
the training's preset rule, and its layout, refused in the training's words); hardware.py holds the GPU kinds and
projects a step onto them; calibration.py scales that bound by what published runs reach (published.py fits it);
options.py plans every ZeRO option; levers.py finds the longest sequence of each long-sequence lever combination
(alst.py holds it to ALST's published runs); choice.py picks one; report.py prints them. The numbers come from
megatron/accounting/predict/, as the training runs' predictions do.
"""
from megatron.accounting.plan.choice import checkpoint_advice, choose, remedies
from megatron.accounting.plan.flags import PlanFlags, parse_flags
from megatron.accounting.plan.levers import LEVERS, Longest, levers
from megatron.accounting.plan.options import OPTIONS, Plan, plan
from megatron.accounting.plan.request import PlanRequest, model_config, plan_request
from megatron.accounting.plan.units import PlanError

__all__ = ["LEVERS", "Longest", "OPTIONS", "Plan", "PlanError", "PlanFlags", "PlanRequest", "checkpoint_advice",
           "choose", "levers", "model_config", "parse_flags", "plan", "plan_request", "remedies"]
