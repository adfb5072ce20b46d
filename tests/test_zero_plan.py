"""tools/zero_plan.py: every option's predicted memory and traffic, the pick, one-line refusals, and its
predictions against the five real CPU driver runs (conftest.five_driver_runs)."""
import json
import re

import pytest

from conftest import tool_in_process
from megatron.model import accounting
from megatron.model.config import GPTConfig

EXAMPLE = ["--model-size", "1.3B", "--seq-length", "1024", "--micro-batch-size", "4", "--gpus", "8",
           "--gpu-memory", "40GB"]
OPTIONS = ["DP", "Z1", "Z2", "Z3", "Z3 + optimizer offload", "Z3 + full offload", "Z3 + NVMe offload"]


def plan_json(capsys, *args):
    code, out, err = tool_in_process(capsys, "zero_plan.py", *args, "--json")
    assert code == 0, err
    return json.loads(out)


def test_readme_example_prints_every_option_and_a_pick(capsys):
    code, out, err = tool_in_process(capsys, "zero_plan.py", *EXAMPLE)
    assert code == 0 and err == ""
    assert out.startswith("1.3B: 1.31B parameters, seq 1024, micro batch 4, 8 GPUs (TP=1, PP=1), bf16\n")
    rows = [line for line in out.splitlines() if line.startswith(("DP ", "Z"))]
    assert [re.split(r"\s{2,}", row)[0] for row in rows] == OPTIONS
    # without gradient accumulation DP, Z1 and Z2 send the same, so the pick leaves the most memory free;
    # Z1 and Z2 then keep the same gradients (DeepSpeed reduces stage 1's at the only backward of a step)
    assert out.rstrip().endswith("(Z2 needs as much and sends as much; DP sends as little but leaves less memory free)")
    assert "\npick: Z1: fits (" in out


def test_predictions_are_the_accounting_functions(capsys):
    data = plan_json(capsys, *EXAMPLE)
    plans = {p["option"]: p for p in data["plans"]}
    config = GPTConfig(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=1024,
                       max_position_embeddings=1024, padded_vocab_size=50304)
    for option, stage in (("DP", 0), ("Z1", 1), ("Z2", 2), ("Z3", 3)):
        setup = accounting.TrainingSetup(world_size=8, micro_batch_size=4, precision="bf16", zero_stage=stage)
        memory = accounting.memory_per_rank(config, setup)
        assert plans[option]["total_gb"] == pytest.approx(memory["total"] / 2**30)
        assert plans[option]["traffic_gb"] == pytest.approx(
            sum(accounting.zero_traffic_per_step(config, setup).values()) / 2**30)
    # the ZeRO paper's ratios: stage 3 sends 1.5x, its model states are a quarter of stage 1's here
    assert plans["Z3"]["traffic_gb"] == pytest.approx(1.5 * plans["Z1"]["traffic_gb"])
    assert plans["DP"]["model_states_gb"] > plans["Z1"]["model_states_gb"] == plans["Z2"]["model_states_gb"] \
        > plans["Z3"]["model_states_gb"] > plans["Z3 + optimizer offload"]["model_states_gb"]
    assert plans["Z3 + full offload"]["pcie_gb"] > plans["Z3 + optimizer offload"]["pcie_gb"] > 0
    assert data["choice"] == "Z1"


def test_explicit_shape_equals_the_preset(capsys):
    shape = ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16"]
    assert plan_json(capsys, *EXAMPLE[2:], *shape)["plans"] == plan_json(capsys, *EXAMPLE)["plans"]


def test_two_nodes_tensor_parallel_and_a_model_that_fits_nowhere(capsys):
    data = plan_json(capsys, *EXAMPLE, "--nodes", "2", "--tp", "2")
    assert len(data["plans"]) == 7 and data["choice"] is not None
    data = plan_json(capsys, "--model-size", "175B", "--seq-length", "2048", "--micro-batch-size", "1", "--gpus", "8",
                     "--gpu-memory", "40GB")
    assert data["choice"] is None and data["why"].startswith("nothing fits")
    # pipeline parallelism: DeepSpeed's pipeline engine takes ZeRO 0 and 1 only
    data = plan_json(capsys, *EXAMPLE, "--pp", "2")
    assert [p["option"] for p in data["plans"]] == ["DP", "Z1"]


@pytest.mark.parametrize("extra, message", [
    (["--gpus", "6", "--tp", "4"], "error: world size 6 is not divisible by --tensor-model-parallel-size 4 x "
                                   "--pipeline-model-parallel-size 1"),
    (["--tp", "3"], "error: --num-attention-heads 16 is not divisible by --tensor-model-parallel-size 3"),
    (["--pp", "5"], "error: --num-layers 24 is not divisible by --pipeline-model-parallel-size 5"),
    (["--gpu-memory", "lots"], "error: --gpu-memory 'lots': expected a size such as 40GB or 80GiB"),
    (["--model-size", "2B"], "error: --model-size 2B: unknown preset (choose from tiny, 125M, "),
    (["--global-batch-size", "12"], "error: --global-batch-size 12 is not divisible by --micro-batch-size 4 x "
                                    "data-parallel size 8"),
    (["--nodes", "0"], "error: --nodes must be >= 1, got 0"),
])
def test_impossible_layouts_are_refused_in_one_line(capsys, extra, message):
    code, out, err = tool_in_process(capsys, "zero_plan.py", *EXAMPLE, *extra)
    assert code == 1 and out == ""
    assert err.startswith(message) and err.count("\n") == 1


@pytest.mark.slow
def test_plan_matches_the_measured_cpu_runs(capsys, five_driver_runs):
    """The planner's traffic and model states for the drivers' CPU experiment (tiny, seq 64, micro-batch 4,
    2 ranks, global batch 8, fp32) within 10% of what the six runs measured and logged."""
    runs, result = five_driver_runs
    assert result.returncode == 0, result.stderr[-3000:]
    plans = {p["option"]: p for p in plan_json(
        capsys, "--model-size", "tiny", "--seq-length", "64", "--micro-batch-size", "4", "--global-batch-size", "8",
        "--gpus", "2", "--gpu-memory", "1GB", "--precision", "fp32")["plans"]}
    for run, option in (("DP", "DP"), ("Z1", "Z1"), ("Z2", "Z2"), ("Z3", "Z3"), ("Z3_OL", "Z3 + full offload"),
                        ("Z3_NVMe", "Z3 + NVMe offload")):
        log = (runs / f"gpt_tiny_{run}" / "train.log").read_text()
        sent = [float(v) for v in re.findall(r"comm at iteration +\d+ \|.* total=(\d+\.\d+)MB", log)]
        assert len(sent) == 4
        # the first step of stage 3 fetches a few parameters twice; later steps are steady
        assert sent[-1] * 2**20 == pytest.approx(plans[option]["traffic_gb"] * 2**30, rel=0.10), run
        measured = dict(re.findall(r"(\w+)=(\d+\.\d+)", re.search(r"measured: ([^|]*)", log).group(1)))
        plan = plans[option]
        for key in ("params", "grads", "optim", "offloaded"):
            assert float(measured[key]) == pytest.approx(plan[f"{key}_gb"], rel=0.10, abs=1e-4), (run, key)
