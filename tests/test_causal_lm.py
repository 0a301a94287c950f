"""The causal-LM policy on a real (tiny, warm-started) Llama checkpoint: generation with a KV cache
and left padding, the response mask, sampling options, log-probs that training recomputes
exactly, and LoRA with its adapters-off reference."""

import numpy as np
import pytest
import torch

from envs.text import load_prompts, load_tokenizer
from policies.causal_lm import CausalLMPolicy
from policies.weights import DTYPES


def _cfg(model, **over):
    cfg = dict(model_type="causal_lm", model_path=str(model), action_dim=4, num_action_chunks=1,
               value_type="chunk_level", max_prompt_length=8, add_value_head=False, do_sample=True,
               temperature=1.0, top_k=1000000, top_p=1.0, repetition_penalty=1.0, min_new_tokens=1, stop=None,
               tokenizer_model=None, tokenizer_use_fast=True, tokenizer_trust_remote_code=False,
               eos_token_id=None, pad_token_id=None, precision="fp32", is_lora=False, lora_rank=4,
               lora_path=None, attn_implementation="sdpa", trust_remote_code=False, low_cpu_mem_usage=True,
               gradient_checkpointing=False, value_head_hidden_sizes=[])
    cfg.update(over)
    return cfg


def _obs(tiny_math, count=32, width=8):
    params = {"data_paths": [str(tiny_math["data"] / "test.jsonl")], "prompt_key": "prompt",
              "answer_key": "answer", "max_prompt_length": width, "apply_chat_template": True}
    prompts, _ = load_prompts(params, load_tokenizer({"model_path": str(tiny_math["model"])}))
    ids = np.zeros((count, width), np.int64)
    mask = np.zeros_like(ids)
    for row, p in enumerate(prompts[:count]):
        ids[row, -len(p.ids):], mask[row, -len(p.ids):] = p.ids, 1
    return {"input_ids": ids, "attention_mask": mask}


@pytest.fixture(scope="module")
def policy(tiny_math):
    torch.manual_seed(0)
    return CausalLMPolicy(_cfg(tiny_math["model"], temperature=0.7))


@pytest.mark.slow
def test_rollout_logprobs_equal_the_recomputed_ones(policy, tiny_math):
    torch.manual_seed(1)
    out = policy.act(_obs(tiny_math))
    assert out.actions.shape == out.logprobs.shape == out.token_mask.shape == (32, 1, 4)
    assert out.actions.dtype == torch.long and out.values is None
    again = policy.evaluate(out.forward_inputs, out.actions)
    assert (again.logprobs - out.logprobs).abs().max() < 1e-5
    assert (again.logprobs[~out.token_mask] == 0).all() and (out.logprobs[out.token_mask] < 0).all()
    assert again.logprobs.requires_grad and (again.entropy[out.token_mask] > 0).all()


def test_generation_stops_at_eos_and_the_mask_ends_there(policy, tiny_math):
    out = policy.act(_obs(tiny_math), do_sample=False)
    tokens, mask = out.actions[:, 0], out.token_mask[:, 0]
    for row, keep in zip(tokens, mask):
        length = int(keep.sum())
        eos = (row[:length] == policy.eos).nonzero()
        # the mask covers the response up to and including its first EOS, padding after it
        assert eos.numel() == 0 and length == 4 or eos[0] == length - 1
        assert (row[length:] == policy.pad).all()


def test_greedy_ignores_padding_width_and_sampling_options(policy, tiny_math):
    narrow, wide = _obs(tiny_math, width=8), _obs(tiny_math, width=12)
    assert torch.equal(policy.act(narrow, do_sample=False).actions, policy.act(wide, do_sample=False).actions)
    top1 = CausalLMPolicy(_cfg(tiny_math["model"], top_k=1))
    torch.manual_seed(3)
    assert torch.equal(top1.act(narrow).actions, policy.act(narrow, do_sample=False).actions)
    torch.manual_seed(3)
    hot = policy.act(narrow).actions
    torch.manual_seed(4)
    assert not torch.equal(hot, policy.act(narrow).actions)  # sampling varies with the seed


