r"""Canonical JSON (RFC 8785-like) and the content hash that identifies a study.

A study's id is the SHA-256 of its canonical encoding, so a client can check that all N servers
hold the same study by comparing ids it recomputes itself. Members are sorted, there is no
whitespace, and numbers follow ECMAScript's Number-to-string rule (as RFC 8785 requires). Strings
differ from RFC 8785: the output is pure ASCII. Every UTF-16 code unit outside U+0020..U+007E
(so U+007F DEL and all non-ASCII text too, a supplementary character as its surrogate pair) is
written ``\uXXXX`` with lower-case hex, except the short escapes ``\b \t \n \f \r``; ``"``
and ``\`` are ``\"`` and ``\\``. RFC 8785 writes DEL and non-ASCII text as raw UTF-8, so a
JCS library reproduces these bytes only for strings of printable ASCII (docs/protocol.md,
"Study id", states the rule and its differences; conformance/study_ids.json has vectors).
Integers (Python ``int``) are written in full decimal: the same as RFC 8785 below 2^53, which
every integer of a study is.
"""

from __future__ import annotations

import hashlib
import math
from decimal import Decimal
from json.encoder import encode_basestring_ascii as _string  # json.dumps(s, ensure_ascii=True)'s own
from typing import Any


def _number(x: float | int) -> str:
    if isinstance(x, bool):
        return "true" if x else "false"
    if isinstance(x, int):
        return str(x)
    if not math.isfinite(x):
        raise ValueError("canonical JSON has no NaN or infinity")
    if x == 0:
        return "0"
    sign = "-" if x < 0 else ""
    parts = Decimal(repr(abs(x))).as_tuple()
    digits_tuple, exponent = parts.digits, int(parts.exponent)  # finite: an int, never 'n'/'N'/'F'
    digits = "".join(map(str, digits_tuple)).rstrip("0")
    exponent += len(digits_tuple) - len(digits)
    k = len(digits)
    n = exponent + k  # value = 0.digits * 10^n
    if k <= n <= 21:
        body = digits + "0" * (n - k)
    elif 0 < n <= 21:
        body = digits[:n] + "." + digits[n:]
    elif -6 < n <= 0:
        body = "0." + "0" * (-n) + digits
    else:
        e = n - 1
        mantissa = digits if k == 1 else digits[0] + "." + digits[1:]
        body = f"{mantissa}e{'+' if e > 0 else '-'}{abs(e)}"
    return sign + body


def _encode(value: Any, out: list[str]) -> None:
    if value is None:
        out.append("null")
    elif isinstance(value, (bool, int, float)):
        out.append(_number(value))
    elif isinstance(value, str):
        out.append(_string(value))
    elif isinstance(value, (list, tuple)):
        if all(type(item) is str for item in value):  # a study's columns: one join, not a call each
            out.append("[" + ",".join(map(_string, value)) + "]")
            return
        out.append("[")
        for i, item in enumerate(value):
            if i:
                out.append(",")
            _encode(item, out)
        out.append("]")
    elif isinstance(value, dict):
        out.append("{")
        for i, key in enumerate(sorted(value)):
            if not isinstance(key, str):
                raise TypeError("canonical JSON keys must be strings")
            if i:
                out.append(",")
            out.append(_string(key))
            out.append(":")
            _encode(value[key], out)
        out.append("}")
    else:
        raise TypeError(f"cannot encode {type(value).__name__} canonically")


def canonical_json(value: Any) -> bytes:
    out: list[str] = []
    _encode(value, out)
    return "".join(out).encode("ascii")


def content_hash(value: Any) -> str:
    """Lower-case hex SHA-256 of the canonical encoding."""
    return hashlib.sha256(canonical_json(value)).hexdigest()
