"""Share-server benchmarks: commit at scale, bulk and single uploads over loopback HTTP.

Each function returns a flat dict of figures (``dpsketch bench`` prints them) and takes its
sizes as parameters, so CI can run a bounded version. Every throughput comes with a baseline
measured on the same machine, so the ratio, not the absolute number, says how close the server
is to what the hardware allows:

* commit: an exact S @ X with scipy.sparse over all included shares already in memory (what a
  server without running totals would at least have to do, before even reading the shares);
* bulk upload: raw SQLite inserts of the same rows with the same durability (WAL, fsync per
  transaction), no HTTP and no hashing, both as the server stores them (one row per upload batch,
  services/batches.py: the store's limit) and as a plain ``executemany`` of a row per report
  (issue 16's baseline); and the
  exact sketch of the same rows in memory (the sketch hash of every id and one sparse product;
  median of three passes), no HTTP, no binding check, no store, with the compiled hash and with
  its reference code (hashlib's BLAKE2b per id: issue 16's "BLAKE2b of the ids + exact scipy
  sketch"); ``--seeds`` sends the 32-byte seeds every server but one receives by default
  (the baselines then store what the server stores, and sketch the expanded shares), and a
  SQLite server's bytes on disk per report are reported either way, with the bytes the server
  process wrote to its disk during the upload (/proc/PID/io: the log and the checkpoints'
  copies) against what the disk takes durably (two writers fdatasync-ing 32 MiB chunks), and
  the server's CPU during the upload (/proc/PID/task: seconds per 10^6 rows, cores kept busy,
  and how busy its busiest thread was, which says whether one thread sets the pace);
* single upload: a do-nothing HTTP endpoint served as the server is (dpsketch.serving.serve),
  driven by the same load generator with the same bodies between the server's intervals (the
  loopback request rate; each interval against the echo just before and after it, median of
  ``--rounds``), and the rate of one fsync per report (no group commit);
* seed-compressed upload: the same reports' full-share body (decode, binding check, shares), and
  the seed expansion as it was before (one ``cryptography`` cipher per seed).

The upload benches run the server's default policy: every upload carries an upload token (one
without a quota, issued by the operator) and every record its binding proof, which the server
checks (docs/protocol.md 4a) before storing; the records are bound as a client binds them.
"""

from __future__ import annotations

import contextlib

import asyncio
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from dpsketch.client_sdk.upload import default_batch_rows
from dpsketch.protocol import binding, chacha, messages, ring, sketch
from dpsketch.protocol.messages import SEEDS_MEDIA_TYPE, SHARES_MEDIA_TYPE, encode_batch
from dpsketch.protocol.study import Study, design
from dpsketch.tools.cluster import free_port, terminate
from dpsketch.services import batches as services_batches
from dpsketch.tools.loadtest import status_kib

OPERATOR = "bench-operator-token-0123456789"
ANALYST = "bench-analyst-token-0123456789"


# --- helpers -----------------------------------------------------------------------------------


def _rss_mib() -> float:
    kib = status_kib("VmRSS")
    return float("nan") if kib is None else kib / 1024


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) so a phase can be measured on its own."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_mib() -> float:
    try:
        kib = status_kib("VmHWM")
    except OSError:
        kib = None
    if kib is not None:
        return kib / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _study(n: int, d: int, k: int, s: int, servers: list[str]) -> Study:
    return design(name="bench", columns=[f"x{i}" for i in range(d)], label=None, servers=servers,
                  expected_reports=n, k=k, s=s, min_reports=max(1, int(0.9 * n)), max_reports=max(2 * n, 1000))[0]


def _random_rows(rng: np.random.Generator, m: int, d: int) -> tuple[list[bytes], np.ndarray]:
    raw = os.urandom(16 * m)
    ids = [raw[i:i + 16] for i in range(0, 16 * m, 16)]
    return ids, rng.integers(0, np.iinfo(np.uint64).max, size=(m, d), dtype=np.uint64, endpoint=True)


def _bound_rows(rng: np.random.Generator, study: Study, m: int) -> tuple[list[bytes], np.ndarray, np.ndarray]:
    """m random shares for the study's first server, with report ids and proofs that bind them
    as a client's would (the other servers' payloads random seeds): (ids, proofs, shares)."""
    shares = rng.integers(0, np.iinfo(np.uint64).max, size=(m, study.width), dtype=np.uint64, endpoint=True)
    ids, proofs = binding.bind_for_server(study.study_id, study.n_servers, 0, binding.CONTENT_SHARE, shares)
    return ids, proofs, shares


def _bound_body(rng: np.random.Generator, study: Study, m: int, seeds: bool = False) -> bytes:
    """A body of m bound random reports for the first server: full shares, or (``seeds``) the
    32-byte seeds that every server but one receives by default."""
    if not seeds:
        return encode_batch(*_bound_rows(rng, study, m))
    payloads = rng.integers(0, 256, size=(m, ring.SEED_BYTES), dtype=np.uint8)
    ids, proofs = binding.bind_for_server(study.study_id, study.n_servers, 0, binding.CONTENT_SEED, payloads)
    return messages.encode_seed_batch(ids, proofs, payloads)


def _percentiles(latencies: list[float]) -> dict[str, float]:
    if not latencies:
        return {"p50_ms": float("nan"), "p99_ms": float("nan")}
    arr = np.asarray(latencies) * 1000
    return {"p50_ms": round(float(np.percentile(arr, 50)), 3), "p99_ms": round(float(np.percentile(arr, 99)), 3)}


class _Workdir:
    def __init__(self, workdir: Path | None):
        self.given = workdir
        self.path = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="dpsketch-bench-"))
        self.path.mkdir(parents=True, exist_ok=True)

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, *exc) -> None:
        if self.given is None:
            shutil.rmtree(self.path, ignore_errors=True)


# --- (a) commit --------------------------------------------------------------------------------


