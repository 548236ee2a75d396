"""Credentials never leave the process: distinctive secret values are set (storage options
by env and by the Python API, AWS_* secret variables, a URL with a password and a presigned
query) and every output shardcache produces is searched for them, while fetches with the
real credentials still work (moto accepts any key and secret)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from shardcache import ShardCache, StallError
from shardcache._base.errors import ConfigError, FetchError
from shardcache._base.redact import REDACTED, redact_options, redact_text, redact_url
from shardcache._config.settings import Settings

BUCKET = "secrets-bucket"
KEY_ID = "AKIDdistinctKeyId4411"
SECRET = "Secret-distinct-7f3e9a"
SESSION = "Session-distinct-c0ffee"
ENV_SECRET = "EnvSecret-distinct-5b2d"
ENV_SESSION = "EnvSession-distinct-91aa"
PASSWORD = "Passw0rd-distinct-6e1f"
SIGNATURE = "Signature-distinct-0d4c"
CREDENTIAL = "Credential-distinct-77b3"
SECRETS = (KEY_ID, SECRET, SESSION, ENV_SECRET, ENV_SESSION, PASSWORD, SIGNATURE, CREDENTIAL)


def _library_logs(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """shardcache's own records (not the test parts' in shardcache.testing)."""
    return [
        r
        for r in caplog.records
        if r.name.startswith("shardcache") and not r.name.startswith("shardcache.testing")
    ]


def _assert_clean(where: str, text: str) -> None:
    leaked = [s for s in SECRETS if s in text]
    assert not leaked, f"{where} shows {leaked}:\n{text}"


def _options(endpoint_url: str, **extra: Any) -> dict[str, Any]:
    """Per-protocol storage options: s3 gets the credentials, http:// URLs nothing."""
    s3 = {
        "key": KEY_ID,
        "secret": SECRET,
        "token": SESSION,
        "client_kwargs": {"region_name": "us-east-1"},
        "config_kwargs": {"signature_version": "s3v4"},
        "endpoint_url": endpoint_url,
    }
    return {"s3": s3 | extra}


def _secret_env(s3: Any, cache_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(s3.env())
    env["SHARDCACHE_STORAGE_OPTIONS"] = json.dumps(_options(s3.endpoint_url))
    env["SHARDCACHE_DIR"] = str(cache_dir)
    env["AWS_SECRET_ACCESS_KEY"] = ENV_SECRET
    env["AWS_SESSION_TOKEN"] = ENV_SESSION
    return env


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardcache", *args],
        env=env,
        capture_output=True,
        check=False,
        text=True,
        timeout=120,
    )


def _files_on_disk(root: Path) -> str:
    """Every file below ``root`` except the shards' own data, as text."""
    parts = []
    for path in root.rglob("*"):
        if path.is_file() and not path.name.endswith(".tar"):
            parts.append(f"--- {path}\n{path.read_bytes().decode('utf-8', 'replace')}")
    assert parts, f"no metadata or lock records under {root}"
    return "\n".join(parts)


def _presigned(base: str, key: str) -> str:
    """An http URL to moto with a password and a presigned-style query (moto ignores both)."""
    host = base.removeprefix("http://")
    return (
        f"http://reader:{PASSWORD}@{host}/{BUCKET}/{key}?X-Amz-Algorithm=AWS4-HMAC-SHA256"
        f"&X-Amz-Credential={CREDENTIAL}&X-Amz-Security-Token={SESSION}"
        f"&X-Amz-Signature={SIGNATURE}&x-id=GetObject"
    )


def test_redaction_keeps_names_and_leaves_clean_values_alone() -> None:
    shown = redact_options(
        {
            "key": KEY_ID,
            "secret": SECRET,
            "anon": False,
            "client_kwargs": {"aws_session_token": SESSION, "endpoint_url": "http://h:9"},
            "s3": {"headers": {"Authorization": f"Bearer {SESSION}"}},
        }
    )
    assert shown == {
        "key": REDACTED,
        "secret": REDACTED,
        "anon": False,
        "client_kwargs": {"aws_session_token": REDACTED, "endpoint_url": "http://h:9"},
        "s3": {"headers": {"Authorization": REDACTED}},
    }
    plain = "s3://bucket/train-{000..009}.tar?versionId=3&x=a@b"
    assert redact_url(plain) == plain and redact_text(f"see {plain}.") == f"see {plain}."
    assert redact_url(f"s3://{KEY_ID}:{SECRET}@bucket/a.tar") == f"s3://{REDACTED}@bucket/a.tar"
    assert redact_text(f"AWS_SESSION_TOKEN={ENV_SESSION} AWS_REGION=x") == (
        f"AWS_SESSION_TOKEN={REDACTED} AWS_REGION=x"
    )


def test_config_text_and_json_show_option_names_not_secrets(s3, tmp_path: Path) -> None:
    env = _secret_env(s3, tmp_path / "cache")
    env["SHARDCACHE_STORAGE_OPTIONS"] = json.dumps(
        _options(
            f"http://admin:{PASSWORD}@127.0.0.1:9",
            client_kwargs={"aws_session_token": SESSION},
        )
    )
    text = _cli(env, "config")
    as_json = _cli(env, "config", "--json")
    assert text.returncode == 0 and as_json.returncode == 0, text.stderr + as_json.stderr
    for name, out in (("config", text), ("config --json", as_json)):
        _assert_clean(name, out.stdout + out.stderr)
    shown = json.loads(as_json.stdout)["storage_options"]["value"]["s3"]
    assert shown["key"] == shown["secret"] == shown["token"] == REDACTED
    assert shown["client_kwargs"] == {"aws_session_token": REDACTED}
    assert shown["endpoint_url"] == f"http://{REDACTED}@127.0.0.1:9"
    assert '"secret": "***"' in text.stdout


