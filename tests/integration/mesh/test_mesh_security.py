"""Another user's process on the node is refused by the mesh: it cannot read the job's key
file, and its requests, unsigned or signed with its own key, get 401 and 403 without a
byte (the server's counts say so, not only the client's)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from urllib.parse import urlencode

from accounts import OUTSIDER, world_tmp
from mesh_holder import BUCKET, JOB

from shardcache._mesh.auth import JobKey, Verifier
from shardcache._mesh.secret import key_file_secret
from shardcache._mesh.server import PATH, MeshServer

REPO = Path(__file__).parents[3]

# A plain socket: http.client resolves the host through the idna codec, which the dropped
# account cannot import from root's interpreter.
CAROL = """
import socket
from shardcache._mesh.auth import HEADER, JobKey
from shardcache._mesh.secret import key_file_secret
seen = []
try:
    key_file_secret(pathlib.Path({key!r}))
    seen.append("read the job's key")
except PermissionError:
    seen.append("key refused")
own = JobKey(key_file_secret(pathlib.Path.home() / "mesh.key"), {job!r})
for signed in ("", HEADER + ": " + own.sign("GET", {target!r}) + "\\r\\n"):
    with socket.socket() as sock:
        sock.settimeout(10)
        sock.connect(("127.0.0.1", {port}))
        sock.sendall(("GET {target} HTTP/1.1\\r\\nHost: peer\\r\\n" + signed + "\\r\\n").encode())
        seen.append(int(sock.recv(64).split()[1]))
print(json.dumps(seen))
"""


def test_another_users_process_is_refused(accounts, holder, tmp_path: Path) -> None:
    key = tmp_path / "home" / ".config" / "shardcache" / "mesh.key"
    verifier = Verifier(JobKey(key_file_secret(key), JOB))
    request = holder.requests[f"s3://{BUCKET}/b.tar"]
    target = f"{PATH}?{urlencode(request.query())}"
    with MeshServer(holder.shards(), verifier, "127.0.0.1") as server, world_tmp() as home:
        code = CAROL.format(key=str(key), job=JOB, target=target, port=server.port)
        ran = accounts[OUTSIDER].run(code, {"PYTHONPATH": str(REPO)}, home)
        assert ran.returncode == 0, ran.stderr
        assert json.loads(ran.stdout) == ["key refused", 401, 403]
        assert server.wait_idle(5)  # a transfer's counts are final once it ends
        counts = server.counts()
    assert (counts.get("401"), counts.get("403"), counts.get("bytes")) == (1, 1, None)
    assert os.stat(key).st_uid == os.geteuid()
