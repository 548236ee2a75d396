"""Settings: parsing, precedence, launcher detection and error messages."""

from __future__ import annotations

import json
import logging
import pickle
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from repo import ROOT

from shardcache._base.errors import ConfigError
from shardcache._config.display import format_setting
from shardcache._config.parse import parse_duration, parse_size
from shardcache._config.settings import PREFETCH_OPTIONS, Settings, prefetch_overrides
from shardcache._config.specs import SPECS
from shardcache._config.unknown import unknown_env


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1048576", 1 << 20),
        ("64K", 64_000),  # decimal, as sizes are printed
        ("30M", 30_000_000),
        ("500G", 500 * 10**9),
        ("1.5T", 1_500 * 10**9),
        ("10gb", 10 * 10**9),
        ("64KiB", 64 << 10),  # binary with i
        ("8Mi", 8 << 20),
        ("2TiB", 2 << 40),
        (" 7 ", 7),
        ("7B", 7),
    ],
)
def test_sizes(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [("90s", 90), ("5m", 300), ("1h30m", 5400), ("250ms", 0.25), ("0.5", 0.5), ("2d", 172800)],
)
def test_durations(text: str, expected: float) -> None:
    assert parse_duration(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["", "abc", "5x", "1h30", "s", "-5s", "nan", "inf", "1e400"])
def test_bad_durations_name_the_accepted_form(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_duration(text, "SHARDCACHE_STALL_TIMEOUT")
    assert "SHARDCACHE_STALL_TIMEOUT" in str(info.value) and "90s" in str(info.value)


@pytest.mark.parametrize("text", ["", "lots", "-1G", "5X", "1e3", "99999999999P"])
def test_bad_sizes(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_size(text, "SHARDCACHE_MAX_BYTES")
    assert "SHARDCACHE_MAX_BYTES" in str(info.value)


def test_defaults_without_any_env(tmp_path: Path) -> None:
    s = Settings.resolve(env={"TMPDIR": str(tmp_path)})
    assert s.scope == "rank" and s.rank == 0 and s.world_size == 1
    assert s.cache_dir.parent == tmp_path and s.cache_dir.name.startswith("shardcache-")
    assert s.scope_dir == s.cache_dir / "rank-0"
    assert all(src == "default" for name, src in s.sources.items() if name != "job_id")


def test_default_root_is_never_the_home_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    s = Settings.resolve(env={})
    assert not str(s.cache_dir).startswith(str(Path.home()))


def test_torchrun_env() -> None:
    env = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "GROUP_RANK": "2"}
    s = Settings.resolve(env=env)
    assert (s.rank, s.local_rank, s.world_size, s.node_rank) == (5, 1, 8, 2)
    assert s.sources["rank"] == "env RANK (torchrun)"
    assert s.scope_dir.name == "rank-5"


def test_slurm_env() -> None:
    env = {
        "SLURM_PROCID": "3",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS": "4",
        "SLURM_NODEID": "1",
        "SLURM_JOB_ID": "777",
    }
    s = Settings.resolve(env=env)
    assert (s.rank, s.local_rank, s.world_size, s.node_rank, s.job_id) == (3, 1, 4, 1, "777")
    assert s.sources["rank"] == "env SLURM_PROCID (slurm)"


def test_torchrun_inside_slurm_wins() -> None:
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "RANK": "6", "WORLD_SIZE": "8"}
    s = Settings.resolve(env=env)
    assert (s.rank, s.world_size) == (6, 8)


def test_precedence_argument_over_shardcache_env_over_launcher(tmp_path: Path) -> None:
    env = {
        "RANK": "1",
        "WORLD_SIZE": "4",
        "SHARDCACHE_RANK": "2",
        "SHARDCACHE_SCOPE": "node",
        "SHARDCACHE_DIR": str(tmp_path / "env"),
        "SHARDCACHE_THREADS": "3",
    }
    s = Settings.resolve(env=env, threads=9, cache_dir=tmp_path / "arg")
    assert s.rank == 2 and s.sources["rank"] == "env SHARDCACHE_RANK"
    assert s.threads == 9 and s.sources["threads"] == "argument"
    assert s.cache_dir == tmp_path / "arg"
    assert s.scope == "node" and s.scope_dir == tmp_path / "arg" / "node"


def test_every_setting_has_an_env_variable_and_parses_its_default() -> None:
    for name, spec in SPECS.items():
        assert spec.env.startswith("SHARDCACHE_"), name


