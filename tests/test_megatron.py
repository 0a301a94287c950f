"""The Megatron-Core backend of the causal LM (policies/megatron/) on real Megatron-Core 0.16.1
over gloo: the HF <-> Megatron weight mapping, log-probs equal to the HF causal LM's, tensor
parallelism (2 spawned ranks) equal to one rank, dist_checkpointing resharding, export, the
training helpers, the refused options, and the CPU adapters (each upstream path still fails
without its adapter).

Tiny Qwen2 (grouped-query attention, QKV biases, untied embeddings) and Llama (tied embeddings,
a head size that is not hidden / heads, Llama 3 rope scaling) models are built from configs with
random weights, each also with an odd vocabulary (tiny_lm's 15 tokens), which tensor parallel 2
pads to 16 rows; in-process tests run Megatron on a one-process gloo group."""

from __future__ import annotations

import os
import socket
import traceback
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")  # the megatron extra
pytestmark = pytest.mark.timeout(600)  # a checkpoint saver without psutil hangs instead of failing

from core.errors import ConfigError

VOCAB = 64
ODD_VOCAB = 15  # tiny_lm's character vocabulary: not a multiple of the TP size 2
ODD = ("qwen2_odd", "llama_odd")  # the checkpoints with ODD_VOCAB (untied and tied embeddings)
VOCAB_SPLIT = ("embedding.word_embeddings.weight", "output_layer.weight")  # padded to a multiple of TP
STEPS = 3  # optimizer steps of the training comparisons
LR = 1e-2
CLIP = 1.0


# ----------------------------------------------------------------------------- tiny checkpoints
def make_checkpoint(folder: Path, family: str, vocab: int = VOCAB) -> Path:
    """A random HF checkpoint folder of ``family`` with a character tokenizer (the model's
    ``vocab`` may be smaller than the tokenizer's: the tests draw token ids below it)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    from policies.tiny_lm import train_tokenizer

    tokenizer = train_tokenizer(["0123456789+-= abcdefghijklmnopqrstuvwxyz"])
    ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed({"qwen2": 0, "llama": 1}[family])
    if family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(
            vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, **ids))
    else:
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=16384, tie_word_embeddings=True,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192}, **ids))
    with torch.no_grad():  # norms and biases away from 1 and 0, so that a mis-mapped one shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.normal_(1.0 if "norm" in name else 0.0, 0.2)
    path = folder / (family if vocab == VOCAB else f"{family}_odd")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module", autouse=True)
def one_process_group():
    """In-process tests share Megatron's groups over a one-process gloo group (model.init_parallel
    starts it); both are torn down after this module, so later modules start without them."""
    yield
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("megatron")
    even = {family: make_checkpoint(root, family) for family in ("qwen2", "llama")}
    return {**even, **{f"{family}_odd": make_checkpoint(root, family, ODD_VOCAB) for family in even}}


def vocab_of(name: str) -> int:
    return ODD_VOCAB if name in ODD else VOCAB


def megatron_cfg(path: Path, **over) -> dict:
    cfg = dict(model_type="causal_lm", model_path=str(path), action_dim=6, num_action_chunks=1,
               value_type="chunk_level", max_prompt_length=8, temperature=0.7, precision="fp32", is_lora=False,
               gradient_checkpointing=False, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
               sequence_parallel=False, recompute_granularity=None, recompute_method=None,
               recompute_num_layers=None, activation="swiglu", normalization="rmsnorm",
               position_embedding_type="rope", attention_softmax_in_fp32=True, megatron_checkpoint=None)
    cfg.update(over)
    return cfg


def hf_policy(path: Path):
    from policies.causal_lm import CausalLMPolicy

    cfg = megatron_cfg(path)
    cfg.update(add_value_head=False, do_sample=True, top_k=1000000, top_p=1.0, repetition_penalty=1.0,
               min_new_tokens=1, stop=None, tokenizer_model=None, tokenizer_use_fast=True,
               tokenizer_trust_remote_code=False, eos_token_id=None, pad_token_id=None, lora_rank=4, lora_path=None,
               attn_implementation="sdpa", trust_remote_code=False, low_cpu_mem_usage=True)
    return CausalLMPolicy(cfg)


def batch(seed: int = 0, size: int = 6, vocab: int = VOCAB) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Left-padded prompts (padding 0..5 tokens), responses with masks of different lengths."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (size, 8), generator=g)
    mask = torch.ones_like(ids)
    response_mask = torch.ones(size, 6)
    for row in range(size):
        pad = row % 6
        ids[row, :pad], mask[row, :pad] = 0, 0
        response_mask[row, 6 - row % 4:] = 0
    actions = torch.randint(2, vocab, (size, 1, 6), generator=g)
    return {"input_ids": ids, "attention_mask": mask, "response_mask": response_mask}, actions


def logits_of(policy, ids: torch.Tensor) -> torch.Tensor:
    """The GPTModel's (vocab-sharded) logits of unpadded sequences ``ids``."""
    width = ids.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool).triu(1)[None, None]
    return policy.model(ids, torch.arange(width)[None].expand_as(ids), causal)


