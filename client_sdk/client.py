"""The client: verify a study at every server, then clip, noise, encode, share and upload rows.

Privacy hinges on two things the client alone can check, so it checks them before any share
leaves the machine:

* every server holds the same study (the client recomputes the content-hash id of the study each
  server returns; a server cannot quietly lower sigma or change the sketch), and
* share j goes to the server the study names as server j, with N distinct servers. A URL listed
  twice, or two URLs for the same server, would hand one organisation two shares of a report -
  with N = 2 that is the row itself. Each URL's ``GET /v1/studies/{id}`` must name
  ``study.servers[j]`` as its ``server_id`` (and, when sealing, its ``GET /v1/info`` too).

A one-row plaintext client therefore sends each server two requests, the study and its share,
over one kept-alive connection per server, each handed straight to httpx's transport (Client._send). The study's check (its guarantee recomputed) runs once
per distinct study JSON in a process (client_sdk/verified.py), however many servers or clients
return it, and without dp-accounting's import for a replace-one study (accounting.gaussian_epsilon).

Uploads are idempotent by report id: a report's id and its share bytes are fixed once, so a retry
after a timeout, a 5xx, a 429 or a 503 resends the same bytes and the server acknowledges it as a
duplicate instead of counting it twice. Bulk uploads use the binary batch endpoint, one worker
thread per server, with bounded queues so memory stays flat however long the input is.

A report counts only if all N servers hold it. If a server refuses or stays unreachable for part
of the data, the call raises :class:`IncompleteUpload` naming exactly which batches are missing
where, with their bytes, so :meth:`Client.resend` can finish the job; nothing is hidden.

Exactly once across runs: ``submit_many`` keys each submission's randomness from a secret kept in
a local journal (client_sdk/journal.py), so running it again on the same input after a crash,
SIGKILL, Ctrl-C or :class:`IncompleteUpload` regenerates the same reports, skips the batches every
server holds and completes the rest: each row is stored once.
"""

from __future__ import annotations

import contextlib
import email.utils
import os
import random
import re
import signal
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpcore  # noqa: F401 - loaded with the SDK, not by the first Client: httpx imports it (and
# through it trio or anyio where installed) lazily in its first transport, a few tenths of a second of a
# process's first one-row upload (issue 46's profile of 1,000 one-row clients)
import httpx
import numpy as np
from pydantic import BaseModel, ValidationError

from dpsketch import __version__
from dpsketch.plain_errors import unreachable_reason
from dpsketch.protocol import chacha, envelope, messages, proved_shares, ring
from dpsketch.protocol.bounds import CLAMP_WARNING_SHARE
from dpsketch.protocol.problems import ProblemError
from dpsketch.protocol.study import Study

from . import data as _data
from . import journal as _journal
from dpsketch.protocol import report as _report
from . import sealing as _sealing
from . import verified as _verified
from .errors import (
    BatchFailure,
    FloorTooWeak,
    IncompleteUpload,
    PendingUpload,
    SDKError,
    ServerProtocolError,
    ServerUnreachable,
    StudyMismatch,
    UploadCancelled,
    UploadInterrupted,
    cert_error,
)
from .prepare import is_batch_record, prepare_batch, prepare_proof_batch
from .upload import MAX_BATCH_BYTES, Progress, UploadRun, batch_rows, proof_batch_rows

STUDY_ID = re.compile(r"^[0-9a-f]{64}$")


class SubmitResult(list):
    """The hex report ids of a ``submit_many`` call (a list), plus what the servers said.

    ``n_reports``: rows of the input now stored at every server (``skipped`` included);
    ``report_counts``: each server's total for the study after its last upload;
    ``duplicates``: reports a server already held (a resumed submission's partly stored batches);
    ``skipped``: rows an earlier run of the same submission had stored at every server, not sent
    again (their ids are not in the list); ``journal``: the submission's journal file (None
    without one; client_sdk/journal.py); ``already_complete``: an earlier run had stored every
    row, so this call sent nothing.
    """

    def __init__(self, ids: list[str], n_reports: int, report_counts: dict[str, int],
                 duplicates: dict[str, int], skipped: int = 0, journal: str | None = None,
                 already_complete: bool = False, clamped: dict[str, int] | None = None,
                 clipped: int = 0, rows_seen: int = 0):
        super().__init__(ids)
        self.n_reports = n_reports
        self.report_counts = report_counts
        self.duplicates = duplicates
        self.skipped = skipped
        self.journal = journal
        self.already_complete = already_complete
        #: per column, how many of the input's values lay outside the study's bounds and were
        #: clamped to them (a study with bounds; docs/protocol.md section 2e), over rows_seen rows
        self.clamped = clamped or {}
        #: rows whose norm exceeded the study's row bound and were clipped (a study without bounds)
        self.clipped = clipped
        self.rows_seen = rows_seen

    def clamp_summary(self) -> str:
        """One line for a person: what the map into the study's row ball changed ("" if nothing)."""
        parts = [f"{c} {k} ({k / max(self.rows_seen, 1):.1%})" for c, k in self.clamped.items() if k]
        text = f"values clamped to the study's bounds: {', '.join(parts)}" if parts else ""
        if self.clipped:
            text += ("; " if text else "") + (f"{self.clipped} rows ({self.clipped / max(self.rows_seen, 1):.1%}) "
                                              f"clipped to the study's row bound (it declares no bounds: rows "
                                              f"must already be scaled into its ball)")
        return text


class DataLimitedWarning(UserWarning):
    """More than 1% of a column's values were clamped to the study's bounds, or rows were clipped
    to its row bound: the answers describe the clamped data (consider wider bounds)."""


def limited_warning(result: SubmitResult, share: float = CLAMP_WARNING_SHARE) -> str:
    """The :class:`DataLimitedWarning`'s message when a column had more than ``share`` of its
    values clamped, or any row was clipped; "" otherwise (what :func:`warn_if_limited` warns, and
    what both routes of ``dpsketch submit`` print: client_sdk/cli.py ``print_data_limits``)."""
    heavy = [c for c, k in result.clamped.items() if k > share * max(result.rows_seen, 1)]
    if not (heavy or result.clipped):
        return ""
    return result.clamp_summary() + (f" (more than {share:.0%} in {', '.join(heavy)}: consider "
                                     f"wider bounds)" if heavy else "")


