"""The launch paths (examples_zero drivers, ALCF/, Slurm through the drivers) alike: one lock per run folder, the
resume rule on every host, a user's own settings honoured or refused in one line (docs/environment.md)."""
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from conftest import REPO_ROOT, free_port, launch_script, wait_for, waiting_driver_launch
from conftest import test_env as subprocess_env  # aliased: pytest would collect test_env as a test
from megatron.checkpointing import protocol
from megatron.launch.settings import training_settings

DRIVER = REPO_ROOT / "examples_zero" / "gpt_deepspeed_Z1.sh"
ALCF = REPO_ROOT / "ALCF" / "train-gpt3.sh"


def run(script: Path, *args, **env) -> subprocess.CompletedProcess:
    environment = subprocess_env(**{k: v for k, v in env.items() if v is not None})
    for name in [name for name, value in env.items() if value is None]:
        environment.pop(name, None)
    return launch_script(script, args, environment)


def command_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stdout.splitlines() if "DRY_RUN=1, not starting: " in line]
    assert len(lines) == 1, result.stdout + result.stderr
    return lines[0].split("not starting: ", 1)[1] + " "


def committed_checkpoint(checkpoints: Path, tag: str) -> None:
    protocol.prepare_save(str(checkpoints), tag)
    (checkpoints / protocol.staging_tag(tag)).mkdir()
    protocol.commit(str(checkpoints), tag, {"iteration": int(tag.removeprefix("global_step"))})


@pytest.fixture
def waiting_launch(tmp_path):
    with waiting_driver_launch(tmp_path) as launch:
        yield launch


@pytest.mark.slow
def test_a_second_launch_of_a_running_run_is_refused_on_every_path(waiting_launch):
    """One lock per run folder, taken before the resume rule: a second launch (a driver, with FRESH=1 too, or
    ALCF/ on the same folder) ends in one line naming the run folder and the process that holds it, and moves
    nothing of the live run."""
    first, runs, run_dir = waiting_launch
    before = sorted(p.name for p in run_dir.iterdir())
    holder = f"pid {first.pid} on {os.uname().nodename} since "
    for script, env in ((DRIVER, dict(RUNS_DIR=runs)), (DRIVER, dict(RUNS_DIR=runs, FRESH=1)),
                        (ALCF, dict(OUTPUT_ROOT=runs, RUN_NAME="gpt_tiny_Z1", MODEL_SIZE_KEY="GPT_TINY",
                                    CUDA_VISIBLE_DEVICES=""))):
        second = run(script, **env)
        assert second.returncode == 1, second.stderr
        [line] = second.stderr.splitlines()
        assert line.startswith(f"error: run folder {run_dir} is in use by another launch ({holder}"), line
        assert line.endswith("): wait for it to end or stop it; a second launch would mix its checkpoints and "
                             "logs with the first's")
    assert set(before) <= {p.name for p in run_dir.iterdir()}  # nothing moved (the first launch adds its own)
    assert not list(runs.glob("gpt_tiny_Z1.old-*"))
    assert first.poll() is None  # the first launch goes on


