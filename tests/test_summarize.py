"""analysis/summarize.py: log parsing (ours and upstream formats), the summary numbers, outputs, exit codes."""
import csv
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from statistics import fmean

import matplotlib

matplotlib.use("Agg")
import matplotlib.image as mpimg  # noqa: E402
import pytest  # noqa: E402

from conftest import REPO_ROOT, test_env  # noqa: E402
from analysis import log_parser  # noqa: E402
from analysis.log_parser import ParsedLog, parse_line, parse_log  # noqa: E402
from analysis.run_metadata import from_folder_name  # noqa: E402

FIXTURES = REPO_ROOT / "tests" / "fixtures" / "logs"
SUMMARIZE = REPO_ROOT / "analysis" / "summarize.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# ALCF layout: outputs/<run name>/logs/<user>-<host>-nhosts2-ngpu8-<date>.log
ALCF_RUN = "upstream/gpt_SP_actCkpt_GPT1_3B_z1_seqlen1024_mp8_pp1_sp1_nl24_hs2048_gb1_mb1"

OUR_ITERATION = (
    " iteration       10/     200 | consumed samples:          320 | consumed tokens:       327680 | elapsed time "
    "per iteration (ms): 812.3 | learning rate: 1.500E-04 | global batch size:    32 | lm loss: 7.912345E+00 | "
    "loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 | number of nan iterations:   0 | "
    "samples per second: 39.394 | tokens per gpu per second (tgs): 20169.846 | TFLOPs: 61.23 |")
UPSTREAM_ITERATION = (
    " iteration      199/  317892 | consumed samples:       152832 | consumed tokens:    625999872 | elapsed time "
    "per iteration (ms): 14287.5 | learning rate: 2.407E-04 | global batch size:   768 | lm loss: 6.543210E-01 | "
    "loss scale: 1.0 | actual seqlen:  4096 | number of skipped iterations:   0 | number of nan iterations:   0 | "
    "samples per second: 53.753 | tokens per gpu per second(tgs): 917.421 | TFLOPs: 55.89 |")
OUR_MEMORY = ("[Rank 0] memory at iteration       10 | device=cuda, MemAllocated=0.12GB, MaxMemAllocated=0.34GB, "
              "HostRSS=1.23GB, MaxHostRSS=1.30GB, MFU=45.10% |")
DEEPSPEED_MEMORY = ("[2024-03-07 15:27:02,646] [INFO] [timer.py:260:stop] epoch=0/micro_step=199/global_step=199, "
                    "RunningAvgSamplesPerSec=58.730622229657506, CurrSamplesPerSec=61.35304005128382, "
                    "MemAllocated=6.01GB, MaxMemAllocated=19.52GB")


def run_cli(*args, **kwargs):
    return subprocess.run([sys.executable, str(SUMMARIZE), *map(str, args)], env=test_env(), cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120, **kwargs)


def parsed(*lines: str) -> ParsedLog:
    log = ParsedLog(path=Path("fixture.log"))
    for line in lines:
        parse_line(log, log_parser.strip_ansi(line))
    return log


# ---- the docs/log-lines.md regexes on our lines and upstream's -------------------------------------------

@pytest.mark.parametrize("regex, line, expected", [
    (log_parser.TGS_RE, OUR_ITERATION, "20169.846"),
    (log_parser.TGS_RE, UPSTREAM_ITERATION, "917.421"),
    (log_parser.ELAPSED_MS_RE, OUR_ITERATION, "812.3"),
    (log_parser.ELAPSED_MS_RE, UPSTREAM_ITERATION, "14287.5"),
    (log_parser.LM_LOSS_RE, OUR_ITERATION, "7.912345E+00"),
    (log_parser.LM_LOSS_RE, UPSTREAM_ITERATION, "6.543210E-01"),
    (log_parser.MEM_ALLOCATED_RE, DEEPSPEED_MEMORY, "6.01"),
    (log_parser.MAX_MEM_ALLOCATED_RE, DEEPSPEED_MEMORY, "19.52"),
    (log_parser.MEM_ALLOCATED_RE, OUR_MEMORY, "0.12"),
    (log_parser.MAX_MEM_ALLOCATED_RE, OUR_MEMORY, "0.34"),
])
def test_design_regexes_match_both_formats(regex, line, expected):
    assert regex.search(line).group(1) == expected


def test_iteration_records_in_both_formats():
    ours, upstream = parsed(OUR_ITERATION, UPSTREAM_ITERATION).iterations
    assert (ours.iteration, ours.train_iters, ours.consumed_samples, ours.consumed_tokens) == (10, 200, 320, 327680)
    assert (ours.elapsed_ms, ours.lm_loss, ours.tgs, ours.tflops) == (812.3, 7.912345, 20169.846, 61.23)
    assert (ours.global_batch_size, ours.samples_per_second) == (32, 39.394)
    assert (upstream.iteration, upstream.train_iters, upstream.consumed_tokens) == (199, 317892, 625999872)
    assert (upstream.lm_loss, upstream.tgs, upstream.elapsed_ms) == (0.654321, 917.421, 14287.5)


def test_memory_records_from_ours_deepspeed_and_megatron():
    log = parsed(OUR_MEMORY, DEEPSPEED_MEMORY,
                 "[Rank 3] (after 1 iterations) memory (MB) | allocated: 18244.640625 | max allocated: 41299.5 | "
                 "reserved: 46764.0 | max reserved: 46764.0")
    ours, deepspeed, megatron = log.memory
    assert (ours.source, ours.rank, ours.iteration) == ("zero-lab", 0, 10)
    assert (ours.allocated_gb, ours.max_allocated_gb, ours.host_rss_gb, ours.max_host_rss_gb, ours.mfu_pct) == (
        0.12, 0.34, 1.23, 1.30, 45.10)
    assert (deepspeed.source, deepspeed.iteration, deepspeed.allocated_gb, deepspeed.max_allocated_gb) == (
        "deepspeed", 199, 6.01, 19.52)
    assert (megatron.rank, megatron.iteration) == (3, 1)
    assert megatron.allocated_gb == pytest.approx(18244.640625 / 1024)
    assert megatron.max_allocated_gb == pytest.approx(41299.5 / 1024)


def test_prefixes_colours_and_glued_ranks():
    log = parsed(
        "[2024-01-01 10:00:00,123] [INFO] [training.py:1:log] " + OUR_ITERATION,
        "0: " + UPSTREAM_ITERATION.replace("199/", "200/"),
        "\x1b[32m[rank1]: " + OUR_MEMORY.replace("[Rank 0]", "[Rank 1]") + "\x1b[0m",
        OUR_MEMORY + OUR_MEMORY.replace("[Rank 0]", "[Rank 1]").replace("0.12GB", "0.15GB").replace(", MFU=45.10%", ""),
    )
    assert [r.iteration for r in log.iterations] == [10, 200]
    assert log.iterations[0].lm_loss == 7.912345 and log.iterations[1].tgs == 917.421
    assert [(m.rank, m.allocated_gb) for m in log.memory] == [(1, 0.12), (0, 0.12), (1, 0.15)]
    assert log.memory[2].mfu_pct is None  # the glued rank-1 record does not borrow rank 0's MFU


def test_validation_epoch_model_state_run_info_and_end_lines():
    log = parsed(
        " validation loss at iteration 100 | lm loss value: 6.123456E+00 | lm loss PPL: 4.562118E+02 | ",
        " validation loss at the end of training for val data | lm loss value: 7.123456E-01 | "
        "lm loss PPL: 2.038503E+00 | ",
        " epoch    1 done | iteration       50 | consumed samples:         1600 | epoch time (s): 123.456 | "
        "lm loss: 7.123456E+00 |",
        " model state memory per rank (GB) | measured: params=0.0120 grads=0.0120 optim=0.0240 offloaded=0.0000 "
        "activations=0.0062 other=0.1000 | ZeRO estimate (stage=1, dp=2, dtype=fp32, offload=none): params=0.0120 "
        "grads=0.0120 optim=0.0120 total=0.0360 offloaded=0.0000 activations=0.0062 output_buffer=0.0480 |",
        " > run info | zero stage: 3 | offload: optimizer+params | model: tiny | world size: 2 | micro batch: 4 | "
        "global batch: 16 | seq length: 128 | train samples per epoch: 1234 |",
        "[after training is done] datetime: 2024-04-04 09:11:30",
    )
    assert [(v.iteration, v.lm_loss, v.ppl) for v in log.validations] == [
        (100, 6.123456, 456.2118), (None, 0.7123456, 2.038503)]
    (epoch,) = log.epochs
    assert (epoch.epoch, epoch.iteration, epoch.consumed_samples, epoch.epoch_time_s, epoch.lm_loss) == (
        1, 50, 1600, 123.456, 7.123456)
    assert log.iterations == []  # the epoch line's "lm loss" is not an iteration record
    state = log.model_state
    assert state.measured == {"params": 0.012, "grads": 0.012, "optim": 0.024, "offloaded": 0.0,
                              "activations": 0.0062, "other": 0.1}
    assert state.estimate["total"] == 0.036
    assert (state.zero_stage, state.dp_size, state.dtype, state.offload) == (1, 2, "fp32", "none")
    assert log.run_info["offload"] == "optimizer+params" and log.run_info["train samples per epoch"] == "1234"
    assert log.saw_end_marker


