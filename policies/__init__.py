"""Policies behind one act/evaluate interface (``policies/base.py``), by ``actor.model.model_type``.

The config layer builds them (``embodied.config.build_policy``: the schema's rules first); adding
a model is a module implementing ``Policy``, its line here and its ``config/model/<name>.yaml``
(docs/architecture.md)."""

from core.registry import Registry

# task_type: the runner.task_type (and so the envs) a model acts in, read without importing it
POLICIES = Registry("model type", "actor.model.model_type", task_type="embodied")
POLICIES.add("causal_lm", "policies.causal_lm:CausalLMPolicy", task_type="math")
POLICIES.add("cnn", "policies.cnn:CNNPolicy")
POLICIES.add("mlp", "policies.mlp:MLPPolicy")
POLICIES.add("openvla_oft", "policies.openvla_oft:OpenVLAOFTPolicy")
