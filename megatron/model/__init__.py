"""GPT model: `from megatron.model import GPTConfig, GPTModel, MODEL_PRESETS`.

The pipeline form (DeepSpeed PipelineModule) is `megatron.model.gpt_model_pipe.build_gpt_pipe`,
imported on its own because it pulls in deepspeed.
"""
from megatron.model.config import GPTConfig, ModelConfigError
from megatron.model.presets import MODEL_PRESETS
from megatron.model.gpt_model import GPTModel

__all__ = ["GPTConfig", "GPTModel", "MODEL_PRESETS", "ModelConfigError"]