def _comm(iteration: int, total: float, predicted: float = 78.322) -> str:
    return (f"[Rank 0] comm at iteration {iteration:8d} | all_reduce=0.000MB | reduce_scatter=26.107MB | "
            f"all_gather={total - 26.107:.3f}MB | broadcast=0.000MB | p2p=0.000MB | total={total:.3f}MB | "
            f"bytes/param={total / 6.527:.3f} | predicted={predicted:.3f}MB |")


def test_comm_lines_and_the_zero_tradeoff_section(tmp_path):
    """Bytes sent per iteration, measured beside predicted: the steady-state intervals' mean (the first
    stage-3 step gathers more), a cut-off line dropped, and report.md's trade-off section."""
    from analysis.report import tradeoff_section
    from analysis.run_metadata import RunMetadata
    from analysis.run_summary import summarize_run

    lines = [OUR_ITERATION.replace("10/     200", f"{i:>2}/       4") for i in range(1, 5)]
    log = parsed(
        " model state memory per rank (GB) | measured: params=0.0127 grads=0.0127 optim=0.0382 offloaded=0.0000 "
        "activations=0.0031 other=0.0253 | ZeRO estimate (stage=3, dp=2, dtype=fp32, offload=none): params=0.0127 "
        "grads=0.0127 optim=0.0382 total=0.0637 offloaded=0.0000 activations=0.0031 output_buffer=0.0240 |",
        *[line + " " + _comm(i + 1, 90.604 if i == 0 else 78.302) for i, line in enumerate(lines)],
        _comm(5, 78.302)[:60])
    assert [c.iteration for c in log.comm] == [1, 2, 3, 4]
    assert log.comm[1].by_kind_mb == {"all_reduce": 0.0, "reduce_scatter": 26.107, "all_gather": 52.195,
                                      "broadcast": 0.0, "p2p": 0.0}
    assert (log.comm[1].total_mb, log.comm[1].predicted_mb) == (78.302, 78.322)
    z3 = summarize_run(log, RunMetadata(zero_stage=3, offload="none", world_size=2), "z3", skip_first=2)
    assert (z3.traffic_mb, z3.traffic_predicted_mb) == (78.302, 78.322)
    assert (z3.activations_gb, z3.activations_estimate_gb, z3.output_buffer_estimate_gb) == (0.0031, 0.0031, 0.024)
    assert (z3.offloaded_gb, z3.offloaded_estimate_gb) == (0.0, 0.0)
    z1_log = parsed(log_parser.strip_ansi(
        " model state memory per rank (GB) | measured: params=0.0255 grads=0.0240 optim=0.0382 offloaded=0.0000 "
        "activations=0.0031 other=0.0240 | ZeRO estimate (stage=1, dp=2, dtype=fp32, offload=none): params=0.0255 "
        "grads=0.0255 optim=0.0382 total=0.0892 offloaded=0.0000 activations=0.0031 output_buffer=0.0240 |"),
        *[line + " " + _comm(i + 1, 26.107, 26.107).replace("all_gather=0.000", "all_gather=13.054")
          for i, line in enumerate(lines)])
    z1 = summarize_run(z1_log, RunMetadata(zero_stage=1, offload="none", world_size=2), "z1", skip_first=2)
    section = tradeoff_section([z3, z1], "zero_tradeoff.png")
    assert section.startswith("## ZeRO trade-off\n")
    assert "ratios are to Z1's measurements" in section
    assert "| Z3 | ?/? | 0.0636/0.0637 | 0.0000/0.0000 | 0.0031/0.0031 | 78.30/78.32 | 12.00 | 0.73x | 3.00x |" \
        in section
    assert "| Z1 | ?/? | 0.0877/0.0892 | 0.0000/0.0000 | 0.0031/0.0031 | 26.11/26.11 | 4.00 | 1.00x | 1.00x |" \
        in section
    assert section.rstrip().endswith("(zero_tradeoff.png)")
    assert tradeoff_section([summarize_run(parsed(OUR_ITERATION), RunMetadata(), "x", 2)], None) == ""


# docs/log-lines.md's time line, printed right after the comm line
TIME_LINE = ("[Rank 0] time at iteration       10 | measured: compute=123.4ms communication=45.6ms offload=0.0ms "
             "total=169.0ms | predicted: compute=120.1ms communication=50.2ms offload=0.0ms overlap=0.0ms "
             "total=170.3ms |")


def test_time_lines_read_by_name():
    """Each part read by name: a pair added later is kept, a line cut before its predicted part ends is dropped,
    a time line glued to the comm line is still found, and a compute time rounded below zero keeps its sign."""
    assert log_parser.TIME_RE.pattern in (REPO_ROOT / "docs" / "log-lines.md").read_text()
    log = parsed(TIME_LINE,
                 _comm(12, 78.302) + TIME_LINE.replace("at iteration       10", "at iteration       12")
                 .replace("offload=0.0ms total=169.0ms", "offload=0.0ms recompute=12.5ms total=169.0ms"),
                 TIME_LINE.replace("10", "14").replace("compute=123.4ms", "compute=-0.1ms"),
                 TIME_LINE.replace("10", "16")[:150])
    assert [t.iteration for t in log.times] == [10, 12, 14] and [c.iteration for c in log.comm] == [12]
    first, glued, negative = log.times
    assert first.measured_ms == {"compute": 123.4, "communication": 45.6, "offload": 0.0, "total": 169.0}
    assert first.predicted_ms == {"compute": 120.1, "communication": 50.2, "offload": 0.0, "overlap": 0.0,
                                  "total": 170.3}
    assert glued.measured_ms["recompute"] == 12.5 and glued.measured_ms["total"] == 169.0
    assert negative.measured_ms["compute"] == -0.1


def test_elapsed_seconds_and_bigscience_rank_prefix_are_read():
    (record,) = parsed("[default7]: iteration       10/     100 | consumed samples:           10 | "
                       "elapsed time per iteration (s): 2.40 | lm loss: 1.012345E+01 |").iterations
    assert (record.iteration, record.elapsed_ms, record.lm_loss) == (10, 2400.0, 10.12345)


def test_truncated_last_line_keeps_only_finished_fields():
    log = parse_log(FIXTURES / "ours" / "gpt_tiny_Z3_OL" / "train.log")
    assert log.ended_mid_line
    last = log.iterations[-1]
    assert (last.iteration, last.consumed_tokens, last.elapsed_ms, last.global_batch_size) == (4, 8192, 1450.0, 8)
    assert last.lm_loss is None  # "9.8765E+0" was cut off before its "|"


def test_folder_names_give_metadata():
    z3 = from_folder_name("gpt_tiny_Z3_OL")
    assert (z3.zero_stage, z3.offload, z3.model, z3.label) == (3, "optimizer+params", "tiny", "Z3+offload")
    dp = from_folder_name("gpt_125M_DP")
    assert (dp.zero_stage, dp.offload, dp.model, dp.label) == (0, "none", "125M", "Z0")
    alcf = from_folder_name("gpt_SP_actCkpt_GPT13B_z1_seqlen1024_mp8_pp1_sp1_nl40_hs5120_gb1_mb1")
    assert (alcf.zero_stage, alcf.model, alcf.seq_length, alcf.global_batch, alcf.micro_batch) == (
        1, "GPT13B", 1024, 1, 1)
    assert from_folder_name("gpt_actCkpt_GPT1_3B_z2_seqlen2048_mp1_pp1_sp1_nl24_hs2048_gb8_mb1").model == "GPT1_3B"
    assert from_folder_name("gpt_GPT_TINY_z0_seqlen128_mp1_pp1_sp1_nl2_hs128_gb4_mb1").model == "GPT_TINY"
    assert from_folder_name("0404090742_x1921c0s0b0n0").label is None


# ---- the CLI on the fixture runs -------------------------------------------------------------------

@pytest.fixture(scope="module")
def summary(tmp_path_factory):
    out = tmp_path_factory.mktemp("summary")
    result = run_cli(FIXTURES, "--out", out)
    assert result.returncode == 0, result.stderr
    with open(out / "summary.csv", newline="") as f:
        rows = {row["run"]: row for row in csv.DictReader(f)}
    return out, result, rows


def number(row, key):
    return float(row[key])


