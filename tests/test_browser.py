"""Every notebook in JupyterLab, in a real Chromium, as a learner opens it.

For each ``notebooks/NN_*.ipynb`` (found by name, so new notebooks join by themselves):

1. open it; every stored widget view renders from the stored state before anything runs;
2. wait for an autosave and save once more: the ``.ipynb`` and its paired ``src/*.py``
   must keep every byte (JupyterLab and jupytext rewrite nothing);
3. a notebook with widgets (and any listed under ``run_all`` in
   ``tests/browser_notebooks.toml``) is run end to end: Restart Kernel and Run All, no cell
   may have an error output, then the first control of every widget is moved and its
   drawn output must change;
4. every other notebook is not executed a second time: the browser opens the copy nbval
   executed in this test run (``build/executed/``, written by ``notebooks/conftest.py``)
   and checks what a learner would see of it: every output rendered, every image
   loaded, no error output and nothing on stderr;
5. screenshots go to ``build/browser/``, run-all seconds to ``build/browser/timings.json``.

Where no executed copy exists (the browser test run alone), it executes the notebook once
(nbclient, as ``make refresh`` does) to make one. JupyterLab serves a temporary copy of
``notebooks/`` (or of ``$PAGEDKV_BROWSER_NOTEBOOKS``) on 127.0.0.1 with its own settings,
so nothing of the checkout or of the user's Jupyter set-up is touched.
``tests/test_browser_mutants.py`` runs this test on broken notebooks and watches it fail.

Needs Debian's ``chromium`` (``make browser-deps`` as root) and Playwright for Python (dev
extra; its own browser download is not used). ``PAGEDKV_BROWSER``: ``auto`` (default)
skips with the reason where Chromium is missing; ``required`` (CI) fails instead;
``off`` skips. ``PAGEDKV_CHROMIUM`` names another Chromium binary.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = Path(os.environ.get("PAGEDKV_BROWSER_NOTEBOOKS") or ROOT / "notebooks")
SHOTS = Path(os.environ.get("PAGEDKV_BROWSER_SHOTS") or ROOT / "build" / "browser")
EXECUTED = Path(os.environ.get("PAGEDKV_EXECUTED_DIR") or ROOT / "build" / "executed")
CONFIG = tomllib.loads((Path(__file__).with_name("browser_notebooks.toml")).read_text())
NAMES = sorted(p.stem for p in NOTEBOOKS.glob("[0-9][0-9]*_*.ipynb"))
MODE = os.environ.get("PAGEDKV_BROWSER", "auto").strip().lower()
CHROMIUM = os.environ.get("PAGEDKV_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
# The flags a root CI machine without a network needs (see .ci/run); --headless comes from Playwright.
FLAGS = [
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
] + (["--no-sandbox"] if hasattr(os, "geteuid") and os.geteuid() == 0 else [])
RUN_ALL_TIMEOUT_S = 150
REDRAW_S = float(os.environ.get("PAGEDKV_BROWSER_REDRAW_S", 60))  # shorter in the test of this test
AUTOSAVE_S = 1


def _missing() -> str | None:
    if MODE == "off":
        return "PAGEDKV_BROWSER=off"
    if not CHROMIUM or not os.access(CHROMIUM, os.X_OK):
        return (
            "no Chromium found: install Debian's package (`make browser-deps` as root, or "
            "`sudo apt-get install chromium`), or set PAGEDKV_CHROMIUM to a Chromium binary"
        )
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright for Python is missing: `make setup` installs the dev extra"
    return None


def _gate() -> None:
    reason = _missing()
    if reason is None:
        return
    if MODE == "required":
        pytest.fail(f"PAGEDKV_BROWSER=required, but {reason}", pytrace=False)
    pytest.skip(f"browser test skipped: {reason}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _settings(root: Path) -> Path:
    """JupyterLab user settings for the test: autosave after 1 s, no news prompt."""
    settings = {
        "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosaveInterval": AUTOSAVE_S},
        # every cell in the DOM, so that the rendering checks see all outputs (not a window of them)
        "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
        "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false"},
    }
    for rel, value in settings.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))
    return root


def _runs_all(name: str) -> bool:
    """Whether ``name`` is run end to end in the browser (its widgets need a live kernel)."""
    return _widget_views(NOTEBOOKS / f"{name}.ipynb") > 0 or name in CONFIG.get("run_all", [])


def _executed_copies(folder: Path) -> None:
    """Put the executed copy of every notebook not run end to end in ``folder/executed/``:
    nbval's from this test run where it is newer than the notebook, else one made now."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import nbformat
    from build_notebooks import execute

    (folder / "executed").mkdir()
    for name in NAMES:
        if _runs_all(name) or name in CONFIG.get("open_only", []):
            continue
        source, copy = NOTEBOOKS / f"{name}.ipynb", EXECUTED / f"{name}.ipynb"
        if copy.exists() and copy.stat().st_mtime >= source.stat().st_mtime:
            shutil.copy(copy, folder / "executed" / copy.name)
            continue
        print(f"{name}: no executed copy from nbval in {EXECUTED}: executing it once here")
        nb = nbformat.read(source, as_version=4)
        execute(nb, NOTEBOOKS, name)
        nbformat.write(nb, folder / "executed" / copy.name)


