"""Megatron-DeepSpeed command-line flags, parsed once into typed, validated sections.

`parse_args(argv, world_size)` is the only entry point: argparse reads the flags (and a
--deepspeed_config JSON, merged with them by megatron/deepspeed_json.py), each section's
__post_init__ checks what it can see alone, and `check_support` checks the combinations against
one table. Every error is a `ConfigError` naming the flag to change. Nothing here opens the run's
files: the data, the tokenizer, the output folders and a checkpoint to resume are checked after
parsing, by megatron/startup.py (which also fills in the padded vocabulary from the tokenizer).
"""
import argparse
import types
import typing
from dataclasses import MISSING as NO_DEFAULT
from dataclasses import Field, dataclass, field, fields

import deepspeed
import torch

from megatron.batch_rampup import BatchRamp, BatchRampError
from megatron.core.parallel_state import ParallelLayout
from megatron.curriculum import FLAG as CURRICULUM_FLAG
from megatron.curriculum import CurriculumConfig, CurriculumError, read_curriculum
from megatron.deepspeed_json import (
    MISSING,
    DeepSpeedJSONError,
    merge_flags,
    read_deepspeed_json,
    refuse_unused_sections,
)
from megatron.errors import ZeroLabError
from megatron.layout_check import BatchError, batch_split, moe_problems, ulysses_problems
from megatron.model.config import GPTConfig, parallel_shape_problems
from megatron.model.presets import LLAMA_FLAGS, MODEL_PRESETS, SHAPE_FLAGS, PresetError, preset_fields
from megatron.tokenizer import TokenizerConfig
from megatron.upstream_flags import (RECOMPUTE_NUM_LAYERS, accepted_lines, add_upstream_flags, recompute_layers,
                                     refused_message)

PARAMS_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Megatron-DeepSpeed's --data-impl values: zero-lab reads the mmap indexed format, the one both name
DATA_IMPLS = ("mmap", "infer")


class ConfigError(ZeroLabError, ValueError):
    """A bad flag or flag combination; the message names the flag and what was expected."""


def _require(condition, message):
    if not condition:
        raise ConfigError(message)


def flag(default=NO_DEFAULT, help=None, *, names=(), from_json=False, **kwargs) -> Field:
    """A section's field that is also a pretrain_gpt.py flag: its default is written here once and build_parser
    makes the argparse argument from the field (the flag is --field-name unless `names` says otherwise; help
    may say {default}). from_json: the flag's own default is None, as a --deepspeed_config JSON may give the
    value (megatron/deepspeed_json.py); the field's default applies where neither does."""
    return field(default=default, metadata=dict(flag=True, help=help, names=names, from_json=from_json), **kwargs)


@dataclass
class ParallelArgs:
    """The parallel layout (built and checked once, here), Megatron's --sequence-parallel, and how long a
    collective may wait before the run ends (--distributed-timeout-minutes: a lost host ends the job)."""
    layout: ParallelLayout
    sequence_parallel: bool = flag(False)
    distributed_timeout_minutes: float = flag(
        10.0, "a collective that waits longer ends the run (a lost host); Megatron's default, {default:g}")

    def __post_init__(self):
        _require(self.distributed_timeout_minutes > 0,
                 f"--distributed-timeout-minutes must be > 0, got {self.distributed_timeout_minutes}")

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def tensor_model_parallel_size(self) -> int:
        return self.layout.tensor_model_parallel_size

    @property
    def pipeline_model_parallel_size(self) -> int:
        return self.layout.pipeline_model_parallel_size

    @property
    def data_parallel_size(self) -> int:
        return self.layout.data_parallel_size

    @property
    def sequence_parallel_size(self) -> int:
        """DeepSpeed-Ulysses' (--ds-sequence-parallel-size), not Megatron's --sequence-parallel."""
        return self.layout.sequence_parallel_size


@dataclass
class OptimizerArgs:
    """Megatron's defaults; the launch scripts pass the gpt3 preset's instead (megatron/training_defaults.py)."""
    lr: float = flag(1.0e-4)
    min_lr: float = flag(0.0)
    lr_decay_style: str = flag("cosine")
    lr_warmup_iters: int = flag(0)
    lr_warmup_fraction: float | None = flag(None)
    lr_decay_iters: int | None = flag(None)
    # a --train-samples run's warm-up and decay (Megatron's sample-based schedule; megatron/optimizer.py LRSchedule)
    lr_warmup_samples: int = flag(0, "with --train-samples: samples of linear warm-up")
    lr_decay_samples: int | None = flag(None, "with --train-samples: samples to decay over (default: --train-samples)")
    # by consumed tokens instead of steps, as Megatron-DeepSpeed counts them (a curriculum's steps are shorter)
    lr_warmup_tokens: int | None = flag(None, "tokens of linear warm-up (overrides the warm-up by steps)")
    lr_decay_tokens: int | None = flag(None, "tokens to decay over (overrides the decay by steps)")
    weight_decay: float = flag(0.01)
    clip_grad: float = flag(1.0, "default: the JSON's gradient_clipping, else {default}", from_json=True)
    adam_beta1: float = flag(0.9)
    adam_beta2: float = flag(0.999)
    adam_eps: float = flag(1e-8)
    optimizer: str = flag("adam", "adam (AdamW, with --adam-beta1/--adam-beta2/--adam-eps) or sgd (torch's SGD with "
                                  "--sgd-momentum); both clip by --clip-grad and skip non-finite steps")
    sgd_momentum: float = flag(0.9, "the momentum of --optimizer sgd")
    # a resume whose flags give another schedule (a longer --train-iters) follows the flags, with a line saying so
    use_checkpoint_opt_param_scheduler: bool = flag(
        False, "on a resume, keep the learning-rate schedule saved in the checkpoint (--lr, --min-lr, warm-up, decay) "
               "instead of the flags' (docs/schedule.md)", names=("--use-checkpoint-opt_param-scheduler",))
    override_opt_param_scheduler: bool = flag(
        False, "on a resume, follow the flags' learning-rate schedule where it differs from the checkpoint's (as a "
               "resume does by default) without the line that says so", names=("--override-opt_param-scheduler",))

    def __post_init__(self):
        _require(self.optimizer in ("adam", "sgd"), f"--optimizer must be adam or sgd, got {self.optimizer!r}")
        _require(self.sgd_momentum >= 0, f"--sgd-momentum must be >= 0, got {self.sgd_momentum}")
        _require(self.lr_decay_style in ("cosine", "linear", "constant", "inverse-square-root"),
                 "--lr-decay-style must be cosine, linear, constant or inverse-square-root, got "
                 f"{self.lr_decay_style!r}")
        _require(self.lr >= 0 and self.min_lr >= 0, "--lr and --min-lr must be >= 0")
        _require(self.min_lr <= self.lr, f"--min-lr {self.min_lr} is larger than --lr {self.lr}")
        _require(not (self.lr_warmup_fraction is not None and self.lr_warmup_iters > 0),
                 "--lr-warmup-fraction and --lr-warmup-iters are exclusive; give one")
        _require(not (self.lr_warmup_fraction is not None and self.lr_warmup_samples > 0),
                 "--lr-warmup-fraction and --lr-warmup-samples are exclusive; give one")
        for name, value, least in (("--lr-warmup-iters", self.lr_warmup_iters, 0),
                                   ("--lr-warmup-samples", self.lr_warmup_samples, 0),
                                   ("--lr-warmup-tokens", self.lr_warmup_tokens, 0),
                                   ("--lr-decay-iters", self.lr_decay_iters, 1),
                                   ("--lr-decay-samples", self.lr_decay_samples, 1),
                                   ("--lr-decay-tokens", self.lr_decay_tokens, 1)):
            _require(value is None or value >= least, f"{name} must be >= {least}, got {value}")
        _require(self.clip_grad >= 0, f"--clip-grad must be >= 0, got {self.clip_grad}")
        _require(not (self.use_checkpoint_opt_param_scheduler and self.override_opt_param_scheduler),
                 "--use-checkpoint-opt_param-scheduler and --override-opt_param-scheduler are exclusive: keep the "
                 "saved schedule or take the flags', not both")


