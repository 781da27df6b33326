"""``dpsketch study``: drive a running analyzer from the shell."""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys

from dpsketch.protocol import ProblemError

from .client import AnalyzerClient


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dpsketch study",
                                description="Create, watch, finalize and analyse studies on a running analyzer.")
    p.add_argument("--analyzer", default=os.environ.get("DPSKETCH_ANALYZER", "http://127.0.0.1:8100"),
                   help="analyzer base URL (default: $DPSKETCH_ANALYZER or %(default)s)")
    p.add_argument("--ca-file", default=os.environ.get("DPSKETCH_CA_FILE"), metavar="PEM",
                   help="verify the analyzer's TLS certificate against this CA bundle "
                        "(default: $DPSKETCH_CA_FILE, else the system's trust store)")
    p.add_argument("--token", default=os.environ.get("DPSKETCH_ANALYZER_TOKEN"),
                   help="analyzer API token (default: $DPSKETCH_ANALYZER_TOKEN)")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("create", help="design a study and provision it on every share server")
    c.add_argument("--name", required=True)
    c.add_argument("--columns", default="", help="comma-separated column names (not for --kind histogram)")
    c.add_argument("--label", help="regression label column")
    c.add_argument("--expected-reports", type=int, required=True)
    c.add_argument("--epsilon", type=float, default=1.0)
    c.add_argument("--delta", type=float, default=1e-6)
    c.add_argument("--row-bound", type=float, default=1.0)
    c.add_argument("--neighbouring", choices=["replace-one", "add-remove"], default="replace-one")
    c.add_argument("--t", type=int, default=0, help="tolerated colluding clients")
    c.add_argument("--kind", choices=["sketch", "gram", "moments", "histogram", "l1", "auto"], default="sketch",
                   help="sketch (default): OSNAP sketch of the rows; gram: plain sum of "
                   "[a, u(a a^T), 1], central-model accuracy at ~d^2/2 values per client; moments: "
                   "plain sum of u(a a^T) alone, less noise for ridge, least squares and PCA (no row "
                   "sum or count); "
                   "histogram: counts over the bins of --axis (one or two); l1: the multi-level l1 "
                   "sketch, for least absolute deviations (study lad); auto: gram when it fits "
                   "the upload budget and every server's storage policy (see: dpsketch recommend)")
    c.add_argument("--axis", action="append", metavar="SPEC",
                   help="a histogram axis: COLUMN:e0,e1,... (numeric edges; underflow and overflow "
                   "bins are added) or COLUMN=a,b,... (categories; an 'other' bin is added); give "
                   "one, or two for a joint grid (then --columns may be left out)")
    c.add_argument("--party", action="append", metavar="NAME=COL,COL,...[:BOUND]",
                   help="a sketch study whose columns different parties hold for the same individuals: "
                   "one --party per party, its columns in order (the study's columns are the parties' "
                   "blocks; --columns may be left out) and optionally its bound B_j (default "
                   "B sqrt(d_j / d)); docs/vertical.md")
    from .recommend import add_floor_arguments

    add_floor_arguments(c)
    c.add_argument("--k", type=int, help="sketch rows (default: chosen from n and d)")
    c.add_argument("--s", type=int, default=4, help="sketch blocks (default: %(default)s)")
    c.add_argument("--min-reports", type=int)
    c.add_argument("--secret-sign", action=argparse.BooleanOptionalAction, default=None,
                   help="every client multiplies its clipped row by a secret +-1 before its noise, and "
                   "the noise is calibrated for it: the same epsilon with much less noise "
                   "(docs/secret_sign.md). Default: on for a sketch study with k > 1 and no parties, "
                   "off otherwise; --no-secret-sign opts out")
    c.add_argument("--population", metavar="ID",
                   help="the population the study is meant for (advisory): refused now if a server's "
                   "ledger of it has no room; the servers charge the populations their operators issue "
                   "upload tokens for (docs/ledger.md)")

    for name, text in [("show", "show a study"), ("progress", "report counts per server"),
                       ("finalize", "commit the common reports everywhere and release the sketch")]:
        sp = sub.add_parser(name, help=text)
        sp.add_argument("study_id")
    sub.add_parser("list", help="list studies")
    lg_ = sub.add_parser("ledger", help="a population's privacy ledger at every share server: the "
                         "studies charged, their composition and the budget (docs/ledger.md)")
    lg_.add_argument("population", nargs="?", help="the population id")
    lg_.add_argument("--study", dest="ledger_study", metavar="STUDY_ID",
                     help="the ledger of this study's population instead")

    r = sub.add_parser("ridge", help="ridge regression on the released sketch")
    r.add_argument("study_id")
    r.add_argument("--label")
    r.add_argument("--alpha", type=float)
    r.add_argument("--no-debias", action="store_true")
    ls = sub.add_parser("least-squares", help="least squares on the released sketch")
    ls.add_argument("study_id")
    ls.add_argument("--label")
    ls.add_argument("--no-debias", action="store_true")
    lg = sub.add_parser("logistic", help="logistic regression on the released Gram (docs/logistic.md)")
    lg.add_argument("study_id")
    lg.add_argument("--label")
    lg.add_argument("--alpha", type=float)
    lg.add_argument("--classes", help="the label's negative,positive values (default: 0,1)")
    lg.add_argument("--intercept-column", help="a constant column (intercept of a sketch study)")
    lg.add_argument("--no-intercept", action="store_true")
    lg.add_argument("--calibration", choices=["gaussian", "taylor"])
    lg.add_argument("--no-debias", action="store_true")
    ld = sub.add_parser("lad", help="least absolute deviations on a released l1 study (docs/lad.md)")
    ld.add_argument("study_id")
    ld.add_argument("--label")
    ld.add_argument("--alpha", type=float, help="l1 penalty on the coefficients (default: 0)")
    ld.add_argument("--noise-correction", choices=["none", "calibrate"],
                    help="calibrate: undo the noise's shrinkage by regression calibration (default: none)")
    pc = sub.add_parser("pca", help="top principal components of the released sketch")
    pc.add_argument("study_id")
    pc.add_argument("--rank", type=int, required=True)
    pc.add_argument("--no-debias", action="store_true")

    h = sub.add_parser("histogram", help="a histogram study's counts and proportions with confidence intervals")
    h.add_argument("study_id")
    h.add_argument("--confidence", type=float, default=0.95)
    for name, text in [("quantiles", "quantiles of a binned numeric column"),
                       ("moments", "mean and variance of a binned numeric column"),
                       ("kendall-tau", "Kendall's tau-b between the two axes"),
                       ("auc", "AUC (Mann-Whitney U) of a score axis against a label axis"),
                       ("gini-mean-difference", "Gini's mean difference of a binned numeric column"),
                       ("gini-simpson", "Gini-Simpson diversity of a column")]:
        sp = sub.add_parser(name, help=text)
        sp.add_argument("study_id")
        sp.add_argument("--confidence", type=float, default=0.95)
        if name in ("quantiles", "moments", "gini-mean-difference", "gini-simpson"):
            sp.add_argument("--column", help="the axis (default: the only one)")
        if name == "quantiles":
            sp.add_argument("--p", type=float, action="append", dest="probabilities",
                            help="a probability, repeatable (default: 0.25, 0.5, 0.75)")
        if name == "auc":
            sp.add_argument("--score", required=True)
            sp.add_argument("--label", required=True)
            sp.add_argument("--positive", required=True, help="the positive class")
    return p



