"""The conformance vectors in conformance/ (docs/protocol.md section 10), recomputed from their
inputs with the product's code and, where the specification gives a formula, with an independent
implementation of that formula written here from the document: exact for bytes, ids and ring
elements, within each vector's stated tolerance for floats. Also checks that every file and
vector carries every field the document promises, and that the generator is deterministic and
the files are up to date with it."""

from __future__ import annotations

import copy
import hashlib
import json
import math
import subprocess
import sys
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from dpsketch.protocol import canonical, l1sketch, ring, sketch
from dpsketch.protocol.study import Study

ROOT = Path(__file__).resolve().parents[1]
DIR = ROOT / "conformance"
U64 = 1 << 64
FILES = ("study_ids.json", "ring.json", "sketch.json", "analyses.json", "noise.json", "sealing.json",
         "accounting.json")

HEADER = {"format", "spec_version", "protocol", "category", "description", "tolerance_rule", "vectors"}
#: The fields every vector of a type must carry (docs/protocol.md section 10).
REQUIRED = {
    "canonical_json": {"id", "type", "description", "input", "canonical", "canonical_hex", "sha256",
                       "same_as_rfc8785"},
    "study": {"id", "type", "description", "input", "canonical", "canonical_hex", "study_id", "same_as_rfc8785",
              "derived"},
    "encode": {"id", "type", "x", "frac_bits", "bound", "encoded"},
    "decode": {"id", "type", "ring", "frac_bits", "value"},
    "share": {"id", "type", "n_servers", "x", "random_shares", "last_share"},
    "seed_share": {"id", "type", "n_servers", "width", "x", "seeds", "expanded", "last_share"},
    "osnap": {"id", "type", "seed", "k", "s", "report_id", "digest", "rows", "buckets", "signs"},
    "l1": {"id", "type", "seed", "s", "level0_buckets", "levels", "buckets", "branching", "k", "report_id", "rows"},
    "aggregate": {"id", "type", "kind", "seed", "k", "s", "width", "report_ids", "shares", "aggregate",
                  "aggregate_hex", "inclusion_hash", "lambda_min", "tolerance"},
    "release": {"id", "type", "description", "study", "study_id", "n_reports", "aggregate_shares", "ring_sum",
                "entry_scale", "release", "release_tolerance", "analyses"},
    # noise.json (tests/test_conformance_noise.py recomputes them)
    "keystream": {"id", "type", "key", "bytes", "words64", "words32", "bits"},
    "block_table": {"id", "type", "t", "limit", "block", "entries", "bounds_sha256"},
    "uniform_below": {"id", "type", "key", "bound", "count", "values", "bytes_used"},
    "bernoulli_exp": {"id", "type", "key", "den", "nums", "results", "bytes_used"},
    "sampler": {"id", "type", "key", "t", "limit", "count", "draws", "bytes_used"},
    "secret_sign": {"id", "type", "key", "rows", "signs", "bytes_used"},
    "noise_parameters": {"id", "type", "study", "study_id", "width", "clip_bound", "shift", "spacing", "client",
                         "server", "party_clip_bounds"},
    "batch": {"id", "type", "study", "study_id", "key", "compress", "full", "rows", "clip_bound", "shift", "spacing",
              "client", "server", "signs", "vectors", "encoded", "noise", "noisy", "bytes_after_signs",
              "bytes_after_noise", "commitments", "report_ids", "servers", "bytes_used"},
    # sealing.json (tests/test_conformance_sealing.py recomputes them)
    "kem_keygen": {"id", "type", "suite", "xwing_seed", "private_key", "public_key", "key_id"},
    "kem_decapsulation": {"id", "type", "suite", "kem_id", "private_key", "enc", "shared_secret"},
    "hpke_open": {"id", "type", "suite", "kem_id", "kdf_id", "aead_id", "shared_secret", "info", "psk_id_hash",
                  "info_hash", "key_schedule_context", "secret", "key", "base_nonce", "aad", "ciphertext",
                  "plaintext"},
    "sealed_blocks": {"id", "type", "suite", "private_key", "public_key", "key_id", "study_id", "server_id",
                      "position", "party", "party_index", "width", "party_key", "content", "count", "records",
                      "shares", "salt_key", "ephemeral_key", "batch_id", "secret", "fixed", "context", "info",
                      "sealed_secret", "transcript", "record_key", "aad", "sealed", "body"},
    "sealed_batch_record": {"id", "type", "suite", "private_key", "public_key", "key_id", "study_id", "server_id",
                            "position", "batch_vector", "media_type", "record", "content", "count", "batch_id",
                            "ephemeral_key", "header_batch_id", "secret", "fixed", "context", "info",
                            "sealed_secret", "transcript", "record_key", "aad", "sealed", "body"},
    # accounting.json (tests/test_conformance_accounting.py recomputes them)
    "presence": {"id", "type", "shift", "ratio", "width", "delta", "signed", "epsilon", "tolerance"},
    "study_guarantee": {"id", "type", "description", "study", "epsilon", "floor_epsilon", "verdict", "tolerance"},
}
ANALYSIS = {"id", "method", "path", "request", "response", "tolerance"}
#: Response members per analysis path (docs/protocol.md sections 6b and 6c).
RESPONSE = {
    "sketch": {"study_id", "columns", "kind", "k", "n_reports", "sigma", "sketch"},
    "gram": {"study_id", "kind", "columns", "n_reports", "gram", "row_sum", "noisy_count"},
    "ridge": {"study_id", "label", "features", "coef", "alpha", "tau", "n_floored", "debias", "n_reports"},
    "least-squares": {"study_id", "label", "features", "coef", "alpha", "tau", "n_floored", "debias", "n_reports"},
    "pca": {"study_id", "columns", "components", "explained_variance", "debias", "n_reports"},
    "logistic": {"study_id", "label", "classes", "features", "coef", "intercept", "alpha", "calibration", "debias",
                 "n_reports"},
    "lad": {"study_id", "label", "features", "coef", "objective", "alpha", "noise_correction", "n_reports"},
    "histogram": {"study_id", "axes", "shape", "n_reports", "noise_variance", "confidence", "counts", "counts_ci",
                  "proportions", "proportions_ci", "nonnegative_counts"},
    "quantiles": {"study_id", "column", "probabilities", "quantiles", "clipped", "edges", "cdf", "n_reports"},
    "statistic": {"study_id", "statistic", "value", "se", "ci", "confidence", "n_reports", "details"},
}


