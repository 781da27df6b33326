"""Write the conformance vectors of docs/protocol.md section 10 into conformance/.

    .venv/bin/python scripts/make_conformance.py            # (re)write conformance/*.json
    .venv/bin/python scripts/make_conformance.py --check    # exit 1 if a vector would change
    .venv/bin/python scripts/make_conformance.py --out DIR  # write elsewhere

Deterministic: every input comes from fixed seeds (numpy's PCG64, never a CSPRNG: these are test
data, not noise anyone relies on), so running it twice gives the same bytes on one machine; on
another, the analyses' floats may differ in their last bits (BLAS), so ``--check`` compares
floats within the tolerance each vector states (everything else exactly). The expected outputs
are computed with the product's code (``dpsketch.protocol`` and the analyzer's HTTP routes);
``tests/test_conformance.py`` recomputes every one of them from the inputs and compares. Another
implementation reads the same files (each is self-describing: see its ``description`` and every
vector's ``type``) and checks itself against them.

Seven files, one per category:

* ``study_ids.json``: JSON values and studies -> canonical bytes (hex) -> SHA-256 / study id;
* ``ring.json``: fixed-point encoding and decoding, additive sharing, seed-compressed sharing;
* ``sketch.json``: report ids -> OSNAP rows and signs, l1-sketch rows, a server's aggregate share
  and certificate over a small inclusion set;
* ``analyses.json``: released aggregate shares of a study -> the decoded release and the
  analyzer's responses (views and analyses), floats with a stated tolerance;
* ``noise.json``: a keystream key -> the sampler's draws, the secret signs and a whole client batch,
  bit for bit (``conformance_noise.py``);
* ``sealing.json``: the sealing suites' KEMs (X-Wing's combiner) and HPKE key schedule, byte for
  byte, a sealed batch of a party's blocks and a sealed batch proof record
  (``conformance_sealing.py``);
* ``accounting.json``: the add/remove accounting: the presence pair's epsilon and add/remove
  studies' guarantees with the verdict a client must reach (``conformance_accounting.py``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))  # conformance_noise, conformance_sealing

from dpsketch.protocol import canonical, features, l1sketch, ring, sketch  # noqa: E402
from dpsketch.protocol.study import Study, design  # noqa: E402

OUT = ROOT / "conformance"
FORMAT = "dpsketch-conformance/1"
#: The version of docs/protocol.md these vectors belong to (its first line).
SPEC_VERSION = "2.7"
PROTOCOL = "dpsketch/2"
#: How a float is compared: |got - want| <= atol + rtol * |want| (per vector or per analysis).
TOLERANCE_RULE = "|got - want| <= atol + rtol * |want|, element by element; null stands for a non-finite value"

U64 = 1 << 64


def header(category: str, description: str) -> dict[str, Any]:
    return {"format": FORMAT, "spec_version": SPEC_VERSION, "protocol": PROTOCOL, "category": category,
            "description": description, "tolerance_rule": TOLERANCE_RULE}


def dec(values) -> Any:
    """uint64 ring elements as decimal strings (nested like the array): JSON numbers lose them."""
    arr = np.asarray(values, dtype=np.uint64)
    return np.vectorize(lambda v: str(int(v)), otypes=[object])(arr).tolist() if arr.ndim else str(int(arr))


# --- 1. canonical JSON and study ids ----------------------------------------------------------

def rfc8785_like_string(s: str) -> str:
    """A true RFC 8785 (JSON.stringify) string: only ", \\ and controls escaped, the rest raw."""
    return json.dumps(s, ensure_ascii=False)


def _rfc8785_equal(value: Any) -> bool:
    """Whether a true RFC 8785 encoder (raw UTF-8 strings, integers as IEEE doubles) gives the
    same bytes as ours for this value."""
    def walk(v: Any) -> bool:
        if isinstance(v, str):
            return rfc8785_like_string(v) == json.dumps(v, ensure_ascii=True)
        if isinstance(v, bool) or v is None:
            return True
        if isinstance(v, int):
            return abs(v) <= 2 ** 53
        if isinstance(v, float):
            return True
        if isinstance(v, list):
            return all(walk(x) for x in v)
        if isinstance(v, dict):
            keys = list(v)
            utf16 = sorted(keys, key=lambda k: k.encode("utf-16-be"))
            return sorted(keys) == utf16 and all(walk(k) and walk(x) for k, x in v.items())
        raise TypeError(type(v))

    return walk(value)


