"""``dpsketch enrol`` and ``dpsketch submit --relay``: relayed uploads from the command line
(docs/relay.md, docs/protocol.md section 7b).

``dpsketch enrol`` reads the study and every server's HPKE key from the servers themselves
(:func:`client_sdk.relayed.enrol`), checks that each server's policy takes relayed uploads, and
writes the enrolment file; ``dpsketch submit --relay URL
--enrolment FILE data.csv`` then sends the CSV's rows through the relay with
:class:`client_sdk.relayed.RelayClient`, several rows per request.

Exactly once without a keyed journal: a relayed entry is sealed and MACed on the device, and the
same bytes sent again are a duplicate at every server (idempotent by report id). So before a
request leaves the machine its entries are appended to a journal file (fsynced; mode 0600 in a
0700 directory, beside ``dpsketch submit``'s journals), and once the relay answered that every
server stored them, the rows are marked done. A run started again after Ctrl-C, a crash or an
unreachable relay first resends the request that was in flight, byte for byte, then goes on
from the first row not yet sent. The entries hold no secret (each batch is sealed to its
server, the MAC is not the token), unlike the direct route's journal key.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from dpsketch.protocol import relayed
from dpsketch.protocol.problems import ProblemError

from .cli import (EXIT_ERROR, EXIT_INCOMPLETE, EXIT_INTERRUPTED, EXIT_OK, EXIT_TERMINATED, EXIT_USAGE,
                  Terminated, add_tls_arguments, describe_error, on_sigterm, print_data_limits,
                  privacy_limit_option, scan_rows, tls_verify)
from .errors import NotRelayable

#: rows per relay request unless --batch-size says otherwise
DEFAULT_ROWS = 64
#: a request is cut before its entries pass this (the relay's --max-device-bytes is 4 MiB by default)
MAX_REQUEST_BYTES = 1 << 20
JOURNAL_FORMAT = "dpsketch-relayed-submission/1"

DESCRIPTION = """\
Enrol in a dpsketch study for relayed uploads (docs/relay.md): read the study and each share
server's HPKE public key from the servers themselves, check them as dpsketch submit does (the
same study at every server, its id recomputed, the URLs in the study's server order, the
study's floor against --max-floor-epsilon), and write them to an enrolment file for dpsketch
submit --relay. The file holds no token and no secret; it must come from the servers, never from
a relay (a relay that chose the keys could open the shares). It stays valid until the study is
committed.

A study with parties or with batch proofs cannot be relayed (the servers refuse such bundles
with 415), nor a study at a server whose published policy takes no relayed uploads (dpsketch
server --relayed-uploads off: it refuses every bundle with 403): either is refused here, nothing
written.
"""

EPILOG = """\
exit codes: 0 the enrolment was written; 1 error (a server unreachable, a study not held by
every server, a study that cannot be relayed, a server that takes no relayed uploads; nothing
written); 2 usage error.

example:
  dpsketch enrol --study 3f9c...e1 \\
      --servers https://dp.a.example,https://dp.b.example,https://dp.c.example --out study.json
  dpsketch submit --relay https://relay.example --enrolment study.json --token T1,T2,T3 data.csv
