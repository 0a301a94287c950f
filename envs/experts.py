"""Scripted experts: policies that read the privileged state (object poses) and solve a task,
to record demonstrations without training a state policy first (``python -m embodied.record
--expert <name>``). Each maps ``privileged_states [B, D]`` to actions ``[B, A]``, by name in
``EXPERTS`` with the env type it drives."""

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


def libero_pick_place(states: np.ndarray, gripper_open_action: int = -1) -> np.ndarray:
    """A LIBERO task whose goal is one On/In (``envs.libero`` privileged state: end-effector 3,
    finger positions 2 and velocities 2, object 3, target 3, grasp height 1, object top 1), under LIBERO's
    OSC_POSE delta actions with the orientation held: above the object, down to its grasp
    height, close until the fingers stop on it, lift straight up, over the target, let go. It
    keeps no memory: the phase is read from the state. Succeeds in ~100 steps on LIBERO-Object's
    groceries, not on bowls (the gripper's last action: ``gripper_open_action`` opens)."""
    eef, fingers, finger_speed = states[:, 0:3], states[:, 3:5], states[:, 5:7]
    obj, target, grasp_height, top = states[:, 7:10], states[:, 10:13], states[:, 13], states[:, 14]
    grasp = obj.copy()  # at its model's grasp height, or 3 cm below its top where that is higher (bottles' necks)
    grasp[:, 2] = np.maximum(obj[:, 2] + grasp_height, top - 0.03)
    width = fingers[:, 0] - fingers[:, 1]
    settled = np.abs(finger_speed).max(axis=1) < 0.01
    empty = settled & (width < 0.01)  # closed on nothing: open and try again
    holding = settled & ~empty & (width < OPEN_WIDTH - 0.005) & (np.linalg.norm(eef - grasp, axis=1) < 0.03)
    over_object = np.linalg.norm(eef[:, :2] - obj[:, :2], axis=1) < 0.01
    at_grasp = over_object & (eef[:, 2] < grasp[:, 2] + 0.01)
    carry_height = target[:, 2] + 0.2
    over_target = np.linalg.norm(eef[:, :2] - target[:, :2], axis=1) < 0.02
    # not holding: over the object at a safe height, then down to the grasp point
    aim = np.where(over_object[:, None], grasp, np.concatenate([obj[:, :2], np.maximum(
        grasp[:, 2] + 0.1, eef[:, 2])[:, None]], axis=1))
    close = (at_grasp | holding) & ~empty
    # holding: straight up first, then over the target, then a little lower and let go
    lifted = eef[:, 2] > carry_height - 0.05
    carry = np.where(lifted[:, None], np.concatenate([target[:, :2], carry_height[:, None]], axis=1),
                     np.concatenate([eef[:, :2], carry_height[:, None]], axis=1))
    carry = np.where(over_target[:, None], np.concatenate([target[:, :2], target[:, 2:] + 0.12], axis=1), carry)
    aim = np.where(holding[:, None], carry, aim)
    release = holding & over_target & (np.abs(eef[:, 2] - target[:, 2] - 0.12) < 0.02)
    move = np.clip((aim - eef) / 0.05 * 1.5, -1, 1)
    grip = np.where(close & ~release, 1.0, -1.0) * -gripper_open_action
    return np.concatenate([move, np.zeros((len(states), 3)), grip[:, None]], axis=1).astype(np.float32)


OPEN_WIDTH = 0.0775  # LIBERO's Panda gripper: distance of its fingers when open (m; 0.0774 measured)
EXPERTS = {"push_cube": ("maniskill", push_cube), "libero_pick_place": ("libero", libero_pick_place)}
