"""Configuration of one share server, gathered in one immutable object.

The command line (``services.__main__``) builds it from flags and environment; tests build it
directly. Keeping it a plain dataclass means ``create_app(settings)`` needs no globals, so one
test process can run several independent servers side by side.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from dpsketch.protocol.study import SERVER_ID_PATTERN

MIB = 1 << 20


@dataclass(frozen=True)
class Settings:
    server_id: str
    db_path: Path
    operator_token: str
    analyst_token: str
    #: Largest request body accepted (413 beyond). A 10k-row batch at d = 100 is about 8 MiB.
    max_body_bytes: int = 64 * MIB
    #: How long a write waits for a SQLite lock held by someone else before answering 503.
    busy_timeout_s: float = 5.0
    #: Upper bounds on one group commit: more rows or requests wait for the next transaction.
    max_group_rows: int = 200_000
    max_group_jobs: int = 1024
    #: Requests waiting for the writer beyond this are refused with 503 (back-pressure).
    max_queued_jobs: int = 4096
    #: ... and so are uploads beyond this many share bytes waiting (bounds memory under load).
    max_queued_bytes: int = 1024 * MIB
    #: Resource policy: this server keeps a k x k int64 matrix and a k x d aggregate per study
    #: in memory, so it refuses (422 invalid-study) studies that would not fit.
    max_k: int = 4096
    max_aggregate_cells: int = 1 << 24
    #: Rows read per chunk when rebuilding a study's running totals from the database.
    load_chunk_rows: int = 50_000
    #: Load every open study's running totals in a background thread at startup.
    warm_start: bool = True

    def __post_init__(self) -> None:
        if not re.match(SERVER_ID_PATTERN, self.server_id):
            raise ValueError(f"server id {self.server_id!r} must match {SERVER_ID_PATTERN}")
        if not self.operator_token or not self.analyst_token:
            raise ValueError("both an operator token and an analyst token are required")
        if self.operator_token == self.analyst_token:
            raise ValueError("the operator and analyst tokens must differ (they grant different roles)")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be at least 1024")
