"""Shared fixtures: the arithmetic prompt set and a warm-started tiny causal LM, made once per
test session (about 15 s) for the math tests."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_math(tmp_path_factory) -> dict[str, Path]:
    """``{"data": folder with train.jsonl / test.jsonl, "model": HF checkpoint folder}``."""
    import torch

    from envs.arithmetic import write_split
    from policies.tiny_lm import warm_start

    root = tmp_path_factory.mktemp("math")
    write_split(root / "data")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = warm_start(root / "model", root / "data")
    finally:
        torch.set_num_threads(threads)
    return {"data": root / "data", "model": root / "model", "accuracy": result["accuracy"]}