@dataclass(kw_only=True)  # keywords only: the fields keep the order of the flags in --help
class TrainingArgs:
    train_iters: int | None = flag(None)
    train_samples: int | None = flag(None)
    train_epochs: float | None = flag(None, "zero-lab extra: passes over the train split")
    train_tokens: int | None = flag(None, "also stop once this many tokens are consumed (Megatron-DeepSpeed's count: "
                                          "a curriculum's steps count their truncated length)")
    micro_batch_size: int = flag(help="required unless the JSON gives train_micro_batch_size_per_gpu")
    global_batch_size: int = flag(help="default: the JSON's train_batch_size, else micro batch x the JSON's "
                                       "gradient_accumulation_steps (else 1) x data-parallel size")
    gradient_accumulation_steps: int
    # Megatron's batch-size ramp: <start> <increment> <ramp samples> (megatron/batch_rampup.py)
    rampup_batch_size: list[int] | None = flag(
        None, "with --train-samples: <start batch> <increment> <ramp-up samples>: the global batch grows from start "
              "by increment, evenly over the ramp-up samples, to --global-batch-size")
    seed: int = flag(1234)
    max_nan_iterations: int = flag(10)
    exit_interval: int | None = flag(None, "stop (after saving with --save) when the iteration is a multiple of this")
    exit_duration_in_mins: float | None = flag(
        None, "after this many minutes since the ranks started, save (with --save) and exit 0, all ranks agreeing")
    exit_signal_handler: bool = flag(
        False, "on SIGTERM: save a checkpoint after the current step and exit 0 (docs/checkpoints.md)")
    eod_mask_loss: bool = flag(False)
    compile: bool = flag(False, "torch.compile the model")
    curriculum_learning_legacy: bool = flag(
        False, "zero-lab extra: insist on the sequence-length curriculum, which the --deepspeed_config JSON's "
               "curriculum_learning section with \"enabled\": true turns on by itself, as in Megatron-DeepSpeed "
               "(docs/curriculum.md)")
    # what the MoE layers' load-balancing losses are weighted by in the loss (Megatron-DeepSpeed's default)
    moe_loss_coeff: float = flag(0.1, "the MoE load-balancing loss's weight in the loss")
    create_moe_param_group: bool = flag(
        False, "expert parameters in optimizer groups of their own (always so under ZeRO, which needs them)")

    def __post_init__(self):
        given = [flag for flag, value in (("--train-iters", self.train_iters),
                                          ("--train-samples", self.train_samples),
                                          ("--train-epochs", self.train_epochs)) if value is not None]
        _require(len(given) == 1,
                 "give exactly one of --train-iters, --train-samples, --train-epochs"
                 + (f" (got {' and '.join(given)})" if given else ""))
        _require(self.max_nan_iterations > 0, "--max-nan-iterations must be >= 1")
        _require(self.exit_interval is None or self.exit_interval > 0, "--exit-interval must be >= 1")
        _require(self.exit_duration_in_mins is None or self.exit_duration_in_mins > 0,
                 f"--exit-duration-in-mins must be > 0, got {self.exit_duration_in_mins}")
        _require(self.train_tokens is None or self.train_tokens > 0,
                 f"--train-tokens must be >= 1, got {self.train_tokens}")
        _require(self.rampup_batch_size is None or len(self.rampup_batch_size) == 3,
                 "--rampup-batch-size takes three numbers: <start batch size> <batch size increment> <ramp-up "
                 f"samples>, got {self.rampup_batch_size}")
        _require(self.moe_loss_coeff >= 0, f"--moe-loss-coeff must be >= 0, got {self.moe_loss_coeff}")