def test_summary_numbers_equal_hand_computed_means(summary):
    _, _, rows = summary
    z1 = rows["ours/gpt_tiny_Z1"]
    # Fixture iterations 1..6; the default --skip-first 2 leaves iterations 3..6 for throughput.
    # One iteration per interval; rates are work over time: 4 iterations of 16 x 128 tokens (1024 per
    # rank of 2) in 400 + 500 + 450 + 420 = 1770 ms.
    ms = [400.0, 500.0, 450.0, 420.0]
    assert number(z1, "tgs_mean") == pytest.approx(4 * 1024 / 1.770, rel=1e-6)  # 2314.12
    assert number(z1, "tokens_per_s") == pytest.approx(4 * 1024 / 1.770 * 2, rel=1e-6)  # world size 2
    assert number(z1, "ms_per_iter_mean") == pytest.approx(fmean(ms))
    assert number(z1, "samples_per_s_mean") == pytest.approx(4 * 16 / 1.770, rel=1e-5)
    # TFLOPs and MFU as logged (0.06, 0.05, 0.05, 0.06), weighted by each interval's time
    over_time = (0.06 * 400 + 0.05 * 500 + 0.05 * 450 + 0.06 * 420) / 1770
    assert number(z1, "tflops_mean") == pytest.approx(over_time)
    assert number(z1, "mfu_mean_pct") == pytest.approx(over_time)
    assert int(z1["intervals_used"]) == 4
    # Memory: every logging step of both ranks (rank 0 then rank 1 values per iteration).
    allocated = [0.10, 0.11, 0.12, 0.12, 0.12, 0.13, 0.12, 0.13, 0.12, 0.13, 0.12, 0.13]
    assert number(z1, "mem_alloc_mean_gb") == pytest.approx(fmean(allocated))
    assert number(z1, "mem_alloc_max_gb") == 0.13
    assert number(z1, "max_mem_alloc_peak_gb") == 0.35
    host = [1.20, 1.19, 1.22, 1.21, 1.24, 1.22, 1.25, 1.23, 1.25, 1.23, 1.26, 1.24]
    assert number(z1, "host_rss_mean_gb") == pytest.approx(fmean(host))
    assert number(z1, "host_rss_peak_gb") == 1.28
    assert number(z1, "epoch_time_s") == pytest.approx((3.700 + 1.370) / 2)
    assert z1["epoch_time_source"] == "measured" and z1["epochs_done"] == "2"
    assert number(z1, "loss_first") == 10.82345 and number(z1, "loss_last") == 8.345678
    assert [float(v) for v in z1["epoch_losses"].split(";")] == [10.40411, 8.744855]
    assert number(z1, "val_loss_last") == 8.234567
    assert number(z1, "zero_estimate_gb") == 0.036
    assert number(z1, "model_state_measured_gb") == pytest.approx(0.012 + 0.012 + 0.024)
    assert (z1["label"], z1["zero_stage"], z1["offload"], z1["model"]) == ("Z1 tiny", "1", "none", "tiny")
    assert (z1["world_size"], z1["micro_batch"], z1["global_batch"], z1["seq_length"]) == ("2", "4", "16", "128")


def test_time_per_iteration_of_a_resumed_run_with_time_lines(summary):
    """ours/gpt_tiny_Z3: a CUDA run logging every 2 of 19 iterations, a time line after each comm line. Attempt
    1 logged 2..14 and died; attempt 2 resumed from the checkpoint at 8 and logged 10..18 and 19 again."""
    out, _, rows = summary
    z3 = rows["ours/gpt_tiny_Z3"]
    assert (z3["attempts"], z3["status"], z3["intervals_used"]) == ("2", "finished", "6")
    # Each iteration's last print, the first 2 intervals of each attempt out: attempt 1's 6 and 8, attempt 2's
    # 14, 16, 18 (2 iterations each) and 19 (1); attempt 1's own 10, 12, 14 (14: 700 ms, 300 of them
    # communicating) are not counted. (iterations, measured compute, communication) in ms; total = their sum:
    kept = [(2, 380.0, 120.0), (2, 390.0, 130.0), (2, 375.0, 125.0), (2, 372.0, 118.0), (2, 383.0, 127.0),
            (1, 390.0, 140.0)]
    assert number(z3, "time_compute_ms") == pytest.approx(sum(n * c for n, c, _ in kept) / 11)  # 4190 / 11
    assert number(z3, "time_communication_ms") == pytest.approx(sum(n * c for n, _, c in kept) / 11)  # 1380 / 11
    assert number(z3, "time_total_ms") == pytest.approx(5570 / 11)  # 506.4
    assert number(z3, "time_total_ms") == pytest.approx(number(z3, "ms_per_iter_mean"))
    assert number(z3, "time_offload_ms") == 0.0
    # Predicted: 360 + 150 = 510 ms in attempt 1 (4 kept iterations), 365 + 146 = 511 ms in attempt 2 (7)
    assert number(z3, "time_compute_predicted_ms") == pytest.approx((4 * 360 + 7 * 365) / 11)  # 363.2
    assert number(z3, "time_communication_predicted_ms") == pytest.approx((4 * 150 + 7 * 146) / 11)  # 147.5
    assert number(z3, "time_total_predicted_ms") == pytest.approx((4 * 510 + 7 * 511) / 11)  # 510.6
    assert number(z3, "time_overlap_predicted_ms") == 0.0
    # the traffic over the same intervals: attempt 1's 90.604 MB at 14 is not the kept print
    assert number(z3, "traffic_mb") == 78.302
    # MFU and HFU from the kept prints' memory lines, over time (ms x iterations)
    weights = [1000, 1040, 1000, 980, 1020, 530]
    hfu = [0.99, 0.95, 0.99, 1.01, 0.97, 0.93]
    mfu = [0.75, 0.72, 0.75, 0.76, 0.73, 0.70]
    assert number(z3, "hfu_mean_pct") == pytest.approx(sum(h * w for h, w in zip(hfu, weights)) / 5570)  # 0.977
    assert number(z3, "mfu_mean_pct") == pytest.approx(sum(m * w for m, w in zip(mfu, weights)) / 5570)  # 0.738
    # epoch 1 once: attempt 1's whole line (7.2 s) beats attempt 2's partial one (4.1 s)
    assert (z3["epochs_done"], z3["epoch_time_s"], z3["partial_epochs"]) == ("1", "7.2", "")

    table = (out / "summary.md").read_text()
    header = [cell.strip() for cell in table.splitlines()[0].strip("|").split("|")]
    column = header.index("ms/iter measured/predicted")
    assert header[column - 1] == "sent MB/iter measured/predicted"
    assert header[header.index("MFU (%)") + 1] == "HFU (%)"
    cells = {line.split(" | ")[0].lstrip("| "): [c.strip() for c in line.strip("|").split("|")]
             for line in table.splitlines()[2:] if line.startswith("| Z")}
    assert cells["Z3"][column - 1:column + 1] == ["78.30/78.32", "506.4/510.6"]
    assert cells["Z3"][header.index("HFU (%)")] == "1.0"
    # no time lines (upstream Megatron-DeepSpeed, and our run without them): the empty placeholder
    for label in ("Z2", "Z1 GPT1_3B", "Z1 tiny", "Z3+offload"):
        assert cells[label][column] == "", label
    report = (out / "report.md").read_text()
    split = report[report.index("### Time per iteration: compute, communication, offload"):]
    assert ("| run | compute measured/predicted (ms) | communication measured/predicted (ms) | "
            "offload measured/predicted (ms) | overlap predicted (ms) | total measured/predicted (ms) |") in split
    assert "| Z3 | 380.9/363.2 | 125.5/147.5 | 0.0/0.0 | 0.0 | 506.4/510.6 |" in split
    assert split.count("\n| Z") == 1  # only the run that logged time lines


def test_upstream_run_numbers_and_metadata(summary):
    _, _, rows = summary
    (up,) = [row for name, row in rows.items() if name.startswith("upstream/ds_stage2")]
    # Megatron's argument dump: world size 24, ZeRO 2; throughput from iterations 3 and 4.
    assert (up["label"], up["world_size"], up["seq_length"], up["global_batch"]) == ("Z2", "24", "4096", "96")
    assert number(up, "tokens_per_s") == pytest.approx((835.918 * 19600 + 844.537 * 19400) / 39000 * 24)
    assert number(up, "ms_per_iter_mean") == pytest.approx(fmean([19600.0, 19400.0]))
    assert number(up, "loss_last") == 0.7654321 and number(up, "val_loss_last") == 0.7123456
    # report_memory (MB) after iteration 1 plus DeepSpeed's lines at steps 2..4
    assert number(up, "mem_alloc_mean_gb") == pytest.approx(fmean([18244.640625 / 1024, 17.82, 17.82, 17.82]))
    assert number(up, "max_mem_alloc_peak_gb") == 40.34
    assert up["complete"] == "True"
    alcf = rows[ALCF_RUN]
    # labelled "Z1 GPT1_3B": another Z1 run (gpt_tiny_Z1) is in the same table
    assert (alcf["label"], alcf["model"], alcf["world_size"], alcf["seq_length"]) == ("Z1 GPT1_3B", "GPT1_3B", "8", "1024")
    # No tgs logged: tokens per iteration (1 x 1024) over the iteration time.
    # Two logged intervals and --skip-first 2: the last one is kept rather than none.
    assert number(alcf, "tokens_per_s") == pytest.approx(1024 / 2.30)
    assert alcf["intervals_used"] == "1"


