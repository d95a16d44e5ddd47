"""``celery -A proj zklock``: see who holds which lock and who leads beat, check the setup, and evict a holder.

Registered through the ``celery.commands`` entry point::

    celery -A proj zklock check              # settings, connection, server version and mode, round trip
    celery -A proj zklock status             # beat election, held locks, the server we asked
    celery -A proj zklock locks --key 'invoice:*' --json
    celery -A proj zklock queued             # dedupe markers: key, task id, age, expiry
    celery -A proj zklock schedule           # beat entries: runs, last run, next run
    celery -A proj zklock exporter --port N  # ZooKeeper's state as Prometheus gauges
    celery -A proj zklock evict 'invoice:42' # take a lock from its holder, after showing it and asking

It uses the app's credential, if any. Every command but ``evict`` and ``clear-queued`` only
reads; ``evict`` is the one that changes a lock, and refuses a node that is not this app's lock.
"""

from __future__ import annotations

import json
import logging
import time
from datetime import datetime, timezone
from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar

import click
from kazoo.exceptions import NoAuthError, NoNodeError

from ..conf import SECRET_SETTINGS, Settings, beat_name, did_you_mean
from ..glue.api import layout_of, settings_of
from ..glue.celery_internals import hide_in_reports
from ..layout import Layout, node_object
from ..zk import Session
from ..zk.nodes import unreadable
from . import render
from .cli_admin import _connect, check, clear_queued, evict, exporter_command
from .cli_limits import limit
from .tree import elections, locks, queued, server_info

__all__ = ["elections", "locks", "queued", "schedule", "server_info", "zklock"]

T = TypeVar("T")

# Celery imports this module for every `celery` command (our celery.commands entry point): so
# `celery report`, which prints the app's configuration, masks our secrets too.
hide_in_reports(SECRET_SETTINGS)


def _reading(ctx: click.Context, read: Callable[[Session, Settings, Any], T]) -> Tuple[Settings, Any, T]:
    """Connect, ``read(session, settings, app)``, close: what each read-only command does first."""
    settings, session, app = _connect(ctx)
    try:
        return settings, app, read(session, settings, app)
    finally:
        session.close()