def train(policy, forward_inputs, actions, steps: int = STEPS, optimizer=None, sharded: bool = False):
    """``steps`` Adam steps on one batch, in the actor's call order; returns the losses (mean
    over data-parallel ranks), the gradient norms and the optimizer (``sharded``: a distributed
    optimizer, whose parameters are this replica's share)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    optimizer = optimizer or torch.optim.Adam(policy.parameters(), lr=LR)
    losses, norms = [], []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        out = policy.evaluate(forward_inputs, actions)
        # per-sample sums, averaged over samples: the mean over DP ranks is the full batch's loss
        loss = -out.logprobs.sum((1, 2)).mean() - 0.01 * out.entropy.sum((1, 2)).mean()
        loss.backward()
        policy.reduce_gradients()
        norms.append(policy.clip_grad_norm(CLIP, [p for g in optimizer.param_groups for p in g["params"]], sharded))
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=parallel_state.get_data_parallel_group())
        losses.append(float(mean) / parallel_state.get_data_parallel_world_size())
    return losses, norms, optimizer


# ------------------------------------------------------------------------- weight mapping (pure)
@pytest.mark.parametrize("name", ["qwen2", "llama", *ODD])
def test_weight_mapping_splits_and_gathers_back_exactly(checkpoints, name):
    from transformers import AutoModelForCausalLM

    from policies.megatron.weights import (
        hf_to_megatron,
        megatron_to_hf,
        padded_vocab_size,
        read_architecture,
    )

    arch = read_architecture(checkpoints[name])
    hf = AutoModelForCausalLM.from_pretrained(checkpoints[name]).state_dict()
    shards = [hf_to_megatron(hf, arch, rank, 2) for rank in range(2)]
    qkv = shards[0]["decoder.layers.0.self_attention.linear_qkv.weight"]
    # rank 0 holds the first of the two key/value groups: its query heads, then k_0, then v_0
    per_group = arch.num_heads // arch.num_kv_heads * arch.head_dim
    query, key = hf["model.layers.0.self_attn.q_proj.weight"], hf["model.layers.0.self_attn.k_proj.weight"]
    assert torch.equal(qkv[:per_group], query[:per_group])
    assert torch.equal(qkv[per_group:per_group + arch.head_dim], key[:arch.head_dim])
    back = megatron_to_hf(shards, arch)
    assert set(back) == set(hf) and all(torch.equal(back[key], hf[key]) for key in hf)
    assert ("output_layer.weight" in shards[0]) == name.startswith("qwen2")  # tied embeddings: no output layer
    # the vocabulary: HF's rows, then zero rows up to a multiple of the TP size (16 for 15 tokens)
    assert padded_vocab_size(vocab_of(name), 2) == (16 if name in ODD else VOCAB)
    for key in VOCAB_SPLIT:
        if key in shards[0]:
            rows = torch.cat([shard[key] for shard in shards])
            assert rows.shape[0] == padded_vocab_size(arch.vocab_size, 2) and not rows[arch.vocab_size:].any()


def test_unmapped_families_and_features_are_refused(tmp_path):
    import json

    from policies.megatron.weights import read_architecture

    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match="model_type 'gpt2'.*GPT2LMHeadModel.*llama, qwen2"):
        read_architecture(tmp_path / "gpt2")
    (tmp_path / "window").mkdir()
    (tmp_path / "window" / "config.json").write_text(json.dumps({"model_type": "qwen2", "use_sliding_window": True}))
    with pytest.raises(ConfigError, match="use_sliding_window"):
        read_architecture(tmp_path / "window")


# ------------------------------------------------------------------------------ options refused
@pytest.mark.parametrize("over, world, message", [
    (dict(tensor_model_parallel_size=2), 3, "tensor_model_parallel_size=2 does not divide the actor's world size"),
    (dict(tensor_model_parallel_size=4), 4, "does not divide num_key_value_heads"),
    (dict(tensor_model_parallel_size=3), 3, "does not divide num_attention_heads"),
    (dict(pipeline_model_parallel_size=2), 2, "pipeline_model_parallel_size: not supported"),
    (dict(is_lora=True), 1, "is_lora: not supported with actor.training_backend megatron"),
    (dict(recompute_granularity="full"), 1, "recompute_method"),
    (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=3), 1, "recompute_num_layers"),
    (dict(recompute_num_layers=1), 1, "recompute_num_layers needs actor.model.recompute_granularity"),
    (dict(recompute_granularity="selective", gradient_checkpointing=True), 1, "both set"),
    (dict(activation="gelu"), 1, "activation='gelu' disagrees"),
    (dict(normalization="layernorm"), 1, "normalization='layernorm' disagrees"),
    (dict(max_prompt_length=100, action_dim=40), 1, "exceeds the 128 positions"),
])
def test_bad_options_are_refused_naming_the_key(checkpoints, over, world, message):
    from policies.megatron import check_options

    with pytest.raises(ConfigError, match=message):
        check_options(megatron_cfg(checkpoints["qwen2"], **over), world)


def test_cpu_only_options_are_refused(checkpoints):
    from policies.megatron import check_options

    check_options(megatron_cfg(checkpoints["qwen2"], tensor_model_parallel_size=2), 4)  # TP 2 x DP 2: fine
    check_options(megatron_cfg(checkpoints["qwen2_odd"], tensor_model_parallel_size=2), 2)  # vocabulary padded
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="sequence_parallel: not supported without CUDA"):
            check_options(megatron_cfg(checkpoints["qwen2"], tensor_model_parallel_size=2, sequence_parallel=True), 2)
        with pytest.raises(ConfigError, match="apply_rope_fusion: not supported without CUDA"):
            check_options(megatron_cfg(checkpoints["qwen2"], apply_rope_fusion=True), 1)


# --------------------------------------------------------------------- one rank (in process)
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_logits_and_logprobs_equal_the_hf_causal_lm(checkpoints, family):
    from transformers import AutoModelForCausalLM

    from policies.megatron.policy import MegatronCausalLMPolicy

    policy = MegatronCausalLMPolicy(megatron_cfg(checkpoints[family]))
    ids = torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(checkpoints[family])(ids).logits
        assert (logits_of(policy, ids) - expected).abs().max() < 1e-5
    forward_inputs, actions = batch()
    reference = hf_policy(checkpoints[family]).evaluate(forward_inputs, actions)
    out = policy.evaluate(forward_inputs, actions)
    assert out.logprobs.shape == out.entropy.shape == (6, 1, 6)
    assert (out.logprobs - reference.logprobs).abs().max() < 1e-5
    assert (out.entropy - reference.entropy).abs().max() < 1e-5
    masked = forward_inputs["response_mask"][:, None] == 0
    assert masked.any() and (out.logprobs[masked] == 0).all() and (out.logprobs[~masked] < 0).all()


def test_bf16_logprobs_are_close_to_fp32(checkpoints):
    from policies.megatron.policy import MegatronCausalLMPolicy

    path = checkpoints["llama"]
    policy = MegatronCausalLMPolicy(megatron_cfg(path, precision="bf16"))
    assert {p.dtype for p in policy.parameters()} == {torch.bfloat16}
    forward_inputs, actions = batch()
    out = policy.evaluate(forward_inputs, actions)
    assert out.logprobs.dtype == torch.float32  # scored in fp32, as causal_lm
    assert (out.logprobs - hf_policy(path).evaluate(forward_inputs, actions).logprobs).abs().max() < 0.05


def test_gradients_equal_the_hf_causal_lm(checkpoints):
    """Log-prob and entropy gradients through the vocab-parallel functions equal autograd's
    through HF's full log_softmax (the entropy's backward is written by hand)."""
    from policies.megatron.policy import MegatronCausalLMPolicy

    path = checkpoints["qwen2"]
    policy, reference = MegatronCausalLMPolicy(megatron_cfg(path)), hf_policy(path)
    forward_inputs, actions = batch(seed=1)
    for loss_of in (lambda out: out.logprobs.sum(), lambda out: out.entropy.sum()):
        policy.zero_grad()
        reference.zero_grad()
        loss_of(policy.evaluate(forward_inputs, actions)).backward()
        loss_of(reference.evaluate(forward_inputs, actions)).backward()
        ours = _grads_in_hf_layout(policy)
        theirs = {k.removeprefix("model."): p.grad for k, p in reference.named_parameters()}
        for name, grad in theirs.items():
            assert torch.allclose(ours[name], grad, atol=1e-5, rtol=1e-4), name


def _grads_in_hf_layout(policy) -> dict[str, torch.Tensor]:
    from policies.megatron.weights import megatron_to_hf

    return megatron_to_hf([{k: p.grad for k, p in policy.model.named_parameters()}], policy.arch)


def test_weight_sync_export_and_checkpoint_round_trips(checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    from policies.megatron.policy import MegatronCausalLMPolicy

    path = checkpoints["llama"]
    policy = MegatronCausalLMPolicy(megatron_cfg(path))
    forward_inputs, actions = batch(seed=2)
    train(policy, forward_inputs, actions, steps=1)  # weights that differ from the checkpoint's
    trained = policy.evaluate(forward_inputs, actions).logprobs.detach()
    # weight sync: the rollout's HF policy takes the state dict as it is
    rollout = hf_policy(path)
    rollout.load_trainable_state_dict(policy.trainable_state_dict())
    assert (rollout.evaluate(forward_inputs, actions).logprobs - trained).abs().max() < 1e-5
    # export: an HF folder that from_pretrained and the causal LM policy read
    policy.export_pretrained(tmp_path / "export")
    exported = hf_policy(tmp_path / "export")
    assert (exported.evaluate(forward_inputs, actions).logprobs - trained).abs().max() < 1e-5
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export").state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in policy.hf_state_dict().items())
    # dist_checkpointing: a fresh policy (HF weights) reads the trained ones back
    policy.save_checkpoint(tmp_path / "ckpt")
    fresh = MegatronCausalLMPolicy(megatron_cfg(path))
    fresh.load_state_dict(fresh.read_checkpoint(tmp_path / "ckpt"))
    assert torch.equal(fresh.evaluate(forward_inputs, actions).logprobs, trained)
    again = MegatronCausalLMPolicy(megatron_cfg(path, megatron_checkpoint=str(tmp_path / "ckpt")))
    assert torch.equal(again.evaluate(forward_inputs, actions).logprobs, trained)


# ----------------------------------------------------- mixed precision (actor.optim.fp16 / bf16)
def mixed_optimizer(groups, lr: float = 3e-4, scale: float = 1024.0, dynamic: bool = False, window: int = 5):
    """``MegatronBackend.optimizer``'s mixed-precision optimizer (Adam) over ``groups``."""
    from policies.megatron.mixed_precision import LossScale, MainWeightsOptimizer

    return MainWeightsOptimizer(groups, lambda g: torch.optim.Adam(g, lr=lr), LossScale(scale, window, dynamic))


