"""Whose metrics files are whose: the process that made each worker's or beat's multiprocess
directory (:func:`owner`), whether it is gone (:func:`gone`, across pid reuse and pid
namespaces), the removal of directories their owners left (:func:`reap`), and the collector
that drops an exited pool process's live gauges. See :mod:`.metrics`."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import socket
from typing import Any, Dict, List, Optional

#: The name of each directory a worker or beat makes (in the temporary directory), and so of those it reaps.
PREFIX = "celery-zklock-metrics-"


#: In each such directory: the process that made it (see :func:`owner`).
OWNER = "owner.json"


class _Collector:
    """prometheus_client's MultiProcessCollector, after forgetting the live gauges of processes
    that died without a word (a SIGKILLed pool process)."""

    def __init__(self, path: str) -> None:
        from prometheus_client import multiprocess

        self.path = path
        self._inner = multiprocess.MultiProcessCollector(None, path)

    def collect(self) -> Any:
        from prometheus_client import multiprocess

        for name in glob.glob(os.path.join(self.path, "gauge_live*_*.db")):
            found = re.search(r"_(\d+)\.db$", name)
            if found and not _alive(int(found.group(1))):
                multiprocess.mark_process_dead(int(found.group(1)), self.path)
        return self._inner.collect()


def reap(directory: str) -> List[str]:
    """Remove the metrics directories in ``directory`` whose owner is gone, and return their paths.

    A worker SIGKILLed (or a machine that crashed and kept its /tmp) cannot remove its own,
    of about 17 files of 64 kB each. Only a directory named with :data:`PREFIX`, owned by
    this user, whose :data:`OWNER` record says it was made on this host and in this pid
    namespace by a process that no longer runs (:func:`gone`), is removed. One without a
    record is left alone: it is being made, or a version before records made it.

    Example::

        reap(tempfile.gettempdir())   # ['/tmp/celery-zklock-metrics-x1y2z3'], a SIGKILLed worker's
    """
    removed: List[str] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        try:
            if (not entry.name.startswith(PREFIX) or not entry.is_dir(follow_symlinks=False)
                    or entry.stat(follow_symlinks=False).st_uid != os.getuid()):
                continue
            with open(os.path.join(entry.path, OWNER), encoding="utf-8") as f:
                record = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and gone(record):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


def owner(pid: int) -> Dict[str, Any]:
    """What :data:`OWNER` records of the process ``pid`` (this one): enough to tell later that it is gone.

    >>> sorted(owner(os.getpid()))
    ['host', 'pid', 'pidns', 'process']
    """
    return {"pid": pid, "process": _process(pid), "host": socket.gethostname(), "pidns": _pid_namespace()}


def gone(record: Dict[str, Any]) -> bool:
    """Whether the process an :data:`OWNER` record names has ended (False when that cannot be told).

    Its pid may have been given to another process since: the process's start time (and the
    machine's boot) tells them apart. A pid of another host or pid namespace (a /tmp shared
    between containers) says nothing about ours, so such a record is never gone.

    >>> gone(owner(os.getpid()))
    False
    """
    pid = record.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    if record.get("host") != socket.gethostname() or record.get("pidns") != _pid_namespace():
        return False
    now = _process(pid)
    if now is None:
        return True
    then = record.get("process")
    return bool(then) and bool(now) and then != now


def _process(pid: int) -> Optional[str]:
    """What tells the process running as ``pid`` from a later one given that pid; None if none runs.

    On Linux the machine's boot id and the process's start time (in clock ticks since boot);
    elsewhere "" while the pid is in use. A zombie (killed, not yet waited for) runs no more.
    """
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            stat = f.read()
    except FileNotFoundError:
        if os.path.exists("/proc/self/stat"):
            return None  # procfs is there, this pid is not
        return "" if _alive(pid) else None
    except OSError:
        return "" if _alive(pid) else None
    # The command's name, in parentheses, may hold spaces and parentheses: fields are counted after it.
    fields = stat[stat.rfind(")") + 2:].split()
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="utf-8") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{boot}:{fields[19]}"  # field 22 of proc(5), starttime


def _pid_namespace() -> Optional[str]:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs: not gone, and not a zombie (a dead child its parent has not reaped
    yet, as a worker leaves its SIGKILLed embedded beat, answers signal 0 as if it lived)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True  # no /proc (not Linux): signal 0 is all there is