def parse_party(spec: str) -> dict:
    """``NAME=c1,c2[:BOUND]`` as a party of a study (ValueError naming the problem)."""
    name, eq, rest = spec.partition("=")
    columns, _, bound = rest.partition(":")
    cols = [c.strip() for c in columns.split(",") if c.strip()]
    if not eq or not name.strip() or not cols:
        raise ValueError(f"--party {spec!r}: expected NAME=COL,COL,...[:BOUND]")
    out: dict = {"name": name.strip(), "columns": cols}
    if bound:
        try:
            out["row_bound"] = float(bound)
        except ValueError:
            raise ValueError(f"--party {spec!r}: the bound {bound!r} is not a number") from None
    return out


def ledger_summary(view: dict) -> str:
    """One line per server: composed epsilon against the naive sum and the budget."""
    if view.get("population") is None:
        return ("this study names no population; the servers charge it to the populations their "
                "operators issue its upload tokens for (GET /v1/populations/{p}/ledger)")
    lines = [f"population {view['population']}:"]
    for s in view["servers"]:
        book = s.get("ledger")
        if book is None:
            lines.append(f"  {s['server_id']}: unreadable ({s.get('error')})")
            continue
        eps = "unbounded" if book["epsilon"] is None else f"{book['epsilon']:.4g}"
        naive = "unbounded" if book["naive_epsilon"] is None else f"{book['naive_epsilon']:.4g}"
        budget = ("no budget" if book["budget_epsilon"] is None
                  else f"budget {book['budget_epsilon']:g}")
        lines.append(f"  {s['server_id']}: {len(book['studies'])} studies, epsilon = {eps} at delta = "
                     f"{book['delta']:g} ({book['neighbouring']}; naive sum {naive}); {budget}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        verify = ssl.create_default_context(cafile=args.ca_file) if args.ca_file else True
        with AnalyzerClient(args.analyzer, args.token, verify=verify) as client:
            if args.command == "create":
                from .recommend import floor_argument

                from dpsketch.protocol.histogram import parse_axis

                floor = floor_argument(args)
                extra: dict = {} if floor == "default" else {"epsilon_floor": floor}
                if args.axis:
                    extra["histogram"] = {"axes": [parse_axis(a).model_dump(exclude_none=True) for a in args.axis]}
                if args.party:
                    extra["parties"] = [parse_party(spec) for spec in args.party]
                if args.population:
                    extra["population"] = args.population
                if args.secret_sign is not None:
                    extra["secret_sign"] = args.secret_sign
                out = client.create_study(
                    name=args.name, columns=[c for c in args.columns.split(",") if c], label=args.label,
                    expected_reports=args.expected_reports, epsilon=args.epsilon, delta=args.delta,
                    row_bound=args.row_bound, neighbouring=args.neighbouring, t=args.t, kind=args.kind, k=args.k,
                    s=args.s, min_reports=args.min_reports, **extra)
                print("\n".join(out["explanation"]), file=sys.stderr)
            elif args.command == "list":
                out = client.studies()
            elif args.command == "ledger":
                if (args.population is None) == (args.ledger_study is None):
                    print("dpsketch study ledger: give a population id or --study STUDY_ID", file=sys.stderr)
                    return 2
                out = client.ledger(args.population, args.ledger_study)
                print(ledger_summary(out), file=sys.stderr)
            elif args.command == "show":
                out = client.study(args.study_id)
            elif args.command == "progress":
                out = client.progress(args.study_id)
            elif args.command == "finalize":
                out = client.finalize(args.study_id)
            elif args.command == "ridge":
                out = client.ridge(args.study_id, label=args.label, alpha=args.alpha,
                                   debias=not args.no_debias)
            elif args.command == "least-squares":
                out = client.least_squares(args.study_id, label=args.label, debias=not args.no_debias)
            elif args.command == "logistic":
                classes = None
                if args.classes is not None:
                    try:
                        classes = [float(v) for v in args.classes.split(",")]
                    except ValueError:
                        print(f"dpsketch study: --classes must be two numbers, e.g. 0,1; got {args.classes!r}",
                              file=sys.stderr)
                        return 2
                out = client.logistic(args.study_id, label=args.label, alpha=args.alpha, classes=classes,
                                      intercept_column=args.intercept_column,
                                      fit_intercept=False if args.no_intercept else None,
                                      calibration=args.calibration, debias=not args.no_debias)
            elif args.command == "lad":
                out = client.lad(args.study_id, label=args.label, alpha=args.alpha,
                                 noise_correction=args.noise_correction)
            elif args.command == "pca":
                out = client.pca(args.study_id, n_components=args.rank, debias=not args.no_debias)
            elif args.command == "histogram":
                out = client.histogram(args.study_id, confidence=args.confidence)
            else:
                fields = {k: v for k, v in vars(args).items()
                          if k in ("confidence", "column", "probabilities", "score", "label", "positive")
                          and v is not None}
                out = client.statistic(args.study_id, args.command, **fields)
    except ProblemError as exc:
        print(f"dpsketch study: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # network errors: one line, no traceback
        print(f"dpsketch study: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(out, indent=2))
    return 0
