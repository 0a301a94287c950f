"""Visual meshes with fewer triangles, for cameras rendered on the CPU.

On lavapipe (Vulkan on the CPU) a frame costs what its triangles cost, nearly whatever the image
size: ManiSkill's Panda draws 135k of them, 22 ms of a 25 ms frame at 64 px. Quadric edge
collapse (``fast-simplification``) brings each mesh under a cap when the scene is built; at 2,000
a 64 px frame takes 6 ms and 0.3 % of its pixels change by more than 16/255 (benchmarks/README.md,
"rgb ManiSkill env steps/s"). Textured meshes (ManiSkill's floor) are kept: simplification
keeps no texture coordinates. Collision shapes are untouched, so the physics is the same.
"""

from __future__ import annotations

from typing import Any

import fast_simplification
import numpy as np
from sapien.render import RenderBodyComponent, RenderShapeTriangleMesh

# simplified parts by (mesh file, part, cap): every scene of a process loads the same robot
_CACHE: dict[tuple[str, int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}


def _weld(vertices: np.ndarray, triangles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One vertex per position: asset meshes split vertices along normal and UV seams, which
    would leave the simplification open borders it cannot collapse."""
    key = np.round(vertices / 1e-6).astype(np.int64)
    _, first, inverse = np.unique(key, axis=0, return_index=True, return_inverse=True)
    return vertices[first], inverse.reshape(-1)[triangles]


def _normals(vertices: np.ndarray, triangles: np.ndarray) -> np.ndarray:
    """Smooth vertex normals, area-weighted (the face normals' sums)."""
    corners = vertices[triangles]
    face = np.cross(corners[:, 1] - corners[:, 0], corners[:, 2] - corners[:, 0])
    normals = np.zeros_like(vertices)
    for k in range(3):
        np.add.at(normals, triangles[:, k], face)
    return (normals / np.maximum(np.linalg.norm(normals, axis=1, keepdims=True), 1e-12)).astype(np.float32)


def _simplified(part: Any, target: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    vertices, triangles = _weld(part.vertices.astype(np.float64), part.triangles.astype(np.int64))
    if len(triangles) > target:
        vertices, triangles = fast_simplification.simplify(vertices, triangles, target_count=target)
    vertices = vertices.astype(np.float32)
    return vertices, triangles.astype(np.uint32), _normals(vertices, triangles)


def _shapes(shape: RenderShapeTriangleMesh, cap: int) -> list[RenderShapeTriangleMesh]:
    """``shape`` as one simplified shape per part, each part's share of ``cap`` in proportion to
    its triangles, placed and scaled as the original."""
    parts = shape.parts
    total = sum(len(p.triangles) for p in parts)
    out = []
    for i, part in enumerate(parts):
        target = max(4, cap * len(part.triangles) // total)
        key = (shape.filename, i, target)
        made = _CACHE.get(key) if shape.filename else None
        if made is None:
            made = _simplified(part, target)
            if shape.filename:
                _CACHE[key] = made
        vertices, triangles, normals = made
        new = RenderShapeTriangleMesh(vertices, triangles, normals, np.zeros((len(vertices), 2), np.float32),
                                      part.material)
        new.local_pose, new.scale, new.front_face = shape.local_pose, shape.scale, shape.front_face
        out.append(new)
    return out


def simplify_visual_meshes(scenes: list[Any], cap: int) -> None:
    """Replace every untextured visual mesh of ``scenes`` (SAPIEN scenes) that has more than
    ``cap`` triangles by a simplified one."""
    for scene in scenes:
        for entity in scene.entities:
            body = entity.find_component_by_type(RenderBodyComponent)
            if body is None:
                continue
            shapes, changed = [], False
            for shape in body.render_shapes:
                if (isinstance(shape, RenderShapeTriangleMesh)
                        and sum(len(p.triangles) for p in shape.parts) > cap
                        and all(p.material.base_color_texture is None for p in shape.parts)):
                    shapes += _shapes(shape, cap)
                    changed = True
                else:
                    shapes.append(shape)
            if changed:
                new = RenderBodyComponent()
                for shape in shapes:
                    new.attach(shape)
                new.visibility = body.visibility
                entity.remove_component(body)
                entity.add_component(new)
