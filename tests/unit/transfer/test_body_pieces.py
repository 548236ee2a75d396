"""How a GET body is handed from the event loop to the download thread (``read_body``):
small pieces first, so a reader following the download sees its first samples early,
then pieces of up to 1 MiB, so a fast body costs few hand-overs, and never more, so the
buffers are reused."""

from __future__ import annotations

from fsspec.asyn import get_loop

from shardcache._transfer.download import read_body

KiB = 1024


class TrickleBody:
    """A response body whose every read returns at most ``step`` bytes at once, as a body
    arriving over a slow link does."""

    def __init__(self, size: int, step: int) -> None:
        self.left = size
        self.step = step
        self.closed = False

    async def read(self, n: int) -> bytes:
        count = min(n, self.step, self.left)
        self.left -= count
        return b"x" * count

    def close(self) -> None:
        self.closed = True


class LoopOnly:
    """What ``read_body`` needs of a file system: fsspec's event loop."""

    loop = get_loop()


def test_first_pieces_are_small_then_grow_to_a_mebibyte() -> None:
    body = TrickleBody(3 * 1024 * KiB, step=16 * KiB)
    sizes = [len(piece) // KiB for piece in read_body(LoopOnly(), body, 8 * 1024 * KiB)]
    assert sizes == [64, 64, 64, 64, 128, 256, 512, 1024, 896]
    assert body.closed


def test_no_piece_exceeds_the_piece_size_asked_for() -> None:
    body = TrickleBody(1024 * KiB, step=16 * KiB)
    sizes = [len(piece) // KiB for piece in read_body(LoopOnly(), body, 48 * KiB)]
    assert sizes == [48] * 21 + [16]


class FastBody(TrickleBody):
    """A body that has everything buffered: each read returns all it asks for."""

    def __init__(self, size: int) -> None:
        super().__init__(size, step=size)
        self.asked: list[int] = []

    async def read(self, n: int) -> bytes:
        self.asked.append(n)
        return await super().read(n)


def test_a_fast_body_is_read_and_handed_over_a_mebibyte_at_most_at_a_time() -> None:
    body = FastBody(20 * 1024 * KiB)
    sizes = [len(piece) // KiB for piece in read_body(LoopOnly(), body, 8 * 1024 * KiB)]
    assert sizes == [1024] * 20
    assert max(body.asked) == 1024 * KiB
