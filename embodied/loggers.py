"""Metric loggers behind one interface: TensorBoard (default), SwanLab, W&B.

Chosen by ``runner.logger.logger_backends`` and written under ``runner.logger.log_path``.
SwanLab and W&B run offline when there is no login, so a run never stops at a prompt.
"""

from __future__ import annotations

import json
import netrc
import os
from pathlib import Path
from typing import Any, Protocol

# the config keys read here (tests/test_schema.py: every schema key is read or refused)
CONFIG_KEYS = ("runner.logger.log_path", "runner.logger.project_name", "runner.logger.experiment_name",
               "runner.logger.logger_backends")


class Backend(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...
    def close(self) -> None: ...


class TensorBoardBackend:
    def __init__(self, log_dir: Path, config: dict[str, Any]):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir / "tensorboard"))
        self.writer.add_text("config", f"```\n{_yaml(config)}\n```", 0)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_text(self, tag: str, text: str, step: int) -> None:
        self.writer.add_text(tag, text, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class SwanLabBackend:
    def __init__(self, log_dir: Path, config: dict[str, Any], project: str, name: str):
        import swanlab

        mode = "online" if _swanlab_logged_in() else "offline"
        self.run = swanlab.init(project=project, name=name, config=config, mode=mode,
                                log_dir=str(log_dir / "swanlab"), reinit=True)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class WandbBackend:
    def __init__(self, log_dir: Path, config: dict[str, Any], project: str, name: str):
        import wandb

        mode = "online" if _wandb_logged_in() else "offline"
        self.run = wandb.init(project=project, name=name, config=config, mode=mode,
                              dir=str(log_dir), reinit="finish_previous")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class MetricLogger:
    """Fans one ``log(metrics, step)`` call out to every configured backend."""

    def __init__(self, logger_cfg: Any, config: dict[str, Any] | None = None):
        self.log_dir = log_dir = Path(logger_cfg.log_path)
        log_dir.mkdir(parents=True, exist_ok=True)
        config = config or {}
        project, name = logger_cfg.project_name, logger_cfg.experiment_name
        self.backends: list[Backend] = []
        for backend in logger_cfg.logger_backends:
            if backend == "tensorboard":
                self.backends.append(TensorBoardBackend(log_dir, config))
            elif backend == "swanlab":
                self.backends.append(SwanLabBackend(log_dir, config, project, name))
            elif backend == "wandb":
                self.backends.append(WandbBackend(log_dir, config, project, name))
            else:
                raise ValueError(f"runner.logger.logger_backends: unknown backend {backend!r}")

    def log(self, metrics: dict[str, float], step: int) -> None:
        scalars = {k: float(v) for k, v in metrics.items()}
        for backend in self.backends:
            backend.log(scalars, step)

    def log_samples(self, split: str, samples: list[dict[str, Any]], step: int) -> None:
        """Example responses (text envs): one JSON line each in ``<log_path>/samples.jsonl``, and
        a markdown table as TensorBoard text ``<split>/samples``."""
        if not samples:
            return
        with open(self.log_dir / "samples.jsonl", "a") as f:
            f.writelines(json.dumps({"step": step, "split": split, **s}) + "\n" for s in samples)
        rows = ["| " + " | ".join(str(s[k]).replace("|", "\\|").replace("\n", " ") for k in samples[0]) + " |"
                for s in samples]
        table = "\n".join(["| " + " | ".join(samples[0]) + " |", "|" + "---|" * len(samples[0]), *rows])
        for backend in self.backends:
            if hasattr(backend, "log_text"):
                backend.log_text(f"{split}/samples", table, step)

    def close(self) -> None:
        for backend in self.backends:
            backend.close()


def _swanlab_logged_in() -> bool:
    if os.environ.get("SWANLAB_API_KEY"):
        return True
    return _netrc_has(Path(os.environ.get("SWANLAB_SAVE_DIR", Path.home() / ".swanlab")) / ".netrc")


def _wandb_logged_in() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    return _netrc_has(Path(os.environ.get("NETRC", Path.home() / ".netrc")), "api.wandb.ai")


def _netrc_has(path: Path, host: str | None = None) -> bool:
    try:
        hosts = netrc.netrc(str(path)).hosts
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False
    return bool(hosts) if host is None else host in hosts


def _yaml(config: dict[str, Any]) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(config))
