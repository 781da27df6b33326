"""The analyst console in a real browser: headless Chromium (Debian's, tests/browser.py) driven by
Selenium against real share servers and a real analyzer.

The module walks the analyst's path: sign in with the token, create a study through the form
(with the recommendation's bytes and predicted accuracy), upload through the SDK, watch the
progress, finalize through the confirmation, and read every result view: the regression forest
plot, PCA, logistic regression with a ROC curve on a held-out CSV that never leaves the browser,
a histogram with intervals and quantiles, LAD, the population ledger. What the page shows (the
exact numbers the charts carry, and where they are drawn) is checked against the API's answers,
and the downloads against the same numbers. Then the adversary's side: a page of another origin
in the same browser cannot create a study, the analyzer allows no cross-origin request, a study
name is text and never markup, add/remove counts stay private. Accessibility: axe-core (vendored
under tests/vendor) finds no violation on every view, and the keyboard reaches every control with
a visible focus.

Screenshots go to a temporary directory, and also to ``$DPSKETCH_SCREENSHOTS`` when it is set
(``DPSKETCH_SCREENSHOTS=docs/console`` regenerates the figures of docs/console.md).
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import struct
import threading
import time
import tomllib
import xml.etree.ElementTree as ET
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
import pytest

import browser
from conftest import cluster_for_module

ROOT = Path(__file__).resolve().parents[1]
CONSOLE = ROOT / "analyzer" / "console"
AXE = ROOT / "tests" / "vendor" / "axe-core" / "axe.min.js"
POPULATION = "survey-2026"
BUDGET = 8.0
COLUMNS = ["age", "hours", "owns_home", "wage"]
BOUNDS = [[16, 90], [0, 80], [0, 1], [0, 200]]
N = 4000

pytestmark = pytest.mark.timeout(240)


# --- fixtures ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chrome():
    found = browser.ensure()  # before the cluster: a machine without a browser skips (or fails in CI) at once
    # The SDK checks each study's guarantee with dp-accounting, whose import takes seconds: import
    # it now, while the cluster and the browser start (waiting on other processes, mostly).
    threading.Thread(target=_warm_sdk, name="warm-sdk", daemon=True).start()
    return found


def _warm_sdk() -> None:
    from dpsketch.protocol import accounting

    import dpsketch.client_sdk  # noqa: F401

    accounting.warm_up()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, chrome):
    # open uploads: each server charges every study to its operator's default population at
    # provisioning (issue 41), here the population the console's study form names too
    budget = {"DPSKETCH_POPULATION_EPSILON": str(BUDGET), "DPSKETCH_DEFAULT_POPULATION": POPULATION}
    with cluster_for_module(tmp_path_factory, "console", server_env={f"s{j}": budget for j in (1, 2, 3)}) as c:
        yield c


@pytest.fixture(scope="module")
def an(cluster):
    from dpsketch.analyzer.client import AnalyzerClient

    with AnalyzerClient(cluster.analyzer.url, cluster.api_token) as client:
        yield client


@pytest.fixture(scope="module")
def driver(chrome, tmp_path_factory):
    b = browser.Browser(*chrome, tmp_path_factory.mktemp("downloads"))
    b.driver.downloads = b.downloads
    try:
        yield b.driver
    finally:
        b.quit()


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    dirs = [tmp_path_factory.mktemp("screenshots")]
    if os.environ.get("DPSKETCH_SCREENSHOTS"):
        dirs.append(Path(os.environ["DPSKETCH_SCREENSHOTS"]))
        dirs[-1].mkdir(parents=True, exist_ok=True)
    return dirs


#: what the flow tests hand on to the next (one module, run in order, in one process)
STATE: dict = {}


# --- helpers -------------------------------------------------------------------------------

def wait(driver, condition, timeout: float = 30):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(condition)


def css(driver, selector):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, selector)


def present(driver, selector, timeout: float = 30):
    from selenium.webdriver.common.by import By

    return wait(driver, lambda d: (d.find_elements(By.CSS_SELECTOR, selector) or [None])[0], timeout)


def js(driver, script, *args):
    return driver.execute_script(script, *args)


def click(driver, selector):
    element = present(driver, selector)
    js(driver, "arguments[0].scrollIntoView({block: 'center'})", element)
    element.click()
    return element


def fill(driver, selector, value):
    element = present(driver, selector)
    element.clear()
    element.send_keys(str(value))
    return element


def choose(driver, selector, value):
    from selenium.webdriver.support.ui import Select

    Select(present(driver, selector)).select_by_value(value)


def go(driver, cluster, fragment):
    """Open a view (a fragment change re-renders it; the same URL again is a reload)."""
    url = f"{cluster.analyzer.url}/console/#{fragment}"
    if driver.current_url == url:
        driver.refresh()
    else:
        driver.get(url)


def shot(driver, dirs, name, element=None):
    """A screenshot of the whole page (or one element) into every screenshot directory."""
    if element is None:
        js(driver, "window.scrollTo(0, 0)")
    height = js(driver, "return Math.ceil(document.documentElement.scrollHeight)")
    driver.set_window_size(1280, max(900, min(height, 6000)))
    try:
        png = driver.get_screenshot_as_png() if element is None else element.screenshot_as_png
    finally:
        driver.set_window_size(1280, 900)
    for d in dirs:
        (d / f"{name}.png").write_bytes(png)
    if len(dirs) > 1:  # for the docs: a 256-colour palette (a third of the bytes; text stays sharp)
        from PIL import Image

        image = Image.open(io.BytesIO(png)).convert("RGB").quantize(256, method=Image.Quantize.MEDIANCUT)
        for d in dirs[1:]:
            image.save(d / f"{name}.png", optimize=True)
    return png


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def marks(driver, scope, mark):
    """Every mark of a kind in a figure: its data-* attributes, and the geometry of its parts."""
    return js(driver, """
        const scope = document.querySelector(arguments[0]);
        return [...scope.querySelectorAll(`[data-mark="${arguments[1]}"]`)].map((g) => {
          const part = (name) => g.querySelector(`[data-part="${name}"]`);
          const num = (el, a) => el ? Number(el.getAttribute(a)) : null;
          return {...g.dataset,
            cx: num(part("point"), "cx"),
            x1: num(part("interval"), "x1"), x2: num(part("interval"), "x2"),
            y1: num(part("interval"), "y1"), y2: num(part("interval"), "y2"),
            bar_y: num(part("bar"), "y"), bar_h: num(part("bar"), "height")};
        });""", scope, mark)


def plot_scale(driver, scope, axis):
    data = js(driver, f"""const p = document.querySelector(arguments[0]).querySelector('[data-plot]');
        return [p.dataset.{axis}Domain, p.dataset.{axis}Range];""", scope)
    (d0, d1), (r0, r1) = ([float(v) for v in s.split(",")] for s in data)
    return lambda v: r0 + (v - d0) / (d1 - d0) * (r1 - r0)


def cell_values(driver, selector):
    """The exact numbers (data-value) of a table's rows, keyed by the row's first header."""
    return js(driver, """return Object.fromEntries([...document.querySelectorAll(arguments[0] + ' tbody tr')].map(
        (tr) => [tr.querySelector('th').textContent, [...tr.querySelectorAll('td.num')].map(
            (td) => td.dataset.value === '' ? null : Number(td.dataset.value))]));""", selector)


def shown_number_matches(text: str, value: float) -> bool:
    """A number shown rounded to 4 significant digits reads back within half a unit of it."""
    return abs(float(text.replace("−", "-")) - value) <= 5e-4 * max(abs(value), 1e-12) + 1e-15


def download(driver, figure_selector, kind, timeout=20):
    """Click a figure's download button and return the file's bytes."""
    folder: Path = driver.downloads
    before = set(folder.iterdir())
    click(driver, f"{figure_selector} [data-download='{kind}']")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        new = [p for p in set(folder.iterdir()) - before if not p.name.endswith(".crdownload")]
        if new and new[0].stat().st_size > 0:
            time.sleep(0.05)
            return new[0].name, new[0].read_bytes()
        time.sleep(0.05)
    raise AssertionError(f"no {kind} download from {figure_selector}")


def page_errors(driver):
    """Console messages that say the page broke: CSP or Trusted Types violations, uncaught errors."""
    return [e["message"] for e in driver.get_log("browser")
            if re.search(r"Content Security Policy|Trusted ?Type|Uncaught|TypeError|ReferenceError", e["message"])]


def sign_in(driver, cluster, remember=False):
    go(driver, cluster, "/studies")
    if js(driver, "return sessionStorage.length") == 0:
        fill(driver, "#token", cluster.api_token)
        if remember:
            click(driver, "#remember")
        click(driver, "#token-form button[type=submit]")
    present(driver, "#refresh")


def wage_rows(n: int, seed: int) -> np.ndarray:
    """age, hours, owns_home (0/1, more likely with age and hours), wage (linear in all three)."""
    rng = np.random.default_rng(seed)
    age = rng.uniform(18, 80, n)
    hours = rng.uniform(5, 70, n)
    owns = (rng.random(n) < 1 / (1 + np.exp(-(-5 + 0.06 * age + 0.04 * hours)))).astype(float)
    wage = np.clip(10 + 0.4 * age + 0.8 * hours + 12 * owns + rng.normal(0, 8, n), 0, 200)
    return np.column_stack([age, hours, owns, wage])


def upload(cluster, study_id, rows):
    from dpsketch.client_sdk import Client

    with Client(cluster.server_urls, token=cluster.upload_tokens(study_id, quota=len(rows))) as client:
        assert client.submit_many(study_id, rows).n_reports == len(rows)


def finalize_in_page(driver, shots=None, name=None):
    click(driver, "#finalize")
    dialog = present(driver, "dialog#finalize-dialog[open]")
    text = dialog.text
    confirm = css(driver, "#finalize-confirm")
    assert "cannot be undone" in text and "one inclusion set" in text and "for ever" in text
    assert not confirm.is_enabled()  # not before the analyst ticks that they understand
    click(driver, "#finalize-understood")
    assert confirm.is_enabled()
    if shots:
        shot(driver, shots, name)
    confirm.click()
    present(driver, "[data-state='released']", timeout=60)


# --- the files and their headers -----------------------------------------------------------

@pytest.mark.timeout(900)  # its setup may install Chromium first (apt-get), then starts the cluster
def test_console_files_ship_in_the_package_and_are_served_with_strict_headers(cluster):
    files = sorted(p.relative_to(CONSOLE).as_posix() for p in CONSOLE.rglob("*") if p.is_file())
    # every file is package data (so a wheel install serves it): pyproject.toml's globs cover it
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["dpsketch.analyzer"]
    packaged = {p.relative_to(ROOT / "analyzer").as_posix() for pattern in patterns for p in (ROOT / "analyzer").glob(pattern)}
    assert {f"console/{f}" for f in files} <= packaged
    assert "index.html" in files and "js/main.js" in files
    with httpx.Client(base_url=cluster.analyzer.url, timeout=10) as http:
        r = http.get("/console")
        assert r.status_code == 308 and r.headers["location"] == "console/"
        for name in ["", *files]:
            r = http.get(f"/console/{name}")
            assert r.status_code == 200, name
            csp = r.headers["content-security-policy"]
            for directive in ("default-src 'self'", "script-src 'self'", "frame-ancestors 'none'", "object-src 'none'",
                              "require-trusted-types-for 'script'"):
                assert directive in csp, (name, csp)
            assert "unsafe-inline" not in csp and "unsafe-eval" not in csp and "http" not in csp
            assert r.headers["x-content-type-options"] == "nosniff" and r.headers["x-frame-options"] == "DENY"
            assert "access-control-allow-origin" not in r.headers
            text = r.text
            # offline: nothing is loaded from anywhere else (the SVG namespace is a name, not a fetch)
            assert not re.findall(r"https?://(?!www\.w3\.org/2000/svg)", text), name
            if name.endswith(".js"):
                assert r.headers["content-type"].startswith("text/javascript")
                assert not re.search(r"\binnerHTML\b|\bouterHTML\b|insertAdjacentHTML|document\.write|\beval\(|new Function", text), name
        # index.html loads exactly its module and stylesheet, no inline script
        index = http.get("/console/").text
        assert re.findall(r"<script[^>]*>", index) == ['<script type="module" src="js/main.js">']
        assert "</script>" in index and index.count("<script") == 1 and "style=" not in index
        for bad in ("nope.js", "../app.py", "..%2Fapp.py", "js/../../app.py"):
            r = http.get(f"/console/{bad}")
            assert r.status_code == 404, bad
        # the API itself allows no cross-origin request: no CORS headers on a preflight or a GET
        evil = {"Origin": "http://attacker.localhost:9999"}
        pre = http.options("/v1/studies", headers={**evil, "Access-Control-Request-Method": "POST",
                                                    "Access-Control-Request-Headers": "authorization, content-type"})
        assert pre.status_code >= 400 and not any(h.startswith("access-control-") for h in pre.headers)
        r = http.get("/v1/studies", headers={**evil, "Authorization": f"Bearer {cluster.api_token}"})
        assert r.status_code == 200 and not any(h.startswith("access-control-") for h in r.headers)


# --- the token -----------------------------------------------------------------------------

def test_the_token_is_kept_in_the_session_and_never_in_a_url(driver, cluster, shots):
    go(driver, cluster, "/studies")
    present(driver, "#token")
    shot(driver, shots, "01-sign-in")
    fill(driver, "#token", "not-the-token")
    click(driver, "#token-form button[type=submit]")
    alert = present(driver, "#token-status [role=alert]")
    assert "bearer token" in alert.text.lower() or "401" in alert.text
    assert js(driver, "return [sessionStorage.length, localStorage.length]") == [0, 0]
    # the real token, not remembered: this tab's session only
    fill(driver, "#token", cluster.api_token)
    click(driver, "#token-form button[type=submit]")
    present(driver, "#refresh")
    stored = js(driver, "return [sessionStorage.getItem('dpsketch.analyzer-token'), localStorage.length]")
    assert stored == [cluster.api_token, 0]
    urls = js(driver, "return [location.href, ...performance.getEntriesByType('resource').map((e) => e.name)]")
    assert all(cluster.api_token not in u for u in urls) and any("/v1/studies" in u for u in urls)
    assert js(driver, "return document.cookie") == ""
    # a new tab of the same browser has no session: it asks again
    driver.switch_to.new_window("tab")
    go(driver, cluster, "/studies")
    present(driver, "#token")
    driver.close()
    driver.switch_to.window(driver.window_handles[0])
    # "remember on this device" is the only way into local storage, and "Forget token" clears both
    click(driver, "#sign-out")
    present(driver, "#token")
    assert js(driver, "return [sessionStorage.length, localStorage.length]") == [0, 0]
    sign_in(driver, cluster, remember=True)
    assert js(driver, "return localStorage.getItem('dpsketch.analyzer-token')") == cluster.api_token
    click(driver, "#sign-out")
    present(driver, "#token")
    assert js(driver, "return [sessionStorage.length, localStorage.length]") == [0, 0]
    sign_in(driver, cluster)
    assert page_errors(driver) == []


# --- create, upload, progress, finalize ----------------------------------------------------

def test_create_through_the_form_upload_progress_and_finalize(driver, cluster, an, shots):
    sign_in(driver, cluster)
    go(driver, cluster, "/new")
    fill(driver, "#study-name", "Wages and home ownership")
    click(driver, "#add-column")
    click(driver, "#add-column")
    for i, (name, (lo, hi)) in enumerate(zip(COLUMNS, BOUNDS), start=1):
        fill(driver, f"[data-column-row='{i}'] [data-col=name]", name)
        fill(driver, f"[data-column-row='{i}'] [data-col=lower]", lo)
        fill(driver, f"[data-column-row='{i}'] [data-col=upper]", hi)
    choose(driver, "#study-label", "wage")
    fill(driver, "#expected-reports", N)
    fill(driver, "#population", POPULATION)
    # the recommendation: bytes per kind as POST /v1/recommend answers them
    target = dict(d=4, expected_reports=N, epsilon=1.0, delta=1e-6, neighbouring="replace-one", row_bound=1.0, t=0)
    rec = an.recommend(**target, predict=False)
    present(driver, "#recommendation-table")
    shown = js(driver, """return Object.fromEntries([...document.querySelectorAll('#recommendation-table tbody tr')].map(
        (tr) => [tr.dataset.kind, [...tr.querySelectorAll('td.num')].map((td) => Number(td.dataset.value))]))""")
    for option in rec["options"]:
        width, upload_bytes, share_bytes, sigma = shown[option["kind"]]
        assert (width, upload_bytes, share_bytes) == (option["width"], option["upload_bytes"], option["share_bytes"])
        assert sigma == option["sigma"]
    assert css(driver, "#recommended-kind").text == rec["kind"]
    # the predicted accuracy (a seeded simulation: the same answer the API gives)
    click(driver, "#predict")
    wait(driver, lambda d: "Predicted ridge" in css(d, "#recommendation-table").text, timeout=90)
    predicted = an.recommend(**target, predict=True)
    shown = js(driver, """return Object.fromEntries([...document.querySelectorAll('#recommendation-table tbody tr')].map(
        (tr) => [tr.dataset.kind, [...tr.querySelectorAll('td.num')].slice(4).map((td) => Number(td.dataset.value))]))""")
    for option in predicted["options"]:
        if option["kind"] == "gram":  # a gram study's design has no random seed: the same simulation
            assert shown["gram"] == [option["predicted"]["ridge"], option["predicted"]["pca"]]
        else:  # a sketch study's public seed is drawn anew for every design, and so is its prediction
            assert all(np.isfinite(v) and v >= 1 - 1e-9 for v in shown[option["kind"]])
    body = json.loads(css(driver, "#request-preview").get_attribute("textContent"))
    assert body["bounds"] == dict(zip(COLUMNS, BOUNDS)) and body["kind"] == "auto" and body["label"] == "wage"
    shot(driver, shots, "02-new-study")
    click(driver, "#create")
    study_id = present(driver, "#study-id").text
    assert len(study_id) == 64 and driver.current_url.endswith(f"#/study/{study_id}")
    view = an.study(study_id)
    STATE["gram"] = study_id
    assert view["study"]["kind"] == rec["kind"] == "gram" and view["study"]["population"] == POPULATION
    facts = js(driver, "return Object.fromEntries([...document.querySelectorAll('[data-fact]')].map((e) => [e.dataset.fact, e.textContent]))")
    g = view["guarantees"]
    assert shown_number_matches(facts["epsilon"].split(" ")[0], g["epsilon"])
    assert shown_number_matches(facts["floor_epsilon"].split(" ")[0], g["floor_epsilon"])
    assert shown_number_matches(facts["delta"], g["delta"]) and facts["neighbouring"].startswith("replace-one")
    assert shown_number_matches(facts["lambda_star"], g["lambda_star"])
    assert cell_values(driver, "#bounds") == dict(zip(COLUMNS, [[float(a), float(b)] for a, b in view["study"]["bounds"]]))

    # progress: half the rows through the SDK, then the rest
    rows = wage_rows(N, seed=1)
    upload(cluster, study_id, rows[: N // 2])
    click(driver, "#refresh")
    wait(driver, lambda d: len(d.find_elements("css selector", "#progress [data-count]")) == 3)
    progress = an.progress(study_id)
    page = js(driver, """return [...document.querySelectorAll('#progress li')].map((li) => [li.dataset.server,
        li.querySelector('[data-count]').dataset.count, li.querySelector('progress').value, li.querySelector('progress').max,
        li.querySelector('[data-health]').dataset.health])""")
    assert page == [[s["server_id"], str(s["report_count"]), s["report_count"], progress["min_reports"], "ok"]
                    for s in progress["servers"]]
    assert all(s["report_count"] == N // 2 for s in progress["servers"])
    assert css(driver, "#progress [data-ready]").get_attribute("data-ready") == "no"  # N / 2 < min_reports
    go(driver, cluster, "/studies")
    row = present(driver, f"tr[data-study='{study_id}']")
    assert [e.get_attribute("data-count") for e in row.find_elements("css selector", "[data-count]")] == [str(N // 2)] * 3
    shot(driver, shots, "03-studies")
    upload(cluster, study_id, rows[N // 2:])
    go(driver, cluster, f"/study/{study_id}")
    assert present(driver, "#progress [data-ready]").get_attribute("data-ready") == "yes"
    finalize_in_page(driver, shots, "04-finalize-confirmation")
    view = an.study(study_id)
    facts = js(driver, "return Object.fromEntries([...document.querySelectorAll('[data-fact]')].map((e) => [e.dataset.fact, e.textContent]))")
    assert view["state"] == "released" and facts["n_reports"] == str(view["n_reports"]) == str(N)
    assert facts["inclusion_hash"] == view["inclusion_hash"]
    assert "λ_min(S Sᵀ) − t ≥ λ*" in facts["certificate"]
    assert page_errors(driver) == []


# --- results -------------------------------------------------------------------------------

def check_forest(driver, scope, result, intervals: bool):
    """The forest plot draws exactly the API's coefficients (and intervals), where the scale puts them."""
    x = plot_scale(driver, scope, "x")
    rows = marks(driver, scope, "coefficient")
    assert [r["name"] for r in rows] == result["features"]
    for r, coef, ci in zip(rows, result["coef"], result.get("conf_int") or [None] * len(rows)):
        assert float(r["value"]) == coef
        assert r["cx"] == pytest.approx(x(coef), abs=1e-6)
        if intervals:
            assert [float(r["low"]), float(r["high"])] == ci
            assert (r["x1"], r["x2"]) == (pytest.approx(x(ci[0]), abs=1e-6), pytest.approx(x(ci[1]), abs=1e-6))
            assert r["x1"] <= r["cx"] <= r["x2"]
        else:
            assert "low" not in r and r["x1"] is None


