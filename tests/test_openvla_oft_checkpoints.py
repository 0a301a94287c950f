"""OpenVLA-OFT checkpoints users have: the official L1-regression head with proprio and two
images, RL frameworks' layout (value head and projector inside the weights), LoRA that reaches
the LM head, training checkpoints (adapter only) and merged exports; every file of a folder used
or refused. Tiny checkpoints are written by policies.openvla_oft.tiny in each layout."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from embodied.cli import load as load_config
from embodied.config import ConfigError as EmbodiedConfigError
from embodied.config import build_policy
from policies.openvla_oft.checkpoint import CheckpointError, default_dtype, from_pretrained
from policies.openvla_oft.config import VLAConfig
from policies.openvla_oft.model import OpenVLAOFT
from policies.openvla_oft.policy import ValueHead
from policies.openvla_oft.tiny import (
    l1_head_shapes,
    norm_stats,
    public_shapes,
    tiny_config,
    value_head_shapes,
    write_tiny_checkpoint,
)
from tests.test_openvla_oft import make_obs, tiny_cfg

L1 = dict(action_head="l1_regression", use_proprio=True, num_images_in_input=2)


@pytest.fixture(scope="module")
def l1_ckpt(tmp_path_factory):
    """The official OFT layout: weights, proprio projector and L1 head files (``module.`` keys)."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("oft_l1"), proprio_dim=8, l1_head=True)


