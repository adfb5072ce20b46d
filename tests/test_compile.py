"""--compile: the model under torch.compile through DeepSpeed's engine.compile() at every ZeRO stage, on CPU
ranks (gloo, inductor): the model's forward is one graph (no graph break), a compiled run trains as the uncompiled
one does, and the CPU memory reading skips the tensors compile's tracing leaves behind (docs/gpu.md)."""
import pytest
import torch

from megatron.accounting.measure.memory import live_tensor_bytes
from megatron.model import MODEL_PRESETS, GPTConfig, GPTModel
from runs import run_pretrain
from conftest import iteration_losses

SEQ, VOCAB = 16, 512


def model_of(preset: str) -> GPTModel:
    fields = dict(MODEL_PRESETS[preset], seq_length=SEQ, max_position_embeddings=SEQ, padded_vocab_size=VOCAB)
    torch.manual_seed(0)
    return GPTModel(GPTConfig(**fields), None).train()


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_the_models_forward_is_one_graph(preset):
    """Dropout on, labels given: the forward and the fused output-layer loss trace into one graph. Before, the
    loss's scratch buffers (megatron/core/scratch.py), a dict mutated inside its autograd.Function, broke it."""
    model = model_of(preset)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    explained = torch._dynamo.explain(model)(tokens, torch.arange(SEQ).expand(2, SEQ), tokens)
    torch._dynamo.reset()
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_the_cpu_memory_reading_skips_tensors_without_memory():
    """Compile's tracing leaves fake and functional tensors alive in its caches: the first has no memory (its
    data pointer is 0), the plain tensor a functional one wraps raises on its data pointer. Before, the first
    memory line of a --compile run on CPU ranks failed on it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    before = live_tensor_bytes()
    with FakeTensorMode():
        fake = torch.empty(2**22)
    functional = torch._to_functional_tensor(torch.empty(2**20))
    assert live_tensor_bytes() - before <= 2**22  # at most the real tensor behind the functional one
    del fake, functional


# ZeRO stage flags -> the runs compared; ranks 1 unless given
STAGES = {"z0": ["--zero-stage", "0"], "z1": ["--zero-stage", "1"], "z2": ["--zero-stage", "2"],
          "z3": ["--zero-stage", "3"],
          "z3_offload": ["--zero-stage", "3", "--zero-offload-optimizer", "--zero-offload-params"]}
SHORT = ["--train-iters", "3", "--global-batch-size", "4", "--lr-warmup-iters", "1"]
# the compiled losses against the uncompiled ones, relative: the log prints 7 digits, and at every stage they
# were all the same (docs/gpu-reference.md)
LOSS_TOLERANCE = 1e-6


def assert_same_losses(dolly_data_dir, ranks, flags):
    eager = iteration_losses(run_pretrain(dolly_data_dir, *SHORT, *flags, ranks=ranks).stdout)
    compiled = iteration_losses(run_pretrain(dolly_data_dir, *SHORT, *flags, "--compile", ranks=ranks).stdout)
    assert sorted(eager) == sorted(compiled) == [1, 2, 3]
    for iteration, loss in eager.items():
        assert float(compiled[iteration]) == pytest.approx(float(loss), rel=LOSS_TOLERANCE), (iteration, eager,
                                                                                               compiled)


@pytest.mark.slow
@pytest.mark.parametrize("stage", list(STAGES))
def test_a_compiled_run_trains_as_the_uncompiled_one(dolly_data_dir, stage):
    assert_same_losses(dolly_data_dir, 1, STAGES[stage])


@pytest.mark.slow
def test_a_compiled_run_on_two_ranks_trains_as_the_uncompiled_one(dolly_data_dir):
    assert_same_losses(dolly_data_dir, 2, STAGES["z3"])
