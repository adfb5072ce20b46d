"""A user's own DeepSpeed JSON (DS_CONFIG) through the Z1 driver on 2 CPU ranks: every key it sets is kept,
zero-lab's tuned communication keys fill what it leaves out (one line names them), and the comm line's prediction
reads the config the run uses: fp32 ZeRO-1 sends 4 bytes per parameter with the owner reduction, 6 with
DeepSpeed's multi-rank bucket all-reduce (docs/zero-tradeoff-reference.md)."""
import json
import re
import subprocess

import pytest

from conftest import REPO_ROOT, driver_env

pytestmark = pytest.mark.slow

ITERS = 2


def run_z1(dolly_data_dir, tmp_path, user: dict):
    path = tmp_path / "my_ds.json"
    path.write_text(json.dumps(user))
    env = driver_env(dolly_data_dir, tmp_path / "runs", DS_CONFIG=path, TRAIN_ITERS=ITERS, EVAL_ITERS=0,
                     ZERO_LAB_SKIP_PROBES=1)
    del env["TRAIN_EPOCHS"], env["MICRO_BATCH"]  # the JSON gives the micro-batch
    result = subprocess.run(["bash", str(REPO_ROOT / "examples_zero" / "gpt_deepspeed_Z1.sh"), "--save", ""],
                            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert json.loads(path.read_text()) == user  # the user's file is never changed
    run = tmp_path / "runs" / "gpt_tiny_Z1"
    log = (run / "train.log").read_text()
    comm = re.findall(r"comm at iteration +\d+ \|.* total=(\S+)MB \| bytes/param=(\S+) \| predicted=(\S+)MB", log)
    assert len(comm) == ITERS, log[-3000:]
    total, per_param, predicted = comm[-1]
    return log, json.loads((run / "ds_config.json").read_text()), float(total), float(per_param), float(predicted)


def test_a_json_of_batch_sizes_and_stage_gets_the_tuned_keys_and_sends_what_is_predicted(dolly_data_dir, tmp_path):
    user = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1}}
    log, used, total, per_param, predicted = run_z1(dolly_data_dir, tmp_path, user)
    zero = used["zero_optimization"]
    assert (zero["stage"], zero["reduce_scatter"], zero["use_multi_rank_bucket_allreduce"]) == (1, True, False)
    assert used["train_micro_batch_size_per_gpu"] == 4
    added = re.findall(r"^ > --deepspeed_config \S+my_ds\.json leaves out (\d+) key\(s\) zero-lab tunes; added: "
                       r"(.*) \(set a key in the JSON to keep your own value\)$", log, re.M)
    assert len(added) == 1, log[:3000]
    count, keys = added[0]
    assert sorted(keys.split(", ")) == ["timers"] + [f"zero_optimization.{key}" for key in sorted(zero) if key != "stage"]
    assert int(count) == len(zero) and "zero_optimization.reduce_bucket_size" in keys
    assert used["timers"] == {"throughput": {"enabled": False}}  # DeepSpeed's timer synchronizes at every step
    # ZeRO-1 in fp32 over 2 ranks: a reduce and an all-gather of half the 4-byte model each
    assert per_param == 4.0 and total == pytest.approx(predicted, abs=2e-3)


def test_a_key_the_json_sets_is_kept_and_the_prediction_follows_it(dolly_data_dir, tmp_path):
    user = {"train_micro_batch_size_per_gpu": 4,
            "zero_optimization": {"stage": 1, "use_multi_rank_bucket_allreduce": True}}
    log, used, total, per_param, predicted = run_z1(dolly_data_dir, tmp_path, user)
    assert used["zero_optimization"]["use_multi_rank_bucket_allreduce"] is True
    assert "zero_optimization.use_multi_rank_bucket_allreduce" not in re.search(r"added: (.*)", log).group(1)
    # DeepSpeed all-reduces every bucket: the gradients' share twice, then the all-gather
    assert per_param == 6.0 and total == pytest.approx(predicted, abs=2e-3)


def test_the_jsons_communication_dtype_sets_the_gradients_bytes_in_the_prediction(dolly_data_dir, tmp_path):
    user = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1}, "communication_data_type": "bf16"}
    log, used, total, per_param, predicted = run_z1(dolly_data_dir, tmp_path, user)
    assert used["communication_data_type"] == "bf16"
    # the gradients reduced to their owners in bf16 (2 bytes for half the model), the fp32 parameters gathered (4)
    assert per_param == 3.0 and total == pytest.approx(predicted, abs=2e-3)
