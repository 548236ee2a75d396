"""What the servers run as child processes share (shardcache.testing._child_server): a start
that fails, for a missing program or one that will not serve, says why and leaves nothing
behind."""

from __future__ import annotations

import shutil

import pytest

from shardcache import MissingExtraError
from shardcache.testing import AzuriteServer, GcsEmulator, RcloneS3Server, SeaweedS3Server
from shardcache.testing._child_server import ChildS3Server, ChildServer

SERVERS = [GcsEmulator, AzuriteServer, RcloneS3Server, SeaweedS3Server]


def _left(server: ChildServer) -> list[str]:
    """What of the server's own directories still exists."""
    paths = [server.state] + ([server.root] if isinstance(server, ChildS3Server) else [])
    return [str(path) for path in paths if path.exists()]


@pytest.mark.parametrize("kind", SERVERS, ids=lambda kind: kind.__name__)
def test_a_missing_program_is_a_missing_extra_error_and_leaves_nothing(
    kind: type[ChildServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kind, "program", lambda self: None)
    server = kind()
    with pytest.raises(MissingExtraError, match=f"needs {kind.program_name}.*install"):
        server.start()
    assert _left(server) == []


@pytest.mark.parametrize("kind", SERVERS, ids=lambda kind: kind.__name__)
def test_a_program_that_exits_is_retried_then_reported_and_leaves_nothing(
    kind: type[ChildServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    false = shutil.which("false")
    assert false is not None
    monkeypatch.setattr(kind, "program", lambda self: false)
    server = kind()
    with pytest.raises(RuntimeError, match=f"{kind.program_name} did not start: exited with 1"):
        server.start()
    assert _left(server) == []
    with pytest.raises(RuntimeError, match="not running"):
        server.pid  # noqa: B018 (the property raises)
