"""Uncontended acquire+release latency: celery-zklock against kazoo's Lock, same server, one run.

Runs the implementations in interleaved blocks so drift on the machine hits
both alike. A release does not wait for its delete, so the honest measure is
the time of a whole acquire+release cycle: the next acquire pays for the
previous delete if the server has not finished it.

Rows besides ours and kazoo's: our lock without its own-node watch (what that
guarantee costs), our lock with every request going through kazoo's
connection thread (what the direct request path saves), and the same messages
as our lock over a bare socket in one thread (the floor under any Python client).

The CPU column is this process's CPU time (all its threads: kazoo's
connection thread too) per cycle. With ``--pin`` the server runs on CPU 1 and
this process on CPU 0, so the server's work never lands in it.

    python -m benchmarks.bench_lock [--rounds 10] [--block 200] [--fsync] [--pin] [--compare DIR]

``--compare DIR`` adds two rows: ``lock()`` in a child process running this checkout's
``celery_zklock``, and in one running the ``celery_zklock`` under ``DIR`` (another checkout,
say ``git archive <commit> celery_zklock | tar -x -C DIR``), each asked for its block in turn
with the rest, so that both children pay the same process and the same drift.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import uuid
from typing import Callable, Dict, List, Tuple

from celery import Celery
from kazoo.client import KazooClient
from kazoo.protocol.serialization import (
    Connect,
    Create2,
    Delete,
    Exists,
    GetChildren,
    ReplyHeader,
    int_struct,
)
from kazoo.security import OPEN_ACL_UNSAFE

import celery_zklock
from celery_zklock.glue.api import settings_of
from celery_zklock.recipes import Lock
from celery_zklock.zk import Session, close_sessions
from harness import ZooKeeperPeer


class RawProtocol:
    """The floor for any Python client: one thread, one socket, kazoo's serializers and nothing
    else (no second thread, no pings, no watch dispatch, no error handling). Not a lock to use."""

    def __init__(self, hosts: str) -> None:
        host, port = hosts.split(",")[0].rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.inbox = b""
        self.xid = 0
        self._send_frames([Connect(0, 0, 10000, 0, b"\0" * 16, False).serialize()])
        self._frame()
        self.delete: object = None

    def _send_frames(self, bodies: List[bytes]) -> None:
        self.sock.sendall(b"".join(int_struct.pack(len(b)) + b for b in bodies))

    def _frame(self) -> bytes:
        while len(self.inbox) < 4 or len(self.inbox) < 4 + int_struct.unpack_from(self.inbox)[0]:
            self.inbox += self.sock.recv(65536)
        n = int_struct.unpack_from(self.inbox)[0]
        frame, self.inbox = self.inbox[4:4 + n], self.inbox[4 + n:]
        return frame

    def send(self, *requests: object) -> None:
        bodies = []
        for r in requests:
            self.xid += 1
            bodies.append(int_struct.pack(self.xid) + int_struct.pack(r.type) + r.serialize())  # type: ignore[attr-defined]
        self._send_frames(bodies)

    def reply(self, request: object) -> object:
        while True:
            frame = self._frame()
            header, offset = ReplyHeader.deserialize(frame, 0)
            if header.xid >= 0:  # not a watch event
                return request.deserialize(frame, offset) if not header.err else None  # type: ignore[attr-defined]

    def lock_cycle(self, parent: str) -> None:
        """The messages of our uncontended lock: create + children (pipelined), exists with a
        watch on our node, and a delete sent with the next create and not waited for."""
        create = Create2(f"{parent}/{uuid.uuid4().hex}__lock__", b"{}", OPEN_ACL_UNSAFE, 3)
        children = GetChildren(parent, None)
        pending = [self.delete] if self.delete is not None else []
        self.send(*pending, create, children)
        for request in pending:
            self.reply(request)
        path: str = self.reply(create)[0]  # type: ignore[index]  # Create2's reply: (path, stat)
        self.reply(children)
        watch = Exists(path, True)
        self.send(watch)
        self.reply(watch)
        self.delete = Delete(path, -1)


class Child:
    """``lock()`` cycles in a child process whose ``celery_zklock`` comes from ``path``: it runs a
    block of cycles each time it is asked, and answers with their times and its CPU per cycle."""

    def __init__(self, path: str, hosts: str) -> None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        # Run from ``path``: ``python -m`` puts its working directory first on sys.path, ahead of
        # PYTHONPATH and of the editable install, so that is where celery_zklock comes from.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([path, root])}
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_lock", "--serve", hosts],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=path)
        self.where = self._ask(0)["where"]

    def _ask(self, cycles: int) -> Dict[str, object]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{cycles}\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())  # type: ignore[no-any-return]

    def block(self, cycles: int) -> Tuple[List[float], float]:
        answer = self._ask(cycles)
        return answer["times"], answer["cpu"]  # type: ignore[return-value]

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


def serve(hosts: str) -> None:
    """The child's side of :class:`Child`: a block of ``lock()`` cycles per line read."""
    app = Celery("bench", set_as_current=False)
    app.conf.zklock_hosts = hosts
    for line in sys.stdin:
        cycles, times = int(line), []
        c0 = time.process_time()
        for _ in range(cycles):
            t0 = time.perf_counter()
            lock = celery_zklock.lock(app, "bench-child")
            lock.acquire()
            lock.release()
            times.append(time.perf_counter() - t0)
        cpu = (time.process_time() - c0) / cycles if cycles else 0.0
        print(json.dumps({"times": times, "cpu": cpu, "where": os.path.dirname(celery_zklock.__file__)}), flush=True)
    close_sessions()