CANONICAL_VALUES: list[tuple[str, str, Any]] = [
    ("del", "U+007F (DEL) is escaped as \\u007f (RFC 8785 would write the raw byte 0x7f)",
     {"name": "rates\x7f2026"}),
    ("latin1", "non-ASCII letters are \\uXXXX, lower-case hex (RFC 8785: raw UTF-8)",
     {"name": "\u00c9tudes f\u00fcr Z\u00fcrich"}),
    ("cjk-and-emoji", "a supplementary character (U+1F600) is its UTF-16 surrogate pair, each unit escaped",
     {"name": "\u6771\u4eac \U0001F600"}),
    ("controls", "controls: the five short escapes \\b \\t \\n \\f \\r, every other code point below U+0020 as \\u00xx",
     {"s": "\x00\x01\b\t\n\x0b\f\r\x1b\x1f"}),
    ("quote-backslash-slash", "\" and \\ are \\\" and \\\\; / is not escaped; U+2028/U+2029 are \\u2028/\\u2029",
     {"s": "a\"b\\c/d\u2028e\u2029"}),
    ("printable-ascii", "printable ASCII U+0020..U+007E other than \" and \\ is written as is (RFC 8785 agrees)",
     {"s": "".join(chr(c) for c in range(0x20, 0x7f))}),
    ("numbers", "numbers: ECMAScript Number.prototype.toString (shortest round trip)",
     {"n": [1.0, -0.0, 0.0, 1e-7, 1e-6, 0.000123, 1e20, 1e21, 1.5e300, 123.456, 0.1, 5e-324,
            1.7976931348623157e308, -2.5, 100, -7, 4096.0, 1e-320]}),
    ("big-integer", "an integer above 2^53 is written in full decimal (RFC 8785 would round it to a double); no "
     "member of a study can hold one", {"n": [9007199254740993, 2 ** 53, 1 << 40]}),
    ("member-order", "members sorted by code point (for these ASCII/BMP names the same as RFC 8785's UTF-16 order), "
     "nested objects too; true, false, null, empty containers",
     {"b": {"z": True, "a": False, "A": None, "_": [], "aa": {}}, "a": 1, "\u00e9": "x", "Z": [True, None]}),
]


def _study_inputs() -> list[tuple[str, str, Study]]:
    base = dict(columns=["x1", "x2", "y"], label="y", servers=["s1", "s2"], expected_reports=10_000,
                seed="00" * 31 + "2a", epsilon=1.0)
    sketch_study, _ = design(name="conformance sketch study", **base)
    unsigned, _ = design(name="conformance sketch study", secret_sign=False, **base)
    out = [
        ("study-ascii", "an ordinary sketch study (ASCII name; secret_sign true, the default for a sketch "
         "study): RFC 8785 gives the same bytes", sketch_study),
        ("study-unsigned", "the same study without the secret sign (secret_sign false: the member is omitted, "
         "and the noise is the plain Gaussian calibration's)", unsigned),
        ("study-del", "the same study named with a DEL (U+007F): its id differs from a raw-UTF-8 encoder's",
         sketch_study.model_copy(update={"name": "rates\x7f2026"})),
        ("study-non-ascii", "the same study with a non-ASCII name (\\u escapes, a surrogate pair)",
         sketch_study.model_copy(update={"name": "\u00c9tude \u6771\u4eac \U0001F600"})),
        ("study-escapes", "the same study with a name holding a tab, a quote, a backslash, a slash and a newline",
         sketch_study.model_copy(update={"name": "tab\tquote\"back\\slash/new\nline"})),
    ]
    gram, _ = design(name="conformance gram study", kind="gram", **{**base, "columns": ["x1", "x2", "x3", "y"]})
    out.append(("study-gram", "a gram study (k = s = 1, width d(d+3)/2 + 1 = 15 for d = 4)", gram))
    hist, _ = design(name="conformance histogram \u00e9", kind="histogram", columns=[], label=None,
                     servers=["s1", "s2"], expected_reports=10_000, seed="11" * 32,
                     histogram={"axes": [{"column": "age", "edges": [18, 30.5, 65]},
                                         {"column": "city", "categories": ["Z\u00fcrich", "Gen\u00e8ve"]}]})
    out.append(("study-histogram", "a histogram study: every axis has column, edges and categories (the unused one "
                "null); width = (3+1) * (2+1) = 12 cells", hist))
    marginal, _ = design(name="conformance marginal histogram", kind="histogram", columns=[], label=None,
                         servers=["s1", "s2"], expected_reports=10_000, seed="44" * 32,
                         histogram={"marginal": True,
                                    "axes": [{"column": "age", "edges": [18, 30.5, 65]},
                                             {"column": "city", "categories": ["Z\u00fcrich", "Gen\u00e8ve"]},
                                             {"column": "wage", "edges": [0, 1000, 2500, 1e4]}]})
    out.append(("study-histogram-marginal", "a marginal histogram study (histogram member marginal true; "
                "omitted when false): 3 axes side by side, width = (3+1) + (2+1) + (4+1) = 12 cells, "
                "row_bound = sqrt(3) = 1.7320508075688772 (the norm of a vector with one 1 per axis)",
                marginal))
    l1, _ = design(name="conformance l1 study", kind="l1", **{**base, "seed": "22" * 32})
    out.append(("study-l1", "an l1 study (member l1; k = s * level0_buckets + levels * buckets)", l1))
    parties, _ = design(name="conformance parties study", columns=[], label="y", servers=["s1", "s2"],
                        expected_reports=10_000, seed="33" * 32,
                        parties=[{"name": "bank", "columns": ["x1", "x2"]}, {"name": "shop", "columns": ["y"]}])
    out.append(("study-parties", "a sketch study with parties (member parties)", parties))
    moments, _ = design(name="conformance moments study", kind="moments", **{**base, "seed": "99" * 32})
    out.append(("study-moments", "a moments study (k = s = 1, width d(d+1)/2 = 6 for d = 3)", moments))
    return out


