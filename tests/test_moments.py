"""The moments study kind (issue 15): u(a a^T) alone, without the gram kind's [a, 1] features.

* Its feature map is the gram kind's middle block, its exact sensitivity is that of A^T A
  (sqrt(2) B^2 replace-one, B^2 add/remove; checked on random and extremal pairs), and the
  same epsilon needs 0.44 of the gram kind's noise variance at B = 1.
* Over real share servers, the analyzer and the SDK over HTTP: the release is exactly the ring sum
  of the clients' encoded u(a a^T) (no server noise on servers that allow it), the analyzer
  answers ridge and PCA from it and refuses what needs first moments; and at epsilon = 1 with
  the default floor its ridge fits are closer to the optimum than the gram kind's on the same
  data, numerically, over several data sets.
"""

from __future__ import annotations

import math

import httpx
import numpy as np
import pytest

from dpsketch.analyzer import error_ratios, synthetic
from dpsketch.analyzer.client import AnalyzerClient
from dpsketch.client_sdk import Client
from dpsketch.client_sdk.client import prepare_batch
from dpsketch.protocol import ProblemError, Study, design, features, privacy, ring
from dpsketch.protocol.noise import NOISE_TAIL_SIGMAS

from test_e2e import no_floor_module_cluster  # noqa: F401 (a fixture)

COLUMNS = ["x0", "x1", "x2", "y"]


def moments_study(n: int, columns=COLUMNS, **kw) -> Study:
    study, _ = design(name="moments", columns=list(columns), label=columns[-1], servers=["s1", "s2", "s3"],
                      expected_reports=n, kind="moments", seed="cd" * 32, **kw)
    return study


def test_features_are_the_gram_kinds_middle_block():
    a = np.random.default_rng(1).normal(size=(300, 5))
    m = features.moment_features(a)
    assert m.shape == (300, features.width("moments", 5)) == (300, 15)
    np.testing.assert_array_equal(m, features.gram_features(a)[:, 5:-1])
    np.testing.assert_allclose(features.symmetric_from_upper(m.sum(axis=0), 5), a.T @ a, rtol=1e-10, atol=1e-9)
    np.testing.assert_array_equal(features.client_vectors("moments", a), m)


@pytest.mark.parametrize("bound", [0.3, 1.0, 2.5])
def test_sensitivity_is_that_of_a_at_and_is_reached(bound):
    rng = np.random.default_rng(2)
    delta = privacy.sensitivity(bound, "replace-one", "moments")
    assert delta == pytest.approx(math.sqrt(2.0) * bound ** 2)
    a = rng.normal(size=(20_000, 4))
    b = rng.normal(size=(20_000, 4))
    a *= bound * rng.uniform(0, 1, (20_000, 1)) ** 0.25 / np.linalg.norm(a, axis=1, keepdims=True)
    b *= bound * rng.uniform(0, 1, (20_000, 1)) ** 0.25 / np.linalg.norm(b, axis=1, keepdims=True)
    diff = np.linalg.norm(features.moment_features(a) - features.moment_features(b), axis=1)
    assert diff.max() <= delta * (1 + 1e-12)
    # reached by two orthogonal rows of norm B
    e1, e2 = np.eye(4)[:1] * bound, np.eye(4)[1:2] * bound
    reached = np.linalg.norm(features.moment_features(e1) - features.moment_features(e2))
    assert reached == pytest.approx(delta)
    assert privacy.sensitivity(bound, "add-remove", "moments") == pytest.approx(
        np.linalg.norm(features.moment_features(e1)))


def test_design_validation_and_the_noise_it_saves():
    st = moments_study(10_000)
    assert (st.k, st.s, st.width, st.secret_sign) == (1, 1, 10, False)
    assert st.value_bound == pytest.approx(1.0 + NOISE_TAIL_SIGMAS * st.sigma)
    assert st.guarantees()["epsilon"] <= 1.0 + 1e-9
    gram, _ = design(name="g", columns=COLUMNS, label="y", servers=["s1", "s2", "s3"], expected_reports=10_000,
                     kind="gram", seed="cd" * 32)
    # noise variance per released coordinate, clients and servers: 2 B^4 / (2 B^4 + 2 B^2 + 1/2)
    var = lambda s: s.sigma ** 2 * 10_000 + s.n_servers * s.server_sigma ** 2  # noqa: E731
    assert var(st) / var(gram) == pytest.approx(2.0 / 4.5, rel=1e-4)
    fields = st.model_dump()
    with pytest.raises(ValueError, match="plain sum"):
        Study(**{**fields, "k": 4, "s": 4})
    with pytest.raises(ValueError, match="more than the study's epsilon"):
        Study(**{**fields, "sigma": st.sigma * 0.99})
    with pytest.raises(ValueError, match="secret_sign"):  # nothing to hide a sign in: u(a a^T) keeps it
        moments_study(1000, secret_sign=True)
    with pytest.raises(ValueError, match="k must be 1"):
        moments_study(1000, k=8)


