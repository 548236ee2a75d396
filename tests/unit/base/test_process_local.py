"""Process-wide state (``_base.process_local``): one value per process, carried into forked
children by its owner's rule, and a block of code with its own (``fresh_process_state``)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import threading
import time

from shardcache._base.process_local import ProcessLocal
from shardcache._observe import metrics, spool
from shardcache._retry import throttle
from shardcache.testing import fresh_process_state

WAIT = 20.0  # bound of every wait here
FORK = mp.get_context("fork")


def _in_child(target, *args) -> object:
    """``target(*args)`` in a forked child; its result through a pipe (bounded wait)."""
    ours, theirs = FORK.Pipe(duplex=False)

    def run() -> None:
        theirs.send(target(*args))

    child = FORK.Process(target=run)
    child.start()
    try:
        assert ours.poll(WAIT), "the child did not answer"
        return ours.recv()
    finally:
        child.join(WAIT)
        if child.is_alive():
            child.kill()


def test_one_value_per_process_made_on_first_use() -> None:
    made = []
    holder = ProcessLocal(lambda: made.append(1) or object())
    assert holder.peek() is None and not made
    value = holder.get()
    assert holder.get() is value and holder.peek() is value and made == [1]


def test_a_forked_child_gets_its_owners_rule_or_a_new_value() -> None:
    carried = ProcessLocal(lambda: ["parent"], after_fork=lambda v: [*v, "child"])
    anew = ProcessLocal(lambda: [os.getpid()])
    carried.get(), anew.get()
    pid = os.getpid()
    assert _in_child(carried.get) == ["parent", "child"]
    child_value = _in_child(anew.get)
    assert child_value != [pid] and len(child_value) == 1
    assert carried.get() == ["parent"] and anew.get() == [pid]  # the parent's are untouched


def test_a_child_forked_while_a_thread_makes_the_value_does_not_wait_for_it() -> None:
    """The parent's lock is held (its factory blocks in another thread) at the fork: the
    child makes its own value with a new lock instead of waiting forever."""
    entered, finish = threading.Event(), threading.Event()

    def slow_factory() -> str:
        if os.getpid() == parent:
            entered.set()
            assert finish.wait(WAIT)
        return f"made in {os.getpid()}"

    parent = os.getpid()
    holder = ProcessLocal(slow_factory)
    maker = threading.Thread(target=holder.get)
    maker.start()
    try:
        assert entered.wait(WAIT)
        got = _in_child(holder.get)
        assert got != f"made in {parent}" and str(got).startswith("made in ")
    finally:
        finish.set()
        maker.join(WAIT)
    assert holder.get() == f"made in {parent}"


def test_a_fresh_block_has_its_own_values_and_gives_the_old_ones_back() -> None:
    plain = ProcessLocal(object)
    restarted = ProcessLocal(lambda: "first", restart=lambda: "restarted")
    before, restarted_before = plain.get(), restarted.get()
    with fresh_process_state():
        assert plain.peek() is None and plain.get() is not before
        assert restarted.peek() == "restarted"
    assert plain.get() is before and restarted.get() == restarted_before


def test_a_fresh_block_counts_no_metrics_sinks_or_spooled_totals_of_before() -> None:
    metrics.count(hits=5)
    worker_total = metrics.end_epoch()  # an epoch's total, as a DataLoader worker spools it
    metrics.count(hits=3)
    before: list[dict] = []
    remove = metrics.add_metrics_sink(before.append)
    # That total spooled for this process before the block.
    directory = spool.spool_root() / str(os.getpid())
    directory.mkdir(parents=True, exist_ok=True)
    spooled = directory / f"{os.getpid() + 1}-e0-{time.monotonic_ns()}.json"
    spooled.write_text(json.dumps(worker_total))
    # Written after this process started (so its own start does not rule it out), before
    # the block.
    earlier = time.time() - 0.5
    os.utime(spooled, (earlier, earlier))
    try:
        with fresh_process_state():
            inside: list[dict] = []
            metrics.add_metrics_sink(inside.append)
            metrics.count(hits=1)
            assert metrics.end_epoch()["hits"] == 1  # neither the 3 of before nor the 5 spooled
            assert [r["kind"] for r in inside] == ["epoch"] and before == []
        assert metrics.end_epoch()["hits"] == 3 and [r["kind"] for r in before] == ["epoch"]
    finally:
        remove()


def test_a_fresh_block_is_not_slowed_down_by_a_throttle_of_before() -> None:
    slowed = throttle.process_throttle(None)
    with fresh_process_state():
        assert throttle.process_throttle(None) is not slowed
    assert throttle.process_throttle(None) is slowed
