"""Helpers every policy's checkpoint code shares: strict key/shape matching with a readable
error, and gathering FSDP2-sharded tensors for rank 0 to write."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from core.errors import CheckpointError

MAX_LISTED = 20
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # config names of dtypes


def listing(keys: Iterable[str]) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:MAX_LISTED])
    return f"{shown}, ... ({len(keys)} in all)" if len(keys) > MAX_LISTED else shown


def check_keys(expected: Mapping[str, tuple[int, ...]], found: Mapping[str, tuple[int, ...]], source: str) -> None:
    """Fail, naming the tensors, unless ``found`` has exactly the names and shapes of ``expected``."""
    missing = set(expected) - set(found)
    unexpected = set(found) - set(expected)
    misshapen = [
        f"{k} {found[k]} != {expected[k]}"
        for k in sorted(set(expected) & set(found))
        if tuple(found[k]) != tuple(expected[k])
    ]
    problems = []
    if missing:
        problems.append(f"missing keys: {listing(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {listing(unexpected)}")
    if misshapen:
        problems.append(f"shape mismatches: {listing(misshapen)}")
    if problems:
        raise CheckpointError(f"{source} does not match the model; " + "; ".join(problems))


def is_writer() -> bool:
    """Whether this process writes files: under torch.distributed every rank gathers, rank 0 writes."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A plain CPU tensor (gathers FSDP2-sharded DTensors; every rank must call)."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().cpu()