def test_metadata_from_ds_config_command_and_env(summary):
    _, _, rows = summary
    z3 = rows["ours/gpt_tiny_Z3_OL"]
    assert (z3["label"], z3["zero_stage"], z3["offload"], z3["model"]) == ("Z3+offload", "3", "optimizer+params", "tiny")
    assert (z3["world_size"], z3["micro_batch"], z3["global_batch"], z3["seq_length"]) == ("2", "2", "8", "256")
    assert number(z3, "tgs_mean") == 731.429  # iteration 3 only: the cut-off iteration 4 logged no tgs


def test_incomplete_runs_are_marked(summary):
    _, result, rows = summary
    assert rows["ours/gpt_tiny_Z1"]["complete"] == "True"
    z3 = rows["ours/gpt_tiny_Z3_OL"]
    assert (z3["complete"], z3["incomplete_reason"], z3["last_iteration"]) == ("False", "log ends mid-line", "4")
    alcf = rows[ALCF_RUN]
    assert alcf["complete"] == "False" and "no end-of-training marker" in alcf["incomplete_reason"]
    assert re.search(r"^Z3\+offload +INCOMPLETE ", result.stdout, re.M)  # the terminal's compact table
    assert re.search(r"^Z1 tiny +finished ", result.stdout, re.M)
    assert (rows["ours/gpt_tiny_Z1"]["status"], rows["ours/gpt_tiny_Z1"]["nan_iterations"]) == ("finished", "0")
    assert (z3["status"], alcf["status"]) == ("INCOMPLETE", "INCOMPLETE")


def test_log_without_training_lines_is_reported_and_skipped(summary):
    out, result, rows = summary
    assert not any("crashed_at_startup" in name for name in rows)
    assert "skipped" in result.stderr and "crashed_at_startup/train.log: no training lines" in result.stderr
    skipped = json.loads((out / "summary.json").read_text())["skipped"]
    assert len(skipped) == 1 and skipped[0].endswith("crashed_at_startup/train.log: no training lines")


def test_outputs_tables_report_and_readable_pngs(summary):
    out, result, rows = summary
    assert len(rows) == 5
    data = json.loads((out / "summary.json").read_text())
    assert data["skip_first"] == 2 and len(data["runs"]) == 5
    z1 = next(r for r in data["runs"] if r["run"] == "ours/gpt_tiny_Z1")
    assert z1["loss_curve"][0] == [2048, 10.82345] and len(z1["loss_curve"]) == 6
    table = (out / "summary.md").read_text()
    assert table.startswith("| run | status |") and table.count("\n| Z") == 5
    assert "| 0.0480/0.0360 |" in table  # measured model states (params+grads+optim) beside the estimate
    report = (out / "report.md").read_text()
    pngs = ["throughput.png", "epoch_time.png", "accelerator_memory.png", "host_memory.png", "loss.png"]
    for name in pngs:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000, name
        image = mpimg.imread(out / name)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100, name
        assert f"]({name})" in report
    assert not list(out.glob(".*tmp*")), "temporary files left behind"


def test_skip_first_zero_uses_every_interval(tmp_path):
    result = run_cli(FIXTURES / "ours" / "gpt_tiny_Z1", "--out", tmp_path, "--skip-first", "0", "--no-plots")
    assert result.returncode == 0, result.stderr
    (row,) = csv.DictReader(open(tmp_path / "summary.csv", newline=""))
    assert number(row, "ms_per_iter_mean") == pytest.approx(fmean([2500.0, 800.0, 400.0, 500.0, 450.0, 420.0]))
    assert not list(tmp_path.glob("*.png"))


def test_single_log_file_writes_beside_it(tmp_path):
    log = tmp_path / "gpt_tiny_Z2" / "train.log"
    log.parent.mkdir()
    # the same run printed by both ranks: each iteration must count once
    text = (FIXTURES / "ours" / "gpt_tiny_Z1" / "train.log").read_text()
    log.write_text(text + text)
    result = run_cli(log, "--no-plots")
    assert result.returncode == 0, result.stderr
    (row,) = csv.DictReader(open(tmp_path / "gpt_tiny_Z2" / "summary.csv", newline=""))
    assert row["label"] == "Z1" and row["last_iteration"] == "6"  # the run info line beats the folder name
    assert number(row, "ms_per_iter_mean") == pytest.approx(fmean([400.0, 500.0, 450.0, 420.0]))


@pytest.mark.parametrize("make_path, expected", [
    (lambda tmp: tmp / "does-not-exist", "no such file or directory"),
    (lambda tmp: shutil.copytree(FIXTURES / "ours" / "crashed_at_startup", tmp / "runs" / "crashed"),
     "no training runs found"),
    (lambda tmp: tmp, "no training runs found"),
])
def test_nothing_to_summarize_exits_non_zero_with_one_line(tmp_path, make_path, expected):
    result = run_cli(make_path(tmp_path))
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0]
    assert "Traceback" not in result.stderr
    assert not list(tmp_path.rglob("summary.*"))


def test_bad_flag_value_and_help():
    bad = run_cli(FIXTURES, "--skip-first", "-1")
    assert bad.returncode == 2 and "--skip-first -1: expected a count >= 0" in bad.stderr
    helped = run_cli("--help")
    assert helped.returncode == 0
    for word in ("--skip-first", "--out", "summary.csv", "INCOMPLETE", "tgs", "Exit status"):
        assert word in helped.stdout


# ---- run status: finished, diverged, stopped early ------------------------------------------------------

def our_iteration(iteration, total, loss, nan_count):
    """An iteration line exactly as megatron/training_log.py prints it (a NaN loss prints as NAN)."""
    from megatron.training_log import IterationStats, iteration_line
    return iteration_line(IterationStats(
        iteration=iteration, train_iters=total, consumed_samples=8 * iteration, consumed_tokens=512 * iteration,
        elapsed_ms=100.0, learning_rate=1e30, global_batch_size=8, lm_loss=loss, loss_scale=1.0, grad_norm=None,
        skipped_iterations=nan_count, nan_iterations=nan_count, samples_per_second=80.0,
        tokens_per_gpu_per_second=2560.0, tflops=0.01))


NAN = float("nan")
STOP_LINE = ("error: stopping at iteration 4: 3 iterations in a row had a non-finite loss or gradient "
             "(--max-nan-iterations 3)")
STATUS_LOGS = {
    # megatron/training.py stopped the run: iterations 2 and 3 logged NaN, the error line names 4
    "gpt_tiny_nan_stop": ([our_iteration(1, 10, 10.5, 0), our_iteration(2, 10, NAN, 1), our_iteration(3, 10, NAN, 2),
                           STOP_LINE], "diverged at iteration 4", "2"),
    # an upstream-style run that kept going: NaN from iteration 3 to its end, end marker printed
    "gpt_tiny_nan_to_end": ([our_iteration(2, 6, 10.5, 0), our_iteration(4, 6, NAN, 1), our_iteration(6, 6, NAN, 3),
                             "[after training is done] datetime: 2026-11-23 10:00:00"], "diverged at iteration 5", "3"),
    # NaN in one interval, then finite again: not diverged
    "gpt_tiny_recovered": ([our_iteration(2, 4, 10.5, 0), our_iteration(3, 4, NAN, 1), our_iteration(4, 4, 9.5, 1),
                            "[after training is done] datetime: 2026-11-23 10:00:00"], "finished", "1"),
    "gpt_tiny_exit_interval": ([our_iteration(1, 10, 10.5, 0), our_iteration(2, 10, 10.1, 0),
                                " exiting program at iteration 2 (--exit-interval 2)"],
                               "stopped early at iteration 2", "0"),
    # --exit-signal-handler: the exit line names the iteration, past the last logged one
    "gpt_tiny_sigterm": ([our_iteration(2, 10, 10.5, 0), our_iteration(4, 10, 10.1, 0),
                          " exiting program after receiving SIGTERM at iteration 5 (checkpoint saved to runs/x/ckpt)"],
                         "stopped early at iteration 5", "0"),
    "gpt_tiny_cut_off": ([our_iteration(1, 10, 10.5, 0), our_iteration(2, 10, 10.1, 0)], "INCOMPLETE", "0"),
    # --exit-duration-in-mins: Megatron's line, which names no iteration
    "gpt_tiny_exit_duration": ([our_iteration(1, 10, 10.5, 0), our_iteration(2, 10, 10.1, 0),
                                "[exiting program after 0.0234 minutes] datetime: 2026-12-06 10:00:00 "],
                               "stopped early at iteration 2", "0"),
}