def test_temperature_scales_the_logprobs(tiny_math):
    obs = _obs(tiny_math)
    cold = CausalLMPolicy(_cfg(tiny_math["model"], temperature=0.5))
    warm = CausalLMPolicy(_cfg(tiny_math["model"], temperature=2.0))
    out = cold.act(obs, do_sample=False)
    assert (cold.evaluate(out.forward_inputs, out.actions).logprobs[out.token_mask]
            > warm.evaluate(out.forward_inputs, out.actions).logprobs[out.token_mask]).float().mean() > 0.9


def test_a_call_temperature_replaces_the_policys_own(tiny_math):
    """Evaluation's ``temperature_eval``: ``act(temperature=t)`` samples and scores at t, as a
    policy whose own temperature is t does."""
    obs = _obs(tiny_math)
    own = CausalLMPolicy(_cfg(tiny_math["model"], temperature=1.0))
    hot = CausalLMPolicy(_cfg(tiny_math["model"], temperature=3.0))
    torch.manual_seed(5)
    a = own.act(obs, temperature=3.0)
    torch.manual_seed(5)
    b = hot.act(obs)
    assert torch.equal(a.actions, b.actions) and torch.allclose(a.logprobs, b.logprobs)
    torch.manual_seed(5)
    assert not torch.equal(own.act(obs).actions, a.actions)


def test_lora_trains_adapters_only_and_disabled_adapters_give_the_base(tiny_math):
    base = CausalLMPolicy(_cfg(tiny_math["model"]))
    lora = CausalLMPolicy(_cfg(tiny_math["model"], is_lora=True))
    trainable = [n for n, p in lora.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    names = list(lora.trainable_state_dict())
    assert all(any(f"{m}.lora_A" in n for n in names) for m in ("q_proj", "v_proj", "down_proj"))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.add_(0.5)  # adapters that change the outputs
    out = base.act(_obs(tiny_math), do_sample=False)
    moved = lora.evaluate(out.forward_inputs, out.actions).logprobs
    reference = base.evaluate(out.forward_inputs, out.actions).logprobs
    assert (moved - reference).abs().max() > 1e-2
    with lora.frozen_reference(), torch.no_grad():
        assert (lora.evaluate(out.forward_inputs, out.actions).logprobs - reference).abs().max() < 1e-5


def test_lora_checkpoint_is_the_peft_adapter_and_reads_back_strictly(tiny_math, tmp_path):
    from policies.weights import CheckpointError

    lora = CausalLMPolicy(_cfg(tiny_math["model"], is_lora=True))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.add_(0.5)
    lora.save_checkpoint(tmp_path / "lora")
    assert sorted(p.name for p in (tmp_path / "lora").iterdir()) == ["lora_adapter"]
    state = lora.read_checkpoint(tmp_path / "lora")
    trained = {n: p for n, p in lora.named_parameters() if p.requires_grad}
    assert set(state) == set(trained) and all(torch.equal(state[n], trained[n]) for n in state)
    # the same adapter is what actor.model.lora_path reads
    again = CausalLMPolicy(_cfg(tiny_math["model"], is_lora=True, lora_path=str(tmp_path / "lora" / "lora_adapter")))
    assert all(torch.equal(p, trained[n]) for n, p in again.named_parameters() if p.requires_grad)

    base = CausalLMPolicy(_cfg(tiny_math["model"]))
    with pytest.raises(CheckpointError, match="set is_lora=true"):
        base.read_checkpoint(tmp_path / "lora")
    base.save_checkpoint(tmp_path / "full")
    with pytest.raises(CheckpointError, match="lora_adapter/adapter_model.safetensors is missing"):
        lora.read_checkpoint(tmp_path / "full")
    with pytest.raises(CheckpointError, match="lora_rank"):
        CausalLMPolicy(_cfg(tiny_math["model"], is_lora=True, lora_rank=8,
                            lora_path=str(tmp_path / "lora" / "lora_adapter")))


def test_sampling_options_are_ours_not_the_checkpoints_generation_config(tiny_math, tmp_path):
    """A checkpoint whose generation_config.json samples top-1 / top-p 0.01 (near greedy) must not
    narrow sampling that algorithm.sampling_params leaves open (top_k off, top_p 1)."""
    import json
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_math["model"], model)
    (model / "generation_config.json").write_text(json.dumps({"top_k": 1, "top_p": 0.01, "do_sample": True}))
    obs = _obs(tiny_math)
    for options in (dict(top_k=1000000), dict(top_k=-1), dict(top_k=0)):
        policy = CausalLMPolicy(_cfg(model, **options))
        greedy = policy.act(obs, do_sample=False).actions
        torch.manual_seed(5)
        assert not torch.equal(policy.act(obs).actions, greedy), options