def main() -> None:
    if sys.argv[1:2] == ["--serve"]:
        return serve(sys.argv[2])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--block", type=int, default=200)
    parser.add_argument("--fsync", action="store_true", help="let the server fsync each write (production-like)")
    parser.add_argument("--pin", action="store_true", help="ZooKeeper on CPU 1, this process on CPU 0")
    parser.add_argument("--compare", metavar="DIR", help="add lock() rows from child processes: this checkout's "
                                                          "celery_zklock and DIR's")
    args = parser.parse_args()

    extra = {"forceSync": "yes"} if args.fsync else {}
    if args.pin:
        os.sched_setaffinity(0, {0})
    with ZooKeeperPeer(extra_config=extra, cpus="1" if args.pin else None) as zk:
        app = Celery("bench", set_as_current=False)
        app.conf.zklock_hosts = zk.hosts
        kazoo = KazooClient(hosts=zk.hosts)
        kazoo.start()
        raw = RawProtocol(zk.hosts)
        path = celery_zklock.lock_path(app, "bench")
        reused = kazoo.Lock(path + "-reused")

        def ours() -> None:
            lock = celery_zklock.lock(app, "bench")
            lock.acquire()
            lock.release()

        class Unwatched(Lock):
            # What watching our own node (so a holder learns if someone deletes it) costs.
            def _watch_own_node(self) -> None:
                pass

        session = celery_zklock.lock(app, "bench").session

        def ours_unwatched() -> None:
            lock = Unwatched(session, path + "-unwatched")
            lock.acquire()
            lock.release()

        class KazooPath(Session):
            # The same lock with every request going through kazoo's connection thread.
            def client_class(self, handler: object) -> type:
                return KazooClient

        queued = KazooPath(settings_of(app)).start()

        def ours_queued() -> None:
            lock = Lock(queued, path + "-queued")
            lock.acquire()
            lock.release()

        def kazoo_new() -> None:
            lock = kazoo.Lock(path + "-kazoo")
            lock.acquire()
            lock.release()

        def kazoo_reused() -> None:
            reused.acquire()
            reused.release()

        kazoo.ensure_path(path + "-raw")

        def raw_floor() -> None:
            raw.lock_cycle(path + "-raw")

        cases: Dict[str, Callable[[], None]] = {
            "celery-zklock lock()": ours,
            "  without own-node watch": ours_unwatched,
            "  on kazoo's request path": ours_queued,
            "kazoo Lock, new per use": kazoo_new,
            "kazoo Lock, reused": kazoo_reused,
            "raw protocol, one thread": raw_floor,
        }
        children: Dict[str, Child] = {}
        if args.compare:
            here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            children = {"lock(), this checkout (child)": Child(here, zk.hosts),
                        f"lock(), {args.compare} (child)": Child(os.path.abspath(args.compare), zk.hosts)}
            for name, child in children.items():
                print(f"{name}: celery_zklock from {child.where}")
        samples: Dict[str, List[float]] = {name: [] for name in [*cases, *children]}
        cpu: Dict[str, List[float]] = {name: [] for name in samples}
        for fn in cases.values():  # warm up: connections, paths, JIT of the server
            for _ in range(100):
                fn()
        for child in children.values():
            child.block(100)
        for _ in range(args.rounds):
            for name, fn in cases.items():
                c0 = time.process_time()
                for _ in range(args.block):
                    t0 = time.perf_counter()
                    fn()
                    samples[name].append(time.perf_counter() - t0)
                cpu[name].append((time.process_time() - c0) / args.block)
            for name, child in children.items():
                times, spent = child.block(args.block)
                samples[name] += times
                cpu[name].append(spent)
        for child in children.values():
            child.close()
        kazoo.stop()
        queued.close()
        close_sessions()

    base = statistics.median(samples["kazoo Lock, new per use"])
    base_cpu = statistics.median(cpu["kazoo Lock, new per use"])
    print(f"acquire+release, uncontended, {args.rounds * args.block} cycles each, ZooKeeper 3.8 on loopback, "
          f"forceSync={'yes' if args.fsync else 'no'}, {'pinned to its own CPU' if args.pin else 'sharing the CPUs'}")
    print(f"{'implementation':<28}{'median ms':>10}{'p90 ms':>9}{'vs kazoo new':>14}{'CPU ms':>9}{'vs kazoo new':>14}")
    for name, values in samples.items():
        values.sort()
        med = statistics.median(values)
        p90 = values[int(len(values) * 0.9)]
        spent = statistics.median(cpu[name])
        print(f"{name:<28}{med * 1000:>10.3f}{p90 * 1000:>9.3f}{med / base:>13.2f}x{spent * 1000:>9.3f}"
              f"{spent / base_cpu:>13.2f}x")


if __name__ == "__main__":
    main()