def test_regression_forest_plot_draws_the_apis_coefficients_and_intervals(driver, cluster, an, shots):
    study_id = STATE["gram"]
    go(driver, cluster, f"/study/{study_id}")
    for method, call in (("least-squares", an.least_squares), ("ridge", an.ridge)):
        choose(driver, "#regression-method", method)
        choose(driver, "#regression-label", "wage")
        click(driver, "#regression-run")
        figure = present(driver, f"#regression-output figure[data-figure='{method}-wage']")
        result = call(study_id, label="wage", confidence=0.95)
        intervals = "conf_int" in result
        note = css(driver, "#regression-output [data-intervals]")
        assert note.get_attribute("data-intervals") == ("yes" if intervals else "none")
        if not intervals:
            assert "no confidence intervals" in note.text
        check_forest(driver, "#regression-output", result, intervals)
        table = cell_values(driver, "#regression-output table")
        assert table["(intercept)"][0] == result["intercept"]
        assert [table[f][0] for f in result["features"]] == result["coef"]
        if intervals:
            assert [table[f][-2:] for f in result["features"]] == result["conf_int"]
    shot(driver, shots, "05-forest-plot", figure)
    # the interval path of the plot, whatever this analyzer answers: the page's own renderer
    # given the API's coefficients with intervals of +-1 draws each line where its scale says
    drawn = driver.execute_async_script("""const done = arguments[arguments.length - 1];
        import(new URL('js/charts/forest.js', document.baseURI).href).then((m) => {
          const svg = m.forestPlot({title: 't', description: 'd', xLabel: 'x', rows: arguments[0]});
          document.querySelector('main').append(svg);
          const p = svg.querySelector('[data-plot]');
          const out = [p.dataset.xDomain, p.dataset.xRange, [...svg.querySelectorAll('[data-part=interval]')].map(
            (l) => [Number(l.getAttribute('x1')), Number(l.getAttribute('x2'))])];
          svg.remove();
          done(out);
        }, (e) => done(String(e)));""", [{"name": f, "value": c, "low": c - 1, "high": c + 1}
                                        for f, c in zip(result["features"], result["coef"])])
    (d0, d1), (r0, r1) = ([float(v) for v in part.split(",")] for part in drawn[:2])
    assert d0 <= min(result["coef"]) - 1 and d1 >= max(result["coef"]) + 1
    assert drawn[2] == [[pytest.approx(r0 + (c + e - d0) / (d1 - d0) * (r1 - r0), abs=1e-6) for e in (-1, 1)]
                        for c in result["coef"]]
    # the downloads hold the same numbers
    name, data = download(driver, "#regression-output figure", "csv")
    assert name == "ridge-wage.csv"
    got = list(csv.DictReader(io.StringIO(data.decode())))
    assert [r["term"] for r in got] == [*result["features"], "(intercept)"]
    assert [float(r["coef"]) for r in got] == [*result["coef"], result["intercept"]]
    if intervals:
        assert [[float(r["ci_low"]), float(r["ci_high"])] for r in got[:-1]] == result["conf_int"]
    name, data = download(driver, "#regression-output figure", "svg")
    tree = ET.fromstring(data.split(b"\n", 1)[1])
    values = [float(g.get("data-value")) for g in tree.iter() if g.get("data-mark") == "coefficient"]
    assert name == "ridge-wage.svg" and values == result["coef"]
    name, data = download(driver, "#regression-output figure", "png")
    svg_w, svg_h = (int(tree.get(a)) for a in ("width", "height"))
    assert name == "ridge-wage.png" and png_size(data) == (2 * svg_w, 2 * svg_h)
    assert page_errors(driver) == []