def mixed(policy, scale: float = 1024.0, dynamic: bool = False, window: int = 5, lr: float = 3e-4):
    """A mixed-precision optimizer over ``policy`` and its scaler."""
    from policies.megatron.mixed_precision import Scaler

    optimizer = mixed_optimizer([{"params": list(policy.parameters())}], lr, scale, dynamic, window)
    return optimizer, Scaler(optimizer)


def train_mixed(policy, optimizer, scaler, forward_inputs, actions, steps: int, sharded: bool = False,
                clip=None) -> list[float]:
    """The actor's call order with a loss scaler (core/backend.py); the losses on this rank.
    ``clip``: what clips the gradients and returns their norm (a backend's ``clip_gradients``)."""
    import math

    stepped = [p for g in optimizer.param_groups for p in g["params"]]
    clip = clip or (lambda: policy.clip_grad_norm(CLIP, stepped, sharded))
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        out = policy.evaluate(forward_inputs, actions)
        loss = -out.logprobs.sum((1, 2)).mean() - 0.01 * out.entropy.sum((1, 2)).mean()
        scaler.scale(loss).backward()
        policy.reduce_gradients()
        scaler.unscale_(optimizer)
        if math.isfinite(clip()):
            scaler.step(optimizer)
        scaler.update()
        losses.append(float(loss))
    return losses


def test_mixed_precision_trains_an_fp16_model_as_fp32_does(checkpoints):
    """fp16 parameters with fp32 main weights follow the fp32 run (plain Adam on the fp16
    parameters breaks at once: its epsilon is 0 in fp16, and 0/0 is nan)."""
    from policies.megatron.policy import MegatronCausalLMPolicy

    forward_inputs, actions = batch()
    reference = MegatronCausalLMPolicy(megatron_cfg(checkpoints["qwen2"]))
    optimizer = torch.optim.Adam(reference.parameters(), lr=3e-4)
    losses32 = []
    for _ in range(6):
        optimizer.zero_grad(set_to_none=True)
        out = reference.evaluate(forward_inputs, actions)
        loss = -out.logprobs.sum((1, 2)).mean() - 0.01 * out.entropy.sum((1, 2)).mean()
        loss.backward()
        reference.clip_grad_norm(CLIP)
        optimizer.step()
        losses32.append(loss.item())
    half = MegatronCausalLMPolicy(megatron_cfg(checkpoints["qwen2"], precision="fp16"))
    optimizer, scaler = mixed(half)
    losses = train_mixed(half, optimizer, scaler, forward_inputs, actions, steps=6)
    assert losses == pytest.approx(losses32, rel=2e-3) and losses[-1] < losses[0] - 1.0
    assert {m.dtype for m in optimizer.main_params} == {torch.float32}
    assert {p.dtype for p in half.parameters()} == {torch.float16}
    assert all(torch.equal(p, m.half()) for p, m in zip(half.parameters(), optimizer.main_params))
    trained32 = dict(reference.named_parameters())
    error = max(float((m - trained32[name]).abs().max())
                for (name, _), m in zip(half.named_parameters(), optimizer.main_params))
    assert error < 2e-3  # Adam's steps are 3e-4 each: six of them, nearly as fp32 took them
    plain = MegatronCausalLMPolicy(megatron_cfg(checkpoints["qwen2"], precision="fp16"))
    train(plain, forward_inputs, actions, steps=2, optimizer=torch.optim.Adam(plain.parameters(), lr=3e-4))
    assert not all(torch.isfinite(p).all() for p in plain.parameters())


def test_bf16_mixed_precision_steps_fp32_main_weights_without_a_loss_scale(checkpoints):
    from policies.megatron.policy import MegatronCausalLMPolicy

    forward_inputs, actions = batch()
    half = MegatronCausalLMPolicy(megatron_cfg(checkpoints["qwen2"], precision="bf16"))
    optimizer, scaler = mixed(half, scale=1.0)  # what MegatronBackend.optimizer gives bf16: scale 1, static
    losses = train_mixed(half, optimizer, scaler, forward_inputs, actions, steps=4)
    assert losses[-1] < losses[0] and not scaler.overflow
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    assert all(torch.equal(p, m.bfloat16()) for p, m in zip(half.parameters(), optimizer.main_params))
    # the updates (3e-4 a step) are below bf16's resolution of most weights: they add up in fp32
    assert any(not torch.equal(m, m.bfloat16().float()) for m in optimizer.main_params)


