"""``celery zklock limit``: a key's limits changed live, without a deploy (see :mod:`..recipes.live`).

::

    celery -A proj zklock limit set partner:acme --limit 5 --rate 20/s
    celery -A proj zklock limit show partner:acme
    celery -A proj zklock limit clear partner:acme
    celery -A proj zklock limit list
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import click
from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError

from ..glue.api import layout_of
from ..layout import check_key, decode_key
from ..recipes.live import NONE, Live, encode_live, parse_live
from ..recipes.rate import parse_rate
from ..recipes.rules import units
from ..zk import Session
from .cli_admin import _connect

__all__ = ["describe_live", "limit"]


def describe_live(live: Live) -> str:
    """A stored value in one line.

    >>> describe_live(Live(5, {1.0: 20, 86400.0: 10000}))
    'limit 5; 20 starts per 1s; 10000 starts per 86400s'
    >>> print(describe_live(NONE))
    nothing stored: the code's limit and rate apply
    """
    parts = ([f"limit {live.limit}"] if live.limit is not None else []) + \
        [f"{n} starts per {w:g}s" for w, n in sorted(live.rates.items())]
    return "; ".join(parts) if parts else "nothing stored: the code's limit and rate apply"


def _read(session: Session, path: str) -> Tuple[Live, Optional[int]]:
    try:
        data, stat = session.client.get(path)
    except NoNodeError:
        return NONE, None
    return parse_live(data), stat.version


@click.group(name="limit")
def limit() -> None:
    """A key's limit= and rate= counts, changed live: every contender of the key reads the stored
    value and decides under it at once; clear goes back to the code's."""


@contextlib.contextmanager
def _opened(ctx: click.Context) -> Iterator[Tuple[Session, Any]]:
    """A session of the app's settings, and the app, for one command; closed after it."""
    _, session, app = _connect(ctx)
    try:
        yield session, app
    finally:
        session.close()


def _key(key: str) -> str:
    try:
        return check_key(key)
    except (TypeError, ValueError) as exc:
        raise click.BadParameter(str(exc), param_hint="KEY") from None


@limit.command(name="set")
@click.argument("key")
@click.option("--limit", "count", type=click.IntRange(min=1), default=None,
              help="At most this many holders of the key's semaphore (its tasks' limit=) at once.")
@click.option("--rate", "rates", multiple=True, metavar="RATE",
              help="A start rate for one of the key's windows (its tasks' rate=), like 20/s or 1000/d; repeat "
                   "for several windows.")
@click.pass_context
def set_limit(ctx: click.Context, key: str, count: Optional[int], rates: Tuple[str, ...]) -> None:
    """Store KEY's limit or rate counts, over what its tasks' code says."""
    key = _key(key)
    if count is None and not rates:
        raise click.UsageError("give --limit N, --rate R, or both")
    windows: Dict[float, int] = {}
    for given in rates:
        try:
            for one in parse_rate(given):
                if one.window in windows:
                    raise ValueError(f"two counts for the {one.window:g}s window ({windows[one.window]} and "
                                     f"{one.count}); give one")
                windows[one.window] = one.count
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--rate") from None
    with _opened(ctx) as (session, app):
        new = _update(session, layout_of(app).limit(key), lambda stored: Live(
            count if count is not None else stored.limit, {**stored.rates, **windows}, stored.high()))
        assert new is not None  # set's change always stores a value
        click.echo(f"{key}: {describe_live(new)}")
        _warn_unused(session, app, key, count, windows)


def _update(session: Session, path: str, change: Callable[[Live], Optional[Live]]) -> Optional[Live]:
    """Store ``change(stored)`` at ``path``, version-checked: a concurrent write is read again,
    never overwritten. None, storing nothing, where ``change`` says None."""
    for _ in range(10):
        stored, version = _read(session, path)
        new = change(stored)
        if new is None:
            return None
        try:
            if version is None:
                session.client.create(path, encode_live(new), makepath=True)
            else:
                session.client.set(path, encode_live(new), version=version)
        except (BadVersionError, NodeExistsError, NoNodeError):
            continue
        return new
    raise click.ClickException(f"{path} kept changing under us; try again")


def _warn_unused(session: Session, app: Any, key: str, count: Optional[int], windows: Dict[float, int]) -> None:
    """Say which of what was just stored no contender of the key uses now: a misspelt key, or a
    window its tasks do not have, is stored all the same and changes nothing."""
    layout = layout_of(app)
    unused = ([] if count is None or session.client.exists(layout.lock(key, semaphore=True)) else ["--limit"])
    unused += [f"--rate for {w:g}s" for w in windows if not session.client.exists(layout.rate(key, w))]
    if unused:
        click.echo(f"note: no contender of {key!r} uses {' or '.join(unused)} now (none since its node was last "
                   "removed, or none ever: check the key and its tasks' windows); stored all the same", err=True)
    for window, n in sorted(windows.items()):
        try:
            largest = max((units(c) for c in session.client.get_children(layout.rate(key, window)) if "__sem__" in c),
                          default=0)
        except NoNodeError:
            continue
        if largest > n:
            click.echo(f"warning: a start of {key!r} queued now takes {largest} units of the {window:g}s window, more "
                       f"than {n}: it and every start behind it wait until the count is raised again, or until their "
                       "policy's timeout", err=True)


@limit.command(name="show")
@click.argument("key")
@click.pass_context
def show_limit(ctx: click.Context, key: str) -> None:
    """What is stored for KEY."""
    key = _key(key)
    with _opened(ctx) as (session, app):
        click.echo(f"{key}: {describe_live(_read(session, layout_of(app).limit(key))[0])}")


@limit.command(name="clear")
@click.argument("key")
@click.pass_context
def clear_limit(ctx: click.Context, key: str) -> None:
    """Clear what is stored for KEY: its tasks' code decides again."""
    key = _key(key)
    with _opened(ctx) as (session, app):
        # Not deleted: the largest count stays, for slots it admitted that outlive the clear.
        cleared = _update(session, layout_of(app).limit(key),
                          lambda stored: stored.cleared() if stored.counts else None)
        click.echo(f"{key}: cleared; the code's limit and rate apply" if cleared else f"{key}: nothing was stored")


@limit.command(name="list")
@click.pass_context
def list_limits(ctx: click.Context) -> None:
    """Every key with something stored."""
    with _opened(ctx) as (session, app):
        tree = layout_of(app).limits_tree
        try:
            names = sorted(session.client.get_children(tree))
        except NoNodeError:
            names = []
        shown_any = False
        for name in names:
            stored, _ = _read(session, f"{tree}/{name}")
            if not stored.counts:
                continue  # cleared
            shown_any = True
            shown: Any = decode_key(name) or name  # a hashed name cannot be turned back into its key
            click.echo(f"  {shown}: {describe_live(stored)}")
        if not shown_any:
            click.echo("  (no key has limits stored)")
