"""The vision side: timm-compatible ViTs in plain torch and the fused DINOv2 + SigLIP featurizer.

Parameter names match timm's VisionTransformer as OpenVLA checkpoints store it (with the
LayerScale ``gamma`` renamed ``scale_factor``, as the Hugging Face export does), so the
``vision_backbone.*`` tensors of a real checkpoint load as they are. OpenVLA reads patch
features from the second-to-last block, so the last block is kept for the checkpoint but never run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from policies.openvla_oft.config import ViTSpec

LN_EPS = 1e-6


class LayerScale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.scale_factor = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale_factor


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"ViT embed_dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


class Block(nn.Module):
    def __init__(self, spec: ViTSpec):
        super().__init__()
        dim = spec.embed_dim
        self.norm1 = nn.LayerNorm(dim, eps=LN_EPS)
        self.attn = Attention(dim, spec.num_heads)
        self.ls1 = LayerScale(dim) if spec.layer_scale else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=LN_EPS)
        self.mlp = Mlp(dim, int(dim * spec.mlp_ratio))
        self.ls2 = LayerScale(dim) if spec.layer_scale else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.ls1(self.attn(self.norm1(x)))
        return x + self.ls2(self.mlp(self.norm2(x)))


class AttentionPoolLatent(nn.Module):
    """SigLIP's pooling head. OpenVLA never uses it, but its tensors are in every checkpoint."""

    def __init__(self, spec: ViTSpec):
        super().__init__()
        dim = spec.embed_dim
        self.latent = nn.Parameter(torch.zeros(1, 1, dim))
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim, eps=LN_EPS)
        self.mlp = Mlp(dim, int(dim * spec.mlp_ratio))


class PatchEmbed(nn.Module):
    def __init__(self, spec: ViTSpec):
        super().__init__()
        self.proj = nn.Conv2d(3, spec.embed_dim, kernel_size=spec.patch_size, stride=spec.patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class ViT(nn.Module):
    """A timm VisionTransformer that returns the patch tokens of its second-to-last block."""

    def __init__(self, spec: ViTSpec, image_size: int):
        super().__init__()
        if image_size % spec.patch_size:
            raise ValueError(f"image size {image_size} is not a multiple of the patch size {spec.patch_size}")
        self.spec = spec
        self.num_patches = (image_size // spec.patch_size) ** 2
        dim = spec.embed_dim
        self.num_prefix_tokens = int(spec.class_token) + spec.reg_tokens
        self.patch_embed = PatchEmbed(spec)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim)) if spec.class_token else None
        self.reg_token = nn.Parameter(torch.zeros(1, spec.reg_tokens, dim)) if spec.reg_tokens else None
        pos_len = self.num_patches + (0 if spec.no_embed_class else self.num_prefix_tokens)
        self.pos_embed = nn.Parameter(torch.zeros(1, pos_len, dim))
        self.blocks = nn.Sequential(*[Block(spec) for _ in range(spec.depth)])
        self.norm = nn.LayerNorm(dim, eps=LN_EPS)
        self.attn_pool = AttentionPoolLatent(spec) if spec.map_pool else None

    @property
    def embed_dim(self) -> int:
        return self.spec.embed_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)
        prefix = [t.expand(x.shape[0], -1, -1) for t in (self.cls_token, self.reg_token) if t is not None]
        if self.spec.no_embed_class:
            x = torch.cat(prefix + [x + self.pos_embed], dim=1)
        else:
            x = torch.cat(prefix + [x], dim=1) + self.pos_embed
        for block in self.blocks[:-1]:
            x = block(x)
        return x[:, self.num_prefix_tokens :]


class VisionBackbone(nn.Module):
    """One ViT, or DINOv2 (``featurizer``) + SigLIP (``fused_featurizer``) with patch features
    concatenated along the channel dimension.

    Input: ``[B, n_images * n_backbones * 3, H, W]``, each image's channels stacked in backbone
    order (every backbone has its own normalization). Output: ``[B, n_images * patches, dim]``,
    image by image.
    """

    def __init__(self, specs: list[ViTSpec], image_size: int):
        super().__init__()
        self.featurizer = ViT(specs[0], image_size)
        self.fused_featurizer = ViT(specs[1], image_size) if len(specs) > 1 else None
        self.num_backbones = len(specs)

    @property
    def featurizers(self) -> list[ViT]:
        return [f for f in (self.featurizer, self.fused_featurizer) if f is not None]

    @property
    def embed_dim(self) -> int:
        return sum(f.embed_dim for f in self.featurizers)

    @property
    def num_patches(self) -> int:
        return self.featurizer.num_patches

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        b, c, h, w = pixel_values.shape
        per_image = 3 * self.num_backbones
        if c % per_image:
            raise ValueError(f"pixel_values has {c} channels; expected a multiple of {per_image}")
        n_images = c // per_image
        x = pixel_values.reshape(b * n_images, self.num_backbones, 3, h, w)
        features = torch.cat([f(x[:, i]) for i, f in enumerate(self.featurizers)], dim=-1)
        return features.view(b, n_images * features.shape[1], features.shape[2])