def wait_until_serving(proc: subprocess.Popen, url: str, log: Path) -> None:
    """Return once the JupyterLab ``proc`` answers at ``url``; fail the test, with the end
    of its ``log``, if it exits first or does not answer within 120 s."""
    for _ in range(240):
        try:
            urllib.request.urlopen(f"{url}/api/status", timeout=2)
            return
        except OSError:
            if proc.poll() is not None:
                pytest.fail(f"JupyterLab exited: {log.read_text()[-2000:]}")
            time.sleep(0.5)
    pytest.fail(f"JupyterLab did not start within 120 s: {log.read_text()[-2000:]}")


@pytest.fixture(scope="module")
def lab():
    """A JupyterLab server on 127.0.0.1 over a copy of the notebooks; yields (url, folder)."""
    _gate()
    work = Path(tempfile.mkdtemp(prefix="pagedkv-lab-"))
    folder = work / "notebooks"
    shutil.copytree(NOTEBOOKS, folder, ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
    _executed_copies(folder)
    env = dict(
        os.environ,
        JUPYTER_CONFIG_DIR=str(work / "config"),
        JUPYTER_DATA_DIR=str(work / "data"),
        JUPYTER_RUNTIME_DIR=str(work / "runtime"),
        JUPYTER_PLATFORM_DIRS="1",
    )
    # Trusted, as `make lab` trusts them: untrusted outputs (widget views) are not rendered.
    subprocess.run(
        [sys.executable, "-m", "jupyter", "trust", *map(str, sorted(folder.glob("*.ipynb")))],
        env=env,
        check=True,
        capture_output=True,
    )
    port = _free_port()
    log = open(work / "lab.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyter",
            "lab",
            "--no-browser",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={port}",
            f"--ServerApp.root_dir={folder}",
            "--IdentityProvider.token=",
            "--ServerApp.password=",
            "--ServerApp.allow_root=True",
            "--LabApp.expose_app_in_browser=True",
            "--LabApp.news_url=",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            f"--LabApp.user_settings_dir={_settings(work / 'settings')}",
            f"--LabApp.workspaces_dir={work / 'workspaces'}",
            "--KernelManager.transport_encryption=auto",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(proc, url, work / "lab.log")
        yield url, folder
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="module")
def page(lab):
    from playwright.sync_api import sync_playwright

    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            tempfile.mkdtemp(prefix="pagedkv-chromium-"),
            executable_path=CHROMIUM,
            args=FLAGS,
            headless=True,
            viewport={"width": 1400, "height": 900},
        )
        yield context.new_page()
        context.close()


# Guarded: until JupyterLab's bundle has run there is no window.jupyterapp, and a
# predicate that throws ends Playwright's wait_for_function at once instead of polling.
PANEL = "(window.jupyterapp && window.jupyterapp.shell.currentWidget)"
READY = f"""() => {{
  const p = {PANEL};
  return !!(p && p.context && p.context.isReady && p.content && p.content.widgets.length &&
            p.sessionContext.session && p.sessionContext.session.kernel &&
            p.sessionContext.session.kernel.status === 'idle');
}}"""
# The command's promise settles when Run All has finished (JupyterLab 4 returns
# NotebookActions.runCells from it). Waiting on it, not on the cells' execution counts,
# matters: the stored counts are already set before the restart, so a poll of them
# could call the run done before it began.
RUN_ALL = """() => {
  window.pkRunAll = undefined;
  window.jupyterapp.commands.execute('notebook:restart-run-all').then(
    ok => { window.pkRunAll = ok === undefined ? 'not run' : ok ? 'ok' : 'a cell failed'; },
    err => { window.pkRunAll = `threw ${err}`; });
}"""
DONE = f"""() => {{
  const k = {PANEL}.sessionContext.session && {PANEL}.sessionContext.session.kernel;
  return window.pkRunAll !== undefined && !!k && k.status === 'idle';
}}"""
CLOSE = f"""async () => {{
  const p = {PANEL};
  if (p && p.sessionContext) {{ await p.sessionContext.shutdown(); p.dispose(); }}
}}"""
ERRORS = f"""() => {PANEL}.content.widgets
  .filter(c => c.model.type === 'code')
  .flatMap((c, i) => c.model.outputs.toJSON().filter(o => o.output_type === 'error')
  .map(o => `cell ${{c.model.id}}: ${{o.ename}}: ${{o.evalue}}`))"""


