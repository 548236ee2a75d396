"""Shard specs -> an ordered list of URLs.

A spec is a URL with an optional brace pattern (``s3://b/train-{000000..000999}.tar``,
expanded by the ``braceexpand`` package exactly as webdataset does, zero padding
included), a list of such strings, or a manifest file (``@path``, or an existing local
``.txt``/``.json``/``.manifest`` path).

Departures from plain ``braceexpand`` (each turns a silent surprise into a ``UrlError``):

- braces must balance and every ``{...}`` group must be a range or a comma list; a group
  that is neither (``{abc}``, ``{0...9}``) is rejected instead of kept literally (escape a
  literal brace as ``\\{``);
- the size of the expansion is computed before expanding (``braceexpand`` materialises
  every range), and more than ``MAX_EXPANSION`` URLs is an error;
- ``::`` separates specs as in webdataset, so fsspec protocol chaining
  (``simplecache::s3://...``) is rejected; webdataset's ``WDS_`` environment variable
  substitution is not done.

Lists are brace-expanded item by item (webdataset passes lists through untouched).

``pipe:`` URLs (``pipe:aws s3 cp s3://b/x-{000..009}.tar -``) are shell commands whose
standard output is the shard, as in webdataset. Their braces are expanded exactly as
webdataset does (plain ``braceexpand``): a brace group that is neither a range nor a list
(``awk '{print}'``, ``${VAR}``) stays literal instead of being an error, and a backslash
is dropped as braceexpand drops it. Unbalanced braces, the expansion bound, the length
limit and the control-character checks apply as to any URL; the command is never taken
for a path, and '::' inside it is allowed only in a JSON manifest's ``{"url": ...}``
object (in a spec string '::' separates specs, as in webdataset).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse
from urllib.request import url2pathname

from braceexpand import braceexpand
from fsspec.registry import known_implementations, registry

from ._config import env_setting
from ._errors import UrlError
from ._redact import get_logger

log = get_logger(__name__)

Spec = str | os.PathLike[str] | Iterable[str | os.PathLike[str]]

MAX_EXPANSION = 10_000_000
"""Most URLs one spec (or one call) may expand to."""

MAX_URL_BYTES = 8192
"""Longest URL accepted, in UTF-8 bytes."""

MANIFEST_SUFFIXES = (".txt", ".json", ".manifest")

PIPE_PREFIX = "pipe:"
"""A URL starting with this is a shell command whose standard output is the shard."""

_SHOW_CHARS = 200
_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
# "s3:/b/k" or "s3:b/k": a known protocol name followed by ":" but not "//".
_BROKEN_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]+):(?!//)(?!:)")
# The same range grammar as braceexpand (the step's sign is ignored there too).
_INT_RANGE_RE = re.compile(r"^(-?\d+)\.\.(-?\d+)(?:\.\.-?(\d+))?$")
_CHAR_RANGE_RE = re.compile(r"^([A-Za-z])\.\.([A-Za-z])(?:\.\.-?(\d+))?$")
_BARE_PROTOCOL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*$")
_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_FORBIDDEN_CHARS = {"\x00": "NUL", "\n": "a newline", "\r": "a carriage return"}
_HINT_BRACES = (
    "Write ranges as {000000..000999} and lists as {a,b,c}; balance every brace; "
    "escape a literal brace as \\{ or \\}."
)


def _show(text: object) -> str:
    """repr() of a spec or URL, cut short so a huge input cannot flood a message."""
    if isinstance(text, str):
        if len(text) > _SHOW_CHARS:
            return f"{text[:_SHOW_CHARS]!r}... ({len(text)} characters)"
        return repr(text)
    shown = repr(text)
    return shown if len(shown) <= _SHOW_CHARS else f"{shown[:_SHOW_CHARS]}..."


def _fail(
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
    message = f"{problem}{where}: {_show(spec)}. Expected {expected}; got {seen}. {hint}"
    # Keep the attribute small and picklable (a spec may be a huge string or a generator).
    if not isinstance(spec, str):
        spec = _show(spec)
    elif len(spec) > _SHOW_CHARS:
        spec = spec[:_SHOW_CHARS]
    return UrlError(message, spec=spec, expected=expected, seen=seen, hint=hint, **extra)


@dataclass(frozen=True)
class ManifestEntry:
    """One object listed in a manifest; ``meta`` holds the entry's other JSON keys."""

    url: str
    meta: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- protocols


