"""Dataset statistics: choosing them, de-normalizing actions, normalizing proprio, gripper fix-ups.

Checkpoints store per-dataset ``norm_stats`` (in config.json and dataset_statistics.json). The
model predicts actions in [-1, 1], mapped from each dimension's [q01, q99] range; dimensions with
``mask`` false (the gripper) are left as predicted. This follows the public OpenVLA-OFT eval.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from policies.openvla_oft.config import ConfigError

# The public code adds this to the range so that a constant dimension does not divide by zero.
RANGE_EPS = 1e-8


def resolve_unnorm_key(norm_stats: Mapping[str, Any], unnorm_key: str | None, source: str = "the checkpoint") -> str:
    """The dataset whose statistics de-normalize actions.

    None picks the only dataset; a key missing as such but present with the ``_no_noops``
    suffix (how LIBERO datasets are registered) resolves to the suffixed one.
    """
    if not norm_stats:
        raise ConfigError(f"{source}: no dataset statistics (norm_stats)")
    if unnorm_key is None:
        if len(norm_stats) != 1:
            raise ConfigError(
                f"actor.model.unnorm_key is null but {source} has statistics for several datasets; "
                f"expected one of {sorted(norm_stats)}"
            )
        return next(iter(norm_stats))
    if unnorm_key not in norm_stats and f"{unnorm_key}_no_noops" in norm_stats:
        return f"{unnorm_key}_no_noops"
    if unnorm_key not in norm_stats:
        raise ConfigError(
            f"actor.model.unnorm_key={unnorm_key!r} is not in {source}; "
            f"expected one of {sorted(norm_stats)}"
        )
    return unnorm_key


def _bounds(stats: Mapping[str, Any], what: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    for key in ("q01", "q99"):
        if key not in stats:
            raise ConfigError(f"norm_stats {what} statistics lack {key!r}")
    low = torch.tensor(stats["q01"], dtype=torch.float64)
    high = torch.tensor(stats["q99"], dtype=torch.float64)
    mask = torch.tensor(stats.get("mask", [True] * low.numel()), dtype=torch.bool)
    return low, high, mask


def unnormalize_actions(normalized: torch.Tensor, action_stats: Mapping[str, Any]) -> torch.Tensor:
    """[-1, 1] actions (last dim = action dim) -> environment units, where ``mask`` is true."""
    low, high, mask = _bounds(action_stats, "action")
    if normalized.shape[-1] != low.numel():
        raise ConfigError(
            f"actor.model.action_dim={normalized.shape[-1]} but the action statistics have {low.numel()} dimensions"
        )
    x = normalized.to(torch.float64)
    out = torch.where(mask, 0.5 * (x + 1) * (high - low + RANGE_EPS) + low, x)
    return out.to(torch.float32)


def normalize_actions(actions: torch.Tensor, action_stats: Mapping[str, Any]) -> torch.Tensor:
    """Environment units -> [-1, 1] (clipped) where ``mask`` is true: the inverse of
    ``unnormalize_actions``, which turns demonstrated actions into training targets."""
    low, high, mask = _bounds(action_stats, "action")
    x = actions.to(torch.float64)
    out = torch.where(mask, (2 * (x - low) / (high - low + RANGE_EPS) - 1).clamp(-1.0, 1.0), x)
    return out.to(torch.float32)


def dataset_statistics(values: np.ndarray, mask: list[bool] | None = None) -> dict[str, Any]:
    """OpenVLA's statistics of one quantity of a dataset (``values [N, D]``): mean, std, min,
    max and the 1st / 99th percentiles per dimension, and the ``mask`` of the dimensions that
    are normalized."""
    values = np.asarray(values, dtype=np.float64)
    stats = {name: fn(values, axis=0).tolist() for name, fn in
             (("mean", np.mean), ("std", np.std), ("max", np.max), ("min", np.min))}
    stats["q01"], stats["q99"] = (np.quantile(values, q, axis=0).tolist() for q in (0.01, 0.99))
    if mask is not None:
        stats["mask"] = list(mask)
    return stats


def normalize_proprio(proprio: torch.Tensor, proprio_stats: Mapping[str, Any]) -> torch.Tensor:
    """Robot state -> [-1, 1] (clipped) where ``mask`` is true, as the proprio projector was trained."""
    low, high, mask = _bounds(proprio_stats, "proprio")
    if proprio.shape[-1] != low.numel():
        raise ConfigError(
            f"obs states have {proprio.shape[-1]} dimensions but the proprio statistics have {low.numel()}"
        )
    x = proprio.to(torch.float64)
    out = torch.where(mask, 2 * (x - low) / (high - low + RANGE_EPS) - 1, x).clamp(-1.0, 1.0)
    return out.to(torch.float32)


def dataset_gripper(actions: torch.Tensor, normalize: bool, invert: bool) -> torch.Tensor:
    """The inverse of ``postprocess_gripper``: an env's gripper action in the dataset's convention."""
    out = actions.clone()
    if invert:
        out[..., -1] = -out[..., -1]
    if normalize:
        out[..., -1] = (out[..., -1] + 1) / 2
    return out


def postprocess_gripper(actions: torch.Tensor, normalize: bool, invert: bool) -> torch.Tensor:
    """The public LIBERO eval's gripper handling on the last action dimension.

    ``normalize`` maps the dataset's [0, 1] gripper to [-1, 1] and binarizes it to -1/+1 by sign;
    ``invert`` flips the sign (the training data uses 0 = close, the simulator -1 = open).
    """
    out = actions.clone()
    if normalize:
        out[..., -1] = torch.sign(2 * out[..., -1] - 1)
    if invert:
        out[..., -1] = -out[..., -1]
    return out
