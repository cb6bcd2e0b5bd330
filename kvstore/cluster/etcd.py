"""A small client for etcd's v3 JSON gateway (HTTP), with bounded waits.

Why not the ``etcd3`` package: it pins grpcio/protobuf releases years old that
clash with what vLLM and torch bring. etcd serves the same v3 API as JSON over
HTTP (``/v3/kv/range`` etc., keys and values base64), so the standard library's
urllib is enough: no new dependency, and every call has a timeout.
"""

from __future__ import annotations

import base64
import json
import logging
import urllib.error
import urllib.request
from typing import NamedTuple
from urllib.parse import urlparse

from kvstore.core.errors import ConfigError, PeerUnavailableError

log = logging.getLogger(__name__)


class KeyValue(NamedTuple):
    key: bytes
    value: bytes
    mod_revision: int
    lease: int


class RangeResult(NamedTuple):
    kvs: list[KeyValue]
    revision: int


def parse_etcd_url(url: str) -> str:
    """``etcd://host:port`` (or http://) -> the gateway's base URL."""
    parsed = urlparse(url if "://" in url else f"etcd://{url}")
    if parsed.scheme not in ("etcd", "http") or not parsed.hostname:
        raise ConfigError(f"not an etcd address: {url!r} (use etcd://host:2379)")
    return f"http://{parsed.hostname}:{parsed.port or 2379}"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _prefix_end(prefix: bytes) -> bytes:
    """The smallest key greater than every key starting with ``prefix``."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return b"\x00"
    return stripped[:-1] + bytes([stripped[-1] + 1])


class EtcdClient:
    """Blocking calls to one etcd endpoint; each bounded by ``timeout_s``."""

    def __init__(self, url: str, timeout_s: float = 2.0) -> None:
        self.base = parse_etcd_url(url)
        self.timeout_s = timeout_s

    def _call(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(
            self.base + path, data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:200].decode(errors="replace")
            raise PeerUnavailableError(f"etcd {self.base}{path}: HTTP {exc.code} {detail}") from exc
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise PeerUnavailableError(f"etcd at {self.base} unreachable: {exc}") from exc

    def status(self) -> dict:
        """Raises PeerUnavailableError unless etcd answers."""
        return self._call("/v3/maintenance/status", {})

    def grant(self, ttl_s: int) -> int:
        return int(self._call("/v3/lease/grant", {"TTL": int(ttl_s)})["ID"])

    def keepalive(self, lease: int) -> int:
        """Refresh a lease; returns its TTL, 0 when the lease is gone."""
        reply = self._call("/v3/lease/keepalive", {"ID": str(lease)})
        return int(reply.get("result", {}).get("TTL", 0))

    def revoke(self, lease: int) -> None:
        self._call("/v3/lease/revoke", {"ID": str(lease)})

    def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        body = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        self._call("/v3/kv/put", body)

    def delete(self, key: bytes) -> None:
        self._call("/v3/kv/deleterange", {"key": _b64(key)})

    def get_prefix(self, prefix: bytes) -> RangeResult:
        reply = self._call("/v3/kv/range",
                           {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix))})
        kvs = [KeyValue(base64.b64decode(kv["key"]), base64.b64decode(kv.get("value", "")),
                        int(kv.get("mod_revision", 0)), int(kv.get("lease", 0)))
               for kv in reply.get("kvs", [])]
        return RangeResult(kvs, int(reply["header"]["revision"]))
