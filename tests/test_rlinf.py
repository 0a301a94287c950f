"""RLinf's experiment files come across (embodied/config/rlinf.py, docs/rlinf.md), and the config
layer's messages for a misspelled key, a misspelled config name and a defaults list that
cannot be composed.

The RLinf configs below are written here in RLinf's published format (their groups, their
``hydra/job_logging`` override and ``$EMBODIED_PATH`` search path, their key names): a ManiSkill
PPO OpenVLA-OFT experiment in v0.1's style, a LIBERO GRPO OpenVLA-OFT one in the current style,
and math GRPO experiments in both styles."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import stand_in_assets
from omegaconf import OmegaConf

from embodied import cli
from embodied.config import rlinf
from embodied.config import compose
from embodied.config.schema import CONFIG_DIR, leaves

SHIPPED = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml") if p.stem != "base")
HEADER = """defaults:
{groups}  - override hydra/job_logging: stdout

hydra:
  run:
    dir: .
  output_subdir: null
  searchpath:
    - file://${{oc.env:EMBODIED_PATH}}/config/
"""

OFT_MODEL = """model_type: "openvla_oft"
{version}model_path: "/path/to/model/oft/"
precision: "bf16"
value_type: action_level
action_dim: 7
num_action_chunks: 8
use_proprio: False
unnorm_key: bridge_orig
center_crop: True
add_value_head: False
is_lora: False
lora_rank: 32
lora_path: null
num_images_in_input: 1
attn_implementation: "sdpa"
low_cpu_mem_usage: True
trust_remote_code: True
policy_setup: "widowx_bridge"
"""

FSDP_V01 = """strategy: "fsdp"
sharding_strategy: "full_shard"
gradient_checkpointing: False
cpu_offload: False
offload_pin_memory: False
reshard_after_forward: True
enable_gradient_accumulation: True
forward_prefetch: False
limit_all_gathers: False
backward_prefetch: null
use_orig_params: False
use_liger_kernel: False
fsdp_size: -1
mixed_precision:
  param_dtype: null
  reduce_dtype: null
  buffer_dtype: null
amp:
  enabled: False
  precision: "bf16"
  use_grad_scaler: False
"""

FSDP_CURRENT = FSDP_V01.replace("""amp:
  enabled: False
  precision: "bf16"
  use_grad_scaler: False
""", """amp_autocast:
  enabled: False
  precision: "bf16"
grad_scaler:
  enabled: False
""").replace("forward_prefetch: False", "forward_prefetch: True")

MANISKILL_SCENE_V01 = """simulator_type: maniskill
total_num_envs: null
auto_reset: False
ignore_terminations: False
use_rel_reward: True
reward_mode: raw
seed: 0
group_size: 1
use_fixed_reset_state_ids: False
max_steps_per_rollout_epoch: 80
max_episode_steps: 80
video_cfg:
  save_video: False
  info_on_video: True
  video_base_dir: ${runner.logger.log_path}/video/train
init_params:
  id: "PutOnPlateInScene25Main-v3"
  num_envs: null
  obs_mode: "rgb+segmentation"
  control_mode: null
  sim_backend: "gpu"
  sim_config:
    sim_freq: 500
    control_freq: 5
  max_episode_steps: ${env.train.max_episode_steps}
  sensor_configs:
    shader_pack: "default"
  render_mode: all
  obj_set: train
"""

MANISKILL_PPO_V01 = HEADER.format(groups="""  - env/maniskill_scene@env.train
  - env/maniskill_scene@env.eval
  - model/openvla_oft@actor.model
  - training_backend/fsdp@actor.fsdp_config
""") + """
cluster:
  num_nodes: 1
  component_placement:
    actor: 0-1
    env: 0
    rollout: 1

runner:
  task_type: embodied
  logger:
    log_path: "{out}"
    project_name: rlinf
    experiment_name: "maniskill_ppo"
    logger_backends: ["tensorboard"]
  max_epochs: 100
  max_steps: -1
  only_eval: False
  eval_policy_path: null
  val_check_interval: -1
  save_interval: 40
  seq_length: 4096
  max_prompt_length: 30
  resume_dir: null

algorithm:
  normalize_advantages: True
  kl_penalty: kl
  group_size: 1
  rollout_epoch: 1
  eval_rollout_epoch: 1
  reward_type: action_level
  logprob_type: token_level
  entropy_type: token_level
  adv_type: gae
  loss_type: actor_critic
  loss_agg_func: "token-mean"
  bootstrap_type: always
  kl_beta: 0.0
  entropy_bonus: 0
  clip_ratio_high: 0.28
  clip_ratio_low: 0.2
  clip_ratio_c: 3.0
  value_clip: 0.2
  huber_delta: 10.0
  gamma: 0.99
  gae_lambda: 0.95
  sampling_params:
    do_sample: True
    temperature_train: 1.0
    temperature_eval: 0.6
    top_k: 0
    top_p: 1.0
    repetition_penalty: 1.0
  length_params:
    max_new_token: null
    max_length: 1024
    min_length: 1

env:
  group_name: "EnvGroup"
  channel:
    name: "env_buffer_list"
    queue_name: "obs_buffer"
    queue_size: 0
  enable_offload: False
  train:
    total_num_envs: 16
    auto_reset: True
    max_episode_steps: 80
    max_steps_per_rollout_epoch: 160
  eval:
    total_num_envs: 8
    auto_reset: True
    ignore_terminations: True
    max_episode_steps: 80
    max_steps_per_rollout_epoch: 80
    use_fixed_reset_state_ids: True

rollout:
  group_name: "RolloutGroup"
  channel:
    name: ${env.channel.name}
    queue_name: "action_buffer"
    queue_size: 0
  mode: "colocate"
  backend: "huggingface"
  enable_offload: True
  pipeline_stage_num: 1
  model:
    model_path: "/path/to/model/oft/"
    precision: ${actor.model.precision}

