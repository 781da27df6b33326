"""Study lifecycle across the N share servers: create, watch, finalize, release.

Finalization follows DESIGN.md "Upload, finalization, release": collect the report ids each
server holds, intersect them (a report counts only if all N hold it), record the set durably,
ask every server to commit to exactly that set, fetch the N aggregate shares and add them mod
2^64. Every step is idempotent, so a crashed analyzer simply runs finalize again.
"""

from __future__ import annotations

import hashlib
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
import dataclasses
from dataclasses import dataclass

import httpx
import numpy as np

from dpsketch.protocol import (ProblemError, Study, batch_validity, batch_verifiers, design, field, inclusion, ledger,
                               messages, proved_shares, validity, verification)
from dpsketch.protocol.messages import CommitResult, PopulationLedger, ServerInfo, StudyInfo
from dpsketch.protocol.sketch import REPORT_ID_BYTES

from .config import ClusterConfig, ServerEndpoint
from .store import AnalyzerStore, StudyRecord

RETRY_STATUSES = {429, 502, 503, 504}
#: A verification round's query and decision: a server checks every report it holds (about
#: 10 us a report of CPU; tens of seconds at 10^6 on a loaded machine), so more than the
#: default timeout
ROUND_TIMEOUT_S = 900.0
#: calls to one server the analyzer's kept thread pool runs at once (Coordinator._each)
POOL_CALLS_PER_SERVER = 8
#: the most bytes httpx's HTTP/1.1 connections take from a socket in one read (httpcore's own
#: is 64 KiB). Why: a finalization fetches every server's report-id list at once, 16 MB a
#: server at 10^6 reports, and h11 copies its buffer once per read, under the GIL: the analyzer
#: spent 60-80 ms of CPU on each list, 1 MiB reads 17-35 ms (issue 46; a 16 MB loopback
#: response, load 4-5). A read takes what the socket holds, so small answers are unchanged.
READ_BYTES = 1 << 20


def _read_larger_chunks(read_bytes: int = READ_BYTES) -> None:
    """Raise httpcore's read size to ``read_bytes`` for the whole process (its connections are
    made inside httpx's pool, with no per-client setting); never lowers it. Without httpcore
    (an httpx that no longer uses it), nothing changes."""
    try:
        import httpcore
    except ImportError:  # pragma: no cover - httpx has always brought httpcore so far
        return
    connection = getattr(httpcore, "HTTP11Connection", None)
    if isinstance(getattr(connection, "READ_NUM_BYTES", None), int) and connection.READ_NUM_BYTES < read_bytes:
        connection.READ_NUM_BYTES = read_bytes


_read_larger_chunks()


class UpstreamError(Exception):
    """A share server refused or failed; carries the server id and its problem, if any."""

    def __init__(self, server_id: str, detail: str, problem: ProblemError | None = None):
        self.server_id = server_id
        self.problem = problem
        super().__init__(f"server {server_id}: {detail}")


