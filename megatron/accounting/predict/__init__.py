"""Prediction: what a run should take before it starts (parameters, FLOPs, memory, traffic, step time per rank),
one module per quantity; megatron.accounting re-exports the parts the training log and the analysis use."""
