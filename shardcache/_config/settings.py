"""Resolved settings: explicit arguments > ``SHARDCACHE_*`` env > launcher env > defaults.

Every value is parsed once, by a small typed parser (``_config.parse``) that the table of
settings names (``_config.specs``), and remembers where it came from so ``shardcache
config`` can show it (``_config.display``). A bad value raises :class:`ConfigError`
naming the variable, the value and the accepted form. A ``SHARDCACHE_*`` variable no
setting reads (``_config.unknown``) is warned of, once per variable and process, not in
DataLoader workers (the process that built the dataset warned).
"""

from __future__ import annotations

import dataclasses
import getpass
import os
import sys
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._base.errors import ConfigError
from .._base.redact import get_logger
from .display import show_bound, shown
from .parse import parse_int, parse_optional_rate, parse_size
from .specs import LAUNCHER_ENV, SPECS, SettingSpec
from .unknown import unknown_env

logger = get_logger(__name__)


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
    etag_md5: str = SPECS["etag_md5"].default
    read_while_downloading: str = SPECS["read_while_downloading"].default
    threads: int = SPECS["threads"].default
    prefetch_depth: int = SPECS["prefetch_depth"].default
    stall_timeout: float = SPECS["stall_timeout"].default
    revalidate: float = SPECS["revalidate"].default
    shards_changed: str = SPECS["shards_changed"].default
    shared_group: str | None = SPECS["shared_group"].default
    manifest_pipes: str = SPECS["manifest_pipes"].default
    metrics: str | None = SPECS["metrics"].default
    metrics_interval: float = SPECS["metrics_interval"].default
    delivery_check: str = SPECS["delivery_check"].default
    rendezvous_port: int = SPECS["rendezvous_port"].default
    rendezvous_timeout: float = SPECS["rendezvous_timeout"].default
    rendezvous_dir: Path | None = SPECS["rendezvous_dir"].default
    mesh: bool = SPECS["mesh"].default
    mesh_addr: str | None = SPECS["mesh_addr"].default
    mesh_secret: str | None = SPECS["mesh_secret"].default
    mesh_upload_rate: int | None = SPECS["mesh_upload_rate"].default
    mesh_concurrency: int = SPECS["mesh_concurrency"].default
    mesh_timeout: float = SPECS["mesh_timeout"].default
    mesh_min_rate: int = SPECS["mesh_min_rate"].default
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
        fields = (f"{n}={shown(n, getattr(self, n))!r}" for n in [*SPECS, "job_id"])
        return f"Settings({', '.join(fields)})"

    def describe(self) -> list[tuple[str, str, Any, str]]:
        """Rows of (setting, env variable, value, source) for ``shardcache config``;
        credentials in ``storage_options`` are redacted."""
        rows = [
            (n, s.env, shown(n, getattr(self, n)), self.sources.get(n, "default"))
            for n, s in SPECS.items()
        ]
        rows.append(("job_id", "SLURM_JOB_ID", self.job_id, self.sources.get("job_id", "default")))
        rows.append(("scope_dir", "-", self.scope_dir, "derived"))
        return rows


def env_setting(name: str, env: Mapping[str, str] | None = None) -> Any:
    """One setting from the environment alone (for code that runs without a cache)."""
    return _resolve_one(name, SPECS[name], os.environ if env is None else env, None)


def _resolve_one(name: str, spec: SettingSpec, env: Mapping[str, str], explicit: Any) -> Any:
    return _parse_given(spec, _given(name, spec, env, explicit))


def _given(
    name: str, spec: SettingSpec, env: Mapping[str, str], explicit: Any
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


def _parse_given(spec: SettingSpec, given: tuple[str, Any, str] | None) -> Any:
    if given is None:
        return spec.default
    label, raw, _source = given
    # A rate given in code is checked by the same parser (it has no bounds of its own: None
    # means no cap).
    parse_it = isinstance(raw, str) or (
        spec.parse is parse_optional_rate and not isinstance(raw, bool)
    )
    value = spec.parse(str(raw), label) if parse_it else raw
    _check_bounds(label, raw, spec, value)
    return value


_warned_env: set[str] = set()
_warned_lock = threading.Lock()


def warn_unknown_env(env: Mapping[str, str] | None = None) -> None:
    """Log a warning for each :func:`unknown_env` variable, once per variable and process;
    none in a DataLoader worker (the dataset's stage warned when it was built)."""
    data = sys.modules.get("torch.utils.data")  # imported by the program if it uses torch
    if data is not None and data.get_worker_info() is not None:
        return
    for var, close in unknown_env(env).items():
        with _warned_lock:
            if var in _warned_env:
                continue
            _warned_env.add(var)
        hint = f"did you mean {close}?" if close else "'shardcache config' lists the settings"
        logger.warning("%s is not a shardcache setting and is ignored: %s", var, hint)


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


def _check_bounds(label: str, raw: Any, spec: SettingSpec, value: Any) -> None:
    if spec.low is None or spec.high is None:
        return
    low, high = show_bound(spec, spec.low), show_bound(spec, spec.high)
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
