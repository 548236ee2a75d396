"""A dataset's lockfile in force: made or read once per process, the shards checked
against it before the first sample, a changed shard pinned to its recorded version where
the store keeps it (``url?versionId=V``) or named in a
:class:`~shardcache.DatasetChangedError` (or a warning, by choice); its digest stamped into
every state and checked in a loaded one.

Where the lock lives: the lockfile is written once per job, beside the checkpoint (the
first process to write it wins), and each consumer state carries only its digest and
location, so a state stays small whatever the shard count. The check costs a metadata
read per shard the cache holds and one ``HEAD`` per shard it does not (none for a shard
whose S3 version the lock records: that version is read as it is), once per process that
prepares the dataset.

When the job learns its sample index (:mod:`~shardcache._datasets.job_index`), each cache
holds only its share of the shards; the ranks give, with their records, the identity of
each copy their caches hold, and the lock made then takes those instead of a ``HEAD`` (none
at all when every shard was learned by some cache). Which identities stand in for a
request, and why:

* **the cache's own record** of a copy it holds: the bytes this cache reads;
* **another cache's record, given in this job's exchange**, and only for the lock made
  right after it (:meth:`LockUse.record`): the lock then records the bytes the job's
  caches hold and read, fetched from the store by this job's learning or held since (as
  this cache's own copies are); a ``HEAD`` would ask the store the learning just read;
* **nothing else.** A resume's check (:meth:`LockUse.read_urls`) runs before this job
  learns or exchanges anything. An identity kept from an earlier job (a kept index
  carries none) or another cache's copy says what a shard was when it was fetched, not
  that it was not rewritten since (the lock may be newer); this process may fetch the
  shard from the store (another layout, an evicted copy), and reading it catches only a
  rewrite that moves its samples. So a resume asks the store for every shard its cache
  does not hold, and a shard rewritten after the lock was made is named, whatever a kept
  index or another cache holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .._base.errors import ConfigError, DatasetChangedError, ResumeError
from .._base.redact import get_logger
from .._base.url_kinds import pin_version, url_protocol
from .._cache.shard_cache import ShardCache
from .dataset_lock import (
    Change,
    DatasetLock,
    ShardIdentity,
    changes,
    identities,
    make_lock,
    read_lock,
    write_lock,
)

logger = get_logger(__name__)

ON_CHANGE = ("error", "warn")
_SHOWN = 20  # changed shards a message lists one by one (the error's ``changed`` has all)
_VERSIONED = frozenset({"s3", "s3a"})  # stores a recorded version is read back from


class LockUse:
    """A dataset's lockfile (``location``; None: no lock) and what a changed shard does
    (``on_change``: ``"error"`` or ``"warn"``; None: the cache's setting,
    ``SHARDCACHE_SHARDS_CHANGED``). Resolved once per process, when the dataset first
    needs its shards (:meth:`read_urls`, :meth:`record`); the digest stamped into every
    state then (:meth:`stamp`) and checked in a loaded one (:meth:`check_state`)."""

    def __init__(self, location: str | None, on_change: str | None) -> None:
        if location is not None and not (isinstance(location, str) and location):
            raise ConfigError(
                f"lock={location!r}: expected the path or URL of a dataset lockfile",
                name="lock",
                value=location,
            )
        if on_change is not None and on_change not in ON_CHANGE:
            raise ConfigError(
                f"shards_changed={on_change!r}: expected one of {ON_CHANGE}",
                name="shards_changed",
                value=on_change,
                accepted=ON_CHANGE,
            )
        self.location = location
        self.on_change = on_change
        self.lock: DatasetLock | None = None  # once resolved in this process
        self.requests = 0  # HEADs this process sent to resolve it

    def read_urls(
        self, urls: Sequence[str], cache: ShardCache, *, threads: int
    ) -> list[str] | None:
        """The URLs to read ``urls`` by under the lockfile when it exists (a changed shard
        pinned to its recorded version), after checking every shard against it; None when
        there is no lockfile yet (:meth:`record` makes it once the shards are known)."""
        if self.location is None:
            return list(urls)
        lock = read_lock(self.location)
        if lock is None:
            return None
        return self._against(lock, urls, cache, threads)

    def record(
        self,
        urls: Sequence[str],
        cache: ShardCache,
        *,
        threads: int,
        held: Mapping[str, ShardIdentity] | None = None,
    ) -> list[str]:
        """Make the lock of ``urls`` as the cache holds them (and as ``held``: the copies
        the job's other caches hold, as they gave them while learning the sample index
        just now) and write it (the first writer wins); the URLs to read by under the lock
        the file holds."""
        assert self.location is not None
        theirs = read_lock(self.location)  # another process may have written it meanwhile
        if theirs is not None:
            return self._against(theirs, urls, cache, threads, held)
        now, self.requests = identities(urls, cache, threads=threads, held=held)
        mine = make_lock(now)
        lock = write_lock(self.location, mine, exclusive=True)
        if lock.digest == mine.digest:
            logger.info(
                "dataset lock of %d shards written to %s (%d HEAD requests)",
                len(urls),
                self.location,
                self.requests,
            )
            self.lock = lock
            return list(urls)
        return self._against(lock, urls, cache, threads, held)

    def _against(
        self,
        lock: DatasetLock,
        urls: Sequence[str],
        cache: ShardCache,
        threads: int,
        held: Mapping[str, ShardIdentity] | None = None,
    ) -> list[str]:
        """Check ``urls`` against ``lock``: the URLs to read them by (a changed shard, or
        one not cached, pinned to its recorded S3 version); the others that changed raise
        :class:`DatasetChangedError`, or are named in a warning."""
        assert self.location is not None
        missing = lock.missing(urls)
        if missing:
            raise ConfigError(
                f"the dataset lock {self.location} has no entry for {len(missing)} of the "
                f"{len(urls)} shards (first: {missing[0]}): it was written for another shard "
                f"list. Give this dataset its own lockfile, or write it again "
                f"(shardcache lock SPEC -o {self.location})",
                path=self.location,
                missing=len(missing),
                first_missing=missing[0],
            )
        # A recorded version not in the cache is read as it is: no request to compare it.
        now, self.requests = identities(
            urls, cache, threads=threads, ask=lambda url: _version(lock, url) is None, held=held
        )
        direct = {
            url: pin_version(url, version)
            for url in urls
            if url not in now and (version := _version(lock, url))
        }
        if direct:
            logger.info(
                "%d shards not in the cache are read at the versions the dataset lock %s records",
                len(direct),
                self.location,
            )
        changed = changes(lock, now)
        pinned = {c.url: pin_version(c.url, c.expected.version_id) for c in changed if _pins(c)}
        unpinned = [c for c in changed if c.url not in pinned]
        if pinned:
            logger.warning(
                "%d shards changed since the dataset lock %s was written; reading the "
                "recorded versions (first: %s)",
                len(pinned),
                self.location,
                next(iter(pinned.values())),
            )
        if unpinned:
            error = changed_error(self.location, unpinned, len(urls))
            if (self.on_change or cache.settings.shards_changed) == "error":
                raise error
            logger.warning("%s; reading them as they are now (shards_changed='warn')", error)
        self.lock = lock
        pinned.update(direct)
        return [pinned.get(url, url) for url in urls]

    def stamp(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` with the digest of the lock in force (when one is)."""
        if self.lock is not None:
            state["lock"] = {"digest": self.lock.digest, "location": self.location}
        return state

    def check_state(self, state: Mapping[str, Any]) -> None:
        """Refuse a state taken under another lock than this dataset's lockfile holds."""
        theirs = _state_lock(state)
        if theirs is None:
            return
        where = theirs.get("location")
        if self.location is None:
            raise ResumeError(
                f"the state was taken under the dataset lock {where} (digest "
                f"{theirs.get('digest')}); pass lock={where!r} so that the resume reads the "
                "shards the state counted",
                what="dataset lock",
                expected=theirs,
                seen=None,
            )
        lock = self.lock or read_lock(self.location)
        if lock is None:
            raise ResumeError(
                f"the state was taken under the dataset lock {where} (digest "
                f"{theirs.get('digest')}), but {self.location} does not exist: restore that "
                "lockfile to resume",
                what="dataset lock",
                path=self.location,
                expected=theirs,
            )
        if lock.digest != theirs.get("digest"):
            raise ResumeError(
                f"the state was taken under the dataset lock {where} of digest "
                f"{theirs.get('digest')}, but {self.location} holds digest {lock.digest}: "
                "resume with the lockfile the state was taken with",
                what="dataset lock",
                path=self.location,
                expected=lock.digest,
                seen=theirs.get("digest"),
            )


