"""ALCF/train-gpt3.sh (PBS + mpiexec launch scripts) and megatron/runtime/dist_env.py.

The scripts run for real in a subprocess; only what a dev box lacks is faked on PATH: a PBS
node file with two hosts, `nvidia-smi` listing four GPUs, `qsub`, and for the Open MPI test
an `mpiexec --version` that answers like Open MPI. The slow tests launch real ranks with
Debian's MPICH mpiexec.
"""
import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO_ROOT, launch_script
from conftest import test_env as subprocess_env  # aliased: pytest would collect test_env as a test
from megatron.runtime.dist_env import DistEnvError, LauncherEnv, export_launcher_env, resolve_launcher_env
from test_presets import LLAMA_PUBLISHED, PUBLISHED

TRAIN = REPO_ROOT / "ALCF" / "train-gpt3.sh"
SUBMIT = REPO_ROOT / "ALCF" / "submit-pbs.sh"
EXAMPLE_RUN = "gpt_SP_actCkpt_GPT13B_z1_seqlen1024_mp8_pp1_sp1_nl40_hs5120_gb1_mb1"
HOSTS = ["x3001c0s7b0n0.hsn.cm.polaris.alcf.anl.gov", "x3001c0s7b1n0.hsn.cm.polaris.alcf.anl.gov"]
LAUNCH_VARS = ("PBS_NODEFILE", "HOSTFILE", "CUDA_VISIBLE_DEVICES", "NGPU_PER_HOST", "RUN_NAME", "PBS_JOBID",
               "GLOBAL_BATCH", "GAS", "MPSIZE", "PPSIZE", "SP_TYPE", "ZERO_STAGE", "DTYPE", "DATA_PATH",
               "MODEL_SIZE_KEY", "TRAIN_ITERS", "TRAIN_EPOCHS", "OMP_NUM_THREADS", "VENV_DIR",
               "ZERO_LAB_ROOT", "PBS_O_WORKDIR", "PBS_ACCOUNT", "MPIEXEC_EXTRA_ARGS", "OUTPUT_ROOT")


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


