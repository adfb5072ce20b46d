"""Faults around checkpoints, each caused for real: SIGTERM during training, SIGKILL of a rank during a
save, a file-size limit (as a full disk) during an overwrite, a crafted checkpoint that would run code, a
resume on another layout (DeepSpeed's universal checkpoint), and the start-up checks of the paths.

One uninterrupted run (2 CPU ranks, ZeRO-1, dropout off, 8 iterations, a checkpoint every 2: tests/runs.py's
saved-checkpoint run, shared with the manifest tests) is the reference the resumed runs must
repeat loss for loss; they start from its flags (runs.pretrain_cmd)."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from functools import partial

import psutil
import pytest
import torch

from conftest import REPO_ROOT, free_port, test_env
from runs import SKIP_PROBES, pretrain_cmd
from runs import run_pretrain as pretrain
from megatron.checkpointing.checksum import file_crc32, format_crc
from megatron.checkpointing.protocol import check_resumable, incomplete_reason

LOSS = re.compile(r" iteration +(\d+)/ +\d+ \|.*?\| lm loss: (\S+) \|")


def losses(log: str) -> dict[int, float]:
    return {int(step): float(loss) for step, loss in LOSS.findall(log)}


def error_lines(run) -> list[str]:
    return [line for line in run.stderr.splitlines() if line.startswith("error: ")]


def copy_checkpoints(source, target, tags, latest):
    target.mkdir()
    for tag in tags:
        shutil.copytree(source / tag, target / tag)
    (target / "latest").write_text(latest)
    return target


@pytest.fixture(scope="module")
def reference(checkpoint_run):
    """The uninterrupted run (tests/runs.py's saved-checkpoint run, shared with the manifest tests): its losses
    and its checkpoints global_step2, 4, 6, 8. Tests copy what they change."""
    found = losses(checkpoint_run.stdout)
    assert sorted(found) == list(range(1, 9))
    return found, checkpoint_run.folder


@pytest.mark.slow
def test_sigterm_saves_the_current_iteration_and_resume_repeats_the_losses(dolly_data_dir, reference, tmp_path):
    ref_losses, _ = reference
    save = tmp_path / "ckpt"
    proc = subprocess.Popen(pretrain_cmd(dolly_data_dir, 2, "--zero-stage", "1", "--save", str(save),
                                         "--exit-signal-handler"),
                            env=test_env(**SKIP_PROBES), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = []
    for line in proc.stdout:
        log.append(line)
        if re.match(r" iteration +2/", line):
            # a scheduler's SIGTERM, to one rank only: the ranks must still agree to stop together
            workers = [p for p in psutil.Process(proc.pid).children() if p.environ().get("RANK") == "1"]
            assert len(workers) == 1
            workers[0].send_signal(signal.SIGTERM)
    assert proc.wait(timeout=300) == 0, "".join(log)[-3000:]
    log = "".join(log)
    stopped = re.search(r"^ exiting program after receiving SIGTERM at iteration (\d+) \(checkpoint saved to (.+)\)$",
                        log, re.M)
    assert stopped, log[-3000:]
    step = int(stopped.group(1))
    assert 2 <= step < 8 and stopped.group(2) == str(save)
    assert (save / "latest").read_text() == f"global_step{step}"
    assert json.loads((save / f"global_step{step}" / "zero_lab_state.json").read_text())["iteration"] == step
    assert "[after training is done]" not in log
    assert losses(log) == {i: ref_losses[i] for i in range(1, step + 1)}

    resumed = pretrain(dolly_data_dir, "--zero-stage", "1", "--save", str(save), "--load", str(save))
    assert f"loaded checkpoint {save / f'global_step{step}'}" in resumed.stdout
    assert losses(resumed.stdout) == {i: ref_losses[i] for i in range(step + 1, 9)}
    # the RNG states, data position, optimizer and schedule came back: the weights are the reference's, bit for bit
    _, ref_folder = reference
    weights = [torch.load(folder / "global_step8" / "mp_rank_00_model_states.pt", map_location="cpu",
                          weights_only=True)["module"] for folder in (ref_folder, save)]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])


KILL_DURING_SAVE = '''
import builtins, os, signal
if os.environ.get("RANK") == os.environ["ZL_KILL_RANK"]:
    real_open = builtins.open
    def open_then_die(file, mode="r", *args, **kwargs):
        if ("w" in mode and isinstance(file, str) and os.environ["ZL_KILL_TAG"] + "/" in file
                and file.endswith("optim_states.pt")):
            real_open(file, "wb").close()  # the 0-byte shard of the report, then the kill
            os.kill(os.getpid(), signal.SIGKILL)
        return real_open(file, mode, *args, **kwargs)
    builtins.open = open_then_die
'''


def _save_perturb_and_resume(rank, folder):
    """On each of 2 ranks (ZeRO-1, a real DeepSpeed engine): generators unlike the other rank's, a save, other
    draws, a resume; the states the resume hands set_rng_state must be this rank's own."""
    import deepspeed
    from megatron.arguments import parse_args
    from megatron.checkpointing.rng import rng_state, set_rng_state
    from megatron.checkpointing.save_load import load_checkpoint, save_checkpoint
    from megatron.model import MODEL_PRESETS, GPTConfig, GPTModel

    args = parse_args(["--model-size", "tiny", "--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "2",
                       "--data-path", "unread", "--vocab-file", "unread", "--merge-file", "unread",
                       "--zero-stage", "1", "--save", folder, "--load", folder], world_size=2)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    torch.manual_seed(1234 + rank)  # as the tracker's stream differs per TP rank, and a GPU's per device
    model = GPTModel(GPTConfig(**dict(MODEL_PRESETS["tiny"], num_layers=1, seq_length=16,
                                      max_position_embeddings=16, padded_vocab_size=64)))
    with model.rng_tracker.fork(torch.device("cpu")):
        torch.rand(rank + 1)
    # a stand-in for the GPUs' generators: rank r has drawn r + 1 times from the device it runs on
    devices = [torch.tensor([rank, 0], dtype=torch.uint8), torch.tensor([0, rank + 1], dtype=torch.uint8)]
    torch.cuda.is_available = lambda: True
    torch.cuda.get_rng_state_all = lambda: [state.clone() for state in devices]
    torch.cuda.set_rng_state_all = lambda states: devices.__setitem__(slice(None), [s.clone() for s in states])
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}})
    saved = rng_state(model)
    save_checkpoint(engine, args, 2, 4, rank)
    torch.rand(7)
    with model.rng_tracker.fork(torch.device("cpu")):
        torch.rand(3)
    devices[:] = [torch.zeros(2, dtype=torch.uint8)] * 2
    *_, resumed = load_checkpoint(engine, args)
    set_rng_state(resumed, model)
    assert torch.equal(torch.get_rng_state(), saved["torch"]), f"rank {rank}: CPU generator"
    assert [state.tolist() for state in devices] == [state.tolist() for state in saved["cuda"]], \
        f"rank {rank}: the GPUs' generators"
    tracker = model.rng_tracker.get_states()
    assert tracker.keys() == saved["model_parallel_tracker"].keys()
    assert all(torch.equal(tracker[key], saved["model_parallel_tracker"][key]) for key in tracker), \
        f"rank {rank}: tensor-parallel tracker"


