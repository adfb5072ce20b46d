"""A user's DeepSpeed JSON (`--deepspeed_config`) and the flags that say the same things: one rule for every key.

For each setting both can give (the ZeRO stage, CPU offload of the optimizer and of the parameters, NVMe
offload, bf16, fp16 and its loss scale and hysteresis, the batch sizes, gradient clipping):
- only the JSON gives it: the JSON's value is the run's;
- only the flag gives it: the flag's value is written into the JSON the run uses;
- both give it: they must agree, else the run is refused in one line naming the flag and the JSON key.

The JSON's "optimizer" and "scheduler" sections are refused: the run passes its own AdamW and LR schedule,
built from the flags, to deepspeed.initialize, so the JSON's would be ignored and the run would train with
a learning rate other than the one the file asks for.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from megatron.errors import ZeroLabError


class DeepSpeedJSONError(ZeroLabError, ValueError):
    """A DeepSpeed JSON that cannot be read, or that disagrees with a flag; the message names both."""


MISSING = object()  # neither side gives the setting


def read_deepspeed_json(path: str | None) -> dict:
    if path is None:
        return {}
    try:
        config = json.loads(Path(path).read_text())
    except OSError as err:
        raise DeepSpeedJSONError(f"--deepspeed_config {path}: cannot read ({err.strerror})") from err
    except json.JSONDecodeError as err:
        raise DeepSpeedJSONError(f"--deepspeed_config {path}: line {err.lineno}: not valid JSON ({err.msg})") from err
    if not isinstance(config, dict):
        raise DeepSpeedJSONError(f"--deepspeed_config {path}: expected a JSON object, got {type(config).__name__}")
    return config


# The JSON sections the flags replace: (the flags to use instead, the drivers' variables that set them).
UNUSED_SECTIONS = {
    "optimizer": ("zero-lab builds AdamW from --lr, --adam-beta1, --adam-beta2, --adam-eps, --weight-decay",
                  "LR, ADAM_BETA1, ADAM_BETA2, WEIGHT_DECAY"),
    "scheduler": ("zero-lab's LR schedule comes from --lr, --lr-decay-style, --lr-warmup-fraction/--lr-warmup-iters, "
                  "--min-lr", "LR, LR_DECAY_STYLE, LR_WARMUP_FRACTION, MIN_LR"),
}


def _summary(section) -> str:
    """E.g. "AdamW, lr 0.0003": the section's type and every parameter that is a learning rate."""
    if not isinstance(section, dict):
        return repr(section)
    params = section.get("params") if isinstance(section.get("params"), dict) else {}
    parts = [str(section.get("type", "no type"))]
    parts += [f"{key} {value}" for key, value in params.items() if "lr" in key.lower()]
    return ", ".join(parts)


def refuse_unused_sections(config: dict, path: str) -> None:
    """Refuse a JSON whose optimizer or scheduler would be silently replaced by the flags' (one line each)."""
    for name, (instead, variables) in UNUSED_SECTIONS.items():
        if name in config:
            raise DeepSpeedJSONError(f'--deepspeed_config {path}: its "{name}" section ({_summary(config[name])}) is '
                                     f"not used: {instead} (the drivers' {variables}): remove the section and set "
                                     "those")


def _get(config: dict, path: tuple[str, ...]):
    for key in path:
        if not isinstance(config, dict) or key not in config:
            return MISSING
        config = config[key]
    return config