@pytest.fixture
def cluster(tmp_path):
    """A fake PBS allocation: node file with two hosts, nvidia-smi listing 4 GPUs per host, PALS mpiexec."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _executable(bin_dir / "nvidia-smi",
                "#!/bin/sh\nfor i in 0 1 2 3; do echo \"GPU $i: NVIDIA A100-SXM4-40GB (UUID: GPU-$i)\"; done\n")
    # a stand-in for PALS's mpiexec (ALCF): neither Hydra's nor Open MPI's version banner
    _executable(bin_dir / "mpiexec", "#!/bin/sh\necho 'mpiexec version 1.2.12 (HPE PALS stand-in)'\n")
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("".join(f"{host}\n" for host in HOSTS))
    return tmp_path


def run_script(workdir: Path, script: Path = TRAIN, args=(), gpus=True, **env):
    """Run an ALCF script in workdir with a clean launch environment plus env."""
    env = {"OUTPUT_ROOT": workdir / "outputs", "LOGFILES": workdir / "logfiles", **env}
    full = subprocess_env(USER="tester", **env)
    for var in LAUNCH_VARS:
        if var not in env:
            full.pop(var, None)
    if gpus:
        full["PATH"] = f"{workdir / 'bin'}{os.pathsep}{full['PATH']}"
    else:
        full["CUDA_VISIBLE_DEVICES"] = ""  # hides any real GPU too
    return launch_script(script, args, full, cwd=workdir)


def launch_line(result) -> str:
    lines = [line for line in result.stdout.splitlines() if line.startswith("[launch] mpiexec")]
    assert len(lines) == 1, result.stdout + result.stderr
    return lines[0]


def flag_value(line: str, flag: str) -> str:
    match = re.search(rf" {re.escape(flag)} (\S+)", line)
    assert match, f"{flag} missing from {line}"
    return match.group(1)


# ---- dry runs: the command built for a 2-host x 4-GPU PBS job ----

def test_example_run_name_and_mpiexec_command(cluster):
    result = run_script(cluster, DRY_RUN=1, PBS_NODEFILE=cluster / "nodefile", MODEL_SIZE_KEY="GPT13B",
                        MPSIZE=8, SEQ_LEN=1024, MICRO_BATCH=1, SP_TYPE="megatron", ZERO_STAGE=1,
                        USE_ACTIVATION_CHECKPOINTING=1)
    assert result.returncode == 0, result.stderr
    line = launch_line(result)
    assert f" -n 8 --ppn 4 --hostfile {cluster / 'nodefile'} " in line
    assert line.startswith("[launch] mpiexec --verbose --envall ")
    assert f"{REPO_ROOT / 'pretrain_gpt.py'} " in line
    assert flag_value(line, "--model-size") == "13B"  # the shape itself comes from megatron/model/presets.py
    assert flag_value(line, "--tensor-model-parallel-size") == "8"
    assert flag_value(line, "--global-batch-size") == "1"
    assert flag_value(line, "--zero-stage") == "1"
    for flag in ("--sequence-parallel", "--checkpoint-activations", "--bf16", "--deepspeed"):
        assert f" {flag} " in line
    run_dir = cluster / "outputs" / EXAMPLE_RUN
    assert flag_value(line, "--run-dir") == str(run_dir)
    assert flag_value(line, "--save") == str(run_dir / "checkpoints")
    assert flag_value(line, "--tensorboard-dir") == str(run_dir / "tensorboard")
    assert f"run: {EXAMPLE_RUN} " in result.stdout
    assert not (cluster / "outputs").exists() and not (cluster / "logfiles").exists()  # a dry run writes nothing


def test_user_example_gpt1_5b_derives_global_batch(cluster):
    result = run_script(cluster, DRY_RUN=1, PBS_NODEFILE=cluster / "nodefile", MODEL_SIZE_KEY="GPT1_5B",
                        SEQ_LEN=1024, MICRO_BATCH=2, GAS=4, MPSIZE=2, SP_TYPE="megatron",
                        USE_ACTIVATION_CHECKPOINTING=0, ZERO_STAGE=3)
    assert result.returncode == 0, result.stderr
    line = launch_line(result)
    assert flag_value(line, "--model-size") == "1.5B"
    assert "[models] GPT1_5B: preset 1.5B, layers=48 hidden=1600 heads=25" in result.stdout  # GPT-2 XL
    # 8 GPUs / (mp 2 x pp 1) = dp 4; global = micro 2 x gas 4 x dp 4
    assert flag_value(line, "--global-batch-size") == "32"
    assert " --checkpoint-activations" not in line
    assert "run: gpt_SP_GPT1_5B_z3_seqlen1024_mp2_pp1_sp1_nl48_hs1600_gb32_mb2 " in result.stdout


def test_hostfile_and_visible_devices_and_extra_args(cluster):
    hostfile = cluster / "hosts"
    hostfile.write_text("nodeA slots=4\nnodeB:4\nnodeC\n")
    result = run_script(cluster, args=["--eval-iters", "0"], DRY_RUN=1, HOSTFILE=hostfile,
                        CUDA_VISIBLE_DEVICES="0,1", MODEL_SIZE_KEY="GPT125M", SP_TYPE="none", GLOBAL_BATCH=12, MICRO_BATCH=2,
                        MPIEXEC_EXTRA_ARGS="--cpu-bind depth -d 16")
    assert result.returncode == 0, result.stderr
    line = launch_line(result)
    assert f" -n 6 --ppn 2 --hostfile {hostfile} --cpu-bind depth -d 16 {sys.executable} " in line
    assert "hosts: nodeA nodeB nodeC " in result.stdout
    assert line.rstrip().endswith("--eval-iters 0")
    assert flag_value(line, "--global-batch-size") == "12"
    assert "run: gpt_GPT125M_z1_" in result.stdout and " --sequence-parallel" not in line


def test_run_name_says_sp_only_when_on_and_outputs_go_to_the_repository(cluster):
    """Tensor parallelism alone (MPSIZE=2, no SP_TYPE/SP) is no sequence parallelism: no --sequence-parallel, no
    SP_ in the name; SP=1 gives both. Without OUTPUT_ROOT the run folder is the repository's outputs/, whichever
    folder the script runs from (here a temporary one), as the drivers' runs/."""
    env = dict(DRY_RUN=1, PBS_NODEFILE=cluster / "nodefile", MODEL_SIZE_KEY="GPT125M", MPSIZE=2)
    for sp, prefix in ((None, "gpt_GPT125M_z1_"), ("1", "gpt_SP_GPT125M_z1_")):
        result = run_script(cluster, **env, **({"SP": sp} if sp else {}))
        assert result.returncode == 0, result.stderr
        line = launch_line(result)
        assert (" --sequence-parallel " in line) == (sp == "1")
        name = re.search(r"\[args\] run: (\S+) ", result.stdout).group(1)
        assert name.startswith(prefix), name
    full = subprocess_env(USER="tester", **env)
    for var in (*LAUNCH_VARS, "LOGFILES", "SP"):
        if var not in env:
            full.pop(var, None)
    full["PATH"] = f"{cluster / 'bin'}{os.pathsep}{full['PATH']}"
    result = subprocess.run(["bash", str(TRAIN)], cwd=cluster, env=full, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    name = re.search(r"\[args\] run: (\S+) ", result.stdout).group(1)
    assert flag_value(launch_line(result), "--run-dir") == str(REPO_ROOT / "outputs" / name)


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec (scripts/setup.sh installs MPICH)")
def test_no_gpu_runs_cpu_ranks_on_this_host(tmp_path):
    result = run_script(tmp_path, gpus=False, DRY_RUN=1, MODEL_SIZE_KEY="GPT_TINY", SEQ_LEN=64)
    assert result.returncode == 0, result.stderr
    line = launch_line(result)
    assert " -n 2 --ppn 2 " in line
    if "HYDRA" in subprocess.run(["mpiexec", "--version"], capture_output=True, text=True).stdout:
        # Hydra's --verbose would print every environment variable into the log
        assert line.startswith("[launch] mpiexec --envall -n 2 ") and "--verbose" not in line
    # without a node file the job is this host; the hostfile is written at launch into the run folder
    assert flag_value(line, "--hostfile").endswith("/hostfile")
    assert "accelerator=cpu" in result.stdout and " --bf16" not in line
    assert flag_value(line, "--model-size") == "tiny"


def test_deepspeed_sequence_parallelism_takes_spsize(cluster):
    """ALCF's SP_TYPE=deepspeed with SPSIZE: DeepSpeed-Ulysses (docs/long-sequences.md), 8 ranks = SP 2 x DP 4."""
    result = run_script(cluster, DRY_RUN=1, PBS_NODEFILE=cluster / "nodefile", MODEL_SIZE_KEY="GPT125M",
                        SP_TYPE="deepspeed", SPSIZE=2, MICRO_BATCH=1)
    assert result.returncode == 0, result.stderr
    line = launch_line(result)
    assert flag_value(line, "--ds-sequence-parallel-size") == "2" and " --sequence-parallel " not in line
    assert flag_value(line, "--global-batch-size") == "4"  # MICRO_BATCH 1 x data-parallel size 4


def test_open_mpi_spelling(cluster):
    _executable(cluster / "bin" / "mpiexec",
                "#!/bin/sh\necho 'mpiexec (OpenRTE) 4.1.5'\necho 'Report bugs to http://www.open-mpi.org/community/help/'\n")
    result = run_script(cluster, DRY_RUN=1, PBS_NODEFILE=cluster / "nodefile", MODEL_SIZE_KEY="GPT350M")
    assert result.returncode == 0, result.stderr
    line = launch_line(result)
    assert f" -n 8 -npernode 4 --hostfile {cluster / 'nodefile'} " in line
    assert "--envall" not in line and " -x PATH " in line and " -x CUDA_DEVICE_MAX_CONNECTIONS " in line


# ---- bad input: one clear line, exit 1, nothing written ----

@pytest.mark.parametrize("env, message", [
    (dict(MODEL_SIZE_KEY="GPT7B"), r"MODEL_SIZE_KEY=GPT7B is not a known model; valid keys: GPT_TINY, GPT125M, .*, "
                                   r"GPT13B, GPT25B, GPT175B, LLAMA_TINY, LLAMA2_7B, LLAMA2_13B, LLAMA3_8B$"),
    (dict(PBS_NODEFILE="/nonexistent/nodefile"), r"PBS_NODEFILE=/nonexistent/nodefile: hostfile does not exist"),
    # a flag the script made from a variable is named with it (megatron/flag_sources.py)
    (dict(MPSIZE=3), r"world size 8 is not divisible by --tensor-model-parallel-size 3 \(from MPSIZE\) x "
                     r"--pipeline-model-parallel-size 1 \(from PPSIZE\)$"),
    (dict(SP_TYPE="deepspeed", SP=1), r"SP_TYPE=deepspeed and SP=1 disagree: set one of them$"),
    (dict(SPSIZE=3), r"world size 8 is not divisible by --tensor-model-parallel-size 1 \(from MPSIZE\) x "
                     r"--pipeline-model-parallel-size 1 \(from PPSIZE\) x "
                     r"--ds-sequence-parallel-size 3 \(from SPSIZE\)$"),
    (dict(GLOBAL_BATCH=6, MICRO_BATCH=1), r"--global-batch-size 6 \(from GLOBAL_BATCH\) is not divisible by --micro-batch-size 1 "
                           r"\(from MICRO_BATCH\) x data-parallel size 8$"),
    (dict(MICRO_BATCH="two"), r"MICRO_BATCH=two: expected a positive integer"),
    (dict(NGPU_PER_HOST=0), r"NGPU_PER_HOST=0: expected a positive integer"),
    (dict(HOSTFILE="/nonexistent/hosts", PBS_NODEFILE=""), r"HOSTFILE=/nonexistent/hosts: hostfile does not exist"),
    (dict(VENV_DIR="/nonexistent/venv"), r"VENV_DIR=/nonexistent/venv: no bin/activate there"),
])
def test_bad_settings_fail_clearly(cluster, env, message):
    env = {"PBS_NODEFILE": cluster / "nodefile", "MODEL_SIZE_KEY": "GPT125M", **env}
    result = run_script(cluster, **env)  # not a dry run: the checks must stop it before mpiexec
    assert result.returncode == 1
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(error_lines) == 1 and re.search(message, error_lines[0]), result.stderr
    assert "Traceback" not in result.stderr and "[launch]" not in result.stdout
    assert not (cluster / "outputs").exists()


# ---- the PBS submit script ----

def test_submit_builds_qsub_from_variables(cluster):
    record = cluster / "qsub-args"
    _executable(cluster / "bin" / "qsub", f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {record}\necho 12345.polaris-pbs\n")
    result = run_script(cluster, script=SUBMIT, PBS_ACCOUNT="myproject", NNODES=4, WALLTIME="02:00:00",
                        QUEUE="prod", FILESYSTEMS="home:grand")
    assert result.returncode == 0, result.stderr
    assert "12345.polaris-pbs" in result.stdout
    args = record.read_text().splitlines()
    for pair in (["-A", "myproject"], ["-q", "prod"], ["-l", "select=4:system=polaris"],
                 ["-l", "walltime=02:00:00"], ["-l", "filesystems=home:grand"]):
        assert any(args[i:i + 2] == pair for i in range(len(args))), (pair, args)
    assert "-V" in args and args[-1] == str(SUBMIT)

    missing = run_script(cluster, script=SUBMIT)
    assert missing.returncode == 1 and "error: PBS_ACCOUNT is not set" in missing.stderr


def test_submit_inside_job_runs_train_script(cluster):
    # ZERO_LAB_ROOT arrives through qsub -V from the submitting shell
    result = run_script(cluster, script=SUBMIT, PBS_JOBID="12345.polaris-pbs", PBS_O_WORKDIR=cluster,
                        ZERO_LAB_ROOT=REPO_ROOT,
                        PBS_NODEFILE=cluster / "nodefile", DRY_RUN=1, MODEL_SIZE_KEY="GPT13B", MPSIZE=8,
                        SEQ_LEN=1024, MICRO_BATCH=1, SP_TYPE="megatron", USE_ACTIVATION_CHECKPOINTING=1)
    assert result.returncode == 0, result.stderr
    assert f"run: {EXAMPLE_RUN} " in result.stdout and " -n 8 --ppn 4 " in launch_line(result)

    # plain `qsub ALCF/submit-pbs.sh` from somewhere other than the repository root
    lost = run_script(cluster, script=SUBMIT, PBS_JOBID="12345.polaris-pbs", PBS_O_WORKDIR=cluster, DRY_RUN=1)
    assert lost.returncode == 1
    assert f"error: {cluster}/ALCF/train-gpt3.sh not found: submit from the zero-lab repository root" in lost.stderr


# ---- megatron/runtime/dist_env.py ----

def test_dist_env_pals_and_hydra():
    pals = {"PMI_RANK": "5", "PMI_SIZE": "8", "PMI_LOCAL_RANK": "1", "PALS_LOCAL_RANKID": "1",
            "PBS_NODEFILE": "/unused-when-master-addr-set", "MASTER_ADDR": "x3001c0s7b0n0"}
    assert resolve_launcher_env(pals) == LauncherEnv(5, 1, 8, "x3001c0s7b0n0", 29500, "MPICH/PALS")
    hydra = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MASTER_PORT": "6000"}
    assert resolve_launcher_env(hydra) == LauncherEnv(3, 1, 4, "localhost", 6000, "MPICH/PALS")


def test_dist_env_open_mpi_master_from_hostfile(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# allocation\n\nnode17 slots=4\nnode18 slots=4\n")
    environ = {"OMPI_COMM_WORLD_RANK": "6", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
               "HOSTFILE": str(hostfile)}
    assert resolve_launcher_env(environ) == LauncherEnv(6, 2, 8, "node17", 29500, "Open MPI")
    environ = {"PMI_RANK": "0", "PMI_SIZE": "2", "PMI_LOCAL_RANK": "0", "PBS_NODEFILE": str(hostfile),
               "HOSTFILE": "/ignored"}
    assert resolve_launcher_env(environ).master_addr == "node17"  # PBS_NODEFILE first


def test_dist_env_torchrun_wins_and_single_process():
    torchrun = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29511", "PMI_RANK": "0", "PMI_SIZE": "1"}
    assert resolve_launcher_env(torchrun) == LauncherEnv(1, 1, 2, "127.0.0.1", 29511, "torchrun/deepspeed")
    environ = {}
    assert export_launcher_env(environ) == LauncherEnv(0, 0, 1, "localhost", 29500, "none")
    assert environ == {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost",
                       "MASTER_PORT": "29500"}


@pytest.mark.parametrize("environ, message", [
    ({"PMI_RANK": "x", "PMI_SIZE": "2", "PMI_LOCAL_RANK": "0"}, "PMI_RANK='x' is not an integer"),
    ({"PMI_RANK": "2", "PMI_SIZE": "2", "PMI_LOCAL_RANK": "0"}, "PMI_RANK=2 is not below PMI_SIZE=2"),
    ({"PMI_RANK": "1", "PMI_SIZE": "2"}, "rank 1 of 2 was launched without a local rank: expected one of "
                                         "PMI_LOCAL_RANK, PALS_LOCAL_RANKID, MPI_LOCALRANKID"),
    ({"OMPI_COMM_WORLD_RANK": "0"}, "Open MPI launcher: OMPI_COMM_WORLD_SIZE is not set"),
    ({"PBS_NODEFILE": "/nonexistent/nodefile"}, "PBS_NODEFILE=/nonexistent/nodefile: cannot read hostfile"),
    ({"MASTER_PORT": "http"}, "MASTER_PORT='http' is not an integer"),
])
def test_dist_env_bad_environment(environ, message):
    with pytest.raises(DistEnvError, match=re.escape(message)):
        resolve_launcher_env(environ)


ALLREDUCE = """
import torch, torch.distributed as dist
from megatron.runtime.dist_env import export_launcher_env
env = export_launcher_env()
dist.init_process_group("gloo")  # env:// rendezvous from what export_launcher_env filled in
total = torch.tensor([float(env.rank + 1)])
dist.all_reduce(total)
print(f"rank {dist.get_rank()}/{dist.get_world_size()} local {env.local_rank} via {env.launcher} "
      f"master {env.master_addr} sum {total.item():.0f}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec (scripts/setup.sh installs MPICH)")
def test_dist_env_under_real_mpiexec(tmp_path):
    hostfile = tmp_path / "nodefile"
    hostfile.write_text(f"{os.uname().nodename}\n")
    env = subprocess_env(PBS_NODEFILE=hostfile, MASTER_PORT=29517)
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR"):
        env.pop(var, None)
    result = subprocess.run(["mpiexec", "-n", "2", "--ppn", "2", "--hostfile", str(hostfile),
                             sys.executable, "-c", ALLREDUCE], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    # mpiexec forwards each rank's output in chunks that may land on one line; match the messages, not lines
    lines = sorted(re.findall(r"rank \d+/\d+ local \d+ via \S+ master \S+ sum \d+", result.stdout))
    master = os.uname().nodename
    assert lines == [f"rank 0/2 local 0 via MPICH/PALS master {master} sum 3",
                     f"rank 1/2 local 1 via MPICH/PALS master {master} sum 3"]


# ---- a real run: MPICH mpiexec, 2 CPU ranks, the tiny key, the dolly sample ----

# not anchored at line starts: mpiexec may forward another rank's line without its newline first
ITERATION_LINE = re.compile(r" iteration +(\d+)/ +4 \| .*elapsed time per iteration \(ms\): (\d+\.\d+) \| "
                            r".*lm loss: (\d+\.\d+E[+-]\d+) \| .*\(tgs\): (\d+\.\d+)")
MEMORY_LINE = re.compile(r"memory at iteration +\d+ \| device=cpu, MemAllocated=(\d+\.\d+)GB, MaxMemAllocated=(\d+\.\d+)GB, "
                         r"HostRSS=(\d+\.\d+)GB")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec (scripts/setup.sh installs MPICH)")
def test_real_run_through_mpiexec(tmp_path, dolly_data_dir):
    settings = dict(DATA_DIR=dolly_data_dir, MODEL_SIZE_KEY="GPT_TINY", SEQ_LEN=64, MICRO_BATCH=2,
                    TRAIN_ITERS=4, LOG_INTERVAL=1, EVAL_INTERVAL=2, EVAL_ITERS=1,
                    DATA_SPLIT="90,8,2")  # the 382-record sample is too small for the default 969,30,1 test split
    result = run_script(tmp_path, gpus=False, **settings)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    run_name = "gpt_GPT_TINY_z1_seqlen64_mp1_pp1_sp1_nl2_hs128_gb4_mb2"
    run_dir = tmp_path / "outputs" / run_name
    log = Path((tmp_path / "logfiles").read_text().splitlines()[-1])
    assert log.parent == run_dir / "logs" and log.is_file()
    assert re.fullmatch(rf"tester-{re.escape(os.uname().nodename)}-nhosts1-ngpu2-\d{{4}}-\d\d-\d\d-\d{{6}}\.log", log.name)
    assert f"log: {log}" in result.stdout
    text = log.read_text()
    assert text.splitlines()[0].startswith("[zero-lab] attempt 1 started ")
    command = (run_dir / "command.txt").read_text().splitlines()
    assert command[0].startswith("# attempt 1 | ") and command[1].startswith("mpiexec --envall -n 2 --ppn 2 --hostfile ")
    assert " > run info | zero stage: 1 | offload: none | model: tiny | world size: 2 | micro batch: 2 | " \
           "global batch: 4 | seq length: 64 |" in text
    iterations = ITERATION_LINE.findall(text)
    assert [int(i) for i, *_ in iterations] == [1, 2, 3, 4]
    assert all(float(ms) > 0 and 5.0 < float(loss) < 12.0 and float(tgs) > 0 for _, ms, loss, tgs in iterations)
    assert len(MEMORY_LINE.findall(text)) >= 4
    assert len(re.findall(r" validation loss at iteration [24] \| lm loss value: \d\.\d+E[+-]\d+ \|", text)) == 2
    assert (run_dir / "hostfile").read_text().split() == [os.uname().nodename]
    assert (run_dir / "checkpoints" / "latest").is_file()
    assert list((run_dir / "tensorboard").iterdir())
    ds_config = json.loads((run_dir / "ds_config.json").read_text())
    assert ds_config["zero_optimization"]["stage"] == 1 and ds_config["train_batch_size"] == 4

    # the same run again resumes from its checkpoint (the one resume rule); FRESH=1 would start afresh
    fresh = run_script(tmp_path, gpus=False, DRY_RUN=1, FRESH=1, **settings)
    assert (f"[run] DRY_RUN=1, the run would be starting afresh (FRESH=1): would move the old files of {run_dir} to "
            f"{run_dir}.old-<time>") in fresh.stderr and (run_dir / "checkpoints" / "latest").is_file()
    again = run_script(tmp_path, gpus=False, **{**settings, "TRAIN_ITERS": 5})
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert flag_value(launch_line(again), "--load") == str(run_dir / "checkpoints")
    assert f"[run] resuming from global_step4 in {run_dir / 'checkpoints'}" in again.stderr
    logs = sorted((run_dir / "logs").iterdir())  # <user>-<host>-...-<date>: in the order they started
    assert len(logs) == 2 and logs[1].read_text().startswith("[zero-lab] attempt 2 started ")

    # the summary joins the run's two attempt logs into one run
    summary = subprocess.run([sys.executable, str(REPO_ROOT / "analysis" / "summarize.py"), "outputs",
                              "--out", "summary", "--no-plots"], cwd=tmp_path, env=subprocess_env(),
                             capture_output=True, text=True, timeout=120)
    assert summary.returncode == 0, summary.stderr
    [row] = json.loads((tmp_path / "summary" / "summary.json").read_text())["runs"]
    assert (row["run"], row["zero_stage"], row["world_size"], row["global_batch"], row["last_iteration"],
            row["attempts"], row["status"]) == (run_name, 1, 2, 4, 5, 2, "finished")
    assert row["loss_first"] == pytest.approx(float(iterations[0][2]))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec (scripts/setup.sh installs MPICH)")
def test_a_failed_run_through_mpiexec_ends_with_its_cause(tmp_path):
    """docs/bad-input.md under ALCF's mpiexec: the ranks' one error line, once, last, no traceback."""
    result = run_script(tmp_path, gpus=False, MODEL_SIZE_KEY="GPT_TINY", SEQ_LEN=64,
                        DATA_PATH=tmp_path / "nothing_here")
    assert result.returncode == 1
    cause = (f"error: --data-path (from DATA_PATH): {tmp_path / 'nothing_here'}.bin does not exist (expected a "
             "prefix with .bin/.idx files from tools/preprocess_data.py)")
    assert result.stderr.splitlines()[-1] == cause
    output = result.stdout + result.stderr
    assert [line for line in output.splitlines() if "error: " in line] == [cause] and "Traceback" not in output


# MODEL_SIZE_KEY -> the preset (tests/test_presets.py's PUBLISHED: the published model it is named after)
ALCF_KEYS = {"GPT_TINY": "tiny", "GPT125M": "125M", "GPT350M": "355M", "GPT760M": "760M", "GPT774M": "774M",
             "GPT1_3B": "1.3B", "GPT1_5B": "1.5B", "GPT2_7B": "2.7B", "GPT6_7B": "6.7B", "GPT13B": "13B",
             "GPT25B": "25B", "GPT175B": "175B", "LLAMA_TINY": "llama-tiny", "LLAMA2_7B": "llama2-7b",
             "LLAMA2_13B": "llama2-13b", "LLAMA3_8B": "llama3-8b"}
PUBLISHED_KEYS = [key for key, preset in ALCF_KEYS.items() if preset in PUBLISHED]
LLAMA_KEYS = [key for key, preset in ALCF_KEYS.items() if preset in LLAMA_PUBLISHED]


@functools.cache
@functools.cache
def models_sh_shapes() -> dict[str, tuple[str, int, int, int]]:
    """Every key's (preset, layers, hidden, heads) as `bash ALCF/models.sh` prints them (once per session: a
    process per key)."""
    shapes = {}
    for key in ALCF_KEYS:
        result = subprocess.run(["bash", str(REPO_ROOT / "ALCF" / "models.sh")], capture_output=True, text=True,
                                timeout=60, env=subprocess_env(MODEL_SIZE_KEY=key, CUDA_VISIBLE_DEVICES=""))
        assert result.returncode == 0, result.stderr
        said = re.fullmatch(r"\[models\] (\S+): preset (\S+), layers=(\d+) hidden=(\d+) heads=(\d+)\n", result.stdout)
        assert said and said.group(1) == key, result.stdout
        shapes[key] = (said.group(2), *map(int, said.groups()[2:]))
    return shapes


@pytest.mark.parametrize("key", PUBLISHED_KEYS)
def test_models_sh_key_has_the_published_shape(key):
    """ALCF/models.sh's shape for each key against the published model the key names (GPT-3 Table 2.1, GPT-2,
    ALCF's own 25B: the figures written out in tests/test_presets.py)."""
    source, _, layers, hidden, heads, _ = PUBLISHED[ALCF_KEYS[key]]
    assert models_sh_shapes()[key] == (ALCF_KEYS[key], layers, hidden, heads), source


@pytest.mark.parametrize("key", LLAMA_KEYS)
def test_models_sh_llama_key_has_the_released_shape(key):
    source, _, layers, hidden, heads, *_ = LLAMA_PUBLISHED[ALCF_KEYS[key]]
    assert models_sh_shapes()[key] == (ALCF_KEYS[key], layers, hidden, heads), source


def test_models_sh_small_keys_build_models_of_the_published_size():
    """The real GPTModel built from the shapes models.sh prints: GPT125M with GPT-2's vocabulary and 1024
    positions has exactly the released GPT-2 small checkpoint's 124,439,808 parameters (and with GPT-3's 2048
    positions 125.2M, Table 2.1's 125M); GPT_TINY with 512 tokens and 64 positions the hand count of
    tests/test_presets.py, 470,528."""
    from megatron.model import GPTConfig, GPTModel

    def parameters(key, vocab, positions):
        _, layers, hidden, heads = models_sh_shapes()[key]
        with torch.device("meta"):  # shapes only: no 125M weights drawn
            model = GPTModel(GPTConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                                       seq_length=positions, max_position_embeddings=positions,
                                       padded_vocab_size=vocab))
        return sum(p.numel() for p in model.parameters())

    assert parameters("GPT125M", 50257, 1024) == 124_439_808
    assert parameters("GPT125M", 50257, 2048) == pytest.approx(125e6, rel=0.01)
    assert parameters("GPT_TINY", 512, 64) == 470_528


@pytest.mark.parametrize("key", PUBLISHED_KEYS)
def test_readme_model_table_has_the_published_shapes(key):
    """ALCF/README.md's table of MODEL_SIZE_KEY shapes: every key in it, each with its published shape."""
    table = {key: tuple(map(int, shape)) for key, *shape in
             re.findall(r"`((?:GPT|LLAMA)\w+)` \| (\d+)/(\d+)/(\d+)", (REPO_ROOT / "ALCF" / "README.md").read_text())}
    assert sorted(table) == sorted(ALCF_KEYS)
    source, _, layers, hidden, heads, _ = PUBLISHED[ALCF_KEYS[key]]
    assert table[key] == (layers, hidden, heads), source
