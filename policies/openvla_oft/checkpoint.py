"""Reading and writing OpenVLA / OpenVLA-OFT checkpoint folders (Hugging Face layout).

A folder holds ``config.json`` (Prismatic/OpenVLA fields, ``norm_stats``), the weights as
``model.safetensors`` or shards listed in ``model.safetensors.index.json`` (keys
``vision_backbone.featurizer.*``, ``vision_backbone.fused_featurizer.*``, ``projector.*``,
``language_model.*``), ``dataset_statistics.json``, the tokenizer files and, for OFT models
trained with proprio, ``proprio_projector--*.pt``. Every tensor must match a model parameter by
name and shape: anything missing, unexpected or misshapen fails with the names listed.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from policies.openvla_oft.config import VLAConfig
from policies.openvla_oft.model import OpenVLAOFT
from policies.weights import CheckpointError, check_keys, full_tensor, is_writer, listing

CONFIG_FILE = "config.json"
STATS_FILE = "dataset_statistics.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PROPRIO_PATTERN = "proprio_projector--*.pt"
PROPRIO_FILE = "proprio_projector--checkpoint.pt"
PROPRIO_PREFIX = "proprio_projector."
DEFAULT_SHARD_BYTES = 5 * 1024**3


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing (expected an OpenVLA checkpoint folder)") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None


def read_config(path: str | Path) -> VLAConfig:
    """config.json, with dataset_statistics.json (when present) updating its norm_stats."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint folder {path} does not exist")
    config = VLAConfig.from_dict(_read_json(path / CONFIG_FILE), str(path / CONFIG_FILE))
    if (path / STATS_FILE).exists():
        config.norm_stats.update(_read_json(path / STATS_FILE))
    return config


def weight_files(path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file holding it."""
    if (path / INDEX_FILE).exists():
        weight_map = _read_json(path / INDEX_FILE).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{path / INDEX_FILE} has no 'weight_map' object")
        files = {k: path / v for k, v in weight_map.items()}
        absent = sorted({str(f) for f in files.values() if not f.exists()})
        if absent:
            raise CheckpointError(f"{path / INDEX_FILE} lists shard files that are missing: {absent}")
        return files
    if (path / SINGLE_FILE).exists():
        with safe_open(path / SINGLE_FILE, "pt") as f:
            return {k: path / SINGLE_FILE for k in f.keys()}
    raise CheckpointError(f"{path} has neither {INDEX_FILE} nor {SINGLE_FILE}")


def _shapes(files: Mapping[str, Path]) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for file in sorted(set(files.values())):
        with safe_open(file, "pt") as f:
            for k in f.keys():
                if files.get(k) == file:
                    shapes[k] = tuple(f.get_slice(k).get_shape())
    return shapes


def _proprio_file(path: Path) -> Path | None:
    found = sorted(path.glob(PROPRIO_PATTERN))
    if len(found) > 1:
        raise CheckpointError(f"{path} has several proprio projector files {[f.name for f in found]}; keep one")
    return found[0] if found else None


def _read_proprio(file: Path) -> dict[str, torch.Tensor]:
    state = torch.load(file, map_location="cpu", weights_only=True)
    # DDP-trained projectors carry a "module." prefix
    return {k.removeprefix("module."): v for k, v in state.items()}


@contextmanager
def default_dtype(dtype: torch.dtype):
    """Create parameters directly in ``dtype`` (a 7B model never exists in fp32)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def from_pretrained(
    path: str | Path,
    *,
    use_proprio: bool = False,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
) -> OpenVLAOFT:
    """Build the model a checkpoint folder describes and load its weights (strict)."""
    path = Path(path)
    config = read_config(path)
    proprio = None
    if use_proprio:
        file = _proprio_file(path)
        if file is None:
            raise CheckpointError(f"actor.model.use_proprio is true but {path} has no {PROPRIO_PATTERN} file")
        proprio = _read_proprio(file)
        if "fc1.weight" not in proprio:
            raise CheckpointError(f"{file} has no fc1.weight; found {listing(proprio)}")
    files = weight_files(path)
    with torch.device(device), default_dtype(dtype):
        model = OpenVLAOFT(
            config,
            proprio_dim=proprio["fc1.weight"].shape[1] if proprio else None,
            attn_implementation=attn_implementation,
        )
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.startswith(PROPRIO_PREFIX)}
    check_keys(expected, _shapes(files), f"checkpoint {path}")
    if proprio is not None:
        expected_proprio = {k: tuple(v.shape) for k, v in model.proprio_projector.state_dict().items()}
        check_keys(expected_proprio, {k: tuple(v.shape) for k, v in proprio.items()}, f"proprio projector in {path}")
        model.proprio_projector.load_state_dict(proprio)
    for file in sorted(set(files.values())):
        with safe_open(file, "pt", device=str(device)) as f:
            shard = {k: f.get_tensor(k) for k in f.keys() if files.get(k) == file}
        model.load_state_dict(shard, strict=False)
    return model


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # AutoTokenizer warns that config.json is no tokenizer's model type
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot load a tokenizer from {path}: {e}") from None
    finally:
        hf_logging.set_verbosity(verbosity)


def base_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's own tensors under checkpoint names, without LoRA adapters (peft injects
    ``lora_*`` modules and moves the wrapped weight to ``*.base_layer.*``)."""
    out = {}
    for name, t in model.state_dict().items():
        if ".lora_" in name:
            continue
        out[name.replace(".base_layer.", ".")] = full_tensor(t)
    return out


def save_pretrained(
    model: OpenVLAOFT, path: str | Path, *, tokenizer=None, max_shard_bytes: int = DEFAULT_SHARD_BYTES
) -> None:
    """Write ``model`` in the layout ``from_pretrained`` reads (and OpenVLA tools expect).

    Under FSDP2 every rank must call it (it gathers shards); rank 0 writes.
    """
    path = Path(path)
    state = base_state_dict(model)
    if not is_writer():
        return
    path.mkdir(parents=True, exist_ok=True)
    proprio = {k.removeprefix(PROPRIO_PREFIX): v for k, v in state.items() if k.startswith(PROPRIO_PREFIX)}
    weights = {k: v.contiguous() for k, v in state.items() if not k.startswith(PROPRIO_PREFIX)}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(weights):
        nbytes = weights[name].numel() * weights[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = weights[name]
        size += nbytes
    for stale in list(path.glob("model-*-of-*.safetensors")) + [path / SINGLE_FILE, path / INDEX_FILE]:
        stale.unlink(missing_ok=True)
    if len(shards) == 1:
        save_file(shards[0], str(path / SINGLE_FILE), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(path / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
        total = sum(v.numel() * v.element_size() for v in weights.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2))
    config = model.config.to_dict()
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    (path / STATS_FILE).write_text(json.dumps(config["norm_stats"], indent=2))
    for stale in path.glob(PROPRIO_PATTERN):
        stale.unlink()
    if proprio:
        torch.save(proprio, path / PROPRIO_FILE)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))

