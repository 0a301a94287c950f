"""OpenVLA-OFT on tiny checkpoints written in the public layout (policies.openvla_oft.tiny spells
the tensor names out independently of the model classes)."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from embodied.config import build_policy, register_resolvers
from embodied.config.schema import CONFIG_DIR, check_schema
from embodied.algorithms import reduce_logprobs
from policies import POLICIES
from policies.openvla_oft import OpenVLAOFTPolicy
from policies.openvla_oft.policy import lora_targets
from policies.openvla_oft.action_tokenizer import ActionTokenizer
from policies.openvla_oft.checkpoint import (
    CheckpointError,
    from_pretrained,
    load_tokenizer,
    read_config,
    save_pretrained,
)
from policies.openvla_oft.config import ConfigError, vit_spec
from policies.openvla_oft.decoding import ActionSampler, parallel_decode, sequential_decode
from policies.lora import apply_lora
from policies.openvla_oft.model import PromptInputs, position_ids
from policies.openvla_oft.normalization import (
    normalize_proprio,
    postprocess_gripper,
    resolve_unnorm_key,
    unnormalize_actions,
)
from policies.openvla_oft.preprocess import build_prompts, center_crop_resize, normalize_images, prepare_images
from policies.openvla_oft.tiny import public_shapes, write_tiny_checkpoint

TASKS = ["pick up the red cube", "Turn on the stove", "open the top drawer and put the bowl inside"]
N_TOKENS = 8 * 7


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_vla"), proprio_dim=8)


def model_cfg(**overrides) -> dict:
    """``actor.model`` as the framework composes it: model/base.yaml + model/openvla_oft.yaml
    under config/base.yaml, schema-checked and resolved."""
    root = OmegaConf.load(CONFIG_DIR / "base.yaml")
    own = OmegaConf.load(CONFIG_DIR / "model" / "openvla_oft.yaml")
    own.pop("defaults")
    root.actor.model = OmegaConf.merge(OmegaConf.load(CONFIG_DIR / "model" / "base.yaml"), own)
    root = OmegaConf.merge(root, {"actor": {"model": overrides}})
    check_schema(root)
    register_resolvers()
    OmegaConf.resolve(root)
    return OmegaConf.to_container(root.actor.model)


def tiny_cfg(ckpt, **overrides) -> dict:
    values = dict(model_path=str(ckpt), unnorm_key="tiny_dataset", precision="fp32", lora_rank=4, use_proprio=True)
    return model_cfg(**(values | overrides))


def make_obs(batch: int, seed: int = 0, size: tuple[int, int] = (64, 80)) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "main_images": rng.integers(0, 256, (batch, *size, 3), dtype=np.uint8),
        "wrist_images": rng.integers(0, 256, (batch, 56, 56, 3), dtype=np.uint8),
        "states": rng.normal(size=(batch, 8)).astype(np.float32),
        "task_descriptions": [TASKS[i % len(TASKS)] for i in range(batch)],
    }


def prompt_inputs(model, tokenizer, batch: int = 3, seed: int = 0) -> PromptInputs:
    """Model inputs with prompts of different lengths (so rows carry different padding)."""
    gen = torch.Generator().manual_seed(seed)
    size = model.config.image_size
    images = torch.randint(0, 256, (batch, 1, 3, size, size), generator=gen, dtype=torch.uint8)
    ids, mask = build_prompts(tokenizer, [TASKS[i % 3] for i in range(batch)], 30)
    proprio = torch.rand(batch, 8, generator=gen) * 2 - 1 if model.proprio_projector is not None else None
    return PromptInputs(ids, mask, normalize_images(images, model.config.vit_specs), proprio)


def rows(inputs: PromptInputs, i: int) -> PromptInputs:
    return PromptInputs(
        inputs.input_ids[i : i + 1], inputs.attention_mask[i : i + 1], inputs.pixel_values[i : i + 1],
        None if inputs.proprio is None else inputs.proprio[i : i + 1],
    )


# ---------------------------------------------------------------------------- action tokens
def test_action_tokenizer_matches_openvla_binning_and_round_trips():
    tok = ActionTokenizer(vocab_size=512, n_bins=256)
    x = torch.linspace(-1.2, 1.2, 1001)
    # OpenVLA: token = vocab_size - np.digitize(clip(x), linspace(-1, 1, 256))
    expected = 512 - np.digitize(np.clip(x.numpy(), -1, 1), np.linspace(-1, 1, 256))
    assert torch.equal(tok.encode(x), torch.as_tensor(expected))
    assert tok.encode(torch.tensor([1.0])).item() == 256 == tok.first_token_id  # the last 256 ids
    assert tok.encode(torch.tensor([-1.0])).item() == 511
    inside = torch.linspace(-1, 0.999, 999)
    bin_width = 2 / 255
    assert (tok.decode(tok.encode(inside)) - inside).abs().max() <= bin_width / 2 + 1e-6
    # every token but the first (the overflow bin of x == 1.0) is a fixed point of decode->encode
    tokens = torch.arange(257, 512)
    assert torch.equal(tok.encode(tok.decode(tokens)), tokens)
    assert tok.decode(torch.tensor([256])) == tok.decode(torch.tensor([257]))
    assert torch.equal(tok.tokens_to_slots(tok.slots_to_tokens(torch.arange(256))), torch.arange(256))
    with pytest.raises(ValueError, match=r"\[256, 511\]"):
        tok.tokens_to_slots(torch.tensor([255]))


# ---------------------------------------------------------------------------- statistics
def test_unnormalize_proprio_and_gripper_against_hand_computed_values():
    stats = {"q01": [-1.0, 0.0, 2.0], "q99": [1.0, 4.0, 2.0], "mask": [True, True, False]}
    x = torch.tensor([[-1.0, 0.5, 0.3], [1.0, -1.0, -0.7]])
    eps = 1e-8  # the public code's range epsilon
    expected = torch.tensor([
        [-1.0, 0.5 * 1.5 * (4 + eps), 0.3],
        [0.5 * 2 * (2 + eps) - 1.0, 0.0, -0.7],
    ])
    assert torch.allclose(unnormalize_actions(x, stats), expected, atol=1e-6)
    no_mask = {"q01": [0.0], "q99": [2.0]}  # without a mask every dimension is de-normalized
    assert torch.allclose(unnormalize_actions(torch.tensor([[0.0]]), no_mask), torch.tensor([[1.0]]))
    with pytest.raises(ConfigError, match="action_dim=2"):
        unnormalize_actions(torch.zeros(1, 2), stats)

    p = torch.tensor([[0.0, 2.0, 5.0]])
    proprio_stats = {"q01": [-1.0, 0.0, 0.0], "q99": [1.0, 4.0, 2.0]}
    expected_proprio = torch.tensor([[0.0, 0.0, 1.0]])  # the last is 4, clipped to 1
    assert torch.allclose(normalize_proprio(p, proprio_stats), expected_proprio, atol=1e-6)

    grip = torch.tensor([[0.5, 0.7], [0.5, 0.2]])
    assert torch.equal(postprocess_gripper(grip, normalize=True, invert=False)[:, -1], torch.tensor([1.0, -1.0]))
    assert torch.equal(postprocess_gripper(grip, normalize=True, invert=True)[:, -1], torch.tensor([-1.0, 1.0]))
    assert torch.equal(postprocess_gripper(grip, normalize=False, invert=False), grip)


def test_unnorm_key_resolution():
    stats = {"libero_spatial_no_noops": {}, "bridge_orig": {}}
    assert resolve_unnorm_key(stats, "libero_spatial") == "libero_spatial_no_noops"
    assert resolve_unnorm_key(stats, "bridge_orig") == "bridge_orig"
    assert resolve_unnorm_key({"only": {}}, None) == "only"
    with pytest.raises(ConfigError, match=r"unnorm_key='fractal'.*bridge_orig"):
        resolve_unnorm_key(stats, "fractal")
    with pytest.raises(ConfigError, match="several datasets"):
        resolve_unnorm_key(stats, None)


def test_logprob_levels_are_reshapes_of_token_logprobs():
    per_token = torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 3, 4)
    assert torch.equal(reduce_logprobs(per_token, "token_level"), per_token)
    action_level = torch.tensor([[6.0, 22.0, 38.0], [54.0, 70.0, 86.0]])
    assert torch.equal(reduce_logprobs(per_token, "action_level"), action_level)
    assert torch.equal(reduce_logprobs(per_token, "chunk_level"), torch.tensor([66.0, 210.0]))


# ---------------------------------------------------------------------------- preprocessing
def test_center_crop_samples_the_box_like_tf_crop_and_resize():
    h, w = 20, 30
    ramp = torch.linspace(0, 1, w).expand(1, 3, h, w).contiguous()  # value = x / (w - 1)
    out = center_crop_resize(ramp, 0.9)
    side = math.sqrt(0.9)
    expected = torch.linspace((1 - side) / 2, (1 + side) / 2, w)  # box sampled at linspace(x1, x2)
    assert torch.allclose(out[0, 0], expected.expand(h, w), atol=1e-5)


def test_image_preparation_and_the_two_normalizations():
    img = torch.zeros(2, 56, 56, 3, dtype=torch.uint8)
    img[..., 0], img[..., 1], img[..., 2] = 51, 128, 204
    same = prepare_images(img, 56, center_crop=False)
    assert same.shape == (2, 3, 56, 56) and torch.equal(same, img.permute(0, 3, 1, 2))
    resized = prepare_images(torch.full((1, 90, 120, 3), 77, dtype=torch.uint8), 56, center_crop=True)
    assert resized.dtype == torch.uint8 and resized.shape == (1, 3, 56, 56) and (resized == 77).all()

    ids = ("vit_large_patch14_reg4_dinov2.lvd142m", "vit_so400m_patch14_siglip_224")
    specs = [vit_spec(i, None, "test") for i in ids]
    pixels = normalize_images(torch.stack([same, same], dim=1), specs)  # 2 images per sample
    assert pixels.shape == (2, 12, 56, 56)
    rgb = torch.tensor([51, 128, 204]) / 255
    dino = (rgb - torch.tensor([0.485, 0.456, 0.406])) / torch.tensor([0.229, 0.224, 0.225])
    siglip = (rgb - 0.5) / 0.5
    per_image = torch.cat([dino, siglip])  # channels: image 1 (DINOv2, SigLIP), image 2 (...)
    assert torch.allclose(pixels[0, :, 0, 0], torch.cat([per_image, per_image]), atol=1e-6)


def test_prompts_follow_the_openvla_format_left_padded(ckpt):
    tok = load_tokenizer(ckpt)
    ids, mask = build_prompts(tok, TASKS[:2], 30)
    space = tok.convert_tokens_to_ids("▁")
    assert ids.shape == (2, 31) and (ids[:, 0] == tok.bos_token_id).all() and (ids[:, -1] == space).all()
    for row, task in zip(range(2), TASKS):
        text = tok.decode(ids[row][mask[row]][1:-1])
        assert text.strip() == f"In: What action should the robot take to {task.lower()}?\nOut:"
        n = int(mask[row].sum())
        assert not mask[row, 1 : 31 - n + 1].any() and mask[row, 31 - n + 1 :].all()
    with pytest.raises(ConfigError, match="max_prompt_length is 5"):
        build_prompts(tok, TASKS[:1], 5)


# ---------------------------------------------------------------------------- checkpoints
def test_tiny_checkpoint_loads_and_round_trips_through_save(ckpt, tmp_path):
    model = from_pretrained(ckpt, use_proprio=True)
    tok = load_tokenizer(ckpt)
    # every tensor of the public files landed in the parameter of the same name
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    state = model.state_dict()
    for file in sorted(set(index.values())):
        with safe_open(ckpt / file, "pt") as f:
            for k in f.keys():
                assert torch.equal(state[k], f.get_tensor(k)), k
    proprio = torch.load(next(ckpt.glob("proprio_projector--*.pt")), weights_only=True)
    assert torch.equal(state["proprio_projector.fc1.weight"], proprio["module.fc1.weight"])

    inputs = prompt_inputs(model, tok)
    with torch.no_grad():
        before = model(inputs, N_TOKENS)
    out = tmp_path / "saved"
    save_pretrained(model, out, tokenizer=tok, max_shard_bytes=200_000)
    saved_index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(saved_index) == set(index) and len(set(saved_index.values())) > 2
    assert json.loads((out / "config.json").read_text()) == json.loads((ckpt / "config.json").read_text())
    stats = "dataset_statistics.json"
    assert json.loads((out / stats).read_text()) == json.loads((ckpt / stats).read_text())
    with torch.no_grad():
        after = from_pretrained(out, use_proprio=True)(inputs, N_TOKENS)
    assert torch.equal(before.logits, after.logits)
    assert torch.equal(before.hidden_before_actions, after.hidden_before_actions)

    single = tmp_path / "single"
    save_pretrained(model, single, tokenizer=tok)  # one file below the shard size
    assert (single / "model.safetensors").exists() and not (single / "model.safetensors.index.json").exists()
    with torch.no_grad():
        assert torch.equal(from_pretrained(single, use_proprio=True)(inputs, N_TOKENS).logits, before.logits)


def test_checkpoint_with_wrong_keys_fails_naming_them(ckpt, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    index_path = bad / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    file = index["weight_map"]["projector.fc3.bias"]
    shard = load_file(str(bad / file))
    del shard["projector.fc3.bias"]
    shard["projector.fc4.weight"] = torch.zeros(2, 2)
    shard["language_model.model.norm.weight"] = torch.ones(7)  # wrong shape (hidden 64)
    save_file(shard, str(bad / file))
    del index["weight_map"]["projector.fc3.bias"]
    index["weight_map"]["projector.fc4.weight"] = file
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as err:
        from_pretrained(bad, use_proprio=True)
    message = str(err.value)
    assert "missing keys: projector.fc3.bias" in message
    assert "unexpected keys: projector.fc4.weight" in message
    assert "language_model.model.norm.weight (7,) != (64,)" in message

    no_key = tmp_path / "no_key"
    shutil.copytree(ckpt, no_key)
    config = json.loads((no_key / "config.json").read_text())
    del config["timm_model_ids"]
    (no_key / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"config.json: missing required key 'timm_model_ids'"):
        read_config(no_key)
    no_proprio = tmp_path / "no_proprio"
    shutil.copytree(ckpt, no_proprio)
    next(no_proprio.glob("proprio_projector--*.pt")).unlink()
    with pytest.raises(CheckpointError, match=r"use_proprio is true but .* has no proprio_projector--\*\.pt"):
        from_pretrained(no_proprio, use_proprio=True)


def test_public_names_cover_the_model_exactly(ckpt):
    """The independent list of public tensor names equals the model's own parameters."""
    config = json.loads((ckpt / "config.json").read_text())
    model = from_pretrained(ckpt, use_proprio=True)
    own = {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.startswith("proprio_projector.")}
    assert own == public_shapes(config)


