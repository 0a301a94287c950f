"""Policies behind one act/evaluate interface (see DESIGN.md), by ``actor.model.model_type``."""

from embodied.registry import Registry

POLICIES = Registry("model type", "actor.model.model_type", {
    "mlp": "policies.mlp:MLPPolicy",
    "cnn": "policies.cnn:CNNPolicy",
})
