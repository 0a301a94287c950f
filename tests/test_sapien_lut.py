"""SAPIEN's BRDF table stored once per machine (envs/sapien_lut.py): the stored texels are the
split-sum integral SAPIEN's shader computes, cameras given them draw exactly the pictures SAPIEN
draws with its own, and they do use them; without a store SAPIEN computes its own, as before.
Each rendering runs in a fresh process (SAPIEN keeps its table for the life of a process), with
the store in a folder of the test's own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from envs import sapien_lut

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
NO_STORE = "/dev/null/cache"  # not a folder: ensure() warns and SAPIEN computes its own table

# Shiny spheres of three roughnesses under an environment map, the one light term that reads the
# table (ManiSkill's scenes have no environment map: their pictures do not depend on it)
SPHERES = """
import sys
from pathlib import Path
import numpy as np
import imageio.v3 as iio
from envs import maniskill_scene  # chooses the Vulkan driver; its cameras take the stored table
import sapien

faces = []
for i, name in enumerate(["px", "nx", "py", "ny", "pz", "nz"]):
    face = np.zeros((16, 16, 3), np.uint8)
    face[..., i % 3], face[:8, :, (i + 1) % 3] = 60 + 30 * i, 200
    faces.append(Path(sys.argv[1]).with_name(f"{name}.png"))
    iio.imwrite(faces[-1], face)
scene = sapien.Scene()
scene.set_environment_map(sapien.render.RenderCubemap(*map(str, faces)))
scene.add_directional_light([0, 1, -1], [1, 1, 1])
spheres = scene.create_actor_builder()
for i, roughness in enumerate([0.1, 0.4, 0.8]):
    spheres.add_sphere_visual(sapien.Pose([0, 0.5 * (i - 1), 0]), radius=0.2, material=sapien.render.RenderMaterial(
        base_color=[0.8, 0.8, 0.8, 1], roughness=roughness, metallic=1.0))
spheres.build_kinematic()
camera = scene.add_camera("camera", 96, 64, 1.0, 0.01, 10.0)
camera.entity.set_pose(sapien.Pose([-1.5, 0, 0]))
scene.update_render()
camera.take_picture()
np.save(sys.argv[1], camera.get_picture("Color"))
"""


def run(code: str, cache: str | Path, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "XDG_CACHE_HOME": str(cache)})
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def pictures(tmp_path: Path, name: str, cache: str | Path) -> np.ndarray:
    (tmp_path / name).mkdir()
    run(SPHERES, cache, str(tmp_path / name / "color.npy"))
    return np.load(tmp_path / name / "color.npy")


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """The table in a cache folder of its own, stored by the first ManiSkill env with cameras."""
    cache = tmp_path_factory.mktemp("cache")
    run("from embodied.config import load_env_config\n"
        "from envs import make_vector_env\n"
        "make_vector_env(load_env_config('maniskill_push_cube', ['init_params.obs_mode=rgb']), num_envs=1).close()",
        cache)
    stored = sorted((cache / "embodied-rl").glob("sapien_brdf_lut-*.npy"))
    assert len(stored) == 1
    return stored[0]


def radical_inverse(i: np.ndarray) -> np.ndarray:
    """Van der Corput: the bits of ``i`` mirrored after the binary point."""
    bits = i.astype(np.uint64)
    value = np.zeros(i.shape)
    for b in range(32):
        value += ((bits >> b) & 1) * 2.0 ** -(b + 1)
    return value


def split_sum(roughness: float, cos_view: float, samples: int = 1024) -> np.ndarray:
    """Karis' split-sum environment BRDF (scale, bias) by GGX importance sampling over a
    Hammersley set, in float64, with SAPIEN's geometry term (Schlick-GGX, k = (roughness / 2)^2,
    the dot(N, V) of the visibility term cancelled)."""
    i = np.arange(samples)
    u, v = i / samples, radical_inverse(i)
    a = roughness**2
    phi = 2 * np.pi * u
    cos_h = np.sqrt((1 - v) / (1 + (a * a - 1) * v))
    sin_h = np.sqrt(1 - cos_h**2)
    # the normal is +z, whose tangent frame (from the x axis) takes H's x to -y and its y to x
    h = np.stack([sin_h * np.sin(phi), -sin_h * np.cos(phi), cos_h], axis=1)
    view = np.array([np.sqrt(1 - cos_view**2), 0.0, cos_view])
    vh = h @ view
    light = 2 * vh[:, None] * h - view
    nl, nh, vh = np.maximum(light[:, 2], 0), np.maximum(h[:, 2], 0), np.maximum(vh, 0)
    k = (roughness / 2) ** 2
    lit = nl > 0
    g_vis = nl / ((cos_view * (1 - k) + k) * (nl * (1 - k) + k)) * vh / nh
    fresnel = (1 - vh) ** 5
    return np.array([np.sum(((1 - fresnel) * g_vis)[lit]), np.sum((fresnel * g_vis)[lit])]) / samples


def test_the_stored_table_is_the_split_sum_brdf_integral(store):
    table = np.load(store)
    assert table.dtype == np.float16 and table.shape == (sapien_lut.SIZE, sapien_lut.SIZE, 2)
    rng = np.random.default_rng(0)
    for row, col in rng.integers(0, sapien_lut.SIZE, (100, 2)):  # rows: cos(view angle), columns: roughness
        expected = split_sum((col + 0.5) / sapien_lut.SIZE, (row + 0.5) / sapien_lut.SIZE)
        np.testing.assert_allclose(table[row, col], expected, rtol=1e-3, atol=1e-4, err_msg=f"texel {row, col}")


def test_cameras_draw_with_the_stored_table_exactly_what_they_draw_with_sapiens_own(store, tmp_path):
    ours = pictures(tmp_path, "stored", store.parent.parent)
    own = pictures(tmp_path, "own", NO_STORE)
    assert ours.shape == (64, 96, 4) and ours[..., :3].std() > 0.1
    np.testing.assert_array_equal(ours, own)  # 32-bit floats, bit for bit

    # and they take it from the store: a table of other texels draws other pictures
    doctored = tmp_path / "doctored" / "embodied-rl"
    doctored.mkdir(parents=True)
    np.save(doctored / store.name, np.load(store)[::-1].copy())
    assert not np.array_equal(pictures(tmp_path, "other", doctored.parent), ours)


def test_a_store_that_cannot_be_made_leaves_sapien_computing_its_own(monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", NO_STORE)
    with pytest.warns(UserWarning, match="SAPIEN's BRDF table could not be stored in /dev/null/cache/embodied-rl, so "
                                         "every process with cameras computes its own"):
        assert sapien_lut.ensure() is None
