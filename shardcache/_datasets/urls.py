"""Shard specs -> an ordered list of URLs, and manifest files -> their entries.

A spec is a URL with an optional brace pattern (``s3://b/train-{000000..000999}.tar``,
expanded as webdataset expands it: ``_url_braces`` owns the grammar and its departures), a
list of such strings, or a manifest file (``@path``, or an existing local
``.txt``/``.json``/``.manifest`` path).

``::`` separates specs as in webdataset, so fsspec protocol chaining
(``simplecache::s3://...``) is rejected; webdataset's ``WDS_`` environment variable
substitution is not done. Lists are brace-expanded item by item (webdataset passes lists
through untouched).

``pipe:`` URLs (``pipe:aws s3 cp s3://b/x-{000..009}.tar -``) are shell commands whose
standard output is the shard, as in webdataset. The command is never taken for a path, and
'::' inside it is allowed only in a JSON manifest's ``{"url": ...}`` object (in a spec string
'::' separates specs, as in webdataset). A manifest's ``pipe:`` entries run only when allowed.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._base.redact import get_logger
from .._base.url_check import brief_repr, checked_url, is_known_protocol, url_error
from .._base.url_kinds import is_pipe_url, url_scheme
from .._config.settings import env_setting
from .url_braces import MAX_EXPANSION, expand_pattern

log = get_logger(__name__)

Spec = str | os.PathLike[str] | Iterable[str | os.PathLike[str]]

MANIFEST_SUFFIXES = (".txt", ".json", ".manifest")

_BARE_PROTOCOL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*$")


@dataclass(frozen=True)
class ManifestEntry:
    """One object listed in a manifest; ``meta`` holds the entry's other JSON keys."""

    url: str
    meta: dict[str, Any] = field(default_factory=dict)


def _split_specs(text: str, spec: object, where: str) -> list[str]:
    """Split on '::' as webdataset does; reject what looks like fsspec protocol chaining."""
    parts = text.split("::")
    for part in parts[:-1]:
        if _BARE_PROTOCOL_RE.match(part) and is_known_protocol(part.lower()):
            raise url_error(
                spec,
                "fsspec protocol chaining is not supported",
                "'::' only between complete shard specs, as in webdataset",
                f"{part + '::'!r} before another URL",
                "Give the plain URL (s3://bucket/key): shardcache does its own caching.",
                where=where,
            )
    return parts


def _expand_string(text: str, spec: object, where: str, *, in_manifest: bool) -> list[str]:
    """Expand one spec string: '::'-separated parts, each a manifest or a brace pattern."""
    urls: list[str] = []
    for part in _split_specs(text, spec, where):
        manifest = None if in_manifest else _manifest_path(part)
        if manifest is not None:
            urls.extend(entry.url for entry in read_manifest(manifest))
        else:
            if in_manifest:
                _require_absolute(part, spec, where)
            urls.extend(expand_pattern(part, spec, where))
        _check_total(len(urls), spec)
    return urls


def _check_total(total: int, spec: object) -> None:
    if total > MAX_EXPANSION:
        raise url_error(
            spec,
            "Too many URLs",
            f"at most {MAX_EXPANSION:,} URLs in one call",
            f"{total:,} so far",
            "Split the data set into several specs or manifests.",
            count=total,
        )


# ---------------------------------------------------------------------------- manifests


def _manifest_path(spec: str) -> Path | None:
    """The manifest file ``spec`` names, or None when it is a URL pattern."""
    if spec.startswith("@"):
        return Path(spec[1:]).expanduser()
    if url_scheme(spec) or is_pipe_url(spec) or "{" in spec:
        return None
    if spec.lower().endswith(MANIFEST_SUFFIXES) and Path(spec).is_file():
        return Path(spec)
    return None


def _require_absolute(url: str, spec: object, where: str) -> None:
    if url_scheme(url) is None and not is_pipe_url(url) and not Path(url).is_absolute():
        raise url_error(
            spec,
            "Relative entry in manifest",
            "a full URL (s3://bucket/key) or an absolute local path",
            brief_repr(url),
            "Manifest entries are not resolved against anything: write them in full.",
            url=url,
            where=where,
        )


def read_manifest(
    path: str | os.PathLike[str], *, allow_pipes: bool | None = None
) -> list[ManifestEntry]:
    """Read a manifest: text (one URL or brace pattern per line, ``#`` comments) or JSON.

    JSON is a list of URLs, a list of ``{"url": ..., ...}`` objects, or
    ``{"shards": [...]}`` of either. String entries may use brace patterns; an object
    names exactly one object (its other keys are kept in ``meta``) and is not expanded.

    A manifest is data, often written by someone else: a ``pipe:`` entry (a shell command)
    is a ``UrlError`` unless ``allow_pipes`` (default: SHARDCACHE_MANIFEST_PIPES=allow).
    """
    if allow_pipes is None:
        allow_pipes = env_setting("manifest_pipes") == "allow"
    path = Path(path)
    spec = f"@{path}"
    try:
        # Bytes, not read_text(): universal newlines would turn a stray "\r" into a line.
        text = path.read_bytes().decode("utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise url_error(
            spec,
            "Cannot read manifest",
            "a readable UTF-8 text or JSON file",
            f"{type(exc).__name__}: {exc}",
            "Check the path and its permissions.",
            path=str(path),
        ) from exc
    if path.suffix.lower() == ".json":
        entries = _parse_json_manifest(text, spec)
    else:
        entries = _parse_text_manifest(text, spec)
    if not entries:
        raise url_error(
            spec,
            "Empty manifest",
            "at least one URL",
            "no entries",
            "Add shard URLs to the manifest (one per line, or a JSON list).",
            path=str(path),
        )
    if not allow_pipes:
        _refuse_commands(entries, spec)
    log.debug("manifest %s: %d entries", path, len(entries))
    return entries


