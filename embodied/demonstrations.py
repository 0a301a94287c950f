"""The demonstrations an SFT run (``algorithm.loss_type: sft``) trains on: the files of
``data.demo_paths`` (``envs/demos.py`` reads them as the eval env shows observations), checked in
the driver before any worker starts, prepared once for the model (``Policy.imitation_options``:
e.g. OpenVLA-OFT's action statistics written into the checkpoint folder it trains), and held by
every actor rank as ``DemoSamples``, from which each rank draws its own minibatches.

A sample is one demonstrated step: its observation and the action chunk from it (the next
``num_action_chunks`` actions, the episode's last action repeated past its end, as OpenVLA-OFT's
data pipeline pads chunks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from core.errors import ConfigError
from embodied.batch import DemoSamples
from envs.demos import DemoSet, check_demos, demo_view, read_demos
from policies import POLICIES
from policies.base import Policy

# the config keys read here (tests/test_schema.py: every schema key is read or refused)
CONFIG_KEYS = ("data.demo_paths",)
PREPARED_DIR = "sft_model"  # under runner.logger.log_path: what imitation_options writes
BATCH = 256  # observations turned into forward inputs at once


def view(cfg: DictConfig) -> dict[str, Any]:
    """How the demos must look: as the eval env shows observations, with the model's action dims."""
    return demo_view(cfg.env.eval) | {"action_dim": cfg.actor.model.action_dim}


def files(cfg: DictConfig) -> list[Path]:
    """``data.demo_paths`` with each folder standing for its demo files (``*.h5``, ``*.hdf5``, in
    name order), as LIBERO's datasets and ``embodied.record`` keep one file per task."""
    paths = []
    for entry in map(Path, cfg.data.demo_paths):
        if not entry.is_dir():
            paths.append(entry)
            continue
        found = sorted(p for p in entry.iterdir() if p.suffix in (".h5", ".hdf5"))
        if not found:
            raise ConfigError(f"data.demo_paths: the folder {entry} holds no demo file (*.h5, *.hdf5)")
        paths += found
    return paths


def check(cfg: DictConfig) -> list[DemoSet]:
    """Every file of ``data.demo_paths`` checked from its metadata (layout, action dims, image
    size, control mode): one ``ConfigError`` naming the file, episode and key."""
    paths = files(cfg)
    if not paths:
        raise ConfigError(f"data.demo_paths = []: expected at least one demo file with algorithm.loss_type="
                          f"{cfg.algorithm.loss_type} (python -m embodied.record writes them)")
    return [check_demos(path, **view(cfg)) for path in paths]


def dataset_name(cfg: DictConfig) -> str:
    """The key of the demos' statistics in a checkpoint's ``dataset_statistics.json``:
    ``actor.model.unnorm_key`` when the model has it set, else the first demo file's (or folder's) name."""
    return cfg.actor.model.get("unnorm_key") or Path(cfg.data.demo_paths[0]).stem


def prepare(cfg: DictConfig) -> DictConfig:
    """The config the workers of an SFT run get: ``actor.model`` as the policy prepares it for
    these demonstrations (``Policy.imitation_options``), in the run's folder."""
    demos = [d for path in files(cfg) for d in read_demos(path, **view(cfg))]
    actions = np.concatenate([d.actions for d in demos])
    states = np.concatenate([d.obs["states"] for d in demos]) if "states" in demos[0].obs else None
    options = OmegaConf.to_container(cfg.actor.model, resolve=True)
    folder = Path(cfg.runner.logger.log_path) / PREPARED_DIR
    prepared = POLICIES.get(options["model_type"]).imitation_options(options, actions, states, dataset_name(cfg),
                                                                      folder)
    if prepared == options:
        return cfg
    out = OmegaConf.create(OmegaConf.to_container(cfg))
    out.actor.model = prepared
    OmegaConf.set_struct(out, True)
    OmegaConf.set_readonly(out, True)
    return out


def chunks(actions: np.ndarray, num_chunks: int) -> np.ndarray:
    """``[T, A]`` actions -> ``[T, num_chunks, A]``: step t's chunk is actions t .. t + C - 1,
    the last action repeated past the episode's end."""
    index = np.minimum(np.arange(len(actions))[:, None] + np.arange(num_chunks), len(actions) - 1)
    return actions[index]


def load(cfg: DictConfig, policy: Policy) -> DemoSamples:
    """Every demonstrated step as the policy stores it (``Policy.imitation_inputs``), in the
    order of the files and their episodes."""
    parts = []
    for path in files(cfg):
        for demo in read_demos(path, **view(cfg)):
            actions = chunks(demo.actions, policy.num_action_chunks)
            for start in range(0, len(actions), BATCH):
                obs = {k: v[start:start + BATCH] for k, v in demo.obs.items()}
                inputs, targets = policy.imitation_inputs(obs, torch.as_tensor(actions[start:start + BATCH]))
                parts.append(DemoSamples({k: v.cpu() for k, v in inputs.items()}, targets.cpu()))
    return DemoSamples.cat(parts, dim=0)


def draw(count: int, step: int, size: int, rank: int, ranks: int, seed: int) -> torch.Tensor:
    """Indices of data-parallel rank ``rank``'s share (``size`` samples) of training step
    ``step``'s global batch (``ranks * size``): the global batches run through a fresh shuffle
    of the ``count`` samples per epoch, so every sample counts once per epoch; keyed on the
    step alone, so a resumed run draws what the uninterrupted one would have."""
    total = ranks * size
    positions = (step - 1) * total + rank * size + torch.arange(size)
    epochs = positions // count
    out = torch.empty(size, dtype=torch.long)
    for epoch in epochs.unique().tolist():
        order = torch.randperm(count, generator=torch.Generator().manual_seed(seed + epoch))
        where = epochs == epoch
        out[where] = order[positions[where] % count]
    return out