def bench_commit(n: int = 10**6, d: int = 100, k: int = 400, s: int = 4, excluded_fraction: float = 0.01,
                 chunk_rows: int = 20_000, workdir: Path | None = None, rebuild: bool = True,
                 baseline: bool = True, seed: int = 1) -> dict[str, Any]:
    """Load n random reports into a store (in-process, through the writer's bulk path: the sketch
    hash, then the store; the rows made beforehand, so their generation is not timed) against the
    reference sketch of the same rows (issue 16's "in-process load" against "BLAKE2b of the ids +
    exact scipy sketch"); then time commit over all but ``excluded_fraction`` of them plus
    fetching the aggregate, with the peak RSS of that phase; then the scipy.sparse baseline and
    (optionally) a rebuild from the file."""
    from dpsketch.protocol import kernels
    from dpsketch.services import idsets
    from dpsketch.services.settings import Settings
    from dpsketch.services.state import load_state
    from dpsketch.services.store import Store, warm_kernels

    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {"n": n, "d": d, "k": k, "s": s, "excluded_fraction": excluded_fraction}
    with _Workdir(workdir) as wd:
        db = wd / "bench-commit.sqlite3"
        for suffix in ("", "-wal", "-shm"):
            Path(str(db) + suffix).unlink(missing_ok=True)
        store = Store(Settings(server_id="bench", db_path=db, operator_token=OPERATOR, analyst_token=ANALYST,
                               warm_start=False))
        try:
            study = _study(n, d, k, s, ["bench", "other"])
            store.provision(study)
            record = store.record(study.study_id)
            chunks = [_random_rows(rng, min(chunk_rows, n - start), d) for start in range(0, n, chunk_rows)]
            all_ids = [rid for ids, _ in chunks for rid in ids]
            bodies = [b"".join(ids) for ids, _ in chunks]  # the ids as a batch body holds them
            warm_kernels()  # the compiled loops loaded, as a server does at start
            written = _bytes_written(os.getpid())
            waited, cpu = _runqueue_wait_s(os.getpid()), time.process_time()
            load_before = os.getloadavg()[0]
            t0 = time.perf_counter()
            window = []
            for joined, (_, shares) in zip(bodies, chunks):
                # what the batch route's worker thread hands the writer: the ids as an IdList over
                # the body's bytes, hashed and sorted (app._parse_batch), so the writer takes the
                # path of every batch upload (its checks on sorted arrays, no set of the ids)
                id_list = messages.IdList(joined)
                rows, signs = study.hash_report_ids(id_list, joined)
                window.append(store.submit_upload(record, id_list, shares, rows, signs,
                                                  sorted_ids=idsets.SortedIds(joined)))
                if len(window) >= 4:
                    window.pop(0).result()
            for fut in window:
                fut.result()
            load_s = time.perf_counter() - t0
            written = _bytes_written(os.getpid()) - written
            waited, cpu = _runqueue_wait_s(os.getpid()) - waited, time.process_time() - cpu
            out.update(load_s=round(load_s, 3), load_rows_per_s=round(n / load_s),
                       load_cpu_s=round(cpu, 3), load_runqueue_wait_s=round(waited, 3),
                       load_average_1min=[round(load_before, 2), round(os.getloadavg()[0], 2)],
                       disk_bytes_per_report=round(written / n, 1))
            # the durable floor of the same bytes, each chunk synced as the writer syncs a commit:
            # what the store keeps (each byte once), and what this process wrote during the load
            # (the WAL, then the checkpoints' copies)
            stored = [_stored_bytes(study, len(ids), False) for ids, _ in chunks]
            floor_s = _durable_floor_seconds(wd / "floor-probe", stored)
            floor_written_s = _durable_floor_seconds(wd / "floor-probe", [round(b * written / sum(stored))
                                                                          for b in stored])
            out.update(baseline_durable_floor_s=round(floor_s, 3), load_over_durable_floor=round(load_s / floor_s, 2),
                       baseline_durable_floor_as_written_s=round(floor_written_s, 3),
                       load_over_durable_floor_as_written=round(load_s / floor_written_s, 2))
            if baseline:  # the same rows' reference sketch, in memory
                x = np.concatenate([shares for _, shares in chunks])
                with kernels.SKETCH.reference():
                    reference_s = _sketch_seconds(study, all_ids, x)
                del x
                out.update(baseline_reference_sketch_s=round(reference_s, 3),
                           load_over_reference_sketch=round(load_s / reference_s, 2))
            del chunks
            n_excluded = int(round(excluded_fraction * n))
            included = sorted(all_ids[n_excluded:]) if n_excluded else sorted(all_ids)
            body = b"".join(included)
            del included
            rss_before = _rss_mib()
            peak_ok = _reset_peak_rss()
            t0 = time.perf_counter()
            result = store.commit(study.study_id, body)
            aggregate, _ = store.aggregate(study.study_id)
            commit_s = time.perf_counter() - t0
            out.update(
                n_included=result.n_reports, commit_s=round(commit_s, 3),
                lambda_min=round(result.lambda_min, 3), lambda_star=round(result.lambda_star, 3),
                margin=round(result.margin, 3), aggregate_bytes=len(aggregate),
                rss_before_commit_mib=round(rss_before, 1),
                peak_rss_commit_mib=round(_peak_rss_mib(), 1), peak_rss_is_phase_only=peak_ok,
            )
            del body
        finally:
            store.close()
        out["db_mib"] = round(db.stat().st_size / 2**20, 1)
        if rebuild:  # what a restart costs: stream every report back and redo the totals
            from dpsketch.services.db import connect
            from dpsketch.services.state import StudyRecord

            conn = connect(db, 5.0, readonly=True)
            t0 = time.perf_counter()
            load_state(conn, StudyRecord(record.seq, study, n), 50_000)
            out["rebuild_from_db_s"] = round(time.perf_counter() - t0, 3)
            conn.close()
        if baseline:
            from dpsketch.protocol.sketch import signed_sum

            ids_b, x = _random_rows(rng, result.n_reports, d)
            t0 = time.perf_counter()
            rows, signs = sketch.hash_report_ids(study.seed_bytes, ids_b, k, s)
            t1 = time.perf_counter()
            signed_sum(rows, signs, x, k)
            t2 = time.perf_counter()
            out.update(baseline_hash_s=round(t1 - t0, 3), baseline_spmm_s=round(t2 - t1, 3),
                       commit_over_spmm=round(commit_s / (t2 - t1), 2),
                       commit_over_hash_plus_spmm=round(commit_s / (t2 - t0), 2))
    out["peak_rss_process_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return out


# --- real server processes ---------------------------------------------------------------------


def _start_server(wd: Path, server_id: str = "s1", db: Path | str | None = None):
    """A real server process on a SQLite file in ``wd`` or on ``db`` (a file or a
    postgresql:// URL of an empty database)."""
    from dpsketch.tools.cluster import ServerSpec, share_server

    spec = ServerSpec(server_id=server_id, operator_token=OPERATOR, analyst_token=ANALYST,
                      db_path=db if db is not None else wd / f"{server_id}.sqlite3")
    return share_server(spec, wd).start(timeout=60)


@contextlib.contextmanager
def _serving(wd: Path, db: Path | str | None, replicas: int = 1):
    """One server process, or ``replicas`` of one server on one PostgreSQL database behind an
    haproxy (tools/loadbalancer.py); yields the URL and port clients use and the servers' pids."""
    if replicas == 1:
        proc = _start_server(wd, db=db)
        try:
            yield proc.url, proc.port, [proc.proc.pid]
        finally:
            proc.stop()
        return
    from dpsketch.tools import loadbalancer
    from dpsketch.tools.cluster import free_port

    if db is None or not str(db).startswith("postgresql://"):
        raise ValueError("replicas share a PostgreSQL database: give db as a postgresql:// URL")
    procs = []
    try:
        for i in range(replicas):
            proc = _start_server(wd, "s1", db=db) if i == 0 else _start_replica(wd, db, i)
            procs.append(proc)
        port = free_port()
        with loadbalancer.running_haproxy(loadbalancer.ensure_haproxy(), port,
                                          [(f"r{i}", p.port) for i, p in enumerate(procs)], wd) as url:
            yield url, port, [p.proc.pid for p in procs]
    finally:
        for proc in procs:
            proc.stop()


def _start_replica(wd: Path, db: str, i: int):
    from dpsketch.tools.cluster import ServerSpec, share_server

    spec = ServerSpec(server_id="s1", operator_token=OPERATOR, analyst_token=ANALYST, db_path=db)
    proc = share_server(spec, wd)
    proc.name, proc.log_path = f"s1-replica{i}", wd / f"s1-replica{i}.log"
    return proc.start(timeout=60)


def provision(url: str, study: Study, operator: str = OPERATOR) -> str:
    """Provision the study and return an upload token for it (no quota), issued by the operator
    (token ``operator``) as the server's default policy requires."""
    import httpx

    from dpsketch.services.admin import ServerAdmin

    r = httpx.put(f"{url}/v1/studies/{study.study_id}", content=study.canonical(), timeout=60,
                  headers={"Authorization": f"Bearer {operator}", "Content-Type": "application/json"})
    r.raise_for_status()
    with ServerAdmin(url, operator) as admin:
        return admin.issue_upload_tokens(study.study_id, 1, None).token


def warm_server(url: str, d: int, rng: np.random.Generator, operator: str = OPERATOR) -> None:
    """Load the server's compiled loops before anything is timed: one batch of kernels.MIN_ROWS
    rows to a study of its own (a batch that size loads them, services/store.py), so the
    figures are steady-state ingest. Without it the first second of a short run hashed with
    the reference code while numba loaded, and runs of 10^6 rows moved 2x (144k vs 315k rows/s);
    and a load test's server RSS took a step of about 125 MiB (numba and LLVM) partway through.
    ``operator``: the server's operator token."""
    from dpsketch.protocol import kernels

    study = design(name="bench-warm-up", columns=[f"x{i}" for i in range(d)], label=None,
                   servers=["s1", "s2"], expected_reports=2 * kernels.MIN_ROWS, k=400, s=4,
                   min_reports=kernels.MIN_ROWS, max_reports=4 * kernels.MIN_ROWS)[0]
    token = provision(url, study, operator)
    _, _, errors = _post_batches(url, f"/v1/studies/{study.study_id}/batches",
                                 [_bound_body(rng, study, kernels.MIN_ROWS)], SHARES_MEDIA_TYPE, 1,
                                 timeout=120, token=token)
    if errors:
        raise RuntimeError("the warm-up batch was refused")


def _post_from_threads(bodies: list[bytes], media_type: str | list[str], concurrency: int, connect
                       ) -> tuple[float, list[float], int]:
    """POST every body (of ``media_type``, or of its own in a list of them) from ``concurrency``
    threads, each with its own connection: ``connect()`` opens one and returns (post, close),
    ``post(body, content_type)`` answering the status; (seconds, per-request latencies, non-200s)."""
    types = [media_type] * len(bodies) if isinstance(media_type, str) else media_type
    todo = iter(zip(bodies, types))
    lock = threading.Lock()
    latencies: list[float] = []
    errors = [0]

    def worker() -> None:
        post, close = connect()
        try:
            while True:
                with lock:
                    body, content_type = next(todo, (None, None))
                if body is None:
                    return
                t = time.perf_counter()
                status = post(body, content_type)
                with lock:
                    latencies.append(time.perf_counter() - t)
                    errors[0] += status != 200
        finally:
            close()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for fut in [pool.submit(worker) for _ in range(concurrency)]:
            fut.result()
    return time.perf_counter() - t0, latencies, errors[0]


def _post_batches(url: str, path: str, bodies: list[bytes], media_type: str | list[str], concurrency: int,
                  timeout: float, token: str) -> tuple[float, list[float], int]:
    """:func:`_post_from_threads` through httpx clients, one a thread."""
    import httpx

    def connect():
        client = httpx.Client(base_url=url, timeout=timeout)

        def post(body: bytes, content_type: str) -> int:
            headers = {"Content-Type": content_type, "Authorization": f"Bearer {token}"}
            return client.post(path, content=body, headers=headers).status_code
        return post, client.close

    return _post_from_threads(bodies, media_type, concurrency, connect)


def _post_batches_raw(port: int, path: str, bodies: list[bytes], media_type: str | list[str], concurrency: int,
                      timeout: float, token: str) -> tuple[float, list[float], int]:
    """:func:`_post_batches` from a lean sender: ``concurrency`` threads, each one keep-alive
    HTTP/1.1 connection on a plain blocking socket, sending each prepared body with one
    ``sendall`` of its head and one of the body (the kernel copies it; the GIL is released) and
    reading the short JSON answer. What the sender costs is then a few system calls a batch, so
    that on one machine the server's ingest, not the client's HTTP library, is what is timed (in a
    deployment the client is another machine)."""

    def connect():
        sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        answers = sock.makefile("rb")

        def post(body: bytes, content_type: str) -> int:
            head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
                    f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
            sock.sendall(head)
            sock.sendall(body)
            status = int(answers.readline().split()[1])
            length = 0
            while True:
                line = answers.readline()
                if line in (b"\r\n", b""):
                    break
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            answers.read(length)
            return status

        def close() -> None:
            answers.close()
            sock.close()
        return post, close

    return _post_from_threads(bodies, media_type, concurrency, connect)


def _bytes_written(pid: int) -> int:
    """The bytes a process has sent to the storage layer so far (/proc/PID/io, ``write_bytes``:
    counted when its pages are dirtied, every thread's)."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    raise RuntimeError(f"no write_bytes in /proc/{pid}/io")


def _thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) each thread of a process has used so far, by thread id
    (/proc/PID/task/TID/stat; a thread that ended between the listing and the read is left out)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after the name, which may hold spaces
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _runqueue_wait_s(pid: int) -> float:
    """Seconds the threads of a process have spent runnable but waiting for a CPU so far
    (/proc/PID/task/TID/schedstat, second field; 0 where the kernel keeps no such count): on a
    machine whose cores are shared, how long the process was ready to work and could not."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return total / 1e9


def _server_cpu(before: dict[int, dict[int, float]], after: dict[int, dict[int, float]], seconds: float,
                rows: int) -> dict[str, float]:
    """Where a run's server CPU went, from :func:`_thread_cpu_s` of each server process before
    and after: its CPU seconds per 10^6 rows, the cores it kept busy on average, and the busy
    fraction of its busiest thread (near 1: that thread, the writer on a full-share server, sets
    the pace whatever the other core does)."""
    used = [cpu - before.get(pid, {}).get(tid, 0.0) for pid, threads in after.items()
            for tid, cpu in threads.items()]
    total = sum(used)
    return {"server_cpu_s_per_million_rows": round(total * 1e6 / rows, 3),
            "server_cores_used": round(total / seconds, 3),
            "server_busiest_thread_busy": round(max(used, default=0.0) / seconds, 3)}


def _durable_write_mib_per_s(path: Path, seconds: float = 1.0, chunk: int = 32 << 20, writers: int = 2) -> float:
    """What this disk takes durably: ``writers`` threads each writing chunks of random bytes to a
    new file and fdatasync-ing each, for ``seconds`` (a store that syncs what it acknowledges
    writes no faster; on this VM the figure moves 2-3 x between runs, and one writer of 8 MiB
    chunks gets a third to a half of it)."""
    data = os.urandom(chunk)
    written = [0] * writers

    def write(i: int) -> None:
        name = path.with_name(f"{path.name}-{i}")
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            while written[i] == 0 or time.perf_counter() - t0 < seconds:
                os.write(fd, data)
                os.fdatasync(fd)
                written[i] += chunk
        finally:
            os.close(fd)
            name.unlink()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(written) / 2**20 / (time.perf_counter() - t0)


def _durable_floor_seconds(path: Path, batch_bytes: list[int]) -> float:
    """What the disk needs at least to make a store's bytes durable the way the store commits
    them: one writer appending each batch's stored bytes (``batch_bytes``: the report ids and
    what is kept of the payloads, each byte once) to a new file and fdatasync-ing after each
    batch, as the writer syncs each commit before it acknowledges; seconds for all of them. No
    SQLite, no second copy (the WAL checkpoint's), no hashing: a store that writes less than
    this, or syncs less often, would not hold what it acknowledged."""
    data = os.urandom(max(batch_bytes))
    view = memoryview(data)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        t0 = time.perf_counter()
        for size in batch_bytes:
            os.write(fd, view[:size])
            os.fdatasync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)
        path.unlink()