@pytest.mark.parametrize(
    ("var", "value", "fragment"),
    [
        ("SHARDCACHE_SCOPE", "cluster", "rank, node"),
        ("SHARDCACHE_LOCK_MODE", "nfs", "auto, flock, lease"),
        ("SHARDCACHE_THREADS", "0", "between 1 and 1024"),
        ("SHARDCACHE_THREADS", "-2", "between 1"),
        ("SHARDCACHE_THREADS", "many", "whole number"),
        ("SHARDCACHE_THREADS", "99999999", "between 1 and 1024"),
        ("SHARDCACHE_PREFETCH_DEPTH", "0", "between 1"),
        ("SHARDCACHE_RETRIES", "1000", "between 0 and 100"),
        ("SHARDCACHE_LOCK_TIMEOUT", "0s", "between"),
        ("SHARDCACHE_LOCK_TIMEOUT", "forever", "90s"),
        ("SHARDCACHE_STALL_TIMEOUT", "1000d", "between 10ms and 30d"),
        ("SHARDCACHE_CHUNK_SIZE", "1", "between 4KiB and 1GiB"),
        ("SHARDCACHE_MAX_BYTES", "-5", "500G"),
        ("SHARDCACHE_STORAGE_OPTIONS", "[1, 2]", "JSON object"),
        ("SHARDCACHE_VERIFY", "sha", "etag, size"),
        ("SHARDCACHE_MAX_REQUEST_RATE", "fast", "requests per second"),
        ("SHARDCACHE_MAX_REQUEST_RATE", "-1", "requests per second"),
        ("SHARDCACHE_MAX_REQUEST_RATE", "1e7", "between 0.001 and 1e+06"),
        ("SHARDCACHE_JOB_REQUEST_RATE", "lots", "requests per second"),
        ("SHARDCACHE_DIR", "", "node-local"),
        ("SHARDCACHE_NODE_LOCK_DIR", "locks", "absolute path"),
        ("SHARDCACHE_NODE_LOCK_DIR", "", "or off"),
        ("SHARDCACHE_RANK", "x", "whole number"),
        ("RANK", "zero", "whole number"),
        ("SLURM_NTASKS", "-1", "between 1"),
    ],
)
def test_bad_values_name_variable_value_and_accepted_form(
    var: str, value: str, fragment: str
) -> None:
    with pytest.raises(ConfigError) as info:
        Settings.resolve(env={var: value})
    message = str(info.value)
    assert var in message
    assert repr(value) in message
    assert fragment in message
    assert isinstance(info.value, ValueError)


def test_rank_beyond_world_size_is_reported() -> None:
    with pytest.raises(ConfigError, match="inconsistent"):
        Settings.resolve(env={"RANK": "4", "WORLD_SIZE": "4"})


def test_bad_explicit_argument_names_the_argument() -> None:
    with pytest.raises(ConfigError, match="argument threads"):
        Settings.resolve(env={}, threads=0)
    with pytest.raises(ConfigError, match="unknown setting"):
        Settings.resolve(env={}, thread=2)


def test_prefetch_options_are_checked_by_the_settings_they_override() -> None:
    assert prefetch_overrides(threads=2, depth=None, stall_timeout=0.5) == {
        "threads": 2,
        "stall_timeout": 0.5,
    }
    for option, setting in PREFETCH_OPTIONS.items():
        spec = SPECS[setting]
        kind = type(spec.default)
        assert prefetch_overrides(**{option: kind(spec.high)}) == {option: spec.high}
        for outside in (spec.low - 1, spec.high + 1):
            with pytest.raises(ConfigError, match=f"prefetch option {option}=.*out of range"):
                prefetch_overrides(**{option: kind(outside)})
        with pytest.raises(ConfigError, match=f"prefetch option {option}=.*wrong type"):
            prefetch_overrides(**{option: "2"})
    with pytest.raises(ConfigError, match="unknown prefetch option"):
        prefetch_overrides(prefetch_depth=2)


def test_max_request_rate_spellings() -> None:
    for text in ("0", "none", "", "off"):
        assert Settings.resolve(env={"SHARDCACHE_MAX_REQUEST_RATE": text}).max_request_rate is None
    assert Settings.resolve(env={"SHARDCACHE_MAX_REQUEST_RATE": "2.5/s"}).max_request_rate == 2.5
    assert Settings.resolve(env={}, max_request_rate=40).max_request_rate == 40.0
    with pytest.raises(ConfigError, match="argument max_request_rate"):
        Settings.resolve(env={}, max_request_rate=-3)
    assert Settings.resolve(env={"SHARDCACHE_JOB_REQUEST_RATE": "5500"}).job_request_rate == 5500