actor:
  group_name: "ActorGroup"
  channel:
    name: ${env.channel.name}
    queue_name: "replay_buffer"
    queue_size: 0
  training_backend: "fsdp"
  micro_batch_size: 8
  global_batch_size: 64
  seed: 1234
  enable_offload: True
  model:
    model_path: "/path/to/model/oft/"
    model_type: "openvla_oft"
    unnorm_key: bridge_orig
    add_value_head: True
    is_lora: True
    lora_rank: 16
    lora_path: ${oc.env:RLINF_TEST_LORA_DIR}
  optim:
    lr: 1.0e-4
    value_lr: 3.0e-3
    clip_grad: 10.0
    critic_warmup_steps: 0
  tokenizer:
    tokenizer_type: "HuggingFaceTokenizer"
    tokenizer_model: "/path/to/model/oft/"
    use_fast: False
    trust_remote_code: True
    padding_side: "right"
  fsdp_config:
    strategy: "fsdp"
    gradient_checkpointing: True
    mixed_precision:
      param_dtype: ${actor.model.precision}
      reduce_dtype: ${actor.model.precision}
      buffer_dtype: ${actor.model.precision}
    amp:
      enabled: True

reward:
  use_reward_model: False

critic:
  use_critic_model: False
"""

LIBERO_SUITE = """env_type: libero
task_suite_name: libero_10
total_num_envs: null
auto_reset: False
ignore_terminations: False
max_steps_per_rollout_epoch: 512
max_episode_steps: 512
use_fixed_reset_state_ids: True
use_ordered_reset_state_ids: False
specific_reset_id: null
use_rel_reward: True
reward_coef: 5.0
reset_gripper_open: True
is_eval: False
seed: 0
group_size: 1
video_cfg:
  save_video: False
  info_on_video: True
  video_base_dir: ${runner.logger.log_path}/video/train
init_params:
  camera_heights: 256
  camera_widths: 256
"""

PATCH_SYNCER = """type: patch
patch:
  snapshot_device: cpu
  delta_encoding: True
  compression: none
"""

LIBERO_GRPO_CURRENT = HEADER.format(groups="""  - env/libero_10@env.train
  - env/libero_10@env.eval
  - model/openvla_oft@actor.model
  - hybrid_engines/fsdp@actor.fsdp_config
  - weight_syncer/patch_syncer@weight_syncer
""") + """
cluster:
  num_nodes: 1
  component_placement:
    actor,env,rollout: all

runner:
  task_type: embodied
  logger:
    log_path: "{out}"
    project_name: rlinf
    experiment_name: "libero_10_grpo"
    logger_backends: ["tensorboard"]
  max_epochs: 200
  max_steps: -1
  only_eval: False
  val_check_interval: -1
  save_interval: 25
  resume_dir: null
  ckpt_path: null

algorithm:
  normalize_advantages: True
  kl_penalty: kl
  group_size: 4
  reward_type: action_level
  logprob_type: token_level
  entropy_type: token_level
  adv_type: grpo
  loss_type: actor
  loss_agg_func: "token-mean"
  kl_beta: 0.0
  entropy_bonus: 0
  clip_ratio_high: 0.28
  clip_ratio_low: 0.2
  clip_ratio_c: 3.0
  value_clip: 0.2
  huber_delta: 10.0
  gamma: 0.99
  gae_lambda: 0.95
  reward_coef: 5.0
  filter_rewards: True
  rewards_lower_bound: 1.0
  rewards_upper_bound: 4.0

env:
  group_name: "EnvGroup"
  train:
    rollout_epoch: 2
    total_num_envs: 16
    group_size: ${algorithm.group_size}
    max_steps_per_rollout_epoch: 512
    max_episode_steps: 512
    use_fixed_reset_state_ids: True
    use_ordered_reset_state_ids: True
    reset_gripper_open: False
    enable_offload: False
  eval:
    rollout_epoch: 1
    total_num_envs: 16
    auto_reset: True
    ignore_terminations: True
    max_episode_steps: 512
    max_steps_per_rollout_epoch: 512
    group_size: 1
    use_fixed_reset_state_ids: True
    use_ordered_reset_state_ids: True
    reset_gripper_open: False
    is_eval: True
    enable_offload: False

rollout:
  sampling_params:
    do_sample: True
    temperature_train: 1.6
    temperature_eval: 1.6
    top_k: -1
    top_p: 1.0
    repetition_penalty: 1.0
  group_name: "RolloutGroup"
  generation_backend: "huggingface"
  enable_offload: True
  pipeline_stage_num: 1
  model:
    model_path: "/path/to/model/oft/"
    precision: ${actor.model.precision}

actor:
  group_name: "ActorGroup"
  training_backend: "fsdp"
  micro_batch_size: 16
  global_batch_size: 512
  seed: 1234
  enable_offload: True
  model:
    model_path: "/path/to/model/oft/"
    model_type: "openvla_oft"
    max_prompt_length: 64
  optim:
    lr: 2.0e-5
    value_lr: 3.0e-3
    adam_beta1: 0.9
    adam_beta2: 0.999
    adam_eps: 1.0e-08
    weight_decay: 0.01
    clip_grad: 1.0
  fsdp_config:
    strategy: "fsdp"
    gradient_checkpointing: True
    mixed_precision:
      param_dtype: ${actor.model.precision}
      reduce_dtype: ${actor.model.precision}
      buffer_dtype: ${actor.model.precision}

reward:
  use_reward_model: False

critic:
  use_critic_model: False
"""

MATH_GRPO = """defaults:
{groups}  - override hydra/job_logging: stdout

hydra:
  run:
    dir: .
  output_subdir: null

cluster:
  num_nodes: 1
  component_placement:
    actor,rollout,reward: all

runner:
  task_type: reasoning
  logger:
    log_path: ${{runner.output_dir}}/${{runner.experiment_name}}
    project_name: rlinf
    experiment_name: ${{runner.experiment_name}}
    logger_backends: ["tensorboard"]
  max_epochs: 3
  max_steps: -1
  val_check_interval: 1
  save_interval: 50
  seq_length: 24
  enable_dynamic_batch_size: False
  max_tokens_per_mbs: 4096
  resume_dir: null
  experiment_name: grpo-tiny
  output_dir: {out}

