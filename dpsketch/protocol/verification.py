"""The messages of a validity study's verification round (docs/protocol.md section 6d).

A study with ``validity`` has every report checked by every server before anything is released
(dpsketch/protocol/validity.py: the proof, the query, the decision). The servers never talk to
each other; the analyzer carries four requests to each of them, in this order:

1. ``POST .../verify/commit``: the server closes the study to uploads, draws its 32-byte
   contribution c_j and answers its commitment (a hash of c_j, the study and its position);
2. ``POST .../verify/reveal`` with the N commitments: the server answers c_j;
3. ``POST .../verify/query`` with the N contributions: the query seed is fixed from all of them
   (so from none that a client or any N - 1 servers chose alone, and only after uploads closed)
   and the server answers its verifier share of every report it holds;
4. ``POST .../verify/decide`` with the sum of the other servers' verifier shares: the server adds
   its own and decides each report for itself.

The JSON bodies are the models below; the verifier shares travel in the binary format of
``validity.encode_verifiers``; the decision's answer is a report-id list of the refused reports
with the counts in headers. Why the commit and reveal: a contribution revealed before every
server committed would let the last server (or an analyzer holding one contribution) steer
the query point; committed first, the seed is uniform if one server is honest.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from . import validity

#: A 32-byte value in lowercase hex (commitments and contributions).
HEX32_PATTERN = r"^[0-9a-f]{64}$"
Hex32 = Annotated[str, StringConstraints(pattern=HEX32_PATTERN)]

#: The verifier shares of reports (a query's answer, a decision's request): validity.py's format.
VERIFIERS_MEDIA_TYPE = validity.VERIFIERS_MEDIA_TYPE
#: Headers of a decision's answer: how many reports it decided, and how many of them it refused.
DECIDED_HEADER = "X-Dpsketch-Decided"
REFUSED_HEADER = "X-Dpsketch-Refused"
#: Header of a query's answer: the query seed (hex) the server fixed.
QUERY_SEED_HEADER = "X-Dpsketch-Query-Seed"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Commitment(_Strict):
    """A server's answer to ``verify/commit``: its commitment to its contribution."""

    study_id: str
    server_id: str
    position: int = Field(description="the server's index in the study's servers")
    commitment: str = Field(pattern=HEX32_PATTERN)


class RevealRequest(_Strict):
    """``verify/reveal``: every server's commitment, in the study's server order."""

    commitments: list[Hex32] = Field(min_length=1, max_length=64)

    def as_bytes(self) -> list[bytes]:
        return [bytes.fromhex(c) for c in self.commitments]


class Contribution(_Strict):
    """A server's answer to ``verify/reveal``: its contribution to the query seed."""

    study_id: str
    server_id: str
    position: int
    contribution: str = Field(pattern=HEX32_PATTERN)


class QueryRequest(_Strict):
    """``verify/query``: every server's contribution, in the study's server order."""

    contributions: list[Hex32] = Field(min_length=1, max_length=64)

    def as_bytes(self) -> list[bytes]:
        return [bytes.fromhex(c) for c in self.contributions]


class VerificationSummary(_Strict):
    """What the analyzer records of a study's round (its StudyView and progress): how many
    reports every server decided and how many each refused (a report refused anywhere is left
    out of the release)."""

    query_seed: str = Field(pattern=HEX32_PATTERN)
    decided: int = Field(description="reports held by every server, decided by each")
    refused: int = Field(description="reports refused by at least one server")
    refused_by_server: dict[str, int]
