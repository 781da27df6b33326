"""The vectors of conformance/noise.json (docs/protocol.md sections 5 and 5a): what a client draws
from a batch's keystream key, bit for bit. Imported by make_conformance.py.

Every draw here goes through the product's code (``dpsketch.protocol.keystream``, ``noise``,
``client_sdk.prepare``) from a key fixed by the vector's id, so another implementation that reads
the stream in the documented order gets the same numbers; ``bytes_used`` says how far into the
stream each draw went, which tells an implementation that disagrees where it went astray.
tests/test_conformance.py recomputes them with a scalar implementation written from the text.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import numpy as np

from dpsketch.protocol import report as report_path
from dpsketch.client_sdk.prepare import prepare_batch
from dpsketch.protocol import binding, noise, ring
from dpsketch.protocol.keystream import Keystream
from dpsketch.protocol.study import Study, design

DESCRIPTION = (
    "The client's randomness from a batch's keystream key (docs/protocol.md sections 5 and 5a). Every "
    "stream is ChaCha20 (RFC 8439) under key, block counter 0, nonce the 12 ASCII bytes dpsketch/rng; "
    "bytes_used is how many stream bytes the draw consumed. keystream: its first bytes, and the first "
    "64-bit words, 32-bit words and bits of fresh streams. block_table: the sampler's inverse-CDF table "
    "for (t, limit): block m, entries floor(limit / m), every bound floor(2^64 F_j) (decimal strings; "
    "first 8 and last 4 when there are more than 64) and bounds_sha256 over all of them as little-endian "
    "uint64. uniform_below, bernoulli_exp: the sampler's two exact primitives. sampler: count draws of "
    "N_Z(t) cut at |X| <= limit. secret_sign: the +-1 of each of m rows. noise_parameters: a study's clip "
    "bound B', noise grid and the sampler parameters of its clients and servers. batch: a whole client "
    "batch from its key (signs, encoded vectors, noise, shares or seeds, salts, commitments, report ids, "
    "proofs and each server's body); rows are inside the ball, so nothing is clipped.")


def key_of(name: str) -> bytes:
    """The keystream key of a vector: SHA-256 of its id (any fixed 32 bytes would do)."""
    return hashlib.sha256(b"dpsketch/conformance/noise/" + name.encode()).digest()


def _dec(values) -> list[str]:
    return [str(int(v)) for v in np.asarray(values).reshape(-1).tolist()]


def keystream_vectors() -> list[dict[str, Any]]:
    out = []
    for name in ("keystream-a", "keystream-b"):
        key = key_of(name)
        first = Keystream.from_key(key).bytes(96)
        out.append({"id": name, "type": "keystream", "key": key.hex(), "bytes": first.hex(),
                    "words64": _dec(Keystream.from_key(key).words(4)),
                    "words32": _dec(Keystream.from_key(key).words32(4)),
                    "bits": [int(b) for b in Keystream.from_key(key).bits(20)]})
    return out


#: (id, t, limit, count): m = 1 (t = 1, 3), two-value blocks with 32-bit Bernoulli words (t = 200),
#: a last block cut at the limit, both sides of the 32/64-bit word switch (2 t^2 < 2^24 iff t <= 2896),
#: a real study's client parameters, the largest t, a limit of 0 (every draw 0).
SAMPLER_CASES = [
    ("t1", 1, 19, 100), ("t3", 3, 59, 100), ("t200", 200, 3999, 100), ("t200-partial-block", 200, 3998, 100),
    ("t2896", 2896, 57919, 100), ("t2897", 2897, 57939, 100), ("t5000", 5000, 99999, 100),
    ("t100000-partial-block", 100_000, 1_999_999, 100), ("study-client", 225_440, 4_508_793, 200),
    ("t-max", 1 << 24, 20 * (1 << 24) - 1, 50), ("limit0", 5, 0, 20),
]


def table_vectors() -> list[dict[str, Any]]:
    out = []
    seen = set()
    for _, t, limit, _count in SAMPLER_CASES:
        if (t, limit) in seen:
            continue
        seen.add((t, limit))
        table = noise._block_table(t, limit)
        bounds = [int(b) for b in table.bounds.tolist()]
        vec = {"id": f"table-t{t}-l{limit}", "type": "block_table", "t": t, "limit": limit,
               "block": table.block, "entries": len(bounds),
               "bounds_sha256": hashlib.sha256(table.bounds.astype("<u8").tobytes()).hexdigest()}
        if len(bounds) <= 64:
            vec["bounds"] = [str(b) for b in bounds]
        else:
            vec["first"] = [str(b) for b in bounds[:8]]
            vec["last"] = [str(b) for b in bounds[-4:]]
        out.append(vec)
    return out


def primitive_vectors() -> list[dict[str, Any]]:
    out = []
    for bound, count in ((3, 40), (2202, 40), ((1 << 28) + 3, 20), (1 << 63, 20)):
        name = f"uniform-below-{bound}"
        stream = Keystream.from_key(key_of(name))
        values = noise.uniform_below(count, bound, stream)
        out.append({"id": name, "type": "uniform_below", "key": key_of(name).hex(), "bound": str(bound),
                    "count": count, "values": _dec(values), "bytes_used": stream.position})
    for den in (80_000, 16_773_632, 16_785_218, 101_647_396_096):  # 2 t^2 for t = 200, 2896, 2897, 225440
        name = f"bernoulli-exp-{den}"
        nums = np.array([0, 1, den // 1000, den // 10, den // 5, den // 2, den - 1, den] * 5, dtype=np.uint64)
        stream = Keystream.from_key(key_of(name))
        bits = noise.bernoulli_exp(nums, den, stream)
        out.append({"id": name, "type": "bernoulli_exp", "key": key_of(name).hex(), "den": str(den),
                    "nums": _dec(nums), "results": [int(b) for b in bits], "bytes_used": stream.position})
    return out


def sampler_vectors() -> list[dict[str, Any]]:
    out = []
    for name, t, limit, count in SAMPLER_CASES:
        stream = Keystream.from_key(key_of(name))
        draws = noise.discrete_gaussian(count, t, limit, stream)
        out.append({"id": f"sampler-{name}", "type": "sampler", "key": key_of(name).hex(), "t": t, "limit": limit,
                    "count": count, "draws": [int(x) for x in draws.tolist()], "bytes_used": stream.position})
    for m in (1, 8, 13):
        name = f"secret-sign-{m}"
        stream = Keystream.from_key(key_of(name))
        flips = stream.bits(m)
        out.append({"id": name, "type": "secret_sign", "key": key_of(name).hex(), "rows": m,
                    "signs": [-1 if f else 1 for f in flips.tolist()], "bytes_used": stream.position})
    return out


def _studies() -> list[tuple[str, Study]]:
    base = dict(columns=["x1", "x2", "y"], label="y", servers=["s1", "s2", "s3"], expected_reports=10_000,
                epsilon=1.0)
    studies = [
        ("sketch-signed", design(name="noise sketch", seed="a1" * 32, **base)[0]),
        ("sketch-unsigned-add-remove", design(name="noise sketch ar", seed="a2" * 32, secret_sign=False,
                                              neighbouring="add-remove", **base)[0]),
        ("sketch-bounds", design(name="noise bounds", seed="a3" * 32,
                                 bounds=[[16.0, 90.0], [0.0, 100.0], [0.0, 1e4]], **base)[0]),
        ("gram", design(name="noise gram", kind="gram", seed="a4" * 32, **base)[0]),
        ("moments", design(name="noise moments", kind="moments", seed="a5" * 32, **base)[0]),
        ("l1", design(name="noise l1", kind="l1", seed="a6" * 32, **{**base, "expected_reports": 100_000})[0]),
        ("histogram", design(name="noise histogram", kind="histogram", columns=[], label=None, servers=["s1", "s2"],
                             expected_reports=10_000, seed="a7" * 32,
                             histogram={"axes": [{"column": "age", "edges": [18, 30.5, 65]},
                                                 {"column": "city", "categories": ["a", "b"]}]})[0]),
        ("parties", design(name="noise parties", columns=[], label="y", servers=["s1", "s2"], expected_reports=10_000,
                           seed="a8" * 32, parties=[{"name": "bank", "columns": ["x1", "x2"]},
                                                    {"name": "shop", "columns": ["y"]}])[0]),
        ("gram-no-floor", design(name="noise gram no floor", kind="gram", seed="a9" * 32, epsilon_floor=None,
                                 **base)[0]),
    ]
    return studies


def _grid_params(study: Study) -> dict[str, Any]:
    grid = study.noise_grid
    client = None
    if study.sigma > 0:
        client = {"t": grid.scale(study.sigma), "limit": grid.limit(study.sigma)}
    server = None
    if study.server_sigma > 0:
        std = study.server_noise_std
        server = {"std": std, "t": grid.scale(std), "limit": grid.limit(std)}
    return {"shift": grid.shift, "spacing": grid.spacing, "client": client, "server": server}


def parameter_vectors() -> list[dict[str, Any]]:
    out = []
    for name, study in _studies():
        parties = None
        if study.parties is not None:
            h = study.noise_grid.spacing
            parties = [{"name": p.name, "clip_bound": max(0.0, p.row_bound - h * math.sqrt(p.width) / 2.0)}
                       for p in study.parties]
        out.append({"id": f"parameters-{name}", "type": "noise_parameters", "study": study.model_dump(mode="json"),
                    "study_id": study.study_id, "width": study.width, "clip_bound": study.clip_bound,
                    **_grid_params(study), "party_clip_bounds": parties})
    return out


def batch_vectors() -> list[dict[str, Any]]:
    studies = dict(_studies())
    rng = np.random.default_rng(5)
    out = []
    cases = [("sketch-signed", False, None), ("sketch-bounds", True, 1), ("gram", False, None),
             ("histogram", True, 0)]
    for name, compress, full in cases:
        study = studies[name]
        m = 5
        if study.histogram is not None:
            rows = [[float(rng.choice([10.0, 20.0, 40.0, 70.0])), str(rng.choice(["a", "b", "zz"]))] for _ in range(m)]
            values = np.array(rows, dtype=object)
        elif study.bounds is not None:
            lo = np.array([b[0] for b in study.bounds])
            hi = np.array([b[1] for b in study.bounds])
            values = np.round(lo + (hi - lo) * rng.uniform(0.1, 0.9, (m, study.d)), 3)
            rows = values.tolist()
        else:
            values = np.round(rng.uniform(-0.5, 0.5, (m, study.d)), 4)  # norms below 0.87: nothing clipped
            rows = values.tolist()
        key = key_of(f"batch-{name}")
        stream = Keystream.from_key(key)
        batch = prepare_batch(study, values, compress=compress, full=full, stream=stream)
        # the same stream again, step by step, for the intermediate values the vector states
        replay = Keystream.from_key(key)
        vectors = report_path.client_vectors(values, study)
        signs = None
        if study.secret_sign:
            flips = replay.bits(m)
            signs = [-1 if f else 1 for f in flips.tolist()]
            vectors = vectors * np.where(flips, -1.0, 1.0)[:, None]
        grid = study.noise_grid
        encoded = ring.encode_on_grid(vectors, study.frac_bits, grid.shift, study.value_bound)
        after_signs = replay.position
        draws = np.zeros(encoded.size, dtype=np.int64)
        if study.sigma > 0:
            draws = noise.discrete_gaussian(encoded.size, grid.scale(study.sigma), grid.limit(study.sigma), replay)
        after_noise = replay.position
        noisy = (encoded + (draws << grid.shift).reshape(encoded.shape)).view(np.uint64)
        assert np.array_equal(ring.reconstruct([batch.share(j) for j in range(study.n_servers)]), noisy)
        n = study.n_servers
        salts = [np.asarray(batch.proofs[j])[:, :16] for j in range(n)]
        commitments = []
        for i in range(m):
            row = []
            for j in range(n):
                seeded = batch.seeds is not None and batch.seeds[j] is not None
                payload = bytes(batch.seeds[j][i]) if seeded else batch.shares[j][i].astype("<u8").tobytes()
                content = binding.CONTENT_SEED if seeded else binding.CONTENT_SHARE
                row.append(hashlib.sha256(binding.COMMIT_DOMAIN + bytes((j, content)) + bytes(salts[j][i])
                                          + payload).digest()[:16].hex())
            commitments.append(row)
        servers = []
        for j in range(n):
            seeded = batch.seeds is not None and batch.seeds[j] is not None
            servers.append({"position": j, "media_type": batch.media_type(j),
                            "seeds": [bytes(s).hex() for s in batch.seeds[j]] if seeded else None,
                            "share": [_dec(r) for r in batch.share(j)],
                            "salts": [bytes(s).hex() for s in salts[j]],
                            "proofs": [bytes(p).hex() for p in batch.proofs[j]],
                            "body": batch.body(j).hex()})
        out.append({"id": f"batch-{name}", "type": "batch", "study": study.model_dump(mode="json"),
                    "study_id": study.study_id, "key": key.hex(), "compress": compress,
                    "full": (n - 1 if full is None else full) if compress else None,
                    "rows": rows, "clip_bound": study.clip_bound, **_grid_params(study),
                    "signs": signs, "vectors": vectors.tolist(), "encoded": [_dec(r) for r in encoded.view(np.uint64)],
                    "noise": [int(x) for x in draws.tolist()], "noisy": [_dec(r) for r in noisy],
                    "bytes_after_signs": after_signs, "bytes_after_noise": after_noise,
                    "commitments": commitments, "report_ids": [r.hex() for r in batch.report_ids],
                    "servers": servers, "bytes_used": stream.position})
    return out


def noise_vectors() -> list[dict[str, Any]]:
    return (keystream_vectors() + table_vectors() + primitive_vectors() + sampler_vectors() + parameter_vectors()
            + batch_vectors())
