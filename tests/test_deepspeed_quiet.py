"""megatron/deepspeed_quiet.py: DeepSpeed's console lines that tell a zero-lab user nothing are dropped, and only
those (issue 56, item 10). The real runs' consoles are checked in tests/test_moe.py."""
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, test_env
from megatron.deepspeed_quiet import EXPERT_GROUP_CREATED, SHM_OP_LOADED, gpu_installed, without_lines


def test_only_the_named_lines_are_dropped_and_the_rest_passes_as_printed(capsys):
    with without_lines(SHM_OP_LOADED, EXPERT_GROUP_CREATED):
        print("before")
        print(SHM_OP_LOADED)
        print(f"{EXPERT_GROUP_CREATED}ep_size_2")
        print("DeepSpeed cpu_adam built with errors")  # another line of DeepSpeed's: kept
        sys.stdout.write("a line in ")
        sys.stdout.write("two writes\nand the end without a newline")
    assert capsys.readouterr().out == ("before\nDeepSpeed cpu_adam built with errors\na line in two writes\n"
                                       "and the end without a newline")


def test_stdout_is_given_back_when_the_call_inside_fails(capsys):
    original = sys.stdout
    with pytest.raises(RuntimeError), without_lines(SHM_OP_LOADED):
        print("what came before the error")
        raise RuntimeError("init_distributed failed")
    assert sys.stdout is original
    assert capsys.readouterr().out == "what came before the error\n"


@pytest.mark.skipif(gpu_installed(), reason="a GPU is installed here: DeepSpeed's warning is kept (a broken driver)")
def test_deepspeeds_cpu_warning_is_not_printed_on_a_machine_without_a_gpu():
    """DeepSpeed warned `Setting accelerator to CPU. If you have GPU ...` at the top of every tool when DS_ACCELERATOR
    was unset; any import of megatron drops it where no GPU is installed."""
    env = test_env()
    env.pop("DS_ACCELERATOR")
    code = "import megatron.arguments, deepspeed; print(deepspeed.get_accelerator().device_name())"
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=120)
    # DeepSpeed's logger writes to stdout
    assert result.returncode == 0 and result.stdout == "cpu\n", result.stdout + result.stderr
    assert "Setting accelerator to CPU" not in result.stderr
    # DeepSpeed alone still says it
    alone = subprocess.run([sys.executable, "-c", "import deepspeed"], env=env, cwd=REPO_ROOT, capture_output=True,
                           text=True, timeout=120)
    assert "Setting accelerator to CPU" in alone.stdout
