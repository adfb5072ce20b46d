"""The launch cases whose dry-run command lines are kept as golden files (tests/golden/launch/<name>.txt).

Each case is one dry run of one launch path as a user starts it: a script, the environment variables the
user sets, the extra arguments. tests/golden/record_launch.py runs them with DRY_RUN=1 in a clean environment
(README.md says which) and writes, per case, the exit status and the command line, or for a refused setting
its one error line. The Python launch planner gives the same files from the same cases (README.md).

In env values, {tmp} is the case's own temporary folder (RUNS_DIR, OUTPUT_ROOT and LOGFILES are under it),
{repo} the repository and {fixtures} tests/golden/fixtures. A value of None unsets a variable the recorder
sets by default (CUDA_VISIBLE_DEVICES="" and DRY_RUN=1).
"""
from __future__ import annotations

from dataclasses import dataclass, field

DRIVERS = ("DP", "Z1", "Z2", "Z3", "Z3_OL", "Z3_NVMe")
ALCF = "ALCF/train-gpt3.sh"
SLURM = "examples_zero/slurm/train.sbatch"
# what test_slurm.py's two_node_allocation fakes: a 2-node x 4-task allocation, submitted from the repository
SLURM_ALLOCATION = dict(SLURM_JOB_ID="777", SLURM_NTASKS="8", SLURM_JOB_NUM_NODES="2", SLURM_NTASKS_PER_NODE="4",
                        SLURM_JOB_NODELIST="node[01-02]", SLURM_SUBMIT_DIR="{repo}")
TWO_HOSTS = dict(NNODES="2", MASTER_ADDR="10.0.0.1")


@dataclass(frozen=True)
class Case:
    name: str
    script: str  # relative to the repository; run as `bash <script> <args>` from the repository root
    env: dict[str, str | None] = field(default_factory=dict)
    args: tuple[str, ...] = ()
    error: bool = False  # a refused setting: the golden is the exit status and the error line
    gpus: int = 0  # > 0: torch and nvidia-smi see this many GPUs (stand-ins; the recorder's machine has none)
    mpi: str = "pals"  # the flavour `mpiexec --version` answers for ALCF/launch.sh: pals, hydra or openmpi
    checkpoint: str = ""  # a run folder under {tmp} that holds a committed checkpoint (global_step3) beforehand

    @property
    def path(self) -> str:
        """driver, alcf or slurm: the launch path the case runs."""
        if self.script == ALCF:
            return "alcf"
        return "slurm" if self.script == SLURM else "driver"


def driver(experiment: str) -> str:
    return f"examples_zero/gpt_deepspeed_{experiment}.sh"


Z1 = driver("Z1")