def test_vit_features_come_from_the_second_to_last_block(ckpt):
    model = from_pretrained(ckpt, use_proprio=True)
    vit = model.vision_backbone.featurizer  # DINOv2 with a class token and 4 registers
    x = torch.randn(2, 3, 56, 56)
    with torch.no_grad():
        base = vit(x)
        assert base.shape == (2, 16, 32)  # (56 / 14)^2 patches; the 5 prefix tokens are dropped
        vit.blocks[-1].mlp.fc1.weight.add_(1.0)
        assert torch.equal(vit(x), base)
        vit.blocks[-2].mlp.fc1.weight.add_(1.0)
        assert not torch.allclose(vit(x), base)


# ---------------------------------------------------------------------------- decoding
def test_parallel_decoding_matches_token_by_token_decoding_under_a_causal_mask(ckpt):
    """What is compared: with a causal attention mask, the logits of the one-pass parallel
    decode (prompt + 56 zero action slots + stop token) at "▁" and at slots 0..54 must equal
    those of a KV-cached decode that feeds the 55 zero slots one per step, row by row in a
    padded batch of 3; so must the chosen tokens, greedy and sampled (the same Gumbel noise).
    With OFT's bidirectional mask the two cannot agree (slot i sees later slots), and the test
    checks that the bidirectional logits really depend on what follows."""
    model = from_pretrained(ckpt, use_proprio=True)
    inputs = prompt_inputs(model, load_tokenizer(ckpt))
    greedy = ActionSampler(do_sample=False)
    sampled = ActionSampler(do_sample=True, temperature=0.7, top_k=50)
    noise = sampled.gumbel((3, N_TOKENS, 256), torch.device("cpu"), torch.Generator().manual_seed(1))
    with torch.no_grad():
        par = parallel_decode(model, inputs, N_TOKENS, greedy, causal=True)
        seq = sequential_decode(model, inputs, N_TOKENS, greedy, feed_tokens=False)
        assert torch.allclose(par.logits, seq.logits, atol=1e-4, rtol=1e-4)
        assert torch.equal(par.slots, seq.slots)
        par_s = parallel_decode(model, inputs, N_TOKENS, sampled, causal=True, gumbel=noise)
        seq_s = sequential_decode(model, inputs, N_TOKENS, sampled, feed_tokens=False, gumbel=noise)
        assert torch.equal(par_s.slots, seq_s.slots)
        assert not torch.equal(par_s.slots, par.slots)  # sampling did not collapse to greedy

        bi = parallel_decode(model, inputs, N_TOKENS, greedy, causal=False)
        assert not torch.allclose(bi.logits[:, 0], par.logits[:, 0], atol=1e-3)
        bi_short = model(inputs, 7, causal=False)  # one action instead of eight
        causal_short = model(inputs, 7, causal=True)
        assert not torch.allclose(bi_short.logits[:, 0], bi.logits[:, 0], atol=1e-3)
        assert torch.allclose(causal_short.logits[:, :7], par.logits[:, :7], atol=1e-4)
        # padding is invisible: each row alone gives what it gives in the padded batch
        for i in range(3):
            alone = model(rows(inputs, i), N_TOKENS)
            assert torch.allclose(alone.logits[0], bi.logits[i], atol=1e-4)