@pytest.mark.slow  # INIT_HF: the planner reads config.json through transformers (about 4 s a plan)
def test_host_k_of_a_torchrun_run_follows_host_0s_resume_decision(tmp_path):
    """NNODES=2: host 1 asks the resume rule without acting on it, so with INIT_HF both hosts pass the same
    --load: the run's checkpoint when it has one, else the converted model with --finetune (converted by host 0
    only)."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(dict(model_type="gpt2", n_layer=2, n_embd=128, n_head=4,
                                                    n_positions=1024)))
    runs = tmp_path / "runs"
    run_dir = runs / "gpt_tiny_Z1"
    (run_dir).mkdir(parents=True)
    (run_dir / "train.log").write_text("an earlier attempt that saved nothing\n")
    hosts = dict(RUNS_DIR=runs, INIT_HF=hf, NNODES=2, MASTER_ADDR="127.0.0.1", DRY_RUN=1)
    fresh = [command_line(run(DRIVER, NODE_RANK=rank, **hosts)) for rank in (0, 1)]
    init = f" --load {run_dir / 'hf_init_hf'} --finetune "
    assert all(init in line and f" --load {run_dir / 'checkpoints'} " not in line for line in fresh), fresh
    committed_checkpoint(run_dir / "checkpoints", "global_step3")
    resumed = [command_line(run(DRIVER, NODE_RANK=rank, **hosts)) for rank in (0, 1)]
    assert all(f" --load {run_dir / 'checkpoints'} " in line and " --finetune " not in line for line in resumed)
    fresh_again = run(DRIVER, NODE_RANK=1, FRESH=1, **hosts)
    assert init in command_line(fresh_again)  # FRESH=1 on every host: host 1 starts afresh as host 0 does
    assert (run_dir / "checkpoints" / "latest").is_file() and (run_dir / "train.log").is_file()  # host 1 moved nothing


@pytest.mark.slow  # INIT_HF: the planner reads config.json through transformers (about 4 s a plan)
def test_host_k_does_not_convert_init_hf(tmp_path):
    """A real host 1 start with INIT_HF and no checkpoint: it passes host 0's --finetune flags, converts nothing
    (host 0 does, before its ranks meet host 1's) and waits for host 0 in the rendezvous."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(dict(model_type="gpt2", n_layer=2, n_embd=128, n_head=4,
                                                    n_positions=1024)))
    runs = tmp_path / "runs"
    run_dir = runs / "gpt_tiny_Z1"
    env = subprocess_env(RUNS_DIR=runs, INIT_HF=hf, NNODES=2, NODE_RANK=1, MASTER_ADDR="127.0.0.1",
                         MASTER_PORT=free_port(), DATA_PATH=tmp_path / "no_data_needed_before_the_ranks_meet")
    host1 = subprocess.Popen(["bash", str(DRIVER)], cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: (run_dir / "command.node1.txt").exists(), 60, "host 1 started no attempt")
        command = (run_dir / "command.node1.txt").read_text()
        assert f" --load {run_dir / 'hf_init_hf'} --finetune " in command
        assert not (run_dir / "hf_init_hf").exists()
        assert (run_dir / ".zero-lab.node1.lock").read_text().startswith(f"pid {host1.pid} ")
    finally:
        os.killpg(host1.pid, signal.SIGKILL)
        host1.wait(timeout=30)


# ---- every variable checked once, the same defaults and precedence on both paths ----

def pretrain_flags(line: str) -> dict[str, str]:
    """The pretrain_gpt.py flags of a printed command line, flag -> value ('' for a switch)."""
    words = line.split("/pretrain_gpt.py ", 1)[1].split()
    flags, index = {}, 0
    while index < len(words):
        flag, value = words[index], ""
        if index + 1 < len(words) and not words[index + 1].startswith("--"):
            value = words[index + 1]
            index += 1
        flags[flag] = value.replace("\\,", ",")
        index += 1
    return flags


def driver_flags(tmp_path, **env) -> dict[str, str]:
    result = run(DRIVER, DRY_RUN=1, RUNS_DIR=tmp_path, **env)
    assert result.returncode == 0, result.stderr
    return pretrain_flags(command_line(result))


def alcf_flags(tmp_path, **env) -> dict[str, str]:
    result = run(ALCF, DRY_RUN=1, OUTPUT_ROOT=tmp_path, CUDA_VISIBLE_DEVICES="", **env)
    assert result.returncode == 0, result.stderr
    [line] = [line for line in result.stdout.splitlines() if line.startswith("[launch] ") and "pretrain_gpt.py" in line]
    return pretrain_flags(line)


# what a run is: everything but where its files go and the path's own switches
PATH_FLAGS = {"--save", "--load", "--tensorboard-dir", "--run-dir", "--exit-signal-handler", "--deepspeed",
              "--zero-stage"}


def training(flags: dict[str, str]) -> dict[str, str]:
    return {flag: value for flag, value in flags.items() if flag not in PATH_FLAGS}