@pytest.mark.slow  # two ranks of a real DeepSpeed engine
def test_a_resume_gives_each_rank_its_own_random_generators(tmp_path):
    """At ZeRO 0-2 DeepSpeed writes the client state from rank 0 only; each rank's generators are saved in a
    file of its own, in the manifest, and each rank gets its own back (issue 40 item 5)."""
    from test_parallel_training import _spawned
    folder = tmp_path / "ckpt"
    torch.multiprocessing.spawn(_spawned, args=(2, free_port(), partial(_save_perturb_and_resume, folder=str(folder))),
                                nprocs=2, join=True)
    marker = json.loads((folder / "global_step2" / "zero_lab_state.json").read_text())
    for rank in range(2):
        assert f"rng_state_rank{rank}.pt" in marker["crc32"]


def test_a_checkpoint_without_per_rank_generators_resumes_the_client_states(tmp_path):
    """A checkpoint saved before each rank had its file: every rank takes the client state's, as before."""
    from megatron.checkpointing.rng import own_rng_state
    client = {"rng_state": {"torch": torch.get_rng_state()}}
    assert own_rng_state(str(tmp_path), 1, client) is client["rng_state"]


@pytest.mark.slow
def test_sigkill_of_a_rank_during_a_save_in_a_reused_run_folder(dolly_data_dir, reference, tmp_path):
    """A fresh run re-uses a folder holding the reference's checkpoints; rank 1 is SIGKILLed while writing
    global_step4, a tag the old run had completed. The new save was written beside the old one
    (global_step4.saving): `latest` keeps naming the new run's global_step2, the old global_step4 is still
    complete, and a resume continues the reference's losses."""
    ref_losses, ref_folder = reference
    folder = copy_checkpoints(ref_folder, tmp_path / "ckpt", ["global_step2", "global_step4", "global_step6",
                                                              "global_step8"], "global_step8")
    old_marker = (folder / "global_step4" / "zero_lab_state.json").read_text()
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(KILL_DURING_SAVE)
    env = test_env(PYTHONPATH=f"{hook}{os.pathsep}{test_env()['PYTHONPATH']}", ZL_KILL_RANK="1",
                   ZL_KILL_TAG="global_step4.saving")
    killed = pretrain(dolly_data_dir, "--zero-stage", "1", "--save", str(folder), "--save-interval", "2",
                      env=env, expect=None)
    assert killed.returncode != 0
    assert (folder / "latest").read_text() == "global_step2"
    assert (folder / "global_step4.saving" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").stat().st_size == 0
    assert (folder / "global_step4" / "zero_lab_state.json").read_text() == old_marker
    assert incomplete_reason(str(folder / "global_step4")) is None

    resumed = pretrain(dolly_data_dir, "--zero-stage", "1", "--save", str(folder), "--load", str(folder))
    assert losses(resumed.stdout) == {i: ref_losses[i] for i in range(3, 9)}
    assert not (folder / "global_step4.saving").exists()  # the next save cleared the interrupted one


@pytest.mark.slow
def test_an_interrupted_overwrite_keeps_the_checkpoint_it_was_replacing(dolly_data_dir, reference, tmp_path):
    """A finished run saved at step 2; a fresh run into the same folder fails while saving its own step 2 (a
    file-size limit, ulimit -f, as a full disk): one line, `latest` still names global_step2 and that is the
    first run's, intact, so --load resumes the first run from its step 2 with the reference's losses."""
    ref_losses, ref_folder = reference
    folder = copy_checkpoints(ref_folder, tmp_path / "ckpt", ["global_step2"], "global_step2")
    first_run = (folder / "global_step2" / "zero_lab_state.json").read_text()
    cmd = pretrain_cmd(dolly_data_dir, 2, "--zero-stage", "1", "--seed", "99", "--save", str(folder),
                       "--save-interval", "2")
    # 10 MiB per file: the dataset's index files exist already; each checkpoint file is larger
    run = subprocess.run(["bash", "-c", 'ulimit -f 10240 && exec "$@"', "bash", *cmd], env=test_env(**SKIP_PROBES),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode != 0
    lines = error_lines(run)
    assert lines and re.fullmatch(rf"error: --save {re.escape(str(folder))}: writing checkpoint global_step2 failed "
                                  r"on rank \d \(.*File too large.*\); 'latest' still names global_step2", lines[0])
    assert (folder / "latest").read_text() == "global_step2"
    assert (folder / "global_step2" / "zero_lab_state.json").read_text() == first_run
    assert check_resumable(str(folder)) == "global_step2"

    resumed = pretrain(dolly_data_dir, "--zero-stage", "1", "--load", str(folder))
    assert f"loaded checkpoint {folder / 'global_step2'}" in resumed.stdout
    assert losses(resumed.stdout) == {i: ref_losses[i] for i in range(3, 9)}


EVIL = '''
import pathlib, sys, torch
class Payload:
    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(sys.argv[2]),))
state = torch.load(sys.argv[1], weights_only=False)
state["payload"] = Payload()
torch.save(state, sys.argv[1])
'''


@pytest.mark.slow
def test_crafted_checkpoint_runs_no_code(dolly_data_dir, reference, tmp_path):
    _, ref_folder = reference
    folder = copy_checkpoints(ref_folder, tmp_path / "ckpt", ["global_step8"], "global_step8")
    states, marker = folder / "global_step8" / "mp_rank_00_model_states.pt", tmp_path / "code-ran"
    subprocess.run([sys.executable, "-c", EVIL, str(states), str(marker)], check=True, env=test_env())
    # the attacker keeps the completion marker consistent too, its manifest's CRC-32 included (a checksum
    # finds damage, not an edit made on purpose: the restricted loading is what stops this one)
    record = json.loads((folder / "global_step8" / "zero_lab_state.json").read_text())
    record["files"][states.name] = states.stat().st_size
    record["crc32"][states.name] = format_crc(file_crc32(str(states)))
    (folder / "global_step8" / "zero_lab_state.json").write_text(json.dumps(record))
    flags = ["--zero-stage", "1", "--load", str(folder), "--train-iters", "9"]

    refused = pretrain(dolly_data_dir, *flags, expect=1)
    assert not marker.exists()
    assert set(error_lines(refused)) == {
        f"error: {states}: refusing to load, it holds a pickled builtins.getattr, pathlib.Path, pathlib.PosixPath "
        "(a checkpoint may hold only tensors and plain types; unpickling other objects can run code). Give "
        "--trust-checkpoint only if you trust where this file came from"}  # one line from each rank

    trusted = pretrain(dolly_data_dir, *flags, "--trust-checkpoint")
    assert marker.exists() and sorted(losses(trusted.stdout)) == [9]


@pytest.mark.slow
def test_resume_two_rank_zero1_on_one_rank_zero3_through_universal_checkpoint(dolly_data_dir, reference, tmp_path):
    ref_losses, ref_folder = reference
    folder = copy_checkpoints(ref_folder, tmp_path / "ckpt", ["global_step4"], "global_step4")
    plain = pretrain(dolly_data_dir, "--zero-stage", "3", "--load", str(folder), ranks=1, expect=1)
    assert error_lines(plain) == [
        f"error: --load {folder}: checkpoint global_step4 was saved with data-parallel size 2 at ZeRO stage 1, "
        "this run has data-parallel size 1 at ZeRO stage 3: resume it with --universal-checkpoint "
        "(docs/checkpoints.md)"]

    resumed = pretrain(dolly_data_dir, "--zero-stage", "3", "--load", str(folder), "--universal-checkpoint",
                       ranks=1)
    assert f"loaded checkpoint {folder / 'global_step4_universal'}" in resumed.stdout
    found = losses(resumed.stdout)
    assert sorted(found) == [5, 6, 7, 8]
    # same samples and optimizer state; only the order of the floating-point sums differs
    assert all(abs(found[i] - ref_losses[i]) < 1e-3 for i in found), (found, ref_losses)
    assert json.loads((folder / "global_step4_universal" / "zero_lab_state.json").read_text())["converted_from"] \
        == "global_step4"


@pytest.mark.slow
def test_universal_resume_refuses_what_deepspeed_cannot_do(dolly_data_dir, reference, tmp_path):
    _, ref_folder = reference
    folder = copy_checkpoints(ref_folder, tmp_path / "ckpt", ["global_step4"], "global_step4")
    refused = pretrain(dolly_data_dir, "--zero-stage", "0", "--load", str(folder), "--universal-checkpoint",
                       ranks=1, expect=1)
    assert error_lines(refused) == [
        f"error: --load {folder} --universal-checkpoint: cannot resume global_step4: DeepSpeed loads a universal "
        "checkpoint only into a ZeRO optimizer; give --zero-stage 1, 2 or 3"]
    assert not (folder / "global_step4_universal").exists()


@pytest.mark.slow  # uses the reference run
def test_tools_refuse_a_crafted_checkpoint(capsys, reference, tmp_path):
    """tools/checkpoint_to_hf.py and generate_text.py read through megatron/saved_model, restricted the same way;
    the --trust-checkpoint their message names is theirs too."""
    from conftest import tool_in_process
    _, ref_folder = reference
    folder = copy_checkpoints(ref_folder, tmp_path / "ckpt", ["global_step8"], "global_step8")
    states, marker = folder / "global_step8" / "mp_rank_00_model_states.pt", tmp_path / "code-ran"
    subprocess.run([sys.executable, "-c", EVIL, str(states), str(marker)], check=True, env=test_env())
    refusal = [f"error: {states}: refusing to load, it holds a pickled builtins.getattr, pathlib.Path, "
               "pathlib.PosixPath (a checkpoint may hold only tensors and plain types; unpickling other objects "
               "can run code). Give --trust-checkpoint only if you trust where this file came from"]
    code, out, err = tool_in_process(capsys, "checkpoint_to_hf.py", "--load", folder, "--output", tmp_path / "hf")
    assert code == 1 and not marker.exists() and not (tmp_path / "hf").exists()
    assert err.strip().splitlines() == refusal
    code, out, err = tool_in_process(capsys, "generate_text.py", "--load", folder, "--prompt", "Hi", "--greedy",
                                     "--max-new-tokens", "2")
    assert code == 1 and not marker.exists() and err.strip().splitlines() == refusal
    assert os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD") is None  # the restriction ends with the load
    code, out, err = tool_in_process(capsys, "checkpoint_to_hf.py", "--load", folder, "--output", tmp_path / "hf",
                                     "--trust-checkpoint")
    assert code == 0 and marker.exists() and (tmp_path / "hf" / "model.safetensors").is_file()


# ---- start-up checks: before the model is built, one line naming the flag and the path ----

def toy_flags(data_dir, *extra):
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "2", "--train-iters", "10", "--data-path", str(data_dir / "dolly_text_document"),
            "--vocab-file", str(data_dir / "gpt2-vocab.json"), "--merge-file", str(data_dir / "gpt2-merges.txt"),
            *extra]


def start_up(*flags):
    """The flags parsed, then megatron/startup.py's checks of the files they name."""
    from megatron.arguments import parse_args
    from megatron.startup import prepare_run
    return prepare_run(parse_args(list(flags)), verbose=False)


@pytest.mark.parametrize("flag", ["--save", "--tensorboard-dir", "--run-dir"])
def test_output_folder_that_cannot_be_made_is_refused(dolly_data_dir, tmp_path, flag):
    from megatron.startup import StartupError
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(StartupError) as err:
        start_up(*toy_flags(dolly_data_dir, flag, str(blocker / "run")))
    assert str(err.value) == f"{flag} {blocker / 'run'}: {blocker} is not a folder"
    start_up(*toy_flags(dolly_data_dir, flag, str(tmp_path / "new" / "run")))  # creatable: accepted


def test_data_and_vocabulary_files_must_be_readable_files(dolly_data_dir, tmp_path):
    from megatron.startup import StartupError
    folder = tmp_path / "vocab.json"
    folder.mkdir()
    with pytest.raises(StartupError) as err:
        start_up(*toy_flags(dolly_data_dir, "--vocab-file", str(folder)))
    assert str(err.value) == f"--vocab-file {folder} does not exist (GPT2BPETokenizer needs it)"
    with pytest.raises(StartupError) as err:
        start_up(*toy_flags(dolly_data_dir, "--data-path", str(tmp_path / "missing")))
    assert str(err.value) == (f"--data-path: {tmp_path / 'missing.bin'} does not exist (expected a prefix with "
                              ".bin/.idx files from tools/preprocess_data.py)")


def test_startup_check_stops_pretrain_before_any_work(dolly_data_dir, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    run = subprocess.run([sys.executable, str(REPO_ROOT / "pretrain_gpt.py"),
                          *toy_flags(dolly_data_dir, "--save", str(blocker / "ckpt"))],
                         env=test_env(MASTER_PORT=free_port()), capture_output=True, text=True, timeout=300)
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1] == f"error: --save {blocker / 'ckpt'}: {blocker} is not a folder"
    assert "Traceback" not in run.stderr and "building" not in run.stdout  # no tokenizer, data or model built


def test_save_on_a_read_only_filesystem_is_refused_at_start_up(dolly_data_dir, tmp_path):
    """A read-only tmpfs in a private mount namespace: root cannot write there either."""
    folder = tmp_path / "ro"
    folder.mkdir()
    mount = f"mount -t tmpfs -o ro tmpfs '{folder}'"
    if shutil.which("unshare") is None or subprocess.run(["unshare", "--mount", "sh", "-c", mount],
                                                         capture_output=True, timeout=30).returncode:
        pytest.skip("cannot mount a read-only tmpfs here (needs unshare and mount privileges)")
    command = " ".join(f"'{part}'" for part in [sys.executable, str(REPO_ROOT / "pretrain_gpt.py"),
                                                  *toy_flags(dolly_data_dir, "--save", str(folder / "ckpt"))])
    run = subprocess.run(["unshare", "--mount", "sh", "-c", f"{mount} && exec {command}"],
                         env=test_env(MASTER_PORT=free_port()), capture_output=True, text=True, timeout=300)
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1] == f"error: --save {folder / 'ckpt'}: {folder} is not writable"