def test_autoregressive_decoding_feeds_its_own_tokens(ckpt):
    model = from_pretrained(ckpt, use_proprio=True)
    inputs = prompt_inputs(model, load_tokenizer(ckpt))
    greedy = ActionSampler(do_sample=False)
    with torch.no_grad():
        ar = sequential_decode(model, inputs, 14, greedy, feed_tokens=True)
        slots_fed = sequential_decode(model, inputs, 14, greedy, feed_tokens=False)
        # the first token only sees the prompt, so both agree there and then diverge
        assert torch.equal(ar.slots[:, 0], slots_fed.slots[:, 0])
        assert not torch.allclose(ar.logits[:, 1:], slots_fed.logits[:, 1:])
        # teacher forcing the AR tokens through one causal pass reproduces the AR logits
        embeds, mask = model.prompt_embeddings(inputs)
        fed = model.language_model.get_input_embeddings()(model.action_tokenizer.slots_to_tokens(ar.slots[:, :-1]))
        full = torch.cat([embeds, fed], dim=1)
        key_mask = torch.cat([mask, mask.new_ones(3, 13)], dim=1)
        hidden = model.language_hidden(full, key_mask, position_ids(key_mask), causal=True)
        assert torch.allclose(model.action_logits(hidden[:, -14:]), ar.logits, atol=1e-4)


