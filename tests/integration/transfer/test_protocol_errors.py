"""Retries decided from the real cause on every protocol, and errors that keep their built-in
family: a real HTTP server on loopback, the moto S3 server behind the fault proxy, and real
local files (permissions enforced on a process that dropped root's capabilities)."""

from __future__ import annotations

import functools
import os
import pickle
import shutil
import ssl
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from httpserver import TRUNCATE, HttpServer, http_server
from mounts import needs_root
from ports import reserved_port

from shardcache import (
    PermanentFetchError,
    RemoteIsADirectoryError,
    RemoteNotFoundError,
    RemotePermissionError,
    ShardCache,
    TransientFetchError,
)

pytestmark = pytest.mark.timeout(120)
RETRIES = 2
BODY = os.urandom(300_000)


@pytest.fixture
def server() -> Iterator[HttpServer]:
    with http_server() as running:
        yield running


def _cache(tmp_path: Path, **options) -> ShardCache:
    return ShardCache(tmp_path / "cache", retries=RETRIES, retry_backoff=0.01, **options)


# -- http(s):// ----------------------------------------------------------------------


@pytest.mark.parametrize("status", [503, 500, 429, 408])
def test_http_transient_status_is_retried_then_served(
    server: HttpServer, tmp_path: Path, status: int
) -> None:
    url = server.add("/a.tar", BODY, failures=[status, status])
    cache = _cache(tmp_path)
    assert cache.fetch(url).read_bytes() == BODY
    assert server.seen("/a.tar").count(status) == 2
    assert cache.stats().misses == 1


def test_http_persistent_503_gives_up_after_every_attempt(
    server: HttpServer, tmp_path: Path
) -> None:
    url = server.add("/a.tar", BODY, failures=[503] * 100)
    with pytest.raises(TransientFetchError, match="HTTP 503") as caught:
        # Every refusal an attempt (by default a 503 is waited out for 120 s first).
        _cache(tmp_path, slowdown_retry_time=0).fetch(url)
    assert caught.value.attempts == RETRIES + 1
    # fsspec looks an object up with HEAD, then GET: two requests per attempt.
    assert server.seen("/a.tar") == [503] * 2 * (RETRIES + 1)


def test_http_404_is_not_found_at_once(server: HttpServer, tmp_path: Path) -> None:
    url = server.url + "/missing.tar"
    with pytest.raises(RemoteNotFoundError, match="does not exist") as caught:
        _cache(tmp_path).fetch(url)
    assert isinstance(caught.value, FileNotFoundError)
    assert caught.value.attempts == 1
    assert server.seen("/missing.tar") == [404, 404]  # HEAD, GET: one attempt


@pytest.mark.parametrize("status", [403, 401])
def test_http_denied_is_a_permission_error_at_once(
    server: HttpServer, tmp_path: Path, status: int
) -> None:
    url = server.add("/secret.tar", BODY, failures=[status] * 10)
    with pytest.raises(RemotePermissionError, match="permission denied") as caught:
        _cache(tmp_path).fetch(url)
    assert isinstance(caught.value, PermissionError)
    assert caught.value.attempts == 1
    assert len(server.seen("/secret.tar")) == 2


def test_http_other_4xx_is_permanent_at_once(server: HttpServer, tmp_path: Path) -> None:
    url = server.add("/bad.tar", BODY, failures=[400] * 10)
    with pytest.raises(PermanentFetchError, match="HTTP 400") as caught:
        _cache(tmp_path).fetch(url)
    assert caught.value.attempts == 1


def test_http_status_during_the_download_is_retried(server: HttpServer, tmp_path: Path) -> None:
    url = server.add("/a.tar", BODY, failures=[502], method="GET")
    cache = _cache(tmp_path)
    assert cache.fetch(url).read_bytes() == BODY
    assert 502 in server.seen("/a.tar", "GET")


