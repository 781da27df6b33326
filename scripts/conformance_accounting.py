"""The add/remove accounting vectors of conformance/accounting.json (written by
scripts/make_conformance.py; docs/protocol.md sections 5 and 10).

* ``presence``: the epsilon at delta of the add/remove pair P = N(shift e_1, ratio I_width)
  against Q = N(0, I_width), both directions, as the reference computes it (pessimistic
  privacy-loss distributions on the 10^-3 grid, or coarser for a very wide law; ratio 1: the
  Gaussian's closed form); ``signed``: the secret sign's mixture on width + 1 columns instead.
* ``study_guarantee``: a study (add/remove of every kind; replace-one for the same check's other
  branch: the Gaussian, and the sign mixture's bound), as a server would serve it, and what a client checking
  it must find: its epsilon at lambda_star and at 1 (the floor) for the noise really drawn
  (``Study.report_epsilon``: section 5a's argument included; null when unbounded) and the verdict, ``accepted`` or
  ``refused`` (the reference's ``Study`` refuses it: the noise does not give the promised epsilon
  or floor within its relative tolerance of 1e-9). The refused studies are designed ones whose
  promise was tightened by 1e-7 to 1e-2 relative, or whose noise was shrunk.
"""

from __future__ import annotations

import math
from typing import Any

from dpsketch.protocol import accounting, secret_sign
from dpsketch.protocol.study import Study, design

DESCRIPTION = ("The add/remove accounting (docs/protocol.md section 5, 'Per-report epsilon'). type presence: "
               "epsilon at delta of N(shift e_1, ratio I_width) against N(0, I_width) in both directions "
               "(signed: the secret sign's mixture on width + 1 columns), from pessimistic privacy-loss "
               "distributions on a 1e-3 loss grid. type study_guarantee: a study (add/remove, or replace-one); "
               "epsilon and "
               "floor_epsilon are its per-report epsilon at lambda_star and at 1 for the noise really drawn "
               "(section 5a), verdict whether a client accepts it (its noise gives epsilon and epsilon_floor "
               "within 1e-9 relative) or refuses it.")

#: (shift, ratio, width) of the presence vectors: a narrow and a wide shift, width 1 (no variance
#: part), a wide one (231 = a gram study of d = 20), a large ratio whose law needs a coarser grid
PAIRS = [(1.0, 1.01, 10), (0.5, 1.5, 1), (2.0, 1.001, 100), (1.2, 1.2, 231), (0.8, 10.0, 200), (0.7, 1.0, 4)]
TOLERANCE = {"rtol": 1e-8, "atol": 0.0}


def presence_vectors() -> list[dict[str, Any]]:
    out = []
    for shift, ratio, width in PAIRS:
        for signed in (False, True):
            if ratio == 1.0 and signed:
                continue
            delta = 1e-6
            eps = (secret_sign.presence_epsilon(shift, ratio, width, delta) if signed
                   else accounting.add_remove_epsilon(shift, ratio, width, delta))
            out.append({"id": f"presence-{'signed-' if signed else ''}{shift:g}-{ratio:g}-{width}", "type": "presence",
                        "shift": shift, "ratio": ratio, "width": width, "delta": delta, "signed": signed,
                        "epsilon": eps, "tolerance": TOLERANCE})
    return out


def _designs() -> list[tuple[str, str, Study]]:
    base = dict(columns=["x1", "x2", "y"], label="y", servers=["s1", "s2"], expected_reports=10_000, epsilon=1.0,
                neighbouring="add-remove")
    specs = [
        ("sketch-signed", "a sketch study with the secret sign (the mixture's accounting)",
         dict(base, seed="00" * 31 + "2a")),
        ("sketch", "a sketch study without the sign", dict(base, seed="00" * 31 + "2a", secret_sign=False)),
        ("gram", "a gram study (width 15)", dict(base, kind="gram", columns=["x1", "x2", "x3", "y"], seed="55" * 32)),
        ("moments", "a moments study (width 6)", dict(base, kind="moments", seed="99" * 32)),
        ("l1", "an l1 study (s + 1 non-zeros per column)", dict(base, kind="l1", seed="22" * 32)),
        ("histogram", "a histogram study of 4 x 3 cells",
         dict(kind="histogram", columns=[], label=None, servers=["s1", "s2"], expected_reports=10_000,
              seed="11" * 32, neighbouring="add-remove",
              histogram={"axes": [{"column": "age", "edges": [18, 30.5, 65]},
                                  {"column": "city", "categories": ["a", "b"]}]})),
        ("parties", "a sketch study with two parties and three servers",
         dict(columns=[], label="y", servers=["s1", "s2", "s3"], expected_reports=10_000, seed="33" * 32,
              neighbouring="add-remove", parties=[{"name": "bank", "columns": ["x1", "x2"]},
                                                  {"name": "shop", "columns": ["y"]}])),
        ("servers-only", "the servers' noise alone (sigma = 0, epsilon_floor = epsilon: a Gaussian shift)",
         dict(base, seed="66" * 32, secret_sign=False, epsilon_floor=1.0)),
        ("validity", "a sketch study with validity proofs (its tail also counts 2^-64 per report)",
         dict(base, seed="77" * 32, validity=True, secret_sign=False)),
    ]
    return [(vid, why, design(name=f"accounting {vid}", **kw)[0]) for vid, why, kw in specs]