def test_sampler_temperature_and_top_k():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    s = ActionSampler(do_sample=True, temperature=2.0, top_k=2)
    logp = s.log_probs(logits)
    assert torch.isinf(logp[0, 2:]).all()
    assert torch.allclose(logp[0, :2].exp(), torch.softmax(torch.tensor([1.0, 0.5]), -1))
    assert torch.allclose(s.entropy(logp), -(logp[0, :2].exp() * logp[0, :2]).sum())
    draws = torch.stack([s.choose(logits) for _ in range(2000)])
    assert set(draws.unique().tolist()) == {0, 1}
    assert abs((draws == 0).float().mean().item() - torch.softmax(torch.tensor([1.0, 0.5]), -1)[0].item()) < 0.05
    assert ActionSampler(do_sample=False).choose(logits).item() == 0


# ---------------------------------------------------------------------------- the policy
def test_registry_and_config_group(ckpt):
    assert POLICIES.get("openvla_oft") is OpenVLAOFTPolicy
    cfg = tiny_cfg(ckpt)
    assert cfg["top_k"] == 1000000 and cfg["max_prompt_length"] == 30  # from algorithm / runner
    with pytest.raises(ConfigError, match="model_path is required"):
        build_policy(model_cfg(unnorm_key="tiny_dataset"))
    with pytest.raises(ConfigError, match="hidden_size=4096 but the checkpoint has 64"):
        build_policy(tiny_cfg(ckpt, hidden_size=4096))
    with pytest.raises(ConfigError, match="action_dim=6"):
        build_policy(tiny_cfg(ckpt, action_dim=6))