def study_id_vectors() -> dict[str, Any]:
    vectors = []
    for vid, description, value in CANONICAL_VALUES:
        data = canonical.canonical_json(value)
        vectors.append({"id": vid, "type": "canonical_json", "description": description, "input": value,
                        "canonical": data.decode("ascii"), "canonical_hex": data.hex(),
                        "sha256": hashlib.sha256(data).hexdigest(),
                        "same_as_rfc8785": _rfc8785_equal(value)})
    for vid, description, study in _study_inputs():
        obj = study.model_dump(mode="json")
        data = study.canonical()
        vectors.append({"id": vid, "type": "study", "description": description, "input": obj,
                        "canonical": data.decode("ascii"), "canonical_hex": data.hex(),
                        "study_id": study.study_id, "same_as_rfc8785": _rfc8785_equal(obj),
                        "derived": {"d": study.d, "width": study.width, "k": study.k, "s": study.s,
                                    "aggregate_cells": study.k * study.width,
                                    "share_bytes": study.share_bytes}})
    return {**header("study_ids", "Canonical JSON and study ids (docs/protocol.md, 'Study id'). type canonical_json: "
                     "canonical_json(input) must be the ASCII bytes canonical_hex (= canonical) and sha256 their "
                     "SHA-256. type study: input is a study object as a server receives it; it must validate and "
                     "its canonical encoding and study_id (lower-case hex SHA-256 of it) must match; derived gives "
                     "d, the share width and the aggregate size. same_as_rfc8785 says whether a true RFC 8785 "
                     "encoder would produce the same bytes."),
            "vectors": vectors}


# --- 2. ring -----------------------------------------------------------------------------------

