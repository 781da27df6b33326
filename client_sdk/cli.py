"""``dpsketch submit``: upload the rows of a CSV file to a study's share servers.

The file is read twice: once to check every row (so a bad value on the last line is reported
before any share leaves the machine, and the progress bar knows the total), then streamed in
batches to the servers. Errors end in one line on stderr and a non-zero exit code, never a
traceback: this is run by data owners, not developers.

Running the same command again after Ctrl-C, SIGTERM, SIGKILL, a crash or an incomplete upload
completes the submission, storing each row once (the submission journal, client_sdk/journal.py).
``--relay URL --enrolment FILE`` sends the rows through a relay instead (client_sdk/relay_cli.py).
"""

from __future__ import annotations

import argparse
import os
import signal
import ssl
import sys
import time
import warnings
from typing import TYPE_CHECKING

import httpx

from dpsketch.protocol.problems import ProblemError

if TYPE_CHECKING:
    from .budget import PrivacyLimit
    from .client import SubmitResult
    from dpsketch.protocol.study import Study

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INCOMPLETE, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 3, 130, 143

DESCRIPTION = """\
Submit the rows of a CSV file to a dpsketch study, privately.

Each row is clipped to the study's norm bound, given exact discrete Gaussian noise drawn from a
ChaCha20 keystream keyed from the operating system's secure random generator (os.urandom), and
split into one additive share per server: no server, nor any group of all but one of them,
learns anything about the row.

Before sending anything the command fetches the study from every server, checks that all of
them hold exactly the study ID given (it recomputes the content hash) and that the URLs are the
study's servers, in its order. The CSV needs a header row; its columns are matched to the
study's columns by name, in any order. Every value must be a finite number: a NaN or an
infinity is refused, naming its line and column, before anything is sent.

Exactly once: the noise, shares and salts of a submission are drawn from ChaCha20 keyed by a
secret kept in a local journal (mode 0600, --journal-dir), keyed by the study and the SHA-256 of
the file. Running the same command again after Ctrl-C, SIGTERM, a crash or an incomplete upload
rebuilds the same reports: batches every server holds are skipped, the others completed (servers
count a report they hold once), so each row is stored once. The journal's key is deleted once
every server holds every row; running the command once more then sends nothing. A file changed
under an unfinished submission is refused (--new-submission starts a new one).
"""