@dataclass
class DataArgs(TokenizerConfig):
    """--data-path and --split, plus the tokenizer flags that build_tokenizer reads."""
    data_path: list[str] = flag(default_factory=list)
    split: str = flag("969, 30, 1")
    # Megatron's --data-path cache folder for the index arrays; None: next to the data, or, where the data's
    # folder is read-only, the one megatron/startup.py picks
    data_cache_path: str | None = flag(None, "folder for the dataset index caches (default: next to the data; a "
                                             "read-only data folder: <--run-dir>/index-cache)")
    # None: 2 on CUDA, 0 on CPU ranks, where the workers compete with the ranks for the cores
    # (bench/results/cpu-2core.md, bench_host_work.py)
    allow_tokenizer_mismatch: bool = flag(
        False, "zero-lab extra: train on data whose sidecar says another tokenizer type or vocabulary size made it "
               "(refused without it; docs/bad-input.md)")
    num_workers: int | None = flag(None, "data-loader worker processes per rank (0: load on the training thread); "
                                         "default 2 on CUDA, 0 on CPU ranks")
    data_impl: str = flag("infer", "mmap or infer: the indexed .bin/.idx format tools/preprocess_data.py writes "
                                   "(Megatron-DeepSpeed's mmap), the only one zero-lab reads")

    def __post_init__(self):
        _require(self.data_impl not in ("lazy", "cached"),
                 f"--data-impl {self.data_impl}: zero-lab reads only the mmap indexed format; give --data-impl mmap "
                 "(or infer) and preprocess the data with tools/preprocess_data.py (docs/data-format.md)")
        _require(self.data_impl in DATA_IMPLS, f"--data-impl must be mmap or infer, got {self.data_impl!r}")
        _require(bool(self.data_path), "--data-path is required (a dataset prefix, or weight prefix ...)")
        _require(self.num_workers is None or self.num_workers >= 0,
                 f"--num-workers must be >= 0, got {self.num_workers}")
        if len(self.data_path) > 1:
            _require(len(self.data_path) % 2 == 0,
                     f"--data-path: a blend is 'weight prefix weight prefix ...', got {len(self.data_path)} words")


@dataclass
class LoggingArgs:
    """Megatron's intervals; the launch scripts pass the gpt3 preset's (megatron/training_defaults.py)."""
    log_interval: int = flag(100)
    eval_interval: int = flag(1000)
    eval_iters: int = flag(10)
    tensorboard_dir: str | None = flag(None)
    # Weights & Biases (megatron/wandb_writer.py): logging needs a project; the name and folder default to the
    # --run-dir folder's name and the folder itself
    wandb_project: str | None = flag(
        None, "log the TensorBoard scalars, the run's config and the DeepSpeed JSON to this Weights & Biases "
              "project (pip install -e .[wandb]; WANDB_MODE=offline keeps them local)")
    wandb_exp_name: str | None = flag(
        None, "the wandb run's name, with --wandb-project (default: the --run-dir folder's name)")
    wandb_save_dir: str | None = flag(
        None, "where wandb writes its files, with --wandb-project (default: --run-dir, else wandb's own)")
    # the data-parallel link the step-time prediction assumes; None: measured at start-up (comm_probe.py)
    link_bandwidth_gbps: float | None = flag(
        None, "the data-parallel link's bandwidth (Gbit/s) for the predicted step time; with --link-latency-us, "
              "instead of measuring both at start-up (docs/zero-tradeoff.md)")
    link_latency_us: float | None = flag(None, "the latency of one collective on that link, in microseconds")
    # Megatron-DeepSpeed's optional TensorBoard scalars, under its names (megatron/training.py)
    tensorboard_queue_size: int = flag(1000, "TensorBoard events held before a write to disk; Megatron's {default}")
    log_timers_to_tensorboard: bool = flag(
        False, "write the interval's step time split into compute, communication and offload (compute-time, "
               "communication-time, offload-time: seconds per iteration)")
    log_batch_size_to_tensorboard: bool = flag(False, "write the global batch size (batch-size/batch-size)")
    log_validation_ppl_to_tensorboard: bool = flag(
        False, "write the validation perplexity (lm-loss-validation/lm loss validation ppl)")
    log_optimizer_states_to_tensorboard: bool = flag(
        False, "write the norms and largest values of the Adam moments and weights (optimizer/...)")

    def __post_init__(self):
        _require(self.tensorboard_queue_size > 0, "--tensorboard-queue-size must be >= 1")
        _require(self.log_interval > 0, "--log-interval must be >= 1")
        _require(self.eval_interval > 0, "--eval-interval must be >= 1")
        _require(self.eval_iters >= 0, "--eval-iters must be >= 0")
        _require((self.link_bandwidth_gbps is None) == (self.link_latency_us is None),
                 "--link-bandwidth-gbps and --link-latency-us go together (or neither: the link is measured)")
        _require(self.link_bandwidth_gbps is None or self.link_bandwidth_gbps > 0, "--link-bandwidth-gbps must be > 0")
        _require(self.link_latency_us is None or self.link_latency_us >= 0, "--link-latency-us must be >= 0")


@dataclass
class CheckpointArgs:
    save: str | None = flag(None, "checkpoint folder; an empty string saves nothing, as no --save")
    load: str | None = flag(None)
    save_interval: int | None = flag(None)
    finetune: bool = flag(False)
    trust_checkpoint: bool = flag(False, "unpickle any object a checkpoint holds (it can run code; "
                                         "docs/checkpoints.md)")
    universal_checkpoint: bool = flag(False, "resume --load on another data-parallel size or ZeRO stage "
                                             "(docs/checkpoints.md)")
    # the cluster's mean time between failures: prints the interval that fits
    mtbf_hours: float | None = flag(
        None, "the cluster's mean time between failures: after the first save, print the checkpoint interval "
              "that loses the least time in expectation beside --save-interval (docs/faults.md)")
    no_load_optim: bool = flag(False, "resume --load without its optimizer states and learning-rate schedule (the "
                                      "schedule starts again from its first step)")
    no_load_rng: bool = flag(False, "resume --load without its random generators (they start from --seed)")
    async_save: bool = flag(False, "copy the state to host memory and write the checkpoint in the background while "
                                   "training goes on (Megatron-Core's flag; docs/checkpoints.md)")

    def __post_init__(self):
        _require(not self.universal_checkpoint or (self.load is not None and not self.finetune),
                 "--universal-checkpoint resumes the run in --load on another layout; it needs --load and "
                 "no --finetune (which takes only the weights, from any layout)")
        _require(self.save_interval is None or self.save_interval > 0, "--save-interval must be >= 1")
        _require(not (self.universal_checkpoint and self.no_load_optim),
                 "--no-load-optim cannot be combined with --universal-checkpoint (a universal checkpoint is resumed "
                 "whole); drop one")
        _require(self.mtbf_hours is None or self.mtbf_hours > 0, f"--mtbf-hours must be > 0, got {self.mtbf_hours}")
        _require(not self.async_save or bool(self.save), "--async-save writes --save's checkpoints in the background; "
                                                         "give --save DIR, or drop --async-save")