def test_unparsable_storage_options_are_not_echoed() -> None:
    broken = f'{{"secret": "{SECRET}", }}'
    with pytest.raises(ConfigError) as info:
        Settings.resolve(env={"SHARDCACHE_STORAGE_OPTIONS": broken})
    assert "SHARDCACHE_STORAGE_OPTIONS" in str(info.value) and "not valid JSON" in str(info.value)
    _assert_clean("ConfigError", str(info.value) + repr(info.value) + repr(info.value.value))


def test_fetch_works_and_no_output_or_record_shows_a_secret(
    s3,
    fault_proxy,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", ENV_SECRET)
    monkeypatch.setenv("AWS_SESSION_TOKEN", ENV_SESSION)
    s3.put_objects(BUCKET, {"a.tar": b"a" * 5000, "b.tar": b"b" * 3000})
    cache_dir = tmp_path / "cache"
    caplog.set_level(logging.DEBUG, logger="shardcache")
    options = _options(s3.endpoint_url)
    cache = ShardCache(cache_dir, storage_options=options, retries=1, retry_backoff=0)
    assert cache.fetch(f"s3://{BUCKET}/a.tar").read_bytes() == b"a" * 5000
    # One 503 first, so the retry is logged with the URL.
    fault_proxy.add_fault("status:503", times=1, method="GET", path_contains="b.tar")
    signed = _presigned(fault_proxy.endpoint_url, "b.tar")
    assert cache.fetch(signed).read_bytes() == b"b" * 3000
    assert fault_proxy.faults_injected("status:503") == 1
    # The real URL was fetched: moto saw the query, and the cache key is the full URL.
    assert any(SIGNATURE in r.query for r in s3.requests(method="GET"))
    assert cache.path_for(signed) != cache.path_for(signed.replace(SIGNATURE, "other"))
    errors = []
    for url in (f"s3://no-such-{BUCKET}/a.tar", _presigned(s3.endpoint_url, "missing.tar")):
        with pytest.raises(FetchError) as info:
            cache.fetch(url)
        assert info.value.url == url  # the attribute keeps the real URL for handlers
        errors.append(f"{info.value}\n{info.value!r}")
    assert "no-such-" in errors[0] and "missing.tar" in errors[1]
    assert f"X-Amz-Signature={REDACTED}" in errors[1]
    shard_logs = _library_logs(caplog)
    assert any("retrying" in r.getMessage() and "b.tar" in r.getMessage() for r in shard_logs)
    _assert_clean("shardcache logs", "\n".join(caplog.handler.format(r) for r in shard_logs))
    _assert_clean("error messages", "\n".join(errors))
    _assert_clean("reprs", f"{cache!r} {cache.settings!r} {cache.remote.options!r}")
    _assert_clean("records on disk", _files_on_disk(cache_dir))

    env = _secret_env(s3, cache_dir)
    status = _cli(env, "status", "--json", "--rank", "0")
    verify = _cli(env, "verify", "--json")
    warm = _cli(env, "-v", "warm", f"s3://{BUCKET}/a.tar", _presigned(s3.endpoint_url, "gone.tar"))
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["entries"] == 2
    assert verify.returncode == 0, verify.stdout + verify.stderr
    checked = json.loads(verify.stdout)
    assert (checked["counts"]["ok"], checked["counts"]["skipped"]) == (1, 1), verify.stdout
    assert "credentials" in checked["items"][0]["detail"]  # the signed URL is not on record
    assert warm.returncode == 1 and "gone.tar" in warm.stdout, warm.stdout + warm.stderr
    for name, out in (("status", status), ("verify", verify), ("warm -v", warm)):
        _assert_clean(name, out.stdout + out.stderr)


@pytest.mark.timeout(90)
def test_stall_error_report_shows_no_secret(
    s3, fault_proxy, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    s3.put_objects(BUCKET, {f"train-{i}.tar": bytes([i]) * 100_000 for i in range(2)})
    urls = [_presigned(fault_proxy.endpoint_url, f"train-{i}.tar") for i in range(2)]
    caplog.set_level(logging.DEBUG, logger="shardcache")
    cache = ShardCache(tmp_path / "cache", io_timeout=6.0, retries=0)
    cache.fetch(urls[1])  # warm the HTTP client up, so the stall is the hung GET's alone
    fault_proxy.add_fault("hang", times=1, method="GET", path_contains="train-0.tar")
    shards = cache.prefetch(urls, threads=2, depth=2, stall_timeout=2.0)
    with pytest.raises(StallError) as info:
        next(shards)
    assert fault_proxy.faults_injected("hang") == 1
    assert info.value.url == urls[0] and "train-0.tar" in str(info.value)
    shards.close()
    shard_logs = "\n".join(caplog.handler.format(r) for r in _library_logs(caplog))
    _assert_clean("StallError", f"{info.value}\n{info.value!r}")
    _assert_clean("shardcache logs", shard_logs)