def _widget_views(path: Path) -> int:
    nb = json.loads(path.read_text())
    return sum(
        "application/vnd.jupyter.widget-view+json" in o.get("data", {})
        for c in nb["cells"]
        for o in c.get("outputs", [])
    )


def _record(name: str, seconds: float) -> None:
    path = SHOTS / "timings.json"
    timings = json.loads(path.read_text()) if path.exists() else {}
    timings[name] = round(seconds, 1)
    path.write_text(json.dumps(dict(sorted(timings.items())), indent=1) + "\n")


WIDGET_CELLS = f"""() => {PANEL}.content.widgets
  .map((c, i) => [i, c.model.type === 'code' && c.model.outputs.toJSON()
    .some(o => o.data && o.data['application/vnd.jupyter.widget-view+json'])])
  .filter(([i, has]) => has).map(([i]) => i)"""


def _widget_in_cell(page, cell: int):
    """Scroll cell ``cell`` into view (JupyterLab renders off-screen cells lazily) and
    return a locator for the widget in its output."""
    page.evaluate(
        f"""async () => {{
          const nb = {PANEL}.content;
          await nb.scrollToItem({cell}, 'center');
          nb.widgets[{cell}].node.setAttribute('data-pk-cell', '{cell}');
        }}"""
    )
    widget = page.locator(f'[data-pk-cell="{cell}"] .widget-interact').last
    widget.wait_for(state="visible", timeout=30_000)
    return widget


def _poll(page, read, until, timeout_s: float, failure: str):
    """Call ``read()`` every 250 ms until ``until(value)`` holds and return that value;
    fail with ``failure`` after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while not until(value := read()):
        if time.monotonic() > deadline:
            pytest.fail(failure)
        page.wait_for_timeout(250)
    return value


def _exercise_widget(page, widget, index: int, name: str) -> None:
    """Move the widget's first control; its drawn output must change."""
    output = widget.locator(".widget-output")

    def drawn() -> str:
        imgs = output.locator("img")
        return imgs.first.get_attribute("src") if imgs.count() else output.inner_text()

    readout = widget.locator(".widget-readout").first
    select = widget.locator("select").first
    # A view made by Run All fills its readout and output a moment after it becomes
    # visible: wait for both, or the control is read empty and "before" is no drawing.
    before = _poll(page, drawn, bool, 30, f"{name}: widget {index} drew nothing within 30 s")
    if readout.count():
        no_readout = f"{name}: widget {index} shows no readout within 30 s"
        old = _poll(page, lambda: readout.inner_text().strip(), bool, 30, no_readout)
        readout.click()
        page.keyboard.press("Control+A")
        page.keyboard.type(str(int(old.replace(",", "")) + 1))
        page.keyboard.press("Enter")
    elif select.count():
        options = select.locator("option").all_inner_texts()
        current = select.input_value()
        select.select_option(label=next(o for o in options if o != current))
    else:
        pytest.fail(f"{name}: widget {index} has no slider or dropdown to move")
    moved = f"{name}: widget {index} did not redraw within {REDRAW_S:g} s after its control moved"
    _poll(page, drawn, lambda now: now != before, REDRAW_S, moved)
    page.screenshot(path=str(SHOTS / f"{name}_widget{index}.png"))


@pytest.mark.parametrize("name", NAMES)
def test_notebook_in_jupyterlab(lab, page, name):
    try:
        _check_notebook(lab, page, name)
    finally:  # shut this notebook's kernel down and close it, so it costs the next one nothing
        try:
            page.evaluate(CLOSE)
        except Exception as err:  # never hide the check's own failure behind the clean-up's
            print(f"{name}: closing the notebook failed: {err}")


