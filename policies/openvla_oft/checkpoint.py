"""Reading and writing OpenVLA / OpenVLA-OFT checkpoint folders (Hugging Face layout).

A folder holds ``config.json`` (Prismatic/OpenVLA fields, ``norm_stats``), the weights as
``model.safetensors`` or shards listed in ``model.safetensors.index.json`` (keys
``vision_backbone.featurizer.*``, ``vision_backbone.fused_featurizer.*``, ``projector.*``,
``language_model.*``), ``dataset_statistics.json`` and the tokenizer files. Besides, by layout:

- official OpenVLA-OFT: ``proprio_projector--*.pt`` (``use_proprio``) and the L1-regression head
  ``action_head--*.pt`` (``action_head: l1_regression``), saved from DDP with a ``module.`` prefix;
- RL frameworks' OFT (discrete tokens): ``value_head.*`` and ``proprio_projector.*`` tensors
  inside the main weights;
- ours, after RL: ``rl_heads.safetensors`` (value head, the L1 policy's log-std) and, from a LoRA
  run, a ``lora_adapter/`` folder in peft's layout.

Every entry of the folder is used, ignored by name (documentation, remote code and processor
files this loader does not need) or refused: a file the config does not ask for, or a config that
asks for a file the folder lacks, fails naming both (``inspect_folder``). Every tensor must match
a model parameter by name and shape: anything missing, unexpected or misshapen fails with the
names listed.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
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
ACTION_HEAD_PATTERN = "action_head--*.pt"
ACTION_HEAD_FILE = "action_head--checkpoint.pt"
ACTION_HEAD_PREFIX = "action_head."
VALUE_PREFIX = "value_head."
RL_HEADS_FILE = "rl_heads.safetensors"
LOG_STD = "action_log_std"  # the L1 policy's Gaussian log-std, in rl_heads.safetensors
FULL_MODEL_DIR = "model"  # a full fine-tuning run's checkpoint folder inside its actor folder
ADAPTER_DIR = "lora_adapter"
DEFAULT_SHARD_BYTES = 5 * 1024**3
# read by the tokenizer loader, or carried by HF folders for tools that run the checkpoint's own
# code (remote code, processor settings this loader reimplements): ignored by name
TOKENIZER_FILES = {
    "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
}
IGNORED_FILES = {
    "README.md", "generation_config.json", "preprocessor_config.json", "processor_config.json",
    "configuration_prismatic.py", "modeling_prismatic.py", "processing_prismatic.py",
}
REFUSED_PATTERNS = {
    "noisy_action_projector--*.pt": "a diffusion action head (OFT's use_diffusion), which is not supported",
    "vision_backbone--*.pt": "a FiLM vision backbone (OFT's use_film), which is not supported",
    "pytorch_model*.bin": "weights in .bin files; convert them to safetensors",
}


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


def _one(path: Path, pattern: str) -> Path | None:
    found = sorted(path.glob(pattern))
    if len(found) > 1:
        raise CheckpointError(f"{path} has several {pattern} files {[f.name for f in found]}; keep one")
    return found[0] if found else None


def read_torch_file(file: Path) -> dict[str, torch.Tensor]:
    """A ``torch.save``-d state dict; a DDP ``module.`` prefix (OFT's training script) is removed."""
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is one message naming it
        raise CheckpointError(f"{file} is not a readable torch state dict: {e}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{file} holds a {type(state).__name__}, not a state dict")
    return {k.removeprefix("module."): v for k, v in state.items()}


@dataclass
class FolderContents:
    """What ``inspect_folder`` found, file by file, for the options given."""

    weights: dict[str, Path]  # main tensor name -> shard, without value_head.* / proprio_projector.*
    shapes: dict[str, tuple[int, ...]]
    proprio: dict[str, torch.Tensor] | None = None  # projector tensors (file or main weights)
    action_head: dict[str, torch.Tensor] | None = None
    rl_state: dict[str, torch.Tensor] = field(default_factory=dict)  # value_head.*, action_log_std
    files: dict[str, str] = field(default_factory=dict)  # part -> file it came from (for messages)


def inspect_folder(
    path: str | Path,
    *,
    use_proprio: bool = False,
    action_head: str = "discrete",
    add_value_head: bool = False,
    lora_path: str | Path | None = None,
) -> FolderContents:
    """Sort every entry of a checkpoint folder into used, ignored by name, or refused (an error
    naming the file and the config key), and read the small parts (heads, projector)."""
    path = Path(path)
    read_config(path)
    files = weight_files(path)
    shapes = _shapes(files)
    used = {CONFIG_FILE, STATS_FILE, INDEX_FILE, *(f.name for f in files.values())}
    contents = FolderContents({}, {})

    main_value = {k for k in shapes if k.startswith(VALUE_PREFIX)}
    main_proprio = {k for k in shapes if k.startswith(PROPRIO_PREFIX)}
    proprio_file = _one(path, PROPRIO_PATTERN)
    if main_value and not add_value_head:
        raise CheckpointError(
            f"{path}'s weights hold a value head ({listing(main_value)}) but actor.model.add_value_head is "
            "false; set it true to use that head"
        )
    if proprio_file and main_proprio:
        raise CheckpointError(
            f"{path} has a proprio projector both in {proprio_file.name} and in its weights "
            f"({listing(main_proprio)}); keep one"
        )
    if (proprio_file or main_proprio) and not use_proprio:
        where = proprio_file.name if proprio_file else f"its weights ({listing(main_proprio)})"
        raise CheckpointError(
            f"{path} has a proprio projector in {where} but actor.model.use_proprio is false; the "
            "checkpoint was trained with the robot state as input: set use_proprio true"
        )
    if use_proprio and not (proprio_file or main_proprio):
        raise CheckpointError(
            f"actor.model.use_proprio is true but {path} has no {PROPRIO_PATTERN} file and no "
            f"{PROPRIO_PREFIX}* tensors in its weights"
        )
    if proprio_file:
        contents.proprio = read_torch_file(proprio_file)
        contents.files["proprio"] = str(proprio_file)
        used.add(proprio_file.name)
    elif main_proprio:
        contents.proprio = _read_tensors(files, main_proprio, PROPRIO_PREFIX)
        contents.files["proprio"] = f"{path} weights"
    if main_value:
        contents.rl_state.update(_read_tensors(files, main_value, ""))

    head_file = _one(path, ACTION_HEAD_PATTERN)
    if head_file and action_head != "l1_regression":
        raise CheckpointError(
            f"{path} has an L1-regression action head {head_file.name} but actor.model.action_head is "
            f"{action_head!r}; set action_head=l1_regression to act with it"
        )
    if action_head == "l1_regression":
        if head_file is None:
            raise CheckpointError(
                f"actor.model.action_head=l1_regression but {path} has no {ACTION_HEAD_PATTERN} file"
            )
        contents.action_head = read_torch_file(head_file)
        contents.files["action_head"] = str(head_file)
        used.add(head_file.name)

    rl_file = path / RL_HEADS_FILE
    if rl_file.exists():
        saved = load_file(str(rl_file))
        if main_value and any(k.startswith(VALUE_PREFIX) for k in saved):
            raise CheckpointError(f"{path} has a value head both in {RL_HEADS_FILE} and in its weights; keep one")
        if any(k.startswith(VALUE_PREFIX) for k in saved) and not add_value_head:
            raise CheckpointError(
                f"{rl_file} holds a value head but actor.model.add_value_head is false; set it true to use it"
            )
        if "action_log_std" in saved and action_head != "l1_regression":
            raise CheckpointError(
                f"{rl_file} holds action_log_std (an L1-head policy) but actor.model.action_head is {action_head!r}"
            )
        contents.rl_state.update(saved)
        contents.files["rl_heads"] = str(rl_file)
        used.add(RL_HEADS_FILE)

    adapter = path / ADAPTER_DIR
    if adapter.is_dir():
        if lora_path is None or Path(lora_path).resolve() != adapter.resolve():
            raise CheckpointError(
                f"{path} holds {ADAPTER_DIR}/ but actor.model.lora_path does not name it: set "
                f"lora_path={adapter} (with is_lora true) to apply it, or remove it if the weights already "
                "have it merged (OFT's training script keeps the adapter next to the merged weights)"
            )
        used.add(ADAPTER_DIR)

    for entry in sorted(path.iterdir()):
        name = entry.name
        if name in used or name in TOKENIZER_FILES or name in IGNORED_FILES or name.startswith("."):
            continue
        for pattern, what in REFUSED_PATTERNS.items():
            if entry.match(pattern):
                raise CheckpointError(f"{entry} is {what}")
        raise CheckpointError(
            f"{entry} is not part of an OpenVLA-OFT checkpoint this loader knows (see "
            "policies/openvla_oft/checkpoint.py); remove it or move it out of the folder"
        )
    contents.weights = {k: f for k, f in files.items() if k not in main_value | main_proprio}
    contents.shapes = {k: s for k, s in shapes.items() if k in contents.weights}
    return contents


def _read_tensors(files: Mapping[str, Path], names: set[str], prefix: str) -> dict[str, torch.Tensor]:
    out = {}
    for name in sorted(names):
        with safe_open(files[name], "pt") as f:
            out[name.removeprefix(prefix)] = f.get_tensor(name)
    return out


@contextmanager
def default_dtype(dtype: torch.dtype):
    """Create parameters directly in ``dtype`` (a 7B model never exists in fp32)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _check_part(module: nn.Module, state: Mapping[str, torch.Tensor], source: str) -> None:
    check_keys(
        {k: tuple(v.shape) for k, v in module.state_dict().items()},
        {k: tuple(v.shape) for k, v in state.items()},
        source,
    )


def load_checkpoint(
    path: str | Path,
    *,
    use_proprio: bool = False,
    action_head: str = "discrete",
    add_value_head: bool = False,
    lora_path: str | Path | None = None,
    stop_token: bool = True,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
) -> tuple[OpenVLAOFT, dict[str, torch.Tensor]]:
    """Build the model a checkpoint folder describes and load its weights (strict); also return
    the RL tensors the folder holds (``value_head.*``, ``action_log_std``) for the policy."""
    path = Path(path)
    config = read_config(path)
    contents = inspect_folder(
        path, use_proprio=use_proprio, action_head=action_head, add_value_head=add_value_head, lora_path=lora_path
    )
    proprio, head = contents.proprio, contents.action_head
    if proprio is not None and "fc1.weight" not in proprio:
        raise CheckpointError(f"{contents.files['proprio']} has no fc1.weight; found {listing(proprio)}")
    if head is not None and "model.fc2.weight" not in head:
        raise CheckpointError(f"{contents.files['action_head']} has no model.fc2.weight; found {listing(head)}")
    with torch.device(device), default_dtype(dtype):
        model = OpenVLAOFT(
            config,
            proprio_dim=proprio["fc1.weight"].shape[1] if proprio is not None else None,
            l1_action_dim=head["model.fc2.weight"].shape[0] if head is not None else None,
            stop_token=stop_token,
            attn_implementation=attn_implementation,
        )
    extra = (PROPRIO_PREFIX, ACTION_HEAD_PREFIX)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.startswith(extra)}
    check_keys(expected, contents.shapes, f"checkpoint {path}")
    if proprio is not None:
        _check_part(model.proprio_projector, proprio, f"proprio projector {contents.files['proprio']}")
        model.proprio_projector.load_state_dict(proprio)
    if head is not None:
        _check_part(model.action_head, head, f"action head {contents.files['action_head']}")
        model.action_head.load_state_dict(head)
    files = contents.weights
    for file in sorted(set(files.values())):
        with safe_open(file, "pt", device=str(device)) as f:
            shard = {k: f.get_tensor(k) for k in f.keys() if files.get(k) == file}
        model.load_state_dict(shard, strict=False)
    return model, contents.rl_state


def from_pretrained(path: str | Path, **options) -> OpenVLAOFT:
    """The model of a checkpoint folder (``load_checkpoint`` without the RL tensors)."""
    return load_checkpoint(path, **options)[0]


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
    model: OpenVLAOFT,
    path: str | Path,
    *,
    tokenizer=None,
    rl_state: Mapping[str, torch.Tensor] | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> None:
    """Write ``model`` in the official OFT layout ``load_checkpoint`` reads (and OpenVLA tools
    expect): main weights, proprio projector and L1 head files; ``rl_state`` (value head,
    log-std) goes to ``rl_heads.safetensors``.

    Under FSDP2 every rank must call it (it gathers shards); rank 0 writes.
    """
    path = Path(path)
    state = base_state_dict(model)
    if not is_writer():
        return
    path.mkdir(parents=True, exist_ok=True)
    proprio = {k.removeprefix(PROPRIO_PREFIX): v for k, v in state.items() if k.startswith(PROPRIO_PREFIX)}
    head = {k.removeprefix(ACTION_HEAD_PREFIX): v for k, v in state.items() if k.startswith(ACTION_HEAD_PREFIX)}
    weights = {k: v.contiguous() for k, v in state.items() if not k.startswith((PROPRIO_PREFIX, ACTION_HEAD_PREFIX))}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(weights):
        nbytes = weights[name].numel() * weights[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = weights[name]
        size += nbytes
    for stale in [*path.glob("model-*-of-*.safetensors"), path / SINGLE_FILE, path / INDEX_FILE, path / RL_HEADS_FILE,
                  *path.glob(PROPRIO_PATTERN), *path.glob(ACTION_HEAD_PATTERN)]:
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
    if proprio:
        torch.save(proprio, path / PROPRIO_FILE)
    if head:
        torch.save(head, path / ACTION_HEAD_FILE)
    if rl_state:
        save_file({k: v.contiguous() for k, v in rl_state.items()}, str(path / RL_HEADS_FILE))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
