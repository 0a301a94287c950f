"""Policies behind one act/evaluate interface (``policies/base.py``), by ``actor.model.model_type``.

The config layer builds them (``embodied.config.build_policy``: the schema's rules first); adding
a model is a module implementing ``Policy``, its line here and its ``config/model/<name>.yaml``
(docs/architecture.md)."""

from core.registry import Registry

# Declared per model, read without importing it: task_types, the runner.task_type values (and so
# the envs) it acts in; training, its classes for actor.training_backend other than fsdp (which trains the
# entry's own class), e.g. a Megatron-Core model whose weights sync into the entry's class;
# rollout, its classes for rollout.backend other than huggingface (the entry's own class), e.g. a
# generation engine that takes the entry's weights.
# reads, the keys outside actor.model that reach the model (through ``${...}`` in its model file,
# or the rollout worker's eval temperature): the config layer refuses them under the other types.
POLICIES = Registry("model type", "actor.model.model_type", task_types=("embodied",), training={}, rollout={})
TOKEN_SAMPLING = {  # a head over token logits (a policy class may refuse them under another head)
    "algorithm.sampling_params.temperature": "the softmax temperature of sampled tokens",
    "algorithm.sampling_params.temperature_eval": "the temperature of evaluation rollouts",
    "algorithm.sampling_params.top_k": "top-k filtering of sampled tokens",
    "actor.model.temperature": "the softmax temperature of sampled tokens",
    "actor.model.top_k": "top-k filtering of sampled tokens",
}
POLICIES.add("causal_lm", "policies.causal_lm:CausalLMPolicy", task_types=("math", "agent"),
             training={"megatron": "policies.megatron.policy:MegatronCausalLMPolicy"},
             rollout={"vllm": "policies.engines.vllm:VLLMCausalLM", "sglang": "policies.engines.sglang:SGLangCausalLM"},
             reads={**TOKEN_SAMPLING,
                    "algorithm.sampling_params.top_p": "nucleus sampling of generated text",
                    "algorithm.sampling_params.repetition_penalty": "the repetition penalty of generated text",
                    "algorithm.sampling_params.min_new_tokens": "the shortest response",
                    "algorithm.sampling_params.max_new_tokens": "the longest response",
                    "algorithm.sampling_params.stop": "the strings that end a response",
                    "runner.seq_length": "the prompt and response tokens",
                    "rollout.eos": "the token that ends a response",
                    "rollout.padding": "the token that pads a response",
                    "actor.tokenizer": "its own tokenizer; the others read the one saved in their checkpoint",
                    "rollout.model.precision": "the rollout model's dtype"})
POLICIES.add("cnn", "policies.cnn:CNNPolicy")
POLICIES.add("mlp", "policies.mlp:MLPPolicy")
POLICIES.add("openvla_oft", "policies.openvla_oft:OpenVLAOFTPolicy",
             reads={**TOKEN_SAMPLING, "runner.max_prompt_length": "the tokens of a task description",
                    "rollout.model.precision": "the rollout model's dtype"})
