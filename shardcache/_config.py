"""Resolved settings: explicit arguments > ``SHARDCACHE_*`` env > launcher env > defaults.

Every value is parsed once, by a small typed parser, and remembers where it came
from so ``shardcache config`` can show it. A bad value raises :class:`ConfigError`
naming the variable, the value and the accepted form.
"""

from __future__ import annotations

import dataclasses
import difflib
import getpass
import json
import math
import os
import re
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ._errors import ConfigError
from ._redact import get_logger, redact_options, redact_text
from ._trust import group_id

T = TypeVar("T")
logger = get_logger(__name__)

_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]?)(?:I?B)?\s*$", re.IGNORECASE)
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
SIZE_FORM = "a size in bytes with an optional binary unit: 1048576, 64K, 500M, 500G, 1.5T, 2TiB"
DURATION_FORM = "a duration: a number of seconds or units ms/s/m/h/d, e.g. 0.5, 90s, 5m, 1h30m"


def parse_size(text: str, name: str = "size") -> int:
    """Parse ``"500G"``-style sizes (binary units: K = 1024) into bytes."""
    match = _SIZE_RE.match(str(text))
    if not match:
        raise ConfigError(
            f"{name}={text!r} is not a size; expected {SIZE_FORM}.",
            name=name,
            value=text,
        )
    number, unit = match.groups()
    value = float(number) * _SIZE_UNITS[unit.upper()]
    if not math.isfinite(value) or value >= 2**63:
        raise ConfigError(
            f"{name}={text!r} is too large; expected at most 8E (2**63 bytes).",
            name=name,
            value=text,
        )
    return int(value)


def parse_duration(text: str, name: str = "duration") -> float:
    """Parse ``"90s"``, ``"5m"``, ``"1h30m"``, ``"250ms"`` or a plain number of seconds."""
    raw = str(text).strip().lower()
    seconds: float | None = None
    try:
        seconds = float(raw)
    except ValueError:
        pos, total = 0, 0.0
        for match in _DURATION_RE.finditer(raw):
            if match.start() != pos:
                break
            total += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
            pos = match.end()
        if raw and pos == len(raw):
            seconds = total
    if seconds is None or not math.isfinite(seconds):
        raise ConfigError(
            f"{name}={text!r} is not a duration; expected {DURATION_FORM}.",
            name=name,
            value=text,
        )
    return seconds


def parse_int(text: str, name: str = "value") -> int:
    """Parse a decimal integer."""
    try:
        return int(str(text).strip())
    except ValueError:
        raise ConfigError(
            f"{name}={text!r} is not an integer; expected a whole number like 4.",
            name=name,
            value=text,
        ) from None


def _choice(*choices: str) -> Callable[[str, str], str]:
    def parse(text: str, name: str) -> str:
        value = str(text).strip().lower()
        if value not in choices:
            raise ConfigError(
                f"{name}={text!r} is not allowed; expected one of: {', '.join(choices)}.",
                name=name,
                value=text,
            )
        return value

    return parse


def _optional_size(text: str, name: str) -> int | None:
    if str(text).strip().lower() in {"", "0", "none", "unlimited", "off"}:
        return None
    return parse_size(text, name)


RATE_FORM = "a number of requests per second such as 50 or 0.5 (optionally with /s), or 0/none"
_MAX_RATE = 1e6


def _optional_rate(text: str, name: str) -> float | None:
    """Requests per second, ``0``/``none``/``unlimited``/``off`` for no limit."""
    raw = str(text).strip().lower()
    if raw in {"", "0", "none", "unlimited", "off"}:
        return None
    try:
        value = float(raw.removesuffix("/s"))
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ConfigError(
            f"{name}={text!r} is not a request rate; expected {RATE_FORM}.",
            name=name,
            value=text,
        )
    if value == 0:
        return None
    if not 0.001 <= value <= _MAX_RATE:
        raise ConfigError(
            f"{name}={text!r} is out of range; expected a rate between 0.001 and "
            f"{_MAX_RATE:g} requests/s, or 0 for none.",
            name=name,
            value=text,
        )
    return value