# --- over real HTTP ---------------------------------------------------------------------------


def test_moments_release_over_http_is_the_sum_of_the_clients_second_moments(no_floor_module_cluster):
    """No server noise (servers that allow it): the released A^T A is exactly the ring sum of the
    clients' encoded u(a a^T) + noise, the analyzer fits ridge and PCA on it, shows no row sum or
    count, and refuses an analysis that needs first moments."""
    c = no_floor_module_cluster
    n = 3000
    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        created = an.create_study(name="moments-e2e", columns=COLUMNS, label="y", expected_reports=n,
                                  kind="moments", min_reports=n, epsilon_floor=None)
    study = Study.model_validate(created["study"])
    assert study.kind == "moments" and study.width == 10 and study.k == 1 and study.server_sigma == 0
    assert "secret_sign" not in created["study"]

    rng = np.random.default_rng(5)
    rows = rng.normal(0, 0.4, size=(n, 4))
    batch = prepare_batch(study, rows)
    encoded = ring.reconstruct(batch.shares)
    assert encoded.shape == (n, 10)
    for j, url in enumerate(c.server_urls):
        r = httpx.post(f"{url}/v1/studies/{study.study_id}/batches", content=batch.body(j), timeout=60,
                       headers={"Content-Type": batch.media_type(j)})
        assert r.status_code == 200, r.text
    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        assert an.finalize(study.study_id)["n_reports"] == n
        released = np.array(an.sketch(study.study_id)["sketch"])
        gram = an.gram(study.study_id)
        ridge = an.ridge(study.study_id)
        pca = an.pca(study.study_id, n_components=2)
        with pytest.raises(ProblemError) as bad:  # logistic needs the row sum for its intercept
            an.logistic(study.study_id, label="y")
    assert bad.value.status == 422 and "row sum" in bad.value.detail
    expected = ring.decode(encoded.sum(axis=0, dtype=np.uint64), study.frac_bits)
    np.testing.assert_array_equal(released.reshape(-1), expected)
    g = np.array(gram["gram"])
    assert gram["kind"] == "moments" and gram.get("row_sum") is None and gram.get("noisy_count") is None
    np.testing.assert_allclose(g, features.symmetric_from_upper(expected, 4), rtol=1e-12, atol=1e-9)
    # the noise added is the study's: each client's 10 encoded moments minus those of its clipped
    # row have sd sigma (30,000 draws: the estimate's own sd is about 0.4 %)
    clipped = rows * np.minimum(1.0, study.clip_bound / np.linalg.norm(rows, axis=1))[:, None]
    noise = ring.decode(encoded, study.frac_bits) - features.moment_features(clipped)
    assert noise.std() == pytest.approx(study.sigma, rel=0.03)
    # and the release is their sum: A^T A of the clipped rows plus that noise, exactly
    err = features.upper_triangle(g - clipped.T @ clipped)
    np.testing.assert_allclose(err, noise.sum(axis=0), atol=1e-6 * math.sqrt(n))
    assert len(ridge["coef"]) == 3 and len(pca["components"]) == 2