def test_pca_scree_and_loadings_are_the_apis(driver, cluster, an, shots):
    study_id = STATE["gram"]
    go(driver, cluster, f"/study/{study_id}")
    fill(driver, "#pca-components", 3)
    click(driver, "#pca-run")
    present(driver, "#pca-output figure[data-figure='pca-loadings']")
    result = an.pca(study_id, n_components=3)
    bars = marks(driver, "#pca-output figure[data-figure='pca-scree']", "component")
    y = plot_scale(driver, "#pca-output figure[data-figure='pca-scree']", "y")
    assert [float(b["value"]) for b in bars] == result["explained_variance"]
    for b, v in zip(bars, result["explained_variance"]):
        assert b["bar_h"] == pytest.approx(abs(y(v) - y(0)), abs=1e-6)
    loadings = marks(driver, "#pca-output figure[data-figure='pca-loadings']", "loading")
    assert [float(m["value"]) for m in loadings] == [v for row in result["components"] for v in row]
    assert [m["column"] for m in loadings[:4]] == result["columns"] == COLUMNS
    assert [v[0] for v in cell_values(driver, "#pca-output [data-table='pca-mean']").values()] == result["mean"]
    shot(driver, shots, "06-pca", present(driver, "#pca"))
    _, data = download(driver, "#pca-output figure[data-figure='pca-scree']", "csv")
    got = list(csv.DictReader(io.StringIO(data.decode())))
    assert [float(r["explained_variance"]) for r in got] == result["explained_variance"]
    assert [float(r["explained_variance_ratio"]) for r in got] == result["explained_variance_ratio"]