def _stored_bytes(study: Study, m: int, seeded: bool) -> int:
    """The bytes a store holds of a batch of m reports: the ids, and the shares or (where a seed
    is smaller, ``batches.stores_seeds``) the seeds."""
    payload = ring.SEED_BYTES if seeded and services_batches.stores_seeds(study.width) else 8 * study.width
    return m * (messages.REPORT_ID_BYTES + payload)


def _report_count(url: str, study: Study) -> int:
    import httpx

    return int(httpx.get(f"{url}/v1/studies/{study.study_id}").json()["report_count"])


# --- (b) bulk upload ---------------------------------------------------------------------------


def bench_bulk_upload(n: int = 200_000, d: int = 32, batch_rows: int | None = None, concurrency: int = 2,
                      workdir: Path | None = None, seed: int = 2, db: Path | str | None = None,
                      baseline: bool = True, replicas: int = 1, seeds: bool = False,
                      rotation: int = 0, sender: str = "httpx", reference_only: bool = False) -> dict[str, Any]:
    """POST n random rows in batches of ``batch_rows`` (default: the SDK's, client_sdk/upload.py)
    to a real server over loopback (its store: ``db``, default a new SQLite file; ``replicas`` >
    1: that many on one PostgreSQL ``db`` behind haproxy), as full shares, or (``seeds``) as the
    seeds a seed server receives, or (``rotation`` = N) as one server of N receives an SDK
    upload: batch i as full shares where i mod N is 0, else as seeds. The baselines then take
    each kind's batches at its own rate.

    Every body is made (noise-free random shares, bound and encoded as a client would) before
    the clock starts: the client's preparation is another machine's work in a deployment.
    ``sender``: what posts them, "httpx" (``concurrency`` threads, an ``httpx.Client`` each: a
    client library, as before) or "raw" (:func:`_post_batches_raw`: plain sockets, a few system
    calls a batch), so that the timed part is as near the server's own ingest over loopback as
    one machine allows; ``client_cpu_s_per_million_rows`` is this process's CPU during the
    upload either way. On SQLite the same run measures the durable floor of the same bytes
    (:func:`_durable_floor_seconds`: each batch's stored bytes written once and fdatasync-ed,
    as the writer syncs each commit): ``baseline_durable_floor_rows_per_s`` and
    ``ratio_to_durable_floor``. ``reference_only``: of the baselines, only the reference sketch
    (issue 16's, the issue's target) and the durable floor: a run of 10^6 rows at d = 100 on a
    loaded 2-core machine then takes minutes less."""
    if seeds and rotation:
        raise ValueError("give seeds or rotation, not both")
    if sender not in ("httpx", "raw"):
        raise ValueError("sender is 'httpx' or 'raw'")
    rng = np.random.default_rng(seed)
    study = _study(n, d, 400, 4, [f"s{j + 1}" for j in range(max(2, rotation))])
    if batch_rows is None:  # the same rows the SDK puts in a batch of this study
        batch_rows = default_batch_rows(d, study.n_servers)
    batches, kinds = [], []  # kinds: whether each batch is seeds
    for i, start in enumerate(range(0, n, batch_rows)):
        m = min(batch_rows, n - start)
        seeded = seeds or bool(rotation and i % rotation)
        batches.append((m, _bound_body(rng, study, m, seeded)))
        kinds.append(seeded)
    media_types = [SEEDS_MEDIA_TYPE if k else SHARES_MEDIA_TYPE for k in kinds]
    out: dict[str, Any] = {"n": n, "d": d, "batch_rows": batch_rows, "concurrency": concurrency,
                           "payload": (f"one server of {rotation}: batch i as full shares where i mod {rotation} = 0, "
                                       f"else seeds" if rotation else "seeds" if seeds else "shares"),
                           "body_mib": round(len(batches[0][1]) / 2**20, 2), "n_servers": study.n_servers,
                           "upload_auth": "tokens", "sender": sender}
    with _Workdir(workdir) as wd:
        with _serving(wd, db, replicas) as (url, port, pids):
            warm_server(url, d, rng)
            token = provision(url, study)
            written = sum(_bytes_written(pid) for pid in pids)
            cpu = {pid: _thread_cpu_s(pid) for pid in pids}
            waited = sum(_runqueue_wait_s(pid) for pid in pids)
            load_before = os.getloadavg()[0]
            client_cpu = time.process_time()
            post = partial(_post_batches_raw, port) if sender == "raw" else partial(_post_batches, url)
            elapsed, latencies, errors = post(f"/v1/studies/{study.study_id}/batches", [b for _, b in batches],
                                              media_types, concurrency, timeout=120, token=token)
            client_cpu = time.process_time() - client_cpu
            cpu_after = {pid: _thread_cpu_s(pid) for pid in pids}
            waited = sum(_runqueue_wait_s(pid) for pid in pids) - waited
            written = sum(_bytes_written(pid) for pid in pids) - written
            out.update(_server_cpu(cpu, cpu_after, elapsed, n),
                       client_cpu_s_per_million_rows=round(client_cpu * 1e6 / n, 3),
                       # the server's threads runnable but not running (a CPU taken by other work),
                       # per 10^6 rows: beside its CPU seconds, what the machine's load cost it
                       server_runqueue_wait_s_per_million_rows=round(waited * 1e6 / n, 3),
                       load_average_1min=[round(load_before, 2), round(os.getloadavg()[0], 2)])
            held = _report_count(url, study)
        if db is None:  # what the server wrote to its disk (log and checkpoints), against what the disk takes
            # a quick run (CI's) probes a quarter of a second: each second writes about a GiB
            disk = _durable_write_mib_per_s(wd / "disk-probe", seconds=1.0 if n >= 100_000 else 0.25)
            out.update(server_disk_bytes_per_report=round(written / n, 1),
                       server_disk_write_mib_per_s=round(written / 2**20 / elapsed, 1),
                       baseline_disk_write_mib_per_s=round(disk, 1),
                       disk_bandwidth_used=round(written / 2**20 / elapsed / disk, 3))
            # the durable floor of the same bytes, each batch synced as the writer syncs a
            # commit: what the store keeps (each byte once), and what the server wrote (the WAL,
            # then the checkpoints' copies)
            stored = [_stored_bytes(study, m, k) for (m, _), k in zip(batches, kinds)]
            floor_s = _durable_floor_seconds(wd / "floor-probe", stored)
            floor_written_s = _durable_floor_seconds(wd / "floor-probe", [round(b * written / sum(stored))
                                                                          for b in stored])
            out.update(baseline_durable_floor_rows_per_s=round(n / floor_s),
                       baseline_durable_floor_mib_per_s=round(sum(stored) / 2**20 / floor_s, 1),
                       ratio_to_durable_floor=round(floor_s / elapsed, 3),
                       baseline_durable_floor_as_written_rows_per_s=round(n / floor_written_s),
                       ratio_to_durable_floor_as_written=round(floor_written_s / elapsed, 3))
        out.update(replicas=replicas, seconds=round(elapsed, 3), rows_per_s=round(n / elapsed), errors=errors,
                   server_report_count=held, mib_per_s=round(sum(len(b) for _, b in batches) / 2**20 / elapsed, 1),
                   **_percentiles(latencies))
        if db is None:  # the SQLite file and its log after the server's clean stop: bytes on disk a report
            on_disk = sum(f.stat().st_size for f in wd.glob("s1.sqlite3*"))
            out.update(store_bytes_per_report=round(on_disk / max(held, 1), 1))
        if baseline:
            def rate(fn: Any) -> float:
                """A baseline over every batch: each kind's batches at that kind's rate,
                ``fn(batches, media_type, kind)``."""
                seconds = 0.0
                for seeded in sorted(set(kinds)):
                    group = [b for b, k in zip(batches, kinds) if k is seeded]
                    media_type = SEEDS_MEDIA_TYPE if seeded else SHARES_MEDIA_TYPE
                    seconds += sum(m for m, _ in group) / fn(group, media_type, "seeds" if seeded else "shares")
                return n / seconds

            reference = rate(lambda group, mt, kind: _reference_sketch_rows_per_s(study, group, mt))
            out.update(baseline_reference_sketch_rows_per_s=round(reference),
                       ratio_to_reference_sketch=round(out["rows_per_s"] / reference, 3))
            if reference_only:
                return out
            raw = rate(lambda group, mt, kind: _raw_sqlite_rows_per_s(wd / f"raw-{kind}.sqlite3", group, study, mt))
            rows = rate(lambda group, mt, kind: _raw_sqlite_rows_per_s(wd / f"rows-{kind}.sqlite3", group, study, mt,
                                                                       one_statement=False))
            exact = rate(lambda group, mt, kind: _exact_sketch_rows_per_s(study, group, mt))
            out.update(baseline_raw_sqlite_rows_per_s=round(raw),
                       ratio_to_raw_sqlite=round(out["rows_per_s"] / raw, 3),
                       baseline_executemany_rows_per_s=round(rows),
                       ratio_to_executemany=round(out["rows_per_s"] / rows, 3),
                       baseline_exact_sketch_rows_per_s=round(exact),
                       ratio_to_exact_sketch=round(out["rows_per_s"] / exact, 3))
    return out


