"""The OpenVLA-OFT policy behind the framework's act/evaluate interface (``policies.base``).

``act(obs)`` runs one parallel-decoding pass per observation batch and returns the action chunk
in environment units, per-token log-probs, the value estimate and the inputs to store;
``evaluate(forward_inputs, actions)`` (also ``policy(...)``, so FSDP hooks fire) recomputes
log-probs, entropy and values for a stored batch in one batched forward pass, with gradients.

Two action heads (``actor.model.action_head``):

- ``discrete``: each action value is one of 256 action tokens, sampled under the
  temperature/top-k distribution over the LM head's action rows (OpenVLA, RL frameworks' OFT);
- ``l1_regression``: OFT's MLP head turns the action-slot hidden states into normalized actions
  in one pass. Greedy acting returns them; for RL the policy is a Gaussian around them with a
  learned, state-independent log-std per action dim (``init_log_std``), which gives log-probs
  and entropy to PPO/GRPO.

Rollouts store compact inputs: prompt token ids, the uint8 images after resize/crop
(normalization is redone in ``evaluate``), normalized proprio and the chosen action tokens
(discrete) or normalized actions (L1 head).

A training checkpoint (``save_checkpoint``) is the adapter in peft's layout plus
``rl_heads.safetensors`` for a LoRA run (the base stays where ``model_path`` points), or a full
checkpoint folder under ``model/`` otherwise; ``export_pretrained`` writes a run as one
checkpoint folder with LoRA merged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch.distributions import Normal

from core.description import EnvDescription
from core.errors import expected
from policies.base import ActOutput, EvaluateOutput, Policy
from policies.lora import ADAPTER_CONFIG, ADAPTER_DIR, ADAPTER_WEIGHTS, adapters_disabled, apply_lora, save_adapter
from policies.openvla_oft import checkpoint
from policies.openvla_oft.config import ConfigError, PolicyOptions
from policies.openvla_oft.decoding import ActionSampler
from policies.openvla_oft.action_head import L1RegressionHead
from policies.openvla_oft.model import ActionOutput, OpenVLAOFT, PromptInputs
from policies.openvla_oft.projector import ProprioProjector
from policies.openvla_oft.normalization import (
    normalize_proprio,
    postprocess_gripper,
    resolve_unnorm_key,
    unnormalize_actions,
)
from policies.openvla_oft.preprocess import as_uint8_images, build_prompts, normalize_images, prepare_images
from policies.weights import DTYPES, CheckpointError, check_keys, full_tensor, is_writer

INPUT_KEYS = ("input_ids", "attention_mask", "images", "proprio")
LOG_STD = "action_log_std"
FULL_MODEL_DIR = "model"
VALUE_LAST_STD = 0.02  # RL frameworks' value head: a small last layer, so initial values are ~0


def lora_targets(model: OpenVLAOFT) -> str:
    """peft's target regex: every linear layer that does work, as OFT's "all-linear" LoRA: the
    Llama attention and MLP projections, the vision projector and the ViT blocks except each
    backbone's last (never run: features come from the second-to-last block), and the
    L1-regression head's linears when there is one. The LM head, the unused SigLIP pooling head
    and the proprio projector stay frozen (``lora_target_modules`` picks others)."""
    backbone = model.vision_backbone
    vits = [
        rf"vision_backbone\.{name}\.blocks\.(?!{len(vit.blocks) - 1}\.)\d+\.(attn\.(qkv|proj)|mlp\.fc[12])"
        for name, vit in (("featurizer", backbone.featurizer), ("fused_featurizer", backbone.fused_featurizer))
        if vit is not None
    ]
    llm = r"language_model\.model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)"
    head = [r"action_head\.model\.(fc[12]|mlp_resnet_blocks\.\d+\.ffn\.1)"] if model.action_head is not None else []
    return "(" + "|".join([llm, r"projector\.fc\d", *vits, *head]) + ")"


class ValueHead(nn.Module):
    """MLP critic on one hidden state; one value per chunk or per action of the chunk.

    Initialized as RL frameworks do for OFT: Kaiming-normal hidden layers, a last layer drawn
    with std 0.02 and no bias, so the first values are near zero."""

    def __init__(self, hidden_size: int, hidden_sizes: tuple[int, ...], out_dim: int):
        super().__init__()
        layers: list[nn.Module] = []
        width = hidden_size
        for h in hidden_sizes:
            layers += [nn.Linear(width, h), nn.GELU()]
            width = h
        layers.append(nn.Linear(width, out_dim, bias=False))
        self.mlp = nn.Sequential(*layers)
        for layer in self.mlp[:-1]:
            if isinstance(layer, nn.Linear):
                nn.init.kaiming_normal_(layer.weight, mode="fan_out", nonlinearity="relu")
                nn.init.zeros_(layer.bias)
        nn.init.normal_(self.mlp[-1].weight, std=VALUE_LAST_STD)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.mlp(hidden)


class OpenVLAOFTPolicy(Policy):
    """Built from ``actor.model``: the checkpoint folder at ``model_path`` (weights, statistics,
    heads, projector; see ``checkpoint.inspect_folder``), LoRA adapters (fresh or from
    ``lora_path``), a value head and, with the L1 head, the Gaussian's log-std (fresh, or read
    from the folder's RL tensors). Parameters are created on ``device`` in ``precision``."""

    config_keys = tuple(f.name for f in fields(PolicyOptions))
    reads_task_prompt = True
    refused_keys = {
        "low_cpu_mem_usage": "low_cpu_mem_usage, because openvla_oft builds its modules itself and "
                             "loads the weights into them",
        "trust_remote_code": "remote code, because openvla_oft is implemented here and never runs a "
                             "checkpoint's modeling code",
    }

    def __init__(self, cfg: Mapping[str, Any], device: str | torch.device = "cpu"):
        super().__init__(cfg)
        self.options = options = PolicyOptions.from_config(cfg)
        vla, rl_state = checkpoint.load_checkpoint(
            options.model_path,
            use_proprio=options.use_proprio,
            action_head=options.action_head,
            add_value_head=options.add_value_head,
            lora_path=options.lora_path,
            stop_token=options.action_stop_token,
            dtype=DTYPES[options.precision],
            device=device,
            attn_implementation=options.attn_implementation,
        )
        self.tokenizer = checkpoint.load_tokenizer(options.model_path)
        self._check_matches_checkpoint(vla, self.tokenizer, options)
        if vla.action_head is not None and vla.action_head.action_dim != self.action_dim:
            raise ConfigError(
                f"actor.model.action_dim={self.action_dim} but the action head in {options.model_path} "
                f"predicts {vla.action_head.action_dim} dimensions"
            )
        proprio_dim = vla.proprio_projector.fc1.in_features if vla.proprio_projector is not None else None
        self.unnorm_key, self.action_stats, self.proprio_stats = action_statistics(
            vla.config.norm_stats, options, self.action_dim, proprio_dim
        )
        if options.is_lora:
            targets = options.lora_target_modules or lora_targets(vla)
            targets = list(targets) if isinstance(targets, tuple) else targets
            vla = apply_lora(vla, targets, options.lora_rank, options.lora_alpha, options.lora_path)
        self.vla = vla

        self.value_head = None
        if options.add_value_head:
            out_dim = 1 if self.value_type == "chunk_level" else self.num_action_chunks
            with torch.device(device), checkpoint.default_dtype(vla.dtype):
                self.value_head = ValueHead(vla.hidden_size, options.value_head_hidden_sizes, out_dim)
        if options.action_head == "l1_regression":
            self.action_log_std = nn.Parameter(
                torch.full((self.action_dim,), float(options.init_log_std), device=device)
            )
        if rl_state:
            own = {k: tuple(v.shape) for k, v in self.state_dict().items() if k.startswith("value_head.") or k == LOG_STD}
            check_keys(own, {k: tuple(v.shape) for k, v in rl_state.items()}, f"RL tensors of {options.model_path}")
            self.load_state_dict(rl_state, strict=False)

    @classmethod
    def samples_tokens(cls, cfg: Mapping[str, Any]) -> bool:
        return cfg["action_head"] == "discrete"

    @classmethod
    def unread_keys(cls, cfg: Mapping[str, Any]) -> dict[str, str]:
        out = super().unread_keys(cfg)
        if cfg["action_head"] != "l1_regression":
            out["actor.model.init_log_std"] = f"the {cfg['action_head']} head has no Gaussian std"
        return out

    @classmethod
    def check_config(cls, cfg: Mapping[str, Any]) -> None:
        """What can be checked from the folders before any worker starts (when ``model_path`` is
        set): options, every file of ``model_path`` (used or refused), head and projector shapes,
        the statistics for ``unnorm_key``, and a ``lora_path`` adapter against the base weights."""
        if cfg.get("model_path") is None:
            return
        options = PolicyOptions.from_config(cfg)
        contents = checkpoint.inspect_folder(
            options.model_path, use_proprio=options.use_proprio, action_head=options.action_head,
            add_value_head=options.add_value_head, lora_path=options.lora_path,
        )
        config = checkpoint.read_config(options.model_path)
        hidden, action_dim = config.text_config.hidden_size, int(cfg["action_dim"])
        parts = {}
        with torch.device("meta"):
            if contents.proprio is not None and "fc1.weight" in contents.proprio:
                parts["proprio"] = ProprioProjector(contents.proprio["fc1.weight"].shape[1], hidden)
            if contents.action_head is not None:
                parts["action_head"] = L1RegressionHead(hidden, action_dim)
        for part, module in parts.items():
            check_keys(
                {k: tuple(v.shape) for k, v in module.state_dict().items()},
                {k: tuple(v.shape) for k, v in getattr(contents, part).items()},
                f"{part.replace('_', ' ')} {contents.files[part]} (for actor.model.action_dim={action_dim}, "
                f"hidden size {hidden})",
            )
        proprio_dim = parts["proprio"].fc1.in_features if "proprio" in parts else None
        action_statistics(config.norm_stats, options, action_dim, proprio_dim)
        if options.is_lora and options.lora_path:
            check_adapter_against_base(Path(options.lora_path), contents, options.model_path)

    @classmethod
    def check_env(cls, cfg: Mapping[str, Any], env: EnvDescription, split: str) -> None:
        """The gripper action the policy outputs must be the one that opens the env's gripper,
        where the env fixes it (LIBERO: datasets store the gripper as [0 close, 1 open];
        ``normalize_gripper`` makes that -1/+1 (+1 open) and ``invert_gripper`` flips it)."""
        if env.gripper_open_action is None:
            return
        key, given = env.gripper_open_action
        if not cfg["normalize_gripper"]:
            raise expected("actor.model.normalize_gripper", False, f"true with env.{split} (its gripper takes "
                           "-1/+1; the model predicts the dataset's [0, 1])")
        opens = -1 if cfg["invert_gripper"] else 1
        if given != opens:
            raise expected(f"env.{split}.{key}", given, f"{opens} with actor.model.invert_gripper="
                           f"{cfg['invert_gripper']} (the model's action that opens the gripper)")

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

    def enable_gradient_checkpointing(self) -> list[nn.Module]:
        """The Llama layers recompute their activations in the backward pass."""
        self.core.language_model.gradient_checkpointing_enable({"use_reentrant": False})
        return list(self.core.language_model.model.layers)

    def frozen_reference(self):
        """With LoRA the base model, adapters off; else None (the actor keeps a frozen copy)."""
        return adapters_disabled(self) if isinstance(self.vla, PeftModel) else None

    @property
    def has_value_head(self) -> bool:
        return self.value_head is not None

    def value_parameters(self) -> list[nn.Parameter]:
        return [] if self.value_head is None else list(self.value_head.parameters())

    @torch.no_grad()
    def values(self, obs: Mapping[str, Any]) -> Tensor | None:
        if self.value_head is None:
            return None
        return self.forward_model(self.observation_inputs(obs))[1].cpu()

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

    def forward_model(self, forward_inputs: Mapping[str, Tensor]) -> tuple[ActionOutput, Tensor | None]:
        """One pass of the network over stored inputs: the head's output and the values."""
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
        return out, values

    def logits_and_values(self, forward_inputs: Mapping[str, Tensor]) -> tuple[Tensor, Tensor | None]:
        """Action-bin logits ``[B, chunks * action_dim, n_bins]`` and values (discrete head)."""
        out, values = self.forward_model(forward_inputs)
        if out.logits is None:
            raise ValueError("the L1-regression head has no action logits (actor.model.action_head=l1_regression)")
        return out.logits, values

    def gaussian(self, mean: Tensor) -> Normal:
        """The L1 head's RL policy: independent Gaussians around the head's normalized actions."""
        return Normal(mean, self.action_log_std.float().exp().expand_as(mean))

    def to_env_actions(self, normalized: Tensor) -> Tensor:
        """Normalized actions ``[B, chunks, action_dim]`` -> environment units (statistics, gripper)."""
        return postprocess_gripper(
            unnormalize_actions(normalized.cpu(), self.action_stats),
            normalize=self.options.normalize_gripper,
            invert=self.options.invert_gripper,
        )

    @torch.no_grad()
    def act(self, obs: Mapping[str, Any], do_sample: bool = True) -> ActOutput:
        forward_inputs = self.observation_inputs(obs)
        out, values = self.forward_model(forward_inputs)
        values = None if values is None else values.cpu()
        if out.actions is not None:  # L1-regression head: the head's output, or a draw around it
            dist = self.gaussian(out.actions)
            normalized = dist.sample() if do_sample else dist.mean
            forward_inputs["normalized_actions"] = normalized.cpu()
            return ActOutput(self.to_env_actions(normalized), dist.log_prob(normalized).cpu(), values, forward_inputs)
        logits = out.logits
        sampler = self.sampler(do_sample)
        slots = sampler.choose(logits)
        shape = (logits.shape[0], self.num_action_chunks, self.action_dim)
        logprobs = sampler.log_probs(logits).gather(-1, slots[..., None])[..., 0].view(shape)
        tokens = self.core.action_tokenizer.slots_to_tokens(slots).view(shape).cpu()
        forward_inputs["action_tokens"] = tokens
        actions = self.to_env_actions(self.core.action_tokenizer.decode(tokens))
        return ActOutput(actions, logprobs.cpu(), values, forward_inputs)

    def evaluate(self, forward_inputs: Mapping[str, Tensor], actions: Tensor) -> EvaluateOutput:
        """Per-token log-probs and entropy ``[B, chunks, action_dim]`` and values, with grad.

        The log-probs are those of what ``act`` chose, as stored in ``forward_inputs`` (action
        tokens, or normalized actions for the L1 head): ``actions`` (environment units) only has
        to match their shape, since de-normalization and gripper binarization cannot be inverted.
        """
        key = "normalized_actions" if self.options.action_head == "l1_regression" else "action_tokens"
        chosen = forward_inputs[key]
        if tuple(actions.shape) != tuple(chosen.shape):
            raise ValueError(
                f"actions {tuple(actions.shape)} do not match forward_inputs[{key!r}] {tuple(chosen.shape)}"
            )
        out, values = self.forward_model(forward_inputs)
        if out.actions is not None:
            dist = self.gaussian(out.actions)
            # fresh tensors, not views (FSDP2-safe, as in policies.actor_critic)
            return EvaluateOutput(dist.log_prob(chosen.to(out.actions.device)), dist.entropy(), values)
        logits = out.logits
        slots = self.core.action_tokenizer.tokens_to_slots(chosen.to(logits.device)).reshape(logits.shape[0], -1)
        log_probs = self.sampler(True).log_probs(logits)
        logprobs = log_probs.gather(-1, slots[..., None])[..., 0].reshape(chosen.shape).clone()
        entropy = ActionSampler.entropy(log_probs).reshape(chosen.shape).clone()
        return EvaluateOutput(logprobs, entropy, values)

    # ------------------------------------------------------------------ checkpoints
    def rl_state_dict(self) -> dict[str, Tensor]:
        """The tensors RL adds to an OFT checkpoint: value head and log-std (gathers under FSDP2)."""
        return {k: full_tensor(v) for k, v in self.state_dict().items() if k.startswith("value_head.") or k == LOG_STD}

    def save_pretrained(self, path: str | Path) -> None:
        """The whole policy as one checkpoint folder (base weights as they are, LoRA not merged)
        plus ``lora_adapter/`` when LoRA is on. Under FSDP2 every rank must call it; rank 0 writes."""
        path = Path(path)
        checkpoint.save_pretrained(self.core, path, tokenizer=self.tokenizer, rl_state=self.rl_state_dict())
        if isinstance(self.vla, PeftModel):
            save_adapter(self.vla, path / ADAPTER_DIR)

    def save_checkpoint(self, path: str | Path) -> None:
        """A training checkpoint: with LoRA the adapter (peft layout) and ``rl_heads.safetensors``,
        not the base; otherwise a full checkpoint folder in ``path/model``. Collective under FSDP2."""
        path = Path(path)
        if isinstance(self.vla, PeftModel):
            save_adapter(self.vla, path / ADAPTER_DIR)
            rl_state = self.rl_state_dict()
            if rl_state and is_writer():
                save_file({k: v.contiguous() for k, v in rl_state.items()}, str(path / checkpoint.RL_HEADS_FILE))
        else:
            checkpoint.save_pretrained(self.core, path / FULL_MODEL_DIR, tokenizer=self.tokenizer,
                                       rl_state=self.rl_state_dict())

    def read_checkpoint(self, path: str | Path) -> dict[str, Tensor]:
        """What ``save_checkpoint`` wrote, as a state dict of this policy (the trainable tensors
        with LoRA, every tensor otherwise), checked against the policy's own names and shapes."""
        path = Path(path)
        own = {k: tuple(v.shape) for k, v in self.state_dict().items()}
        if isinstance(self.vla, PeftModel):
            adapter = path / ADAPTER_DIR
            if not (adapter / ADAPTER_WEIGHTS).exists():
                raise CheckpointError(f"{path} has no {ADAPTER_DIR}/{ADAPTER_WEIGHTS} (actor.model.is_lora is true)")
            names = {adapter_file_key(k): k for k, p in self.named_parameters() if p.requires_grad and ".lora_" in k}
            saved = load_file(str(adapter / ADAPTER_WEIGHTS))
            check_keys({f: own[k] for f, k in names.items()}, {k: tuple(v.shape) for k, v in saved.items()},
                       f"LoRA adapter {adapter / ADAPTER_WEIGHTS}")
            state = {names[k]: v for k, v in saved.items()}
            rl_file = path / checkpoint.RL_HEADS_FILE
            rl_state = load_file(str(rl_file)) if rl_file.exists() else {}
            expected = {k: s for k, s in own.items() if k.startswith("value_head.") or k == LOG_STD}
            check_keys(expected, {k: tuple(v.shape) for k, v in rl_state.items()}, f"RL tensors {rl_file}")
            return state | rl_state
        folder = path / FULL_MODEL_DIR
        if (path / ADAPTER_DIR).is_dir() and not folder.exists():
            raise CheckpointError(
                f"{path} holds a LoRA run's {ADAPTER_DIR}/ but actor.model.is_lora is false; set is_lora=true "
                "(and lora_rank as trained)"
            )
        model, rl_state = checkpoint.load_checkpoint(
            folder, use_proprio=self.options.use_proprio, action_head=self.options.action_head,
            add_value_head=self.options.add_value_head, stop_token=self.options.action_stop_token,
        )
        state = {f"vla.{k}": v for k, v in model.state_dict().items()} | rl_state
        check_keys(own, {k: tuple(v.shape) for k, v in state.items()}, f"checkpoint {folder}")
        return state

    @torch.no_grad()
    def export_pretrained(self, path: str | Path) -> None:
        """One checkpoint folder in the official layout with LoRA merged into the base weights,
        statistics, tokenizer, head and projector files, and ``rl_heads.safetensors``. The
        policy's LoRA is merged in place: export from a policy built for it."""
        if isinstance(self.vla, PeftModel):
            self.vla = self.vla.merge_and_unload()
        checkpoint.save_pretrained(self.core, path, tokenizer=self.tokenizer, rl_state=self.rl_state_dict())