algorithm:
  group_size: 4
  n_minibatches: 2
  training_batch_size_per_gpu: 2
  rollout_batch_size_per_gpu: null
  logprob_forward_micro_batch_size: 1
  val_rollout_batch_size_per_gpu: 4
  recompute_logprobs: True
  shuffle_rollout: True
  loss_type: actor
  loss_agg_func: "token-mean"
  kl_beta: 0.0
  kl_penalty_type: k3
  ratio_clip_eps: 0.2
  entropy_bonus: 0.0
  calculate_entropy: False
  clip_ratio_c: null
  clip_ratio_low: null
  clip_ratio_high: null
  adv_type: grpo
  normalize_advantages: True
  early_stop_imp_ratio: 5.0
  use_valid_token_scale: False
  sampling_params:
    do_sample: True
    temperature: 0.9
    top_k: 1000000
    top_p: 1.0
    repetition_penalty: 1.0
    max_new_tokens: ${{subtract:${{runner.seq_length}}, ${{data.max_prompt_length}}}}
    min_new_tokens: 1

rollout:
  group_name: "RolloutGroup"
  gpu_memory_utilization: 0.55
  model:
    model_path: {model}
    model_type: qwen2.5
    precision: fp16  # rollouts in fp16 beside an fp32 actor, as RLinf's math configs do
  enforce_eager: False
  distributed_executor_backend: mp
  disable_log_stats: False
  detokenize: False
  padding: null
  eos: null
  rollout_backend: vllm
  sglang:
    attention_backend: triton
    decode_log_interval: 500000
    use_torch_compile: False
    torch_compile_max_bs: 128
  vllm:
    attention_backend: FLASH_ATTN
    enable_chunked_prefill: True
    enable_prefix_caching: True
  return_logprobs: ${{not:${{algorithm.recompute_logprobs}}}}
  tensor_parallel_size: 1
  pipeline_parallel_size: 1
  validate_weight: False
  validate_save_dir: null
  print_outputs: False
  max_running_requests: 64
  cuda_graph_max_bs: 128

data:
  type: math
  dataset_name: boba
  max_prompt_length: 8
  filter_prompt_by_length: True
  rollout_batch_size: 8
  val_rollout_batch_size: null
  num_workers: 2
  shuffle: True
  validation_shuffle: True
  seed: 1234
  train_data_paths: ["{data}/train.jsonl"]
  val_data_paths: ["{data}/test.jsonl"]
  prompt_key: prompt
  answer_key: answer
  apply_chat_template: False

actor:
  group_name: "ActorGroup"
  training_backend: fsdp
  mcore_gpt: True
  spec_name: decoder_gpt
  enable_offload: False
  global_batch_size: 8
  micro_batch_size: 1
  enable_dp_load_balance: False
  calculate_flops: False
  seed: 1234
  model:
    model_type: ${{rollout.model.model_type}}
    model_path: {model}
    precision: fp32
    is_lora: False
    seq_length: ${{runner.seq_length}}
    encoder_seq_length: ${{runner.seq_length}}
  optim:
    optimizer: adam
    bf16: True
    fp16: False
    lr: 1e-05
    adam_beta1: 0.9
    adam_beta2: 0.95
    adam_eps: 1.0e-05
    min_lr: 1.0e-6
    weight_decay: 0.01
    use_distributed_optimizer: True
    overlap_grad_reduce: False
    overlap_param_gather: False
    optimizer_enable_pin: false
    overlap_param_gather_with_optimizer_step: False
    clip_grad: 1.0
    loss_scale: 65536
  lr_sched:
    lr_warmup_fraction: 0.01
    lr_warmup_init: 0.0
    lr_warmup_iters: 0
    max_lr: 1.0e-5
    min_lr: 0.0
    lr_decay_style: constant
    lr_decay_iters: 10
  tokenizer:
    tokenizer_model: {model}
    use_fast: True
    trust_remote_code: False
    padding_side: 'right'
{fsdp}
reward:
  group_name: "RewardGroup"
  use_reward_model: false
  reward_type: 'math'
  reward_scale: 1.0
  tokenizer:
    tokenizer_model: ${{actor.tokenizer.tokenizer_model}}
    use_fast: ${{actor.tokenizer.use_fast}}
    trust_remote_code: ${{actor.tokenizer.trust_remote_code}}
    padding_side: ${{actor.tokenizer.padding_side}}

critic:
  use_critic_model: false
"""

MLP_POLICY = """model_type: "mlp_policy"
model_path: ""
policy_setup: "panda-qpos"
obs_dim: 42
action_dim: 8
num_action_chunks: 1
hidden_dim: 256
precision: "32"
add_value_head: True
is_lora: False
lora_rank: 32
"""

PICK_CUBE = """env_type: maniskill
total_num_envs: null
wrap_obs_mode: simple
use_full_state: False
auto_reset: False
ignore_terminations: False
use_rel_reward: False
reward_mode: raw
seed: 0
group_size: 1
use_fixed_reset_state_ids: False
max_episode_steps: 50
video_cfg:
  save_video: False
  info_on_video: True
  video_base_dir: ${runner.logger.log_path}/video/train
init_params:
  id: "PickCube-v1"
  num_envs: null
  obs_mode: "state"
  control_mode: "pd_joint_delta_pos"
  sim_backend: "cpu"
  sim_config:
    sim_freq: 100
    control_freq: 20
  max_episode_steps: ${env.train.max_episode_steps}
  sensor_configs:
    shader_pack: "default"
"""

MLP_PPO = HEADER.format(groups="""  - env/maniskill_pick_cube@env.train
  - env/maniskill_pick_cube@env.eval
  - model/mlp_policy@actor.model
  - hybrid_engines/fsdp@actor.fsdp_config
""") + """
cluster:
  num_nodes: 1
  component_placement:
    env,rollout,actor: 0