@pytest.mark.parametrize("settings", [
    {},  # the defaults: tiny on 2 CPU ranks, seq 128, micro 4, 60 iterations, fp32, GPT-3's 125M learning rate
    pytest.param(dict(TP=2, GAS=2, SP=1, USE_ACTIVATION_CHECKPOINTING=1, PRECISION="bf16", TRAIN_EPOCHS=1,
                      MICRO_BATCH=2)),
    pytest.param(dict(MPSIZE=2, DTYPE="bf16", SEQ_LEN=64, GLOBAL_BATCH=8, LR="1e-3", TRAIN_ITERS=7,
                      DATA_SPLIT="90,8,2")),
])
def test_the_drivers_and_alcf_train_the_same_run_from_the_same_settings(tmp_path, settings):
    """One set of defaults and one precedence (megatron/launch/settings.py): the same variables give the same
    pretrain_gpt.py flags through examples_zero/ and ALCF/, whichever of the two names (TP or MPSIZE, PRECISION
    or DTYPE, SPLIT or DATA_SPLIT) they are given by."""
    driver = training(driver_flags(tmp_path / "d", **settings))
    alcf = training(alcf_flags(tmp_path / "a", MODEL_SIZE_KEY="GPT_TINY", **settings))
    assert driver == alcf
    if not settings:
        assert {flag: driver[flag] for flag in ("--model-size", "--seq-length", "--micro-batch-size",
                                                "--global-batch-size", "--train-iters", "--lr", "--min-lr")} == {
            "--model-size": "tiny", "--seq-length": "128", "--micro-batch-size": "4", "--global-batch-size": "8",
            "--train-iters": "60", "--lr": "6.0e-4", "--min-lr": "6.00e-05"}
        assert not {"--bf16", "--sequence-parallel", "--checkpoint-activations", "--train-epochs"} & set(driver)
    elif "GAS" in settings:  # Megatron's rule: 2 x 2 accumulated x 1 data-parallel rank (TP 2 of 2 ranks)
        assert (driver["--global-batch-size"], driver["--train-epochs"]) == ("4", "1")
        assert {"--bf16", "--sequence-parallel", "--checkpoint-activations"} <= set(driver)
    else:
        assert (driver["--tensor-model-parallel-size"], driver["--split"], driver["--lr"]) == ("2", "90,8,2", "1e-3")


def test_wandb_project_passes_wandb_project_on_both_paths(tmp_path):
    """WANDB_PROJECT (issue 33): Megatron-DeepSpeed's --wandb-project through examples_zero/ and ALCF/ alike (the
    wandb run is named after the run folder, its files in it: pretrain_gpt.py's --run-dir); unset, no wandb flag."""
    driver = driver_flags(tmp_path / "d", WANDB_PROJECT="zl-runs")
    alcf = alcf_flags(tmp_path / "a", MODEL_SIZE_KEY="GPT_TINY", WANDB_PROJECT="zl-runs")
    assert driver["--wandb-project"] == alcf["--wandb-project"] == "zl-runs"
    assert training(driver) == training(alcf)
    unset = [driver_flags(tmp_path / "d2", WANDB_PROJECT=None),
             alcf_flags(tmp_path / "a2", MODEL_SIZE_KEY="GPT_TINY", WANDB_PROJECT=None)]
    assert not [flags for flags in unset if any(flag.startswith("--wandb") for flag in flags)]


def test_position_embedding_type_rotary_passes_the_rotary_flag_on_both_paths(tmp_path):
    """POSITION_EMBEDDING_TYPE (issue 43): rotary gives --use-rotary-position-embeddings through examples_zero/
    and ALCF/ alike; learned, or unset, gives the learned position table (no flag)."""
    driver = driver_flags(tmp_path / "d", POSITION_EMBEDDING_TYPE="rotary")
    alcf = alcf_flags(tmp_path / "a", MODEL_SIZE_KEY="GPT_TINY", POSITION_EMBEDDING_TYPE="rotary")
    assert "--use-rotary-position-embeddings" in driver and training(driver) == training(alcf)
    for value in ("learned", None):
        assert "--use-rotary-position-embeddings" not in driver_flags(tmp_path / "l", POSITION_EMBEDDING_TYPE=value)
    sources = training_settings({"POSITION_EMBEDDING_TYPE": "rotary"}, accelerator="cpu", world=2,
                                model_size="tiny").sources
    assert sources["--use-rotary-position-embeddings"] == "POSITION_EMBEDDING_TYPE"  # what a message about it names