def test_run_status_from_real_log_lines(tmp_path):
    for name, (lines, _, _) in STATUS_LOGS.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "train.log").write_text("\n".join(lines) + "\n")
    result = run_cli(tmp_path, "--no-plots")
    assert result.returncode == 0, result.stderr
    with open(tmp_path / "summary.csv", newline="") as f:
        rows = {row["run"]: row for row in csv.DictReader(f)}
    runs = json.loads((tmp_path / "summary.json").read_text())["runs"]
    statuses = {run["run"]: (run["status"], run["nan_iterations"]) for run in runs}
    table = (tmp_path / "summary.md").read_text()
    assert "| NaN iters |" in table.splitlines()[0]
    for name, (_, status, nan_count) in STATUS_LOGS.items():
        assert (rows[name]["status"], rows[name]["nan_iterations"]) == (status, nan_count), name
        assert statuses[name] == (status, int(nan_count))
        assert rows[name]["complete"] == str(status == "finished")
        label = next(run["label"] for run in runs if run["run"] == name)
        assert f"| {label} | {status} |" in table
    # the stop's last finite loss stays in the table, but the status says the run diverged
    assert rows["gpt_tiny_nan_stop"]["loss_last"] == "10.5"
    assert rows["gpt_tiny_nan_stop"]["incomplete_reason"] == "stopped on NaN/Inf losses"
    assert "diverged at iteration 4 (stopped on NaN/Inf losses)" in table
    assert rows["gpt_tiny_sigterm"]["incomplete_reason"] == "exited on SIGTERM"
    assert rows["gpt_tiny_exit_interval"]["incomplete_reason"] == "exited on --exit-interval"


# ---- end to end: the six real ZeRO drivers, then the summary of their runs --------------------------

@pytest.mark.slow
def test_summary_of_the_six_real_driver_runs(six_driver_runs):
    # run_all.sh is the user's command: all six drivers (2 epochs of 2 iterations each), then
    # analysis/summarize.py on their runs folder (conftest.six_driver_runs, shared with test_drivers)
    runs, result = six_driver_runs
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with open(runs / "summary.csv", newline="") as f:
        rows = {row["run"]: row for row in csv.DictReader(f)}
    expected = {"gpt_tiny_DP": ("Z0", "0", "none"), "gpt_tiny_Z1": ("Z1", "1", "none"),
                "gpt_tiny_Z2": ("Z2", "2", "none"), "gpt_tiny_Z3": ("Z3", "3", "none"),
                "gpt_tiny_Z3_OL": ("Z3+offload", "3", "optimizer+params"),
                "gpt_tiny_Z3_NVMe": ("Z3+NVMe", "3", "nvme")}
    assert set(rows) == set(expected)
    for name, (label, stage, offload) in expected.items():
        row = rows[name]
        assert (row["label"], row["zero_stage"], row["offload"], row["complete"]) == (label, stage, offload, "True")
        # 4 logged iterations less the 2 warm-up intervals
        assert (row["world_size"], row["seq_length"], row["last_iteration"], row["intervals_used"]) == (
            "2", "64", "4", "2")
        for column in ("tgs_mean", "tokens_per_s", "ms_per_iter_mean", "epoch_time_s", "mem_alloc_mean_gb",
                       "max_mem_alloc_peak_gb", "host_rss_peak_gb", "loss_first",
                       "loss_last", "val_loss_last", "traffic_mb", "traffic_predicted_mb"):
            assert float(row[column]) > 0, (name, column)
        # with the optimizer and parameters offloaded, stage 3 keeps no model state on the accelerator: its
        # gradient partition too is in host memory, beside the offloaded optimizer
        on_accelerator = number(row, "zero_estimate_gb")
        assert on_accelerator == 0 if offload != "none" else on_accelerator > 0, name
        assert (number(row, "offloaded_estimate_gb") > 0) == (offload != "none"), name
        assert number(row, "tokens_per_s") == pytest.approx(number(row, "tgs_mean") * 2)
        assert 5.0 < number(row, "loss_last") < 12.0  # GPT-2 vocab: ln(50257) = 10.8 at the start
    # ZeRO-3 shards the parameters over 2 ranks; the estimate the training printed says so
    assert number(rows["gpt_tiny_Z3"], "zero_estimate_gb") < number(rows["gpt_tiny_DP"], "zero_estimate_gb")
    for name in ("throughput.png", "epoch_time.png", "accelerator_memory.png", "host_memory.png", "loss.png"):
        png = (runs / name).read_bytes()
        assert png.startswith(PNG_MAGIC) and len(png) > 1000
        assert mpimg.imread(runs / name).shape[0] > 100
    assert "| Z3+offload | finished |" in (runs / "report.md").read_text()
    # the ZeRO trade-off: each stage's traffic and model states, measured beside predicted
    for row in rows.values():
        assert number(row, "traffic_mb") == pytest.approx(number(row, "traffic_predicted_mb"), rel=0.10)
    z1, z3 = rows["gpt_tiny_Z1"], rows["gpt_tiny_Z3"]
    # one micro-batch per step: the ZeRO paper's 1.5x
    assert 1.4 <= number(z3, "traffic_mb") / number(z1, "traffic_mb") <= 1.6
    assert number(z3, "model_state_measured_gb") < 0.8 * number(z1, "model_state_measured_gb")
    offloaded = rows["gpt_tiny_Z3_OL"]
    assert number(offloaded, "model_state_measured_gb") < 0.5 * number(z3, "model_state_measured_gb")
    assert number(offloaded, "offloaded_gb") == pytest.approx(number(offloaded, "offloaded_estimate_gb"), rel=0.10)
    report = (runs / "report.md").read_text()
    section = report[report.index("## ZeRO trade-off"):]
    assert "ratios are to Z0's measurements" in section
    for label in ("Z0", "Z1", "Z2", "Z3", "Z3+offload", "Z3+NVMe"):
        pair = r"\d\.\d{4}/\d\.\d{4}"
        row = rf"^\| {re.escape(label)} \| 4/8 \| {pair} \| {pair} \| {pair} \| \d+\.\d\d/\d+\.\d\d \|"
        assert re.search(row, section, re.M), label
    assert "![Memory per rank against traffic per iteration](zero_tradeoff.png)" in section
    assert mpimg.imread(runs / "zero_tradeoff.png").shape[0] > 100


# ---- means after a resume, and means of rates over uneven intervals ---------------------------------------

def _our_lines(attempt, iteration, ms, comm_mb):
    """One logging step of the printing rank exactly as megatron/training_log.py writes it: world size 2,
    global batch 8 x 64 tokens (256 tokens per rank per iteration), 0.5 TFLOP per rank per iteration,
    a 100 TFLOPs peak (MFU % = TFLOPs, HFU 1.5 x MFU: recomputed forwards), comm_mb MB sent per iteration."""
    from megatron.training_log import IterationStats, comm_line, iteration_line, memory_line
    seconds = ms / 1000.0
    stats = IterationStats(
        iteration=iteration, train_iters=16, consumed_samples=8 * iteration, consumed_tokens=512 * iteration,
        elapsed_ms=ms, learning_rate=1e-4, global_batch_size=8, lm_loss=10.0 - iteration / 10, loss_scale=1.0,
        grad_norm=None, skipped_iterations=0, nan_iterations=0, samples_per_second=8 / seconds,
        tokens_per_gpu_per_second=256 / seconds, tflops=0.5 / seconds)
    mem = {"allocated": 2**30, "max_allocated": 2**30, "rss": 2**30, "max_rss": 2**30}
    mfu = 100.0 * (0.5 / seconds) / 100.0
    return [iteration_line(stats), memory_line(0, "cuda", iteration, mem, mfu, 1.5 * mfu),
            comm_line(0, iteration, {"reduce_scatter": comm_mb * 2**20}, 10**6, 10 * 2**20)]


def _epoch(epoch, iteration, seconds):
    from megatron.training_log import epoch_line
    return epoch_line(epoch, iteration, 8 * iteration, seconds, 9.0)


RUN_INFO = (" > run info | zero stage: 1 | offload: none | model: tiny | world size: 2 | micro batch: 4 | "
            "global batch: 8 | seq length: 64 | train samples per epoch: 32 |")
# 4 iterations per epoch, logged every 2. Attempt 1 saved at 7 and died at 11; attempt 2 resumed from 7,
# so it ran iterations 8 and 10 again (attempt 1's lines for them stay in the log) and printed epoch 2's
# line again, timing only iteration 8 of it.
ATTEMPT_1 = ["[zero-lab] attempt 1 started 2026-11-23 20:00:00 UTC on node01: fresh start", RUN_INFO,
             *_our_lines(1, 2, 1000.0, 12.0), *_our_lines(1, 4, 500.0, 10.0), _epoch(1, 4, 2.5),
             *_our_lines(1, 6, 500.0, 10.0), *_our_lines(1, 8, 400.0, 10.0), _epoch(2, 8, 2.0),
             *_our_lines(1, 10, 400.0, 40.0)]
ATTEMPT_2 = ["[zero-lab] attempt 2 started 2026-11-23 21:00:00 UTC on node01: resuming from runs/r/checkpoints",
             RUN_INFO, *_our_lines(2, 8, 1000.0, 12.0), _epoch(2, 8, 1.1),
             *_our_lines(2, 10, 250.0, 16.0), *_our_lines(2, 12, 250.0, 10.0), _epoch(3, 12, 1.2),
             *_our_lines(2, 14, 500.0, 10.0), *_our_lines(2, 16, 500.0, 10.0), _epoch(4, 16, 2.2),
             "[after training is done] datetime: 2026-11-23 21:10:00"]


