"""What every analysis route does alike: name the label, turn a bad fit into a 422, answer JSON.

An analysis route (``install`` in each module of this package) takes a released study, checks the
request against it, fits one estimator and answers. The estimators raise ``ValueError`` or
``KeyError`` naming what was wrong with the parameters; a client caused it, so it is a 422
``invalid-request`` with that message (docs/protocol.md section 8), never a 500. A fit whose
numbers are not finite is refused the same way, and JSON, which has no NaN or infinity, gets null
where a statistic is undefined.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from dpsketch.protocol import ProblemError

#: What a route answers when a fit came out NaN or infinite.
NOT_FINITE = "the solution is not finite for these parameters"


def refuse(message: str) -> ProblemError:
    """The 422 ``invalid-request`` problem a route raises for a request that cannot be answered."""
    return ProblemError("invalid-request", message)


def label_of(requested: str | None, study_label: str | None, columns: Sequence[str]) -> str:
    """The label a regression fits: the request's, else the study's; one of ``columns`` or 422."""
    label = requested or study_label
    if label is None or label not in columns:
        raise refuse(f"label must be one of the columns {list(columns)}; got {label!r}")
    return label


@contextmanager
def fitting() -> Iterator[None]:
    """Run an estimator's fit: its ``ValueError`` or ``KeyError`` becomes a 422 with its message."""
    try:
        yield
    except (ValueError, KeyError) as exc:
        raise refuse(str(exc).strip("'\"")) from None


def require_finite(*values: Any, message: str = NOT_FINITE) -> None:
    """422 unless every number in ``values`` is finite."""
    if not all(np.all(np.isfinite(v)) for v in values):
        raise refuse(message)


def json_number(x: float) -> float | None:
    """JSON has no NaN or infinity: None where a number is not available."""
    return float(x) if np.isfinite(x) else None


def json_finite(x: Any) -> Any:
    """``x`` with every NaN or infinite float inside dicts, lists, tuples and arrays made None (a
    statistic the noise left undefined, a share estimated from no reports)."""
    if isinstance(x, dict):
        return {k: json_finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, np.ndarray)):
        return [json_finite(v) for v in np.asarray(x, dtype=object).tolist()]
    if isinstance(x, float) and not np.isfinite(x):
        return None
    return x