@pytest.fixture(scope="module")
def rl_ckpt(tmp_path_factory):
    """RL frameworks' layout: value head and proprio projector inside the main weights."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("oft_rl"), proprio_dim=8, rl_layout=True, seed=1)


@pytest.fixture(scope="module")
def plain_ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("oft_plain"), seed=2)


def perturb_trainables(policy, scale: float = 0.05, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(policy.named_parameters()):
            if p.requires_grad:
                p.add_(scale * torch.randn(p.shape, generator=gen))


def head_by_hand(state: dict[str, torch.Tensor], hidden: torch.Tensor, action_dim: int) -> torch.Tensor:
    """OFT's L1 head written out from the file's own tensors: LayerNorm, Linear, ReLU, two
    pre-norm residual blocks, LayerNorm, Linear, on each action's hidden states concatenated."""
    s = {k.removeprefix("module."): v for k, v in state.items()}
    b, n, h = hidden.shape
    x = hidden.reshape(b, n // action_dim, action_dim * h)
    x = F.layer_norm(x, x.shape[-1:], s["model.layer_norm1.weight"], s["model.layer_norm1.bias"])
    x = F.relu(F.linear(x, s["model.fc1.weight"], s["model.fc1.bias"]))
    for i in range(2):
        p = f"model.mlp_resnet_blocks.{i}.ffn"
        y = F.layer_norm(x, x.shape[-1:], s[f"{p}.0.weight"], s[f"{p}.0.bias"])
        x = x + F.relu(F.linear(y, s[f"{p}.1.weight"], s[f"{p}.1.bias"]))
    x = F.layer_norm(x, x.shape[-1:], s["model.layer_norm2.weight"], s["model.layer_norm2.bias"])
    return F.linear(x, s["model.fc2.weight"], s["model.fc2.bias"])


# ---------------------------------------------------------------------------- LoRA
def test_lora_on_lm_head_shapes_action_logits_and_every_adapter_gets_a_gradient(plain_ckpt):
    cfg = tiny_cfg(plain_ckpt, use_proprio=False, lora_target_modules=["q_proj", "down_proj", "lm_head"],
                   lora_alpha=8.0)
    policy = build_policy(cfg)
    lora = {n: p for n, p in policy.named_parameters() if ".lora_" in n}
    modules = {n.split(".lora_")[0] for n in lora}
    assert "vla.base_model.model.language_model.lm_head" in modules
    assert len(modules) == 2 * 2 + 1  # q_proj and down_proj of 2 layers, the LM head
    scaling = policy.vla.base_model.model.language_model.lm_head.scaling["default"]
    assert scaling == pytest.approx(8.0 / 4)  # lora_alpha / lora_rank from the config

    obs = make_obs(2)
    before = policy.act(obs, do_sample=False)
    head_b = policy.vla.base_model.model.language_model.lm_head.lora_B["default"].weight
    with torch.no_grad():  # only the LM head's adapter moves: the action logits must follow
        head_b.add_(0.5 * torch.randn_like(head_b))
    after = policy(before.forward_inputs, before.actions)
    assert not torch.allclose(after.logprobs, before.logprobs, atol=1e-3)

    perturb_trainables(policy)  # B = 0 at init would leave every A without gradient
    policy.train()
    out = policy.act(obs)
    new = policy(out.forward_inputs, out.actions)
    (new.logprobs.sum() + new.values.sum()).backward()
    dead = [n for n, p in lora.items() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not dead, dead


def test_default_lora_targets_all_get_gradients_with_the_l1_head(l1_ckpt):
    policy = build_policy(tiny_cfg(l1_ckpt, **L1))
    lora = {n: p for n, p in policy.named_parameters() if ".lora_" in n}
    modules = {n.split(".lora_")[0].removeprefix("vla.base_model.model.") for n in lora}
    assert {"action_head.model.fc1", "action_head.model.fc2", "action_head.model.mlp_resnet_blocks.1.ffn.1"} <= modules
    assert "language_model.lm_head" not in modules
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable == set(lora) | {n for n in trainable if n.startswith("value_head.")} | {"action_log_std"}
    perturb_trainables(policy)
    policy.train()
    out = policy.act(make_obs(2))
    new = policy(out.forward_inputs, out.actions)
    (new.logprobs.sum() + new.values.sum() + new.entropy.sum()).backward()
    dead = [n for n, p in policy.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.abs().sum() > 0)]
    assert not dead, dead


# ---------------------------------------------------------------------------- L1-regression head
def test_l1_head_checkpoint_greedy_actions_are_the_heads_denormalized_output(l1_ckpt):
    policy = build_policy(tiny_cfg(l1_ckpt, **L1, is_lora=False, add_value_head=False))
    head_file = next(l1_ckpt.glob("action_head--*.pt"))
    saved = torch.load(head_file, weights_only=True)
    assert len(saved) == 16 and all(k.startswith("module.") for k in saved)
    obs = make_obs(3)
    out = policy.act(obs, do_sample=False)
    assert out.actions.shape == out.logprobs.shape == (3, 8, 7)
    assert out.forward_inputs["images"].shape == (3, 2, 3, 56, 56)  # agent view + wrist

    model_out, _ = policy.forward_model(out.forward_inputs)
    with torch.no_grad():
        normalized = head_by_hand(saved, model_out.action_hidden, 7)
    assert torch.allclose(out.forward_inputs["normalized_actions"], normalized, atol=1e-5)
    stats = policy.action_stats
    q01, q99 = torch.tensor(stats["q01"]), torch.tensor(stats["q99"])
    expected = 0.5 * (normalized + 1) * (q99 - q01 + 1e-8) + q01
    assert torch.allclose(out.actions[..., :6], expected[..., :6], atol=1e-5)
    assert torch.allclose(out.actions[..., 6], normalized[..., 6], atol=1e-5)  # mask false: the gripper
    # the head reads the hidden states of "▁" and the first A - 1 slots, as the discrete logits do
    assert model_out.logits is None and model_out.action_hidden.shape == (3, 56, 64)

    gripper = build_policy(tiny_cfg(l1_ckpt, **L1, is_lora=False, add_value_head=False,
                                    normalize_gripper=True, invert_gripper=True))
    flipped = gripper.act(obs, do_sample=False).actions[..., 6]
    assert torch.equal(flipped, -torch.sign(2 * normalized[..., 6] - 1))


def test_l1_head_rl_policy_is_a_gaussian_around_the_head(l1_ckpt):
    policy = build_policy(tiny_cfg(l1_ckpt, **L1, init_log_std=-1.0))
    obs = make_obs(4)
    greedy = policy.act(obs, do_sample=False)
    torch.manual_seed(0)
    sampled = policy.act(obs)
    mean = greedy.forward_inputs["normalized_actions"]
    drawn = sampled.forward_inputs["normalized_actions"]
    std = math.exp(-1.0)
    assert 0.5 * std < (drawn - mean).std().item() < 1.5 * std
    expected = -((drawn - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
    assert torch.allclose(sampled.logprobs, expected, atol=1e-4)
    new = policy(sampled.forward_inputs, sampled.actions)
    assert torch.allclose(new.logprobs, sampled.logprobs, atol=1e-5)
    assert torch.allclose(new.entropy, torch.full_like(new.entropy, 0.5 * math.log(2 * math.pi * math.e * std**2)))
    assert new.values.shape == (4,)


# ---------------------------------------------------------------------------- RL-framework layout
def test_rl_layout_loads_value_head_and_projector_from_the_main_weights(rl_ckpt):
    cfg = tiny_cfg(rl_ckpt, action_stop_token=False, top_k=-1, is_lora=False)
    policy = build_policy(cfg)
    index = json.loads((rl_ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    shard = load_file(str(rl_ckpt / index["value_head.mlp.4.weight"]))
    assert torch.equal(policy.value_head.mlp[4].weight, shard["value_head.mlp.4.weight"])
    proprio = load_file(str(rl_ckpt / index["proprio_projector.fc1.weight"]))
    assert torch.equal(policy.core.proprio_projector.fc1.weight, proprio["proprio_projector.fc1.weight"])

    obs = make_obs(2)
    out = policy.act(obs, do_sample=False)
    # top_k -1 is off: the same distribution as keeping all 256 bins
    all_bins = build_policy(tiny_cfg(rl_ckpt, action_stop_token=False, top_k=256, is_lora=False))
    assert torch.allclose(all_bins(out.forward_inputs, out.actions).logprobs, out.logprobs, atol=1e-6)
    # the stop token after the slots changes what the (bidirectional) slots see
    with_stop = build_policy(tiny_cfg(rl_ckpt, action_stop_token=True, is_lora=False))
    assert not torch.allclose(with_stop(out.forward_inputs, out.actions).logprobs, out.logprobs, atol=1e-3)

    with pytest.raises(CheckpointError, match=r"value_head\.mlp\.0\.bias.*add_value_head is false"):
        build_policy(tiny_cfg(rl_ckpt, add_value_head=False))
    with pytest.raises(CheckpointError, match=r"proprio_projector\.fc1\.bias.*use_proprio is false"):
        build_policy(tiny_cfg(rl_ckpt, use_proprio=False))


def test_fresh_value_head_starts_small_like_rl_frameworks():
    torch.manual_seed(0)
    head = ValueHead(4096, (512, 128), 1)
    last = head.mlp[-1]
    assert last.bias is None and abs(last.weight.std().item() - 0.02) < 0.005
    first = head.mlp[0]
    assert abs(first.weight.std().item() - math.sqrt(2 / 512)) < 0.1 * math.sqrt(2 / 512)  # Kaiming, fan_out
    assert torch.equal(first.bias, torch.zeros(512))


def test_an_exported_folder_starts_a_run_with_or_without_a_critic(l1_ckpt, tmp_path):
    """SFT exports no value head: PPO from it starts a fresh critic and keeps the trained log-std;
    a PPO export brings its critic back; a critic unused or a log-std of another size is refused."""
    sft = build_policy(tiny_cfg(l1_ckpt, action_head="l1_regression", add_value_head=False, is_lora=False))
    with torch.no_grad():
        sft.action_log_std.fill_(-1.25)
    sft.export_pretrained(tmp_path / "sft")
    assert set(load_file(str(tmp_path / "sft" / "rl_heads.safetensors"))) == {"action_log_std"}

    ppo = build_policy(tiny_cfg(tmp_path / "sft", action_head="l1_regression", add_value_head=True, is_lora=False))
    assert ppo.value_head is not None and torch.equal(ppo.action_log_std, torch.full((7,), -1.25))
    with torch.no_grad():
        ppo.action_log_std.fill_(-0.5)
    ppo.export_pretrained(tmp_path / "ppo")
    assert "value_head.mlp.0.weight" in load_file(str(tmp_path / "ppo" / "rl_heads.safetensors"))

    again = build_policy(tiny_cfg(tmp_path / "ppo", action_head="l1_regression", add_value_head=True, is_lora=False))
    assert torch.equal(again.action_log_std, torch.full((7,), -0.5))
    for k, v in ppo.value_head.state_dict().items():
        assert torch.equal(again.value_head.state_dict()[k], v), k
    with pytest.raises(CheckpointError, match="holds a value head but actor.model.add_value_head is false"):
        build_policy(tiny_cfg(tmp_path / "ppo", action_head="l1_regression", add_value_head=False, is_lora=False))

    from safetensors.torch import save_file

    save_file({"action_log_std": torch.zeros(5)}, str(tmp_path / "sft" / "rl_heads.safetensors"))
    with pytest.raises(CheckpointError, match=r"action_log_std \(5,\) != \(7,\)"):
        build_policy(tiny_cfg(tmp_path / "sft", action_head="l1_regression", add_value_head=True, is_lora=False))


# ---------------------------------------------------------------------------- folders: used or refused
def test_every_file_is_used_or_refused_by_name(l1_ckpt, plain_ckpt, tmp_path):
    head = next(l1_ckpt.glob("action_head--*.pt")).name
    with pytest.raises(CheckpointError, match=rf"{head} but actor.model.action_head is 'discrete'"):
        build_policy(tiny_cfg(l1_ckpt, use_proprio=True))
    with pytest.raises(CheckpointError, match=r"action_head=l1_regression but .* has no action_head--\*\.pt"):
        build_policy(tiny_cfg(plain_ckpt, use_proprio=False, action_head="l1_regression"))
    with pytest.raises(CheckpointError, match=r"proprio_projector--100_checkpoint.pt but actor.model.use_proprio"):
        build_policy(tiny_cfg(l1_ckpt, action_head="l1_regression", use_proprio=False))
    odd = tmp_path / "odd"
    shutil.copytree(plain_ckpt, odd)
    torch.save({"x": torch.zeros(1)}, odd / "extra_weights.pt")
    with pytest.raises(CheckpointError, match=r"extra_weights.pt is not part of an OpenVLA-OFT checkpoint"):
        from_pretrained(odd)
    (odd / "extra_weights.pt").unlink()
    torch.save({}, odd / "noisy_action_projector--100_checkpoint.pt")
    with pytest.raises(CheckpointError, match=r"noisy_action_projector--100_checkpoint.pt is a diffusion action head"):
        from_pretrained(odd)
    (odd / "noisy_action_projector--100_checkpoint.pt").unlink()
    (odd / "lora_adapter").mkdir()
    with pytest.raises(CheckpointError, match=r"holds lora_adapter/ but actor.model.lora_path does not name it"):
        from_pretrained(odd)
    shutil.rmtree(odd / "lora_adapter")
    (odd / "README.md").write_text("model card")  # documentation is ignored by name
    from_pretrained(odd)


def config_error(args: list[str]) -> str:
    with pytest.raises(EmbodiedConfigError) as err:
        load_config("maniskill_ppo_openvla_oft", args)
    return str(err.value)


def test_bad_folders_fail_before_workers_naming_file_and_key(l1_ckpt, plain_ckpt, tmp_path):
    """What validate.py (exit code 2, no worker started) says about folders that do not fit."""
    common = ["actor.model.unnorm_key=tiny_dataset", "actor.model.precision=fp32", "actor.model.lora_rank=4"]
    bad_head = tmp_path / "bad_head"
    shutil.copytree(l1_ckpt, bad_head)
    head_file = next(bad_head.glob("action_head--*.pt"))
    state = torch.load(head_file, weights_only=True)
    state["module.model.fc2.weight"] = torch.zeros(6, 64)
    torch.save(state, head_file)
    message = config_error([f"actor.model.model_path={bad_head}", *common, "actor.model.action_head=l1_regression",
                            "actor.model.use_proprio=true"])
    assert head_file.name in message and "model.fc2.weight (6, 64) != (7, 64)" in message

    message = config_error([f"actor.model.model_path={plain_ckpt}", "actor.model.unnorm_key=bridge_orig"])
    assert "unnorm_key='bridge_orig'" in message and "dataset_statistics.json" in message
    assert "tiny_dataset_no_noops" in message

    other = write_tiny_checkpoint(tmp_path / "other", config=tiny_config(llm_hidden=32), seed=3)
    policy = build_policy(tiny_cfg(other, use_proprio=False))
    policy.save_checkpoint(tmp_path / "run")  # an adapter trained on a 32-wide base
    adapter = tmp_path / "run" / "lora_adapter"
    message = config_error([f"actor.model.model_path={plain_ckpt}", *common, f"actor.model.lora_path={adapter}"])
    assert "adapter_model.safetensors" in message and "trained on another base model" in message
    assert "lora_A.weight" in message or "lora_B.weight" in message

    no_stats = tmp_path / "no_stats"
    shutil.copytree(plain_ckpt, no_stats)
    config = json.loads((no_stats / "config.json").read_text())
    config["norm_stats"] = {"other": config["norm_stats"]["tiny_dataset_no_noops"]}
    (no_stats / "config.json").write_text(json.dumps(config))
    (no_stats / "dataset_statistics.json").write_text(json.dumps(config["norm_stats"]))
    message = config_error([f"actor.model.model_path={no_stats}", *common])
    assert "unnorm_key='tiny_dataset'" in message and str(no_stats) in message and "['other']" in message


# ---------------------------------------------------------------------------- save, read, export
@pytest.mark.parametrize("layout", ["discrete", "l1"])
def test_lora_checkpoint_holds_the_adapter_and_export_merges_it(layout, l1_ckpt, plain_ckpt, tmp_path):
    if layout == "l1":
        base, extra = l1_ckpt, dict(L1, init_log_std=-1.5)
    else:
        base, extra = plain_ckpt, dict(use_proprio=False)
    policy = build_policy(tiny_cfg(base, **extra))
    perturb_trainables(policy)
    obs = make_obs(3)
    torch.manual_seed(1)
    out = policy.act(obs)
    greedy = policy.act(obs, do_sample=False)

    run = tmp_path / "run"
    policy.save_checkpoint(run)
    assert sorted(p.name for p in run.iterdir()) == ["lora_adapter", "rl_heads.safetensors"]
    assert sorted(p.name for p in (run / "lora_adapter").iterdir()) == ["README.md", "adapter_config.json",
                                                                        "adapter_model.safetensors"]
    adapter = load_file(str(run / "lora_adapter" / "adapter_model.safetensors"))
    assert all(".lora_A.weight" in k or ".lora_B.weight" in k for k in adapter)
    rl = load_file(str(run / "rl_heads.safetensors"))
    assert ("action_log_std" in rl) == (layout == "l1") and "value_head.mlp.4.weight" in rl

    torch.manual_seed(123)  # other fresh adapters and heads, then the checkpoint's
    fresh = build_policy(tiny_cfg(base, **extra))
    fresh.load_state_dict(fresh.read_checkpoint(run), strict=False)
    again = fresh(out.forward_inputs, out.actions)
    assert torch.allclose(again.logprobs, out.logprobs, atol=1e-5)
    assert torch.allclose(again.values, out.values, atol=1e-5)

    # peft itself reads the adapter onto the base model (a from_pretrained-style tool)
    from peft import PeftModel

    vla = from_pretrained(base, use_proprio=extra["use_proprio"], action_head=extra.get("action_head", "discrete"))
    peft_model = PeftModel.from_pretrained(vla, str(run / "lora_adapter"))
    ours = dict(fresh.vla.named_parameters())
    for name, p in peft_model.named_parameters():
        if ".lora_" in name:
            assert torch.equal(p, ours[name]), name

    exported = tmp_path / "exported"
    fresh.export_pretrained(exported)
    names = {p.name for p in exported.iterdir()}
    assert {"config.json", "dataset_statistics.json", "model.safetensors", "rl_heads.safetensors",
            "tokenizer.json"} <= names
    if layout == "l1":
        assert {"action_head--checkpoint.pt", "proprio_projector--checkpoint.pt"} <= names
    back = build_policy(tiny_cfg(exported, **extra, is_lora=False))
    again = back.act(obs, do_sample=False)
    if layout == "l1":
        assert torch.allclose(again.actions, greedy.actions, atol=1e-5)
    else:
        assert torch.equal(again.forward_inputs["action_tokens"], greedy.forward_inputs["action_tokens"])
    assert torch.allclose(back(out.forward_inputs, out.actions).logprobs, out.logprobs, atol=1e-4)


def test_full_finetune_checkpoint_is_a_checkpoint_folder(plain_ckpt, tmp_path):
    policy = build_policy(tiny_cfg(plain_ckpt, use_proprio=False, is_lora=False))
    perturb_trainables(policy, scale=0.01)
    obs = make_obs(2)
    greedy = policy.act(obs, do_sample=False)
    policy.save_checkpoint(tmp_path / "run")
    folder = tmp_path / "run" / "model"
    state = policy.read_checkpoint(tmp_path / "run")
    assert state.keys() == policy.state_dict().keys()
    again = build_policy(tiny_cfg(folder, use_proprio=False, is_lora=False))  # usable as model_path
    assert torch.equal(again.act(obs, do_sample=False).actions, greedy.actions)


# ---------------------------------------------------------------------------- 7B parity (no weights)
def test_7b_config_matches_the_public_names_and_shapes_with_the_l1_head():
    """OpenVLA-7B's sizes (DINOv2 ViT-L + SigLIP SO400M at 224 px, Llama-2 7B, vocab 32064) built
    on the meta device: the 982 main tensors and OFT's 16 L1-head tensors have the public names
    and shapes, and the parameter counts are the released ones."""
    raw = tiny_config(image_size=224, stats=norm_stats())
    raw["timm_arch_overrides"] = [
        {"embed_dim": 1024, "depth": 24, "num_heads": 16, "patch_size": 14},
        {"embed_dim": 1152, "depth": 27, "num_heads": 16, "patch_size": 14},
    ]
    raw["pad_token_id"] = 32000
    raw["text_config"] = {"model_type": "llama", "pad_token_id": 32000, "vocab_size": 32064, "hidden_size": 4096,
                          "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
                          "num_key_value_heads": 32}
    with torch.device("meta"), default_dtype(torch.bfloat16):
        model = OpenVLAOFT(VLAConfig.from_dict(raw, "7B config"), proprio_dim=8, l1_action_dim=7)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    main = {k: s for k, s in shapes.items() if not k.startswith(("action_head.", "proprio_projector."))}
    assert main == public_shapes(raw)
    assert len(main) == 982 and sum(math.prod(s) for s in main.values()) == 7_541_237_184
    head = {k.removeprefix("action_head."): s for k, s in shapes.items() if k.startswith("action_head.")}
    assert head == l1_head_shapes(4096, 7) and len(head) == 16
    assert 150e6 < sum(math.prod(s) for s in head.values()) < 152e6  # "about 151M parameters"
    assert value_head_shapes(4096)["value_head.mlp.0.weight"] == (512, 4096)


@pytest.mark.slow
def test_eval_config_for_the_l1_head_and_exit_code_2(plain_ckpt, tmp_path):
    # the proprio projector takes the 29 state dimensions of PickCube with the wrist camera robot
    l1_ckpt = write_tiny_checkpoint(tmp_path / "l1_29", config=tiny_config(stats=norm_stats(proprio_dim=29)),
                                    proprio_dim=29, l1_head=True)
    cfg, _ = load_config("maniskill_eval_openvla_oft", [f"actor.model.model_path={l1_ckpt}",
                                                        "actor.model.unnorm_key=tiny_dataset", "runner.only_eval=true"])
    model = cfg.actor.model
    assert (model.action_head, model.use_proprio, model.num_images_in_input, model.center_crop) == (
        "l1_regression", True, 2, True)
    assert cfg.runner.ckpt_path is None  # eval of the pretrained folder alone
    from tests.runs import embodied

    _, done = embodied("eval", ["--config-name", "maniskill_eval_openvla_oft", f"actor.model.model_path={plain_ckpt}",
                                "actor.model.unnorm_key=tiny_dataset", "actor.model.use_proprio=false", "--dry-run"], code=2)
    assert done.stderr.count("\n") == 1 and "action_head=l1_regression" in done.stderr and str(plain_ckpt) in done.stderr