def _exact_sketch_rows_per_s(study: Study, batches: list[tuple[int, bytes]], media_type: str = SHARES_MEDIA_TYPE) -> float:
    """The exact sketch S X of the same rows in memory (the sketch hash of every id, then one
    sparse product; seeds expanded beforehand), no HTTP, no binding check and no store: what
    ingest costs at the least."""
    uploads = [messages.decode_upload(body, media_type, study.width, study.n_servers) for _, body in batches]
    ids = [rid for u in uploads for rid in u.ids]
    shares = np.concatenate([u.shares(study.width) for u in uploads])
    sketch.warm_up()  # the compiled hash loaded, as a server does at start
    # the median of three: one pass is short enough for the machine to move it 2x
    return len(ids) / _sketch_seconds(study, ids, shares, passes=3)


def _sketch_seconds(study: Study, ids: list[bytes], shares: np.ndarray, passes: int = 1) -> float:
    """Seconds for the exact sketch S X of these rows in memory (the sketch hash of every id, then
    one sparse product), the median of ``passes``; with whichever sketch code is loaded."""
    seconds = []
    for _ in range(passes):
        t0 = time.perf_counter()
        rows, signs = study.hash_report_ids(ids)
        sketch.signed_sum(rows, signs, shares, study.k)
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds)


