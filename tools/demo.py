"""``dpsketch demo``: the whole product end to end on real processes, with the paper's yardstick.

Starts N share servers and the analyzer on loopback ports (temporary SQLite files), or uses a
running cluster (``--analyzer`` and ``--servers``, as the compose demo service does); generates
the synthetic data of paper 000 section 5; submits every row through the client SDK over HTTP;
finalizes through the analyzer's REST API; runs ridge and PCA there; and prints the error ratio
to the non-private optimum of each release (by default one study of each kind: the OSNAP
sketch and the Gram sum), of the local model and of the central model, all at the same
(epsilon, delta): the user's question "how close to a trusted server, and which study kind?"
answered on the real pipeline.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
import textwrap
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dpsketch demo",
        description="Run the pipeline end to end (clients -> N share servers -> analyzer) on "
        "synthetic data and compare the release with the local and central models.",
    )
    p.add_argument("--clients", type=int, default=1_000_000, help="rows (clients) per study (default: %(default)s; about 2.5 minutes on 2 cores "
                   "for both kinds)")
    p.add_argument("--servers", default="3", help="number of share servers to start (default: 3), "
                   "or a comma-separated list of URLs of running servers (then --analyzer too)")
    p.add_argument("--analyzer", help="URL of a running analyzer (default: start one)")
    p.add_argument("--analyzer-token", default=os.environ.get("DPSKETCH_ANALYZER_TOKEN"),
                   help="the running analyzer's API token (default: $DPSKETCH_ANALYZER_TOKEN)")
    p.add_argument("--operator-tokens", default=os.environ.get("DPSKETCH_OPERATOR_TOKENS"),
                   help="with --analyzer: the running servers' operator tokens, comma-separated in "
                   "server order, to issue the demo's upload tokens as each organisation would "
                   "(default: $DPSKETCH_OPERATOR_TOKENS; without them the servers must run with "
                   "--upload-auth open)")
    p.add_argument("--analyzer-token-file", type=Path,
                   help="file holding the analyzer's API token (wins over --analyzer-token)")
    p.add_argument("--operator-token-files",
                   help="files holding the servers' operator tokens, comma-separated in server "
                   "order (wins over --operator-tokens; docker compose hands them over so)")
    p.add_argument("--d", type=int, default=10, help="feature columns (default: %(default)s)")
    p.add_argument("--rank", type=int, default=3, help="PCA rank r (default: %(default)s)")
    p.add_argument("--kind", choices=["both", "sketch", "gram"], default="both",
                   help="study kind(s) to run (default: %(default)s): sketch shares d values per "
                   "client, gram shares d + d(d+1)/2 + 1 for central-model accuracy (see: "
                   "dpsketch recommend)")
    p.add_argument("--epsilon", type=float, default=1.0, help="default: %(default)s")
    p.add_argument("--delta", type=float, default=1e-6, help="default: %(default)s")
    p.add_argument("--seed", type=int, default=0, help="synthetic data seed (default: %(default)s); "
                   "the privacy noise always comes from the OS CSPRNG")
    p.add_argument("--clip-quantile", type=float, default=0.99,
                   help="the row bound B sits at this quantile of the row norms; rows above it are "
                   "clipped, as a data owner choosing B would (default: %(default)s; 1 scales "
                   "every row inside B without clipping)")
    p.add_argument("--allow-insecure-http", action="store_true",
                   help="let the SDK send upload tokens over plain http:// to servers on other hosts "
                        "(a development cluster on a network you trust; refused by default)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--keep", action="store_true",
                   help="leave the cluster the demo started up after the demo, with its studies, until "
                   "Ctrl-C (or SIGTERM): prints the analyst console's URL and the API token to paste "
                   "into it; the temporary directory with logs and databases is kept too (with "
                   "--analyzer: only prints the console's URL)")
    return p


@dataclass
class Cluster:
    analyzer_url: str
    server_urls: list[str]
    analyzer_token: str | None
    operator_tokens: list[str]  # the demo plays every organisation: it issues the upload tokens

    def upload_tokens(self, study_id: str, rows: int) -> list[str] | None:
        """What each organisation hands the demo's data owner: a token for ``rows`` reports
        (None without the operators' tokens: then the servers must take open uploads)."""
        from dpsketch.services.admin import issue_for_data_owner

        if not self.operator_tokens:
            return None
        return issue_for_data_owner(list(zip(self.server_urls, self.operator_tokens)), study_id, rows)


def _log(quiet: bool, msg: str) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def start_local_cluster(n_servers: int, workdir: Path, stack: ExitStack) -> Cluster:
    from dpsketch.tools.cluster import ServerSpec, analyzer, share_server, start_all

    specs = [
        ServerSpec(f"s{j + 1}", secrets.token_urlsafe(16), secrets.token_urlsafe(16),
                   workdir / f"s{j + 1}.sqlite3")
        for j in range(n_servers)
    ]
    procs = [share_server(spec, workdir) for spec in specs]
    for proc in procs:
        stack.callback(proc.stop)
    start_all(procs)
    api_token = secrets.token_urlsafe(24)
    config = {  # the analyzer gets analyst tokens only: it cannot issue upload tokens
        "servers": [
            {"server_id": s.server_id, "url": p.url, "analyst_token": s.analyst_token}
            for s, p in zip(specs, procs)
        ],
        "api_token": api_token,
    }
    config_path = workdir / "cluster.json"
    config_path.write_text(json.dumps(config))
    config_path.chmod(0o600)
    an = analyzer(config_path, workdir / "analyzer.sqlite3", workdir)
    stack.callback(an.stop)
    an.start()
    return Cluster(an.url, [p.url for p in procs], api_token, [s.operator_token for s in specs])


def run_study(cluster: Cluster, task: str, kind: str, data: Any, args: argparse.Namespace,
              quiet: bool, references: bool = True) -> dict[str, Any]:
    """Create a study for one synthetic data set, submit it, finalize, analyse, compare (with the
    local and central references only if ``references``: they depend on the data, not the kind)."""
    from tqdm import tqdm

    from dpsketch.analyzer.client import AnalyzerClient
    from dpsketch.analyzer.error_ratios import compare, default_alpha
    from dpsketch.analyzer.release import release_from_values
    from dpsketch.client_sdk import Client
    from dpsketch.protocol import Study

    n = data.rows.shape[0]
    with AnalyzerClient(cluster.analyzer_url, cluster.analyzer_token) as an:
        created = an.create_study(
            name=f"demo-{task}-{kind}", columns=data.columns, label=data.label, expected_reports=n,
            epsilon=args.epsilon, delta=args.delta, row_bound=data.row_bound,
            min_reports=n, kind=kind,
        )
        study_id = created["study_id"]
        tag = f"{task}, {kind}"
        _log(quiet, f"\n[{tag}] study {study_id[:16]}...")
        for line in created["explanation"]:
            _log(quiet, "  " + line)
        t0 = time.perf_counter()
        tokens = cluster.upload_tokens(study_id, n)
        with Client(cluster.server_urls, token=tokens,
                    allow_insecure_http=getattr(args, "allow_insecure_http", False)) as client, tqdm(
            total=n, unit="rows", disable=quiet, desc=f"[{tag}] submit", file=sys.stderr
        ) as bar:
            client.submit_many(study_id, data.rows, progress=bar.update)
        upload_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        fin = an.finalize(study_id)
        finalize_s = time.perf_counter() - t0
        _log(quiet, f"[{tag}] uploaded {n} rows in {upload_s:.1f}s; finalized over "
                    f"{fin['n_reports']} reports in {finalize_s:.1f}s")
        sketch_view = an.sketch(study_id)
        study = Study.model_validate(created["study"])
        release = release_from_values(study, np.asarray(sketch_view["sketch"]), sketch_view["n_reports"])
        # The analyst's answers come from the analyzer's REST API; the comparison re-fits the
        # same release next to simulated local and central releases of the same rows, with the
        # same ridge penalty, so all three ratios are measured the same way.
        if task == "ridge":
            alpha = default_alpha(n, data.row_bound)
            served = an.ridge(study_id, label=data.label, alpha=alpha)
            ratios = compare(data, study, release, alpha=alpha, tasks=("ridge",),
                             references=references)["ridge"]
            result: dict[str, Any] = {**ratios, "alpha": alpha, "coef": served["coef"]}
        else:
            served = an.pca(study_id, n_components=args.rank)
            ratios = compare(data, study, release, rank=args.rank, tasks=("pca",),
                             references=references)["pca"]
            result = {**ratios, "rank": args.rank, "explained_variance": served["explained_variance"]}
        result.update(study_id=study_id, kind=kind, n_reports=fin["n_reports"], upload_seconds=upload_s,
                      finalize_seconds=finalize_s, k=study.k, sigma=study.sigma, width=study.width,
                      server_sigma=study.server_sigma, guarantees=created["guarantees"])
        return result


def _read_token(path: Path) -> str:
    try:
        token = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise SystemExit(f"dpsketch demo: cannot read the token file {path}: {exc}") from None
    if not token:
        raise SystemExit(f"dpsketch demo: the token file {path} is empty")
    return token


def hold_until_interrupted(cluster: Cluster, workdir: Path) -> None:
    """``--keep``: say where the analyst console is and with which token, then keep the cluster
    up until Ctrl-C or SIGTERM (either stops every process the demo started, as at the end of a
    demo without --keep)."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    lines = ["", "The cluster stays up (--keep). Open the analyst console:", f"  {cluster.analyzer_url}/console/"]
    if cluster.analyzer_token:
        lines.append(f"and paste the analyzer's API token: {cluster.analyzer_token}")
    lines.append(f"Share servers: {', '.join(cluster.server_urls)}")
    lines.append(f"Logs and databases: {workdir}")
    lines.append("Ctrl-C stops the cluster.")
    print("\n".join(lines), file=sys.stderr, flush=True)
    try:
        while not stop.wait(1.0):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print("stopping the cluster ...", file=sys.stderr, flush=True)


def run(args: argparse.Namespace, show=None) -> dict[str, Any]:
    """Run the demo and return its result; ``show(result)``, if given, is called while the cluster
    is still up (so ``--keep`` prints the table before it waits)."""
    from dpsketch.analyzer import synthetic

    quiet = args.json
    workdir = None
    with ExitStack() as stack:
        if args.analyzer:
            urls = [u.strip() for u in args.servers.split(",") if u.strip()]
            if len(urls) < 2:
                raise SystemExit("with --analyzer, --servers must list the share servers' URLs")
            operators = [t.strip() for t in (args.operator_tokens or "").split(",") if t.strip()]
            if args.operator_token_files:
                operators = [_read_token(Path(f.strip())) for f in args.operator_token_files.split(",") if f.strip()]
            if operators and len(operators) != len(urls):
                raise SystemExit("--operator-tokens (or --operator-token-files) needs one token per server URL")
            analyzer_token = (_read_token(args.analyzer_token_file) if args.analyzer_token_file
                              else args.analyzer_token)
            cluster = Cluster(args.analyzer, urls, analyzer_token, operators)
        else:
            if not args.servers.isdigit() or int(args.servers) < 2:
                raise SystemExit("--servers must be a number >= 2 (or URLs together with --analyzer)")
            workdir = Path(tempfile.mkdtemp(prefix="dpsketch-demo-"))
            if not args.keep:
                stack.callback(shutil.rmtree, workdir, True)
            else:
                _log(quiet, f"working directory (kept): {workdir}")
            _log(quiet, f"starting {args.servers} share servers and the analyzer ...")
            cluster = start_local_cluster(int(args.servers), workdir, stack)
        clip = None if args.clip_quantile >= 1 else args.clip_quantile
        ridge_data = synthetic.regression_data(args.clients, args.d, seed=args.seed, clip_quantile=clip)
        pca_data = synthetic.lowrank_data(args.clients, args.d, rank=args.rank, seed=args.seed + 1,
                                          clip_quantile=clip)
        kinds = ["sketch", "gram"] if args.kind == "both" else [args.kind]
        studies = {kind: {task: run_study(cluster, task, kind, data, args, quiet,
                                          references=kind == kinds[0])
                          for task, data in (("ridge", ridge_data), ("pca", pca_data))}
                   for kind in kinds}
        result = summary(args, cluster, kinds, studies)
        if show is not None:
            show(result)
        if args.keep and workdir is not None:
            hold_until_interrupted(cluster, workdir)
        elif args.keep:  # a running cluster is not the demo's to hold: just say where to look
            _log(False, f"analyst console: {cluster.analyzer_url}/console/")
    return result


def summary(args: argparse.Namespace, cluster: Cluster, kinds: list[str], studies: dict) -> dict[str, Any]:
    first = studies[kinds[0]]
    return {
        "n_reports": first["ridge"]["n_reports"],
        "servers": len(cluster.server_urls),
        "d": args.d,
        "epsilon": args.epsilon,
        "delta": args.delta,
        "kinds": kinds,
        # per task: the LTM ratio of each kind next to the local and central baselines
        **{task: {"local": first[task]["local"], "central": first[task]["central"],
                  **{kind: studies[kind][task]["ltm"] for kind in kinds}}
           for task in ("ridge", "pca")},
        "studies": studies,
    }


def render(result: dict[str, Any]) -> str:
    lines = [
        "",
        f"dpsketch demo: n = {result['n_reports']} clients, {result['servers']} share servers, "
        f"d = {result['d']}, epsilon = {result['epsilon']}, delta = {result['delta']}",
        "error ratio to the non-private optimum (1.00 = optimum; lower is better)",
        "",
        f"{'task':<8}" + "".join(f"{'LTM ' + kind:>14}" for kind in result["kinds"])
        + f"{'local model':>14}{'central model':>15}",
    ]
    for task, name in (("ridge", "ridge"), ("pca", "PCA")):
        r = result[task]
        lines.append(f"{name:<8}" + "".join(f"{r[kind]:>14.3f}" for kind in result["kinds"])
                     + f"{r['local']:>14.3f}{r['central']:>15.3f}")
    lines.append("")
    for kind in result["kinds"]:
        study = result["studies"][kind]["ridge"]
        if kind == "sketch":
            note = (f"LTM sketch: each client shares its row plus a little noise; the servers apply "
                    f"the OSNAP sketch (k = {study['k']} rows).")
        else:
            note = (f"LTM gram: each client shares [a, u(a a^T), 1] ({study['width']} values) plus "
                    f"a little noise; the servers sum them: the central model's A^T A, inside the LTM.")
        lines.append(textwrap.fill(note, 100, subsequent_indent="  "))
    first = result["studies"][result["kinds"][0]]["ridge"]
    if first.get("guarantees"):
        g = first["guarantees"]
        floor = g["floor_epsilon"]
        lines.append(textwrap.fill(
            f"Each server adds its own noise (server_sigma = {first['server_sigma']:.3g}): every report "
            f"is ({g['epsilon']:.3g}, {result['delta']:g})-DP with the other honest reports, and "
            + (f"{floor:.3g}-DP" if floor is not None else "has no guarantee")
            + " even if all other reports are an adversary's and all servers but one collude.",
            100, subsequent_indent="  "))
    lines.append(textwrap.fill("local: each client adds sigma_local, no sketch; central: a trusted "
                               "server adds noise to A^T A (SSP for ridge, Analyze-Gauss for PCA).",
                               100, subsequent_indent="  "))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def show(result: dict[str, Any]) -> None:
        print(json.dumps(result) if args.json else render(result), flush=True)

    run(args, show)
    return 0
