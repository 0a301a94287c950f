"""The eval report: one HTML page per ``embodied-eval`` in the run's log folder
(``eval_report_step<step>.html``), for a person rather than a script (the JSON line is for those).

It holds the success per task (a table and a bar chart), the checkpoint and the resolved config,
and every recorded episode's video (``env.eval.video_cfg``), failures first, each named by its
task and reset state (e.g. LIBERO's init state). The page needs nothing else: styles and the chart
are inline, and the videos are embedded in it when they add up to at most ``EMBED_LIMIT`` bytes;
larger sets are linked by their path relative to the page (by default under the same log folder).
"""

from __future__ import annotations

import base64
import html
import os
import time
from pathlib import Path
from typing import Any

EMBED_LIMIT = 64 * 2**20

STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1200px; color: #222; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 28px; }
.meta { color: #555; } .meta code { background: #f3f3f3; padding: 1px 4px; }
table { border-collapse: collapse; } td, th { padding: 3px 12px; border-bottom: 1px solid #e3e3e3; text-align: left; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
.episodes { display: grid; grid-template-columns: repeat(auto-fill, minmax(280px, 1fr)); gap: 14px; }
figure { margin: 0; border: 1px solid #ddd; border-radius: 6px; padding: 8px; }
figure.fail { border-color: #d9534f; } figure.pass { border-color: #4cae4c; }
figure video { width: 100%; background: #000; } figcaption { font-size: 12px; word-break: break-word; }
.badge { font-weight: 600; } .fail .badge { color: #c9302c; } .pass .badge { color: #3d8b3d; }
pre { background: #f6f6f6; padding: 10px; overflow: auto; max-height: 480px; }
"""


def write_eval_report(folder: str | Path, *, step: int, source: str | None, success: float, episodes: int,
                      tasks: dict[str, dict[str, float]], videos: list[dict[str, Any]], config_yaml: str) -> Path:
    """Write the page (atomically: a reader never sees half of it) and return its path.
    ``tasks``: ``{task: {"success", "episodes"}}``; ``videos``: ``VideoRecorder.pop_episodes``
    records."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"eval_report_step{step}.html"
    rows = tasks or {"all episodes": {"success": success, "episodes": episodes}}
    embed = sum(os.path.getsize(v["video"]) for v in videos if os.path.exists(v["video"])) <= EMBED_LIMIT
    # failures first, then files of all envs tiled (success unknown), then successes
    ordered = sorted(videos, key=lambda v: ({False: 0, None: 1, True: 2}[v["success"]], v["task"] or "",
                                            v["reset_state"] or "", v["video"]))
    failed = sum(v["success"] is False for v in videos)
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>Eval: {html.escape(str(source))} step {step}</title><style>{STYLE}</style></head><body>",
        f"<h1>Eval success {success:.1%} over {episodes} episodes</h1>",
        f"<p class='meta'>Checkpoint <code>{html.escape(str(source))}</code>, step {step}; written "
        f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}.</p>",
        "<h2>Success per task</h2>", _chart(rows), _table(rows),
        f"<h2>Episodes ({len(videos)} recorded, {failed} failed)</h2>",
        "<p class='meta'>No videos were recorded: set <code>env.eval.video_cfg.save_video=true</code> "
        "(and <code>per_episode=true</code> for one file per episode).</p>" if not videos else
        "<div class='episodes'>" + "".join(_episode(v, folder, embed) for v in ordered) + "</div>",
        "<h2>Config</h2><details><summary>resolved config of this evaluation</summary>",
        f"<pre>{html.escape(config_yaml)}</pre></details></body></html>",
    ]
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text("\n".join(parts))
    partial.replace(path)
    return path


def _chart(rows: dict[str, dict[str, float]]) -> str:
    """Horizontal bars, one per task, as inline SVG."""
    bar, label, width = 18, 360, 300
    height = bar * len(rows) + 24
    items = []
    for i, (task, t) in enumerate(rows.items()):
        y = 4 + i * bar
        items.append(f"<text x='{label - 6}' y='{y + 13}' text-anchor='end' font-size='12'>"
                     f"{html.escape(_short(task))}</text>"
                     f"<rect x='{label}' y='{y + 2}' width='{width}' height='{bar - 4}' fill='#eee'/>"
                     f"<rect x='{label}' y='{y + 2}' width='{width * t['success']:.1f}' height='{bar - 4}' fill='#4a90d9'/>"
                     f"<text x='{label + width + 6}' y='{y + 13}' font-size='12'>{t['success']:.0%}</text>")
    return (f"<svg class='chart' width='{label + width + 50}' height='{height}' role='img' "
            f"aria-label='success per task'>{''.join(items)}</svg>")


def _table(rows: dict[str, dict[str, float]]) -> str:
    body = "".join(f"<tr><td>{html.escape(task)}</td><td class='num'>{int(t['episodes'])}</td>"
                   f"<td class='num'>{t['success']:.1%}</td></tr>" for task, t in rows.items())
    return ("<table class='tasks'><thead><tr><th>task</th><th class='num'>episodes</th>"
            f"<th class='num'>success</th></tr></thead><tbody>{body}</tbody></table>")


def _episode(video: dict[str, Any], folder: Path, embed: bool) -> str:
    name = Path(video["video"]).name
    if embed:
        src = "data:video/mp4;base64," + base64.b64encode(Path(video["video"]).read_bytes()).decode()
    else:
        src = html.escape(os.path.relpath(video["video"], folder))
    if video["success"] is None:
        kind, caption = "", f"<span class='badge'>all envs</span> {html.escape(name)}"
    else:
        kind = "pass" if video["success"] else "fail"
        caption = (f"<span class='badge'>{'success' if video['success'] else 'failure'}</span> "
                   f"{html.escape(video['task'] or '')}<br>{html.escape(video['reset_state'] or '')}, "
                   f"{video['length']} steps<br><small>{html.escape(name)}</small>")
    return (f"<figure class='{kind}'><video controls muted loop preload='metadata' src='{src}'></video>"
            f"<figcaption>{caption}</figcaption></figure>")


def _short(text: str, limit: int = 56) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "\u2026"