runner:
  task_type: embodied
  logger:
    log_path: "{out}"
    project_name: rlinf
    experiment_name: "maniskill_ppo_mlp"
    logger_backends: ["tensorboard"]
  max_epochs: 1000
  max_steps: -1
  only_eval: False
  val_check_interval: 50
  save_interval: -1

algorithm:
  update_epoch: 8
  normalize_advantages: True
  group_size: 1
  reward_type: action_level
  logprob_type: action_level
  entropy_type: action_level
  adv_type: gae
  loss_type: actor_critic
  loss_agg_func: "token-mean"
  clip_ratio_high: 0.2
  clip_ratio_low: 0.2
  value_clip: 0.2
  huber_delta: 10.0
  gamma: 0.8
  gae_lambda: 0.9

env:
  group_name: "EnvGroup"
  train:
    total_num_envs: 64
    auto_reset: True
    max_episode_steps: 50
  eval:
    total_num_envs: 32
    auto_reset: True
    ignore_terminations: True
    max_episode_steps: 50

rollout:
  group_name: "RolloutGroup"
  model:
    model_path: ""
    precision: ${actor.model.precision}
  enable_torch_compile: True
  enable_cuda_graph: True

actor:
  group_name: "ActorGroup"
  training_backend: "fsdp"
  micro_batch_size: 3200
  global_batch_size: 3200
  seed: 1234
  enable_offload: False
  model:
    model_path: ""
    model_type: "mlp_policy"
  optim:
    lr: 3.0e-4
    value_lr: 3.0e-4
    clip_grad: 0.5
  fsdp_config:
    strategy: "fsdp"
    sharding_strategy: "no_shard"
    mixed_precision:
      param_dtype: ${actor.model.precision}
      reduce_dtype: ${actor.model.precision}
      buffer_dtype: ${actor.model.precision}
"""

MATH_FSDP = {  # v0.1 writes fsdp_config (with amp.*) in the file; current files take a group
    "v0.1": ("", "  fsdp_config:\n" + "".join(f"    {line}\n" for line in FSDP_V01.replace(
        'enabled: False\n  precision: "bf16"', 'enabled: True\n  precision: "bf16"').splitlines())),
    "current": ("  - ../hybrid_engines/fsdp@actor.fsdp_config\n", ""),
}


def _write(folder: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


@pytest.fixture
def maniskill_v01(tmp_path, monkeypatch) -> Path:
    monkeypatch.delenv("EMBODIED_PATH", raising=False)
    monkeypatch.delenv("RLINF_TEST_LORA_DIR", raising=False)
    return _write(tmp_path / "embodiment" / "config", {
        "env/maniskill_scene.yaml": MANISKILL_SCENE_V01,
        "model/openvla_oft.yaml": OFT_MODEL.format(version=""),
        "training_backend/fsdp.yaml": FSDP_V01,
        "maniskill_ppo_openvlaoft.yaml": MANISKILL_PPO_V01.replace("{out}", str(tmp_path / "results")),
    })


@pytest.fixture
def libero_current(tmp_path, monkeypatch) -> Path:
    monkeypatch.delenv("EMBODIED_PATH", raising=False)
    return _write(tmp_path / "embodiment" / "config", {
        "env/libero_10.yaml": LIBERO_SUITE,
        "model/openvla_oft.yaml": OFT_MODEL.format(version='implement_version: "rlinf"\n'),
        "hybrid_engines/fsdp.yaml": FSDP_CURRENT,
        "weight_syncer/patch_syncer.yaml": PATCH_SYNCER,
        "libero_10_grpo_openvlaoft.yaml": LIBERO_GRPO_CURRENT.replace("{out}", str(tmp_path / "results")),
    })


@pytest.fixture
def mlp_ppo(tmp_path, monkeypatch) -> Path:
    monkeypatch.delenv("EMBODIED_PATH", raising=False)
    return _write(tmp_path / "embodiment" / "config", {
        "env/maniskill_pick_cube.yaml": PICK_CUBE,
        "model/mlp_policy.yaml": MLP_POLICY,
        "hybrid_engines/fsdp.yaml": FSDP_CURRENT,
        "maniskill_ppo_mlp.yaml": MLP_PPO.replace("{out}", str(tmp_path / "results")),
    })


@pytest.fixture(scope="module")
def tiny_oft(tmp_path_factory) -> Path:
    from policies.openvla_oft.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_oft"))


def _math(folder: Path, style: str, tiny: dict[str, Path]) -> Path:
    groups, fsdp = MATH_FSDP[style]
    text = MATH_GRPO.format(groups=groups, fsdp=fsdp, out=folder / "results", model=tiny["model"], data=tiny["data"])
    return _write(folder / "reasoning" / "config", {"math/qwen2.5-grpo-fsdp.yaml": text,
                                                     "hybrid_engines/fsdp.yaml": FSDP_CURRENT}) / "math"


def _run(capsys, folder: Path, name: str, *args: str) -> tuple[int, str, str]:
    code = cli._main(["--config-path", str(folder), "--config-name", name, *args], "embodied-train")
    out, err = capsys.readouterr()
    return code, out, err


def _listed(err: str) -> list[str]:
    """The keys of the one message's lines (``  - <key> = value: why`` or ``<node>.* (n keys)``)."""
    return [re.split(r" = | \(", line.strip()[2:])[0] for line in err.splitlines() if line.startswith("  - ")]


# ------------------------------------------------------------------ recognizing the format
def test_rlinf_files_are_recognized_and_ours_are_not(maniskill_v01, tmp_path):
    assert rlinf.is_rlinf_config(maniskill_v01, "maniskill_ppo_openvlaoft")
    assert not any(rlinf.is_rlinf_config(CONFIG_DIR, name) for name in SHIPPED)
    (tmp_path / "ours.yaml").write_text("defaults:\n  - base\n  - _self_\nhydra:\n  searchpath:\n"
                                        "    - file://${oc.env:EMBODIED_PATH}/config/\n")
    assert not rlinf.is_rlinf_config(tmp_path, "ours")  # our schema first: a config of ours


