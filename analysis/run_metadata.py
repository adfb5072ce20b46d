"""What a run was: ZeRO stage, offload, model, world size, batch sizes, sequence length, SP, MoE layout.

Sources, weakest first: the folder name, env.json, command.txt, ds_config.json, the
arguments Megatron echoes into the log, and the run info line the training prints. A
stronger source overrides a weaker one field by field.
"""
from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, fields, replace
from pathlib import Path

from analysis.log_parser import ParsedLog

# "nvme": optimizer states and parameters offloaded to NVMe (ZeRO-Infinity, gpt_deepspeed_Z3_NVMe.sh)
OFFLOAD_KINDS = ("none", "optimizer", "optimizer+params", "nvme")


@dataclass
class RunMetadata:
    zero_stage: int | None = None
    offload: str | None = None  # one of OFFLOAD_KINDS
    model: str | None = None
    world_size: int | None = None
    micro_batch: int | None = None
    global_batch: int | None = None
    seq_length: int | None = None
    train_samples_per_epoch: int | None = None
    # mixture of experts (docs/moe.md): each MoE layer's experts (one value when all alike), the expert-parallel
    # size and the experts per token; None for a dense model
    num_experts: list[int] | None = None
    expert_parallel: int | None = None
    topk: int | None = None
    # DeepSpeed-Ulysses' sequence-parallel size (--ds-sequence-parallel-size; docs/long-sequences.md)
    sequence_parallel: int | None = None

    def overridden_by(self, stronger: "RunMetadata") -> "RunMetadata":
        updates = {f.name: getattr(stronger, f.name) for f in fields(self)
                   if getattr(stronger, f.name) is not None}
        return replace(self, **updates)

    @property
    def label(self) -> str | None:
        """Short run label for tables and plots: Z0..Z3, "+offload" when anything is offloaded."""
        if self.zero_stage is None:
            return None
        suffix = {None: "", "none": "", "nvme": "+NVMe"}.get(self.offload, "+offload")
        return f"Z{self.zero_stage}{suffix}"


def _to_int(value) -> int | None:
    try:
        return int(str(value).strip())
    except (TypeError, ValueError):
        return None


def _offload(optimizer: bool, params: bool) -> str:
    return "optimizer+params" if params else ("optimizer" if optimizer else "none")


_MODEL_TOKEN_RE = re.compile(r"^(?:tiny|GPT\d+(?:\.\d+)?[MBT]|\d+(?:\.\d+)?[MBT])$", re.IGNORECASE)
_NAME_FIELDS = {
    "zero_stage": re.compile(r"^(?:z|stage)(\d)$", re.IGNORECASE),
    "seq_length": re.compile(r"^seq(?:len)?(\d+)$", re.IGNORECASE),
    "global_batch": re.compile(r"^gb(\d+)$", re.IGNORECASE),
    "micro_batch": re.compile(r"^mb(\d+)$", re.IGNORECASE),
    "sequence_parallel": re.compile(r"^sp(\d+)$"),  # ALCF's _sp1_: its SP is --ds-sequence-parallel-size
}


# ALCF model keys hold underscores themselves: GPT1_3B, GPT_TINY.
_ALCF_MODEL_RE = re.compile(r"(?:^|_)(GPT(?:_TINY|\d+(?:_\d+)?[MBT]))(?=_|$)")


def from_folder_name(name: str) -> RunMetadata:
    """gpt_tiny_Z3_OL, gpt_125M_DP, ALCF's gpt_SP_actCkpt_GPT13B_z1_seqlen1024_..._gb1_mb1,
    ds_stage2_nl32_hs4096_mb4_seq4096_gb96_pp1_tp1_bf16."""
    meta = RunMetadata()
    alcf_model = _ALCF_MODEL_RE.search(name)
    if alcf_model:
        meta.model = alcf_model.group(1)
    for token in name.split("_"):
        if token == "DP":
            meta.zero_stage = 0
        elif token == "OL":
            meta.offload = "optimizer+params"
        elif token == "NVMe":
            meta.offload = "nvme"
        elif _MODEL_TOKEN_RE.match(token) and meta.model is None:
            meta.model = token
        for attr, pattern in _NAME_FIELDS.items():
            match = pattern.match(token)
            if match:
                setattr(meta, attr, int(match.group(1)))
    if meta.zero_stage is not None and meta.offload is None:
        meta.offload = "none"
    return meta


