"""tools/zero_plan.py: every option's predicted memory against the ZeRO paper's Table 1 and against the six real
CPU driver runs (conftest.six_driver_runs), traffic ratios, the pick, and one-line refusals."""
import json
import re

import pytest

from conftest import tool_in_process

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
    # bf16 (the default): DP and Z2 send the least, 2 Psi x 2 bytes x 7/8; Z1 runs DeepSpeed's bf16 optimizer,
    # which all-reduces the gradients and all-gathers the parameters (3 Psi x 2 x 7/8) and keeps an fp32 buffer
    # of every gradient; of DP and Z2 the pick leaves the most memory free
    assert out.rstrip().endswith("(DP sends as little but leaves less memory free)")
    assert "\npick: Z2: fits (12.5 GB per GPU) and sends 4.28 GB per GPU per step, the least" in out


def parameter_count(layers: int, hidden: int, vocab: int, positions: int) -> int:
    """A GPT-2 block's weights counted by hand: QKV and projection (4h² + 4h), MLP (8h² + 5h), two LayerNorms
    (4h) per layer; word and position embeddings; the final LayerNorm."""
    return layers * (12 * hidden * hidden + 13 * hidden) + (vocab + positions) * hidden + 2 * hidden


# The ZeRO paper's Table 1 (Rajbhandari et al., 2020): model states per GPU of a 7.5B-parameter model on 64
# GPUs, mixed-precision Adam (K = 12), in GB of 10**9 bytes: DP 16Ψ, P_os 4Ψ + 12Ψ/N, P_os+g 2Ψ + 14Ψ/N,
# P_os+g+p 16Ψ/N.
PAPER_TABLE_1 = {"DP": 120.0, "P_os": 31.4, "P_os+g": 16.6, "P_os+g+p": 1.88}


def test_model_states_are_the_zero_papers_table_1(capsys):
    """A 7.46B GPT (36 layers, hidden 4096) on 64 GPUs, scaled to the paper's 7.5B, in fp16 as the paper's
    mixed precision (2-byte gradients; bf16's, accumulated in fp32, below). Stage 1 equals the paper's
    P_os when it accumulates gradients over micro-batches (it then holds every gradient); with one micro-batch
    per step DeepSpeed 0.19.8 reduces stage 1's gradients at the step's only backward and keeps just the
    partition's, as stage 2 does: both then need P_os+g (measured on the CPU runs, docs/zero-tradeoff-reference.md).
    Stages 1 and 2 keep the whole gradient of the parameter that straddles a partition boundary, hence a few
    tenths of a GB above the paper's 16.6."""
    shape = ["--num-layers", "36", "--hidden-size", "4096", "--num-attention-heads", "32", "--seq-length", "1024",
             "--gpus", "64", "--gpu-memory", "80GB", "--micro-batch-size", "1"]
    scale = 7.5e9 / parameter_count(36, 4096, 50304, 1024)
    assert 0.99 < scale < 1.01

    def model_states_gb(*extra, precision="fp16"):  # per GPU, in the paper's GB, for 7.5B parameters
        plans = plan_json(capsys, *shape, "--precision", precision, *extra)["plans"]
        return {p["option"]: p["model_states_gb"] * 2**30 / 1e9 * scale for p in plans}

    one_micro_batch, accumulating = model_states_gb(), model_states_gb("--global-batch-size", "128")
    assert one_micro_batch["DP"] == pytest.approx(PAPER_TABLE_1["DP"], rel=0.005)
    assert accumulating["Z1"] == pytest.approx(PAPER_TABLE_1["P_os"], rel=0.01)
    assert one_micro_batch["Z1"] == one_micro_batch["Z2"] == accumulating["Z2"]
    assert one_micro_batch["Z2"] == pytest.approx(PAPER_TABLE_1["P_os+g"], rel=0.02)
    assert one_micro_batch["Z2"] > PAPER_TABLE_1["P_os+g"]
    assert one_micro_batch["Z3"] == pytest.approx(PAPER_TABLE_1["P_os+g+p"], rel=0.01)
    # bf16 with fp32 accumulation, Psi = 7.5e9, N = 64, K = 12: stage 0 accumulates in bf16, 16 Psi = 120 GB;
    # stage 1's bf16 optimizer keeps every gradient in bf16 and fp32, 2 Psi + (2 + 4) Psi + 12 Psi / N
    # = 15 + 45 + 1.406 = 61.41 GB, with or without accumulation; stage 2 an fp32 partition of each group,
    # 2 Psi + 4 Psi / N + 12 Psi / N = 15 + 0.469 + 1.406 = 16.875 GB; stage 3 (2 + 4 + 12) Psi / N = 2.109 GB
    bf16 = model_states_gb(precision="bf16")
    assert bf16["DP"] == pytest.approx(120.0, rel=0.005)
    assert bf16["Z1"] == pytest.approx(61.41, rel=0.001)
    assert model_states_gb("--global-batch-size", "128", precision="bf16")["Z1"] == bf16["Z1"]
    assert bf16["Z2"] == pytest.approx(16.875, rel=0.001)
    assert bf16["Z3"] == pytest.approx(2.109, rel=0.001)


