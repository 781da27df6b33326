"""A peer side by side: Flower's SecAgg+ and dpsketch's plain sum over the same vectors.

Each of n clients holds one vector of d values (row i comes from its own seeded generator, so
both sides and every Ray worker rebuild exactly the same rows; every row has L2 norm below 1, so
every value lies in [-1, 1]). Both systems must deliver the sum of the n vectors to one party:

* Flower (``flwr``, the simulation runtime, in the optional extra ``peer``): one round of the
  legacy ``DefaultWorkflow`` whose fit stage is ``SecAggPlusWorkflow``; every ClientApp carries
  ``secaggplus_mod`` and returns its vector with weight 1 (``max_weight`` = 1, so the weights
  quantize exactly), the server unmasks the mean and the sum is n times it. Values are clipped to
  [-1, 1] (``clipping_range`` = 1, the same bound dpsketch's rows have) and the quantization
  range is Flower's default 2^22 while n * 2^22 fits the 2^32 modulus, else floor((2^32 - 1) / n):
  with the default the unmasked sum wraps from n = 1024 on.
* dpsketch: a real local cluster (3 share servers and the analyzer, each its own uvicorn
  process on a loopback port, temporary SQLite files), a plain-sum study (kind ``sketch`` with
  k = s = 1: one output row, every sign +1) without server noise (``epsilon_floor`` None, on
  servers started with ``DPSKETCH_MAX_FLOOR_EPSILON=none`` and no population budget, since the
  run makes a study per path and size). Three upload paths, each in a fresh
  study and both timed from the first upload to the released sum at the analyzer:
  ``single``: every client is its own ``client_sdk.Client`` with its own upload tokens,
  connections and TLS setup and calls ``submit`` once (it fetches and checks the study at every
  server, then posts its share to each: 2 N = 6 HTTP requests), ``--workers`` at a time over
  ``--client-processes`` processes (``one_row_clients`` says what they share); ``relay``: every
  client is its own ``client_sdk.relayed.RelayClient`` with its own upload tokens and the
  enrolment a device holds (the study and each server's HPKE key, read from the servers before
  the clock starts, as the tokens are), and sends its row's sealed shares in one request to a
  ``dpsketch relay`` in front of the servers (docs/relay.md), the same workers and processes;
  ``bulk``: one ``Client.submit_many`` of all n rows. ``--fresh-processes`` adds one-row clients
  that are each a new Python process, as a device that starts and submits is.
* the bare-HTTP floor (``--paths floor``): the single path's clients, processes and threads
  sending 1 request, N POSTs, or N GETs and N POSTs each to N servers that only read and answer
  (``floor_app``): no design sending that many requests per client is faster on this machine,
  so Flower's round over a floor bounds what such a design could reach.

Correctness is checked on both sides: Flower's sum against the true sum (max abs error, from its
stochastic quantization); dpsketch's release against the exact ring sum of what the clients sent
(it must be equal bit for bit) and against the true sum in units of its noise sd sqrt(n) sigma
(the clients' Gaussian noise at epsilon = 1, delta = 1e-6 is part of the protocol).

Run it from the product's venv with Flower in a venv of its own (``pip install -e '.[peer]'``
there: Flower pins older FastAPI and uvicorn than the servers use), both sides interleaved::

    python benchmarks/peer_flower.py --n 1000 --workers 64 --client-processes 2 --cold-check \
        --paths single,relay,bulk,floor --reps 3 --flower-python /tmp/peer-venv/bin/python --write-docs docs/peer.md

``--skip-flower`` measures dpsketch alone with the product's own dependencies. Each repetition
measures every system at every n before the next starts, with the load average recorded beside
each run; the table gives medians and ranges, and ratios within a repetition.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a file from a checkout
    sys.path.insert(0, str(ROOT))

#: the Flower masks live in Z_(2^32) (SecAggPlusWorkflow: modulus_range must stay below 2^32 + 1)
FLOWER_MODULUS = 1 << 32
#: Flower's default quantization range
FLOWER_DEFAULT_QRANGE = 1 << 22
#: HTTP requests a one-row plaintext client sends each server: GET the study, POST its share
REQUESTS_PER_SERVER = 2
TABLE_START = "<!-- peer-table:start -->"
TABLE_END = "<!-- peer-table:end -->"
MISSING_FLWR = ("Flower is not installed: the Flower side of this benchmark needs the optional extra "
                "'peer' (pip install -e '.[peer]', best in a separate venv); "
                "or run with --skip-flower to measure dpsketch alone")


# --- the vectors --------------------------------------------------------------------------------


def row(seed: int, i: int, d: int) -> np.ndarray:
    """Client i's vector: a uniform direction times a radius uniform in [0, 0.999)."""
    rng = np.random.default_rng([seed, i])
    v = rng.standard_normal(d)
    return v * (0.999 * rng.random() / np.linalg.norm(v))


def rows(seed: int, n: int, d: int) -> np.ndarray:
    return np.stack([row(seed, i, d) for i in range(n)])


# --- Flower SecAgg+ ----------------------------------------------------------------------------


def have_flwr() -> bool:
    from importlib import import_module

    try:
        return all(hasattr(import_module(module), name) for module, name in (
            ("flwr.server.workflow", "SecAggPlusWorkflow"), ("flwr.simulation", "run_simulation"),
            ("flwr.client.mod", "secaggplus_mod")))
    except ImportError:
        return False