def adapter_file_key(param_name: str) -> str:
    """A LoRA parameter's name in peft's ``adapter_model.safetensors``: no ``vla.`` prefix (the
    adapter belongs to the model, not the policy) and no adapter name."""
    return param_name.removeprefix("vla.").replace(".default.", ".")


def action_statistics(
    norm_stats: Mapping[str, Any], options: PolicyOptions, action_dim: int, proprio_dim: int | None
) -> tuple[str, dict, dict | None]:
    """``(unnorm_key, action statistics, proprio statistics)``, checked against the model."""
    source = f"{options.model_path}/{checkpoint.STATS_FILE} (or config.json norm_stats)"
    unnorm_key = resolve_unnorm_key(norm_stats, options.unnorm_key, source)
    stats = norm_stats[unnorm_key]
    if "action" not in stats:
        raise ConfigError(f"{source}: norm_stats[{unnorm_key!r}] has no 'action' statistics")
    action_stats = stats["action"]
    if len(action_stats.get("q01", ())) != action_dim:
        raise ConfigError(
            f"actor.model.action_dim={action_dim} but {source} norm_stats[{unnorm_key!r}].action has "
            f"{len(action_stats.get('q01', ()))} dimensions"
        )
    proprio_stats = None
    if options.use_proprio:
        if "proprio" not in stats:
            raise ConfigError(f"actor.model.use_proprio is true but {source} norm_stats[{unnorm_key!r}] has no 'proprio'")
        proprio_stats = stats["proprio"]
        if proprio_dim is not None and len(proprio_stats.get("q01", ())) != proprio_dim:
            raise ConfigError(
                f"{source} norm_stats[{unnorm_key!r}].proprio has {len(proprio_stats.get('q01', ()))} dimensions "
                f"but the proprio projector in {options.model_path} takes {proprio_dim}"
            )
    return unnorm_key, action_stats, proprio_stats