def _summary(lines, skip_first, meta=None):
    from analysis.run_metadata import from_run_info
    from analysis.run_summary import summarize_run
    log = parsed(*lines)
    return summarize_run(log, meta or from_run_info(log.run_info), "run", skip_first)


def test_summary_of_a_resumed_run_counts_each_iteration_and_epoch_once():
    s = _summary(ATTEMPT_1 + ATTEMPT_2, skip_first=1)
    assert (s.attempts, s.status, s.last_iteration) == (2, "finished", 16)
    # Last print wins: 2, 4, 6 from attempt 1; 8..16 from attempt 2. One warm-up interval per attempt
    # out (attempt 1's 2, attempt 2's 8): kept 4, 6 (500 ms), 10, 12 (250 ms), 14, 16 (500 ms), 2
    # iterations each: 12 iterations in 2 x (500 + 500 + 250 + 250 + 500 + 500) = 5000 ms.
    assert s.intervals_used == 6
    assert s.ms_per_iter_mean == pytest.approx(5000 / 12)  # 416.7
    assert s.tgs_mean == pytest.approx(12 * 256 / 5.0)  # 614.4 tokens/s per rank
    assert s.tokens_per_s == pytest.approx(12 * 512 / 5.0)  # 1228.8
    assert s.samples_per_s_mean == pytest.approx(12 * 8 / 5.0)  # 19.2
    assert s.tflops_mean == pytest.approx(12 * 0.5 / 5.0)  # 1.2
    # MFU from the memory lines of the kept prints only (attempt 1's line at iteration 10 said 1.25%):
    # the kept TFLOPs over the 100 TFLOPs peak
    assert s.mfu_mean_pct == pytest.approx(1.2)
    assert s.hfu_mean_pct == pytest.approx(1.8)
    # Traffic: 10 MB per iteration except attempt 2's iteration 10 (16 MB); attempt 1's 40 MB at 10 is
    # not the kept print. Equal intervals: (10 + 10 + 16 + 10 + 10 + 10) / 6.
    assert s.traffic_mb == pytest.approx(66 / 6)
    assert s.traffic_predicted_mb == pytest.approx(10.0)
    # Epochs 1..4 once each; epoch 2's whole line (attempt 1, 2.0 s) beats attempt 2's partial one (1.1 s).
    assert (s.epochs_done, s.partial_epochs, s.epoch_time_source) == (4, [], "measured")
    assert s.epoch_time_s == pytest.approx((2.5 + 2.0 + 1.2 + 2.2) / 4)  # 1.975
    assert len(s.epoch_losses) == 4


def test_refused_attempts_that_trained_nothing_give_the_row_neither_batch_sizes_nor_attempts(tmp_path):
    """Issue 56, item 7: a run trained at 4/8 in 2 attempts, then was launched 6 more times and refused (at
    start-up, with command.txt and the log appended; the last found nothing to train after printing its run info
    line at 4/4): its row said attempts 8 and 4/4."""
    from analysis.collect import collect
    refused = [f"[zero-lab] attempt {n} started 2026-11-23 22:0{n}:00 UTC on node01: resuming from runs/r/checkpoints"
               for n in range(3, 9)]
    nothing = [RUN_INFO.replace("global batch: 8", "global batch: 4"),
               "nothing to train: the checkpoint resumed is at iteration 16, already at or past the 16 iterations "
               "asked for; ask for more iterations, or start afresh with FRESH=1 or under another RUN_NAME",
               "[after training is done] datetime: 2026-11-23 22:09:00"]
    lines = ATTEMPT_1 + ATTEMPT_2
    for header in refused[:-1]:
        lines += [header, "error: --global-batch-size 4 is not divisible by --micro-batch-size 4 x data-parallel "
                          "size 2"]
    lines += [refused[-1], *nothing]
    run = tmp_path / "gpt_tiny_Z1"
    run.mkdir()
    (run / "train.log").write_text("\n".join(lines) + "\n")
    commands = [f"# attempt {n} | 2026-11-23 2{n}:00:00 UTC | node01\ntorchrun --nproc-per-node 2 pretrain_gpt.py "
                f"--micro-batch-size 4 --global-batch-size {8 if n < 3 else 4} --seq-length 64" for n in range(1, 9)]
    (run / "command.txt").write_text("\n".join(commands) + "\n")
    s, = collect(tmp_path, skip_first=1).runs
    assert (s.attempts, s.micro_batch, s.global_batch, s.world_size) == (2, 4, 8, 2)
    assert (s.status, s.last_iteration) == ("finished", 16)
    # without the run info line the command of the last attempt that trained (attempt 2's) gives the batch sizes
    (run / "train.log").write_text("\n".join(line for line in lines if "> run info" not in line) + "\n")
    s, = collect(tmp_path, skip_first=1).runs
    assert (s.attempts, s.micro_batch, s.global_batch) == (2, 4, 8)


def test_an_epoch_only_a_resumed_attempt_logged_is_partial():
    from analysis.report import markdown_table, notes
    # attempt 1 died at 7 (before epoch 2's end), so epoch 2's only line times iterations 8 only
    s = _summary(ATTEMPT_1[:-8] + ATTEMPT_2, skip_first=1)
    assert (s.epochs_done, s.partial_epochs) == (4, [2])
    assert s.epoch_time_s == pytest.approx((2.5 + 1.2 + 2.2) / 3)  # the whole epochs 1, 3, 4
    # summary.md and report.md: the epoch time cell, and the note under the table saying what it leaves out
    assert "| 2.0 |" in markdown_table([s])  # 1.967
    assert (f"- {s.label}: epoch 2 partial (logged only by an attempt that resumed inside it), left out of the epoch "
            "time") in notes([s], [], 1)
    assert "partial" not in notes([_summary(ATTEMPT_1 + ATTEMPT_2, skip_first=1)], [], 1)


def _time_line(iteration: int, measured: dict, predicted: dict) -> str:
    """docs/log-lines.md's time line: ms per iteration by part (TIME_LINE's format)."""
    def parts(values):
        return " ".join(f"{name}={ms:.1f}ms" for name, ms in values.items())
    return f"[Rank 0] time at iteration {iteration:8d} | measured: {parts(measured)} | predicted: {parts(predicted)} |"


def _with_time_lines(lines: list[str]) -> list[str]:
    """The lines with a time line after each comm line, as training_log.py prints them: the step's time (the
    iteration line's) split into 1 ms of communication per MB sent and compute; a flat 400 ms prediction."""
    out = []
    for line in lines:
        out.append(line)
        if (elapsed := log_parser.ELAPSED_MS_RE.search(line)) is not None:
            ms = float(elapsed.group(1))
        if (comm := log_parser.COMM_RE.search(line)) is not None:
            sent = float(comm.group(2))
            out.append(_time_line(int(comm.group(1)), dict(compute=ms - sent, communication=sent, offload=0.0,
                                                           total=ms),
                                  dict(compute=300.0, communication=100.0, offload=0.0, overlap=0.0, total=400.0)))
    return out


def test_time_per_iteration_over_the_steady_state_of_a_resumed_run():
    """The time lines' means use the throughput's intervals and weights: each iteration's last print (attempt
    1's lines for 8 and 10 not counted), without each attempt's warm-up."""
    s = _summary(_with_time_lines(ATTEMPT_1 + ATTEMPT_2), skip_first=1)
    # the measured total is the iteration line's time, so its mean is ms/iter
    assert s.time_total_ms == pytest.approx(s.ms_per_iter_mean) and s.time_total_ms == pytest.approx(5000 / 12)
    # kept 4, 6, 10, 12, 14, 16 (attempt 1's 10 sent 40 MB, attempt 2's 16): as the traffic
    assert s.time_communication_ms == pytest.approx(66 / 6)
    assert s.time_compute_ms == pytest.approx(5000 / 12 - 66 / 6)
    assert (s.time_offload_ms, s.time_offload_predicted_ms, s.time_overlap_predicted_ms) == (0.0, 0.0, 0.0)
    assert (s.time_compute_predicted_ms, s.time_communication_predicted_ms, s.time_total_predicted_ms) == (
        300.0, 100.0, 400.0)


def _upstream_iteration(iteration, ms):
    """UPSTREAM_ITERATION's format (Megatron-DeepSpeed): global batch 8 x 64 tokens on 2 ranks."""
    seconds = ms / 1000.0
    return (f" iteration {iteration:8d}/{45:8d} | consumed samples: {8 * iteration:12d} | consumed tokens: "
            f"{512 * iteration:12d} | elapsed time per iteration (ms): {ms:.1f} | learning rate: 2.407E-04 | "
            f"global batch size:     8 | lm loss: 6.543210E-01 | loss scale: 1.0 | actual seqlen:    64 | "
            f"number of skipped iterations:   0 | number of nan iterations:   0 | samples per second: "
            f"{8 / seconds:.3f} | tokens per gpu per second(tgs): {256 / seconds:.3f} | TFLOPs: 1.00 |")