def _reference_sketch_rows_per_s(study: Study, batches: list[tuple[int, bytes]],
                                 media_type: str = SHARES_MEDIA_TYPE) -> float:
    """:func:`_exact_sketch_rows_per_s` with the sketch hash's reference code (hashlib's BLAKE2b
    per id, then scipy): issue 16's "BLAKE2b of the ids + exact scipy sketch" baseline."""
    from dpsketch.protocol import kernels

    with kernels.SKETCH.reference():
        return _exact_sketch_rows_per_s(study, batches, media_type)


def _raw_sqlite_rows_per_s(path: Path, batches: list[tuple[int, bytes]], study: Study, media_type: str,
                           one_statement: bool = True) -> float:
    """The same rows (report id and what the server stores of the payload: the share, or the
    seed where seeds are stored; not the proof) with the same
    durability, straight from Python: into the server's own schema as one batch row per upload
    (``db.INSERT_BATCH``, the limit of this store), or (``one_statement`` False) as a plain
    ``executemany`` of one row per report into a table of (rowid, study, id, share), one
    transaction per batch (what issue 16 measured as "raw SQLite inserts")."""
    from dpsketch.services import db

    conn = db.initialise(path, 5.0)
    conn.execute("INSERT INTO studies (study_id, canonical, created_at) VALUES ('x', x'', 0)")
    conn.execute("CREATE TABLE reports (id INTEGER PRIMARY KEY, study INTEGER NOT NULL, report_id BLOB NOT NULL, "
                 "share BLOB NOT NULL)")
    stored = []  # (m, ids, what the server stores of the payloads), made before the clock starts
    for m, body in batches:
        upload = messages.decode_upload(body, media_type, study.width, study.n_servers)
        seeds = media_type == SEEDS_MEDIA_TYPE and services_batches.stores_seeds(study.width)
        kept = upload.payloads if seeds else upload.shares(study.width)
        stored.append((m, upload.joined, np.ascontiguousarray(kept).tobytes()))
    base = 1
    t0 = time.perf_counter()
    rows = 0
    for m, ids, shares in stored:
        each = len(shares) // m
        conn.execute("BEGIN IMMEDIATE")
        if one_statement:
            conn.execute(db.INSERT_BATCH, {"first": base, "study": 1, "m": m, "ids": ids, "shares": shares,
                                           "pseudonyms": None, "party": None, "proof_position": None})
        else:
            conn.executemany("INSERT INTO reports (id, study, report_id, share) VALUES (?, 1, ?, ?)",
                             [(base + i, ids[16 * i:16 * (i + 1)], shares[each * i:each * (i + 1)])
                              for i in range(m)])
        conn.execute("COMMIT")
        base += m
        rows += m
    elapsed = time.perf_counter() - t0
    conn.close()
    return rows / elapsed