def _is_known_protocol(proto: str) -> bool:
    # Looked up on each call: implementations may be registered at run time.
    return proto in registry or proto in known_implementations


LOCAL_PROTOCOLS = frozenset({"file", "local"})  # protocols whose URLs name local files


def is_pipe_url(url: str) -> bool:
    """True for webdataset's ``pipe:<command>`` URLs (case-sensitive, as in webdataset)."""
    return url.startswith(PIPE_PREFIX)


def url_protocol(url: str) -> str:
    """The protocol of ``url`` ("s3", "gs", "http", ...), lower-cased; "file" for a path;
    "pipe" for a ``pipe:`` command."""
    if is_pipe_url(url):
        return "pipe"
    match = _SCHEME_RE.match(url)
    return match.group(1).lower() if match else "file"


def local_path(url: str) -> str:
    """The absolute path of the file a local ``url`` names, read as webdataset's ``gopen``
    reads it: a plain path (``~`` expanded, relative to the working directory), or a
    ``file:`` URL (``file:/p``, ``file:///p``, ``file://localhost/p``) with its
    percent-escapes decoded. ``file://name/p`` keeps fsspec's reading (``name/p``)."""
    if url[:5].lower() == "file:":
        parsed = urlparse(url)
        path = url2pathname(parsed.path)
        if parsed.netloc not in ("", "localhost"):
            path = parsed.netloc + path
    elif url[:8].lower() == "local://":
        path = url[8:]
    else:
        path = url
    return os.path.abspath(os.path.expanduser(path))