@pytest.mark.slow
def test_our_configs_compose_exactly_as_before():
    for name in SHIPPED:
        ours = OmegaConf.to_container(compose(name))
        assert OmegaConf.to_container(cli.compose_any(name, (), str(CONFIG_DIR))) == ours


# ------------------------------------------------------------------ v0.1 ManiSkill PPO: one message
def test_maniskill_v01_lists_every_key_it_cannot_carry_over_in_one_message(maniskill_v01, capsys):
    """Before: a bare ConfigCompositionException ($EMBODIED_PATH unset). Now: composed from its
    folder, every key that has no equivalent listed once, with its reason; exit code 2."""
    code, _, err = _run(capsys, maniskill_v01, "maniskill_ppo_openvlaoft", "--dry-run")
    assert code == 2
    assert err.count("config error") == 1
    listed = _listed(err)
    # a task of RLinf's own (its id, and obj_set that only it takes), and a path that does not resolve
    assert sorted(listed) == ["actor.model.lora_path", "env.eval.init_params.id", "env.eval.init_params.obj_set",
                              "env.train.init_params.id", "env.train.init_params.obj_set"]
    assert f"{len(listed)} setting(s)" in err
    for carried in ("algorithm.huber_delta", "algorithm.sampling_params.temperature_eval", "sim_config.sim_freq",
                    "max_steps_per_rollout_epoch",
                    "sim_config.control_freq", "sensor_configs.shader_pack", "render_mode"):
        assert not any(carried in key for key in listed)
    assert "actor.model.lora_path (unresolved): cannot resolve it" in err
    assert "env.eval.max_steps_per_rollout_epoch" not in listed  # 80 = its max_episode_steps


def test_maniskill_v01_renamed_keys_land_where_they_should(maniskill_v01):
    values = rlinf.read(maniskill_v01, "maniskill_ppo_openvlaoft").values
    expected = {
        "env.train.env_type": "maniskill",                      # simulator_type (v0.1)
        "algorithm.sampling_params.temperature": 1.0,          # temperature_train
        "algorithm.bootstrap_at_done": "always",               # bootstrap_type
        "algorithm.loss_type": "ppo",                          # actor_critic
        "algorithm.huber_delta": 10.0,                         # Huber's value loss (gae)
        "actor.fsdp_config.amp_autocast.enabled": True,        # amp.enabled (v0.1)
        "actor.model.gradient_checkpointing": True,            # fsdp_config.gradient_checkpointing
        "actor.fsdp_config.strategy": "fsdp2",                 # fsdp
        "actor.fsdp_config.mixed_precision.param_dtype": "bf16",
        "actor.model.action_head": "discrete",                 # RLinf's OFT variant (its default)
        "actor.model.action_stop_token": False,
        "actor.model.normalize_gripper": True,                 # widowx_bridge binarizes the gripper
        "env.train.init_params.control_mode": "arm_pd_ee_target_delta_pose_align2_gripper_pd_joint_pos",
        "runner.experiment_name": "maniskill_ppo",
        "cluster.component_placement.actor": "0-1",
        "algorithm.sampling_params.temperature_eval": 0.6,     # evaluation samples at it
        "env.train.max_steps_per_rollout_epoch": 160,          # two episodes of 80 per rollout
        "env.train.init_params.sim_freq": 500,                 # sim_config.sim_freq
        "env.eval.init_params.control_freq": 5,                # sim_config.control_freq
        "env.eval.init_params.shader_pack": "default",         # sensor_configs.shader_pack
    }
    assert {key: values.get(key) for key in expected} == expected
    dropped = ("rollout.model.model_path", "rollout.mode", "actor.model.trust_remote_code", "actor.tokenizer.use_fast",
               "actor.tokenizer.padding_side", "actor.fsdp_config.mixed_precision.buffer_dtype")
    assert not any(key in values for key in dropped)  # same as the actor's / implied here


# ------------------------------------------------------------------ current ManiSkill PPO with RLinf's MLP
def test_mlp_ppo_dry_runs_as_written_and_lands_on_our_mlp(mlp_ppo, capsys):
    code, out, err = _run(capsys, mlp_ppo, "maniskill_ppo_mlp", "--dry-run")
    assert code == 0, err
    assert "maniskill PickCube-v1, 64 envs, 50 steps/episode" in out
    cfg = rlinf.compose("maniskill_ppo_mlp", [], mlp_ppo)
    model, fsdp = cfg.actor.model, cfg.actor.fsdp_config
    assert (model.model_type, model.state_dim, list(model.hidden_dims)) == ("mlp", 42, [256, 256, 256])
    assert "precision" not in model and "lora_rank" not in model and "model_path" not in model
    assert (fsdp.mixed_precision.param_dtype, fsdp.mixed_precision.reduce_dtype) == ("fp32", "fp32")  # their "32"
    assert fsdp.sharding_strategy == "no_shard"  # theirs: replicated on each actor rank (one here)
    assert cfg.algorithm.huber_delta == 10.0 and cfg.algorithm.gamma == 0.8
    params = cfg.env.train.init_params
    assert (params.id, params.sim_freq, params.control_freq, params.shader_pack) == ("PickCube-v1", 100, 20, "default")


@pytest.mark.parametrize("edit, keys, why", [
    (('precision: "32"', 'precision: "bf16"'), ["actor.model.precision"], "the MLP here computes in fp32"),
    (('model_path: ""\n    model_type', 'model_path: "/some/mlp.pt"\n    model_type'),
     ["actor.model.model_path", "rollout.model.model_path"], "the MLP here starts from scratch"),
])
def test_mlp_ppo_settings_that_would_change_the_run_are_listed(mlp_ppo, capsys, edit, keys, why):
    for name in ("maniskill_ppo_mlp.yaml", "model/mlp_policy.yaml"):
        path = mlp_ppo / name
        path.write_text(path.read_text().replace(*edit))
    code, _, err = _run(capsys, mlp_ppo, "maniskill_ppo_mlp", "--dry-run")
    assert code == 2 and _listed(err) == keys and why in err, err


