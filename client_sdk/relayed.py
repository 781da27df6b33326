"""Submitting through a relay: one request per device (docs/protocol.md section 7b, docs/relay.md).

Two steps, apart in time:

* **Enrolment** (:func:`enrol`, then :meth:`Enrolment.save`): once, from the share servers
  themselves, with a :class:`~client_sdk.client.Client` that reads and checks the study at every
  server and each server's HPKE key (``encrypt=True``): an :class:`Enrolment` holds the verified
  study and the key sealed to for each server. A key read after the study exists stays valid
  until the study is committed (docs/protocol.md section 7a, "Rotation"), so the enrolment does
  too. It is public (no token in it) but must come from the servers, not from the relay: a
  relay that chose the keys could open the shares.
* **Submission** (:class:`RelayClient`): the row prepared as for any client (the protocol's
  one path, ``client_sdk.prepare``), each server's share sealed to its enrolled key as a one-record
  version 4 batch, each batch's entry MACed with that server's upload token, all sent to the
  relay in one request. A misdirected entry opens nowhere, so no per-server read is needed
  before sending, which is what a direct client must do (docs/trust.md).

The relay answers once every server answered; an entry whose outcome is worth sending again
(502, 503) is sent again, the same bytes (idempotent by report id), up to ``max_retries`` times.
"""

from __future__ import annotations

import http.client
import json
import os
import ssl
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from dpsketch import __version__
from dpsketch.protocol import envelope, relayed
from dpsketch.protocol.messages import RelayedOutcome, RelayedResults
from dpsketch.protocol.problems import ProblemError
from dpsketch.protocol.study import Study

from . import data as _data
from . import sealing as _sealing
from .client import _tls_context, retry_delay
from .errors import NotRelayable, SDKError, ServerProtocolError, ServerUnreachable, cert_error
from .prepare import prepare_batch

RETRYABLE = frozenset({408, 429, 500, 502, 503, 504})


@dataclass(frozen=True)
class Enrolment:
    """A study as every server confirmed it, and the HPKE key to seal to at each (study order)."""

    study: Study
    recipients: tuple[envelope.Recipient, ...]

    def __post_init__(self) -> None:
        if [r.server_id for r in self.recipients] != list(self.study.servers):
            raise ValueError("an enrolment holds one key per server of the study, in its order")
        if len({r.public_key for r in self.recipients}) != len(self.recipients):
            raise ValueError("two servers of an enrolment share a public key")

    @property
    def study_id(self) -> str:
        return self.study.study_id

    def to_json(self) -> str:
        return json.dumps({"study": self.study.model_dump(mode="json"),
                           "recipients": [{"server_id": r.server_id, "suite": r.suite.name,
                                           "public_key": r.public_key.hex()} for r in self.recipients]})

    @classmethod
    def from_json(cls, text: str | bytes) -> "Enrolment":
        doc = json.loads(text)
        study = Study.model_validate(doc["study"])
        recipients = []
        for r in doc["recipients"]:
            suite = envelope.SUITES.get(r["suite"])
            if suite is None:
                raise ValueError(f"enrolment: suite {r['suite']!r} is not one this installation seals with")
            recipients.append(envelope.Recipient(r["server_id"], bytes.fromhex(r["public_key"]), suite))
        return cls(study, tuple(recipients))

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Enrolment":
        with open(path, encoding="utf-8") as f:
            return cls.from_json(f.read())


def enrol(client: Any, study_id: str) -> Enrolment:
    """The enrolment of ``study_id`` read through ``client`` (a Client with ``encrypt=True``),
    which fetches the study and keys from every server and checks them (Client.study).

    Raises :class:`~client_sdk.errors.NotRelayable` for a study whose reports no relay can carry
    (:func:`check_relayable`): its bundles would be refused at every attempt, so none is enrolled."""
    if not client.encrypt:
        raise ValueError("enrol with Client(..., encrypt=True): the enrolment holds the servers' HPKE keys")
    study = client.study(study_id)
    check_relayable(study, client)
    return Enrolment(study, tuple(client.recipients(study_id)))


