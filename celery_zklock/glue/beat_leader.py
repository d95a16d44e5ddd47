"""``LeaderScheduler``: the stock scheduler, leader-elected, its entries' state in ZooKeeper and
each run recorded, fenced on the leadership, before it is sent (see :mod:`.beat`)."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from datetime import datetime, timezone
from typing import Any, Dict, Optional, Tuple

from celery.beat import ScheduleEntry
from kazoo.exceptions import ConnectionLoss, KazooException, NodeExistsError, NoNodeError

from ..exceptions import ConfigurationError
from ..layout import node_object
from ..recipes.election import Leadership
from ..zk import Session, deadline
from ..zk.deadlines import wait_connected
from .beat import _Leadership

logger = logging.getLogger("celery_zklock.beat")


class LeaderScheduler(_Leadership):
    """The stock scheduler, leader-elected, with its state in ZooKeeper and fenced dispatch.

    A crash between recording a run and sending it loses that one run rather
    than sending it twice: the record comes first, so no leader can send a
    run that another leader also sends.
    """

    #: Seconds between syncs do not matter: every run is recorded before it is sent.
    sync_every = 3600

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        #: Entry name -> (token, run number) of a run :meth:`reserve` recorded and
        #: :meth:`apply_entry` has not sent yet.
        self._recorded: Dict[str, Tuple[Optional[int], int]] = {}
        super().__init__(*args, **kwargs)

    def _join(self) -> None:
        if not self.app.conf.beat_schedule:
            raise ConfigurationError("beat_schedule is empty: LeaderScheduler has nothing to schedule")
        super()._join()

    # -- state in ZooKeeper ----------------------------------------------------
    def _entry_path(self, name: str) -> str:
        assert self.layout is not None
        return self.layout.entry(self.beat_name, name)

    def on_leadership(self) -> None:
        """Continue exactly where the previous leader stopped: load every entry's state."""
        assert self.election is not None and self.layout is not None
        session = self.election.session
        session.nodes.ensure_path(self.layout.entries(self.beat_name))
        client = session.client
        for name, entry in list(self.schedule.items()):
            try:
                raw, _ = client.get(self._entry_path(name))
            except NoNodeError:
                continue  # never run under this election
            try:
                state = node_object(raw)
                # In the app's time zone, as Celery's own app.now(): before 5.7 Celery
                # compares crontab fields with last_run_at's fields without converting.
                last = datetime.fromtimestamp(float(state["last_run_at"]), timezone.utc).astimezone(
                    self.app.timezone)
                count = int(state["total_run_count"])
            except (ValueError, KeyError, TypeError) as exc:
                logger.error("beat: state of entry %r at %s is corrupt (%s); treating it as never run",
                             name, self._entry_path(name), exc)
                continue
            self.schedule[name] = entry.__class__(**dict(entry, last_run_at=last, total_run_count=count))
        self.populate_heap()  # order the runs by the loaded state
        super().on_leadership()

    def reserve(self, entry: ScheduleEntry) -> ScheduleEntry:
        """Celery takes a run here: record it, fenced on our leadership, before anything is sent.

        If the record fails, the run is not taken: the entry keeps its old state
        and :meth:`apply_entry` sends nothing.
        """
        self._recorded.pop(entry.name, None)
        new = super().reserve(entry)
        lead = self.election.leadership() if self.election is not None else None
        if lead is None or not self._record(lead, new):
            logger.warning("beat: lost leadership before sending run %d of %s; not sent", new.total_run_count,
                           entry.name)
            self.schedule[entry.name] = entry
            return entry
        self._recorded[entry.name] = (lead.token, new.total_run_count)
        return new

    def apply_entry(self, entry: ScheduleEntry, producer: Any = None) -> None:
        recorded = self._recorded.pop(entry.name, None)
        election = self.election
        if recorded is None or election is None:
            return  # reserve() did not record this run (it said why)
        with election.dispatching() as lead:
            # The leadership we recorded under, still ours: not only a live session (a late
            # reply revives the session of a leader that has already stood down).
            if lead is None or lead.token != recorded[0] or not election.session.is_alive():
                # Another leader may be sending: this run goes unsent (its record counts it).
                logger.warning("beat: leadership lost or in doubt after recording run %d of %s; not sent (run "
                               "counted)", recorded[1], entry.name)
                return
            options = dict(entry.options)
            options["headers"] = {**options.get("headers", {}), "zklock_beat": {
                "pid": os.getpid(), "host": socket.gethostname(), "token": recorded[0],
                "entry": entry.name, "run": recorded[1], "sent": time.time()}}
            entry.options = options
            self._send(entry, producer)

    def _record(self, lead: Leadership, entry: ScheduleEntry) -> bool:
        """Record the run in one transaction that also checks our election node; True if it committed.

        Every attempt is fenced by that check, so trying again is safe for as long as it
        takes: a connection blip must not drop a run while leadership holds.
        """
        assert self.election is not None and self.layout is not None
        session = self.election.session
        client = session.client
        run = {"last_run_at": entry.last_run_at.timestamp(), "total_run_count": entry.total_run_count,
               "token": lead.token}
        data = json.dumps(run).encode()
        path = self._entry_path(entry.name)
        for _ in range(5):
            try:
                tx = client.transaction()
                tx.check(lead.node_path, -1)  # -1: any version; fails if our election node is gone
                if client.exists(path) is None:
                    tx.create(path, data)
                else:
                    tx.set_data(path, data)
                results = tx.commit()
            except ConnectionLoss:
                # The transaction may have committed before the connection broke: read it back.
                committed = self._committed(path, entry.name, run, session)
                if committed is None:
                    return False
                if committed:
                    return True
                continue  # it never reached the server: record it again, fenced as before
            except Exception as exc:  # the session expired, or no answer in time: leadership unproven
                logger.warning("beat: could not record %s (%s)", entry.name, exc)
                return False
            if not any(isinstance(r, Exception) for r in results):
                return True
            if isinstance(results[1], NodeExistsError):
                continue  # created meanwhile by a former leader: set it instead
            if isinstance(results[1], NoNodeError):
                # The entries node was deleted (by hand, or with its tree) while we lead.
                entries = self.layout.entries(self.beat_name)
                session.nodes.path_gone(entries)
                session.nodes.ensure_path(entries, session.timeout)
                continue
            logger.warning("beat: record of %s refused: %s", entry.name, results)
            return False
        return False

    def _committed(self, path: str, name: str, run: Dict[str, Any], session: Session) -> Optional[bool]:
        """After a lost reply: whether the entry holds exactly this run, under this leadership
        (None: the connection did not come back within the session timeout)."""
        if not wait_connected(session, deadline(session.timeout)):
            logger.warning("beat: could not learn whether run %d of %s was recorded; not sent",
                           run["total_run_count"], name)
            return None
        try:
            stored = node_object(session.client.get(path)[0])
        except NoNodeError:
            stored = {}
        except KazooException:
            return None
        newer = stored.get("token")
        if isinstance(newer, int) and isinstance(run["token"], int) and newer > run["token"]:  # czxids rise
            logger.warning("beat: the reply to the record of run %d of %s was lost, and another leadership has "
                           "recorded since; not sent", run["total_run_count"], name)
            return None
        committed = all(stored.get(k) == v for k, v in run.items())
        logger.warning("beat: the reply to the record of %s was lost; it %s", path,
                       "committed: sending" if committed else "did not commit: recording it again")
        return committed