def test_a_task_rlinf_registers_itself_is_named_as_the_cause(mlp_ppo, capsys):
    """RLinf's OpenVLA(-OFT) ManiSkill files train on tasks RLinf adds to ManiSkill's registry;
    the message names the task first, beside the options only such a task takes."""
    path = mlp_ppo / "env" / "maniskill_pick_cube.yaml"
    path.write_text(path.read_text().replace('id: "PickCube-v1"', 'id: "PutOnPlateInScene25Main-v3"\n  obj_set: train'))
    code, _, err = _run(capsys, mlp_ppo, "maniskill_ppo_mlp", "--dry-run")
    assert code == 2 and _listed(err) == [f"env.{split}.init_params.{key}" for split in ("train", "eval")
                                          for key in ("id", "obj_set")], err
    assert ("env.train.init_params.id = 'PutOnPlateInScene25Main-v3': not a task of ManiSkill's: RLinf registers "
            "it itself") in err and "(closest: ['PutCarrotOnPlateInScene-v1'])" in err


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session")
def test_mlp_ppo_trains_from_the_rlinf_file(mlp_ppo):
    from tests.runs import embodied

    result, done = embodied("train", ["--config-path", str(mlp_ppo), "--config-name", "maniskill_ppo_mlp",
                                      *(f"env.{split}.{key}" for split in ("train", "eval")
                                        for key in ("total_num_envs=4", "max_episode_steps=10")),
                                      "actor.micro_batch_size=20", "actor.global_batch_size=40",
                                      "runner.max_epochs=2", "runner.val_check_interval=2"])
    assert result["env_steps"] == 2 * 4 * 10 and 0.0 <= result["eval_success"] <= 1.0, result
    assert "model: mlp" in done.stdout


# ------------------------------------------------------------------ current LIBERO GRPO: dry-run
def _libero_paths(model: Path, assets: Path) -> list[str]:
    return [f"actor.model.model_path={model}", f"rollout.model.model_path={model}", "actor.model.unnorm_key=tiny_dataset",
            *(f"env.{split}.init_params.assets_path={assets}" for split in ("train", "eval"))]


def test_libero_current_dry_runs_with_only_paths_overridden(libero_current, tiny_oft, tmp_path, capsys):
    assets = stand_in_assets(tmp_path / "libero_assets")
    code, out, err = _run(capsys, libero_current, "libero_10_grpo_openvlaoft", "--dry-run",
                          *_libero_paths(tiny_oft, assets))
    assert code == 0, err
    assert "config OK" in out and "libero libero_10, 16 envs, 512 steps/episode, group_size 4" in out


def test_rlinf_grpo_groups_of_different_reset_states_carry_over(libero_current, tiny_oft, tmp_path, capsys):
    """RLinf's LIBERO-10 file leaves env.train.group_size at its suite default (1) under GRPO groups
    of 8: an advantage group of envs from different reset states, carried over as such; a size that
    does not divide the group is reported."""
    assets = stand_in_assets(tmp_path / "libero_assets")
    cfg = rlinf.compose("libero_10_grpo_openvlaoft", [*_libero_paths(tiny_oft, assets), "env.train.group_size=2"],
                        libero_current)
    assert (cfg.algorithm.group_size, cfg.env.train.group_size) == (4, 2)
    code, out, err = _run(capsys, libero_current, "libero_10_grpo_openvlaoft", "--dry-run",
                          *_libero_paths(tiny_oft, assets), "env.train.group_size=1")
    assert code == 0, err
    code, _, err = _run(capsys, libero_current, "libero_10_grpo_openvlaoft", "--dry-run",
                        *_libero_paths(tiny_oft, assets), "env.train.group_size=3")
    assert code == 2 and "env.train.group_size = 3: a GRPO group here is algorithm.group_size (4) envs" in err


def test_libero_current_values_in_the_native_config(libero_current, tiny_oft, tmp_path):
    assets = stand_in_assets(tmp_path / "libero_assets")
    cfg = rlinf.compose("libero_10_grpo_openvlaoft", [*_libero_paths(tiny_oft, assets),
                                                      "rollout.sampling_params.temperature_train=0.7"], libero_current)
    model, train, evaluate = cfg.actor.model, cfg.env.train, cfg.env.eval
    assert cfg.algorithm.sampling_params.temperature == 0.7  # an override in RLinf's key space, renamed
    assert cfg.algorithm.sampling_params.top_k == -1         # rollout.sampling_params.* moved
    assert cfg.algorithm.sampling_params.temperature_eval == 1.6  # evaluation samples at it
    assert cfg.algorithm.rollout_epoch == 2                  # env.train.rollout_epoch
    assert (cfg.algorithm.adv_type, cfg.algorithm.loss_type, cfg.algorithm.group_size) == ("grpo", "ppo", 4)
    assert cfg.algorithm.filter_rewards  # bounds 1.0 / 4.0 keep exactly the mixed groups of 4 at coef 5
    assert (model.model_type, model.action_head, model.action_stop_token) == ("openvla_oft", "discrete", False)
    assert model.normalize_gripper and model.invert_gripper  # RLinf's LIBERO gripper convention
    assert model.gradient_checkpointing and model.max_prompt_length == 64
    assert cfg.rollout.model.model_path is None and cfg.rollout.backend == "huggingface"
    assert cfg.actor.fsdp_config.strategy == "fsdp2"
    assert (train.group_size, train.max_episode_steps, train.reward_coef) == (4, 512, 5.0)
    assert train.init_params.num_settle_steps == 15 and train.init_params.camera_heights == 256
    assert not train.init_params.reset_gripper_open and not evaluate.init_params.reset_gripper_open  # 0 command
    assert evaluate.each_reset_state_once and not evaluate.auto_reset and evaluate.ignore_terminations
    assert (train.reset_state_order, evaluate.reset_state_order) == ("ordered", "shuffled")  # eval: is_eval
    unordered = rlinf.compose("libero_10_grpo_openvlaoft", [*_libero_paths(tiny_oft, assets),
                                                            "env.train.use_ordered_reset_state_ids=false"], libero_current)
    assert unordered.env.train.reset_state_order == "random"  # RLinf's draws with replacement
    assert cfg.runner.experiment_name == "libero_10_grpo"