def _check_protocol(url: str, spec: object, where: str) -> None:
    match = _SCHEME_RE.match(url)
    if match is None:
        broken = _BROKEN_SCHEME_RE.match(url)
        # "file:/path" is a URL webdataset reads (RFC 8089's short form), not a typo.
        if (
            broken
            and broken.group(1).lower() != "file"
            and _is_known_protocol(broken.group(1).lower())
        ):
            name = broken.group(1)
            raise _fail(
                spec,
                "Malformed URL scheme",
                f"'{name}://...'",
                f"'{name}:' without '//' (it would be read as a local path)",
                f"Write {name}://bucket/key.",
                url=url,
                where=where,
            )
        return
    proto = match.group(1).lower()
    if not _is_known_protocol(proto):
        raise _fail(
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
    _check_url(url, url)


def _check_url(url: str, spec: object, where: str = "") -> str:
    if is_pipe_url(url) and not url[len(PIPE_PREFIX) :].strip():
        raise _fail(
            spec,
            "Empty pipe command",
            "'pipe:' followed by a shell command that writes the shard to its stdout",
            "nothing after 'pipe:'",
            "Write e.g. 'pipe:aws s3 cp s3://bucket/key.tar -'.",
            url=url,
            where=where,
        )
    if not url:
        raise _fail(
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
            raise _fail(
                spec,
                "Invalid character in URL",
                "a URL without NUL, newline or carriage return",
                f"{name} at position {url.index(char)} of {_show(url)}",
                "List one URL per manifest line or pass a list of URLs.",
                url=url,
                where=where,
            )
    size = len(url.encode("utf-8", "surrogatepass"))
    if size > MAX_URL_BYTES:
        raise _fail(
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
        raise _fail(
            spec,
            "'::' inside a URL",
            "one URL per entry (fsspec protocol chaining is not supported)",
            _show(url),
            "In a spec string '::' separates specs, as in webdataset; list each URL on its own.",
            url=url,
            where=where,
        )
    _check_protocol(url, spec, where)
    return url


# ------------------------------------------------------------------------------ braces


def _scan(text: str, start: int = 0) -> Iterator[tuple[int, str, int]]:
    """(position, character, brace depth after it) of every unescaped character."""
    depth = 0
    pos = start
    while pos < len(text):
        char = text[pos]
        if char == "\\":
            pos += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
        yield pos, char, depth
        pos += 1


def _find_close(text: str, open_pos: int) -> int:
    """Index of the brace closing the one at ``open_pos``, or -1."""
    for pos, char, depth in _scan(text, open_pos):
        if char == "}" and depth == 0:
            return pos
    return -1


def _split_top_commas(text: str) -> list[str]:
    parts: list[str] = []
    start = 0
    for pos, char, depth in _scan(text):
        if char == "," and depth == 0:
            parts.append(text[start:pos])
            start = pos + 1
    parts.append(text[start:])
    return parts


def _range_count(expr: str) -> int | None:
    """Items in a braceexpand range expression, or None when ``expr`` is not a range."""
    match = _INT_RANGE_RE.match(expr)
    if match:
        start, end = int(match.group(1)), int(match.group(2))
        step = int(match.group(3) or 1) or 1
        return abs(end - start) // step + 1
    match = _CHAR_RANGE_RE.match(expr)
    if match:
        start, end = _ALPHABET.index(match.group(1)), _ALPHABET.index(match.group(2))
        step = int(match.group(3) or 1) or 1
        return abs(end - start) // step + 1
    return None


def _count(pattern: str, spec: object, where: str, *, literal_groups: bool = False) -> int:
    """How many strings braceexpand(pattern) yields; UrlError when it is malformed.

    Mirrors braceexpand's grammar (pattern = product of literals and groups; group =
    range or comma list of patterns) without expanding anything. ``literal_groups``: a
    group that is neither range nor list is kept literally, as braceexpand keeps it (its
    inner groups still expand); otherwise it is an error.
    """
    total = 1
    pos = 0
    while pos < len(pattern):
        char = pattern[pos]
        if char == "\\":
            pos += 2
            continue
        if char == "}":
            raise _fail(
                spec,
                "Unbalanced braces",
                "every '}' to close an earlier '{'",
                f"a stray '}}' at position {pos} of {_show(pattern)}",
                _HINT_BRACES,
                where=where,
            )
        if char == "{":
            close = _find_close(pattern, pos)
            if close < 0:
                raise _fail(
                    spec,
                    "Unbalanced braces",
                    "every '{' to be closed by a '}'",
                    f"an unclosed '{{' at position {pos} of {_show(pattern)}",
                    _HINT_BRACES,
                    where=where,
                )
            expr = pattern[pos + 1 : close]
            count = _range_count(expr)
            if count is None:
                alternatives = _split_top_commas(expr)
                if len(alternatives) < 2 and literal_groups:
                    alternatives = [expr]
                elif len(alternatives) < 2:
                    raise _fail(
                        spec,
                        "Malformed brace pattern",
                        "a range {first..last[..step]} or a list {a,b,...} in braces",
                        f"{{{expr}}}",
                        _HINT_BRACES,
                        where=where,
                    )
                count = sum(
                    _count(alt, spec, where, literal_groups=literal_groups) for alt in alternatives
                )
            total *= count
            pos = close + 1
            continue
        pos += 1
    return total


def _expand_pattern(pattern: str, spec: object, where: str = "") -> list[str]:
    # A shell command's braces (awk '{print}', ${VAR}) are webdataset's business: kept.
    count = _count(pattern, spec, where, literal_groups=is_pipe_url(pattern))
    if count > MAX_EXPANSION:
        raise _fail(
            spec,
            "Brace pattern too large",
            f"at most {MAX_EXPANSION:,} URLs",
            f"{count:,}",
            "Check the range bounds (a typo such as an extra digit multiplies the count).",
            count=count,
            where=where,
        )
    return [_check_url(url, spec, where) for url in braceexpand(pattern)]


def _split_specs(text: str, spec: object, where: str) -> list[str]:
    """Split on '::' as webdataset does; reject what looks like fsspec protocol chaining."""
    parts = text.split("::")
    for part in parts[:-1]:
        if _BARE_PROTOCOL_RE.match(part) and _is_known_protocol(part.lower()):
            raise _fail(
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
            urls.extend(_expand_pattern(part, spec, where))
        _check_total(len(urls), spec)
    return urls


def _check_total(total: int, spec: object) -> None:
    if total > MAX_EXPANSION:
        raise _fail(
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
    if _SCHEME_RE.match(spec) or is_pipe_url(spec) or "{" in spec:
        return None
    if spec.lower().endswith(MANIFEST_SUFFIXES) and Path(spec).is_file():
        return Path(spec)
    return None


def _require_absolute(url: str, spec: object, where: str) -> None:
    if _SCHEME_RE.match(url) is None and not is_pipe_url(url) and not Path(url).is_absolute():
        raise _fail(
            spec,
            "Relative entry in manifest",
            "a full URL (s3://bucket/key) or an absolute local path",
            _show(url),
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
        raise _fail(
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
        raise _fail(
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
        raise _fail(
            spec,
            "Shell command in manifest",
            "URLs the cache reads itself (s3://, https://, paths): a manifest is data, and a "
            "pipe: entry would run whatever it says as you",
            f"{len(commands)} pipe: entr{'y' if len(commands) == 1 else 'ies'}, the first "
            f"{_show(commands[0])}",
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
        where = f" (line {number}: {_show(line)})"
        urls = _expand_string(line, spec, where, in_manifest=True)
        entries.extend(ManifestEntry(url) for url in urls)
        _check_total(len(entries), spec)
    return entries


def _parse_json_manifest(text: str, spec: str) -> list[ManifestEntry]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _fail(
            spec,
            "Cannot parse JSON manifest",
            "valid JSON",
            f"{exc.msg} at line {exc.lineno}, column {exc.colno}",
            "Fix the JSON syntax.",
            line=exc.lineno,
        ) from exc
    if isinstance(data, dict):
        if "shards" not in data:
            raise _fail(
                spec,
                "Unexpected JSON manifest layout",
                'a list, or an object with a "shards" list',
                f"an object with keys {sorted(data)[:10]}",
                'Wrap the entries as {"shards": [...]}.',
            )
        data = data["shards"]
    if not isinstance(data, list):
        raise _fail(
            spec,
            "Unexpected JSON manifest layout",
            "a list of URLs or of objects with a 'url' key",
            type(data).__name__,
            'Write ["s3://b/a.tar", ...] or [{"url": "s3://b/a.tar"}, ...].',
        )
    entries: list[ManifestEntry] = []
    for index, item in enumerate(data):
        where = f" (entry {index}: {_show(item)})"
        if isinstance(item, str):
            urls = _expand_string(item, spec, where, in_manifest=True)
            entries.extend(ManifestEntry(url) for url in urls)
            _check_total(len(entries), spec)
        elif isinstance(item, dict) and isinstance(item.get("url"), str):
            url = item["url"]
            _require_absolute(url, spec, where)
            meta = {key: value for key, value in item.items() if key != "url"}
            entries.append(ManifestEntry(_check_url(url, spec, where), meta))
        else:
            raise _fail(
                spec,
                "Bad JSON manifest entry",
                "a URL string or an object with a string 'url' key",
                _show(item),
                'Write each entry as "s3://b/a.tar" or {"url": "s3://b/a.tar"}.',
                where=where,
            )
    return entries


# ------------------------------------------------------------------------------ public


def _expand_one(item: object, where: str = "") -> list[str]:
    if isinstance(item, os.PathLike):
        item = os.fspath(item)
    if not isinstance(item, str):
        raise _fail(
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
        raise _fail(
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
        raise _fail(
            spec,
            "Empty shard spec",
            "at least one URL",
            "nothing",
            "Pass at least one URL.",
        )
    return urls


__all__ = [
    "LOCAL_PROTOCOLS",
    "MAX_EXPANSION",
    "MAX_URL_BYTES",
    "PIPE_PREFIX",
    "ManifestEntry",
    "expand_urls",
    "is_pipe_url",
    "read_manifest",
    "url_protocol",
]
