"""The analyzer's view of the cluster: which share servers exist and the tokens it holds for them.

Loaded from a JSON file (``--config``) or the ``DPSKETCH_CLUSTER`` environment variable holding
the same JSON, so docker compose can pass it without a file:

    {"servers": [{"server_id": "s1", "url": "http://127.0.0.1:8101",
                  "operator_token": "...", "analyst_token": "..."}, ...],
     "api_token": null, "ca_file": null}

``ca_file`` (optional) is a PEM CA bundle used to verify ``https://`` server URLs.

Order matters: server j of this list receives share j of every report.
"""

from __future__ import annotations

import json
import os
import ssl
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ServerEndpoint(BaseModel):
    model_config = ConfigDict(extra="forbid")
    server_id: str
    url: str
    operator_token: str | None = Field(
        default=None, description="not needed: a server takes the analyst token to provision a "
        "study. Leave it out: whoever holds a server's operator token can issue upload tokens, "
        "hence Sybil reports (docs/trust.md)"
    )
    analyst_token: str


class ClusterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    servers: list[ServerEndpoint] = Field(min_length=2)
    api_token: str | None = Field(
        default=None, description="bearer token analysts must present to this analyzer; the "
        "analyzer refuses to start without one unless run with --insecure-no-api-token"
    )
    ca_file: str | None = Field(
        default=None, description="CA bundle (PEM) to verify the share servers' HTTPS certificates "
        "with, instead of the system's trust store (e.g. ca.pem from deploy/make-certs.py)"
    )

    @model_validator(mode="after")
    def _distinct(self) -> "ClusterConfig":
        ids = [s.server_id for s in self.servers]
        if len(set(ids)) != len(ids):
            raise ValueError("server ids must be distinct")
        urls = [s.url.rstrip("/") for s in self.servers]
        if len(set(urls)) != len(urls):
            raise ValueError("server urls must be distinct: one share per server")
        return self

    def ssl_context(self) -> ssl.SSLContext | None:
        """The context verifying the servers against ``ca_file``; None: httpx's default trust."""
        if self.ca_file is None:
            return None
        try:
            return ssl.create_default_context(cafile=self.ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"cannot load the CA file {self.ca_file}: {exc}") from exc

    @property
    def server_ids(self) -> list[str]:
        return [s.server_id for s in self.servers]

    @property
    def urls(self) -> list[str]:
        return [s.url.rstrip("/") for s in self.servers]

    @classmethod
    def load(cls, path: str | Path | None = None) -> "ClusterConfig":
        if path is not None:
            return cls.model_validate_json(Path(path).read_text())
        raw = os.environ.get("DPSKETCH_CLUSTER")
        if not raw:
            raise ValueError("no cluster configuration: pass --config FILE or set DPSKETCH_CLUSTER")
        return cls.model_validate(json.loads(raw))
