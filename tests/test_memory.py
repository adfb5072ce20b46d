"""megatron/memory.py reads private DeepSpeed attributes: each must exist in the installed DeepSpeed (this
test breaks when DeepSpeed renames one), and a missing one raises instead of measuring zero."""
import inspect
import re

import pytest

from megatron import memory


def _deepspeed_class(name):
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    return {cls.__name__: cls for cls in (BF16_Optimizer, DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3)}[name]


def _assigned_attributes(cls) -> set[str]:
    return set(re.findall(r"self\.(\w+)\s*(?::[^=\n]*)?=[^=]", inspect.getsource(cls)))


@pytest.mark.parametrize("class_name", sorted(memory._FP32_MASTER))
def test_every_private_attribute_read_exists_in_deepspeed(class_name):
    assigned = _assigned_attributes(_deepspeed_class(class_name))
    wanted = {memory._FP32_MASTER[class_name], *memory._GRADIENT_BUFFERS.get(class_name, ())}
    assert wanted <= assigned, wanted - assigned


def test_a_missing_attribute_raises_naming_it():
    class Renamed:
        pass

    with pytest.raises(memory.DeepSpeedInternalsError, match=r"Renamed has no attribute 'averaged_gradients'"):
        memory._private(Renamed(), "averaged_gradients")
