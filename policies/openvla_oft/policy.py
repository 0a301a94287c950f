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

import json
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch.distributions import Normal

from core.description import EnvDescription
from policies.base import ActOutput, EvaluateOutput, ImitationOutput, Policy
from policies.lora import ADAPTER_DIR, ADAPTER_WEIGHTS, adapters_disabled, apply_lora, save_adapter
from policies.openvla_oft import checkpoint, checks
from policies.openvla_oft.checkpoint import FULL_MODEL_DIR, LOG_STD
from policies.openvla_oft.checks import action_statistics
from policies.openvla_oft.config import ConfigError, PolicyOptions
from policies.openvla_oft.decoding import ActionSampler
from policies.openvla_oft.model import ActionOutput, OpenVLAOFT, PromptInputs
from policies.openvla_oft.normalization import (
    dataset_gripper,
    dataset_statistics,
    normalize_actions,
    normalize_proprio,
    postprocess_gripper,
    unnormalize_actions,
)
from policies.openvla_oft.preprocess import as_uint8_images, build_prompts, normalize_images, prepare_images
from policies.value_head import ValueHead
from policies.weights import DTYPES, CheckpointError, check_keys, full_tensor, is_writer

INPUT_KEYS = ("input_ids", "attention_mask", "images", "proprio")


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


