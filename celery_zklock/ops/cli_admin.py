"""The ``celery zklock`` commands that check the setup, change the tree or serve: ``check``,
``clear-queued``, ``evict`` and ``exporter`` (registered on the group in :mod:`.cli`, with the
connection helpers every command shares)."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any, Dict, List, NoReturn, Optional

import click
from kazoo.exceptions import BadVersionError, NoNodeError

from ..conf import Settings, describe, did_you_mean
from ..exceptions import ConfigurationError, ZkLockError
from ..glue.api import layout_of, metrics_of, settings_of, task_defaults
from ..glue.options import problems, reports_itself
from ..recipes.lock import EVICTED_BY
from ..zk import Session, check_acl
from ..zk.background import RUNNER
from ..zk.probe import addresses, four_letter_word, server_limits
from . import evict as eviction
from . import exporter, render
from .tree import queued, server_info


# -- what every command shares ----------------------------------------------------------------
def _connect(ctx: click.Context) -> tuple[Settings, Session, Any]:
    app = ctx.obj.app
    try:
        settings = settings_of(app)
        return settings, Session(settings).start(), app
    except ZkLockError as exc:
        _refused(exc)


def _refused(exc: ZkLockError) -> NoReturn:
    """Exit 1 with each of ``exc``'s problems on an ``Error:`` line of its own: settings are checked
    all at once, and a second problem printed bare under the first reads as part of it."""
    for problem in exc.problems if isinstance(exc, ConfigurationError) else (str(exc),):
        click.echo(f"Error: {problem}", err=True)
    raise SystemExit(1)


@click.command(name="clear-queued")
@click.option("--task", "task_name", required=True, help="The task whose markers to clear (its registered name).")
@click.option("--key", default=None, help="Only this key's marker (the key as the task renders it, like 'user:42').")
@click.pass_context
def clear_queued(ctx: click.Context, task_name: str, key: Optional[str]) -> None:
    """Delete stale dedupe markers: after `celery purge`, or when a copy's message is known lost.

    A marker whose copy is running (its worker's session holds it) is left alone: it goes
    when the copy ends. Each delete is version-checked, so a marker a publisher took over
    meanwhile stays.
    """
    settings, session, app = _connect(ctx)
    try:
        layout = layout_of(app)
        path = layout.queued(task_name, key) if key is not None else None
        every = queued(session, settings.root)
        # --key is the key as the task renders it, or (under hashed names) the marker's name,
        # as `queued` lists it.
        rows = [r for r in every if r["task"] == task_name
                and (key is None or r["path"] == path or r["path"].rsplit("/", 1)[1] == key)]
        if task_name not in app.tasks and not any(r["task"] == task_name for r in every):
            # A task the app no longer has may still have markers: refused only with none.
            raise click.UsageError(f"--task {task_name!r}: no such task in this app and no marker of it"
                                   f"{did_you_mean(task_name, app.tasks)}")
        cleared, running = 0, 0
        for r in rows:
            if r["running"]:
                running += 1
                continue
            try:
                session.client.delete(r["path"], version=r["version"])
                cleared += 1
            except (NoNodeError, BadVersionError):
                pass  # released or taken over since we read it: not stale
    finally:
        session.close()
    click.echo(f"cleared {cleared} marker(s) of {task_name}" + (f" with key {key!r}" if key is not None else "")
               + (f"; {running} left: their copies are running" if running else ""))


# -- evict: the one command that takes a lock away (its steps: .evict) --------------------
@click.command()
@click.argument("key", required=False)
@click.option("--node", default=None, metavar="PATH",
              help="A holder's node by its full path (a key's path and its holders' nodes are in `locks --json`): "
                   "the way to pick one of a read lock's or a semaphore's holders.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option("--revoke", is_flag=True,
              help="Also revoke the holder's task, with terminate, before it is asked to go. Terminate stops the "
                   "body under prefork (its pool process is killed), gevent and eventlet (its greenlet); the threads "
                   "and solo pools cannot terminate (nor gevent before Celery 5.5), and there the lost lock's "
                   "interrupt is what stops the body.")
@click.option("--wait", "wait", type=click.FloatRange(min=0, min_open=True), default=30.0, show_default=True,
              metavar="SECONDS",
              help="How long the holder has to let go once asked; after it, evict deletes its node itself.")
@click.pass_context
def evict(ctx: click.Context, key: Optional[str], node: Optional[str], yes: bool, revoke: bool, wait: float) -> None:
    """Take a lock from its holder: ask it to let go, and delete its node if it does not.

    KEY is the key as the task renders it, like 'invoice:42' (under hashed key names its name
    is computed with the app's secret); its lock and its semaphore are both looked in. The
    holder is shown (worker, process, task, task id, held for, fencing token, node) and the
    question asked, unless --yes. Then an eviction request is written into the holder's node:
    the holder learns it through its node's watch, counts the lock as lost, its body stops as
    its on_lock_lost says, and its node goes as the task releases the lock, so the body is
    interrupted before the next contender holds. A holder that has not let go within --wait
    seconds (a body that ignores the interrupt, a hung or paused process, a holder cut off
    from ZooKeeper) has its node deleted: its body may still be running then, and the next
    holder's greater fencing token is what protects the stores that check it.

    Exit status: 0 when evicted (or when the holder let go while you were asked); 1 when
    refused, answered no, or nothing holds it; 2 for a wrong use of KEY, --node or --wait.
    """
    if (key is None) == (node is None):
        raise click.UsageError("give KEY or --node PATH, not both" if key is not None else "give KEY or --node PATH")
    _, session, app = _connect(ctx)
    try:
        layout = layout_of(app)
        holder = eviction.to_evict(session, layout, key, node)
        for line in render.holder_lines(holder):
            click.echo(line)
        # Another client's holder (a Java service's, by Curator) reads no request and is never
        # told its node went: asking would only write over its data and wait out --wait.
        foreign = render.foreign_holder(holder)
        task_id = holder["task_id"] if revoke and isinstance(holder["task_id"], str) and holder["task_id"] else None
        if revoke and task_id is None:
            click.echo("--revoke: a foreign holder names no task: nothing will be revoked" if foreign else
                       "--revoke: its node names no task id (a lock taken outside a task): nothing will be revoked")
        if not yes:
            click.confirm("Take the lock from it (delete its node: a foreign holder cannot be asked to let go)?"
                          if foreign else
                          "Take the lock from it (ask it to let go, and delete its node if it has not within "
                          f"{wait:g}s)" + (" and revoke its task" if task_id else "") + "?", abort=True)
        if foreign:
            if not eviction.delete(session, holder):
                click.echo(f"{holder['path']} is gone already: its holder let go; nothing deleted")
                return
            click.echo(f"evicted: deleted {holder['path']}: a foreign holder cannot be asked to let go, and is never "
                       "told (a Curator lock goes on as if it held); the fencing token is what protects the stores "
                       "that check it")
            click.echo(f"  any later holder's fencing token is greater than {holder['token']}")
            return
        if task_id is not None:
            # Before the request: a prefork worker kills the body's process as it answers, and
            # a revoke that cannot be sent leaves the lock as it was.
            for line in eviction.revoke(app, task_id):
                click.echo(line)
        # Ask, not delete: the delete is what hands the lock on, so a holder that deletes its
        # own node once its body has stopped orders the interrupt before the next start.
        version = eviction.ask(session, holder)
        if version is None:
            click.echo(f"{holder['path']} is gone already: its holder let go before it was asked; nothing deleted")
            return
        click.echo(f"asked the holder to let go ({EVICTED_BY} written into its node); waiting up to {wait:g}s")
        started = time.monotonic()
        if version == eviction.ASKED_THEN_GONE or eviction.gone_within(session, holder["path"], wait):
            took = time.monotonic() - started
            if eviction.session_alive(session, layout, holder["owner"]):
                click.echo(f"evicted: its holder let go of {holder['path']} after {took:.1f}s: it counted the lock as "
                           'lost ("deleted"), its body stopped as its on_lock_lost says (the default, "interrupt", '
                           "raises LockLost in it), and only then did its node go")
            else:
                # A node that goes with its session says nothing of the body: a holder cut
                # off, or paused past its session timeout, has not even seen the request.
                click.echo(f"evicted: {holder['path']} went with its holder's ZooKeeper session after {took:.1f}s "
                           "(the session ended: the holder was cut off, paused, killed or stopped), not because it "
                           "let go")
                click.echo("  its body may still be running, until its own clock counts the lock as lost; the "
                           "fencing token is what protects the stores that check it")
        else:
            deleted = eviction.delete(session, {**holder, "version": version})
            if not deleted:
                click.echo(f"evicted: its holder let go of {holder['path']} just as the {wait:g}s wait ended")
            else:
                click.echo(f"evicted: deleted {holder['path']}: its holder did not let go within {wait:g}s")
                click.echo("  its body may still be running (it ignores the interrupt or never saw it, or its process "
                           "is hung, paused or cut off from ZooKeeper); the fencing token is what protects the "
                           "stores that check it")
        click.echo(f"  any later holder's fencing token is greater than {holder['token']}")
    finally:
        session.close()


@click.command(name="exporter")
@click.option("--port", type=click.IntRange(1, 65535), required=True, help="The port to serve /metrics on.")
@click.option("--address", default=None,
              help="The address to serve on (default: zklock_metrics_address, itself 127.0.0.1 by default).")
@click.option("--interval", type=click.FloatRange(min=0, min_open=True), default=15.0, show_default=True,
              help="Read the tree at most once per this many seconds; a scrape sooner gets the last read.")
@click.option("--max-reads", type=click.IntRange(min=7), default=1000, show_default=True,
              help="At most this many ZooKeeper requests per read of the tree; past it the values are partial.")
@click.option("--per-key", is_flag=True,
              help="Also a series per key (refused under hashed key names): a label per key, unbounded in number.")
@click.pass_context
def exporter_command(ctx: click.Context, port: int, address: Optional[str], interval: float, max_reads: int,
                     per_key: bool) -> None:
    """Serve ZooKeeper's state as Prometheus gauges: holders, waiters, oldest ages, parked
    copies, dedupe markers, rate slots and counts stored live, the beat election. One per app;
    it only reads."""
    app = ctx.obj.app
    layout = layout_of(app)
    if per_key and layout.secret is not None:
        raise click.UsageError("--per-key is refused under zklock_key_names='hashed': a key's label would carry "
                               "what the hashed names hide (and keys are unbounded in number)")
    try:
        import prometheus_client  # noqa: F401 - the extra is there
        address = metrics_of(app).address if address is None else address
    except ImportError:
        raise click.ClickException("the exporter needs prometheus_client: pip install 'celery-zklock[metrics]'") \
            from None
    except ZkLockError as exc:
        _refused(exc)
    try:
        settings = settings_of(app)
        # A parked queue stalled past its workers' resend bound gets a series of its own.
        stalled_after = task_defaults(app).park_resend_after
    except ZkLockError as exc:
        _refused(exc)
    session = Session(settings)
    try:
        server = exporter.serve(exporter.Exporter(session, layout, interval, max_reads, per_key, stalled_after),
                                address, port)
    except OSError as exc:
        raise click.ClickException(f"cannot serve on {address}:{port} ({exc.strerror or exc}): check --address "
                                   "and --port") from None
    click.echo(f"celery-zklock: exporter at http://{address}:{port}/metrics, reading {settings.root} at most "
               f"every {interval:g}s in at most {max_reads} requests")
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    # Served from now on; up 0 until ZooKeeper is reached.
    RUNNER.spawn("celery-zklock-exporter", exporter.connect_until, session, stopping)
    try:
        stopping.wait()
    except KeyboardInterrupt:
        stopping.set()
    server.shutdown()
    server.server_close()
    session.close()


@click.command()
@click.pass_context
def check(ctx: click.Context) -> None:
    """Validate the settings and the tasks' lock options, ask the servers, connect; exit 1 on any problem."""
    app = ctx.obj.app
    reports_itself(app)  # each problem once, as an Error line below, not logged again as the app finalizes
    failures = problems(app)  # every wrong setting, each named, and every wrong task option
    try:
        settings = settings_of(app)
    except ZkLockError:
        _check_failed(failures, app.conf)  # problems() named each wrong setting
    limits: Dict[str, Optional[int]] = {}
    ticks: List[float] = []  # each server's tickTime, in seconds
    if not settings.use_ssl:  # four-letter words are not served on ZooKeeper's TLS port
        for host, port in addresses(settings.hosts):
            try:
                four_letter_word(host, port, "srvr")
                conf = server_limits(four_letter_word(host, port, "conf"))
            except ZkLockError as exc:
                failures.append(f"zklock_hosts: {exc}")
                continue
            limits = limits or conf
            if conf["tickTime"]:
                ticks.append(conf["tickTime"] / 1000)
    tick = settings.server_tick_time
    if ticks and tick is not None and tick < max(ticks):
        failures.append(f"zklock_server_tick_time={tick:g} is less than the servers' tickTime ({max(ticks):g}s): a "
                        "lock would count as held after the server could have expired its session; set "
                        f"zklock_server_tick_time={max(ticks):g}")
    if failures:
        _check_failed(failures, app.conf)  # before connecting: kazoo would retry for zklock_connect_timeout
    try:
        session = Session(settings).start()
    except ZkLockError as exc:
        _check_failed([str(exc)], app.conf)
    try:
        server = server_info(session)
        granted = session.clock.negotiated_timeout
        root = session.client.exists(settings.root)
        if root is not None and settings.acl != "open":
            check_acl(settings.root, session.client.get_acls(settings.root)[0], settings.acl)
    except ZkLockError as exc:
        failures.append(str(exc))
    finally:
        session.close()
    most = limits.get("maxSessionTimeout")
    if granted is None and most is not None and settings.session_timeout * 1000 > most:
        granted = most / 1000  # not reported by this kazoo: the servers' bound says what it will be
    if granted is not None and granted != settings.session_timeout:
        bounds = ", ".join(f"{k}={v} ms" for k, v in limits.items() if v is not None and k != "tickTime")
        failures.append(
            f"zklock_session_timeout={settings.session_timeout:g}s but the server grants {granted:g}s"
            + (f" (its {bounds})" if bounds else "") + ": locks would count as lost on the server's clock, "
            f"not yours; set zklock_session_timeout={granted:g} or change the server's limits")
    if failures:
        _check_failed(failures, app.conf)
    click.echo(f"settings ok: zklock_hosts={settings.hosts} zklock_root={settings.root} "
               f"zklock_session_timeout={settings.session_timeout:g}s (granted as asked) "
               f"zklock_server_tick_time={'unset' if tick is None else f'{tick:g}s'} zklock_acl={settings.acl} "
               f"tls={'on' if settings.use_ssl else 'off'} "
               f"auth={'digest user ' + settings.auth[0] if settings.auth else 'none'}")
    click.echo(f"connected to {server['server'] or '?'}: ZooKeeper {server['version'] or '? (srvr not whitelisted)'}, "
               f"mode {server['mode'] or '?'}, round trip {server['rtt_ms']:.2f} ms (median of 5)")
    click.echo(f"{settings.root}: {'exists' if root is not None else 'not created yet (the first lock creates it)'}")
    if tick is None and ticks:
        click.echo(f"note: zklock_server_tick_time is unset, so the lost-lock clock assumes a tick of half the "
                   f"session timeout ({settings.session_timeout / 2:g}s); the servers tick every {max(ticks):g}s: "
                   f"set zklock_server_tick_time={max(ticks):g} and a lock counts as lost later, as safely")


def _check_failed(failures: List[str], conf: Any) -> NoReturn:
    for failure in failures:
        click.echo(f"Error: {failure}", err=True)
    click.echo("settings used:", err=True)
    for line in describe(conf):
        click.echo(f"  {line}", err=True)
    raise SystemExit(1)