def test_the_learning_rate_follows_the_model_size_as_in_the_gpt3_paper(tmp_path):
    """GPT-3 (Brown et al. 2020, Table 2.1): 6.0e-4 at 125M, 2.0e-4 at 1.3B, 1.0e-4 at 13B, 0.6e-4 at 175B;
    decayed to a tenth."""
    for size, key, lr, min_lr in (("125M", "GPT125M", "6.0e-4", "6.00e-05"), ("1.3B", "GPT1_3B", "2.0e-4", "2.00e-05"),
                                  ("13B", "GPT13B", "1.0e-4", "1.00e-05"), ("175B", "GPT175B", "0.6e-4", "6.00e-06")):
        driver = driver_flags(tmp_path, MODEL_SIZE=size, NGPUS=1)
        alcf = alcf_flags(tmp_path, MODEL_SIZE_KEY=key, NGPU_PER_HOST=1)
        assert (driver["--lr"], driver["--min-lr"]) == (alcf["--lr"], alcf["--min-lr"]) == (lr, min_lr)


# the cases of the issue that asked for the checks, then the rest (a dry run takes milliseconds in-process)
FIRST_SETTINGS = [
    (dict(MICRO_BATCH="two"), "MICRO_BATCH=two: expected a positive integer"),
    (dict(SEQ_LEN="abc"), "SEQ_LEN=abc: expected a positive integer"),
    (dict(PRECISION="bfloat16"), "PRECISION=bfloat16: expected one of fp32, bf16, fp16"),
    (dict(PRECISION="fp16"), "PRECISION=fp16: DeepSpeed's CPU accelerator has no fp16; expected fp32 or bf16 "
                             "without a GPU"),
]
BAD_SETTINGS = [*FIRST_SETTINGS, *[
    (dict(GAS="0"), "GAS=0: expected a positive integer"),
    (dict(TRAIN_EPOCHS="one"), "TRAIN_EPOCHS=one: expected a number >= 0"),
    (dict(DTYPE="half"), "DTYPE=half: expected one of fp32, bf16, fp16"),
    (dict(PRECISION="bf16", DTYPE="fp32"), "PRECISION=bf16 and DTYPE=fp32 name the same setting: set one of them"),
    (dict(TP="2", MPSIZE="1"), "TP=2 and MPSIZE=1 name the same setting: set one of them"),
    (dict(TRAIN_ITERS="3", TRAIN_EPOCHS="1"), "TRAIN_ITERS=3 and TRAIN_EPOCHS=1 both set the run's length: set "
                                              "one of them"),
    (dict(LR="fast"), "LR=fast: expected a number >= 0"),
    (dict(ADAM_BETA2="1.5"), "ADAM_BETA2=1.5: expected a number from 0 to 1"),
    (dict(LR_DECAY_STYLE="cos"), "LR_DECAY_STYLE=cos: expected one of cosine, linear, constant"),
    (dict(USE_ACTIVATION_CHECKPOINTING="yes"), "USE_ACTIVATION_CHECKPOINTING=yes: expected 0 or 1"),
    (dict(SP="on"), "SP=on: expected 0 or 1"),
    (dict(SPLIT="90/8/2"), "SPLIT=90/8/2: expected up to three comma-separated weights, e.g. 969,30,1"),
    (dict(SEED="-1"), "SEED=-1: expected an integer >= 0"),
    (dict(DISTRIBUTED_TIMEOUT_MINUTES="ten"), "DISTRIBUTED_TIMEOUT_MINUTES=ten: expected a number >= 0"),
    (dict(DS_CONFIG="/nonexistent/ds.json"), "DS_CONFIG=/nonexistent/ds.json: no such file (expected a DeepSpeed "
                                             "JSON)"),
    (dict(FRESH="yes"), "FRESH=yes: expected 0 or 1"),
    (dict(DRY_RUN="2"), "DRY_RUN=2: expected 0 or 1"),
    (dict(MASTER_PORT="http"), "MASTER_PORT=http: expected a TCP port, 1 to 65535"),
    (dict(MASTER_PORT="99999"), "MASTER_PORT=99999: expected a TCP port, 1 to 65535"),
    (dict(OMP_NUM_THREADS="all"), "OMP_NUM_THREADS=all: expected a positive integer"),
    (dict(POSITION_EMBEDDING_TYPE="rope"), "POSITION_EMBEDDING_TYPE=rope: expected one of learned, rotary"),
]]