def test_zero_traffic_ratios_and_offload(capsys):
    """The ZeRO paper's communication: stage 3 sends 1.5x what stages 0-2 send (fp16, the paper's precision);
    in bf16 stage 1's bf16 optimizer sends 1.5x too (all-reduce and all-gather); offload moves states out."""
    plans = {p["option"]: p for p in plan_json(capsys, *EXAMPLE, "--precision", "fp16")["plans"]}
    assert plans["Z3"]["traffic_gb"] == pytest.approx(1.5 * plans["Z1"]["traffic_gb"])
    assert plans["DP"]["traffic_gb"] == pytest.approx(plans["Z1"]["traffic_gb"]) == plans["Z2"]["traffic_gb"]
    assert plans["DP"]["model_states_gb"] > plans["Z1"]["model_states_gb"] == plans["Z2"]["model_states_gb"] \
        > plans["Z3"]["model_states_gb"] > plans["Z3 + optimizer offload"]["model_states_gb"]
    data = plan_json(capsys, *EXAMPLE)
    plans = {p["option"]: p for p in data["plans"]}
    assert plans["Z1"]["traffic_gb"] == pytest.approx(1.5 * plans["DP"]["traffic_gb"]) == plans["Z3"]["traffic_gb"]
    assert plans["DP"]["traffic_gb"] == plans["Z2"]["traffic_gb"]
    assert plans["DP"]["model_states_gb"] > plans["Z1"]["model_states_gb"] > plans["Z2"]["model_states_gb"] \
        > plans["Z3"]["model_states_gb"] > plans["Z3 + optimizer offload"]["model_states_gb"]
    assert plans["Z3 + full offload"]["pcie_gb"] > plans["Z3 + optimizer offload"]["pcie_gb"] > 0
    assert data["choice"] == "Z2"


def test_explicit_shape_equals_the_preset(capsys):
    shape = ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16"]
    assert plan_json(capsys, *EXAMPLE[2:], *shape)["plans"] == plan_json(capsys, *EXAMPLE)["plans"]


