"""What a learner's first minute in ``make lab`` shows, in a real Chromium.

``make lab`` serves the checkout's root, opens ``notebooks/README.md`` (the learner's
index) as a rendered Markdown page, and starts JupyterLab with the grading interface
switched off (``JUPYTER_CONFIG_PATH=scripts/lab/learner``); ``INSTRUCTOR=1`` keeps it.
This test starts JupyterLab with the Makefile's own arguments over a copy of the
checkout's ``notebooks/`` and ``exercises/`` (so nothing of the checkout is touched) and
checks, as a learner sees it: the index renders at the default URL, ``exercises/`` is
reachable from the same root and its README renders, no Nbgrader menu, no warning at
start-up. The instructor's start, with the Nbgrader menu, is the same test's contrast:
it proves the menu check can fail. About 30 s (two JupyterLab starts).

Gated like ``tests/test_browser.py`` (``PAGEDKV_BROWSER``, Debian's ``chromium``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from test_browser import CHROMIUM, FLAGS, _free_port, _gate, wait_until_serving

ROOT = Path(__file__).resolve().parents[1]
LEARNER_CONFIG = ROOT / "scripts" / "lab" / "learner"


def _make_lab_arguments() -> tuple[str, str]:
    """``(root_dir, default_url)`` as the Makefile's ``lab`` target passes them."""
    recipe = (ROOT / "Makefile").read_text().split("\nlab:", 1)[1].split("\n\n", 1)[0]
    root = re.search(r"--ServerApp\.root_dir=(\S+)", recipe).group(1)
    url = re.search(r"--LabApp\.default_url=(\S+)", recipe).group(1)
    return root, url


@contextmanager
def _lab(instructor: bool):
    """JupyterLab started as ``make lab`` (``INSTRUCTOR=1`` with ``instructor``) over a copy
    of the checkout's learner folders; yields ``(url, start-up log text)``."""
    root_arg, default_url = _make_lab_arguments()
    assert root_arg == "$(CURDIR)", f"make lab serves {root_arg}, not the checkout's root"
    work = Path(tempfile.mkdtemp(prefix="pagedkv-lab-root-"))
    root = work / "checkout"
    for folder in ("notebooks", "exercises"):
        shutil.copytree(ROOT / folder, root / folder, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    (work / "app-settings").mkdir()
    shutil.copy(ROOT / "scripts" / "lab" / "overrides.json", work / "app-settings" / "overrides.json")
    env = dict(
        os.environ,
        JUPYTER_CONFIG_DIR=str(work / "config"),
        JUPYTER_DATA_DIR=str(work / "data"),
        JUPYTER_RUNTIME_DIR=str(work / "runtime"),
        JUPYTER_PLATFORM_DIRS="1",
    )
    env.pop("JUPYTER_CONFIG_PATH", None)
    if not instructor:
        env["JUPYTER_CONFIG_PATH"] = str(LEARNER_CONFIG)
    port = _free_port()
    log_path = work / "lab.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--KernelManager.transport_encryption=auto",
             "--allow-root", f"--ServerApp.root_dir={root}", f"--LabApp.default_url={default_url}",
             "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--IdentityProvider.token=",
             "--ServerApp.password=", "--LabApp.news_url=", f"--LabApp.app_settings_dir={work / 'app-settings'}",
             "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
             f"--LabApp.workspaces_dir={work / 'workspaces'}"],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until_serving(proc, url, log_path)
            yield url, log_path
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
    shutil.rmtree(work, ignore_errors=True)


def _first_screen(url: str) -> tuple[str, str, str]:
    """``(index text, exercises README text, menu bar text)`` as Chromium renders them."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(f"{url}/", timeout=120_000)  # the default URL: the learner's index
        index = page.wait_for_selector(".jp-RenderedMarkdown h1", timeout=120_000).inner_text()
        menus = page.locator(".lm-MenuBar-content").inner_text()
        page.goto(f"{url}/lab/tree/exercises/README.md", timeout=120_000)
        page.wait_for_function(
            "() => [...document.querySelectorAll('.jp-RenderedMarkdown h1')].some(h => /Exercises/.test(h.innerText))",
            timeout=120_000,
        )
        exercises = page.locator(".jp-RenderedMarkdown h1").all_inner_texts()
        browser.close()
    return index, " | ".join(exercises), menus


def test_make_lab_opens_the_learners_index_with_the_exercises_reachable_and_no_grading_interface():
    _gate()
    with _lab(instructor=False) as (url, log):
        index, exercises, menus = _first_screen(url)
        listing = urllib.request.urlopen(f"{url}/api/contents/exercises", timeout=10).read().decode()
        started = log.read_text()
    assert "learner's path" in index, f"the default URL did not render notebooks/README.md: {index!r}"
    assert "Exercises" in exercises, f"exercises/README.md did not render from the same root: {exercises!r}"
    assert "09_prealloc_cache.ipynb" in listing, "exercises/ is not reachable from make lab's root"
    assert "Nbgrader" not in menus, f"a learner's JupyterLab shows the grading menu: {menus!r}"
    # The one warning expected: this test's server has no token (make lab's has one).
    warnings = [w for w in re.findall(r"^\[W .*$", started, re.M) if "authentication is disabled" not in w]
    assert not warnings and "nbgrader" not in started.lower(), f"warnings at start-up: {warnings}"

    with _lab(instructor=True) as (url, _):
        _, _, menus = _first_screen(url)
    assert "Nbgrader" in menus, f"INSTRUCTOR=1 should keep the grading menu (the check above could not fail): {menus!r}"