@pytest.mark.parametrize("script", [DRIVER, ALCF], ids=["driver", "alcf"])
@pytest.mark.parametrize("settings, message", BAD_SETTINGS)
def test_a_bad_variable_is_named_with_its_value_and_what_is_expected(tmp_path, script, settings, message):
    settings = {"DRY_RUN": 0 if "FRESH" in settings else 1, **settings}  # FRESH: a real launch, refused
    result = run(script, RUNS_DIR=tmp_path, OUTPUT_ROOT=tmp_path,
                 CUDA_VISIBLE_DEVICES="", MODEL_SIZE_KEY="GPT_TINY", **settings)
    assert (result.returncode, result.stderr) == (1, f"error: {message}\n")
    assert not any(tmp_path.iterdir())  # refused before anything is written


@pytest.mark.parametrize("settings, message", [
    (dict(NGPUS="two"), "NGPUS=two: expected a positive integer"),
    (dict(LAUNCHER="mpirun"), "LAUNCHER=mpirun: expected one of torchrun, deepspeed, mpiexec, srun"),
    (dict(MODEL_SIZE="7B"), "MODEL_SIZE=7B: expected a preset (tiny, 125M, 355M, 760M, 774M, 1.3B, 1.5B, 2.7B, "
                            "6.7B, 13B, 25B, 175B, llama-tiny, llama2-7b, llama2-13b, llama3-8b, tiny-moe4, "
                            "gpt-125m-moe8, gpt-350m-moe16)"),
    (dict(NNODES="2", NODE_RANK="x"), "NODE_RANK=x: expected an integer >= 0"),
    # ALCF's ZERO_STAGE: each driver runs its own stage, and says so instead of ignoring another
    (dict(ZERO_STAGE="3"), "ZERO_STAGE=3: gpt_deepspeed_Z1.sh runs ZeRO stage 1 (each driver is one experiment: "
                           "gpt_deepspeed_DP.sh, _Z1, _Z2 and _Z3 run stages 0 to 3): run that stage's driver, or "
                           "leave ZERO_STAGE unset"),
])
def test_a_bad_driver_variable_is_named(tmp_path, settings, message):
    result = run(DRIVER, DRY_RUN=1, RUNS_DIR=tmp_path, **settings)
    assert (result.returncode, result.stderr) == (1, f"error: {message}\n")


@pytest.mark.parametrize("driver, offload, own", [("Z1", "1", "0"), ("Z3", "nvme", "0"), ("Z3_OL", "0", "1"),
                                                   ("Z3_NVMe", "1", "nvme")])
def test_an_offload_other_than_the_drivers_is_refused(tmp_path, driver, offload, own):
    """OFFLOAD=1 beside gpt_deepspeed_Z3.sh trained with offload in a folder named Z3, and OFFLOAD=0 beside _Z3_OL
    was overwritten: each driver is one experiment, and another OFFLOAD is one line, as ZERO_STAGE is."""
    result = run(REPO_ROOT / "examples_zero" / f"gpt_deepspeed_{driver}.sh", DRY_RUN=1, RUNS_DIR=tmp_path,
                 OFFLOAD=offload)
    assert (result.returncode, result.stderr) == (1, f"error: OFFLOAD={offload}: gpt_deepspeed_{driver}.sh runs with "
                                                     f"OFFLOAD={own} (each driver is one experiment: "
                                                     "gpt_deepspeed_Z3_OL.sh offloads to CPU memory, OFFLOAD=1; "
                                                     "gpt_deepspeed_Z3_NVMe.sh to NVMe, OFFLOAD=nvme; the others "
                                                     "offload nothing): run that driver, or leave OFFLOAD unset\n")
    same = run(REPO_ROOT / "examples_zero" / f"gpt_deepspeed_{driver}.sh", DRY_RUN=1, RUNS_DIR=tmp_path, OFFLOAD=own)
    assert same.returncode == 0, same.stderr
    offloads = {"0": [], "1": ["--zero-offload-optimizer", "--zero-offload-params"], "nvme": ["--zero-nvme-path"]}
    flags = command_line(same).split()
    assert [flag for flag in flags if flag.startswith(("--zero-offload", "--zero-nvme"))] == offloads[own]