def test_logistic_regression_and_a_roc_curve_on_a_local_file_that_is_never_uploaded(driver, cluster, an, shots, tmp_path):
    from sklearn.metrics import roc_auc_score

    study_id = STATE["gram"]
    go(driver, cluster, f"/study/{study_id}")
    choose(driver, "#logistic-label", "owns_home")
    click(driver, "#logistic-run")
    present(driver, "#logistic-output figure")
    result = an.logistic(study_id, label="owns_home", classes=[0, 1])
    rows = marks(driver, "#logistic-output", "coefficient")
    assert [r["name"] for r in rows] == result["features"] == ["age", "hours", "wage"]
    assert [float(r["value"]) for r in rows] == result["coef"]
    assert cell_values(driver, "#logistic-output table")["(intercept)"][0] == result["intercept"]
    # held-out rows (not uploaded to the study), scored in the browser
    held = wage_rows(1500, seed=99)
    path = tmp_path / "held-out.csv"
    path.write_text(",".join(COLUMNS) + "\n" + "\n".join(",".join(repr(float(v)) for v in row) for row in held) + "\n")
    requests_before = js(driver, "return performance.getEntriesByType('resource').length")
    present(driver, "#roc-file").send_keys(str(path))
    auc = float(present(driver, "#roc-auc").get_attribute("data-value"))
    x = held[:, [COLUMNS.index(f) for f in result["features"]]]
    expected = roc_auc_score(held[:, COLUMNS.index("owns_home")], result["intercept"] + x @ np.array(result["coef"]))
    assert auc == pytest.approx(expected, abs=1e-12) and auc > 0.6
    # the file never left the browser: no request at all since it was chosen
    assert js(driver, "return performance.getEntriesByType('resource').length") == requests_before
    shot(driver, shots, "07-logistic-roc", present(driver, "#logistic"))
    _, data = download(driver, "#roc-output figure", "csv")
    points = list(csv.DictReader(io.StringIO(data.decode())))
    assert (float(points[0]["fpr"]), float(points[0]["tpr"]), float(points[-1]["fpr"]), float(points[-1]["tpr"])) == (0, 0, 1, 1)
    assert page_errors(driver) == []