def changed_error(location: str, changed: Sequence[Change], total: int) -> DatasetChangedError:
    """The error naming every shard of ``changed`` (the first ``_SHOWN`` in the message)."""
    lines = [change.line() for change in changed[:_SHOWN]]
    if len(changed) > _SHOWN:
        lines.append(f"... and {len(changed) - _SHOWN} more (`shardcache lock --diff {location}`)")
    listing = "\n  ".join(lines)
    return DatasetChangedError(
        f"{len(changed)} of {total} shards changed since the dataset lock {location} was "
        "written, and the store keeps no version of their recorded bytes (S3 bucket "
        f"versioning off, or another store):\n  {listing}\nRestore those shards, or start "
        f"anew from a new lock (remove {location}, or `shardcache lock SPEC -o {location}`) "
        "and a fresh epoch, or pass shards_changed='warn' to read them as they are now",
        lock=location,
        changed=[change.url for change in changed],
        expected=[change.expected.as_json(change.url) for change in changed],
        seen=[None if c.seen is None else c.seen.as_json(c.url) for c in changed],
    )


def _pins(change: Change) -> bool:
    """Whether ``change``'s recorded bytes can be read back: a version id on a versioned
    store, of a shard still there."""
    return change.seen is not None and _version_of(change.url, change.expected) is not None


def _version(lock: DatasetLock, url: str) -> str | None:
    return _version_of(url, lock.shards[url])


def _version_of(url: str, identity: ShardIdentity) -> str | None:
    """The version ``identity`` records that ``url``'s store can read back, else None."""
    version = identity.version_id
    if version in (None, "null") or url_protocol(url) not in _VERSIONED:
        return None
    return version


def _state_lock(state: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The lock stamp of a consumer state, or of a job state's parts."""
    if isinstance(state.get("lock"), Mapping):
        return state["lock"]  # type: ignore[no-any-return]
    for part in state.get("parts") or ():
        if isinstance(part, Mapping) and isinstance(part.get("lock"), Mapping):
            return part["lock"]  # type: ignore[no-any-return]
    return None


__all__ = ["ON_CHANGE", "LockUse", "changed_error"]