@dataclass
class DeepSpeedArgs:
    zero_stage: int = flag(0, "default: the JSON's stage, else {default}", from_json=True)
    offload_optimizer: bool = flag(False, "ZeRO optimizer state (and step) on the CPU",
                                   names=("--zero-offload-optimizer", "--cpu-optimizer"))
    offload_params: bool = flag(False, "ZeRO-3 parameters on the CPU", names=("--zero-offload-params",))
    bf16: bool = flag(False)
    fp16: bool = flag(False)
    deepspeed_config: str | None = None  # deepspeed.add_config_arguments makes its flag
    run_dir: str | None = flag(None, "folder where the DeepSpeed JSON actually used is written")
    # ZeRO-Infinity: optimizer states and parameters offloaded to files here
    nvme_path: str | None = flag(None, "ZeRO-3 optimizer states and parameters offloaded to files in this folder "
                                       "(async I/O)", names=("--zero-nvme-path",))
    # fp16's loss scaling (the JSON's fp16 section): 0 is dynamic; hysteresis: overflows before the scale drops
    loss_scale: float = flag(0.0, "fp16: a static loss scale (0: dynamic); default: the JSON's fp16.loss_scale, "
                                  "else {default}", from_json=True)
    hysteresis: int = flag(2, "fp16: overflows in a row before the dynamic loss scale drops; default: the JSON's "
                              "fp16.hysteresis, else {default}", from_json=True)
    # each recomputed layer's input kept in host memory until its recompute: zero-lab's host tier
    # (megatron/core/tensor_parallel/activation_offload.py), or with --deepspeed-activation-checkpointing DeepSpeed's
    # cpu_checkpointing on CUDA (on CPU ranks DeepSpeed's keeps them where they are)
    checkpoint_in_cpu: bool = flag(False, "with recompute (--checkpoint-activations): keep each layer's checkpointed "
                                          "input in host memory until its recompute (CPU ranks: an emulated host "
                                          "tier; with --deepspeed-activation-checkpointing, CUDA only)")
    # the --deepspeed_config JSON with the flags merged in (megatron/deepspeed_json.py); None: generated
    user_config: dict | None = None

    def __post_init__(self):
        _require(self.zero_stage in (0, 1, 2, 3), f"--zero-stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        _require(self.loss_scale >= 0, f"--loss-scale must be >= 0 (0: dynamic), got {self.loss_scale}")
        _require(self.hysteresis >= 1, f"--hysteresis must be >= 1, got {self.hysteresis}")

    @property
    def precision(self) -> str:
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"

    @property
    def offload(self) -> str:
        if self.nvme_path is not None:
            return "nvme"
        if self.offload_params:
            return "optimizer+params"
        return "optimizer" if self.offload_optimizer else "none"


@dataclass
class Args:
    model: GPTConfig  # the one typed model shape; checkpoints store GPTConfig.to_dict()
    model_name: str  # the --model-size preset, or "custom"
    parallel: ParallelArgs
    optimizer: OptimizerArgs
    training: TrainingArgs
    data: DataArgs
    logging: LoggingArgs
    checkpoint: CheckpointArgs
    deepspeed: DeepSpeedArgs
    argv: list[str] = field(default_factory=list)
    # --curriculum-learning-legacy's schedule, from the JSON (megatron/curriculum.py); None: every step is whole
    curriculum: CurriculumConfig | None = None
    # one start-up line each for the Megatron-DeepSpeed flags accepted in place of what zero-lab does itself
    notes: list[str] = field(default_factory=list)


def _strip_none(annotation):
    """`X | None` is X."""
    if isinstance(annotation, types.UnionType):
        [annotation] = [kind for kind in typing.get_args(annotation) if kind is not type(None)]
    return annotation


def _flag_type(annotation):
    """int, float, str, bool or list from a field's annotation (`X | None` is X)."""
    annotation = _strip_none(annotation)
    return typing.get_origin(annotation) or annotation


def _add_flags(group, section, *names: str) -> None:
    """Add the flags of `section`'s fields `names` (default: every field made by `flag`), each with the field's
    default, so that no default is written twice. A field from elsewhere (the model's shape, the tokenizer's)
    is the flag --its-name, and None by default where it has no default."""
    hints = typing.get_type_hints(section)
    specs = {spec.name: spec for spec in fields(section)}
    for spec in [specs[name] for name in names] or [spec for spec in specs.values() if spec.metadata.get("flag")]:
        meta = spec.metadata
        options = meta.get("names") or (f"--{spec.name.replace('_', '-')}",)
        given = spec.default is not NO_DEFAULT and not meta.get("from_json")
        default = spec.default if given else None
        help_text = meta["help"].format(default=spec.default) if meta.get("help") else None
        kind = _flag_type(hints[spec.name])
        if kind is bool:
            group.add_argument(*options, action="store_true", help=help_text)
        elif kind is list:
            [item] = typing.get_args(_strip_none(hints[spec.name])) or [str]
            group.add_argument(*options, nargs="*", type=None if item is str else item, default=default,
                               help=help_text)
        else:
            group.add_argument(*options, type=None if kind is str else kind, default=default, help=help_text)


def build_parser() -> argparse.ArgumentParser:
    """Megatron's flags, made from the sections' fields (GPTConfig's, the tokenizer's and the layout's for those):
    each default is the field's, written once."""
    parser = argparse.ArgumentParser(description="Pretrain a GPT with DeepSpeed (Megatron-DeepSpeed flags)",
                                     allow_abbrev=False)
    model = parser.add_argument_group("model")
    model.add_argument("--model-size", default=None, help=f"preset: {', '.join(MODEL_PRESETS)}")
    _add_flags(model, GPTConfig, *SHAPE_FLAGS, "ffn_hidden_size",
               "seq_length", "max_position_embeddings", "hidden_dropout", "attention_dropout", "init_method_std",
               "layernorm_epsilon", "use_rotary_position_embeddings", "rotary_percent",
               *(name for name in LLAMA_FLAGS if name not in ("ffn_hidden_size", "rope_theta")), "squared_relu")
    # Megatron-DeepSpeed's Llama scripts name --rope-theta --rotary-position-embeddings-theta
    model.add_argument("--rope-theta", "--rotary-position-embeddings-theta", dest="rope_theta", type=float,
                       default=_default(GPTConfig, "rope_theta"), help="the rotary angles' base (Llama 3: 500000)")
    model.add_argument("--checkpoint-activations", action="store_true",  # GPTConfig's recompute_activations
                       help="recompute each layer's activations in the backward pass")
    model.add_argument("--recompute-granularity", choices=("full", "selective"), default=None,
                       help="full: as --checkpoint-activations; selective: accepted with a line "
                            "(docs/megatron-flags.md)")
    model.add_argument("--recompute-method", choices=("uniform", "block"), default=None,
                       help="with --recompute-granularity full: uniform with --recompute-num-layers 1, or block "
                            "with all of a stage's layers (or 0); others are refused")
    model.add_argument("--recompute-num-layers", type=int, default=RECOMPUTE_NUM_LAYERS, help="see --recompute-method")
    model.add_argument("--deepspeed-activation-checkpointing", action="store_true",
                       help="the recompute runs through deepspeed.checkpointing, configured by the JSON's "
                            "activation_checkpointing section and --checkpoint-in-cpu")
    _add_flags(model, DeepSpeedArgs, "checkpoint_in_cpu")
    _add_flags(model, GPTConfig, "tiled_mlp_compute", "tiled_mlp_shards", "tiled_logits_loss",
               "tiled_logits_loss_shards")
    # Megatron's query-key layer scaling divides scores by the layer number in fp16 kernels; zero-lab's SDPA has none
    model.add_argument("--no-query-key-layer-scaling", action="store_true",
                       help="accepted and ignored: the attention has no query-key layer scaling (docs/model.md)")
    moe = parser.add_argument_group("mixture of experts (docs/moe.md)")
    _add_flags(moe, GPTConfig, "num_experts", "expert_interval", "moe_expert_parallel_size", "topk",
               "moe_train_capacity_factor", "moe_eval_capacity_factor", "moe_min_capacity", "mlp_type")
    moe.add_argument("--disable-moe-token-dropping", action="store_false", dest="moe_token_dropping",
                     help="no expert capacity limit: every token reaches its experts")
    # --moe-loss-coeff and --create-moe-param-group are TrainingArgs' (the training group)

    par = parser.add_argument_group("parallelism")
    _add_flags(par, ParallelLayout, "tensor_model_parallel_size", "pipeline_model_parallel_size",
               "sequence_parallel_size")
    par.add_argument("--no-pipeline-parallel", action="store_true")
    _add_flags(par, ParallelArgs)

    _add_flags(parser.add_argument_group("optimizer and schedule"), OptimizerArgs)

    train = parser.add_argument_group("training")
    _add_flags(train, TrainingArgs)
    # the deepspeed launcher passes --local_rank=N to every rank (LOCAL_RANK in the environment says the same)
    train.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    _add_flags(train, DeepSpeedArgs, "bf16", "fp16", "loss_scale", "hysteresis")

    data = parser.add_argument_group("data")
    _add_flags(data, DataArgs)
    _add_flags(data, TokenizerConfig, "tokenizer_type", "vocab_file", "merge_file", "tokenizer_model", "vocab_size",
               "make_vocab_size_divisible_by")

    log = parser.add_argument_group("logging and checkpoints")
    _add_flags(log, LoggingArgs)
    _add_flags(log, CheckpointArgs)

    zero = parser.add_argument_group("ZeRO")
    _add_flags(zero, DeepSpeedArgs, "zero_stage", "offload_optimizer", "offload_params", "nvme_path", "run_dir")
    deepspeed.add_config_arguments(parser)
    # every Megatron-DeepSpeed script passes --deepspeed; every zero-lab run uses DeepSpeed, so it changes nothing
    next(action for action in parser._actions if "--deepspeed" in action.option_strings).help = (
        "accepted and ignored: every run uses DeepSpeed (Megatron-DeepSpeed's scripts pass it)")
    add_upstream_flags(parser)
    return parser


def _model_config(ns, params_dtype: torch.dtype, recompute: bool) -> GPTConfig:
    """The shape the flags give over a --model-size preset's (preset_fields, the planner's rule too); its padded
    vocabulary is filled in from the tokenizer by megatron/startup.py."""
    try:
        model = preset_fields(ns.model_size, {name: getattr(ns, name) for name in (
            *SHAPE_FLAGS, *LLAMA_FLAGS, "use_rotary_position_embeddings")} | {"num_experts": ns.num_experts or None})
    except PresetError as err:
        raise ConfigError(str(err)) from err
    _require(ns.seq_length is not None, "--seq-length is required")
    with_deepspeed = _deepspeed_recompute(ns, model.get("num_experts", [1]))[0]
    return GPTConfig(**model, seq_length=ns.seq_length,
                     max_position_embeddings=ns.max_position_embeddings or ns.seq_length,
                     padded_vocab_size=None,
                     hidden_dropout=ns.hidden_dropout, attention_dropout=ns.attention_dropout,
                     layernorm_epsilon=ns.layernorm_epsilon, init_method_std=ns.init_method_std,
                     recompute_activations=recompute,
                     recompute_with_deepspeed=with_deepspeed,
                     recompute_offload=recompute and ns.checkpoint_in_cpu and not with_deepspeed,
                     params_dtype=params_dtype, sequence_parallel=ns.sequence_parallel,
                     rotary_percent=ns.rotary_percent, squared_relu=ns.squared_relu, **_moe_shape(ns),
                     **{name: getattr(ns, name) for name in (
                         "tiled_mlp_compute", "tiled_mlp_shards", "tiled_logits_loss", "tiled_logits_loss_shards")})


def _parse_with_preset(argv: list[str]) -> argparse.Namespace:
    """The flags, with a --model-size preset's architecture (rotary, RMSNorm, SwiGLU, ...) as their defaults, so
    that flags given explicitly win over it, as in Megatron's model scripts."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    architecture = {key: value for key, value in MODEL_PRESETS.get(ns.model_size, {}).items()
                    # --num-experts: preset_fields takes the preset's
                    if key not in ("num_layers", "hidden_size", "num_attention_heads", "num_experts")}
    if not architecture:
        return ns
    parser.set_defaults(**architecture)
    return parser.parse_args(argv)


def _moe_shape(ns) -> dict:
    """GPTConfig's mixture-of-experts fields from the flags, but --num-experts (preset_fields gives it)."""
    return dict(**{name: getattr(ns, name) for name in (
        "expert_interval", "moe_expert_parallel_size", "topk", "moe_train_capacity_factor",
        "moe_eval_capacity_factor", "moe_min_capacity", "moe_token_dropping", "mlp_type")})


def _json_count(config: dict, key: str, path: str):
    """A batch count the JSON gives (None when it does not); it must be an integer >= 1."""
    value = config.get(key)
    _require(value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1),
             f"--deepspeed_config {path}: {key} must be an integer >= 1, got {value!r}")
    return value