def _node_lock_dir(text: str, name: str) -> Path | str:
    value = str(text).strip()
    if value.lower() == "off":
        return "off"
    if "\x00" in value or not os.path.isabs(value):
        raise ConfigError(
            f"{name}={text!r} is not usable; expected an absolute path of a node-local "
            "directory such as /tmp/shardcache-locks, or off.",
            name=name,
            value=text,
        )
    return Path(value)


def _metrics_target(text: str, name: str) -> str | None:
    """Where metrics records go: a directory, a file name pattern with ``{pid}``, or off."""
    value = str(text).strip()
    if value.lower() in ("", "off", "0", "false", "no"):
        return None
    problem = None
    if "\x00" in value:
        problem = "it contains a NUL byte"
    elif "{" in value:
        fields = {"job": "j", "rank": 0, "worker": "main", "host": "h", "pid": 1}
        try:
            shown = value.format(**fields)
        except (KeyError, IndexError, ValueError) as exc:
            problem = f"its pattern does not format ({type(exc).__name__}: {exc})"
        else:
            if value.format(**(fields | {"pid": 2})) == shown:
                problem = "its pattern lacks {pid}: processes would append to one file"
    if problem is not None:
        raise ConfigError(
            f"{name}={text!r} is not usable ({problem}); expected a directory (one "
            "<job>-r<rank>-w<worker>-<host>-<pid>.jsonl per process), a file name pattern "
            "with fields {job} {rank} {worker} {host} and {pid}, or off.",
            name=name,
            value=text,
        )
    return os.path.expanduser(value)