def test_moments_fit_better_than_gram_on_the_same_data(no_floor_module_cluster):
    """epsilon = 1, the default floor, three servers, d = 10 + label, n = 5,000 through the SDK and
    the analyzer: per data set one gram and one moments study, over 12 data sets. The moments
    study's noise variance is 0.44 of the gram study's, and the ridge excess (ratio - 1 with the
    benchmark's penalty 1e-3 n) falls accordingly. Simulated at these parameters (the release's
    law: the exact feature sum plus N(0, n sigma^2 + N server_sigma^2) per coordinate, 4,000 runs
    per data set and kind, ``python tests/test_moments.py``): mean excess 0.26 -> 0.11, the ratio
    of the mean excess of 12 runs (moments / gram) has median 0.43 and is at or above 1 in 1.8e-5
    of 10^6 resampled groups (at n = 10^4 the law of the ratio is the same: 1.9e-5). With 6 data
    sets at n = 10^4 (the former test, the same upload volume) it was 1.4e-3. A kind that changed
    nothing still fails half the time (the ratio's median is then 1)."""
    n, seeds = 5_000, list(range(11, 23))
    excess = {"gram": [], "moments": []}
    cluster = no_floor_module_cluster  # its policy also takes studies with the default floor
    with AnalyzerClient(cluster.analyzer.url, cluster.api_token) as an, Client(cluster.server_urls) as client:
        for seed in seeds:
            data = synthetic.regression_data(n, 10, seed=seed, clip_quantile=0.99, row_bound=1.0)
            x, y = data.features(), data.target()
            alpha = error_ratios.default_alpha(n, 1.0)
            for kind in excess:
                view = an.create_study(name=f"{kind}-{seed}", columns=list(data.columns), label=data.label,
                                       expected_reports=n, min_reports=n, kind=kind)
                study = Study.model_validate(view["study"])
                assert study.kind == kind and view["guarantees"]["epsilon"] <= 1.0 + 1e-9
                client.submit_many(study.study_id, data.rows, batch_size=n)
                assert an.finalize(study.study_id)["n_reports"] == n
                coef = np.array(an.ridge(study.study_id, label=data.label, alpha=alpha)["coef"])
                excess[kind].append(error_ratios.ridge_ratio(x, y, coef, alpha) - 1.0)
    g, m = np.array(excess["gram"]), np.array(excess["moments"])
    print(f"ridge excess over {len(seeds)} data sets: gram {g.mean():.4f} ({g.round(4)}), "
          f"moments {m.mean():.4f} ({m.round(4)}); ratio {m.mean() / g.mean():.3f}")
    assert m.mean() < g.mean()


def _simulate(runs: int = 4000, n: int = 5_000, sets: int = 12, draws: int = 1_000_000, seed: int = 0) -> None:
    """The test's law in memory: per data set and kind the study as the analyzer designs it, its
    release drawn as the exact sum of the clients' feature vectors plus the clients' and servers'
    noise (what ``simulation.simulate_ltm`` draws for these kinds), the analyzer's ridge; then the
    ratio of mean excess over one run per data set, resampled ``draws`` times, and the same for a
    kind that changed nothing (gram against gram)."""
    from dpsketch.analyzer import simulation
    from dpsketch.analyzer.estimators import RidgeRegression
    from dpsketch.analyzer.release import GramSumRelease

    rng = np.random.default_rng(seed)
    excess = np.zeros((sets, 2, runs))
    for i in range(sets):
        data = synthetic.regression_data(n, 10, seed=11 + i, clip_quantile=0.99, row_bound=1.0)
        x, y, alpha = data.features(), data.target(), error_ratios.default_alpha(n, 1.0)
        for v, kind in enumerate(("gram", "moments")):
            study, _ = design(name=kind, columns=list(data.columns), label=data.label, servers=["s1", "s2", "s3"],
                              expected_reports=n, min_reports=n, kind=kind)
            total = features.client_vectors(kind, simulation.clip_rows(data.rows, study.row_bound)).sum(axis=0)
            sd = math.sqrt(study.sigma ** 2 * n + simulation.server_noise_variance(study))
            for r in range(runs):
                release = GramSumRelease(study=study, values=total + rng.normal(0.0, sd, study.width), n_reports=n)
                coef = RidgeRegression(label=data.label, alpha=alpha).fit(release).coef_
                excess[i, v, r] = error_ratios.ridge_ratio(x, y, coef, alpha) - 1.0
    print(f"mean excess: gram {excess[:, 0].mean():.4f}, moments {excess[:, 1].mean():.4f}")
    pick = lambda v: excess[np.arange(sets), v, rng.integers(0, runs, (draws, sets))]  # noqa: E731
    gram, moments, gram2 = pick(0), pick(1), pick(0)
    ratio, null = moments.mean(1) / gram.mean(1), gram2.mean(1) / gram.mean(1)
    print(f"{sets} runs: ratio quantiles 50/99/99.99 % {np.quantile(ratio, [0.5, 0.99, 0.9999]).round(3).tolist()}; "
          f"P(test fails) {(ratio >= 1).mean():.1e}; P(a kind that changed nothing passes) {(null < 1).mean():.2f}")


if __name__ == "__main__":
    import sys

    _simulate(int(sys.argv[1]) if len(sys.argv) > 1 else 4000)