"""


def _enrol_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dpsketch enrol", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--study", metavar="ID", required=True, help="the study id (64 hex characters)")
    p.add_argument("--servers", metavar="URL,URL,...", required=True,
                   help="the share servers' base URLs, comma-separated, in the study's server order")
    p.add_argument("--out", metavar="FILE", required=True, help="where to write the enrolment (JSON)")
    p.add_argument("--sealing", choices=("classical", "post-quantum", "prefer-post-quantum"),
                   default="classical",
                   help="the HPKE suite to enrol each server's key of (default: %(default)s; "
                        "docs/sealing.md)")
    p.add_argument("--max-floor-epsilon", type=float, metavar="EPS",
                   default=float(os.environ["DPSKETCH_MAX_FLOOR_EPSILON"]) if os.environ.get(
                       "DPSKETCH_MAX_FLOOR_EPSILON") else None,
                   help="refuse a study whose floor is weaker than EPS (as dpsketch submit; "
                        "default: $DPSKETCH_MAX_FLOOR_EPSILON)")
    p.add_argument("--timeout", type=float, default=30.0, metavar="S",
                   help="seconds to wait for each HTTP request (default: %(default)s)")
    p.add_argument("--max-retries", type=int, default=5, metavar="N",
                   help="retries per request on network errors, 5xx, 429 (default: %(default)s)")
    add_tls_arguments(p)
    p.add_argument("--quiet", "-q", action="store_true", help="no summary")
    return p


def _worded(refusal: NotRelayable) -> str:
    """Why a study cannot be relayed (client_sdk.relayed.check_relayable, the one check), worded
    for a person at the command line: the command to upload with instead."""
    study = f"study {refusal.study_id[:12]}..."
    if refusal.server_id is not None:
        return (f"server {refusal.server_id} ({refusal.url}) takes no relayed uploads (its /v1/info policy: "
                f"relayed_uploads false, dpsketch server --relayed-uploads off): upload to the servers "
                f"directly (dpsketch submit --servers ...); nothing written")
    if refusal.reason == "parties":
        return (f"{study} has parties: each party uploads its blocks directly "
                f"(dpsketch submit --servers ... --party), a relay cannot carry them (docs/relay.md)")
    return (f"{study} has {refusal.reason}: its rows are uploaded directly "
            f"(dpsketch submit --servers ...), a relay cannot carry them (docs/relay.md)")


def _not_relayable(study: Any) -> str | None:
    """Why the study cannot be relayed, for a person at the command line (None: it can)."""
    from .relayed import check_relayable

    try:
        check_relayable(study)
    except NotRelayable as refusal:
        return _worded(refusal)
    return None


def main(argv: list[str] | None = None) -> int:
    """``dpsketch enrol``."""
    args = _enrol_parser().parse_args(argv)

    def fail(message: str, code: int = EXIT_ERROR) -> int:
        print(f"dpsketch enrol: error: {' '.join(message.split())}", file=sys.stderr)
        return code

    from .client import Client
    from .errors import SDKError
    from .relayed import enrol

    urls = [u for u in (x.strip() for x in args.servers.split(",")) if u]
    verify, problem = tls_verify(args.insecure, args.ca_file)
    if problem:
        return fail(*problem)
    try:
        with Client(urls, timeout=args.timeout, max_retries=args.max_retries, verify=verify,
                    encrypt=True, sealing=args.sealing, max_floor_epsilon=args.max_floor_epsilon) as client:
            enrolment = enrol(client, args.study)  # NotRelayable: refused, nothing written
    except NotRelayable as refusal:
        return fail(_worded(refusal))
    except (SDKError, ProblemError, ValueError, OSError, httpx.HTTPError) as exc:
        return fail(describe_error(exc))
    try:
        enrolment.save(args.out)
    except OSError as exc:
        return fail(f"cannot write {args.out}: {exc.strerror or exc}")
    if not args.quiet:
        study = enrolment.study
        suites = sorted({r.suite.name for r in enrolment.recipients})
        print(f"enrolled in study {args.study[:12]}... ({study.kind}, {len(study.columns)} columns, "
              f"servers {', '.join(study.servers)}, sealing {'/'.join(suites)}): wrote {args.out}; "
              f"submit with: dpsketch submit --relay URL --enrolment {args.out} data.csv")
    return EXIT_OK


# --- the relayed submission's journal ----------------------------------------------------------


@dataclass
class RelayJournal:
    """One CSV file's relayed submission to one study: how many of its rows (from the top)
    every server stored, and the request in flight, as its entries (journal file, JSON lines)."""

    file: Path
    header: dict
    done: int = 0
    #: (first row, rows, entries) of the request sent last and not answered
    pending: tuple[int, int, list[relayed.Entry]] | None = None

    @classmethod
    def open(cls, directory: Path, study_id: str, csv_path: str, *, new: bool) -> "RelayJournal":
        from .errors import InputChanged, SDKError
        from .journal import Journal, fingerprint_file, write_atomic

        fingerprint = fingerprint_file(csv_path)
        source = os.path.abspath(csv_path)
        path = Journal(directory).path(study_id, "relayed:" + fingerprint)
        if not new and path.exists():
            found = cls._read(path)
            if found is None:
                raise SDKError(f"the relayed submission journal {path} is unreadable: it may hold a "
                               f"request in flight, so nothing is sent (delete it, or pass "
                               f"--new-submission, to submit anew)")
            return found
        stale = [j for j in cls._all(directory) if j.header["study_id"] == study_id and
                 j.header["source"] == source and j.header["fingerprint"] != fingerprint and
                 not j.header.get("complete")]
        if stale and not new:
            raise InputChanged(f"{source} changed since an unfinished relayed submission of it to "
                               f"study {study_id[:12]}... started ({stale[0].done} of its rows are "
                               f"stored at every server; journal {stale[0].file}): rerun with the file as "
                               f"it was to complete it, or pass --new-submission to submit this file "
                               f"as new rows")
        for old in stale:
            old.file.unlink(missing_ok=True)
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        header = {"format": JOURNAL_FORMAT, "study_id": study_id, "fingerprint": fingerprint,
                  "source": source, "complete": False, "created_at": time.time()}
        write_atomic(path, header)
        return cls(path, header)

    @classmethod
    def _all(cls, directory: Path) -> list["RelayJournal"]:
        found = (cls._read(p) for p in sorted(directory.glob("*.json"))) if directory.is_dir() else ()
        return [j for j in found if j is not None]

    @classmethod
    def _read(cls, path: Path) -> "RelayJournal | None":
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
            header = json.loads(lines[0])
        except (OSError, ValueError, IndexError):
            return None
        if not isinstance(header, dict) or header.get("format") != JOURNAL_FORMAT:
            return None
        done, pending = 0, None
        for line in lines[1:]:
            try:
                record = json.loads(line)
                if "done" in record:
                    done = max(done, int(record["done"]))
                else:
                    pending = (int(record["first"]), int(record["rows"]),
                               relayed.decode(base64.b64decode(record["bundle"])))
            except (ValueError, KeyError, TypeError):
                continue  # a record cut short by a crash (a pending one was fsynced before sending)
        if pending is not None and pending[0] + pending[1] <= done:
            pending = None
        return cls(path, header, done, pending)

    def _append(self, record: dict, durable: bool) -> None:
        with open(self.file, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
            fh.flush()
            if durable:
                os.fsync(fh.fileno())

    def before_send(self, first: int, rows: int, entries: Sequence[relayed.Entry]) -> None:
        """Durably, before the request leaves: lost, a rerun would build these rows anew and a
        server that stored them would count them twice."""
        self._append({"first": first, "rows": rows,
                      "bundle": base64.b64encode(relayed.encode(entries)).decode()}, durable=True)
        self.pending = (first, rows, list(entries))

    def after_send(self, upto: int) -> None:
        """Every server stored the rows before ``upto`` (flushed only: lost, the request is resent,
        duplicates)."""
        self._append({"done": upto}, durable=False)
        self.done, self.pending = upto, None

    def finish(self, n_rows: int) -> None:
        """Every row is stored: keep only that (a rerun sends nothing)."""
        from .journal import write_atomic

        self.header = {**self.header, "complete": True, "n_rows": n_rows, "completed_at": time.time()}
        write_atomic(self.file, self.header)
        self.pending = None


# --- dpsketch submit --relay --------------------------------------------------------------------


def submit_relayed(args: argparse.Namespace, fail: Callable[..., int]) -> int:
    """``dpsketch submit --relay URL --enrolment FILE data.csv`` (args as dpsketch submit parses them)."""
    from dpsketch.protocol import report

    from . import data
    from .client import SubmitResult
    from .errors import SDKError, ServerUnreachable
    from .journal import default_dir
    from .relayed import RETRYABLE, Enrolment, RelayClient

    if not (args.relay and args.enrolment):
        return fail("--relay URL and --enrolment FILE go together (dpsketch enrol writes the file)", EXIT_USAGE)
    if not args.csv:
        return fail("data.csv is required", EXIT_USAGE)
    for flag, given in (("--servers", args.servers), ("--party", args.party), ("--id-column", args.id_column),
                        ("--sealing", args.sealing)):
        if given:
            return fail(f"{flag} does not go with --relay (the enrolment names the study's servers and "
                        f"keys; a study with parties is uploaded directly)", EXIT_USAGE)
    if args.batch_size is not None and args.batch_size < 1:
        return fail("--batch-size must be at least 1", EXIT_USAGE)
    verify, problem = tls_verify(args.insecure, args.ca_file)
    if problem:
        return fail(*problem)
    try:
        enrolment = Enrolment.load(args.enrolment)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return fail(f"cannot read the enrolment {args.enrolment}: {getattr(exc, 'strerror', None) or exc}")
    study = enrolment.study
    if args.study and args.study != study.study_id:
        return fail(f"--study {args.study[:12]}... is not the enrolment's study {study.study_id[:12]}...", EXIT_USAGE)
    n_servers = len(enrolment.recipients)
    tokens: list[str] | None = None
    if args.token:
        tokens = [t.strip() for t in args.token.split(",")]
        if len(tokens) == 1:
            tokens = tokens * n_servers
        if len(tokens) != n_servers or not all(tokens):
            return fail(f"--token lists {len(tokens)} tokens for the study's {n_servers} servers; give one, "
                        f"or one per server in the study's order ({', '.join(study.servers)})", EXIT_USAGE)
    refused = _not_relayable(study)
    if refused:
        return fail(refused)
    if args.max_floor_epsilon is not None:
        floor = float(study.guarantees()["floor_epsilon"])  # type: ignore[arg-type]  # a number for every study (as Client.study reads it)
        if not floor <= args.max_floor_epsilon:
            return fail(f"study {study.study_id[:12]}...: with no other honest report a report keeps only "
                        f"epsilon = {floor:.4g}, above --max-floor-epsilon {args.max_floor_epsilon:g}; "
                        f"nothing sent")
    try:
        privacy_limit = privacy_limit_option(args.privacy_limit)
    except ValueError as exc:
        return fail(f"--privacy-limit {args.privacy_limit!r}: expected EPSILON,DELTA ({exc})", EXIT_USAGE)
    if not os.path.isfile(args.csv):
        return fail(f"{args.csv}: no such file")
    name = os.path.basename(args.csv)
    started = time.monotonic()
    journal: RelayJournal | None = None
    total = sent_before = 0
    try:
        if privacy_limit is not None:
            privacy_limit.check(study)  # PrivacyLimitExceeded: nothing sent
        total = scan_rows(args.csv, study, args.ignore_extra_columns)
        if total == 0:
            return fail(f"{args.csv}: no data rows")
        if not args.no_journal:
            directory = Path(args.journal_dir) if args.journal_dir else default_dir()
            journal = RelayJournal.open(directory, study.study_id, args.csv, new=args.new_submission)
            if journal.header.get("complete"):
                if not args.quiet:
                    print(f"all {journal.header.get('n_rows')} rows of {name} were already stored at every "
                          f"server for study {study.study_id[:12]}... by an earlier run; nothing sent (to "
                          f"submit them again as new rows: --new-submission)")
                return EXIT_OK
            sent_before = journal.done
    except (SDKError, ValueError, OSError) as exc:
        return fail(describe_error(exc))
    stored = sent_before
    counts = {"accepted": 0, "duplicates": 0}
    limits = SubmitResult([], total, {}, {})  # clamped, clipped, rows_seen: as the direct route's
    try:
        previous = signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:  # not the main thread
        previous = None
    bar = None
    try:
        with RelayClient(args.relay, enrolment, tokens, timeout=args.timeout, max_retries=args.max_retries,
                         verify=verify) as client:

            def send(first: int, rows: int, entries: list[relayed.Entry], resend: bool = False) -> None:
                nonlocal stored
                if journal is not None and not resend:
                    journal.before_send(first, rows, entries)
                for outcome in client.send(entries):
                    if outcome.result is not None:
                        counts["accepted"] += outcome.result.accepted
                        counts["duplicates"] += outcome.result.duplicates
                if journal is not None:
                    journal.after_send(first + rows)
                stored = first + rows
                if bar is not None:
                    bar.update(rows)

            if not args.quiet:
                from tqdm import tqdm

                bar = tqdm(total=total, initial=stored, unit="row", desc="uploaded", file=sys.stderr)
            if journal is not None and journal.pending is not None:
                first, rows, entries = journal.pending
                send(first, rows, entries, resend=True)  # the request in flight, as it was
            limit = args.batch_size or DEFAULT_ROWS
            row_index, first, group, size = 0, stored, [], 0
            raw = study.histogram is not None
            for chunk in data.read_csv(args.csv, study.columns, 1000, ignore_extra=args.ignore_extra_columns,
                                       raw=raw):
                if not raw:  # what the map into the ball changed, rows an earlier run sent included
                    clamped, clipped = report.limited_counts(chunk, study)
                    limits.clipped += clipped
                    for column, k in zip(study.columns, clamped.tolist()):
                        limits.clamped[column] = limits.clamped.get(column, 0) + k
                limits.rows_seen += len(chunk)
                for row in chunk:
                    row_index += 1
                    if row_index <= stored:
                        continue
                    _, entries = client.entries(row)
                    group.extend(entries)
                    size += sum(len(e.batch) + 64 for e in entries)
                    if row_index - first >= limit or size >= MAX_REQUEST_BYTES:
                        send(first, row_index - first, group)
                        first, group, size = row_index, [], 0
            if group:
                send(first, row_index - first, group)
        if journal is not None:
            journal.finish(total)
        if privacy_limit is not None:
            privacy_limit.record(study)
    except KeyboardInterrupt as exc:
        code = EXIT_TERMINATED if isinstance(exc, Terminated) else EXIT_INTERRUPTED
        return fail(f"{'terminated' if code == EXIT_TERMINATED else 'interrupted'}: {_progress(stored, total, journal)}",
                    code)
    except (ProblemError, ServerUnreachable) as exc:
        server_id = getattr(exc, "server_id", None)  # a refusal names its server (RelayClient.send)
        where = f"server {server_id}: " if server_id else ""
        retryable = isinstance(exc, ServerUnreachable) or exc.status in RETRYABLE
        return fail(f"{where}{describe_error(exc)}; {_progress(stored, total, journal, retryable)}",
                    EXIT_INCOMPLETE if retryable else EXIT_ERROR)
    except (SDKError, ValueError, OSError, httpx.HTTPError) as exc:
        return fail(f"{describe_error(exc)}; {_progress(stored, total, journal)}")
    finally:
        if bar is not None:
            bar.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if not args.quiet:
        resumed = f"; {sent_before} of them stored by an earlier run and not sent again" if sent_before else ""
        print(f"submitted {total} rows of {name} through the relay {args.relay} to {n_servers} servers for "
              f"study {study.study_id[:12]}... in {time.monotonic() - started:.1f} s (entries stored: "
              f"{counts['accepted']}, already held: {counts['duplicates']}{resumed})")
    print_data_limits(limits, args.quiet)
    return EXIT_OK


def _progress(stored: int, total: int, journal: RelayJournal | None, again: bool = True) -> str:
    """What a failed or stopped run leaves, and what running it again does."""
    held = f"{stored} of {total} rows are stored at every server"
    if journal is None:
        return f"{held} (no journal: running the command again counts them again)"
    if not again:
        return f"{held}; nothing further sent (journal {journal.file})"
    return (f"{held}; run the same command again to complete: the request in flight is resent as it "
            f"was, each row is stored once (journal {journal.file})")