def warn_if_limited(result: SubmitResult, share: float = CLAMP_WARNING_SHARE) -> None:
    """A :class:`DataLimitedWarning` when a column had more than ``share`` of its values clamped,
    or any row was clipped."""
    import warnings

    message = limited_warning(result, share)
    if message:
        warnings.warn(message, DataLimitedWarning, stacklevel=3)


# --- the client ------------------------------------------------------------------------------


def _plain_http_to_another_host(url: str) -> bool:
    """Whether ``url`` is plain http to a host other than this machine's loopback (where a bearer
    token would cross a network in clear)."""
    import ipaddress

    parsed = httpx.URL(url)
    if parsed.scheme != "http":
        return False
    host = parsed.host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True


def _tls_context(urls: Sequence[str], verify: bool | str | ssl.SSLContext) -> bool | ssl.SSLContext:
    """One TLS context for all of a client's servers, built only if one of them speaks https.

    httpx builds a context per connection pool otherwise: N loads of the CA bundle (about 60 ms
    each on a small machine) for a client that submits one row, and N for plain-http loopback
    URLs that never use them. The same context verifies every server, as N would."""
    if isinstance(verify, ssl.SSLContext):
        return verify
    if not any(httpx.URL(u).scheme == "https" for u in urls):
        # no TLS handshake can happen (http URLs; redirects are not followed), yet httpx makes a
        # context for every pool: give it one unverifying context, made once per process
        global _NO_TLS
        if _NO_TLS is None:
            _NO_TLS = httpx.create_ssl_context(verify=False)
        return _NO_TLS
    return httpx.create_ssl_context(verify=verify)


_NO_TLS: ssl.SSLContext | None = None


def _proxies_in_env() -> bool:
    """Whether the environment names a proxy (HTTP_PROXY, https_proxy, ALL_PROXY, NO_PROXY...).

    httpx reads the proxy variables for every ``httpx.Client`` it makes (urllib's scan of the
    whole environment: about 1 ms each, N per SDK client, a third of a one-row client's own CPU
    measured in session 53). Its other use of ``trust_env``, SSL_CERT_FILE and SSL_CERT_DIR,
    does not apply here: every pool gets the context :func:`_tls_context` made. So without a
    proxy variable the pools are made with ``trust_env=False``, which changes nothing else, and
    with one they read it as before."""
    return any(key.lower().endswith("_proxy") for key in os.environ)


def retry_delay(attempt: int, retry_after: str | None, backoff: float, max_backoff: float,
                max_retry_after: float) -> float:
    """Seconds to wait before retry ``attempt`` + 1: exponential backoff with jitter, or the
    server's ``Retry-After`` (seconds or an HTTP date) if longer, capped at ``max_retry_after``."""
    # Jitter only spreads retries out; it is not secret, so the stdlib generator is fine.
    delay = min(max_backoff, backoff * 2.0 ** attempt) * random.uniform(0.5, 1.0)
    if retry_after:
        wait: float | None
        try:
            wait = float(retry_after)
        except ValueError:
            try:
                when = email.utils.parsedate_to_datetime(retry_after)
                wait = when.timestamp() - time.time()
            except (TypeError, ValueError):
                wait = None
        if wait is not None:
            delay = max(delay, min(max(wait, 0.0), max_retry_after))
    return delay


_chacha_warmed = threading.Event()


def _warm_chacha() -> None:
    """Load the seed expansion's compiled loop in a background thread, once per process, while a
    bulk submission fetches its study (a one-row ``submit`` sends full shares and never needs it:
    loading numba would be about a second of CPU for nothing)."""
    if not _chacha_warmed.is_set():
        _chacha_warmed.set()
        threading.Thread(target=chacha.warm_up, name="chacha20-warm-up", daemon=True).start()



@contextlib.contextmanager
def _ctrl_c_stops(aborted: threading.Event, interrupted: threading.Event):
    """While an upload runs in the main thread under Python's default SIGINT handler, Ctrl-C
    also sets ``aborted`` (the upload workers stop at once) and ``interrupted`` (the caller raises
    UploadInterrupted after the workers finish), before raising KeyboardInterrupt as usual. A
    KeyboardInterrupt raised where Python swallows exceptions (a ``__del__``, a weakref or GC
    callback: "Exception ignored in ...") would otherwise be lost, and the upload would run on to
    the end after the data owner asked it to stop. A handler the program set
    itself, or a run outside the main thread, is left alone."""
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return

    def on_sigint(signum, frame):
        aborted.set()
        interrupted.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