def check_relayable(study: Study, client: Any = None) -> None:
    """Raise :class:`~client_sdk.errors.NotRelayable` unless ``study``'s reports can go through a
    relay: not for a study with parties or batch proofs (the rule is
    :func:`dpsketch.protocol.relayed.unrelayable`; the servers answer 415), nor, given ``client``
    (a Client with ``encrypt=True`` that read the study: its servers' ``/v1/info``), at a server
    whose published policy says ``relayed_uploads`` is false (``dpsketch server --relayed-uploads
    off``: it answers every bundle 403). ``enrol`` and ``dpsketch enrol`` run it, and ``dpsketch
    submit --relay`` without a client on the study of an enrolment file.

    A policy without a ``relayed_uploads`` member, or no policy, is let through: docs/protocol.md
    makes ``/v1/info``'s ``policy`` optional (section 6) and never requires the member, so its
    absence says nothing either way (another implementation, or a server from before relayed
    uploads). Refusing it would keep such a study off every relay on a guess, and nothing is at
    stake in letting it through: a server that takes no bundle refuses it whole itself (403, or
    no route), nothing stored, and the device gets that refusal as the server's outcome
    (``RelayClient.submit`` raises it, naming the server). Only an explicit false refuses here.
    """
    why = relayed.unrelayable(study)
    if why is not None:
        raise NotRelayable(study.study_id, why)
    if client is None:
        return
    if not client.encrypt:
        raise ValueError("check a study's servers with Client(..., encrypt=True): only it reads their /v1/info")
    for url, info in zip(client.urls, client.server_infos(study.study_id)):
        if (info.policy or {}).get("relayed_uploads") is False:
            raise NotRelayable(study.study_id, "relayed uploads off", info.server_id, url)


def _proxy_for(scheme: str) -> bool:
    """Whether the environment names a proxy for the relay's scheme (``http_proxy``,
    ``https_proxy`` or ``all_proxy``, lower or upper case): then the request goes through httpx,
    which honours it and ``no_proxy``. Six lookups, not client.py's scan of the whole environment,
    which cost a one-row device about 0.1 ms."""
    return any(os.environ.get(name) for key in (f"{scheme}_proxy", "all_proxy") for name in (key, key.upper()))


def _problem(outcome: RelayedOutcome, server_id: str) -> ProblemError:
    body = dict(outcome.problem or {})
    err = ProblemError.from_body(outcome.status, body) if body else ProblemError(
        "upstream-failure", f"server {server_id}: status {outcome.status} without a problem", status=outcome.status)
    err.server_id = server_id  # type: ignore[attr-defined]
    return err