def test_an_overflow_skips_the_step_and_a_dynamic_scale_backs_off_then_grows(checkpoints):
    from policies.megatron.mixed_precision import INITIAL_SCALE, LossScale
    from policies.megatron.policy import MegatronCausalLMPolicy

    scale = LossScale(8.0, window=2, dynamic=True)
    seen = []
    for overflow in (True, True, True, False, False, False, True):
        scale.update(overflow)
        seen.append(scale.scale)
    # the first overflow is forgiven (hysteresis 2), then each halves; 2 clean steps double it and
    # restore the hysteresis
    assert seen == [8.0, 4.0, 2.0, 2.0, 4.0, 4.0, 4.0]
    static = LossScale(8.0, window=2, dynamic=False)
    static.update(True)
    assert static.scale == 8.0
    forward_inputs, actions = batch()
    half = MegatronCausalLMPolicy(megatron_cfg(checkpoints["qwen2"], precision="fp16"))
    optimizer, scaler = mixed(half, INITIAL_SCALE, dynamic=True, window=3)
    before = [m.detach().clone() for m in optimizer.main_params]
    losses = train_mixed(half, optimizer, scaler, forward_inputs, actions, steps=3)
    # 2^32 x the loss overflows fp16: nothing moved, and the scale came down after the second
    assert all(torch.equal(m, b) for m, b in zip(optimizer.main_params, before))
    assert scaler.get_scale() == INITIAL_SCALE / 4
    optimizer, scaler = mixed(half, 1024.0)
    losses = train_mixed(half, optimizer, scaler, forward_inputs, actions, steps=1)
    out = half.evaluate(forward_inputs, actions)
    scaler.scale(out.logprobs.sum()).backward()
    next(half.parameters()).grad[0, 0] = float("inf")  # one gradient overflowed
    scaler.unscale_(optimizer)
    assert scaler.overflow
    moved = [m.detach().clone() for m in optimizer.main_params]
    scaler.step(optimizer)
    assert all(torch.equal(m, b) for m, b in zip(optimizer.main_params, moved)) and losses


def test_a_mixed_precision_checkpoint_keeps_the_fp32_main_weights_and_the_loss_scale(checkpoints, tmp_path):
    from policies.megatron.policy import MegatronCausalLMPolicy

    forward_inputs, actions = batch()
    policy = MegatronCausalLMPolicy(megatron_cfg(checkpoints["qwen2"], precision="fp16"))
    optimizer, scaler = mixed(policy, 1024.0, dynamic=True, window=2)
    train_mixed(policy, optimizer, scaler, forward_inputs, actions, steps=3)
    policy.save_checkpoint(tmp_path / "mixed", optimizer)
    saved = [m.detach().clone() for m in optimizer.main_params]
    assert any(not torch.equal(m, m.half().float()) for m in saved)  # more than the fp16 weights hold
    after = train_mixed(policy, optimizer, scaler, forward_inputs, actions, steps=2)
    again = MegatronCausalLMPolicy(megatron_cfg(checkpoints["qwen2"], precision="fp16"))
    resumed, resumed_scaler = mixed(again, 1.0, dynamic=True, window=2)
    again.load_state_dict(again.read_checkpoint(tmp_path / "mixed"))
    again.load_optimizer(resumed, tmp_path / "mixed")
    assert all(torch.equal(m, s) for m, s in zip(resumed.main_params, saved))
    assert resumed_scaler.get_scale() == 2048.0 and resumed.loss_scale.clean == 1  # 3 clean steps, window 2
    assert train_mixed(again, resumed, resumed_scaler, forward_inputs, actions, steps=2) == after


def test_a_deep_copy_is_an_independent_twin(checkpoints):
    """The actor's KL reference is ``copy.deepcopy(policy)``."""
    import copy

    from policies.megatron.policy import MegatronCausalLMPolicy

    policy = MegatronCausalLMPolicy(megatron_cfg(checkpoints["qwen2"]))
    forward_inputs, actions = batch()
    train(policy, forward_inputs, actions, steps=1)
    twin = copy.deepcopy(policy).requires_grad_(False)
    trained = policy.evaluate(forward_inputs, actions).logprobs
    assert torch.equal(twin.evaluate(forward_inputs, actions).logprobs, trained)
    train(policy, forward_inputs, actions, steps=1)
    assert not torch.equal(twin.evaluate(forward_inputs, actions).logprobs, policy.evaluate(forward_inputs, actions).logprobs)


def test_reading_a_folder_that_is_no_checkpoint_fails_naming_it(checkpoints, tmp_path):
    from core.errors import CheckpointError
    from policies.megatron.policy import MegatronCausalLMPolicy

    policy = MegatronCausalLMPolicy(megatron_cfg(checkpoints["qwen2"]))
    with pytest.raises(CheckpointError, match="not a Megatron dist_checkpointing folder"):
        policy.read_checkpoint(tmp_path)


# ------------------------------------------- CPU adapters: upstream still fails without each one
def fails_at(error: pytest.ExceptionInfo, file: str, line: int) -> bool:
    """Whether the exception passed through upstream ``file``:``line`` (the line cpu.py cites)."""
    return any(f.filename.endswith(file) and f.lineno == line for f in traceback.extract_tb(error.tb))


cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the adapters apply without CUDA only")


def test_the_adapters_are_written_for_the_installed_megatron():
    import megatron.core

    from policies.megatron import cpu

    assert megatron.core.__version__ == cpu.MEGATRON_VERSION


@cpu_only
def test_rotary_adapter(monkeypatch):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import (
        RotaryEmbedding,
    )

    from policies.megatron import cpu

    def rotary():
        return RotaryEmbedding(kv_channels=16, rotary_percent=1.0, rotary_base=500.0, use_cpu_initialization=True)

    with pytest.raises(AssertionError, match="not compiled with CUDA") as error:
        rotary().get_emb(12, offset=2)
    assert fails_at(error, "rotary_pos_embedding.py", 162)
    adapted = rotary()
    cpu.keep_rotary_on_host(adapted)
    with monkeypatch.context() as patch:  # upstream's own result, its CUDA device pointed at the host
        patch.setattr(torch.cuda, "current_device", lambda: "cpu")
        expected = rotary().get_emb(12, offset=2)
    assert torch.equal(adapted.get_emb(12, offset=2), expected)


@cpu_only
def test_rng_tracker_choice():
    """Megatron's training RNG tracker cannot even be seeded without CUDA; the inference
    tracker that init_parallel installs seeds and forks as no-ops (dropout is 0)."""
    from megatron.core.tensor_parallel.random import (
        CudaRNGStatesTracker,
        get_cuda_rng_tracker,
    )

    from policies.megatron.model import init_parallel

    with pytest.raises(AssertionError, match="not compiled with CUDA") as error:
        CudaRNGStatesTracker().add("model-parallel-rng", 1234)
    assert fails_at(error, "tensor_parallel/random.py", 235)
    init_parallel(1)
    tracker = get_cuda_rng_tracker()
    assert type(tracker).__name__ == "InferenceCudaRNGStatesTracker"
    tracker.add("model-parallel-rng", 1234)  # neither raises
    with tracker.fork():
        pass


