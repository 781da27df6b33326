"""``dpsketch study``: drive a running analyzer from the shell.

Every command prints its answer as a readable table on a terminal and as JSON when piped
(``--output`` chooses); ``create`` and ``pilot`` can print the bare study id (``--output id``) so
a shell captures it: ``STUDY=$(dpsketch study create ... --output id)``. Errors are one line on
stderr and a non-zero exit code, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
from typing import Any

from dpsketch.protocol import ProblemError

from . import cli_tables
from .client import AnalyzerClient

#: what ``--output`` may say, per command (``id``: create and pilot only)
OUTPUTS = ("table", "json")


def _output_option(p: argparse.ArgumentParser, extra: tuple[str, ...] = ()) -> None:
    """``--output`` after a subcommand too (``dpsketch study ridge ID --output json``); SUPPRESS
    keeps the top-level value when the subcommand's is not given."""
    p.add_argument("--output", "-o", choices=(*OUTPUTS, *extra), default=argparse.SUPPRESS,
                   help="table (the default on a terminal), json (the default when piped)"
                   + (", or id: only the study id, for a shell variable" if "id" in extra else ""))


def _confidence(p: argparse.ArgumentParser) -> None:
    p.add_argument("--confidence", type=float, default=0.95, metavar="LEVEL",
                   help="level of the confidence intervals (default: %(default)s)")


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
    p.add_argument("--output", "-o", choices=OUTPUTS, default=None,
                   help="table (the default on a terminal) or json (the default when piped)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser("create", help="design a study and provision it on every share server",
                       description="Design a study (k, s, lambda_star, noise, ring) and provision it on every "
                       "share server. Give --bounds so clients map raw values into the study's row ball "
                       "and the answers come back in the data's units (or run `dpsketch study pilot` first "
                       "to have them proposed).")
    c.add_argument("--name", required=True, help="a human label for the study")
    c.add_argument("--columns", default="", help="comma-separated column names, in the order of the data "
                   "(not for --kind histogram)")
    c.add_argument("--label", help="the regression label column (default: none; ridge and friends then "
                   "need --label)")
    c.add_argument("--bounds", metavar="COL=LO:HI,...",
                   help="the public range of every column, e.g. age=16:90,hours=0:100,wage=0:10000: clients "
                   "clamp each value to it (and say how many they clamped) and analyses answer in the data's "
                   "units with an intercept; without it rows must already lie in the ball of radius "
                   "--row-bound (docs/protocol.md section 2e)")
    c.add_argument("--expected-reports", type=int, required=True, metavar="N",
                   help="how many reports (rows) you expect; sizes the sketch and the noise")
    c.add_argument("--epsilon", type=float, default=1.0,
                   help="the privacy target epsilon per report (default: %(default)s)")
    c.add_argument("--delta", type=float, default=1e-6,
                   help="the privacy target delta per report (default: %(default)s)")
    c.add_argument("--row-bound", type=float, default=1.0, metavar="B",
                   help="B, the L2 norm every mapped row is clipped to (default: %(default)s; with --bounds "
                   "only the scale of the ball, which changes nothing)")
    c.add_argument("--neighbouring", choices=["replace-one", "add-remove"], default="replace-one",
                   help="what the guarantee hides: replacing one report (default) or its presence")
    c.add_argument("--t", type=int, default=0, help="tolerated colluding clients (default: %(default)s)")
    c.add_argument("--kind", choices=["auto", "sketch", "gram", "moments", "histogram", "l1"], default="auto",
                   help="auto (default): the most accurate kind that fits, gram when its upload fits the "
                   "budget and every server's storage policy, else sketch (the explanation says which and "
                   "why); sketch: OSNAP sketch of the rows; gram: plain sum of [a, u(a a^T), 1], "
                   "central-model accuracy at ~d^2/2 values per client; moments: plain sum of u(a a^T) "
                   "alone; histogram: counts over the bins of --axis; l1: the multi-level l1 sketch, for "
                   "least absolute deviations (see: dpsketch recommend)")
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
    c.add_argument("--k", type=int, help="sketch rows (default: chosen from n and d; implies --kind sketch "
                   "under auto)")
    c.add_argument("--s", type=int, default=4, help="sketch blocks (default: %(default)s)")
    c.add_argument("--min-reports", type=int, metavar="N",
                   help="no release over fewer reports (default: 90%% of --expected-reports)")
    c.add_argument("--secret-sign", action=argparse.BooleanOptionalAction, default=None,
                   help="every client multiplies its clipped row by a secret +-1 before its noise, and "
                   "the noise is calibrated for it: the same epsilon with much less noise "
                   "(docs/secret_sign.md). Default: on for a sketch study with k > 1 and no parties, "
                   "off otherwise; --no-secret-sign opts out")
    c.add_argument("--validity", action="store_true",
                   help="every client proves its report valid (within the row bound plus a noise allowance) "
                   "and every server refuses reports whose proofs fail: one client then moves a release no "
                   "more than an honest one at the bound can (docs/validity.md). Sketch (parties too: each block "
                   "proved with its party's bound), "
                   "histogram, gram, moments and l1 studies; under auto the kind is chosen among those")
    c.add_argument("--batch-proofs", action="store_true",
                   help="with --validity: the servers also take batch records, one proof for a bulk owner's "
                   "batch of rows (docs/protocol.md section 4d; the SDK's submit_many sends them), about a "
                   "tenth of per-report proofs' bytes and client time. Sketch and l1 studies without parties")
    c.add_argument("--population", metavar="ID",
                   help="the population the study is meant for (advisory): refused now if a server's "
                   "ledger of it has no room; the servers charge the populations their operators issue "
                   "upload tokens for (docs/ledger.md)")
    _output_option(c, ("id",))

    pl = sub.add_parser("pilot", help="a private pilot study whose release proposes each column's bounds",
                        description="Create a pilot: a marginal histogram of every column over scale-free "
                        "bins, charged to the ledger like any study. Data owners submit their raw CSV to it; "
                        "after finalize, `dpsketch study propose-bounds` reads the columns' bounds off its "
                        "noisy quantiles, for `create --bounds`.")
    pl.add_argument("--name", required=True, help="a human label for the pilot")
    pl.add_argument("--columns", required=True, help="comma-separated column names")
    pl.add_argument("--expected-reports", type=int, required=True, metavar="N",
                    help="how many rows you expect")
    pl.add_argument("--epsilon", type=float, default=None,
                    help="the pilot's privacy target (default: the analyzer's pilot default)")
    pl.add_argument("--delta", type=float, default=1e-6, help="the pilot's delta (default: %(default)s)")
    pl.add_argument("--population", metavar="ID", help="the population the pilot draws from (docs/ledger.md)")
    _output_option(pl, ("id",))

    pb = sub.add_parser("propose-bounds", help="bounds for every column from a released pilot",
                        description="Read each column's bounds off a released pilot's noisy quantiles; "
                        "--output bounds prints only COL=LO:HI,... for `create --bounds`.")
    pb.add_argument("study_id", help="the pilot's study id")
    pb.add_argument("--lower", type=float, default=0.005, metavar="P",
                    help="the quantile the lower bounds sit at or below (default: %(default)s)")
    pb.add_argument("--upper", type=float, default=0.995, metavar="P",
                    help="the quantile the upper bounds sit at or above (default: %(default)s)")
    _output_option(pb, ("bounds",))

    for name, text in [("show", "show a study: its parameters, guarantees and explanation"),
                       ("progress", "reports held per server against min_reports"),
                       ("finalize", "commit the common reports everywhere and release (cannot be undone; a study "
                                    "with validity proofs: every server first checks every proof and takes "
                                    "no more uploads)")]:
        sp = sub.add_parser(name, help=text, description=text)
        sp.add_argument("study_id", help="the study id (64 hex characters)")
        _output_option(sp)
    ls_ = sub.add_parser("list", help="list studies", description="list the analyzer's studies")
    _output_option(ls_)
    lg_ = sub.add_parser("ledger", help="a population's privacy ledger at every share server: the "
                         "studies charged, their composition and the budget (docs/ledger.md)")
    lg_.add_argument("population", nargs="?", help="the population id")
    lg_.add_argument("--study", dest="ledger_study", metavar="STUDY_ID",
                     help="the ledger of this study's population instead")
    _output_option(lg_)

    intercept = dict(action=argparse.BooleanOptionalAction, default=None,
                     help="fit an intercept (default: whenever the study declares bounds)")
    r = sub.add_parser("ridge", help="ridge regression on the release, in the data's units",
                       description="Ridge regression of --label on the other columns, with an intercept "
                       "and confidence intervals from the release's public noise law.")
    r.add_argument("study_id", help="the study id")
    r.add_argument("--label", help="the label column (default: the study's label)")
    r.add_argument("--alpha", type=float,
                   help="ridge penalty in units of the standardized Gram (sums over reports of the columns "
                   "scaled by their bounds to [-1, 1]); default: chosen from the release's noise (AdaSSP)")
    r.add_argument("--no-debias", action="store_true",
                   help="do not subtract the known noise energy from the Gram (not recommended)")
    r.add_argument("--intercept", **intercept)
    _confidence(r)
    _output_option(r)
    ls = sub.add_parser("least-squares", help="least squares on the release, in the data's units",
                        description="Ordinary least squares of --label on the other columns (ridge with "
                        "alpha 0), with an intercept and confidence intervals.")
    ls.add_argument("study_id", help="the study id")
    ls.add_argument("--label", help="the label column (default: the study's label)")
    ls.add_argument("--no-debias", action="store_true",
                    help="do not subtract the known noise energy from the Gram (not recommended)")
    ls.add_argument("--intercept", **intercept)
    _confidence(ls)
    _output_option(ls)
    lg = sub.add_parser("logistic", help="logistic regression on the released Gram (docs/logistic.md)")
    lg.add_argument("study_id", help="the study id")
    lg.add_argument("--label", help="the label column (default: the study's label)")
    lg.add_argument("--alpha", type=float, help="ridge penalty on the surrogate (default: from the noise)")
    lg.add_argument("--classes", help="the label's negative,positive values (default: 0,1)")
    lg.add_argument("--intercept-column",
                    help="a constant column (the intercept of a sketch study without bounds)")
    lg.add_argument("--no-intercept", action="store_true", help="fit through the origin")
    lg.add_argument("--calibration", choices=["gaussian", "taylor"],
                    help="gaussian (default): scale and intercept from the within-class score law; taylor: "
                    "the Taylor-at-0 surrogate's minimiser (docs/logistic.md)")
    lg.add_argument("--no-debias", action="store_true", help="do not subtract the known noise energy")
    _output_option(lg)
    ld = sub.add_parser("lad", help="robust regression (least absolute deviations, Huber rounds) on a released "
                        "gram or moments study, or LAD on an l1 study (docs/lad.md)",
                        description="On a gram or moments study: one round of Huber iteratively reweighted least "
                        "squares (docs/lad.md); the answer's next_weights (save it with --output json) go to the "
                        "data owners for the next round's rows and back here with --weights. On an l1 study: LAD "
                        "on the l1 sketch.")
    ld.add_argument("study_id", help="the study id")
    ld.add_argument("--label", help="the label column (default: the study's label)")
    ld.add_argument("--weights", metavar="JSON",
                    help="gram or moments study: the round weights its rows were weighted with (a file holding "
                    "the previous round's answer or its next_weights); absent for round 1")
    ld.add_argument("--tuning", type=float,
                    help="gram or moments study: the next round's Huber threshold in residual rms (default: 1)")
    ld.add_argument("--alpha", type=float, help="l1 study: l1 penalty on the coefficients (default: 0)")
    ld.add_argument("--noise-correction", choices=["none", "calibrate"],
                    help="l1 study: calibrate undoes the noise's shrinkage by regression calibration (default: none)")
    _output_option(ld)
    wr = sub.add_parser("weight-rows", help="a data owner's rows for the next round of `study lad` (local, "
                        "no analyzer)", description="Map each row of IN (a CSV with a header naming the "
                        "columns) into the row ball with the constant column _1 and multiply it by its Huber "
                        "weight under the published round weights (analyzer.analyses.lad_rounds.weighted_rows; docs/lad.md). "
                        "Submit OUT to the next round's study (a moments study over the columns and _1, no bounds).")
    wr.add_argument("--weights", required=True, metavar="JSON", help="the round's weights (the previous "
                    "`dpsketch study lad` answer or its next_weights)")
    wr.add_argument("input", metavar="IN", help="CSV of raw rows (extra columns are ignored)")
    wr.add_argument("output", metavar="OUT", help="CSV to write (the columns, then _1)")
    pc = sub.add_parser("pca", help="principal components of the release (centred, in units, with bounds)")
    pc.add_argument("study_id", help="the study id")
    pc.add_argument("--n-components", "--rank", dest="n_components", type=int, required=True, metavar="R",
                    help="how many components (--rank is the older name)")
    pc.add_argument("--no-debias", action="store_true", help="do not subtract the known noise energy")
    pc.add_argument("--center", action=argparse.BooleanOptionalAction, default=None,
                    help="centre the rows first (default: whenever the study declares bounds)")
    _output_option(pc)

    h = sub.add_parser("histogram", help="a histogram study's counts and proportions with confidence intervals")
    h.add_argument("study_id", help="the study id")
    _confidence(h)
    _output_option(h)
    for name, text in [("quantiles", "quantiles of a binned numeric column"),
                       ("moments", "mean and variance of a binned numeric column"),
                       ("kendall-tau", "Kendall's tau-b between the two axes"),
                       ("auc", "AUC (Mann-Whitney U) of a score axis against a label axis"),
                       ("gini-mean-difference", "Gini's mean difference of a binned numeric column"),
                       ("gini-simpson", "Gini-Simpson diversity of a column")]:
        sp = sub.add_parser(name, help=text, description=text)
        sp.add_argument("study_id", help="the study id")
        _confidence(sp)
        _output_option(sp)
        if name in ("quantiles", "moments", "gini-mean-difference", "gini-simpson"):
            sp.add_argument("--column", help="the axis (default: the only one)")
        if name == "quantiles":
            sp.add_argument("--p", type=float, action="append", dest="probabilities",
                            help="a probability, repeatable (default: 0.25, 0.5, 0.75)")
        if name == "auc":
            sp.add_argument("--score", required=True, help="the numeric axis that scores")
            sp.add_argument("--label", required=True, help="the categorical axis holding the classes")
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