def _json_object(text: str, name: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        # Not parsed, so its secrets cannot be found: the text itself is not shown.
        raise ConfigError(
            f"{name} ({len(text)} characters, not shown: it may hold credentials) is not "
            f"valid JSON ({exc}); expected a JSON object such as "
            '\'{"endpoint_url": "http://127.0.0.1:9000"}\'.',
            name=name,
            value=None,
        ) from None
    if not isinstance(value, dict):
        redacted = redact_options(value)
        shown = text if redacted == value else json.dumps(redacted)
        raise ConfigError(
            f"{name}={shown!r} is JSON but not an object; expected a JSON object such as "
            "'{\"anon\": true}'.",
            name=name,
            value=shown,
        )
    return value


def _group(text: str, name: str) -> str | None:
    """A group name or gid that exists; empty means unset. Whether this process is a member
    is checked when a cache is opened (:meth:`shardcache._trust.Trust.for_group`)."""
    value = str(text).strip()
    if value:
        group_id(value, name)
    return value or None


def _path(text: str, name: str) -> Path:
    value = str(text).strip()
    if not value or "\x00" in value:
        raise ConfigError(
            f"{name}={text!r} is not a usable path; expected a node-local directory such as "
            "/tmp/shardcache or /local/scratch/$USER/shardcache.",
            name=name,
            value=text,
        )
    return Path(value).expanduser()


@dataclass(frozen=True)
class _Spec:
    """How one setting is read: its env variable, parser, bounds and default."""

    env: str
    parse: Callable[[str, str], Any]
    default: Any
    help: str
    low: float | None = None
    high: float | None = None
    unset: str = "unset"  # what a value of None means, as ``shardcache config`` shows it


SPECS: dict[str, _Spec] = {
    "cache_dir": _Spec("SHARDCACHE_DIR", _path, None, "cache root (node-local disk)"),
    "scope": _Spec(
        "SHARDCACHE_SCOPE",
        _choice("rank", "node"),
        "rank",
        "rank: <dir>/rank-<RANK> per process; node: one <dir>/node per node",
    ),
    "max_bytes": _Spec(
        "SHARDCACHE_MAX_BYTES",
        _optional_size,
        None,
        "size bound of the cache (0/none: unlimited)",
        unset="unlimited",
    ),
    "lock_mode": _Spec(
        "SHARDCACHE_LOCK_MODE",
        _choice("auto", "flock", "lease"),
        "auto",
        "auto: flock on local disks, lease on network file systems",
    ),
    "node_lock_dir": _Spec(
        "SHARDCACHE_NODE_LOCK_DIR",
        _node_lock_dir,
        None,
        "lease locks: node-local directory of the lock taken before the lease (off: none)",
        unset="<temp dir>/shardcache-<uid>/node-locks",
    ),
    "lock_timeout": _Spec(
        "SHARDCACHE_LOCK_TIMEOUT",
        parse_duration,
        3600.0,
        "hard limit on waiting for a lock",
        0.01,
        30 * 86400,
    ),
    "lock_stuck_after": _Spec(
        "SHARDCACHE_LOCK_STUCK_AFTER",
        parse_duration,
        300.0,
        "give up on a live lock holder whose progress record has not changed for this long",
        0.01,
        30 * 86400,
    ),
    "lease_time": _Spec(
        "SHARDCACHE_LEASE_TIME",
        parse_duration,
        60.0,
        "lease locks: a holder silent this long is presumed dead (renewed every quarter)",
        # Below 1 s a loaded machine can delay a renewal past the lease: live holders
        # would lose their leases.
        1.0,
        86400,
    ),
    "retries": _Spec(
        "SHARDCACHE_RETRIES", parse_int, 5, "retries of transient remote errors", 0, 100
    ),
    "retry_backoff": _Spec(
        "SHARDCACHE_RETRY_BACKOFF",
        parse_duration,
        0.5,
        "first retry delay (doubles, jittered, capped at 30 s)",
        0,
        3600,
    ),
    "slowdown_retry_time": _Spec(
        "SHARDCACHE_SLOWDOWN_RETRY_TIME",
        parse_duration,
        120.0,
        "how long a request the store keeps refusing for its rate (SlowDown, 429, 503) is "
        "retried before those refusals count against SHARDCACHE_RETRIES; 0: every refusal "
        "counts",
        0,
        86400,
    ),
    "io_timeout": _Spec(
        "SHARDCACHE_IO_TIMEOUT",
        parse_duration,
        60.0,
        "connect/read timeout of one remote request",
        0.01,
        86400,
    ),
    "chunk_size": _Spec(
        "SHARDCACHE_CHUNK_SIZE",
        parse_size,
        8 << 20,
        "download chunk (bounds memory)",
        4096,
        1 << 30,
    ),
    "parallel_threshold": _Spec(
        "SHARDCACHE_PARALLEL_THRESHOLD",
        parse_size,
        64 << 20,
        "S3 objects at least this big are fetched with parallel ranged GETs",
        1,
        1 << 50,
    ),
    "part_size": _Spec(
        "SHARDCACHE_PART_SIZE",
        parse_size,
        16 << 20,
        "size of one ranged GET of a parallel download",
        4096,
        1 << 32,
    ),
    "parallel_parts": _Spec(
        "SHARDCACHE_PARALLEL_PARTS",
        parse_int,
        8,
        "ranged GETs in flight per parallel download (1: never parallel)",
        1,
        256,
    ),
    "max_request_rate": _Spec(
        "SHARDCACHE_MAX_REQUEST_RATE",
        _optional_rate,
        None,
        "requests/s this process sends to S3 at most (HEADs, GETs, ranged parts, retries); "
        "0/none: no cap. Either way a SlowDown answer slows the whole process down",
        unset="no cap",
    ),
    "job_request_rate": _Spec(
        "SHARDCACHE_JOB_REQUEST_RATE",
        _optional_rate,
        None,
        "requests/s the whole job sends to S3 at most, shared evenly: each process takes "
        "this / (world size x its rank's DataLoader workers), e.g. 5500 for one S3 prefix; "
        "0/none: no cap",
        unset="no cap",
    ),
    "preallocate": _Spec(
        "SHARDCACHE_PREALLOCATE",
        _choice("auto", "off"),
        "auto",
        "auto: reserve each download's full size with posix_fallocate before fetching, "
        "except on network file systems; off: never reserve (the disk can then fill "
        "mid-download: CacheFullError after one eviction pass and one retry)",
    ),
    "verify": _Spec(
        "SHARDCACHE_VERIFY",
        _choice("etag", "size"),
        "etag",
        "etag: size + the object's S3 checksum (CRC64NVME, CRC32C, CRC32, SHA), else MD5 of a "
        "single-part ETag; size: size only",
    ),
    "read_while_downloading": _Spec(
        "SHARDCACHE_READ_WHILE_DOWNLOADING",
        _choice("on", "off"),
        "on",
        "on: the WebDataset stage and ShardCache.open read a shard this process downloads as "
        "its bytes arrive (the first sample after the first chunk); the file is still "
        "published only verified, and a failed verification raises IntegrityError from the "
        "stream after samples were read from the unverified bytes; off: read only the "
        "verified, published file",
    ),
    "threads": _Spec("SHARDCACHE_THREADS", parse_int, 4, "prefetch download threads", 1, 1024),
    "prefetch_depth": _Spec(
        "SHARDCACHE_PREFETCH_DEPTH",
        parse_int,
        8,
        "shards downloading or waiting unconsumed",
        1,
        100_000,
    ),
    "stall_timeout": _Spec(
        "SHARDCACHE_STALL_TIMEOUT",
        parse_duration,
        300.0,
        "raise StallError when the awaited shard made no progress this long",
        0.01,
        30 * 86400,
    ),
    "revalidate": _Spec(
        "SHARDCACHE_REVALIDATE",
        parse_duration,
        0.0,
        "remote shards: a hit last checked longer ago than this asks the store (HEAD) "
        "whether its ETag changed; 0: never (objects are immutable)",
        0.0,
        365 * 86400,
    ),
    "shared_group": _Spec(
        "SHARDCACHE_SHARED_GROUP",
        _group,
        None,
        "one cache shared on purpose by the members of this group (name or gid): "
        "directories 2770 and group-owned, files group-readable; unset: private to the user "
        "(directories 0700, files 0600; anything another user could write is refused)",
        unset="unset (private)",
    ),
    "manifest_pipes": _Spec(
        "SHARDCACHE_MANIFEST_PIPES",
        _choice("refuse", "allow"),
        "refuse",
        "pipe: URLs (shell commands) listed in a manifest file: refuse (UrlError naming the "
        "manifest and line) or allow; pipe: URLs in your own code and arguments always run",
    ),
    "metrics": _Spec(
        "SHARDCACHE_METRICS",
        _metrics_target,
        None,
        "append metrics records (JSON lines) to a file per process in this directory "
        "(or a file name pattern with {pid}); off (the default): no files",
        unset="off",
    ),
    "metrics_interval": _Spec(
        "SHARDCACHE_METRICS_INTERVAL",
        parse_duration,
        30.0,
        "seconds between interval metrics records while data flows",
        0.001,
        86400,
    ),
    "storage_options": _Spec(
        "SHARDCACHE_STORAGE_OPTIONS",
        _json_object,
        None,
        "JSON object passed to fsspec (e.g. endpoint_url, anon, profile)",
    ),
    "rank": _Spec("SHARDCACHE_RANK", parse_int, 0, "global rank", 0, 1 << 24),
    "local_rank": _Spec("SHARDCACHE_LOCAL_RANK", parse_int, 0, "rank within the node", 0, 1 << 24),
    "world_size": _Spec("SHARDCACHE_WORLD_SIZE", parse_int, 1, "number of ranks", 1, 1 << 24),
    "node_rank": _Spec("SHARDCACHE_NODE_RANK", parse_int, 0, "index of this node", 0, 1 << 24),
}

# Launcher variables, in precedence order: torchrun (which may itself run under SLURM) first.
LAUNCHER_ENV: dict[str, tuple[tuple[str, str], ...]] = {
    "rank": (("RANK", "torchrun"), ("SLURM_PROCID", "slurm")),
    "local_rank": (("LOCAL_RANK", "torchrun"), ("SLURM_LOCALID", "slurm")),
    "world_size": (("WORLD_SIZE", "torchrun"), ("SLURM_NTASKS", "slurm")),
    "node_rank": (("GROUP_RANK", "torchrun"), ("SLURM_NODEID", "slurm")),
}


@dataclass(frozen=True, kw_only=True, repr=False)
class Settings:
    """Every shardcache setting, resolved. Build with :meth:`Settings.resolve`.

    Its ``repr`` and :meth:`describe` show ``storage_options`` with credentials redacted."""

    cache_dir: Path
    scope: str = SPECS["scope"].default
    max_bytes: int | None = SPECS["max_bytes"].default
    lock_mode: str = SPECS["lock_mode"].default
    node_lock_dir: Path | str | None = SPECS["node_lock_dir"].default
    lock_timeout: float = SPECS["lock_timeout"].default
    lock_stuck_after: float = SPECS["lock_stuck_after"].default
    lease_time: float = SPECS["lease_time"].default
    retries: int = SPECS["retries"].default
    retry_backoff: float = SPECS["retry_backoff"].default
    slowdown_retry_time: float = SPECS["slowdown_retry_time"].default
    io_timeout: float = SPECS["io_timeout"].default
    chunk_size: int = SPECS["chunk_size"].default
    parallel_threshold: int = SPECS["parallel_threshold"].default
    part_size: int = SPECS["part_size"].default
    parallel_parts: int = SPECS["parallel_parts"].default
    max_request_rate: float | None = SPECS["max_request_rate"].default
    job_request_rate: float | None = SPECS["job_request_rate"].default
    preallocate: str = SPECS["preallocate"].default
    verify: str = SPECS["verify"].default
    read_while_downloading: str = SPECS["read_while_downloading"].default
    threads: int = SPECS["threads"].default
    prefetch_depth: int = SPECS["prefetch_depth"].default
    stall_timeout: float = SPECS["stall_timeout"].default
    revalidate: float = SPECS["revalidate"].default
    shared_group: str | None = SPECS["shared_group"].default
    manifest_pipes: str = SPECS["manifest_pipes"].default
    metrics: str | None = SPECS["metrics"].default
    metrics_interval: float = SPECS["metrics_interval"].default
    storage_options: dict[str, Any] = field(default_factory=dict)
    rank: int = SPECS["rank"].default
    local_rank: int = SPECS["local_rank"].default
    world_size: int = SPECS["world_size"].default
    node_rank: int = SPECS["node_rank"].default
    job_id: str | None = None
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def resolve(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Resolve every setting; ``overrides`` (explicit arguments, ``None`` = unset) win.

        Raises the :class:`ConfigError` of the first bad value. ``SHARDCACHE_*`` variables
        that no setting reads are logged as warnings, with the closest setting's variable
        (once per variable and process)."""
        settings, errors = cls.diagnose(env, **overrides)
        if errors:
            raise next(iter(errors.values()))
        return settings

    @classmethod
    def diagnose(
        cls, env: Mapping[str, str] | None = None, **overrides: Any
    ) -> tuple[Settings, dict[str, ConfigError]]:
        """:meth:`resolve`, but a bad value does not hide the others: its setting keeps its
        default and its error is returned, by setting name (``shardcache config``)."""
        env = os.environ if env is None else env
        unknown = set(overrides) - set(SPECS)
        if unknown:
            raise ConfigError(
                f"unknown setting(s) {sorted(unknown)}; expected some of {sorted(SPECS)}.",
                name=", ".join(sorted(unknown)),
                value=None,
            )
        warn_unknown_env(env)
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        errors: dict[str, ConfigError] = {}
        for name, spec in SPECS.items():
            given = _given(name, spec, env, overrides.get(name))
            sources[name] = "default" if given is None else given[2]
            try:
                values[name] = _parse_given(spec, given)
            except ConfigError as exc:
                values[name], errors[name] = spec.default, exc
        if values["cache_dir"] is None:
            values["cache_dir"] = default_cache_root(env)
        if values["storage_options"] is None:
            values["storage_options"] = {}
        job_id = env.get("SLURM_JOB_ID") or env.get("TORCHELASTIC_RUN_ID") or None
        sources["job_id"] = "env SLURM_JOB_ID / TORCHELASTIC_RUN_ID" if job_id else "default"
        if not errors.keys() & {"rank", "node_rank", "world_size"}:
            try:
                _check_ranks(values, sources)
            except ConfigError as exc:
                errors[exc.name] = exc
        return cls(**values, job_id=job_id, sources=sources), errors

    @property
    def scope_dir(self) -> Path:
        """The directory this process caches into: ``<root>/rank-<R>`` or ``<root>/node``."""
        if self.scope == "node":
            return self.cache_dir / "node"
        return self.cache_dir / f"rank-{self.rank}"

    def replace(self, **changes: Any) -> Settings:
        """A copy with ``changes`` applied and validated like explicit arguments."""
        merged = {n: getattr(self, n) for n in SPECS} | changes
        sources = dict(self.sources) | {n: "argument" for n in changes}
        for name, value in changes.items():
            merged[name] = _resolve_one(name, SPECS[name], {}, value)
        return dataclasses.replace(self, **merged, sources=sources)

    def __repr__(self) -> str:
        shown = (f"{n}={_shown(n, getattr(self, n))!r}" for n in [*SPECS, "job_id"])
        return f"Settings({', '.join(shown)})"

    def describe(self) -> list[tuple[str, str, Any, str]]:
        """Rows of (setting, env variable, value, source) for ``shardcache config``;
        credentials in ``storage_options`` are redacted."""
        rows = [
            (n, s.env, _shown(n, getattr(self, n)), self.sources.get(n, "default"))
            for n, s in SPECS.items()
        ]
        rows.append(("job_id", "SLURM_JOB_ID", self.job_id, self.sources.get("job_id", "default")))
        rows.append(("scope_dir", "-", self.scope_dir, "derived"))
        return rows


def format_setting(name: str, value: Any) -> str:
    """``value`` of setting ``name`` written as the documentation writes it (``1h``, ``8M``,
    ``unlimited``): a form its variable accepts, where the setting has one."""
    spec = SPECS.get(name)
    if value is None:
        return spec.unset if spec is not None else "none"
    if spec is not None and spec.parse is parse_duration:
        return _format_duration(value) if value else "0"
    if spec is not None and spec.parse in (parse_size, _optional_size):
        return _format_size(value)
    if spec is not None and spec.parse is _optional_rate:
        return f"{value:g}/s"
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value)


def env_setting(name: str, env: Mapping[str, str] | None = None) -> Any:
    """One setting from the environment alone (for code that runs without a cache)."""
    return _resolve_one(name, SPECS[name], os.environ if env is None else env, None)


def _shown(name: str, value: Any) -> Any:
    """``value`` of setting ``name`` as shown to people: credentials redacted."""
    if name == "storage_options":
        return redact_options(value)
    return redact_text(value) if isinstance(value, str) else value


def _resolve_one(name: str, spec: _Spec, env: Mapping[str, str], explicit: Any) -> Any:
    return _parse_given(spec, _given(name, spec, env, explicit))


def _given(
    name: str, spec: _Spec, env: Mapping[str, str], explicit: Any
) -> tuple[str, Any, str] | None:
    """(label, raw value, source) of setting ``name``, or None when nothing sets it."""
    if explicit is not None:
        return f"argument {name}", explicit, "argument"
    if spec.env in env:
        return spec.env, env[spec.env], f"env {spec.env}"
    for var, launcher in LAUNCHER_ENV.get(name, ()):
        if var in env:
            return f"{var} ({launcher})", env[var], f"env {var} ({launcher})"
    return None


def _parse_given(spec: _Spec, given: tuple[str, Any, str] | None) -> Any:
    if given is None:
        return spec.default
    label, raw, _source = given
    # A rate given in code is checked by the same parser (it has no bounds of its own: None
    # means no cap).
    parse_it = isinstance(raw, str) or (spec.parse is _optional_rate and not isinstance(raw, bool))
    value = spec.parse(str(raw), label) if parse_it else raw
    _check_bounds(label, raw, spec, value)
    return value


DEVELOPER_ENV = frozenset(
    {
        "SHARDCACHE_BENCH_VENV",
        "SHARDCACHE_HYPOTHESIS",
        "SHARDCACHE_REQUIRE_ACCOUNTS",
        "SHARDCACHE_REQUIRE_SLURM",
        "SHARDCACHE_TEST_CLOCK_SKEW",
        "SHARDCACHE_TORTURE",
        "SHARDCACHE_TORTURE_RESULTS",
    }
)
"""``SHARDCACHE_*`` variables of the test suite and scripts (see Development), not settings."""

_PREFIX = "SHARDCACHE_"
_warned_env: set[str] = set()
_warned_lock = threading.Lock()


def unknown_env(env: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """Every ``SHARDCACHE_*`` variable of ``env`` that no setting reads, with the closest
    setting's variable (difflib), or None when none is close."""
    env = os.environ if env is None else env
    known = {spec.env.removeprefix(_PREFIX): spec.env for spec in SPECS.values()}
    unknown: dict[str, str | None] = {}
    for var in sorted(env):
        if var.startswith(_PREFIX) and var not in DEVELOPER_ENV:
            tail = var.removeprefix(_PREFIX)
            if tail not in known:
                close = difflib.get_close_matches(tail, known, n=1)
                unknown[var] = known[close[0]] if close else None
    return unknown


def warn_unknown_env(env: Mapping[str, str] | None = None) -> None:
    """Log a warning for each :func:`unknown_env` variable, once per variable and process."""
    for var, close in unknown_env(env).items():
        with _warned_lock:
            if var in _warned_env:
                continue
            _warned_env.add(var)
        hint = f"did you mean {close}?" if close else "'shardcache config' lists the settings"
        logger.warning("%s is not a shardcache setting and is ignored: %s", var, hint)


def _show_bound(spec: _Spec, bound: float) -> str:
    if spec.parse is parse_duration:
        return _format_duration(bound)
    if spec.parse is parse_size:
        return _format_size(int(bound))
    return f"{bound:g}"


def _format_duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds * 1000:g}ms"


def _format_size(size: int) -> str:
    for unit in ("P", "T", "G", "M", "K"):
        if size >= _SIZE_UNITS[unit] and size % _SIZE_UNITS[unit] == 0:
            return f"{size // _SIZE_UNITS[unit]}{unit}"
    return str(size)


def check_argument(name: str, value: Any, label: str) -> None:
    """Check ``value``, given in code for setting ``name``, by that setting's own rules: its
    type (an integer, or a number of seconds; never a string or a bool) and bounds."""
    spec = SPECS[name]
    whole = spec.parse in (parse_int, parse_size)
    if isinstance(value, bool) or not isinstance(value, int if whole else int | float):
        raise ConfigError(
            f"{label}={value!r} has the wrong type; expected "
            f"{'an integer' if whole else 'a number of seconds'} ({spec.help}).",
            name=label,
            value=value,
        )
    _check_bounds(label, value, spec, value)


PREFETCH_OPTIONS: dict[str, str] = {
    "threads": "threads",
    "depth": "prefetch_depth",
    "stall_timeout": "stall_timeout",
}
"""The prefetch options (``ShardCache.prefetch``, ``Prefetcher``, the WebDataset stage), each
with the setting it overrides: that setting's spec gives its default, type and bounds."""


def prefetch_overrides(**options: Any) -> dict[str, Any]:
    """The prefetch ``options`` given in code (None: not given, left out), each checked by
    the rules of the setting it overrides (:data:`PREFETCH_OPTIONS`, :func:`check_argument`)."""
    unknown = options.keys() - PREFETCH_OPTIONS.keys()
    if unknown:
        raise ConfigError(
            f"unknown prefetch option(s) {sorted(unknown)}; expected some of "
            f"{sorted(PREFETCH_OPTIONS)}.",
            name=", ".join(sorted(unknown)),
            value=None,
        )
    given = {option: value for option, value in options.items() if value is not None}
    for option, value in given.items():
        check_argument(PREFETCH_OPTIONS[option], value, f"prefetch option {option}")
    return given


def _check_bounds(label: str, raw: Any, spec: _Spec, value: Any) -> None:
    if spec.low is None or spec.high is None:
        return
    low, high = _show_bound(spec, spec.low), _show_bound(spec, spec.high)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(
            f"{label}={raw!r} has the wrong type; expected a number between {low} and {high}.",
            name=label,
            value=raw,
        )
    if not spec.low <= value <= spec.high:
        raise ConfigError(
            f"{label}={raw!r} is out of range; expected a value between {low} and {high} "
            f"({spec.help}).",
            name=label,
            value=raw,
        )


def _check_ranks(values: dict[str, Any], sources: dict[str, str]) -> None:
    for name in ("rank", "node_rank"):
        if values[name] >= values["world_size"] and sources["world_size"] != "default":
            raise ConfigError(
                f"{name}={values[name]} (from {sources[name]}) is not below world_size="
                f"{values['world_size']} (from {sources['world_size']}); the launcher "
                "environment is inconsistent: unset stale RANK/WORLD_SIZE or SLURM_* variables.",
                name=name,
                value=values[name],
            )


def default_cache_root(env: Mapping[str, str] | None = None) -> Path:
    """A node-local default root: ``$TMPDIR`` (or /tmp) ``/shardcache-<user>``.

    Never the home directory, which on clusters is usually a network file system.
    """
    env = os.environ if env is None else env
    base = env.get("TMPDIR") or tempfile.gettempdir()
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return Path(base) / f"shardcache-{user}"