def test_the_shared_core_finds_the_token_columns_and_checks_what_every_causal_lm_checks(tiny_math, tmp_path):
    """policies/causal_core.py, which the HF, engine and Megatron policies call: the columns that
    hold a token in some row (against a loop over rows), the model folder, the length and the
    EOS / padding ids (padding falls back to EOS where the tokenizer has none)."""
    from core.errors import ConfigError
    from policies import causal_core

    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        rows, width = 5, 9
        pad_left = torch.randint(1, width + 1, (rows,), generator=g)
        mask = (torch.arange(width)[None] >= pad_left[:, None]).long()
        lengths = torch.randint(0, 6, (rows,), generator=g)
        response = (torch.arange(6)[None] < lengths[:, None]).float()
        start, stop = causal_core.token_columns(mask, response)
        assert start == (int(pad_left.min()) if mask.any() else 0)
        assert stop == (int(lengths.max()) if lengths.max() > 0 else 1)
    with pytest.raises(ConfigError, match="actor.model.model_path = .*: expected a Hugging Face model folder"):
        causal_core.model_folder({"model_path": str(tmp_path)})
    with pytest.raises(ConfigError, match=r"runner.seq_length \(12\) \+ 1 exceeds the 12 positions .* \(why\)"):
        causal_core.check_length(12, 12, tmp_path, extra=1, why="why")
    causal_core.check_length(12, 12, tmp_path)  # fits
    cfg = _cfg(tiny_math["model"])
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_math["model"])
    eos, pad = causal_core.special_tokens(cfg, tiny_math["model"])
    assert eos == tokenizer.eos_token_id is not None
    assert pad == (tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id)
    assert causal_core.special_tokens(cfg | {"eos_token_id": 3, "pad_token_id": 5}, tiny_math["model"]) == (3, 5)


def _a_stop_string(tokenizer, out) -> str:
    """Two characters that some of ``out``'s responses hold and some do not."""
    from collections import Counter

    texts = [tokenizer.decode(row[keep], skip_special_tokens=True)
             for row, keep in zip(out.actions[:, 0], out.token_mask[:, 0])]
    pairs = Counter(p for t in texts for p in {t[i:i + 2] for i in range(len(t) - 1)})
    return next(p for p, count in pairs.most_common() if count < len(texts) and p.strip() == p)