@pytest.mark.parametrize("value_type", ["chunk_level", "action_level"])
def test_act_then_evaluate_agree(ckpt, value_type):
    cfg = tiny_cfg(ckpt, value_type=value_type, use_proprio=True, num_images_in_input=2, temperature=0.8, top_k=64)
    policy = build_policy(cfg)
    obs = make_obs(3)
    torch.manual_seed(0)
    out = policy.act(obs)
    assert out.actions.shape == out.logprobs.shape == (3, 8, 7)
    assert out.values.shape == ((3,) if value_type == "chunk_level" else (3, 8))
    fi = out.forward_inputs
    assert fi["images"].shape == (3, 2, 3, 56, 56) and fi["images"].dtype == torch.uint8
    assert fi["action_tokens"].min() >= 256 and fi["action_tokens"].max() < 512

    new = policy(fi, out.actions)  # forward == evaluate
    assert torch.allclose(new.logprobs, out.logprobs, atol=1e-5)
    assert torch.allclose(new.values, out.values, atol=1e-5)
    assert (new.entropy >= 0).all() and (new.entropy <= math.log(64) + 1e-4).all()  # top-64 support
    assert new.logprobs.requires_grad

    # actions are the chosen bins, de-normalized with q01/q99; the masked gripper passes through
    stats = policy.action_stats
    centers = policy.core.action_tokenizer.decode(fi["action_tokens"])
    q01, q99 = torch.tensor(stats["q01"]), torch.tensor(stats["q99"])
    assert torch.allclose(out.actions[..., :6], (0.5 * (centers + 1) * (q99 - q01 + 1e-8) + q01)[..., :6], atol=1e-5)
    assert torch.equal(out.actions[..., 6], centers[..., 6])

    greedy = policy.act(obs, do_sample=False)
    assert torch.equal(greedy.actions, policy.act(obs, do_sample=False).actions)
    assert torch.allclose(policy(greedy.forward_inputs, greedy.actions).logprobs, greedy.logprobs, atol=1e-5)