class _Commands(click.Group):
    """Our commands, with ZooKeeper's refusal of a read said in one line, not a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except NoAuthError:
            settings = settings_of(ctx.obj.app)
            raise click.ClickException(str(unreadable(settings.root))) from None


@click.group(name="zklock", cls=_Commands)
def zklock() -> None:
    """celery-zklock: lock holders, the beat leader, a setup check, and evicting a holder."""
    # kazoo logs each failed connect attempt; our one line says what failed.
    logging.getLogger("kazoo").addHandler(logging.NullHandler())
    logging.getLogger("kazoo").propagate = False


#: ``status``'s exit codes: all is well; a beat election wants attention (no leader, or a stuck one).
STATUS_OK, STATUS_ATTENTION = 0, 2


def _leader_scheduler(app: Any) -> Optional[str]:
    """The app's ``beat_scheduler`` if it is leader-elected (``zklock``, LeaderScheduler, a
    ``leader_only`` class), else None (Celery's own, another, or one that cannot be loaded here)."""
    from celery.beat import Scheduler
    from celery.utils.imports import load_extension_class_names, symbol_by_name

    from ..glue.beat import _Leadership

    name = app.conf.beat_scheduler
    if not isinstance(name, str):
        cls = name
    else:
        try:
            cls = symbol_by_name(name, aliases=dict(load_extension_class_names("celery.beat_schedulers")))
        except Exception:  # noqa: BLE001 - a scheduler whose library is not here says nothing either way
            return None
    if isinstance(cls, type) and issubclass(cls, Scheduler) and issubclass(cls, _Leadership):
        return name if isinstance(name, str) else f"{cls.__module__}:{cls.__qualname__}"
    return None


def _status(session: Session, settings: Settings, app: Any, beat: bool = False) -> Dict[str, Any]:
    """What ``status`` reports, as one document (``--json`` prints it whole). ``beat``: this
    app runs a leader-elected beat, whatever its ``beat_scheduler`` says."""
    now = time.time()
    name = beat_name(app.conf, app.main)
    ours = Layout(settings.root).election(name)
    problems = []
    found = []
    # An empty election is another app's leftover, unless it is this app's.
    for e in elections(session, settings.root):
        if not (e["leader"] or e["path"] == ours):
            continue
        stalled = render.stalled(e["leader"], now) if e["leader"] else ""
        if e["leader"] is None:
            problems.append(f"beat election {e['name']}: no leader")
        elif stalled.startswith("STUCK"):
            problems.append(f"beat election {e['name']}: {stalled}")
        found.append({**e, "this_app": e["path"] == ours, "stalled": stalled or None})
    scheduler = _leader_scheduler(app)
    expected = "status --beat" if beat else f"beat_scheduler={scheduler!r}" if scheduler is not None else None
    missing = None
    if expected is not None and not any(e["this_app"] for e in found):
        # A beat that stopped as it started (a bad setting, a crash) leaves no election behind.
        missing = (f"none, but this app's scheduler is leader-elected ({expected}): no beat of it has joined the "
                   "election (its beat is not running, or stopped as it started: its log says why)")
        problems.append(f"beat election {name}: {missing}")
    rows = [r for r in locks(session, settings.root) if r["holders"] or r["waiters"] or r.get("parked")]
    return {"server": server_info(session), "root": settings.root, "beat": name, "beat_missing": missing,
            "elections": found,
            # The table's WAITERS and PARKED columns, summed.
            "counts": {"held": sum(len(r["holders"]) for r in rows), "waiting": sum(r["waiters"] for r in rows),
                       "parked": sum(len(r.get("parked", [])) for r in rows)},
            "locks": rows, "problems": problems}


@zklock.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON document, for scripts and monitors.")
@click.option("--beat", is_flag=True,
              help="This app runs a leader-elected beat (for one named on the command line, as "
                   "`worker -B --scheduler zklock`): exit 2 when its election has no leader or does not exist.")
@click.pass_context
def status(ctx: click.Context, as_json: bool, beat: bool) -> None:
    """The beat election, the held locks, and the server asked.

    Exit status: 0 when all is well; 2 when a beat election wants attention (this app's has
    no leader, or a leader holds an election but has stopped ticking, or the app's
    scheduler is leader-elected, or --beat is given, and no beat of it has joined the
    election); 1 when ZooKeeper cannot be asked.
    """
    settings, _, report = _reading(ctx, lambda session, settings, app: _status(session, settings, app, beat))
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        server = report["server"]
        click.echo(f"ZooKeeper {server['server'] or '?'} (session {server['session_id']}, "
                   f"mode {server['mode'] or '?'}, round trip {server['rtt_ms']:.2f} ms), root {settings.root}")
        # This app's election missing, though it should have one: said where it would be listed.
        missing = report["beat_missing"]
        if report["elections"]:
            click.echo("Beat election:" + (f"\n  {report['beat']} (this app): {missing}" if missing else ""))
        else:
            click.echo(f"Beat election: {missing or 'none (no LeaderScheduler has run here)'}")
        for e in report["elections"]:
            mark = " (this app)" if e["this_app"] else ""
            leader = e["leader"]
            click.echo(f"  {e['name']}{mark}: " + (
                f"leader {render.beat_who(leader)} since {leader.get('leader_since', '?')} "
                f"(token {leader['token']})" + (f" -- {e['stalled']}" if e["stalled"] else "")
                if leader else "no leader"))
            for s in e["standbys"]:
                click.echo(f"    standby {render.beat_who(s)} waiting since {s.get('since', '?')}")
        counts = report["counts"]
        click.echo(f"Locks: {counts['held']} held, {counts['waiting']} waiting, {counts['parked']} parked")
        for line in render.lock_lines(report["locks"]):
            click.echo(line)
    ctx.exit(STATUS_ATTENTION if report["problems"] else STATUS_OK)


def schedule(session: Session, layout: Layout, app: Any) -> List[Dict[str, Any]]:
    """Each ``beat_schedule`` entry with its last run as ``LeaderScheduler`` recorded it in
    ZooKeeper (None: never run under this election) and when it is due next."""
    from celery.beat import ScheduleEntry

    now = app.now()
    beat = beat_name(app.conf, app.main)
    rows = []
    for name, options in sorted((app.conf.beat_schedule or {}).items()):
        path = layout.entry(beat, name)
        try:
            state = node_object(session.client.get(path)[0])
        except NoNodeError:
            state = {}
        last = state.get("last_run_at")
        entry = ScheduleEntry(name=name, app=app, **{k: v for k, v in options.items() if k != "name"})
        row: Dict[str, Any] = {"entry": name, "task": entry.task, "schedule": str(entry.schedule),
                               "runs": state.get("total_run_count"), "last_run": None, "next_run": None,
                               "path": path}
        if isinstance(last, (int, float)):
            at = datetime.fromtimestamp(last, timezone.utc).astimezone(app.timezone)
            due = now + entry.schedule.remaining_estimate(at)
            row.update(last_run=at.isoformat(timespec="seconds"), next_run=due.isoformat(timespec="seconds"),
                       due_in=round((due - now).total_seconds(), 3))
        rows.append(row)
    return rows


@zklock.command(name="schedule")
@click.option("--json", "as_json", is_flag=True, help="One JSON document, for scripts.")
@click.pass_context
def schedule_command(ctx: click.Context, as_json: bool) -> None:
    """The beat entries: each one's task, schedule, runs, last run and next run, as the elected beats record them."""
    settings, app, rows = _reading(ctx, lambda session, _, app: schedule(session, layout_of(app), app))
    if as_json:
        click.echo(json.dumps({"root": settings.root, "beat": beat_name(app.conf, app.main), "entries": rows},
                              indent=2))
        return
    if not rows:
        click.echo("  (beat_schedule is empty)")
        return
    click.echo(f"  {'ENTRY':<24} {'TASK':<32} {'SCHEDULE':<28} {'RUNS':>5} {'LAST RUN':<25} NEXT RUN")
    for r in rows:
        click.echo(f"  {render.cell(r['entry'], 24)} {render.cell(r['task'], 32)} "
                   f"{render.cell(r['schedule'], 28)} "
                   f"{'-' if r['runs'] is None else r['runs']:>5} {r['last_run'] or 'never (here)':<25} "
                   f"{r['next_run'] or 'as the leader starts'}")


@zklock.command(name="locks")
@click.option("--key", "pattern", default=None,
              help="Only keys matching this glob, e.g. 'invoice:*' (one exact key under hashed key names).")
@click.option("--waiters", "show_waiters", is_flag=True,
              help="Also a row per waiter, then per parked copy, in queue order.")
@click.option("--task", "task_name", default=None, metavar="NAME",
              help="Only keys a copy of this task (its registered name) holds, waits for or is parked at; with "
                   "--waiters, only its waiters and parked copies get a row.")
@click.option("--json", "as_json", is_flag=True, help="One JSON document, for scripts (waiters always in it).")
@click.pass_context
def locks_command(ctx: click.Context, pattern: Optional[str], show_waiters: bool, task_name: Optional[str],
                  as_json: bool) -> None:
    """Held and waited-for locks: mode, holders (host/pid, worker, task, task id), held for, waiters, token."""

    def read(session: Session, settings: Settings, app: Any) -> List[Dict[str, Any]]:
        rows = locks(session, settings.root, pattern, layout_of(app).secret)
        if task_name is None:
            return rows
        rows = [row for row in rows if render.names_task(row, task_name)]
        known = [name for name in app.tasks if not name.startswith("celery.")]
        if not rows and known and task_name not in app.tasks:
            # A task the app no longer has (a deploy renamed it) may still have copies: refused only with
            # none; and only by an app that knows its tasks (one whose modules the CLI did not import
            # would refuse every name).
            raise click.UsageError(f"--task {task_name!r}: no such task in this app, and no lock names it"
                                   f"{did_you_mean(task_name, app.tasks)}")
        return rows

    settings, _, rows = _reading(ctx, read)
    if as_json:
        click.echo(json.dumps({"root": settings.root, "locks": rows}, indent=2))
    elif (pattern is not None or task_name is not None) and not rows:
        click.echo("  no lock" + (f" matches {pattern!r}" if pattern is not None else "")
                   + (" and" if pattern is not None and task_name is not None else "")
                   + (f" is held, waited for or parked at by task {task_name}" if task_name is not None else ""))
    else:
        for line in render.lock_lines(rows, show_waiters, task_name):
            click.echo(line)


@zklock.command(name="queued")
@click.option("--json", "as_json", is_flag=True, help="One JSON document, for scripts.")
@click.pass_context
def queued_command(ctx: click.Context, as_json: bool) -> None:
    """Dedupe markers: each key with a copy queued, running, or (``latest``) started; its task id, age and expiry."""
    settings, _, rows = _reading(ctx, lambda session, settings, _: queued(session, settings.root))
    if as_json:
        click.echo(json.dumps({"root": settings.root, "queued": rows}, indent=2))
        return
    if not rows:
        # "queued" reads as a parked queue to a park user: say where those are.
        click.echo("  (no copy is queued under dedupe; parked copies: celery zklock locks --waiters)")
        return
    click.echo(f"  {'KEY':<32} {'TASK':<28} {'TASK ID':<36} {'AGE':>7} {'EXPIRES IN':>10}  STATE")
    for r in rows:
        left = r["expires_in"]
        expires = "-" if r["running"] or left is None or left <= 0 else render.age(left)
        click.echo(f"  {render.cell(r['key'], 32)} {render.cell(r['task'] or '-', 28)} "
                   f"{str(r['task_id'] or '-'):<36} {render.age(r['age']) if r['age'] is not None else '?':>7} "
                   f"{expires:>10}  {_STATES[r['state']]}")


#: ``queued``'s STATE column: what each marker stands for (see tree.marker_state).
_STATES = {
    "queued": "queued",
    "running": "running",
    # A latest marker is not a queued copy: it outlives its run, to turn older copies away.
    "started": 'started (dedupe="latest"; it may have ended): kept until it expires, to skip older copies',
    "expired": "expired: stands for nothing (the next publish of its key takes it over, or a publisher's sweep "
               "deletes it)",
}


# Checking the setup, changing the tree, serving: their own module.
for _command in (check, clear_queued, evict, exporter_command, limit):
    zklock.add_command(_command)