DRIVER_CASES = [
    # each driver at its CPU defaults: tiny on 2 CPU ranks through torchrun, seq 128, micro 4, 60 iterations, fp32
    *(Case(f"driver_{experiment}_defaults", driver(experiment)) for experiment in DRIVERS),
    # with GPUs: GPT-2 125M, seq 1024, micro 8, bf16, one epoch, every GPU through the deepspeed launcher
    Case("driver_Z1_gpu4_defaults", Z1, gpus=4),
    Case("driver_Z3_OL_gpu4_defaults", driver("Z3_OL"), gpus=4),
    Case("driver_Z2_gpu4_fp16", driver("Z2"), dict(PRECISION="fp16"), gpus=4),
    Case("driver_Z3_model_175B", driver("Z3"), dict(MODEL_SIZE="175B", NGPUS="1")),
    Case("driver_Z2_global_batch", driver("Z2"), dict(MICRO_BATCH="2", GLOBAL_BATCH="16")),  # accumulation 4
    Case("driver_Z2_gas", driver("Z2"), dict(GAS="3")),
    Case("driver_Z1_train_epochs", Z1, dict(TRAIN_EPOCHS="2")),
    Case("driver_Z1_bf16_seq_micro", Z1, dict(PRECISION="bf16", SEQ_LEN="256", MICRO_BATCH="2")),
    Case("driver_Z1_pp2", Z1, dict(PP="2", NGPUS="4")),
    # ALCF's names of the same settings, on a driver
    Case("driver_Z1_alcf_names", Z1, dict(MPSIZE="2", DTYPE="bf16", DATA_SPLIT="90,8,2", LR_WARMUP_FRAC="0.05")),
    # test_launch_settings.py's second settings case: everything at once
    Case("driver_Z1_tp_gas_sp_ckpt_bf16_epochs", Z1, dict(TP="2", GAS="2", SP="1", USE_ACTIVATION_CHECKPOINTING="1",
                                                          PRECISION="bf16", TRAIN_EPOCHS="1", MICRO_BATCH="2")),
    Case("driver_Z3_NVMe_nvme_path", driver("Z3_NVMe"), dict(OFFLOAD="nvme", NVME_PATH="{tmp}/nvme")),
    Case("driver_Z1_ds_config", Z1, dict(DS_CONFIG="{fixtures}/ds_config.json")),
    Case("driver_Z1_ds_config_and_variables", Z1,
         dict(DS_CONFIG="{fixtures}/ds_config.json", MICRO_BATCH="2", CLIP_GRAD="0.5", PRECISION="bf16")),
    Case("driver_Z1_init_hf", Z1, dict(INIT_HF="{fixtures}/hf_gpt2_tiny")),
    Case("driver_Z1_init_hf_resumes", Z1, dict(INIT_HF="{fixtures}/hf_gpt2_tiny"), checkpoint="runs/gpt_tiny_Z1"),
    # a transformers 4 style Llama config.json (top-level rope_theta 1e6, rms_norm_eps 1e-6): llama-tiny's shape
    Case("driver_Z1_init_hf_llama", Z1, dict(INIT_HF="{fixtures}/hf_llama_tiny")),
    Case("driver_Z1_launcher_deepspeed", Z1, dict(LAUNCHER="deepspeed")),
    Case("driver_Z1_launcher_mpiexec", Z1, dict(LAUNCHER="mpiexec", NGPUS="4")),
    # test_gpu_suite.py's Z3_OL line: CUDA_VISIBLE_DEVICES=4,5 gives the runner --include localhost:4,5, not
    # --num_gpus; --save '' after the run's own (the suite's dry run keeps no checkpoint)
    Case("driver_Z3_OL_gpu2_visible_gpus", driver("Z3_OL"), dict(CUDA_VISIBLE_DEVICES="4,5"), ("--save", ""),
         gpus=2),
    Case("driver_Z1_two_hosts_rank0", Z1, dict(TWO_HOSTS, NODE_RANK="0")),
    Case("driver_Z1_two_hosts_rank1", Z1, dict(TWO_HOSTS, NODE_RANK="1")),
    Case("driver_Z1_two_hosts_wait_port", Z1, dict(TWO_HOSTS, NODE_RANK="0", HOST_WAIT_SECONDS="120",
                                                   MASTER_PORT="29700", MAX_RESTARTS="2")),
    # what the planner's supervisor plans again when the other hosts did not come back: host 0 alone, the global
    # batch kept, through the universal checkpoint
    Case("driver_Z1_restart_host0_alone", Z1, dict(NNODES="1", GAS="", GLOBAL_BATCH="16", MAX_RESTARTS="2", FRESH="0"),
         ("--universal-checkpoint",), checkpoint="runs/gpt_tiny_Z1"),
    Case("driver_Z1_resumes", Z1, checkpoint="runs/gpt_tiny_Z1"),
    Case("driver_Z1_fresh", Z1, dict(FRESH="1"), checkpoint="runs/gpt_tiny_Z1"),
    Case("driver_Z1_run_name_and_args", Z1, dict(RUN_NAME="my_run"), ("--seed", "7", "--eval-iters", "0")),
    Case("driver_Z1_optimizer_data_logging", Z1,
         dict(LR="1e-3", MIN_LR="1e-5", LR_DECAY_STYLE="linear", LR_WARMUP_FRACTION="0.1", ADAM_BETA1="0.8",
              ADAM_BETA2="0.99", WEIGHT_DECAY="0.01", CLIP_GRAD="2.0", SEED="42", LOG_INTERVAL="1",
              EVAL_INTERVAL="10", EVAL_ITERS="2", SAVE_INTERVAL="20", DISTRIBUTED_TIMEOUT_MINUTES="30",
              WANDB_PROJECT="zl-runs", TRAIN_ITERS="7", SPLIT="98,1,1")),
    Case("driver_Z1_data_blend", Z1, dict(DATA_PATH="0.3 {tmp}/data/a_text_document 0.7 {tmp}/data/b_text_document",
                                          VOCAB_FILE="{tmp}/data/vocab.json", MERGE_FILE="{tmp}/data/merges.txt")),
]