def test_a_call_temperature_replaces_the_policys_own(ckpt):
    """Evaluation's ``temperature_eval``: ``act(temperature=t)`` draws and scores the bins at t,
    as a policy whose own temperature is t does; greedy picks the same bins at any temperature."""
    own = build_policy(tiny_cfg(ckpt, add_value_head=False, is_lora=False, temperature=1.0, top_k=64))
    hot = build_policy(tiny_cfg(ckpt, add_value_head=False, is_lora=False, temperature=4.0, top_k=64))
    hot.load_state_dict(own.state_dict())
    obs = make_obs(3)
    torch.manual_seed(2)
    a = own.act(obs, temperature=4.0)
    torch.manual_seed(2)
    b = hot.act(obs)
    assert torch.equal(a.actions, b.actions) and torch.allclose(a.logprobs, b.logprobs, atol=1e-6)
    torch.manual_seed(2)
    assert not torch.equal(own.act(obs).actions, a.actions)
    greedy, greedy_hot = own.act(obs, do_sample=False), own.act(obs, do_sample=False, temperature=4.0)
    assert torch.equal(greedy.actions, greedy_hot.actions)
    assert (greedy_hot.logprobs < greedy.logprobs).all()  # a flatter distribution over the bins


def test_act_is_batch_invariant_and_checks_obs(ckpt):
    policy = build_policy(tiny_cfg(ckpt, add_value_head=False, is_lora=False))
    obs = make_obs(3)
    batched = policy.act(obs, do_sample=False)
    assert batched.values is None
    for i in range(3):
        one = policy.act({k: v[i : i + 1] for k, v in obs.items()}, do_sample=False)
        assert torch.equal(one.forward_inputs["action_tokens"][0], batched.forward_inputs["action_tokens"][i])
    with pytest.raises(ValueError, match="uint8"):
        policy.act(obs | {"main_images": obs["main_images"].astype(np.float32)})
    with pytest.raises(KeyError, match="task_descriptions"):
        policy.act({"main_images": obs["main_images"]})
    two_images = build_policy(tiny_cfg(ckpt, num_images_in_input=2, is_lora=False))
    with pytest.raises(KeyError, match="wrist_images"):
        two_images.act({k: v for k, v in obs.items() if k != "wrist_images"})
    with pytest.raises(ValueError, match="do not match"):
        policy.evaluate(batched.forward_inputs, batched.actions[:, :1])


