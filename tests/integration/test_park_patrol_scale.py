"""The periodic look for parked queues nobody watches (``park_worker.orphans``) on a root of many
queues: it reads them all, however many, and adopts an unwatched one wherever it is listed."""

from __future__ import annotations

from celery_zklock.glue import park, park_worker
from celery_zklock.glue.api import layout_of, settings_of
from celery_zklock.zk import session_for

HEAD = b'{"task": "probe.parked", "id": "x", "content_type": "application/json", "content_encoding": "utf-8"}\n{}'


def test_a_look_over_thousands_of_watched_queues_ends_and_finds_the_unwatched_one(app, kazoo):
    # One deadline (zklock_connect_timeout) for a round trip per queue, in turn: past a few
    # thousand queues (~0.5 ms each here, 1 s here) every look timed out before the end, and
    # a queue listed late was never adopted; the watch thread was blocked all that while.
    app.conf.zklock_connect_timeout = 1
    app.conf.broker_url = "memory://"

    @app.task(name="probe.parked")
    def probe() -> None:
        """A task the look finds named in each queue's head."""
    layout = layout_of(app)
    kazoo.ensure_path(layout.parked("k0").rsplit("/", 1)[0])
    total = 3000
    for start in range(0, total, 500):
        tx = kazoo.transaction()
        for i in range(start, start + 500):
            path = layout.parked(f"k{i}")
            tx.create(path, b"")
            tx.create(f"{path}/p-0123456789abcdef-0000000000", HEAD)
            if i != total - 1:
                tx.create(f"{path}/w-someone-0000000001", b"")  # a live watcher elsewhere
        assert not any(isinstance(r, Exception) for r in tx.commit())
    session = session_for(settings_of(app))
    park_worker.orphans(app, session)  # raised KazooTimeoutError
    watched = park._watch(session, settings_of(app), app).watched()
    assert layout.parked(f"k{total - 1}") in watched, "the unwatched queue is adopted"
    assert len(watched) == 1, "only it"
