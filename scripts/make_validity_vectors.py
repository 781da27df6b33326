"""Write the test vectors of a validity study's reports (docs/validity.md, issue 40) into
conformance/validity.json.

    .venv/bin/python scripts/make_validity_vectors.py            # (re)write the file
    .venv/bin/python scripts/make_validity_vectors.py --check    # exit 1 if it would change

Deterministic: the study's seed, the client's keystream key and the servers' contributions are
fixed bytes. Each vector is one study with ``validity = "norm-bound/1"`` (its JSON, so its id)
and a batch of reports through the whole path an independent client and server must reproduce:
the plan derived from the study (grid, R^2, digits), the noisy vectors as ring integers (the
input of ``validity.prepare``: clipping, sign and noise are pinned by conformance/ already), the
grid units (of the noise alone for a histogram, whose one-hot rows are given too; of the noise
e = u - psi(r) for a gram or moments study, whose clipped rows, witness and proved scale are given
too), the input digits, the client keystream's draws in order (helpers' seeds, binding
salts, prove randomness), the report ids, the joint randomness, the proofs, the leader's shares,
each server's coordinate shares and split words, the round (contributions, commitments, query
seed, t), each server's verifier shares, their sum and the decisions; and one tampered report
refused. Field elements are decimal strings; F_(p^2) elements pairs [c0, c1].
tests/test_validity.py checks the file against this generator and recomputes the round's
hashes with hashlib.
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
from dpsketch.protocol import binding, features, field, flp, parties, report, validity  # noqa: E402
from dpsketch.protocol.keystream import Keystream  # noqa: E402
from dpsketch.protocol.study import design  # noqa: E402

OUT = ROOT / "conformance" / "validity.json"


def _dec(a) -> list:
    return np.vectorize(lambda v: str(int(v)), otypes=[object])(np.asarray(a, dtype=np.uint64)).tolist()


def _fixed(label: str, size: int = 32) -> bytes:
    return hashlib.sha256(b"dpsketch/validity-vector/1/" + label.encode()).digest()[:size]


def study_vector(label: str, servers: list[str], full: int, rows: list[list], epsilon: float = 1.0) -> dict:
    """One validity study's batch; ``epsilon`` = 4 (the default floor) gives a study without
    client noise (sigma = 0: its grid from the servers' noise, validity.floor_grid; t = 0)."""
    histogram = label.startswith("histogram")
    if histogram:
        spec = {"axes": [{"column": "age", "edges": [0, 40]}, {"column": "city", "categories": ["a", "b"]}],
                "marginal": True}
        study = design(name=label, columns=["age", "city"], label=None, servers=servers, kind="histogram",
                       histogram=spec, expected_reports=10_000, seed=_fixed(label + "/study").hex(),
                       validity=True, epsilon=epsilon)[0]
    else:
        kind = label.split("-")[0] if label.split("-")[0] in ("gram", "moments", "l1") else "sketch"
        study = design(name=label, columns=["x1", "x2", "y"], label="y", servers=servers, kind=kind,
                       expected_reports=10_000, seed=_fixed(label + "/study").hex(), validity=True,
                       epsilon=epsilon)[0]
    plan = validity.plan(study)
    noise_stream = Keystream.from_key(_fixed(label + "/noise"))
    onehot = None
    if histogram:
        values = np.array(rows, dtype=object)
        onehot = study.histogram.one_hot(study.histogram.cell_index(values))
        encoded = report.privatize_encoded(values, study, noise_stream)
        units = validity.grid_units(plan, encoded) - plan.circuit.unit * onehot.astype(np.int64)
        inputs = plan.circuit.encode(onehot, units)
    elif study.proved_features:  # gram, moments: the features of the clipped rows, their witness
        clipped = report.clipped_rows(np.array(rows, dtype=np.float64), study)
        encoded = report.noisy_encoded(features.client_vectors(study.kind, clipped), study, noise_stream)
        witness = validity.witness_rows(plan, clipped)
        units = validity.grid_units(plan, encoded) - plan.circuit.features(witness)  # the noise e
        inputs = plan.circuit.encode(witness, units)
    else:  # a sketch study's rows are signed (its secret sign); an l1 study's are not
        a = np.array(rows, dtype=np.float64)
        encoded = (report.noisy_encoded(signed_vectors(a, study, noise_stream), study, noise_stream)
                   if study.secret_sign else report.privatize_encoded(a, study, noise_stream))
        units = validity.grid_units(plan, encoded)
        inputs = plan.circuit.encode(units)
    proved = validity.prepare(study, encoded, Keystream.from_key(_fixed(label + "/client")), full=full,
                              onehot=onehot, rows=clipped if study.proved_features else None)
    return {
        "id": label, "type": "validity_study",
        "study": study.model_dump(mode="json"), "study_id": study.study_id,
        "plan": {**_plan(study, plan),
                 **({"t_upper": validity.client_scale(study, study.sigma * features.UPPER_SCALE), "lin": plan.circuit.lin,
                     "count_unit": plan.circuit.count_unit, "r2_row": plan.circuit.r2_row,
                     "q_row": plan.circuit.q_row, "H_row": plan.circuit.half_row,
                     "row_slack_digits": plan.circuit.row_slack_digits}
                    if study.proved_features else {})},
        **({"clipped": np.asarray(clipped).tolist(), "witness": witness.tolist(),
            "proved_scale": features.proved_scale(study.kind, study.row_width).tolist()}
           if study.proved_features else {}),
        "rows": rows, "onehot": None if onehot is None else onehot.astype(int).tolist(),
        "encoded": _dec(encoded), "units": units.tolist(), "input": _dec(inputs),
        **_proved(label, study, plan, proved, full),
    }


def _plan(study, plan) -> dict:
    """A plan as the vectors give it: the grid, the bound, the digits and every length."""
    grid = study.noise_grid
    return {"circuit": plan.circuit.name, "grid_shift": grid.shift, "frac_bits": grid.frac_bits,
            "t": validity.client_scale(study, study.sigma), "unit": getattr(plan.circuit, "unit", None),
            "blocks": getattr(plan.circuit, "blocks", None),
            "r2": plan.bound, "beta": plan.circuit.beta, "q": plan.circuit.q, "H": plan.circuit.half,
            "slack_digits": plan.circuit.slack_digits, "input_len": plan.input_len,
            "proof_len": plan.proof_len, "verifier_len": plan.verifier_len,
            "leader_width": plan.leader_width}


def _proved(label: str, study, plan, proved, full: int, verifier_len: int | None = None,
            client: str | None = None) -> dict:
    """A proved batch through the round: the client keystream's draws and what they made (ids,
    joint randomness, proofs, the leader's shares), each server's coordinate shares and split
    words, the round's contributions, commitments, query seed and point, each server's verifier
    shares (padded with zeros to ``verifier_len``: a study with parties) and their sum, the
    decisions, and those of a tampered copy (the leader's first input element of report 0 + 1)."""
    ids = proved.report_ids
    servers = study.servers
    jr = flp.joint_rand(plan.circuit, ids)
    views = []
    for seed in proved.seeds:
        payload = proved.leader if seed is None else seed
        views.append(validity.server_shares(plan, payload, seed is not None))
    contributions = [_fixed(f"{label}/contribution/{j}") for j in range(len(servers))]
    commitments = [validity.commitment(study.study_id, j, c) for j, c in enumerate(contributions)]
    query_seed = validity.query_seed(study.study_id, contributions)
    shares = [validity.verifier_shares(plan, query_seed, ids, x, p) for x, p in views]
    total = flp.reconstruct(shares)
    # a tampered copy: the leader's first input element of report 0 plus one
    leader = proved.leader.copy()
    leader[0, 0] = field.add(leader[0, 0], np.uint64(1))
    tampered = list(shares)
    tampered[full] = validity.verifier_shares(plan, query_seed, ids, *validity.server_shares(plan, leader, False))
    proofs = flp.reconstruct([p for _, p in views])
    pad = (lambda v: v) if verifier_len is None else (
        lambda v: np.concatenate([v, np.zeros((len(v), verifier_len - v.shape[1], 2), dtype=np.uint64)], axis=1))
    return {
        "full": full, "client_key": _fixed(client or label + "/client").hex(),
        "helper_seeds": {str(j): s.tobytes().hex() for j, s in enumerate(proved.seeds) if s is not None},
        "binding": [b.tobytes().hex() for b in proved.binding],
        "report_ids": [i.hex() for i in ids], "joint_rand": _dec(jr), "proof": _dec(proofs),
        "leader": _dec(proved.leader),
        "coordinate_shares": [_dec(validity.coordinate_shares(plan, x)) for x, _ in views],
        "aggregands": [_dec(validity.aggregand(plan, x)) for x, _ in views],
        "contributions": [c.hex() for c in contributions], "commitments": [c.hex() for c in commitments],
        "query_seed": query_seed.hex(), "t": _dec(flp.query_point(query_seed)),
        "verifier_shares": [_dec(pad(s)) for s in shares], "verifier": _dec(pad(total)),
        "decisions": validity.decide(plan, ids, total).tolist(),
        "tampered_decisions": validity.decide(plan, ids, flp.reconstruct(tampered)).tolist(),
    }


def parties_vector(label: str, servers: list[str], people: list[str], rows: list[list]) -> dict:
    """A signed sketch study with two parties (x1 | x2, y) and validity: each party's blocks of
    the same individuals (docs/validity.md section 13), from the party key's pseudonyms and signs
    to the decisions. Per party: its plan (NormBound of its width and its own bound B_j), its
    clipped signed blocks before noise (report.block_vectors), the noisy ring vectors (noise from
    Keystream.from_key(noise_key)), the digits, and everything of a proved batch as above with its
    own client keystream; the block ids hash the block prefix (docs/protocol.md 2d: domain,
    study id, party index, pseudonym) where a report id hashes the report domain and study id.
    The round is the study's: one query seed for both parties' blocks, each verifier share
    padded with zeros to the widest party's length (``verifier_len``)."""
    study = design(name=label, columns=["x1", "x2", "y"], label="y", servers=servers,
                   parties=[{"name": "bank", "columns": ["x1"]}, {"name": "clinic", "columns": ["x2", "y"]}],
                   secret_sign=True, expected_reports=10_000, seed=_fixed(label + "/study").hex(),
                   validity=True)[0]
    key = _fixed(label + "/party-key")
    pseudonyms = parties.pseudonyms(key, study.study_id, people)
    signs = parties.signs(key, study.study_id, pseudonyms)
    a = np.array(rows, dtype=np.float64)
    out = []
    for index, declared in enumerate(study.parties or []):
        plan = validity.party_plan(study, index)
        blocks = report.block_vectors(study, declared.name, a[:, parties.slices(study.parties)[index]], signs)
        encoded = report.noisy_encoded(blocks, study, Keystream.from_key(_fixed(f"{label}/{declared.name}/noise")))
        units = validity.grid_units(plan, encoded)
        full = index % len(servers)
        proved = validity.prepare(study, encoded, Keystream.from_key(_fixed(f"{label}/{declared.name}/client")),
                                  full=full, party=index, pseudonyms=pseudonyms)
        out.append({"party": declared.name, "index": index, "row_bound": declared.row_bound,
                    "plan": _plan(study, plan), "blocks": blocks.tolist(),
                    "noise_key": _fixed(f"{label}/{declared.name}/noise").hex(),
                    "encoded": _dec(encoded), "units": units.tolist(), "input": _dec(plan.circuit.encode(units)),
                    "block_prefixes": [b.hex() for b in binding.block_prefixes(study.study_id, index, pseudonyms)],
                    **_proved(label, study, plan, proved, full, validity.verifier_len(study),
                              f"{label}/{declared.name}/client")})
    return {"id": label, "type": "validity_parties_study", "study": study.model_dump(mode="json"),
            "study_id": study.study_id, "party_key": key.hex(), "individuals": people,
            "pseudonyms": [p.hex() for p in pseudonyms], "signs": signs.astype(int).tolist(), "rows": rows,
            "verifier_len": validity.verifier_len(study), "parties": out}


def vectors() -> dict:
    return {
        "format": "dpsketch-conformance/1",
        "spec_version": "validity-draft-4",
        "protocol": "dpsketch/2",
        "category": "validity",
        "description": (
            "Reports of studies with validity = norm-bound/1 (docs/validity.md): from the noisy ring "
            "vectors to the servers' verifier shares and decisions. Field elements are decimal strings "
            "(F_p, p = 2^64 - 2^32 + 1), F_(p^2) elements pairs [c0, c1]. The client keystream "
            "(Keystream.from_key(client_key)) is drawn in this order: the helpers' seeds (32 bytes a "
            "report, helper by helper in server order), the binding salts (docs/protocol.md 4a), the "
            "prove randomness (F_p elements by rejection, flp.prove_rand). tampered_decisions: the "
            "leader's first input element of report 0 plus one. A validity_parties_study (draft 4) "
            "holds one such batch per party, proved with the party's own plan, bound as blocks "
            "(block_prefixes), its verifier shares padded with zeros to the study's verifier_len. The "
            "studies at epsilon = 4 (floor-three-servers, histogram-floor, gram-floor) have no client "
            "noise: sigma = 0, t = 0, the grid from the servers' noise (docs/validity.md section 14)."),
        "tolerance_rule": "exact",
        "vectors": [
            study_vector("two-servers", ["s0", "s1"], 0, [[0.3, -0.2, 0.5], [1.0, 1.0, 1.0]]),
            study_vector("three-servers-leader-last", ["s0", "s1", "s2"], 2, [[-0.6, 0.1, 0.2]]),
            study_vector("histogram-marginal", ["s0", "s1", "s2"], 1, [[12.5, "b"], [77.0, "zz"]]),
            study_vector("gram-two-servers", ["s0", "s1"], 1, [[0.3, -0.2, 0.5], [1.0, 1.0, 1.0]]),
            study_vector("moments-three-servers", ["s0", "s1", "s2"], 0, [[-0.6, 0.1, 0.2]]),
            study_vector("l1-two-servers", ["s0", "s1"], 0, [[0.3, -0.2, 0.5], [0.1, 0.9, -0.4]]),
            # epsilon at the default floor of 4: no client noise (sigma = 0, t = 0), the grid from the
            # servers' noise and max_reports (validity.floor_grid; docs/validity.md section 14)
            study_vector("floor-three-servers", ["s0", "s1", "s2"], 1, [[0.3, -0.2, 0.5], [1.0, 1.0, 1.0]], epsilon=4.0),
            study_vector("histogram-floor", ["s0", "s1"], 0, [[12.5, "b"], [77.0, "zz"]], epsilon=4.0),
            study_vector("gram-floor", ["s0", "s1", "s2"], 2, [[0.3, -0.2, 0.5], [-0.6, 0.1, 0.2]], epsilon=4.0),
            parties_vector("parties-two-servers", ["s0", "s1"], ["alice", "bob"], [[0.3, -0.2, 0.5], [0.9, 0.8, -0.7]]),
        ],
    }


def render() -> str:
    return json.dumps(vectors(), indent=1) + "\n"


def main(argv: list[str] | None = None) -> int:
    from scripts.make_flp_vectors import vectors_cli

    return vectors_cli(render, OUT, "make_validity_vectors.py", argv)


if __name__ == "__main__":
    sys.exit(main())
