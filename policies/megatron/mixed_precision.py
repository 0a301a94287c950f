"""Megatron's mixed precision (``actor.optim.fp16`` / ``bf16`` with ``actor.training_backend:
megatron``): the model computes in the half-precision parameters ``actor.model.precision`` gives it,
and the optimizer steps fp32 main copies of them, so that updates far smaller than a half-precision
step of the weight still add up. fp16 losses are scaled so that small gradients survive the
half-precision backward: by ``actor.optim.loss_scale`` (static), or, when it is null, by a dynamic
scale as Megatron-Core's ``DynamicGradScaler`` keeps it (``actor.optim.loss_scale_window``).

One optimizer step, in the trainer's order (``core/backend.py``)::

    scaler.scale(loss).backward()      # per micro-batch: half-precision gradients of loss x scale
    backend.reduce_gradients(policy)   # data-parallel average of those gradients
    scaler.unscale_(optimizer)         # main gradients = fp32(gradient) / scale
    backend.clip_gradients(policy)     # the main gradients' norm: non-finite on every rank if any
    scaler.step(optimizer)             # (when finite) the main weights step, the model gets them
    scaler.update()                    # an overflow lowers a dynamic scale, clean steps raise it
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from policies.megatron.training import WrappedOptimizer

# Megatron-Core's dynamic scaler as Megatron-LM starts it (--initial-loss-scale, --min-loss-scale,
# --hysteresis); RLinf's configs set only the window
INITIAL_SCALE = 2.0**32
MIN_SCALE = 1.0
HYSTERESIS = 2  # overflows in a row before the first backoff


class LossScale:
    """The loss scale: static (``dynamic`` false; 1 for bf16, whose range is fp32's) or dynamic."""

    def __init__(self, scale: float, window: int, dynamic: bool) -> None:
        self.scale, self.window, self.dynamic = float(scale), window, dynamic
        self.clean = 0  # steps without overflow since the last change
        self.hysteresis = HYSTERESIS

    def update(self, overflow: bool) -> None:
        """After a step: a dynamic scale halves on an overflow (once ``HYSTERESIS`` came in a row,
        then at each), and doubles after ``window`` clean steps."""
        if not self.dynamic:
            return
        if overflow:
            self.clean = 0
            self.hysteresis -= 1
            if self.hysteresis <= 0:
                self.scale = max(self.scale / 2, MIN_SCALE)
            return
        self.clean += 1
        if self.clean == self.window:
            self.clean, self.hysteresis = 0, HYSTERESIS
            self.scale *= 2

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "clean": self.clean, "hysteresis": self.hysteresis}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale, self.clean, self.hysteresis = state["scale"], state["clean"], state["hysteresis"]


class MainWeightsOptimizer(WrappedOptimizer):
    """An optimizer (``build`` over the groups) that steps fp32 copies of the model's half-precision
    parameters; the model's parameters get the stepped weights after each step. The trainer sees a
    torch optimizer: ``param_groups`` (the main weights, whose rates it sets), ``state``,
    ``zero_grad``, ``step``, ``state_dict`` (with the main weights, so a resume is exact)."""

    def __init__(self, groups: list[dict[str, Any]], build: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
                 loss_scale: LossScale) -> None:
        from megatron.core.tensor_parallel import copy_tensor_model_parallel_attributes

        self.model_params: list[Tensor] = []
        self.main_params: list[Tensor] = []
        main_groups = []
        for group in groups:
            mains = []
            for param in group["params"]:
                main = torch.nn.Parameter(param.detach().float())
                copy_tensor_model_parallel_attributes(main, param)  # the clip counts TP shards once
                self.model_params.append(param)
                mains.append(main)
            self.main_params += mains
            main_groups.append({**group, "params": mains})
        self.inner = build(main_groups)
        self.loss_scale = loss_scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in (*self.model_params, *self.main_params):
            param.grad = None

    @torch.no_grad()
    def unscale(self) -> bool:
        """Main gradients from the model's (divided by the loss scale); True when one is not finite
        on any rank (every rank then skips the step)."""
        inverse = 1.0 / self.loss_scale.scale
        overflow = torch.zeros(1, device=self.main_params[0].device if self.main_params else None)
        for param, main in zip(self.model_params, self.main_params):
            if param.grad is None:
                main.grad = None
                continue
            main.grad = param.grad.float().mul_(inverse)
            overflow += (~torch.isfinite(main.grad)).any().float()
        dist.all_reduce(overflow, op=dist.ReduceOp.MAX)
        return bool(overflow.item())

    @torch.no_grad()
    def step(self) -> None:
        self.inner.step()
        self.copy_to_model()

    @torch.no_grad()
    def copy_to_model(self) -> None:
        for param, main in zip(self.model_params, self.main_params):
            param.copy_(main)

    @torch.no_grad()
    def copy_from_model(self) -> None:
        """Main weights from the model's (after the model's weights were loaded without them)."""
        for param, main in zip(self.model_params, self.main_params):
            main.copy_(param)

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's, each parameter's main weights as its ``fp32_param`` (sharded like
        the parameter in a Megatron checkpoint, as Megatron's own optimizer saves them), and the
        loss scale."""
        state = self.inner.state_dict()
        for index, main in enumerate(self.main_params):
            state["state"].setdefault(index, {})["fp32_param"] = main.detach()
        state["loss_scale"] = self.loss_scale.state_dict()
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = {**state, "state": {i: dict(s) for i, s in state["state"].items()}}
        self.loss_scale.load_state_dict(state.pop("loss_scale"))
        for index, main in enumerate(self.main_params):
            main.copy_(state["state"][index].pop("fp32_param"))
        state["state"] = {i: s for i, s in state["state"].items() if s}
        self.inner.load_state_dict(state)
        self.copy_to_model()


class Scaler:
    """What the trainer calls, in the order of torch's ``GradScaler``, for the loss scale of a
    ``MainWeightsOptimizer`` (``step`` is the trainer's optimizer's: it may hold that one)."""

    def __init__(self, mixed: MainWeightsOptimizer) -> None:
        self.mixed, self.loss_scale = mixed, mixed.loss_scale
        self.overflow = False

    def scale(self, loss: Tensor) -> Tensor:
        return loss * self.loss_scale.scale

    def unscale_(self, optimizer: Any) -> None:
        self.overflow = self.mixed.unscale()

    def step(self, optimizer: Any) -> None:
        if not self.overflow:
            optimizer.step()

    def update(self) -> None:
        self.loss_scale.update(self.overflow)

    def get_scale(self) -> float:
        return self.loss_scale.scale
