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
POLICIES = Registry("model type", "actor.model.model_type", task_types=("embodied",), training={}, rollout={})
POLICIES.add("causal_lm", "policies.causal_lm:CausalLMPolicy", task_types=("math", "agent"),
             training={"megatron": "policies.megatron.policy:MegatronCausalLMPolicy"},
             rollout={"vllm": "policies.engines.vllm:VLLMCausalLM", "sglang": "policies.engines.sglang:SGLangCausalLM"})
POLICIES.add("cnn", "policies.cnn:CNNPolicy")
POLICIES.add("mlp", "policies.mlp:MLPPolicy")
POLICIES.add("openvla_oft", "policies.openvla_oft:OpenVLAOFTPolicy")