@cpu_only
def test_attention_buffer_adapter():
    from megatron.core.utils import GlobalMemoryBuffer

    from policies.megatron import cpu

    with pytest.raises(AssertionError, match="not compiled with CUDA") as error:
        GlobalMemoryBuffer().get_tensor((4, 3), torch.float32, "mpu")
    assert fails_at(error, "megatron/core/utils.py", 631)
    buffer = cpu.host_memory_buffer()
    big = buffer.get_tensor((4, 3), torch.float32, "mpu")
    small = buffer.get_tensor((2, 5), torch.float32, "mpu")  # fits: the same memory, reshaped
    assert big.shape == (4, 3) and small.shape == (2, 5) and big.data_ptr() == small.data_ptr()


@cpu_only
@pytest.mark.parametrize("recompute", [
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    dict(recompute_granularity="selective"),
    None,  # actor.model.gradient_checkpointing: the actor calls enable_gradient_checkpointing()
])
def test_recompute_adapter(checkpoints, recompute):
    from policies.megatron.policy import MegatronCausalLMPolicy

    path = checkpoints["qwen2"]
    forward_inputs, actions = batch(seed=3)
    plain = MegatronCausalLMPolicy(megatron_cfg(path))
    recomputed = MegatronCausalLMPolicy(megatron_cfg(path, **(recompute or {})))
    if recompute is None:
        assert len(recomputed.enable_gradient_checkpointing()) == 2  # both layers
    for policy in (plain, recomputed):
        policy.train()
        policy.evaluate(forward_inputs, actions).logprobs.sum().backward()
    for (name, p), q in zip(plain.named_parameters(), recomputed.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), name
    # upstream's recompute (set on the model's config, read at forward time) needs CUDA RNG state
    plain.model.config.recompute_granularity, plain.model.config.recompute_method = "full", "uniform"
    plain.model.config.recompute_num_layers = 1
    with pytest.raises(AssertionError, match="not compiled with CUDA") as error:
        plain.evaluate(forward_inputs, actions)
    assert fails_at(error, "tensor_parallel/random.py", 55)


@cpu_only
def test_checkpoint_save_adapter(checkpoints, tmp_path):
    import functools

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
    from megatron.core.dist_checkpointing.strategies.state_dict_saver import (
        save_state_dict_async_finalize,
    )
    from megatron.core.dist_checkpointing.strategies.torch import (
        TorchDistSaveShardedStrategy,
    )

    from policies.megatron import cpu
    from policies.megatron.policy import MegatronCausalLMPolicy

    model = MegatronCausalLMPolicy(megatron_cfg(checkpoints["qwen2"])).model
    for name in ("upstream", "half", "adapted"):
        (tmp_path / name).mkdir()
    with pytest.raises(AssertionError, match="not compiled with CUDA") as error:
        dist_checkpointing.save({"model": model.sharded_state_dict()}, str(tmp_path / "upstream"))
    assert fails_at(error, "filesystem_async.py", 230)

    class HostStagingOnly(TorchDistSaveShardedStrategy):  # the adapter's first half alone
        def _get_save_and_finalize_callbacks(self, writer, save_state_dict_ret):
            save_fn, _, args = writer.get_save_function_and_args()
            return AsyncRequest(save_fn, args, [functools.partial(save_state_dict_async_finalize, *save_state_dict_ret)],
                                preload_fn=functools.partial(writer.preload_tensors, writer.write_buckets, False))

    with pytest.raises(AssertionError, match="not compiled with CUDA") as error:
        dist_checkpointing.save({"model": model.sharded_state_dict()}, str(tmp_path / "half"),
                                sharded_strategy=HostStagingOnly("torch_dist", 1))
    assert fails_at(error, "state_dict_saver.py", 252)
    dist_checkpointing.save({"model": model.sharded_state_dict()}, str(tmp_path / "adapted"),
                            sharded_strategy=cpu.host_save_strategy())
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(tmp_path / "adapted"))["model"]
    assert all(torch.equal(loaded[k], p) for k, p in model.named_parameters())


# ------------------------------------------------------------ two ranks (spawned, real gloo)
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(target, folder: Path, *args, ranks: int = 2, timeout: float = 300.0) -> list:
    """Run ``target(rank, folder, *args)`` on ``ranks`` spawned processes of one gloo group; their
    return values, or a failure with the first rank's traceback (or a timeout: nothing hangs)."""
    import multiprocessing
    import time

    context = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [context.Process(target=_rank, args=(target, rank, ranks, port, folder, args)) for rank in range(ranks)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(deadline - time.monotonic(), 0.1))
    if any(p.is_alive() for p in procs):
        for p in procs:
            p.kill()
            p.join()
        pytest.fail(f"the {ranks} ranks did not finish in {timeout:.0f} s")
    for rank, p in enumerate(procs):
        if p.exitcode != 0:
            error = folder / f"error{rank}.txt"
            pytest.fail(f"rank {rank} exited with {p.exitcode}:\n{error.read_text() if error.exists() else ''}")
    return [torch.load(folder / f"result{rank}.pt", weights_only=False) for rank in range(ranks)]


