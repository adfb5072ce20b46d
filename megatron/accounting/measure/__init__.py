"""Measurement inside a run: the start-up probes (compute, collectives, host work), the traffic counter, the
memory readings and the step clock whose figures the log prints beside megatron.accounting.predict's."""