def test_proprio_is_one_more_token_that_matters(ckpt):
    policy = build_policy(tiny_cfg(ckpt, use_proprio=True, add_value_head=False, is_lora=False))
    obs = make_obs(2)
    a = policy.logits_and_values(policy.observation_inputs(obs))[0]
    b = policy.logits_and_values(policy.observation_inputs(obs | {"states": obs["states"] + 1}))[0]
    assert not torch.allclose(a, b)


# ---------------------------------------------------------------------------- LoRA
def test_lora_targets_trainables_and_adapter_round_trip(ckpt, tmp_path):
    policy = build_policy(tiny_cfg(ckpt, use_proprio=True))
    wrapped = {n.rsplit(".lora_A", 1)[0] for n, _ in policy.named_parameters() if ".lora_A." in n}
    prefix = "vla.base_model.model."
    assert f"{prefix}language_model.model.layers.1.self_attn.q_proj" in wrapped
    assert f"{prefix}language_model.model.layers.0.mlp.down_proj" in wrapped
    assert {f"{prefix}projector.fc{i}" for i in (1, 2, 3)} <= wrapped
    assert f"{prefix}vision_backbone.featurizer.blocks.0.attn.qkv" in wrapped
    assert f"{prefix}vision_backbone.fused_featurizer.blocks.1.mlp.fc2" in wrapped
    assert not any(k in n for n in wrapped for k in ("lm_head", "attn_pool", "proprio_projector", "embed_tokens"))
    assert f"{prefix}vision_backbone.featurizer.blocks.2.attn.qkv" not in wrapped  # the last block never runs
    assert len(wrapped) == 2 * 7 + 3 + 2 * 2 * 4
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert all(".lora_" in n or n.startswith("value_head.") for n in trainable)

    with torch.no_grad():  # make the adapters and the head non-trivial, then save and reload
        for n, p in policy.named_parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    obs = make_obs(2)
    out = policy.act(obs, do_sample=False)
    policy.save_pretrained(tmp_path / "rl")
    adapter_dir = str(tmp_path / "rl" / "lora_adapter")
    reloaded = build_policy(tiny_cfg(tmp_path / "rl", use_proprio=True, lora_path=adapter_dir))
    again = reloaded(out.forward_inputs, out.actions)
    assert torch.allclose(again.logprobs, out.logprobs, atol=1e-5)
    assert torch.allclose(again.values, out.values, atol=1e-5)
    shutil.copytree(tmp_path / "rl", tmp_path / "base", ignore=shutil.ignore_patterns("lora_adapter"))
    fresh = build_policy(tiny_cfg(tmp_path / "base", use_proprio=True))  # without the adapter: different
    assert not torch.allclose(fresh(out.forward_inputs, out.actions).logprobs, out.logprobs, atol=1e-3)

    adapter = load_file(str(tmp_path / "rl" / "lora_adapter" / "adapter_model.safetensors"))
    adapter["base_model.model.projector.fc9.lora_A.weight"] = torch.zeros(4, 4)
    save_file(adapter, str(tmp_path / "rl" / "lora_adapter" / "adapter_model.safetensors"))
    with pytest.raises(CheckpointError, match=r"unexpected keys: base_model.model.projector.fc9.lora_A.weight"):
        _lora_from(tmp_path / "rl", rank=4)
    with pytest.raises(CheckpointError, match="lora_rank=8 but the adapter"):
        _lora_from(tmp_path / "rl", rank=8)


def _lora_from(folder, rank: int):
    vla = from_pretrained(folder, use_proprio=True, add_value_head=True, lora_path=folder / "lora_adapter")
    return apply_lora(vla, lora_targets(vla), rank, min(rank, 16), folder / "lora_adapter")


