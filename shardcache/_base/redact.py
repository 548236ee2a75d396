"""Keep credentials out of everything shardcache prints or records.

Storage options, URLs and free text are shown with secret values replaced by ``***``;
the names stay visible, so a reader still sees that a key or token was set. Only what
is shown or written for people is redacted: the URL that is fetched, the options given
to fsspec and the cache key are never changed.

- :func:`redact_options`: a storage-options mapping, recursively (``client_kwargs``,
  ``config_kwargs``, headers, per-protocol options). A value is secret when its key names a
  credential (:func:`is_secret_name`): s3fs's ``key`` and ``secret``, ``token``,
  ``password``, ``session_token``, ``aws_secret_access_key``, ``Authorization``, ...
- :func:`redact_url`: userinfo (``https://user:pass@host``, ``s3://KEY:SECRET@bucket``)
  and credential query parameters (``X-Amz-Signature``, ``X-Amz-Credential``,
  ``X-Amz-Security-Token``, ``sig``, ``token``, ...) of presigned URLs.
- :func:`redact_text`: every URL in a message, ``NAME=value`` pairs of secret-looking
  environment variables (``AWS_SECRET_ACCESS_KEY=...``), quoted ``"name": "value"`` pairs
  with a secret name (JSON, dict and header reprs) and ``Authorization:`` headers.
- :func:`get_logger`: a module logger whose records (message, arguments and traceback)
  pass through :func:`redact_text`. The CLI also puts :class:`RedactingFilter` on its log
  handler, so ``-v`` redacts third-party records (botocore's request headers) too; a
  program that configures logging itself redacts only shardcache's own records.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

REDACTED = "***"

_SECRET_NAMES = {"key", "sig", "pass", "pwd", "auth"}
_SECRET_PARTS = (
    "secret",
    "token",
    "passw",
    "credential",
    "signature",
    "accesskey",
    "access_key",
    "authorization",
    "private_key",
    "account_key",
    "api_key",
    "apikey",
    "customer_key",
    "customerkey",
    "connection_string",
    "cookie",
)
_URL_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]+")
_USERINFO_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)([^/?#\s]+)@")
_QUERY_PARAM_RE = re.compile(r"([?&;])([^=&;#]+)=([^&;#]*)")
_ENV_PAIR_RE = re.compile(
    r"\b([A-Z0-9_]*(?:SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL)[A-Z0-9_]*)=(\S+)"
)
# A quoted name, ':' or '=', a quoted value (JSON, dict and header reprs; b'' values).
_QUOTED_PAIR_RE = re.compile(r"""(['"])([^'"\n]{1,64})\1(\s*[:=]\s*)(b?)(['"])([^'"\n]*)\5""")
_HEADER_RE = re.compile(
    r"\b(authorization|x-amz-security-token|cookie)(\s*:\s*)[^'\"\n,}]+", re.IGNORECASE
)


def is_secret_name(name: str) -> bool:
    """Whether an option, query parameter or variable called ``name`` holds a credential."""
    normal = name.strip().lower().replace("-", "_")
    return normal in _SECRET_NAMES or any(part in normal for part in _SECRET_PARTS)


def redact_options(options: Any) -> Any:
    """A copy of ``options`` (a mapping, possibly nested, or a list) with secret values
    replaced by ``***`` and credentials in other strings (URLs) redacted."""
    if isinstance(options, Mapping):
        return {
            key: REDACTED
            if is_secret_name(str(key)) and value not in (None, "")
            else redact_options(value)
            for key, value in options.items()
        }
    if isinstance(options, list | tuple):
        return type(options)(redact_options(value) for value in options)
    if isinstance(options, str):
        return redact_text(options)
    return options


def redact_url(url: str) -> str:
    """``url`` with its userinfo and credential query parameters replaced by ``***``;
    the same string when it carries none."""
    url = _USERINFO_RE.sub(lambda m: f"{m.group(1)}{REDACTED}@", url, count=1)
    query_at = url.find("?")
    if query_at < 0:
        return url
    head, query = url[:query_at], url[query_at:]
    return head + _QUERY_PARAM_RE.sub(_redact_param, query)


def _redact_param(match: re.Match[str]) -> str:
    sep, name, value = match.groups()
    return f"{sep}{name}={REDACTED}" if is_secret_name(name) and value else match.group(0)


def redact_text(text: str) -> str:
    """``text`` with credentials in its URLs, secret ``NAME=value`` variables and
    ``Authorization:`` headers replaced by ``***``."""
    text = _URL_RE.sub(lambda m: redact_url(m.group(0)), text)
    text = _ENV_PAIR_RE.sub(lambda m: f"{m.group(1)}={REDACTED}", text)
    text = _QUOTED_PAIR_RE.sub(_redact_pair, text)
    return _HEADER_RE.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)


def _redact_pair(match: re.Match[str]) -> str:
    quote, name, sep, prefix, vquote, value = match.groups()
    if not value or not is_secret_name(name):
        return match.group(0)
    return f"{quote}{name}{quote}{sep}{prefix}{vquote}{REDACTED}{vquote}"


class RedactingFilter(logging.Filter):
    """Formats a record's message (and traceback) once, with credentials redacted."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        record.msg, record.args = redact_text(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = redact_text(logging.Formatter().formatException(record.exc_info))
        if record.stack_info:
            record.stack_info = redact_text(record.stack_info)
        return True


_FILTER = RedactingFilter()


def get_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)`` with credentials redacted from every record it logs."""
    logger = logging.getLogger(name)
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
    return logger
