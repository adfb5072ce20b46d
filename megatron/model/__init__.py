"""GPT model: `from megatron.model import GPTConfig, GPTModel, MODEL_PRESETS`.

The pipeline form (DeepSpeed PipelineModule) is `megatron.model.gpt_model_pipe.build_gpt_pipe`,
imported on its own because it pulls in deepspeed. The names are imported when first asked for, so that
`megatron.model.presets` (the one table of shapes, read by the launch planner) comes without torch.
"""
from megatron.model.presets import MODEL_PRESETS

__all__ = ["GPTConfig", "GPTModel", "MODEL_PRESETS", "ModelConfigError"]


def __getattr__(name: str):
    if name in ("GPTConfig", "ModelConfigError"):
        from megatron.model import config
        return getattr(config, name)
    if name == "GPTModel":
        from megatron.model.gpt_model import GPTModel
        return GPTModel
    raise AttributeError(f"module 'megatron.model' has no attribute {name!r}")
