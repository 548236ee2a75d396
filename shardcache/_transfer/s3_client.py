"""How the S3 clients s3fs makes for us are configured: the options we add to the user's
(timeouts, retries, connection pool, checksum validation, certificates) and the parsed service
models every client of the process shares."""

from __future__ import annotations

import threading
import urllib.request
from typing import Any

from .download import RemoteOptions


def s3_client_options(chosen: dict[str, Any], options: RemoteOptions) -> dict[str, Any]:
    """``chosen`` (the user's s3fs options, a copy) with our defaults added; a key the user set
    is kept as it is."""
    config = dict(chosen.get("config_kwargs") or {})
    config.setdefault("connect_timeout", options.io_timeout)
    config.setdefault("read_timeout", options.io_timeout)
    # Our RetryPolicy owns retries: botocore's and s3fs's own would multiply them.
    config.setdefault("retries", {"total_max_attempts": 1})
    # One client serves every thread of the process (Remote.filesystem): enough connections
    # for every download thread's parts at once.
    config.setdefault("max_pool_connections", options.max_connections)
    # We verify downloads ourselves (SHARDCACHE_VERIFY; the whole-object GET asks for the
    # object's checksum: download.ask_for_checksums). botocore's own check of a GET's
    # x-amz-checksum-* would compute it a second time, and a server that sends the whole
    # object's checksum with a ranged GET would fail every part.
    config.setdefault("response_checksum_validation", "when_required")
    chosen["config_kwargs"] = config
    if _plain_http_without_tls(chosen):
        chosen["client_kwargs"] = dict(chosen.get("client_kwargs") or {}) | {"verify": False}
    return chosen


def _plain_http_without_tls(chosen: dict[str, Any]) -> bool:
    """Whether the client talks plain ``http://`` to an endpoint the user named, with nothing
    that could use TLS on the way.

    aiobotocore loads the whole certificate bundle when a client sends its first request,
    TLS or not: 20-40 ms of CPU on the path of every process's (and every DataLoader
    worker's) first sample. For such a client ``verify=False`` skips only that load. It is
    not set when the user chose ``verify`` or a client certificate, when any proxy is
    configured (a proxy may be reached over TLS), or when the endpoint comes from anywhere
    but these options (botocore's environment and profile rules decide that one). A
    redirect from the plain endpoint to ``https://`` would not be verified; whoever can
    forge that unauthenticated redirect can already forge the plain response itself."""
    client = chosen.get("client_kwargs") or {}
    endpoint = chosen.get("endpoint_url") or client.get("endpoint_url")
    if not isinstance(endpoint, str) or not endpoint.lower().startswith("http://"):
        return False
    config = chosen["config_kwargs"]
    chosen_tls = "verify" in client or config.get("client_cert") or config.get("proxies")
    return not (chosen_tls or urllib.request.getproxies())


_loader_lock = threading.Lock()
_shared: dict[str, Any] = {}  # "loader": botocore's data loader, for every S3 client here


def share_service_models(fs: Any) -> None:
    """Give a new S3 file system (one that would make its own aiobotocore session) a session
    whose data loader is shared by the whole process: every session otherwise parses
    botocore's S3 service model and endpoint rules again, 0.15-0.4 s of CPU per client on
    a 2-core machine, paid by every cache and every DataLoader worker. The loader only
    reads botocore's bundled JSON (``AWS_DATA_PATH`` is read when it is first made);
    credentials, profile and configuration stay per session."""
    if getattr(fs, "session", True) is not None or getattr(fs, "_s3", True) is not None:
        return  # the caller gave its own session, or this s3fs is not the one we know
    from aiobotocore.session import AioSession

    session = AioSession(**getattr(fs, "kwargs", {}))
    with _loader_lock:
        if "loader" not in _shared:
            _shared["loader"] = session.get_component("data_loader")
        else:
            session.register_component("data_loader", _shared["loader"])
    fs.session = session