def ring_vectors() -> dict[str, Any]:
    vectors = []
    cases = [
        ("zero", 0.0, 20, 10.0), ("one", 1.0, 20, 10.0), ("minus-one", -1.0, 20, 10.0),
        ("half-lsb-even", 2.5 * 2.0 ** -20, 20, 10.0), ("half-lsb-odd", 3.5 * 2.0 ** -20, 20, 10.0),
        ("minus-half-lsb", -2.5 * 2.0 ** -20, 20, 10.0), ("tiny", 1e-6, 20, 10.0), ("pi", 3.14159, 20, 10.0),
        ("f0-tie", 2.5, 0, 10.0), ("f0-negative-tie", -0.5, 0, 10.0),
        ("bound", 10.0, 40, 10.0), ("minus-bound", -10.0, 40, 10.0), ("f62", 1.5, 62, 1.75),
    ]
    for vid, x, f, bound in cases:
        enc = ring.encode(np.array([x]), f, bound)
        vectors.append({"id": f"encode-{vid}", "type": "encode", "x": x, "frac_bits": f, "bound": bound,
                        "encoded": dec(enc[0]), "decoded": float(ring.decode(enc, f)[0])})
    for vid, x, f, bound in [("above-bound", 10.5, 20, 10.0), ("below-minus-bound", -10.000001, 20, 10.0)]:
        with_error = None
        try:
            ring.encode(np.array([x]), f, bound)
        except ring.EncodingRangeError:
            with_error = True
        assert with_error
        vectors.append({"id": f"encode-{vid}", "type": "encode", "x": x, "frac_bits": f, "bound": bound,
                        "encoded": None, "refused": True})
    for vid, value, f in [("sum-wraps-negative", U64 - 3 * (1 << 10), 10), ("max-positive", (1 << 63) - 1, 30),
                          ("min-negative", 1 << 63, 30), ("plain", 123456789, 8)]:
        vectors.append({"id": f"decode-{vid}", "type": "decode", "ring": str(value), "frac_bits": f,
                        "value": float(ring.decode(np.array([value], dtype=np.uint64), f)[0])})
    rng = np.random.default_rng(20261124)
    for vid, n in [("two-servers", 2), ("three-servers", 3), ("five-servers", 5)]:
        x = ring.encode(rng.normal(0, 2, 4), 24, 20.0)
        randoms = [rng.integers(0, U64, size=4, dtype=np.uint64, endpoint=False) for _ in range(n - 1)]
        last = x.copy()
        for r in randoms:
            last -= r
        assert np.array_equal(ring.reconstruct(randoms + [last]), x)
        vectors.append({"id": f"share-{vid}", "type": "share", "n_servers": n, "x": dec(x),
                        "random_shares": [dec(r) for r in randoms], "last_share": dec(last)})
    for vid, n, width in [("two-servers", 2, 3), ("three-servers", 3, 5)]:
        x = ring.encode(rng.normal(0, 2, width), 24, 20.0)
        seeds = [bytes(rng.integers(0, 256, size=32, dtype=np.uint8)) for _ in range(n - 1)]
        expanded = [ring.expand_seed(s, width) for s in seeds]
        last = x.copy()
        for e in expanded:
            last -= e
        vectors.append({"id": f"seed-share-{vid}", "type": "seed_share", "n_servers": n, "width": width,
                        "x": dec(x), "seeds": [s.hex() for s in seeds], "expanded": [dec(e) for e in expanded],
                        "last_share": dec(last)})
    return {**header("ring", "Fixed-point ring encoding and sharing (docs/protocol.md section 4). Ring elements are "
                     "decimal strings (uint64). encode: x with |x| <= bound encodes as round_half_even(x * "
                     "2^frac_bits) mod 2^64, or is refused (refused: true, encoded null); decoded is the element "
                     "read back (two's complement / 2^frac_bits). decode: a ring element (e.g. a sum) to its real "
                     "value. share: the last server's share is x minus the other shares mod 2^64. seed_share: "
                     "each seed expands to width elements (ChaCha20 keystream, section 4); the last share is x "
                     "minus the expanded seeds."),
            "vectors": vectors}


# --- 3. sketch ----------------------------------------------------------------------------------

