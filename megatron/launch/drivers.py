"""The examples_zero drivers' launch path: one experiment (a ZeRO stage and an offload) on this host's ranks,
through torchrun (default on CPU ranks), DeepSpeed's launcher (default with GPUs), mpiexec, or srun inside a Slurm
allocation; several hosts by NNODES, NODE_RANK and MASTER_ADDR with torchrun. docs/environment.md lists the
variables.

Defaults: GPT-2 125M, seq 1024, bf16 on every visible GPU; without a GPU the tiny preset on 2 CPU ranks, fp32, a
few minutes per driver. The run folder is RUNS_DIR/RUN_NAME (default runs/gpt_<model>_<experiment>[_tpN_ppN_sp_ulyssesN_moeN_epN_rotary]: a run of
another model or layout does not resume the preset's own folder);
host 0 owns it (the resume rule, train.log, command.txt), host k writes train.nodek.log beside them.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass

from megatron.launch import settings as training
from megatron.launch.given_flags import read_layout_flags
from megatron.launch.plan import (REPO, Launch, check_port, die, free_port, given, gpu_memory_bytes, python_of,
                                  resume_rule, visible_gpus)
from megatron.launch.settings import check
from megatron.model.presets import MODEL_PRESETS

# examples_zero/gpt_deepspeed_<experiment>.sh -> (its ZeRO stage, its OFFLOAD: 0 none, 1 optimizer states and
# parameters in CPU memory, nvme in files under NVME_PATH, ZeRO-Infinity)
EXPERIMENTS = {"DP": (0, "0"), "Z1": (1, "0"), "Z2": (2, "0"), "Z3": (3, "0"), "Z3_OL": (3, "1"),
               "Z3_NVMe": (3, "nvme")}


@dataclass
class HFInit:
    """INIT_HF's model: the MODEL_SIZE preset of its architecture (None: none is; its flags give the shape), its
    positions, and the flags of its shape, rope theta and norms' epsilon (megatron/inference/hf_flags.py)."""
    preset: str | None
    positions: str
    flags: list[str]


def read_init_hf(init_hf: str, model_size: str | None, python: str, env: dict[str, str]) -> HFInit:
    """INIT_HF=<Hugging Face GPT-2 or Llama folder>, read through transformers' config class by the ranks' Python
    (transformers imports torch, which this process does not: about 4 s of CPU, only with INIT_HF)."""
    if not os.path.isfile(os.path.join(init_hf, "config.json")):
        die(f"INIT_HF={init_hf}: not a Hugging Face model folder (no config.json)")
    run = subprocess.run([python, "-m", "megatron.inference.hf_flags", init_hf, *filter(None, [model_size])],
                         env=env, capture_output=True, text=True)
    if run.returncode != 0:
        lines = run.stderr.strip().splitlines() or [f"error: INIT_HF={init_hf}: cannot read its config.json"]
        die(lines[-1].removeprefix("error: "))
    read = json.loads(run.stdout.strip().splitlines()[-1])
    if model_size and read["preset"] != model_size:
        if read["preset"] or not read["differs"]:
            die(f"INIT_HF={init_hf} is a {read['preset'] or 'custom-shaped'} model but MODEL_SIZE={model_size}")
        die(f"INIT_HF={init_hf} is not a MODEL_SIZE={model_size} model: its {', '.join(read['differs'])}; leave "
            "MODEL_SIZE out, INIT_HF's config.json gives the shape")
    return HFInit(preset=read["preset"], positions=str(read["positions"]), flags=read["flags"])


