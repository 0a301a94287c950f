"""SAPIEN's BRDF lookup table, computed once per machine instead of once per process.

Before a process's first camera picture, SAPIEN's renderer computes a 512 x 512 split-sum BRDF
table (a compute shader, 1024 samples a texel) unless the camera was given one. On lavapipe, the
CPU Vulkan device, that takes about 10 CPU-seconds: more than building the scene and rendering an
episode, paid again by every env subprocess with cameras or a video. The table depends only on
SAPIEN and the driver, so ``ensure`` has it computed once and read back texel for texel (in a
process of its own: a copy of SAPIEN's minimal shader pack whose last pass draws the table into a
float picture), stored under ``~/.cache/embodied-rl``; ``install`` hands the stored table to
every camera before its pictures, and SAPIEN then uses it instead of computing its own. The
texels are the ones SAPIEN computes, so the pictures are too (tests/test_sapien_lut.py).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from core.cache import cache_dir

SIZE = 512  # svulkan2's default table
TEXTURE = "BRDFLUT"  # the shaders' samplerBRDFLUT: SAPIEN computes it when a camera has none
_table: list[Any] = []  # this process's texture, made at the first picture (after SAPIEN's device)


def path() -> Path:
    """The stored table of this SAPIEN and this Vulkan driver (``VK_ICD_FILENAMES``'s library)."""
    icd = (os.environ.get("VK_ICD_FILENAMES") or os.environ.get("VK_DRIVER_FILES") or "").split(os.pathsep)[0]
    try:
        library = Path(json.loads(Path(icd).read_text())["ICD"]["library_path"])
        driver = f"{library}|{library.stat().st_size}|{library.stat().st_mtime_ns}"
    except (OSError, KeyError, ValueError):
        driver = icd
    key = hashlib.sha256(f"{importlib.metadata.version('sapien')}|{driver}".encode()).hexdigest()[:16]
    return cache_dir() / f"sapien_brdf_lut-{key}.npy"


def ensure() -> Path | None:
    """The stored table, computed first if missing (a subprocess, about 10 CPU-seconds, once per
    machine; processes asking at once wait for one computation). None, with a warning, when it
    cannot be made: SAPIEN then computes its own in every process, as without the store."""
    stored = path()
    if stored.is_file():
        return stored
    try:
        stored.parent.mkdir(parents=True, exist_ok=True)
        with open(stored.parent / "sapien_brdf_lut.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not stored.is_file():
                fd, tmp = tempfile.mkstemp(dir=stored.parent, suffix=".npy")
                os.close(fd)
                done = subprocess.run([sys.executable, "-m", "envs.sapien_lut", tmp], capture_output=True, text=True,
                                      timeout=600)
                if done.returncode != 0:
                    os.unlink(tmp)
                    raise RuntimeError(done.stderr.strip()[-500:])
                os.replace(tmp, stored)
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        warnings.warn(f"SAPIEN's BRDF table could not be stored in {stored.parent}, so every process with "
                      f"cameras computes its own (about 10 CPU-seconds on a CPU device): {err}", stacklevel=2)
        return None
    return stored


def install() -> None:
    """Give every SAPIEN camera of this process the stored table before each picture (setting it
    is a map entry in the renderer; SAPIEN reads it at the camera's first picture). Without a
    stored table cameras are left as they are."""
    from sapien import render

    take_picture = render.RenderCameraComponent.take_picture
    if getattr(take_picture, "stored_table", False):
        return

    def take_picture_with_stored_table(camera: Any) -> None:
        if not _table:
            stored = path()
            _table.append(render.RenderTexture(np.load(stored), 2, "r16g16sfloat", 1, "linear", "edge", False)
                          if stored.is_file() else None)
        if _table[0] is not None:
            camera.set_texture(TEXTURE, _table[0])
        take_picture(camera)

    take_picture_with_stored_table.stored_table = True  # type: ignore[attr-defined]
    render.RenderCameraComponent.take_picture = take_picture_with_stored_table


def compute(out: Path) -> None:
    """Have SAPIEN compute its table and read it back exactly: a copy of its minimal shader pack
    whose last pass outputs the table at the texel centres of a picture of the table's size, in
    32-bit floats. Changes SAPIEN's shader folder and picture format for the whole process, so
    it runs in one of its own (``python -m envs.sapien_lut OUT``, started by ``ensure`` from a
    process whose Vulkan driver envs/maniskill.py chose: the subprocess inherits the choice)."""
    import sapien
    from sapien import render

    shaders = Path(sapien.__file__).parent / "vulkan_shader"
    with tempfile.TemporaryDirectory() as tmp:
        pack = Path(tmp) / "minimal"
        shutil.copytree(shaders / "minimal", pack)
        shutil.copytree(shaders / "common", Path(tmp) / "common")  # the pack's #include "../common/..."
        last = pack / "composite0.frag"
        source = last.read_text()
        last.write_text(source[:source.index("void main()")]
                        + "void main() {\n  outColor = vec4(texture(samplerBRDFLUT, inUV).xy, 0, 1);\n}\n")
        render.set_camera_shader_dir(str(pack))
        render.set_picture_format("Color", "r32g32b32a32sfloat")
        scene = sapien.Scene()
        camera = scene.add_camera("brdf_lut", SIZE, SIZE, 1.0, 0.01, 10.0)
        scene.update_render()
        camera.take_picture()
        texels = np.ascontiguousarray(camera.get_picture("Color")[..., :2])
    table = texels.astype(np.float16)
    if not np.array_equal(table.astype(np.float32), texels):
        raise RuntimeError("the picture does not hold the table's 16-bit texels")
    # rows are cos(view angle), columns roughness: a smooth surface seen head-on reflects all
    if abs(float(table[-1, 0, 0]) - 1.0) > 0.01 or float(table[-1, 0, 1]) > 0.01:
        raise RuntimeError(f"the table's smooth head-on texel is {table[-1, 0]}, not (1, 0)")
    with open(out, "wb") as file:
        np.save(file, table)


if __name__ == "__main__":
    compute(Path(sys.argv[1]))
