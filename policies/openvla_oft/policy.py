"""The OpenVLA-OFT policy behind the framework's act/evaluate interface (DESIGN.md).

``act(obs)`` runs one parallel-decoding pass per observation batch and returns the action chunk
in environment units, per-token log-probs, the value estimate and the inputs to store;
``evaluate(forward_inputs, actions)`` recomputes log-probs, entropy and values for a stored
batch in one batched forward pass (with gradients), under the same sampling distribution.

Rollouts store compact inputs: prompt token ids, the 224px uint8 images after resize/crop
(normalization is redone in ``evaluate``), normalized proprio and the chosen action token ids.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from torch import nn

from policies.openvla_oft import checkpoint
from policies.openvla_oft.config import ConfigError, PolicyOptions
from policies.openvla_oft.decoding import ActionSampler
from policies.openvla_oft.lora import ADAPTER_DIR, apply_lora, save_adapter
from policies.openvla_oft.model import OpenVLAOFT, PromptInputs
from policies.openvla_oft.normalization import (
    normalize_proprio,
    postprocess_gripper,
    resolve_unnorm_key,
    unnormalize_actions,
)
from policies.openvla_oft.preprocess import as_uint8_images, build_prompts, normalize_images, prepare_images

LEVELS = ("token_level", "action_level", "chunk_level")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
VALUE_HEAD_FILE = "value_head.safetensors"


def reshape_to_level(per_token: torch.Tensor, level: str) -> torch.Tensor:
    """``[B, chunks, action_dim]`` per-token log-probs (or entropies) -> the requested level.

    token_level keeps ``[B, chunks, action_dim]``; action_level sums each action's tokens to
    ``[B, chunks]``; chunk_level sums the whole chunk to ``[B]`` (tokens are independent given the
    observation, so sums are joint log-probs and joint entropies).
    """
    if level == "token_level":
        return per_token
    if level == "action_level":
        return per_token.sum(-1)
    if level == "chunk_level":
        return per_token.sum((-1, -2))
    raise ConfigError(f"log-prob/entropy level {level!r}: expected one of {list(LEVELS)}")


class ValueHead(nn.Module):
    """MLP critic on one hidden state; one value per chunk or per action of the chunk."""

    def __init__(self, hidden_size: int, hidden_sizes: tuple[int, ...], out_dim: int):
        super().__init__()
        layers: list[nn.Module] = []
        width = hidden_size
        for h in hidden_sizes:
            layers += [nn.Linear(width, h), nn.GELU()]
            width = h
        layers.append(nn.Linear(width, out_dim, bias=False))
        self.mlp = nn.Sequential(*layers)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.mlp(hidden)


@dataclass
class ActResult:
    actions: torch.Tensor  # [B, chunks, action_dim] float32, environment units
    logprobs: torch.Tensor  # at the requested level (see reshape_to_level)
    values: torch.Tensor | None  # [B] (chunk_level) or [B, chunks] (action_level); None without a value head
    forward_inputs: dict[str, torch.Tensor]  # CPU tensors, batched on dim 0


@dataclass
class EvaluateResult:
    logprobs: torch.Tensor
    entropy: torch.Tensor
    values: torch.Tensor | None


class OpenVLAOFTPolicy(nn.Module):
    def __init__(self, vla: OpenVLAOFT | PeftModel, tokenizer, options: PolicyOptions):
        super().__init__()
        self.vla = vla
        self.tokenizer = tokenizer
        self.options = options
        self.sampler = ActionSampler(options.do_sample, options.temperature, options.top_k)
        core = self.core
        self._check_matches_checkpoint(core, tokenizer, options)
        norm_stats = core.config.norm_stats
        self.unnorm_key = resolve_unnorm_key(norm_stats, options.unnorm_key)
        stats = norm_stats[self.unnorm_key]
        if "action" not in stats:
            raise ConfigError(f"norm_stats[{self.unnorm_key!r}] has no 'action' statistics")
        self.action_stats = stats["action"]
        if len(self.action_stats["q01"]) != options.action_dim:
            raise ConfigError(
                f"actor.model.action_dim={options.action_dim} but norm_stats[{self.unnorm_key!r}] "
                f"has {len(self.action_stats['q01'])} action dimensions"
            )
        self.proprio_stats = None
        if options.use_proprio:
            if "proprio" not in stats:
                raise ConfigError(f"actor.model.use_proprio is true but norm_stats[{self.unnorm_key!r}] has no 'proprio'")
            self.proprio_stats = stats["proprio"]
        self.value_head = None
        if options.add_value_head:
            out_dim = 1 if options.value_type == "chunk_level" else options.num_action_chunks
            self.value_head = ValueHead(core.hidden_size, options.value_head_hidden_sizes, out_dim).to(core.dtype)

    @staticmethod
    def _check_matches_checkpoint(core: OpenVLAOFT, tokenizer, options: PolicyOptions) -> None:
        config = core.config
        checks = [
            ("vocab_size", options.vocab_size, config.tokenizer_vocab_size),
            ("hidden_size", options.hidden_size, config.text_config.hidden_size),
            ("image_size", options.image_size, (config.image_size, config.image_size)),
        ]
        for key, wanted, actual in checks:
            if wanted is not None and wanted != actual:
                raise ConfigError(f"actor.model.{key}={wanted!r} but the checkpoint has {actual!r} (null takes the checkpoint's)")
        if tokenizer.vocab_size != config.tokenizer_vocab_size:
            raise ConfigError(
                f"the tokenizer has {tokenizer.vocab_size} tokens but config.json implies "
                f"{config.tokenizer_vocab_size} (text_config.vocab_size - pad_to_multiple_of); action tokens would be wrong"
            )

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], device: str | torch.device = "cpu") -> OpenVLAOFTPolicy:
        """Build from ``actor.model``: checkpoint at ``model_path``, LoRA, and a saved value head
        (``value_head.safetensors`` in ``model_path``) when there is one."""
        options = PolicyOptions.from_config(cfg)
        if not options.is_lora and options.lora_path:
            raise ConfigError("actor.model.lora_path is set but actor.model.is_lora is false")
        vla = checkpoint.from_pretrained(
            options.model_path,
            use_proprio=options.use_proprio,
            dtype=DTYPES[options.precision],
            device=device,
            attn_implementation=options.attn_implementation,
        )
        tokenizer = checkpoint.load_tokenizer(options.model_path)
        if options.is_lora:
            vla = apply_lora(vla, options.lora_rank, options.lora_path)
        policy = cls(vla, tokenizer, options).to(device)
        saved_head = Path(options.model_path) / VALUE_HEAD_FILE
        if policy.value_head is not None and saved_head.exists():
            state = load_file(str(saved_head))
            checkpoint.check_keys(
                {k: tuple(v.shape) for k, v in policy.value_head.state_dict().items()},
                {k: tuple(v.shape) for k, v in state.items()},
                f"value head {saved_head}",
            )
            policy.value_head.load_state_dict(state)
        return policy

    @property
    def core(self) -> OpenVLAOFT:
        return self.vla.base_model.model if isinstance(self.vla, PeftModel) else self.vla

    @property
    def device(self) -> torch.device:
        return self.core.projector.fc1.weight.device

    @property
    def num_action_tokens(self) -> int:
        return self.options.num_action_chunks * self.options.action_dim

    def shard_units(self) -> list[nn.Module]:
        """Modules an FSDP actor shards one by one (then the policy itself as the root)."""
        core = self.core
        blocks = [block for f in core.vision_backbone.featurizers for block in f.blocks]
        return [*core.language_model.model.layers, *blocks]

    def observation_inputs(self, obs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Env observation -> the CPU tensors ``evaluate`` needs (prompts, images, proprio)."""
        for key in ("main_images", "task_descriptions"):
            if key not in obs:
                raise KeyError(f"obs[{key!r}] is missing; the OpenVLA-OFT policy needs it")
        size = self.core.config.image_size
        views = [as_uint8_images(obs["main_images"], "main_images")]
        n_extra = self.options.num_images_in_input - 1
        if n_extra:
            if obs.get("wrist_images") is None:
                raise KeyError(f"actor.model.num_images_in_input={n_extra + 1} needs obs['wrist_images']")
            wrist = torch.as_tensor(obs["wrist_images"])
            wrist = wrist[:, None] if wrist.ndim == 4 else wrist
            if wrist.ndim != 5 or wrist.shape[1] < n_extra:
                raise ValueError(f"obs['wrist_images'] must be [B, H, W, 3] or [B, K>={n_extra}, H, W, 3]; got {tuple(wrist.shape)}")
            views += [as_uint8_images(wrist[:, i], "wrist_images") for i in range(n_extra)]
        images = torch.stack(
            [prepare_images(v.to(self.device), size, self.options.center_crop) for v in views], dim=1
        )
        input_ids, attention_mask = build_prompts(
            self.tokenizer, list(obs["task_descriptions"]), self.options.max_prompt_length
        )
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "images": images.cpu()}
        if self.options.use_proprio:
            if obs.get("states") is None:
                raise KeyError("actor.model.use_proprio is true but obs['states'] is missing")
            inputs["proprio"] = normalize_proprio(torch.as_tensor(obs["states"]), self.proprio_stats)
        return inputs

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        images: torch.Tensor,
        proprio: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Action-bin logits ``[B, chunks * action_dim, n_bins]`` and values, one pass."""
        core = self.core
        inputs = PromptInputs(
            input_ids=input_ids,
            attention_mask=attention_mask,
            pixel_values=normalize_images(images, core.config.vit_specs),
            proprio=proprio,
        )
        out = core(inputs, self.num_action_tokens)
        values = None
        if self.value_head is not None:
            values = self.value_head(out.hidden_before_actions).float()
            values = values[:, 0] if self.options.value_type == "chunk_level" else values
        return out.logits, values

    def _run(self, forward_inputs: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        keys = ("input_ids", "attention_mask", "images", "proprio")
        return self(**{k: forward_inputs[k].to(self.device) for k in keys if k in forward_inputs})

    @torch.no_grad()
    def act(
        self,
        obs: Mapping[str, Any],
        *,
        logprob_type: str = "token_level",
        generator: torch.Generator | None = None,
    ) -> ActResult:
        """Sample (or pick greedily, ``do_sample``) one action chunk per observation."""
        forward_inputs = self.observation_inputs(obs)
        logits, values = self._run(forward_inputs)
        b = logits.shape[0]
        gumbel = self.sampler.gumbel(tuple(logits.shape), logits.device, generator) if self.sampler.do_sample else None
        slots = self.sampler.choose(logits, gumbel)
        logprobs = self.sampler.log_probs(logits).gather(-1, slots[..., None])[..., 0]
        shape = (b, self.options.num_action_chunks, self.options.action_dim)
        tokens = self.core.action_tokenizer.slots_to_tokens(slots).view(shape).cpu()
        normalized = self.core.action_tokenizer.decode(tokens)
        actions = postprocess_gripper(
            unnormalize_actions(normalized, self.action_stats),
            normalize=self.options.normalize_gripper,
            invert=self.options.invert_gripper,
        )
        forward_inputs["action_tokens"] = tokens
        return ActResult(
            actions=actions,
            logprobs=reshape_to_level(logprobs.view(shape).cpu(), logprob_type),
            values=None if values is None else values.cpu(),
            forward_inputs=forward_inputs,
        )

    def evaluate(
        self,
        forward_inputs: Mapping[str, torch.Tensor],
        actions: torch.Tensor | None = None,
        *,
        logprob_type: str = "token_level",
        entropy_type: str = "token_level",
    ) -> EvaluateResult:
        """Log-probs of the action tokens, entropy and values for stored inputs (with grad).

        ``actions`` are action token ids ``[B, chunks, action_dim]``, by default the ones ``act``
        stored in ``forward_inputs['action_tokens']``. Environment-unit actions cannot be turned
        back into tokens (de-normalization and gripper binarization lose information).
        """
        tokens = forward_inputs["action_tokens"] if actions is None else actions
        if tokens.is_floating_point():
            raise TypeError("evaluate() needs action token ids (forward_inputs['action_tokens']), not continuous actions")
        logits, values = self._run(forward_inputs)
        b = logits.shape[0]
        slots = self.core.action_tokenizer.tokens_to_slots(tokens.to(logits.device)).reshape(b, -1)
        log_probs = self.sampler.log_probs(logits)
        shape = (b, self.options.num_action_chunks, self.options.action_dim)
        logprobs = log_probs.gather(-1, slots[..., None])[..., 0].view(shape)
        entropy = self.sampler.entropy(log_probs).view(shape)
        return EvaluateResult(
            logprobs=reshape_to_level(logprobs, logprob_type),
            entropy=reshape_to_level(entropy, entropy_type),
            values=values,
        )

    def save_pretrained(self, path: str | Path) -> None:
        """The checkpoint layout (base weights), plus ``lora_adapter/`` and the value head.

        Under FSDP2 every rank must call it (it gathers shards).
        """
        path = Path(path)
        checkpoint.save_pretrained(self.core, path, tokenizer=self.tokenizer)
        if isinstance(self.vla, PeftModel):
            save_adapter(self.vla, path / ADAPTER_DIR)
        if self.value_head is not None:
            state = {k: checkpoint.full_tensor(v) for k, v in self.value_head.state_dict().items()}
            save_file(state, str(path / VALUE_HEAD_FILE))