class Client:
    """Submit rows to the N share servers of a study.

    ``server_urls`` are the servers' base URLs in the study's server order (share j goes to
    URL j). ``token`` (one for all, or one per server) is sent as a bearer token if given.
    Retries: up to ``max_retries`` after the first attempt, sleeping
    ``backoff * 2^attempt`` seconds (capped at ``max_backoff``, with jitter), or the server's
    ``Retry-After`` if longer (capped at ``max_retry_after``). Batches are cut to at most
    ``max_batch_bytes`` per request body; ``queue_depth`` batches per server may wait in memory.
    ``transport`` (an httpx transport) receives every request, as httpx's own connection pool
    does otherwise (tests use it to inject faults). ``compress`` (the default)
    sends all servers but one a 32-byte seed per report from ``submit_many`` instead of their
    8d-byte share (``application/x-dpsketch-seeds``; docs/protocol.md section 4) where that is
    smaller (share width above 4; narrower shares all go whole), and the one its
    full share; which one rotates over the servers batch by batch, so each takes in and stores
    the larger shares of 1/N of the batches. Besides the N records'
    ids and proofs (16 + 16N bytes each) a report uploads 8d + 32(N-1) bytes instead of 8dN
    (with N = 3: 256 + 8d bytes in all instead of 192 + 24d), and preparing a batch takes about
    as long as with full shares (the seeds expand through one compiled ChaCha20 loop,
    dpsketch/protocol/chacha.py; ``dpsketch bench seeds``).
    ``compress=False`` sends every server its full share. Single reports (``submit``) and
    blocks (``submit_blocks``) always go as full shares. A study with validity proofs
    (``study.validity``; docs/protocol.md section 4c) is always seed-compressed, whatever
    ``compress`` says: the leader of each batch (rotating as above) gets its F_p input and proof
    shares, every other server a seed; its single reports go as one-record batches (it takes
    no single-report JSON), and with parties each party's blocks go the same way, each proved
    with the party's bound (docs/validity.md section 13).

    With ``encrypt=True`` every share (or seed) is sealed to its server with HPKE (X25519,
    HKDF-SHA256, ChaCha20-Poly1305; docs/protocol.md section 7a) under the server's current
    public key from ``GET /v1/info``, bound to the study, the server and the report id, and sent
    as ``application/x-dpsketch-sealed`` (single reports too, as a one-record batch). The client
    refuses to seal unless every server publishes a key and no two servers publish the same key.
    Each body is sealed as one batch (one HPKE seal and one ChaCha20-Poly1305 message per body
    and server, section 7a version 4): 133 bytes per body and server (1,221 post-quantum) and
    nothing per report, well under a microsecond per report and server to seal or open; a
    server must list version 4 in ``hpke.versions``. Plaintext over TLS stays the default; use it when
    shares pass through a party other than their server (a gateway, a queue, a log). It combines
    with ``compress`` (the seeds are sealed).

    ``sealing`` (with ``encrypt=True``) chooses the HPKE suite per server (client_sdk/sealing.py,
    docs/sealing.md): ``"classical"`` (the default, as above), ``"post-quantum"`` (the hybrid
    MLKEM768-X25519 KEM at every server, refused with :class:`SDKError` before anything is sent
    unless every server publishes such a key; about 1.1 KB more per body and server) or
    ``"prefer-post-quantum"`` (post-quantum where published, classical elsewhere).
    :meth:`sealing_suites` tells which suite each server gets.

    ``max_floor_epsilon``: the data owner's own limit on the study's floor, the epsilon each
    report keeps when every other report is an adversary's and all servers but one collude
    (docs/trust.md). A study whose floor is weaker is refused before anything is sent
    (:class:`FloorTooWeak`); None accepts the study as it is (its servers' policies already
    bound the floor, 4 by default).

    ``allow_insecure_http``: send upload tokens over plain ``http://`` to a host other than this
    machine's loopback. Off by default: such a URL with a token raises :class:`SDKError` at
    once, since the token would cross the network in clear (docs/trust.md, "Secure defaults").

    ``privacy_limit`` (a :class:`client_sdk.budget.PrivacyLimit`): the data owner's own limit
    over every study it contributes to, kept in a local file. A study that would take the
    owner's running total past it is refused before anything is sent
    (:class:`~client_sdk.budget.PrivacyLimitExceeded`); a study is recorded once every server
    holds the owner's rows (docs/ledger.md).

    ``journal``: where :meth:`submit_many` keeps each submission's journal, which makes running
    the same submission again store each row exactly once (client_sdk/journal.py, README "Resuming
    an interrupted upload"): ``True`` (the default) is ``$DPSKETCH_SUBMISSIONS_DIR``, else
    ``~/.dpsketch/submissions``; a path is that directory; ``False`` keeps no journal (every call
    draws fresh randomness, so running it again counts every row again).
    """

    def __init__(self, server_urls: Sequence[str], *, timeout: float = 30.0, max_retries: int = 5,
                 backoff: float = 0.5, max_backoff: float = 30.0, max_retry_after: float = 120.0,
                 http2: bool = False, verify: bool | str | ssl.SSLContext = True,
                 token: str | Sequence[str] | None = None, queue_depth: int = 2,
                 max_batch_bytes: int = MAX_BATCH_BYTES, transport: httpx.BaseTransport | None = None,
                 compress: bool = True, encrypt: bool = False, max_floor_epsilon: float | None = None,
                 privacy_limit: Any = None,
                 sealing: str = _sealing.CLASSICAL, journal: bool | str | os.PathLike = True,
                 allow_insecure_http: bool = False):
        urls = [u.strip().rstrip("/") for u in server_urls]
        if len(urls) < 2:
            raise ValueError("need the URLs of at least two share servers")
        if any(not u for u in urls):
            raise ValueError("empty server URL")
        seen = {u.lower() for u in urls}
        if len(seen) != len(urls):
            dup = next(u for u in urls if sum(v.lower() == u.lower() for v in urls) > 1)
            raise StudyMismatch(f"server URL {dup} is listed twice: it would receive two shares "
                                f"of every report")
        if max_retries < 0 or backoff < 0 or queue_depth < 1:
            raise ValueError("max_retries and backoff must be >= 0, queue_depth >= 1")
        tokens = [token] * len(urls) if token is None or isinstance(token, str) else list(token)
        if len(tokens) != len(urls):
            raise ValueError("give one token, or one token per server URL")
        for url, tok in zip(urls, tokens):
            if tok and not allow_insecure_http and _plain_http_to_another_host(url):
                raise SDKError(f"refusing to send an upload token over plain http to {url}: anyone on the "
                               f"path could read it and upload in its name. Use https://, or pass "
                               f"allow_insecure_http=True (dpsketch submit --allow-insecure-http) for a "
                               f"network you trust")
        self.urls = urls
        self.max_retries = max_retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.max_retry_after = max_retry_after
        self.queue_depth = queue_depth
        self.max_batch_bytes = max_batch_bytes
        self.compress = compress
        self.encrypt = encrypt
        self.sealing = _sealing.check_policy(sealing)
        if sealing != _sealing.CLASSICAL and not encrypt:
            raise ValueError(f"sealing={sealing!r} chooses how shares are sealed: give encrypt=True too")
        if max_floor_epsilon is not None and not max_floor_epsilon > 0:
            raise ValueError("max_floor_epsilon must be positive (or None)")
        self.max_floor_epsilon = max_floor_epsilon
        #: a client_sdk.budget.PrivacyLimit: the data owner's own running total (docs/ledger.md)
        self.privacy_limit = privacy_limit
        self.journal = (None if journal is False else
                        _journal.Journal(None if journal is True else journal))
        self._recipients: dict[str, list[envelope.Recipient]] = {}
        #: per study, each server's /v1/info as read with the study (encrypt only; server_infos)
        self._infos: dict[str, list[messages.ServerInfo]] = {}
        self._http = []
        #: per server, the transport its requests are handed to directly (:meth:`_send`), or None
        #: (a proxy in the environment: httpx.Client routes each request), with the client's
        #: default headers and timeout, read once
        self._direct: list[tuple[httpx.BaseTransport, str, dict[str, str], dict] | None] = []
        tls = _tls_context(urls, verify) if transport is None else verify
        trust_env = _proxies_in_env()
        for url, tok in zip(urls, tokens):
            headers = {"User-Agent": f"dpsketch-client/{__version__}"}
            if tok:
                headers["Authorization"] = f"Bearer {tok}"
            direct = transport
            if direct is None and not trust_env:  # the pool httpx.Client would make, held here
                direct = httpx.HTTPTransport(verify=tls, http2=http2, trust_env=False)
            http = httpx.Client(base_url=url, timeout=timeout, http2=http2, verify=tls, headers=headers,
                                transport=direct, trust_env=trust_env)
            self._http.append(http)
            self._direct.append(None if direct is None else
                                (direct, url, {k.decode(): v.decode() for k, v in http.headers.raw},
                                 http.timeout.as_dict()))
        self._pool = ThreadPoolExecutor(max_workers=len(urls), thread_name_prefix="dpsketch-client")
        self._studies: dict[str, Study] = {}
        self._committed: dict[str, list[str]] = {}
        self._closing = threading.Event()

    # lifecycle
    def close(self) -> None:
        self._closing.set()
        self._pool.shutdown(wait=True)
        for http in self._http:
            http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- HTTP with retries -------------------------------------------------------------------

    def _delay(self, attempt: int, retry_after: str | None) -> float:
        return retry_delay(attempt, retry_after, self.backoff, self.max_backoff, self.max_retry_after)

    def _problem(self, j: int, resp: httpx.Response) -> ProblemError:
        try:
            body = resp.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            text = resp.text.strip().replace("\n", " ")[:200]
            body = {"detail": f"HTTP {resp.status_code} {resp.reason_phrase}: {text}"}
        err = ProblemError.from_body(resp.status_code, body)
        err.url = self.urls[j]  # type: ignore[attr-defined]
        err.server_index = j  # type: ignore[attr-defined]
        return err

    @staticmethod
    def _retryable(status: int) -> bool:
        return status in (408, 429) or (status >= 500 and status not in (501, 505))

    def _request(self, j: int, method: str, path: str, *, cancel: threading.Event | None = None,
                 **kwargs: Any) -> httpx.Response:
        """One logical request to server j: retried on transport errors, 408/429/5xx."""
        attempt = 0
        while True:
            if cancel is not None and cancel.is_set():
                raise UploadCancelled()
            try:
                resp = self._send(j, method, path, **kwargs)
            except httpx.TransportError as exc:
                bad_cert = cert_error(exc)
                if bad_cert is not None:  # not transient: retrying cannot help
                    raise ServerUnreachable(
                        self.urls[j], f"TLS certificate verification failed: "
                        f"{bad_cert.verify_message or bad_cert.reason} (check that its certificate "
                        f"is signed by the CA given as verify= / --ca-file); nothing was sent "
                        f"in this request") from exc
                if attempt >= self.max_retries:
                    raise ServerUnreachable(
                        self.urls[j], f"not reachable: {unreachable_reason(exc)}, after {attempt + 1} "
                        f"attempt{'s' if attempt else ''}") from exc
                delay = self._delay(attempt, None)
            else:
                if resp.status_code < 400:
                    return resp
                if not self._retryable(resp.status_code) or attempt >= self.max_retries:
                    raise self._problem(j, resp)
                delay = self._delay(attempt, resp.headers.get("Retry-After"))
            attempt += 1
            if (cancel if cancel is not None else self._closing).wait(delay):
                raise UploadCancelled()

    def _send(self, j: int, method: str, path: str, *, content: bytes | None = None, json: Any = None,
              headers: dict[str, str] | None = None) -> httpx.Response:
        """One HTTP request to server j, its body read: handed straight to the server's transport
        (httpx's connection pool, or the one given as ``transport``), with the headers and timeout
        its ``httpx.Client`` would add. The client's own layers (URL merging, cookies, auth and
        redirect hooks, none of which the SDK uses: it follows no redirect and no server sets a
        cookie) were about 0.3-0.5 ms of CPU per request, 40 % of httpx's cost for a one-row
        client's six requests (docs/peer.md). With a proxy in the environment the request goes
        through the ``httpx.Client``, which picks the proxy for each URL."""
        direct = self._direct[j]
        if direct is None:
            return self._http[j].request(method, path, content=content, json=json, headers=headers)
        transport, base, defaults, timeout = direct
        request = httpx.Request(method, base + path, content=content, json=json,
                                headers={**defaults, **headers} if headers else defaults,
                                extensions={"timeout": timeout})
        response = transport.handle_request(request)
        response.request = request
        try:
            response.read()
        finally:
            response.close()
        return response

    def _json(self, j: int, resp: httpx.Response, model: type[BaseModel]) -> Any:
        try:
            return model.model_validate(resp.json())
        except (ValueError, ValidationError) as exc:
            raise ServerProtocolError(
                f"{self.urls[j]}: {resp.request.method} {resp.request.url.path} returned a body "
                f"that is not a valid {model.__name__}: {exc}") from None

    def _each_server(self, fn: Callable[[int], Any]) -> list[Any]:
        """Run fn(j) for every server in parallel; re-raise the first error (in server order)."""
        futures = [self._pool.submit(fn, j) for j in range(len(self.urls))]
        results, errors = [], []
        for f in futures:
            try:
                results.append(f.result())
            except Exception as exc:  # noqa: BLE001 - collected and re-raised below
                results.append(None)
                errors.append(exc)
        if errors:
            raise errors[0]
        return results

    # --- the study ---------------------------------------------------------------------------

    def study(self, study_id: str) -> Study:
        """Fetch the study from all N servers and verify it; cached per client once verified.

        Raises :class:`StudyMismatch` unless every server returns parameters that hash to
        ``study_id``, there is one URL per server of the study, and URL j is server j.
        """
        if study_id in self._studies:
            return self._studies[study_id]
        if not isinstance(study_id, str) or not STUDY_ID.fullmatch(study_id):
            raise ValueError("a study id is 64 lower-case hex characters")

        def fetch(j: int) -> tuple[messages.ServerInfo | None, messages.StudyInfo]:
            # the study first, then (sealing only) the info: a HPKE key read here was current
            # after the study existed, so the server keeps it until the study is committed
            # (section 7a). Without sealing the study's own answer names the server (server_id),
            # so a plaintext client asks each server one question before it uploads.
            resp = self._request(j, "GET", f"/v1/studies/{study_id}")
            info = (self._json(j, self._request(j, "GET", "/v1/info"), messages.ServerInfo)
                    if self.encrypt else None)
            try:
                body = resp.json()
                if isinstance(body, dict) and "study" in body:  # checked once per process (verified.py)
                    body = {**body, "study": _verified.study(body["study"])}
                return info, messages.StudyInfo.model_validate(body)
            except ValidationError as exc:
                raise StudyMismatch(f"{self.urls[j]} returned study parameters that fail the "
                                    f"protocol's checks: {exc}") from None
            except ValueError:
                raise ServerProtocolError(f"{self.urls[j]}: study response is not JSON") from None

        fetched = self._each_server(fetch)
        for j, (_, sinfo) in enumerate(fetched):
            got = sinfo.study.study_id
            if got != study_id:
                raise StudyMismatch(
                    f"{self.urls[j]} holds different parameters under study {study_id[:12]}... "
                    f"(they hash to {got[:12]}...): refusing to submit")
        study = fetched[0][1].study
        if len(self.urls) != study.n_servers:
            raise StudyMismatch(
                f"the study splits each report among {study.n_servers} servers "
                f"({', '.join(study.servers)}) but {len(self.urls)} URLs were given")
        for j, (info, sinfo) in enumerate(fetched):
            if info is not None and info.protocol != study.protocol:
                raise StudyMismatch(f"{self.urls[j]} speaks {info.protocol!r}, the study is "
                                    f"{study.protocol!r}")
            named = sinfo.server_id if info is None or info.server_id == study.servers[j] else info.server_id
            if named != study.servers[j] or sinfo.server_id != study.servers[j]:
                raise StudyMismatch(
                    f"URL {j + 1} ({self.urls[j]}) is server {named!r}, but the study sends "
                    f"share {j + 1} to {study.servers[j]!r}; give the URLs in the study's server "
                    f"order: {', '.join(study.servers)}")
        if self.max_floor_epsilon is not None:
            floor = float(study.guarantees()["floor_epsilon"])
            if not floor <= self.max_floor_epsilon:
                raise FloorTooWeak(
                    f"study {study_id[:12]}...: with no other honest report a report keeps only "
                    f"epsilon = {floor:.4g} (server_sigma = {study.server_sigma:g}), above this "
                    f"client's max_floor_epsilon = {self.max_floor_epsilon:g}; refusing to submit")
        if self.encrypt:
            self._infos[study_id] = [info for info, _ in fetched if info is not None]
            self._recipients[study_id] = self._recipients_of(study, self._infos[study_id])
        self._committed[study_id] = [s.server_id for _, s in fetched if s.status != "open"]
        self._studies[study_id] = study
        return study

    def _recipients_of(self, study: Study, infos: list[messages.ServerInfo]) -> list[envelope.Recipient]:
        """Each server's current HPKE key of the suite ``self.sealing`` picks, checked (sealing.py)."""
        return _sealing.recipients(self.urls, study, infos, self.sealing)

    def recipients(self, study_id: str) -> list[envelope.Recipient]:
        """The key each server's shares are sealed to (study order), read and checked with the
        study (what an enrolment holds: client_sdk/relayed.py); empty without ``encrypt``."""
        self.study(study_id)
        return list(self._recipients.get(study_id, []))

    def sealing_suites(self, study_id: str) -> list[str]:
        """The suite each server's shares are sealed with (study order): ``classical`` or
        ``post-quantum``; empty without ``encrypt``."""
        return [r.suite.name for r in self.recipients(study_id)]

    def server_infos(self, study_id: str) -> list[messages.ServerInfo]:
        """Each server's ``GET /v1/info`` (study order) as read with the study and its keys: its
        id, protocol, keys and policy (what ``dpsketch enrol`` checks ``relayed_uploads`` in).
        Only a client with ``encrypt=True`` reads it: empty otherwise."""
        self.study(study_id)
        return list(self._infos.get(study_id, []))

    def _wire(self, study: Study, study_id: str, j: int, body: bytes, media_type: str) -> tuple[bytes, str]:
        """Server j's request body and media type: as prepared, or sealed to server j."""
        if not self.encrypt:
            return body, media_type
        return _sealing.wire(self._recipients[study_id][j], study, study_id, body, media_type)

    def _open_study(self, study_id: str, blocks: bool = False) -> Study:
        study = self.study(study_id)
        if self.privacy_limit is not None:
            self.privacy_limit.check(study)  # PrivacyLimitExceeded: nothing sent
        if study.parties is not None and not blocks:
            raise StudyMismatch(f"study {study_id[:12]}... has parties "
                                f"({', '.join(p.name for p in study.parties)}): each submits its "
                                f"block of every individual with submit_blocks (dpsketch submit --party)")
        closed = self._committed.get(study_id)
        if closed:
            raise ProblemError("study-closed", f"server(s) {', '.join(closed)} report the study "
                               f"as committed: it takes no more reports")
        return study

    # --- uploads -----------------------------------------------------------------------------

    def _upload_batch(self, j: int, study: Study, study_id: str, body: bytes,
                      cancel: threading.Event | None = None,
                      media_type: str = messages.SHARES_MEDIA_TYPE) -> messages.UploadResult:
        """POST one binary batch to server j; on 413 split it in halves (same bytes per report),
        except a proved batch's record (one proof covers its rows: the 413 stands)."""
        path = f"/v1/studies/{study_id}/batches"
        m = _sealing.count_records(body, media_type, study)
        try:
            resp = self._request(j, "POST", path, content=body, cancel=cancel,
                                 headers={"Content-Type": media_type})
        except ProblemError as exc:
            plain_type = getattr(body, "plain_media_type", media_type)  # a sealed body: what it seals
            if exc.status == 413 and m > 1 and not is_batch_record(plain_type, study):
                first, second = _sealing.split_body(body, media_type, study)
                a = self._upload_batch(j, study, study_id, first, cancel, media_type)
                b = self._upload_batch(j, study, study_id, second, cancel, media_type)
                return messages.UploadResult(accepted=a.accepted + b.accepted,
                                             duplicates=a.duplicates + b.duplicates,
                                             report_count=b.report_count)
            raise
        result = self._json(j, resp, messages.UploadResult)
        if result.accepted + result.duplicates != m:
            raise ServerProtocolError(f"{self.urls[j]} acknowledged {result.accepted} + "
                                      f"{result.duplicates} reports of a batch of {m}")
        return result

    def submit(self, study_id: str, row: Any) -> str:
        """Submit one row (d numbers in study order, or a dict by column name); return its hex id.

        One JSON request per server, in parallel (with ``encrypt``: a one-record sealed batch; a
        study with validity proofs, which takes no single-report JSON: a one-record batch of
        the leader's shares or a helper's seed, docs/protocol.md section 4c). Not journaled: each call makes a new report (a row to resubmit after a crash goes
        through :meth:`submit_many`, which stores it once however often it runs).
        """
        study = self._open_study(study_id)
        batch = prepare_batch(study, _data.row_vector(row, study.columns, raw=study.histogram is not None))
        rid = batch.report_ids[0]
        as_batch = self.encrypt or proved_shares.is_proved(study)
        sealed = ([self._wire(study, study_id, j, batch.body(j), batch.media_type(j))
                   for j in range(study.n_servers)] if as_batch else None)

        def send(j: int) -> messages.UploadResult:
            if sealed is not None:
                return self._upload_batch(j, study, study_id, sealed[j][0], media_type=sealed[j][1])
            body = batch.report(j).model_dump()
            resp = self._request(j, "POST", f"/v1/studies/{study_id}/reports", json=body)
            return self._json(j, resp, messages.UploadResult)

        futures = [self._pool.submit(send, j) for j in range(study.n_servers)]
        failures, pending = [], []
        for j, f in enumerate(futures):
            try:
                f.result()
            except Exception as exc:  # noqa: BLE001
                failures.append(BatchFailure(j, study.servers[j], self.urls[j], 0, 0, 1, exc))
                pending.append(PendingUpload(j, study.servers[j], 0, 0, 1, *(
                    sealed[j] if sealed is not None else (batch.body(j), batch.media_type(j)))))
        if failures:
            if len(failures) == study.n_servers:  # stored nowhere: a plain error
                raise failures[0].error
            raise IncompleteUpload(failures, pending, [rid.hex()], 1)
        self._spent(study)
        return rid.hex()

    def submit_many(self, study_id: str, rows: Any, batch_size: int | None = None,
                    progress: Progress | None = None, *, keep_ids: bool = True,
                    ignore_extra_columns: bool = False, new_submission: bool = False,
                    check_file: bool = True, batch_proofs: bool = True) -> SubmitResult:
        """Submit many rows through the binary batch endpoint; return their hex ids in order.

        ``rows``: an (n, d) numpy array, a DataFrame-like object, a CSV path, or an iterable of
        rows. In-memory inputs are checked whole before anything is sent, and so is a CSV file
        (one extra read; ``check_file=False`` skips it when the caller has just checked the file,
        as ``dpsketch submit`` does); other iterables chunk by chunk. A NaN or infinite value is
        refused naming its row and column. ``progress(m)`` is called with the number of rows
        newly stored at *all* servers (and, when a submission resumes, with the rows an earlier
        run stored there). With ``keep_ids=False`` the returned list is empty (saves memory for
        huge inputs; counts are still in the result). ``batch_size``: rows per request; by
        default as many as fill 8 MiB of the largest body (at most 10^5 rows:
        ``client_sdk.upload.batch_rows``), so narrow rows go in fewer, larger requests.

        A study with batch proofs (``study.batch_proofs``; docs/protocol.md section 4d) gets
        proved batches: each batch's rows are made noisy exactly as a per-report proof's are,
        then proved at once (one proof and 128 wrap-around checks for the batch instead of a proof
        a row: ``dpsketch.protocol.report.prepare_proof_batch``); the batch's leader, rotating
        over the servers batch by batch, gets the record with its input and proof shares
        (``application/x-dpsketch-proof-batch``), every other server a 200-byte record with its
        seed (``application/x-dpsketch-proof-batch-seed``). ``batch_size`` is then the rows of a
        proved batch (default: as many as keep the leader's record within 8 MiB, at most 10^5:
        ``client_sdk.upload.proof_batch_rows``); a batch is never cut once proved. The ids
        returned are the rows' ids (``batch_validity.row_ids``: hashes of the batch id and the
        row's index).
        ``batch_proofs=False`` proves each row on its own instead, as for a study without. With
        ``encrypt=True`` each server's record is sealed to it as a batch of one record, content
        0x05 (the leader's) or 0x06 (a helper's), the batch id in the clear (docs/sealing.md
        section 3b; the suites as ``sealing`` picks): a batch sent again (a resumed submission, or
        :meth:`resend`) is sealed again and is still the same batch (a duplicate at the server).

        Exactly once (with the client's ``journal``, the default): calling this again with the
        same study and the same input (the same CSV bytes, or the same rows) after a crash,
        SIGKILL, Ctrl-C or :class:`IncompleteUpload` stores each row once. The journal keys the
        submission's noise, shares and salts, so the rerun regenerates the same reports; batches
        every server acknowledged are skipped, the others sent again (servers answer
        "duplicate" for what they hold, without counting it or charging the upload token). A
        resumed submission keeps the batch size and share layout it started with. Once every
        row is stored the key is deleted and a further call sends nothing
        (``result.already_complete``); ``new_submission=True`` submits the same rows again as
        new reports. A CSV file changed under an unfinished submission of it raises
        :class:`~client_sdk.errors.InputChanged` before anything is sent. Iterators (generators)
        cannot be fingerprinted and get no journal. See client_sdk/journal.py.

        Raises :class:`IncompleteUpload` if some server does not hold some batch after retries;
        a plain error (``ProblemError``, ``ServerUnreachable``) if nothing was stored anywhere;
        :class:`~client_sdk.errors.UploadInterrupted` (a ``KeyboardInterrupt``) on Ctrl-C, with
        the rows every server holds and those only some do.
        """
        if batch_size is not None and batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        if self.compress:
            _warm_chacha()
        study = self._open_study(study_id)
        proved = proved_shares.is_proved(study)
        batched = bool(study.batch_proofs) and batch_proofs  # proved batches (section 4d)
        if batched:
            batch_size = proof_batch_rows(study, batch_size, self.max_batch_bytes)
        else:
            record = (messages.record_bytes(messages.SHARES_MEDIA_TYPE, proved_shares.upload_width(study),
                                            study.n_servers)
                      + (_sealing.overhead_bytes(self._recipients[study_id]) if self.encrypt else 0))
            batch_size = batch_rows(batch_size, record, self.max_batch_bytes)
        raw = study.histogram is not None
        is_file = isinstance(rows, (str, os.PathLike))
        in_memory = isinstance(rows, (np.ndarray, list, tuple)) or _data._is_frame(rows)
        if is_file and check_file:  # every row before the first request, as for in-memory inputs
            check = ((lambda chunk, first: study.histogram.cell_index(chunk, first_row=first))  # type: ignore[union-attr]  # raw: the study has a histogram
                     if raw else None)
            _data.scan_csv(rows, study.columns, ignore_extra=ignore_extra_columns, check=check)
        chunks: Any = None
        if in_memory:  # validate everything before the first request
            chunks = list(_data.iter_chunks(rows, study.columns, batch_size,
                                            ignore_extra=ignore_extra_columns, raw=raw))
            if raw:  # every value must have a cell
                first = 0
                for chunk in chunks:
                    try:
                        study.histogram.cell_index(chunk, first_row=first)  # type: ignore[union-attr]  # raw: the study has a histogram
                    except ValueError as exc:
                        raise _data.InvalidDataError(str(exc)) from None
                    first += len(chunk)
        # with seeds, the server that gets the full shares changes from batch to batch (prepare_batch)
        # narrow shares: a seed saves nothing; a study with validity proofs always takes seeds
        compress = proved or (self.compress and ring.seed_is_smaller(study.width))
        submission = None
        if self.journal is not None and (is_file or in_memory):
            fingerprint = (_journal.fingerprint_file(rows) if is_file
                           else _journal.fingerprint_rows(chunks))
            submission = self.journal.open(study_id, fingerprint,
                                           source=os.path.abspath(rows) if is_file else None,
                                           batch_size=batch_size, compress=compress, new=new_submission,
                                           batch_proofs=batched)
            if submission.complete:
                return SubmitResult([], submission.stored_rows, {}, {sid: 0 for sid in study.servers},
                                    skipped=submission.stored_rows, journal=str(submission.file),
                                    already_complete=True)
            if (submission.batch_size, submission.compress, submission.batch_proofs) != (batch_size, compress,
                                                                                          batched):
                batch_size, compress = submission.batch_size, submission.compress  # as it started
                batched = submission.batch_proofs
                if in_memory and chunks:
                    whole = np.concatenate(chunks)
                    chunks = [whole[i:i + batch_size] for i in range(0, len(whole), batch_size)]
        if chunks is None:  # streamed, in the submission's batches
            chunks = _data.iter_chunks(rows, study.columns, batch_size, ignore_extra=ignore_extra_columns,
                                       raw=raw)

        limited: dict[str, Any] = {"clamped": np.zeros(study.d, dtype=np.int64), "clipped": 0, "rows": 0}

        def batches() -> Any:
            first = 0
            for i, chunk in enumerate(chunks):
                limited["rows"] += len(chunk)
                skip = submission is not None and i in submission.done  # every server holds it
                batch = None
                if not skip or i == 0:  # batch 0 always: it checks that a rerun rebuilds the same reports
                    stream = submission.stream(i) if submission is not None else None
                    # the server given the full shares (or leading the proved batch) rotates
                    batch = (prepare_proof_batch(study, chunk, i % study.n_servers, stream) if batched else
                             prepare_batch(study, chunk, compress, full=i % study.n_servers, stream=stream))
                    if i == 0 and submission is not None:
                        submission.check_first_batch(batch.report_ids)  # ResumeMismatch: nothing sent
                if not raw:  # what the map into the ball changed, skipped batches included
                    clamped, clipped = ((batch.clamped, batch.clipped) if batch is not None else
                                        _report.limited_counts(_data.check_rows(chunk, study.d), study))
                    limited["clamped"] += clamped
                    limited["clipped"] += clipped
                yield i, first, None if skip else batch, len(chunk)
                first += len(chunk)

        result = self._run_upload(study, study_id, batches(), progress, keep_ids, submission)
        result.clamped = {c: int(k) for c, k in zip(study.columns, limited["clamped"])} if not raw else {}
        result.clipped, result.rows_seen = int(limited["clipped"]), int(limited["rows"])
        warn_if_limited(result)
        return result

    def _run_upload(self, study: Study, study_id: str, batches: Any, progress: Progress | None,
                    keep_ids: bool, submission: "_journal.Submission | None" = None) -> SubmitResult:
        """Upload prepared batches through one :class:`~client_sdk.upload.UploadRun`; errors as
        :meth:`submit_many` documents. ``batches`` is a lazy iterable (preparing overlaps
        sending) of (index, first input row, PreparedBatch, rows); the batch is None for one
        every server already holds (a resumed ``submission``), which is skipped."""
        run = UploadRun(self, study, study_id, progress, keep_ids,
                        on_stored=submission.record_done if submission is not None else None)
        journal = str(submission.file) if submission is not None else None
        consumed = skipped = 0
        interrupted = threading.Event()
        try:
            with _ctrl_c_stops(run.aborted, interrupted):
                for index, first_row, batch, n_rows in batches:
                    if batch is None:
                        skipped += n_rows
                        if progress is not None:
                            progress(n_rows)
                    else:
                        # a batch prepared while the run aborted is put too: it becomes pending at
                        # every server, so every prepared row is either stored or handed back to resend
                        run.put(batch, first_row, index)
                    consumed = first_row + n_rows
                    if run.aborted.is_set():
                        break
                run.finish()
                if interrupted.is_set():  # a Ctrl-C whose KeyboardInterrupt was swallowed on its way
                    raise KeyboardInterrupt
        except Exception as exc:
            # bad input (or a failing reader) part-way: let the batches already queued finish,
            # so every row prepared so far is held by all servers, then say what was sent
            run.finish()
            if run.failures or run.pending:
                raise run.incomplete(consumed, journal) from exc
            if not isinstance(exc, _data.InvalidDataError) or not consumed:
                raise
            err = _data.InvalidDataError(
                f"{exc} ({consumed} earlier rows were already submitted; see .report_ids)")
            err.report_ids = run.ids()  # type: ignore[attr-defined]
            raise err from None
        except BaseException as exc:  # Ctrl-C: stop at once, in-flight rows may be partial
            run.aborted.set()
            run.finish()
            if isinstance(exc, KeyboardInterrupt) and not isinstance(exc, UploadInterrupted):
                raise UploadInterrupted(skipped + run.rows_done, run.partial_rows(), journal) from exc
            raise
        if run.failures:
            if run.stored_batches == 0:
                raise run.failures[0].error
            raise run.incomplete(consumed, journal)
        if submission is not None:
            submission.finish(consumed)
        if run.rows_done or skipped:  # (an earlier run may have stopped before recording it)
            self._spent(study)
        return SubmitResult(run.ids(), skipped + run.rows_done, run.report_counts, run.duplicates,
                            skipped=skipped, journal=journal)

    def _spent(self, study: Study) -> None:
        """Every server holds this owner's rows of the study: record it in the owner's ledger."""
        if self.privacy_limit is not None:
            self.privacy_limit.record(study)

    def submit_blocks(self, study_id: str, party: str, rows: Any, *, party_key: bytes,
                      keys: Sequence[str | bytes] | None = None, key_column: str | None = None,
                      batch_size: int | None = None, progress: Progress | None = None,
                      keep_ids: bool = True) -> SubmitResult:
        """Submit one party's block of each individual's row to a study with parties.

        ``rows`` holds the party's columns (any input :meth:`submit_many` takes; other columns are
        ignored); each row's individual is named by ``keys`` (one per row) or by the CSV's
        ``key_column``. ``party_key`` is the 32-byte key the parties share (never a server):
        it turns each key into the pseudonym the servers see (``client_sdk.parties``). The
        client's token must be one of the party's upload tokens. Returns the block ids. Blocks
        go as full shares to every server (``compress`` does not apply to them), except in a
        study with validity proofs, where each block is proved valid with the party's bound and
        goes as a report of such a study does (the leader's input and proof shares, rotated over
        the servers batch by batch, a seed to every other server; docs/protocol.md 4c); with
        ``encrypt=True`` each batch is sealed to its server (the pseudonyms inside the ciphertext,
        docs/sealing.md section 3a).

        A block is one per individual and party: sending the same bytes again is harmless
        (:meth:`resend` after an :class:`IncompleteUpload`), but preparing an individual's block
        anew gives different bytes, which the servers refuse as ``report-conflict``.
        """
        from .parties import keyed_chunks, prepared_blocks

        if batch_size is not None and batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        study = self._open_study(study_id, blocks=True)
        try:
            index, declared = study.party(party)
        except ValueError as exc:
            raise StudyMismatch(str(exc)) from None
        # a study with validity proofs: the leader's record (input and proof shares) is the largest
        record = messages.record_bytes(messages.blocks_media_type(party),
                                       proved_shares.upload_width(study, index), study.n_servers)
        batch_size = batch_rows(batch_size, record, self.max_batch_bytes)
        chunks = keyed_chunks(rows, declared.columns, batch_size, keys=keys, key_column=key_column)
        if keys is not None:
            chunks = iter(list(chunks))  # in memory: validate everything before the first request
        return self._run_upload(study, study_id, _indexed(prepared_blocks(study, party, party_key, chunks)),
                                progress, keep_ids)

    def resend(self, study_id: str, pending: Sequence[PendingUpload]) -> None:
        """Upload again exactly the bytes an :class:`IncompleteUpload` listed as pending.

        Idempotent: reports a server already holds are acknowledged as duplicates.
        Raises :class:`IncompleteUpload` with what is still missing.
        """
        study = self.study(study_id)
        failures, still = [], []
        for p in pending:
            try:
                self._upload_batch(p.server_index, study, study_id, p.body, media_type=p.media_type)
            except Exception as exc:  # noqa: BLE001
                failures.append(BatchFailure(p.server_index, p.server_id, self.urls[p.server_index],
                                             p.batch_index, p.first_row, p.n_rows, exc))
                still.append(p)
        if failures:
            raise IncompleteUpload(failures, still, [], sum(p.n_rows for p in pending))
        self._spent(study)

    def report_counts(self, study_id: str) -> dict[str, int | None]:
        """Each server's report count for the study (``GET /v1/studies/{id}``); None where the
        server withholds it (an add/remove study: the count would tell membership)."""
        study = self.study(study_id)

        def count(j: int) -> int | None:
            resp = self._request(j, "GET", f"/v1/studies/{study_id}")
            value = resp.json().get("report_count")
            return None if value is None else int(value)

        return dict(zip(study.servers, self._each_server(count)))


def _indexed(batches: Any) -> Any:
    """(index, first row, batch, rows) for each prepared batch, as ``Client._run_upload`` takes them."""
    first = 0
    for index, batch in enumerate(batches):
        yield index, first, batch, len(batch)
        first += len(batch)