def test_histogram_study_from_the_form_with_intervals_and_quantiles(driver, cluster, an, shots):
    go(driver, cluster, "/new")
    fill(driver, "#study-name", "Age distribution")
    click(driver, "[data-column-row='2'] button")  # one column is enough
    click(driver, "#kind-histogram")
    fill(driver, "[data-column-row='1'] [data-col=name]", "age")
    fill(driver, "[data-column-row='1'] [data-col=bins]", "20, 30, 40, 50, 60, 70")
    fill(driver, "#expected-reports", 3000)
    click(driver, "#create")
    study_id = present(driver, "#study-id").text
    ages = wage_rows(3000, seed=2)[:, :1]
    upload(cluster, study_id, ages)
    finalize_in_page(driver)
    fill(driver, "#quantile-probabilities", "0.25, 0.5, 0.75")
    click(driver, "#histogram-run")
    present(driver, "#histogram-output [data-table='moments']")
    hist = an.histogram(study_id)
    cells = marks(driver, "#histogram-output figure", "cell")
    assert [c["name"] for c in cells] == hist["axes"][0]["labels"]
    assert [float(c["value"]) for c in cells] == hist["counts"]
    assert [[float(c["low"]), float(c["high"])] for c in cells] == hist["counts_ci"]
    y = plot_scale(driver, "#histogram-output figure", "y")
    for c, (lo, hi) in zip(cells, hist["counts_ci"]):
        assert sorted([c["y1"], c["y2"]]) == [pytest.approx(y(hi), abs=1e-6), pytest.approx(y(lo), abs=1e-6)]
    q = an.statistic(study_id, "quantiles", column="age", probabilities=[0.25, 0.5, 0.75])
    shown = marks(driver, "#histogram-output figure[data-figure='quantiles-age']", "quantile")
    assert [float(m["value"]) for m in shown] == q["quantiles"] and [float(m["p"]) for m in shown] == [0.25, 0.5, 0.75]
    mean = an.statistic(study_id, "moments", column="age")
    assert cell_values(driver, "#histogram-output [data-table='moments']")["mean"] == [mean["value"], *mean["ci"]]
    shot(driver, shots, "08-histogram", present(driver, "#histogram"))
    _, data = download(driver, "#histogram-output figure", "csv")
    got = list(csv.DictReader(io.StringIO(data.decode())))
    assert [float(r["count"]) for r in got] == hist["counts"]
    assert [float(r["proportion_ci_high"]) for r in got] == [c[1] for c in hist["proportions_ci"]]