def _refuse_commands(entries: list[ManifestEntry], spec: str) -> None:
    commands = [entry.url for entry in entries if is_pipe_url(entry.url)]
    if commands:
        raise url_error(
            spec,
            "Shell command in manifest",
            "URLs the cache reads itself (s3://, https://, paths): a manifest is data, and a "
            "pipe: entry would run whatever it says as you",
            f"{len(commands)} pipe: entr{'y' if len(commands) == 1 else 'ies'}, the first "
            f"{brief_repr(commands[0])}",
            "Write the entries as URLs; if you wrote the manifest and trust every command in "
            "it, set SHARDCACHE_MANIFEST_PIPES=allow.",
            command=commands[0],
            count=len(commands),
        )


def _parse_text_manifest(text: str, spec: str) -> list[ManifestEntry]:
    entries: list[ManifestEntry] = []
    # Split on "\n" only: a stray "\r" (or other line break) inside a line is an error
    # for _check_url to report, not a silent second URL.
    for number, raw in enumerate(text.split("\n"), start=1):
        line = raw.rstrip("\r").strip(" \t")
        if not line or line.startswith("#"):
            continue
        where = f" (line {number}: {brief_repr(line)})"
        urls = _expand_string(line, spec, where, in_manifest=True)
        entries.extend(ManifestEntry(url) for url in urls)
        _check_total(len(entries), spec)
    return entries


def _parse_json_manifest(text: str, spec: str) -> list[ManifestEntry]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise url_error(
            spec,
            "Cannot parse JSON manifest",
            "valid JSON",
            f"{exc.msg} at line {exc.lineno}, column {exc.colno}",
            "Fix the JSON syntax.",
            line=exc.lineno,
        ) from exc
    if isinstance(data, dict):
        if "shards" not in data:
            raise url_error(
                spec,
                "Unexpected JSON manifest layout",
                'a list, or an object with a "shards" list',
                f"an object with keys {sorted(data)[:10]}",
                'Wrap the entries as {"shards": [...]}.',
            )
        data = data["shards"]
    if not isinstance(data, list):
        raise url_error(
            spec,
            "Unexpected JSON manifest layout",
            "a list of URLs or of objects with a 'url' key",
            type(data).__name__,
            'Write ["s3://b/a.tar", ...] or [{"url": "s3://b/a.tar"}, ...].',
        )
    entries: list[ManifestEntry] = []
    for index, item in enumerate(data):
        where = f" (entry {index}: {brief_repr(item)})"
        if isinstance(item, str):
            urls = _expand_string(item, spec, where, in_manifest=True)
            entries.extend(ManifestEntry(url) for url in urls)
            _check_total(len(entries), spec)
        elif isinstance(item, dict) and isinstance(item.get("url"), str):
            url = item["url"]
            _require_absolute(url, spec, where)
            meta = {key: value for key, value in item.items() if key != "url"}
            entries.append(ManifestEntry(checked_url(url, spec, where), meta))
        else:
            raise url_error(
                spec,
                "Bad JSON manifest entry",
                "a URL string or an object with a string 'url' key",
                brief_repr(item),
                'Write each entry as "s3://b/a.tar" or {"url": "s3://b/a.tar"}.',
                where=where,
            )
    return entries


# ------------------------------------------------------------------------------ public


def _expand_one(item: object, where: str = "") -> list[str]:
    if isinstance(item, os.PathLike):
        item = os.fspath(item)
    if not isinstance(item, str):
        raise url_error(
            item,
            "Bad shard spec",
            "a str URL/pattern, a path, or a list of them",
            type(item).__name__,
            "Pass URLs as strings.",
            where=where,
        )
    return _expand_string(item, item, where, in_manifest=False)


def expand_urls(spec: Spec) -> list[str]:
    """Expand a shard spec into its ordered list of URLs.

    ``spec`` is a URL or brace pattern, a manifest (``"@path"`` or an existing local
    ``.txt``/``.json``/``.manifest`` file), or an iterable of those (concatenated in
    order). Local paths are returned as given. Raises ``UrlError`` for malformed
    braces, oversized expansions, empty results, control characters, unknown
    protocols, over-long URLs and unreadable manifests.
    """
    if isinstance(spec, (str, os.PathLike)):
        urls = _expand_one(spec)
    elif isinstance(spec, (bytes, bytearray, Mapping)) or not isinstance(spec, Iterable):
        raise url_error(
            spec,
            "Bad shard spec",
            "a str URL/pattern, a path, or a list of them",
            type(spec).__name__,
            "Pass a string such as 's3://b/train-{000..099}.tar' or a list of URLs.",
        )
    else:
        urls = []
        for index, item in enumerate(spec):
            urls.extend(_expand_one(item, where=f" (item {index})"))
            _check_total(len(urls), f"<list of {index + 1}+ specs>")
    if not urls:
        raise url_error(
            spec,
            "Empty shard spec",
            "at least one URL",
            "nothing",
            "Pass at least one URL.",
        )
    return urls


__all__ = ["ManifestEntry", "expand_urls", "read_manifest"]