def _rank(target, rank: int, ranks: int, port: int, folder: Path, args: tuple) -> None:
    import warnings

    import torch.distributed as dist

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    try:
        torch.save(target(rank, folder, *args), folder / f"result{rank}.pt")
    except BaseException:
        (folder / f"error{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def tensor_parallel_shards(tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """``tensors`` (this rank's, by Megatron name) as every rank of the tensor-parallel group holds
    them, ``[rank 0's, rank 1's, ...]``: what ``megatron_to_hf`` takes."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(dist.get_world_size(group))]
    for key, tensor in tensors.items():
        parts = [torch.empty_like(tensor) for _ in shards]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        for shard, part in zip(shards, parts):
            shard[key] = part
    return shards


def vocab_padding(shards: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """The rows past ``ODD_VOCAB`` of the vocab-split tensors in ``shards``, in one tensor."""
    return torch.cat([torch.cat([shard[key] for shard in shards])[ODD_VOCAB:]
                      for key in VOCAB_SPLIT if key in shards[0]])


def weights_of(policy) -> dict[str, torch.Tensor]:
    return {k: p.detach() for k, p in policy.model.named_parameters()}


def probe_loss(out) -> torch.Tensor:
    """Log-probs and entropy weighed alike, so that both backwards show in the gradients."""
    return out.logprobs.sum() + out.entropy.sum()


def _two_ranks(rank: int, folder: Path, checkpoints: dict[str, Path]) -> dict:
    """On each of 2 ranks: TP 2 (every checkpoint; the odd vocabularies also train, save, export
    and start from a TP 1 checkpoint), then TP 1 x DP 2; what the tests compare."""
    from megatron.core import parallel_state
    from transformers import AutoModelForCausalLM

    from policies.megatron import training
    from policies.megatron.distributed_optimizer import ShardedOptimizer
    from policies.megatron.mixed_precision import Scaler
    from policies.megatron.policy import MegatronCausalLMPolicy
    from policies.megatron.weights import megatron_to_hf

    out: dict = {}
    policies = {}
    for name, path in checkpoints.items():
        vocab = vocab_of(name)
        policy = policies[name] = MegatronCausalLMPolicy(megatron_cfg(path, tensor_model_parallel_size=2))
        hf = AutoModelForCausalLM.from_pretrained(path)
        ids = torch.randint(0, vocab, (3, 12), generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            logits = logits_of(policy, ids)  # this rank's slice of the padded vocabulary
            first = rank * logits.shape[-1]
            expected = hf(ids).logits[..., first:first + logits.shape[-1]]  # no padding column
            out[f"{name}/logits_error"] = float((logits[..., :expected.shape[-1]] - expected).abs().max())
        synced, weights = policy.trainable_state_dict(), hf.state_dict()
        out[f"{name}/sync_exact"] = (synced.keys() == {"model." + k for k in weights}
                                     and all(torch.equal(synced["model." + k], v) for k, v in weights.items()))
        evaluated = policy.evaluate(*batch(vocab=vocab))
        out[f"{name}/logprobs"], out[f"{name}/entropy"] = evaluated.logprobs.detach(), evaluated.entropy.detach()
    out["tp2_layout"] = training.data_parallel_size(), training.share_across_tensor_parallel(f"rank {rank}'s")
    # odd vocabularies: gradients, then training, a checkpoint with the optimizer, an export, one more step
    forward_inputs, actions = batch(vocab=ODD_VOCAB)
    for name in ODD:
        policy = policies[name]
        probe_loss(policy.evaluate(forward_inputs, actions)).backward()
        grads = tensor_parallel_shards({k: p.grad for k, p in policy.model.named_parameters()})
        out[f"{name}/grads"] = megatron_to_hf(grads, policy.arch, policy.model.uses_fused_norms)
        out[f"{name}/padding_grads"] = vocab_padding(grads)
        _, _, optimizer = train(policy, forward_inputs, actions)
        out[f"{name}/padding"] = vocab_padding(tensor_parallel_shards(weights_of(policy)))
        out[f"{name}/trained"] = policy.evaluate(forward_inputs, actions).logprobs.detach()
        out[f"{name}/trained_hf"] = policy.hf_state_dict()
        policy.save_checkpoint(folder / f"{name}_tp2", optimizer)
        policy.export_pretrained(folder / f"{name}_export")
        out[f"{name}/after_resume"] = train(policy, forward_inputs, actions, steps=1, optimizer=optimizer)[0]
    # the test process's TP 1 checkpoint (15 rows) starts TP 2 (16 rows)
    policy = MegatronCausalLMPolicy(megatron_cfg(checkpoints["llama_odd"], tensor_model_parallel_size=2,
                                                 megatron_checkpoint=str(folder / "llama_odd_tp1")))
    out["from_tp1"] = policy.evaluate(forward_inputs, actions).logprobs.detach()
    out["from_tp1_padding"] = vocab_padding(tensor_parallel_shards(weights_of(policy)))
    # training on one batch, a checkpoint with the optimizer, one more step after it
    policy = policies["llama"]
    forward_inputs, actions = batch()
    out["losses"], out["norms"], optimizer = train(policy, forward_inputs, actions)
    out["trained"] = policy.evaluate(forward_inputs, actions).logprobs.detach()
    policy.save_checkpoint(folder / "tp2", optimizer)
    out["after_resume"] = train(policy, forward_inputs, actions, steps=1, optimizer=optimizer)[0]
    # TP 1 x DP 2: each rank trains on its half of the batch
    parallel_state.destroy_model_parallel()
    policy = MegatronCausalLMPolicy(megatron_cfg(checkpoints["llama"]))
    out["dp2_layout"] = training.data_parallel_rank(), training.data_parallel_size()
    mine = slice(rank * 3, rank * 3 + 3)
    train(policy, {k: v[mine] for k, v in forward_inputs.items()}, actions[mine])
    out["data_parallel_trained"] = policy.evaluate(forward_inputs, actions).logprobs.detach()
    # fp16 with fp32 main weights, data parallel, then the distributed optimizer: each replica
    # steps and keeps the state of its share
    parallel_state.destroy_model_parallel()
    policy = MegatronCausalLMPolicy(megatron_cfg(checkpoints["llama"], precision="fp16"))
    optimizer, scaler = mixed(policy, lr=LR)
    train_mixed(policy, optimizer, scaler, {k: v[mine] for k, v in forward_inputs.items()}, actions[mine], STEPS)
    out["data_parallel_fp16_state"] = {k: p.detach().float() for k, p in policy.named_parameters()}
    for precision in ("fp32", "fp16"):
        parallel_state.destroy_model_parallel()
        policy = MegatronCausalLMPolicy(megatron_cfg(checkpoints["llama"], precision=precision))
        build = (lambda g: torch.optim.Adam(g, lr=LR)) if precision == "fp32" else (lambda g: mixed_optimizer(g, LR))
        optimizer = ShardedOptimizer([{"params": list(policy.parameters())}], build,
                                     parallel_state.get_data_parallel_group())
        half = {k: v[mine] for k, v in forward_inputs.items()}, actions[mine]
        if precision == "fp32":
            train(policy, *half, optimizer=optimizer, sharded=True)
        else:
            train_mixed(policy, optimizer, Scaler(optimizer.inner), *half, steps=STEPS, sharded=True)
        out[f"sharded_{precision}_trained"] = policy.evaluate(forward_inputs, actions).logprobs.detach().float()
        out[f"sharded_{precision}_state"] = {k: p.detach().float() for k, p in policy.named_parameters()}
        out[f"sharded_{precision}_values"] = sum(t.numel() for state in optimizer.state.values()
                                                 for t in state.values() if t.dim() > 0) \
            + sum(p.numel() for p in optimizer.main_params)
        out[f"sharded_{precision}_weights"] = sum(p.numel() for p in policy.parameters())
    policy.save_checkpoint(folder / "dp2_sharded", optimizer)
    out["sharded_after_resume"] = train_mixed(policy, optimizer, Scaler(optimizer.inner), *half, steps=1, sharded=True)[0]
    parallel_state.destroy_model_parallel()  # a fresh start at the same layout, from the checkpoint
    policy = MegatronCausalLMPolicy(megatron_cfg(checkpoints["llama"], precision="fp16"))
    optimizer = ShardedOptimizer([{"params": list(policy.parameters())}], lambda g: mixed_optimizer(g, LR),
                                 parallel_state.get_data_parallel_group())
    policy.load_state_dict(policy.read_checkpoint(folder / "dp2_sharded"))
    policy.load_optimizer(optimizer, folder / "dp2_sharded")
    out["sharded_resumed"] = train_mixed(policy, optimizer, Scaler(optimizer.inner), *half, steps=1, sharded=True)[0]
    # mixed precision: an overflow in one rank's gradients skips the step on both
    parallel_state.destroy_model_parallel()
    policy = MegatronCausalLMPolicy(megatron_cfg(checkpoints["llama"], precision="fp16"))
    optimizer, scaler = mixed(policy)
    out["overflows"] = []
    for inject in (False, True):
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(policy.evaluate(forward_inputs, actions).logprobs.sum()).backward()
        if inject and rank == 1:
            next(policy.parameters()).grad[0, 0] = float("inf")
        scaler.unscale_(optimizer)
        out["overflows"].append(scaler.overflow)
    return out


def _through_the_backend(rank: int, folder: Path, model_path: Path) -> dict:
    """``MegatronBackend`` as the actor drives it, from a config (fp16, a static loss scale, the
    distributed optimizer, TP 1 x DP 2): a step, a checkpoint, a step; then a fresh policy and
    optimizer of the backend resumed from the checkpoint take that second step again."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from embodied.config import compose
    from embodied.training_options import build_optimizer
    from policies.megatron.backend import MegatronBackend

    port = [free_port()]
    dist.broadcast_object_list(port, src=0)
    dist.destroy_process_group()  # the backend joins the actor's group itself
    os.environ.update(MASTER_PORT=str(port[0]), RANK=str(rank), WORLD_SIZE="2")
    cfg = compose("math_grpo_tiny", [f"actor.model.model_path={model_path}", "actor.training_backend=megatron",
                                     "actor.model.tensor_model_parallel_size=1", "actor.model.precision=fp16",
                                     "actor.optim.fp16=true", "actor.optim.loss_scale=1024",
                                     "actor.optim.use_distributed_optimizer=true"])
    backend, cpu = MegatronBackend(cfg, "cpu"), torch.device("cpu")

    def fresh():
        policy = backend.wrap(backend.build(cpu))
        optimizer = backend.optimizer([{"params": list(policy.parameters())}], lambda g: build_optimizer(g, cfg.actor.optim))
        return policy, optimizer, backend.loss_scaler(optimizer, cpu)

    forward_inputs, actions = batch()
    mine = slice(rank * 3, rank * 3 + 3)
    half = {k: v[mine] for k, v in forward_inputs.items()}, actions[mine]
    policy, optimizer, scaler = fresh()
    train_mixed(policy, optimizer, scaler, *half, steps=1, clip=lambda: backend.clip_gradients(policy, CLIP))
    backend.save(policy, optimizer, folder / "backend")
    out = {"straight": train_mixed(policy, optimizer, scaler, *half, steps=1,
                                   clip=lambda: backend.clip_gradients(policy, CLIP)),
           "owned": sum(p.numel() for p in optimizer.main_params), "weights": sum(p.numel() for p in policy.parameters()),
           "dtypes": {p.dtype for p in policy.parameters()} | {m.dtype for m in optimizer.main_params}}
    parallel_state.destroy_model_parallel()
    policy, optimizer, scaler = fresh()
    backend.load(policy, optimizer, folder / "backend", with_optimizer=True)
    out["resumed"] = train_mixed(policy, optimizer, scaler, *half, steps=1,
                                 clip=lambda: backend.clip_gradients(policy, CLIP))
    return out


@pytest.mark.slow
def test_the_megatron_backend_builds_mixed_precision_and_the_distributed_optimizer_from_the_config(
        checkpoints, tmp_path):
    results = spawn(_through_the_backend, tmp_path, checkpoints["llama"])
    for rank in results:
        assert rank["dtypes"] == {torch.float16, torch.float32}  # fp16 model, fp32 main weights
        assert 0 < rank["owned"] < rank["weights"]  # this replica's share
        assert rank["resumed"] == rank["straight"]
    assert sum(rank["owned"] for rank in results) == results[0]["weights"]


@pytest.fixture(scope="module")
def two_ranks(checkpoints, tmp_path_factory) -> tuple[list[dict], Path]:
    """The two ranks' results and folder, which also holds a TP 1 checkpoint of trained weights
    (written here first) that the ranks start TP 2 from."""
    from policies.megatron.policy import MegatronCausalLMPolicy

    folder = tmp_path_factory.mktemp("two_ranks")
    policy = MegatronCausalLMPolicy(megatron_cfg(checkpoints["llama_odd"]))
    train(policy, *batch(vocab=ODD_VOCAB), steps=1)
    policy.save_checkpoint(folder / "llama_odd_tp1")
    return spawn(_two_ranks, folder, checkpoints), folder


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2", "llama", *ODD])
def test_tensor_parallel_forward_equals_hf_and_one_rank(two_ranks, checkpoints, name):
    from policies.megatron.policy import MegatronCausalLMPolicy

    results, _ = two_ranks
    for rank in results:
        assert rank[f"{name}/logits_error"] < 1e-5  # each rank's vocabulary slice of HF's logits
        assert rank[f"{name}/sync_exact"]  # gathered over TP into HF names and shapes: the very weights
    forward_inputs, actions = batch(vocab=vocab_of(name))
    one = MegatronCausalLMPolicy(megatron_cfg(checkpoints[name])).evaluate(forward_inputs, actions).logprobs
    reference = hf_policy(checkpoints[name]).evaluate(forward_inputs, actions)
    for rank in results:
        assert (rank[f"{name}/logprobs"] - one).abs().max() < 1e-5
        assert (rank[f"{name}/logprobs"] - reference.logprobs).abs().max() < 1e-5
        assert (rank[f"{name}/entropy"] - reference.entropy).abs().max() < 1e-5


@pytest.mark.slow
def test_training_at_tensor_parallel_2_equals_one_rank(two_ranks, checkpoints):
    from policies.megatron.policy import MegatronCausalLMPolicy

    results, _ = two_ranks
    # TP 2: one replica, whose ranks share TP rank 0's batch; TP 1 on 2 ranks: 2 replicas
    assert [rank["tp2_layout"] for rank in results] == [(1, "rank 0's")] * 2
    assert [rank["dp2_layout"] for rank in results] == [(0, 2), (1, 2)]
    policy = MegatronCausalLMPolicy(megatron_cfg(checkpoints["llama"]))
    forward_inputs, actions = batch()
    losses, norms, _ = train(policy, forward_inputs, actions)
    assert losses[-1] < losses[0]
    for rank in results:
        assert rank["losses"] == pytest.approx(losses, rel=1e-5)
        assert rank["norms"] == pytest.approx(norms, rel=1e-5)
        assert norms[0] > CLIP  # the clip acted
    # data parallel: two halves of the batch, gradients averaged, equal the whole batch on one rank
    trained = policy.evaluate(forward_inputs, actions).logprobs
    assert all((rank["data_parallel_trained"] - trained).abs().max() < 1e-5 for rank in results)
    # mixed precision: an inf in rank 1's gradients is an overflow on both (no rank steps alone)
    assert [rank["overflows"] for rank in results] == [[False, True]] * 2



@pytest.mark.slow
def test_the_distributed_optimizer_trains_as_the_plain_one_and_holds_half_the_state(two_ranks, checkpoints):
    """TP 1 x DP 2 with each replica stepping its share of the parameters (fp32, and fp16 with
    fp32 main weights): the same training as every replica stepping all of them; each replica
    holds part of Adam's state; its checkpoint resumes on one rank with a plain optimizer."""
    from policies.megatron.policy import MegatronCausalLMPolicy

    results, folder = two_ranks
    for rank in results:
        assert (rank["sharded_fp32_trained"] - rank["data_parallel_trained"]).abs().max() < 1e-5
        sharded, plain = rank["sharded_fp16_state"], rank["data_parallel_fp16_state"]
        assert max(float((sharded[k] - plain[k]).abs().max()) for k in plain) < 1e-3  # an fp16 rounding at most
    for precision, per_weight in (("fp32", 2), ("fp16", 3)):  # Adam's moments (+ the main weights)
        held = [rank[f"sharded_{precision}_values"] for rank in results]
        assert sum(held) == per_weight * results[0][f"sharded_{precision}_weights"] and min(held) > 0, held
        assert max(held) < 0.75 * sum(held)
    policy = MegatronCausalLMPolicy(megatron_cfg(checkpoints["llama"], precision="fp16"))
    policy.load_state_dict(policy.read_checkpoint(folder / "dp2_sharded"))
    optimizer, scaler = mixed(policy, lr=LR)
    policy.load_optimizer(optimizer, folder / "dp2_sharded")
    forward_inputs, actions = batch()
    after = train_mixed(policy, optimizer, scaler, forward_inputs, actions, steps=1)[0]
    # one rank on the whole batch: the mean of the two replicas' losses on their halves
    assert after == pytest.approx(sum(rank["sharded_after_resume"] for rank in results) / 2, rel=1e-3)
    assert all(rank["sharded_resumed"] == rank["sharded_after_resume"] for rank in results)  # exact at DP 2


@pytest.mark.slow
@pytest.mark.parametrize("name", ODD)
def test_odd_vocabulary_gradients_at_tensor_parallel_2_equal_one_rank(two_ranks, checkpoints, name):
    """The padded vocabulary's rows get no gradient and stay zero through training; the real
    rows' gradients are one rank's."""
    from policies.megatron.policy import MegatronCausalLMPolicy

    results, _ = two_ranks
    policy = MegatronCausalLMPolicy(megatron_cfg(checkpoints[name]))
    probe_loss(policy.evaluate(*batch(vocab=ODD_VOCAB))).backward()
    grads = _grads_in_hf_layout(policy)
    for rank in results:
        assert rank[f"{name}/padding_grads"].numel() > 0 and not rank[f"{name}/padding_grads"].any()
        assert not rank[f"{name}/padding"].any()
        assert rank[f"{name}/grads"].keys() == grads.keys()
        for key, grad in grads.items():
            assert torch.allclose(rank[f"{name}/grads"][key], grad, atol=1e-5, rtol=1e-4), key


@pytest.mark.slow
def test_checkpoint_saved_at_tensor_parallel_2_resumes_at_1(two_ranks, checkpoints):
    from policies.megatron.policy import MegatronCausalLMPolicy

    results, folder = two_ranks
    policy = MegatronCausalLMPolicy(megatron_cfg(checkpoints["llama"]))
    policy.load_state_dict(policy.read_checkpoint(folder / "tp2"))
    forward_inputs, actions = batch()
    assert (policy.evaluate(forward_inputs, actions).logprobs - results[0]["trained"]).abs().max() < 1e-5
    optimizer = torch.optim.Adam(policy.parameters(), lr=LR)
    policy.load_optimizer(optimizer, folder / "tp2")  # Adam's moments, resharded like the weights
    after = train(policy, forward_inputs, actions, steps=1, optimizer=optimizer)[0]
    assert after == pytest.approx(results[0]["after_resume"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", ODD)
def test_odd_vocabulary_export_and_checkpoint_at_tensor_parallel_2_keep_hf_shapes(two_ranks, checkpoints, name):
    """Trained at TP 2 (16 vocabulary rows): the export is an HF folder of the 15-row weights,
    and the checkpoint loads at TP 1 (15 rows) with its weights and Adam's moments."""
    from transformers import AutoModelForCausalLM

    from policies.megatron.policy import MegatronCausalLMPolicy

    results, folder = two_ranks
    trained = results[0][f"{name}/trained_hf"]
    shapes = {k: v.shape for k, v in AutoModelForCausalLM.from_pretrained(checkpoints[name]).state_dict().items()}
    assert {k: v.shape for k, v in trained.items()} == shapes
    exported = AutoModelForCausalLM.from_pretrained(folder / f"{name}_export").state_dict()
    assert exported.keys() == trained.keys() and all(torch.equal(exported[k], v) for k, v in trained.items())
    policy = MegatronCausalLMPolicy(megatron_cfg(checkpoints[name]))
    policy.load_state_dict(policy.read_checkpoint(folder / f"{name}_tp2"))
    assert all(torch.equal(policy.hf_state_dict()[k], v) for k, v in trained.items())
    forward_inputs, actions = batch(vocab=ODD_VOCAB)
    assert (policy.evaluate(forward_inputs, actions).logprobs - results[0][f"{name}/trained"]).abs().max() < 1e-5
    optimizer = torch.optim.Adam(policy.parameters(), lr=LR)
    policy.load_optimizer(optimizer, folder / f"{name}_tp2")
    after = train(policy, forward_inputs, actions, steps=1, optimizer=optimizer)[0]
    assert after == pytest.approx(results[0][f"{name}/after_resume"], rel=1e-5)


@pytest.mark.slow
def test_odd_vocabulary_checkpoint_saved_at_tensor_parallel_1_starts_2(two_ranks, checkpoints):
    """A TP 1 checkpoint (15 vocabulary rows) starts TP 2 (16): the padding row is zero."""
    from policies.megatron.policy import MegatronCausalLMPolicy

    results, folder = two_ranks
    path = checkpoints["llama_odd"]
    one = MegatronCausalLMPolicy(megatron_cfg(path, megatron_checkpoint=str(folder / "llama_odd_tp1")))
    expected = one.evaluate(*batch(vocab=ODD_VOCAB)).logprobs
    for rank in results:
        assert (rank["from_tp1"] - expected).abs().max() < 1e-5
        assert rank["from_tp1_padding"].numel() > 0 and not rank["from_tp1_padding"].any()
