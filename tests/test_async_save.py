"""--async-save (megatron/checkpointing/async_save.py): the host copy, the flag and its driver variable, and real
2-rank runs against the saved-checkpoint run's losses (tests/runs.py): every background checkpoint committed with its
manifest and resumable; a rank SIGKILLed during a background write and a file-size limit (as a full disk) during one
leave `latest` on the previous checkpoint, and the next start resumes it."""
import json
import os
import re
import signal
import subprocess
from collections import OrderedDict

import psutil
import pytest
import torch

from conftest import test_env
from runs import SKIP_PROBES, pretrain_cmd
from runs import run_pretrain as pretrain
from megatron.arguments import ConfigError, parse_args
from megatron.checkpointing.async_save import host_copy, state_bytes
from megatron.checkpointing.protocol import check_resumable, damage_reason
from megatron.launch.settings import LaunchError, training_settings
from test_faults_checkpoint import KILL_DURING_SAVE, copy_checkpoints, error_lines, losses

SAVED = re.compile(r"^  successfully saved checkpoint at iteration +(\d+) to (\S+) in ([\d.]+) s \(([\d.]+) MB\), "
                   r"async: training blocked ([\d.]+) s \(host copy ([\d.]+) MB\), background ([\d.]+) s$", re.M)
WAITED = re.compile(r"^  waited ([\d.]+) s for the background write of checkpoint (global_step\d+) before (.+) "
                    r"\(--async-save\)$", re.M)


def test_the_host_copy_is_the_states_own_and_keeps_its_structure():
    weight = torch.arange(6.0).reshape(2, 3)
    state = {"module": OrderedDict(a=weight, tied=weight), "opt": [(weight[0], 3)], "step": 7, "name": "x"}
    copied, buffers = host_copy(state)
    weight.mul_(10)  # the next step changes the state in place
    assert type(copied["module"]) is OrderedDict and copied["step"] == 7 and copied["name"] == "x"
    assert torch.equal(copied["module"]["a"], torch.arange(6.0).reshape(2, 3))
    assert copied["module"]["a"] is copied["module"]["tied"]  # copied once, saved once, as torch.save would
    assert torch.equal(copied["opt"][0][0], torch.arange(3.0)) and copied["opt"][0][1] == 3
    assert sorted(buffer.numel() for buffer in buffers) == [3, 6]
    # the next save copies into the buffers an earlier one left
    spare = {(torch.float32, (2, 3)): [buffers[0]]}
    again, _ = host_copy({"w": weight}, spare)
    assert again["w"] is buffers[0] and torch.equal(buffers[0], weight) and spare[(torch.float32, (2, 3))] == []


def test_the_copy_is_sized_without_copying_as_host_copy_counts_it():
    weight, other = torch.arange(6.0).reshape(2, 3), torch.zeros(4, dtype=torch.float64)
    state = {"a": weight, "tied": weight, "row": [weight[0]], "o": (other, 1), "n": None}
    _, buffers = host_copy(state)
    assert state_bytes(state) == sum(b.untyped_storage().nbytes() for b in buffers) == 6 * 4 + 3 * 4 + 4 * 8


