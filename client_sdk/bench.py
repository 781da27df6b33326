"""Client-side micro-benchmarks with no network: what seed compression and sealing cost per row.
Used by ``dpsketch bench`` and the tests; they build the same bytes the SDK uploads."""

from __future__ import annotations

import time

import numpy as np

from dpsketch.protocol import binding, envelope, messages, ring

from .prepare import PreparedBatch


def bench_compression(n: int = 100_000, d: int = 6, n_servers: int = 3) -> dict[str, dict[str, float]]:
    """Bytes per row and seconds to prepare (noise, encode, share) and encode the upload bodies
    of ``n`` rows of ``d`` columns, with full shares and seed-compressed; no network."""
    encoded = ring.random_ring((n, d))
    study_id = "00" * 32
    out: dict[str, dict[str, float]] = {}
    for mode in ("full", "compressed"):
        t0 = time.perf_counter()
        if mode == "full":
            shares = ring.share(encoded, n_servers)
            ids, proofs = binding.bind(study_id, [binding.CONTENT_SHARE] * n_servers, shares)
            batch = PreparedBatch(ids, proofs, shares)
        else:
            seeds, last = ring.share_with_seeds(encoded, n_servers)
            contents = [binding.CONTENT_SEED] * (n_servers - 1) + [binding.CONTENT_SHARE]
            ids, proofs = binding.bind(study_id, contents, [*seeds, last])
            batch = PreparedBatch(ids, proofs, [None] * len(seeds) + [last], seeds)
        t1 = time.perf_counter()
        total = sum(len(batch.body(j)) for j in range(n_servers))
        t2 = time.perf_counter()
        out[mode] = {"bytes_per_row": total / n, "share_seconds": t1 - t0, "encode_seconds": t2 - t1}
    return out


def bench_encryption(n: int = 20_000, d: int = 6, n_servers: int = 3) -> dict[str, dict[str, float]]:
    """Bytes per row and microseconds per row (all ``n_servers`` shares of it) to build the
    upload bodies of ``n`` rows of ``d`` columns in plaintext, and to seal them to fresh X25519
    keys (client side) and open them again (server side, ``envelope.open_batch``), as one
    version 3 batch per server (``sealed``, what the SDK sends) and as version 1 records, one
    HPKE seal each (``sealed_v1``, what it sent before); no network. Times are CPU seconds of
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
    for name, version in (("sealed", envelope.VERSION_3), ("sealed_v1", envelope.VERSION_1)):
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