def check_adapter_against_base(adapter: Path, contents: checkpoint.FolderContents, base_path: str) -> None:
    """Every LoRA tensor of a peft adapter folder must sit on a base weight of matching width:
    ``lora_A`` is ``[r, in]``, ``lora_B`` is ``[out, r]`` for a base weight ``[out, in]``."""
    weights = adapter / ADAPTER_WEIGHTS
    if not (adapter / ADAPTER_CONFIG).exists() or not weights.exists():
        raise CheckpointError(f"actor.model.lora_path={str(adapter)!r} needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    base = dict(contents.shapes)
    for part, prefix in (("proprio", "proprio_projector."), ("action_head", "action_head.")):
        base |= {prefix + k: tuple(v.shape) for k, v in (getattr(contents, part) or {}).items()}
    with safe_open(weights, "pt") as f:
        for key in f.keys():
            shape = tuple(f.get_slice(key).get_shape())
            module, _, kind = key.removeprefix("base_model.model.").rpartition(".lora_")
            target = base.get(f"{module}.weight")
            if target is None:
                raise CheckpointError(
                    f"{weights}: {key} adapts {module}, which the base checkpoint {base_path} has no weight "
                    "for: the adapter belongs to another model"
                )
            if len(target) != 2 or len(shape) != 2:
                continue
            ok = shape[1] == target[1] if kind.startswith("A.") else shape[0] == target[0]
            if not ok:
                raise CheckpointError(
                    f"{weights}: {key} has shape {shape} but the base weight {module}.weight is {target}: "
                    "the adapter was trained on another base model"
                )
