"""tools/zero_plan.py's projection against published large training runs (tools/published_runs.json, the table
in docs/zero-tradeoff.md, "Checked against published runs"): each run's predicted hardware TFLOP/s per GPU over
the published one stays inside the band the docs state, so a change to the time model that breaks the projection
fails here."""
import importlib.util
import json
from pathlib import Path

import pytest

from megatron.model import accounting
from megatron.model.config import GPTConfig

ROOT = Path(__file__).resolve().parent.parent
RUNS = json.loads((ROOT / "tools" / "published_runs.json").read_text())
_spec = importlib.util.spec_from_file_location("zero_plan", ROOT / "tools" / "zero_plan.py")
zero_plan = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(zero_plan)


def predict(run: dict) -> tuple[float, float]:
    """(predicted seconds per step, predicted hardware TFLOP/s per GPU) of one published run: zero_plan's flags
    for the hardware, the run's shape and layout as it trained (layers need not divide into the stages)."""
    ns = zero_plan.parse_args(["--num-layers", str(run["num_layers"]), "--seq-length", str(run["seq_length"]),
                               "--micro-batch-size", "1", "--gpus", str(run["gpus_per_node"]), "--gpu", run["gpu"],
                               "--precision", run["precision"], "--inter-node-bandwidth",
                               run["inter_node_bandwidth"]])
    hardware = zero_plan.hardware(ns)
    tp, pp, world = run["tp"], run["pp"], run["gpus_per_node"] * run["nodes"]
    padded = -(-run["vocab_size"] // (128 * tp)) * 128 * tp
    config = GPTConfig(num_layers=run["num_layers"], hidden_size=run["hidden_size"],
                       num_attention_heads=run["num_attention_heads"], seq_length=run["seq_length"],
                       max_position_embeddings=run["seq_length"], padded_vocab_size=padded,
                       recompute_activations=run["recompute"])
    dp = world // (tp * pp)
    accumulation = run["global_batch_size"] // (run["micro_batch_size"] * dp)
    assert accumulation * run["micro_batch_size"] * dp == run["global_batch_size"], run["name"]
    setup = accounting.TrainingSetup(
        world_size=world, micro_batch_size=run["micro_batch_size"], gradient_accumulation_steps=accumulation,
        tensor_parallel_size=tp, pipeline_parallel_size=pp, precision=run["precision"],
        zero_stage=run["zero_stage"], activation_recompute=run["recompute"])
    step = zero_plan.project(config, setup, hardware, run["gpus_per_node"], run["nodes"]).total
    flops = accounting.hardware_flops_per_iteration(config, run["global_batch_size"])
    return step, flops / step / world / 1e12


@pytest.mark.parametrize("run", RUNS["runs"], ids=[run["name"] for run in RUNS["runs"]])
def test_projection_within_the_band_of_the_published_throughput(run):
    step, tflops = predict(run)
    low, high = RUNS["band"]
    ratio = tflops / run["published_tflops_per_gpu"]
    assert low <= ratio <= high, f"{run['name']}: predicted {tflops:.0f} TFLOP/s per GPU, published " \
                                 f"{run['published_tflops_per_gpu']}: {ratio:.2f}"
    if "published_step_s" in run:  # the same check in seconds per step where the source gives them
        assert low <= run["published_step_s"] / step <= high


def test_the_table_has_at_least_four_runs_with_sources():
    assert len(RUNS["runs"]) >= 4 and all(run["source"] and run["assumed"] for run in RUNS["runs"])


if __name__ == "__main__":  # prints the docs' table rows
    for run in RUNS["runs"]:
        step, tflops = predict(run)
        print(f"| {run['name']} | {step:.2f} | {tflops:.0f} | {run['published_tflops_per_gpu']} | "
              f"{tflops / run['published_tflops_per_gpu']:.2f} |")
