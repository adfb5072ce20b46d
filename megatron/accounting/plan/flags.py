"""The planner's command line: its flags, parsed once into `PlanFlags`, the values as given (units.py reads
their sizes and bandwidths). tools/zero_plan.py and the published runs' command lines (published.py) both go
through `parse_flags`; request.py turns the flags into a PlanRequest."""
from __future__ import annotations

import argparse
import typing
from dataclasses import MISSING, dataclass, field, fields

from megatron.accounting.plan.hardware import DEFAULT_HOST_GB, DEFAULT_LATENCY_US, GPU_KINDS
from megatron.accounting.predict.fit import HEADROOM
from megatron.model.config import NORMALIZATIONS, GPTConfig
from megatron.model.presets import LLAMA_FLAGS, MODEL_PRESETS, PRESET_SEQ_LENGTH, PRESET_VOCABULARY

GPT2_VOCAB = 50257


@dataclass(frozen=True)
class PlanFlags:
    """The planner's flags as given (each field the flag of its name unless build_parser says otherwise); the
    defaults here are the flags' defaults."""
    gpus: int  # per node
    model_size: str | None = None
    num_layers: int | None = None
    hidden_size: int | None = None
    num_attention_heads: int | None = None
    vocab_size: int | None = None  # None: the preset's tokenizer's, else GPT-2's (parse_flags fills it in)
    seq_length: int | None = None  # None: the preset's context, else GPT-3's 2048 (parse_flags fills it in)
    micro_batch_size: int = 1
    global_batch_size: int | None = None
    nodes: int = 1
    gpu_memory: str | None = None
    gpu: str | None = None
    efficiency: float | None = None
    intra_node_bandwidth: str | None = None
    inter_node_bandwidth: str | None = None
    latency: str = f"{DEFAULT_LATENCY_US:g}us"
    nvme_bandwidth: str | None = None
    tokens: str | None = None
    storage_bandwidth: str | None = None
    mtbf_hours: float | None = None
    headroom: float = HEADROOM
    tp: int = 1
    pp: int = 1
    sequence_parallel: bool = False
    sp: int = 1  # --ds-sequence-parallel-size (DeepSpeed-Ulysses)
    rotary: bool = False  # --use-rotary-position-embeddings
    flash_attn: bool = False  # --use-flash-attn-v2
    precision: str = "bf16"
    recompute: bool = False
    # the long-sequence levers, the training's flags (docs/long-sequences.md): ALST's tiled MLP and tiled logits and
    # loss, and the recomputed layers' inputs kept in host memory
    tiled_mlp_compute: bool = False
    tiled_mlp_shards: int = 0  # 0: as ALST picks them (megatron/model/tiling.py)
    tiled_logits_loss: bool = False
    tiled_logits_loss_shards: int = 0
    checkpoint_in_cpu: bool = False
    host_gb: float = DEFAULT_HOST_GB  # host memory per node, GB: what offloaded states and layer inputs may take
    alst_check: bool = False  # --alst-check: print only the planner against ALST's published longest sequences
    num_experts: list[int] | None = None
    ep: int | None = None  # --moe-expert-parallel-size; None: every size that divides
    topk: int = 1
    json: bool = False
    async_save: bool = False  # --async-save: a column of each GPU's host copy of its checkpoint files
    # GPTConfig's Llama fields (presets.LLAMA_FLAGS), each its flag's value as given: None (or False) leaves the
    # preset's
    architecture: dict = field(default_factory=dict)

    @property
    def moe_fields(self) -> dict:
        """GPTConfig's MoE fields as the flags give them (None leaves the preset's; an EP size of None, every size
        that divides (request.expert_parallel_sizes), is GPTConfig's 1)."""
        return {"num_experts": self.num_experts, "moe_expert_parallel_size": self.ep}


# the planner's own refusal: the training ignores an EP size without experts
EP_WITHOUT_EXPERTS = "--moe-expert-parallel-size needs --num-experts (or an MoE --model-size)"


