"""The comparison a user sees, checked in a real browser (issue 35): ``mlflow ui`` over a store written by a tiny fit
and a tiny sweep, loaded in headless Chromium from the link ``fit`` and ``sweep`` print (``tracking.runs_link``).

It asserts that the runs table is what opens (not MLflow's GenAI overview) and that the columns that compare
drafters are there without configuring anything. It needs Chromium and Playwright's Python package: ``make
ui-check`` installs both and runs this file (writing the screenshot docs/sweeps.md shows); without them it is
skipped, as on a CI machine that has no browser.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from helpers.cli import exit_code
from helpers.fits import ROOT, TINY

from lightning_spec.tracking import runs_link

pytestmark = pytest.mark.integration
CHROMIUM = os.environ.get("LIGHTNING_SPEC_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
playwright = pytest.importorskip("playwright.sync_api", reason="make ui-check installs Playwright")
if CHROMIUM is None:
    pytest.skip("no Chromium on this machine (make ui-check installs it)", allow_module_level=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A tracking store with a tiny fit and a tiny sweep (4 trials), as a new user's folder holds after trying
    both."""
    folder = tmp_path_factory.mktemp("ui")
    cwd = Path.cwd()
    os.chdir(folder)
    try:
        assert exit_code(["fit", "-c", str(TINY), "--trainer.max_steps=4", "--trainer.val_check_interval=2"]) == 0
        sweep = (ROOT / "sweeps" / "tiny.yaml").read_text().replace("base: experiments/tiny.yaml", f"base: {TINY}")
        (folder / "sweep.yaml").write_text(sweep)
        assert exit_code(["sweep", "-c", "sweep.yaml"]) == 0
    finally:
        os.chdir(cwd)
    return folder


@pytest.fixture(scope="module")
def ui(store):
    """``mlflow ui`` on 127.0.0.1 over that store; yields its base URL."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "ui", "--backend-store-uri",
                               f"sqlite:///{store / 'mlflow.db'}", "--host", "127.0.0.1", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{base}/health", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("mlflow ui did not start within 120 s") from None
                time.sleep(0.5)
        yield base
    finally:
        server.terminate()
        server.wait(timeout=30)


def open_runs(base: str, experiment: str, screenshot: Path | None = None) -> tuple[str, list[str], str]:
    """Load the experiment's comparison link in headless Chromium: (the URL it settles on, the column headers,
    the page's text)."""
    link = runs_link(base, experiment)  # what fit and sweep print, on this server
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        page = browser.new_page(viewport={"width": 1900, "height": 700})
        page.goto(link, wait_until="load", timeout=90_000)
        page.wait_for_selector("[role=columnheader]", timeout=60_000)
        page.wait_for_function("document.body.innerText.includes('val/mal')", timeout=60_000)
        for label in ("Close", "Hide banner"):  # MLflow's assistant panel and the shared-view banner: not ours
            button = page.locator(f"button[aria-label='{label}']")
            if button.count():
                button.first.click()
        time.sleep(2)  # the grid lays out its columns after the runs arrive
        headers = page.eval_on_selector_all("[role=columnheader]", "els => els.map(e => e.innerText.trim())")
        text = page.inner_text("body")
        if screenshot is not None:
            page.screenshot(path=str(screenshot))
        url = page.url
        browser.close()
    return url, headers, text


def experiment_id(store: Path, name: str) -> str:
    import mlflow

    experiment = mlflow.MlflowClient(tracking_uri=f"sqlite:///{store / 'mlflow.db'}").get_experiment_by_name(name)
    assert experiment is not None, name
    return experiment.experiment_id


def test_a_fits_experiment_opens_on_its_runs_with_the_comparison_columns(store, ui):
    fit = experiment_id(store, "lightning_spec: tiny-random")
    url, headers, text = open_runs(ui, fit)
    assert f"/experiments/{fit}/runs" in url and "overview" not in url  # the runs table, not the GenAI overview
    for column in ("family", "objective", "K", "draft_vocab", "steps", "val/mal", "Dataset", "Models"):
        assert column in headers, (column, headers)
    assert "dflash" in text and "KL + ExpDecay" in text  # the values, not only the headers
    assert "sharegpt (" in text and "dflash-K4" in text  # the Dataset and Models columns are filled


def test_a_sweeps_experiment_shows_its_trials_by_the_same_columns(store, ui):
    """One experiment per study, the trials nested under the study's parent run; the screenshot docs/sweeps.md
    shows is this page (``LIGHTNING_SPEC_UI_SCREENSHOT``)."""
    shot = os.environ.get("LIGHTNING_SPEC_UI_SCREENSHOT")
    sweep = experiment_id(store, "lightning_spec: tiny-random, sweep tiny")
    url, headers, text = open_runs(ui, sweep, Path(shot) if shot else None)
    assert f"/experiments/{sweep}/runs" in url
    for column in ("family", "objective", "K", "val/mal"):
        assert column in headers, (column, headers)
    assert "tiny" in text  # the parent run, named after the study


def test_a_sweeps_comparison_plot_shows_on_its_parent_run(store, ui):
    """The parent run's plots (``sweeps/plots.py``) render in the UI's artifact view, not only as files."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{store / 'mlflow.db'}")
    sweep = experiment_id(store, "lightning_spec: tiny-random, sweep tiny")
    (parent,) = [r for r in client.search_runs([sweep]) if "mlflow.parentRunId" not in r.data.tags]
    page_url = (f"{ui}/#/experiments/{sweep}/runs/{parent.info.run_id}/artifacts/plots/metric_vs_block_size.png"
                "?workflowType=machine_learning")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        page = browser.new_page(viewport={"width": 1600, "height": 900})
        page.goto(page_url, wait_until="load", timeout=90_000)
        page.wait_for_function("[...document.images].some(i => i.src.startsWith('blob:') && i.naturalWidth > 0)",
                               timeout=60_000)  # the PNG fetched from the run's artifacts and decoded
        browser.close()

