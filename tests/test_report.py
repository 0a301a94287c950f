"""The eval report (embodied/report.py): written by a real ``embodied-eval`` on ManiSkill, then
opened in a real headless browser (Debian's Chromium through its WebDriver, installed by
scripts/setup_browser.sh): the table, one video per episode, a video that plays; a screenshot is
kept beside the report in the test's folder."""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import imageio
import numpy as np
import pytest

from embodied import report
from tests.runs import ONE_RANK_EACH, embodied
from tests.test_pipeline import TASK, tiny


def mp4(path: Path, frames: int = 5) -> Path:
    imageio.mimwrite(path, np.full((frames, 32, 32, 3), 90, np.uint8), fps=10, macro_block_size=16)
    return path


def episode(path: Path, success: bool | None, state: str = "task000_init00_t") -> dict:
    return {"video": str(path), "reset_state": None if success is None else state,
            "task": None if success is None else "pick", "length": None if success is None else 5,
            "success": success}


def test_failures_come_first_and_large_sets_are_linked(tmp_path, monkeypatch):
    videos = [episode(mp4(tmp_path / "a_pass.mp4"), True), episode(mp4(tmp_path / "b_tiled.mp4"), None),
              episode(mp4(tmp_path / "c_fail.mp4"), False, "task000_init07_t")]
    args = dict(step=3, source="ckpt", success=0.5, episodes=2, tasks={"pick": {"success": 0.5, "episodes": 2}},
                videos=videos, config_yaml="runner:\n  seed: 1 <&>\n")
    page = report.write_eval_report(tmp_path / "logs", **args).read_text()
    assert re.findall(r"<figure class='(\w*)'", page) == ["fail", "", "pass"]
    assert page.count("src='data:video/mp4;base64,") == 3 and "task000_init07_t, 5 steps" in page
    assert "seed: 1 &lt;&amp;&gt;" in page and "<td class='num'>50.0%</td>" in page

    monkeypatch.setattr(report, "EMBED_LIMIT", 0)  # too large to embed: linked relative to the page
    page = report.write_eval_report(tmp_path / "logs", **args).read_text()
    assert "src='../c_fail.mp4'" in page and "base64" not in page
    assert [p.name for p in (tmp_path / "logs").iterdir()] == ["eval_report_step3.html"]  # no partial file left


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session")
def test_eval_report_opens_and_plays_in_a_headless_browser(tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    assert chromium and driver_path, "Chromium and chromedriver missing: run scripts/setup_browser.sh"
    embodied("train", tiny(tmp_path, placement=ONE_RANK_EACH) + ["runner.max_epochs=1"])
    result, done = embodied("eval", tiny(tmp_path, placement=ONE_RANK_EACH) + [
        f"runner.ckpt_path={tmp_path / 'tiny' / 'checkpoints'}", "env.eval.video_cfg.save_video=true",
        "env.eval.video_cfg.per_episode=true"])
    page = Path(result["report"])
    assert page == tmp_path / "tiny" / "eval_report_step1.html" and f"eval report: {page}" in done.stdout

    options = Options()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--autoplay-policy=no-user-gesture-required",
                 "--window-size=1280,1600"):
        options.add_argument(flag)
    browser = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        browser.get(page.as_uri())
        rows = [r.text for r in browser.find_elements("css selector", "table.tasks tbody tr")]
        assert rows == [f"{TASK} 4 {result['eval_success']:.1%}"]
        assert len(browser.find_elements("css selector", "svg.chart rect")) == 2  # a track and a bar
        figures = browser.find_elements("css selector", "figure")
        assert len(figures) == 4  # one video per episode
        outcomes = [f.get_attribute("class") for f in figures]
        assert outcomes == sorted(outcomes)  # "fail" < "pass": failures first
        assert all(re.search(r"state\d+, 10 steps", f.text) for f in figures)
        browser.execute_script("arguments[0].play()", browser.find_element("css selector", "video"))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            state = browser.execute_script(
                "const v = document.querySelector('video');"
                "return {t: v.currentTime, w: v.videoWidth, ready: v.readyState, error: v.error && v.error.code};")
            if state["t"] > 0.2:
                break
            time.sleep(0.2)
        assert state["error"] is None and state["w"] > 0 and state["t"] > 0.2, state  # decoded and playing
        browser.save_screenshot(str(tmp_path / "eval_report.png"))
    finally:
        browser.quit()
    assert (tmp_path / "eval_report.png").stat().st_size > 10_000
    print(f"screenshot: {tmp_path / 'eval_report.png'}")
