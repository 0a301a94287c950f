"""Policies behind one act/evaluate interface (see DESIGN.md), by ``actor.model.model_type``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from embodied.registry import Registry

if TYPE_CHECKING:
    from policies.base import Policy

POLICIES = Registry("model type", "actor.model.model_type", {
    "mlp": "policies.mlp:MLPPolicy",
    "cnn": "policies.cnn:CNNPolicy",
    "openvla_oft": "policies.openvla_oft:OpenVLAOFTPolicy",
    "causal_lm": "policies.causal_lm:CausalLMPolicy",
})


def build_policy(model_cfg: Mapping[str, Any]) -> Policy:
    """The policy named by ``model_cfg.model_type``, built from the ``actor.model`` config."""
    if "model_type" not in model_cfg:
        raise KeyError(f"actor.model.model_type is missing; expected one of {POLICIES.names()}")
    return POLICIES.get(model_cfg["model_type"])(model_cfg)
