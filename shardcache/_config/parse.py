"""The text forms of setting values: one small typed parser per kind of value (sizes,
durations, integers, choices, rates, paths, JSON objects, groups, the metrics target).

Each parser takes the text and the name to blame (a variable, or ``argument <name>``) and
returns the value or raises :class:`ConfigError` naming the name, the value and the
accepted form. Which setting uses which parser: ``_config.specs``.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._base.errors import ConfigError
from .._base.redact import redact_options
from .._base.trust import group_id

# Sizes are decimal as shardcache prints them (500G = 500 * 10**9 bytes); KiB, MiB, ... binary.
SIZE_UNITS = {"": 1, **{u: 1000 ** (i + 1) for i, u in enumerate("KMGTP")}}
BINARY_UNITS = {u: 1 << (10 * (i + 1)) for i, u in enumerate("KMGTP")}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([KMGTP])(I?))?B?\s*$", re.IGNORECASE)
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
SIZE_FORM = (
    "a size in bytes with an optional unit, decimal as shardcache prints sizes (500M = 500 MB "
    "= 500 * 10**6 bytes) or binary with i (64KiB, 8MiB): 1048576, 500M, 500G, 1.5T, 2TiB"
)
DURATION_FORM = "a duration: a number of seconds or units ms/s/m/h/d, e.g. 0.5, 90s, 5m, 1h30m"


def parse_size(text: str, name: str = "size") -> int:
    """Parse ``"500G"``-style sizes into bytes: decimal units (K = 1000, as shardcache prints
    sizes), binary ones with ``i`` (``KiB``, ``Mi``: 1024)."""
    match = _SIZE_RE.match(str(text))
    if not match:
        raise ConfigError(
            f"{name}={text!r} is not a size; expected {SIZE_FORM}.",
            name=name,
            value=text,
        )
    number, unit, binary = match.groups()
    units = BINARY_UNITS if binary else SIZE_UNITS
    value = float(number) * (units[unit.upper()] if unit else 1)
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


def one_of(*choices: str) -> Callable[[str, str], str]:
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


def parse_optional_size(text: str, name: str) -> int | None:
    if str(text).strip().lower() in {"", "0", "none", "unlimited", "off"}:
        return None
    return parse_size(text, name)


RATE_FORM = "a number of requests per second such as 50 or 0.5 (optionally with /s), or 0/none"
_MAX_RATE = 1e6


def parse_optional_rate(text: str, name: str) -> float | None:
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


def parse_node_lock_dir(text: str, name: str) -> Path | str:
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


def parse_metrics_target(text: str, name: str) -> str | None:
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


def parse_json_object(text: str, name: str) -> dict[str, Any]:
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


def parse_group(text: str, name: str) -> str | None:
    """A group name or gid that exists; empty means unset. Whether this process is a member
    is checked when a cache is opened (:meth:`shardcache._base.trust.Trust.for_group`)."""
    value = str(text).strip()
    if value:
        group_id(value, name)
    return value or None


def parse_path(text: str, name: str) -> Path:
    value = str(text).strip()
    if not value or "\x00" in value:
        raise ConfigError(
            f"{name}={text!r} is not a usable path; expected a node-local directory such as "
            "/tmp/shardcache or /local/scratch/$USER/shardcache.",
            name=name,
            value=text,
        )
    return Path(value).expanduser()


SWITCH_ON, SWITCH_OFF = ("1", "on", "true", "yes"), ("0", "off", "false", "no", "")


def parse_switch(text: str, name: str) -> bool:
    """A switch: ``1``/``on``/``true``/``yes`` or ``0``/``off``/``false``/``no``."""
    value = str(text).strip().lower()
    if value not in SWITCH_ON + SWITCH_OFF:
        raise ConfigError(
            f"{name}={text!r} is not a switch; expected 1 or 0 (also on/off, true/false, yes/no).",
            name=name,
            value=text,
        )
    return value in SWITCH_ON


BYTE_RATE_FORM = f"bytes per second: {SIZE_FORM}, optionally with /s (100M/s)"


def parse_byte_rate(text: str, name: str) -> int:
    """Bytes per second: a size, optionally followed by ``/s`` (``100M/s``)."""
    raw = str(text).strip()
    if raw.lower().endswith("/s"):
        raw = raw[:-2]
    try:
        return parse_size(raw, name)
    except ConfigError:
        raise ConfigError(
            f"{name}={text!r} is not a rate; expected {BYTE_RATE_FORM}.", name=name, value=text
        ) from None


def parse_upload_rate(text: str, name: str) -> int | None:
    """The mesh's upload cap: ``auto`` (None: half the link's speed), 0 (serve nothing) or
    bytes per second."""
    if str(text).strip().lower() == "auto":
        return None
    return parse_byte_rate(text, name)


def parse_address(text: str, name: str) -> str:
    """One IP address of this node to bind (never a wildcard, never a host name: a name
    lookup would wait where no socket timeout bounds it)."""
    value = str(text).strip()
    try:
        address = ipaddress.ip_address(value)
    except ValueError:
        problem = "is not an IP address"
    else:
        if not address.is_unspecified:
            return str(address)
        problem = "is the wildcard address, which would serve on every interface"
    raise ConfigError(
        f"{name}={text!r} {problem}; expected this node's IP address on the cluster network, "
        "e.g. 10.0.3.17 (unset: the address of the route to the job's store host).",
        name=name,
        value=text,
    )


SECRET_MIN_BYTES = 16


def parse_secret(text: str, name: str) -> str:
    """A secret of at least 16 bytes; the value never appears in an error."""
    value = str(text).strip()
    if len(value.encode()) < SECRET_MIN_BYTES:
        raise ConfigError(
            f"{name} has {len(value.encode())} bytes (not shown); expected at least "
            f"{SECRET_MIN_BYTES}: export the output of 'openssl rand -hex 32' as {name} in the "
            "job script, before srun or torchrun.",
            name=name,
            value="***",
        )
    return value
