"""conformance/noise.json (docs/protocol.md sections 5 and 5a) recomputed by a scalar implementation
written here from the document's text, "The draw order" and "The clip bound B'", one value at a
time in plain Python integers, and by the product's code: a keystream key must give the same
sampler draws, secret signs and whole client batch (shares, seeds, salts, ids, proofs, bodies),
bit for bit, and each draw must end at the stated stream position."""

from __future__ import annotations

import decimal
import hashlib
import json
import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from dpsketch.client_sdk.prepare import prepare_batch
from dpsketch.protocol import noise
from dpsketch.protocol.keystream import Keystream
from dpsketch.protocol.study import Study

ROOT = Path(__file__).resolve().parents[1]
DOC = json.loads((ROOT / "conformance" / "noise.json").read_text())
VECTORS = DOC["vectors"]
U64 = 1 << 64


def of_type(kind: str) -> list[dict]:
    return [v for v in VECTORS if v["type"] == kind]


# --- the document's reading rules ---------------------------------------------------------------

class Stream:
    """ChaCha20 (RFC 8439) under the key, block counter 0, nonce b"dpsketch/rng", read as bytes."""

    def __init__(self, key: bytes):
        counter_and_nonce = bytes(4) + b"dpsketch/rng"
        self._enc = Cipher(algorithms.ChaCha20(key, counter_and_nonce), mode=None).encryptor()
        self.used = 0

    def read(self, n: int) -> bytes:
        self.used += n
        return self._enc.update(bytes(n))

    def words(self, n: int, size: int) -> list[int]:
        raw = self.read(size // 8 * n)
        step = size // 8
        return [int.from_bytes(raw[i:i + step], "little") for i in range(0, len(raw), step)]

    def bits(self, n: int) -> list[int]:
        raw = self.read((n + 7) // 8)
        return [(raw[i // 8] >> (i % 8)) & 1 for i in range(n)]

    def below(self, n: int, top: int, size: int) -> list[int]:
        w = self.words(n, size)
        while True:
            bad = [i for i, x in enumerate(w) if x >= top]
            if not bad:
                return w
            for i, x in zip(bad, self.words(len(bad), size)):
                w[i] = x

    def uniform_int(self, bound: int) -> int:
        nbytes = -(-bound.bit_length() // 8) + 8
        top = 1 << (8 * nbytes)
        while True:
            w = int.from_bytes(self.read(nbytes), "little")
            if w < top - top % bound:
                return w % bound


def cumulative(t: int, limit: int, block: int, bits: int, digits: int) -> list[int]:
    """floor(2^bits F_j), j < limit // block, in decimal arithmetic at ``digits`` digits."""
    last = limit // block
    with decimal.localcontext() as ctx:
        ctx.prec = digits
        two_t2 = decimal.Decimal(2 * t * t)
        terms = [(-decimal.Decimal((block * i) ** 2) / two_t2).exp() for i in range(last + 1)]
        total = sum(terms, decimal.Decimal(0))
        out, running = [], decimal.Decimal(0)
        for j in range(last):
            running += terms[j]
            out.append(int((running * (1 << bits) / total).to_integral_value(decimal.ROUND_FLOOR)))
    return out


class Table:
    def __init__(self, t: int, limit: int):
        self.t, self.limit = t, limit
        self.block = max(1, -(-(limit + 1) // 2048))
        a = cumulative(t, limit, self.block, 64, 90)
        assert a == cumulative(t, limit, self.block, 64, 130)  # no floor in doubt at this precision
        self.bounds = a

    def exact(self, j: int, bits: int) -> int:
        a = cumulative(self.t, self.limit, self.block, bits, bits // 3 + 60)
        return a[j]


_TABLES: dict[tuple[int, int], Table] = {}


def table(t: int, limit: int) -> Table:
    if (t, limit) not in _TABLES:
        _TABLES[(t, limit)] = Table(t, limit)
    return _TABLES[(t, limit)]


def bernoulli_exp(stream: Stream, gammas: list[int], den: int) -> list[int]:
    result = [0] * len(gammas)
    running = list(range(len(gammas)))
    k = 1
    while running:
        if k > 128:
            for i in running:
                kk = k
                while stream.uniform_int(kk * den) < gammas[i]:
                    kk += 1
                result[i] = kk & 1
            break
        m = k * den
        size = 32 if den < 1 << 24 and m < 1 << 28 else 64
        q = ((1 << size) - 1) // m
        w = stream.below(len(running), q * m, size)
        still = []
        for i, x in zip(running, w):
            if x < q * gammas[i]:
                still.append(i)
            else:
                result[i] = k & 1
        running = still
        k += 1
    return result


def draw(stream: Stream, count: int, t: int, limit: int) -> list[int]:
    tab = table(t, limit)
    m, bounds = tab.block, tab.bounds
    out: list[int] = []
    while len(out) < count:
        need = count - len(out)
        p = need + need // 16 + 16
        w = stream.words(p, 64)
        js = [sum(1 for b in bounds if b <= x) for x in w]
        for i, x in enumerate(w):  # ties, in index order, after all P words
            tied = [j for j, b in enumerate(bounds) if b == x]
            if not tied:
                continue
            js[i], u, bits = tied[0], x, 64
            while tied:
                u, bits = (u << 64) | stream.words(1, 64)[0], bits + 64
                still = []
                for j in tied:
                    f = tab.exact(j, bits)
                    if f < u:
                        js[i] = j + 1
                    elif f == u:
                        still.append(j)
                tied = still
        if m > 1:
            q = 0xFFFFFFFF // m
            rs = [x // q for x in stream.below(p, q * m, 32)]
            gammas = [(2 * m * j + r) * r for j, r in zip(js, rs)]
            keep = bernoulli_exp(stream, gammas, 2 * t * t)
            xs = [m * j + r for j, r, k in zip(js, rs, keep) if k and m * j + r <= limit]
        else:
            xs = js
        signs = stream.bits(len(xs))
        values = [-x if s else x for x, s in zip(xs, signs) if not (s and x == 0)]
        out += values[:need]
    return out


# --- the vectors ------------------------------------------------------------------------------

@pytest.mark.parametrize("vec", of_type("keystream"), ids=lambda v: v["id"])
def test_keystream(vec):
    key = bytes.fromhex(vec["key"])
    assert Stream(key).read(len(vec["bytes"]) // 2).hex() == vec["bytes"]
    assert [str(x) for x in Stream(key).words(4, 64)] == vec["words64"]
    assert [str(x) for x in Stream(key).words(4, 32)] == vec["words32"]
    assert Stream(key).bits(20) == vec["bits"]
    assert Keystream.from_key(key).bytes(len(vec["bytes"]) // 2).hex() == vec["bytes"]


@pytest.mark.parametrize("vec", of_type("block_table"), ids=lambda v: v["id"])
def test_block_table(vec):
    tab = table(vec["t"], vec["limit"])
    assert (tab.block, len(tab.bounds)) == (vec["block"], vec["entries"])
    raw = b"".join(b.to_bytes(8, "little") for b in tab.bounds)
    assert hashlib.sha256(raw).hexdigest() == vec["bounds_sha256"]
    if "bounds" in vec:
        assert [str(b) for b in tab.bounds] == vec["bounds"]
    else:
        assert [str(b) for b in tab.bounds[:8]] == vec["first"] and [str(b) for b in tab.bounds[-4:]] == vec["last"]
    product = noise._block_table(vec["t"], vec["limit"])
    assert product.block == vec["block"] and product.bounds.tolist() == tab.bounds


@pytest.mark.parametrize("vec", of_type("uniform_below") + of_type("bernoulli_exp"), ids=lambda v: v["id"])
def test_primitives(vec):
    key = bytes.fromhex(vec["key"])
    stream, product = Stream(key), Keystream.from_key(key)
    if vec["type"] == "uniform_below":
        bound = int(vec["bound"])
        size = 32 if bound < 1 << 28 else 64
        q = ((1 << size) - 1) // bound
        got = [x // q for x in stream.below(vec["count"], q * bound, size)]
        assert [str(x) for x in got] == vec["values"]
        assert [str(x) for x in noise.uniform_below(vec["count"], bound, product).tolist()] == vec["values"]
    else:
        nums, den = [int(x) for x in vec["nums"]], int(vec["den"])
        assert bernoulli_exp(stream, nums, den) == vec["results"]
        got = noise.bernoulli_exp(np.array(nums, dtype=np.uint64), den, product)
        assert [int(b) for b in got] == vec["results"]
        assert nums[0] == 0 and vec["results"][0] == 1  # exp(0) = 1
    assert stream.used == product.position == vec["bytes_used"]


@pytest.mark.parametrize("vec", of_type("sampler") + of_type("secret_sign"), ids=lambda v: v["id"])
def test_sampler_and_secret_sign(vec):
    key = bytes.fromhex(vec["key"])
    stream, product = Stream(key), Keystream.from_key(key)
    if vec["type"] == "secret_sign":
        assert [-1 if b else 1 for b in stream.bits(vec["rows"])] == vec["signs"]
        assert [-1 if b else 1 for b in product.bits(vec["rows"]).tolist()] == vec["signs"]
    else:
        assert draw(stream, vec["count"], vec["t"], vec["limit"]) == vec["draws"]
        got = noise.discrete_gaussian(vec["count"], vec["t"], vec["limit"], product)
        assert got.tolist() == vec["draws"]
        assert max(abs(x) for x in vec["draws"]) <= vec["limit"]
    assert stream.used == product.position == vec["bytes_used"]


def test_sampler_vectors_cover_both_word_sizes_partial_blocks_and_the_extremes():
    cases = {(v["t"], v["limit"]) for v in of_type("sampler")}
    dens = [2 * t * t for t, _ in cases]
    assert any(d < 1 << 24 for d in dens) and any(d >= 1 << 24 for d in dens)
    blocks = [(table(t, lim).block, lim) for t, lim in cases]
    assert any(m == 1 for m, _ in blocks) and any(m > 1 and (lim + 1) % m for m, lim in blocks)
    assert any(m > 1 and (lim + 1) % m == 0 for m, lim in blocks)
    assert (1 << 24, 20 * (1 << 24) - 1) in cases and any(lim == 0 for _, lim in cases)


# --- the study's parameters and a whole batch ----------------------------------------------------

def sensitivities(kind: str, b: float) -> tuple[float, float]:
    """(replace-one, add/remove) as docs/protocol.md section 5 writes them, in doubles."""
    if kind in ("sketch", "l1"):
        return 2.0 * b, b
    b2 = b * b
    if kind == "gram":
        replace = math.sqrt(2.0 * b2 * b2 + 2.0 * b2 + 0.5) if b2 >= 0.5 else 2.0 * math.sqrt(b2)
        return replace, math.sqrt(b2 + b2 * b2 + 1.0)
    if kind == "moments":
        return math.sqrt(2.0) * b2, b2
    return math.sqrt(2.0) * b, b


def spec_parameters(study: Study) -> dict:
    """Grid, t, L and B' from the text of section 5."""
    f = study.frac_bits
    s_prime = study.s + 1 if study.kind == "l1" else study.s
    server_sd = study.server_sigma * math.sqrt(s_prime)
    largest = max(study.sigma, server_sd)
    shift = 0
    while largest > 0 and largest * 2.0 ** (f - shift) > 2 ** 24:
        shift += 1
    h = 2.0 ** (shift - f)

    def tl(sd: float) -> dict:
        return {"t": max(1, math.ceil(sd / h)), "limit": max(0, math.floor((20.0 * sd) / h) - 1)}

    rho = h * math.sqrt(study.width)
    if study.kind == "histogram":
        clip = study.row_bound
    else:
        full = sensitivities(study.kind, study.row_bound)
        lo, hi = 0.0, study.row_bound
        for _ in range(80):
            mid = 0.5 * (lo + hi)
            here = sensitivities(study.kind, mid)
            if here[0] + rho <= full[0] and here[1] + rho <= full[1]:
                lo = mid
            else:
                hi = mid
        clip = lo
    return {"shift": shift, "spacing": h, "clip_bound": clip,
            "client": tl(study.sigma) if study.sigma > 0 else None,
            "server": {"std": server_sd, **tl(server_sd)} if study.server_sigma > 0 else None}


@pytest.mark.parametrize("vec", of_type("noise_parameters"), ids=lambda v: v["id"])
def test_noise_parameters(vec):
    study = Study.model_validate(vec["study"])
    assert study.study_id == vec["study_id"] and study.width == vec["width"]
    spec = spec_parameters(study)
    for key in ("shift", "spacing", "clip_bound", "client", "server"):
        assert spec[key] == vec[key], key
    assert study.clip_bound == vec["clip_bound"]
    if study.kind in ("sketch", "l1") and study.parties is None:
        # the add/remove condition binds: B' = B - h sqrt(W), to the last bit or two
        assert vec["clip_bound"] == pytest.approx(study.row_bound - spec["spacing"] * math.sqrt(study.width),
                                                  rel=0, abs=4e-16 * study.row_bound)
    if study.parties is not None:
        h = vec["spacing"]
        assert vec["party_clip_bounds"] == [{"name": p.name, "clip_bound": max(0.0, p.row_bound - (h * math.sqrt(p.width)) / 2)}
                                            for p in study.parties]
        joined = math.sqrt(sum(p.row_bound ** 2 for p in study.parties))
        assert joined <= study.row_bound * (1 + 1e-12)


def spec_vectors(study: Study, rows) -> np.ndarray:
    """The client vectors of rows that need no clipping (sections 2a, 2b, 2e), in doubles."""
    if study.histogram is not None:
        return study.histogram.one_hot(study.histogram.cell_index(np.array(rows, dtype=object)))
    a = np.array(rows, dtype=np.float64)
    if study.bounds is not None:
        lo = np.array([b[0] for b in study.bounds])
        hi = np.array([b[1] for b in study.bounds])
        mid, half = lo / 2 + hi / 2, hi / 2 - lo / 2
        z = np.minimum(np.maximum((np.minimum(np.maximum(a, lo), hi) - mid) / half, -1.0), 1.0)
        u = np.column_stack([z, np.ones(len(a))]) if study.kind in ("sketch", "moments", "l1") else z
        a = u * (study.clip_bound / math.sqrt(u.shape[1]))
    assert np.all(np.sqrt(np.sum(a * a, axis=1)) < study.clip_bound * (1 - 1e-9))  # nothing to clip
    if study.kind == "gram":
        d = a.shape[1]
        pairs = [(math.sqrt(2.0) * a[:, i]) * a[:, j] for i in range(d) for j in range(i + 1, d)]
        return np.column_stack([a, a * a, *pairs, np.ones(len(a))])
    return a


@pytest.mark.parametrize("vec", of_type("batch"), ids=lambda v: v["id"])
def test_batch_from_its_key(vec):
    """The whole client batch, rebuilt by the text's order from the key alone."""
    study = Study.model_validate(vec["study"])
    assert study.study_id == vec["study_id"]
    params = spec_parameters(study)
    assert (params["clip_bound"], params["shift"], params["client"]) == (vec["clip_bound"], vec["shift"], vec["client"])
    m, n, width = len(vec["rows"]), study.n_servers, study.width
    stream = Stream(bytes.fromhex(vec["key"]))
    x = spec_vectors(study, vec["rows"])
    if study.secret_sign:
        signs = [-1 if b else 1 for b in stream.bits(m)]
        assert signs == vec["signs"]
        x = x * np.array(signs, dtype=np.float64)[:, None]
    else:
        assert vec["signs"] is None
    assert x.tolist() == vec["vectors"]
    assert stream.used == vec["bytes_after_signs"]
    shift, f = params["shift"], study.frac_bits
    encoded = [[round(Fraction(v) * 2 ** (f - shift)) * 2 ** shift for v in row] for row in x.tolist()]
    assert [[str(v % U64) for v in row] for row in encoded] == vec["encoded"]
    client = params["client"]
    draws = draw(stream, m * width, client["t"], client["limit"]) if client else [0] * (m * width)
    assert draws == vec["noise"] and stream.used == vec["bytes_after_noise"]
    noisy = [[(encoded[i][c] + draws[i * width + c] * 2 ** shift) % U64 for c in range(width)] for i in range(m)]
    assert [[str(v) for v in row] for row in noisy] == vec["noisy"]
    # shares or seeds, then salts
    full = vec["full"] if vec["compress"] else None
    payloads: list = [None] * n
    contents = [1] * n
    if full is None:
        for j in range(n - 1):
            words = stream.words(m * width, 64)
            payloads[j] = [words[i * width:(i + 1) * width] for i in range(m)]
    else:
        for j in [j for j in range(n) if j != full]:
            raw = stream.read(32 * m)
            payloads[j] = [raw[32 * i:32 * (i + 1)] for i in range(m)]
            contents[j] = 2
    last = [row[:] for row in noisy]
    for j in range(n):
        if payloads[j] is None:
            continue
        for i in range(m):
            share = payloads[j][i] if contents[j] == 1 else expand(payloads[j][i], width)
            last[i] = [(a - b) % U64 for a, b in zip(last[i], share)]
    payloads[full if full is not None else n - 1] = last
    salts = stream.read(16 * n * m)
    assert stream.used == vec["bytes_used"]
    study_id = bytes.fromhex(study.study_id)
    ids, commitments = [], []
    for i in range(m):
        row = []
        for j in range(n):
            p = payloads[j][i]
            body = p if contents[j] == 2 else b"".join(v.to_bytes(8, "little") for v in p)
            salt = salts[16 * (j * m + i):16 * (j * m + i + 1)]
            row.append(hashlib.sha256(b"dpsketch/commit/2" + bytes((j, contents[j])) + salt + body).digest()[:16])
        commitments.append(row)
        ids.append(hashlib.sha256(b"dpsketch/report/2" + study_id + b"".join(row)).digest()[:16])
    assert [r.hex() for r in ids] == vec["report_ids"]
    assert [[c.hex() for c in row] for row in commitments] == vec["commitments"]
    for j, server in enumerate(vec["servers"]):
        proofs = [salts[16 * (j * m + i):16 * (j * m + i + 1)] + b"".join(c for o, c in enumerate(commitments[i]) if o != j)
                  for i in range(m)]
        assert [p.hex() for p in proofs] == server["proofs"]
        if contents[j] == 2:
            records = [ids[i] + proofs[i] + payloads[j][i] for i in range(m)]
            assert server["media_type"] == "application/x-dpsketch-seeds"
            assert [s.hex() for s in payloads[j]] == server["seeds"]
        else:
            records = [ids[i] + proofs[i] + b"".join(v.to_bytes(8, "little") for v in payloads[j][i]) for i in range(m)]
            assert server["media_type"] == "application/x-dpsketch-shares" and server["seeds"] is None
            assert [[str(v) for v in row] for row in payloads[j]] == server["share"]
        assert b"".join(records).hex() == server["body"]
    # the product's client, from the same key, sends the same bodies
    rows = np.array(vec["rows"], dtype=object if study.histogram is not None else np.float64)
    batch = prepare_batch(study, rows, compress=vec["compress"], full=full, stream=Keystream.from_key(bytes.fromhex(vec["key"])))
    assert [r.hex() for r in batch.report_ids] == vec["report_ids"]
    assert [batch.body(j).hex() for j in range(n)] == [s["body"] for s in vec["servers"]]


def expand(seed: bytes, width: int) -> list[int]:
    """Section 4: the seed's ChaCha20 keystream, nonce SHA-256("dpsketch/seed-share/1")[:12]."""
    nonce = hashlib.sha256(b"dpsketch/seed-share/1").digest()[:12]
    raw = Cipher(algorithms.ChaCha20(seed, bytes(4) + nonce), mode=None).encryptor().update(bytes(8 * width))
    return [int.from_bytes(raw[8 * i:8 * i + 8], "little") for i in range(width)]


def test_batch_vectors_cover_signs_seeds_bounds_gram_and_histogram():
    kinds = {(v["study"]["kind"], v["compress"], v["signs"] is not None, "bounds" in v["study"]) for v in of_type("batch")}
    assert ("sketch", False, True, False) in kinds and ("sketch", True, True, True) in kinds
    assert any(k[0] == "gram" for k in kinds) and any(k[0] == "histogram" and k[1] for k in kinds)
