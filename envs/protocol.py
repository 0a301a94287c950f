"""The env protocol every env in ``envs/`` implements (the simulators' ``VectorEnv``, the text
env, the video wrapper around either), and the reset-state sequence they share.

An env is a batch of ``num_envs`` envs stepped together in chunks (``envs/vector_env.py`` has the
full semantics): ``reset()`` starts an episode in every env, ``chunk_step(actions[B, C, A])``
returns ``obs, rewards[B, C], terminations[B, C], truncations[B, C], infos``. The env worker
drives any env through these methods alone.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

Obs = dict[str, Any]
# Frames [B, H, W, 3] uint8 that a simulator renders only for videos, when its observations hold
# no camera images (ManiSkill with obs_mode state and video_cfg.save_video on). The video
# recorder draws and removes them, so policies and channels never see them.
RENDER_IMAGES = "render_images"
# Only while recording: ``{key: [B, C, ...]}``, the ``video_keys`` images after each of a chunk's
# C steps, so that a video holds one frame per env step while the policy sees one observation per
# chunk. The video recorder removes them too.
STEP_FRAMES = "step_frames"
CAMERA_KEYS = ("main_images", "wrist_images")
# Object and goal poses for a scripted expert or a state policy (ManiSkill's obs_mode rgb+state,
# LIBERO's init_params.privileged_states); VLAs never read them
PRIVILEGED_STATES = "privileged_states"
# The actions of a variable-length action (a text response) past its end, as envs receive them:
# the rollout worker writes it where the policy's token mask is false (after EOS or a stop string)
NO_TOKEN = -1


def video_keys(keys: Any) -> tuple[str, ...]:
    """The observation keys a video shows: the scene renders of an env without cameras, else
    its cameras."""
    if RENDER_IMAGES in keys:
        return (RENDER_IMAGES,)
    return tuple(k for k in CAMERA_KEYS if k in keys)


class Env(Protocol):
    num_envs: int

    @property
    def rounds(self) -> int:
        """Episodes per env that start every reset state once (``each_reset_state_once``); else 1."""

    def reset(self, reset_state_ids: np.ndarray | list[int] | None = None) -> Obs: ...

    def chunk_step(self, actions: np.ndarray) -> tuple[Obs, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]: ...

    def next_episodes(self) -> np.ndarray:
        """The episode number each env starts at its next reset (what a checkpoint keeps)."""

    def set_next_episodes(self, numbers: np.ndarray | list[int]) -> None:
        """Continue another env's numbering: the next reset starts these episodes."""

    def pop_metrics(self) -> dict[str, float]:
        """Counters of the env's own since the last call (e.g. unparsable text responses)."""

    def pop_samples(self) -> list[dict[str, Any]]:
        """Examples of the last episodes worth logging (e.g. prompts and responses)."""

    def flush(self) -> None:
        """Finish what is being written (videos), so that the files are whole."""

    def close(self) -> None: ...


class ResetStates:
    """The reset state of each env's episodes: a pure function of ``(seed, stream, episode)``,
    where the stream is an env's global index (or its group's, when a group shares its states).

    - ``order`` ``shuffled`` (the default): with ``num_states`` None (unbounded, e.g. seeds) drawn
      at random per stream and episode; finite, the streams take turns through one sequence of
      random permutations of the states, stream ``s``'s episode ``k`` taking position
      ``k * num_streams + s``: each block of ``num_states`` positions starts every state once.
    - ``ordered``: position ``k * num_streams + s`` itself (modulo a finite set's size).
    - ``random``: drawn at random per stream and episode, finite or not (with replacement).
    - ``each_once`` (the eval protocol): the states are split into contiguous runs over the
      streams, ``rounds`` episodes each, so that episodes ``0 .. rounds - 1`` of all streams
      start every state exactly once; episodes past a stream's run are flagged as extra.
    """

    ORDERS = ("shuffled", "ordered", "random")

    def __init__(self, num_states: int | None, num_streams: int, seed: int, *, order: str = "shuffled",
                 each_once: bool = False):
        if order not in self.ORDERS:
            raise ValueError(f"reset state order {order!r}: expected one of {list(self.ORDERS)}")
        self.finite = bool(num_states)
        self.num_states = num_states or 2**31
        self.num_streams = num_streams
        self.seed = seed
        self.order = order
        self.each_once = each_once
        self._permutations: dict[int, np.ndarray] = {}

    @property
    def rounds(self) -> int:
        return -(-self.num_states // self.num_streams) if self.each_once else 1

    def ids(self, streams: np.ndarray, episodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The states of these streams' episodes, and which of them are extra (``each_once``)."""
        n = self.num_states
        if self.each_once:
            position = streams * self.rounds + episodes
            return position % n, (episodes >= self.rounds) | (position >= n)
        extra = np.zeros(len(streams), bool)
        position = episodes * self.num_streams + streams
        if self.order == "ordered":
            return position % n, extra
        if self.order == "random" or not self.finite:
            return np.array([np.random.default_rng([self.seed, int(s), int(k)]).integers(n)
                             for s, k in zip(streams, episodes)], dtype=np.int64), extra
        return np.array([self._permutation(int(p) // n)[int(p) % n] for p in position], np.int64), extra

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._permutations:
            self._permutations = {epoch: np.random.default_rng([self.seed, epoch]).permutation(
                self.num_states)} | {e: v for e, v in self._permutations.items() if e >= epoch - 1}
        return self._permutations[epoch]
