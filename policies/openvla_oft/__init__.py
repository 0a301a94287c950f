"""OpenVLA-OFT: checkpoint-compatible model, parallel action decoding, LoRA RL policy."""

from policies.openvla_oft.policy import ActResult, EvaluateResult, OpenVLAOFTPolicy, reshape_to_level

__all__ = ["ActResult", "EvaluateResult", "OpenVLAOFTPolicy", "reshape_to_level"]