def test_http_body_cut_short_is_retried(server: HttpServer, tmp_path: Path) -> None:
    url = server.add("/a.tar", BODY, failures=[TRUNCATE], method="GET")
    cache = _cache(tmp_path)
    assert cache.fetch(url).read_bytes() == BODY
    gets = server.seen("/a.tar", "GET")
    assert gets[0] == TRUNCATE and len(gets) >= 2


def test_http_server_without_range_support_serves_large_shards(tmp_path: Path) -> None:
    """Python's own file server ignores Range; fsspec's block reads (a ranged GET per
    block) fail on it past the first block. One streaming GET reads the whole body."""
    served = tmp_path / "served"
    served.mkdir()
    (served / "a.tar").write_bytes(BODY)
    requests: list[tuple[str, str | None]] = []

    class Handler(SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            requests.append((self.command, self.headers.get("Range")))

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=served))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        port = httpd.server_address[1]
        cache = _cache(tmp_path, chunk_size=64 << 10)  # several blocks of a 300 kB body
        assert cache.fetch(f"http://127.0.0.1:{port}/a.tar").read_bytes() == BODY
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(10)
    assert requests == [("HEAD", None), ("GET", None)]


def test_http_connection_refused_on_loopback_fails_at_once_naming_the_host(
    tmp_path: Path,
) -> None:
    with reserved_port() as port, pytest.raises(PermanentFetchError) as caught:
        _cache(tmp_path).fetch(f"http://127.0.0.1:{port}/a.tar")  # nothing listens there
    assert caught.value.attempts == 1  # nothing listens on this machine's port: not retried
    message = str(caught.value)
    assert "the connection was refused by 127.0.0.1" in message
    assert "requests go to the host in the URL" in message and "not retried on loopback" in message


def test_s3_connection_refused_names_the_endpoint_of_the_storage_options(
    s3, tmp_path: Path
) -> None:
    with reserved_port() as port, pytest.raises(PermanentFetchError) as caught:
        endpoint = f"http://127.0.0.1:{port}"  # nothing listens there
        options = {**s3.storage_options(), "endpoint_url": endpoint}  # wins over AWS_ENDPOINT_URL
        _cache(tmp_path, storage_options=options).fetch("s3://bucket/a.tar")
    assert caught.value.attempts == 1 and caught.value.endpoint.startswith(endpoint)
    assert f"requests go to {endpoint} (from storage_options endpoint_url)" in str(caught.value)


@needs_root
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux)")
def test_http_failed_name_lookup_is_transient(tmp_path: Path) -> None:
    """Run in a network and mount namespace of its own whose resolver is 127.0.0.1 (where
    nothing answers), so the lookup fails at once and no query leaves the machine."""
    resolv = tmp_path / "resolv.conf"
    resolv.write_text("nameserver 127.0.0.1\noptions attempts:1 timeout:1\n")
    script = textwrap.dedent(
        """
        import sys
        from shardcache import ShardCache, TransientFetchError
        cache = ShardCache(sys.argv[1], retries=2, retry_backoff=0.01)
        try:
            cache.fetch("http://shardcache-test.invalid/a.tar")
        except TransientFetchError as exc:
            print("transient", exc.attempts, exc.cause)
        """
    )
    shell = (
        f"ip link set lo up && mount --bind {resolv} /etc/resolv.conf && "
        f'exec "{sys.executable}" -c "$0" "$1"'
    )
    result = subprocess.run(
        ["unshare", "--net", "--mount", "sh", "-c", shell, script, str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    words = result.stdout.split()
    assert words[:2] == ["transient", str(RETRIES + 1)], result.stdout + result.stderr
    assert "DNS" in result.stdout or "resolution" in result.stdout or "Name" in result.stdout


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (certificate, key) that nothing trusts."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"),
            *("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"),
            *("-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)),
        ],
        capture_output=True,
        timeout=60,
        check=True,
    )
    return cert, key


