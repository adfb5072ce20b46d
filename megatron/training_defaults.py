"""Named presets of training settings: the values a launch path passes to pretrain_gpt.py instead of its own
defaults (Megatron's, written once in megatron/arguments.py's sections). pretrain_gpt.py run alone keeps
Megatron's; the launch scripts (the examples_zero drivers, their Slurm script, ALCF/) pass GPT3_PRESET's,
through megatron/launch/settings.py. No torch here: the launch planner imports it and must start fast.
"""
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Mapping

from megatron.settings_schema import BY_FLAG


@dataclass(frozen=True)
class TrainingPreset:
    """Each field is the pretrain_gpt.py flag of its name (adam_beta2: --adam-beta2) with the value the preset
    passes; lr_by_model_size gives --lr by --model-size, as the paper's table writes it."""
    name: str
    lr_by_model_size: Mapping[str, str]
    adam_beta1: float
    adam_beta2: float
    weight_decay: float
    clip_grad: float
    lr_decay_style: str
    lr_warmup_fraction: float
    seed: int
    distributed_timeout_minutes: int
    split: str
    log_interval: int
    eval_interval: int
    eval_iters: int
    save_interval: int
    checkpoint_activations: bool

    def flag_values(self) -> dict[str, object]:
        """Every flag setting by its field name (the flag's argparse destination)."""
        return {spec.name: getattr(self, spec.name) for spec in fields(self)
                if spec.name not in ("name", "lr_by_model_size")}

    def environment(self) -> dict[str, str]:
        """The launch scripts' variables the preset gives a default (each flag's, megatron/settings_schema.py), with
        their text (docs/environment.md)."""
        return {BY_FLAG[f"--{name.replace('_', '-')}"].name: str(int(value) if isinstance(value, bool) else value)
                for name, value in self.flag_values().items()}


GPT3_PRESET = TrainingPreset(
    name="gpt3",
    # GPT-3 paper (Brown et al. 2020, Table 2.1): peak learning rate by model size, decayed to a tenth; the sizes
    # it has no row for take the nearest smaller row's (tiny: 125M's)
    lr_by_model_size=MappingProxyType({
        "tiny": "6.0e-4", "125M": "6.0e-4", "355M": "3.0e-4", "760M": "2.5e-4", "774M": "2.5e-4", "1.3B": "2.0e-4",
        "1.5B": "2.0e-4", "2.7B": "1.6e-4", "6.7B": "1.2e-4", "13B": "1.0e-4", "25B": "1.0e-4", "175B": "0.6e-4"}),
    # GPT-3 paper optimizer: cosine decay after 1% warm-up, AdamW betas (0.9, 0.95), weight decay 0.1, gradients
    # clipped at norm 1; the rest as Megatron's scripts run them
    adam_beta1=0.9, adam_beta2=0.95, weight_decay=0.1, clip_grad=1.0, lr_decay_style="cosine",
    lr_warmup_fraction=0.01, seed=1234, distributed_timeout_minutes=10, split="969,30,1",
    # intervals a run of 60 CPU iterations shows: a log line every 5, a validation every 50 over 5
    log_interval=5, eval_interval=50, eval_iters=5, save_interval=1000, checkpoint_activations=False,
)
PRESETS = {preset.name: preset for preset in (GPT3_PRESET,)}