def _batch_sizes(ns, layout: ParallelLayout, shared: dict, user_config: dict | None) -> tuple[int, int, int]:
    """(micro batch, global batch, gradient accumulation steps) from the flags and the --deepspeed_config JSON, by
    DeepSpeed's rule train_batch_size = micro batch x gradient_accumulation_steps x data-parallel size. A message
    names each value by the flag that gave it, or else by its JSON key."""
    path, config = ns.deepspeed_config, user_config or {}
    for key in ("train_micro_batch_size_per_gpu", "train_batch_size"):
        _json_count(config, key, path)
    steps = _json_count(config, "gradient_accumulation_steps", path)  # no flag gives it
    micro, global_batch = _value(shared, "micro_batch_size"), _value(shared, "global_batch_size")
    _require(micro is not None, "--micro-batch-size is required (or train_micro_batch_size_per_gpu in "
             + (f"--deepspeed_config {path})" if path else "a --deepspeed_config JSON)"))
    micro_name = "--micro-batch-size" if ns.micro_batch_size is not None else "train_micro_batch_size_per_gpu"
    global_name = "--global-batch-size" if ns.global_batch_size is not None else "train_batch_size"
    _require(micro >= 1, f"--micro-batch-size must be >= 1, got {micro}")
    dp = layout.data_parallel_size
    if global_batch is None and steps is not None:
        global_batch = micro * steps * dp
    try:
        global_batch, accumulation = batch_split(layout, micro, global_batch)
    except BatchError as err:
        if path is None or (micro_name, global_name) == ("--micro-batch-size", "--global-batch-size"):
            raise
        raise ConfigError(f"--deepspeed_config {path}: {global_name} {global_batch} is not divisible by {micro_name} "
                          f"{micro} x data-parallel size {dp}") from err
    if steps is not None and steps != accumulation:
        raise ConfigError(f"--deepspeed_config {path}: {global_name} {global_batch} is not {micro_name} {micro} x "
                          f"gradient_accumulation_steps {steps} x data-parallel size {dp} (= {micro * steps * dp}, "
                          "DeepSpeed's rule): make them agree, or give only two of them")
    return micro, global_batch, accumulation