@pytest.mark.parametrize("saved, run, refused", [
    ((1, 2), (3, 1), None), ((1, 2), (2, 1), None), ((3, 2), (3, 1), None), ((2, 4), (1, 2), None),
    ((0, 2), (1, 1), "saved at ZeRO stage 0"), ((1, 2), (0, 1), "only into a ZeRO optimizer"),
    ((3, 2), (1, 1), "resume it at --zero-stage 3"), ((3, 2), (2, 2), "resume it at --zero-stage 3"),
])
def test_universal_refusals(saved, run, refused):
    """Which layout changes a universal resume takes (the end-to-end tests above run two of them; the
    ZeRO-3 -> ZeRO-1/2 refusal comes from a DeepSpeed 0.19.8 failure seen on the CPU box)."""
    from megatron.checkpointing.resume_check import model_parallel_refusal, needs_universal, universal_refusal
    layouts = [{"zero_stage": stage, "data_parallel_size": dp, "tensor_model_parallel_size": 1,
                "pipeline_model_parallel_size": 1} for stage, dp in (saved, run)]
    assert needs_universal(*layouts) and model_parallel_refusal(*layouts) is None
    reason = universal_refusal(*layouts)
    assert (reason is None) if refused is None else (refused in reason)
    layouts[1]["tensor_model_parallel_size"] = 2
    assert model_parallel_refusal(*layouts).startswith("it was saved with tensor-parallel size 1, this run has 2;")


@pytest.mark.slow
def test_a_run_resumed_past_its_length_says_it_has_nothing_to_train(dolly_data_dir, reference, tmp_path):
    """Resuming global_step8 with --train-iters 4: no iteration runs, and one line says why and what to do (it
    ended before with `[after training is done]` alone)."""
    _, saved = reference
    ckpt = copy_checkpoints(saved, tmp_path / "ckpt", ["global_step8"], "global_step8")
    run = pretrain(dolly_data_dir, "--zero-stage", "1", "--load", str(ckpt), "--save", str(ckpt),
                   "--train-iters", "4")
    assert losses(run.stdout) == {}
    assert ("nothing to train: the checkpoint resumed is at iteration 8, already at or past the 4 iterations asked "
            "for; ask for more iterations, or start afresh with FRESH=1 or under another RUN_NAME (pretrain_gpt.py "
            "alone: another --load folder)") in run.stdout.splitlines()
    assert "[after training is done]" in run.stdout
