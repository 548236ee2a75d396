"""Settings written for people: a value in the form its variable accepts (``1h``, ``8MiB``,
``unlimited``) as ``shardcache config`` and the documentation show it, a bound as an
error message names it, and credentials redacted from what is shown.
"""

from __future__ import annotations

import json
from typing import Any

from .._base.redact import REDACTED, redact_options, redact_text
from .parse import (
    BINARY_UNITS,
    SIZE_UNITS,
    parse_byte_rate,
    parse_duration,
    parse_optional_rate,
    parse_optional_size,
    parse_size,
    parse_switch,
    parse_upload_rate,
)
from .specs import SPECS, SettingSpec


def format_setting(name: str, value: Any) -> str:
    """``value`` of setting ``name`` written as the documentation writes it (``1h``, ``8MiB``,
    ``unlimited``): a form its variable accepts, where the setting has one."""
    spec = SPECS.get(name)
    if value is None:
        return spec.unset if spec is not None else "none"
    if spec is not None and spec.parse is parse_duration:
        return format_duration(value) if value else "0"
    if spec is not None and spec.parse in (parse_size, parse_optional_size):
        return format_size(value)
    if spec is not None and spec.parse is parse_optional_rate:
        return f"{value:g}/s"
    if spec is not None and spec.parse in (parse_byte_rate, parse_upload_rate):
        return f"{format_size(value)}/s" if value else "0"
    if spec is not None and spec.parse is parse_switch:
        return "on" if value else "off"
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value)


def shown(name: str, value: Any) -> Any:
    """``value`` of setting ``name`` as shown to people: credentials redacted."""
    if name == "storage_options":
        return redact_options(value)
    if name == "mesh_secret" and value is not None:
        return REDACTED
    return redact_text(value) if isinstance(value, str) else value


def show_bound(spec: SettingSpec, bound: float) -> str:
    if spec.parse is parse_duration:
        return format_duration(bound)
    if spec.parse is parse_size:
        return format_size(int(bound))
    if spec.parse is parse_byte_rate:
        return f"{format_size(int(bound))}/s"
    return f"{bound:g}"


def format_duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds * 1000:g}ms"


def format_size(size: int) -> str:
    """``size`` in the largest unit that divides it: decimal (``500G``) or binary (``8MiB``)."""
    for unit in ("P", "T", "G", "M", "K"):
        for scale, name in ((SIZE_UNITS[unit], unit), (BINARY_UNITS[unit], f"{unit}iB")):
            if size >= scale and size % scale == 0:
                return f"{size // scale}{name}"
    return str(size)