def check_schema(doc: dict) -> None:
    """AssertionError naming the first missing field of a vector file."""
    missing = HEADER - doc.keys()
    assert not missing, f"file header lacks {sorted(missing)}"
    assert doc["format"] == "dpsketch-conformance/1"
    ids = set()
    for vec in doc["vectors"]:
        assert "type" in vec and vec["type"] in REQUIRED, f"vector without a known type: {vec.get('id')}"
        missing = REQUIRED[vec["type"]] - vec.keys()
        assert not missing, f"vector {vec.get('id')} lacks {sorted(missing)}"
        assert vec["id"] not in ids, f"duplicate vector id {vec['id']}"
        ids.add(vec["id"])
        for an in vec.get("analyses", []):
            missing = ANALYSIS - an.keys()
            assert not missing, f"analysis {vec['id']}/{an.get('id')} lacks {sorted(missing)}"
            assert {"rtol", "atol"} <= an["tolerance"].keys()
            want = RESPONSE[response_kind(an["path"])]
            missing = want - an["response"].keys()
            assert not missing, f"response {vec['id']}/{an['id']} lacks {sorted(missing)}"


def response_kind(path: str) -> str:
    tail = path.split("?")[0].rsplit("/", 1)[1]
    if tail in ("moments", "kendall-tau", "auc", "gini-mean-difference", "gini-simpson"):
        return "statistic"
    return tail


def load(name: str) -> dict:
    return json.loads((DIR / name).read_text())


DOCS = {name: load(name) for name in FILES}