def test_a_specific_reset_id_is_that_task_and_init_state_for_every_env(libero_current, tiny_oft, tmp_path):
    """RLinf numbers a LIBERO suite's reset states task by task, 50 each: id 53 is task 1's
    init state 3."""
    assets = stand_in_assets(tmp_path / "libero_assets")
    cfg = rlinf.compose("libero_10_grpo_openvlaoft", [*_libero_paths(tiny_oft, assets),
                                                      "env.train.specific_reset_id=53"], libero_current)
    params = cfg.env.train.init_params
    assert list(params.task_ids) == [1] and list(params.init_state_range) == [3, 4]
    assert cfg.env.eval.init_params.task_ids is None  # null: the eval split keeps the whole suite


def test_eval_only_leaves_the_training_envs_settings_alone(libero_current):
    """embodied-eval (runner.only_eval): the training envs do not run, so what differs there is
    not reported."""
    windows = [f"env.{split}.max_steps_per_rollout_epoch=7" for split in ("train", "eval")]
    problems = rlinf.read(libero_current, "libero_10_grpo_openvlaoft", ["runner.only_eval=true", *windows]).problems
    assert sorted(problems) == ["env.eval.max_steps_per_rollout_epoch"]


def test_print_config_writes_a_native_file_that_composes_to_the_same_config(libero_current, tiny_oft, tmp_path,
                                                                            capsys):
    assets = stand_in_assets(tmp_path / "libero_assets")
    overrides = _libero_paths(tiny_oft, assets)
    code, out, err = _run(capsys, libero_current, "libero_10_grpo_openvlaoft", "--print-config", *overrides)
    assert code == 0 and not err
    elsewhere = _write(tmp_path / "mine", {"libero_10_grpo.yaml": out})
    native = compose("libero_10_grpo", (), elsewhere)
    translated = rlinf.compose("libero_10_grpo_openvlaoft", overrides, libero_current)
    assert OmegaConf.to_container(native) == OmegaConf.to_container(translated)


def test_print_config_with_untranslated_keys_lists_them_atop_and_exits_2(maniskill_v01, capsys):
    code, out, err = _run(capsys, maniskill_v01, "maniskill_ppo_openvlaoft", "--print-config")
    assert code == 2
    assert out.startswith("# maniskill_ppo_openvlaoft, translated") and "defaults:" in out
    assert "#   env.train.init_params.obj_set = " in out  # reported, atop the native file
    assert "huber_delta: 10.0" in out  # carried over: Huber's value loss under gae
    assert err.count("config error") == 1


def test_an_override_of_a_key_neither_rlinf_nor_we_have_is_listed_with_a_suggestion(libero_current, capsys):
    code, _, err = _run(capsys, libero_current, "libero_10_grpo_openvlaoft", "runner.max_epoch=3")
    assert code == 2
    assert "runner.max_epoch = 3: no counterpart here; did you mean runner.max_epochs?" in err


# ------------------------------------------------------------------ math GRPO in both styles
@pytest.mark.slow
def test_math_grpo_on_megatron_carries_its_mixed_precision_and_distributed_optimizer(tiny_math, tmp_path, capsys):
    """RLinf's Megatron math files: an fp16 model stepped in fp32 (optim.fp16) with a static loss
    scale, the distributed optimizer and valid-token scaling carry over as this backend's own."""
    text = MATH_GRPO.format(groups="", fsdp="", out=tmp_path / "results", model=tiny_math["model"], data=tiny_math["data"])
    for fsdp, megatron in (("training_backend: fsdp", "training_backend: megatron"),
                           ("    precision: fp32\n    is_lora", "    precision: fp16\n    is_lora"),
                           ("bf16: True\n    fp16: False", "bf16: False\n    fp16: True"),
                           ("use_valid_token_scale: False", "use_valid_token_scale: True")):
        assert fsdp in text
        text = text.replace(fsdp, megatron)
    folder = _write(tmp_path / "reasoning" / "config", {"math/qwen2.5-grpo-megatron.yaml": text}) / "math"
    code, out, err = _run(capsys, folder, "qwen2.5-grpo-megatron", "--dry-run")
    assert code == 0, err
    cfg = rlinf.compose("qwen2.5-grpo-megatron", (), folder)
    optim = cfg.actor.optim
    assert (cfg.actor.training_backend, cfg.actor.model.precision) == ("megatron", "fp16")
    assert optim.fp16 and not optim.bf16 and optim.loss_scale == 65536 and optim.use_distributed_optimizer
    assert cfg.algorithm.use_valid_token_scale


