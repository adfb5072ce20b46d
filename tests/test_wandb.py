"""Weights & Biases, optional (issue 33 item 2): --wandb-project/--wandb-exp-name/--wandb-save-dir; the rank that
prints logs the scalars TensorBoard gets, the run's config and the DeepSpeed JSON; without wandb, or without
network, a run that asked for it says so in one line and trains on. Offline (WANDB_MODE=offline): what the run
folder holds is read back from wandb's own transaction log."""
import json
import re
import struct
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, free_port, test_env
from megatron.arguments import parse_args

ARGV = ["--model-size", "tiny", "--seq-length", "64", "--micro-batch-size", "2", "--train-iters", "4",
        "--data-path", "unused"]


def test_the_flags_are_megatron_deepspeeds():
    log = parse_args([*ARGV, "--wandb-project", "zl", "--wandb-exp-name", "z1", "--wandb-save-dir", "/tmp/w"],
                     world_size=2).logging
    assert (log.wandb_project, log.wandb_exp_name, log.wandb_save_dir) == ("zl", "z1", "/tmp/w")
    # none given, or given empty (a driver's variable left empty): no wandb
    for argv in (ARGV, [*ARGV, "--wandb-project", "", "--wandb-exp-name", ""]):
        log = parse_args(argv, world_size=2).logging
        assert (log.wandb_project, log.wandb_exp_name, log.wandb_save_dir) == (None, None, None)


def wandb_env(tmp_path, **overrides) -> dict:
    """test_env with wandb's own folders (settings, cache, logs) in tmp_path, not the user's home."""
    return test_env(WANDB_CONFIG_DIR=tmp_path / "wandb-config", WANDB_CACHE_DIR=tmp_path / "wandb-cache",
                    WANDB_DATA_DIR=tmp_path / "wandb-data", **overrides)