class ShareServerClient:
    """The analyzer's calls to one share server, with retries on transient failures."""

    def __init__(self, endpoint: ServerEndpoint, timeout: float = 60.0, retries: int = 5,
                 verify: ssl.SSLContext | bool = True):
        self.endpoint = endpoint
        self.retries = retries
        self.http = httpx.Client(
            base_url=endpoint.url.rstrip("/"),
            timeout=timeout,
            transport=httpx.HTTPTransport(retries=2, verify=verify),
        )

    def close(self) -> None:
        self.http.close()

    def _request(self, method: str, path: str, *, token: str | None = None, **kwargs) -> httpx.Response:
        headers = kwargs.pop("headers", {})
        if token:
            headers["Authorization"] = f"Bearer {token}"
        delay = 0.2
        for attempt in range(self.retries + 1):
            try:
                response = self.http.request(method, path, headers=headers, **kwargs)
            except httpx.TransportError as exc:
                if "CERTIFICATE_VERIFY_FAILED" in str(exc):
                    # a wrong certificate does not heal with retries: say so at once
                    raise UpstreamError(self.endpoint.server_id,
                                        f"TLS certificate verification failed: {exc}") from exc
                if attempt == self.retries:
                    raise UpstreamError(self.endpoint.server_id, f"unreachable: {exc}") from exc
            else:
                if response.status_code < 400:
                    return response
                if response.status_code not in RETRY_STATUSES or attempt == self.retries:
                    raise self._problem(response)
                retry_after = response.headers.get("Retry-After")
                if retry_after and retry_after.isdigit():
                    delay = max(delay, float(retry_after))
            time.sleep(delay)
            delay = min(delay * 2, 10.0)
        raise AssertionError("unreachable")

    def _problem(self, response: httpx.Response) -> UpstreamError:
        try:
            body = response.json()
            problem = ProblemError.from_body(response.status_code, body)
            if problem.slug == "budget-exceeded" and isinstance(body, dict):
                # keep the numbers (budget, spent, needed) for the analyst's answer
                problem.extra = {k: v for k, v in body.items()
                                 if k not in ("type", "title", "status", "detail", "instance")}
        except ValueError:
            problem = ProblemError(
                "internal-error" if response.status_code >= 500 else "invalid-request",
                response.text[:200],
                status=response.status_code,
            )
        return UpstreamError(self.endpoint.server_id, f"{problem.slug}: {problem.detail}", problem)

    def provision(self, study: Study) -> StudyInfo:
        """PUT the study (a server takes the analyst token for this; its own policy decides)."""
        token = self.endpoint.operator_token or self.endpoint.analyst_token
        r = self._request("PUT", f"/v1/studies/{study.study_id}", token=token,
                          json=study.model_dump(mode="json"))
        return StudyInfo.model_validate(r.json())

    def server_info(self) -> ServerInfo:
        return ServerInfo.model_validate(self._request("GET", "/v1/info").json())

    def ledger(self, population: str) -> PopulationLedger:
        """The server's privacy ledger of a population (public; docs/ledger.md)."""
        return PopulationLedger.model_validate(
            self._request("GET", f"/v1/populations/{population}/ledger").json())

    def info(self, study_id: str) -> StudyInfo:
        """The study's info with the analyst token (so exact counts of add/remove studies too)."""
        return StudyInfo.model_validate(self._request("GET", f"/v1/studies/{study_id}",
                                                      token=self.endpoint.analyst_token).json())

    def report_ids(self, study_id: str) -> bytes:
        """The ids the server holds for the study: a sorted id list (16 bytes an id), checked."""
        return self.held_ids(study_id).tobytes()

    def held_ids(self, study_id: str) -> np.ndarray:
        """The ids the server holds for the study, checked, as an (n, 2) array of their
        big-endian halves over the response's bytes (messages.report_id_halves; no copy)."""
        r = self._request("GET", f"/v1/studies/{study_id}/report-ids", token=self.endpoint.analyst_token)
        try:
            return messages.report_id_halves(r.content)
        except ValueError as exc:
            raise UpstreamError(self.endpoint.server_id, f"a malformed report-id list: {exc}") from None

    def blocks(self, study_id: str) -> np.ndarray:
        """A study with parties: the block index of every block held (messages.decode_block_index), checked."""
        r = self._request("GET", f"/v1/studies/{study_id}/blocks", token=self.endpoint.analyst_token)
        try:
            return messages.decode_block_index(r.content)
        except ValueError as exc:
            raise UpstreamError(self.endpoint.server_id, f"a malformed block index: {exc}") from None

    def commit(self, study_id: str, sorted_ids: bytes, attempts: int = 3,
               held_mask: np.ndarray | None = None, digest: bytes | None = None) -> CommitResult:
        """Commit the study to the inclusion set (a sorted id list), sent in the compact form: a
        bit per id the server holds, over its own sorted list (a bit an id instead of 16 bytes:
        1.25 MB at 10^7 reports; dpsketch/protocol/inclusion.py). ``held_mask``: that bitmap
        over the list this server gave for the intersection (messages.intersect_held), with
        ``digest`` the set's SHA-256, so the list is not fetched a second time; without it, or
        if more reports reached the server in between (409 inclusion-stale), the list is
        fetched now. A set the server does not hold all of goes as the plain id list, which it
        refuses with its own answer (422 unknown-reports)."""
        for attempt in range(attempts):
            if held_mask is not None and attempt == 0:
                body, media_type = inclusion.encode(held_mask, digest or hashlib.sha256(sorted_ids).digest()), \
                    inclusion.MEDIA_TYPE
            else:
                try:
                    body = inclusion.encode_for(self.report_ids(study_id), sorted_ids)
                    media_type = inclusion.MEDIA_TYPE
                except ValueError:
                    body, media_type = sorted_ids, messages.REPORT_IDS_MEDIA_TYPE
            try:
                r = self._request("POST", f"/v1/studies/{study_id}/commit", token=self.endpoint.analyst_token,
                                  content=body, headers={"Content-Type": media_type})
            except UpstreamError as exc:
                if exc.problem is not None and exc.problem.slug == "inclusion-stale" and attempt + 1 < attempts:
                    continue
                raise
            return CommitResult.model_validate(r.json())
        raise AssertionError("unreachable")

    # a validity study's verification round (docs/protocol.md section 6d) ------------------------
    def verify_commit(self, study_id: str) -> verification.Commitment:
        r = self._request("POST", f"/v1/studies/{study_id}/verify/commit", token=self.endpoint.analyst_token)
        return verification.Commitment.model_validate(r.json())

    def verify_reveal(self, study_id: str, commitments: list[bytes]) -> verification.Contribution:
        r = self._request("POST", f"/v1/studies/{study_id}/verify/reveal", token=self.endpoint.analyst_token,
                          json={"commitments": [c.hex() for c in commitments]})
        return verification.Contribution.model_validate(r.json())

    def verify_query(self, study_id: str, contributions: list[bytes],
                     plan: validity.Plan | int) -> tuple[np.ndarray, np.ndarray]:
        """This server's verifier shares of every report it holds: (ids (m, 16) uint8 ascending,
        shares (m, V, 2)), checked."""
        ids, shares, _ = self.verify_query_batches(study_id, contributions, plan, batches=False)
        return ids, shares

    def verify_query_batches(self, study_id: str, contributions: list[bytes], plan: validity.Plan | int,
                             batches: bool = True) -> tuple[np.ndarray, np.ndarray, list[batch_verifiers.BatchVerifier]]:
        """:meth:`verify_query`, and for a study with ``batch_proofs`` (``batches``) every batch's
        entry of the message's batch section (section 6d), checked; none without."""
        r = self._request("POST", f"/v1/studies/{study_id}/verify/query", token=self.endpoint.analyst_token,
                          json={"contributions": [c.hex() for c in contributions]}, timeout=ROUND_TIMEOUT_S)
        try:
            if not batches:
                return (*validity.decode_verifiers(r.content, plan), [])
            v_len = plan if isinstance(plan, int) else plan.verifier_len
            reports, section = batch_verifiers.split(r.content, v_len)
            return (*validity.decode_verifiers(reports, plan), batch_verifiers.decode(section))
        except ValueError as exc:
            raise UpstreamError(self.endpoint.server_id, f"a malformed verifier message: {exc}") from None

    def verify_decide(self, study_id: str, body: "bytes | OthersBody") -> tuple[bytes, int]:
        """Send the sum of the other servers' verifier shares (whole, or made a chunk at a time
        as it is sent: :class:`OthersBody`); (the ids this server refused, as a sorted id list,
        and how many reports it decided)."""
        r = self._request("POST", f"/v1/studies/{study_id}/verify/decide", token=self.endpoint.analyst_token,
                          content=body, headers={"Content-Type": verification.VERIFIERS_MEDIA_TYPE,
                                                 "Content-Length": str(len(body))},
                          timeout=ROUND_TIMEOUT_S)
        try:
            messages.report_id_halves(r.content)
            decided = int(r.headers.get(verification.DECIDED_HEADER, "-1"))
        except ValueError as exc:
            raise UpstreamError(self.endpoint.server_id, f"a malformed decision: {exc}") from None
        return r.content, decided

    def aggregate(self, study: Study) -> tuple[np.ndarray, str]:
        r = self._request("GET", f"/v1/studies/{study.study_id}/aggregate",
                          token=self.endpoint.analyst_token)
        share = messages.decode_aggregate(r.content, study.k, study.width)
        return share, r.headers.get(messages.INCLUSION_HASH_HEADER, "")