def _training_args(ns, layout: ParallelLayout, shared: dict, user_config: dict | None) -> TrainingArgs:
    micro, global_batch, accumulation = _batch_sizes(ns, layout, shared, user_config)
    return _section(TrainingArgs, ns, micro_batch_size=micro, global_batch_size=global_batch,
                    gradient_accumulation_steps=accumulation)


def _section(section, ns, **values):
    """`section` from the flags made from its fields (each by its argparse destination), `values` instead where
    given."""
    for spec in fields(section):
        if spec.metadata.get("flag") and spec.name not in values:
            option = (spec.metadata["names"] or (spec.name,))[0]
            values[spec.name] = getattr(ns, option.lstrip("-").replace("-", "_"))
    return section(**values)


def _default(section, name: str):
    """The default of a section's field: where neither the flag nor the JSON gives the value."""
    return next(spec.default for spec in fields(section) if spec.name == name)


def _value(shared: dict, dest: str, default=None):
    value = shared[dest]
    return default if value is MISSING else value


def _shared_settings(ns) -> tuple[dict | None, dict]:
    """(the --deepspeed_config JSON with the flags merged in, or None; the value of every setting the flags
    and the JSON share), by megatron/deepspeed_json.py's one rule."""
    try:
        user = read_deepspeed_json(ns.deepspeed_config)
        refuse_unused_sections(user, ns.deepspeed_config)
        merged, shared = merge_flags(user, vars(ns), ns.deepspeed_config)
    except DeepSpeedJSONError as err:
        raise ConfigError(str(err)) from None
    return (merged if ns.deepspeed_config is not None else None), shared


