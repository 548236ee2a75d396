"""The exception hierarchy: every failure a user can cause or meet is one of these.

::

    ShardCacheError
    ├── ConfigError(ValueError)           bad argument / SHARDCACHE_* / launcher value
    ├── UrlError(ValueError)              bad URL or spec (braces, empty list, protocol)
    ├── FetchError(OSError)               url, attempts, cause
    │   ├── TransientFetchError           retries exhausted on 5xx/throttle/reset/timeout
    │   ├── PermanentFetchError           not retried: bad bucket, untrusted certificate, ...
    │   │   ├── RemoteNotFoundError(FileNotFoundError)       no such key / bucket / file
    │   │   ├── RemotePermissionError(PermissionError)       access denied, HTTP 401/403
    │   │   ├── RemoteIsADirectoryError(IsADirectoryError)   a directory given as a shard
    │   │   └── UnverifiableError             SHARDCACHE_VERIFY=strict: only a size to check
    │   ├── PipeCommandError              a pipe: command failed on every attempt
    │   └── PeerFetchError                a peer of the cache mesh did not give a shard's bytes
    ├── CacheError                        the local side
    │   ├── CacheDirError(OSError)        cache dir missing, not a dir, not writable
    │   ├── IntegrityError                downloaded bytes do not match size / ETag
    │   ├── CacheFullError(OSError)       out of space
    │   ├── LockTimeout(TimeoutError)     a shard lock could not be acquired in time
    │   └── LockFileError(OSError)        a lock file cannot be created (path, errno)
    ├── ShardFormatError(ValueError)      a shard is not a readable tar (where, what was seen)
    ├── ResumeError(ValueError)           a resume state does not fit this dataset (what differs)
    │   ├── DeliveryMismatchError         what a job delivered is not what its plan says
    │   └── DatasetChangedError           shards differ from the dataset lockfile, no version kept
    ├── SampleIndexError(ValueError)      an index of sample offsets unusable (missing, stale)
    │   └── IndexExchangeError            ranks missing from a job's exchange of the index
    ├── MetricsError(ValueError)          metrics files cannot be reported (newer version, none)
    ├── MissingExtraError(ImportError)    an optional extra is missing (says what to pip install)
    ├── StallError(TimeoutError)          a prefetch worker made no progress
    └── WaitTimeout(TimeoutError)         a cross-rank wait (directory, file) timed out

Every exception carries a complete, human-readable message (what, where, what was
expected, what was seen, what to do) plus the same facts as attributes, and pickles
cleanly so DataLoader workers can re-raise it in the main process.
"""

from __future__ import annotations

from typing import Any

from .redact import redact_text


def _rebuild(cls: type[ShardCacheError], message: str, details: dict[str, Any]) -> ShardCacheError:
    exc = cls.__new__(cls)
    ShardCacheError.__init__(exc, message, **details)
    return exc


class ShardCacheError(Exception):
    """Base class of every shardcache error.

    ``details`` become attributes (``exc.url``, ``exc.path``, ...) so handlers can act
    on the facts without parsing the message. The message is redacted
    (:func:`shardcache._base.redact.redact_text`); the attributes keep the real values.
    """

    def __init__(self, message: str, **details: Any) -> None:
        message = redact_text(message)  # credentials in URLs never reach a message
        super().__init__(message)
        self.message = message
        self.details = details
        for key, value in details.items():
            setattr(self, key, value)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.message, self.details))

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        # Not the args: webdataset appends a shard's stream object to them.
        return f"{type(self).__name__}({self.message!r})"


class ConfigError(ShardCacheError, ValueError):
    """A setting has a value we cannot use (names the variable, value and accepted form)."""


class UrlError(ShardCacheError, ValueError):
    """A URL or shard spec cannot be used."""


class FetchError(ShardCacheError, OSError):
    """Fetching a remote object failed (names the URL, attempts and last cause).

    An ``OSError`` (``IOError``) like every failure to open a shard in webdataset, so code
    written against webdataset's opener (``except IOError``, ``wds.ignore_and_continue``
    wrappers that test for it) keeps working through the drop-in. ``errno`` is None: the
    cause is in ``cause`` and ``__cause__``."""

    retryable = False


class TransientFetchError(FetchError):
    """A transient failure (5xx, throttling, reset, timeout, truncation) outlived the retries."""

    retryable = True


class PermanentFetchError(FetchError):
    """A failure that retrying cannot fix (access denied, invalid bucket, ...)."""


class RemoteNotFoundError(PermanentFetchError, FileNotFoundError):
    """The remote object or bucket does not exist."""


class RemotePermissionError(PermanentFetchError, PermissionError):
    """Reading the source was refused (EACCES, S3 AccessDenied, HTTP 401/403)."""