EPILOG = """\
exit codes: 0 all rows stored at every server (or already were); 1 error (nothing or nothing
further sent); 2 usage error; 3 upload incomplete (some rows are held by some servers only: run
the same command again to complete them, each row is stored once); 130 interrupted (Ctrl-C) and
143 terminated (SIGTERM): the message says how many rows every server holds and how many only
some do; run the same command again to complete. (A --party upload keeps no journal yet: a
block the servers hold can only be resent as it was, docs/vertical.md.)

example:
  dpsketch submit --study 3f9c...e1 \\
      --servers https://dp.a.example,https://dp.b.example,https://dp.c.example data.csv

a party of a study with parties (docs/vertical.md) submits its columns of each individual,
named by a key column, under the party key the parties share (never the servers):
  dpsketch submit --study 3f9c...e1 --servers ... --party bank \\
      --party-key bank-and-partners.key --id-column customer_id bank.csv
  (dpsketch submit --new-party-key FILE writes a fresh key to share among the parties)

through a relay (docs/relay.md): enrol once from the servers themselves, then submit to the
relay with the enrolment file (--token as above, in the study's server order):
  dpsketch enrol --study 3f9c...e1 --servers https://dp.a.example,... --out study.enrolment.json
  dpsketch submit --relay https://relay.example --enrolment study.enrolment.json data.csv
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dpsketch submit", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", metavar="data.csv", nargs="?", help="CSV file with a header row naming the columns")
    p.add_argument("--new-party-key", metavar="FILE",
                   help="write a fresh party key (mode 0600) to FILE for the parties to share, and exit")
    p.add_argument("--study", metavar="ID",
                   help="the study id (64 hex characters; with --relay optional, checked against the enrolment's)")
    p.add_argument("--party", metavar="NAME",
                   help="a study with parties: submit this party's columns of each individual")
    p.add_argument("--party-key", metavar="FILE", default=os.environ.get("DPSKETCH_PARTY_KEY_FILE"),
                   help="with --party: the key file the parties share (default: $DPSKETCH_PARTY_KEY_FILE)")
    p.add_argument("--id-column", metavar="COLUMN",
                   help="with --party: the CSV column holding each individual's key (not sent anywhere)")
    p.add_argument("--servers", metavar="URL,URL,...",
                   help="the share servers' base URLs, comma-separated, in the study's server order")
    p.add_argument("--batch-size", type=int, default=None, metavar="N",
                   help="rows per upload request (default: as many as fill 8 MiB of the largest "
                        "request body, at most 100000; a study with batch proofs: rows per proved "
                        "batch, as many as keep its leader's record within 8 MiB; with --relay: rows "
                        "per relay request, default 64, fewer past 1 MiB of entries)")
    p.add_argument("--timeout", type=float, default=30.0, metavar="S",
                   help="seconds to wait for each HTTP request (default: %(default)s)")
    p.add_argument("--max-retries", type=int, default=5, metavar="N",
                   help="retries per request on network errors, 5xx, 429 (default: %(default)s)")
    p.add_argument("--token", default=os.environ.get("DPSKETCH_CLIENT_TOKEN"), metavar="TOKEN[,TOKEN...]",
                   help="bearer token to send, if the servers require one: one for all servers, or "
                        "one per server in --servers order, comma-separated (a study's upload tokens "
                        "are issued by each server; default: $DPSKETCH_CLIENT_TOKEN)")
    p.add_argument("--allow-insecure-http", action="store_true",
                   help="send the upload tokens over plain http:// to a host other than this machine "
                        "(refused by default: the token would cross the network in clear)")
    p.add_argument("--encrypt", action="store_true",
                   help="seal each share (or a party's block) to its server's HPKE public key "
                        "(docs/protocol.md section 7a, docs/sealing.md)")
    p.add_argument("--sealing", choices=("classical", "post-quantum", "prefer-post-quantum"),
                   help="the HPKE suite to seal with (implies --encrypt): classical X25519 (the "
                        "default), post-quantum MLKEM768-X25519 at every server (refused unless "
                        "every server publishes such a key), or post-quantum where published and "
                        "classical elsewhere (docs/sealing.md)")
    p.add_argument("--compress", action=argparse.BooleanOptionalAction, default=True,
                   help="seed-compressed shares (the default): every server but one gets a 32-byte "
                        "seed instead of a full-width share (the one rotates batch by batch): with "
                        "N servers a row uploads "
                        "8d + 32(N-1) bytes of share data instead of 8dN, plus 16 + 16N of id and "
                        "proof per server (docs/protocol.md section 4); "
                        "--no-compress sends every server its full share; --party blocks always go "
                        "as full shares")
    p.add_argument("--batch-proofs", action=argparse.BooleanOptionalAction, default=True,
                   help="a study with batch proofs (docs/protocol.md section 4d): prove each batch "
                        "of rows at once (the default: one proof and one record a server per batch, "
                        "about a tenth of per-report proofs' upload); --no-batch-proofs proves each "
                        "row on its own, as for a study without them (with --encrypt each "
                        "record is sealed, docs/sealing.md section 3b)")
    p.add_argument("--max-floor-epsilon", type=float, metavar="EPS",
                   default=float(os.environ["DPSKETCH_MAX_FLOOR_EPSILON"]) if os.environ.get(
                       "DPSKETCH_MAX_FLOOR_EPSILON") else None,
                   help="refuse (before sending anything) a study whose floor is weaker than EPS: "
                        "the epsilon each row keeps when every other report is an adversary's and "
                        "all servers but one collude (docs/trust.md; default: "
                        "$DPSKETCH_MAX_FLOOR_EPSILON, else accept what the servers' policies allow)")
    p.add_argument("--privacy-limit", metavar="EPSILON,DELTA",
                   default=os.environ.get("DPSKETCH_PRIVACY_LIMIT") or None,
                   help="this data owner's own limit over every study it submits to: refuse (before "
                        "sending anything) a study that would take the running total kept in "
                        "$DPSKETCH_PRIVACY_LEDGER (default ~/.dpsketch/privacy-ledger.json) past it, and "
                        "record the study once every server holds the rows (docs/ledger.md; default: "
                        "$DPSKETCH_PRIVACY_LIMIT, else no limit)")
    p.add_argument("--journal-dir", metavar="DIR", default=None,
                   help="where the submission journal is kept (one file per study and input, mode "
                        "0600; it holds the submission's secret key until every server holds every "
                        "row) (default: $DPSKETCH_SUBMISSIONS_DIR, else ~/.dpsketch/submissions)")
    p.add_argument("--no-journal", action="store_true",
                   help="keep no journal: fresh randomness, so running the command again counts "
                        "every row again (not recommended)")
    p.add_argument("--new-submission", action="store_true",
                   help="submit the file as new rows even if it (or an earlier version of it) was "
                        "submitted to this study before; rows an earlier submission stored stay "
                        "counted")
    p.add_argument("--relay", metavar="URL",
                   help="send each row through this relay instead of to the servers, sealed to the "
                        "keys of --enrolment FILE (written by dpsketch enrol; no --servers; "
                        "docs/relay.md): one request carries --batch-size rows; the journal "
                        "keeps each request's sealed entries until the relay answers, so running "
                        "the command again stores each row once; a study with parties or batch "
                        "proofs is refused")
    p.add_argument("--enrolment", metavar="FILE",
                   help="with --relay: the study and the servers' keys, as dpsketch enrol wrote them")
    p.add_argument("--ignore-extra-columns", action="store_true",
                   help="skip CSV columns the study does not have instead of refusing the file")
    add_tls_arguments(p)
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar or summary")
    return p


def describe_error(exc: BaseException) -> str:
    """An error as one line for a person at the command line (the ``fail`` of
    dpsketch submit and dpsketch enrol): a protocol refusal with its slug and status, a network error as where it failed."""
    url = getattr(exc, "url", None)
    if isinstance(exc, ProblemError):
        return f"{url + ': ' if url else ''}{exc.slug} ({exc.status}): {exc.detail}"
    if isinstance(exc, httpx.RequestError):
        from dpsketch.plain_errors import unreachable

        try:
            where = str(exc.request.url)
        except RuntimeError:  # no request attached
            where = "a server"
        return unreachable(where, exc)
    if isinstance(exc, httpx.HTTPError):
        return f"HTTP error: {exc}"
    return str(exc) or type(exc).__name__


def add_tls_arguments(p: argparse.ArgumentParser) -> None:
    """--ca-file and --insecure, as every command that talks to the servers reads them (tls_verify)."""
    p.add_argument("--ca-file", metavar="PEM", default=os.environ.get("DPSKETCH_CA_FILE"),
                   help="verify the servers' TLS certificates against this CA bundle instead of "
                        "the system's trust store (default: $DPSKETCH_CA_FILE)")
    p.add_argument("--insecure", action="store_true", help="do not verify TLS certificates")


def privacy_limit_option(value: str | None) -> "PrivacyLimit | None":
    """``--privacy-limit EPSILON,DELTA`` as the data owner's PrivacyLimit, its ledger at
    $DPSKETCH_PRIVACY_LEDGER or ~/.dpsketch/privacy-ledger.json (None without the option);
    ValueError saying what is wrong."""
    if not value:
        return None
    from .budget import PrivacyLimit

    eps, delta = (float(x) for x in value.split(","))
    return PrivacyLimit(eps, delta, os.environ.get("DPSKETCH_PRIVACY_LEDGER") or
                        os.path.expanduser("~/.dpsketch/privacy-ledger.json"))


def tls_verify(insecure: bool, ca_file: str | None) -> tuple[bool | ssl.SSLContext, tuple[str, int] | None]:
    """What to verify TLS certificates with (--insecure, --ca-file), or the error message and
    exit code that refuse the options."""
    if insecure and ca_file:
        return False, ("give --ca-file or --insecure, not both", EXIT_USAGE)
    if not ca_file:
        return not insecure, None
    try:
        return ssl.create_default_context(cafile=ca_file), None
    except (OSError, ssl.SSLError) as exc:
        return False, (f"cannot load the CA file {ca_file}: {exc}", EXIT_ERROR)


def scan_rows(path: str, study: "Study", ignore_extra: bool) -> int:
    """Check every row of the CSV against ``study`` (a histogram study's values against its bins
    too) before anything is sent; the row count."""
    from . import data

    check = ((lambda chunk, first: study.histogram.cell_index(chunk, first_row=first))  # type: ignore[union-attr]  # checked by the conditional
             if study.histogram is not None else None)
    return data.scan_csv(path, study.columns, ignore_extra=ignore_extra, check=check)


def print_data_limits(result: "SubmitResult", quiet: bool) -> None:
    """After an upload (either route: the direct one and ``--relay``), what the map into the
    study's row ball changed (``result``'s ``clamped``, ``clipped`` and ``rows_seen``): the clamp
    summary on stdout unless ``quiet``, and, when it changed enough that the answers describe the
    clamped data, the DataLimitedWarning's message as one line on stderr, quiet or not."""
    from .client import limited_warning

    if not quiet and (result.clamped or result.clipped):
        print(result.clamp_summary() or "no value was outside the study's bounds")
    message = limited_warning(result)
    if message:
        print(f"dpsketch submit: warning: {' '.join(message.split())}", file=sys.stderr)


