"""Write the validity-proof test vectors (docs/validity.md) into conformance/flp.json.

    .venv/bin/python scripts/make_flp_vectors.py            # (re)write conformance/flp.json
    .venv/bin/python scripts/make_flp_vectors.py --check    # exit 1 if the file would change
    .venv/bin/python scripts/make_flp_vectors.py --out F    # write elsewhere

Deterministic: every random input (prove randomness, the helpers' seeds) comes from a ChaCha20
keystream under a fixed key (``Keystream.from_key``), the report ids and the query seed are
fixed bytes. Each vector is one report of a small NormBound instance (w = 3, beta = 4, q = 3,
R^2 = 200) through the whole core: the input digits, the joint randomness derived from the
report id, the proof, the seed-compressed shares, each server's verifier share at the query
point t from the query seed, their sum and the decision. Field elements are decimal strings
(uint64, as in the other conformance files); an F_(p^2) element is a pair [c0, c1].
tests/test_flp.py checks the file against this generator and recomputes parts of it
independently (the joint randomness and seed expansion from hashlib and ``cryptography``).
Another implementation of docs/validity.md checks itself against the same file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dpsketch.protocol import circuits, flp  # noqa: E402
from dpsketch.protocol.keystream import Keystream  # noqa: E402

OUT = ROOT / "conformance" / "flp.json"


def _dec(a: np.ndarray) -> list:
    """uint64 arrays as nested lists of decimal strings."""
    return np.vectorize(lambda v: str(int(v)), otypes=[object])(np.asarray(a, dtype=np.uint64)).tolist()


def _fixed(label: str, size: int = 32) -> bytes:
    return hashlib.sha256(b"dpsketch/flp-vector/1/" + label.encode()).digest()[:size]


def circuit() -> circuits.NormBound:
    return circuits.NormBound(w=3, beta=4, q=3, r2=200)


def report(label: str, x: list[int], num_shares: int, digits: np.ndarray | None = None,
           description: str = "") -> dict:
    """One report through prove, sharing, query and decide."""
    c = circuit()
    inputs = c.encode(np.array([x])) if digits is None else digits.reshape(1, -1).astype(np.uint64)
    report_id = _fixed(label + "/report-id", 16)
    jr = flp.joint_rand(c, [report_id])
    stream = Keystream.from_key(_fixed(label + "/client"))
    pr = flp.prove_rand(c, 1, stream)
    proof = flp.prove(c, inputs, jr, pr)
    shares = flp.share_proofs(flp.share_inputs(c, inputs, num_shares, stream), proof)
    helpers = [flp.expand_share(c, s) for s in shares.helper_seeds]
    query_seed = _fixed(label + "/query-seed")
    t = flp.query_point(query_seed)
    per_server = [(xs, ps) for xs, ps in helpers] + [(shares.leader_inputs, shares.leader_proofs)]
    verifier_shares = [flp.query(c, xs, ps, jr, t, num_shares) for xs, ps in per_server]
    verifier = flp.reconstruct(verifier_shares)
    parts = flp.decision_parts(c, verifier, jr)
    return {
        "id": label, "type": "norm_bound_report", "description": description,
        "x": x, "num_shares": num_shares, "input": _dec(inputs[0]),
        "report_id": report_id.hex(), "joint_rand": _dec(jr[0]), "prove_rand": _dec(pr[0]),
        "proof": _dec(proof[0]),
        "helper_seeds": [s[0].tobytes().hex() for s in shares.helper_seeds],
        "helper_input_shares": [_dec(xs[0]) for xs, _ in helpers],
        "helper_proof_shares": [_dec(ps[0]) for _, ps in helpers],
        "leader_input_share": _dec(shares.leader_inputs[0]), "leader_proof_share": _dec(shares.leader_proofs[0]),
        "query_seed": query_seed.hex(), "t": _dec(t),
        "verifier_shares": [_dec(v[0]) for v in verifier_shares], "verifier": _dec(verifier[0]),
        "v_is_zero": bool(parts["v_is_zero"][0]), "gadgets_hold": [bool(g[0]) for g in parts["gadgets"]],
        "decision": bool(flp.decide(c, verifier, jr)[0]),
    }


def vectors() -> dict:
    c = circuit()
    over = circuits.to_digits(np.array([[20 + c.half, 0 + c.half, 0 + c.half]]), c.beta, c.q)
    # x = (20, 0, 0): |x|^2 = 400 > R^2 = 200; the slack digits claim s = 0 (in range): the norm
    # equation fails, every digit is in range
    over = np.concatenate([over, np.zeros((1, c.slack_digits), dtype=np.uint64)], axis=1)
    return {
        "format": "dpsketch-conformance/1",
        "spec_version": "validity-draft-1",
        "protocol": "dpsketch/2",
        "category": "flp",
        "description": (
            "Fully linear proofs over F_p, p = 2^64 - 2^32 + 1, with randomness in F_(p^2) = F_p[X]/(X^2 - 7) "
            "(docs/validity.md; not yet part of docs/protocol.md). Circuit NormBound(w=3, beta=4, q=3, R^2=200): "
            "input = for each coordinate x_i the 3 little-endian base-4 digits of x_i + 32, then the 4 digits of "
            "the slack s = R^2 - |x|^2. Field elements are decimal strings, F_(p^2) elements pairs [c0, c1]. "
            "joint_rand = [r (the range gadget's weights 1, r, r^2, ...), rho (combines the checks)] derived "
            "from report_id; proof = per gadget 2 seeds per wire then the gadget polynomial's coefficients "
            "(F_(p^2) ones as c0, c1); helper shares expand from helper_seeds (input share first, then proof "
            "share); verifier = per server [v, f_1(t)..f_L(t), q(t) per gadget], summed mod p."),
        "tolerance_rule": "exact",
        "circuit": c.describe(),
        "vectors": [
            report("valid-2-servers", [3, -4, 5], 2, description="|x|^2 = 50 <= 200: accepted"),
            report("valid-3-servers-at-the-bound", [-10, 10, 0], 3, description="|x|^2 = 200 = R^2: accepted"),
            report("norm-above-bound", [20, 0, 0], 2, digits=over,
                   description="|x|^2 = 400 > 200 with slack digits 0: the norm check fails, v != 0"),
        ],
    }


def render() -> str:
    return json.dumps(vectors(), indent=1) + "\n"


def vectors_cli(render_text, default_out: Path, generator: str, argv: list[str] | None = None) -> int:
    """The command line of a vectors script: write the file, or with --check exit 1 if it would
    change (shared with scripts/make_validity_vectors.py)."""
    parser = argparse.ArgumentParser(description=f"Write {default_out.name} (see {generator}'s docstring).")
    parser.add_argument("--check", action="store_true", help="compare with the file instead of writing it")
    parser.add_argument("--out", type=Path, default=default_out, help=f"file to write (default: conformance/{default_out.name})")
    args = parser.parse_args(argv)
    text = render_text()
    if args.check:
        if not args.out.exists() or args.out.read_text() != text:
            print(f"out of date: {args.out} (run scripts/{generator})")
            return 1
        return 0
    args.out.write_text(text)
    print(f"wrote {args.out}: {len(json.loads(text)['vectors'])} vectors")
    return 0


def main(argv: list[str] | None = None) -> int:
    return vectors_cli(render, OUT, "make_flp_vectors.py", argv)


if __name__ == "__main__":
    sys.exit(main())