def sketch_vectors() -> dict[str, Any]:
    vectors = []
    seeds = [bytes(range(32)), bytes.fromhex("00" * 31 + "2a")]
    ids = [bytes(16), bytes(range(16)), b"\xff" * 16, hashlib.sha256(b"conformance").digest()[:16]]
    for seed in seeds:
        for k, s in [(1, 1), (8, 2), (12, 3), (400, 4), (1 << 20, 8), (7, 1)]:
            rows, signs = sketch.hash_report_ids(seed, ids, k, s)
            for i, rid in enumerate(ids):
                digest = hashlib.blake2b(sketch.DOMAIN + rid, digest_size=8 * s, key=seed).digest()
                vectors.append({"id": f"osnap-{seed.hex()[:4]}-k{k}-s{s}-{rid.hex()[:4]}", "type": "osnap",
                                "seed": seed.hex(), "k": k, "s": s, "report_id": rid.hex(), "digest": digest.hex(),
                                "rows": rows[i].tolist(), "buckets": [int(r - l * (k // s)) for l, r in enumerate(rows[i])],
                                "signs": signs[i].tolist()})
    for seed in seeds[:1]:
        for shape in [dict(s=2, level0_buckets=32, levels=4, buckets=32, branching=2),
                      dict(s=1, level0_buckets=64, levels=2, buckets=16, branching=3)]:
            spec = l1sketch.L1Spec(**shape)
            more = ids + [hashlib.sha256(bytes([i])).digest()[:16] for i in range(12)]
            for rid in more:
                vectors.append({"id": f"l1-s{spec.s}-b{spec.branching}-{rid.hex()[:6]}", "type": "l1",
                                "seed": seed.hex(), **shape, "k": spec.k, "report_id": rid.hex(),
                                "rows": l1sketch.rows_of(seed, rid, spec)})
    # a server's aggregate share over an inclusion set, and its certificate
    rng = np.random.default_rng(7)
    for kind, k, s, width in [("sketch", 8, 2, 3), ("l1", None, 2, 2)]:
        seed = bytes(rng.integers(0, 256, 32, dtype=np.uint8))
        report_ids = sorted(bytes(rng.integers(0, 256, 16, dtype=np.uint8)) for _ in range(40))
        shares = rng.integers(0, U64, size=(len(report_ids), width), dtype=np.uint64)
        if kind == "l1":
            shape = dict(s=s, level0_buckets=4, levels=2, buckets=2, branching=2)
            spec = l1sketch.L1Spec(**shape)
            k = spec.k
            rows, signs = l1sketch.hash_report_ids(seed, report_ids, spec)
        else:
            shape = {}
            rows, signs = sketch.hash_report_ids(seed, report_ids, k, s)
        acc = np.zeros((k, width), dtype=np.uint64)
        sketch.accumulate(acc, rows, signs, shares)
        sst = np.zeros((k, k), dtype=np.int64)
        sketch.accumulate_gram(sst, rows, signs)
        if kind == "l1":
            lev = l1sketch.leverages(rows, signs, k, 0, M=sst)
            cert = {"max_leverage": float(lev.max()), "lambda_min": float(1.0 / lev.max())}
        else:
            cert = {"lambda_min": float(np.linalg.eigvalsh(sst / s)[0])}
        inclusion = b"".join(report_ids)
        vectors.append({"id": f"aggregate-{kind}", "type": "aggregate", "kind": kind, "seed": seed.hex(), "k": k,
                        "s": s, **({"l1": shape} if shape else {}), "width": width,
                        "report_ids": [r.hex() for r in report_ids], "shares": dec(shares),
                        "aggregate": dec(acc), "aggregate_hex": acc.astype("<u8").tobytes().hex(),
                        "sst_times_s" if kind == "sketch" else "sst": sst.tolist(),
                        "inclusion_hash": hashlib.sha256(inclusion).hexdigest(), **cert,
                        "tolerance": {"rtol": 1e-9, "atol": 1e-9}})
    return {**header("sketch", "The public sketch (docs/protocol.md sections 3 and 2c). osnap: report id -> digest "
                     "(BLAKE2b keyed with the seed), rows (l*b + h_l within the k rows), buckets h_l and signs g_l. "
                     "l1: report id -> the rows of its 0/1 column (level-0 rows, then the sampled level's row if "
                     "any). aggregate: one server's aggregate share before its noise (k x width, row-major; also "
                     "as the application/x-dpsketch-aggregate body aggregate_hex) for the shares of the sorted "
                     "inclusion set report_ids, its inclusion hash, and the certificate input: for sketch "
                     "sst_times_s = s S S^T (integers) and lambda_min = lambda_min(S S^T); for l1 sst = S S^T and "
                     "the largest leverage (t = 0) with lambda_min = 1 / it."),
            "vectors": vectors}


# --- 4. releases and analyses ------------------------------------------------------------------

def analyzer_client(study: Study, ring_sum: np.ndarray, n_reports: int):
    """A TestClient on the analyzer's real app, over a one-study stand-in coordinator that holds
    this released ring sum (the analyses are the app's routes, byte for byte)."""
    from fastapi.testclient import TestClient

    from dpsketch.analyzer.app import create_app

    record = SimpleNamespace(study=study, state="released", ring_sum=ring_sum, n_reports=n_reports,
                             explanation=[], inclusion_hash="00" * 32)

    class Stand:
        config = SimpleNamespace(api_token=None, server_ids=list(study.servers))

        def record(self, study_id):
            assert study_id == study.study_id, study_id
            return record

    return TestClient(create_app(Stand()))


def _release_case(name: str, description: str, study: Study, vectors: np.ndarray, n_servers_noise_rng,
                  analyses: list[tuple[str, str, dict | None, dict]]) -> dict[str, Any]:
    """Encode the clients' noisy vectors, sketch them, add each server's noise, split into the N
    aggregate shares; then ask the analyzer for every analysis."""
    rng = n_servers_noise_rng
    m = vectors.shape[0]
    ids = [bytes(rng.integers(0, 256, 16, dtype=np.uint8)) for _ in range(m)]
    enc = ring.encode(vectors, study.frac_bits, study.value_bound)
    rows, signs = study.hash_report_ids(ids)
    total = np.zeros(study.aggregate_shape, dtype=np.uint64)
    sketch.accumulate(total, rows, signs, enc)
    n = study.n_servers
    shares = [rng.integers(0, U64, size=study.aggregate_shape, dtype=np.uint64) for _ in range(n - 1)]
    last = total.copy()
    for sh in shares:
        last -= sh
    shares.append(last)
    std = study.server_noise_std
    for j in range(n):
        if std > 0:
            noise = np.clip(rng.normal(0.0, std, study.aggregate_shape), -20 * std, 20 * std)
            shares[j] = shares[j] + ring.encode(noise, study.frac_bits, 20 * std)
    ring_sum = ring.reconstruct(shares)
    release = ring.decode(ring_sum, study.frac_bits) * study.entry_scale
    client = analyzer_client(study, ring_sum, m)
    out = []
    for aid, path, body, tol in analyses:
        url = path.replace("{id}", study.study_id)
        r = client.post(url, json=body) if body is not None else client.get(url)
        assert r.status_code == 200, (aid, r.status_code, r.text)
        out.append({"id": aid, "method": "POST" if body is not None else "GET", "path": path,
                    "request": body, "response": r.json(), "tolerance": tol})
    return {"id": name, "type": "release", "description": description, "study": study.model_dump(mode="json"),
            "study_id": study.study_id, "n_reports": m,
            "aggregate_shares": [sh.astype("<u8").tobytes().hex() for sh in shares],
            "ring_sum": dec(ring_sum), "entry_scale": study.entry_scale, "release": release.tolist(),
            "release_tolerance": {"rtol": 1e-15, "atol": 0.0}, "analyses": out}


def _clip(rows: np.ndarray, bound: float) -> np.ndarray:
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    return rows * np.minimum(1.0, bound / np.maximum(norms, 1e-300))


TIGHT = {"rtol": 1e-7, "atol": 1e-9}


def analysis_vectors() -> dict[str, Any]:
    releases = []
    rng = np.random.default_rng(1124)
    # sketch study: d = 4 (x1, x2, x3, y), k = 40, s = 4, three servers, signed (the default); x3 small
    # so that the default ridge alpha exceeds tau and the eigenvalue floor is reached (alpha = 50)
    n = 6000
    x = rng.normal(0, 0.4, (n, 3)) * np.array([1.0, 0.7, 0.15])
    y = x @ np.array([0.8, -0.5, 0.3]) + rng.normal(0, 0.1, n)
    a = _clip(np.column_stack([x, y]), 1.0)
    study, _ = design(name="conformance sketch release", columns=["x1", "x2", "x3", "y"], label="y",
                      servers=["s1", "s2", "s3"], expected_reports=n, epsilon=2.0, k=40, s=4, seed="44" * 32)
    if study.secret_sign:  # the default for a sketch study: each row signed whole before its noise
        a = a * rng.choice(np.array([-1.0, 1.0]), size=n)[:, None]
    noisy = a + rng.normal(0, study.sigma, a.shape)
    releases.append(_release_case(
        "sketch-ridge-pca", "a sketch study (k = 40, s = 4, three servers): views, ridge with the default and an "
        "explicit alpha, least squares with and without debiasing, PCA", study, noisy, rng,
        [("sketch-view", "/v1/studies/{id}/sketch", None, TIGHT),
         ("gram-view", "/v1/studies/{id}/gram", None, TIGHT),
         ("ridge-default-alpha", "/v1/studies/{id}/analyses/ridge", {}, TIGHT),
         ("ridge-alpha-50", "/v1/studies/{id}/analyses/ridge", {"alpha": 50.0}, TIGHT),
         ("ridge-features-label", "/v1/studies/{id}/analyses/ridge", {"label": "x1", "alpha": 0.0}, TIGHT),
         ("least-squares", "/v1/studies/{id}/analyses/least-squares", {}, TIGHT),
         ("least-squares-no-debias", "/v1/studies/{id}/analyses/least-squares", {"debias": False}, TIGHT),
         ("pca-2", "/v1/studies/{id}/analyses/pca", {"n_components": 2}, TIGHT),
         ("pca-4-no-debias", "/v1/studies/{id}/analyses/pca", {"n_components": 4, "debias": False}, TIGHT)]))
    # gram study with a binary label: d = 4 (x1, x2, x3, y), two servers
    n = 5000
    x = rng.normal(0, 0.35, (n, 3))
    p = 1 / (1 + np.exp(-(x @ np.array([2.0, -1.5, 0.5]) + 0.3)))
    y = (rng.random(n) < p).astype(float)
    a = np.column_stack([_clip(x, 1.0), y])  # ||a|| <= sqrt(2) = B
    study, _ = design(name="conformance gram release", columns=["x1", "x2", "x3", "y"], label="y",
                      servers=["s1", "s2"], expected_reports=n, epsilon=2.0, kind="gram", row_bound=math.sqrt(2),
                      seed="55" * 32)
    phi = features.gram_features(a)
    noisy = phi + rng.normal(0, study.sigma, phi.shape)
    releases.append(_release_case(
        "gram-regression-logistic", "a gram study (k = s = 1, width 15): views, ridge, least squares, PCA, logistic "
        "regression (both calibrations)", study, noisy, rng,
        [("sketch-view", "/v1/studies/{id}/sketch", None, TIGHT),
         ("gram-view", "/v1/studies/{id}/gram", None, TIGHT),
         ("ridge-default-alpha", "/v1/studies/{id}/analyses/ridge", {}, TIGHT),
         ("least-squares", "/v1/studies/{id}/analyses/least-squares", {}, TIGHT),
         ("pca-3", "/v1/studies/{id}/analyses/pca", {"n_components": 3}, TIGHT),
         ("logistic-gaussian", "/v1/studies/{id}/analyses/logistic", {}, {"rtol": 1e-6, "atol": 1e-8}),
         ("logistic-taylor", "/v1/studies/{id}/analyses/logistic", {"calibration": "taylor", "alpha": 10.0},
          {"rtol": 1e-6, "atol": 1e-8})]))
    # histogram study: score (numeric, 5 cells) x group (categorical, 3 cells), two servers
    n = 8000
    group = rng.choice(["a", "b", "c"], size=n, p=[0.5, 0.4, 0.1])
    score = np.clip(rng.normal(np.where(group == "b", 0.65, 0.4), 0.2), -0.5, 1.5)
    study, _ = design(name="conformance histogram release", columns=[], label=None, servers=["s1", "s2"],
                      expected_reports=n, epsilon=2.0, kind="histogram", seed="66" * 32,
                      histogram={"axes": [{"column": "score", "edges": [0.2, 0.4, 0.6, 0.8]},
                                          {"column": "group", "categories": ["a", "b"]}]})
    cells = study.histogram.cell_index(np.column_stack([score.astype(object), group.astype(object)]))
    onehot = study.histogram.one_hot(cells)
    noisy = onehot + rng.normal(0, study.sigma, onehot.shape)
    hist_tol = {"rtol": 1e-6, "atol": 1e-9}
    releases.append(_release_case(
        "histogram-statistics", "a histogram study (5 x 3 cells): the counts view and every statistic", study,
        noisy, rng,
        [("histogram-view", "/v1/studies/{id}/histogram?confidence=0.9", None, hist_tol),
         ("quantiles", "/v1/studies/{id}/analyses/quantiles", {"column": "score"}, hist_tol),
         ("moments", "/v1/studies/{id}/analyses/moments", {"column": "score"}, hist_tol),
         ("kendall-tau", "/v1/studies/{id}/analyses/kendall-tau", {}, hist_tol),
         ("auc", "/v1/studies/{id}/analyses/auc", {"score": "score", "label": "group", "positive": "b"}, hist_tol),
         ("gini-mean-difference", "/v1/studies/{id}/analyses/gini-mean-difference", {"column": "score"}, hist_tol),
         ("gini-simpson", "/v1/studies/{id}/analyses/gini-simpson", {"column": "group"}, hist_tol)]))
    # l1 study: d = 3 (x1, x2, y), least absolute deviations
    n = 10_000
    x = rng.normal(0, 0.4, (n, 2))
    y = x @ np.array([0.7, -0.4]) + rng.laplace(0, 0.05, n)
    a = _clip(np.column_stack([x, y]), 1.0)
    study, _ = design(name="conformance l1 release", columns=["x1", "x2", "y"], label="y", servers=["s1", "s2"],
                      expected_reports=n, epsilon=4.0, kind="l1", seed="77" * 32)
    noisy = a + rng.normal(0, study.sigma, a.shape)
    lad_tol = {"rtol": 1e-5, "atol": 1e-7}
    releases.append(_release_case(
        "l1-lad", "an l1 study: the sketch view and least absolute deviations (plain and with an l1 penalty)",
        study, noisy, rng,
        [("sketch-view", "/v1/studies/{id}/sketch", None, TIGHT),
         ("lad", "/v1/studies/{id}/analyses/lad", {}, lad_tol),
         ("lad-alpha", "/v1/studies/{id}/analyses/lad", {"alpha": 20.0}, lad_tol)]))
    # moments study: d = 4 (x1, x2, x3, y), u(a a^T) alone (width 10), two servers
    n = 5000
    x = rng.normal(0, 0.4, (n, 3)) * np.array([1.0, 0.7, 0.4])
    a = _clip(np.column_stack([x, x @ np.array([0.8, -0.5, 0.3]) + rng.normal(0, 0.1, n)]), 1.0)
    study, _ = design(name="conformance moments release", columns=["x1", "x2", "x3", "y"], label="y",
                      servers=["s1", "s2"], expected_reports=n, epsilon=2.0, kind="moments", seed="88" * 32)
    phi = features.moment_features(a)
    noisy = phi + rng.normal(0, study.sigma, phi.shape)
    releases.append(_release_case(
        "moments-ridge-pca", "a moments study (k = s = 1, width d(d+1)/2 = 10: A^T A without the row sum and "
        "count): views, ridge, least squares, PCA", study, noisy, rng,
        [("sketch-view", "/v1/studies/{id}/sketch", None, TIGHT),
         ("gram-view", "/v1/studies/{id}/gram", None, TIGHT),
         ("ridge-default-alpha", "/v1/studies/{id}/analyses/ridge", {}, TIGHT),
         ("least-squares", "/v1/studies/{id}/analyses/least-squares", {}, TIGHT),
         ("pca-2", "/v1/studies/{id}/analyses/pca", {"n_components": 2}, TIGHT)]))
    return {**header("analyses", "Releases and the analyzer's answers (docs/protocol.md sections 6a, 6b, 6c). Each "
                     "vector is a finalized study: the N aggregate_shares (application/x-dpsketch-aggregate bodies, "
                     "hex) -> ring_sum (their sum mod 2^64, decimal strings) -> release (decoded, times "
                     "entry_scale: 1/sqrt(s), or 1 for an l1 study) over n_reports reports. Each analysis is an "
                     "analyzer request (method, path with {id} the study id, JSON body; null for GET) and the "
                     "exact JSON response: strings, integers, booleans and member names must match exactly, "
                     "floats within the analysis' tolerance."),
            "vectors": releases}


def noise_file() -> dict[str, Any]:
    from conformance_noise import DESCRIPTION, noise_vectors

    return {**header("noise", DESCRIPTION), "vectors": noise_vectors()}


def sealing_file() -> dict[str, Any]:
    from conformance_sealing import DESCRIPTION, sealing_vectors

    return {**header("sealing", DESCRIPTION), "vectors": sealing_vectors(ROOT)}


def accounting_file() -> dict[str, Any]:
    from conformance_accounting import DESCRIPTION, accounting_vectors

    return {**header("accounting", DESCRIPTION), "vectors": accounting_vectors()}


FILES = {"study_ids.json": study_id_vectors, "ring.json": ring_vectors, "sketch.json": sketch_vectors,
         "analyses.json": analysis_vectors, "noise.json": noise_file, "sealing.json": sealing_file,
         "accounting.json": accounting_file}


def matches(got: Any, want: Any, tolerance: dict | None = None) -> bool:
    """Whether a regenerated file says what the stored one says: the same members and values,
    floats within the nearest enclosing ``tolerance`` (``release_tolerance`` for a release),
    exactly where none is stated."""
    if isinstance(want, dict):
        if not isinstance(got, dict) or got.keys() != want.keys():
            return False
        tolerance = want.get("tolerance", tolerance)
        return all(matches(got[key], value, want.get("release_tolerance", tolerance) if key == "release"
                           else tolerance) for key, value in want.items())
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(
            matches(g, w, tolerance) for g, w in zip(got, want))
    if isinstance(want, float) and isinstance(got, float) and tolerance:
        return abs(got - want) <= tolerance["atol"] + tolerance["rtol"] * abs(want)
    return type(got) is type(want) and got == want


def render(make) -> str:
    return json.dumps(make(), indent=1, sort_keys=False, ensure_ascii=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the files instead of writing them")
    parser.add_argument("--out", type=Path, default=OUT, help="directory to write (default: conformance/)")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(exist_ok=True)
    stale = []
    for name, make in FILES.items():
        text = render(make)
        path = out / name
        if args.check:
            if not path.exists() or not matches(json.loads(text), json.loads(path.read_text())):
                stale.append(name)
        else:
            path.write_text(text)
            print(f"wrote {path}: {len(json.loads(text)['vectors'])} vectors")
    if stale:
        print(f"out of date: {', '.join(stale)} (run scripts/make_conformance.py)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