def _set(config: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        config = config.setdefault(key, {})
    config[path[-1]] = value


def _offload_device(section: str) -> Callable[[dict], Any]:
    """A CPU offload as the JSON states it: True for device "cpu", False for any other device."""
    def read(config: dict):
        device = _get(config, ("zero_optimization", section, "device"))
        return MISSING if device is MISSING else device == "cpu"
    return read


_OFFLOADS = ("offload_optimizer", "offload_param")


def _nvme_path(config: dict):
    """The NVMe folder when both offloads go to NVMe; "" when the JSON offloads elsewhere."""
    devices = [_get(config, ("zero_optimization", section, "device")) for section in _OFFLOADS]
    if all(device is MISSING for device in devices):
        return MISSING
    if devices != ["nvme", "nvme"]:
        return ""
    return _get(config, ("zero_optimization", "offload_param", "nvme_path"))


def _write_nvme(config: dict, path: str) -> None:
    for section in _OFFLOADS:
        _set(config, ("zero_optimization", section), {"device": "nvme", "nvme_path": path})


@dataclass(frozen=True)
class SharedSetting:
    flag: str
    dest: str  # the argparse destination; its value None or False means the flag was not given
    path: tuple[str, ...]  # the JSON key a message shows
    read: Callable[[dict], Any]  # the JSON's value, as the flag would give it, or MISSING
    write: Callable[[dict, Any], None]


def _plain(flag: str, dest: str, *path: str) -> SharedSetting:
    return SharedSetting(flag, dest, path, lambda config: _get(config, path),
                         lambda config, value: _set(config, path, value))


def _cpu_offload(flag: str, dest: str, section: str) -> SharedSetting:
    return SharedSetting(flag, dest, ("zero_optimization", section, "device"), _offload_device(section),
                         lambda config, _: _set(config, ("zero_optimization", section), {"device": "cpu"}))


SHARED_SETTINGS = (
    _plain("--zero-stage", "zero_stage", "zero_optimization", "stage"),
    _cpu_offload("--zero-offload-optimizer", "zero_offload_optimizer", "offload_optimizer"),
    _cpu_offload("--zero-offload-params", "zero_offload_params", "offload_param"),
    SharedSetting("--zero-nvme-path", "zero_nvme_path", ("zero_optimization", "offload_param", "nvme_path"),
                  _nvme_path, _write_nvme),
    _plain("--bf16", "bf16", "bf16", "enabled"),
    _plain("--fp16", "fp16", "fp16", "enabled"),
    _plain("--micro-batch-size", "micro_batch_size", "train_micro_batch_size_per_gpu"),
    _plain("--global-batch-size", "global_batch_size", "train_batch_size"),
    _plain("--clip-grad", "clip_grad", "gradient_clipping"),
    _plain("--loss-scale", "loss_scale", "fp16", "loss_scale"),
    _plain("--hysteresis", "hysteresis", "fp16", "hysteresis"),
)


def _stated(config: dict, setting: SharedSetting) -> str:
    """What the JSON says for a setting, as written there (for the nvme folder: its device when not NVMe)."""
    path = setting.path
    if setting.dest == "zero_nvme_path" and _get(config, path) is MISSING:
        path = ("zero_optimization", "offload_param", "device")
        if _get(config, path) is MISSING:
            path = ("zero_optimization", "offload_optimizer", "device")
    return f"{'.'.join(path)} {_get(config, path)!r}"


def merge_flags(user: dict, flags: dict, path: str) -> tuple[dict, dict]:
    """(the JSON the run uses, each shared setting's value by dest) from the user's JSON and the flags'
    values by dest (None or False: not given). MISSING where neither gives a setting."""
    merged = json.loads(json.dumps(user))  # a deep copy; the user's file is never changed
    values = {}
    for setting in SHARED_SETTINGS:
        flag_value, json_value = flags.get(setting.dest), setting.read(user)
        given = flag_value is not None and flag_value is not False
        if given and json_value is not MISSING and json_value != flag_value:
            shown = "" if flag_value is True else f" {flag_value}"
            raise DeepSpeedJSONError(f"{setting.flag}{shown} disagrees with {_stated(user, setting)} in "
                                     f"--deepspeed_config {path}: drop one of them or make them agree")
        if given and json_value is MISSING:
            setting.write(merged, flag_value)
        values[setting.dest] = flag_value if given else json_value
    return merged, values
