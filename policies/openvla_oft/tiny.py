"""Tiny OpenVLA-OFT checkpoints written from scratch in the public Hugging Face layout.

Real checkpoints cannot be downloaded here, so tests, the benchmark and CPU pipeline runs use a
checkpoint this module writes: a Llama-style tokenizer trained on the spot, a config.json with
the OpenVLA fields, safetensors shards with an index, dataset_statistics.json and, in the official
OFT layout, optionally the proprio projector and L1-regression head files (``module.``-prefixed,
as OFT's DDP training saves them); in the RL-framework layout the value head and the proprio
projector are tensors of the main weights instead. Tensor names and shapes are spelled out here from the public layout
(timm ViTs, Prismatic projector, Hugging Face Llama), independently of the model classes, so
loading such a folder checks that the model really addresses the public names.

    python -m policies.openvla_oft.tiny OUT_DIR [--image-size 56] [--proprio-dim 8] [--l1-head]
        [--rl-layout --value-head-out 1]
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

import torch
from safetensors.torch import save_file

TIMM_IDS = ("vit_large_patch14_reg4_dinov2.lvd142m", "vit_so400m_patch14_siglip_224")
DINO_MLP_RATIO, SIGLIP_MLP_RATIO = 4.0, 3.7362
PAD_MULTIPLE = 64
TASKS = (
    "pick up the red cube",
    "put the carrot on the plate",
    "open the top drawer and put the bowl inside",
    "push the cube to the goal",
    "stack the green block on the blue block",
    "turn on the stove",
)
PROMPT = "In: What action should the robot take to {task}?\nOut:"


def train_tiny_tokenizer(vocab_size: int = 512, seed: int = 0):
    """A BPE tokenizer shaped like Llama's: ``<unk>``=0, ``<s>``=1, ``</s>``=2, Metaspace "▁"
    pre-tokenization, ``<PAD>`` added after the base vocabulary (as OpenVLA adds it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(3, 9))) for _ in range(3000)]
    corpus = [PROMPT.format(task=t) for t in TASKS] * 20
    corpus += [" ".join(words[i : i + 12]) for i in range(0, len(words), 12)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"the tiny tokenizer reached {tok.get_vocab_size()} tokens, not {vocab_size}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<PAD>"
    )


