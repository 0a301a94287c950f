"""The OpenVLA-OFT network: vision backbone -> projector -> Llama, with parallel action slots.

Sequence layout (one row; ``A = num_action_chunks * action_dim``)::

    [BOS] [patches of image 1 .. image n] [proprio] [pad ... pad] [prompt ... "Out:" "▁"] [0 x A] [</s>]

(the stop token is absent with ``stop_token=False``, as RL frameworks' OFT variant decodes).

Vision tokens go right after BOS as in Prismatic. Prompts are left-padded in the text part, so
the patches and the action slots sit at the same offsets in every row; padded keys are masked
and position ids count real tokens only, so a padded row computes what it would alone. The A
action slots are zero embeddings (OFT's placeholders); under next-token reading the hidden
state at "▁" predicts action token 0 and the one at slot i predicts token i + 1. The
L1-regression head reads the same A hidden states ("▁" and slots 0..A-2), as OFT does. OFT
checkpoints were trained with every token attending to every other (bidirectional), which is
what ``causal=False`` gives.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaForCausalLM

from policies.openvla_oft.action_head import L1RegressionHead
from policies.openvla_oft.action_tokenizer import ActionTokenizer
from policies.openvla_oft.config import VLAConfig
from policies.openvla_oft.projector import ProprioProjector, Projector
from policies.openvla_oft.vision import VisionBackbone


@dataclass
class PromptInputs:
    """One batch of model inputs before the action slots (see ``preprocess``)."""

    input_ids: torch.Tensor  # [B, 1 + L] long: BOS then the left-padded prompt
    attention_mask: torch.Tensor  # [B, 1 + L] bool
    pixel_values: torch.Tensor  # [B, n_images * n_backbones * 3, H, W]
    proprio: torch.Tensor | None = None  # [B, P] normalized robot state


@dataclass
class ActionOutput:
    action_hidden: torch.Tensor  # [B, A, H] the hidden states that predict the A action values
    hidden_before_actions: torch.Tensor  # [B, H] hidden state at the token before the first slot
    logits: torch.Tensor | None = None  # [B, A, n_bins] float32 over the action rows (discrete head)
    actions: torch.Tensor | None = None  # [B, A / action_dim, action_dim] normalized (L1 head)


def position_ids(key_mask: torch.Tensor) -> torch.Tensor:
    """Positions that count real tokens only (padding gets the position of its neighbour)."""
    return (key_mask.long().cumsum(-1) - 1).clamp(min=0)


def additive_attention_mask(key_mask: torch.Tensor, q_len: int, causal: bool, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, q_len, K] additive mask; the queries are the last ``q_len`` of the K keys.

    Padded keys are hidden; with ``causal`` later keys are too. Every query may attend to itself,
    so a padding row never sees an empty set (its output is ignored).
    """
    k_len = key_mask.shape[-1]
    q_pos = torch.arange(k_len - q_len, k_len, device=key_mask.device)[:, None]
    k_pos = torch.arange(k_len, device=key_mask.device)[None, :]
    allowed = key_mask[:, None, :].bool()
    if causal:
        allowed = allowed & (k_pos <= q_pos)
    allowed = allowed | (k_pos == q_pos)
    zero = torch.zeros((), dtype=dtype, device=key_mask.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)[:, None]