def moe_layout(meta: RunMetadata) -> dict:
    """The MoE layout's fields (None for a dense model), which a run's summary copies (analysis/run_summary.py)."""
    return dict(num_experts=meta.num_experts, expert_parallel=meta.expert_parallel, topk=meta.topk)


def has_layer_experts(layout) -> bool:
    """Whether `layout` (a RunMetadata, or a summary that copied its moe_layout) names experts: an MoE model."""
    return layout.num_experts is not None


def experts_text(layout) -> str:
    """Each MoE layer's experts as the summary table prints them ("4, 8"; "" for a dense model)."""
    return ", ".join(map(str, layout.num_experts or []))


def _experts(value: str | None) -> list[int] | None:
    """"4", "4 8" (the run info line) or "[4, 8]" (Megatron's argument dump); None for a dense model ([1])."""
    counts = [int(n) for n in re.findall(r"\d+", value or "")]
    return counts if any(n > 1 for n in counts) else None


def from_run_info(info: dict[str, str]) -> RunMetadata:
    offload = info.get("offload")
    return RunMetadata(
        # the line names SP only above 1 (docs/log-lines.md): a zero-lab line without it is SP 1
        sequence_parallel=_to_int(info.get("SP", "1" if info else None)),
        num_experts=_experts(info.get("experts")),
        expert_parallel=_to_int(info.get("EP")),
        topk=_to_int(info.get("top-k")),
        zero_stage=_to_int(info.get("zero stage")),
        offload=offload if offload in OFFLOAD_KINDS else None,
        model=info.get("model") or None,
        world_size=_to_int(info.get("world size")),
        micro_batch=_to_int(info.get("micro batch")),
        global_batch=_to_int(info.get("global batch")),
        seq_length=_to_int(info.get("seq length")),
        train_samples_per_epoch=_to_int(info.get("train samples per epoch")),
    )


def from_arguments(args: dict[str, str]) -> RunMetadata:
    """Megatron's start-up argument dump (upstream logs carry no run info line)."""
    meta = RunMetadata(
        zero_stage=_to_int(args.get("zero_stage")),
        world_size=_to_int(args.get("world_size")),
        micro_batch=_to_int(args.get("micro_batch_size")),
        global_batch=_to_int(args.get("global_batch_size")),
        seq_length=_to_int(args.get("seq_length")),
        sequence_parallel=_to_int(args.get("ds_sequence_parallel_size")),
    )
    if _experts(args.get("num_experts")):  # a dense run's dump names the MoE flags too
        meta.num_experts = _experts(args["num_experts"])
        meta.expert_parallel = _to_int(args.get("moe_expert_parallel_size"))
        meta.topk = _to_int(args.get("topk"))
    if "cpu_optimizer" in args:
        meta.offload = _offload(args["cpu_optimizer"] == "True", False)
    if "num_layers" in args and "hidden_size" in args:
        meta.model = f"nl{args['num_layers']}_hs{args['hidden_size']}"
    return meta


def from_ds_config(path: Path) -> RunMetadata:
    config = json.loads(path.read_text())
    zero = config.get("zero_optimization") or {}

    def device(key: str) -> str:
        return (zero.get(key) or {}).get("device") or "none"

    nvme = device("offload_param") == "nvme"
    return RunMetadata(
        zero_stage=_to_int(zero.get("stage", 0)),
        offload="nvme" if nvme else _offload(device("offload_optimizer") != "none", device("offload_param") != "none"),
        micro_batch=_to_int(config.get("train_micro_batch_size_per_gpu")),
        global_batch=_to_int(config.get("train_batch_size")),
    )


