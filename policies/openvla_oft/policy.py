"""The OpenVLA-OFT policy behind the framework's act/evaluate interface (``policies.base``).

``act(obs)`` runs one parallel-decoding pass per observation batch and returns the action chunk
in environment units, per-token log-probs, the value estimate and the inputs to store;
``evaluate(forward_inputs, actions)`` (also ``policy(...)``, so FSDP hooks fire) recomputes
log-probs, entropy and values for a stored batch in one batched forward pass, with gradients,
under the same temperature/top-k distribution.

Rollouts store compact inputs: prompt token ids, the uint8 images after resize/crop
(normalization is redone in ``evaluate``), normalized proprio and the chosen action token ids.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from policies.base import ActOutput, EvaluateOutput, Policy
from policies.lora import ADAPTER_DIR, apply_lora, save_adapter
from policies.openvla_oft import checkpoint
from policies.openvla_oft.config import ConfigError, PolicyOptions
from policies.openvla_oft.decoding import ActionSampler
from policies.openvla_oft.model import OpenVLAOFT, PromptInputs
from policies.openvla_oft.normalization import (
    normalize_proprio,
    postprocess_gripper,
    resolve_unnorm_key,
    unnormalize_actions,
)
from policies.openvla_oft.preprocess import as_uint8_images, build_prompts, normalize_images, prepare_images

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
VALUE_HEAD_FILE = "value_head.safetensors"
INPUT_KEYS = ("input_ids", "attention_mask", "images", "proprio")


def lora_targets(model: OpenVLAOFT) -> str:
    """peft's target regex: every linear layer that does work, as OFT's "all-linear" LoRA: the
    Llama attention and MLP projections, the vision projector and the ViT blocks except each
    backbone's last (never run: features come from the second-to-last block). The LM head, the
    unused SigLIP pooling head and the proprio projector stay frozen."""
    backbone = model.vision_backbone
    vits = [
        rf"vision_backbone\.{name}\.blocks\.(?!{len(vit.blocks) - 1}\.)\d+\.(attn\.(qkv|proj)|mlp\.fc[12])"
        for name, vit in (("featurizer", backbone.featurizer), ("fused_featurizer", backbone.fused_featurizer))
        if vit is not None
    ]
    llm = r"language_model\.model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)"
    return "(" + "|".join([llm, r"projector\.fc\d", *vits]) + ")"


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

    def forward(self, hidden: Tensor) -> Tensor:
        return self.mlp(hidden)


class OpenVLAOFTPolicy(Policy):
    """Built from ``actor.model``: the checkpoint at ``model_path``, LoRA adapters (fresh or from
    ``lora_path``) and a value head (read from ``model_path/value_head.safetensors`` when saved).
    Parameters are created on ``device`` in ``precision``."""

    def __init__(self, cfg: Mapping[str, Any], device: str | torch.device = "cpu"):
        super().__init__(cfg)
        self.options = options = PolicyOptions.from_config(cfg)
        vla = checkpoint.from_pretrained(
            options.model_path,
            use_proprio=options.use_proprio,
            dtype=DTYPES[options.precision],
            device=device,
            attn_implementation=options.attn_implementation,
        )
        self.tokenizer = checkpoint.load_tokenizer(options.model_path)
        self._check_matches_checkpoint(vla, self.tokenizer, options)
        if options.gradient_checkpointing:
            vla.language_model.activation_checkpointing_enable({"use_reentrant": False})
        if options.is_lora:  # alpha as OFT's min(rank, 16)
            vla = apply_lora(vla, lora_targets(vla), options.lora_rank, min(options.lora_rank, 16), options.lora_path)
        self.vla = vla

        norm_stats = vla.config.norm_stats
        self.unnorm_key = resolve_unnorm_key(norm_stats, options.unnorm_key)
        stats = norm_stats[self.unnorm_key]
        if "action" not in stats:
            raise ConfigError(f"norm_stats[{self.unnorm_key!r}] has no 'action' statistics")
        self.action_stats = stats["action"]
        if len(self.action_stats["q01"]) != self.action_dim:
            raise ConfigError(
                f"actor.model.action_dim={self.action_dim} but norm_stats[{self.unnorm_key!r}] "
                f"has {len(self.action_stats['q01'])} action dimensions"
            )
        self.proprio_stats = None
        if options.use_proprio:
            if "proprio" not in stats:
                raise ConfigError(
                    f"actor.model.use_proprio is true but norm_stats[{self.unnorm_key!r}] has no 'proprio'"
                )
            self.proprio_stats = stats["proprio"]
            expected = vla.proprio_projector.fc1.in_features
            if len(self.proprio_stats["q01"]) != expected:
                raise ConfigError(
                    f"norm_stats[{self.unnorm_key!r}].proprio has {len(self.proprio_stats['q01'])} dimensions "
                    f"but the proprio projector in {options.model_path} takes {expected}"
                )

        self.value_head = None
        if options.add_value_head:
            out_dim = 1 if self.value_type == "chunk_level" else self.num_action_chunks
            with torch.device(device), checkpoint.default_dtype(vla.dtype):
                self.value_head = ValueHead(vla.hidden_size, options.value_head_hidden_sizes, out_dim)
            saved = Path(options.model_path) / VALUE_HEAD_FILE
            if saved.exists():
                state = load_file(str(saved))
                checkpoint.check_keys(
                    {k: tuple(v.shape) for k, v in self.value_head.state_dict().items()},
                    {k: tuple(v.shape) for k, v in state.items()},
                    f"value head {saved}",
                )
                self.value_head.load_state_dict(state)

    @staticmethod
    def _check_matches_checkpoint(vla: OpenVLAOFT, tokenizer, options: PolicyOptions) -> None:
        config = vla.config
        checks = [
            ("vocab_size", options.vocab_size, config.tokenizer_vocab_size),
            ("hidden_size", options.hidden_size, config.text_config.hidden_size),
            ("image_size", options.image_size, (config.image_size, config.image_size)),
        ]
        for key, wanted, actual in checks:
            if wanted is not None and wanted != actual:
                raise ConfigError(
                    f"actor.model.{key}={wanted!r} but the checkpoint has {actual!r} (null takes the checkpoint's)"
                )
        if tokenizer.vocab_size != config.tokenizer_vocab_size:
            raise ConfigError(
                f"the tokenizer in {options.model_path} has {tokenizer.vocab_size} tokens but config.json "
                f"implies {config.tokenizer_vocab_size} (text_config.vocab_size - pad_to_multiple_of); "
                "action tokens would be wrong"
            )

    @property
    def core(self) -> OpenVLAOFT:
        """The network itself (inside the peft wrapper when LoRA is on)."""
        return self.vla.base_model.model if isinstance(self.vla, PeftModel) else self.vla

    @property
    def num_action_tokens(self) -> int:
        return self.num_action_chunks * self.action_dim

    def sampler(self, do_sample: bool) -> ActionSampler:
        return ActionSampler(do_sample, self.options.temperature, self.options.top_k)

    def shard_units(self) -> list[nn.Module]:
        """Modules an FSDP actor shards one by one before the policy itself (the root)."""
        core = self.core
        blocks = [block for f in core.vision_backbone.featurizers for block in f.blocks]
        return [*core.language_model.model.layers, *blocks]

    def observation_inputs(self, obs: Mapping[str, Any]) -> dict[str, Tensor]:
        """Env observation -> the CPU tensors ``evaluate`` needs (prompts, images, proprio)."""
        for key in ("main_images", "task_descriptions"):
            if key not in obs:
                raise KeyError(f"obs[{key!r}] is missing; the OpenVLA-OFT policy reads it (the env gave {sorted(obs)})")
        views = [as_uint8_images(obs["main_images"], "main_images")]
        n_extra = self.options.num_images_in_input - 1
        if n_extra:
            if obs.get("wrist_images") is None:
                raise KeyError(f"actor.model.num_images_in_input={n_extra + 1} needs obs['wrist_images']")
            wrist = torch.as_tensor(obs["wrist_images"])
            wrist = wrist[:, None] if wrist.ndim == 4 else wrist
            if wrist.ndim != 5 or wrist.shape[1] < n_extra:
                raise ValueError(
                    f"obs['wrist_images'] must be [B, H, W, 3] or [B, K>={n_extra}, H, W, 3]; got {tuple(wrist.shape)}"
                )
            views += [as_uint8_images(wrist[:, i], "wrist_images") for i in range(n_extra)]
        size = self.core.config.image_size
        images = torch.stack([prepare_images(v.to(self.device), size, self.options.center_crop) for v in views], dim=1)
        tasks = list(obs["task_descriptions"])
        input_ids, attention_mask = build_prompts(self.tokenizer, tasks, self.options.max_prompt_length)
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "images": images.cpu()}
        if self.options.use_proprio:
            if obs.get("states") is None:
                raise KeyError("actor.model.use_proprio is true but obs['states'] is missing")
            inputs["proprio"] = normalize_proprio(torch.as_tensor(obs["states"]), self.proprio_stats)
        return inputs

    def logits_and_values(self, forward_inputs: Mapping[str, Tensor]) -> tuple[Tensor, Tensor | None]:
        """Action-bin logits ``[B, chunks * action_dim, n_bins]`` and values, in one pass."""
        core = self.core
        x = {k: forward_inputs[k].to(self.device) for k in INPUT_KEYS if k in forward_inputs}
        inputs = PromptInputs(
            input_ids=x["input_ids"],
            attention_mask=x["attention_mask"],
            pixel_values=normalize_images(x["images"], core.config.vit_specs),
            proprio=x.get("proprio"),
        )
        out = core(inputs, self.num_action_tokens)
        values = None
        if self.value_head is not None:
            values = self.value_head(out.hidden_before_actions).float()
            # a fresh tensor, not a view (FSDP2-safe, as in policies.actor_critic)
            values = values[:, 0].clone() if self.value_type == "chunk_level" else values
        return out.logits, values

    @torch.no_grad()
    def act(self, obs: Mapping[str, Any], do_sample: bool = True) -> ActOutput:
        forward_inputs = self.observation_inputs(obs)
        logits, values = self.logits_and_values(forward_inputs)
        sampler = self.sampler(do_sample)
        slots = sampler.choose(logits)
        shape = (logits.shape[0], self.num_action_chunks, self.action_dim)
        logprobs = sampler.log_probs(logits).gather(-1, slots[..., None])[..., 0].view(shape)
        tokens = self.core.action_tokenizer.slots_to_tokens(slots).view(shape).cpu()
        actions = postprocess_gripper(
            unnormalize_actions(self.core.action_tokenizer.decode(tokens), self.action_stats),
            normalize=self.options.normalize_gripper,
            invert=self.options.invert_gripper,
        )
        forward_inputs["action_tokens"] = tokens
        return ActOutput(actions, logprobs.cpu(), None if values is None else values.cpu(), forward_inputs)

    def evaluate(self, forward_inputs: Mapping[str, Tensor], actions: Tensor) -> EvaluateOutput:
        """Per-token log-probs and entropy ``[B, chunks, action_dim]`` and values, with grad.

        The log-probs are those of ``forward_inputs['action_tokens']``, the tokens ``act`` chose:
        ``actions`` (environment units) only has to match their shape, since de-normalization
        and gripper binarization cannot be inverted to tokens.
        """
        tokens = forward_inputs["action_tokens"]
        if tuple(actions.shape) != tuple(tokens.shape):
            raise ValueError(
                f"actions {tuple(actions.shape)} do not match forward_inputs['action_tokens'] {tuple(tokens.shape)}"
            )
        logits, values = self.logits_and_values(forward_inputs)
        slots = self.core.action_tokenizer.tokens_to_slots(tokens.to(logits.device)).reshape(logits.shape[0], -1)
        log_probs = self.sampler(True).log_probs(logits)
        # fresh tensors, not views (FSDP2-safe, as in policies.actor_critic)
        logprobs = log_probs.gather(-1, slots[..., None])[..., 0].reshape(tokens.shape).clone()
        entropy = ActionSampler.entropy(log_probs).reshape(tokens.shape).clone()
        return EvaluateOutput(logprobs, entropy, values)

    def save_pretrained(self, path: str | Path) -> None:
        """The checkpoint layout (base weights), plus ``lora_adapter/`` and the value head.

        Under FSDP2 every rank must call it (it gathers shards); rank 0 writes.
        """
        path = Path(path)
        checkpoint.save_pretrained(self.core, path, tokenizer=self.tokenizer)
        if isinstance(self.vla, PeftModel):
            save_adapter(self.vla, path / ADAPTER_DIR)
        if self.value_head is not None:
            state = {k: checkpoint.full_tensor(v) for k, v in self.value_head.state_dict().items()}
            if checkpoint.is_writer():
                save_file(state, str(path / VALUE_HEAD_FILE))
