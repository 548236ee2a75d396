"""The options shardcache adds to an S3 client's (``_transfer.s3_client``): which clients skip
loading the certificate bundle, and that a user's own choice is kept."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from shardcache import ShardCache

PLAIN = "http://10.0.0.7:9000"


@pytest.fixture(autouse=True)
def _no_proxy_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)


def _client_options(tmp_path: Path, storage_options: dict[str, Any]) -> dict[str, Any]:
    cache = ShardCache(tmp_path / "cache", storage_options=storage_options)
    return cache.remote.storage_options_for("s3")


@pytest.mark.parametrize(
    "options",
    [{"endpoint_url": PLAIN}, {"client_kwargs": {"endpoint_url": PLAIN, "region_name": "x"}}],
)
def test_a_plain_http_endpoint_needs_no_certificates(tmp_path: Path, options: dict) -> None:
    resolved = _client_options(tmp_path, options)
    assert resolved["client_kwargs"]["verify"] is False
    if "client_kwargs" in options:
        assert resolved["client_kwargs"]["region_name"] == "x"
        assert "verify" not in options["client_kwargs"], "the user's options are not edited"


@pytest.mark.parametrize(
    "options",
    [
        {},  # the endpoint comes from botocore's environment or profile: not ours to judge
        {"endpoint_url": "https://s3.example.test"},
        {"endpoint_url": "HTTPS://s3.example.test"},
        {"endpoint_url": PLAIN, "client_kwargs": {"verify": "/etc/ssl/my-ca.pem"}},
        {"endpoint_url": PLAIN, "client_kwargs": {"verify": True}},
        {"endpoint_url": PLAIN, "config_kwargs": {"proxies": {"http": "https://proxy:3128"}}},
        {"endpoint_url": PLAIN, "config_kwargs": {"client_cert": "/etc/ssl/me.pem"}},
    ],
)
def test_tls_settings_are_left_to_botocore_otherwise(tmp_path: Path, options: dict) -> None:
    resolved = _client_options(tmp_path, options)
    expected = (options.get("client_kwargs") or {}).get("verify", "unset")
    assert (resolved.get("client_kwargs") or {}).get("verify", "unset") == expected


def test_a_proxy_in_the_environment_keeps_the_certificates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "https://proxy.example.test:3128")
    resolved = _client_options(tmp_path, {"endpoint_url": PLAIN})
    assert "verify" not in (resolved.get("client_kwargs") or {})


def test_our_defaults_never_override_the_users(tmp_path: Path) -> None:
    config = {"read_timeout": 5, "retries": {"total_max_attempts": 7}, "max_pool_connections": 3}
    resolved = _client_options(tmp_path, {"endpoint_url": PLAIN, "config_kwargs": config})
    assert resolved["config_kwargs"] | config == resolved["config_kwargs"]
    assert resolved["config_kwargs"]["connect_timeout"] > 0  # ours, where the user set none
    assert resolved["config_kwargs"]["response_checksum_validation"] == "when_required"
