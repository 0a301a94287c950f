"""Observations -> model inputs, as OpenVLA-OFT checkpoints were trained and evaluated.

Images: resize to the backbone resolution, optionally take the center crop of 0.9 of the area
and resize it back (bilinear, sampled like ``tf.image.crop_and_resize``), quantize to uint8 as the
public eval does, then normalize once per backbone (DINOv2: ImageNet statistics; SigLIP: 0.5/0.5)
and stack the channels. The uint8 images are what rollouts store; ``evaluate`` only normalizes.
The public eval resizes with TF's lanczos3 after a JPEG round trip; we use antialiased bicubic
(environment images of the checkpoint's own resolution skip this step in both).

Text: ``In: What action should the robot take to {task}?\\nOut:`` followed by the "▁" token
(the public code appends it when missing), BOS first, left-padded to ``max_prompt_length``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from policies.openvla_oft.config import ConfigError, ViTSpec

PROMPT = "In: What action should the robot take to {task}?\nOut:"
SPACE_TOKEN = "▁"
CROP_AREA = 0.9


def as_uint8_images(images: np.ndarray | torch.Tensor, key: str) -> torch.Tensor:
    """``[B, H, W, 3]`` uint8 (numpy or torch) -> torch uint8 tensor, checked."""
    t = torch.as_tensor(images)
    if t.dtype != torch.uint8 or t.ndim != 4 or t.shape[-1] != 3:
        raise ValueError(f"obs[{key!r}] must be uint8 [B, H, W, 3]; got {t.dtype} {tuple(t.shape)}")
    return t


def center_crop_resize(images: torch.Tensor, area: float = CROP_AREA) -> torch.Tensor:
    """Center crop of ``area`` of the image, resized back to the same size (bilinear).

    Samples the crop box at ``linspace(top, bottom)`` in pixel-center coordinates, which is how
    TF's crop_and_resize samples a normalized box.
    """
    b, _, h, w = images.shape
    side = math.sqrt(area)
    lo, hi = (1 - side) / 2, (1 + side) / 2
    ys = torch.linspace(2 * lo - 1, 2 * hi - 1, h, device=images.device)
    xs = torch.linspace(2 * lo - 1, 2 * hi - 1, w, device=images.device)
    grid = torch.stack(torch.meshgrid(xs, ys, indexing="xy"), dim=-1).expand(b, h, w, 2)
    return F.grid_sample(images, grid.to(images.dtype), mode="bilinear", align_corners=True)


def prepare_images(images: torch.Tensor, size: int, center_crop: bool) -> torch.Tensor:
    """uint8 ``[B, H, W, 3]`` -> uint8 ``[B, 3, size, size]``, ready to normalize."""
    x = images.permute(0, 3, 1, 2).float()
    if x.shape[-2:] != (size, size):
        x = F.interpolate(x, size=(size, size), mode="bicubic", antialias=True, align_corners=False)
        x = x.round().clamp(0, 255)
    if center_crop:
        # float [0, 1] -> crop -> uint8 with TF's convert_image_dtype rounding (x * 255.5, truncated)
        x = (center_crop_resize(x / 255.0).clamp(0, 1) * 255.5).floor().clamp(0, 255)
    return x.to(torch.uint8)


def normalize_images(images: torch.Tensor, specs: Sequence[ViTSpec]) -> torch.Tensor:
    """uint8 ``[B, n_images, 3, S, S]`` -> pixel values ``[B, n_images * len(specs) * 3, S, S]``."""
    x = images.float() / 255.0
    per_backbone = []
    for spec in specs:
        mean = torch.tensor(spec.mean, device=x.device).view(3, 1, 1)
        std = torch.tensor(spec.std, device=x.device).view(3, 1, 1)
        per_backbone.append((x - mean) / std)
    stacked = torch.stack(per_backbone, dim=2)  # [B, n, backbones, 3, S, S]
    b, n = stacked.shape[:2]
    return stacked.reshape(b, -1, *stacked.shape[-2:])


def prompt_ids(tokenizer, task: str) -> list[int]:
    """The prompt tokens of one task description, after BOS: OpenVLA's prompt, ending in the space token."""
    space_id = tokenizer.convert_tokens_to_ids(SPACE_TOKEN)
    if space_id is None or space_id == tokenizer.unk_token_id:
        raise ConfigError(
            f"the checkpoint's tokenizer has no {SPACE_TOKEN!r} token (a Llama-style tokenizer is expected)"
        )
    ids = tokenizer(PROMPT.format(task=task.lower()), add_special_tokens=False)["input_ids"]
    return ids if ids and ids[-1] == space_id else ids + [space_id]


def build_prompts(tokenizer, tasks: Sequence[str], max_prompt_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Task descriptions -> ``input_ids`` and ``attention_mask`` ``[B, 1 + max_prompt_length]``."""
    if tokenizer.bos_token_id is None or tokenizer.pad_token_id is None:
        raise ConfigError("the checkpoint's tokenizer needs a BOS and a pad token")
    rows = []
    for task in tasks:
        ids = prompt_ids(tokenizer, task)
        if len(ids) > max_prompt_length:
            raise ConfigError(
                f"task description {task!r} takes {len(ids)} prompt tokens; "
                f"actor.model.max_prompt_length is {max_prompt_length}"
            )
        rows.append(ids)
    b = len(rows)
    input_ids = torch.full((b, 1 + max_prompt_length), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((b, 1 + max_prompt_length), dtype=torch.bool)
    input_ids[:, 0] = tokenizer.bos_token_id
    attention_mask[:, 0] = True
    for i, ids in enumerate(rows):
        input_ids[i, -len(ids) :] = torch.tensor(ids)
        attention_mask[i, -len(ids) :] = True
    return input_ids, attention_mask
