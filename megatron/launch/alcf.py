"""ALCF/train-gpt3.sh's launch path: Megatron-DeepSpeed's GPT-3 runs through mpiexec over a PBS job's hosts (or
this host alone), with ALCF's variable names (MODEL_SIZE_KEY, MPSIZE, PPSIZE, DTYPE, SP_TYPE, ...). The steps keep
the names of ALCF's scripts, each of which prints its one line:
- setup: the hosts (PBS_NODEFILE, else HOSTFILE, else this host) and the accelerators per host;
- models: MODEL_SIZE_KEY -> zero-lab's preset (megatron/model/presets.py holds the shapes);
- args: the run's name and folder under OUTPUT_ROOT, and the Megatron-DeepSpeed flags (the training settings
  both launch paths share: megatron/launch/settings.py);
- launch: the mpiexec line for PALS, MPICH's Hydra or Open MPI.
"""
from __future__ import annotations

import contextlib
import io
import os
import pwd
import shlex
import shutil
import socket
import subprocess
import time

from megatron.launch import settings as training
from megatron.launch.given_flags import read_layout_flags
from megatron.launch.plan import (REPO, Launch, check_port, die, free_port, given, python_of, resume_rule,
                                  visible_gpus)
from megatron.launch.settings import check
from megatron.model.presets import MODEL_PRESETS

# the steps of the plan, named after ALCF's scripts: each prints one line starting [<step>]
STEPS = ("setup", "models", "args", "launch")

# ALCF's MODEL_SIZE_KEY names -> zero-lab's presets
MODELS = {"GPT_TINY": "tiny", "GPT125M": "125M", "GPT350M": "355M", "GPT760M": "760M", "GPT774M": "774M",
          "GPT1_3B": "1.3B", "GPT1_5B": "1.5B", "GPT2_7B": "2.7B", "GPT6_7B": "6.7B", "GPT13B": "13B",
          "GPT25B": "25B", "GPT175B": "175B", "LLAMA_TINY": "llama-tiny", "LLAMA2_7B": "llama2-7b",
          "LLAMA2_13B": "llama2-13b", "LLAMA3_8B": "llama3-8b"}
# what Open MPI's mpiexec is told to pass on (-x): it forwards no variable it is not named
OPENMPI_FORWARDED = ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "VIRTUAL_ENV", "DS_ACCELERATOR", "OMP_NUM_THREADS",
                     "CUDA_DEVICE_MAX_CONNECTIONS", "IBV_FORK_SAFE", "MASTER_ADDR", "MASTER_PORT", "HF_HUB_OFFLINE")


def hosts_from_file(variable: str, path: str) -> list[str]:
    """A PBS node file (one line per MPI slot, hosts repeated) or an MPI hostfile (`host:N`, `host slots=N`)."""
    if not os.path.isfile(path):
        die(f"{variable}={path}: hostfile does not exist")
    hosts = []
    with open(path) as handle:
        for line in handle:
            words = line.split("#", 1)[0].split()
            host = words[0].split(":", 1)[0] if words else ""
            if host and host not in hosts:
                hosts.append(host)
    if not hosts:
        die(f"{variable}={path}: hostfile names no host")
    return hosts


def mpiexec_flavour(env: dict[str, str]) -> str:
    """openmpi, hydra or pals (Cray/HPE's, the default), from `mpiexec --version`."""
    banner = subprocess.run(["mpiexec", "--version"], capture_output=True, text=True, env=env)
    text = banner.stdout + banner.stderr
    if "open mpi" in text.lower() or "openrte" in text.lower():
        return "openmpi"
    return "hydra" if "HYDRA" in text else "pals"


