"""tools/zero_plan.py's long-sequence levers: the longest sequence of each lever combination (recomputation, the
tiled MLP and loss, the layer inputs in host memory; megatron/accounting/plan/levers.py), held to
megatron/accounting/predict/memory.py's figures at that length and one slice longer, the host memory limit, the
trainer's flags, and ALST's published longest sequences beside the planner's (`--alst-check`)."""
import json
import re
from dataclasses import replace

import pytest

from conftest import tool_in_process
from megatron import accounting

LONG = ["--model-size", "1.3B", "--gpus", "8", "--gpu-memory", "80GB", "--use-rotary-position-embeddings",
        "--seq-length", "1048576", "--ds-sequence-parallel-size", "8"]
LEVER_FLAGS = ["--recompute", "--tiled-mlp-compute", "--tiled-logits-loss", "--checkpoint-in-cpu"]
ROWS = ["none", "recompute", "+ tiled MLP and loss", "+ layer inputs in host memory"]


def run(capsys, *args):
    code, out, err = tool_in_process(capsys, "zero_plan.py", *args)
    assert code == 0 and err == "", err
    return out


def lever_rows(out: str) -> dict[str, list[str]]:
    """The printed lever table: label -> [adds, longest, option, GPU GB, host GB/node, limit]."""
    block = out.split("longest sequence per lever")[1].split("\n\n")[0].splitlines()[2:]
    return {cells[0]: cells[1:] for cells in (re.split(r"\s{2,}", line.strip()) for line in block)}


def memory(config, setup, length):
    """(GPU GB, host GB per GPU) by memory_per_rank itself at `length` tokens."""
    numbers = accounting.memory_per_rank(replace(config, seq_length=length, max_position_embeddings=length), setup)
    return numbers["total"] / 2**30, (numbers["offloaded"] + numbers["activations_offloaded"]) / 2**30


def lever_model(args, recompute, tiled, offload):
    from megatron.accounting.plan import model_config, parse_flags
    config = model_config(parse_flags(args))
    return replace(config, recompute_activations=recompute, recompute_offload=offload, tiled_mlp_compute=tiled,
                   tiled_logits_loss=tiled)


def option_setup(label, recompute, offload, sp=8, gpus=8):
    from megatron.accounting.plan import OPTIONS
    _, stage, optimizer, params, device = next(option for option in OPTIONS if option[0] == label)
    return accounting.TrainingSetup(world_size=gpus, micro_batch_size=1, sequence_parallel_size=sp, precision="bf16",
                                    zero_stage=stage, offload_optimizer=optimizer, offload_params=params,
                                    offload_device=device, activation_recompute=recompute, activation_offload=offload)


def test_each_lever_row_is_the_longest_any_option_fits(capsys):
    """1.3B on 8 x 80 GB at SP=8: each row's longest fits 72 GB (and the host's 1024 GB per node) at its option,
    and one more slice of 8 tokens fits no option, by memory_per_rank; the rows lengthen in order; the recompute
    row is the per-option table's longest (the run's --recompute), the last that table's with every lever on."""
    from megatron.accounting.plan import OPTIONS
    out = run(capsys, *LONG)
    assert ("longest sequence per lever, each row adding to the one above (micro batch 1, SP=8, the option that fits "
            "it longest; limits: 72.0 GB per GPU, 1024 GB of host memory per node for the offloaded states and layer "
            "inputs, --host-gb):\n  levers") in out
    rows = lever_rows(out)
    assert list(rows) == ROWS
    assert [rows[label][0] for label in ROWS] == ["-", "--checkpoint-activations",
                                                  "--tiled-mlp-compute --tiled-logits-loss", "--checkpoint-in-cpu"]
    lengths = []
    for label, (recompute, tiled, offload) in zip(ROWS, [(False, False, False), (True, False, False),
                                                          (True, True, False), (True, True, True)]):
        config = lever_model(LONG, recompute, tiled, offload)
        longest, option = int(rows[label][1].replace(",", "")), rows[label][2]
        gpu, host = memory(config, option_setup(option, recompute, offload), longest)
        assert gpu <= 72.0 and 8 * host <= 1024, label
        assert f"{gpu:.1f}" == rows[label][3] and f"{8 * host:.1f}" == rows[label][4] and rows[label][5] == "GPU"
        for name, *_ in OPTIONS:
            gpu, host = memory(config, option_setup(name, recompute, offload), longest + 8)
            assert gpu > 72.0 or 8 * host > 1024, (label, name)
        lengths.append(longest)
    assert lengths == sorted(lengths) and len(set(lengths)) == 4  # each lever lengthens it
    per_option = lambda o: max(p["longest_seq"] for p in json.loads(o)["plans"])  # noqa: E731
    assert lengths[1] == per_option(run(capsys, *LONG, "--recompute", "--json"))
    every = json.loads(run(capsys, *LONG, *LEVER_FLAGS, "--json"))
    assert per_option(json.dumps(every)) == lengths[3]
    assert [row["longest_seq"] for row in every["levers"]] == lengths


