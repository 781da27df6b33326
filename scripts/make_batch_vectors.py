"""Write the test vectors of batch proofs' wire records (docs/protocol.md section 4d,
docs/validity.md section 15) into conformance/batch_validity.json.

    .venv/bin/python scripts/make_batch_vectors.py            # (re)write the file
    .venv/bin/python scripts/make_batch_vectors.py --check    # exit 1 if it would change

The single source of the file: after a change to the batch core (its wrap bits' PRG, say),
regenerate with this script and the test (tests/test_batch_records.py) follows.

Deterministic: the study's seed, the noise key, the client's keystream key and the round's
query seed are fixed bytes. Each vector is one sketch study with ``validity`` and
``batch_proofs`` and one batch of m = 3 rows of w = 4 through the whole path an independent
client and server must reproduce: the batch plan the study gives for m (the header's fields and
every length), the noisy vectors as ring integers and grid units (the clipping, sign and noise are
pinned by conformance/noise.json and validity.json already), the roots of each row's slack, the
client keystream's draws in order (the helpers' 32-byte seeds, helper by helper in position
order, then the prove randomness), the headers, every part, the wrap seed, the first bytes of the
wrap bits and the SHA-256 of all of them, the projections, their digits, the digits part, the
batch id, the row ids, the joint randomness, the leader's input and proof shares, each server's
record (media type and hex bytes), input and proof shares (a helper's expanded from its seed) and
coordinate shares, at a fixed query seed each server's
verifier share, their sum and the decision, and the decision with the leader's first proof
element plus one. Field elements are decimal strings, F_(p^2) elements pairs [c0, c1].

Vectors of type ``batch_rows`` start from raw rows and one client key instead, through the path a
client runs (report.prepare_proof_batch, one keystream for the signs, the noise, the seeds, the
blind and the prove randomness), to every server's record, the batch id and the row ids; the
second has m = 15 rows in calls of L = 2, so one padding row.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dpsketch.client_sdk.prepare import signed_vectors  # noqa: E402
from dpsketch.protocol import batch_records, batch_validity, field, flp, report, validity, wraparound  # noqa: E402
from dpsketch.protocol.keystream import Keystream  # noqa: E402
from dpsketch.protocol.study import design  # noqa: E402

OUT = ROOT / "conformance" / "batch_validity.json"
#: the wrap bits given in full up to this many bytes (the table's first rows, row-major)
WRAP_BYTES_SHOWN = 64


def _dec(a) -> list:
    return np.vectorize(lambda v: str(int(v)), otypes=[object])(np.asarray(a, dtype=np.uint64)).tolist()


def _fixed(label: str, size: int = 32) -> bytes:
    return hashlib.sha256(b"dpsketch/batch-vector/1/" + label.encode()).digest()[:size]


def study_of(label: str, servers: list[str]):
    return design(name=label, columns=["x1", "x2", "x3", "y"], label="y", servers=servers,
                  expected_reports=10_000, seed=_fixed(label + "/study").hex(), validity=True,
                  batch_proofs=True)[0]


def batch_vector(label: str, servers: list[str], leader: int, rows: list[list[float]]) -> dict:
    study = study_of(label, servers)
    m = len(rows)
    plan = batch_validity.study_plan(study, m)
    c = plan.circuit
    noise_stream = Keystream.from_key(_fixed(label + "/noise"))
    a = np.array(rows, dtype=np.float64)
    encoded = (report.noisy_encoded(signed_vectors(a, study, noise_stream), study, noise_stream)
               if study.secret_sign else report.privatize_encoded(a, study, noise_stream))
    units = validity.grid_units(validity.plan(study), encoded)
    prefix = c.prefix(units)
    proved = batch_validity.prove(plan, units, Keystream.from_key(_fixed(label + "/client")), leader)
    # what the client computed on the way (the core's steps again, from the proved batch's parts)
    seed = batch_validity.wrap_seed(plan, proved.parts)
    table = wraparound.bits(seed, c.reps, c.v_len)
    proj = field.decode_int(wraparound.project(prefix[:c.v_len], table))
    bid = batch_validity.batch_id(seed, proved.digits_part)
    jr = flp.joint_rand(c, [bid])
    query_seed = _fixed(label + "/query-seed")
    servers_out, messages = [], []
    for position in range(plan.n_servers):
        media_type, body = batch_records.records(plan, proved)[position]
        rec, _, batch = batch_records.receive(study, position, media_type, body)
        assert batch.batch_id == bid and batch.wrap_seed == seed
        share = batch_validity.verifier_share(plan, batch, query_seed)
        messages.append((batch.batch_id, share))
        servers_out.append({
            "position": position, "media_type": media_type, "record": body.hex(),
            "seed": None if rec.seed is None else rec.seed.hex(),
            "input_share": _dec(batch.inputs), "proof_share": _dec(batch.proof),
            "coordinate_shares": _dec(batch_validity.coordinate_shares(plan, batch)),
            "verifier_share": _dec(share)})
    total = flp.reconstruct([np.asarray(v)[None] for _, v in messages])[0]
    tampered = list(messages)
    lead = proved.leader
    proof = proved.leader_proof.copy()
    proof[0] = field.add(proof[0], np.uint64(1))
    forged = batch_validity.ServerBatch(lead, proved.leader_inputs, proof, seed, bid)
    tampered[lead] = (bid, batch_validity.verifier_share(plan, forged, query_seed))
    table_bytes = table.tobytes()
    return {
        "id": label, "type": "batch_proof",
        "study": study.model_dump(mode="json"), "study_id": study.study_id,
        "plan": {"m": c.m, "w": c.w, "r2": c.r2, "reps": c.reps, "threshold": c.threshold,
                 "n_servers": plan.n_servers, "shift": plan.shift, "squares": c.squares, "k": c.k,
                 "rows_per_call": c.rows_per_call, "rows": c.rows, "wrap_digits": c.wrap_digits,
                 "wrap_bound": c.wrap_bound, "v_len": c.v_len, "input_len": c.input_len,
                 "proof_len": c.proof_len, "verifier_len": c.verifier_len,
                 "leader_length": batch_records.leader_length(plan),
                 "helper_length": batch_records.helper_length(plan.n_servers)},
        "rows": rows, "noise_key": _fixed(label + "/noise").hex(), "encoded": _dec(encoded),
        "units": units.tolist(),
        "roots": field.decode_int(prefix[:c.v_len]).reshape(c.rows, c.k)[:, c.w:].tolist(),
        "prefix": _dec(prefix),
        "client_key": _fixed(label + "/client").hex(), "leader": lead,
        "helper_seeds": {str(j): s.hex() for j, s in enumerate(proved.seeds) if s is not None},
        "blind": proved.blind.hex(),
        "plan_header": plan.header.hex(), "record_header": batch_records.header_bytes(plan, lead).hex(),
        "parts": [p.hex() for p in proved.parts], "wrap_seed": seed.hex(),
        "wrap_bits_first": table_bytes[:WRAP_BYTES_SHOWN].hex(), "wrap_bits_bytes": len(table_bytes),
        "wrap_bits_sha256": hashlib.sha256(table_bytes).hexdigest(),
        "projections": [int(v) for v in proj],
        "wrap_input": _dec(c.wrap_input(proj)),
        "digits_part": proved.digits_part.hex(), "batch_id": bid.hex(),
        "row_ids": [r.tobytes().hex() for r in batch_validity.row_ids(bid, m)],
        "joint_rand": _dec(jr),
        "leader_inputs": _dec(proved.leader_inputs), "leader_proof": _dec(proved.leader_proof),
        "servers": servers_out,
        "query_seed": query_seed.hex(), "t": _dec(flp.query_point(query_seed)),
        "verifier": _dec(total),
        "decision": batch_validity.decide(plan, messages),
        "tampered_decision": batch_validity.decide(plan, tampered),
    }


def rows_vector(label: str, study_label: str, servers: list[str], leader: int, rows: list[list[float]]) -> dict:
    """Raw rows and one keystream key to every server's record through the one path a client runs
    (report.prepare_proof_batch: map and clip, the secret signs, the noise, then the helpers'
    seeds, the leader's blind and the prove randomness, all from Keystream.from_key(client_key)):
    what an independent client must reproduce from the rows alone. The noisy ring vectors (the
    same first draws) are given too, to tell a noise difference from a proof difference."""
    study = study_of(study_label, servers)
    key = _fixed(label + "/client")
    a = np.array(rows, dtype=np.float64)
    batch = report.prepare_proof_batch(study, a, Keystream.from_key(key), leader)
    plan = batch_validity.study_plan(study, len(rows))
    encoded = report._noisy_rows(study, a, Keystream.from_key(key)).encoded
    return {
        "id": label, "type": "batch_rows", "study": study.model_dump(mode="json"), "study_id": study.study_id,
        "rows": rows, "client_key": key.hex(), "leader": batch.leader,
        "plan": {"m": plan.m, "rows_per_call": plan.circuit.rows_per_call, "rows": plan.circuit.rows,
                 "input_len": plan.circuit.input_len, "proof_len": plan.circuit.proof_len},
        "encoded": _dec(encoded),
        "records": [{"position": j, "media_type": mt, "record": body.hex()} for j, (mt, body) in enumerate(batch.records)],
        "batch_id": batch.batch_id.hex(), "row_ids": [r.hex() for r in batch.report_ids],
        "clamped": [int(c) for c in batch.clamped], "clipped": int(batch.clipped),
    }


def vectors() -> dict:
    return {
        "format": "dpsketch-conformance/1",
        "spec_version": "batch-draft-3",
        "protocol": "dpsketch/2",
        "category": "batch_validity",
        "description": (
            "Batch proofs' wire records (docs/protocol.md section 4d; docs/validity.md section 15), "
            "draft: servers do not accept them yet. One batch of a sketch study with validity and "
            "batch_proofs per vector, from the noisy ring vectors to every server's record, verifier "
            "share and the decision. Field elements are decimal strings (F_p, p = 2^64 - 2^32 + 1), "
            "F_(p^2) elements pairs [c0, c1]. The client keystream (Keystream.from_key(client_key)) is "
            "drawn in this order: the helpers' 32-byte seeds (helper by helper in position order), "
            "the leader's 32-byte blind, then the prove randomness (flp.prove_rand). wrap_bits_first: the first bytes of the "
            "(ceil(v_len / 8), r + 1) table, row-major. roots: each row's slack's roots (padding rows "
            "too). tampered_decision: the leader's first proof element plus one. Vectors of type batch_rows "
            "start from raw rows instead: one keystream (Keystream.from_key(client_key)) gives the secret signs, "
            "the noise, then the seeds, the blind and the prove randomness (report.prepare_proof_batch), and "
            "every server's record follows; encoded: the noisy ring vectors on the way."),
        "tolerance_rule": "exact",
        "vectors": [
            batch_vector("two-servers", ["s0", "s1"], 0,
                         [[0.3, -0.2, 0.5, 0.1], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]),
            batch_vector("three-servers-leader-last", ["s0", "s1", "s2"], 2,
                         [[-0.6, 0.1, 0.2, 0.3], [0.5, -0.5, 0.5, -0.5], [0.9, 0.0, -0.1, 0.2]]),
            rows_vector("rows-two-servers", "two-servers", ["s0", "s1"], 1,
                        [[0.3, -0.2, 0.5, 0.1], [3.0, 0.0, 0.0, 4.0], [-0.25, 0.5, 0.0, -0.75]]),
            rows_vector("rows-three-servers-padding", "three-servers-leader-last", ["s0", "s1", "s2"], 0,
                        [[round(0.07 * ((5 * i + j) % 13) - 0.4, 2) for j in range(4)] for i in range(15)]),
        ],
    }


def render() -> str:
    return json.dumps(vectors(), indent=1) + "\n"


def main(argv: list[str] | None = None) -> int:
    from scripts.make_flp_vectors import vectors_cli

    return vectors_cli(render, OUT, "make_batch_vectors.py", argv)


if __name__ == "__main__":
    sys.exit(main())