def test_lad_view_of_an_l1_study(driver, cluster, an, shots):
    created = an.create_study(name="Median wage", columns=["age", "hours", "wage"], label="wage", kind="l1",
                              bounds={"age": [16, 90], "hours": [0, 80], "wage": [0, 200]}, expected_reports=9200)
    study_id = created["study_id"]
    upload(cluster, study_id, wage_rows(9200, seed=3)[:, [0, 1, 3]])
    an.finalize(study_id)
    go(driver, cluster, f"/study/{study_id}")
    click(driver, "#lad-run")
    present(driver, "#lad-output figure")
    result = an.lad(study_id, label="wage")
    rows = marks(driver, "#lad-output", "coefficient")
    assert [r["name"] for r in rows] == result["features"] and [float(r["value"]) for r in rows] == result["coef"]
    assert cell_values(driver, "#lad-output table")["(intercept)"][0] == result["intercept"]
    shot(driver, shots, "09-lad", present(driver, "#lad"))


def test_population_ledger_shows_each_servers_budget_and_charges(driver, cluster, an, shots):
    go(driver, cluster, f"/ledger/{POPULATION}")
    present(driver, "[data-ledger-server='s3'] [data-table='charges']")
    ledger = an.ledger(population=POPULATION)
    for server in ledger["servers"]:
        scope = f"[data-ledger-server='{server['server_id']}']"
        l = server["ledger"]
        used, budget, left, naive = cell_values(driver, f"{scope} [data-table='budget']")["ε (composed, PLD)"]
        assert (used, budget, left, naive) == (l["epsilon"], l["budget_epsilon"], l["remaining_epsilon"], l["naive_epsilon"])
        assert budget == BUDGET and 0 < used < budget
        charged = js(driver, f"return [...document.querySelectorAll(\"{scope} tr[data-charge]\")].map((tr) => tr.dataset.charge)")
        assert charged == [e["charge"]["study_id"] for e in l["studies"]] and STATE["gram"] in charged
    shot(driver, shots, "10-ledger")