ledger_summary = cli_tables.ledger_summary


def _create(client: AnalyzerClient, args: argparse.Namespace) -> dict[str, Any]:
    from dpsketch.protocol.bounds import parse_bounds
    from dpsketch.protocol.histogram import parse_axis

    from .recommend import floor_argument

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
    if args.validity:
        extra["validity"] = True
    if args.batch_proofs:
        extra["batch_proofs"] = True
    if args.bounds:
        extra["bounds"] = parse_bounds(args.bounds)
    return client.create_study(
        name=args.name, columns=[c.strip() for c in args.columns.split(",") if c.strip()], label=args.label,
        expected_reports=args.expected_reports, epsilon=args.epsilon, delta=args.delta,
        row_bound=args.row_bound, neighbouring=args.neighbouring, t=args.t, kind=args.kind, k=args.k,
        s=args.s, min_reports=args.min_reports, **extra)


def read_weights(path: str) -> dict[str, Any]:
    """A round's weights from a JSON file: the previous `dpsketch study lad` answer (its
    next_weights member) or the weights alone."""
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--weights {path}: {exc}") from None
    if isinstance(data, dict) and isinstance(data.get("next_weights"), dict):
        data = data["next_weights"]
    if not isinstance(data, dict):
        raise ValueError(f"--weights {path}: not a JSON object")
    return data