def build_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model-size", help=f"a preset: {', '.join(MODEL_PRESETS)}")
    parser.add_argument("--num-layers", type=int)
    parser.add_argument("--hidden-size", type=int)
    parser.add_argument("--num-attention-heads", type=int)
    parser.add_argument("--vocab-size", type=int,
                        help="before padding (default: the preset's tokenizer's, llama3-8b's 128256, say; else "
                             "GPT-2's)")
    parser.add_argument("--seq-length", type=int,
                        help="default: the preset's context (llama3-8b's 8192, say; else GPT-3's 2048)")
    parser.add_argument("--micro-batch-size", type=int, help="default: 1")
    parser.add_argument("--global-batch-size", type=int, help="default: one micro-batch per data-parallel rank")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs per node")
    parser.add_argument("--nodes", type=int)
    parser.add_argument("--gpu-memory", help="per GPU, e.g. 40GB (default: --gpu's)")
    parser.add_argument("--gpu", help=f"the GPU kind, for step times: {', '.join(GPU_KINDS)}")
    parser.add_argument("--efficiency", type=float,
                        help="fraction of the dense peak that large matmuls reach (default: --gpu's, measured)")
    parser.add_argument("--intra-node-bandwidth",
                        help="per GPU and direction inside a node, e.g. 2400Gbit or 300GB/s (default: --gpu's)")
    parser.add_argument("--inter-node-bandwidth",
                        help="per node, all its NICs, e.g. 200Gbit or 25GB/s (default: --gpu's reference node)")
    parser.add_argument("--latency", help=f"per collective and level it crosses (default: {DEFAULT_LATENCY_US:g}us)")
    parser.add_argument("--nvme-bandwidth", help="per node, e.g. 25GB/s; without it NVMe offload is not timed")
    parser.add_argument("--tokens", help="a token budget, e.g. 300B: prints the days to train it")
    parser.add_argument("--storage-bandwidth",
                        help="the checkpoint filesystem's write bandwidth for the whole job, e.g. 20GB/s: with "
                             "--mtbf-hours, prints the checkpoint interval that fits")
    parser.add_argument("--mtbf-hours", type=float,
                        help="the cluster's mean time between failures for a job this size, in hours")
    parser.add_argument("--headroom", type=float,
                        help="fraction of GPU memory kept for the CUDA context, communication buckets and "
                             f"fragmentation (default: {HEADROOM:g})")
    parser.add_argument("--tp", "--tensor-model-parallel-size", dest="tp", type=int)
    parser.add_argument("--pp", "--pipeline-model-parallel-size", dest="pp", type=int)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--ds-sequence-parallel-size", dest="sp", type=int,
                        help="DeepSpeed-Ulysses: split each sequence over this many GPUs (default: 1)")
    parser.add_argument("--use-rotary-position-embeddings", dest="rotary", action="store_true",
                        help="rotary positions: no learned position table, which would grow with --seq-length")
    _add_architecture_flags(parser)
    parser.add_argument("--use-flash-attn-v2", "--use-flash-attn", dest="flash_attn", action="store_true",
                        help="time attention as a fused kernel that writes no s x s scores (FlashAttention; "
                             "zero-lab's SDPA on a GPU); default: unfused, as the calibration's published runs")
    parser.add_argument("--precision", choices=("bf16", "fp16", "fp32"))
    parser.add_argument("--recompute", "--checkpoint-activations", dest="recompute", action="store_true",
                        help="full activation recomputation")
    parser.add_argument("--tiled-mlp-compute", action="store_true",
                        help="each MLP a tile of tokens at a time, recomputed in the backward (ALST's tiled MLP)")
    parser.add_argument("--tiled-mlp-shards", type=int, help="tiles of --tiled-mlp-compute (default: 0, as ALST)")
    parser.add_argument("--tiled-logits-loss", action="store_true",
                        help="the output layer's logits and loss a tile of tokens at a time (ALST's tiled loss)")
    parser.add_argument("--tiled-logits-loss-shards", type=int,
                        help="tiles of --tiled-logits-loss (default: 0, as ALST)")
    parser.add_argument("--checkpoint-in-cpu", action="store_true",
                        help="with --recompute: each recomputed layer's input waits in host memory")
    parser.add_argument("--host-gb", type=float,
                        help=f"host memory per node in GB, for what offload keeps there (default: {DEFAULT_HOST_GB:g}, "
                             "a DGX A100 320GB's)")
    parser.add_argument("--alst-check", action="store_true",
                        help="print only the planned longest sequences of ALST's published Llama-8B runs beside "
                             "them (takes no other flag)")
    parser.add_argument("--num-experts", type=int, nargs="+",
                        help="experts of every other layer, one value or one per MoE layer (an MoE --model-size, "
                             "gpt-125m-moe8 say, has its own)")
    parser.add_argument("--moe-expert-parallel-size", dest="ep", type=int,
                        help="default: every size that divides the GPUs and each layer's experts")
    parser.add_argument("--topk", type=int, help="experts per token (default: 1)")
    parser.add_argument("--json", action="store_true", help="print the plans and the choice as JSON")
    parser.add_argument("--async-save", action="store_true",
                        help="the host memory per GPU that --async-save's copy of its checkpoint files takes")
    parser.set_defaults(**{spec.name: spec.default for spec in fields(PlanFlags) if spec.default is not MISSING})
    return parser


def _add_architecture_flags(parser: argparse.ArgumentParser) -> None:
    """The Llama architecture's flags (presets.LLAMA_FLAGS), typed as GPTConfig's fields, None by default so
    that a --model-size preset's value stands unless the flag is given (docs/model.md)."""
    hints = typing.get_type_hints(GPTConfig)
    for name in LLAMA_FLAGS:
        kind = hints[name]
        flag = f"--{name.replace('_', '-')}"
        if kind is bool:
            parser.add_argument(flag, action="store_true", help="the Llama architecture's (docs/model.md)")
        elif name == "normalization":
            parser.add_argument(flag, choices=NORMALIZATIONS)
        else:
            [kind] = [k for k in typing.get_args(kind) or (kind,) if k is not type(None)]
            parser.add_argument(flag, type=kind, help="default: the preset's, else GPTConfig's (docs/model.md)")


def parse_flags(argv: list[str], description: str = "tools/zero_plan.py") -> PlanFlags:
    """The flags as given; --vocab-size and --seq-length default to the preset's. A usage error exits (code 2)."""
    parser = build_parser(description)
    ns = parser.parse_args(argv)
    if ns.alst_check:
        parser.error("--alst-check takes no other flag: python tools/zero_plan.py --alst-check")
    if ns.model_size is None and ns.num_layers is None:
        parser.error("give --model-size or --num-layers/--hidden-size/--num-attention-heads")
    if ns.vocab_size is None:
        ns.vocab_size = PRESET_VOCABULARY.get(ns.model_size, GPT2_VOCAB)
    if ns.seq_length is None:
        ns.seq_length = PRESET_SEQ_LENGTH.get(ns.model_size, 2048)
    given = vars(ns)
    architecture = {name: given.pop(name) for name in LLAMA_FLAGS}
    return PlanFlags(**given, architecture=architecture)