def flower_quantization_range(n: int) -> int:
    """Flower's default 2^22 while n * 2^22 fits the modulus; else the largest q with n q < 2^32.

    Every client adds its weight factor q (and values in [0, q]) before masking, so the unmasked
    sum is exact only while n q < 2^32: at the default, only below n = 1024."""
    return min(FLOWER_DEFAULT_QRANGE, (FLOWER_MODULUS - 1) // n)


def run_flower(n: int, d: int, seed: int, num_shares: int, threshold: int, cpus_per_client: float,
               workdir: Path, verbose: bool = False) -> dict[str, Any]:
    """One SecAgg+ round over n simulated clients; the sum, the times, the settings."""
    from flwr.client import ClientApp, NumPyClient
    from flwr.client.mod import secaggplus_mod
    from flwr.common import Context, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server import LegacyContext, ServerApp, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
    from flwr.simulation import run_simulation

    qrange = flower_quantization_range(n)
    out: dict[str, Any] = {}

    class VectorClient(NumPyClient):
        def __init__(self, i: int):
            self.i = i

        def get_parameters(self, config):
            return [np.zeros(d)]

        def fit(self, parameters, config):
            return [row(seed, self.i, d)], 1, {}  # weight 1: the unmasked mean times n is the sum

    def client_fn(context: Context):
        return VectorClient(int(context.node_config["partition-id"])).to_client()

    class Capture(FedAvg):
        """FedAvg that also keeps what SecAgg+ unmasked (every result carries the same mean)."""

        def aggregate_fit(self, server_round, results, failures):
            if results:
                out["mean"] = parameters_to_ndarrays(results[0][1].parameters)[0]
                out["n_results"] = len(results)
            out["failures"] = len(failures)
            return super().aggregate_fit(server_round, results, failures)

    secagg = SecAggPlusWorkflow(num_shares=num_shares, reconstruction_threshold=threshold,
                                max_weight=1.0, clipping_range=1.0, quantization_range=qrange,
                                modulus_range=FLOWER_MODULUS)

    def timed_fit(grid, context) -> None:
        t0 = time.perf_counter()
        secagg(grid, context)
        out["secagg_seconds"] = time.perf_counter() - t0

    server_app = ServerApp()

    @server_app.main()
    def main(grid, context: Context) -> None:
        strategy = Capture(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=n,
                           min_evaluate_clients=0, min_available_clients=n,
                           initial_parameters=ndarrays_to_parameters([np.zeros(d)]))
        legacy = LegacyContext(context=context, config=ServerConfig(num_rounds=1), strategy=strategy)
        DefaultWorkflow(fit_workflow=timed_fit)(grid, legacy)

    client_app = ClientApp(client_fn=client_fn, mods=[secaggplus_mod])
    backend = {"client_resources": {"num_cpus": cpus_per_client, "num_gpus": 0.0},
               "init_args": {"logging_level": "error", "log_to_driver": False,
                             "_temp_dir": str(workdir / "ray")}}
    t0 = time.perf_counter()
    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=n,
                   backend_config=backend, verbose_logging=verbose)
    out["total_seconds"] = time.perf_counter() - t0
    if "mean" not in out:
        raise RuntimeError("Flower's SecAgg+ round returned no aggregate (see its log above)")
    got = out.pop("mean") * n
    truth = rows(seed, n, d).sum(axis=0)
    step = 2.0 / qrange  # one quantization step of clipping range 1
    return {
        "system": "flower-secagg+",
        "n": n, "d": d,
        "seconds": out["secagg_seconds"],
        "total_seconds": out["total_seconds"],
        "clients_aggregated": out.get("n_results"),
        "failures": out.get("failures"),
        "num_shares": num_shares, "reconstruction_threshold": threshold,
        "clipping_range": 1.0, "quantization_range": qrange, "modulus_range": FLOWER_MODULUS,
        "max_abs_error": float(np.max(np.abs(got - truth))),
        "quantization_step": step,
        "flwr_version": __import__("flwr").__version__,
    }


# --- dpsketch ----------------------------------------------------------------------------------


class LocalCluster:
    """3 share servers (exact-release policy) and the analyzer on loopback ports."""

    def __init__(self, workdir: Path, n_servers: int = 3, relay_window_ms: float | None = None,
                 relay_max_entries: int | None = None):
        self.workdir = workdir
        self.n_servers = n_servers
        self.relay_window_ms = relay_window_ms
        self.relay_max_entries = relay_max_entries
        self.stack = contextlib.ExitStack()

    def __enter__(self) -> "LocalCluster":
        from dpsketch.tools.cluster import ServerSpec, analyzer, share_server, start_all

        self.specs = [ServerSpec(f"s{j + 1}", secrets.token_urlsafe(16), secrets.token_urlsafe(16),
                                 self.workdir / f"s{j + 1}.sqlite3") for j in range(self.n_servers)]
        # the servers' policy must accept a study without a noise floor (its release is exact),
        # and a study per path and size of one population: no population budget (issue 41 made
        # one the default; the benchmark's synthetic rows are nobody's data)
        # (and any min_reports from 2 on: the dry-run test sums 5 clients' rows; a server's
        # default floor of 50 is a privacy policy, which synthetic rows do not need)
        env = {"DPSKETCH_MAX_FLOOR_EPSILON": "none", "DPSKETCH_POPULATION_EPSILON": "none",
               "DPSKETCH_POPULATION_FLOOR_EPSILON": "none", "DPSKETCH_MIN_REPORTS": "2"}
        procs = [share_server(s, self.workdir, env) for s in self.specs]
        for p in procs:
            self.stack.callback(p.stop)
        start_all(procs)
        self.server_urls = [p.url for p in procs]
        self.api_token = secrets.token_urlsafe(24)
        config = {"servers": [{"server_id": s.server_id, "url": p.url, "analyst_token": s.analyst_token}
                              for s, p in zip(self.specs, procs)],
                  "api_token": self.api_token}
        path = self.workdir / "cluster.json"
        path.write_text(json.dumps(config))
        path.chmod(0o600)
        an = analyzer(path, self.workdir / "analyzer.sqlite3", self.workdir)
        self.stack.callback(an.stop)
        an.start()
        self.analyzer_url = an.url
        self._relay_url: str | None = None
        return self

    def relay_url(self) -> str:
        """A relay in front of the servers, started on first use: ``dpsketch relay`` as shipped
        (its own default window and group size) unless the cluster's ``relay_window_ms`` or
        ``relay_max_entries`` says otherwise."""
        if self._relay_url is None:
            from dpsketch.tools.cluster import relay

            proc = relay({s.server_id: u for s, u in zip(self.specs, self.server_urls)}, self.workdir, None,
                         *(("--window", str(self.relay_window_ms)) if self.relay_window_ms is not None else ()),
                         *(("--max-entries", str(self.relay_max_entries)) if self.relay_max_entries else ()))
            self.stack.callback(proc.stop)
            proc.start()
            self._relay_url = proc.url
        return self._relay_url

    def enrolment(self, study_id: str) -> str:
        """A device's enrolment (client_sdk.relayed), read from the servers themselves, as JSON."""
        import dpsketch.client_sdk.client as sdk
        from dpsketch.client_sdk.relayed import enrol

        with sdk.Client(self.server_urls, encrypt=True, journal=False) as client:
            return enrol(client, study_id).to_json()

    def __exit__(self, *exc: object) -> None:
        self.stack.close()

    def issue_tokens(self, study_id: str, count: int, quota: int) -> list[list[str]]:
        """``count`` upload tokens from every server (what each organisation hands its enrolled
        clients): tokens[j][i] is client i's token at server j."""
        from dpsketch.services.admin import ServerAdmin

        out = []
        for url, spec in zip(self.server_urls, self.specs):
            with ServerAdmin(url, spec.operator_token) as admin:
                out.append(admin.issue_upload_tokens(study_id, count, quota).tokens)
        return out