def bench_sealed_upload(n: int = 100_000, d: int = 32, batch_rows: int | None = None, concurrency: int = 2,
                        workdir: Path | None = None, seed: int = 3, n_v1: int | None = None,
                        rounds: int = 4) -> dict[str, Any]:
    """The same n random shares uploaded to one real server over loopback, each mode into its own
    study: as plaintext batches, as sealed version 4 batches (docs/protocol.md section 7a: one
    HPKE seal and one ChaCha20-Poly1305 message per batch) with the classical and with the
    post-quantum suite (``n_v1`` is accepted and ignored: the per-record layouts are not sealed
    or opened any more, issues 41 and 46), in batches of ``batch_rows`` (default: the SDK's
    default batch at this width, ``client_sdk.upload.default_batch_rows``). The modes take turns
    over ``rounds`` rounds. Reports bytes per report, the client's sealing time per report (CPU)
    and each mode's rows/s and ratio to plaintext (the server opens every sealed batch before
    storing it); and, as ``..._with_sealing``, the rate had the client sealed every body just
    before posting it (its sealing CPU time added to the upload's wall time: no overlap, a
    lower bound of what the SDK, which seals a batch while the previous one travels, achieves)."""
    import httpx

    from dpsketch.protocol import envelope
    from dpsketch.protocol.messages import SEALED_MEDIA_TYPE

    modes = {"plaintext": (None, None, n), "sealed": (envelope.CLASSICAL, envelope.VERSION_4, n),
             "sealed_pq": (envelope.POST_QUANTUM, envelope.VERSION_4, n)}
    if batch_rows is None:
        batch_rows = default_batch_rows(d, 2)
    rng = np.random.default_rng(seed)
    studies = {mode: design(name=f"bench-{mode}", columns=[f"x{i}" for i in range(d)], label=None,
                            servers=["s1", "s2"], expected_reports=n, k=400, s=4,
                            min_reports=max(1, int(0.9 * n)), max_reports=max(2 * n, 1000))[0]
               for mode in modes}
    # the same shares in every mode; each study's report ids bind them to that study
    rows = []
    for start in range(0, n, batch_rows):
        m = min(batch_rows, n - start)
        rows.append(rng.integers(0, np.iinfo(np.uint64).max, size=(m, d), dtype=np.uint64, endpoint=True))
    plain_of = {}
    for mode, study in studies.items():
        bodies, left = [], modes[mode][2]
        for shares in rows:
            if left <= 0:
                break
            shares = shares[:left]
            left -= len(shares)
            ids, proofs = binding.bind_for_server(study.study_id, study.n_servers, 0, binding.CONTENT_SHARE,
                                                  shares)
            bodies.append((len(shares), encode_batch(ids, proofs, shares)))
        plain_of[mode] = bodies
    out: dict[str, Any] = {"n": n, "d": d, "batch_rows": batch_rows, "concurrency": concurrency,
                           "rounds": rounds, "n_servers": 2, "upload_auth": "tokens"}
    with _Workdir(workdir) as wd:
        proc = _start_server(wd)
        try:
            hpke = httpx.get(f"{proc.url}/v1/info").json()["hpke"]
            bodies_of: dict[str, tuple[list[tuple[int, bytes]], str]] = {
                "plaintext": (plain_of["plaintext"], SHARES_MEDIA_TYPE)}
            seal_cpu: dict[str, float] = {}
            for mode, (suite, version, _) in modes.items():
                if suite is None:
                    continue
                keys = hpke["post_quantum"] if suite.post_quantum else hpke
                public = next(k["public_key"] for k in keys["keys"] if k["key_id"] == keys["current"])
                recipient = envelope.Recipient("s1", bytes.fromhex(public), suite, version)
                t0 = time.process_time()
                bodies_of[mode] = ([(m, envelope.seal_body(recipient, studies[mode].study_id, body,
                                                           SHARES_MEDIA_TYPE, d, studies[mode].n_servers))
                                    for m, body in plain_of[mode]], SEALED_MEDIA_TYPE)
                seal_cpu[mode] = time.process_time() - t0
            warm_server(proc.url, d, rng)
            tokens = {mode: provision(proc.url, study) for mode, study in studies.items()}
            # the modes take turns, a slice of each mode's batches per round (in a rotating
            # order), so that a machine whose load drifts slows them alike
            spent = {mode: [0.0, [], 0] for mode in modes}  # seconds, latencies, errors
            for r in range(rounds):
                order = list(bodies_of)[r % len(modes):] + list(bodies_of)[:r % len(modes)]
                for mode in order:
                    batches, media_type = bodies_of[mode]
                    part = batches[r * len(batches) // rounds:(r + 1) * len(batches) // rounds]
                    if not part:
                        continue
                    elapsed, latencies, errors = _post_batches(
                        proc.url, f"/v1/studies/{studies[mode].study_id}/batches", [b for _, b in part],
                        media_type, concurrency, timeout=300, token=tokens[mode])
                    spent[mode][0] += elapsed
                    spent[mode][1] += latencies
                    spent[mode][2] += errors
            for mode, (batches, _) in bodies_of.items():
                count = sum(m for m, _ in batches)
                elapsed, latencies, errors = spent[mode]
                out[mode] = {"rows": count, "bytes_per_report": round(sum(len(b) for _, b in batches) / count, 1),
                             "rows_per_s": round(count / elapsed), "seconds": round(elapsed, 3),
                             "errors": errors, "server_report_count": _report_count(proc.url, studies[mode]),
                             **_percentiles(latencies)}
                if mode in seal_cpu:
                    out[mode]["client_seal_us_per_report"] = round(seal_cpu[mode] / count * 1e6, 2)
        finally:
            proc.stop()
    for mode in modes:
        if mode != "plaintext":
            out[f"ratio_{mode}_to_plaintext_rows_per_s"] = round(
                out[mode]["rows_per_s"] / out["plaintext"]["rows_per_s"], 3)
            out[f"ratio_{mode}_to_plaintext_with_sealing"] = round(
                out["plaintext"]["seconds"] / (out[mode]["seconds"] + seal_cpu[mode]), 3)
    return out


# --- (c) single uploads ------------------------------------------------------------------------

# The do-nothing app, served as ``dpsketch server`` serves its app (dpsketch.serving.serve: the
# same uvicorn options, protocol class, connection guard and one worker) or, with "bare" as the
# second argument, by plain uvicorn.run (no guard): the stack's own cost, for reference.
_ECHO_APP = """
import sys, uvicorn
from dpsketch.serving import serve
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    body = b'{"status":"ok"}'
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
if sys.argv[2:] == ["bare"]:
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False)
else:
    sys.exit(serve(app, host="127.0.0.1", port=int(sys.argv[1]), workers=1, log_level="warning",
                   access_log=False, proxy_headers=False, server_header=False))
"""


@contextlib.contextmanager
def _echo(bare: bool = False):
    """The do-nothing app in its own process; yields its port."""
    port = free_port()
    echo = subprocess.Popen([sys.executable, "-c", _ECHO_APP, str(port), *(["bare"] if bare else [])],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if echo.poll() is not None:
                    raise RuntimeError("the echo app did not start") from None
                time.sleep(0.05)
        yield port
    finally:
        terminate(echo)


async def _drive(port: int, path: str, make_body, content_type: str, clients: int, seconds: float,
                 token: str | None = None) -> dict:
    """A lean keep-alive HTTP/1.1 load generator: ``clients`` connections, one request in
    flight on each, for ``seconds``. Lighter than a general client so the server, not the
    generator, is what is measured."""
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    deadline = time.perf_counter() + seconds
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Content-Type: {content_type}\r\nContent-Length: "

    async def one() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while time.perf_counter() < deadline:
                body = make_body()
                t0 = time.perf_counter()
                writer.write(f"{head}{len(body)}\r\n\r\n".encode() + body)
                status = int((await reader.readline()).split()[1])
                length = 0
                while True:
                    line = await reader.readline()
                    if line in (b"\r\n", b""):
                        break
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                latencies.append(time.perf_counter() - t0)
                statuses[status] = statuses.get(status, 0) + 1
        finally:
            writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(clients)))
    elapsed = time.perf_counter() - t0
    ok = statuses.get(200, 0)
    return {"ok": ok, "statuses": statuses, "per_s": ok / elapsed, **_percentiles(latencies)}