def _vit_shapes(prefix: str, dim: int, depth: int, ratio: float, patch: int, image_size: int, dino: bool) -> dict:
    hidden = int(dim * ratio)
    n = (image_size // patch) ** 2
    s = {f"{prefix}.patch_embed.proj.weight": (dim, 3, patch, patch), f"{prefix}.patch_embed.proj.bias": (dim,)}
    if dino:  # class token + 4 registers, no position embedding for them, LayerScale
        s[f"{prefix}.cls_token"] = (1, 1, dim)
        s[f"{prefix}.reg_token"] = (1, 4, dim)
    s[f"{prefix}.pos_embed"] = (1, n, dim)
    for i in range(depth):
        b = f"{prefix}.blocks.{i}"
        s.update({
            f"{b}.norm1.weight": (dim,), f"{b}.norm1.bias": (dim,),
            f"{b}.attn.qkv.weight": (3 * dim, dim), f"{b}.attn.qkv.bias": (3 * dim,),
            f"{b}.attn.proj.weight": (dim, dim), f"{b}.attn.proj.bias": (dim,),
            f"{b}.norm2.weight": (dim,), f"{b}.norm2.bias": (dim,),
            f"{b}.mlp.fc1.weight": (hidden, dim), f"{b}.mlp.fc1.bias": (hidden,),
            f"{b}.mlp.fc2.weight": (dim, hidden), f"{b}.mlp.fc2.bias": (dim,),
        })
        if dino:
            s[f"{b}.ls1.scale_factor"] = (dim,)
            s[f"{b}.ls2.scale_factor"] = (dim,)
    s[f"{prefix}.norm.weight"] = (dim,)
    s[f"{prefix}.norm.bias"] = (dim,)
    if not dino:  # SigLIP's latent attention-pool head
        a = f"{prefix}.attn_pool"
        s.update({
            f"{a}.latent": (1, 1, dim),
            f"{a}.q.weight": (dim, dim), f"{a}.q.bias": (dim,),
            f"{a}.kv.weight": (2 * dim, dim), f"{a}.kv.bias": (2 * dim,),
            f"{a}.proj.weight": (dim, dim), f"{a}.proj.bias": (dim,),
            f"{a}.norm.weight": (dim,), f"{a}.norm.bias": (dim,),
            f"{a}.mlp.fc1.weight": (hidden, dim), f"{a}.mlp.fc1.bias": (hidden,),
            f"{a}.mlp.fc2.weight": (dim, hidden), f"{a}.mlp.fc2.bias": (dim,),
        })
    return s


def public_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of the safetensors part of a (fused, DINOv2 + SigLIP) checkpoint."""
    (dino, siglip), size = config["timm_arch_overrides"], config["image_sizes"][0]
    shapes = _vit_shapes(
        "vision_backbone.featurizer", dino["embed_dim"], dino["depth"], DINO_MLP_RATIO, dino["patch_size"], size, True
    )
    shapes |= _vit_shapes(
        "vision_backbone.fused_featurizer",
        siglip["embed_dim"], siglip["depth"], SIGLIP_MLP_RATIO, siglip["patch_size"], size, False,
    )
    text = config["text_config"]
    llm, inter, vocab = text["hidden_size"], text["intermediate_size"], text["vocab_size"]
    head_dim = llm // text["num_attention_heads"]
    kv = text["num_key_value_heads"] * head_dim
    vision = dino["embed_dim"] + siglip["embed_dim"]
    shapes |= {
        "projector.fc1.weight": (4 * vision, vision), "projector.fc1.bias": (4 * vision,),
        "projector.fc2.weight": (llm, 4 * vision), "projector.fc2.bias": (llm,),
        "projector.fc3.weight": (llm, llm), "projector.fc3.bias": (llm,),
        "language_model.model.embed_tokens.weight": (vocab, llm),
        "language_model.model.norm.weight": (llm,),
        "language_model.lm_head.weight": (vocab, llm),
    }
    for i in range(text["num_hidden_layers"]):
        p = f"language_model.model.layers.{i}"
        shapes |= {
            f"{p}.self_attn.q_proj.weight": (llm, llm), f"{p}.self_attn.k_proj.weight": (kv, llm),
            f"{p}.self_attn.v_proj.weight": (kv, llm), f"{p}.self_attn.o_proj.weight": (llm, llm),
            f"{p}.mlp.gate_proj.weight": (inter, llm), f"{p}.mlp.up_proj.weight": (inter, llm),
            f"{p}.mlp.down_proj.weight": (llm, inter),
            f"{p}.input_layernorm.weight": (llm,), f"{p}.post_attention_layernorm.weight": (llm,),
        }
    return shapes


def l1_head_shapes(hidden: int, action_dim: int, blocks: int = 2) -> dict[str, tuple[int, ...]]:
    """The 16 tensors of OFT's L1-regression head (an MLP with residual blocks; names as saved)."""
    s = {"model.layer_norm1.weight": (hidden * action_dim,), "model.layer_norm1.bias": (hidden * action_dim,),
         "model.fc1.weight": (hidden, hidden * action_dim), "model.fc1.bias": (hidden,)}
    for i in range(blocks):
        b = f"model.mlp_resnet_blocks.{i}.ffn"
        s |= {f"{b}.0.weight": (hidden,), f"{b}.0.bias": (hidden,),
              f"{b}.1.weight": (hidden, hidden), f"{b}.1.bias": (hidden,)}
    s |= {"model.layer_norm2.weight": (hidden,), "model.layer_norm2.bias": (hidden,),
          "model.fc2.weight": (action_dim, hidden), "model.fc2.bias": (action_dim,)}
    return s


def value_head_shapes(hidden: int, widths: tuple[int, ...] = (512, 128), out_dim: int = 1) -> dict:
    """An RL framework's value head MLP (``value_head.mlp.{0,2,..}``; the last layer has no bias)."""
    s, width = {}, hidden
    for i, w in enumerate(widths):
        s |= {f"value_head.mlp.{2 * i}.weight": (w, width), f"value_head.mlp.{2 * i}.bias": (w,)}
        width = w
    s[f"value_head.mlp.{2 * len(widths)}.weight"] = (out_dim, width)
    return s


def proprio_shapes(hidden: int, proprio_dim: int) -> dict[str, tuple[int, ...]]:
    return {"fc1.weight": (hidden, proprio_dim), "fc1.bias": (hidden,), "fc2.weight": (hidden, hidden),
            "fc2.bias": (hidden,)}


def random_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Weights that keep activations O(1), so logits of a random model are well separated."""
    x = torch.randn(shape, generator=gen)
    if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "ffn.0.weight")):
        return 1 + 0.1 * x
    if name.endswith("scale_factor"):
        return 0.5 + 0.1 * x
    if name.endswith("bias"):
        return 0.02 * x
    if len(shape) >= 2 and not name.endswith(("embed_tokens.weight", "pos_embed", "latent", "token")):
        return x / math.sqrt(math.prod(shape[1:]))
    return x


def norm_stats(action_dim: int = 7, proprio_dim: int = 8) -> dict:
    """Statistics of one made-up dataset, shaped like a LIBERO one (gripper unmasked)."""
    q01 = [-0.5 - 0.1 * i for i in range(action_dim - 1)] + [0.0]
    q99 = [0.6 + 0.1 * i for i in range(action_dim - 1)] + [1.0]
    action = {"q01": q01, "q99": q99, "min": [q - 0.1 for q in q01], "max": [q + 0.1 for q in q99],
              "mean": [0.0] * action_dim, "std": [0.3] * action_dim, "mask": [True] * (action_dim - 1) + [False]}
    proprio = {"q01": [-1.0] * proprio_dim, "q99": [1.0 + i for i in range(proprio_dim)],
               "min": [-1.5] * proprio_dim, "max": [2.0 + i for i in range(proprio_dim)],
               "mean": [0.0] * proprio_dim, "std": [1.0] * proprio_dim}
    dataset = {"action": action, "proprio": proprio, "num_transitions": 1000, "num_trajectories": 10}
    return {"tiny_dataset_no_noops": dataset}


def tiny_config(
    *,
    image_size: int = 56,
    vit_dims: tuple[int, int] = (32, 48),
    vit_depth: int = 3,
    llm_hidden: int = 64,
    llm_layers: int = 2,
    vocab: int = 512,
    stats: dict | None = None,
) -> dict:
    """A config.json as OpenVLA writes it, plus ``timm_arch_overrides`` for the tiny widths."""
    return {
        "architectures": ["OpenVLAForActionPrediction"],
        "model_type": "openvla",
        "vision_backbone_id": "dinosiglip-vit-so-224px",
        "llm_backbone_id": "llama2-7b-pure",
        "arch_specifier": "no-align+fused-gelu-mlp",
        "use_fused_vision_backbone": True,
        "image_resize_strategy": "resize-naive",
        "image_sizes": [image_size, image_size],
        "timm_model_ids": list(TIMM_IDS),
        "timm_override_act_layers": [None, None],
        "timm_arch_overrides": [
            {"embed_dim": vit_dims[0], "depth": vit_depth, "num_heads": 2, "patch_size": 14},
            {"embed_dim": vit_dims[1], "depth": vit_depth, "num_heads": 2, "patch_size": 14},
        ],
        "hf_llm_id": "meta-llama/Llama-2-7b-hf",
        "llm_max_length": 2048,
        "output_projector_states": False,
        "pad_token_id": vocab,
        "pad_to_multiple_of": PAD_MULTIPLE,
        "n_action_bins": 256,
        "norm_stats": stats if stats is not None else norm_stats(),
        "text_config": {
            "model_type": "llama",
            "pad_token_id": vocab,
            "vocab_size": vocab + PAD_MULTIPLE,
            "hidden_size": llm_hidden,
            "intermediate_size": 2 * llm_hidden,
            "num_hidden_layers": llm_layers,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "torch_dtype": "float32",
        },
        "torch_dtype": "float32",
        "transformers_version": "4.40.1",
    }


def write_tiny_checkpoint(
    path: str | Path,
    *,
    config: dict | None = None,
    proprio_dim: int | None = None,
    l1_head: bool = False,
    rl_layout: bool = False,
    value_head_out: int = 1,
    num_shards: int = 2,
    seed: int = 0,
) -> Path:
    """Write a complete checkpoint folder (weights sharded over ``num_shards`` files).

    ``l1_head`` adds ``action_head--*.pt`` (official OFT); ``rl_layout`` puts a value head (with
    ``value_head_out`` outputs) and the proprio projector into the main weights, as RL frameworks
    save their OFT models."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = config or tiny_config()
    vocab = config["text_config"]["vocab_size"] - config["pad_to_multiple_of"]
    llm = config["text_config"]["hidden_size"]
    train_tiny_tokenizer(vocab, seed).save_pretrained(str(path))
    gen = torch.Generator().manual_seed(seed)
    shapes = public_shapes(config)
    if rl_layout:
        shapes |= value_head_shapes(llm, out_dim=value_head_out)
        if proprio_dim:
            shapes |= {f"proprio_projector.{k}": s for k, s in proprio_shapes(llm, proprio_dim).items()}
    names = sorted(shapes)
    per_shard = math.ceil(len(names) / num_shards)
    weight_map = {}
    for i in range(num_shards):
        file = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        chunk = names[i * per_shard : (i + 1) * per_shard]
        save_file({n: random_tensor(n, shapes[n], gen) for n in chunk}, str(path / file), metadata={"format": "pt"})
        weight_map |= {n: file for n in chunk}
    index = {"metadata": {"total_size": 4 * sum(math.prod(s) for s in shapes.values())}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "dataset_statistics.json").write_text(json.dumps(config["norm_stats"], indent=2))
    # saved from DDP-wrapped modules, as OFT's training script does
    if proprio_dim and not rl_layout:
        state = {f"module.{k}": random_tensor(k, s, gen) for k, s in proprio_shapes(llm, proprio_dim).items()}
        torch.save(state, path / "proprio_projector--100_checkpoint.pt")
    if l1_head:
        action_dim = len(next(iter(config["norm_stats"].values()))["action"]["q01"])
        state = {f"module.{k}": random_tensor(k, s, gen) for k, s in l1_head_shapes(llm, action_dim).items()}
        torch.save(state, path / "action_head--100_checkpoint.pt")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--image-size", type=int, default=56)
    parser.add_argument("--proprio-dim", type=int, default=None)
    parser.add_argument("--l1-head", action="store_true", help="add OFT's L1-regression head file")
    parser.add_argument("--rl-layout", action="store_true", help="value head (and projector) in the main weights")
    parser.add_argument("--value-head-out", type=int, default=1, help="value head outputs (chunks for action_level)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    config = tiny_config(image_size=args.image_size, stats=norm_stats(proprio_dim=args.proprio_dim or 8))
    write_tiny_checkpoint(args.out_dir, config=config, proprio_dim=args.proprio_dim, l1_head=args.l1_head,
                          rl_layout=args.rl_layout, value_head_out=args.value_head_out, seed=args.seed)
    print(args.out_dir)


if __name__ == "__main__":
    main()