def _fsdp_rank(rank: int, port: int, ckpt: str, save_dir: str, results) -> None:
    import os

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)  # same fresh adapters and value head on both ranks
        cfg = tiny_cfg(ckpt, use_proprio=True)
        actor = build_policy(cfg)
        frozen_name = "vla.base_model.model.language_model.model.layers.0.self_attn.q_proj.base_layer.weight"
        frozen_before = dict(actor.named_parameters())[frozen_name].detach().clone()
        out = actor.act(make_obs(4, seed=rank))
        for unit in actor.shard_units():
            fully_shard(unit)
        fully_shard(actor)
        before = actor.trainable_state_dict()
        optimizer = torch.optim.Adam([p for p in actor.parameters() if p.requires_grad], lr=1e-2)
        new = actor(out.forward_inputs, out.actions)
        advantages = torch.linspace(-1, 1, 4)
        loss = -(reduce_logprobs(new.logprobs, "chunk_level") * advantages).mean()
        loss = loss + (new.values - advantages).pow(2).mean() - 0.01 * new.entropy.mean()
        loss.backward()
        optimizer.step()
        synced = actor.trainable_state_dict()  # collective: gathers the shards on every rank
        with torch.no_grad():
            trained = actor(out.forward_inputs, out.actions)
        frozen_after = dict(actor.named_parameters())[frozen_name].full_tensor()
        actor.save_pretrained(save_dir)  # collective; rank 0 writes
        dist.barrier()
        result = {
            "finite": bool(torch.isfinite(loss)),
            "only_adapters": all(".lora_" in k or k.startswith("value_head.") for k in synced),
            "lora_b_changed": all(not torch.equal(before[k], synced[k]) for k in synced if ".lora_B." in k),
            "head_changed": not torch.equal(before["value_head.mlp.0.weight"], synced["value_head.mlp.0.weight"]),
            "frozen_unchanged": torch.equal(frozen_before, frozen_after),
        }
        if rank == 0:  # a separate rollout copy receives only the adapters and the value head
            torch.manual_seed(123)
            rollout = build_policy(cfg)
            stale = rollout(out.forward_inputs, out.actions)
            rollout.load_trainable_state_dict(synced)
            with torch.no_grad():
                synced_out = rollout(out.forward_inputs, out.actions)
            result["stale_differs"] = not torch.allclose(stale.logprobs, trained.logprobs, atol=1e-4)
            result["rollout_matches"] = bool(
                torch.allclose(synced_out.logprobs, trained.logprobs, atol=1e-5)
                and torch.allclose(synced_out.values, trained.values, atol=1e-5)
            )
            reloaded = build_policy(tiny_cfg(save_dir, use_proprio=True, lora_path=f"{save_dir}/lora_adapter"))
            with torch.no_grad():
                reloaded_out = reloaded(out.forward_inputs, out.actions)
            result["saved_matches"] = bool(
                torch.allclose(reloaded_out.logprobs, trained.logprobs, atol=1e-5)
                and torch.allclose(reloaded_out.values, trained.values, atol=1e-5)
            )
            result["sync_bytes"] = sum(v.numel() * v.element_size() for v in synced.values())
            result["model_bytes"] = sum(v.numel() * v.element_size() for v in rollout.state_dict().values())
        results[rank] = result
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_lora_under_fsdp2_trains_syncs_only_adapters_and_saves(ckpt, tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_fsdp_rank, args=(port, str(ckpt), str(tmp_path / "saved"), results), nprocs=2)
        results = dict(results)
    for rank in (0, 1):
        r = results[rank]
        assert r["finite"] and r["only_adapters"] and r["lora_b_changed"] and r["head_changed"], r
        assert r["frozen_unchanged"], r
    assert results[0]["stale_differs"] and results[0]["rollout_matches"] and results[0]["saved_matches"], results[0]
    assert results[0]["sync_bytes"] < 0.25 * results[0]["model_bytes"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_policy_on_cuda_agrees_with_evaluate(ckpt):
    policy = OpenVLAOFTPolicy(tiny_cfg(ckpt, precision="bf16"), device="cuda")
    out = policy.act(make_obs(4))
    new = policy(out.forward_inputs, out.actions)
    assert torch.allclose(new.logprobs.cpu(), out.logprobs, atol=1e-2)


def test_gradient_checkpointing_gives_the_same_gradients(ckpt):
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        policy = build_policy(tiny_cfg(ckpt))
        if checkpointing:
            policy.enable_gradient_checkpointing()
        policy.train()
        calls = []
        policy.core.language_model.model.layers[0].input_layernorm.register_forward_hook(lambda *_: calls.append(1))
        torch.manual_seed(1)
        out = policy.act(make_obs(2))
        new = policy(out.forward_inputs, out.actions)
        (new.logprobs.sum() + new.values.sum()).backward()
        assert len(calls) == (3 if checkpointing else 2)  # act, evaluate (+ recompute in backward)
        grads.append({n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 0
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-5), name