def _run(coro):
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:  # pragma: no cover
        return asyncio.run(coro)


def _fsync_per_report_rate(path: Path, d: int, reports: int = 300) -> float:
    from dpsketch.services import db

    conn = db.initialise(path, 5.0)
    conn.execute("INSERT INTO studies (study_id, canonical, created_at) VALUES ('x', x'', 0)")
    t0 = time.perf_counter()
    for i in range(reports):
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(db.INSERT_BATCH, {"first": i + 1, "study": 1, "m": 1, "ids": os.urandom(16),
                                       "shares": os.urandom(8 * d), "pseudonyms": None, "party": None,
                                       "proof_position": None})
        conn.execute("COMMIT")
    rate = reports / (time.perf_counter() - t0)
    conn.close()
    return rate


def bench_single_upload(clients: int = 64, seconds: float = 5.0, d: int = 32,
                        workdir: Path | None = None, db: Path | str | None = None,
                        baseline: bool = True, replicas: int = 1, rounds: int = 3) -> dict[str, Any]:
    """``clients`` concurrent clients each uploading single reports (JSON) for ``seconds`` in
    all (the server's store: ``db``, default a new SQLite file; ``replicas`` as in
    bench_bulk_upload).

    The baseline is the do-nothing app on the same stack (``_ECHO_APP``: served like the
    server, one worker), driven by the same driver with the same bodies, interleaved with the
    server: ``rounds`` intervals of ``seconds / rounds`` on the server, each between two echo
    intervals (``min(seconds / rounds, 3)`` seconds). On a shared machine the echo alone moves
    by up to 2x within one run, so each server interval is compared with the echo just before
    and just after it, and ``ratio_to_echo`` is the median of those per-round ratios. The same
    app under plain ``uvicorn.run`` (no connection guard) is measured too, for reference."""
    out: dict[str, Any] = {"clients": clients, "seconds": seconds, "d": d, "upload_auth": "tokens"}
    study = _study(10**6, d, 400, 4, ["s1", "s2"])
    rounds = max(1, int(rounds))

    pending: list[bytes] = []

    def report_body() -> bytes:
        """A fresh random share for s1 with its id and proof (the other server's commitment
        random: s1 cannot tell), as JSON. Made 512 at a time (about 10 us each, against 45 us
        one by one), so that the driver, which makes them for the echo app too, stays light."""
        if not pending:
            shares = np.frombuffer(os.urandom(8 * d * 512), dtype="<u8").reshape(512, d)
            ids, proofs = binding.bind_for_server(study.study_id, study.n_servers, 0, binding.CONTENT_SHARE,
                                                  shares)
            pending.extend(messages.Report.of(rid, proof, share).model_dump_json().encode()
                           for rid, proof, share in zip(ids, proofs, shares))
        return pending.pop()

    interval = seconds / rounds
    echo_seconds = min(interval, 3.0)

    def drive_echo(port: int) -> dict:
        return _run(_drive(port, "/", report_body, "application/json", clients, echo_seconds))

    with _Workdir(workdir) as wd, contextlib.ExitStack() as stack:
        echo_port = stack.enter_context(_echo()) if baseline else None
        with _serving(wd, db, replicas) as (url, port, _pids):
            token = provision(url, study)
            load_before = os.getloadavg()[0]
            echoes = [drive_echo(echo_port)] if echo_port else []
            runs = []
            for _ in range(rounds):
                runs.append(_run(_drive(port, f"/v1/studies/{study.study_id}/reports", report_body,
                                        "application/json", clients, interval, token)))
                if echo_port:
                    echoes.append(drive_echo(echo_port))
            held = _report_count(url, study)
        statuses: dict[int, int] = {}
        for res in runs:
            for code, count in res["statuses"].items():
                statuses[code] = statuses.get(code, 0) + count
        acknowledged = sum(res["ok"] for res in runs)
        per_s = [res["per_s"] for res in runs]
        out.update(replicas=replicas, rounds=rounds, reports_per_s=round(statistics.fmean(per_s)),
                   reports_per_s_by_round=[round(x) for x in per_s], acknowledged=acknowledged,
                   server_report_count=held, statuses=statuses,
                   p50_ms=statistics.median(res["p50_ms"] for res in runs),
                   p99_ms=max(res["p99_ms"] for res in runs),
                   load_average_1min=[round(load_before, 2), round(os.getloadavg()[0], 2)])
        if not baseline:
            return out
        stack.close()  # the echo
        echo_rates = [e["per_s"] for e in echoes]
        ratios = [per_s[i] / ((echo_rates[i] + echo_rates[i + 1]) / 2) for i in range(rounds)]
        with _echo(bare=True) as bare_port:
            bare = drive_echo(bare_port)
        out.update(baseline_loopback_echo_per_s=round(statistics.fmean(echo_rates)),
                   baseline_echo_per_s_by_interval=[round(x) for x in echo_rates],
                   baseline_echo_p99_ms=max(e["p99_ms"] for e in echoes),
                   ratio_to_echo=round(statistics.median(ratios), 3),
                   ratio_to_echo_by_round=[round(x, 3) for x in ratios],
                   reference_bare_uvicorn_echo_per_s=round(bare["per_s"]))
        fsync_rate = _fsync_per_report_rate(wd / "fsync.sqlite3", d)
        out.update(baseline_fsync_per_report_per_s=round(fsync_rate),
                   group_commit_gain=round(out["reports_per_s"] / fsync_rate, 2))
    return out



# --- (d) seed-compressed uploads ------------------------------------------------------------------


