"""VideoRecorder on a small in-process vector env whose frames are known exactly (the real
ManiSkill recording is in test_maniskill.py): tiling, one frame per reset and per step (per chunk
from an env without step frames), a new file per reset, the thin info strip, files that appear
only when whole and never overwrite, and playable files when a run dies with an exception."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import imageio
import numpy as np
import pytest

from envs.protocol import RENDER_IMAGES, STEP_FRAMES
from envs.vector_env import EnvSetupError
from envs.video import VideoRecorder, strip_height, tile_frames

ROOT = Path(__file__).resolve().parent.parent

GRADIENT_ENV = textwrap.dedent('''
    import numpy as np

    class GradientEnv:
        """A vector env (reset / chunk_step) whose env i shows a flat image of gray 40 * i + 10 *
        step; chunk_step raises at chunk ``fail_at``."""

        action_dim = 1

        def __init__(self, num_envs, size=(32, 48), fail_at=None):
            self.num_envs, self.size, self.fail_at, self.chunks = num_envs, size, fail_at, 0

        def _obs(self):
            gray = (40 * np.arange(self.num_envs) + 10 * self.chunks) % 256
            images = np.broadcast_to(gray[:, None, None, None], (self.num_envs, *self.size, 3))
            return {"main_images": images.astype(np.uint8),
                    "task_descriptions": ["reach the goal"] * self.num_envs}

        def reset(self, reset_state_ids=None):
            self.chunks = 0
            return self._obs()

        def chunk_step(self, actions):
            self.chunks += 1
            if self.chunks == self.fail_at:
                raise RuntimeError("simulator failed")
            b, c = actions.shape[:2]
            infos = {"success": np.arange(b) % 2 == 1, "episode_length": np.full(b, c * self.chunks),
                     "done": np.zeros(b, bool)}
            done = np.zeros((b, c), bool)
            return self._obs(), np.ones((b, c), np.float32), done, done.copy(), infos

        def close(self):
            self.closed = True
''')
namespace: dict = {}
exec(GRADIENT_ENV, namespace)
GradientEnv = namespace["GradientEnv"]


def read(path: Path) -> np.ndarray:
    return np.stack(imageio.mimread(path, memtest=False))


def test_tiles_envs_in_a_padded_grid_with_wrist_images_beside_main():
    main = np.stack([np.full((10, 12, 3), 50 * (i + 1), np.uint8) for i in range(3)])
    frame = tile_frames({"main_images": main})
    assert frame.shape == (32, 32, 3)  # 2 x 2 grid of 10 x 12 tiles, padded to 16s
    assert frame[0, 0, 0] == 50 and frame[0, 12, 0] == 100 and frame[10, 0, 0] == 150
    assert not frame[10:, 12:].any() and not frame[20:].any() and not frame[:, 24:].any()
    both = tile_frames({"main_images": main[:1], "wrist_images": main[1:2]})
    assert both.shape == (16, 32, 3) and both[0, 0, 0] == 50 and both[0, 12, 0] == 100


def test_one_frame_per_reset_and_chunk_and_one_file_per_reset(tmp_path):
    with VideoRecorder(GradientEnv(2), tmp_path, info_on_video=False, name="train") as env:
        env.reset()
        for _ in range(4):
            env.chunk_step(np.zeros((2, 3, 1)))
        env.reset()
        env.chunk_step(np.zeros((2, 3, 1)))
    assert [p.name for p in env.paths] == ["train_0000.mp4", "train_0001.mp4"]
    first, second = read(env.paths[0]), read(env.paths[1])
    assert first.shape == (5, 32, 96, 3) and second.shape == (2, 32, 96, 3)
    # env 1 is the right tile; gray 40 + 10 * chunk (up to h264's small error)
    np.testing.assert_allclose(first[:, 16, 72, 0], [40, 50, 60, 70, 80], atol=3)
    np.testing.assert_allclose(first[:, 16, 24, 0], [0, 10, 20, 30, 40], atol=3)
    assert env.env.closed


def test_info_strip_is_thin_and_drawn_on_each_tile(tmp_path):
    plain = VideoRecorder(GradientEnv(2, (224, 224)), tmp_path / "plain", info_on_video=False)
    info = VideoRecorder(GradientEnv(2, (224, 224)), tmp_path / "info", info_on_video=True)
    for env in (plain, info):
        env.reset()
        env.chunk_step(np.zeros((2, 3, 1)))
        env.close()
    a, b = read(plain.paths[0]).astype(int), read(info.paths[0]).astype(int)
    strip = strip_height(224)
    assert strip / 224 < 0.06
    for x in (0, 224):  # yellow text in the strip at the top of both tiles
        assert (b[:, :strip, x:x + 100, 0] > 150).mean() > 0.05
    assert not (a[..., 0] > 150).any()
    assert np.abs(a[:, strip + 4:] - b[:, strip + 4:]).mean() < 0.5  # the rest of the image unchanged


class SteppedEnv(GradientEnv):
    """Gives every step's image (``STEP_FRAMES``): env i's gray is 40 * i + 5 * step; env 1's
    episode ends at step 2 (without auto-reset it idles)."""

    def __init__(self, num_envs):
        super().__init__(num_envs)
        self.steps = 0
        self.reset_state_names = [f"state{i}" for i in range(num_envs)]
        self.extra_episodes = np.zeros(num_envs, bool)

    def _image(self):
        gray = (40 * np.arange(self.num_envs) + 5 * self.steps) % 256
        return np.broadcast_to(gray[:, None, None, None], (self.num_envs, *self.size, 3)).astype(np.uint8)

    def reset(self, reset_state_ids=None):
        self.steps = 0
        return {"main_images": self._image(), "task_descriptions": ["reach"] * self.num_envs}

    def chunk_step(self, actions):
        b, c = actions.shape[:2]
        frames = []
        for _ in range(c):
            self.steps += 1
            frames.append(self._image())
        lengths = np.full(b, self.steps)
        lengths[1] = min(self.steps, 2)
        done = np.zeros(b, bool)
        done[1] = self.steps - c < 2 <= self.steps
        obs = {"main_images": frames[-1], "task_descriptions": ["reach"] * b,
               STEP_FRAMES: {"main_images": np.stack(frames, 1)}}
        infos = {"success": np.zeros(b, bool), "episode_length": lengths, "done": done}
        none = np.zeros((b, c), bool)
        return obs, np.ones((b, c), np.float32), none, none.copy(), infos


def test_one_frame_per_env_step_with_step_frames(tmp_path):
    with VideoRecorder(SteppedEnv(2), tmp_path, info_on_video=False, name="eval") as env:
        env.reset()
        for _ in range(2):
            obs, *_ = env.chunk_step(np.zeros((2, 3, 1)))
            assert STEP_FRAMES not in obs  # only the recorder reads them
    frames = read(env.paths[0])
    assert frames.shape == (7, 32, 96, 3)  # the reset and 2 chunks x 3 steps
    np.testing.assert_allclose(frames[:, 16, 24, 0], 5 * np.arange(7), atol=3)


def test_a_per_episode_file_ends_at_the_episodes_last_step(tmp_path):
    with VideoRecorder(SteppedEnv(2), tmp_path, info_on_video=False, name="eval", per_episode=True) as env:
        env.reset()
        env.chunk_step(np.zeros((2, 3, 1)))
    first, second = (read(p) for p in env.paths)
    assert first.shape[0] == 4 and second.shape[0] == 3  # env 1 ended after its second step
    np.testing.assert_allclose(second[:, 16, 24, 0], 40 + 5 * np.arange(3), atol=3)


def test_files_appear_whole_and_never_overwrite(tmp_path):
    env = VideoRecorder(GradientEnv(1), tmp_path, name="eval")
    env.reset()
    env.chunk_step(np.zeros((1, 2, 1)))
    assert not list(tmp_path.glob("*.mp4"))  # no .mp4 until whole
    env.close()
    again = VideoRecorder(GradientEnv(1), tmp_path, name="eval")  # a rerun into the same folder
    again.reset()
    again.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval_0000.mp4", "eval_0001.mp4"]
    assert read(tmp_path / "eval_0000.mp4").shape[0] == 2


def test_a_killed_run_leaves_no_mp4_and_the_next_removes_its_partial_file(tmp_path):
    script = GRADIENT_ENV + textwrap.dedent(f'''
        import sys
        from envs.video import VideoRecorder
        env = VideoRecorder(GradientEnv(1), {str(tmp_path)!r}, name="eval")
        env.reset()
        for _ in range(60):  # enough frames for ffmpeg to have written part of the file
            env.chunk_step(np.zeros((1, 1, 1)))
        print("recording", flush=True)
        sys.stdin.read()
    ''')
    run = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           text=True, env={"PYTHONPATH": str(ROOT), "PATH": os.environ["PATH"]})
    assert run.stdout.readline() == "recording\n"
    os.kill(run.pid, signal.SIGKILL)
    run.wait(timeout=30)
    time.sleep(0.5)  # ffmpeg ends on its closed input
    assert [p.name for p in tmp_path.iterdir()] == [".eval_0000.mp4.partial"]
    env = VideoRecorder(GradientEnv(1), tmp_path, name="eval")
    env.reset()
    env.close()
    assert [p.name for p in tmp_path.iterdir()] == ["eval_0000.mp4"]


def test_exception_inside_a_step_leaves_a_playable_file(tmp_path):
    env = VideoRecorder(GradientEnv(3, fail_at=3), tmp_path)
    env.reset()
    env.chunk_step(np.zeros((3, 2, 1)))
    env.chunk_step(np.zeros((3, 2, 1)))
    with pytest.raises(RuntimeError, match="simulator failed"):
        env.chunk_step(np.zeros((3, 2, 1)))
    assert read(env.paths[0]).shape == (3, 64, 96, 3)


def test_run_that_dies_with_an_exception_leaves_a_playable_file(tmp_path):
    script = GRADIENT_ENV + textwrap.dedent(f'''
        from envs.video import VideoRecorder
        env = VideoRecorder(GradientEnv(4), {str(tmp_path)!r})
        env.reset()
        for _ in range(6):
            env.chunk_step(np.zeros((4, 2, 1)))
        raise SystemError("the run failed outside the env")
    ''')
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 1 and "the run failed outside the env" in run.stderr
    assert read(tmp_path / "envs_0000.mp4").shape == (7, 64, 96, 3)


def test_scene_renders_of_an_env_without_cameras_are_recorded_and_not_passed_on(tmp_path):
    class RenderedEnv(GradientEnv):
        """States only, plus renders of the scene for the recorder; every episode ends in chunk 1."""

        def _obs(self):
            obs = super()._obs()
            return {"states": np.zeros((self.num_envs, 3), np.float32), RENDER_IMAGES: obs["main_images"],
                    "task_descriptions": obs["task_descriptions"]}

        def chunk_step(self, actions):
            obs, rewards, terminations, truncations, infos = super().chunk_step(actions)
            infos["done"][:] = True
            infos["final_obs"] = self._obs()
            return obs, rewards, terminations, truncations, infos

    with VideoRecorder(RenderedEnv(2), tmp_path, info_on_video=False) as env:
        obs = env.reset()
        steps = [env.chunk_step(np.zeros((2, 3, 1))) for _ in range(2)]
    assert set(obs) == set(steps[-1][0]) == set(steps[-1][4]["final_obs"]) == {"states", "task_descriptions"}
    frames = read(env.paths[0])
    assert frames.shape == (3, 32, 96, 3)
    np.testing.assert_allclose(frames[:, 16, 72, 0], [40, 50, 60], atol=3)


def test_state_only_env_is_refused_clearly(tmp_path):
    class StateEnv(GradientEnv):
        def _obs(self):
            return {"states": np.zeros((self.num_envs, 3), np.float32)}

    with pytest.raises(EnvSetupError, match="save_video needs camera observations"):
        VideoRecorder(StateEnv(1), tmp_path).reset()
