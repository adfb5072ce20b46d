"""What the planner is asked, resolved once from its flags: `plan_request` checks them in one pass (each refusal
one line naming the flag) and makes the model (GPTConfig, by presets.preset_fields, the training's rule), the
hardware, the usable memory, the batch's split and the token budget; everything after takes the PlanRequest.
The MoE and DeepSpeed-Ulysses layouts are refused by megatron/layout_check.py, in the training's words."""
from __future__ import annotations

from dataclasses import dataclass

from megatron.accounting.plan.flags import EP_WITHOUT_EXPERTS, PlanFlags
from megatron.accounting.plan.hardware import Hardware, hardware
from megatron.accounting.plan.units import PlanError, parse_bandwidth, parse_memory, parse_tokens
from megatron.core.parallel_state import ParallelLayout
from megatron.layout_check import batch_split, moe_problems, ulysses_problems
from megatron.model.config import GPTConfig, ModelConfigError, parallel_shape_problems
from megatron.model.presets import SHAPE_FLAGS, preset_fields


@dataclass(frozen=True)
class PlanRequest:
    flags: PlanFlags  # as given: the layout's sizes, the batch, the precision, and the text the lines quote
    config: GPTConfig  # the whole model (a pipeline stage's: fit.stage_config)
    hardware: Hardware | None  # None: no --gpu, no step times
    usable_gb: float  # GPU memory less the headroom, GB of 2**30 bytes
    accumulation: int  # micro-batches per step
    token_budget: float | None  # --tokens
    storage_bytes_per_s: float | None  # --storage-bandwidth, with --mtbf-hours (the checkpoint interval)

    @property
    def world_size(self) -> int:
        return self.flags.gpus * self.flags.nodes


def plan_request(flags: PlanFlags) -> PlanRequest:
    """Check the flags and resolve them, in this order: counts, headroom, the GPU kind and memory, the token
    budget, the model and its layout, the batch, the checkpoint interval's flags."""
    for flag, value in (("--gpus", flags.gpus), ("--nodes", flags.nodes), ("--seq-length", flags.seq_length),
                        ("--vocab-size", flags.vocab_size)):
        if value < 1:
            raise PlanError(f"{flag} must be >= 1, got {value}")
    if not 0.0 <= flags.headroom < 1.0:
        raise PlanError(f"--headroom must be in [0, 1), got {flags.headroom}")
    if flags.host_gb <= 0:
        raise PlanError(f"--host-gb must be > 0 (GB of host memory per node), got {flags.host_gb:g}")
    if flags.checkpoint_in_cpu and not flags.recompute:  # the training's words (megatron/arguments.py)
        raise PlanError("--checkpoint-in-cpu keeps each recomputed layer's input in host memory: add "
                        "--checkpoint-activations (or --recompute), or drop it")
    hw = hardware(flags.gpu, flags.precision, flags.efficiency, flags.intra_node_bandwidth,
                  flags.inter_node_bandwidth, flags.latency, flags.nvme_bandwidth)
    if flags.gpu_memory is None and hw is None:
        raise PlanError("give --gpu-memory or --gpu")
    memory = parse_memory(flags.gpu_memory) if flags.gpu_memory else hw.kind.memory_gb
    if flags.tokens and hw is None:
        raise PlanError("--tokens needs --gpu: the days to train come from the step time on a GPU kind")
    token_budget = parse_tokens(flags.tokens) if flags.tokens else None
    config = model_config(flags)
    layout = ParallelLayout(flags.gpus * flags.nodes, flags.tp, flags.pp, flags.sp)
    _, accumulation = batch_split(layout, flags.micro_batch_size, flags.global_batch_size)
    return PlanRequest(flags, config, hw, memory * (1.0 - flags.headroom), accumulation, token_budget,
                       storage_bytes_per_s(flags))