class RemoteIsADirectoryError(PermanentFetchError, IsADirectoryError):
    """The source URL names a directory, not a shard file."""


class UnverifiableError(PermanentFetchError):
    """``SHARDCACHE_VERIFY=strict`` and the store describes the object by its size only
    (no checksum, no MD5 ETag, no parts layout): it is not downloaded."""


class PipeCommandError(FetchError):
    """A ``pipe:`` URL's command failed on every attempt: a nonzero exit status, death by a
    signal, or no output for SHARDCACHE_IO_TIMEOUT.

    Attributes: ``command``, ``exit_status`` (``Popen.returncode``: negative for a signal,
    -9 also when shardcache killed a silent command), ``stderr`` (the last few KiB),
    ``timed_out``. An exit status does not say whether the failure is transient, so every
    failure was retried under the retry policy first (``retryable``: trying later may work).
    """

    retryable = True


class PeerFetchError(FetchError):
    """A peer of the job's cache mesh did not give a shard's bytes: refused, reset, too
    slow, an error status or a short body. The fetch goes to the store instead.

    Attributes: ``url``, ``peer`` (``host:port``), ``status`` (the HTTP status, or None when
    no answer came), ``cause``."""

    retryable = True


class CacheError(ShardCacheError):
    """Something is wrong on the local cache side."""


class CacheDirError(CacheError, OSError):
    """The cache directory cannot be created or written."""


class IntegrityError(CacheError):
    """Downloaded bytes do not match the remote object's size or checksum."""


class CacheFullError(CacheError, OSError):
    """There is not enough space in the cache for a shard."""


class LockTimeout(CacheError, TimeoutError):
    """A shard's lock could not be acquired in time; carries the holder and a verdict."""


class LockFileError(CacheError, OSError):
    """A shard's lock file cannot be created or locked (names the path and errno)."""


class ShardFormatError(ShardCacheError, ValueError):
    """A shard is not a tar archive that can be read into samples (names the shard, the
    byte offset and what was found there)."""


class ResumeError(ShardCacheError, ValueError):
    """A resume state cannot be used here: another format version, dataset, shard list,
    seed or job layout; names what differs, both values and what to do."""


class DeliveryMismatchError(ResumeError):
    """The samples a job delivered of an epoch (their digest and count, kept in the resume
    state) are not the ones its plan says it delivered up to there: samples were skipped or
    repeated. Names the epoch, source, where it was checked, expected and seen."""


class DatasetChangedError(ResumeError):
    """Shards differ from the dataset lockfile and the store keeps no version of their
    recorded bytes: ``changed`` lists every such URL, ``expected`` and ``seen`` their
    identities (size, ETag, version, checksum); ``lock`` is the lockfile."""


class SampleIndexError(ShardCacheError, ValueError):
    """A sample index cannot be used: missing, damaged, of another format version or shard
    list, or stale (the shard changed since it was indexed); names the index or shard,
    what was expected, what was seen and what to do."""


class IndexExchangeError(SampleIndexError):
    """The job's ranks did not all give their part of the sample index within the bound
    (no process group: through torchrun's or the SLURM step's store): ``missing`` lists
    the ranks not heard from, ``store`` is where they were awaited, ``timeout`` the bound."""


class MetricsError(ShardCacheError, ValueError):
    """Metrics records cannot be reported: a file of a newer schema version (names the file,
    line and version: upgrade shardcache), or no records at all where some were expected."""


class MissingExtraError(ShardCacheError, ImportError):
    """An optional dependency is not installed; ``extra`` names the shardcache extra (or
    extras, comma-separated: what goes between the brackets), ``modules`` the modules not
    installed, and the message gives the ``pip install 'shardcache[...]'`` command."""


class StallError(ShardCacheError, TimeoutError):
    """A prefetch worker made no progress for the stall timeout."""


class WaitTimeout(ShardCacheError, TimeoutError):
    """A wait for something another rank makes (a directory, a file) timed out.

    Carries what was awaited, the path, host, rank and elapsed time, and says whether the
    path exists now, its mount, its parent's listing and the last error seen.
    """


__all__ = [
    "CacheDirError",
    "CacheError",
    "CacheFullError",
    "ConfigError",
    "DatasetChangedError",
    "FetchError",
    "IndexExchangeError",
    "IntegrityError",
    "LockFileError",
    "LockTimeout",
    "MetricsError",
    "MissingExtraError",
    "PeerFetchError",
    "PermanentFetchError",
    "PipeCommandError",
    "RemoteIsADirectoryError",
    "RemoteNotFoundError",
    "RemotePermissionError",
    "ResumeError",
    "SampleIndexError",
    "ShardCacheError",
    "ShardFormatError",
    "StallError",
    "TransientFetchError",
    "UnverifiableError",
    "UrlError",
    "WaitTimeout",
]
