"""Install zero-lab's `megatron` package and build its pybind11 helper extension.

The extension (`megatron.data.helpers`) builds the GPT dataset's sample index in C++. The `analysis` and `tools`
packages are installed too, so that their scripts (`python analysis/summarize.py`, `python tools/...`) import
`megatron`, `analysis` and `tools.vcluster` from anywhere without editing sys.path.
"""
from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import find_packages, setup

helpers_extension = Pybind11Extension(
    "megatron.data.helpers",
    ["megatron/data/helpers.cpp"],
    cxx_std=17,
    extra_compile_args=["-O3"],
)

setup(
    name="zero-lab",
    version="0.1.0",
    description="Megatron-DeepSpeed style GPT training with a DeepSpeed ZeRO experiment suite",
    packages=find_packages(include=["megatron", "megatron.*", "analysis", "tools", "tools.*"]),
    python_requires=">=3.10",
    # Ranges here, exact versions in constraints.txt: scripts/setup.sh installs the constrained versions
    # (what CI runs), while a machine that already has a package within its range (a GPU image's numpy or
    # transformers, installed from a wheelhouse without network) keeps its own (docs/gpu.md).
    install_requires=[
        # scripts/setup.sh installs torch first (2.13.0: the CPU build on the project machines,
        # a CUDA build on a GPU machine) or keeps a GPU image's own; 2.11 to 2.13 are supported (2.13's
        # all_gather_single/reduce_scatter_single have a fallback in megatron/core/tensor_parallel/mappings.py).
        "torch>=2.11,<2.14",
        "deepspeed==0.19.8",  # exact: the code reads DeepSpeed's checkpoint files and config keys
        "numpy>=2.0,<3",
        "regex>=2024.4",
        "sentencepiece>=0.2,<0.3",
        "pybind11>=2.12",
        "tiktoken>=0.7,<1",
        "matplotlib>=3.8,<4",
        "tqdm>=4.66,<5",
        "psutil>=5.9,<8",
        "safetensors>=0.4.3,<1",
        "transformers>=5.0,<6",
        "tensorboard>=2.15,<3",
    ],
    # wandb: --wandb-project (megatron/wandb_writer.py); without it a run that asks says so and trains on. The
    # test extra has it too, so that CI runs the offline wandb test (tests/test_wandb.py) instead of skipping it.
    extras_require={"wandb": ["wandb>=0.19,<1"],
                    "test": ["pytest>=8,<10", "pytest-timeout>=2.3", "pytest-xdist>=3.5,<4", "wandb>=0.19,<1"]},
    ext_modules=[helpers_extension],
    cmdclass={"build_ext": build_ext},
)