def model_config(flags: PlanFlags) -> GPTConfig:
    """The model the flags give over a --model-size preset's (presets.preset_fields), its vocabulary padded as
    Megatron's --make-vocab-size-divisible-by 128 x TP, refused in one line where the training refuses it."""
    given = {name: getattr(flags, name) for name in SHAPE_FLAGS} | flags.architecture | flags.moe_fields | {
        "use_rotary_position_embeddings": flags.rotary}
    fields = preset_fields(flags.model_size, given)
    multiple = 128 * flags.tp
    padded = -(-flags.vocab_size // multiple) * multiple
    config = GPTConfig(**fields, seq_length=flags.seq_length, max_position_embeddings=flags.seq_length,
                       padded_vocab_size=padded, recompute_activations=flags.recompute,
                       recompute_offload=flags.checkpoint_in_cpu, tiled_mlp_compute=flags.tiled_mlp_compute,
                       tiled_mlp_shards=flags.tiled_mlp_shards, tiled_logits_loss=flags.tiled_logits_loss,
                       tiled_logits_loss_shards=flags.tiled_logits_loss_shards,
                       sequence_parallel=flags.sequence_parallel, topk=flags.topk)
    # layers that do not divide into the stages are split unevenly (stage_config), as Megatron-DeepSpeed does
    problems = [p for p in parallel_shape_problems(config, flags.tp, flags.pp) if not p.startswith("--num-layers")]
    if config.num_layers < flags.pp:
        problems.append(f"--num-layers {config.num_layers} is fewer than --pipeline-model-parallel-size {flags.pp}: "
                        "every stage needs a layer")
    if problems:
        raise ModelConfigError(problems[0])
    layout_problems(config, flags)
    return config


def layout_problems(config: GPTConfig, flags: PlanFlags) -> None:
    """Refuse, in the training's words (megatron/layout_check.py), an MoE layout (docs/moe.md) or a DeepSpeed-Ulysses
    size (docs/long-sequences.md) the training would refuse."""
    if flags.sp < 1:
        raise PlanError(f"--ds-sequence-parallel-size must be >= 1, got {flags.sp}")
    problems = []  # in the training's order: MoE's, then Ulysses'
    if config.is_moe:
        data = flags.gpus * flags.nodes // (flags.tp * flags.pp * flags.sp)
        problems += moe_problems(config.experts_setting, tensor=flags.tp, pipeline=flags.pp, sequence=flags.sp,
                                 data=data, expert=flags.ep or 1)
    elif flags.ep is not None:
        problems.append(EP_WITHOUT_EXPERTS)
    problems += ulysses_problems(flags.sp, tensor=flags.tp, pipeline=flags.pp,
                                 sequence_parallel=flags.sequence_parallel,
                                 num_attention_heads=config.num_attention_heads, seq_length=flags.seq_length)
    if problems:
        raise PlanError(problems[0])


def expert_parallel_sizes(request: PlanRequest) -> list[int]:
    """The EP sizes to plan: the one asked for, else every one that divides the GPUs and each layer's experts."""
    if not request.config.is_moe:
        return [1]
    if request.flags.ep is not None:
        return [request.flags.ep]
    world, moe = request.world_size, [n for n in request.config.layer_experts if n > 1]
    return [ep for ep in range(1, world + 1) if not world % ep and not any(n % ep for n in moe)]


def storage_bytes_per_s(flags: PlanFlags) -> float | None:
    """--storage-bandwidth in bytes/s; it and --mtbf-hours go together (the checkpoint interval needs both)."""
    if flags.storage_bandwidth is None and flags.mtbf_hours is None:
        return None
    if flags.storage_bandwidth is None or flags.mtbf_hours is None:
        raise PlanError("--storage-bandwidth and --mtbf-hours go together: the interval needs the save time and "
                        "the MTBF")
    if flags.mtbf_hours <= 0:
        raise PlanError(f"--mtbf-hours must be > 0, got {flags.mtbf_hours:g}")
    return parse_bandwidth(flags.storage_bandwidth, "--storage-bandwidth") * 1e9 / 8