def _check_notebook(lab, page, name: str) -> None:
    url, folder = lab
    ipynb, source = folder / f"{name}.ipynb", folder / "src" / f"{name}.py"
    originals = {p: p.read_bytes() for p in (ipynb, source) if p.exists()}

    page.goto(f"{url}/lab/tree/{name}.ipynb")
    page.wait_for_function(READY, timeout=120_000)
    views = _widget_views(ipynb)
    if views:  # stored widget state renders before anything runs
        page.wait_for_function(f"() => document.querySelectorAll('.widget-interact').length >= {views}", timeout=30_000)
    page.screenshot(path=str(SHOTS / f"{name}_opened.png"))

    page.wait_for_timeout(AUTOSAVE_S * 1000 + 500)  # an autosave would have happened by now
    page.evaluate(f"() => {PANEL}.context.save()")  # and one save more, for certain
    page.wait_for_function(f"() => !{PANEL}.context.model.dirty", timeout=30_000)
    changed = [p for p, data in originals.items() if p.read_bytes() != data]
    for path in changed:  # kept for a look: diff it against the committed file
        shutil.copy(path, SHOTS / f"{path.stem}.rewritten{path.suffix}")
    assert not changed, (
        f"{name}: opening and saving in JupyterLab rewrote {[p.name for p in changed]} "
        f"(the rewritten copies are in {SHOTS}); run `make refresh NAMES={name}`"
    )

    if name in CONFIG.get("open_only", []):
        return
    if _runs_all(name):
        _run_all_and_move_widgets(page, name, views)
    else:
        _check_executed_copy(page, url, name)


def _run_all_and_move_widgets(page, name: str, views: int) -> None:
    """Restart Kernel and Run All: no error; then every widget redraws when moved."""
    start = time.monotonic()
    page.evaluate(RUN_ALL)
    page.locator(".jp-Dialog .jp-mod-accept").click(timeout=30_000)
    page.wait_for_function(DONE, timeout=RUN_ALL_TIMEOUT_S * 1000, polling=500)
    seconds = time.monotonic() - start
    _record(name, seconds)
    page.screenshot(path=str(SHOTS / f"{name}_run.png"))
    errors = page.evaluate(ERRORS)
    assert not errors, f"{name}: Restart Kernel and Run All left errors:\n" + "\n".join(errors)
    outcome = page.evaluate("() => window.pkRunAll")
    assert outcome == "ok", f"{name}: Restart Kernel and Run All ended with '{outcome}'"

    cells = page.evaluate(WIDGET_CELLS)
    assert len(cells) == views, f"{name}: {views} stored widget views, but {len(cells)} after Run All"
    for i, cell in enumerate(cells):
        _exercise_widget(page, _widget_in_cell(page, cell), i, name)
    print(f"{name}: run all in {seconds:.1f} s, {len(cells)} widget(s) responded")


# What a learner sees of an executed notebook: outputs in the model, output areas drawn,
# images (and how many finished loading), error outputs, stderr outputs.
RENDERED = f"""() => {{
  const p = {PANEL};
  const code = p.content.widgets.filter(c => c.model.type === 'code');
  const json = code.flatMap(c => c.model.outputs.toJSON());
  const drawn = [...p.content.node.querySelectorAll('.jp-OutputArea-output')];
  const images = [...p.content.node.querySelectorAll('.jp-OutputArea-output img')];
  return {{
    outputs: json.length,
    drawn: drawn.length,
    images: images.length,
    loaded: images.filter(i => i.complete && i.naturalWidth > 0).length,
    pngs: json.filter(o => o.data && o.data['image/png']).length,
    errors: json.filter(o => o.output_type === 'error').map(o => `${{o.ename}}: ${{o.evalue}}`),
    stderr: json.filter(o => o.output_type === 'stream' && o.name === 'stderr').map(o => String(o.text).slice(0, 200)),
  }};
}}"""


def _check_executed_copy(page, url: str, name: str) -> None:
    """Open the copy nbval executed: every output drawn, every plot loaded as an image, no
    error and nothing on stderr (a warning a learner would have to ignore)."""
    page.evaluate(CLOSE)
    page.goto(f"{url}/lab/tree/executed/{name}.ipynb")
    page.wait_for_function(READY, timeout=120_000)
    seen = _poll(
        page,
        lambda: page.evaluate(RENDERED),
        lambda r: r["drawn"] >= r["outputs"] and r["loaded"] == r["images"] >= r["pngs"],
        30,
        f"{name}: the executed notebook's outputs did not all render within 30 s: {page.evaluate(RENDERED)}",
    )
    page.screenshot(path=str(SHOTS / f"{name}_executed.png"), full_page=True)
    assert not seen["errors"], f"{name}: the executed notebook holds error outputs: {seen['errors']}"
    assert not seen["stderr"], f"{name}: the executed notebook printed to stderr: {seen['stderr']}"
    print(f"{name}: executed copy rendered, {seen['outputs']} outputs, {seen['images']} images")