DRIVER_ERRORS = [
    Case("driver_error_ngpus_0", Z1, dict(NGPUS="0"), error=True),
    Case("driver_error_micro_batch", Z1, dict(MICRO_BATCH="x"), error=True),
    Case("driver_error_global_batch_not_divisible", Z1, dict(GLOBAL_BATCH="12"), error=True),
    Case("driver_error_zero_stage", Z1, dict(ZERO_STAGE="3"), error=True),
    Case("driver_error_offload", driver("Z3"), dict(OFFLOAD="1"), error=True),
    Case("driver_error_launcher", Z1, dict(LAUNCHER="mpirun"), error=True),
    Case("driver_error_node_rank", Z1, dict(TWO_HOSTS, NODE_RANK="2"), error=True),
    Case("driver_error_two_hosts_no_master", Z1, dict(NNODES="2", NODE_RANK="1"), error=True),
    Case("driver_error_srun_outside_slurm", Z1, dict(LAUNCHER="srun"), error=True),
    Case("driver_error_model_size", Z1, dict(MODEL_SIZE="7B"), error=True),
    Case("driver_error_fp16_on_cpu", Z1, dict(PRECISION="fp16"), error=True),
    Case("driver_error_iters_and_epochs", Z1, dict(TRAIN_ITERS="3", TRAIN_EPOCHS="1"), error=True),
    Case("driver_error_ds_config_optimizer", Z1, dict(DS_CONFIG="{fixtures}/ds_config_optimizer.json"), error=True),
    Case("driver_error_ds_config_stage", driver("Z2"), dict(DS_CONFIG="{fixtures}/ds_config.json"), error=True),
    Case("driver_error_init_hf_not_a_model", Z1, dict(INIT_HF="{tmp}"), error=True),
]

ALCF_CASES = [
    Case("alcf_cpu_defaults", ALCF),
    Case("alcf_gpu4_two_hosts_defaults", ALCF, dict(PBS_NODEFILE="{fixtures}/pbs_nodefile"), gpus=4),
    # ALCF/README.md's example and test_alcf.py's 2-host x 4-GPU PBS job
    Case("alcf_gpt13b_sp_act_ckpt", ALCF, dict(PBS_NODEFILE="{fixtures}/pbs_nodefile", MODEL_SIZE_KEY="GPT13B",
                                               MPSIZE="8", SEQ_LEN="1024", MICRO_BATCH="1", SP_TYPE="megatron",
                                               ZERO_STAGE="1", USE_ACTIVATION_CHECKPOINTING="1"), gpus=4),
    Case("alcf_gpt1_5b_gas_zero3", ALCF, dict(PBS_NODEFILE="{fixtures}/pbs_nodefile", MODEL_SIZE_KEY="GPT1_5B",
                                              SEQ_LEN="1024", MICRO_BATCH="2", GAS="4", MPSIZE="2",
                                              SP_TYPE="megatron", USE_ACTIVATION_CHECKPOINTING="0", ZERO_STAGE="3"),
         gpus=4),
    Case("alcf_hostfile_visible_gpus_extra_args", ALCF,
         dict(HOSTFILE="{fixtures}/mpi_hostfile", CUDA_VISIBLE_DEVICES="0,1", MODEL_SIZE_KEY="GPT125M",
              SP_TYPE="none", GLOBAL_BATCH="12", MICRO_BATCH="2", MPIEXEC_EXTRA_ARGS="--cpu-bind depth -d 16"),
         ("--eval-iters", "0"), gpus=4),
    Case("alcf_hydra", ALCF, dict(NGPU_PER_HOST="4"), mpi="hydra"),
    Case("alcf_openmpi", ALCF, dict(MASTER_PORT="29612"), mpi="openmpi"),
    Case("alcf_ds_config", ALCF, dict(DS_CONFIG="{fixtures}/ds_config.json")),
    Case("alcf_ds_config_zero_stage", ALCF, dict(DS_CONFIG="{fixtures}/ds_config.json", ZERO_STAGE="1")),
    Case("alcf_megatron_names_epochs", ALCF, dict(TP="2", SP="1", PRECISION="bf16", TRAIN_EPOCHS="1",
                                                  SPLIT="98,1,1", NGPU_PER_HOST="4")),
    Case("alcf_pp2_zero0", ALCF, dict(PPSIZE="2", ZERO_STAGE="0", MODEL_SIZE_KEY="GPT125M", GLOBAL_BATCH="8")),
    Case("alcf_fresh_run_name", ALCF, dict(FRESH="1", RUN_NAME="my_alcf_run"), checkpoint="outputs/my_alcf_run"),
]

