"""OpenVLA-OFT: checkpoint-compatible model, parallel action decoding, LoRA RL policy."""

from policies.openvla_oft.policy import OpenVLAOFTPolicy

__all__ = ["OpenVLAOFTPolicy"]
