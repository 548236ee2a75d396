"""A failed peer is put aside for a growing, bounded time; a success takes it back; a forked
child keeps its parent's verdicts."""

from __future__ import annotations

import os

from shardcache._mesh.peers import PeerHealth, health
from shardcache.testing import fresh_process_state


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_failed_peer_is_put_aside_for_longer_each_time_up_to_the_bound() -> None:
    clock = Clock()
    table = PeerHealth(first=30, longest=100, clock=clock)
    assert table.usable("10.0.0.2:4000")
    pauses = []
    for _ in range(4):
        pauses.append(table.failed("10.0.0.2:4000", "refused"))
        assert not table.usable("10.0.0.2:4000") and table.usable("10.0.0.3:4000")
        clock.now += pauses[-1] - 0.001
        assert not table.usable("10.0.0.2:4000")
        clock.now += 0.001
        assert table.usable("10.0.0.2:4000")
    assert pauses == [30, 60, 100, 100]


def test_a_success_takes_the_peer_back_and_starts_the_count_again() -> None:
    clock = Clock()
    table = PeerHealth(first=30, longest=300, clock=clock)
    table.failed("p:1", "timeout")
    table.failed("p:1", "timeout")
    table.succeeded("p:1")
    assert table.usable("p:1")
    assert table.failed("p:1", "timeout") == 30


def test_a_forked_child_keeps_the_parents_verdicts() -> None:
    with fresh_process_state():
        health().failed("10.0.0.9:4000", "reset")
        pid = os.fork()
        if pid == 0:  # the child: exits 0 only if the peer is still put aside there
            os._exit(0 if not health().usable("10.0.0.9:4000") else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