ALCF_ERRORS = [
    Case("alcf_error_model_size_key", ALCF, dict(MODEL_SIZE_KEY="GPT7B"), error=True),
    Case("alcf_error_sp_type_deepspeed", ALCF, dict(SP_TYPE="deepspeed", SP="1"), error=True),
    Case("alcf_error_zero_stage", ALCF, dict(ZERO_STAGE="4"), error=True),
    # the JSON's zero_optimization.stage is 1 (recorded from bash as a command that pretrain_gpt.py then refused)
    Case("alcf_error_ds_config_zero_stage", ALCF, dict(DS_CONFIG="{fixtures}/ds_config.json", ZERO_STAGE="2"),
         error=True),
    Case("alcf_error_ngpu_per_host", ALCF, dict(NGPU_PER_HOST="0"), error=True),
    Case("alcf_error_no_hostfile", ALCF, dict(HOSTFILE="{tmp}/no_hostfile"), error=True),
    Case("alcf_error_global_batch_not_divisible", ALCF, dict(GLOBAL_BATCH="6"), error=True),
]

SLURM_CASES = [
    Case("slurm_default_Z1", SLURM, SLURM_ALLOCATION),
    Case("slurm_Z3_extra_args", SLURM, dict(SLURM_ALLOCATION, EXPERIMENT="Z3"), ("--seed", "7")),
    Case("slurm_cpus_per_task", SLURM, dict(SLURM_ALLOCATION, SLURM_CPUS_PER_TASK="8", EXPERIMENT="Z2")),
    Case("slurm_gpu4_Z3_OL", SLURM, dict(SLURM_ALLOCATION, EXPERIMENT="Z3_OL"), gpus=4),
    # a requeued job (SLURM_RESTART_COUNT > 0) resumes what it saved although the job was submitted with FRESH=1
    Case("slurm_requeue_resumes", SLURM, dict(SLURM_ALLOCATION, SLURM_RESTART_COUNT="1", FRESH="1", MAX_RESTARTS="1"),
         checkpoint="runs/gpt_tiny_Z1"),
    Case("slurm_error_no_job", SLURM, dict(EXPERIMENT="Z1"), error=True),
    Case("slurm_error_experiment", SLURM, dict(SLURM_ALLOCATION, EXPERIMENT="Z9"), error=True),
    Case("slurm_error_driver_variable", SLURM, dict(SLURM_ALLOCATION, MICRO_BATCH="0"), error=True),
]

CASES = [*DRIVER_CASES, *DRIVER_ERRORS, *ALCF_CASES, *ALCF_ERRORS, *SLURM_CASES]