@pytest.mark.slow
@pytest.mark.parametrize("style", ["v0.1", "current"])
def test_math_grpo_dry_runs_with_reasoning_batch_sizes(style, tiny_math, tmp_path, capsys):
    folder = _math(tmp_path, style, tiny_math)
    code, out, err = _run(capsys, folder, "qwen2.5-grpo-fsdp", "--dry-run")  # nothing but the paths overridden
    assert code == 0, err
    assert "config OK" in out and "experiment: grpo-tiny (math)" in out
    cfg = rlinf.compose("qwen2.5-grpo-fsdp", (), folder)
    assert cfg.runner.task_type == "math" and cfg.actor.model.model_type == "causal_lm"
    assert cfg.actor.micro_batch_size == 2          # algorithm.training_batch_size_per_gpu
    assert cfg.actor.global_batch_size == 16        # rollout_batch_size 8 x group 4 / n_minibatches 2
    assert cfg.algorithm.kl_penalty_type == "low_var_kl" and cfg.rollout.recompute_logprobs
    assert cfg.algorithm.sampling_params.temperature == 0.9 and cfg.algorithm.sampling_params.max_new_tokens == 16
    assert set(cfg.cluster.component_placement) == {"actor,rollout,env"}  # RLinf's reward worker
    assert cfg.actor.tokenizer.padding_side == "left" and cfg.actor.fsdp_config.strategy == "fsdp2"
    assert cfg.actor.fsdp_config.amp_autocast.enabled == (style == "v0.1")
    assert cfg.actor.fsdp_config.mixed_precision.param_dtype == "fp32"  # null: no mixed-precision policy
    assert cfg.rollout.model.precision == "fp16" and cfg.actor.model.precision == "fp32"
    assert not cfg.actor.optim.fp16 and not cfg.actor.optim.use_distributed_optimizer  # theirs (true), dropped
    assert cfg.data.train_data_paths == [str(tiny_math["data"] / "train.jsonl")]
    assert cfg.data.apply_chat_template is False and cfg.env.train.init_params.apply_chat_template is False


@pytest.mark.slow
@pytest.mark.parametrize("baseline", [False, True])
def test_rlinf_reinforce_plus_plus_carries_over_with_its_kl_in_the_rewards(baseline, tiny_math, tmp_path, capsys):
    """RLinf's REINFORCE++ file (as qwen2.5-1.5b-reinpp-megatron has it: no reward worker placed,
    reinpp_kl_beta with kl_penalty_type k2, the loss's kl_beta 0); a kl_beta in the loss beside
    it is one message naming both keys. A kl_beta of another estimator stays in the loss."""
    folder = _math(tmp_path, "current", tiny_math)
    path = folder / "qwen2.5-grpo-fsdp.yaml"
    text = path.read_text().replace("    actor,rollout,reward: all", "    actor,rollout: all").replace(
        "  adv_type: grpo\n", f"  adv_type: reinpp\n  use_reinpp_baseline: {baseline}\n  reinpp_kl_beta: 0.001\n").replace(
        "kl_penalty_type: k3", "kl_penalty_type: k2")
    path.write_text(text)
    code, out, err = _run(capsys, folder, "qwen2.5-grpo-fsdp", "--dry-run")
    assert code == 0, err
    algo = rlinf.compose("qwen2.5-grpo-fsdp", (), folder).algorithm
    assert algo.adv_type == ("reinpp_baseline" if baseline else "reinpp")
    assert (algo.kl_beta, algo.use_kl_in_reward, algo.kl_penalty) == (0.001, True, "mse")
    assert set(rlinf.compose("qwen2.5-grpo-fsdp", (), folder).cluster.component_placement) == {"actor,rollout,env"}
    path.write_text(text.replace("  kl_beta: 0.0\n", "  kl_beta: 0.01\n"))
    code, _, err = _run(capsys, folder, "qwen2.5-grpo-fsdp", "--dry-run")
    assert code == 2 and "algorithm.kl_beta = 0.01: a KL in the loss beside REINFORCE++'s KL in the rewards" in err
    path.write_text(text.replace("  kl_beta: 0.0\n", "  kl_beta: 0.01\n").replace("adv_type: reinpp", "adv_type: grpo"))
    algo = rlinf.compose("qwen2.5-grpo-fsdp", (), folder).algorithm
    assert (algo.adv_type, algo.kl_beta, algo.use_kl_in_reward) == ("grpo", 0.01, False)


# ------------------------------------------------------------------ the table
def test_every_renamed_key_lands_on_a_key_of_our_schema():
    ours = set(leaves())
    nodes = {key.rsplit(".", n)[0] for key in ours for n in range(1, key.count(".") + 1)}
    simulator_options = {f"env.train.init_params.{key}" for name in ("maniskill_push_cube", "libero_base")
                         for key in OmegaConf.load(CONFIG_DIR / "env" / f"{name}.yaml").init_params}
    for their, rule in rlinf.RLINF_KEYS.items():
        if isinstance(rule, rlinf.Rename):
            assert rule.to.replace("*", "train") in ours | nodes | simulator_options, their


def test_docs_list_every_key_of_the_table():
    docs = (CONFIG_DIR.parent / "docs" / "rlinf.md").read_text()
    named = set(re.findall(r"`([\w.*]+)`", docs))
    missing = [key for key in rlinf.RLINF_KEYS
               if key not in rlinf.FSDP_MEGATRON_KEYS and key not in named and f"{key}.*" not in named]
    assert missing == []
    assert "FSDP_MEGATRON_KEYS" in docs


# ------------------------------------------------------------------ the config layer's messages
def test_a_misspelled_key_gets_our_message_with_its_suggestion(capsys):
    code, _, err = _run(capsys, CONFIG_DIR, "maniskill_ppo_mlp", "runner.max_epoch=5")
    assert code == 2
    assert err == "embodied-train: config error: unknown config key runner.max_epoch; did you mean runner.max_epochs?\n"


def test_a_misspelled_config_name_lists_the_closest_configs(capsys):
    code, _, err = _run(capsys, CONFIG_DIR, "maniskill_ppo_mpl")
    assert code == 2
    assert err == (f"embodied-train: config error: no config named 'maniskill_ppo_mpl' in {CONFIG_DIR}; "
                   "did you mean maniskill_ppo_mlp, maniskill_grpo_mlp, maniskill_ppo_cnn?\n")


def test_a_defaults_list_that_cannot_be_composed_says_why_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MY_CONFIGS", raising=False)
    _write(tmp_path, {"exp.yaml": "defaults:\n  - base\n  - model/mlp@actor.model\n  - _self_\n"
                                  "hydra:\n  searchpath:\n    - file://${oc.env:MY_CONFIGS}/config\n"})
    code, _, err = _run(capsys, tmp_path, "exp")
    assert code == 2
    assert err.count("\n") == 1
    assert err.startswith("embodied-train: config error: exp: cannot compose: ")
    assert "Environment variable 'MY_CONFIGS' not found" in err
