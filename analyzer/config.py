"""The analyzer's view of the cluster: which share servers exist and the tokens it holds for them.

Loaded from a JSON file (``--config``) or the ``DPSKETCH_CLUSTER`` environment variable holding
the same JSON, so docker compose can pass it without a file:

    {"servers": [{"server_id": "s1", "url": "http://127.0.0.1:8101",
                  "operator_token": "...", "analyst_token": "..."}, ...],
     "api_token": null, "ca_file": null}

``ca_file`` (optional) is a PEM CA bundle used to verify ``https://`` server URLs.

Any token can come from a file instead (``"analyst_token_file"`` for a server's
``"analyst_token"``, ``"api_token_file"`` for ``"api_token"``; one or the other, not both): then
the JSON itself holds no secret, and docker compose or Kubernetes can hand the tokens over as
secret files rather than through the environment, where ``docker inspect`` shows them. A file
is read once, when the analyzer starts; surrounding whitespace is dropped, as the servers' own
``--*-token-file`` options do.

Order matters: server j of this list receives share j of every report.

A malformed configuration is refused in one sentence naming the offending field
("cluster.json: servers.1.url: Field required"), never pydantic's multi-line dump.
"""

from __future__ import annotations

import json
import os
import ssl
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dpsketch.plain_errors import validation_summary


class ServerEndpoint(BaseModel):
    model_config = ConfigDict(extra="forbid")
    server_id: str
    url: str
    operator_token: str | None = Field(
        default=None, description="not needed: a server takes the analyst token to provision a "
        "study. Leave it out: whoever holds a server's operator token can issue upload tokens, "
        "hence Sybil reports (docs/trust.md)"
    )
    analyst_token: str | None = None
    analyst_token_file: str | None = Field(
        default=None, description="file holding analyst_token (instead of the token itself)")

    @model_validator(mode="after")
    def _read_token(self) -> "ServerEndpoint":
        self.analyst_token = _one_token(self.analyst_token, self.analyst_token_file,
                                        f"server {self.server_id}'s analyst_token", required=True)
        return self


def _one_token(value: str | None, path: str | None, what: str, required: bool) -> str | None:
    """The token given inline or in the file at ``path`` (exactly one of them when ``required``)."""
    if value is not None and path is not None:
        raise ValueError(f"{what}: give the token or a file holding it (_file), not both")
    if path is not None:
        try:
            value = Path(path).read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{what}: cannot read the token file {path}: {exc}") from None
        if not value:
            raise ValueError(f"{what}: the token file {path} is empty")
    if required and not value:
        raise ValueError(f"{what} is missing (give it, or a file holding it: _file)")
    return value


class ClusterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    servers: list[ServerEndpoint] = Field(min_length=2)
    api_token: str | None = Field(
        default=None, description="bearer token analysts must present to this analyzer; the "
        "analyzer refuses to start without one unless run with --insecure-no-api-token"
    )
    api_token_file: str | None = Field(
        default=None, description="file holding api_token (instead of the token itself)")
    ca_file: str | None = Field(
        default=None, description="CA bundle (PEM) to verify the share servers' HTTPS certificates "
        "with, instead of the system's trust store (e.g. ca.pem from deploy/make-certs.py)"
    )

    @model_validator(mode="after")
    def _distinct(self) -> "ClusterConfig":
        self.api_token = _one_token(self.api_token, self.api_token_file, "api_token", required=False)
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
        """The configuration in the file at ``path``, else in ``$DPSKETCH_CLUSTER``. A malformed
        one raises ValueError in one line: where it came from, then each offending field."""
        if path is not None:
            source, raw = str(path), Path(path).read_text()
        else:
            source, raw = "DPSKETCH_CLUSTER", os.environ.get("DPSKETCH_CLUSTER") or ""
            if not raw:
                raise ValueError("no cluster configuration: pass --config FILE or set DPSKETCH_CLUSTER")
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise ValueError(f"{source} is not JSON: {exc}") from None
        try:
            return cls.model_validate(body)
        except ValidationError as exc:
            raise ValueError(f"{source}: {validation_summary(exc)}") from None
