"""A test's own process-wide state: shardcache keeps some state per process on purpose
(the loader metrics a rank reports, the request-rate throttle every cache of the process
shares), so without this one test's counts, sinks or slowed-down rate would reach the next."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from shardcache._base.process_local import fresh_state


@contextlib.contextmanager
def fresh_process_state() -> Iterator[None]:
    """Within the block, this process's shardcache state starts as in a new process: no
    metrics counted, no sinks, no mixture sources named, no metrics target set in code, no
    DataLoader worker totals spooled before it, no request-rate throttle slowed down. After
    it, the state from before is back. Use it around one test (an autouse fixture), not
    while another thread uses shardcache::

        @pytest.fixture(autouse=True)
        def _own_shardcache_state():
            with shardcache.testing.fresh_process_state():
                yield
    """
    with fresh_state():
        yield