def test_https_untrusted_certificate_fails_at_once(
    certificate: tuple[Path, Path], tmp_path: Path
) -> None:
    """The same certificate comes back on every attempt: one attempt, a message about the
    certificate, and a hint (SSL_CERT_FILE) that really makes the fetch work."""
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(*certificate)
    hellos: list[str | None] = []
    tls.sni_callback = lambda _sock, name, _ctx: hellos.append(name)  # every ClientHello
    with http_server(tls) as https:
        url = https.add("/a.tar", BODY)
        with pytest.raises(PermanentFetchError, match="certificate was rejected") as caught:
            _cache(tmp_path).fetch(url)
        assert not isinstance(caught.value, TransientFetchError)
        assert caught.value.attempts == 1
        assert "SSL_CERT_FILE" in str(caught.value)
        assert https.requests == []  # no request got past the handshake
        assert len(hellos) == 2  # one attempt: fsspec's info tries HEAD, then GET

        script = "import sys; from shardcache import ShardCache; "
        script += "print(len(ShardCache(sys.argv[1]).fetch(sys.argv[2]).read_bytes()))"
        trusted = subprocess.run(
            [sys.executable, "-c", script, str(tmp_path / "trusting"), url],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env={**os.environ, "SSL_CERT_FILE": str(certificate[0])},
        )
        assert trusted.stdout.split() == [str(len(BODY))], trusted.stderr
        assert set(https.seen("/a.tar")) == {200} and https.seen("/a.tar", "GET") == [200]


# -- s3:// (AccessDenied: tests/integration/cache/test_cache_s3.py) ------------------------


def test_s3_503_then_success_is_retried(s3, fault_proxy, tmp_path: Path) -> None:
    s3.put_objects("retry", {"a.tar": BODY})
    fault_proxy.add_fault("status:503", times=2, method="HEAD", path_contains="a.tar")
    cache = _cache(tmp_path, storage_options={"endpoint_url": fault_proxy.endpoint_url})
    assert cache.fetch("s3://retry/a.tar").read_bytes() == BODY


# -- file:// and plain paths -------------------------------------------------------------


@pytest.mark.parametrize("form", ["path", "file-url"])
def test_local_missing_directory_and_family(tmp_path: Path, form: str) -> None:
    def url(path: Path) -> str:
        return str(path) if form == "path" else path.as_uri()

    cache = _cache(tmp_path)
    with pytest.raises(FileNotFoundError) as missing:
        cache.fetch(url(tmp_path / "nope.tar"))
    assert isinstance(missing.value, RemoteNotFoundError) and missing.value.attempts == 1
    with pytest.raises(IsADirectoryError) as directory:
        cache.fetch(url(tmp_path))
    assert isinstance(directory.value, RemoteIsADirectoryError)
    assert isinstance(directory.value, OSError) and directory.value.attempts == 1
    clone = pickle.loads(pickle.dumps(directory.value))  # DataLoader workers re-raise it
    assert isinstance(clone, IsADirectoryError) and clone.url == directory.value.url


@needs_root
def test_local_unreadable_file_is_a_permission_error_at_once(tmp_path: Path) -> None:
    """Root without its capabilities (setpriv) really cannot read a mode-000 file."""
    shard = tmp_path / "locked.tar"
    shard.write_bytes(BODY)
    shard.chmod(0)
    script = textwrap.dedent(
        """
        import sys
        from shardcache import ShardCache, RemotePermissionError
        try:
            ShardCache(sys.argv[1], retries=2, retry_backoff=0.01).fetch(sys.argv[2])
        except PermissionError as exc:
            print(type(exc).__name__, exc.attempts, isinstance(exc, RemotePermissionError))
        """
    )
    result = subprocess.run(
        [
            *("setpriv", "--bounding-set=-all", "--inh-caps=-all", "--", sys.executable),
            *("-c", script, str(tmp_path / "cache"), str(shard)),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.stdout.split() == ["RemotePermissionError", "1", "True"], result.stderr