def _one_cipher_per_seed(seeds: np.ndarray, d: int) -> np.ndarray:
    """Seed expansion as it was before chacha.py (the baseline): one ``cryptography`` ChaCha20
    cipher per seed, its 16-byte nonce the little-endian counter 0 and then ring.SEED_NONCE."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    nonce, zeros = b"\x00" * 4 + ring.SEED_NONCE, bytes(8 * d)
    raw = b"".join(Cipher(algorithms.ChaCha20(seed.tobytes(), nonce), mode=None).encryptor().update(zeros)
                   for seed in seeds)
    return np.frombuffer(raw, dtype=ring.WIRE_DTYPE).reshape(len(seeds), d)


def bench_seed_expansion(n: int = 100_000, d: int = 10, n_servers: int = 3, repeats: int = 3,
                         reference_rows: int = 20_000, seed: int = 4) -> dict[str, Any]:
    """What a server pays for a seed-compressed upload: decoding a body of n seeds, checking
    their binding and expanding them to the (n, d) shares (the CPU work of an upload before the
    ids are hashed), against the same for the full-share body of the same n reports; the
    expansion alone in rows/s and MB/s of keystream; and the expansion as it was before
    (``_one_cipher_per_seed``, on ``reference_rows`` rows) for the speed-up. Medians of
    ``repeats``, alternating."""
    rng = np.random.default_rng(seed)
    study_id = rng.bytes(32).hex()
    encoded = rng.integers(0, np.iinfo(np.uint64).max, size=(n, d), dtype=np.uint64, endpoint=True)
    seeds, last = ring.share_with_seeds(encoded, n_servers)
    contents = [binding.CONTENT_SEED] * (n_servers - 1) + [binding.CONTENT_SHARE]
    ids, proofs = binding.bind(study_id, contents, [*seeds, last])
    bodies = {"seeds": (messages.encode_seed_batch(ids, proofs[0], seeds[0]), messages.SEEDS_MEDIA_TYPE, 0),
              "full": (encode_batch(ids, proofs[-1], last), SHARES_MEDIA_TYPE, n_servers - 1)}
    ring.expand_seeds(seeds[0][:10], d)  # the compiled loop, loaded
    times: dict[str, list[float]] = {"seeds": [], "full": [], "expand": []}
    for _ in range(repeats):
        for mode, (body, media_type, position) in bodies.items():
            t0 = time.perf_counter()
            upload = messages.decode_upload(body, media_type, d, n_servers)
            upload.verify(study_id, n_servers, position)
            shares = upload.shares(d)
            times[mode].append(time.perf_counter() - t0)
            assert len(shares) == n
        t0 = time.perf_counter()
        ring.expand_seeds(seeds[0], d)
        times["expand"].append(time.perf_counter() - t0)
    m = min(reference_rows, n)
    t0 = time.perf_counter()
    before = _one_cipher_per_seed(seeds[0][:m], d)
    before_per_row = (time.perf_counter() - t0) / m
    if not np.array_equal(before, ring.expand_seeds(seeds[0][:m], d)):  # pragma: no cover
        raise AssertionError("the compiled ChaCha20 differs from cryptography's")
    med = {k: float(np.median(v)) for k, v in times.items()}
    return {
        "n": n, "d": d, "n_servers": n_servers, "repeats": repeats, "threads": chacha.THREADS,
        "seed_body_seconds": round(med["seeds"], 4), "full_body_seconds": round(med["full"], 4),
        "seed_to_full_ratio": round(med["seeds"] / med["full"], 3),
        "expand_rows_per_s": round(n / med["expand"]),
        "expand_keystream_mb_per_s": round(n * 8 * d / med["expand"] / 1e6),
        "baseline_one_cipher_per_seed_rows_per_s": round(1 / before_per_row),
        "speedup_over_one_cipher_per_seed": round(before_per_row * n / med["expand"], 1),
    }


def bench_seed_warm_up() -> dict[str, Any]:
    """Seconds until a fresh process can expand seeds (``chacha.warm_up``, numba included): with
    an empty cache (the loop is compiled) and again with the cache that run left; against the
    seconds to import the client SDK's CLI in a fresh process (what every CLI run pays)."""
    def fresh(code: str, env: dict[str, str]) -> float:
        out = subprocess.run([sys.executable, "-c", "import time; t = time.perf_counter(); " + code +
                              "; print(time.perf_counter() - t)"], env=env, check=True,
                             capture_output=True, text=True)
        return round(float(out.stdout.split()[-1]), 3)

    with tempfile.TemporaryDirectory(prefix="dpsketch-numba-") as cache:
        env = os.environ | {"NUMBA_CACHE_DIR": cache}
        warm = "from dpsketch.protocol import chacha; chacha.warm_up()"
        cold_s = fresh(warm, env)
        cached_s = fresh(warm, env)
    return {"compile_seconds": cold_s, "cached_seconds": cached_s,
            "baseline_import_client_cli_seconds": fresh("import dpsketch.client_sdk.cli", dict(os.environ))}


def main(argv: list[str] | None = None) -> int:
    """``python -m dpsketch.tools.server_bench [commit|bulk|single] [--n N] ...``: print the figures as JSON."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m dpsketch.tools.server_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("which", choices=["commit", "bulk", "single", "all"])
    p.add_argument("--n", type=int, help="reports (default: commit 10^6, bulk 200,000)")
    p.add_argument("--d", type=int, help="row width (default: commit 100, bulk and single 32)")
    p.add_argument("--seconds", type=float, default=5.0, help="single: seconds on the server in all (default 5)")
    p.add_argument("--rounds", type=int, default=3,
                   help="single: server intervals, each between two echo intervals (default 3)")
    p.add_argument("--clients", type=int, default=64,
                   help="single: concurrent keep-alive connections (default 64)")
    p.add_argument("--concurrency", type=int, default=2, help="bulk: batches in flight (default 2)")
    p.add_argument("--batch-rows", type=int, metavar="N",
                   help="bulk: rows per batch (default: the SDK's, as many as fill 8 MiB of full shares)")
    p.add_argument("--seeds", action="store_true",
                   help="bulk: upload seeds (what every server but one receives by default) "
                        "instead of full shares")
    p.add_argument("--rotation", type=int, default=0, metavar="N",
                   help="bulk: what one server of N receives from the SDK (full shares in every Nth "
                        "batch, seeds in the others)")
    p.add_argument("--sender", choices=["httpx", "raw"], default="httpx",
                   help="bulk: what posts the prepared bodies: httpx clients (default, as before) or "
                        "plain sockets (raw: a few system calls a batch, so the server's ingest is what is timed)")
    p.add_argument("--reference-only", action="store_true",
                   help="bulk: of the baselines only the reference sketch and the durable floor (faster)")
    p.add_argument("--workdir", type=Path)
    args = p.parse_args(argv)
    if args.seeds and args.rotation:
        p.error("give --seeds or --rotation, not both")
    extra = {"workdir": args.workdir}
    if args.which in ("commit", "all"):
        kw = extra | ({"n": args.n} if args.n else {}) | ({"d": args.d} if args.d else {})
        print(json.dumps({"commit": bench_commit(**kw)}))
    if args.which in ("bulk", "all"):
        kw = extra | ({"n": args.n} if args.n else {}) | ({"d": args.d} if args.d else {})
        print(json.dumps({"bulk": bench_bulk_upload(concurrency=args.concurrency, seeds=args.seeds,
                                                    rotation=args.rotation, batch_rows=args.batch_rows,
                                                    sender=args.sender, reference_only=args.reference_only,
                                                    **kw)}))
    if args.which in ("single", "all"):
        kw = extra | ({"d": args.d} if args.d else {})
        print(json.dumps({"single": bench_single_upload(clients=args.clients, seconds=args.seconds,
                                                        rounds=args.rounds, **kw)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