# The tiny preset's rank-0 files on 2 ranks, from the checkpoints themselves: 6,843,904 parameters (tied output
# layer), optimizer groups of 6,840,320 (matrices) and 3,584 (biases, LayerNorms) elements; the generators
# (torch's 5,056-byte state, numpy's 624 int64s) in the client state and in the rank's own file
TINY_PARAMETERS, TINY_GROUPS, GENERATORS = 6_843_904, (6_840_320, 3_584), 5_056 + 624 * 8
TINY_COPY = {1: TINY_PARAMETERS * 4 + sum(g // 2 * 12 + 4 for g in TINY_GROUPS) + 2 * GENERATORS,  # 68,459,144
             3: sum(g // 2 * 12 + 4 for g in TINY_GROUPS) + 2 * GENERATORS}  # empty module tensors: 41,083,528


@pytest.mark.parametrize("stage", [1, 3])
def test_the_predicted_copy_is_what_rank_0_writes(stage):
    from megatron.accounting import TrainingSetup
    from megatron.accounting.predict.memory import async_save_copy_bytes
    from megatron.model import GPTConfig
    config = GPTConfig(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=64,
                       max_position_embeddings=64, padded_vocab_size=50304)
    setup = TrainingSetup(world_size=2, micro_batch_size=2, zero_stage=stage, device="cpu")
    assert async_save_copy_bytes(config, setup) == TINY_COPY[stage]


def model_state_fields(stdout: str) -> tuple[dict, dict]:
    from analysis.log_parser import _parse_model_state
    line = next(line for line in stdout.splitlines() if line.startswith(" model state memory per rank (GB)"))
    record = _parse_model_state(line)
    return record.measured, record.estimate


def assert_copy_is_predicted(stdout: str, stage: int):
    """The model-state line's host copy (sized before any save) and its estimate, and every save line's copy, are
    the tiny preset's rank-0 files (TINY_COPY)."""
    measured, estimate = model_state_fields(stdout)
    assert measured["async_save_copy"] == estimate["async_save_copy"] == round(TINY_COPY[stage] / 2**30, 4)
    copies = [float(host) for *_, host, _ in SAVED.findall(stdout)]
    assert copies and all(host == round(TINY_COPY[stage] / 1e6, 1) for host in copies), copies


@pytest.mark.slow
def test_the_model_state_line_holds_the_host_copy_at_zero_1(async_run):
    assert_copy_is_predicted(async_run[0].stdout, 1)


@pytest.mark.slow
def test_the_model_state_line_holds_the_host_copy_at_zero_3(dolly_data_dir, tmp_path):
    run = pretrain(dolly_data_dir, "--zero-stage", "3", "--train-iters", "4", "--save-interval", "2", "--save",
                   str(tmp_path / "ckpt"), "--async-save")
    assert_copy_is_predicted(run.stdout, 3)


def test_a_run_without_async_save_has_no_copy_field():
    from megatron.training_log import model_state_line
    values = dict(params=1, grads=1, optim=1, offloaded=0, other=0)
    estimate = dict(values, model_states=3, activations=0, output_buffer=0)
    assert "async_save_copy" not in model_state_line(values, estimate, 1, 2, "fp32", "none")
    line = model_state_line({**values, "async_save_copy": 2**30}, {**estimate, "async_save_copy": 2**29}, 1, 2,
                            "fp32", "none")
    assert " other=0.0000 async_save_copy=1.0000 | " in line and line.endswith(" async_save_copy=0.5000 |")


def test_async_save_needs_save():
    common = ["--model-size", "tiny", "--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "2",
              "--data-path", "unread", "--vocab-file", "unread", "--merge-file", "unread"]
    with pytest.raises(ConfigError, match=r"^--async-save writes --save's checkpoints in the background; give "
                                          r"--save DIR, or drop --async-save$"):
        parse_args([*common, "--async-save"], world_size=1)
    assert parse_args([*common, "--async-save", "--save", "x"], world_size=1).checkpoint.async_save


def test_the_driver_variable_gives_the_flag():
    settings = training_settings({"ASYNC_SAVE": "1"}, accelerator="cpu", world=2, model_size="tiny")
    assert "--async-save" in settings.flags and settings.sources["--async-save"] == "ASYNC_SAVE"
    assert "--async-save" not in training_settings({}, accelerator="cpu", world=2, model_size="tiny").flags
    with pytest.raises(LaunchError, match=r"^ASYNC_SAVE=yes: expected 0 or 1$"):
        training_settings({"ASYNC_SAVE": "yes"}, accelerator="cpu", world=2, model_size="tiny")


@pytest.fixture(scope="module")
def reference(checkpoint_run):
    found = losses(checkpoint_run.stdout)
    assert sorted(found) == list(range(1, 9))
    return found, checkpoint_run.folder


@pytest.fixture(scope="module")
def async_run(dolly_data_dir, tmp_path_factory):
    """The saved-checkpoint run with --async-save: (its log, its --save folder). Tests copy what they change."""
    save = tmp_path_factory.mktemp("async") / "ckpt"
    run = pretrain(dolly_data_dir, "--zero-stage", "1", "--save-interval", "2", "--save", str(save), "--async-save")
    return run, save


@pytest.mark.slow
def test_background_saves_commit_intact_checkpoints_that_resume_the_reference(dolly_data_dir, reference, async_run,
                                                                              tmp_path):
    """The run saves at 2, 4, 6, 8 in the background: its losses are the reference's (the copy was consistent and
    training went on), each save's line says its blocking and background time, the run's end waited for the last
    write, every checkpoint is committed with its manifest, and a resume from global_step4 repeats the reference."""
    ref_losses, ref_folder = reference
    run, saved_folder = async_run
    save = copy_checkpoints(saved_folder, tmp_path / "ckpt", ["global_step2", "global_step4", "global_step6",
                                                               "global_step8"], "global_step8")
    assert losses(run.stdout) == ref_losses
    saved = SAVED.findall(run.stdout)
    assert [int(it) for it, *_ in saved] == [2, 4, 6, 8]
    assert all(folder == str(saved_folder) for _, folder, *_ in saved)
    for _, _, total, _, blocked, host, background in saved:
        assert float(blocked) < float(total) and abs(float(blocked) + float(background) - float(total)) < 0.02
        assert float(host) > 0
    assert all(before in ("saving global_step4", "saving global_step6", "saving global_step8", "the run ends")
               for _, _, before in WAITED.findall(run.stdout))
    assert (saved_folder / "latest").read_text() == "global_step8"
    assert not list(saved_folder.glob("*.saving"))
    for step in (2, 4, 6, 8):
        folder = save / f"global_step{step}"
        assert damage_reason(str(folder)) is None
        marker = json.loads((folder / "zero_lab_state.json").read_text())
        assert marker["iteration"] == step and set(marker["crc32"]) == set(marker["files"])
        # the same files as the synchronous save's
        assert set(marker["files"]) == set(json.loads((ref_folder / folder.name / "zero_lab_state.json")
                                                      .read_text())["files"])
    (save / "latest").write_text("global_step4")
    resumed = pretrain(dolly_data_dir, "--zero-stage", "1", "--load", str(save))
    assert f"loaded checkpoint {save / 'global_step4'}" in resumed.stdout
    assert losses(resumed.stdout) == {i: ref_losses[i] for i in range(5, 9)}


@pytest.mark.slow
def test_a_background_checkpoint_resumes_on_another_data_parallel_size(dolly_data_dir, reference, async_run, tmp_path):
    """As a synchronous one (test_faults_checkpoint.py): 2-rank ZeRO-1's global_step4 on one rank at ZeRO-3 through
    --universal-checkpoint, with the reference's losses up to the order of the sums."""
    ref_losses, _ = reference
    folder = copy_checkpoints(async_run[1], tmp_path / "ckpt", ["global_step4"], "global_step4")
    resumed = pretrain(dolly_data_dir, "--zero-stage", "3", "--load", str(folder), "--universal-checkpoint",
                       ranks=1)
    assert f"loaded checkpoint {folder / 'global_step4_universal'}" in resumed.stdout
    found = losses(resumed.stdout)
    assert sorted(found) == [5, 6, 7, 8]
    assert all(abs(found[i] - ref_losses[i]) < 1e-3 for i in found), (found, ref_losses)


@pytest.mark.slow
def test_a_rank_killed_during_a_background_write_leaves_the_previous_checkpoint(dolly_data_dir, reference, tmp_path):
    """Rank 1 is SIGKILLed while its writer thread writes global_step4: nothing is committed, `latest` stays on
    global_step2, and the next start resumes from it with the reference's losses."""
    ref_losses, _ = reference
    folder = tmp_path / "ckpt"
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(KILL_DURING_SAVE)
    env = test_env(PYTHONPATH=f"{hook}{os.pathsep}{test_env()['PYTHONPATH']}", ZL_KILL_RANK="1",
                   ZL_KILL_TAG="global_step4.saving")
    killed = pretrain(dolly_data_dir, "--zero-stage", "1", "--save", str(folder), "--save-interval", "2",
                      "--async-save", env=env, expect=None)
    assert killed.returncode != 0
    assert (folder / "latest").read_text() == "global_step2"
    assert (folder / "global_step4.saving" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").stat().st_size == 0
    assert not (folder / "global_step4").exists()
    assert check_resumable(str(folder)) == "global_step2"

    resumed = pretrain(dolly_data_dir, "--zero-stage", "1", "--save", str(folder), "--load", str(folder),
                       "--async-save")
    assert f"loaded checkpoint {folder / 'global_step2'}" in resumed.stdout
    assert losses(resumed.stdout) == {i: ref_losses[i] for i in range(3, 9)}
    assert (folder / "latest").read_text() == "global_step8" and not (folder / "global_step4.saving").exists()


@pytest.mark.slow
def test_a_full_disk_during_a_background_write_ends_in_one_line(dolly_data_dir, reference, tmp_path):
    """A finished run saved at step 2; a fresh run into the same folder cannot write its own step 2 in the
    background (a file-size limit, ulimit -f, as a full disk): the run ends at its next save in one line, and
    `latest` still names the first run's intact global_step2, which --load resumes."""
    ref_losses, ref_folder = reference
    folder = copy_checkpoints(ref_folder, tmp_path / "ckpt", ["global_step2"], "global_step2")
    first_run = (folder / "global_step2" / "zero_lab_state.json").read_text()
    cmd = pretrain_cmd(dolly_data_dir, 2, "--zero-stage", "1", "--seed", "99", "--save", str(folder),
                       "--save-interval", "2", "--async-save")
    run = subprocess.run(["bash", "-c", 'ulimit -f 10240 && exec "$@"', "bash", *cmd], env=test_env(**SKIP_PROBES),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode != 0
    assert set(error_lines(run)) == {f"error: --save {folder}: writing checkpoint global_step2 failed on rank 0 "
                                     "(File too large); 'latest' still names global_step2"}, run.stderr[-3000:]
    assert max(losses(run.stdout)) == 4  # it stopped at the next save, which waits for the write
    assert (folder / "latest").read_text() == "global_step2"
    assert (folder / "global_step2" / "zero_lab_state.json").read_text() == first_run
    assert check_resumable(str(folder)) == "global_step2"

    resumed = pretrain(dolly_data_dir, "--zero-stage", "1", "--load", str(folder))
    assert losses(resumed.stdout) == {i: ref_losses[i] for i in range(3, 9)}


@pytest.mark.slow
def test_sigterms_save_is_committed_before_the_run_says_it_stopped(dolly_data_dir, reference, tmp_path):
    """--exit-signal-handler's save in the background: the stop line comes after the checkpoint is committed (its
    saved line first), `latest` names it, and the run exits 0."""
    ref_losses, _ = reference
    save = tmp_path / "ckpt"
    proc = subprocess.Popen(pretrain_cmd(dolly_data_dir, 2, "--zero-stage", "1", "--save", str(save),
                                         "--exit-signal-handler", "--async-save"),
                            env=test_env(**SKIP_PROBES), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = []
    try:
        for line in proc.stdout:
            log.append(line)
            if re.match(r" iteration +2/", line):
                workers = [p for p in psutil.Process(proc.pid).children() if p.environ().get("RANK") == "1"]
                workers[0].send_signal(signal.SIGTERM)
        assert proc.wait(timeout=300) == 0, "".join(log)[-3000:]
    finally:
        proc.kill()
    log = "".join(log)
    stopped = re.search(r"^ exiting program after receiving SIGTERM at iteration (\d+) \(checkpoint saved to (.+)\)$",
                        log, re.M)
    assert stopped, log[-3000:]
    step = int(stopped.group(1))
    saved = [match for match in SAVED.finditer(log) if int(match.group(1)) == step]
    assert saved and saved[0].start() < stopped.start()
    assert (save / "latest").read_text() == f"global_step{step}"
    assert damage_reason(str(save / f"global_step{step}")) is None
    assert losses(log) == {i: ref_losses[i] for i in range(1, step + 1)}


def test_the_log_parser_reads_both_save_lines(tmp_path):
    from analysis.log_parser import SaveRecord, parse_log
    log = tmp_path / "train.log"
    log.write_text("  successfully saved checkpoint at iteration        2 to runs/x in 0.54 s (109.6 MB)\n"
                   "  successfully saved checkpoint at iteration        4 to runs/x in 0.56 s (109.6 MB), async: "
                   "training blocked 0.07 s (host copy 68.5 MB), background 0.49 s\n")
    assert parse_log(log).saves == [SaveRecord(2, 0.54, 109.6), SaveRecord(4, 0.56, 109.6, 0.07, 68.5, 0.49)]
    assert SAVED.search(log.read_text())  # the test's own pattern reads what docs/log-lines.md shows
