"""What the estimates need to know about a run besides the model's shape, and their error."""
from __future__ import annotations

from dataclasses import dataclass

from megatron.errors import ZeroLabError

PRECISIONS = ("bf16", "fp16", "fp32")

# Bytes of one element of params, grads and activations in each precision.
_ELEMENT_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}

class AccountingError(ZeroLabError, ValueError):
    """A layout the estimates cannot describe; the message names the flag."""



@dataclass(frozen=True)
class TrainingSetup:
    """Everything besides the model shape that the traffic and memory estimates depend on."""
    world_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int = 1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    sequence_parallel: bool = False  # Megatron's, inside the TP group
    # DeepSpeed-Ulysses' N (--ds-sequence-parallel-size): each of N ranks holds s/N of every sequence and, inside
    # the attention, the whole sequence for a/N heads; ZeRO partitions over these N x the data-parallel ranks
    sequence_parallel_size: int = 1
    # --moe-expert-parallel-size: each MoE layer's experts are split over this many data-parallel ranks; ZeRO
    # partitions and reduces the expert parameters over the data-parallel size / EP (the expert-data-parallel ranks)
    expert_parallel_size: int = 1
    precision: str = "fp32"
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_params: bool = False
    offload_device: str = "cpu"  # where offloaded states live: "cpu" or "nvme" (ZeRO-Infinity)
    activation_recompute: bool = False
    # --checkpoint-in-cpu: each recomputed layer's input waits in host memory (pinned on CUDA, an emulated host
    # tier on CPU ranks) until its recompute; the accelerator keeps about nothing per layer
    activation_offload: bool = False
    # "cuda": fused attention (SDPA's flash or memory-efficient kernel), 1-byte dropout masks; "cpu": SDPA's
    # math kernel with attention dropout (it keeps the attention probabilities), its flash kernel without,
    # masks in the activations' dtype
    device: str = "cuda"
    # the dtype DeepSpeed reduces the gradients in (its communication_data_type, which a user's JSON may set); None:
    # the precision, as the generated config reduces wherever ranks share the parameters (docs/zero-tradeoff-reference.md)
    reduce_precision: str | None = None

    def __post_init__(self):
        model_parallel = self.tensor_parallel_size * self.pipeline_parallel_size * self.sequence_parallel_size
        if min(self.world_size, self.micro_batch_size, self.gradient_accumulation_steps, model_parallel) < 1:
            raise AccountingError("world size, micro batch, gradient accumulation, TP, PP and SP must all be >= 1")
        if self.world_size % model_parallel:
            raise AccountingError(f"{self.world_size} ranks do not divide into TP={self.tensor_parallel_size} x "
                                  f"PP={self.pipeline_parallel_size} x SP={self.sequence_parallel_size}")
        if self.expert_parallel_size < 1 or self.data_parallel_size % self.expert_parallel_size:
            raise AccountingError(f"--moe-expert-parallel-size {self.expert_parallel_size} must divide the "
                                  f"data-parallel size {self.data_parallel_size}")
        for name, value in (("precision", self.precision), ("reduce_precision", self.reduce_precision or "fp32")):
            if value not in _ELEMENT_BYTES:
                raise AccountingError(f"{name} must be one of {sorted(_ELEMENT_BYTES)}, got {value!r}")
        if self.device not in ("cuda", "cpu"):
            raise AccountingError(f"device must be cuda or cpu, got {self.device!r}")
        if self.activation_offload and not self.activation_recompute:
            raise AccountingError("--checkpoint-in-cpu offloads the recomputed layers' inputs: it needs "
                                  "--checkpoint-activations")
        if self.offload_device not in ("cpu", "nvme"):
            raise AccountingError(f"offload device must be cpu or nvme, got {self.offload_device!r}")

    @property
    def data_parallel_size(self) -> int:
        """Model replicas that read different samples."""
        model_parallel = self.tensor_parallel_size * self.pipeline_parallel_size * self.sequence_parallel_size
        return self.world_size // model_parallel

    @property
    def zero_partitions(self) -> int:
        """Ranks that hold the same parameters, over which ZeRO partitions and reduces: the sequence ranks times
        the data-parallel ones (DeepSpeed's sequence-data-parallel group)."""
        return self.data_parallel_size * self.sequence_parallel_size

    @property
    def expert_data_parallel_size(self) -> int:
        """Ranks that hold the same experts, over which ZeRO partitions and reduces them."""
        return self.data_parallel_size // self.expert_parallel_size

    @property
    def element_bytes(self) -> int:
        return _ELEMENT_BYTES[self.precision]

    @property
    def reduce_element_bytes(self) -> int:
        """Bytes of one gradient element in the data-parallel reductions (reduce_precision)."""
        return _ELEMENT_BYTES[self.reduce_precision or self.precision]
