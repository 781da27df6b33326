"""Bearer tokens of one share server, kept only as SHA-256 digests, rotatable without restart.

Sources, all valid at once (several tokens per role are fine):

* the environment's DPSKETCH_OPERATOR_TOKEN / DPSKETCH_ANALYST_TOKEN (or the ``--*-token-file``
  files): hashed when ``Settings`` is built; valid for the life of the process;
* ``--tokens-file PATH``: JSON ``{"operator": [...], "analyst": [...]}`` whose entries are
  ``"sha256:<64 hex>"`` digests or plain tokens (hashed on load). The file is re-read when its
  (mtime, size, inode) changes, checked with one ``stat`` per authenticated request, or on
  SIGHUP. A file that does not parse, names one token for both roles or leaves a role without
  any token is refused: the previous tokens stay in force and the error is logged.

A presented token is hashed and compared with every digest of the role with
``hmac.compare_digest`` (no early exit), so timing says nothing about which digest matched.
Tokens are 32-byte-or-longer random strings, so a fast unsalted hash is enough (no dictionary
to attack); the digests in the file may be published to whoever runs the server.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import threading
from collections.abc import Iterable
from pathlib import Path

from dpsketch.protocol.relayed import token_digest

log = logging.getLogger("dpsketch.server")

ROLES = ("operator", "analyst")
DIGEST_PREFIX = "sha256:"
SHORT_TOKEN = 16


#: SHA-256 of a token's UTF-8 bytes (32 bytes): what a server keeps of it, and what a relayed
#: entry's MAC key is derived from (the protocol's definition, dpsketch/protocol/relayed.py)
digest_of = token_digest


def upload_token_id(digest: bytes) -> str:
    """The public id of an upload token: hex of the first 8 bytes of its SHA-256 digest (the
    holder of a token can compute it; it reveals nothing usable about the token)."""
    return digest[:8].hex()


def digest_text(token: str) -> str:
    """The ``sha256:<hex>`` form to put in a tokens file."""
    return DIGEST_PREFIX + digest_of(token).hex()


def warn_if_short(role: str, token: str) -> None:
    if len(token) < SHORT_TOKEN:
        log.warning("the %s token is short (%d chars); use 32+ random chars", role, len(token))


def matches(digests: Iterable[bytes], given: bytes) -> bool:
    """Constant-time membership: compares with every digest, no early exit."""
    found = False
    for d in digests:
        found |= hmac.compare_digest(d, given)
    return found


def _entry_digest(entry: object, role: str) -> bytes:
    if not isinstance(entry, str) or not entry.strip():
        raise ValueError(f"{role}: every entry must be a non-empty string")
    entry = entry.strip()
    if entry.lower().startswith(DIGEST_PREFIX):
        hexpart = entry[len(DIGEST_PREFIX):]
        if len(hexpart) != 64:
            raise ValueError(f"{role}: a sha256: entry needs 64 hex digits")
        try:
            return bytes.fromhex(hexpart)
        except ValueError:
            raise ValueError(f"{role}: a sha256: entry needs 64 hex digits") from None
    warn_if_short(role, entry)
    return digest_of(entry)


def parse_tokens(text: str) -> dict[str, tuple[bytes, ...]]:
    """The digests per role of a tokens file's JSON (ValueError if malformed)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON: {exc}") from None
    if not isinstance(data, dict) or set(data) - set(ROLES):
        raise ValueError('expected an object with members "operator" and/or "analyst"')
    out: dict[str, tuple[bytes, ...]] = {}
    for role in ROLES:
        entries = data.get(role, [])
        if isinstance(entries, str):
            entries = [entries]
        if not isinstance(entries, list):
            raise ValueError(f"{role}: expected a list of tokens")
        out[role] = tuple(dict.fromkeys(_entry_digest(e, role) for e in entries))
    return out


class TokenRegistry:
    """The valid digests per role: static ones from Settings plus the tokens file's."""

    def __init__(self, static: dict[str, tuple[bytes, ...]], path: Path | None):
        self._static = static
        self._path = path
        self._lock = threading.Lock()
        self._stamp: tuple | None = None
        self._force = False
        self._current = {role: tuple(static.get(role, ())) for role in ROLES}
        if path is not None:
            self._reload(initial=True)

    def request_reload(self) -> None:
        """Re-read the file at the next request (the SIGHUP handler calls this)."""
        self._force = True

    def _stat(self) -> tuple | None:
        try:
            st = os.stat(self._path)  # type: ignore[arg-type]
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino, st.st_ctime_ns)

    def _reload(self, initial: bool = False) -> None:
        stamp = self._stat()
        try:
            text = Path(self._path).read_text()  # type: ignore[arg-type]
            loaded = parse_tokens(text)
            merged = {role: tuple(dict.fromkeys(self._static.get(role, ()) + loaded[role])) for role in ROLES}
            if set(merged["operator"]) & set(merged["analyst"]):
                raise ValueError("a token is listed for both roles; the roles need different tokens")
            empty = [role for role in ROLES if not merged[role]]
            if empty:
                raise ValueError(f"no {' and no '.join(empty)} token would be left")
        except (OSError, ValueError) as exc:
            if initial:
                raise ValueError(f"tokens file {self._path}: {exc}") from None
            log.error("tokens file %s not reloaded, the previous tokens stay valid: %s", self._path, exc)
            self._stamp = stamp
            return
        self._current = merged
        self._stamp = stamp
        if not initial:
            log.info("tokens file %s reloaded: %d operator, %d analyst tokens", self._path,
                     len(merged["operator"]), len(merged["analyst"]))

    def digests(self, role: str) -> tuple[bytes, ...]:
        """The role's valid digests now (re-reading the tokens file if it changed)."""
        if self._path is not None and (self._force or self._stat() != self._stamp):
            with self._lock:
                if self._force or self._stat() != self._stamp:
                    self._force = False
                    self._reload()
        return self._current[role]
