"""Client-side micro-benchmarks with no network: what seed compression and sealing cost per row.
Used by ``dpsketch bench`` and the tests; they build the same bytes the SDK uploads."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from dpsketch.protocol import binding, envelope, messages, ring
from dpsketch.protocol.study import design

from dpsketch.client_sdk.prepare import prepare_batch


def bench_compression(n: int = 100_000, d: int = 6, n_servers: int = 3,
                      repeats: int = 3) -> dict[str, Any]:
    """What a client pays to prepare ``n`` rows of ``d`` columns for ``n_servers`` servers
    (``prepare_batch``: clip, noise, encode, share, bind) with full shares and with
    seed-compressed shares, and to encode the upload bodies; no network. ``share_seconds`` times
    the sharing step alone (``ring.share`` against ``ring.share_with_seeds``: the seed expansion
    without the noise and binding around it). Each mode is timed ``repeats`` times, the modes
    alternating, and the medians are reported, with the ratios seeds / full of the same run
    (``prepare_ratio``, ``share_ratio``) and the bytes each row uploads."""
    study = design(name="bench", columns=[f"x{i}" for i in range(d)], label=None,
                   servers=[f"s{j + 1}" for j in range(n_servers)], expected_reports=n, k=16, s=4)[0]
    rows = np.random.default_rng(0).normal(0.0, 0.3, size=(n, d))
    prepare_batch(study, rows[:10], compress=True)  # the seed expansion's compiled loop, loaded
    encoded = ring.random_ring((n, d))
    modes = ("full", "compressed")
    times: dict[str, dict[str, list[float]]] = {m: {"prepare": [], "encode": [], "share": []} for m in modes}
    size: dict[str, float] = {}
    for _ in range(repeats):
        for mode in modes:
            seeded = mode == "compressed"
            t0 = time.perf_counter()
            batch = prepare_batch(study, rows, compress=seeded)
            t1 = time.perf_counter()
            size[mode] = sum(len(batch.body(j)) for j in range(n_servers)) / n
            t2 = time.perf_counter()
            ring.share_with_seeds(encoded, n_servers) if seeded else ring.share(encoded, n_servers)
            t3 = time.perf_counter()
            for key, seconds in (("prepare", t1 - t0), ("encode", t2 - t1), ("share", t3 - t2)):
                times[mode][key].append(seconds)
    out: dict[str, Any] = {
        mode: {"bytes_per_row": size[mode],
               **{f"{key}_seconds": round(float(np.median(v)), 4) for key, v in times[mode].items()}}
        for mode in modes}
    for key in ("prepare", "share"):
        out[f"{key}_ratio"] = round(out["compressed"][f"{key}_seconds"] / out["full"][f"{key}_seconds"], 3)
    out.update(n=n, d=d, n_servers=n_servers, repeats=repeats)
    return out


def bench_encryption(n: int = 20_000, d: int = 6, n_servers: int = 3) -> dict[str, dict[str, float]]:
    """Bytes per row and microseconds per row (all ``n_servers`` shares of it) to build the
    upload bodies of ``n`` rows of ``d`` columns in plaintext, and to seal them to fresh X25519
    keys (client side) and open them again (server side, ``envelope.open_batch``), as one
    version 4 batch per server (``sealed``, the one sealed layout); no network. Times are CPU seconds of
    this process (``time.process_time``), less disturbed than wall time by other work."""
    from cryptography.hazmat.primitives.asymmetric import x25519

    encoded = ring.random_ring((n, d))
    shares = ring.share(encoded, n_servers)
    study_id = "00" * 32
    ids, proofs = binding.bind(study_id, [binding.CONTENT_SHARE] * n_servers, shares)
    t0 = time.process_time()
    plain = [messages.encode_batch(ids, proofs[j], shares[j]) for j in range(n_servers)]
    t1 = time.process_time()
    us = 1e6 / n
    out: dict[str, dict[str, float]] = {
        "plaintext": {"bytes_per_row": sum(map(len, plain)) / n, "encode_us_per_row": (t1 - t0) * us}}
    keys = [envelope.generate_private_key() for _ in range(n_servers)]
    private = [x25519.X25519PrivateKey.from_private_bytes(k) for k in keys]
    for name, version in (("sealed", envelope.VERSION_4),):  # the one sealed layout (1 to 3 were dropped)
        recipients = [envelope.Recipient(f"s{j + 1}", envelope.public_key_of(k), version=version)
                      for j, k in enumerate(keys)]
        t2 = time.process_time()
        sealed = [envelope.seal_body(recipients[j], study_id, plain[j], messages.SHARES_MEDIA_TYPE, d, n_servers)
                  for j in range(n_servers)]
        t3 = time.process_time()
        opened = [envelope.open_batch(sealed[j], d, n_servers, study_id, f"s{j + 1}",
                                      lambda _kid, key=private[j]: key) for j in range(n_servers)]
        t4 = time.process_time()
        for j, upload in enumerate(opened):
            upload.verify(study_id, n_servers, j)
            if not np.array_equal(upload.shares(d), shares[j]):  # pragma: no cover - a broken envelope
                raise AssertionError("a sealed share did not open to itself")
        out[name] = {"version": version, "bytes_per_row": sum(map(len, sealed)) / n,
                     "seal_us_per_row": (t3 - t2) * us, "open_us_per_row": (t4 - t3) * us,
                     "seal_us_per_share": (t3 - t2) * us / n_servers,
                     "open_us_per_share": (t4 - t3) * us / n_servers}
    return out