def close(got, want, rtol: float, atol: float, where: str = "") -> None:
    """Recursive comparison: same structure and member names, strings/ints/bools/None exactly,
    floats within |got - want| <= atol + rtol |want|."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), (where, sorted(got), sorted(want))
        for key in want:
            close(got[key], want[key], rtol, atol, f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), (where, got, want)
        for i, (g, w) in enumerate(zip(got, want)):
            close(g, w, rtol, atol, f"{where}[{i}]")
    elif isinstance(want, float) and not isinstance(want, bool):
        assert isinstance(got, (int, float)) and not isinstance(got, bool), (where, got)
        assert abs(got - want) <= atol + rtol * abs(want), (where, got, want)
    else:
        assert got == want and type(got) is type(want), (where, got, want)


# --- the files themselves ------------------------------------------------------------------------

@pytest.mark.parametrize("name", FILES)
def test_file_has_every_field(name):
    check_schema(DOCS[name])
    assert DOCS[name]["vectors"], name


def test_schema_check_catches_a_missing_field():
    for name, path in [("ring.json", ("vectors", 0, "encoded")), ("analyses.json", ("vectors", 0, "analyses", 2,
                                                                                    "response", "tau")),
                       ("study_ids.json", ("spec_version",))]:
        doc = copy.deepcopy(DOCS[name])
        node = doc
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]
        with pytest.raises(AssertionError):
            check_schema(doc)


def test_spec_version_matches_the_document():
    first = (ROOT / "docs" / "protocol.md").read_text().splitlines()[:6]
    line = next(l for l in first if "Specification version" in l)
    for doc in DOCS.values():
        assert f"Specification version {doc['spec_version']} " in line
        assert doc["protocol"] == "dpsketch/2"


def test_generator_is_deterministic(tmp_path):
    """Two runs of the generator write byte-identical files, the same set as conformance/ (the
    files are then checked against the product by recomputation below, not by regenerating:
    a change in the analyzer's study-design advice changes new vectors, not the validity of these)."""
    runs = [subprocess.Popen([sys.executable, str(ROOT / "scripts" / "make_conformance.py"), "--out",
                              str(tmp_path / run)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, cwd=ROOT) for run in ("a", "b")]  # side by side: two runs
    for proc in runs:
        output, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, output
    for name in FILES:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == sorted(FILES)
    # flp.json, validity.json and batch_validity.json: the validity proofs' vectors, with their own
    # generators (scripts/make_flp_vectors.py, make_validity_vectors.py and make_batch_vectors.py,
    # checked by tests/test_flp.py, tests/test_validity.py and tests/test_batch_records.py)
    assert sorted(p.name for p in DIR.glob("*.json")) == sorted(FILES + ("flp.json", "validity.json",
                                                                          "batch_validity.json"))


def test_check_compares_floats_within_each_vectors_tolerance():
    """``make_conformance.py --check`` (scripts/make_conformance.py ``matches``): another
    machine's last-bit differences in a float pass within the tolerance its vector states, a
    larger change or any change of a string, integer or member, or of a float without a stated
    tolerance, is reported."""
    import copy
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_conformance", ROOT / "scripts" / "make_conformance.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    doc = DOCS["sketch.json"]
    assert script.matches(copy.deepcopy(doc), doc)
    index, vector = next((i, v) for i, v in enumerate(doc["vectors"])
                         if isinstance(v.get("lambda_min"), float) and "tolerance" in v)
    tol = vector["tolerance"]
    for factor, same in ((1 + 1e-15, True), (1 + 100 * tol["rtol"], False)):
        got = copy.deepcopy(doc)
        got["vectors"][index]["lambda_min"] = vector["lambda_min"] * factor
        assert script.matches(got, doc) is same, factor
    got = copy.deepcopy(doc)
    got["vectors"][index]["id"] += "x"
    assert not script.matches(got, doc)
    assert script.matches({"a": 0.1 + 0.2}, {"a": 0.1 + 0.2}) and not script.matches({"a": 0.3}, {"a": 0.1 + 0.2})


# --- study ids ----------------------------------------------------------------------------------

def spec_string(s: str) -> str:
    """The string rule of docs/protocol.md ("Study id"), written from the text."""
    short = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}
    out = ['"']
    units = s.encode("utf-16-be", "surrogatepass")
    for i in range(0, len(units), 2):
        u = int.from_bytes(units[i:i + 2], "big")
        ch = chr(u) if u < 0xD800 or u > 0xDFFF else None
        if ch is not None and ch in short:
            out.append(short[ch])
        elif 0x20 <= u <= 0x7E:
            out.append(chr(u))
        else:
            out.append(f"\\u{u:04x}")
    return "".join(out) + '"'


def spec_number(x) -> str:
    """ECMAScript Number.prototype.toString, from its definition (integers in full)."""
    if isinstance(x, bool):
        return "true" if x else "false"
    if isinstance(x, int):
        return str(x)
    if x == 0:
        return "0"
    sign = "-" if x < 0 else ""
    r = repr(abs(x))  # shortest round-trip digits
    mantissa, _, exp = r.partition("e")
    whole, _, frac = mantissa.partition(".")
    digits = (whole + frac).lstrip("0")
    point = len(whole) + (int(exp) if exp else 0)  # value = 0.DIGITS... * 10^point before stripping
    lead = len(whole + frac) - len((whole + frac).lstrip("0"))
    n = point - lead
    digits = digits.rstrip("0")
    k = len(digits)
    if k <= n <= 21:
        return sign + digits + "0" * (n - k)
    if 0 < n <= 21:
        return sign + digits[:n] + "." + digits[n:]
    if -6 < n <= 0:
        return sign + "0." + "0" * (-n) + digits
    e = n - 1
    return sign + (digits if k == 1 else digits[0] + "." + digits[1:]) + ("e+" if e > 0 else "e-") + str(abs(e))


def spec_canonical(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, (bool, int, float)):
        return spec_number(v)
    if isinstance(v, str):
        return spec_string(v)
    if isinstance(v, list):
        return "[" + ",".join(spec_canonical(x) for x in v) + "]"
    return "{" + ",".join(spec_string(k) + ":" + spec_canonical(v[k]) for k in sorted(v)) + "}"


def rfc8785(v) -> str:
    """A true RFC 8785 encoder for these inputs: raw UTF-8 strings, integers as IEEE doubles."""
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, int) and not isinstance(v, bool):
        return spec_number(float(v)) if abs(v) > 2 ** 53 else str(v)
    if isinstance(v, list):
        return "[" + ",".join(rfc8785(x) for x in v) + "]"
    if isinstance(v, dict):
        keys = sorted(v, key=lambda k: k.encode("utf-16-be"))
        return "{" + ",".join(rfc8785(k) + ":" + rfc8785(v[k]) for k in keys) + "}"
    return spec_canonical(v)


