"""Prometheus updates kept as plain numbers (dpsketch/observability.py Tally) scrape exactly as
the same updates made on the prometheus_client series directly: counters and histograms (every
bucket, sum and count), updates from several threads, and updates racing with scrapes."""

from __future__ import annotations

import random
import threading

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from dpsketch.observability import LATENCY_BUCKETS, HttpMetrics, Tally


def _samples(registry: CollectorRegistry, prefix: str) -> dict:
    out = {}
    for family in registry.collect():
        for s in family.samples:
            if s.name.startswith(prefix) and not s.name.endswith("_created"):
                out[(s.name[len(prefix):], tuple(sorted(s.labels.items())))] = s.value
    return out


def _pair():
    """Two registries with the same series: one updated directly, one through a Tally."""
    direct, tallied = CollectorRegistry(), CollectorRegistry()
    tally = Tally(tallied)
    made = {}
    for name, reg in (("direct", direct), ("tallied", tallied)):
        c = Counter("x_events", "events", ["route", "status"], registry=reg)
        h = Histogram("x_seconds", "seconds", ["route"], buckets=LATENCY_BUCKETS, registry=reg)
        made[name] = (c, h)
    (dc, dh), (tc, th) = made["direct"], made["tallied"]
    return direct, tallied, (dc, dh), (tally.counter(tc), tally.histogram(th))


def test_counters_and_histograms_scrape_as_direct_updates():
    direct, tallied, (dc, dh), (tc, th) = _pair()
    rng = random.Random(3)
    edges = [b for b in LATENCY_BUCKETS] + [0.0, 1e-9, 1e9]  # on a bound counts in that bucket
    for i in range(5000):
        route, status = rng.choice("ab"), rng.choice(["200", "422"])
        amount = rng.choice([1, 2, 7, 250])
        dc.labels(route, status).inc(amount)
        tc(route, status).inc(amount)
        v = rng.choice(edges) if i % 3 == 0 else rng.expovariate(50)
        dh.labels(route).observe(v)
        th(route).observe(v)
        if i % 997 == 0:  # scrapes in between add only what is new
            assert _samples(tallied, "x_") == _samples(direct, "x_")
    assert _samples(tallied, "x_") == _samples(direct, "x_")
    assert generate_latest(tallied).count(b"x_seconds_bucket") == generate_latest(direct).count(b"x_seconds_bucket")


def test_updates_from_threads_racing_with_scrapes_are_all_counted():
    registry = CollectorRegistry()
    tally = Tally(registry)
    c = tally.counter(Counter("y_events", "events", ["route"], registry=registry))
    h = tally.histogram(Histogram("y_seconds", "seconds", ["route"], buckets=(0.1, 1.0), registry=registry))
    per_thread, threads = 20_000, 4
    done = threading.Event()

    def work():
        for i in range(per_thread):
            c("r").inc()
            h("r").observe(0.5 if i % 2 else 0.05)

    def scrape_meanwhile():
        while not done.is_set():
            _samples(registry, "y_")

    scraper = threading.Thread(target=scrape_meanwhile)
    scraper.start()
    workers = [threading.Thread(target=work) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    done.set()
    scraper.join()
    got = _samples(registry, "y_")
    total = per_thread * threads
    assert got[("events_total", (("route", "r"),))] == total
    assert got[("seconds_count", (("route", "r"),))] == total
    assert got[("seconds_bucket", (("le", "0.1"), ("route", "r")))] == total / 2
    assert got[("seconds_bucket", (("le", "1.0"), ("route", "r")))] == total
    assert abs(got[("seconds_sum", (("route", "r"),))] - total / 2 * 0.55) < 1e-6


def test_http_metrics_in_flight_and_negative_increments():
    registry = CollectorRegistry()
    m = HttpMetrics(registry)
    m.in_flight_now += 3
    assert registry.get_sample_value("dpsketch_http_requests_in_flight") == 3
    m.requests_of("r", "GET", "200").inc()
    assert registry.get_sample_value("dpsketch_http_requests_total", {"route": "r", "method": "GET", "status": "200"}) == 1
    try:
        m.requests_of("r", "GET", "200").inc(-1)
    except ValueError:
        pass
    else:  # pragma: no cover
        raise AssertionError("a counter took a negative increment")