class DriverPlanner:
    def __init__(self, experiment: str):
        self.experiment = experiment
        self.stage, self.offload = EXPERIMENTS[experiment]

    def _fixed(self, v: dict[str, str]) -> None:
        """Each driver is one experiment: a ZERO_STAGE or OFFLOAD other than its own is refused."""
        script = f"gpt_deepspeed_{self.experiment}.sh"
        given = v.get("ZERO_STAGE", str(self.stage))
        if given not in ("0", "1", "2", "3"):
            die(f"ZERO_STAGE={given}: ZeRO has stages 0 to 3 only; leave ZERO_STAGE unset ({script} runs stage "
                f"{self.stage}), or run the driver of the stage you want (gpt_deepspeed_DP.sh, _Z1, _Z2, _Z3)")
        if given != str(self.stage):
            die(f"ZERO_STAGE={v['ZERO_STAGE']}: {script} runs ZeRO stage {self.stage} (each driver is one experiment: "
                "gpt_deepspeed_DP.sh, _Z1, _Z2 and _Z3 run stages 0 to 3): run that stage's driver, or leave "
                "ZERO_STAGE unset")
        if v.get("OFFLOAD", self.offload) != self.offload:
            die(f"OFFLOAD={v['OFFLOAD']}: {script} runs with OFFLOAD={self.offload} (each driver is one experiment: "
                "gpt_deepspeed_Z3_OL.sh offloads to CPU memory, OFFLOAD=1; gpt_deepspeed_Z3_NVMe.sh to NVMe, "
                "OFFLOAD=nvme; the others offload nothing): run that driver, or leave OFFLOAD unset")
        v["ZERO_STAGE"], v["OFFLOAD"] = str(self.stage), self.offload

    def _json_stage(self, path: str) -> None:
        """A user's DeepSpeed JSON that asks for another ZeRO stage than this driver's, refused before anything is
        written, naming the driver of that stage."""
        stage = training.json_zero_stage(path)
        if stage is None or stage == self.stage:
            return
        driver = {0: "DP", 1: "Z1", 2: "Z2", 3: "Z3"}.get(stage)
        hint = f"run gpt_deepspeed_{driver}.sh, whose stage it is" if driver else "ZeRO's stages are 0 to 3"
        die(f"DS_CONFIG={path} asks for ZeRO stage {stage} (zero_optimization.stage) but "
            f"gpt_deepspeed_{self.experiment}.sh runs stage {self.stage}: {hint}, or leave the stage out of the JSON")

    def plan(self, env: dict[str, str], args: list[str], dry_run: bool, supervisor=None) -> Launch:
        python = python_of(env)
        v = read_layout_flags(given(env), args)  # a layout flag after the driver counts as its variable
        launch_env = dict(env, PYTHON=python, PYTHONPATH=":".join([str(REPO), *filter(None, [env.get("PYTHONPATH")])]))
        # This Python's tools first: torch builds DeepSpeed's C++ ops with the first `ninja` on PATH, and two
        # different ninjas (a venv's and the system's) invalidate each other's builds on every start.
        launch_env["PATH"] = f"{os.path.dirname(python)}:{env.get('PATH', os.defpath)}"
        hf = read_init_hf(v["INIT_HF"], v.get("MODEL_SIZE"), python, launch_env) if "INIT_HF" in v else None
        if hf is not None and hf.preset is not None:
            v["MODEL_SIZE"] = hf.preset
        accelerator, include = self._ranks(v, env, launch_env)
        launcher, ngpus, nnodes, node_rank = v["LAUNCHER"], int(v["NGPUS"]), int(v["NNODES"]), int(v["NODE_RANK"])
        # INIT_HF of no preset's architecture: its flags give the shape, its folder names the run
        model_size = None if hf is not None and hf.preset is None else v["MODEL_SIZE"]
        # srun's and mpiexec's NGPUS count every rank of the job; NNODES is 1 there
        settings = self._settings(v, args, accelerator, ngpus * nnodes, model_size, hf, python, launch_env)
        s = settings.values
        if "DS_CONFIG" in v:
            self._json_stage(v["DS_CONFIG"])
        # one host: MASTER_PORT, checked before anything starts, else a free port (torchrun: --standalone); the
        # hosts of a multi-host run must agree on a port: MASTER_PORT, else 29500 (srun: the job id's)
        single_host = nnodes == 1 and launcher != "srun"
        port = v.get("MASTER_PORT") or (None if single_host else "29500")
        if port is None and launcher != "torchrun":
            port = free_port()
        elif single_host and port is not None and not dry_run:
            check_port(port)

        tag = "".join([f"_tp{s['TP']}" * (s["TP"] != "1"), f"_pp{s['PP']}" * (s["PP"] != "1"),
                       "_sp" * (s["SP"] == "1"), f"_ulysses{s.get('SP_SIZE')}" * (s.get("SP_SIZE", "1") != "1"),
                       training.model_tags(s, model_size)])
        model_name = model_size or os.path.basename(v["INIT_HF"].rstrip("/"))
        run_name = v.get("RUN_NAME", f"gpt_{model_name}_{self.experiment}{tag}")
        run_dir = os.path.realpath(os.path.join(v.get("RUNS_DIR", str(REPO / "runs")), run_name))
        prepare = []
        if not dry_run:
            prepare.append(lambda: self._make_dolly(s, python, launch_env))
        print(f"[examples_zero] {run_name} -> {run_dir}", flush=True)
        # one launch per run folder (host k of a torchrun run: one per host); host k asks the same resume rule
        # without acting on it (host 0 moves and converts; the folder is shared): both hosts pass the same --load
        lock_name = f".zero-lab.node{node_rank}.lock" if node_rank > 0 else ".zero-lab.lock"
        if supervisor is not None:
            supervisor.take_lock(run_dir, lock_name)
        resume = resume_rule(run_dir, v.get("FRESH") == "1", dry_run or node_rank > 0, env)
        load_flags = self._load_flags(v, run_dir, resume, hf)
        init_dir = load_flags[load_flags.index("--load") + 1]
        if not dry_run and node_rank == 0 and "--finetune" in load_flags and not os.path.isfile(f"{init_dir}/latest"):
            prepare.append(lambda: self._convert_hf(python, v["INIT_HF"], init_dir, launch_env))
        offload_flags = self._offload_flags(v.get("NVME_PATH", f"{run_dir}/nvme"))

        command = [*self._launcher(v, launcher, ngpus, python, port, include, run_name, launch_env),
                   str(REPO / "pretrain_gpt.py"), *settings.flags, "--zero-stage", str(self.stage), *offload_flags,
                   "--save", f"{run_dir}/checkpoints", *load_flags,
                   "--tensorboard-dir", f"{run_dir}/tensorboard", "--run-dir", run_dir,
                   "--exit-signal-handler", *args]  # SIGTERM (preemption): save this iteration, exit 0
        # an error about one of these flags names the variable it came from (megatron/flag_sources.py)
        hf_sources = "".join(f" {flag}=INIT_HF" for flag in (hf.flags if hf else []) if flag.startswith("--"))
        launch_env["ZERO_LAB_FLAG_SOURCES"] = f"--zero-nvme-path=NVME_PATH {settings.sources_text()}{hf_sources}"
        note = f"resuming from {resume}" if resume else "fresh start"
        node = None
        log = f"{run_dir}/train.log"
        if node_rank > 0:  # host k's ranks: their output beside host 0's (which holds the run's log)
            note, node = f"host {node_rank} of {nnodes}", f"node{node_rank}"
            log = f"{run_dir}/train.node{node_rank}.log"
        alone = None
        if nnodes > 1 and node_rank == 0:  # the other hosts gone for good: host 0 goes on with its own ranks
            alone = dict(NNODES="1", GAS="", GLOBAL_BATCH=s.get("GLOBAL_BATCH", ""), NGPUS=str(ngpus))
        return Launch(run_dir=run_dir, command=command, launcher=launcher, log=log, env=launch_env,
                      dry_run_line=f"[examples_zero] DRY_RUN=1, not starting: {shlex.join(command)}", note=note,
                      node=node, alone=alone, prepare=prepare)

    def _offload_flags(self, nvme_path: str) -> list[str]:
        return {"0": [], "1": ["--zero-offload-optimizer", "--zero-offload-params"],
                "nvme": ["--zero-nvme-path", nvme_path]}[self.offload]

    def _settings(self, v: dict[str, str], args: list[str], accelerator: str, world: int, model_size: str | None,
                  hf: HFInit | None, python: str, launch_env: dict[str, str]) -> training.TrainingSettings:
        """The training settings. On GPUs, where neither MICRO_BATCH, a DS_CONFIG's micro-batch nor a
        --micro-batch-size after the driver gives it, the micro-batch is the largest the memory model predicts
        fits the GPU (megatron/launch/micro_batch.py, run in the ranks' Python), said in one line (docs/gpu.md)."""
        def settings(micro_batch: str | None = None) -> training.TrainingSettings:
            return training.training_settings(v, accelerator=accelerator, world=world, model_size=model_size,
                                              model_variable="MODEL_SIZE", micro_batch=micro_batch)

        given_after = any(arg.partition("=")[0] == "--micro-batch-size" for arg in args)
        if accelerator != "cuda" or "MICRO_BATCH" in v or given_after:
            return settings()
        first = settings(micro_batch="1")  # every GLOBAL_BATCH the data-parallel size divides is taken at 1
        if "--micro-batch-size" not in first.flags:  # DS_CONFIG gives it
            return first
        memory = gpu_memory_bytes(v)
        if memory is None:
            chosen = settings()
            print(f"[examples_zero] micro-batch {chosen.values['MICRO_BATCH']}, the GPU default: nvidia-smi gave no "
                  "GPU memory to plan it with; MICRO_BATCH sets it", flush=True)
            return chosen
        flags = [*first.flags, "--zero-stage", str(self.stage), *self._offload_flags("nvme"),
                 *(hf.flags if hf else []), *args]
        run = subprocess.run([python, "-m", "megatron.launch.micro_batch", str(world), str(memory),
                              v.get("GLOBAL_BATCH", "-"), "--", *flags], env=launch_env, capture_output=True, text=True)
        if run.returncode != 0:
            lines = run.stderr.strip().splitlines() or ["the memory plan of the micro-batch failed"]
            die(f"{lines[-1].removeprefix('error: ')} (planning the micro-batch: set MICRO_BATCH to skip it)")
        planned = json.loads(run.stdout.strip().splitlines()[-1])
        print(f"[examples_zero] {planned['line']}", flush=True)
        return settings(micro_batch=str(planned["micro_batch"]))

    def _ranks(self, v: dict[str, str], env: dict[str, str], launch_env: dict[str, str]) -> tuple[str, str]:
        """The launcher, the ranks and hosts, the accelerator and the model, checked, with their defaults in `v`:
        (the accelerator, the deepspeed launcher's --include or "")."""
        check(v, "torchrun|deepspeed|mpiexec|srun", "LAUNCHER")
        check(v, "int", "NGPUS", "NNODES", "HOST_WAIT_SECONDS")
        check(v, "count", "NODE_RANK")
        self._fixed(v)
        if v.get("LAUNCHER") == "srun" and "SLURM_NTASKS" in v:
            v.setdefault("NGPUS", v["SLURM_NTASKS"])
        gpus = visible_gpus(env)
        if gpus > 0:
            accelerator = "cuda"
            v.setdefault("MODEL_SIZE", "125M"), v.setdefault("NGPUS", str(gpus)), v.setdefault("LAUNCHER", "deepspeed")
        else:
            accelerator = "cpu"
            launch_env["DS_ACCELERATOR"] = v.setdefault("DS_ACCELERATOR", "cpu")
            v.setdefault("MODEL_SIZE", "tiny"), v.setdefault("NGPUS", "2"), v.setdefault("LAUNCHER", "torchrun")
        launcher, ngpus = v["LAUNCHER"], int(v["NGPUS"])
        if launcher == "srun" and "SLURM_JOB_ID" not in v:
            die("LAUNCHER=srun: not inside a Slurm allocation (no SLURM_JOB_ID): use sbatch or salloc")
        include = self._deepspeed_include(v, launcher, ngpus)
        nnodes, node_rank = int(v.setdefault("NNODES", "1")), int(v.setdefault("NODE_RANK", "0"))
        if node_rank >= nnodes:
            die(f"NODE_RANK={node_rank}: expected 0 to NNODES-1 ({nnodes - 1})")
        if nnodes > 1 and launcher != "torchrun":
            die(f"NNODES={nnodes}: several hosts by NNODES take LAUNCHER=torchrun; srun and mpiexec (ALCF/) start "
                "the ranks of every host themselves")
        if nnodes > 1 and "MASTER_ADDR" not in v:
            die(f"NNODES={nnodes}: set MASTER_ADDR to the first host (NODE_RANK 0), the same on every host")
        if v["MODEL_SIZE"] not in MODEL_PRESETS:
            die(f"MODEL_SIZE={v['MODEL_SIZE']}: expected a preset ({', '.join(MODEL_PRESETS)})")
        return accelerator, include

    @staticmethod
    def _load_flags(v: dict[str, str], run_dir: str, resume: str | None, hf: HFInit | None) -> list[str]:
        """--load always, as Megatron's scripts pass it: pretrain_gpt.py resumes what <run>/checkpoints holds then.
        INIT_HF is converted once into the run folder, then loaded with --finetune (iteration and optimizer start
        afresh); its positions (GPT-2's table) replace --max-position-embeddings SEQ_LEN, and its shape, rope theta
        and norms' epsilon are passed as flags, those of a resumed run too (which loads its own checkpoint)."""
        if "INIT_HF" not in v:
            return ["--load", f"{run_dir}/checkpoints"]
        model = ["--max-position-embeddings", hf.positions, *hf.flags]
        if resume is not None:
            return [*model, "--load", f"{run_dir}/checkpoints"]
        init_dir = f"{run_dir}/hf_init_{os.path.basename(v['INIT_HF'].rstrip('/'))}"
        return [*model, "--load", init_dir, "--finetune"]

    @staticmethod
    def _deepspeed_include(v: dict[str, str], launcher: str, ngpus: int) -> str:
        """CUDA_VISIBLE_DEVICES=4,5 under the deepspeed launcher: its --num_gpus would re-export 0..N-1 (GPUs 0
        and 1); --include names the GPUs themselves, the first NGPUS of those visible."""
        visible = v.get("CUDA_VISIBLE_DEVICES", "")
        if launcher != "deepspeed" or not visible:
            return ""
        gpus = visible.split(",")
        if not all(gpu.isdigit() for gpu in gpus):
            die(f"CUDA_VISIBLE_DEVICES={visible}: the deepspeed launcher takes GPU indices (e.g. 4,5); use "
                "LAUNCHER=torchrun, which keeps it as it is")
        if ngpus > len(gpus):
            die(f"NGPUS={ngpus}: more than the {len(gpus)} GPUs CUDA_VISIBLE_DEVICES={visible} makes visible")
        return "localhost:" + ",".join(gpus[:ngpus])

    @staticmethod
    def _launcher(v: dict[str, str], launcher: str, ngpus: int, python: str, port: str | None, include: str,
                  run_name: str, launch_env: dict[str, str]) -> list[str]:
        if launcher == "torchrun":
            if v["NNODES"] == "1":
                where = ["--standalone"] if port is None else ["--master_port", port]
                return [python, "-m", "torch.distributed.run", "--nproc_per_node", str(ngpus), *where]
            # c10d rendezvous at MASTER_ADDR; host 0 holds the store (is_host: a host whose own name resolves to
            # 127.0.1.1 would not know MASTER_ADDR as its own); the hosts wait HOST_WAIT_SECONDS for each other
            # there (torchrun's join_timeout), then give up
            return [python, "-m", "torch.distributed.run", "--nproc_per_node", str(ngpus), "--nnodes", v["NNODES"],
                    "--node_rank", v["NODE_RANK"], "--rdzv_backend", "c10d", "--rdzv_id", run_name,
                    "--rdzv_endpoint", f"{v['MASTER_ADDR']}:{port}", "--rdzv_conf",
                    f"is_host={int(v['NODE_RANK'] == '0')},join_timeout={v.get('HOST_WAIT_SECONDS', '600')}"]
        if launcher == "deepspeed":
            gpus = ["--include", include] if include else ["--num_gpus", str(ngpus)]
            return [python, "-m", "deepspeed.launcher.runner", *gpus, "--master_port", port]
        if launcher == "srun":
            # each task finds its rank and the rendezvous in SLURM_* (megatron/runtime/dist_env.py); one OpenMP
            # thread per CPU of the task. srun is given the job's --cpus-per-task itself: since Slurm 22.05 it no
            # longer takes it from the job (only from SRUN_CPUS_PER_TASK), and would bind each task to one CPU.
            cpus = v.get("SLURM_CPUS_PER_TASK")
            launch_env["OMP_NUM_THREADS"] = v.get("OMP_NUM_THREADS", cpus or "1")
            return ["srun", "--ntasks", str(ngpus), *(["--cpus-per-task", cpus] if cpus else []),
                    "--kill-on-bad-exit=1", python]
        # mpiexec (MPICH's Hydra, PALS or Open MPI) on this host: each rank finds its rank in the MPI variables and
        # MASTER_PORT in the environment mpiexec passes on; one OpenMP thread per rank, as torchrun sets. (srun's
        # ranks take their port from the job id unless MASTER_PORT is set: two jobs on one node do not meet.)
        launch_env["MASTER_PORT"] = port
        launch_env["OMP_NUM_THREADS"] = v.get("OMP_NUM_THREADS", "1")
        return ["mpiexec", "-n", str(ngpus), python]

    @staticmethod
    def _make_dolly(s: dict[str, str], python: str, launch_env: dict[str, str]) -> None:
        """The default dataset is made on first use; any other DATA_PATH is checked by pretrain_gpt.py."""
        prefix = f"{s['DATA_DIR']}/dolly_text_document"
        if s["DATA_PATH"] != prefix or (os.path.isfile(f"{prefix}.bin") and os.path.isfile(f"{prefix}.idx")):
            return
        print(f"[examples_zero] {prefix}.bin missing: running tools/process_databricks_gpt2.sh", flush=True)
        status = subprocess.run(["bash", str(REPO / "tools" / "process_databricks_gpt2.sh")],
                                env=dict(launch_env, DATA_DIR=s["DATA_DIR"], PYTHON=python)).returncode
        if status != 0:
            sys.exit(status)

    @staticmethod
    def _convert_hf(python: str, init_hf: str, init_dir: str, launch_env: dict[str, str]) -> None:
        status = subprocess.run([python, str(REPO / "tools" / "hf_to_checkpoint.py"), "--hf", init_hf,
                                 "--save", init_dir], env=launch_env).returncode
        if status != 0:
            sys.exit(1)