def test_the_host_memory_binds_where_the_offloaded_layer_inputs_overflow_it(capsys):
    """With 200 GB of host memory per node the offloaded layer inputs (24 layers x s/8 x 2048 x 2 bytes on each of
    8 GPUs) bind before the GPU: the row says host, and that lever shortens the sequence rather than lengthens it."""
    out = run(capsys, *LONG, "--host-gb", "200")
    rows = lever_rows(out)
    adds, longest, option, gpu, host, limit = rows["+ layer inputs in host memory"]
    assert limit == "host" and float(host) <= 200
    longest = int(longest.replace(",", ""))
    config = lever_model(LONG, True, True, True)
    assert 8 * memory(config, option_setup(option, True, True), longest + 8)[1] > 200
    assert memory(config, option_setup(option, True, True), longest + 8)[0] <= 72.0  # the GPU would hold it
    assert longest < int(rows["+ tiled MLP and loss"][1].replace(",", ""))
    assert rows["+ tiled MLP and loss"][5] == "GPU"


def test_the_levers_plan_the_main_tables_as_the_training_runs_them(capsys):
    """The trainer's flags change every option's plan: the longest-sequence table names them, and Z3's activations
    are memory.py's with the MLP and loss tiled and the layer inputs in host memory (none left per layer)."""
    from megatron.accounting.plan import model_config, parse_flags
    args = [*LONG, *LEVER_FLAGS]
    out = run(capsys, *args)
    assert ("longest sequence that fits 72.0 GB per GPU (micro batch 1, with recomputation, tiled MLP, tiled loss, "
            "layer inputs in host memory, rotary positions, SP=8):") in out
    plans = {p["option"]: p for p in json.loads(run(capsys, *args, "--json"))["plans"]}
    config = model_config(parse_flags(args))
    assert config.tiled_mlp_compute and config.tiled_logits_loss and config.recompute_offload
    setup = option_setup("Z3", True, True)
    assert plans["Z3"]["activations_gb"] == pytest.approx(accounting.activation_bytes(config, setup) / 2**30, rel=1e-6)
    assert plans["Z3"]["total_gb"] == pytest.approx(memory(config, setup, 1048576)[0], rel=1e-6)
    untiled = {p["option"]: p for p in json.loads(run(capsys, *LONG, "--recompute", "--json"))["plans"]}
    assert plans["Z3"]["output_buffer_gb"] < untiled["Z3"]["output_buffer_gb"] / 8
    # the trainer's shard counts: 64 loss tiles hold a 64th of the [s/8, vocab] buffer
    sharded = {p["option"]: p for p in json.loads(run(capsys, *args, "--tiled-logits-loss-shards", "64",
                                                      "--tiled-mlp-shards", "4", "--json"))["plans"]}
    assert sharded["Z3"]["output_buffer_gb"] == pytest.approx(
        -(-1048576 // 8 // 64) * untiled["Z3"]["output_buffer_gb"] / (1048576 // 8), rel=1e-9)


@pytest.mark.parametrize("extra, message", [
    (["--checkpoint-in-cpu"], "error: --checkpoint-in-cpu keeps each recomputed layer's input in host memory: add "
                              "--checkpoint-activations (or --recompute), or drop it"),
    (["--host-gb", "0"], "error: --host-gb must be > 0 (GB of host memory per node), got 0"),
    (["--tiled-mlp-compute", "--tiled-mlp-shards", "-1"],
     "error: --tiled-mlp-shards must be an integer >= 0 (0: as ALST picks), got -1"),
    (["--model-size", "gpt-125m-moe8", "--tiled-mlp-compute"], None),
])
def test_lever_flags_the_training_refuses_are_refused_in_one_line(capsys, extra, message):
    code, out, err = tool_in_process(capsys, "zero_plan.py", *LONG, *extra)
    assert code == 1 and out == ""
    if message:
        assert err == message + "\n"
    else:  # the model's own refusal (megatron/model/config.py), naming --num-experts
        assert err.startswith("error: --tiled-mlp-compute cannot be combined with MoE layers") and err.count("\n") == 1


def test_an_moe_model_tiles_only_the_loss(capsys):
    rows = lever_rows(run(capsys, "--model-size", "gpt-125m-moe8", "--gpus", "8", "--gpu-memory", "80GB"))
    assert list(rows) == ["none", "recompute", "+ tiled loss", "+ layer inputs in host memory"]
    assert rows["+ tiled loss"][0] == "--tiled-logits-loss" and rows["none"][2].endswith("EP=8")


def alst_rows(out: str) -> list[list[str]]:
    lines = out.splitlines()
    assert lines[1].split() == ["setup", "option", "planned", "published", "planned", "/", "published", "limit"]
    return [re.split(r"\s{2,}", line.strip()) for line in lines[2:4]]


def test_alst_published_longest_sequences_beside_the_planners(capsys):
    """ALST (arXiv 2506.13996): Llama-3.1-8B at 500K tokens on one H100 80GB (ZeRO-3, everything offloaded) and
    3.7M on 8 (SP=8, the optimizer offloaded). The printed planned length is the per-option table's at that option
    for the command line it prints (another path through the planner), fits 72 GB by memory_per_rank and one slice
    more does not; every lever lengthens it; the planner is within 2x of the published figures (not fitted)."""
    from megatron.accounting.plan import model_config, parse_flags
    out = run(capsys, "--alst-check")
    assert out.startswith("ALST's published longest sequences (Bekman et al. 2025, arXiv 2506.13996) beside the "
                          "planner's")
    rows = alst_rows(out)
    assert [(row[0], row[1], row[3]) for row in rows] == [
        ("Llama-3.1-8B, 1 x H100 80GB, SP=1", "Z3 + full offload", "500,000"),
        ("Llama-3.1-8B, 8 x H100 80GB, SP=8", "Z3 + optimizer offload", "3,700,000")]
    for row, published, sp in zip(rows, (500_000, 3_700_000), (1, 8)):
        planned = int(row[2].replace(",", ""))
        assert row[4] == f"{planned / published:.2f}" and row[5] == "GPU"
        assert 0.5 < planned / published < 2
        command = re.search(rf"{re.escape(row[0])}: python tools/zero_plan.py (.*)", out).group(1).split()
        assert {"--recompute", "--tiled-mlp-compute", "--tiled-logits-loss", "--checkpoint-in-cpu",
                "--use-flash-attn-v2"} <= set(command)
        plan = json.loads(run(capsys, *command, "--json"))
        assert {p["option"]: p["longest_seq"] for p in plan["plans"]}[row[1]] == planned
        config = model_config(parse_flags(command))
        setup = option_setup(row[1], True, True, sp=sp, gpus=sp)
        assert memory(config, setup, planned)[0] <= 72.0 < memory(config, setup, planned + sp)[0]
        longest = [lever["longest_seq"] for lever in plan["levers"]]
        assert longest == sorted(longest) and longest[-1] >= planned


def test_alst_check_takes_no_other_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        tool_in_process(capsys, "zero_plan.py", *LONG, "--alst-check")
    assert exit_info.value.code == 2
    assert "--alst-check takes no other flag" in capsys.readouterr().err