class RelayClient:
    """A device submitting rows through a relay, with the enrolment it holds and its upload
    tokens (one per server, study order; None for a study that takes uploads without tokens).

    Its one request goes over the standard library's ``http.client``, on one connection kept for
    the client's life: a one-row device's whole request costs about a quarter of what a fresh
    ``httpx.Client`` and its pool cost (0.46 against 1.9 ms of CPU, measured in session 62), and
    that request is most of what such a device does. With a proxy in the environment, or a
    ``transport`` given, the request goes through httpx instead, which knows proxies."""

    def __init__(self, relay_url: str, enrolment: Enrolment, token: Sequence[str] | None = None, *,
                 timeout: float = 30.0, max_retries: int = 5, backoff: float = 0.25,
                 max_backoff: float = 10.0, max_retry_after: float = 60.0,
                 verify: bool | str | ssl.SSLContext = True, transport: httpx.BaseTransport | None = None):
        n = len(enrolment.recipients)
        tokens = [None] * n if token is None else list(token)
        if len(tokens) != n:
            raise ValueError(f"give one upload token per server of the study ({n}), in its order")
        if max_retries < 0 or backoff < 0:
            raise ValueError("max_retries and backoff must be >= 0")
        self.enrolment = enrolment
        self.tokens = tokens
        self.max_retries = max_retries
        self.backoff, self.max_backoff, self.max_retry_after = backoff, max_backoff, max_retry_after
        self.url = relay_url.rstrip("/")
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"relay URL {relay_url!r}: give http(s)://host[:port][/prefix]")
        self._path = f"{parts.path}/v1/studies/{enrolment.study_id}/relayed"
        self._timeout = timeout
        self._headers = {"User-Agent": f"dpsketch-client/{__version__}", "Content-Type": relayed.MEDIA_TYPE}
        self._tls: bool | str | ssl.SSLContext = verify
        if transport is None and parts.scheme == "https":
            self._tls = _tls_context([self.url], verify)
        self._conn: http.client.HTTPConnection | None = None
        self._http: httpx.Client | None = None
        if transport is not None or _proxy_for(parts.scheme):
            self._http = httpx.Client(timeout=timeout, verify=self._tls, transport=transport,
                                      headers=self._headers)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._http is not None:
            self._http.close()

    def __enter__(self) -> "RelayClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def entries(self, row: Any) -> tuple[bytes, list[relayed.Entry]]:
        """One row made into its report id and its entries, one per server (study order)."""
        study = self.enrolment.study
        batch = prepare_batch(study, _data.row_vector(row, study.columns, raw=study.histogram is not None))
        out = []
        for j, recipient in enumerate(self.enrolment.recipients):
            sealed, _ = _sealing.wire(recipient, study, study.study_id, batch.body(j), batch.media_type(j))
            out.append(relayed.make_entry(self.tokens[j], study.study_id, recipient.server_id, bytes(sealed)))
        return batch.report_ids[0], out

    def submit(self, row: Any) -> str:
        """Submit one row through the relay; its hex report id once every server stored it.
        Raises the first refusal (ProblemError, with ``server_id``) if a server refused it, or
        after ``max_retries`` rounds if one stayed unavailable."""
        report_id, entries = self.entries(row)
        self.send(entries)
        return report_id.hex()

    def send(self, entries: Sequence[relayed.Entry]) -> list[RelayedOutcome]:
        """Send entries (again: the same bytes are idempotent) until none is worth retrying."""
        waiting = list(range(len(entries)))
        outcomes: list[RelayedOutcome | None] = [None] * len(entries)
        for attempt in range(self.max_retries + 1):
            got = self._post([entries[i] for i in waiting])
            for i, outcome in zip(waiting, got):
                outcomes[i] = outcome
            refused = [i for i in waiting if outcomes[i].status not in RETRYABLE and outcomes[i].status != 200]  # type: ignore[union-attr]
            if refused:
                raise _problem(outcomes[refused[0]], entries[refused[0]].server_id)  # type: ignore[arg-type]
            waiting = [i for i in waiting if outcomes[i].status != 200]  # type: ignore[union-attr]
            if not waiting:
                return outcomes  # type: ignore[return-value]
            if attempt < self.max_retries:
                time.sleep(self._delay(attempt, None))
        raise _problem(outcomes[waiting[0]], entries[waiting[0]].server_id)  # type: ignore[arg-type]

    def _delay(self, attempt: int, retry_after: str | None) -> float:
        return retry_delay(attempt, retry_after, self.backoff, self.max_backoff, self.max_retry_after)

    def _post(self, entries: Sequence[relayed.Entry]) -> list[RelayedOutcome]:
        body = relayed.encode(entries)
        for attempt in range(self.max_retries + 1):
            try:
                status, content, retry_after = self._exchange(body)
            except (OSError, http.client.HTTPException, httpx.TransportError) as exc:
                bad_cert = cert_error(exc)
                if bad_cert is not None:  # not transient: retrying cannot help
                    raise ServerUnreachable(
                        self.url, f"TLS certificate verification failed: {bad_cert.verify_message or bad_cert.reason} "
                        f"(check that the relay's certificate is signed by the CA given as verify=)") from exc
                if attempt >= self.max_retries:
                    raise ServerUnreachable(self.url, f"the relay could not be reached: {exc}") from None
                time.sleep(self._delay(attempt, None))
                continue
            if status == 200:
                try:
                    results = RelayedResults.model_validate_json(content).results
                except ValueError:
                    raise ServerProtocolError(f"{self.url}: the relay's answer is not RelayedResults JSON") from None
                if len(results) != len(entries):
                    raise ServerProtocolError(f"{self.url} answered {len(results)} outcomes for {len(entries)} entries")
                return results
            if status in RETRYABLE and attempt < self.max_retries:
                time.sleep(self._delay(attempt, retry_after))
                continue
            raise ProblemError.from_http(status, content)
        raise SDKError("unreachable")  # pragma: no cover  (the loop returns or raises)

    def _exchange(self, body: bytes) -> tuple[int, bytes, str | None]:
        """One POST of a bundle: (status, body, Retry-After). A connection that failed or that
        the relay will close is dropped; a kept one the relay closed in the meantime (its idle
        timeout) is replaced at once, without counting as an attempt."""
        if self._http is not None:
            answer = self._http.post(f"{self.url}/v1/studies/{self.enrolment.study_id}/relayed", content=body)
            return answer.status_code, answer.content, answer.headers.get("Retry-After")
        for fresh in ((False, True) if self._conn is not None else (True,)):
            conn = self._connection()
            try:
                conn.request("POST", self._path, body=body, headers=self._headers)
                resp = conn.getresponse()
                content = resp.read()
            except (ConnectionError, http.client.RemoteDisconnected, http.client.BadStatusLine):
                self._drop()
                if fresh:
                    raise
                continue
            except BaseException:
                self._drop()
                raise
            if resp.will_close:
                self._drop()
            return resp.status, content, resp.getheader("Retry-After")
        raise SDKError("unreachable")  # pragma: no cover  (the last pass returns or raises)

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            parts = urllib.parse.urlsplit(self.url)
            if parts.scheme == "https":
                self._conn = http.client.HTTPSConnection(
                    parts.hostname or "", parts.port, timeout=self._timeout,
                    context=self._tls if isinstance(self._tls, ssl.SSLContext) else None)
            else:
                self._conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=self._timeout)
        return self._conn

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
