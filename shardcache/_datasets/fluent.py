"""What ``ResumableDataset`` and ``MixtureDataset`` share with webdataset's pipelines: the
fluent stages (``.decode()``, ``.to_tuple()``, ``.map()``, ``.batched()``, ...) and
``len()``.

The fluent methods are webdataset's own (``wds.compat.FluidInterface``), each appending
its stage with ``compose``, except ``batched``: webdataset's takes one sample more than it
yields (it yields a full batch when the next sample arrives), so a state taken after a
batch would count that sample as delivered. Ours yields a batch as soon as it is full, so
the state after every batch is exact. Only stages that pass, change or drop samples one at
a time are offered (not ``shuffle``, ``slice`` or ``unbatched``, which hold samples back
or count positions a resume does not restore).

``len(dataset)`` is the number of samples this rank yields in the epoch read next, all its
DataLoader workers together, as in Mosaic Streaming and litdata (a rank's count, which
``len(DataLoader)`` divides by the batch size). Every consumer (rank x worker) gets the
same count, so the rank's is ``workers`` times a consumer's, for the ``workers`` given to
``prepare(workers=)`` (inside a worker: the DataLoader's ``num_workers``; else 1, which is
also ``num_workers=0``). It is the count of a whole fresh epoch in this layout, also after
a state was loaded. It needs the shards' sample offsets, as ``prepare()`` does: from the
index file, or learned (with a process group, a collective: call it on every rank).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch.utils.data
from webdataset import filters
from webdataset.compat import FluidInterface

from .resume_options import whole

Self = TypeVar("Self", bound="Fluent")


class Fluent:
    """Mixin of the resumable datasets: webdataset's fluent stages and ``len()``; the class
    gives ``compose`` and, through :meth:`_resumables`, its ``ResumableDataset`` parts."""

    _workers: int | None = None  # prepare(workers=): the DataLoader workers len() counts

    compose: Callable[..., Any]

    def decode(self: Self, *handlers: Any, **options: Any) -> Self:
        """Decode each sample's fields: webdataset's ``.decode()`` (``"pil"``, ``"rgb"``,
        ``"torch"``, a handler; ``only=``, ``partial=``, ``handler=``...)."""
        return FluidInterface.decode(self, *handlers, **options)  # type: ignore[no-any-return]

    def to_tuple(self: Self, *fields: str, **options: Any) -> Self:
        """Each sample as a tuple of its fields (``"jpg;png"``: the first present):
        webdataset's ``.to_tuple()``."""
        return FluidInterface.to_tuple(self, *fields, **options)  # type: ignore[no-any-return]

    def map(self: Self, f: Callable[[Any], Any], **options: Any) -> Self:
        """``f`` of each sample (None drops it): webdataset's ``.map()``."""
        return FluidInterface.map(self, f, **options)  # type: ignore[no-any-return]

    def map_dict(self: Self, **fields: Any) -> Self:
        """Each named field through its function: webdataset's ``.map_dict()``."""
        return FluidInterface.map_dict(self, **fields)  # type: ignore[no-any-return]

    def map_tuple(self: Self, *functions: Any, **options: Any) -> Self:
        """Each tuple element through its function: webdataset's ``.map_tuple()``."""
        return FluidInterface.map_tuple(self, *functions, **options)  # type: ignore[no-any-return]

    def select(self: Self, predicate: Callable[[Any], bool], **options: Any) -> Self:
        """Only the samples ``predicate`` accepts: webdataset's ``.select()``."""
        return FluidInterface.select(self, predicate, **options)  # type: ignore[no-any-return]

    def rename(self: Self, **fields: str) -> Self:
        """Fields renamed (``label="cls;class"``): webdataset's ``.rename()``."""
        return FluidInterface.rename(self, **fields)  # type: ignore[no-any-return]

    def batched(
        self: Self,
        batchsize: int,
        collation_fn: Callable[[list[Any]], Any] | None = filters.default_collation_fn,
        partial: bool = True,
    ) -> Self:
        """Group samples into batches of ``batchsize`` (collated by ``collation_fn``; None:
        lists), the last one shorter unless ``partial=False``; use the DataLoader with
        ``batch_size=None``. Each batch is yielded the moment it is full, so a state taken
        after it counts exactly the samples in the batches yielded (with ``partial=False``
        the short last batch's samples count as delivered: they are the epoch's end)."""
        size = whole("batchsize", batchsize, low=1)
        return self.compose(_Batched(size, collation_fn, partial))  # type: ignore[no-any-return]

    def __len__(self) -> int:
        parts = self._resumables()
        info = torch.utils.data.get_worker_info()
        workers = info.num_workers if info is not None else self._workers or 1
        slots, consumers, per_unit = parts[0].worker_slots(workers)
        return sum(
            sum(part._epoch_split().own_counts(consumers, per_unit)[slots.start : slots.stop])
            for part in parts
        )

    def _resumables(self) -> list[Any]:
        """The ``ResumableDataset`` s whose samples this dataset yields."""
        return [self]

    def _count_workers(self, workers: int | None) -> None:
        """Record ``prepare(workers=)``'s DataLoader workers for ``len()``."""
        if workers is not None:
            self._workers = whole("workers", workers, low=0)


class _Batched:
    """The ``batched`` stage: a batch yielded as soon as it is full (a picklable object,
    so the dataset goes to spawned DataLoader workers)."""

    def __init__(
        self, size: int, collation_fn: Callable[[list[Any]], Any] | None, partial: bool
    ) -> None:
        self.size, self.collation_fn, self.partial = size, collation_fn, partial

    def __call__(self, samples: Iterator[Any]) -> Iterator[Any]:
        batch: list[Any] = []
        for sample in samples:
            batch.append(sample)
            if len(batch) == self.size:
                yield self._collated(batch)
                batch = []
        if batch and self.partial:
            yield self._collated(batch)

    def _collated(self, batch: list[Any]) -> Any:
        return batch if self.collation_fn is None else self.collation_fn(batch)