def test_node_lock_dir(tmp_path: Path) -> None:
    assert Settings.resolve(env={}).node_lock_dir is None  # the default: under the temp dir
    env = {"SHARDCACHE_NODE_LOCK_DIR": str(tmp_path / "locks")}
    assert Settings.resolve(env=env).node_lock_dir == tmp_path / "locks"
    assert Settings.resolve(env={"SHARDCACHE_NODE_LOCK_DIR": " OFF "}).node_lock_dir == "off"


def test_max_bytes_unlimited_spellings() -> None:
    for text in ("0", "none", "unlimited"):
        assert Settings.resolve(env={"SHARDCACHE_MAX_BYTES": text}).max_bytes is None
    assert Settings.resolve(env={"SHARDCACHE_MAX_BYTES": "2G"}).max_bytes == 2 * 10**9


def test_settings_pickle(tmp_path: Path) -> None:
    s = Settings.resolve(env={"SHARDCACHE_DIR": str(tmp_path)})
    assert pickle.loads(pickle.dumps(s)) == s


def _python(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return _python("-m", "shardcache", *args, env=env)


def test_config_command_json_shows_value_and_source(tmp_path: Path) -> None:
    env = {
        "PATH": "/usr/bin:/bin",
        "SHARDCACHE_DIR": str(tmp_path),
        "SLURM_PROCID": "1",
        "SLURM_NTASKS": "2",
    }
    out = _cli("config", "--json", env=env)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["cache_dir"] == {
        "value": str(tmp_path),
        "text": str(tmp_path),
        "env": "SHARDCACHE_DIR",
        "source": "env SHARDCACHE_DIR",
    }
    assert data["lock_timeout"]["value"] == 3600.0 and data["lock_timeout"]["text"] == "1h"
    assert data["rank"]["value"] == 1 and data["rank"]["source"] == "env SLURM_PROCID (slurm)"
    assert data["scope_dir"]["value"] == str(tmp_path / "rank-1")
    text = _cli("config", env=env)
    assert text.returncode == 0 and "SHARDCACHE_DIR" in text.stdout


def test_config_command_shows_every_setting_and_marks_the_bad_ones(tmp_path: Path) -> None:
    env = {
        "PATH": "/usr/bin:/bin",
        "SHARDCACHE_DIR": str(tmp_path),
        "SHARDCACHE_THREADS": "lots",
        "SHARDCACHE_CHUNK_SIZE": "1x",
        "SHARDCACHE_SCOPE": "node",
    }
    out = _cli("config", env=env)
    assert out.returncode == 2
    rows = {line.split()[0]: line for line in out.stdout.splitlines() if line[:1] != " "}
    assert set(rows) == {*SPECS, "job_id", "scope_dir"}
    assert rows["scope"].split()[1] == "node" and "env SHARDCACHE_SCOPE" in rows["scope"]
    assert rows["threads"].split()[1] == "INVALID"
    lines = out.stdout.splitlines()
    below = lines[lines.index(rows["threads"]) + 1]
    assert below.startswith("  error: SHARDCACHE_THREADS='lots' is not an integer")
    assert "  error: SHARDCACHE_CHUNK_SIZE='1x' is not a size" in out.stdout
    assert out.stderr == (
        "shardcache config: invalid: chunk_size, threads (the error is shown under each; "
        "the other settings are as resolved)\n"
    )
    data = json.loads(_cli("config", "--json", env=env).stdout)
    assert data["threads"]["value"] is None and "'lots'" in data["threads"]["error"]
    assert data["scope_dir"]["value"] == str(tmp_path / "node")
    assert "error" not in data["scope"]


def test_config_command_shows_values_as_the_documentation_writes_them(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "SHARDCACHE_DIR": str(tmp_path)}
    out = _cli("config", env=env)
    assert out.returncode == 0, out.stderr
    shown = {line.split()[0]: line.split()[1] for line in out.stdout.splitlines()}
    assert (shown["lock_timeout"], shown["chunk_size"], shown["max_bytes"]) == (
        "1h",
        "8MiB",
        "unlimited",
    )
    env |= {"SHARDCACHE_MAX_BYTES": "1.5T", "SHARDCACHE_MAX_REQUEST_RATE": "2.5"}
    shown = {
        line.split()[0]: line.split()[1] for line in _cli("config", env=env).stdout.splitlines()
    }
    assert (shown["max_bytes"], shown["max_request_rate"]) == ("1500G", "2.5/s")


def test_a_shown_value_reads_back_as_the_same_value() -> None:
    values = {"lock_timeout": 5400.0, "retry_backoff": 0.25, "chunk_size": 3 << 20}
    for name, value in values.items():
        env = {SPECS[name].env: format_setting(name, value)}
        assert getattr(Settings.resolve(env=env), name) == value


def test_documented_defaults_are_what_config_shows() -> None:
    page = ROOT / "docs" / "reference" / "configuration.md"
    table = page.read_text()
    defaults = Settings.resolve(env={})
    for name, spec in SPECS.items():
        row = re.search(rf"^\| `{spec.env}` \| `{name}` \| ([^|]*) \|", table, re.M)
        assert row, f"the configuration table ({page.name}) has no row for {spec.env}"
        if name != "cache_dir":  # computed from TMPDIR and the user
            shown = format_setting(name, getattr(defaults, name))
            assert shown in row.group(1).replace("`", ""), (spec.env, shown, row.group(1))


def test_unknown_variables_are_warned_with_the_closest_name() -> None:
    env = {
        "SHARDCACHE_THRADS": "8",
        "SHARDCACHE_MAXBYTES": "1G",
        "SHARDCACHE_FROBNICATE": "1",
        "SHARDCACHE_THREADS": "2",
        "SHARDCACHE_REQUIRE_SLURM": "1",  # the test suite's own
        "OTHER_THRADS": "1",
    }
    assert unknown_env(env) == {
        "SHARDCACHE_FROBNICATE": None,
        "SHARDCACHE_MAXBYTES": "SHARDCACHE_MAX_BYTES",
        "SHARDCACHE_THRADS": "SHARDCACHE_THREADS",
    }


def test_library_warns_of_an_unknown_variable_once_per_process(tmp_path: Path) -> None:
    code = (
        "import shardcache\n"
        "shardcache.Settings.resolve()\n"
        "shardcache.ShardCache()\n"
        "print(shardcache.Settings.resolve().threads)\n"
    )
    env = {"PATH": "/usr/bin:/bin", "SHARDCACHE_DIR": str(tmp_path), "SHARDCACHE_THRADS": "8"}
    out = _python("-c", code, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "4\n"
    assert out.stderr == (
        "SHARDCACHE_THRADS is not a shardcache setting and is ignored: "
        "did you mean SHARDCACHE_THREADS?\n"
    )


def test_cli_warns_of_an_unknown_variable(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "SHARDCACHE_DIR": str(tmp_path), "SHARDCACHE_SCOPES": "node"}
    out = _cli("config", env=env)
    assert out.returncode == 0
    assert out.stderr.splitlines() == [
        "shardcache: WARNING: SHARDCACHE_SCOPES is not a shardcache setting and is ignored: "
        "did you mean SHARDCACHE_SCOPE?"
    ]


def test_warning_names_each_variable_once(caplog) -> None:
    # Names no other test (of this process) used: each is warned about here for the first time.
    token = uuid.uuid4().hex[:8].upper()
    thrads, foo = f"SHARDCACHE_THRADS{token}", f"SHARDCACHE_FOO{token}"
    with caplog.at_level(logging.WARNING, logger="shardcache._config.settings"):
        for _ in range(3):
            Settings.resolve(env={thrads: "8", foo: "1"})
    assert [r.getMessage().split()[0] for r in caplog.records] == [foo, thrads]


def test_docs_document_every_variable() -> None:
    page = ROOT / "docs" / "reference" / "configuration.md"
    rows = set(re.findall(r"^\| `(SHARDCACHE_\w+)` \|", page.read_text(), re.M))
    missing = [spec.env for spec in SPECS.values() if spec.env not in rows]
    assert not missing, f"the configuration table (docs/reference/configuration.md) lacks {missing}"


def test_diagnose_reports_each_bad_value_once() -> None:
    settings, errors = Settings.diagnose(env={"RANK": "1", "WORLD_SIZE": "two"})
    assert list(errors) == ["world_size"]  # not also "rank 1 is not below world_size 1"
    assert (settings.rank, settings.world_size) == (1, 1)
    _, errors = Settings.diagnose(env={"RANK": "3", "WORLD_SIZE": "2"})
    assert list(errors) == ["rank"]
    with pytest.raises(ConfigError, match="not below world_size"):
        Settings.resolve(env={"RANK": "3", "WORLD_SIZE": "2"})