@pytest.mark.parametrize("vec", DOCS["study_ids.json"]["vectors"], ids=lambda v: v["id"])
def test_study_id_vectors(vec):
    want = bytes.fromhex(vec["canonical_hex"])
    assert want.decode("ascii") == vec["canonical"]
    assert canonical.canonical_json(vec["input"]) == want
    assert spec_canonical(vec["input"]).encode("ascii") == want  # the document's rule
    assert (rfc8785(vec["input"]).encode("utf-8") == want) is vec["same_as_rfc8785"]
    if vec["type"] == "canonical_json":
        assert hashlib.sha256(want).hexdigest() == vec["sha256"] == canonical.content_hash(vec["input"])
        return
    study = Study.model_validate(vec["input"])
    assert study.canonical() == want
    assert study.study_id == vec["study_id"] == hashlib.sha256(want).hexdigest()
    d = len(vec["input"]["columns"])
    kind = vec["input"]["kind"]
    if kind == "histogram":  # a joint grid multiplies the axes' cells, a marginal histogram adds them
        cells = [len(a["edges"] or a["categories"]) + 1 for a in vec["input"]["histogram"]["axes"]]
        width = sum(cells) if vec["input"]["histogram"].get("marginal") else math.prod(cells)
    else:
        width = {"gram": d * (d + 3) // 2 + 1, "moments": d * (d + 1) // 2}.get(kind, d)
    derived = vec["derived"]
    assert derived == {"d": d, "width": width, "k": vec["input"]["k"], "s": vec["input"]["s"],
                       "aggregate_cells": vec["input"]["k"] * width, "share_bytes": 8 * width}
    assert (study.d, study.width, study.k * study.width) == (d, width, derived["aggregate_cells"])
    if kind == "histogram":  # the row bound is the norm of a client's 0/1 vector (section 2b)
        m = len(vec["input"]["histogram"]["axes"])
        assert vec["input"]["row_bound"] == (math.sqrt(m) if vec["input"]["histogram"].get("marginal") else 1.0)


def test_study_id_vectors_cover_the_issue_cases():
    names = [v["input"].get("name", "") for v in DOCS["study_ids.json"]["vectors"] if v["type"] == "study"]
    assert any("\x7f" in n for n in names) and any(any(ord(c) > 0xFFFF for c in n) for n in names)
    assert any("\t" in n and '"' in n and "\\" in n for n in names)
    kinds = {v["input"]["kind"] for v in DOCS["study_ids.json"]["vectors"] if v["type"] == "study"}
    assert kinds == {"sketch", "gram", "moments", "histogram", "l1"}
    del_vec = next(v for v in DOCS["study_ids.json"]["vectors"] if v["id"] == "study-del")
    assert "\\u007f" in del_vec["canonical"] and del_vec["same_as_rfc8785"] is False


# --- ring ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("vec", DOCS["ring.json"]["vectors"], ids=lambda v: v["id"])
def test_ring_vectors(vec):
    t = vec["type"]
    if t == "encode":
        if vec.get("refused"):
            assert vec["encoded"] is None
            with pytest.raises(ring.EncodingRangeError):
                ring.encode(np.array([vec["x"]]), vec["frac_bits"], vec["bound"])
            return
        assert abs(vec["x"]) <= vec["bound"]
        spec = round(Fraction(vec["x"]) * 2 ** vec["frac_bits"]) % U64  # round half to even, exact
        assert str(spec) == vec["encoded"]
        got = ring.encode(np.array([vec["x"]]), vec["frac_bits"], vec["bound"])
        assert str(int(got[0])) == vec["encoded"]
        signed = spec - U64 if spec >= 1 << 63 else spec
        assert float(Fraction(signed, 2 ** vec["frac_bits"])) == vec["decoded"] == ring.decode(got, vec["frac_bits"])[0]
    elif t == "decode":
        v = int(vec["ring"])
        signed = v - U64 if v >= 1 << 63 else v
        assert float(Fraction(signed, 2 ** vec["frac_bits"])) == vec["value"]
        assert ring.decode(np.array([v], dtype=np.uint64), vec["frac_bits"])[0] == vec["value"]
    elif t == "share":
        x = [int(v) for v in vec["x"]]
        shares = [[int(v) for v in s] for s in vec["random_shares"]] + [[int(v) for v in vec["last_share"]]]
        assert len(shares) == vec["n_servers"]
        assert [sum(col) % U64 for col in zip(*shares)] == x
        assert ring.reconstruct([np.array(s, dtype=np.uint64) for s in shares]).tolist() == x
    elif t == "seed_share":
        x = [int(v) for v in vec["x"]]
        assert len(vec["seeds"]) == vec["n_servers"] - 1
        for seed, expanded in zip(vec["seeds"], vec["expanded"]):
            assert [str(v) for v in ring.expand_seed(bytes.fromhex(seed), vec["width"]).tolist()] == expanded
        parts = [[int(v) for v in e] for e in vec["expanded"]] + [[int(v) for v in vec["last_share"]]]
        assert [sum(col) % U64 for col in zip(*parts)] == x
    else:  # pragma: no cover
        pytest.fail(f"unknown ring vector type {t}")


# --- sketch -------------------------------------------------------------------------------------

def spec_osnap_rows(seed: bytes, rid: bytes, k: int, s: int) -> tuple[bytes, list[int], list[int]]:
    digest = hashlib.blake2b(b"dpsketch/osnap/1" + rid, digest_size=8 * s, key=seed).digest()
    b = k // s
    rows, signs = [], []
    for l in range(s):
        u = int.from_bytes(digest[8 * l:8 * l + 8], "little")
        rows.append(l * b + ((u * b) >> 64))
        signs.append(1 if k == 1 or u % 2 == 0 else -1)
    return digest, rows, signs


def spec_l1_rows(seed: bytes, rid: bytes, s: int, level0: int, levels: int, buckets: int, branching: int) -> list[int]:
    digest = hashlib.blake2b(b"dpsketch/l1/1" + rid, digest_size=8 * (s + 2), key=seed).digest()
    u = [int.from_bytes(digest[8 * j:8 * j + 8], "little") for j in range(s + 2)]
    rows = [l * level0 + ((u[l] * level0) >> 64) for l in range(s)]
    h = sum(1 for j in range(1, levels + 2) if u[s] < -(-U64 // branching ** j))
    if 1 <= h <= levels:
        rows.append(s * level0 + (h - 1) * buckets + ((u[s + 1] * buckets) >> 64))
    return rows


@pytest.mark.parametrize("vec", DOCS["sketch.json"]["vectors"], ids=lambda v: v["id"])
def test_sketch_vectors(vec):
    seed = bytes.fromhex(vec["seed"])
    if vec["type"] == "osnap":
        rid = bytes.fromhex(vec["report_id"])
        digest, rows, signs = spec_osnap_rows(seed, rid, vec["k"], vec["s"])
        assert (digest.hex(), rows, signs) == (vec["digest"], vec["rows"], vec["signs"])
        assert vec["buckets"] == [r - l * (vec["k"] // vec["s"]) for l, r in enumerate(rows)]
        got_rows, got_signs = sketch.hash_report_ids(seed, [rid], vec["k"], vec["s"])
        assert got_rows[0].tolist() == rows and got_signs[0].tolist() == signs
    elif vec["type"] == "l1":
        shape = {key: vec[key] for key in ("s", "level0_buckets", "levels", "buckets", "branching")}
        rid = bytes.fromhex(vec["report_id"])
        assert spec_l1_rows(seed, rid, *shape.values()) == vec["rows"]
        spec = l1sketch.L1Spec(**shape)
        assert spec.k == vec["k"] == shape["s"] * shape["level0_buckets"] + shape["levels"] * shape["buckets"]
        rows, signs = l1sketch.hash_report_ids(seed, [rid], spec)
        assert [int(r) for r, g in zip(rows[0], signs[0]) if g] == vec["rows"]
    elif vec["type"] == "aggregate":
        check_aggregate(vec, seed)
    else:  # pragma: no cover
        pytest.fail(f"unknown sketch vector type {vec['type']}")


def check_aggregate(vec: dict, seed: bytes) -> None:
    k, s, width = vec["k"], vec["s"], vec["width"]
    ids = [bytes.fromhex(r) for r in vec["report_ids"]]
    assert ids == sorted(ids)
    shares = [[int(v) for v in row] for row in vec["shares"]]
    acc = [[0] * width for _ in range(k)]
    columns = []  # each report's (row, sign) entries
    for rid, share in zip(ids, shares):
        if vec["kind"] == "l1":
            entries = [(r, 1) for r in spec_l1_rows(seed, rid, s, vec["l1"]["level0_buckets"], vec["l1"]["levels"],
                                                    vec["l1"]["buckets"], vec["l1"]["branching"])]
        else:
            _, rows, signs = spec_osnap_rows(seed, rid, k, s)
            entries = list(zip(rows, signs))
        columns.append(entries)
        for r, g in entries:
            acc[r] = [(a + g * v) % U64 for a, v in zip(acc[r], share)]
    assert [[str(v) for v in row] for row in acc] == vec["aggregate"]
    assert bytes.fromhex(vec["aggregate_hex"]) == b"".join(v.to_bytes(8, "little") for row in acc for v in row)
    assert hashlib.sha256(b"".join(ids)).hexdigest() == vec["inclusion_hash"]
    # the product's accumulation gives the same share
    got = np.zeros((k, width), dtype=np.uint64)
    if vec["kind"] == "l1":
        rows, signs = l1sketch.hash_report_ids(seed, ids, l1sketch.L1Spec(s=s, **{key: vec["l1"][key] for key in (
            "level0_buckets", "levels", "buckets", "branching")}))
    else:
        rows, signs = sketch.hash_report_ids(seed, ids, k, s)
    sketch.accumulate(got, rows, signs, np.array(shares, dtype=np.uint64))
    assert got.tolist() == [[int(v) for v in row] for row in vec["aggregate"]]
    # the certificate's input, S S^T, and lambda_min
    M = np.zeros((k, k), dtype=np.int64)
    for entries in columns:
        for r1, g1 in entries:
            for r2, g2 in entries:
                M[r1, r2] += g1 * g2
    tol = vec["tolerance"]
    if vec["kind"] == "l1":
        assert M.tolist() == vec["sst"]
        P = np.linalg.pinv(M.astype(float))
        lev = max(sum(P[r1, r2] for r1, _ in e for r2, _ in e) for e in columns)
        close(float(lev), vec["max_leverage"], tol["rtol"], tol["atol"])
        close(1.0 / lev, vec["lambda_min"], tol["rtol"], tol["atol"])
    else:
        assert M.tolist() == vec["sst_times_s"]
        close(float(np.linalg.eigvalsh(M / s)[0]), vec["lambda_min"], tol["rtol"], tol["atol"])


# --- releases and analyses ----------------------------------------------------------------------

RELEASES = DOCS["analyses.json"]["vectors"]


def analyzer_client(study: Study, ring_sum: np.ndarray, n_reports: int):
    from fastapi.testclient import TestClient

    from dpsketch.analyzer.app import create_app

    record = SimpleNamespace(study=study, state="released", ring_sum=ring_sum, n_reports=n_reports,
                             explanation=[], inclusion_hash="00" * 32)

    class Stand:
        config = SimpleNamespace(api_token=None, server_ids=list(study.servers))

        def record(self, study_id):
            assert study_id == study.study_id
            return record

    return TestClient(create_app(Stand()))


def release_of(vec: dict) -> tuple[Study, np.ndarray, np.ndarray]:
    study = Study.model_validate(vec["study"])
    assert study.study_id == vec["study_id"]
    assert len(vec["aggregate_shares"]) == study.n_servers
    total = [0] * (study.k * study.width)
    for body in vec["aggregate_shares"]:
        raw = bytes.fromhex(body)
        assert len(raw) == 8 * study.k * study.width
        total = [(t + int.from_bytes(raw[8 * i:8 * i + 8], "little")) % U64 for i, t in enumerate(total)]
    ring_sum = np.array(total, dtype=np.uint64).reshape(study.k, study.width)
    assert [[str(v) for v in row] for row in ring_sum.tolist()] == vec["ring_sum"]
    scale = 1.0 if study.kind == "l1" else 1.0 / math.sqrt(study.s)
    assert vec["entry_scale"] == scale
    signed = [v - U64 if v >= 1 << 63 else v for v in total]
    release = np.array([float(Fraction(v, 2 ** study.frac_bits)) * scale for v in signed]).reshape(study.k, -1)
    tol = vec["release_tolerance"]
    close(release.tolist(), vec["release"], tol["rtol"], tol["atol"])
    return study, ring_sum, release


@pytest.mark.parametrize("vec", RELEASES, ids=lambda v: v["id"])
def test_release_analyses_through_the_analyzer(vec):
    """Every analysis, asked of the analyzer's real routes over the recomputed ring sum."""
    study, ring_sum, _ = release_of(vec)
    client = analyzer_client(study, ring_sum, vec["n_reports"])
    for an in vec["analyses"]:
        url = an["path"].replace("{id}", study.study_id)
        r = client.post(url, json=an["request"]) if an["method"] == "POST" else client.get(url)
        assert r.status_code == 200, (an["id"], r.text)
        close(r.json(), an["response"], an["tolerance"]["rtol"], an["tolerance"]["atol"], an["id"])


def spec_second_moments(study: Study, release: np.ndarray, n: int, debias: bool) -> tuple[np.ndarray, float, float]:
    """The Gram estimate, tau and the cross-noise term of docs/protocol.md section 6c."""
    d = study.d
    server_var = study.n_servers * study.server_sigma ** 2
    if study.kind == "gram":
        v = release.reshape(-1)
        G = np.diag(v[d:2 * d]).astype(float)
        pos = 2 * d
        for i in range(d):
            for j in range(i + 1, d):
                G[i, j] = G[j, i] = v[pos] / math.sqrt(2)
                pos += 1
        assert pos == study.width - 1
        tau = math.sqrt(n * study.sigma ** 2 + server_var) * math.sqrt(2 * d)
        return G, tau, 0.0
    k = study.k
    bias = study.sigma ** 2 * n + k * server_var
    G = release.T @ release
    debiased = G - bias * np.eye(d)
    tau = bias * (2 * math.sqrt(d / k) + d / k)
    cross = math.sqrt((study.sigma ** 2 * n / k + server_var) * max(0.0, float(np.trace(debiased))))
    return (debiased if debias else G), tau, cross


def spec_ridge(G, features, label, columns, tau, alpha, cross):
    fi = [columns.index(c) for c in features]
    li = columns.index(label)
    gxx, gxy = G[np.ix_(fi, fi)], G[fi, li]
    if alpha is None:
        alpha = max(0.0, tau - float(np.linalg.eigvalsh((gxx + gxx.T) / 2)[0])) + cross
    w, V = np.linalg.eigh((gxx + gxx.T) / 2 + alpha * np.eye(len(fi)))
    floored = int(np.sum(w < tau))
    coef = V @ ((V.T @ gxy) / np.maximum(w, tau))
    return coef, alpha, floored


@pytest.mark.parametrize("vec", [v for v in RELEASES if v["study"]["kind"] in ("sketch", "gram")],
                         ids=lambda v: v["id"])
def test_ridge_least_squares_pca_follow_the_specification(vec):
    """Ridge, least squares and PCA recomputed from the formulas of section 6c alone."""
    study, _, release = release_of(vec)
    n = vec["n_reports"]
    checked = 0
    for an in vec["analyses"]:
        kind = response_kind(an["path"])
        resp, tol, req = an["response"], an["tolerance"], an["request"] or {}
        if kind in ("ridge", "least-squares"):
            debias = req.get("debias", True)
            G, tau, cross = spec_second_moments(study, release, n, debias)
            label = req.get("label") or study.label
            features = [c for c in study.columns if c != label]
            alpha = 0.0 if kind == "least-squares" else req.get("alpha")
            coef, alpha, floored = spec_ridge(G, features, label, study.columns, tau, alpha,
                                              cross if study.kind == "sketch" else 0.0)
            assert resp["features"] == features and resp["n_floored"] == floored
            close(resp["tau"], tau, 1e-12, 0.0)
            close(resp["alpha"], alpha, tol["rtol"], tol["atol"])
            close(resp["coef"], coef.tolist(), tol["rtol"], tol["atol"] * max(1.0, float(np.abs(coef).max())))
            checked += 1
        elif kind == "pca":
            G, _, _ = spec_second_moments(study, release, n, req.get("debias", True))
            w, V = np.linalg.eigh((G + G.T) / 2)
            order = np.argsort(w)[::-1][:req["n_components"]]
            comps = []
            for j in order:
                c = V[:, j]
                comps.append((c if c[np.argmax(np.abs(c))] > 0 else -c).tolist())
            close(resp["components"], comps, tol["rtol"], tol["atol"])
            close(resp["explained_variance"], (w[order] / n).tolist(), tol["rtol"], tol["atol"])
            for comp in resp["components"]:
                assert comp[int(np.argmax(np.abs(comp)))] > 0  # the sign convention
            checked += 1
    assert checked >= 3


def test_analysis_vectors_cover_every_kind_and_exercise_the_floor():
    kinds = {v["study"]["kind"] for v in RELEASES}
    assert kinds == {"sketch", "gram", "moments", "histogram", "l1"}
    paths = {response_kind(a["path"]) for v in RELEASES for a in v["analyses"]}
    assert {"ridge", "least-squares", "pca", "logistic", "lad", "histogram", "quantiles", "statistic"} <= paths
    ridge = [a["response"] for v in RELEASES for a in v["analyses"] if response_kind(a["path"]) == "ridge"]
    assert any(r["n_floored"] > 0 for r in ridge) and any(r["n_floored"] == 0 for r in ridge)
    assert any(r["tau"] > 0 and r["alpha"] > r["tau"] for r in ridge)  # the default alpha on a sketch study


def test_section_10_table_counts_what_the_files_hold():
    """docs/protocol.md section 10's table names every file with its number of vectors, every
    vector type with its number, and the number of analyses of the releases, read from the files
    themselves: the counts cannot go stale again (issue 44, G9)."""
    import re

    text = (ROOT / "docs" / "protocol.md").read_text()
    section = text[text.index("\n## 10. Conformance vectors"):]
    section = section[:section.index("\n## ", 1)]
    files, types, current = {}, {}, None
    for line in section.splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]] if line.startswith("|") else []
        if len(cells) < 2:
            continue
        named = re.fullmatch(r"`([a-z_]+\.json)` \((\d+)\)", cells[0])
        if named:
            current = named.group(1)
            files[current] = int(named.group(2))
        typed = re.fullmatch(r"`([a-z0-9_]+)` \((\d+)\)", cells[1])
        if typed and current:
            types[(current, typed.group(1))] = int(typed.group(2))
    assert sorted(files) == sorted(FILES)
    for name in FILES:
        vectors = DOCS[name]["vectors"]
        assert files[name] == len(vectors), name
        counts: dict[str, int] = {}
        for vec in vectors:
            counts[vec["type"]] = counts.get(vec["type"], 0) + 1
        assert {t: n for (f, t), n in types.items() if f == name} == counts, name
    analyses = sum(len(v["analyses"]) for v in DOCS["analyses.json"]["vectors"])
    assert re.search(rf"`analyses`: {analyses} ", section), analyses
    # the members the table promises are the ones the files have
    study = next(v for v in DOCS["study_ids.json"]["vectors"] if v["type"] == "study")
    assert "study_id" in study and "sha256" not in study and "`study_id`" in section
    aggregate = next(v for v in DOCS["sketch.json"]["vectors"] if v["id"] == "aggregate-l1")
    shape = re.search(r"`l1` \(`(\{[^`]*\})`", section).group(1)
    assert set(re.findall(r'"([a-z0-9_]+)"', shape)) == set(aggregate["l1"])


def test_error_table_lists_every_problem_slug_with_its_status():
    """docs/protocol.md section 8's table is the catalogue (dpsketch.protocol.problems): the same
    slugs, each with its default status, so a client written from the document knows every
    problem a service can answer."""
    import re

    from dpsketch.protocol.problems import CATALOGUE

    text = (ROOT / "docs" / "protocol.md").read_text()
    section = text[text.index("\n## 8. Errors"):]
    section = section[:section.index("\n## ", 1)]
    rows = dict(re.findall(r"^\| `([a-z-]+)` \| (\d{3}) \|", section, re.M))
    assert rows == {slug: str(status) for slug, (status, _title) in CATALOGUE.items()}