@contextlib.contextmanager
def shares_sent(n_servers: int, d: int):
    """Record every batch the SDK prepares in this process (a direct Client's and a RelayClient's);
    yields a list that holds, on exit, the ring sum (uint64, d) of the shares those batches
    carried: what the servers must add up."""
    import dpsketch.client_sdk.client as sdk
    import dpsketch.client_sdk.relayed as relayed_sdk
    from dpsketch.protocol import ring

    sent: list = []
    real_prepare, lock = sdk.prepare_batch, threading.Lock()

    def recording(study_, rows_, *args, **kwargs):  # whatever the SDK passes (full, stream, ...)
        batch = real_prepare(study_, rows_, *args, **kwargs)
        with lock:
            sent.append(batch)
        return batch

    sdk.prepare_batch = relayed_sdk.prepare_batch = recording
    out: list[np.ndarray] = []
    try:
        yield out
    finally:
        sdk.prepare_batch = relayed_sdk.prepare_batch = real_prepare
        total = np.zeros(d, dtype=np.uint64)
        for batch in sent:
            total += ring.reconstruct([batch.share(j) for j in range(n_servers)]).sum(axis=0, dtype=np.uint64)
        out.append(total)


def _relay_info(url: str) -> dict[str, Any]:
    """The relay's ``GET /v1/relay``: its counters (``bundles_forwarded``, ``entries_forwarded``)
    and settings (``window_s``, ``max_entries``)."""
    import httpx

    return httpx.get(f"{url}/v1/relay", timeout=10).json()


