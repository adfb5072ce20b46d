"""GPT model: `from megatron.model import GPTConfig, GPTModel, MODEL_PRESETS`."""
from megatron.model.config import MODEL_PRESETS, GPTConfig, ModelConfigError
from megatron.model.gpt_model import GPTModel

__all__ = ["GPTConfig", "GPTModel", "MODEL_PRESETS", "ModelConfigError"]
