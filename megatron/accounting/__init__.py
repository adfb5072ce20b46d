"""What a run should take, predicted before it starts: parameters, FLOPs, memory and traffic per rank.

The one place these numbers come from: the training log, tools/zero_plan.py and the analysis all call here,
one module per quantity.
"""
from megatron.accounting.predict.flops import (
    PEAK_TFLOPS,
    accelerator_part,
    hardware_flops_per_iteration,
    matmul_precision,
    model_flops_per_iteration,
    peak_tflops,
)
from megatron.accounting.predict.memory import (
    activation_bytes,
    fused_attention,
    gradient_bytes_per_element,
    gradient_elements_held,
    memory_per_rank,
    offloaded_activation_bytes,
    output_layer_buffer_bytes,
    runs_bf16_optimizer,
    zero_model_state_estimate,
)
from megatron.accounting.predict.parameters import (active_parameters, count_parameters, expert_groups_on_rank,
                                                  parameter_groups_on_rank, parameters_on_rank)
from megatron.accounting.predict.traffic import (TRAFFIC_KINDS, moe_all_to_all_per_step, moe_capacity,
                                               offload_transfer_per_step, ulysses_all_to_all_per_step,
                                               zero_traffic_per_step)
from megatron.accounting.predict.training_setup import PRECISIONS, AccountingError, TrainingSetup

__all__ = [
    "PEAK_TFLOPS", "PRECISIONS", "TRAFFIC_KINDS", "AccountingError", "TrainingSetup", "accelerator_part",
    "activation_bytes", "active_parameters", "count_parameters", "expert_groups_on_rank",
    "fused_attention",
    "gradient_bytes_per_element", "gradient_elements_held", "hardware_flops_per_iteration", "matmul_precision",
    "memory_per_rank", "model_flops_per_iteration", "moe_all_to_all_per_step", "moe_capacity",
    "offload_transfer_per_step", "offloaded_activation_bytes", "output_layer_buffer_bytes",
    "parameter_groups_on_rank", "parameters_on_rank",
    "peak_tflops", "runs_bf16_optimizer", "ulysses_all_to_all_per_step", "zero_model_state_estimate",
    "zero_traffic_per_step",
]