def test_two_nodes_tensor_parallel_by_hand(capsys):
    """1.3B (24 layers, hidden 2048, 16 heads), seq 1024, micro-batch 4, bf16, 2 nodes x 8 GPUs, TP 2: DP 8, one
    micro-batch per step. Every byte written out here."""
    h, layers, s, b, a, dp = 2048, 24, 1024, 4, 16, 8
    vocab = 50432  # GPT-2's 50257 padded to a multiple of 128 x TP 2
    # one TP rank: half of each matrix (QKV, projection, MLP in and out) and of the column-parallel biases, the
    # row-parallel biases and LayerNorms whole; half the word embedding, all the position embedding
    matrices = [vocab // 2 * h, s * h] + [3 * h * h // 2, h * h // 2, 4 * h * h // 2, 4 * h * h // 2] * layers
    vectors = [h, h, 3 * h // 2, h, h, h, 4 * h // 2, h] * layers + [h, h]
    rank = sum(matrices) + sum(vectors)
    assert (sum(matrices), sum(vectors), rank) == (657_719_296, 471_040, 658_190_336)
    partition = rank // dp  # 82,273,792: ZeRO's share of one data-parallel rank
    # bf16: params 2 and optimizer states 12 bytes per parameter; the gradients accumulate in bf16 at stage 0
    # (2 bytes, every one), in fp32 at stages 1-3: stage 1's bf16 optimizer keeps every gradient in bf16 and in
    # an fp32 buffer (2 + 4), stage 2 an fp32 buffer of exactly its 1/8 of each group (matrices 657,719,296 / 8
    # = 82,214,912, vectors 471,040 / 8 = 58,880: the partition), stage 3 its fp32 gradient partition (4); offload
    # moves the optimizer states and that gradient partition (pinned host memory), then the parameters, off the
    # GPU, where the host optimizer adds an fp32 gradient of its master partition (4)
    assert 657_719_296 // 8 + 471_040 // 8 == partition
    model_states = {
        "DP": (2 + 2 + 12) * rank, "Z1": 2 * rank + (2 + 4) * rank + 12 * partition,
        "Z2": 2 * rank + 4 * partition + 12 * partition, "Z3": (2 + 4 + 12) * partition,
        "Z3 + optimizer offload": 2 * partition, "Z3 + full offload": 0, "Z3 + NVMe offload": 0}
    offloaded = {"Z3 + optimizer offload": (12 + 4 + 4) * partition, "Z3 + full offload": (2 + 12 + 4 + 4) * partition,
                 "Z3 + NVMe offload": (2 + 12 + 4 + 4) * partition}
    assert model_states["DP"] == 10_531_045_376 and model_states["Z1"] == 6_252_808_192
    assert model_states["Z2"] == 2_632_761_344 and model_states["Z3"] == 1_480_928_256
    # Korthikanti et al. 2022 per layer with TP t: s b h (10 + 24 / t) bytes, fp32 log-sum-exp 4 a s b / t,
    # fp32 LayerNorm statistics 16 s b; then ids (16 s b) and the embedding's dropout mask (s b h); the final
    # LayerNorm's input and statistics (2 s b h + 8 s b), the output layer's input (2 s b h), labels (13 s b)
    activations = layers * (s * b * h * (10 + 24 // 2) + 4 * a * s * b // 2 + 16 * s * b) \
        + 16 * s * b + s * b * h + 2 * s * b * h + 8 * s * b + 2 * s * b * h + 13 * s * b
    assert activations == 4_475_998_208
    output_buffer = b * s * vocab // 2 * (4 + 2)  # fp32 exps and bf16 logits over this rank's half vocabulary
    mlp_gradient = b * s * 4 * h // 2 * 2  # the backward's bf16 gradient of one MLP's [tokens, 4h / TP] at the peak
    # sent per step: ZeRO (n-1)/n of the rank's 2-byte gradients/params twice: DP's all-reduce, Z2's reduce and
    # all-gather; three times: Z3's two gathers and a reduce, and Z1's bf16 optimizer, which all-reduces the
    # gradients (cast to bf16) and all-gathers the parameters; and two TP all-reduces' (t-1)/t x 2 of [b, s, h]
    # per layer's attention and MLP, forward and backward, plus two
    all_reduces = (4 * layers + 2) * 2 * (1 / 2) * b * s * h * 2
    zero = 7 / 8 * 2 * rank

    plans = {p["option"]: p for p in plan_json(capsys, *EXAMPLE, "--nodes", "2", "--tp", "2")["plans"]}
    assert list(plans) == OPTIONS
    for option, states in model_states.items():
        plan = plans[option]
        assert plan["model_states_gb"] * 2**30 == pytest.approx(states, rel=1e-12), option
        assert plan["offloaded_gb"] * 2**30 == pytest.approx(offloaded.get(option, 0), rel=1e-12), option
        assert plan["activations_gb"] * 2**30 == pytest.approx(activations, rel=1e-12), option
        assert plan["output_buffer_gb"] * 2**30 == pytest.approx(output_buffer, rel=1e-12), option
        total = states + activations + output_buffer + mlp_gradient
        assert plan["total_gb"] * 2**30 == pytest.approx(total, rel=1e-12), option
        sent = (3 if option.startswith(("Z1", "Z3")) else 2) * zero + all_reduces
        assert plan["traffic_gb"] * 2**30 == pytest.approx(sent, rel=1e-12), option
        assert plan["fits"] == (total <= 40 * 0.9 * 2**30)


def test_a_model_that_fits_nowhere_and_pipeline_parallel_options(capsys):
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
    (["--nodes", "4", "--pp", "32"], "error: --num-layers 24 is fewer than --pipeline-model-parallel-size 32: "
                                     "every stage needs a layer"),
    (["--gpu-memory", "lots"], "error: --gpu-memory 'lots': expected a size such as 40GB or 80GiB"),
    (["--model-size", "2B"], "error: --model-size '2B' is not a preset (choose from tiny, 125M, "),
    (["--global-batch-size", "12"], "error: --global-batch-size 12 is not divisible by --micro-batch-size 4 x "
                                    "data-parallel size 8"),
    (["--nodes", "0"], "error: --nodes must be >= 1, got 0"),
])
def test_impossible_layouts_are_refused_in_one_line(capsys, extra, message):
    code, out, err = tool_in_process(capsys, "zero_plan.py", *EXAMPLE, *extra)
    assert code == 1 and out == ""
    assert err.startswith(message) and err.count("\n") == 1


@pytest.mark.slow
def test_plan_matches_the_measured_cpu_runs(capsys, six_driver_runs):
    """The planner's traffic and model states for the drivers' CPU experiment (tiny, seq 64, micro-batch 4,
    2 ranks, global batch 8, fp32) within 10% of what the six runs measured and logged."""
    runs, result = six_driver_runs
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


# --- step time (issue 34): --gpu and the links, per option, and the pick by time -------------------------------
ISSUE_EXAMPLE = ["--model-size", "13B", "--gpus", "8", "--nodes", "8", "--gpu", "A100-80GB", "--inter-node-bandwidth",
                 "200Gbit", "--tokens", "300B"]


def test_issue_example_prints_step_time_and_days_per_option_and_picks_by_time(capsys):
    code, out, err = tool_in_process(capsys, "zero_plan.py", *ISSUE_EXAMPLE)
    assert code == 0 and err == ""
    assert ("step time on 8 x 8 A100-80GB: 312 TFLOP/s bf16 peak x 0.869, 2400 Gbit/s inside a node, 200 Gbit/s "
            "per node between nodes, 10 us per message; 1 micro-batch per step, 300B tokens") in out
    timed = out.split("step time on")[1]
    rows = [re.split(r"\s{2,}", line) for line in timed.splitlines() if line.startswith(("DP ", "Z"))]
    assert [row[0] for row in rows] == OPTIONS
    assert all(len(row) == 12 for row in rows[:-1]) and rows[-1][2:] == ["-"] * 10  # NVMe: no --nvme-bandwidth
    data = plan_json(capsys, *ISSUE_EXAMPLE)
    plans = {p["option"]: p for p in data["plans"]}
    assert all(p["host_ms"] > 0 for p in data["plans"] if p["step_ms"] is not None)  # the table's, beside the step
    assert data["hardware"] == dict(gpu="A100-80GB", peak_tflops=312.0, efficiency=0.869, intra_node_gbps=2400,
                                    inter_node_gbps=200.0, latency_us=10.0, tokens=300e9)
    fitting = [p for p in data["plans"] if p["fits"] and p["step_ms"] is not None]
    assert data["choice"] == min(fitting, key=lambda p: p["step_ms"])["option"] == "Z2"
    assert data["why"].startswith(f"fits (40.9 GB per GPU) and has the shortest predicted step of those that fit, "
                                  f"{plans['Z2']['step_ms']:.0f} ms (communication")
    for p in fitting:
        assert p["step_ms"] == pytest.approx(p["compute_ms"] + p["communication_ms"] + p["offload_ms"]
                                             + p["bubble_ms"])
        assert p["tokens_per_s"] == pytest.approx(64 * 2048 / p["step_ms"] * 1e3)
        assert p["days"] == pytest.approx(300e9 / p["tokens_per_s"] / 86400)
    # stage 3 sends 1.5x what stage 2 does over the same links; stage 2's reductions partly hide behind the backward
    assert plans["Z3"]["communication_ms"] > 1.5 * plans["Z2"]["communication_ms"]


def test_step_time_by_hand_on_one_node(capsys):
    """1.3B, seq 1024, micro-batch 4, 8 A100-80GBs in one node, bf16, DP: compute = model FLOPs of 32 sequences
    / 8 GPUs at 312e12 x 0.869, plus Adam over all 1.31e9 parameters at 30 bytes each through 2039e9 bytes/s of
    HBM, plus the engine's 4.5 copies of the bf16 gradients (2 bytes each) at half that (a copy reads and
    writes); communication = the gradients' all-reduce, 2 x 7/8 x 2 bytes x parameters, at NVLink's 300e9 bytes/s
    (a ring inside the node: 1/bandwidth per byte counted as sent) plus 3 messages (DeepSpeed's engine
    all-reduces 5e8 elements at a time) x 10 us."""
    from megatron import accounting
    from megatron.model.config import GPTConfig

    data = plan_json(capsys, *EXAMPLE, "--gpu", "A100-80GB")
    dp = data["plans"][0]
    config = GPTConfig(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=1024,
                       max_position_embeddings=1024, padded_vocab_size=50304)
    params = accounting.count_parameters(config)
    compute = (accounting.model_flops_per_iteration(config, 32) / 8 / (312e12 * 0.869) + params * 30 / 2039e9
               + 4.5 * params * 2 / (2039e9 / 2))
    communication = 2 * 7 / 8 * 2 * params / 300e9 + 3 * 10e-6
    bound = dp["bound"]
    assert bound["compute_ms"] == pytest.approx(compute * 1e3, rel=1e-9)
    assert bound["communication_ms"] == pytest.approx(communication * 1e3, rel=1e-9)
    assert bound["offload_ms"] == bound["bubble_ms"] == 0
    assert bound["tflops_per_gpu"] == pytest.approx(accounting.model_flops_per_iteration(config, 32) / 8
                                                    / (compute + communication) / 1e12)
    # expected: the matmuls at 0.745 of that rate, and the memory-bound kernels: 2.01 x (forward + backward = 3
    # forwards) x 24 layers, one micro-batch of 4 sequences, of Korthikanti's s b h 34 + 5 a s^2 b bytes through
    # 2039e9 bytes/s; the gradients' all-reduce at 0.927 of NVLink's bandwidth
    matmul = accounting.model_flops_per_iteration(config, 32) / 8 / (312e12 * 0.869)
    memory = 2.01 * 3 * 24 * (1024 * 4 * 2048 * 34 + 5 * 16 * 1024**2 * 4) / 2039e9
    assert dp["compute_ms"] == pytest.approx((matmul / 0.745 + memory + compute - matmul) * 1e3, rel=1e-9)
    assert dp["communication_ms"] == pytest.approx(communication / 0.927 * 1e3, rel=1e-9)
    assert dp["tflops_per_gpu"] == pytest.approx(bound["tflops_per_gpu"] * bound["step_ms"] / dp["step_ms"])
    # a slower intra-node link or a lower efficiency only slows it down
    slower = plan_json(capsys, *EXAMPLE, "--gpu", "A100-80GB", "--intra-node-bandwidth", "150GB/s")["plans"][0]
    assert slower["bound"]["communication_ms"] == pytest.approx(2 * (communication - 3e-5) * 1e3 + 3e-2, rel=1e-9)
    assert plan_json(capsys, *EXAMPLE, "--gpu", "A100-80GB", "--efficiency", "0.5")["plans"][0]["compute_ms"] \
        > dp["compute_ms"]


def test_flash_attention_times_no_scores_in_the_memory_bound_term(capsys):
    """--use-flash-attn-v2 (zero-lab's SDPA on a GPU): the memory-bound kernels write Korthikanti's s b h 34 and the
    fused kernel's fp32 log-sum-exp (4 a s b bytes), not the unfused 5 a s^2 b scores; the rest of the step is the
    default's. At the Ulysses paper's 1.3B, 32K tokens, SP=4 on 8 A100s that lifts the planner from 0.40 of the
    paper's 175 TFLOP/s bound to 1.06 (bench/results/long_sequences_cpu.md)."""
    data = plan_json(capsys, *EXAMPLE, "--gpu", "A100-80GB")["plans"][0]
    fused = plan_json(capsys, *EXAMPLE, "--gpu", "A100-80GB", "--use-flash-attn-v2")["plans"][0]
    scores, lse = 5 * 16 * 1024**2 * 4, 4 * 16 * 1024 * 4
    assert data["compute_ms"] - fused["compute_ms"] == pytest.approx(2.01 * 3 * 24 * (scores - lse) / 2039e9 * 1e3,
                                                                     rel=1e-9)
    assert fused["communication_ms"] == data["communication_ms"] and fused["bound"] == data["bound"]
    paper = ["--model-size", "1.3B", "--gpus", "8", "--gpu", "A100-40GB", "--seq-length", "32768",
             "--ds-sequence-parallel-size", "4", "--use-rotary-position-embeddings"]
    for flag, ratio in (([], 0.40), (["--use-flash-attn"], 1.06)):
        plan = plan_json(capsys, *paper, *flag)
        chosen = next(p for p in plan["plans"] if p["option"] == plan["choice"])
        assert chosen["tflops_per_gpu"] / 175 == pytest.approx(ratio, abs=0.005)


def test_pipeline_bubble_and_tensor_parallel_all_reduces(capsys):
    # TP 2 x PP 2 x DP 2 on 8 GPUs, 8 micro-batches per step: the bubble is (2-1)/8 of the forward and backward
    args = [*EXAMPLE, "--gpu", "H100-SXM", "--tp", "2", "--pp", "2", "--global-batch-size", "64"]
    code, out, _ = tool_in_process(capsys, "zero_plan.py", *args)
    assert code == 0 and "8 micro-batches per step" in out and "bubble ms" in out
    # compute includes the optimizer's step and the engine's gradient passes, 5-10% here; the expected bubble
    # idles through the TP all-reduces of each micro-batch too
    for p in plan_json(capsys, *args)["plans"]:
        bound = p["bound"]
        assert bound["compute_ms"] / 8 * 0.9 < bound["bubble_ms"] < bound["compute_ms"] / 8
        assert p["compute_ms"] / 8 * 0.9 < p["bubble_ms"] < (p["compute_ms"] + p["communication_ms"]) / 8
    # without TP the activations' all-reduces are gone: less communication
    tp1 = plan_json(capsys, *EXAMPLE, "--gpu", "H100-SXM", "--pp", "2", "--global-batch-size", "64")["plans"]
    tp2 = plan_json(capsys, *args)["plans"]
    assert tp2[0]["communication_ms"] > tp1[0]["communication_ms"]


@pytest.mark.parametrize("text, gbps", [("200Gbit", 200), ("200Gbit/s", 200), ("200Gbps", 200), ("200Gb/s", 200),
                                        ("25GB/s", 200), ("25GB", 200), ("25", 200), ("12.5 GB/s", 100)])
def test_bandwidths_parse_in_bits_or_bytes(capsys, text, gbps):
    data = plan_json(capsys, *ISSUE_EXAMPLE, "--inter-node-bandwidth", text)
    assert data["hardware"]["inter_node_gbps"] == gbps


@pytest.mark.parametrize("extra, message", [
    (["--gpu", "B200"], "error: --gpu B200: unknown kind (choose from A100-40GB, A100-80GB, H100-SXM, H200, "),
    (["--gpu", "V100-32GB"], "error: --gpu V100-32GB has no bf16 tensor cores: give --precision fp16"),
    (["--gpu", "A40", "--inter-node-bandwidth", "fast"], "error: --inter-node-bandwidth 'fast': expected a "
                                                          "bandwidth such as 200Gbit (Gbit/s) or 25GB/s"),
    (["--gpu", "A40", "--latency", "soon"], "error: --latency 'soon': expected a time such as 10us or 0.01ms"),
    (["--gpu", "A40", "--tokens", "many"], "error: --tokens 'many': expected a count such as 300B or 1.5T"),
    (["--gpu", "A40", "--efficiency", "1.5"], "error: --efficiency must be in (0, 1], got 1.5"),
])
def test_time_flags_are_refused_in_one_line(capsys, extra, message):
    code, out, err = tool_in_process(capsys, "zero_plan.py", *EXAMPLE, *extra)
    assert code == 1 and out == ""
    assert err.startswith(message) and err.count("\n") == 1


def test_gpu_kind_gives_the_memory_and_every_kind_has_a_peak(capsys):
    args = ["--model-size", "1.3B", "--gpus", "8"]
    assert plan_json(capsys, *args, "--gpu", "H200")["plans"][0]["fits"] is True  # 141 GB
    code, _, err = tool_in_process(capsys, "zero_plan.py", *args)
    assert code == 1 and err == "error: give --gpu-memory or --gpu\n"
    for kind in ("A100-40GB", "A100-80GB", "H100-SXM", "H200", "V100-32GB", "A40", "MI250X"):
        data = plan_json(capsys, *args, "--gpu", kind, "--precision", "fp16", "--tokens", "1T")
        assert all(p["days"] > 0 for p in data["plans"] if p["option"] != "Z3 + NVMe offload"), kind


# --- issue 42 item 2: the planner's honesty ---------------------------------------------------------------------
def test_tokens_without_a_gpu_kind_is_refused_in_one_line(capsys):
    code, out, err = tool_in_process(capsys, "zero_plan.py", *EXAMPLE, "--tokens", "300B")
    assert code == 1 and out == ""
    assert err == "error: --tokens needs --gpu: the days to train come from the step time on a GPU kind\n"


BLOOM = ["--num-layers", "70", "--hidden-size", "14336", "--num-attention-heads", "112", "--vocab-size", "250880",
         "--micro-batch-size", "2", "--global-batch-size", "2048", "--gpus", "8", "--nodes", "48", "--tp", "4",
         "--pp", "12", "--gpu", "A100-80GB", "--recompute", "--inter-node-bandwidth", "400Gbit"]


def test_layers_that_do_not_divide_into_the_stages_are_planned_as_uneven_stages(capsys):
    """BLOOM's 70 layers over 12 stages: Megatron-DeepSpeed gives 10 stages 6 layers and 2 stages 5; the stages
    of 6 set the memory and the step, so every option's memory, traffic and step are those of 72 layers (6 on
    every stage), while the parameters, tokens and FLOPs are the 70-layer model's."""
    code, out, err = tool_in_process(capsys, "zero_plan.py", *BLOOM)
    assert code == 0 and err == ""
    assert out.startswith("70 layers x 14336: 176.28B parameters")
    assert ("note: 70 layers over 12 pipeline stages: 10 stages of 6 and 2 of 5, as Megatron-DeepSpeed's "
            "type:transformer partition balances them; the stages of 6 set the memory and the step") in out
    uneven = {p["option"]: p for p in plan_json(capsys, *BLOOM)["plans"]}
    even = {p["option"]: p for p in plan_json(capsys, *BLOOM[:1], "72", *BLOOM[2:])["plans"]}
    assert list(uneven) == ["DP", "Z1"]
    for option, p in uneven.items():
        for key in ("total_gb", "traffic_gb", "step_ms", "compute_ms", "communication_ms", "bubble_ms"):
            assert p[key] == pytest.approx(even[option][key], rel=1e-12), (option, key)
        assert p["bound"]["step_ms"] == pytest.approx(even[option]["bound"]["step_ms"], rel=1e-12)
        assert p["tokens_per_s"] == pytest.approx(even[option]["tokens_per_s"], rel=1e-12)
        assert p["hardware_tflops_per_gpu"] == pytest.approx(even[option]["hardware_tflops_per_gpu"] * 70 / 72,
                                                             rel=0.01)  # the ends count once in both


def test_zero1_in_bf16_says_it_runs_deepspeeds_bf16_optimizer(capsys):
    note = ("note: Z1 in bf16 is DeepSpeed's BF16_Optimizer, not the ZeRO paper's stage 1: it accumulates the "
            "gradients in fp32 (6 bytes per parameter, bf16 and fp32 copies of every gradient) and all-reduces them "
            "before gathering the parameters, 1.5x stage 1's bytes (docs/zero-tradeoff.md)")
    code, out, _ = tool_in_process(capsys, "zero_plan.py", *EXAMPLE)
    assert code == 0 and note + "\n" in out
    assert plan_json(capsys, *EXAMPLE)["notes"] == [note]
    for other in (["--precision", "fp16"], ["--pp", "2", "--precision", "fp32"]):
        code, out, _ = tool_in_process(capsys, "zero_plan.py", *EXAMPLE, *other)
        assert code == 0 and "BF16_Optimizer" not in out


LONG = ["--model-size", "1.3B", "--gpus", "8", "--gpu-memory", "80GB", "--use-rotary-position-embeddings",
        "--recompute"]


@pytest.mark.parametrize("extra, message", [
    (["--ds-sequence-parallel-size", "3", "--seq-length", "3072"],
     "error: --num-attention-heads 16 is not divisible by --ds-sequence-parallel-size 3: each rank attends over whole "
     "heads"),
    (["--ds-sequence-parallel-size", "8", "--seq-length", "1000004"],
     "error: --seq-length 1000004 is not divisible by --ds-sequence-parallel-size 8: each rank holds an equal slice"),
    (["--ds-sequence-parallel-size", "16", "--seq-length", "4096"],
     "error: world size 8 is not divisible by --tensor-model-parallel-size 1 x --pipeline-model-parallel-size 1 x "
     "--ds-sequence-parallel-size 16"),
])
def test_an_sp_size_that_cannot_split_is_refused_in_one_line(capsys, extra, message):
    code, out, err = tool_in_process(capsys, "zero_plan.py", *LONG, *extra)
    assert code == 1 and out == ""
    assert err == message + "\n"


def test_the_longest_sequence_that_fits_each_option(capsys):
    """A million tokens over 8 GPUs with Ulysses: each option's longest sequence fits the 72 GB left (80 GB less
    10%) and one more slice of 8 tokens does not, by megatron/accounting/predict/ at micro-batch 1; SP=8 holds s/8 of
    every activation, so the whole sequence fits about 8 times longer than at SP=1 where activations dominate."""
    from dataclasses import replace

    from megatron import accounting
    from megatron.accounting.plan import OPTIONS, model_config, parse_flags
    args = [*LONG, "--seq-length", "1048576", "--ds-sequence-parallel-size", "8"]
    code, out, err = tool_in_process(capsys, "zero_plan.py", *args)
    assert code == 0 and err == ""
    assert out.startswith("1.3B: 1.31B parameters, seq 1048576, micro batch 1, 8 GPUs (TP=1, PP=1, SP=8), bf16\n")
    assert ("longest sequence that fits 72.0 GB per GPU (micro batch 1, with recomputation, rotary positions, "
            "SP=8):\n  DP  ") in out
    plans = {p["option"]: p for p in plan_json(capsys, *args)["plans"]}
    config = model_config(parse_flags(args))
    for label, stage, offload_optimizer, offload_params, device in OPTIONS:
        longest = plans[label]["longest_seq"]
        assert longest % 8 == 0 and plans[label]["fits"] == (longest >= 1048576)
        setup = accounting.TrainingSetup(world_size=8, micro_batch_size=1, sequence_parallel_size=8, precision="bf16",
                                         zero_stage=stage, offload_optimizer=offload_optimizer,
                                         offload_params=offload_params, activation_recompute=True)
        gb = [accounting.memory_per_rank(replace(config, seq_length=s, max_position_embeddings=s), setup)["total"]
              / 2**30 for s in (longest, longest + 8)]
        assert gb[0] <= 72.0 < gb[1], label
    assert plans["DP"]["longest_seq"] < plans["Z3"]["longest_seq"] < plans["Z3 + full offload"]["longest_seq"]
    serial = {p["option"]: p for p in plan_json(capsys, *LONG, "--seq-length", "4096")["plans"]}
    ratio = plans["Z3 + full offload"]["longest_seq"] / serial["Z3 + full offload"]["longest_seq"]
    # a little over 8: at SP=1 the layer recomputed at a time also keeps rotary's rotated q, k and projection
    # input, which the all-to-alls' outputs replace under Ulysses (megatron/accounting/predict/memory.py)
    assert 7.5 < ratio <= 8.2
    assert plans["Z3"]["activations_gb"] == pytest.approx(
        accounting.activation_bytes(config, setup) / 2**30, rel=1e-6)


def test_llama_preset_plans_with_its_own_vocabulary_and_exact_count(capsys):
    """llama3-8b: its tokenizer's 128256 tokens unless --vocab-size says otherwise, and the released checkpoint's
    8,030,261,248 parameters (untied output, GQA 8, SwiGLU: tests/test_presets.py); DP's model states are 16 bytes
    each in bf16 with the fp32 optimizer (119.66 GB of 10**9 bytes, less the padding-free count)."""
    code, out, err = tool_in_process(capsys, "zero_plan.py", "--model-size", "llama3-8b", "--gpus", "8",
                                     "--gpu-memory", "80GB")
    assert code == 0 and err == ""
    assert out.startswith("llama3-8b: 8.03B parameters, seq 8192, micro batch 1, 8 GPUs (TP=1, PP=1), bf16\n")
    code, out, _ = tool_in_process(capsys, "zero_plan.py", "--model-size", "llama3-8b", "--vocab-size", "32000",
                                   "--gpus", "8", "--gpu-memory", "80GB")
    assert code == 0 and out.startswith("llama3-8b: 7.24B parameters")  # 2 x 96256 x 4096 fewer


def test_an_moe_preset_plans_each_stage_and_expert_parallel_size(capsys):
    """gpt-125m-moe8 on 8 GPUs: ZeRO 0-2 (no ZeRO-3 with MoE) at EP 1, 2, 4 and 8; a larger EP holds fewer experts
    and sends fewer gradient bytes but adds the all-to-alls."""
    from megatron import accounting
    from megatron.accounting.plan import model_config, parse_flags

    data = plan_json(capsys, "--model-size", "gpt-125m-moe8", "--gpus", "8", "--gpu-memory", "80GB",
                     "--micro-batch-size", "4")
    plans = {p["option"]: p for p in data["plans"]}
    assert list(plans) == [f"{stage} EP={ep}" for ep in (1, 2, 4, 8) for stage in ("DP", "Z1", "Z2")]
    assert plans["DP EP=8"]["model_states_gb"] < plans["DP EP=2"]["model_states_gb"] < plans["DP EP=1"][
        "model_states_gb"]
    config = model_config(parse_flags(["--model-size", "gpt-125m-moe8", "--gpus", "8", "--gpu-memory", "80GB",
                                       "--micro-batch-size", "4"]))
    for ep in (1, 8):
        setup = accounting.TrainingSetup(world_size=8, micro_batch_size=4, precision="bf16", expert_parallel_size=ep)
        sent = sum(accounting.zero_traffic_per_step(config, setup).values()) + sum(
            accounting.moe_all_to_all_per_step(config, setup).values())
        assert plans[f"DP EP={ep}"]["traffic_gb"] == pytest.approx(sent / 2**30)
    assert accounting.moe_all_to_all_per_step(config, setup)["all_to_all"] > 0
    only = plan_json(capsys, "--model-size", "tiny", "--num-experts", "4", "--topk", "2",
                     "--moe-expert-parallel-size", "2", "--gpus", "2", "--gpu-memory", "8GB")
    assert [p["option"] for p in only["plans"]] == ["DP EP=2", "Z1 EP=2", "Z2 EP=2"]


@pytest.mark.parametrize("flags, message", [
    (["--model-size", "gpt-125m-moe8", "--tp", "2"], "--num-experts 8 cannot be combined with "
                                                      "--tensor-model-parallel-size > 1 (the experts are not split "
                                                      "over tensor-parallel ranks here)"),
    (["--model-size", "gpt-125m-moe8", "--moe-expert-parallel-size", "3"],
     "--moe-expert-parallel-size 3 must divide 8, an MoE layer's experts by --num-experts: each layer's experts are "
     "split evenly over the expert-parallel ranks; use a multiple of 3 experts, or a --moe-expert-parallel-size that "
     "divides 8"),
    (["--model-size", "125M", "--moe-expert-parallel-size", "2"],
     "--moe-expert-parallel-size needs --num-experts (or an MoE --model-size)"),
])
def test_moe_layouts_the_training_refuses_are_refused_in_one_line(capsys, flags, message):
    code, out, err = tool_in_process(capsys, "zero_plan.py", *flags, "--gpus", "8", "--gpu-memory", "80GB")
    assert code == 1 and out == "" and err == f"error: {message}\n"


# one bad layout in each tool's flags: (the planner's, pretrain_gpt.py's, GPUs)
SAME_BAD_LAYOUT = [
    (["--model-size", "gpt-125m-moe8", "--tp", "2"], ["--model-size", "gpt-125m-moe8",
                                                      "--tensor-model-parallel-size", "2"], 8),
    (["--model-size", "gpt-125m-moe8", "--pp", "2"], ["--model-size", "gpt-125m-moe8",
                                                      "--pipeline-model-parallel-size", "2"], 8),
    (["--model-size", "gpt-125m-moe8", "--ds-sequence-parallel-size", "2"],
     ["--model-size", "gpt-125m-moe8", "--ds-sequence-parallel-size", "2"], 8),
    (["--model-size", "gpt-125m-moe8", "--moe-expert-parallel-size", "3"],
     ["--model-size", "gpt-125m-moe8", "--moe-expert-parallel-size", "3"], 8),
    (["--model-size", "gpt-125m-moe8", "--moe-expert-parallel-size", "8"],
     ["--model-size", "gpt-125m-moe8", "--moe-expert-parallel-size", "8"], 4),
    (["--model-size", "125M", "--ds-sequence-parallel-size", "8"], ["--model-size", "125M",
                                                                   "--ds-sequence-parallel-size", "8"], 8),
    (["--model-size", "125M", "--tp", "2", "--ds-sequence-parallel-size", "4"],
     ["--model-size", "125M", "--tensor-model-parallel-size", "2", "--ds-sequence-parallel-size", "4"], 8),
    (["--model-size", "1.3B", "--ds-sequence-parallel-size", "8", "--seq-length", "1028"],
     ["--model-size", "1.3B", "--ds-sequence-parallel-size", "8", "--seq-length", "1028"], 8),
    (["--model-size", "1.3B", "--ds-sequence-parallel-size", "2", "--pp", "2"],
     ["--model-size", "1.3B", "--ds-sequence-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 8),
    (["--model-size", "1.3B", "--ds-sequence-parallel-size", "2", "--tp", "2", "--sequence-parallel"],
     ["--model-size", "1.3B", "--ds-sequence-parallel-size", "2", "--tensor-model-parallel-size", "2",
      "--sequence-parallel"], 8),
    (["--model-size", "2B"], ["--model-size", "2B"], 8),
]


@pytest.mark.parametrize("planner, trainer, gpus", SAME_BAD_LAYOUT, ids=[" ".join(case[0]) for case in SAME_BAD_LAYOUT])
def test_the_planner_refuses_a_layout_in_the_trainings_words(capsys, planner, trainer, gpus):
    """One rule, one text: the planner refuses an MoE or DeepSpeed-Ulysses layout (and an unknown preset) with the
    line pretrain_gpt.py's flag parsing refuses it with (megatron/layout_check.py, presets.preset_fields)."""
    from megatron.arguments import parse_args
    from megatron.errors import ZeroLabError

    seq = [] if "--seq-length" in trainer else ["--seq-length", "2048"]
    with pytest.raises(ZeroLabError) as refused:
        parse_args([*trainer, *seq, "--micro-batch-size", "1", "--train-iters", "10", "--data-path", "unused",
                    "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"], world_size=gpus)
    code, out, err = tool_in_process(capsys, "zero_plan.py", *planner, "--gpus", gpus, "--gpu-memory", "80GB")
    assert code == 1 and out == "" and err == f"error: {refused.value}\n"


def test_an_moe_plan_prints_the_checkpoint_interval_of_its_pick(capsys):
    """The pick of an MoE model is an option at an EP size ("DP EP=1", say): its checkpoint is its ZeRO stage's
    (the planner ended in a StopIteration here before)."""
    from megatron import accounting
    from megatron.accounting.plan import model_config, parse_flags
    from megatron.accounting.predict.memory import checkpoint_bytes

    args = ["--model-size", "gpt-125m-moe8", "--gpus", "8", "--gpu-memory", "80GB", "--storage-bandwidth", "20GB/s",
            "--mtbf-hours", "12"]
    data = plan_json(capsys, *args)
    stage = {"DP": 0, "Z1": 1, "Z2": 2}[data["choice"].split(" EP=")[0]]
    parameters = accounting.count_parameters(model_config(parse_flags(args)))
    assert data["checkpoint"]["bytes"] == checkpoint_bytes(parameters, "bf16", stage)
    code, out, _ = tool_in_process(capsys, "zero_plan.py", *args)
    assert code == 0 and out.splitlines()[-1].startswith("checkpoint: ")


def test_an_moe_model_with_recomputation_plans_as_the_training_runs_it(capsys):
    """The training recomputes MoE layers under --checkpoint-activations (docs/moe.md); the planner plans it, with
    less activation memory than without."""
    args = ["--model-size", "gpt-125m-moe8", "--gpus", "8", "--gpu-memory", "80GB", "--micro-batch-size", "4"]
    plain = {p["option"]: p for p in plan_json(capsys, *args)["plans"]}
    recomputed = {p["option"]: p for p in plan_json(capsys, *args, "--recompute")["plans"]}
    assert list(recomputed) == list(plain)
    assert all(recomputed[o]["activations_gb"] < plain[o]["activations_gb"] for o in plain)


@pytest.mark.parametrize("preset, seq", [("llama3-8b", 8192), ("llama2-7b", 4096), ("1.3B", 2048)])
def test_a_preset_plans_its_own_context_length_unless_seq_length_says_otherwise(capsys, preset, seq):
    """Llama 3 8B was published with an 8192-token context, Llama 2 with 4096 (megatron/model/presets.py); GPT
    shapes keep GPT-3's 2048; --seq-length still wins."""
    data = plan_json(capsys, "--model-size", preset, "--gpus", "8", "--gpu-memory", "80GB")
    code, out, _ = tool_in_process(capsys, "zero_plan.py", "--model-size", preset, "--gpus", "8",
                                   "--gpu-memory", "80GB")
    assert code == 0 and f", seq {seq}, micro batch 1," in out.splitlines()[0]
    shorter = plan_json(capsys, "--model-size", preset, "--seq-length", "1024", "--gpus", "8", "--gpu-memory", "80GB")
    assert shorter["plans"][0]["activations_gb"] < data["plans"][0]["activations_gb"]


def test_a_rotary_preset_says_rotary_positions_under_the_longest_sequence_table(capsys):
    """llama3-8b has rotary positions of its own (no --use-rotary-position-embeddings): the table says so."""
    code, out, _ = tool_in_process(capsys, "zero_plan.py", "--model-size", "llama3-8b", "--gpus", "8",
                                   "--gpu-memory", "80GB")
    assert code == 0 and "(micro batch 1, without recomputation, rotary positions, SP=1):" in out
    code, out, _ = tool_in_process(capsys, "zero_plan.py", *EXAMPLE)
    assert code == 0 and "(micro batch 1, without recomputation, learned positions, SP=1):" in out


@pytest.mark.parametrize("extra, why", [
    # micro-batch 1 already: lowering it is no remedy; the activations alone overflow, so more GPUs are none either
    (["--micro-batch-size", "1"], "nothing fits: raise --tp or --pp, or add --recompute"),
    (["--micro-batch-size", "2", "--recompute"], None),  # Z3 + full offload fits
    (["--micro-batch-size", "4"], "nothing fits: raise --tp or --pp, lower --micro-batch-size, or add --recompute"),
])
def test_nothing_fits_names_only_the_remedies_left(capsys, extra, why):
    """175B on 1,024 A100s at TP=PP=1 (the default layout): the advice leaves out what is already done and what
    would not shrink what overflows."""
    data = plan_json(capsys, "--model-size", "175B", "--gpus", "8", "--nodes", "128", "--gpu-memory", "80GB", *extra)
    assert data["why"] == why if why else data["choice"] is not None



def test_a_pipeline_with_few_micro_batches_says_how_long_it_idles_and_the_batch_that_fixes_it(capsys):
    """175B on 1,024 GPUs at TP 8 x PP 8 with the default batch (one micro-batch per data-parallel rank): 1F1B's
    fill and drain idle (p-1)/m = 7x the compute; 4 (p-1) = 28 micro-batches over DP 16 is a batch of 448, with
    which the note goes."""
    args = ["--model-size", "175B", "--gpus", "8", "--nodes", "128", "--gpu", "H100-SXM", "--tp", "8", "--pp", "8",
            "--recompute"]
    data = plan_json(capsys, *args)
    assert ("note: 1 micro-batch a step over 8 pipeline stages: the pipeline idles (p-1)/m = 7x each GPU's compute "
            "while it fills and drains; --global-batch-size 448 (28 micro-batches) keeps that to 0.25x") in data["notes"]
    dp = next(p for p in data["plans"] if p["option"] == "DP")
    assert dp["bubble_ms"] == pytest.approx(7 * (dp["step_ms"] - dp["bubble_ms"] - dp["communication_ms"]), rel=0.2)
    assert not any("idles" in note for note in plan_json(capsys, *args, "--global-batch-size", "448")["notes"])


def test_async_save_adds_each_options_host_copy(capsys):
    """--async-save: a column of the host memory rank 0's copy of its checkpoint files takes (bf16 weights and
    12 bytes per element of its optimizer partition; at ZeRO-3 the partition only), in the JSON too; absent
    without the flag."""
    from megatron.accounting.predict.memory import RNG_STATE_BYTES
    code, out, _ = tool_in_process(capsys, "zero_plan.py", *EXAMPLE, "--async-save")
    assert code == 0 and out.splitlines()[2].endswith("offloaded GB/GPU  async-save copy GB/GPU (host)")
    plans = {p["option"]: p for p in plan_json(capsys, *EXAMPLE, "--async-save")["plans"]}
    parameters = parameter_count(24, 2048, 50304, 1024)
    vectors = 24 * 13 * 2048 + 2 * 2048  # biases and LayerNorms (parameter_count's 13h a layer, the final norm)
    groups = (parameters - vectors, vectors)
    partitions = sum(-(-group // 16) * 16 // 8 * 12 + 4 for group in groups)
    assert plans["Z1"]["async_save_copy_gb"] * 2**30 == parameters * 2 + partitions + 2 * RNG_STATE_BYTES
    assert plans["Z3"]["async_save_copy_gb"] * 2**30 == partitions + 2 * RNG_STATE_BYTES
    assert plan_json(capsys, *EXAMPLE)["plans"][0]["async_save_copy_gb"] is None
