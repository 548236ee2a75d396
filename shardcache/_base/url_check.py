"""One URL's validity, and the ``UrlError`` every spec or URL problem is raised as.

A URL is refused when it is empty, holds NUL, a newline or a carriage return, is longer than
``MAX_URL_BYTES``, holds ``::`` (fsspec protocol chaining), has a broken scheme (``s3:/b/k``)
or names a protocol fsspec does not know; a ``pipe:`` command only when it is empty, too long
or holds a control character. Each error says what, where, expected, seen and what to do.
"""

from __future__ import annotations

import re
from typing import Any

from fsspec.registry import known_implementations, registry

from .errors import UrlError
from .url_kinds import PIPE_PREFIX, is_pipe_url, url_scheme

MAX_URL_BYTES = 8192
"""Longest URL accepted, in UTF-8 bytes."""

_SHOW_CHARS = 200
# "s3:/b/k" or "s3:b/k": a known protocol name followed by ":" but not "//".
_BROKEN_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]+):(?!//)(?!:)")
_FORBIDDEN_CHARS = {"\x00": "NUL", "\n": "a newline", "\r": "a carriage return"}


def brief_repr(text: object) -> str:
    """repr() of a spec or URL, cut short so a huge input cannot flood a message."""
    if isinstance(text, str):
        if len(text) > _SHOW_CHARS:
            return f"{text[:_SHOW_CHARS]!r}... ({len(text)} characters)"
        return repr(text)
    shown = repr(text)
    return shown if len(shown) <= _SHOW_CHARS else f"{shown[:_SHOW_CHARS]}..."


def url_error(
    spec: object,
    problem: str,
    expected: str,
    seen: str,
    hint: str,
    *,
    where: str = "",
    **extra: Any,
) -> UrlError:
    """Build a UrlError: what (and where), expected, seen, what to do; facts as attributes."""
    message = f"{problem}{where}: {brief_repr(spec)}. Expected {expected}; got {seen}. {hint}"
    # Keep the attribute small and picklable (a spec may be a huge string or a generator).
    if not isinstance(spec, str):
        spec = brief_repr(spec)
    elif len(spec) > _SHOW_CHARS:
        spec = spec[:_SHOW_CHARS]
    return UrlError(message, spec=spec, expected=expected, seen=seen, hint=hint, **extra)


def is_known_protocol(proto: str) -> bool:
    """True when fsspec has an implementation of ``proto`` (looked up on each call:
    implementations may be registered at run time)."""
    return proto in registry or proto in known_implementations


def _check_protocol(url: str, spec: object, where: str) -> None:
    scheme = url_scheme(url)
    if scheme is None:
        broken = _BROKEN_SCHEME_RE.match(url)
        # "file:/path" is a URL webdataset reads (RFC 8089's short form), not a typo.
        if (
            broken
            and broken.group(1).lower() != "file"
            and is_known_protocol(broken.group(1).lower())
        ):
            name = broken.group(1)
            raise url_error(
                spec,
                "Malformed URL scheme",
                f"'{name}://...'",
                f"'{name}:' without '//' (it would be read as a local path)",
                f"Write {name}://bucket/key.",
                url=url,
                where=where,
            )
        return
    proto = scheme.lower()
    if not is_known_protocol(proto):
        raise url_error(
            spec,
            "Unknown URL protocol",
            "a protocol fsspec knows (s3, gs, az, http, https, file, ...) or a plain local path",
            repr(proto),
            "Fix the scheme. webdataset opens some schemes (ais://, scp://) with command-line "
            "tools: give those as pipe: commands (e.g. 'pipe:curl -s -L https://...'), or "
            "install the fsspec implementation of the protocol.",
            url=url,
            protocol=proto,
            where=where,
        )


def check_url(url: str) -> None:
    """Raise the :class:`UrlError` :func:`expand_urls` raises for ``url``, if any (for URLs
    given one at a time, as to ``ShardCache.fetch``)."""
    checked_url(url, url)


def checked_url(url: str, spec: object, where: str = "") -> str:
    if is_pipe_url(url) and not url[len(PIPE_PREFIX) :].strip():
        raise url_error(
            spec,
            "Empty pipe command",
            "'pipe:' followed by a shell command that writes the shard to its stdout",
            "nothing after 'pipe:'",
            "Write e.g. 'pipe:aws s3 cp s3://bucket/key.tar -'.",
            url=url,
            where=where,
        )
    if not url:
        raise url_error(
            spec,
            "Empty URL",
            "a URL or local path",
            "an empty string",
            "Remove the empty entry.",
            url=url,
            where=where,
        )
    for char, name in _FORBIDDEN_CHARS.items():
        if char in url:
            raise url_error(
                spec,
                "Invalid character in URL",
                "a URL without NUL, newline or carriage return",
                f"{name} at position {url.index(char)} of {brief_repr(url)}",
                "List one URL per manifest line or pass a list of URLs.",
                url=url,
                where=where,
            )
    size = len(url.encode("utf-8", "surrogatepass"))
    if size > MAX_URL_BYTES:
        raise url_error(
            spec,
            "URL too long",
            f"at most {MAX_URL_BYTES} bytes",
            f"{size} bytes",
            "Check the spec: a URL this long is almost certainly a mistake.",
            url=url,
            where=where,
        )
    if is_pipe_url(url):
        return url  # a shell command: '::' and what looks like a scheme are its own business
    if "::" in url:
        raise url_error(
            spec,
            "'::' inside a URL",
            "one URL per entry (fsspec protocol chaining is not supported)",
            brief_repr(url),
            "In a spec string '::' separates specs, as in webdataset; list each URL on its own.",
            url=url,
            where=where,
        )
    _check_protocol(url, spec, where)
    return url


__all__ = [
    "MAX_URL_BYTES",
    "brief_repr",
    "check_url",
    "checked_url",
    "is_known_protocol",
    "url_error",
]