@pytest.mark.parametrize("script", [DRIVER, ALCF], ids=["driver", "alcf"])
def test_a_jsons_optimizer_section_is_refused_before_the_run_folder_is_touched(tmp_path, script):
    """FRESH=1 with a DS_CONFIG whose optimizer section would be replaced: refused in one line before the lock and
    the resume rule run, so the run folder's checkpoint stays where it was."""
    user = tmp_path / "ds_config.json"
    user.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4,
                                "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}))
    runs = tmp_path / "runs"
    run_dir = runs / "gpt_tiny_Z1" if script == DRIVER else runs
    committed_checkpoint(run_dir / "checkpoints", "global_step2")
    before = sorted(str(p.relative_to(runs)) for p in runs.rglob("*"))
    result = run(script, RUNS_DIR=runs, OUTPUT_ROOT=runs, CUDA_VISIBLE_DEVICES="", MODEL_SIZE_KEY="GPT_TINY",
                 FRESH=1, DS_CONFIG=user)
    assert (result.returncode, result.stderr) == (1, f'error: DS_CONFIG={user}: its "optimizer" section (Adam, lr '
                                                     "0.001) is not used: zero-lab builds AdamW from --lr, "
                                                     "--adam-beta1, --adam-beta2, --adam-eps, --weight-decay (the "
                                                     "drivers' LR, ADAM_BETA1, ADAM_BETA2, WEIGHT_DECAY): remove the "
                                                     "section and set those\n")
    assert sorted(str(p.relative_to(runs)) for p in runs.rglob("*")) == before


def test_a_drivers_own_zero_stage_may_be_named(tmp_path):
    """ZERO_STAGE equal to the driver's stage is what the driver runs anyway (--zero-stage 1)."""
    result = run(DRIVER, DRY_RUN=1, RUNS_DIR=tmp_path, ZERO_STAGE="1")
    assert result.returncode == 0, result.stderr
    assert " --zero-stage 1 " in command_line(result)


def test_a_users_deepspeed_json_gives_what_no_variable_sets(tmp_path):
    """A DeepSpeed JSON written as Megatron-DeepSpeed's examples write them: its batch sizes and clipping stand
    when MICRO_BATCH, GLOBAL_BATCH, GAS and CLIP_GRAD are not set (no flag of ours contradicts them); a variable
    that is set is passed, and pretrain_gpt.py checks it against the JSON; PRECISION=fp32 against a JSON in bf16
    is refused in one line."""
    user = tmp_path / "ds_config.json"
    user.write_text(json.dumps({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
                                "gradient_clipping": 0.5, "bf16": {"enabled": True},
                                "zero_optimization": {"stage": 1}}))
    for flags in (driver_flags(tmp_path, DS_CONFIG=user),
                  alcf_flags(tmp_path, DS_CONFIG=user, MODEL_SIZE_KEY="GPT_TINY")):
        assert not {"--micro-batch-size", "--global-batch-size", "--clip-grad", "--bf16"} & set(flags)
        assert flags["--deepspeed_config"] == str(user)
    given = driver_flags(tmp_path, DS_CONFIG=user, MICRO_BATCH=2, CLIP_GRAD=0.5)
    assert (given["--micro-batch-size"], given["--clip-grad"]) == ("2", "0.5") and "--global-batch-size" not in given
    # GLOBAL_BATCH alone beside the JSON's micro batch is passed, never dropped (pretrain_gpt.py checks the two)
    micro_only = tmp_path / "micro_only.json"
    micro_only.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2}))
    for flags in (driver_flags(tmp_path, DS_CONFIG=micro_only, GLOBAL_BATCH=16),
                  alcf_flags(tmp_path, DS_CONFIG=micro_only, GLOBAL_BATCH=16, MODEL_SIZE_KEY="GPT_TINY")):
        assert flags["--global-batch-size"] == "16" and "--micro-batch-size" not in flags
    for script in (DRIVER, ALCF):
        fp32 = run(script, DRY_RUN=1, RUNS_DIR=tmp_path, OUTPUT_ROOT=tmp_path, CUDA_VISIBLE_DEVICES="",
                   MODEL_SIZE_KEY="GPT_TINY", DS_CONFIG=user, PRECISION="fp32")
        assert (fp32.returncode, fp32.stderr) == (1, f"error: PRECISION=fp32 disagrees with bf16.enabled true in "
                                                     f"DS_CONFIG={user}: drop one of them or make them agree\n")
    no_micro = tmp_path / "no_micro.json"
    no_micro.write_text(json.dumps({"gradient_accumulation_steps": 2}))
    flags = driver_flags(tmp_path, DS_CONFIG=no_micro)
    assert flags["--micro-batch-size"] == "4" and "--global-batch-size" not in flags and flags["--clip-grad"] == "1.0"
    gas = run(DRIVER, DRY_RUN=1, RUNS_DIR=tmp_path, DS_CONFIG=user, GAS=2)
    assert (gas.returncode, gas.stderr) == (1, f"error: GAS=2: DS_CONFIG={user} gives the micro batch, so set "
                                               "gradient_accumulation_steps there (or MICRO_BATCH here too)\n")