def test_a_stop_string_ends_a_response_after_the_token_that_completes_it(policy, tiny_math):
    """``algorithm.sampling_params.stop``: each response ends after the first token whose text
    completes a stop string (checked here on the decoded text), with the tokens and log-probs it
    would have had without the stop, padding after it; training recomputes the same log-probs."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_math["model"])
    obs = _obs(tiny_math)
    plain = policy.act(obs, do_sample=False)
    stop = _a_stop_string(tokenizer, plain)
    stopping = CausalLMPolicy(_cfg(tiny_math["model"], temperature=0.7, stop=[stop]))
    out = stopping.act(obs, do_sample=False)
    full, cut = plain.token_mask[:, 0].sum(-1), out.token_mask[:, 0].sum(-1)
    assert (cut < full).any() and (cut <= full).all()
    for row, (n, whole) in enumerate(zip(cut.tolist(), full.tolist())):
        tokens = out.actions[row, 0]
        assert torch.equal(tokens[:n], plain.actions[row, 0, :n])
        assert torch.allclose(out.logprobs[row, 0, :n], plain.logprobs[row, 0, :n])
        assert (tokens[n:] == stopping.pad).all() and (out.logprobs[row, 0, n:] == 0).all()
        text = tokenizer.decode(tokens[:n], skip_special_tokens=True)
        if n < whole:  # its last token completes the stop string, the ones before do not
            assert stop in text and stop not in tokenizer.decode(tokens[:n - 1], skip_special_tokens=True)
        else:
            assert stop not in text
    again = stopping.evaluate(out.forward_inputs, out.actions)
    assert (again.logprobs - out.logprobs).abs().max() < 1e-5
    from core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"algorithm.sampling_params.stop = '</a>': expected a list of non-empty"):
        CausalLMPolicy(_cfg(tiny_math["model"], stop="</a>"))


def test_a_value_head_reads_the_prompts_last_hidden_state_and_keeps_with_the_adapter(tiny_math, tmp_path):
    """PPO's critic on the causal LM: act, ``values`` (the decoder alone) and ``evaluate`` (the
    training forward) give each prompt the same value, whatever its padding; the value head
    trains with the LoRA adapters, is part of the weight sync, and a LoRA checkpoint keeps it
    beside the adapter (a full fine-tune's model.pt holds it); a checkpoint read with the other
    add_value_head is refused naming the key."""
    from core.errors import ConfigError

    cfg = _cfg(tiny_math["model"], add_value_head=True, value_head_hidden_sizes=[16], is_lora=True)
    torch.manual_seed(0)
    policy = CausalLMPolicy(cfg)
    obs = _obs(tiny_math)
    out = policy.act(obs)
    assert out.values.shape == (32,) and out.values.std() > 0
    assert torch.allclose(policy.values(obs), out.values, atol=1e-5)
    assert torch.allclose(policy.values(_obs(tiny_math, width=12)), out.values, atol=1e-5)
    again = policy.evaluate(out.forward_inputs, out.actions)
    assert torch.allclose(again.values, out.values, atol=1e-5)
    again.values.square().sum().backward()
    heads = {f"value_head.{k}" for k, _ in policy.value_head.named_parameters()}
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.value_parameters())
    assert heads <= set(policy.trainable_state_dict()) and not policy.trains_all_weights()

    policy.save_checkpoint(tmp_path / "lora")
    assert (tmp_path / "lora" / "value_head.pt").is_file()
    torch.manual_seed(1)
    fresh = CausalLMPolicy(cfg)
    assert not torch.allclose(fresh.values(obs), out.values)
    fresh.load_trainable_state_dict(fresh.read_checkpoint(tmp_path / "lora"))
    assert torch.allclose(fresh.values(obs), out.values, atol=1e-6)
    CausalLMPolicy.check_checkpoint(cfg, tmp_path / "lora", "runner.ckpt_path")
    with pytest.raises(ConfigError, match=r"^actor.model.add_value_head = False: expected True: runner.ckpt_path=.* "
                                          r"holds a value head \(value_head.pt\)$"):
        CausalLMPolicy.check_checkpoint(cfg | {"add_value_head": False}, tmp_path / "lora", "runner.ckpt_path")

    with pytest.raises(ConfigError, match=r"^actor.model.value_type = 'action_level': expected chunk_level with a "
                                          r"causal_lm value head"):
        CausalLMPolicy.check_config(cfg | {"value_type": "action_level"})

    full = CausalLMPolicy(cfg | {"is_lora": False})
    full.save_checkpoint(tmp_path / "full")
    assert heads <= set(torch.load(tmp_path / "full" / "model.pt", weights_only=True))


@pytest.mark.parametrize("precision,gap", [("bf16", 0.1), ("fp16", 0.02)])
def test_a_rollout_precision_builds_the_rollout_model_in_it_and_casts_the_synced_weights(tiny_math, precision, gap):
    """``rollout.model.precision``: the rollout worker's policy holds the actor's weights in that
    dtype after a sync; its samples are scored by the fp32 actor within the dtype's rounding."""
    from embodied.backends import build_rollout_policy
    from embodied.config import build_policy, compose

    cfg = compose("math_grpo_tiny", [f"actor.model.model_path={tiny_math['model']}",
                                     f"rollout.model.precision={precision}"])
    actor, rollout = build_policy(cfg.actor.model), build_rollout_policy(cfg)
    assert {p.dtype for p in actor.parameters()} == {torch.float32}
    with torch.no_grad():  # the actor trained a step
        for p in actor.parameters():
            p.add_(torch.randn_like(p), alpha=0.01)
    rollout.load_trainable_state_dict(actor.trainable_state_dict())
    dtype = DTYPES[precision]
    for (name, mine), theirs in zip(rollout.state_dict().items(), actor.state_dict().values()):
        assert mine.dtype == dtype and torch.equal(mine, theirs.to(dtype)), name
    torch.manual_seed(0)
    out = rollout.act(_obs(tiny_math))
    again = actor.evaluate(out.forward_inputs, out.actions)
    assert 0 < (again.logprobs - out.logprobs)[out.token_mask].abs().max() < gap