def _each_device(one: Any, n: int, threads: int, n_servers: int, d: int, progress: str | None) -> np.ndarray:
    """``one(i)`` for every device i, ``threads`` at a time; the ring sum of every share sent."""
    t0 = time.perf_counter()
    with shares_sent(n_servers, d) as total, ThreadPoolExecutor(max_workers=threads) as pool:
        for done, _ in enumerate(pool.map(one, range(n)), 1):
            if progress and done % max(1, n // 10) == 0:
                print(f"  {progress}: {done}/{n} clients ({time.perf_counter() - t0:.1f}s)", file=sys.stderr,
                      flush=True)
    return total[0]


def one_row_clients(urls: list[str], study_id: str, tokens: list[list[str]], data: np.ndarray, threads: int,
                    cold_check: bool, n_servers: int, progress: str | None = None) -> np.ndarray:
    """Client i (its own ``Client``, tokens[i] its own token per server) submits data[i], ``threads``
    clients at a time; the ring sum of every share they sent.

    Each client does everything a real one-row client does, with its own tokens, connections and
    TLS setup: fetch the study from every server and check it, prepare its row, upload a share to
    each server. What clients of one process share: the loaded code, and (without
    ``cold_check``) the process's memory of studies it has verified (client_sdk/verified.py) and
    its accounting cache; with ``cold_check`` both are cleared before each client."""
    import dpsketch.client_sdk.client as sdk
    from dpsketch.client_sdk import verified
    from dpsketch.protocol import accounting

    def one(i: int) -> None:
        if cold_check:
            verified.forget()
            accounting.report_epsilon.cache_clear()
        with sdk.Client(urls, token=tokens[i], journal=False) as client:
            client.submit(study_id, data[i])

    return _each_device(one, len(data), threads, n_servers, data.shape[1], progress)


def one_row_relay_clients(relay_url: str, enrolment_json: str, tokens: list[list[str]], data: np.ndarray,
                          threads: int, cold_check: bool, n_servers: int, progress: str | None = None) -> np.ndarray:
    """Client i (its own ``RelayClient``, tokens[i] its own token per server) submits data[i]
    through the relay in one request, ``threads`` clients at a time; the ring sum of every share
    they sent. Each device holds its enrolment (the study and each server's HPKE key, read from
    the servers before the clock starts, as its upload tokens were); with ``cold_check`` every
    device parses and checks it again (the study's hash, its guarantee) as a fresh one would."""
    from dpsketch.client_sdk import verified
    from dpsketch.client_sdk.relayed import Enrolment, RelayClient
    from dpsketch.protocol import accounting

    held = Enrolment.from_json(enrolment_json)

    def one(i: int) -> None:
        enrolment = held
        if cold_check:
            verified.forget()
            accounting.report_epsilon.cache_clear()
            enrolment = Enrolment.from_json(enrolment_json)
            enrolment.study.guarantees()
        with RelayClient(relay_url, enrolment, tokens[i]) as client:
            client.submit(data[i])

    return _each_device(one, len(data), threads, n_servers, data.shape[1], progress)


def _client_process_ready(_: int = 0) -> int:
    """Run in each client process before the clock starts: the SDK loaded (a device has it
    installed and running), nothing about the study known."""
    import dpsketch.client_sdk.client  # noqa: F401

    time.sleep(0.5)  # hold this worker so that the next warm-up task starts the next process
    return os.getpid()


def client_processes(stack: contextlib.ExitStack, processes: int) -> Any:
    """``processes`` client processes (spawned, each with the SDK loaded: _client_process_ready)
    before the clock starts, closed with ``stack``; None for one, which runs in this process."""
    if processes <= 1:
        return None
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    pool = stack.enter_context(ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")))
    assert len(set(pool.map(_client_process_ready, range(processes)))) == processes
    return pool


def _client_process(job: tuple) -> np.ndarray:
    return one_row_clients(*job)


def _relay_client_process(job: tuple) -> np.ndarray:
    return one_row_relay_clients(*job)


#: what one fresh device runs: a new Python process that imports the SDK, makes a Client with its
#: own tokens, and submits its one row (study fetched from every server and checked, row prepared,
#: a share uploaded to each); it prints its own phase times
FRESH_CLIENT = """
import json, sys, time
t0 = time.perf_counter()
from dpsketch.client_sdk import Client
t1 = time.perf_counter()
urls, tokens, study_id, row = json.loads(sys.argv[1])
with Client(urls, token=tokens, journal=False) as client:
    study = client.study(study_id)
    t2 = time.perf_counter()
    client.submit(study_id, row)
t3 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "study": t2 - t1, "submit": t3 - t2}))
"""


def run_fresh_clients(cluster: LocalCluster, k: int, d: int, seed: int, epsilon: float, delta: float) -> dict[str, Any]:
    """k one-row clients, one after another, each a fresh process (FRESH_CLIENT): wall and CPU time
    per device, the interpreter's start included, with each phase's median."""
    from dpsketch.analyzer.client import AnalyzerClient
    from dpsketch.protocol import Study

    with AnalyzerClient(cluster.analyzer_url, cluster.api_token) as an:
        created = an.create_study(name=f"peer-fresh-{k}", columns=[f"x{c}" for c in range(d)], label=None,
                                  expected_reports=max(k, 2), min_reports=max(k, 2), kind="sketch", k=1, s=1,
                                  epsilon=epsilon, delta=delta, row_bound=1.0, epsilon_floor=None)
    study_id = Study.model_validate(created["study"]).study_id
    tokens = cluster.issue_tokens(study_id, k, 1)
    data = rows(seed, k, d)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    walls, cpus, phases = [], [], []
    load0 = os.getloadavg()[0]
    for i in range(k):
        job = json.dumps([cluster.server_urls, [t[i] for t in tokens], study_id, data[i].tolist()])
        before = os.times()
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", FRESH_CLIENT, job], cwd=ROOT, env=env,
                              capture_output=True, text=True)
        walls.append(time.perf_counter() - t0)
        after = os.times()
        if done.returncode:
            raise RuntimeError(f"a fresh client failed: {done.stderr[-2000:]}")
        cpus.append(after.children_user - before.children_user + after.children_system - before.children_system)
        phases.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return {"system": "dpsketch-fresh-process", "n": k, "d": d, "wall_seconds": float(np.median(walls)),
            "cpu_seconds": float(np.median(cpus)),
            **{f"{name}_seconds": float(np.median([p[name] for p in phases])) for name in phases[0]},
            "load_before": load0, "load_after": os.getloadavg()[0]}


def run_dpsketch(cluster: LocalCluster, path: str, data: np.ndarray, epsilon: float, delta: float,
                 workers: int = 1, progress: bool = True, cold_check: bool = False,
                 processes: int = 1) -> dict[str, Any]:
    """One plain-sum study over ``data`` through path ``single`` or ``bulk``; times and checks.

    ``single`` runs ``workers`` clients at a time, in ``processes`` client processes (each
    ``workers / processes`` threads; real clients run on machines of their own, and one Python
    process serialises its threads' Python code)."""
    import dpsketch.client_sdk.client as sdk
    from dpsketch.analyzer.client import AnalyzerClient
    from dpsketch.protocol import Study, ring

    n, d = data.shape
    with AnalyzerClient(cluster.analyzer_url, cluster.api_token) as an:
        created = an.create_study(name=f"peer-{path}-{n}", columns=[f"x{c}" for c in range(d)],
                                  label=None, expected_reports=n, min_reports=n, kind="sketch", k=1, s=1,
                                  epsilon=epsilon, delta=delta, row_bound=1.0, epsilon_floor=None)
    study = Study.model_validate(created["study"])
    assert study.k == 1 and study.s == 1 and study.server_sigma == 0 and study.kind == "sketch"
    study_id = study.study_id
    one_row = path in ("single", "relay")
    # enrolment, not timed: one token per client and server (single, relay), one per server (bulk);
    # a relay's device also holds the study and the servers' keys, read from the servers
    tokens = cluster.issue_tokens(study_id, n if one_row else 1, 1 if one_row else n)
    per_client = [[t[i] for t in tokens] for i in range(len(tokens[0]))]
    enrolment = cluster.enrolment(study_id) if path == "relay" else None
    relay_url = cluster.relay_url() if path == "relay" else None
    requests = 0
    processes = max(1, min(processes, workers, n)) if one_row else 1
    relayed0 = _relay_info(relay_url) if relay_url else None
    totals: list[np.ndarray] = []
    with contextlib.ExitStack() as stack:
        pool = client_processes(stack, processes)
        load0 = os.getloadavg()[0]
        t0 = time.perf_counter()
        if path == "single" and processes > 1:
            threads = max(1, workers // processes)
            jobs = [(cluster.server_urls, study_id, per_client[k::processes], data[k::processes], threads,
                     cold_check, study.n_servers) for k in range(processes)]
            totals.extend(pool.map(_client_process, jobs))
        elif path == "single":
            totals.append(one_row_clients(cluster.server_urls, study_id, per_client, data, workers, cold_check,
                                          study.n_servers, "single" if progress else None))
        elif path == "relay" and processes > 1:
            threads = max(1, workers // processes)
            jobs = [(relay_url, enrolment, per_client[k::processes], data[k::processes], threads, cold_check,
                     study.n_servers) for k in range(processes)]
            totals.extend(pool.map(_relay_client_process, jobs))
        elif path == "relay":
            totals.append(one_row_relay_clients(relay_url, enrolment, per_client, data, workers, cold_check,
                                                study.n_servers, "relay" if progress else None))
        elif path == "bulk":
            with shares_sent(study.n_servers, d) as total:
                with sdk.Client(cluster.server_urls, token=per_client[0]) as client:
                    client.submit_many(study_id, data)
            totals.extend(total)
        else:
            raise ValueError(f"unknown path {path!r}")
        if path == "single":
            requests = n * REQUESTS_PER_SERVER * study.n_servers  # per client and server: GET study, POST
        elif path == "relay":
            requests = n  # one per client, to the relay
        upload_s = time.perf_counter() - t0
        with AnalyzerClient(cluster.analyzer_url, cluster.api_token) as an:
            fin = an.finalize(study_id)
            released = np.asarray(an.sketch(study_id)["sketch"], dtype=np.float64).reshape(-1)
        seconds = time.perf_counter() - t0
    load1 = os.getloadavg()[0]
    assert fin["n_reports"] == n, fin
    bundles = None
    if relay_url and relayed0:
        after = _relay_info(relay_url)
        sent = after["bundles_forwarded"] - relayed0["bundles_forwarded"]
        bundles = sent, (after["entries_forwarded"] - relayed0["entries_forwarded"]) / max(1, sent)

    total = np.sum(totals, axis=0, dtype=np.uint64)  # wraps mod 2^64, as the servers' sums do
    exact = ring.decode(total[None, :], study.frac_bits).reshape(-1)
    truth = data.sum(axis=0)
    noise_sd = math.sqrt(n) * study.sigma
    err = released - truth
    return {
        "system": f"dpsketch-{path}",
        "n": n, "d": d,
        "seconds": seconds,
        "upload_seconds": upload_s,
        "finalize_seconds": seconds - upload_s,
        "http_requests_per_client": (REQUESTS_PER_SERVER * study.n_servers if path == "single"
                                     else 1 if path == "relay" else None),
        "http_requests": requests or None,
        "relay_bundles": bundles[0] if bundles else None,  # what the relay sent the servers
        "relay_entries_per_bundle": bundles[1] if bundles else None,
        "relay_window_ms": relayed0["window_s"] * 1000 if relayed0 else None,  # the relay's settings in this run
        "relay_max_entries": relayed0["max_entries"] if relayed0 else None,
        "workers": workers if one_row else None,
        "cold_check": cold_check if one_row else None,
        "client_processes": processes if one_row else None,
        "load_before": load0, "load_after": load1,
        "epsilon": epsilon, "delta": delta, "sigma": study.sigma, "frac_bits": study.frac_bits,
        "release_equals_ring_sum": bool(np.array_equal(released, exact)),
        "max_abs_error_vs_ring_sum": float(np.max(np.abs(released - exact))),
        "noise_sd": noise_sd,
        "max_abs_error": float(np.max(np.abs(err))),
        "max_abs_error_in_sd": float(np.max(np.abs(err)) / noise_sd),
        "rms_error_in_sd": float(np.sqrt(np.mean(err**2)) / noise_sd),
        "fastapi_version": __import__("fastapi").__version__,
        "uvicorn_version": __import__("uvicorn").__version__,
    }


# --- the bare-HTTP floor ------------------------------------------------------------------------
#
# What the single path's requests cost with nothing behind them: the same client processes and
# threads, each client its own connection pools (one per server, no TLS on loopback, as the SDK
# makes them), sending requests of the single path's sizes to servers that only read each body
# and answer fixed bytes, on the same uvicorn (httptools, uvloop) as the share servers. Three
# request patterns per client: one request to one server (what a relay that forwarded many
# clients' sealed shares in one request would take from each client), one POST to each of the
# N servers (a client that already holds its study), and today's GET then POST at each server.
# No client-side work (noise, encoding, binding, study check) and no server-side work (binding,
# storage, the running totals) is in it: a design that sends that many requests per client
# cannot be faster than its floor on this machine.

#: request pattern -> what it stands for (the table's column labels)
FLOOR_PATTERNS = {"1": "1 request", "N": "N POSTs", "2N": "N GETs + N POSTs"}
#: the floor servers' GET answer size, from their environment (the study's JSON in the run)
_FLOOR_GET_BYTES = int(os.environ.get("DPSKETCH_FLOOR_GET_BYTES", "2048"))
_FLOOR_POST_ANSWER = b'{"accepted":1,"duplicates":0,"report_count":1000}'


async def floor_app(scope: dict, receive: Any, send: Any) -> None:
    """ASGI app of a floor server: read the request's body, answer 200 with fixed bytes (a GET:
    ``DPSKETCH_FLOOR_GET_BYTES`` of them; a POST: an UploadResult's size)."""
    if scope["type"] != "http":  # uvicorn runs it with --lifespan off
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    body = b"x" * _FLOOR_GET_BYTES if scope["method"] == "GET" else _FLOOR_POST_ANSWER
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


@contextlib.contextmanager
def floor_servers(workdir: Path, n_servers: int, get_bytes: int):
    """n_servers floor servers (floor_app under uvicorn with httptools and uvloop) on loopback;
    yields their URLs."""
    from dpsketch.tools.cluster import ManagedProcess, free_ports, start_all, stop_all

    env = {**os.environ, "DPSKETCH_FLOOR_GET_BYTES": str(get_bytes)}
    procs = [ManagedProcess(f"floor{j + 1}", [sys.executable, "-m", "uvicorn", "--app-dir", str(ROOT / "benchmarks"),
                                              "peer_flower:floor_app", "--host", "127.0.0.1", "--port", str(port),
                                              "--http", "httptools", "--loop", "uvloop", "--lifespan", "off",
                                              "--log-level", "warning", "--no-access-log"],
                            env, port, workdir / f"floor{j + 1}.log")
             for j, port in enumerate(free_ports(n_servers))]
    try:
        start_all(procs)
        yield [p.url for p in procs]
    finally:
        stop_all(procs)


def floor_clients(urls: list[str], pattern: str, count: int, threads: int, post_bytes: int) -> int:
    """``count`` floor clients, ``threads`` at a time: each makes its own pools and sends its
    pattern's requests one after another; returns the requests sent."""
    import httpx

    no_tls = httpx.create_ssl_context(verify=False)  # as the SDK's http-only clients share one
    body = b"x" * post_bytes
    headers = {"Content-Type": "application/json", "Authorization": "Bearer " + "t" * 43,
               "User-Agent": "dpsketch-floor"}
    plan = ([(0, "POST")] if pattern == "1" else [(j, "POST") for j in range(len(urls))] if pattern == "N"
            else [(j, "GET") for j in range(len(urls))] + [(j, "POST") for j in range(len(urls))])

    def one(_: int) -> None:
        pools = [httpx.HTTPTransport(verify=no_tls, trust_env=False) for _ in urls]
        try:
            for j, method in plan:
                request = httpx.Request(method, urls[j] + "/v1/studies/floor" + ("/reports" if method == "POST" else ""),
                                        content=body if method == "POST" else None, headers=headers)
                response = pools[j].handle_request(request)
                try:
                    response.read()
                finally:
                    response.close()
                if response.status_code != 200:
                    raise RuntimeError(f"floor server answered {response.status_code}")
                if method == "POST":  # the client reads its UploadResult, as the SDK does
                    json.loads(response.content)
        finally:
            for pool in pools:
                pool.close()

    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(one, range(count)))
    return count * len(plan)


def _floor_process(job: tuple) -> int:
    return floor_clients(*job)


def run_floor(urls: list[str], pattern: str, n: int, workers: int, processes: int, post_bytes: int,
              get_bytes: int) -> dict[str, Any]:
    """n floor clients of ``pattern``, ``workers`` at a time over ``processes`` client processes
    (as the single path runs its clients); the wall time from the first request to the last answer."""
    processes = max(1, min(processes, workers, n))
    threads = max(1, workers // processes)
    jobs = [(urls, pattern, len(range(k, n, processes)), threads, post_bytes) for k in range(processes)]
    with contextlib.ExitStack() as stack:
        pool = client_processes(stack, processes)
        load0 = os.getloadavg()[0]
        t0 = time.perf_counter()
        sent = sum(pool.map(_floor_process, jobs)) if pool is not None else floor_clients(*jobs[0])
        seconds = time.perf_counter() - t0
    return {"system": f"http-floor-{pattern}", "n": n, "seconds": seconds, "http_requests": sent,
            "http_requests_per_client": sent // n, "workers": workers, "client_processes": processes,
            "post_bytes": post_bytes, "get_bytes": get_bytes,
            "load_before": load0, "load_after": os.getloadavg()[0]}


def request_sizes(cluster: LocalCluster, d: int, epsilon: float, delta: float) -> tuple[int, int]:
    """The single path's request sizes at this d, from a study made for it: the bytes of a
    server's answer to ``GET /v1/studies/{id}`` and of one report's JSON body."""
    import httpx

    from dpsketch.analyzer.client import AnalyzerClient
    from dpsketch.client_sdk import prepare_batch
    from dpsketch.protocol import Study

    with AnalyzerClient(cluster.analyzer_url, cluster.api_token) as an:
        created = an.create_study(name=f"peer-sizes-{d}", columns=[f"x{c}" for c in range(d)], label=None,
                                  expected_reports=2, min_reports=2, kind="sketch", k=1, s=1, epsilon=epsilon,
                                  delta=delta, row_bound=1.0, epsilon_floor=None)
    study = Study.model_validate(created["study"])
    get_bytes = len(httpx.get(f"{cluster.server_urls[0]}/v1/studies/{study.study_id}").content)
    report = prepare_batch(study, rows(0, 1, d)).report(0).model_dump()
    return get_bytes, len(json.dumps(report, separators=(",", ":")).encode())


# --- the table --------------------------------------------------------------------------------


def _runs(results: list[dict[str, Any]], system: str, n: int) -> list[dict[str, Any]]:
    return [r for r in results if r["system"] == system and r["n"] == n]


def median_seconds(results: list[dict[str, Any]], system: str, n: int) -> float | None:
    times = [r["seconds"] for r in _runs(results, system, n)]
    return float(np.median(times)) if times else None


def ratios(results: list[dict[str, Any]], slow: str, fast: str, n: int) -> list[float]:
    """slow's time over fast's at n, within each repetition (the pairs measured side by side;
    results merged from another run, without a rep, pair in order)."""
    a, b = _runs(results, slow, n), _runs(results, fast, n)
    return [x["seconds"] / y["seconds"] for x, y in zip(a, b)]


def exponent(results: list[dict[str, Any]], system: str, n0: int, n1: int) -> float | None:
    """The slope of log(median time) against log(n) from n0 to n1 (1 = linear), if both were measured."""
    t0, t1 = median_seconds(results, system, n0), median_seconds(results, system, n1)
    if t0 is None or t1 is None or n0 == n1:
        return None
    return math.log(t1 / t0) / math.log(n1 / n0)


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "—" if x is None else format(x, spec)


def _spread(values: list[float], spec: str) -> str:
    """The median, and with several runs their range: "17.2 (16.0-18.1)"."""
    if not values:
        return "—"
    mid = format(float(np.median(values)), spec)
    if len(values) == 1:
        return mid
    return f"{mid} ({format(min(values), spec)}-{format(max(values), spec)})"


def render(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    fresh = [r for r in results if r["system"] == "dpsketch-fresh-process"]
    floor_ns = sorted({r["n"] for r in results if r["system"].startswith("http-floor-")})
    everything = results  # the floor's table pairs the floors with Flower's and the single path's runs
    results = [r for r in results if r["system"] != "dpsketch-fresh-process"
               and not r["system"].startswith("http-floor-")]
    ns = sorted({r["n"] for r in results})
    stacks = sorted({f"FastAPI {r['fastapi_version']}, uvicorn {r['uvicorn_version']}"
                     for r in results if "fastapi_version" in r})
    reps = max([sum(1 for r in results if r["system"] == sys_ and r["n"] == n)
                for sys_ in ("flower-secagg+", "dpsketch-single", "dpsketch-relay", "dpsketch-bulk") for n in ns] or [1])
    workers = sorted({r["workers"] for r in results if r.get("workers")})
    procs = sorted({r["client_processes"] for r in results if r.get("client_processes")})
    cold = {r.get("cold_check") for r in results if r["system"] in ("dpsketch-single", "dpsketch-relay")}
    relays = sorted({(r["relay_window_ms"], r["relay_max_entries"]) for r in results if r.get("relay_window_ms") is not None})
    lines = [
        f"d = {meta['d']}; {'one run each' if reps == 1 else f'median (range) of {reps} interleaved runs'}; "
        f"{meta['machine']}; flwr {meta.get('flwr_version') or 'not run'}; dpsketch servers on "
        f"{' / '.join(stacks) or '—'}; single and relay paths: {'/'.join(map(str, workers)) or '—'} clients at a time"
        f"{' in ' + '/'.join(map(str, procs)) + ' processes' if procs and procs != [1] else ''}"
        f"{', each checking the study itself' if cold == {True} else ''}"
        f"{''.join(f'; relay window {w:g} ms, groups of up to {m}' for w, m in relays)}; {meta['date']}",
        "",
        "| n | Flower SecAgg+ round (s) | Flower simulation total (s) | dpsketch single (s) | "
        "dpsketch relay (s) | dpsketch bulk (s) | Flower / single | Flower / relay | Flower / bulk | "
        "Flower max abs error | dpsketch release = ring sum | dpsketch max error / noise sd | load (1 min) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n in ns:
        f, s, rl, b = (_runs(results, name, n)
                       for name in ("flower-secagg+", "dpsketch-single", "dpsketch-relay", "dpsketch-bulk"))
        exact = [r["release_equals_ring_sum"] for r in s + rl + b]
        errs = [r["max_abs_error_in_sd"] for r in s + rl + b]
        loads = [x for r in f + s + rl + b for x in (r.get("load_before"), r.get("load_after")) if x is not None]
        lines.append(
            f"| {n:,} | {_spread([r['seconds'] for r in f], '.1f')} | "
            f"{_spread([r['total_seconds'] for r in f], '.1f')} | "
            f"{_spread([r['seconds'] for r in s], '.2f')} | {_spread([r['seconds'] for r in rl], '.2f')} | "
            f"{_spread([r['seconds'] for r in b], '.2f')} | "
            f"{_spread(ratios(results, 'flower-secagg+', 'dpsketch-single', n), '.1f')} | "
            f"{_spread(ratios(results, 'flower-secagg+', 'dpsketch-relay', n), '.1f')} | "
            f"{_spread(ratios(results, 'flower-secagg+', 'dpsketch-bulk', n), '.0f')} | "
            f"{_fmt(max(r['max_abs_error'] for r in f) if f else None, '.1e')} | "
            f"{('yes' if all(exact) else 'NO') if exact else '—'} | "
            f"{_fmt(max(errs) if errs else None, '.2f')} | "
            f"{f'{min(loads):.1f}-{max(loads):.1f}' if loads else '—'} |")
    if len(ns) >= 2:
        systems = [(label, name) for label, name in (("Flower SecAgg+ round", "flower-secagg+"),
                                                     ("dpsketch single", "dpsketch-single"),
                                                     ("dpsketch relay", "dpsketch-relay"),
                                                     ("dpsketch bulk", "dpsketch-bulk"))
                   if any(r["system"] == name for r in results)]
        lines += ["", "Scaling exponent of the median time in n, log(t1 / t0) / log(n1 / n0) (1 = linear):", "",
                  "| from n to n | " + " | ".join(label for label, _ in systems) + " |",
                  "|---|" + "---|" * len(systems)]
        for n0, n1 in zip(ns, ns[1:]):
            lines.append(f"| {n0:,} to {n1:,} | " + " | ".join(
                _fmt(exponent(results, name, n0, n1)) for _, name in systems) + " |")
    if floor_ns:
        lines += ["", render_floor(everything, floor_ns)]
    if fresh:
        loads = [x for r in fresh for x in (r["load_before"], r["load_after"])]
        lines += ["", f"One-row clients, each a fresh Python process, one after another ({len(fresh)} run(s) of "
                  f"{fresh[0]['n']} processes; medians per process; load {min(loads):.1f}-{max(loads):.1f}):", "",
                  "| wall (s) | CPU (s) | import the SDK (s) | Client + fetch and check the study (s) | "
                  "prepare and upload (s) |", "|---|---|---|---|---|",
                  f"| {_spread([r['wall_seconds'] for r in fresh], '.2f')} | "
                  f"{_spread([r['cpu_seconds'] for r in fresh], '.2f')} | "
                  f"{_spread([r['import_seconds'] for r in fresh], '.2f')} | "
                  f"{_spread([r['study_seconds'] for r in fresh], '.3f')} | "
                  f"{_spread([r['submit_seconds'] for r in fresh], '.3f')} |"]
    return "\n".join(lines)


def render_floor(results: list[dict[str, Any]], ns: list[int]) -> str:
    """The bare-HTTP floor's table: each pattern's time and Flower's round over it (the most any
    design sending that many requests per client could reach here), and the single path over
    the floor of its own requests; ratios within each repetition."""
    sizes = next(r for r in results if r["system"].startswith("http-floor-"))
    lines = [f"The bare-HTTP floor (the single path's clients, processes and threads; servers that only read "
             f"each body and answer: a GET {sizes['get_bytes']:,} bytes, a POST body {sizes['post_bytes']:,} "
             f"bytes; seconds, and ratios within each run):", "",
             "| n | " + " | ".join(f"floor: {label} per client (s) | Flower / it" for label in FLOOR_PATTERNS.values())
             + " | dpsketch single / its floor (N GETs + N POSTs) | load (1 min) |",
             "|---|" + "---|" * (2 * len(FLOOR_PATTERNS) + 2)]
    for n in ns:
        runs = [r for r in results if r["system"].startswith("http-floor-") and r["n"] == n]
        loads = [x for r in runs for x in (r["load_before"], r["load_after"])]
        lines.append(f"| {n:,} | " + " | ".join(
            f"{_spread([r['seconds'] for r in _runs(results, f'http-floor-{k}', n)], '.2f')} | "
            f"{_spread(ratios(results, 'flower-secagg+', f'http-floor-{k}', n), '.1f')}" for k in FLOOR_PATTERNS)
            + f" | {_spread(ratios(results, 'dpsketch-single', 'http-floor-2N', n), '.2f')}"
            f" | {min(loads):.1f}-{max(loads):.1f} |")
    return "\n".join(lines)


def write_docs(path: Path, table: str) -> None:
    """Replace the text between the table markers of ``path`` (the rest of the page is prose)."""
    text = path.read_text()
    if TABLE_START not in text or TABLE_END not in text:
        raise SystemExit(f"{path} has no {TABLE_START} ... {TABLE_END} block to replace")
    head, rest = text.split(TABLE_START, 1)
    _, tail = rest.split(TABLE_END, 1)
    path.write_text(f"{head}{TABLE_START}\n{table}\n{TABLE_END}{tail}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", default="100,1000", help="client counts, comma-separated (default: %(default)s)")
    p.add_argument("--d", type=int, default=100, help="values per client (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="vector seed (default: %(default)s)")
    p.add_argument("--paths", default="single,relay,bulk",
                   help="dpsketch paths (single, relay, bulk), and 'floor': the single path's requests against servers that only "
                   "read and answer, in three patterns per client (default: %(default)s)")
    p.add_argument("--relay-max-entries", type=int, default=None, metavar="N",
                   help="the relay path's dpsketch relay --max-entries (default: the relay's own)")
    p.add_argument("--relay-window", type=float, default=None, metavar="MS",
                   help="the relay path's dpsketch relay --window (default: the relay's own)")
    p.add_argument("--skip-flower", action="store_true", help="measure dpsketch only (no flwr needed)")
    p.add_argument("--skip-dpsketch", action="store_true", help="measure Flower only")
    p.add_argument("--num-shares", type=int, default=3,
                   help="SecAgg+ shares of each client's keys, i.e. its neighbours + 1 (default: %(default)s)")
    p.add_argument("--threshold", type=int, default=2,
                   help="SecAgg+ reconstruction threshold (default: %(default)s)")
    p.add_argument("--cpus-per-client", type=float, default=1.0,
                   help="Ray CPUs per simulated Flower client (default: %(default)s)")
    p.add_argument("--workers", type=int, default=1,
                   help="dpsketch single path: clients uploading at once (default: %(default)s, one "
                   "after another)")
    p.add_argument("--epsilon", type=float, default=1.0, help="dpsketch study (default: %(default)s)")
    p.add_argument("--delta", type=float, default=1e-6, help="dpsketch study (default: %(default)s)")
    p.add_argument("--json", metavar="FILE", help="also write every result as JSON here")
    p.add_argument("--merge", metavar="FILE", action="append", default=[],
                   help="add the results of an earlier --json run to the table (e.g. the dpsketch side "
                   "measured in the product's venv, the Flower side in the peer venv)")
    p.add_argument("--write-docs", metavar="MD", help="replace the table block of this page (docs/peer.md)")
    p.add_argument("--reps", type=int, default=1,
                   help="repetitions, interleaved: each rep measures every system at every n (default: %(default)s)")
    p.add_argument("--flower-python", metavar="PYTHON",
                   help="run the Flower side with this interpreter (a venv with the 'peer' extra), in a child "
                   "process per round, interleaved with the dpsketch side measured here")
    p.add_argument("--client-processes", type=int, default=1,
                   help="dpsketch single path: client processes the --workers clients at a time are spread over "
                   "(default: %(default)s; real clients do not share one interpreter's lock)")
    p.add_argument("--cold-check", action="store_true",
                   help="dpsketch single path: every client checks the study's guarantee itself (clears the "
                   "process's verified studies and accounting cache before each client), as a fresh device does")
    p.add_argument("--fresh-processes", type=int, default=0, metavar="K",
                   help="also run K one-row clients one after another, each a fresh Python process (a device "
                   "that starts, imports the SDK, checks the study and submits), and report their median wall "
                   "and CPU time (default: %(default)s)")
    p.add_argument("--verbose", action="store_true", help="Flower's own log")
    return p


def flower_in_child(python: str, n: int, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """One Flower round run by this script under another interpreter (a venv with the ``peer``
    extra: Flower pins older FastAPI, Starlette and uvicorn than the product's venv holds)."""
    out = workdir / f"flower-{n}-{time.monotonic_ns()}.json"
    cmd = [python, str(Path(__file__).resolve()), "--skip-dpsketch", "--n", str(n), "--d", str(args.d),
           "--seed", str(args.seed), "--num-shares", str(args.num_shares), "--threshold", str(args.threshold),
           "--cpus-per-client", str(args.cpus_per_client), "--json", str(out)]
    load0 = os.getloadavg()[0]
    done = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=None if args.verbose else subprocess.DEVNULL)
    if done.returncode:
        raise SystemExit(f"the Flower side failed under {python} (status {done.returncode}); "
                         f"run it alone with --verbose")
    res = json.loads(out.read_text())["results"][0]
    res["load_before"], res["load_after"] = load0, os.getloadavg()[0]
    return res


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    ns = [int(x) for x in args.n.split(",") if x.strip()]
    paths = [x.strip() for x in args.paths.split(",") if x.strip()]
    if any(x not in ("single", "bulk", "relay", "floor") for x in paths):
        raise SystemExit("--paths takes single, bulk, relay and/or floor")
    if "floor" in paths and args.skip_dpsketch:
        raise SystemExit("the floor path takes its request sizes from the dpsketch cluster: drop --skip-dpsketch")
    if not args.skip_dpsketch and min(ns, default=2) < 2:
        raise SystemExit("the dpsketch side needs n >= 2 (a study's min_reports exceeds t = 0 and the "
                         "release must hold more than one report)")
    flower_child = args.flower_python and not args.skip_flower
    if not args.skip_flower and not flower_child and not have_flwr():
        print(MISSING_FLWR, file=sys.stderr)
        return 2
    meta: dict[str, Any] = {
        "d": args.d,
        "machine": f"{os.cpu_count()} CPUs, Python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
        "reps": args.reps,
        "workers": args.workers,
    }
    results: list[dict[str, Any]] = []
    for name in args.merge:
        earlier = json.loads(Path(name).read_text())
        results.extend(earlier["results"])
        for key, value in earlier.get("meta", {}).items():
            meta.setdefault(key, value)

    def report(res: dict[str, Any], rep: int) -> None:
        res["rep"] = rep
        if res["system"] == "flower-secagg+":
            meta["flwr_version"] = res["flwr_version"]
        results.append(res)
        print(json.dumps(res), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1))

    def flower(n: int, rep: int) -> None:
        print(f"Flower SecAgg+, n = {n}, rep {rep + 1} ...", file=sys.stderr, flush=True)
        if flower_child:
            report(flower_in_child(args.flower_python, n, args, workdir), rep)
        else:
            report(run_flower(n, args.d, args.seed, args.num_shares, args.threshold,
                              args.cpus_per_client, workdir, args.verbose), rep)

    workdir = Path(tempfile.mkdtemp(prefix="dpsketch-peer-"))
    try:
        with contextlib.ExitStack() as stack:
            cluster = None
            if not args.skip_dpsketch:
                print("starting 3 share servers and the analyzer ...", file=sys.stderr, flush=True)
                cluster = stack.enter_context(LocalCluster(workdir, relay_window_ms=args.relay_window,
                                                                 relay_max_entries=args.relay_max_entries))
            floor_urls, sizes = None, (0, 0)
            if cluster is not None and "floor" in paths:
                sizes = request_sizes(cluster, args.d, args.epsilon, args.delta)
                print(f"starting {cluster.n_servers} floor servers (GET answers {sizes[0]} bytes, POSTs "
                      f"{sizes[1]} bytes) ...", file=sys.stderr, flush=True)
                floor_urls = stack.enter_context(floor_servers(workdir, cluster.n_servers, sizes[0]))
            # interleaved: every repetition measures each system at each n before the next one
            # starts, so a change in the machine's other load falls on both sides alike
            for rep in range(args.reps):
                for n in ns:
                    if cluster is not None:
                        data = rows(args.seed, n, args.d)
                        for path in (p for p in paths if p != "floor"):
                            print(f"dpsketch {path}, n = {n}, rep {rep + 1} ...", file=sys.stderr, flush=True)
                            report(run_dpsketch(cluster, path, data, args.epsilon, args.delta, args.workers,
                                                cold_check=args.cold_check, processes=args.client_processes), rep)
                        for pattern in FLOOR_PATTERNS if floor_urls else ():
                            print(f"bare-HTTP floor, {FLOOR_PATTERNS[pattern]} per client, n = {n}, rep {rep + 1} ...",
                                  file=sys.stderr, flush=True)
                            report(run_floor(floor_urls, pattern, n, args.workers, args.client_processes,
                                             sizes[1], sizes[0]), rep)
                    if not args.skip_flower:
                        flower(n, rep)
                if cluster is not None and args.fresh_processes:
                    print(f"dpsketch: {args.fresh_processes} fresh client processes, rep {rep + 1} ...",
                          file=sys.stderr, flush=True)
                    report(run_fresh_clients(cluster, args.fresh_processes, args.d, args.seed, args.epsilon,
                                             args.delta), rep)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    table = render(results, meta)
    print("\n" + table)
    if args.write_docs:
        write_docs(Path(args.write_docs), table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
