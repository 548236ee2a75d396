"""Who a process is, and whether a process recorded earlier is provably alive or dead.

A pid alone proves nothing: pids are reused, and the same pid on another host, after a
reboot, or in another pid namespace is a different process. A record therefore carries
host, boot id, pid namespace, pid and the process start time (in clock ticks since boot).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=1)
def hostname() -> str:
    return socket.gethostname()


@lru_cache(maxsize=1)
def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (start time since boot), or None if no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return -1
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = stat[stat.rfind(")") + 2 :].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return -1


def exited(pid: int) -> bool:
    """Whether ``pid`` has exited but is not reaped yet (a zombie: it runs no more; a parent
    that died leaves its children so where no init process reaps them, as in containers)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2 :][:1] in ("Z", "X")


_CURRENT: dict[int, ProcessIdentity] = {}  # ProcessIdentity.current(), by pid


def proc_state(pid: int) -> str:
    """A one-line summary of a local process for diagnostics: state, wait channel, command."""
    parts = []
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("State:", "Name:")):
                parts.append(" ".join(line.split()))
        wchan = Path(f"/proc/{pid}/wchan").read_text().strip()
        if wchan and wchan != "0":
            parts.append(f"wchan: {wchan}")
    except OSError as exc:
        parts.append(f"/proc/{pid} unreadable ({exc.strerror or exc})")
    return ", ".join(parts)


@lru_cache(maxsize=1)
def _boot_time() -> float | None:
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def start_time(ticks: int) -> float | None:
    """Wall-clock start time of a process from its start ticks (None if unknown)."""
    boot = _boot_time()
    if ticks < 0 or boot is None:
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ProcessIdentity:
    """Enough to decide later, from any process on any host, whether this one still runs."""

    host: str
    boot_id: str
    pidns: str
    pid: int
    start_ticks: int | None

    @classmethod
    def current(cls) -> ProcessIdentity:
        """This process (read from /proc once per process: a forked child reads its own)."""
        pid = os.getpid()
        me = _CURRENT.get(pid)
        if me is None:
            me = cls(hostname(), boot_id(), pid_namespace(), pid, start_ticks(pid))
            _CURRENT.clear()  # a forked child's parent
            _CURRENT[pid] = me
        return me

    def liveness(self) -> tuple[str, str]:
        """("alive" | "dead" | "unknown", why) as judged from the calling process."""
        if self.host != hostname():
            return "unknown", f"holder runs on another host ({self.host}); judged by lease age"
        if self.boot_id and boot_id() and self.boot_id != boot_id():
            return "dead", "this host has rebooted since the holder started"
        if self.pidns and pid_namespace() and self.pidns != pid_namespace():
            return "unknown", "holder is in another pid namespace (container)"
        ticks = start_ticks(self.pid)
        if ticks is None:
            return "dead", f"pid {self.pid} no longer exists on {self.host}"
        if self.start_ticks not in (None, -1) and ticks not in (-1, self.start_ticks):
            return "dead", f"pid {self.pid} was reused by another process"
        return "alive", f"pid {self.pid} is running on this host ({proc_state(self.pid)})"