def _deepspeed_args(ns, user_config: dict | None, shared: dict) -> DeepSpeedArgs:
    nvme_path = _value(shared, "zero_nvme_path") or None  # "": the JSON offloads somewhere else
    offload_params = _value(shared, "zero_offload_params", False) or nvme_path is not None
    return DeepSpeedArgs(
        zero_stage=_value(shared, "zero_stage", _default(DeepSpeedArgs, "zero_stage")),
        offload_optimizer=_value(shared, "zero_offload_optimizer", False) or offload_params,
        offload_params=offload_params, nvme_path=nvme_path,
        bf16=_value(shared, "bf16", False), fp16=_value(shared, "fp16", False),
        loss_scale=_value(shared, "loss_scale", _default(DeepSpeedArgs, "loss_scale")),
        hysteresis=_value(shared, "hysteresis", _default(DeepSpeedArgs, "hysteresis")),
        checkpoint_in_cpu=ns.checkpoint_in_cpu,
        deepspeed_config=ns.deepspeed_config, run_dir=ns.run_dir, user_config=user_config)


def _curriculum(ns, user_config: dict | None) -> CurriculumConfig | None:
    try:
        return read_curriculum(user_config, ns.deepspeed_config, ns.curriculum_learning_legacy, ns.seq_length)
    except CurriculumError as err:
        raise ConfigError(str(err)) from None


# The one table of combinations DeepSpeed (or this stack) does not support:
# (is it unsupported?, the message naming the flag to change).
def _unsupported_combinations(args: Args, device_type: str):
    ds, par, m = args.deepspeed, args.parallel, args.model
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    length_step = args.curriculum.difficulty_step if args.curriculum is not None else tp
    return [
        (ds.fp16 and ds.bf16, "--fp16 and --bf16 are exclusive; drop one"),
        (ds.fp16 and device_type == "cpu",
         "--fp16 is not supported on the CPU accelerator; drop --fp16 (or use --bf16)"),
        (args.optimizer.optimizer == "sgd" and ds.offload_optimizer,
         "--optimizer sgd cannot run with --zero-offload-optimizer (the offloaded step is DeepSpeed's CPU Adam); "
         "use --optimizer adam, or no offload"),
        (ds.offload_optimizer and ds.zero_stage == 0,
         "--zero-offload-optimizer needs ZeRO; set --zero-stage 1, 2 or 3"),
        (ds.nvme_path is not None and ds.zero_stage != 3,
         f"--zero-nvme-path needs --zero-stage 3 (got --zero-stage {ds.zero_stage})"),
        (ds.offload_params and ds.zero_stage != 3,
         f"--zero-offload-params needs --zero-stage 3 (got --zero-stage {ds.zero_stage})"),
        (ds.zero_stage >= 2 and par.pipeline_model_parallel_size > 1,
         f"--zero-stage {ds.zero_stage} cannot be combined with pipeline parallelism; "
         "use --zero-stage 0/1 or --no-pipeline-parallel"),
        *_schedule_problems(args),
        *_moe_problems(args),
        *_ulysses_problems(args),  # before Megatron's --sequence-parallel's own rule: its message names both
        (args.curriculum is not None and pp > 1,
         f"{CURRICULUM_FLAG} cannot be combined with pipeline parallelism (DeepSpeed's pipeline engine keeps the "
         "activation shape of its first step); use --no-pipeline-parallel"),
        (par.sequence_parallel and length_step % tp != 0,
         f"--sequence-parallel splits each sequence over the {tp} tensor-parallel ranks: the curriculum's "
         f"difficulty_step {length_step} must be a multiple of {tp}"),
        (par.sequence_parallel and tp == 1,
         "--sequence-parallel needs --tensor-model-parallel-size > 1 (it splits the sequence over the TP group)"),
        # heads, hidden, ffn and vocabulary by TP, layers by PP (the rules the model builders use too)
        *((True, problem) for problem in parallel_shape_problems(m, tp, pp)),
    ]


def _ulysses_problems(args: Args):
    """What DeepSpeed-Ulysses (--ds-sequence-parallel-size N) cannot run (docs/long-sequences.md): the layout's
    rules (layout_check.ulysses_problems, the planner's too), then the curriculum's and the JSON's."""
    sp, m, par = args.parallel.sequence_parallel_size, args.model, args.parallel
    flag = f"--ds-sequence-parallel-size {sp}"
    zero = (args.deepspeed.user_config or {}).get("zero_optimization") or {}
    return [] if sp == 1 else [
        *((True, problem) for problem in ulysses_problems(
            sp, tensor=par.tensor_model_parallel_size, pipeline=par.pipeline_model_parallel_size,
            sequence_parallel=par.sequence_parallel, num_attention_heads=m.num_attention_heads,
            seq_length=m.seq_length)),
        (args.curriculum is not None and args.curriculum.difficulty_step % sp != 0,
         f"{flag} splits each sequence over {sp} ranks: the curriculum's difficulty_step "
         f"{args.curriculum.difficulty_step if args.curriculum is not None else 0} must be a multiple of {sp}"),
        # megatron/training.py's sequence_gradient_factor knows ZeRO-3's reduce-scatter averaging only
        (args.deepspeed.zero_stage == 3 and zero.get("reduce_scatter", True) is False,
         f"{flag} at ZeRO stage 3 needs zero_optimization.reduce_scatter on (--deepspeed_config "
         f"{args.deepspeed.deepspeed_config} turns it off): DeepSpeed averages the gradients another way there"),
    ]


def _schedule_problems(args: Args):
    """Megatron's rules: a run counts by iterations or by samples, and its schedule flags with it; the batch-size ramp
    is sample-based, and each of its batches splits into micro-batches on every data-parallel rank."""
    t, opt = args.training, args.optimizer
    by_samples = t.train_samples is not None
    unit = "--train-iters" if t.train_iters is not None else "--train-epochs"
    problems = [(by_samples and opt.lr_decay_iters is not None,
                 "--lr-decay-iters is iteration-based; with --train-samples give --lr-decay-samples"),
                (by_samples and opt.lr_warmup_iters > 0,
                 "--lr-warmup-iters is iteration-based; with --train-samples give --lr-warmup-samples"),
                (not by_samples and opt.lr_decay_samples is not None,
                 f"--lr-decay-samples is sample-based; with {unit} give --lr-decay-iters"),
                (not by_samples and opt.lr_warmup_samples > 0,
                 f"--lr-warmup-samples is sample-based; with {unit} give --lr-warmup-iters"),
                (not by_samples and t.rampup_batch_size is not None,
                 f"--rampup-batch-size needs sample-based training: give --train-samples instead of {unit}")]
    if t.rampup_batch_size is not None:
        try:
            BatchRamp.from_flag(t.rampup_batch_size, t.global_batch_size, t.micro_batch_size,
                                args.parallel.data_parallel_size)
        except BatchRampError as err:
            problems.append((True, str(err)))
    return problems


