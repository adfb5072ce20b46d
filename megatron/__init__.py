"""zero-lab's training stack. Any import of it first drops DeepSpeed's warning that it chose the CPU, on a machine
with no GPU to find (megatron/deepspeed_quiet.py): every tool and rank printed it at the top."""
from megatron.deepspeed_quiet import drop_cpu_fallback_warning

drop_cpu_fallback_warning()