def on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM stops an upload as Ctrl-C does: the rows in flight finish, the summary says how
    many every server holds, and the same command completes the rest."""
    raise Terminated()


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised by :func:`on_sigterm`: a KeyboardInterrupt, so an upload stops as on
    Ctrl-C, and its own class, so the command exits 143 rather than 130."""


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from . import data
    from .client import Client, DataLimitedWarning
    from .errors import IncompleteUpload, SDKError

    def fail(message: str, code: int = EXIT_ERROR) -> int:
        one_line = " ".join(message.split())
        print(f"dpsketch submit: error: {one_line}", file=sys.stderr)
        return code

    if args.new_party_key:
        from .parties import new_key_file

        try:
            new_key_file(args.new_party_key)
        except OSError as exc:
            return fail(f"cannot write {args.new_party_key}: {exc.strerror or exc}")
        if not args.quiet:
            print(f"wrote a new party key to {args.new_party_key}: share it with the other parties "
                  f"only (never with a server or the analyst)")
        return EXIT_OK
    if args.relay or args.enrolment:
        from .relay_cli import submit_relayed

        return submit_relayed(args, fail)
    for needed, flag in ((args.csv, "data.csv"), (args.study, "--study"), (args.servers, "--servers")):
        if not needed:
            return fail(f"{flag} is required", EXIT_USAGE)
    if args.party and not (args.party_key and args.id_column):
        return fail("--party needs --party-key FILE and --id-column COLUMN", EXIT_USAGE)
    party_key = None
    if args.party:
        from .parties import read_key_file

        try:
            party_key = read_key_file(args.party_key)
        except (OSError, ValueError) as exc:
            return fail(f"{exc}")
    urls = [u for u in (x.strip() for x in args.servers.split(",")) if u]
    if args.batch_size is not None and args.batch_size < 1:
        return fail("--batch-size must be at least 1", EXIT_USAGE)
    if not os.path.isfile(args.csv):
        return fail(f"{args.csv}: no such file")
    verify, problem = tls_verify(args.insecure, args.ca_file)
    if problem:
        return fail(*problem)
    token: str | list[str] | None = args.token
    if token and "," in token:
        token = [t.strip() for t in token.split(",")]  # type: ignore[union-attr]  # token is the option's str here
        if len(token) != len(urls) or not all(token):
            return fail(f"--token lists {len(token)} tokens for {len(urls)} servers; give one, or "
                        f"one per server", EXIT_USAGE)
    try:
        privacy_limit = privacy_limit_option(args.privacy_limit)
    except ValueError as exc:
        return fail(f"--privacy-limit {args.privacy_limit!r}: expected EPSILON,DELTA ({exc})", EXIT_USAGE)
    journal: bool | str = False if args.no_journal else (args.journal_dir or True)
    result = None
    other_warnings: list[warnings.WarningMessage] = []
    started = time.monotonic()
    try:
        previous = signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:  # not the main thread (main() called from a test): no handler
        previous = None
    try:
        with Client(urls, timeout=args.timeout, max_retries=args.max_retries, token=token,
                    allow_insecure_http=args.allow_insecure_http,
                    verify=verify, encrypt=args.encrypt or args.sealing is not None,
                    sealing=args.sealing or "classical", compress=args.compress,
                    max_floor_epsilon=args.max_floor_epsilon, privacy_limit=privacy_limit,
                    journal=journal) as client:
            study = client.study(args.study)
            if args.party:
                party_columns = study.party(args.party)[1].columns  # ValueError: no such party
                seen: set[str] = set()

                def check_keys(chunk, first: int) -> None:
                    for i, key in enumerate(str(k) for k in chunk[:, 0]):
                        if not key or key in seen:
                            raise ValueError(f"data row {first + i + 1}: {args.id_column} "
                                             f"{'is empty' if not key else repr(key) + ' repeats'}")
                        seen.add(key)

                data.scan_csv(args.csv, [args.id_column], ignore_extra=True, check=check_keys)
                seen.clear()
                total = data.scan_csv(args.csv, party_columns, ignore_extra=True)
            else:
                total = scan_rows(args.csv, study, args.ignore_extra_columns)
            if total == 0:
                return fail(f"{args.csv}: no data rows")
            bar = None
            if not args.quiet:
                from tqdm import tqdm

                bar = tqdm(total=total, unit="row", desc="uploaded", file=sys.stderr)
            try:
                if args.party:
                    result = client.submit_blocks(args.study, args.party, args.csv, party_key=party_key,  # type: ignore[arg-type]  # a party has its key by now
                                                  key_column=args.id_column, batch_size=args.batch_size,
                                                  progress=bar.update if bar else None, keep_ids=False)
                else:
                    with warnings.catch_warnings(record=True) as other_warnings:
                        warnings.simplefilter("ignore", DataLimitedWarning)  # print_data_limits says it below
                        result = client.submit_many(args.study, args.csv, batch_size=args.batch_size,
                                                    progress=bar.update if bar else None, keep_ids=False,
                                                    ignore_extra_columns=args.ignore_extra_columns,
                                                    new_submission=args.new_submission,
                                                    batch_proofs=args.batch_proofs,
                                                    check_file=False)  # scanned above
            finally:
                if bar is not None:
                    bar.close()
    except KeyboardInterrupt as exc:
        from .errors import UploadInterrupted

        code = EXIT_TERMINATED if isinstance(exc, Terminated) or isinstance(
            exc.__cause__, Terminated) else EXIT_INTERRUPTED
        what = "terminated" if code == EXIT_TERMINATED else "interrupted"
        if isinstance(exc, UploadInterrupted):
            where = f" (journal {exc.journal})" if exc.journal else ""
            return fail(f"{what}: {exc}{where}", code)
        if result is None:
            return fail(f"{what} before any row was sent", code)
        # the upload had finished: say so below
    except IncompleteUpload as exc:
        return fail(f"{exc}", EXIT_INCOMPLETE)
    except (SDKError, ProblemError, ValueError, OSError, httpx.HTTPError) as exc:
        return fail(describe_error(exc))
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if not args.quiet:
        name = os.path.basename(args.csv)
        if getattr(result, "already_complete", False):
            print(f"all {result.n_reports} rows of {name} were already stored at every server for "
                  f"study {args.study[:12]}... by an earlier run; nothing sent (to submit them "
                  f"again as new rows: --new-submission)")
            return EXIT_OK
        counts = ", ".join(f"{sid} {n}" for sid, n in result.report_counts.items()) or "not shown (add/remove study)"
        what = f"party {args.party}'s blocks of " if args.party else ""
        resumed = (f"; {result.skipped} of them stored by an earlier run and not sent again"
                   if getattr(result, "skipped", 0) else "")
        print(f"submitted {what}{result.n_reports} rows of {name} to "
              f"{len(urls)} servers for study {args.study[:12]}... in "
              f"{time.monotonic() - started:.1f} s (reports held: {counts}{resumed})")
    print_data_limits(result, args.quiet)
    for warning in other_warnings:
        print(f"dpsketch submit: warning: {warning.message}", file=sys.stderr)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
