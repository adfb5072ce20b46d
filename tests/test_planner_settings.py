"""megatron/launch/settings.py, the launch planner's training settings: for each case, the pretrain_gpt.py flags
(with the variable behind each) or the one-line error that the shell (scripts/defaults.sh) gave when it held these
rules in bash (tests/fixtures/launch_settings.json, recorded from it before the planner)."""
import json
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, test_env
from megatron.launch.settings import LaunchError, training_settings

RECORDED = json.loads((REPO_ROOT / "tests" / "fixtures" / "launch_settings.json").read_text())

JSONS = {
    "micro_clip.json": {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.5},
    "bf16.json": {"bf16": {"enabled": True}},
    "optimizer.json": {"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}},
    "list.json": [1, 2],
    "batch.json": {"train_batch_size": 16},
}

CASES = [  # (name, variables, accelerator, world, model size, ALCF's names)
    ("cpu defaults", {}, "cpu", 2, "tiny", False),
    ("cuda defaults", {}, "cuda", 1, "125M", False),
    ("global batch", {"MICRO_BATCH": "2", "GLOBAL_BATCH": "16"}, "cpu", 2, "tiny", False),
    ("accumulation", {"GAS": "3"}, "cpu", 2, "tiny", False),
    ("global and accumulation disagree", {"GLOBAL_BATCH": "16", "GAS": "3"}, "cpu", 2, "tiny", False),
    ("global not divisible", {"GLOBAL_BATCH": "15"}, "cpu", 2, "tiny", False),
    ("tensor parallel", {"TP": "2", "SP": "1"}, "cpu", 4, "tiny", False),
    ("tensor parallel too large", {"TP": "4"}, "cpu", 2, "tiny", False),
    ("ALCF names", {"MPSIZE": "2", "DTYPE": "bf16", "DATA_SPLIT": "98,2,0", "LR_WARMUP_FRAC": "0.02"}, "cpu", 4,
     "tiny", True),
    ("ALCF names disagree", {"TP": "2", "MPSIZE": "4"}, "cpu", 4, "tiny", True),
    ("fp16 on cpu", {"PRECISION": "fp16"}, "cpu", 2, "tiny", False),
    ("fp16 on cuda", {"PRECISION": "fp16"}, "cuda", 8, "1.3B", False),
    ("length twice", {"TRAIN_ITERS": "5", "TRAIN_EPOCHS": "1"}, "cpu", 2, "tiny", False),
    ("epochs", {"TRAIN_EPOCHS": "2"}, "cpu", 2, "tiny", False),
    ("bad number", {"MIN_LR": "x"}, "cpu", 2, "tiny", False),
    ("bad fraction", {"ADAM_BETA2": "1.5"}, "cpu", 2, "tiny", False),
    ("bad port", {"MASTER_PORT": "70000"}, "cpu", 2, "tiny", False),
    ("bad int", {"SEQ_LEN": "0"}, "cpu", 2, "tiny", False),
    ("bad split", {"SPLIT": "1,2,3,4"}, "cpu", 2, "tiny", False),
    ("json micro and clip", {"DS_CONFIG": "micro_clip.json"}, "cpu", 2, "tiny", False),
    ("json micro with global", {"DS_CONFIG": "micro_clip.json", "GLOBAL_BATCH": "8"}, "cpu", 2, "tiny", False),
    ("json micro with accumulation", {"DS_CONFIG": "micro_clip.json", "GAS": "2"}, "cpu", 2, "tiny", False),
    ("json bf16 without precision", {"DS_CONFIG": "bf16.json"}, "cpu", 2, "tiny", False),
    ("json bf16 against fp32", {"DS_CONFIG": "bf16.json", "PRECISION": "fp32"}, "cpu", 2, "tiny", False),
    ("json optimizer", {"DS_CONFIG": "optimizer.json"}, "cpu", 2, "tiny", False),
    ("json list", {"DS_CONFIG": "list.json"}, "cpu", 2, "tiny", False),
    ("json batch", {"DS_CONFIG": "batch.json"}, "cpu", 2, "tiny", False),
    ("json missing", {"DS_CONFIG": "nowhere.json"}, "cpu", 2, "tiny", False),
    ("weighted data", {"DATA_PATH": "0.3 /d/a_text_document 0.7 /d/b_text_document"}, "cpu", 2, "tiny", False),
    ("wandb, checkpointing, pipeline", {"WANDB_PROJECT": "p", "USE_ACTIVATION_CHECKPOINTING": "1", "PP": "2"},
     "cpu", 2, "tiny", False),
    ("GPT-3 175B rates", {}, "cuda", 8, "175B", False),
    ("flags given", {"LR": "1e-3", "CLIP_GRAD": "0", "EVAL_ITERS": "0", "LOG_INTERVAL": "1"}, "cpu", 2, "tiny", False),
]
IDS = [case[0] for case in CASES]


def case_env(tmp_path, variables):
    for file, content in JSONS.items():
        (tmp_path / file).write_text(json.dumps(content))
    return {key: str(tmp_path / value) if key == "DS_CONFIG" else value for key, value in variables.items()}


def normalised(text: str, tmp_path) -> str:
    return text.replace(str(tmp_path), "<tmp>").replace(str(REPO_ROOT), "<repo>")


def test_every_case_was_recorded():
    assert sorted(RECORDED) == sorted(IDS)


@pytest.mark.parametrize("name, variables, accelerator, world, model_size, alcf", CASES, ids=IDS)
def test_the_planners_settings_equal_the_recorded_shells(tmp_path, name, variables, accelerator, world, model_size,
                                                         alcf):
    recorded = RECORDED[name]
    env = case_env(tmp_path, variables)
    try:
        settings = training_settings(env, accelerator=accelerator, world=world, model_size=model_size, alcf_names=alcf)
    except LaunchError as error:
        assert recorded["status"] == 1 and normalised(f"error: {error}", tmp_path) == recorded["error"]
        return
    assert recorded["status"] == 0, recorded
    assert [normalised(flag, tmp_path) for flag in settings.flags] == recorded["flags"]
    assert settings.sources == recorded["sources"]


def test_the_planner_imports_no_torch():
    """A dry run is one light process: the planner, its paths and what they import leave torch out."""
    code = ("import sys, megatron.launch.cli; "
            "print(sorted(name for name in sys.modules if name.split('.')[0] in ('torch', 'deepspeed', 'numpy')))")
    result = subprocess.run([sys.executable, "-c", code],
                            cwd=REPO_ROOT, env=test_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