class OpenVLAOFTPolicy(Policy):
    """Built from ``actor.model``: the checkpoint folder at ``model_path`` (weights, statistics,
    heads, projector; see ``checkpoint.inspect_folder``), LoRA adapters (fresh or from
    ``lora_path``), a value head and, with the L1 head, the Gaussian's log-std (fresh, or read
    from the folder's RL tensors). Parameters are created on ``device`` in ``precision``."""

    config_keys = tuple(f.name for f in fields(PolicyOptions))
    checkpoint_keys = (*Policy.checkpoint_keys, "model_path", "action_head", "action_stop_token", "use_proprio",
                       "unnorm_key", "value_head_hidden_sizes", "center_crop", "lora_rank", "lora_alpha",
                       "lora_target_modules", "lora_path", "num_images_in_input", "max_prompt_length")
    checkpoint_defaults = ("max_prompt_length",)  # positions count real tokens: padding changes nothing
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
            # A new run starts from the folder: a value head it lacks starts fresh (an SFT export
            # has none); what the folder holds must fit whole.
            held = {_rl_group(k) for k in rl_state}
            own = {k: tuple(v.shape) for k, v in self.state_dict().items()
                   if (k.startswith("value_head.") or k == LOG_STD) and _rl_group(k) in held}
            check_keys(own, {k: tuple(v.shape) for k, v in rl_state.items()}, f"RL tensors of {options.model_path}")
            self.load_state_dict(rl_state, strict=False)

    @classmethod
    def unread_keys(cls, cfg: Mapping[str, Any]) -> dict[str, str]:
        from policies import TOKEN_SAMPLING

        out = super().unread_keys(cfg)
        head = cfg["action_head"]
        if head != "discrete":
            out |= dict.fromkeys(TOKEN_SAMPLING, f"the {head} head samples no token logits (the discrete head does)")
        if head != "l1_regression":
            out["actor.model.init_log_std"] = f"the {head} head has no Gaussian std"
        return out

    @classmethod
    def check_config(cls, cfg: Mapping[str, Any]) -> None:
        checks.check_folders(cfg)

    @classmethod
    def check_env(cls, cfg: Mapping[str, Any], env: EnvDescription, split: str) -> None:
        super().check_env(cfg, env, split)
        checks.check_env(cfg, env, split)

    @classmethod
    def check_checkpoint(cls, cfg: Mapping[str, Any], folder: Path, key: str) -> None:
        checks.check_training_checkpoint(cfg, folder, key)

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

    def sampler(self, do_sample: bool, temperature: float | None = None) -> ActionSampler:
        return ActionSampler(do_sample, temperature or self.options.temperature, self.options.top_k)

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
    def act(self, obs: Mapping[str, Any], do_sample: bool = True, temperature: float | None = None) -> ActOutput:
        forward_inputs = self.observation_inputs(obs)
        out, values = self.forward_model(forward_inputs)
        values = None if values is None else values.cpu()
        if out.actions is not None:  # L1-regression head: the head's output, or a draw around it
            dist = self.gaussian(out.actions)
            normalized = dist.sample() if do_sample else dist.mean
            forward_inputs["normalized_actions"] = normalized.cpu()
            return ActOutput(self.to_env_actions(normalized), dist.log_prob(normalized).cpu(), values, forward_inputs)
        logits = out.logits
        sampler = self.sampler(do_sample, temperature)
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

    # ------------------------------------------------------------------ imitation (SFT)
    @torch.no_grad()
    def imitation_inputs(self, obs: Mapping[str, Any], actions: Tensor) -> tuple[dict[str, Tensor], Tensor]:
        """Demonstrations as ``act`` stores them: prompts and images, and the actions in the
        dataset's gripper convention, normalized by the statistics of ``unnorm_key`` (as OFT's
        training normalizes them), as action tokens (discrete head) or values (L1 head)."""
        inputs = self.observation_inputs(obs)
        actions = torch.as_tensor(actions, dtype=torch.float32)
        normalized = normalize_actions(dataset_gripper(actions, self.options.normalize_gripper,
                                                       self.options.invert_gripper), self.action_stats)
        if self.options.action_head == "l1_regression":
            inputs["normalized_actions"] = normalized
        else:
            inputs["action_tokens"] = self.core.action_tokenizer.encode(normalized)
        return inputs, actions

    def imitation(self, forward_inputs: Mapping[str, Tensor], actions: Tensor) -> ImitationOutput:
        """OpenVLA-OFT's own objectives: the L1 head's normalized actions against the targets
        (no likelihood), or the action tokens' log-probs under the LM head's softmax over the
        action bins (cross-entropy; no temperature or top-k), with the greedy bins' values."""
        out, _ = self.forward_model(forward_inputs)
        if out.actions is not None:
            return ImitationOutput(None, out.actions, forward_inputs["normalized_actions"].to(out.actions.device))
        tokenizer = self.core.action_tokenizer
        tokens = forward_inputs["action_tokens"].to(out.logits.device)
        slots = tokenizer.tokens_to_slots(tokens).reshape(tokens.shape[0], -1)
        log_probs = torch.log_softmax(out.logits.float(), dim=-1)
        logprobs = log_probs.gather(-1, slots[..., None])[..., 0].reshape(tokens.shape)
        greedy = tokenizer.decode(tokenizer.slots_to_tokens(out.logits.argmax(dim=-1))).reshape(tokens.shape)
        return ImitationOutput(logprobs, greedy, tokenizer.decode(tokens))

    @classmethod
    def imitation_options(cls, cfg: Mapping[str, Any], actions: np.ndarray, states: np.ndarray | None,
                          dataset: str, folder: Path) -> dict[str, Any]:
        """The checkpoint an SFT run trains, in ``folder``, with the demos' statistics
        (``dataset_statistics.json`` under ``dataset``, which becomes ``unnorm_key``): with
        ``model_path`` null a tiny OpenVLA-OFT in the public layout (``tiny.py``; ``image_size``
        or 56 px, its LLM ``hidden_size`` or 64 wide, the L1 head's file for ``action_head:
        l1_regression``, a proprio projector for ``use_proprio``); else ``model_path``'s files
        linked, its statistics plus the demos'. A checkpoint that already holds ``dataset`` is
        trained as it is (its statistics kept), and a folder prepared by an earlier start of the
        run is taken again."""
        options = dict(cfg) | {"unnorm_key": dataset}
        source = cfg.get("model_path")
        if source is not None and dataset in checkpoint.read_config(source).norm_stats:
            return options
        options["model_path"] = str(folder)
        if (folder / checkpoint.CONFIG_FILE).exists():
            return options
        normalize = cfg["normalize_gripper"]
        actions = dataset_gripper(torch.as_tensor(actions, dtype=torch.float32), normalize, cfg["invert_gripper"])
        stats: dict[str, Any] = {"action": dataset_statistics(actions.numpy(), [True] * (actions.shape[1] - 1)
                                                               + [not normalize]),
                                 "num_transitions": len(actions)}
        if cfg["use_proprio"]:
            if states is None:
                raise ConfigError("actor.model.use_proprio is true but the demonstrations hold no states")
            stats["proprio"] = dataset_statistics(states)
        if source is None:
            from policies.openvla_oft.tiny import tiny_config, write_tiny_checkpoint

            size = cfg.get("image_size") or (56, 56)
            config = tiny_config(image_size=int(size[0]), llm_hidden=int(cfg.get("hidden_size") or 64),
                                 stats={dataset: stats})
            write_tiny_checkpoint(folder, config=config,
                                  proprio_dim=states.shape[1] if cfg["use_proprio"] else None,
                                  l1_head=cfg["action_head"] == "l1_regression")
            return options
        folder.mkdir(parents=True)
        for entry in Path(source).iterdir():
            if entry.name != checkpoint.STATS_FILE:
                (folder / entry.name).symlink_to(entry.resolve())
        norm_stats = checkpoint.read_config(source).norm_stats | {dataset: stats}
        (folder / checkpoint.STATS_FILE).write_text(json.dumps(norm_stats, indent=2))
        return options

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


def _rl_group(key: str) -> str:
    """The part of the RL tensors a key belongs to: the whole value head, or the log-std."""
    return "value_head" if key.startswith("value_head.") else key