class OpenVLAOFT(nn.Module):
    """Module names match the Hugging Face OpenVLA export (``vision_backbone``, ``projector``,
    ``language_model``), so checkpoints and peft adapters address the same tensors."""

    def __init__(
        self,
        config: VLAConfig,
        *,
        proprio_dim: int | None = None,
        l1_action_dim: int | None = None,
        stop_token: bool = True,
        attn_implementation: str = "sdpa",
    ):
        super().__init__()
        self.config = config
        self.attn_implementation = attn_implementation
        self.vision_backbone = VisionBackbone(config.vit_specs, config.image_size)
        llm_dim = config.text_config.hidden_size
        self.projector = Projector(config.use_fused_vision_backbone, self.vision_backbone.embed_dim, llm_dim)
        text_config = copy.deepcopy(config.text_config)
        text_config._attn_implementation = attn_implementation
        self.language_model = LlamaForCausalLM(text_config)
        self.proprio_projector = ProprioProjector(proprio_dim, llm_dim) if proprio_dim else None
        self.action_head = L1RegressionHead(llm_dim, l1_action_dim) if l1_action_dim else None
        self.stop_token = stop_token
        self.action_tokenizer = ActionTokenizer(config.tokenizer_vocab_size, config.n_action_bins)
        self.stop_token_id = int(config.text_config.eos_token_id)

    @property
    def hidden_size(self) -> int:
        return self.config.text_config.hidden_size

    @property
    def dtype(self) -> torch.dtype:
        return self.projector.fc1.weight.dtype

    def prompt_embeddings(self, inputs: PromptInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings ``[B, S, H]`` and key mask ``[B, S]`` of BOS, vision (+ proprio), prompt."""
        tokens = self.language_model.get_input_embeddings()(inputs.input_ids)
        visual = self.projector(self.vision_backbone(inputs.pixel_values.to(self.dtype)))
        if self.proprio_projector is not None:
            if inputs.proprio is None:
                raise ValueError("this checkpoint has a proprio projector (use_proprio) but no proprio was given")
            proprio = self.proprio_projector(inputs.proprio.to(self.dtype))
            visual = torch.cat([visual, proprio[:, None]], dim=1)
        embeds = torch.cat([tokens[:, :1], visual, tokens[:, 1:]], dim=1)
        mask = inputs.attention_mask.bool()
        visual_mask = torch.ones(mask.shape[0], visual.shape[1], dtype=torch.bool, device=mask.device)
        return embeds, torch.cat([mask[:, :1], visual_mask, mask[:, 1:]], dim=1)

    def language_hidden(
        self,
        embeds: torch.Tensor,
        key_mask: torch.Tensor,
        positions: torch.Tensor,
        *,
        causal: bool,
        cache=None,
    ) -> torch.Tensor:
        """Last hidden states of the Llama body; ``key_mask`` covers cached and new tokens."""
        if self.attn_implementation == "flash_attention_2":
            attention = {"attention_mask": key_mask.long(), "is_causal": causal}
        else:
            attention = {"attention_mask": additive_attention_mask(key_mask, embeds.shape[1], causal, embeds.dtype)}
        out = self.language_model.model(
            inputs_embeds=embeds,
            position_ids=positions,
            past_key_values=cache,
            use_cache=cache is not None,
            **attention,
        )
        return out.last_hidden_state

    def action_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the ``n_bins`` action rows of the LM head only (float32).

        A plain head multiplies by its action rows alone; a wrapped one (peft LoRA on
        ``lm_head``) is called as a module, so its adapter shapes the action logits."""
        first = self.action_tokenizer.first_token_id
        head = self.language_model.lm_head
        if type(head) is nn.Linear:
            return F.linear(hidden, head.weight[first : first + self.action_tokenizer.n_bins]).float()
        return head(hidden)[..., first : first + self.action_tokenizer.n_bins].float()

    def forward(self, inputs: PromptInputs, num_action_tokens: int, causal: bool = False) -> ActionOutput:
        """One pass over prompt + ``num_action_tokens`` zero slots (+ stop token): OFT decoding.
        The discrete head gives logits, the L1-regression head normalized actions."""
        embeds, mask = self.prompt_embeddings(inputs)
        b, n = embeds.shape[0], num_action_tokens
        parts = [embeds, embeds.new_zeros(b, n, embeds.shape[-1])]
        if self.stop_token:
            parts.append(self.language_model.get_input_embeddings()(
                torch.full((b, 1), self.stop_token_id, dtype=torch.long, device=embeds.device)
            ))
        full = torch.cat(parts, dim=1)
        key_mask = torch.cat([mask, mask.new_ones(b, full.shape[1] - mask.shape[1])], dim=1)
        hidden = self.language_hidden(full, key_mask, position_ids(key_mask), causal=causal)
        end = hidden.shape[1] - int(self.stop_token) - 1  # index of the last action slot
        action_hidden = hidden[:, end - n : end]
        out = ActionOutput(action_hidden=action_hidden, hidden_before_actions=hidden[:, end - n])
        if self.action_head is None:
            out.logits = self.action_logits(action_hidden)
        else:
            out.actions = self.action_head(action_hidden).float()
        return out
