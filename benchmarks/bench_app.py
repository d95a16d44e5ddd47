"""Tasks for bench_tasks.py: the same trivial body, unlocked, locked, and with kazoo's Lock inside."""

import logging
import os
import time

import redis
from celery import Celery
from celery.signals import after_setup_logger
from kazoo.client import KazooClient
from kazoo.handlers.threading import SequentialThreadingHandler

from celery_zklock import zk_locked
from celery_zklock.zk import green

app = Celery("bench_app")
app.conf.update(
    broker_url=os.environ.get("BENCH_BROKER", "memory://"),
    zklock_hosts=os.environ.get("BENCH_ZK", "127.0.0.1:1"),
    zklock_root="/bench",
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
)
_clients: dict = {}


@after_setup_logger.connect
def _quiet(**kwargs):
    # A log line per task would cost more than the lock; keep the worker's "ready." line.
    for name in ("celery.app.trace", "celery.worker.strategy"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _client(kind: str):
    pid_kind = (os.getpid(), kind)  # one per process, made after fork
    if pid_kind not in _clients:
        if kind == "redis":
            _clients[pid_kind] = redis.Redis.from_url(app.conf.broker_url)
        else:
            zk = KazooClient(hosts=app.conf.zklock_hosts, handler=green.handler(SequentialThreadingHandler))
            zk.start()
            _clients[pid_kind] = zk
    return _clients[pid_kind]


def done(counter: str, pause: float) -> None:
    if pause:
        time.sleep(pause)  # under -P gevent, a gevent.sleep: the I/O a green fleet waits on
    _client("redis").incr(counter)


@app.task
def unlocked(i, counter, pause=0.0):
    done(counter, pause)


@app.task
@zk_locked(key="distinct:{counter}:{i}")  # each run's keys are new, as kazoo's paths below
def locked_distinct(i, counter, pause=0.0):
    done(counter, pause)


@app.task
@zk_locked(key="hot:{hot}")
def locked_hot(i, hot, counter, pause=0.0):
    done(counter, pause)


@app.task
def kazoo_lock_in_body(i, counter, pause=0.0):
    with _client("kazoo").Lock(f"/bench/kazoo/{counter}/{i}"):
        done(counter, pause)