def weight_rows_file(weights_path: str, src: str, dst: str) -> int:
    """``dpsketch study weight-rows``: the round's rows of a CSV file, written to another; returns
    how many rows."""
    import csv

    import numpy as np

    from .analyses.lad_rounds import RoundWeights, weighted_rows

    weights = RoundWeights.from_dict(read_weights(weights_path))
    try:
        with open(src, newline="") as fh:
            reader = csv.DictReader(fh)
            missing = [c for c in weights.columns if c not in (reader.fieldnames or [])]
            if missing:
                raise ValueError(f"{src} lacks the columns {missing}")
            rows = np.array([[float(r[c]) for c in weights.columns] for r in reader], dtype=np.float64)
    except OSError as exc:
        raise ValueError(f"{src}: {exc}") from None
    out = weighted_rows(rows.reshape(-1, len(weights.columns)), weights)
    with open(dst, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(weights.round_columns)
        writer.writerows([[repr(float(v)) for v in row] for row in out])
    return len(out)


def _run(client: AnalyzerClient, args: argparse.Namespace) -> dict[str, Any] | list:
    """The command's answer (the analyzer's JSON)."""
    cmd = args.command
    if cmd == "create":
        return _create(client, args)
    if cmd == "pilot":
        fields: dict[str, Any] = {"name": args.name, "expected_reports": args.expected_reports,
                                  "columns": [c.strip() for c in args.columns.split(",") if c.strip()],
                                  "delta": args.delta}
        if args.epsilon is not None:
            fields["epsilon"] = args.epsilon
        if args.population:
            fields["population"] = args.population
        return client.create_pilot(**fields)
    if cmd == "propose-bounds":
        return client.propose_bounds(args.study_id, lower=args.lower, upper=args.upper)
    if cmd == "list":
        return client.studies()
    if cmd == "ledger":
        if (args.population is None) == (args.ledger_study is None):
            raise ValueError("give a population id or --study STUDY_ID")
        return client.ledger(args.population, args.ledger_study)
    if cmd == "show":
        return client.study(args.study_id)
    if cmd == "progress":
        return client.progress(args.study_id)
    if cmd == "finalize":
        return client.finalize(args.study_id)
    if cmd == "ridge":
        return client.ridge(args.study_id, label=args.label, alpha=args.alpha, debias=not args.no_debias,
                            fit_intercept=args.intercept, confidence=args.confidence)
    if cmd == "least-squares":
        return client.least_squares(args.study_id, label=args.label, debias=not args.no_debias,
                                    fit_intercept=args.intercept, confidence=args.confidence)
    if cmd == "logistic":
        classes = None
        if args.classes is not None:
            try:
                classes = [float(v) for v in args.classes.split(",")]
            except ValueError:
                raise ValueError(f"--classes must be two numbers, e.g. 0,1; got {args.classes!r}") from None
        return client.logistic(args.study_id, label=args.label, alpha=args.alpha, classes=classes,
                               intercept_column=args.intercept_column,
                               fit_intercept=False if args.no_intercept else None,
                               calibration=args.calibration, debias=not args.no_debias)
    if cmd == "lad":
        return client.lad(args.study_id, label=args.label, alpha=args.alpha,
                          noise_correction=args.noise_correction, tuning=args.tuning,
                          weights=None if args.weights is None else read_weights(args.weights))
    if cmd == "pca":
        return client.pca(args.study_id, n_components=args.n_components, debias=not args.no_debias,
                          center=args.center)
    if cmd == "histogram":
        return client.histogram(args.study_id, confidence=args.confidence)
    fields = {k: v for k, v in vars(args).items()
              if k in ("confidence", "column", "probabilities", "score", "label", "positive") and v is not None}
    return client.statistic(args.study_id, cmd, **fields)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    output = args.output or ("table" if sys.stdout.isatty() else "json")
    if args.command == "weight-rows":  # local: the data owner's side, no analyzer
        try:
            count = weight_rows_file(args.weights, args.input, args.output)
        except ValueError as exc:
            print(f"dpsketch study: {exc}", file=sys.stderr)
            return 2
        print(f"dpsketch study: wrote {count} weighted rows to {args.output}", file=sys.stderr)
        return 0
    try:
        verify = ssl.create_default_context(cafile=args.ca_file) if args.ca_file else True
        with AnalyzerClient(args.analyzer, args.token, verify=verify) as client:
            out = _run(client, args)
    except ProblemError as exc:
        print(f"dpsketch study: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # a malformed option value, before anything was asked
        print(f"dpsketch study: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # network errors: one line, no traceback
        print(f"dpsketch study: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if args.command in ("create", "pilot"):
        print("\n".join(out.get("explanation", [])), file=sys.stderr)
    if args.command == "ledger" and output == "json":
        print(cli_tables.ledger_summary(out), file=sys.stderr)
    if output == "json":
        print(json.dumps(out, indent=2))
    elif output == "id":
        print(out["study_id"])
    elif output == "bounds":
        print(out["text"])
    else:
        print(cli_tables.render(args.command, out))
    return 0