def _moe_problems(args: Args):
    """What the MoE layers (--num-experts > 1) cannot run with here (docs/moe.md): ZeRO-3, the layout's rules
    (layout_check.moe_problems, the planner's too) and the optimizer states' TensorBoard lines."""
    m, par, ds = args.model, args.parallel, args.deepspeed
    flag = m.experts_setting
    return [] if not m.is_moe else [
        (ds.zero_stage == 3, f"{flag} cannot run at --zero-stage 3: DeepSpeed {deepspeed.__version__}'s MoE layer "
                             "does not support ZeRO stage 3; use --zero-stage 0, 1 or 2"),
        *((True, problem) for problem in moe_problems(
            flag, tensor=par.tensor_model_parallel_size, pipeline=par.pipeline_model_parallel_size,
            sequence=par.sequence_parallel_size, data=par.data_parallel_size, expert=m.moe_expert_parallel_size)),
        (args.logging.log_optimizer_states_to_tensorboard,
         f"{flag} cannot be combined with --log-optimizer-states-to-tensorboard (the experts' states are "
         "partitioned over other groups); drop it"),
    ]


def _recompute(ns, pipeline: int) -> tuple[bool, list[str]]:
    """(recompute every layer?, its start-up line if any) from --checkpoint-activations or Megatron's recompute
    flags (megatron/upstream_flags.py), which it wins over as in Megatron-DeepSpeed."""
    layers = ns.num_layers or MODEL_PRESETS.get(ns.model_size or "", {}).get("num_layers") or 1
    recompute, problem, note = recompute_layers(ns.recompute_granularity, ns.recompute_method,
                                                ns.recompute_num_layers, max(1, layers // pipeline))
    _require(problem is None, problem)
    _require(not ns.checkpoint_in_cpu or ns.checkpoint_activations or recompute,
             "--checkpoint-in-cpu keeps each recomputed layer's input in host memory: add --checkpoint-activations "
             "(or --recompute-granularity full), or drop it")
    return ns.checkpoint_activations or recompute, [note] if note and not ns.checkpoint_activations else []


def _deepspeed_recompute(ns, num_experts: list[int]) -> tuple[bool, list[str]]:
    """(recompute through deepspeed.checkpointing?, its start-up line if any). Not for MoE layers: DeepSpeed's
    reentrant checkpoint runs the forward without a graph, so the gates' load-balancing loss, which the layer keeps
    aside, would reach the loss without its gradient; Megatron-DeepSpeed returns it through the checkpointed
    function instead. Torch's non-reentrant checkpointing keeps it, with the same gradients."""
    if not ns.deepspeed_activation_checkpointing:
        return False, []
    if max(num_experts) == 1:
        return True, []
    return False, ["--deepspeed-activation-checkpointing: the MoE model recomputes through torch's non-reentrant "
                   "checkpointing, which keeps the gates' load-balancing loss in the graph (DeepSpeed's would drop "
                   "its gradient); the JSON's activation_checkpointing section does not apply"]


def check_support(args: Args, device_type: str) -> None:
    for unsupported, message in _unsupported_combinations(args, device_type):
        _require(not unsupported, message)


def parse_args(argv: list[str], world_size: int = 1, device_type: str = "cpu") -> Args:
    """Parse and validate the values; raises ConfigError (argparse's own usage errors exit with code 2)."""
    ns = _parse_with_preset(argv)
    refused = refused_message(ns)  # a Megatron-DeepSpeed flag zero-lab has no feature for
    _require(refused is None, refused)
    pipeline = 1 if ns.no_pipeline_parallel else ns.pipeline_model_parallel_size
    recompute, recompute_notes = _recompute(ns, pipeline)
    layout = ParallelLayout(world_size, ns.tensor_model_parallel_size, pipeline, ns.ds_sequence_parallel_size)
    user_config, shared = _shared_settings(ns)
    deepspeed_args = _deepspeed_args(ns, user_config, shared)
    model = _model_config(ns, PARAMS_DTYPES[deepspeed_args.precision], recompute)
    args = Args(
        model=model,
        model_name=ns.model_size or "custom",
        parallel=_section(ParallelArgs, ns, layout=layout),
        optimizer=_section(OptimizerArgs, ns,
                           clip_grad=_value(shared, "clip_grad", _default(OptimizerArgs, "clip_grad"))),
        training=_training_args(ns, layout, shared, user_config),
        data=_section(DataArgs, ns, data_path=ns.data_path or [],
                      **{name: getattr(ns, name) for name in ("tokenizer_type", "vocab_file", "merge_file",
                                                              "tokenizer_model", "vocab_size",
                                                              "make_vocab_size_divisible_by",
                                                              "tensor_model_parallel_size")}),
        # '' as no flag, as --save '' (a driver's variable left empty)
        logging=_section(LoggingArgs, ns, wandb_project=ns.wandb_project or None,
                         wandb_exp_name=ns.wandb_exp_name or None, wandb_save_dir=ns.wandb_save_dir or None),
        # --save '' (bench/gpu_suite.sh after a driver's own --save) means no checkpoints, as Megatron's `if
        # args.save:` reads it; kept as '' it would reach os.makedirs('') on one rank while the others wait
        checkpoint=_section(CheckpointArgs, ns, save=ns.save or None),
        deepspeed=deepspeed_args,
        argv=list(argv),
        curriculum=_curriculum(ns, user_config),
        notes=accepted_lines(ns) + recompute_notes + _deepspeed_recompute(ns, model.num_experts)[1],
    )
    check_support(args, device_type)
    return args
