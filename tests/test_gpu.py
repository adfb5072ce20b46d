"""On CUDA only (skipped without a GPU): a short driver run in bf16 whose memory lines come from the
CUDA allocator, the allocator peak reset per logging interval, our attention on a flash or cuDNN
SDPA kernel, and a CUDA toolkit that can build the offload driver's CPU Adam. docs/gpu.md says how a
GPU session runs these."""
import json
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import REPO_ROOT, driver_env

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (torch.cuda.is_available() is False)")

MEMORY = re.compile(r"memory at iteration +(\d+) \| device=(\w+), MemAllocated=(\d+\.\d+)GB, "
                    r"MaxMemAllocated=(\d+\.\d+)GB, HostRSS=(\d+\.\d+)GB")


@pytest.fixture
def data_dir(request):
    """The repository's prepared data/ where present (a GPU machine without network gets it carried
    along: docs/gpu.md), else the dolly sample prepared now (needs the GPT-2 vocabulary from the hub
    or the package index)."""
    local = REPO_ROOT / "data"
    needed = ("gpt2-vocab.json", "gpt2-merges.txt", "dolly_text_document.bin", "dolly_text_document.idx")
    if all((local / name).is_file() for name in needed):
        return local
    return request.getfixturevalue("dolly_data_dir")


@pytest.mark.slow
def test_z1_driver_on_cuda_trains_in_bf16_with_allocator_memory_lines(data_dir, tmp_path):
    env = driver_env(data_dir, tmp_path, DS_ACCELERATOR="cuda", NGPUS=1, MODEL_SIZE="tiny", SEQ_LEN=128,
                     PRECISION="bf16", TRAIN_ITERS=10, LOG_INTERVAL=5, EVAL_INTERVAL=10, MICRO_BATCH=4)
    env.pop("TRAIN_EPOCHS")
    result = subprocess.run(["bash", str(REPO_ROOT / "examples_zero" / "gpt_deepspeed_Z1.sh")], env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run = tmp_path / "gpt_tiny_Z1"
    assert json.loads((run / "ds_config.json").read_text())["bf16"]["enabled"] is True
    memory = MEMORY.findall((run / "train.log").read_text())
    assert [int(m[0]) for m in memory] == [5, 10]
    for _, device, allocated, peak, _ in memory:
        assert device == "cuda"
        assert 0 < float(allocated) <= float(peak)


def test_memory_tracker_reports_the_cuda_peak_of_each_interval():
    from megatron.accounting.measure.memory import MemoryTracker

    tracker = MemoryTracker(on_cuda=True)
    tracker.sample()  # an interval starts
    spike = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    del spike
    tracker.sample(end_interval=False)  # the model-state line's reading, mid-interval
    first = tracker.sample()
    second = tracker.sample()
    assert first["max_allocated"] >= 256 * 2**20
    assert second["max_allocated"] < 256 * 2**20  # the spike belonged to the first interval only
    assert second["allocated"] == torch.cuda.memory_allocated()


def test_attention_runs_on_a_flash_or_cudnn_sdpa_kernel_in_bf16():
    sys.path.insert(0, str(REPO_ROOT / "bench"))
    from bench_gpt_vs_hf import attention_kernels

    from megatron.model import GPTConfig

    config = GPTConfig(num_layers=1, hidden_size=256, num_attention_heads=4, seq_length=512, padded_vocab_size=50304,
                       max_position_embeddings=512, params_dtype=torch.bfloat16)
    kernels = attention_kernels(config, SimpleNamespace(micro_batch_size=2, seq_length=512), torch.device("cuda"))
    assert kernels and all(kernel.split()[0] in ("flash", "cuDNN") for kernel in kernels), kernels


def test_this_machine_can_build_the_offload_drivers_cpu_adam():
    """Z3_OL compiles DeepSpeed's CPU Adam with the CUDA toolkit's nvcc, which must match torch's CUDA: the
    start-up check's verdict here, before the suite's Z3_OL runs find out (docs/gpu.md)."""
    from torch.utils.cpp_extension import CUDA_HOME

    from megatron.optimizer import check_cpu_adam_buildable, nvcc_version_text

    check_cpu_adam_buildable("cuda", CUDA_HOME, torch.version.cuda, nvcc_version_text(CUDA_HOME))
