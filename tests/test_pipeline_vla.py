"""OpenVLA-OFT (a tiny checkpoint in the public layout) through the whole pipeline: rgb PickCube,
LoRA under FSDP2 on 2 gloo ranks, adapter-only weight sync to the rollout workers."""

import math
import subprocess
import sys

import pytest
import torch

from embodied import checkpoint
from tests.test_pipeline import embodied, scalars

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_vla(tmp_path_factory):
    path = tmp_path_factory.mktemp("vla") / "tiny-openvla-oft"
    subprocess.run([sys.executable, "-m", "policies.openvla_oft.tiny", str(path), "--image-size", "56"],
                   check=True, capture_output=True, timeout=300)
    return path


def vla_args(out, model_path, name):
    return [
        f"actor.model.model_path={model_path}", "actor.model.unnorm_key=tiny_dataset",
        f"runner.output_dir={out}", f"runner.experiment_name={name}", "runner.val_check_interval=-1",
        "runner.save_interval=1",
        "env.train.total_num_envs=4", "env.train.max_episode_steps=16",
        "env.eval.total_num_envs=4", "env.eval.max_episode_steps=16",
        "env.train.init_params.camera_heights=64", "env.train.init_params.camera_widths=64",
        "env.eval.init_params.camera_heights=64", "env.eval.init_params.camera_widths=64",
        "actor.global_batch_size=8", "actor.micro_batch_size=4",  # one minibatch: 4 envs x 2 chunks
    ]


def lora_weights(step_dir):
    state = torch.load(step_dir / "actor" / "model.pt", weights_only=True)
    return {k: v for k, v in state.items() if ".lora_B." in k}


def test_ppo_lora_trains_and_the_rollout_acts_with_the_new_adapter(tmp_path, tiny_vla):
    result, _ = embodied("train", ["--config-name", "maniskill_ppo_openvla_oft", "runner.max_epochs=2",
                                   *vla_args(tmp_path, tiny_vla, "ppo")], timeout=900)
    assert result["env_steps"] == 2 * 4 * 16
    log = tmp_path / "ppo"
    assert all(math.isfinite(v) for v in scalars(log, "actor/total_loss").values())
    assert all(math.isfinite(v) for v in scalars(log, "critic/value_loss").values())
    steps = checkpoint.list_checkpoints(log / "checkpoints")
    first, second = lora_weights(steps[0]), lora_weights(steps[1])
    assert first and first.keys() == second.keys()
    assert any(not torch.equal(first[k], second[k]) for k in first)  # the adapters trained
    # Step 2's batch was collected by the rollout workers after the step-1 update: the actor's
    # first forward (before any step-2 update) reproduces their log-probs only if the rollout
    # received the updated adapters.
    assert scalars(log, "actor/ratio")[2] == pytest.approx(1.0, abs=1e-4)


def test_grpo_lora_step_runs(tmp_path, tiny_vla):
    args = vla_args(tmp_path, tiny_vla, "grpo") + ["runner.max_epochs=1", "algorithm.group_size=2"]
    result, _ = embodied("train", ["--config-name", "maniskill_grpo_openvla_oft", *args], timeout=900)
    assert result["env_steps"] == 4 * 16
    assert math.isfinite(scalars(tmp_path / "grpo", "actor/total_loss")[1])
