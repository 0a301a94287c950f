"""Scripted experts: policies that read the privileged state (object poses) and solve a task,
to record demonstrations without training a state policy first."""

from __future__ import annotations

import numpy as np


def push_cube(states: np.ndarray) -> np.ndarray:
    """PushCube-v1 under ``pd_ee_delta_pos`` (state layout: qpos 9, qvel 9, tcp pose 7, goal
    position 3, cube pose 7): get behind the cube high, go down, push it to the goal. Succeeds
    in ~25 steps from nearly every reset state."""
    tcp, goal, cube = states[:, 18:21], states[:, 25:28], states[:, 28:31]
    behind = cube + np.array([-0.05, 0.0, 0.0])
    aligned = (np.abs(tcp[:, 1] - cube[:, 1]) < 0.01) & (tcp[:, 0] < cube[:, 0] - 0.035)
    target = np.where(aligned[:, None], behind, behind + [0, 0, 0.04])
    pushing = aligned & (tcp[:, 2] <= 0.025)
    target = np.where(pushing[:, None], goal, target)
    target[:, 2] = np.where(aligned, 0.02, 0.06)
    move = np.clip((target - tcp) / 0.1 * 3, -1, 1)
    return np.concatenate([move, -np.ones((len(states), 1))], axis=1).astype(np.float32)