class OthersBody:
    """A decision's body for one server (docs/protocol.md section 6d: the sum of the other
    servers' verifier shares), made a chunk of reports at a time while it is sent, as
    ``total - own`` (every server's sum less this server's own shares): the analyzer then holds
    one sum for every server instead of one per server, and no encoded copy of any. Iterable
    again for a retry (httpx reads it once per attempt); its length is the Content-Length."""

    CHUNK_REPORTS = 8192

    def __init__(self, report_ids: np.ndarray, total: np.ndarray, own: np.ndarray, batch_section: bytes = b""):
        self.report_ids, self.total, self.own = report_ids, total, own
        self.batch_section = batch_section  # a study with batch_proofs: the others' sums of its batches

    def __len__(self) -> int:
        m, v_len = self.total.shape[:2]
        return 4 + m * (REPORT_ID_BYTES + 16 * v_len) + len(self.batch_section)

    def __iter__(self) -> Iterator[bytes]:
        m = len(self.total)
        yield validity.verifiers_head(self.report_ids)
        for a in range(0, m, self.CHUNK_REPORTS):
            b = min(m, a + self.CHUNK_REPORTS)
            yield field.to_wire(field.sub(self.total[a:b], self.own[a:b]))
        if self.batch_section:
            yield self.batch_section


def _with_rows(ids: np.ndarray, rows: list[np.ndarray]) -> np.ndarray:
    """A server's held ids (an (n, 2) array of halves, sorted) with its batches' row ids, sorted
    (as report_id_halves gives a list)."""
    if not rows:
        return ids
    joined = np.concatenate([np.ascontiguousarray(ids, dtype=">u8").reshape(-1, 2)]
                            + [r.view(">u8").reshape(-1, 2) for r in rows])
    return messages.report_id_halves(messages.encode_report_ids(joined))


@dataclass(frozen=True)
class Completeness:
    """Where the individuals of a study with parties stand across the servers."""

    #: individuals with every party's block at every server, and the sorted ids of their blocks
    #: (concatenated: the inclusion set's report-id list)
    complete: int
    included: bytes
    #: per party: individuals seen (some block at some server) whose block of that party is not
    #: at every server
    missing_by_party: dict[str, int]
    #: per server: individuals with every block at that server
    complete_by_server: dict[str, int]
    individuals_seen: int

    def as_dict(self) -> dict:
        return {"complete": self.complete, "individuals_seen": self.individuals_seen,
                "missing_by_party": self.missing_by_party, "complete_by_server": self.complete_by_server}


def completeness(study: Study, held: list[np.ndarray], server_ids: list[str]) -> Completeness:
    """Which individuals count: those whose every party's block is held by every server (a block's
    id commits to its shares, its party and its pseudonym, so equal ids mean equal blocks; a
    record that some server lists with another pseudonym or party is not held everywhere).
    ``held``: each server's block index (messages.decode_block_index). On arrays: at 10^6
    individuals the Python sets of tuples this replaces took about 25 s and several GB."""
    names = [p.name for p in study.parties or ()]
    n_parties = len(names)
    first = min(held, key=len)
    everywhere = np.ones(len(first), dtype=bool)
    for other in held:
        if other is first:
            continue
        at = messages.locate(other["id_hi"], other["id_lo"], first["id_hi"], first["id_lo"])
        found = at >= 0
        same = other[np.where(found, at, 0)]
        everywhere &= (found & (same["pseudonym_hi"] == first["pseudonym_hi"])
                       & (same["pseudonym_lo"] == first["pseudonym_lo"]) & (same["party"] == first["party"]))
    common = first[everywhere]  # ascending by block id
    blocks_of = _blocks_per_pseudonym(common["pseudonym_hi"], common["pseudonym_lo"])
    complete = blocks_of == n_parties
    seen = _distinct(np.concatenate([h["pseudonym_hi"] for h in held]),
                     np.concatenate([h["pseudonym_lo"] for h in held]))
    missing = {}
    for j, name in enumerate(names):
        of_party = common[common["party"] == j]
        missing[name] = seen - _distinct(of_party["pseudonym_hi"], of_party["pseudonym_lo"])
    by_server = {sid: int(np.count_nonzero(_blocks_per_pseudonym(h["pseudonym_hi"], h["pseudonym_lo"],
                                                                 per_record=False) == n_parties))
                 for sid, h in zip(server_ids, held)}
    included = common[complete]
    ids = np.empty((len(included), 2), dtype=">u8")
    ids[:, 0], ids[:, 1] = included["id_hi"], included["id_lo"]
    individuals = int(np.count_nonzero(complete)) // max(n_parties, 1)
    return Completeness(individuals, ids.tobytes(), missing, by_server, seen)