def test_uneven_and_partial_intervals_and_an_upstream_resume():
    from analysis.run_metadata import RunMetadata
    # An upstream log (no attempt headers), logging every 10 of 45 iterations. The first launch logged
    # 10..40 and died; the second resumed from the checkpoint at 20: its iteration 30 goes back, which
    # starts a second attempt, whose first interval (3000 ms) is warm-up like the first launch's 10.
    lines = [_upstream_iteration(10, 2000.0), _upstream_iteration(20, 800.0), _upstream_iteration(30, 1200.0),
             _upstream_iteration(40, 800.0),
             _upstream_iteration(30, 3000.0), _upstream_iteration(40, 1200.0), _upstream_iteration(45, 800.0),
             "[after training is done] datetime: 2024-03-07 16:00:00"]
    s = _summary(lines, skip_first=1, meta=RunMetadata(world_size=2, global_batch=8, seq_length=64))
    assert (s.attempts, s.status, s.intervals_used) == (2, "finished", 3)
    # Kept: 20 (10 iterations of 800 ms), 40 of the second launch (10 of 1200 ms), 45 (5 of 800 ms):
    # 25 iterations x 256 tokens per rank in 8000 + 12000 + 4000 = 24000 ms.
    assert s.ms_per_iter_mean == pytest.approx(24000 / 25)  # 960
    assert s.tgs_mean == pytest.approx(25 * 256 / 24.0, rel=1e-5)  # 266.67; logged 320.0, 213.333, 320.0
    assert s.tokens_per_s == pytest.approx(25 * 512 / 24.0, rel=1e-5)  # 533.33
    assert s.samples_per_s_mean == pytest.approx(25 * 8 / 24.0, rel=1e-4)  # 8.333
    # The mean of the logged rates would read (320 + 213.333 + 320) / 3 = 284.4, 6.7% high; the two
    # full intervals alone (800 and 1200 ms) (320 + 213.333) / 2 = 266.7 against 20 x 256 / 20 s = 256, +4.2%.


# ---- a real resumed run ---------------------------------------------------------------------------------

def _printed(attempt_text: str, pattern: str) -> dict[int, float]:
    """iteration -> the number a line of one attempt printed after it (the first group names the iteration)."""
    return {int(it): float(value) for it, value in re.findall(pattern, attempt_text, re.M)}


