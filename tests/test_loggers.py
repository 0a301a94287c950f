"""Metric loggers write files that read back."""

import glob

import pytest
from omegaconf import OmegaConf

from embodied.loggers import MetricLogger


def _logger_cfg(tmp_path, backends):
    return OmegaConf.create({
        "log_path": str(tmp_path / "run"), "project_name": "tests",
        "experiment_name": "loggers", "logger_backends": backends,
    })


def test_tensorboard_event_file_reads_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricLogger(_logger_cfg(tmp_path, ["tensorboard"]), {"actor": {"lr": 0.1}})
    for step in range(3):
        logger.log({"train/loss": 1.0 / (step + 1), "env/success": step / 2}, step)
    logger.close()
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    losses = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert losses == [(0, 1.0), (1, pytest.approx(0.5)), (2, pytest.approx(1 / 3))]
    assert [e.value for e in events.Scalars("env/success")] == [0.0, 0.5, 1.0]


def test_swanlab_runs_offline_without_login_and_its_run_file_reads_back(tmp_path, monkeypatch):
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    monkeypatch.delenv("SWANLAB_API_KEY", raising=False)
    monkeypatch.setenv("SWANLAB_SAVE_DIR", str(tmp_path / "no-login"))
    logger = MetricLogger(_logger_cfg(tmp_path, ["swanlab"]))
    for step in range(3):
        logger.log({"train/loss": float(step)}, step)
    logger.close()
    (run_file,) = glob.glob(str(tmp_path / "run" / "swanlab" / "run-*" / "*.swanlab"))
    reader = DataStoreReader()
    reader.open(run_file)
    scalars = []
    while (raw := reader.scan()) is not None:
        record = Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "scalar":
            scalars.append((record.scalar.key, record.scalar.step, record.scalar.value.number))
    assert scalars == [("train/loss", 0, 0.0), ("train/loss", 1, 1.0), ("train/loss", 2, 2.0)]


@pytest.mark.slow
def test_wandb_runs_offline_without_login(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = MetricLogger(_logger_cfg(tmp_path, ["wandb"]), {"seed": 1})
    logger.log({"train/loss": 0.5}, 0)
    logger.close()
    runs = glob.glob(str(tmp_path / "run" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1


def test_unknown_backend_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="logger_backends: unknown backend 'mlflow'"):
        MetricLogger(_logger_cfg(tmp_path, ["mlflow"]))