class AlcfPlanner:
    def _setup(self, v: dict[str, str], launch_env: dict[str, str]) -> tuple[list[str], str | None, str, int]:
        """(hosts, the job's hostfile or None, accelerator, ranks per host)."""
        if "PBS_NODEFILE" in v:
            hostfile = v["PBS_NODEFILE"]
            hosts = hosts_from_file("PBS_NODEFILE", hostfile)
        elif "HOSTFILE" in v:
            hostfile = v["HOSTFILE"]
            hosts = hosts_from_file("HOSTFILE", hostfile)
        else:
            hostfile, hosts = None, [socket.gethostname()]
        gpus = visible_gpus(launch_env)
        accelerator = "cuda" if gpus > 0 else "cpu"
        check(v, "int", "NGPU_PER_HOST")
        per_host = int(v.get("NGPU_PER_HOST", gpus if gpus > 0 else 2))
        if accelerator == "cpu":
            launch_env["DS_ACCELERATOR"] = "cpu"
            # ranks on one host share its cores; without this each one starts a thread per core
            threads = len(os.sched_getaffinity(0)) // per_host
            launch_env["OMP_NUM_THREADS"] = v.get("OMP_NUM_THREADS", str(max(threads, 1)))
        launch_env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # kernels in issue order (Megatron's TP/SP overlap needs it)
        launch_env["IBV_FORK_SAFE"] = "1"  # data loader workers fork after InfiniBand is initialised
        print(f"[setup] hosts: {' '.join(hosts)} | NHOSTS={len(hosts)} NGPU_PER_HOST={per_host} "
              f"NGPUS={len(hosts) * per_host} accelerator={accelerator}", flush=True)
        return hosts, hostfile, accelerator, per_host

    @staticmethod
    def _model(v: dict[str, str], accelerator: str) -> str:
        key = v.setdefault("MODEL_SIZE_KEY", "GPT125M" if accelerator == "cuda" else "GPT_TINY")
        if key not in MODELS:
            die(f"MODEL_SIZE_KEY={key} is not a known model; valid keys: {', '.join(MODELS)}")
        preset = MODEL_PRESETS[MODELS[key]]
        print(f"[models] {key}: preset {MODELS[key]}, layers={preset['num_layers']} hidden={preset['hidden_size']} "
              f"heads={preset['num_attention_heads']}", flush=True)
        return MODELS[key]

    @staticmethod
    def _sequence_parallel(v: dict[str, str]) -> str:
        """SP_TYPE: Megatron's sequence parallelism (megatron, SP=1), DeepSpeed-Ulysses (deepspeed: SPSIZE ranks per
        sequence, the settings' SP_SIZE, docs/long-sequences.md) or none; the variable messages name."""
        check(v, "megatron|none|deepspeed", "SP_TYPE")
        check(v, "0|1|2|3", "ZERO_STAGE")
        sp_type = v.get("SP_TYPE")
        if sp_type in ("deepspeed", "none") and v.get("SP", "0") != "0":
            die(f"SP_TYPE={sp_type} and SP={v['SP']} disagree: set one of them")
        if sp_type == "megatron" and v.get("SP", "1") != "1":
            die(f"SP_TYPE=megatron and SP={v['SP']} disagree: set one of them")
        if sp_type:
            v["SP"] = "1" if sp_type == "megatron" else "0"
        return "SP_TYPE" if sp_type else "SP"

    def plan(self, env: dict[str, str], args: list[str], dry_run: bool, supervisor=None) -> Launch:
        python = python_of(env)
        v = read_layout_flags(given(env), args)  # a layout flag after the script counts as its variable
        launch_env = dict(env, PYTHON=python, PYTHONPATH=":".join([str(REPO), *filter(None, [env.get("PYTHONPATH")])]))
        hosts, hostfile, accelerator, per_host = self._setup(v, launch_env)
        world = len(hosts) * per_host
        # one host: MASTER_PORT, checked before anything starts, else a free port; several hosts: MASTER_PORT or the
        # ranks' default (megatron/runtime/dist_env.py)
        if len(hosts) == 1 and "MASTER_PORT" not in v:
            launch_env["MASTER_PORT"] = free_port()
        elif len(hosts) == 1 and not dry_run:
            check_port(v["MASTER_PORT"])
        model_size = self._model(v, accelerator)
        sp_variable = self._sequence_parallel(v)
        # with a DeepSpeed JSON of the user's (DS_CONFIG), the stage is the JSON's unless ZERO_STAGE is set
        zero_stage_set = "ZERO_STAGE" in v
        zero_stage = v.setdefault("ZERO_STAGE", "1")
        settings = training.training_settings(v, accelerator=accelerator, world=world, model_size=model_size,
                                              model_variable="MODEL_SIZE_KEY", alcf_names=True,
                                              sp_variable=sp_variable)
        s = settings.values
        json_stage = training.json_zero_stage(v["DS_CONFIG"]) if "DS_CONFIG" in v else None
        if zero_stage_set and json_stage is not None and str(json_stage) != zero_stage:
            die(f"ZERO_STAGE={zero_stage} and zero_optimization.stage {json_stage} in DS_CONFIG={v['DS_CONFIG']} "
                "disagree: set one of them (without ZERO_STAGE the JSON's stage is the run's)")
        run_dir, run_name = self._run_folder(v, s, zero_stage)
        user = env.get("USER") or pwd.getpwuid(os.getuid()).pw_name
        log = (f"{run_dir}/logs/{user}-{socket.gethostname()}-nhosts{len(hosts)}-ngpu{world}-"
               f"{time.strftime('%Y-%m-%d-%H%M%S')}.log")
        checkpoints = f"{run_dir}/checkpoints"
        launch_env["ZERO_LAB_FLAG_SOURCES"] = f"--zero-stage=ZERO_STAGE {settings.sources_text()}"
        megatron_args = [*settings.flags, "--save", checkpoints, "--tensorboard-dir", f"{run_dir}/tensorboard",
                         "--deepspeed", "--run-dir", run_dir,
                         "--exit-signal-handler"]  # PBS's SIGTERM at walltime or preemption: save, exit 0
        if "DS_CONFIG" not in v or zero_stage_set:
            megatron_args += ["--zero-stage", zero_stage]
        self._say_args(v, s, run_name, zero_stage, zero_stage_set, bool(v.get("PRECISION") or v.get("DTYPE")))

        # mpiexec needs a hostfile; without PBS_NODEFILE/HOSTFILE the run uses this host only
        job_hostfile = hostfile or f"{run_dir}/hostfile"
        if supervisor is not None:
            supervisor.take_lock(run_dir, ".zero-lab.lock")
        resume = resume_rule(run_dir, v.get("FRESH") == "1", dry_run, env)
        megatron_args += ["--load", checkpoints]
        prepare = [] if dry_run else [lambda: self._prepare(run_dir, hostfile, hosts, log, v)]
        if shutil.which("mpiexec", path=launch_env.get("PATH")) is None:
            die("mpiexec not found on PATH: load the MPI module (PBS clusters) or install MPICH "
                "(apt-get install mpich)")
        command = [*self._mpiexec(launch_env, world, per_host, job_hostfile), *v.get("MPIEXEC_EXTRA_ARGS", "").split(),
                   python, str(REPO / "pretrain_gpt.py"), *megatron_args, *args]
        print(f"[launch] {shlex.join(command)}", flush=True)
        return Launch(run_dir=run_dir, command=command, launcher="mpiexec", log=log, env=launch_env,
                      dry_run_line="[launch] DRY_RUN=1: not launching",
                      note=f"resuming from {resume}" if resume else "fresh start", prepare=prepare)

    @staticmethod
    def _run_folder(v: dict[str, str], s: dict[str, str], zero_stage: str) -> tuple[str, str]:
        """e.g. gpt_SP_actCkpt_GPT13B_z1_seqlen1024_mp8_pp1_sp1_nl40_hs5120_gb1_mb1 (ALCF Megatron-DeepSpeed's
        naming; gb/mb "ds" when DS_CONFIG's JSON gives the batch), under OUTPUT_ROOT (default <repo>/outputs)."""
        run_name = v.get("RUN_NAME")
        if run_name is None:
            preset = MODEL_PRESETS[MODELS[v["MODEL_SIZE_KEY"]]]
            run_name = (f"{v['MODEL_SIZE_KEY']}_z{zero_stage}_seqlen{s['SEQ_LEN']}_mp{s['TP']}_pp{s['PP']}"
                        f"_sp{s.get('SP_SIZE', '1')}{training.model_tags(s, MODELS[v['MODEL_SIZE_KEY']])}"
                        f"_nl{preset['num_layers']}_hs{preset['hidden_size']}"
                        f"_gb{s.get('GLOBAL_BATCH', 'ds')}_mb{s.get('MICRO_BATCH', 'ds')}")
            run_name = "actCkpt_" * (s["USE_ACTIVATION_CHECKPOINTING"] == "1") + run_name
            run_name = "gpt_" + "SP_" * (s["SP"] == "1") + run_name  # Megatron's sequence parallelism is on
        return os.path.realpath(os.path.join(v.get("OUTPUT_ROOT", str(REPO / "outputs")), run_name)), run_name

    @staticmethod
    def _say_args(v, s, run_name: str, zero_stage: str, zero_stage_set: bool, precision_given: bool) -> None:
        from_json = "DS_CONFIG" in v
        zero = "from DS_CONFIG" if from_json and not zero_stage_set else zero_stage
        batch = "batch from DS_CONFIG"
        if "GLOBAL_BATCH" in s and "MICRO_BATCH" in s:
            batch = f"global batch {s['GLOBAL_BATCH']} = micro {s['MICRO_BATCH']} x gas {s['GAS']} x dp {s['DPSIZE']}"
        elif "GLOBAL_BATCH" in s:
            batch = f"global batch {s['GLOBAL_BATCH']}, micro batch from DS_CONFIG"
        precision = "precision from DS_CONFIG" if from_json and not precision_given else s["PRECISION"]
        print(f"[args] run: {run_name} | mp={s['TP']} pp={s['PP']} | {batch} | zero {zero} | {precision}", flush=True)

    @staticmethod
    def _mpiexec(launch_env: dict[str, str], world: int, per_host: int, hostfile: str) -> list[str]:
        """PALS (Cray/HPE, ALCF) and Hydra (MPICH) take --ppn and --envall; Open MPI spells ranks per node -npernode
        and forwards only variables named with -x. Hydra's --verbose would copy every environment variable
        (tokens included) into the log, so only PALS gets it."""
        flavour = mpiexec_flavour(launch_env)
        if flavour == "openmpi":
            forwarded = [word for name in OPENMPI_FORWARDED if name in launch_env for word in ("-x", name)]
            return ["mpiexec", "--verbose", "-n", str(world), "-npernode", str(per_host), "--hostfile", hostfile,
                    *forwarded]
        verbose = ["--verbose"] * (flavour == "pals")
        return ["mpiexec", *verbose, "--envall", "-n", str(world), "--ppn", str(per_host), "--hostfile", hostfile]

    @staticmethod
    def _prepare(run_dir: str, hostfile: str | None, hosts: list[str], log: str, v: dict[str, str]) -> None:
        os.makedirs(f"{run_dir}/logs", exist_ok=True)
        if hostfile is None:
            with open(f"{run_dir}/hostfile", "w") as handle:
                handle.write("".join(f"{host}\n" for host in hosts))
        logfiles = v.get("LOGFILES", str(REPO / "logfiles"))
        with open(logfiles, "a") as handle:
            handle.write(log + "\n")
        print(f"[train-gpt3] log: {log}", flush=True)
        print(f"[train-gpt3] follow it with: tail -f $(tail -1 {logfiles})", flush=True)


def show(step: str, env: dict[str, str], args: list[str]) -> int:
    """What one step decides (ALCF/<step>.sh), from a dry plan: its lines only; a refusal as always."""
    said = io.StringIO()
    with contextlib.redirect_stdout(said), contextlib.redirect_stderr(io.StringIO()):
        AlcfPlanner().plan(dict(env, DRY_RUN="1"), args, dry_run=True)
    print("".join(line for line in said.getvalue().splitlines(keepends=True) if line.startswith(f"[{step}]")), end="")
    return 0