def pretrain(data_dir, tmp_path, *extra, env=None, iters=4) -> subprocess.CompletedProcess:
    """pretrain_gpt.py on 2 CPU ranks: logged every 2 iterations, evaluated at the last."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(REPO_ROOT / "pretrain_gpt.py"), "--model-size", "tiny", "--seq-length", "64",
           "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(iters), "--log-interval", "2",
           "--eval-interval", str(iters), "--eval-iters", "1", "--lr", "1e-3", "--seed", "7", "--zero-stage", "1",
           "--data-path", str(data_dir / "dolly_text_document"), "--vocab-file", str(data_dir / "gpt2-vocab.json"),
           "--merge-file", str(data_dir / "gpt2-merges.txt"), *extra]
    run = subprocess.run(cmd, env=env or test_env(), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run


# ---- wandb's offline run folder, read back ---------------------------------------------------------------------

BLOCK = 32768  # the .wandb file: a 7-byte header (":W&B", magic, version), then LevelDB's log format in 32 KiB blocks


def wandb_records(path):
    """The records of a .wandb transaction log, as wandb's own protobuf messages (wandb 0.31 has no Python reader;
    `wandb sync` reads it in Go): each record is LevelDB log chunks (crc32c, length, type: full/first/middle/last)."""
    from wandb.proto import wandb_internal_pb2
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    position, payload = 7, b""
    while position + 7 <= len(data):
        left = BLOCK - position % BLOCK
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if left < 7 or (kind == 0 and length == 0):  # a block's zero padding
            position += left
            continue
        payload += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # full, last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            payload = b""
            yield record


def offline_run(save_dir):
    """(project, run name, config, {step: history row}) of the one offline run under save_dir."""
    [folder] = (save_dir / "wandb").glob("offline-run-*")  # one rank logs: one run
    [log] = folder.glob("run-*.wandb")
    project = name = config = None
    history = {}
    for record in wandb_records(log):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            project, name = record.run.project, record.run.display_name
            config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
        elif kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[row["_step"]] = row
    return project, name, config, history


def printed(pattern: str, text: str) -> dict[int, float]:
    """{iteration: the value the line printed} for the lines `pattern` matches (groups: iteration, value)."""
    return {int(it): float(value) for it, value in re.findall(pattern, text)}


@pytest.mark.slow
def test_an_offline_run_logs_the_scalars_config_and_deepspeed_json(dolly_data_dir, tmp_path):
    pytest.importorskip("wandb", reason="wandb is not installed: pip install -e .[wandb] (the test extra has it)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    save_dir, run_dir = tmp_path / "wandb-files", tmp_path / "run"
    run = pretrain(dolly_data_dir, tmp_path, "--wandb-project", "zl-test", "--wandb-exp-name", "offline-z1",
                   "--wandb-save-dir", str(save_dir), "--run-dir", str(run_dir),
                   "--tensorboard-dir", str(tmp_path / "tb"),
                   env=wandb_env(tmp_path, WANDB_MODE="offline", ZERO_LAB_SKIP_PROBES=0))  # the step-time scalars
    assert "--wandb-project" not in run.stdout  # it started: no line saying otherwise
    project, name, config, history = offline_run(save_dir)
    assert (project, name) == ("zl-test", "offline-z1")

    # the config: every section of the flags, the schedule they come to, the DeepSpeed JSON actually used
    assert config["deepspeed_config"] == json.loads((run_dir / "ds_config.json").read_text())
    assert config["deepspeed_config"]["zero_optimization"]["stage"] == 1
    assert config["schedule"]["train_iters"] == config["training"]["train_iters"] == 4
    assert (config["training"]["global_batch_size"], config["model"]["seq_length"]) == (8, 64)
    assert config["deepspeed"]["zero_stage"] == 1 and config["model"]["params_dtype"] == "torch.float32"
    assert config["logging"]["wandb_project"] == "zl-test" and config["model_name"] == "tiny"

    # the scalars: one row per logging interval, the values the log lines printed
    assert sorted(history) == [2, 4]
    out = run.stdout
    # (the printed values, the tolerance: half the last digit printed)
    expected = {
        "lm loss": (printed(r" iteration +(\d+)/.*?\| lm loss: (\S+) \|", out), dict(rel=1e-6)),
        "learning-rate": (printed(r" iteration +(\d+)/.*?\| learning rate: (\S+) \|", out), dict(rel=1e-3)),
        "grad-norm": (printed(r" iteration +(\d+)/.*?\| grad norm: (\S+) \|", out), dict(abs=5e-4)),
        "tgs": (printed(r" iteration +(\d+)/.*?\(tgs\): (\S+) \|", out), dict(abs=5e-4)),
        "iteration-time": ({it: ms / 1000 for it, ms in printed(r" iteration +(\d+)/.*?\(ms\): (\S+) \|",
                                                                  out).items()}, dict(abs=5e-5)),
        "memory/host-rss-GB": (printed(r"memory at iteration +(\d+) \|.*? HostRSS=(\S+)GB", out), dict(abs=5e-3)),
        "traffic/total-MB": (printed(r"comm at iteration +(\d+) \|.* total=(\S+)MB \|", out), dict(abs=5e-4)),
        "traffic/predicted-MB": (printed(r"comm at iteration +(\d+) \|.* predicted=(\S+)MB \|", out),
                                 dict(abs=5e-4)),
        "step-time/measured-total-ms": (printed(r"time at iteration +(\d+) \| measured: .*?total=(\S+)ms", out),
                                        dict(abs=0.05)),
        "step-time/measured-communication-ms": (printed(r"time at iteration +(\d+) \| measured: .*?communication="
                                                        r"(\S+)ms", out), dict(abs=0.05)),
        "step-time/predicted-total-ms": (printed(r"time at iteration +(\d+) \| measured: .*\| predicted: .*?total="
                                                 r"(\S+)ms", out), dict(abs=0.05)),
    }
    for key, (values, tolerance) in expected.items():
        assert sorted(values) == [2, 4], key
        for step, value in values.items():
            assert history[step][key] == pytest.approx(value, **tolerance), (key, step)
    assert history[2]["TFLOPs"] > 0 and history[4]["memory/max-allocated-GB"] > 0
    assert history[4]["validation lm loss"] == pytest.approx(
        float(re.search(r"validation loss at iteration 4 \| lm loss value: (\S+) \|", out).group(1)), rel=1e-6)
    for part in ("compute", "communication", "offload", "overlap"):
        assert f"step-time/predicted-{part}-ms" in history[4]
    assert {"traffic/reduce_scatter-MB", "traffic/all_gather-MB", "traffic/bytes-per-param"} <= set(history[4])

    # the same scalars as TensorBoard's, under the same names
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {key for row in history.values() for key in row
                                              if not key.startswith("_")}


@pytest.mark.slow
def test_a_run_whose_wandb_cannot_be_imported_says_so_in_one_line_and_trains_on(dolly_data_dir, tmp_path):
    """A real import failure: a `wandb` package first on the path whose import raises ImportError."""
    (tmp_path / "broken" / "wandb").mkdir(parents=True)
    (tmp_path / "broken" / "wandb" / "__init__.py").write_text(
        'raise ImportError("this wandb is a broken stand-in (tests/test_wandb.py)")\n')
    env = test_env()
    env["PYTHONPATH"] = f"{tmp_path / 'broken'}:{env['PYTHONPATH']}"
    run = pretrain(dolly_data_dir, tmp_path, "--wandb-project", "zl-test", env=env)
    output = (run.stdout + run.stderr).splitlines()
    assert [line for line in output if "wandb" in line.lower()] == [
        "warning: --wandb-project zl-test: wandb cannot be imported (this wandb is a broken stand-in "
        "(tests/test_wandb.py)); training goes on without it (pip install -e .[wandb])"]
    assert len(re.findall(r"^ iteration +\d+/ +4 \|", run.stdout, re.M)) == 2
    assert "[after training is done]" in run.stdout
    assert not (tmp_path / "wandb").exists()


@pytest.mark.slow
def test_wandb_without_network_is_one_line_not_an_error(tmp_path):
    """wandb online with nothing to reach (a closed local port as its server) gives up after its init timeout:
    one line, no exception, so the run trains on."""
    pytest.importorskip("wandb", reason="wandb is not installed: pip install -e .[wandb] (the test extra has it)")
    code = ("from megatron.wandb_writer import open_wandb\n"
            "writer, line = open_wandb('zl-test', None, 'files', 'runs/gpt_tiny_Z1', {'a': 1})\n"
            "print('RESULT', writer, line)\n")
    env = wandb_env(tmp_path, WANDB_MODE="online", WANDB_BASE_URL=f"http://127.0.0.1:{free_port()}",
                    WANDB_API_KEY="a" * 40, WANDB_INIT_TIMEOUT="5")
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    [line] = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert line.startswith("RESULT None warning: --wandb-project zl-test: wandb did not start (CommError: ")
    assert line.endswith("); training goes on without it (WANDB_MODE=offline logs without network)")