@pytest.mark.slow
def test_a_run_trains_with_the_batch_and_clipping_of_a_users_json(tmp_path, dolly_data_dir):
    """The Z1 driver with only DS_CONFIG set among the batch variables: the JSON's 16 = 2 x 4 x 2 ranks and its
    clipping are what DeepSpeed gets (<run>/ds_config.json) and what the run says it trains with."""
    from conftest import driver_env

    user = tmp_path / "ds_config.json"
    user.write_text(json.dumps({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
                                "gradient_accumulation_steps": 4, "gradient_clipping": 0.5,
                                "zero_optimization": {"stage": 1}}))
    env = driver_env(dolly_data_dir, tmp_path / "runs", DS_CONFIG=user, TRAIN_ITERS=2)
    for name in ("MICRO_BATCH", "TRAIN_EPOCHS"):
        env.pop(name)
    result = subprocess.run(["bash", str(DRIVER)], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = tmp_path / "runs" / "gpt_tiny_Z1"
    used = json.loads((run_dir / "ds_config.json").read_text())
    assert (used["train_batch_size"], used["train_micro_batch_size_per_gpu"], used["gradient_accumulation_steps"],
            used["gradient_clipping"]) == (16, 2, 4, 0.5)
    log = (run_dir / "train.log").read_text()
    assert " > run info | zero stage: 1 | offload: none | model: tiny | world size: 2 | micro batch: 2 | " \
           "global batch: 16 |" in log


def test_the_deepspeed_launcher_trains_on_the_visible_gpus(tmp_path):
    """CUDA_VISIBLE_DEVICES=4,5,6 with NGPUS=2: the runner gets --include localhost:4,5 (its --num_gpus 2 would
    re-export GPUs 0 and 1); a GPU named by UUID, or more ranks than visible GPUs, is refused in one line."""
    result = run(DRIVER, DRY_RUN=1, RUNS_DIR=tmp_path, LAUNCHER="deepspeed", CUDA_VISIBLE_DEVICES="4,5,6", NGPUS=2)
    line = command_line(result).replace("\\,", ",")
    assert " -m deepspeed.launcher.runner --include localhost:4,5 --master_port " in line and "--num_gpus" not in line
    plain = command_line(run(DRIVER, DRY_RUN=1, RUNS_DIR=tmp_path, LAUNCHER="deepspeed", CUDA_VISIBLE_DEVICES=None,
                             NGPUS=2))
    assert " -m deepspeed.launcher.runner --num_gpus 2 --master_port " in plain
    for visible, ranks, message in (
            ("GPU-3f2a", 1, "CUDA_VISIBLE_DEVICES=GPU-3f2a: the deepspeed launcher takes GPU indices (e.g. 4,5); use "
                            "LAUNCHER=torchrun, which keeps it as it is"),
            ("4", 2, "NGPUS=2: more than the 1 GPUs CUDA_VISIBLE_DEVICES=4 makes visible")):
        refused = run(DRIVER, DRY_RUN=1, RUNS_DIR=tmp_path, LAUNCHER="deepspeed", CUDA_VISIBLE_DEVICES=visible,
                      NGPUS=ranks)
        assert (refused.returncode, refused.stderr) == (1, f"error: {message}\n")