def _vector(vid: str, description: str, designed: Study, update: dict[str, Any] | None = None) -> dict[str, Any]:
    """The guarantee of a designed study with ``update`` applied (unvalidated), whether or not the
    reference accepts the result."""
    study = designed.model_copy(update=update or {})
    obj = study.model_dump(mode="json")
    eps, floor = study.report_epsilon(study.lambda_star), study.report_epsilon(1.0)
    try:
        Study.model_validate(obj)
        verdict = "accepted"
    except ValueError as exc:
        assert "more than the study's epsilon" in str(exc), exc
        verdict = "refused"
    return {"id": f"study-{vid}", "type": "study_guarantee", "description": description, "study": obj,
            "epsilon": _finite(eps), "floor_epsilon": _finite(floor), "verdict": verdict, "tolerance": TOLERANCE}


def _finite(x: float) -> float | None:
    """JSON has no infinity: an unbounded epsilon is null."""
    return x if math.isfinite(x) else None


def study_vectors() -> list[dict[str, Any]]:
    out = []
    designs = _designs()
    designed = {vid: study for vid, _, study in designs}
    for vid, description, study in designs:
        out.append(_vector(vid, description + ", as designed", study))
    sketch = designed["sketch"]
    eps, floor = sketch.report_epsilon(sketch.lambda_star), sketch.report_epsilon(1.0)
    out.append(_vector("sketch-epsilon-tight", "the unsigned sketch study promising 1e-7 less than its noise "
                       "gives (refused: the tolerance is 1e-9)", sketch, {"epsilon": eps * (1 - 1e-7)}))
    out.append(_vector("sketch-epsilon-within", "the same promising 5e-10 less than its noise gives (accepted: "
                       "within the tolerance)", sketch, {"epsilon": eps * (1 - 5e-10)}))
    out.append(_vector("sketch-floor-tight", "the same promising a floor 1e-7 below what it gives (refused)",
                       sketch, {"epsilon_floor": floor * (1 - 1e-7)}))
    signed = designed["sketch-signed"]
    out.append(_vector("sketch-signed-tight", "the signed sketch study promising 1e-6 less than the "
                       "mixture gives (refused)", signed,
                       {"epsilon": signed.report_epsilon(signed.lambda_star) * (1 - 1e-6)}))
    gram = designed["gram"]
    out.append(_vector("gram-noise-shrunk", "the gram study with its client and server noise shrunk by 1 % "
                       "(refused: the floor is not met)", gram,
                       {"sigma": gram.sigma * 0.99, "server_sigma": gram.server_sigma * 0.99}))
    out.append(_vector("histogram-no-server-noise", "the histogram study without its server noise (refused: "
                       "with no other honest report its presence shows)", designed["histogram"],
                       {"server_sigma": 0.0}))
    # replace-one: the Gaussian and the sign mixture's branch of the same check
    base = dict(columns=["x1", "x2", "y"], label="y", servers=["s1", "s2"], expected_reports=10_000, epsilon=1.0)
    ro = {"replace-one-sketch-signed": design(name="accounting ro signed", seed="88" * 32, **base)[0],
          "replace-one-sketch": design(name="accounting ro", seed="88" * 32, secret_sign=False, **base)[0],
          "replace-one-gram": design(name="accounting ro gram", kind="gram", seed="89" * 32, **base)[0]}
    for vid, study in ro.items():
        out.append(_vector(vid, f"a replace-one {study.kind} study{' with the secret sign' if study.secret_sign else ''}"
                           ", as designed", study))
    unsigned = ro["replace-one-sketch"]
    eps = unsigned.report_epsilon(unsigned.lambda_star)
    out.append(_vector("replace-one-sketch-epsilon-tight", "the unsigned replace-one study promising 1e-7 less "
                       "than its noise gives (refused)", unsigned, {"epsilon": eps * (1 - 1e-7)}))
    out.append(_vector("replace-one-sketch-epsilon-within", "the same promising 5e-10 less (accepted)", unsigned,
                       {"epsilon": eps * (1 - 5e-10)}))
    signed = ro["replace-one-sketch-signed"]
    out.append(_vector("replace-one-sketch-signed-tight", "the signed replace-one study promising 1e-6 less than "
                       "the mixture's bound gives (refused)", signed,
                       {"epsilon": signed.report_epsilon(signed.lambda_star) * (1 - 1e-6)}))
    return out


def accounting_vectors() -> list[dict[str, Any]]:
    return presence_vectors() + study_vectors()
