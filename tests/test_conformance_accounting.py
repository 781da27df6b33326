"""conformance/accounting.json recomputed with the product's code (docs/protocol.md sections 5
and 10): the accounting a client checks a study with (add/remove above all; replace-one for the
same check's other branches), and the verdict.

The TypeScript client reproduces the same vectors (clients/typescript/test/accounting.test.ts),
so the two clients reach the same verdict on these studies: accepting the designed ones,
refusing those whose noise falls short of their promise by as little as 1e-7 relative.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from dpsketch.protocol import accounting, secret_sign
from dpsketch.protocol.study import Study

ROOT = Path(__file__).resolve().parents[1]
VECTORS = json.loads((ROOT / "conformance" / "accounting.json").read_text())["vectors"]


def _near(got: float, want: float | None, tol: dict) -> bool:
    if want is None:
        return got == math.inf
    return abs(got - want) <= tol["atol"] + tol["rtol"] * abs(want)


@pytest.mark.parametrize("vec", [v for v in VECTORS if v["type"] == "presence"], ids=lambda v: v["id"])
def test_presence_epsilon(vec):
    if vec["signed"]:
        got = secret_sign.presence_epsilon(vec["shift"], vec["ratio"], vec["width"], vec["delta"])
    else:
        got = accounting.add_remove_epsilon(vec["shift"], vec["ratio"], vec["width"], vec["delta"])
    assert _near(got, vec["epsilon"], vec["tolerance"]), (got, vec["epsilon"])


@pytest.mark.parametrize("vec", [v for v in VECTORS if v["type"] == "study_guarantee"], ids=lambda v: v["id"])
def test_study_guarantee_and_verdict(vec):
    """The Python client's check is the Study model's validation: it accepts exactly the studies
    the vector accepts, and recomputes the same epsilons."""
    obj = vec["study"]
    if vec["verdict"] == "accepted":
        study = Study.model_validate(obj)
    else:
        with pytest.raises(ValueError, match="more than the study's epsilon"):
            Study.model_validate(obj)
        # with a promise its noise meets (the other checks pass), then its own promise back
        study = Study.model_validate({**obj, "epsilon": 20.0, "epsilon_floor": None}).model_copy(
            update={"epsilon": obj["epsilon"], "epsilon_floor": obj["epsilon_floor"]})
    assert _near(study.report_epsilon(study.lambda_star), vec["epsilon"], vec["tolerance"])
    assert _near(study.report_epsilon(1.0), vec["floor_epsilon"], vec["tolerance"])


def test_refused_vectors_differ_from_accepted_ones_only_in_their_promise_or_noise():
    """Each refused study is an accepted one with a tighter promise or less noise: the refusal is
    the accounting's, nothing else."""
    accepted = {v["id"]: v["study"] for v in VECTORS if v["type"] == "study_guarantee" and v["verdict"] == "accepted"}
    refused = [v for v in VECTORS if v["type"] == "study_guarantee" and v["verdict"] == "refused"]
    assert len(refused) >= 5
    for vec in refused:
        diffs = [{k for k in base if base[k] != vec["study"].get(k)} for base in accepted.values()]
        assert min(diffs, key=len) <= {"epsilon", "epsilon_floor", "sigma", "server_sigma"}, vec["id"]