def _by_id(hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """The order that sorts 128-bit keys given by their halves: by the high half, and by both
    only where two different keys share it (crafted: a lexsort is several times slower)."""
    order = np.argsort(hi)
    h, l = hi[order], lo[order]
    if len(order) > 1 and bool(np.any((h[1:] == h[:-1]) & (l[1:] != l[:-1]))):
        order = np.lexsort((lo, hi))
    return order


def _runs(hi: np.ndarray, lo: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(order, starts): the sorting order of the keys and where each run of equal keys begins in it."""
    hi, lo = hi.astype(np.uint64), lo.astype(np.uint64)  # native and contiguous: sorts 2-3x faster
    order = _by_id(hi, lo)
    h, l = hi[order], lo[order]
    new = np.ones(len(order), dtype=bool)
    new[1:] = (h[1:] != h[:-1]) | (l[1:] != l[:-1])
    return order, np.flatnonzero(new)


def _distinct(hi: np.ndarray, lo: np.ndarray) -> int:
    return len(_runs(hi, lo)[1])


def _blocks_per_pseudonym(hi: np.ndarray, lo: np.ndarray, per_record: bool = True) -> np.ndarray:
    """How many records share each record's pseudonym (per_record), or each distinct pseudonym's count."""
    order, starts = _runs(hi, lo)
    counts = np.diff(np.append(starts, len(order)))
    if not per_record:
        return counts
    out = np.empty(len(order), dtype=np.int64)
    out[order] = np.repeat(counts, counts)
    return out


@dataclass(frozen=True)
class ServerProgress:
    server_id: str
    url: str
    reachable: bool
    report_count: int | None
    status: str | None
    error: str | None = None
    #: a study with parties: blocks held per party at this server
    party_counts: dict[str, int] | None = None
    #: the populations whose ledger at this server charges the study (the operator's)
    populations: list[str] | None = None


class Coordinator:
    """The analyzer's Python API for the study lifecycle; the REST app is a thin layer over it."""

    #: the threads that ask every server at once (:meth:`_each`), kept: a finalization does so
    #: four times, and starting three threads each time cost 0.03-0.09 s of a 10^6-report
    #: finalize on a busy 2-core machine (a new thread waits to be scheduled before it works).
    #: Made on first use, under the (class-wide) lock.
    _pool: ThreadPoolExecutor | None = None
    _pool_lock = threading.Lock()

    def __init__(self, config: ClusterConfig, store: AnalyzerStore, log: Callable[[str], None] | None = None):
        self.config = config
        self.store = store
        context = config.ssl_context()  # one context, shared: loading the CA file once
        self.servers = [ShareServerClient(e, verify=True if context is None else context)
                        for e in config.servers]
        self.log = log or (lambda _msg: None)

    def close(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)
        for s in self.servers:
            s.close()

    # create ------------------------------------------------------------------------------
    def create_study(self, **design_args) -> tuple[Study, list[str]]:
        """Design a study for this cluster (k, s, lambda_star, sigma, f) and provision it everywhere."""
        auto = design_args.get("kind") == "auto"
        chosen: list[str] = []
        if auto and design_args.get("histogram") is not None:
            auto, design_args["kind"] = False, "histogram"
            chosen = ["Kind: auto chose histogram: the request gives bins."]
        elif auto and design_args.get("parties") is not None:
            auto, design_args["kind"] = False, "sketch"
            chosen = ["Kind: auto chose sketch: only a sketch study can have parties (docs/vertical.md)."]
        elif auto and design_args.get("batch_proofs"):
            auto, design_args["kind"] = False, "sketch"
            chosen = ["Kind: auto chose sketch: batch proofs exist for sketch and l1 studies (docs/protocol.md "
                      "section 4d)."]
        elif auto and ((design_args.get("k") or 1) > 1 or design_args.get("secret_sign")):
            auto, design_args["kind"] = False, "sketch"
            chosen = ["Kind: auto chose sketch: the request sets the sketch's shape (k > 1) or its secret sign."]
        if auto:
            from .recommend import recommend

            rec = recommend(
                len(design_args["columns"]), design_args["expected_reports"],
                n_servers=len(self.config.server_ids), predict=False,
                **{k: design_args[k] for k in ("epsilon", "delta", "row_bound", "neighbouring", "t")
                   if k in design_args},
            )
            design_args["kind"] = rec.kind
            chosen = [f"Kind: auto chose {rec.kind} (the most accurate kind that fits): " + " ".join(rec.reasons)]
            if design_args.get("validity") and rec.kind not in ("sketch", "gram", "moments", "l1"):
                design_args["kind"] = "sketch"
                chosen = [f"Kind: auto chose sketch: {rec.kind} studies take no validity proofs yet."]
        study, explanation = design(servers=self.config.server_ids, **design_args)  # ValueError: 422
        explanation = chosen + explanation
        if auto and study.kind == "gram":
            # the servers' storage policies decide too, not only the upload budget
            limit, who = self.storage_limit()
            if limit is not None and study.max_storage_bytes > limit:
                gram_bytes = study.max_storage_bytes
                design_args["kind"] = "sketch"
                study, explanation = design(servers=self.config.server_ids, **design_args)
                explanation.insert(0,
                    f"Kind: auto chose sketch: a gram study would claim {gram_bytes} bytes at each "
                    f"server (max_reports = {study.max_reports}), more than {who}'s max_study_bytes "
                    f"= {limit}; this sketch study claims {study.max_storage_bytes}.")
        if study.population is not None:
            self._check_budgets(study)
        self.store.add_study(study, explanation)
        try:
            for server in self.servers:
                server.provision(study)
        except UpstreamError as exc:
            if exc.problem is not None and exc.problem.slug in ("invalid-study", "budget-exceeded"):
                # a server's own policy refuses it: the study cannot run on this cluster, so the
                # analyzer forgets it (servers that accepted it keep an empty study, and charge it)
                self.store.forget_unprovisioned(study.study_id)
                if exc.problem.slug == "budget-exceeded":
                    raise ProblemError("budget-exceeded", str(exc),
                                       extra={"server_id": exc.server_id, **(exc.problem.extra or {})}) from exc
            raise
        return study, explanation

    def _check_budgets(self, study: Study) -> None:
        """Refuse (409 budget-exceeded) before any server is asked when a server's published
        ledger and budget say the population the study names has no room for it. Advisory: the
        servers charge a study to the population of the upload tokens their operators issue for
        it (docs/ledger.md), not to the one the study names, and decide for themselves; this
        only spares provisioning a study its intended population cannot pay for."""
        charge = ledger.Charge.of(study)
        for server in self.servers:
            try:
                book = server.ledger(study.population)
            except UpstreamError:
                continue
            if book.budget_epsilon is None and book.budget_floor_epsilon is None:
                continue
            budget = ledger.Budget(book.budget_epsilon if book.budget_epsilon is not None else 1e300,
                                   book.budget_delta, book.neighbouring, floor_epsilon=book.budget_floor_epsilon)
            verdict = ledger.check([e.charge for e in book.studies], charge, budget)
            if not verdict.fits:
                sid = server.endpoint.server_id
                raise ProblemError(
                    "budget-exceeded",
                    f"server {sid} would refuse this study (nothing was provisioned): "
                    + verdict.explain(budget, f"population {study.population!r}"),
                    extra={"server_id": sid, **verdict.problem_members(budget, study.population)})

    def ledgers(self, population: str) -> list[dict]:
        """Every server's ledger of ``population`` (or why it could not be read)."""
        out = []
        for server in self.servers:
            entry: dict = {"server_id": server.endpoint.server_id, "url": server.endpoint.url}
            try:
                entry["ledger"] = server.ledger(population).model_dump(mode="json")
            except UpstreamError as exc:
                entry["error"] = str(exc)
            out.append(entry)
        return out

    def storage_limit(self) -> tuple[int | None, str | None]:
        """The smallest max_study_bytes the servers publish in /v1/info, and whose it is
        (None: no server limits storage)."""
        limit: int | None = None
        who: str | None = None
        for server in self.servers:
            value = (server.server_info().policy or {}).get("max_study_bytes")
            if value is not None and (limit is None or value < limit):
                limit, who = int(value), server.endpoint.server_id
        return limit, who

    def record(self, study_id: str) -> StudyRecord:
        rec = self.store.get(study_id)
        if rec is None:
            raise ProblemError("unknown-study", f"this analyzer has no study {study_id}")
        return rec

    # watch -------------------------------------------------------------------------------
    def progress(self, study_id: str) -> list[ServerProgress]:
        self.record(study_id)
        out = []
        for server in self.servers:
            try:
                info = server.info(study_id)
                out.append(ServerProgress(server.endpoint.server_id, server.endpoint.url, True,
                                          info.report_count, info.status, party_counts=info.party_counts,
                                          populations=info.populations))
            except UpstreamError as exc:
                out.append(ServerProgress(server.endpoint.server_id, server.endpoint.url, False,
                                          None, None, str(exc)))
        return out

    def completeness(self, study_id: str) -> Completeness:
        """A study with parties: which individuals are complete at every server, and what is
        missing per party (from every server's block index)."""
        study = self.record(study_id).study
        if study.parties is None:
            raise ProblemError("invalid-request", f"study {study_id} has no parties")
        held = [server.blocks(study_id) for server in self.servers]
        return completeness(study, held, [s.endpoint.server_id for s in self.servers])

    # finalize ----------------------------------------------------------------------------
    def _check_batch_rule(self, held: list[int], common: int) -> None:
        """Refuse before any server commits when the intersection leaves out more of some server's
        reports than that server's published max_excluded_fraction allows: it would refuse its
        commit after the others had committed, and the study could never be released. The usual
        cause is a server that was down for part of the upload; the SDK's resend fixes it."""
        infos = self._each_or_raise(lambda server: server.server_info())
        for server, info, count in zip(self.servers, infos, held):
            policy = info.policy or {}
            fraction = policy.get("max_excluded_fraction")
            if fraction is None:
                continue
            excluded = count - common
            if excluded > int(float(fraction) * count):
                raise ProblemError(
                    "inclusion-refused",
                    f"server {server.endpoint.server_id} holds {excluded} of its {count} reports "
                    f"that some other server lacks; its policy lets a release leave out at most "
                    f"{float(fraction):g} of them. Nothing was committed. Have the data owners resend "
                    f"what is missing (Client.resend / dpsketch submit again), then finalize again",
                    extra={"server_id": server.endpoint.server_id, "excluded": excluded,
                           "held": count})

    @staticmethod
    def _check_enough(study: Study, n_common: int) -> None:
        """Refuse (nothing committed) an inclusion set below min_reports."""
        if n_common < study.min_reports:
            raise ProblemError(
                "certificate-refused",
                f"only {n_common} reports are held by every server"
                f"{' and accepted by each' if study.validity is not None else ''}; the study needs "
                f"min_reports = {study.min_reports}. Wait for more uploads.",
                extra={"n_reports": n_common, "min_reports": study.min_reports},
            )

    def _each(self, call: Callable[[ShareServerClient], object]) -> list[object]:
        """``call(server)`` for every server at once, one thread each (issue 46: asked one after
        another, the servers' answers at 10^6 reports took about 3.4 s of a 5.5 s finalize);
        each server's result, or the exception it raised, in the servers' order."""
        def guarded(server: ShareServerClient) -> object:
            try:
                return call(server)
            except Exception as exc:  # returned, so the caller sees every server's outcome
                return exc

        if len(self.servers) == 1:
            return [guarded(self.servers[0])]
        with self._pool_lock:
            if self._pool is None:
                # idle threads are reused, so one finalization keeps one thread per server; the
                # headroom lets studies finalized at once by the analyzer service (a verification
                # round may wait minutes on a server) run side by side instead of queueing
                self._pool = ThreadPoolExecutor(POOL_CALLS_PER_SERVER * len(self.servers),
                                                thread_name_prefix="dpsketch-finalize")
            pool = self._pool
        return list(pool.map(guarded, self.servers))

    def _each_or_raise(self, call: Callable[[ShareServerClient], object]) -> list:
        """:meth:`_each`, raising the first server's exception (in the servers' order) if any."""
        results = self._each(call)
        for result in results:
            if isinstance(result, Exception):
                raise result
        return results

    def finalize(self, study_id: str) -> StudyRecord:
        """Choose (or resume) the inclusion set, commit it everywhere, reconstruct the sketch.
        Every server is asked at once at each step (its ids, its commit, its aggregate share);
        the ids travel and are intersected as arrays (messages.intersect_held), and each
        server's commit bitmap comes from that same pass, not from a second fetch of its ids."""
        rec = self.record(study_id)
        if rec.state == "released":
            return rec
        study = rec.study
        included = self.store.inclusion(study_id)
        masks: list[np.ndarray] | None = None
        if included is None and study.parties is not None:
            included = self._party_inclusion(study_id)
        if included is None:
            # every server's list at once: 16 bytes an id each (480 MB for 3 servers at 10^7)
            lists = self._each_or_raise(lambda server: server.held_ids(study_id))
            held = [len(ids) for ids in lists]
            common, masks = messages.intersect_held(lists)
            del lists
            if study.validity is not None:
                # every server checks every proof (section 6d); it closes the study to uploads,
                # so not before the reports held everywhere could make a release
                self._check_enough(study, len(common) // REPORT_ID_BYTES)
                self._check_batch_rule(held, len(common) // REPORT_ID_BYTES)
                common, masks, held = self.verify(study_id)
            n_common = len(common) // REPORT_ID_BYTES
            dropped = sum(held) - len(held) * n_common
            self.log(f"{n_common} reports held by all {len(held)} servers "
                     f"({dropped} server copies of partial or refused reports excluded)")
            self._check_enough(study, n_common)
            self._check_batch_rule(held, n_common)
            digest = hashlib.sha256(common).digest()
            included = self.store.fix_inclusion(study_id, common, digest.hex())
            self.log("inclusion set recorded; committing it at every server")
            if included != common:  # an earlier finalize fixed another set: its bitmaps are not these
                masks = None
        if masks is None:
            digest = hashlib.sha256(included).digest()
        expected_hash = digest.hex()
        n_reports = len(included) // REPORT_ID_BYTES
        outcomes = self._each(lambda server: server.commit(
            study_id, included, held_mask=None if masks is None else masks[self.servers.index(server)],
            digest=digest))
        failures = [o for o in outcomes if isinstance(o, Exception)]
        refusals = [o for o in failures if isinstance(o, UpstreamError) and o.problem is not None
                    and o.problem.slug in ("certificate-refused", "inclusion-refused")]
        if failures and len(refusals) == len(self.servers):
            # Every server refused the set (every honest server computes the same certificate
            # over the same set), so none committed: forget it, so a later finalize can pick a
            # larger one. If any server committed, or may have (no answer), the set stays.
            self.store.clear_inclusion(study_id)
            raise refusals[0].problem from refusals[0]
        if failures:
            raise failures[0]
        for server, result in zip(self.servers, outcomes):
            if result.inclusion_hash != expected_hash:
                raise UpstreamError(server.endpoint.server_id, "committed a different inclusion set")
            n_reports = result.n_reports  # individuals, for a study with parties
            self.log(f"{server.endpoint.server_id}: committed {result.n_reports} reports, "
                     f"lambda_min = {result.lambda_min:.1f} >= lambda_star + t = "
                     f"{result.lambda_star + result.t:.1f}")
        shares = []
        for server, (share, header_hash) in zip(self.servers, self._each_or_raise(lambda s: s.aggregate(study))):
            if header_hash != expected_hash:
                raise UpstreamError(server.endpoint.server_id, "aggregate is over a different set")
            shares.append(share)
        # the ring sum (a study with validity proofs: the F_p sum, centred into the ring)
        self.store.release(study_id, proved_shares.reconstruct(study, shares), n_reports)
        return self.record(study_id)

    def verify(self, study_id: str) -> tuple[bytes, list[np.ndarray], list[int]]:
        """Run a validity study's verification round at every server (docs/protocol.md section
        6d), each step at every server at once: commit, reveal, query, decide. Every step is
        idempotent at the servers, so after any failure (of a server or of this analyzer) the
        round is simply run again and gives the same query seed and the same decisions.
        Returns the reports every server holds and accepted (a sorted id list), each server's
        mask of them over its sorted held ids (its commit bitmap), and how many each holds;
        records how many reports each server refused."""
        study = self.record(study_id).study
        plan = validity.verifier_len(study)  # a study with parties: its widest party's
        ids = [s.endpoint.server_id for s in self.servers]
        if ids != list(study.servers):
            raise ProblemError("invalid-request", f"the cluster's servers {ids} are not the study's "
                               f"{list(study.servers)}, in its order")
        commits = self._each_or_raise(lambda server: server.verify_commit(study_id))
        for j, (server, answer) in enumerate(zip(self.servers, commits)):
            if answer.position != j or answer.study_id != study_id:
                raise UpstreamError(server.endpoint.server_id, f"committed at position {answer.position} "
                                    f"of study {answer.study_id}, not {j} of {study_id}")
        commitments = [bytes.fromhex(c.commitment) for c in commits]
        self.log("every server closed the study to uploads and committed to its contribution")
        reveals = self._each_or_raise(lambda server: server.verify_reveal(study_id, commitments))
        contributions = [bytes.fromhex(r.contribution) for r in reveals]
        try:
            validity.check_reveal(study_id, commitments, contributions)
        except validity.ValidityError as exc:
            raise UpstreamError("(a server)", f"a revealed contribution does not open its commitment: {exc}") from None
        seed = validity.query_seed(study_id, contributions)
        answers = self._each_or_raise(lambda server: server.verify_query_batches(study_id, contributions, plan,
                                                                                study.batch_proofs))
        lists = [np.ascontiguousarray(a[0]).view(">u8").reshape(-1, 2) for a in answers]
        common, masks = messages.intersect_held(lists)
        # each server's shares of the reports held everywhere: a view of its answer where it
        # holds nothing else (the usual case), a copy only of what it holds beyond
        own = [shares if mask.all() else shares[mask] for (_ids, shares, _b), mask in zip(answers, masks)]
        n_common = len(common) // REPORT_ID_BYTES
        common_ids = np.frombuffer(common, dtype=np.uint8).reshape(n_common, REPORT_ID_BYTES)
        total = own[0]
        for shares in own[1:]:
            total = validity.add_verifiers(total, shares)
        sections, n_rows = [b""] * len(self.servers), 0
        if study.batch_proofs:
            # batches are decided whole (section 6d): the batches held everywhere, each server's
            # decision body carrying the others' sums of theirs; the commit bitmaps and the
            # inclusion set then range over every held id, the batches' rows among them
            sections, n_rows, batch_rows = self._batch_sums([a[2] for a in answers])
            lists = [_with_rows(ids, rows) for ids, rows in zip(lists, batch_rows)]
            common, masks = messages.intersect_held(lists)
        del answers
        held = [len(x) for x in lists]
        self.log(f"query seed {seed.hex()[:16]}...: {n_common} reports"
                 + (f" and batches of {n_rows} rows" if study.batch_proofs else "")
                 + f" held by all {len(held)} servers")
        decisions = self._each_or_raise(lambda server: server.verify_decide(
            study_id, OthersBody(common_ids, total, own[self.servers.index(server)],
                                 sections[self.servers.index(server)])))
        n_decided = n_common + n_rows
        for server, (_refused, decided) in zip(self.servers, decisions):
            if decided != n_decided:
                raise UpstreamError(server.endpoint.server_id, f"decided {decided} reports, not the {n_decided} sent")
        common_ids = np.frombuffer(common, dtype=np.uint8).reshape(-1, REPORT_ID_BYTES)
        n_common = len(common_ids)
        by_server = {sid: len(refused) // REPORT_ID_BYTES for sid, (refused, _) in zip(ids, decisions)}
        refused = messages.encode_report_ids(b"".join(r for r, _ in decisions))  # the union, sorted
        n_refused = len(refused) // REPORT_ID_BYTES
        if n_refused:
            r_hi, r_lo = messages.native_halves(messages.report_id_halves(refused))
            for ids_j, mask in zip(lists, masks):
                hi, lo = messages.native_halves(ids_j)
                at = messages.locate(hi, lo, r_hi, r_lo)
                mask[at[at >= 0]] = False
            c_hi, c_lo = messages.native_halves(messages.report_id_halves(common))
            keep = messages.locate(r_hi, r_lo, c_hi, c_lo) < 0
            common = common_ids[keep].tobytes()
        summary = verification.VerificationSummary(query_seed=seed.hex(), decided=n_common, refused=n_refused,
                                                   refused_by_server=by_server)
        self.store.record_verification(study_id, summary.model_dump(mode="json"))
        self.log(f"every server decided {n_common} {'blocks' if study.parties else 'reports'}; refused: "
                 f"{n_refused} ({', '.join(f'{k} {v}' for k, v in by_server.items())})")
        return common, masks, held

    def _batch_sums(self, held: list[list[batch_verifiers.BatchVerifier]]
                    ) -> tuple[list[bytes], int, list[list[np.ndarray]]]:
        """For each server: the batch section of its decision (the others' sums of the batches
        every server holds); how many rows those batches have; and each server's batches' row ids
        (every batch it holds, as its held set counts them). A batch is known by its id, which
        fixes its header, so honest servers agree on its m and V: a server that does not is
        faulty (502)."""
        by_id = [{e.batch_id: e for e in entries} for entries in held]
        common = sorted(set.intersection(*(set(d) for d in by_id))) if by_id else []
        totals = []
        for bid in common:
            entries = [d[bid] for d in by_id]
            for server, e in zip(self.servers, entries):
                if (e.m, e.verifier_len) != (entries[0].m, entries[0].verifier_len):
                    raise UpstreamError(server.endpoint.server_id, f"batch {bid.hex()}: {e.m} rows and "
                                        f"V = {e.verifier_len}, another server {entries[0].m} and "
                                        f"{entries[0].verifier_len}")
            total = entries[0].share
            for e in entries[1:]:
                total = field.add(total, e.share)
            totals.append(total)
        sections = [batch_verifiers.encode([batch_verifiers.BatchVerifier(bid, d[bid].m, field.sub(t, d[bid].share))
                                            for bid, t in zip(common, totals)]) for d in by_id]
        rows = [[batch_validity.row_ids(e.batch_id, e.m) for e in entries] for entries in held]
        return sections, sum(by_id[0][bid].m for bid in common), rows

    def _party_inclusion(self, study_id: str) -> bytes:
        """Fix the inclusion set of a study with parties: the blocks of every individual complete
        at every server; refused (nothing committed) below min_reports or when a server's batch
        rule would refuse it."""
        study = self.record(study_id).study
        held = [server.blocks(study_id) for server in self.servers]
        server_ids = [s.endpoint.server_id for s in self.servers]
        state = completeness(study, held, server_ids)
        self._check_party_state(study, state)
        if study.validity is not None:
            # every server checks every block's proof (section 6d), once the blocks that could
            # make a release are there; an individual with a block refused anywhere is left out
            # whole: its blocks are dropped from every server's index and completeness is counted
            # again, so the batch rule counts it as one excluded individual
            accepted, _masks, _held = self.verify(study_id)
            a_hi, a_lo = messages.native_halves(messages.report_id_halves(accepted))
            kept = [h[messages.locate(a_hi, a_lo, h["id_hi"].astype(np.uint64), h["id_lo"].astype(np.uint64)) >= 0]
                    for h in held]
            before = state.complete
            # each server's batch rule counts against the individuals complete there, refused or not
            state = dataclasses.replace(completeness(study, kept, server_ids),
                                        complete_by_server=state.complete_by_server)
            self.log(f"{before - state.complete} individuals left out for a block some server refused")
            self._check_party_state(study, state)
        return self.store.fix_inclusion(study_id, state.included)

    def _check_party_state(self, study: Study, state: Completeness) -> None:
        """Refuse (nothing committed) too few complete individuals, or a set some server's batch
        rule would refuse."""
        self.log(f"{state.complete} of {state.individuals_seen} individuals have every party's block at "
                 f"every server; missing per party: "
                 + ", ".join(f"{name} {n}" for name, n in state.missing_by_party.items()))
        if state.complete < study.min_reports:
            raise ProblemError(
                "certificate-refused",
                f"only {state.complete} individuals have every party's block at every server; the study "
                f"needs min_reports = {study.min_reports} (missing per party: {state.missing_by_party}). "
                f"Wait for more uploads.", extra={"n_reports": state.complete, "min_reports": study.min_reports,
                                                  "missing_by_party": state.missing_by_party})
        verdict = " (or that has a block some server refused)" if study.validity is not None else ""
        for server in self.servers:
            fraction = (server.server_info().policy or {}).get("max_excluded_fraction")
            here = state.complete_by_server[server.endpoint.server_id]
            if fraction is not None and here - state.complete > int(float(fraction) * here):
                raise ProblemError(
                    "inclusion-refused",
                    f"server {server.endpoint.server_id} holds {here - state.complete} complete "
                    f"individuals that some other server lacks a block of{verdict}; its policy lets a release "
                    f"leave out at most {float(fraction):g} of its {here}. Nothing was committed. Have "
                    f"the parties resend what is missing, then finalize again",
                    extra={"server_id": server.endpoint.server_id, "excluded": here - state.complete,
                           "held": here, "missing_by_party": state.missing_by_party})
