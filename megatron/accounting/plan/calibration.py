"""What the bound leaves out, fitted to published runs: the Calibration (tools/published_runs.json holds the fitted
values; published.py fits them), the step split into the parts it scales (StepParts, step_parts) and the expected
step it gives (StepParts.expected). Tests swap CALIBRATION and H100_CALIBRATION here to time a run left out."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from megatron import accounting
from megatron.accounting.plan.hardware import Hardware, links, project
from megatron.accounting.predict.step_time import StepTime, messages_per_step, model_parallel_alone, ulysses_seconds
from megatron.model.config import GPTConfig


@dataclass(frozen=True)
class Calibration:
    """What the bound leaves out, as few numbers fitted to published runs (`fit_calibration`; the fitted values
    are tools/published_runs.json's "calibration")."""
    matmul: float  # the fraction of --gpu's large-matmul rate that a layer's FLOPs run at
    memory_passes: float  # the layer's activation bytes (Korthikanti's count) through HBM per forward-equivalent
    link: float  # the fraction of a link's nominal bandwidth that NCCL's collectives reach


PUBLISHED_RUNS = Path(__file__).resolve().parents[3] / "tools" / "published_runs.json"
PUBLISHED = json.loads(PUBLISHED_RUNS.read_text())
CALIBRATION = Calibration(**PUBLISHED["calibration"]["values"])  # fitted on the A100 runs
# fitted on the H100 runs: their matmul fraction alone (fit_matmul), the A100 fit's memory passes and link kept
H100_CALIBRATION = replace(CALIBRATION, **PUBLISHED["h100_calibration"]["values"])
H100_PARTS = ("H100 SXM", "H200 SXM")  # the GPU kinds H100_CALIBRATION times; the others take the A100 runs'


def calibration_for(hw: Hardware) -> Calibration:
    """The calibration that times `hw`: the H100 runs' on H100 and H200 (the same tensor cores), else the A100
    runs' (on V100, A40 and MI250X unchecked)."""
    return H100_CALIBRATION if hw.kind.part in H100_PARTS else CALIBRATION


@dataclass(frozen=True)
class StepParts:
    """The busiest stage's step, in seconds, split by what the calibration scales. Per micro-batch, and so
    stretched by the pipeline's fill and drain (`stretch`, 1 + (p-1)/m for p stages and m micro-batches): the
    layers' hardware FLOPs at the large-matmul rate, the memory-bound kernels' bytes at HBM speed (softmax,
    LayerNorm, GeLU, dropout, bias adds, the loss-scale checks), the model-parallel collectives (TP's
    all-reduces, recomputation's forward's too; PP's sends). Once a step: the data-parallel collectives left
    exposed, the engine's passes over the gradients and the optimizer (`other`), offload."""
    matmul: float
    memory: float
    model_parallel: float
    data_parallel: float
    other: float
    offload: float
    stretch: float

    def expected(self, c: Calibration) -> StepTime:
        per_micro_batch = self.matmul / c.matmul + c.memory_passes * self.memory + self.model_parallel / c.link
        return StepTime(compute=self.matmul / c.matmul + c.memory_passes * self.memory + self.other,
                        communication=(self.model_parallel + self.data_parallel) / c.link, offload=self.offload,
                        bubble=(self.stretch - 1) * per_micro_batch)


def layer_memory_bytes(config: GPTConfig, setup: accounting.TrainingSetup, flash_attn: bool = False) -> float:
    """Bytes one layer's forward writes on a TP rank for one micro-batch, Korthikanti et al. 2022's count with
    unfused attention (as the 2021-2022 codebases of the published runs ran it): s b h (10 + 24/t) + 5 a s^2 b / t
    in 16-bit, the 10 split over TP too under sequence parallelism; under DeepSpeed-Ulysses (N) s/N tokens, and
    the a s^2 scores for a/N heads. `flash_attn` (--use-flash-attn-v2; zero-lab's SDPA on a GPU): a fused kernel
    writes no scores, only its fp32 log-sum-exp, 4 a s b / t bytes. The memory-bound kernels read and write about
    these bytes; `Calibration.memory_passes` says how many times."""
    s, b, h, a = config.seq_length, setup.micro_batch_size, config.hidden_size, config.num_attention_heads
    t, n = setup.tensor_parallel_size, setup.sequence_parallel_size
    replicated = 10 / t if setup.sequence_parallel else 10
    outside = s / n * b * h * (replicated + 24 / t) * setup.element_bytes / 2
    if flash_attn:
        return outside + 4 * a * s * b / t / n
    return outside + 5 * a * s * s * b / t / n * setup.element_bytes / 2


def step_parts(config: GPTConfig, setup: accounting.TrainingSetup, hw: Hardware, gpus_per_node: int,
               nodes: int, flash_attn: bool = False) -> tuple[StepTime, StepParts] | None:
    """(the bound, `project`'s step, and the same step split into StepParts). `config`: the busiest stage's;
    `flash_attn`: attention runs a fused kernel (layer_memory_bytes)."""
    projected = project(config, setup, hw, gpus_per_node, nodes)
    if projected is None:
        return None
    stage, bound = projected
    tp, pp, g = setup.tensor_parallel_size, setup.pipeline_parallel_size, setup.gradient_accumulation_steps
    _, model = links(setup, hw, gpus_per_node, nodes)
    sequences = setup.micro_batch_size * g * setup.data_parallel_size
    matmul = accounting.hardware_flops_per_iteration(config, sequences) / setup.world_size / (
        hw.peak_tflops * 1e12 * hw.efficiency)
    config_alone, alone = model_parallel_alone(config, setup)  # what the layout sends without data parallelism
    traffic = accounting.zero_traffic_per_step(config_alone, alone, stage)
    messages = messages_per_step(config_alone, alone, stage, {})
    bound_model_parallel = sum(model.costs[kind].seconds(traffic[kind], messages[kind])
                               for kind in accounting.TRAFFIC_KINDS) + ulysses_seconds(config, setup, model)
    layers = config.num_layers // pp
    recomputed = 2 * layers * g if setup.activation_recompute and tp > 1 else 0  # the recomputed forward's two
    activation = setup.micro_batch_size * config_alone.seq_length * config.hidden_size * setup.element_bytes
    model_parallel = bound_model_parallel + model.costs["all_reduce"].seconds(
        recomputed * 2 * (tp - 1) / tp * activation, recomputed)
    layer_bytes = layer_memory_bytes(config, setup, flash_attn)
    memory = (3 + setup.activation_recompute) * layers * g * layer_bytes / hw.kind.hbm_bytes_per_s
    return bound, StepParts(matmul=matmul, memory=memory, model_parallel=model_parallel,
                            data_parallel=bound.communication - bound.overlap - bound_model_parallel,
                            other=bound.compute - matmul, offload=bound.offload, stretch=1 + (pp - 1) / g)

