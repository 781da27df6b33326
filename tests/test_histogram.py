"""Histogram studies over real processes (docs/protocol.md section 2b): the bins, the SDK with raw
values, exact reconstruction of the noisy counts, refusals, and the analyzer's statistics."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from dpsketch.analyzer.client import AnalyzerClient
from dpsketch.client_sdk import Client, InvalidDataError
from dpsketch.protocol import ProblemError, Study, ring
from dpsketch.protocol.histogram import Axis, HistogramSpec, HistogramValueError

from conftest import Cluster, cluster_for_module
from studies import record_batches

AGE = {"column": "age", "edges": [18, 30, 50, 70]}  # cells: <18, [18,30), [30,50), [50,70), >=70
SMOKER = {"column": "smoker", "categories": ["yes", "no"]}  # cells: yes, no, (other)
NO_FLOOR = {"DPSKETCH_MAX_FLOOR_EPSILON": "none"}


def test_bins_put_every_value_in_one_cell():
    axis = Axis(**AGE)
    assert axis.bins == 5 and axis.labels() == ["< 18", "[18, 30)", "[30, 50)", "[50, 70)", ">= 70"]
    got = axis.index([-1e300, 17.99, 18, 29.9, 30, 69.99, 70, 1e300, float("inf"), float("-inf")]).tolist()
    assert got == [0, 0, 1, 1, 2, 3, 4, 4, 4, 0]
    cat = Axis(**SMOKER)
    assert cat.index(["yes", " no ", "No", "", 1]).tolist() == [0, 1, 2, 2, 2]
    spec = HistogramSpec(axes=[AGE, SMOKER])
    assert spec.shape == (5, 3) and spec.cells == 15
    cells = spec.cell_index(np.array([[25, "no"], [90, "maybe"], ["17", "yes"]], dtype=object))
    assert cells.tolist() == [1 * 3 + 1, 4 * 3 + 2, 0 * 3 + 0]
    with pytest.raises(HistogramValueError, match="row 1, column age"):
        spec.cell_index(np.array([[25, "no"], ["old", "no"]], dtype=object))
    with pytest.raises(HistogramValueError, match="NaN"):
        axis.index([1.0, float("nan")])
    with pytest.raises(ValueError, match="strictly increasing"):
        Axis(column="a", edges=[1, 1])
    with pytest.raises(ValueError, match="either edges"):
        Axis(column="a", edges=[1], categories=["x"])


@pytest.fixture(scope="module")
def exact_cluster(tmp_path_factory) -> Iterator[Cluster]:
    """Servers that accept studies without server noise (exact releases), shared by the module's
    tests that use them: each creates a study of its own and looks only at it."""
    with cluster_for_module(tmp_path_factory, "hist-exact", api_token="tok-" + "h" * 16,
                            server_env={s: NO_FLOOR for s in ("s1", "s2", "s3")}) as c:
        yield c


def test_histogram_study_end_to_end_is_exact_and_keeps_out_of_range_values(exact_cluster, monkeypatch):
    c = exact_cluster
    sent = record_batches(monkeypatch)
    rng = np.random.default_rng(4)
    n = 3000
    ages = rng.normal(45, 20, size=n)
    ages[:5] = [-3, 17.5, 70, 150, 1e9]  # out of the edges: the outer cells hold them
    smoker = rng.choice(["yes", "no", "n/a"], size=n, p=[0.3, 0.6, 0.1])
    rows = np.column_stack([ages, smoker]).astype(object)
    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        created = an.create_study(name="hist", kind="histogram", histogram={"axes": [AGE, SMOKER]},
                                  expected_reports=n, min_reports=n, epsilon_floor=None)
        study = Study.model_validate(created["study"])
        assert study.kind == "histogram" and study.width == 15 and study.columns == ["age", "smoker"]
        with Client(c.server_urls) as client:
            client.submit_many(study.study_id, rows, batch_size=700)
            client.submit(study.study_id, {"smoker": "yes", "age": 33})  # a dict, by name
        fin = an.finalize(study.study_id)
        assert fin["n_reports"] == n + 1
        view = an.sketch(study.study_id)
        hist = an.histogram(study.study_id)
    # the release is exactly the sum of what the clients sent (one-hot + noise, on the ring)
    expected = np.zeros(study.width, dtype=np.uint64)
    for batch in sent:
        expected += ring.reconstruct(batch.shares if batch.seeds is None else
                                     [batch.share(j) for j in range(3)]).sum(axis=0, dtype=np.uint64)
    released = np.asarray(view["sketch"]).reshape(-1)
    np.testing.assert_array_equal(released, ring.decode(expected, study.frac_bits))
    # and close to the true counts, out-of-range values in the outer cells
    true = np.zeros(15)
    np.add.at(true, HistogramSpec(axes=[AGE, SMOKER]).cell_index(rows), 1)
    true[2 * 3 + 0] += 1  # the single submit: [30, 50) x yes
    assert true[0:3].sum() >= 2 and true[12:15].sum() >= 3  # <18 and >=70 rows hold the outliers
    sd = math.sqrt(hist["noise_variance"])
    assert hist["n_reports"] == n + 1 and hist["shape"] == [5, 3]
    assert hist["axes"][1]["labels"] == ["yes", "no", "(other)"]
    counts = np.asarray(hist["counts"]).reshape(-1)
    assert np.all(np.abs(counts - true) < 6 * sd + 1e-9)
    ci = np.asarray(hist["counts_ci"]).reshape(-1, 2)
    assert np.all(ci[:, 0] <= counts) and np.all(counts <= ci[:, 1])


def test_malformed_values_are_refused_before_anything_is_sent(exact_cluster, tmp_path):
    c = exact_cluster
    study_cli = [sys.executable, "-m", "dpsketch.tools.cli", "study", "--analyzer", c.analyzer.url, "--token", c.api_token]
    out = subprocess.run(study_cli + ["create", "--name", "hist-bad", "--kind", "histogram", "--axis",
                                      "age:18,30,50,70", "--expected-reports", "200", "--min-reports", "100",
                                      "--no-floor"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    created = json.loads(out.stdout)
    assert created["study"]["histogram"]["axes"] == [{"column": "age", "edges": [18, 30, 50, 70],
                                                    "categories": None}]  # protocol.md 2b: unused member null
    sid = created["study_id"]
    bad_axis = subprocess.run(study_cli + ["create", "--name", "x", "--kind", "histogram", "--axis", "age:18,old",
                                           "--expected-reports", "200"], capture_output=True, text=True, timeout=120)
    assert bad_axis.returncode != 0 and "numeric edges must be numbers" in bad_axis.stderr
    with Client(c.server_urls) as client:
        for bad in ([[30], ["forty"]], [[float("nan")]]):
            with pytest.raises(InvalidDataError):
                client.submit_many(sid, np.array(bad, dtype=object))
        with pytest.raises(InvalidDataError):
            client.submit(sid, ["n/a"])
        assert set(client.report_counts(sid).values()) == {0}  # nothing reached any server
    csv = tmp_path / "ages.csv"
    csv.write_text("age\n20\n35\nunknown\n40\n")
    out = subprocess.run([sys.executable, "-m", "dpsketch.tools.cli", "submit", "--study", sid, "--servers",
                          ",".join(c.server_urls), str(csv)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "'unknown' is not a number" in out.stderr
    assert all(httpx.get(f"{u}/v1/studies/{sid}").json()["report_count"] == 0 for u in c.server_urls)
    csv.write_text("age\n20\n35\n99\n40\n")
    out = subprocess.run([sys.executable, "-m", "dpsketch.tools.cli", "submit", "--study", sid, "--servers",
                          ",".join(c.server_urls), "--compress", str(csv)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert all(httpx.get(f"{u}/v1/studies/{sid}").json()["report_count"] == 4 for u in c.server_urls)


def test_statistics_over_rest_and_their_refusals(servers):
    """A released two-axis histogram answers every statistic with a value near the non-private
    one (within 6 of its own standard errors plus the binning); the wrong questions get 422."""
    c = Cluster(servers, 3, api_token="tok-" + "s" * 16)  # the default floor: servers add noise
    rng = np.random.default_rng(9)
    n = 4000
    score = rng.normal(0, 1, n)
    label = np.where(rng.random(n) < 1 / (1 + np.exp(-2 * score)), "1", "0")
    spec = {"axes": [{"column": "score", "edges": list(np.linspace(-2.5, 2.5, 11))},
                     {"column": "label", "categories": ["0", "1"]}]}
    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        created = an.create_study(name="stats", kind="histogram", histogram=spec, expected_reports=n,
                                  min_reports=n, epsilon=4.0)
        sid = created["study_id"]
        assert created["guarantees"]["floor_epsilon"] <= 4.0 + 1e-6
        with Client(c.server_urls) as client:
            client.submit_many(sid, np.column_stack([score, label]).astype(object))
        an.finalize(sid)
        auc = an.statistic(sid, "auc", score="score", label="label", positive="1")
        tau = an.statistic(sid, "kendall-tau")
        gmd = an.statistic(sid, "gini-mean-difference", column="score")
        simpson = an.statistic(sid, "gini-simpson", column="label")
        moments = an.statistic(sid, "moments", column="score")
        quantiles = an.statistic(sid, "quantiles", column="score", probabilities=[0.1, 0.5, 0.9])
        refusals = []
        for name, body in [("quantiles", {"column": "label"}), ("moments", {"column": "nope"}),
                           ("auc", {"score": "score", "label": "label", "positive": "2"}),
                           ("ridge", {}), ("gini-simpson", {})]:
            with pytest.raises(ProblemError) as err:
                an.statistic(sid, name, **body)
            refusals.append((err.value.status, err.value.slug))
    assert refusals == [(422, "invalid-request")] * 5
    out = subprocess.run([sys.executable, "-m", "dpsketch.tools.cli", "study", "--analyzer", c.analyzer.url, "--token",
                          c.api_token, "auc", sid, "--score", "score", "--label", "label", "--positive", "1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["value"] == auc["value"]  # the same post-processing of the same release
    from sklearn.metrics import roc_auc_score
    from scipy.stats import kendalltau

    cells = HistogramSpec.model_validate(spec).axes[0].index(score)
    true_auc = roc_auc_score((label == "1").astype(int), cells)
    true_tau = kendalltau(cells, (label == "1").astype(int)).statistic
    for got, truth in ((auc, true_auc), (tau, true_tau)):
        assert got["ci"][0] <= got["value"] <= got["ci"][1]
        assert abs(got["value"] - truth) < 6 * got["se"] + 1e-6, (got, truth)
    assert 0 < simpson["value"] < 1 and gmd["value"] > 0
    assert abs(moments["value"] - 0.0) < 0.2  # the binned mean of a centred normal
    q = quantiles["quantiles"]
    assert q[0] < q[1] < q[2] and abs(q[1]) < 0.3


def test_recommend_says_where_a_histogram_stops_fitting():
    """The plan's storage is what the servers will check (Study.max_storage_bytes of the designed
    study), and its noise is the designed study's; beyond the default storage it says so."""
    from dpsketch.analyzer.recommend import histogram_plan
    from dpsketch.protocol.study import DEFAULT_MAX_STUDY_BYTES, design

    spec = {"axes": [{"column": "x", "edges": list(range(1, 12))}, {"column": "y", "edges": list(range(1, 12))}]}
    study, _ = design(name="p", columns=[], label=None, servers=["s1", "s2", "s3"], expected_reports=10**6,
                      kind="histogram", histogram=spec)
    plan = histogram_plan(144, 10**6)
    assert plan["server_storage_bytes"] == study.max_storage_bytes and plan["fits_default_server_storage"]
    assert plan["sigma"] == pytest.approx(study.sigma, rel=1e-9)
    assert plan["server_sigma"] == pytest.approx(study.server_sigma, rel=1e-9)
    cells = plan["max_cells_in_default_storage"]
    assert histogram_plan(cells, 10**6)["fits_default_server_storage"]
    assert not histogram_plan(cells + 1, 10**6)["fits_default_server_storage"]
    out = subprocess.run([sys.executable, "-m", "dpsketch.tools.cli", "recommend", "--histogram-cells", "8192",
                          "--expected-reports", "100000"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "over their default 32 GiB" in out.stdout
    assert histogram_plan(8192, 100_000)["server_storage_bytes"] > DEFAULT_MAX_STUDY_BYTES
