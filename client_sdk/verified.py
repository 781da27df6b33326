"""Studies this process has verified, so that the same bytes are never checked twice.

Checking a study (``Study``'s validator) recomputes its guarantee, epsilon at lambda_star and the
floor, through dp-accounting. That check is the client's own privacy protection and always runs
on parameters this process has not seen before. But a client fetches the study from every server
(N copies of the same bytes), and a process may hold many clients (an app with a ``Client`` per
user, a gateway, the many-clients benchmark): each of them checking the same bytes again proves
nothing new.

So a verified study is remembered under its exact JSON value (``json.dumps`` with sorted keys and
no whitespace: two values that differ in any member, number or string give different keys), and
the same value from any server, to any ``Client`` of this process, reuses the ``Study`` it
produced. Nothing is trusted that was not checked here: a study whose bytes differ in anything,
a lowered sigma, another server list, a changed name, is a different key and is checked in
full. A study that fails its check is not remembered (it raises every time). The memory is this
process's only, never a file: a file could be rewritten by whoever can write to it.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

from dpsketch.protocol.study import Study

#: distinct studies remembered per process (a Study is a few KB; the oldest goes first)
MAX_REMEMBERED = 256

_lock = threading.Lock()
_verified: OrderedDict[str, Study] = OrderedDict()


def _key(raw: Any) -> str | None:
    try:
        return json.dumps(raw, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError):  # not plain JSON: let the full check say what is wrong
        return None


def study(raw: Any) -> Study:
    """``Study.model_validate(raw)``, checked once per distinct JSON value in this process.

    Raises what the check raises (pydantic's ``ValidationError``) for a study that fails it."""
    key = _key(raw)
    if key is not None:
        with _lock:
            hit = _verified.get(key)
            if hit is not None:
                _verified.move_to_end(key)
                return hit
    checked = Study.model_validate(raw)
    if key is not None:
        with _lock:
            _verified[key] = checked
            while len(_verified) > MAX_REMEMBERED:
                _verified.popitem(last=False)
    return checked


def forget() -> None:
    """Drop every remembered study (tests, and a benchmark that times the cold check)."""
    with _lock:
        _verified.clear()