def _flag_values(argv: list[str]) -> dict[str, str]:
    values = {}
    for i, arg in enumerate(argv):
        if not arg.startswith("--"):
            continue
        name, eq, value = arg[2:].partition("=")
        if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value = argv[i + 1]
        values[name.replace("_", "-")] = value
    return values


def _commands(text: str) -> dict[int | None, str]:
    """command.txt's commands by attempt number (each after its `# attempt N | ...` line; None before any)."""
    commands: dict[int | None, str] = {}
    attempt = None
    for line in text.splitlines():
        header = re.match(r"# attempt (\d+) \|", line)
        if header:
            attempt = int(header.group(1))
        elif line.strip() and not line.startswith("#"):
            commands[attempt] = line
    return commands


def from_command(path: Path, attempt: int | None = None) -> RunMetadata:
    """The command of `attempt` (the last that trained), else the latest (command.txt keeps every attempt's, each
    after a `# attempt` line, those refused at start-up too)."""
    by_attempt = _commands(path.read_text())
    commands = [by_attempt[attempt]] if attempt in by_attempt else list(by_attempt.values())
    flags = _flag_values(shlex.split(commands[-1]) if commands else [])
    nodes = _to_int(flags.get("nnodes")) or 1
    per_node = _to_int(flags.get("nproc-per-node")) or _to_int(flags.get("num-gpus"))
    return RunMetadata(
        zero_stage=_to_int(flags.get("zero-stage")),
        world_size=per_node * nodes if per_node else None,
        micro_batch=_to_int(flags.get("micro-batch-size")),
        global_batch=_to_int(flags.get("global-batch-size")),
        seq_length=_to_int(flags.get("seq-length")),
        sequence_parallel=_to_int(flags.get("ds-sequence-parallel-size")),
    )


def _find_key(obj, key: str):
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        for value in obj.values():
            found = _find_key(value, key)
            if found is not None:
                return found
    return None


def from_env_json(path: Path) -> RunMetadata:
    return RunMetadata(world_size=_to_int(_find_key(json.loads(path.read_text()), "world_size")))


def _named_folder(log_path: Path, root: Path) -> Path:
    """The folder whose name describes the run: ALCF keeps logs in <run>/<timestamp_host>/."""
    candidate = log_path.parent
    while candidate != root and root in candidate.parents:
        if from_folder_name(candidate.name) != RunMetadata():
            return candidate
        candidate = candidate.parent
    return log_path.parent


def from_log_name(name: str) -> RunMetadata:
    """ALCF's <user>-<host>-nhosts1-ngpu8-<date>.log names carry the world size."""
    match = re.search(r"-ngpu(\d+)-", name)
    return RunMetadata(world_size=int(match.group(1)) if match else None)


def collect_metadata(log: ParsedLog, root: Path) -> tuple[RunMetadata, Path, list[str]]:
    """Metadata of the run that wrote `log`, the folder naming it, and problems met on the way."""
    folder = _named_folder(log.path, root)
    meta = from_folder_name(folder.name).overridden_by(from_log_name(log.path.name))
    problems = []
    readers = (("env.json", from_env_json),
               ("command.txt", lambda path: from_command(path, log.trained_attempt)),
               ("ds_config.json", from_ds_config))
    for name, reader in readers:
        # beside the log (examples_zero runs) or in the run folder above it (ALCF's <run>/logs/)
        candidates = [log.path.parent / name, folder / name]
        path = next((p for p in candidates if p.is_file()), None)
        if path is not None:
            try:
                meta = meta.overridden_by(reader(path))
            except (ValueError, AttributeError, TypeError) as exc:
                problems.append(f"{path}: unreadable ({exc.__class__.__name__}: {exc}), ignored")
    meta = meta.overridden_by(from_arguments(log.arguments)).overridden_by(from_run_info(log.trained_run_info))
    return meta, folder, problems