# --- the adversary's side ------------------------------------------------------------------

def test_add_remove_counts_are_shown_only_as_the_api_answers_them(driver, cluster, an):
    """The console shows the count the analyzer's API answers and never one of its own: where the
    API says null (a server that hides an add/remove study's count) the page says "private" and
    draws no bar. (This analyzer asks the servers with its analyst tokens, to which they give
    exact counts, docs/protocol.md section 6; so its API answers them, and so does the page.)"""
    created = an.create_study(name="Who took part", columns=["x", "y"], label="y", neighbouring="add-remove",
                              bounds={"x": [0, 1], "y": [0, 1]}, expected_reports=1000)
    study_id = created["study_id"]
    upload(cluster, study_id, np.random.default_rng(4).random((37, 2)))
    progress = an.progress(study_id)
    expected = ["private" if s["report_count"] is None else str(s["report_count"]) for s in progress["servers"]]
    for fragment, scope in (("/studies", f"tr[data-study='{study_id}']"), (f"/study/{study_id}", "#progress")):
        go(driver, cluster, fragment)
        present(driver, f"{scope} [data-count]")
        element = present(driver, scope)
        assert [e.get_attribute("data-count") for e in element.find_elements("css selector", "[data-count]")] == expected
    # the API's progress with the counts hidden, through the page's own renderer
    hidden = {**progress, "servers": [{**s, "report_count": None} for s in progress["servers"]]}
    shown = driver.execute_async_script("""const done = arguments[arguments.length - 1];
        import(new URL('js/views/progress.js', document.baseURI).href).then((m) => {
          const list = m.serverProgress(arguments[0]);
          done([[...list.querySelectorAll('[data-count]')].map((e) => e.dataset.count),
                list.querySelectorAll('progress').length, list.textContent]);
        }, (e) => done(String(e)));""", hidden)
    counts, bars, text = shown
    assert counts == ["private"] * 3 and bars == 0 and not re.search(r"\d+ /", text) and "37" not in text


def test_a_page_of_another_origin_cannot_create_or_read_studies(driver, cluster, an):
    """The attacker's page runs in the same browser as a signed-in console tab: a simple POST
    (no preflight) reaches the analyzer without the token, and a request that carries the
    token needs a preflight the analyzer does not allow."""
    analyzer = cluster.analyzer.url
    study = json.dumps({"name": "planted", "columns": ["a", "b"], "expected_reports": 100})
    page = f"""<!doctype html><title>elsewhere</title><form id=f method=post enctype=text/plain target=sink
      action="{analyzer}/v1/studies"><input name='{{"name":"planted-by-form","columns":["a"],"expected_reports":100,"x":"' value='"}}'></form>
      <iframe name=sink></iframe><script>
      const A = {json.dumps(analyzer)}, body = {json.dumps(study)}, out = {{}};
      async function attempt(name, f) {{ try {{ const r = await f(); out[name] = r.type + ":" + r.status; }} catch (e) {{ out[name] = "blocked"; }} }}
      (async () => {{
        await attempt("simple", () => fetch(A + "/v1/studies", {{method: "POST", mode: "no-cors", headers: {{"Content-Type": "text/plain"}}, body, credentials: "include"}}));
        await attempt("bearer", () => fetch(A + "/v1/studies", {{method: "POST", headers: {{"Authorization": "Bearer {cluster.api_token}", "Content-Type": "application/json"}}, body}}));
        await attempt("read", () => fetch(A + "/v1/studies", {{credentials: "include"}}));
        document.getElementById("f").submit();
        setTimeout(() => {{ window.done = out; }}, 1500);
      }})();</script>"""

    class Attacker(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            data = page.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    from dpsketch.tools.cluster import free_port

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Attacker)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    before = {s["study_id"] for s in an.studies()}
    try:
        sign_in(driver, cluster)  # a console tab with the token in its session
        console_tab = driver.current_window_handle
        driver.switch_to.new_window("tab")
        driver.get(f"http://localhost:{server.server_address[1]}/")
        out = wait(driver, lambda d: d.execute_script("return window.done"), timeout=20)
        driver.close()
        driver.switch_to.window(console_tab)
    finally:
        server.shutdown()
        server.server_close()
    assert out["simple"] == "opaque:0"  # sent, but without the token, and unreadable
    assert out["bearer"] == "blocked" and out["read"] == "blocked"  # the preflight / CORS check fails
    assert {s["study_id"] for s in an.studies()} == before
    assert not [s for s in an.studies() if s["study"]["name"].startswith("planted")]