@pytest.mark.slow
def test_summary_of_a_real_resumed_run(dolly_data_dir, tmp_path):
    """The Z1 driver on 2 CPU ranks, 3 epochs of 2 iterations, a checkpoint every 3. Attempt 1 stops at
    iteration 5 (--exit-interval), saving global_step5; that save is then damaged (a truncated file), so
    attempt 2 resumes from global_step3: iterations 4 and 5 are run and printed twice, and epoch 2
    (iterations 3-4) spans the attempts (attempt 2 prints its line again, timing only iteration 4).
    The summary's figures are computed here by hand from the lines each attempt printed."""
    from conftest import driver_env
    from analysis.run_metadata import from_run_info
    from analysis.run_summary import summarize_run
    env = driver_env(dolly_data_dir, tmp_path, SAVE_INTERVAL=3)
    env.update(TRAIN_EPOCHS="3", EVAL_INTERVAL="100", EVAL_ITERS="0")
    driver = ["bash", str(REPO_ROOT / "examples_zero" / "gpt_deepspeed_Z1.sh")]
    first = subprocess.run([*driver, "--exit-interval", "5"], env=env, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    folder = tmp_path / "gpt_tiny_Z1"
    checkpoints = folder / "checkpoints"
    assert (checkpoints / "latest").read_text() == "global_step5"
    (checkpoints / "global_step5" / "mp_rank_00_model_states.pt").write_bytes(b"x")  # a save cut short
    second = subprocess.run(driver, env=env, capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    text = (folder / "train.log").read_text()
    attempts = re.split(r"^\[zero-lab\] attempt \d started .*$", text, flags=re.M)[1:]
    assert len(attempts) == 2 and "resuming from global_step3" in second.stderr, second.stderr[-3000:]

    iteration = r"^ iteration +(\d+)/ +6 \|.*?"
    ms = [_printed(a, iteration + r"elapsed time per iteration \(ms\): (\d+\.\d+)") for a in attempts]
    tgs = [_printed(a, iteration + r"\(tgs\): (\d+\.\d+)") for a in attempts]
    tflops = [_printed(a, iteration + r"TFLOPs: (\d+\.\d+)") for a in attempts]
    epochs = [_printed(a, r"^ epoch +(\d+) done \|.*?epoch time \(s\): (\d+\.\d+)") for a in attempts]
    assert (sorted(ms[0]), sorted(ms[1])) == ([1, 2, 3, 4, 5], [4, 5, 6])  # 4 and 5 twice
    assert (sorted(epochs[0]), sorted(epochs[1])) == ([1, 2], [2, 3])  # epoch 2 twice

    log = parse_log(folder / "train.log")
    s = summarize_run(log, from_run_info(log.run_info), "gpt_tiny_Z1", skip_first=1)
    assert (s.attempts, s.status, s.last_iteration) == (2, "finished", 6)
    # By hand: each iteration's last print (1-3 from attempt 1, 4-6 from attempt 2), the first interval of each
    # attempt out (attempt 1's 1, attempt 2's 4): kept attempt 1's 2 and 3, attempt 2's 5 and 6, one
    # iteration each; attempt 1's 5 (and 4) not used.
    kept_ms = [ms[0][2], ms[0][3], ms[1][5], ms[1][6]]
    kept_tgs = [tgs[0][2], tgs[0][3], tgs[1][5], tgs[1][6]]
    kept_tflops = [tflops[0][2], tflops[0][3], tflops[1][5], tflops[1][6]]
    assert s.intervals_used == 4
    assert s.ms_per_iter_mean == pytest.approx(sum(kept_ms) / 4)
    # tokens over time: 8 x 64 tokens per iteration (global batch 8, seq 64), 256 per rank of 2; the logged
    # rates are rounded (ms to 0.1), hence the tolerance
    assert (s.global_batch, s.seq_length, s.world_size) == (8, 64, 2)
    assert s.tgs_mean == pytest.approx(4 * 256 / (sum(kept_ms) / 1000), rel=1e-3)
    assert s.tgs_mean == pytest.approx(sum(t * m for t, m in zip(kept_tgs, kept_ms)) / sum(kept_ms), rel=1e-9)
    assert s.tokens_per_s == pytest.approx(2 * s.tgs_mean)
    assert s.tflops_mean == pytest.approx(sum(t * m for t, m in zip(kept_tflops, kept_ms)) / sum(kept_ms))
    # no peak is known for a CPU: said once per launch, and no MFU/HFU in the memory lines or the summary
    assert [part.count(" > MFU and HFU not reported: 'cpu' (no part known;") for part in attempts] == [1, 1]
    assert "MFU=" not in text and s.mfu_mean_pct is None and s.hfu_mean_pct is None
    # Epochs once each: epoch 2's whole line is attempt 1's (attempt 2's timed iteration 4 only)
    assert (s.epochs_done, s.partial_epochs, s.epoch_time_source) == (3, [], "measured")
    assert s.epoch_time_s == pytest.approx((epochs[0][1] + epochs[0][2] + epochs[1][3]) / 3)


def test_summarizing_a_reference_sweep_points_to_compare():
    """A reference sweep's folder keeps its summary, not its logs: summarizing it says how to compare with it."""
    reference = REPO_ROOT / "runs" / "reference" / "cpu-2rank"
    result = subprocess.run([sys.executable, str(REPO_ROOT / "analysis" / "summarize.py"), str(reference)],
                            env=test_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip() == (f"error: {reference}: no training runs found (no log with iteration lines); it "
                                     "is a reference sweep: compare runs with it by python analysis/summarize.py "
                                     f"runs/ --compare {reference}")


def _moe_iteration(iteration: int, load: float, dropped: float, routed: bool = True) -> str:
    from megatron.training_log import IterationStats, MoEStats, iteration_line
    return iteration_line(IterationStats(
        iteration=iteration, train_iters=6, consumed_samples=8 * iteration, consumed_tokens=512 * iteration,
        elapsed_ms=500.0, learning_rate=1e-4, global_batch_size=8, lm_loss=10.0 - iteration / 10, loss_scale=1.0,
        grad_norm=1.0, skipped_iterations=0, nan_iterations=0, samples_per_second=16.0,
        tokens_per_gpu_per_second=512.0, tflops=0.1,
        moe=MoEStats(0.1 + iteration / 100, load, dropped) if routed else None))


def test_an_moe_runs_routing_is_read_and_plotted_over_iterations(tmp_path):
    lines = [RUN_INFO] + [_moe_iteration(i, 1.0 + i / 10, i / 100) for i in range(1, 7)]
    [record] = parsed(lines[1]).iterations
    assert (record.moe_loss, record.expert_load, record.tokens_dropped) == (0.11, 1.1, 0.01)
    log = tmp_path / "runs" / "gpt_tiny_Z1" / "train.log"
    log.parent.mkdir(parents=True)
    log.write_text("\n".join(lines) + "\n")
    result = run_cli(tmp_path / "runs", "--out", tmp_path / "out", "--skip-first", "0")
    assert result.returncode == 0, result.stderr
    [run] = json.loads((tmp_path / "out" / "summary.json").read_text())["runs"]
    assert run["moe_curve"][0] == [1, 0.11, 1.1, 0.01] and len(run["moe_curve"]) == 6
    image = mpimg.imread(tmp_path / "out" / "moe.png")
    assert image.ndim == 3 and image.shape[0] > 100
    assert "](moe.png)" in (tmp_path / "out" / "report.md").read_text()
    assert "moe_curve" not in (tmp_path / "out" / "summary.csv").read_text()


def test_a_ulysses_runs_sp_size_is_in_its_log_and_in_the_summary(tmp_path):
    """Issue 56, item 7: a Ulysses run's log never named its SP size, and the summary had no SP column. The run info
    line names SP above 1 (a zero-lab line without it is SP 1); upstream logs give it by Megatron's argument dump,
    command.txt or ALCF's folder name (_sp2_)."""
    from analysis.run_metadata import from_arguments, from_folder_name
    from megatron.training_log import run_info_line
    ulysses = run_info_line(1, "none", "tiny", 2, 4, 4, 64, 32, sp=2)
    assert ulysses.endswith("| train samples per epoch: 32 | SP: 2 |")
    assert run_info_line(1, "none", "tiny", 2, 4, 8, 64, 32, sp=1) == RUN_INFO  # SP 1 is not named
    body = [_moe_iteration(i, 1.0, 0.0, routed=False) for i in range(1, 5)]
    for name, info in (("gpt_tiny_Z1_ulysses", ulysses), ("gpt_tiny_Z1", RUN_INFO)):
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "train.log").write_text("\n".join([info, *body]) + "\n")
    result = run_cli(tmp_path / "runs", "--out", tmp_path / "out", "--no-plots")
    assert result.returncode == 0, result.stderr
    table = [line for line in (tmp_path / "out" / "summary.md").read_text().splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in table[0].strip("|").split("|")]
    column = header.index("SP")
    assert header[column - 1: column + 2] == ["ranks", "SP", "micro/global batch"]
    rows = {cells[-1]: cells[column] for line in table[2:]
            if (cells := [cell.strip() for cell in line.strip("|").split("|")] + [line])}
    assert sorted(rows.values()) == ["1", "2"]
    with open(tmp_path / "out" / "summary.csv", newline="") as f:
        assert {row["run"]: row["sequence_parallel"] for row in csv.DictReader(f)} == {
            "gpt_tiny_Z1_ulysses": "2", "gpt_tiny_Z1": "1"}
    assert from_arguments({"ds_sequence_parallel_size": "4"}).sequence_parallel == 4
    assert from_folder_name(ALCF_RUN.split("/")[-1]).sequence_parallel == 1


def test_a_dense_run_has_no_moe_plot(summary):
    out, _, _ = summary
    assert not (out / "moe.png").exists()
    assert all(run["moe_curve"] == [] for run in json.loads((out / "summary.json").read_text())["runs"])


MOE_COLUMNS = ["experts", "EP", "top-k", "params total/active", "moe loss mean/last",
               "expert load (max/mean) mean/last", "tokens dropped mean/last"]


def _write_log(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True)
    path.write_text("\n".join(lines) + "\n")


def test_an_moe_runs_summary_has_the_moe_columns_and_a_dense_runs_are_empty(tmp_path):
    from analysis.run_metadata import from_run_info
    from megatron.training_log import parameters_line, run_info_line
    moe_info = run_info_line(1, "none", "tiny-moe4", 2, 4, 8, 64, 32, [4], 2, 2)
    assert moe_info.endswith("| train samples per epoch: 32 | experts: 4 | EP: 2 | top-k: 2 |")
    pyramid = run_info_line(1, "none", "tiny", 2, 4, 8, 64, 32, [4, 8], 1, 1)
    assert pyramid.endswith("| experts: 4 8 | EP: 1 | top-k: 1 |")
    assert from_run_info(parsed(pyramid).run_info).num_experts == [4, 8]
    assert run_info_line(1, "none", "tiny", 2, 4, 8, 64, 32) == RUN_INFO  # a dense run's line is as before
    moe = [moe_info, parameters_line(1_204_224, 807_936, 1_006_080, 1_006_080)]
    moe += [_moe_iteration(i, 1.0 + i / 10, i / 100) for i in range(1, 7)]
    dense = [RUN_INFO, parameters_line(807_936, 807_936, 807_936, 807_936)]
    dense += [_moe_iteration(i, 0, 0, routed=False) for i in range(1, 7)]
    _write_log(tmp_path / "runs" / "moe" / "train.log", moe)
    _write_log(tmp_path / "runs" / "dense" / "train.log", dense)
    out = tmp_path / "out"
    result = run_cli(tmp_path / "runs", "--out", out, "--skip-first", "2", "--no-plots")
    assert result.returncode == 0, result.stderr
    assert "(the full table, 35 columns)" in result.stdout
    # iterations 3-6 kept, one iteration an interval: moe loss 0.13-0.16, load 1.3-1.6, dropped 0.03-0.06
    expected = {"moe": ["4", "2", "2", "1,204,224/807,936", "0.1450/0.1600", "1.450/1.600", "0.0450/0.0600"],
                "dense": ["", "", "", "807,936/807,936", "", "", ""]}
    for page in ("summary.md", "report.md"):
        table = [line for line in (out / page).read_text().splitlines() if line.startswith("| ")]
        header = [cell.strip() for cell in table[0].strip("|").split("|")]
        assert header[-7:] == MOE_COLUMNS
        rows = {cells[0]: cells[-7:] for line in table[2:]
                if (cells := [cell.strip() for cell in line.strip("|").split("|")])}
        assert rows == {"Z1 tiny-moe4": expected["moe"], "Z1 tiny": expected["dense"]}
    with open(out / "summary.csv", newline="") as f:
        csv_rows = {row["label"]: row for row in csv.DictReader(f)}
    moe_row, dense_row = csv_rows["Z1 tiny-moe4"], csv_rows["Z1 tiny"]
    assert (moe_row["num_experts"], moe_row["expert_parallel"], moe_row["topk"]) == ("4", "2", "2")
    assert (moe_row["params_total"], moe_row["params_active"]) == ("1204224", "807936")
    assert float(moe_row["moe_loss_mean"]) == pytest.approx(0.145) and float(moe_row["moe_loss_last"]) == 0.16
    assert float(moe_row["expert_load_mean"]) == pytest.approx(1.45) and float(moe_row["expert_load_last"]) == 1.6
    assert float(moe_row["tokens_dropped_mean"]) == pytest.approx(0.045)
    assert float(moe_row["tokens_dropped_last"]) == 0.06
    moe_fields = [name for name in moe_row if name.startswith(("moe_loss", "expert_", "tokens_dropped", "num_experts",
                                                               "topk"))]
    assert len(moe_fields) == 9 and all(dense_row[name] == "" for name in moe_fields)
    runs = {run["label"]: run for run in json.loads((out / "summary.json").read_text())["runs"]}
    assert runs["Z1 tiny-moe4"]["num_experts"] == [4] and runs["Z1 tiny-moe4"]["expert_load_last"] == 1.6
    assert runs["Z1 tiny-moe4"]["moe_loss_mean"] == pytest.approx(0.145)
    assert all(runs["Z1 tiny"][name] is None for name in moe_fields)
    assert runs["Z1 tiny"]["params_active"] == 807936


def test_the_moe_layout_is_read_from_upstreams_argument_dump():
    from analysis.run_metadata import from_arguments
    log = parsed("  num_experts ..................................... [8, 16]",
                 "  moe_expert_parallel_size ........................ 2", "  topk ............................ 1")
    meta = from_arguments(log.arguments)
    assert (meta.num_experts, meta.expert_parallel, meta.topk) == ([8, 16], 2, 1)
    dense = from_arguments(parsed("  num_experts ................. [1]", "  topk ....... 1").arguments)
    assert (dense.num_experts, dense.expert_parallel, dense.topk) == (None, None, None)


def test_a_dense_sweeps_table_has_no_moe_columns(summary):
    from analysis.report import MARKDOWN_COLUMNS
    out, _, rows = summary
    header = [cell.strip() for cell in (out / "summary.md").read_text().splitlines()[0].strip("|").split("|")]
    assert header == [name for name, _ in MARKDOWN_COLUMNS]
    assert all(row["moe_loss_mean"] == row["num_experts"] == "" for row in rows.values())
