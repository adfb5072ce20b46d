"""env.json of a run folder: versions, accelerator, world size, host and git commit (runs/README.md)."""
import json
import os
import platform
import socket
import subprocess
from pathlib import Path

import deepspeed
import torch

from megatron.initialize import DistInfo


def _git_commit(repo: Path) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None  # not a checkout (e.g. an installed copy): recorded as null
    return out.stdout.strip()


def environment_record(dist_info: DistInfo) -> dict:
    from deepspeed.accelerator import get_accelerator
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "cuda": torch.version.cuda,
        "accelerator": get_accelerator().device_name(),
        "device_name": torch.cuda.get_device_name(dist_info.device) if dist_info.on_cuda else platform.processor()
        or platform.machine(),
        "world_size": dist_info.world_size,
        "hostname": socket.gethostname(),
        "git_commit": _git_commit(Path(__file__).resolve().parent.parent),
    }


def write_environment_record(run_dir: str, dist_info: DistInfo) -> Path:
    target = Path(run_dir) / "env.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".env.json.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(environment_record(dist_info), indent=2) + "\n")
    os.replace(tmp, target)
    return target