def test_a_study_name_is_text_never_markup(driver, cluster, an):
    name = '<img src=x onerror="window.pwned=1"><script>window.pwned=2</script>'
    study_id = an.create_study(name=name, columns=["a", "b"], expected_reports=1000)["study_id"]
    for fragment in ("/studies", f"/study/{study_id}"):
        go(driver, cluster, fragment)
        present(driver, f"a[href='#/study/{study_id}']" if fragment == "/studies" else "#study-id")
        assert js(driver, "return document.querySelectorAll('main img, main script').length") == 0
        assert name in css(driver, "main").text
        assert js(driver, "return window.pwned === undefined")
    assert page_errors(driver) == []


# --- accessibility -------------------------------------------------------------------------

def axe_violations(driver):
    if not js(driver, "return typeof window.axe === 'object'"):
        js(driver, AXE.read_text() + "\nreturn true;")
    result = driver.execute_async_script("""const done = arguments[arguments.length - 1];
        axe.run(document, {resultTypes: ['violations']}).then((r) => done(r.violations.map(
          (v) => ({id: v.id, impact: v.impact, nodes: v.nodes.map((n) => n.target.join(' ')).slice(0, 5)}))),
          (e) => done([{id: 'axe-error', nodes: [String(e)]}]));""")
    return result


def keyboard_reaches_every_control(driver):
    """Tab from the top of the page: every enabled, visible control gets the focus (a radio group
    is one stop), and a focused control shows an outline. The page logs each focus (focusin)
    with the focused control's outline, so all the Tab presses go in one WebDriver call."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    controls = js(driver, """
        const all = [...document.querySelectorAll('a[href], button, input, select, textarea, summary, [tabindex]:not([tabindex="-1"])')]
          .filter((e) => !e.disabled && e.getClientRects().length && getComputedStyle(e).visibility !== 'hidden'
                    && (e.tagName === 'SUMMARY' ? !e.parentElement.parentElement.closest('details:not([open])') : !e.closest('details:not([open])')));
        all.forEach((e, i) => { e.dataset.kbd = e.type === 'radio' ? 'radio:' + e.name : String(i); });
        window.focusLog = [];
        document.addEventListener('focusin', (event) => {
          const s = getComputedStyle(event.target);
          window.focusLog.push([event.target.dataset.kbd || null, s.outlineStyle, s.outlineWidth]);
        });
        document.activeElement && document.activeElement.blur();
        window.scrollTo(0, 0);
        return [...new Set(all.map((e) => e.dataset.kbd))];""")
    ActionChains(driver).send_keys(Keys.TAB * (len(controls) + 3)).perform()
    log = js(driver, "return window.focusLog")
    reached = {key for key, _, _ in log if key}
    unfocused = sorted({key for key, style, width in log if key and (style == "none" or width in ("0px", ""))})
    describe = "return [...document.querySelectorAll('[data-kbd]')].filter((e) => arguments[0].includes(e.dataset.kbd)).map((e) => e.outerHTML.slice(0, 120))"
    return js(driver, describe, sorted(set(controls) - reached)), js(driver, describe, unfocused)


def test_accessibility_every_view_passes_axe_and_the_keyboard(driver, cluster, an):
    study_id = STATE["gram"]
    histogram = next(s["study_id"] for s in an.studies() if s["study"]["kind"] == "histogram")
    checked = []
    driver.execute_script("sessionStorage.clear(); localStorage.clear()")
    go(driver, cluster, "/studies")
    present(driver, "#token")
    views = [("sign-in", None), ("studies", "/studies"), ("new", "/new"), ("study", f"/study/{study_id}"),
             ("histogram", f"/study/{histogram}"), ("ledger", f"/ledger/{POPULATION}")]
    for name, fragment in views:
        if fragment:
            if js(driver, "return sessionStorage.length") == 0:
                sign_in(driver, cluster)
            go(driver, cluster, fragment)
            present(driver, "h1")
        else:
            assert present(driver, "#token").is_displayed()
        if name == "new":
            fill(driver, "#expected-reports", 5000)
            present(driver, "#recommendation-table")
        if name == "study":
            for run in ("#regression-run", "#pca-run", "#logistic-run"):
                click(driver, run)
            present(driver, "#logistic-output figure")
            present(driver, "#pca-output figure")
            present(driver, "#regression-output figure")
        if name == "histogram":
            click(driver, "#histogram-run")
            present(driver, "#histogram-output [data-table='moments']")
        violations = axe_violations(driver)
        assert violations == [], (name, violations)
        if name in ("sign-in", "new", "study"):
            missing, unfocused = keyboard_reaches_every_control(driver)
            assert not missing and not unfocused, (name, missing, unfocused)
        if name == "sign-in":  # both checks catch what they look for: an unlabelled field, no outline
            js(driver, """document.getElementById('remember').style.outlineStyle = 'none';
                const bare = document.createElement('input'); bare.id = 'bare'; document.querySelector('main').append(bare);""")
            assert [v["id"] for v in axe_violations(driver)] == ["label"]
            missing, unfocused = keyboard_reaches_every_control(driver)
            assert not missing and len(unfocused) == 1 and 'id="remember"' in unfocused[0], unfocused
            js(driver, "document.getElementById('bare').remove()")
        checked.append(name)
    assert checked == [n for n, _ in views]
    assert page_errors(driver) == []
