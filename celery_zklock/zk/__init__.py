"""ZooKeeper plumbing under the recipes: no Celery here.

- :mod:`.session`: the kazoo client (hosts, auth, TLS, its handler), and :mod:`.registry`: one session per process;
- :mod:`.clock`: :class:`LivenessClock`, the pure rule for when a session's nodes count as lost;
- :mod:`.nodes`: persistent paths, key containers, and deletes nobody waits for;
- :mod:`.deadlines`: a timeout as one ``time.monotonic()`` moment, the seconds left, a reply waited for until then;
- :mod:`.green`: the gevent or eventlet handler, when one of them patched the process.
"""

from .clock import Liveness, LivenessClock
from .deadlines import deadline, remaining, reply, through_blips
from .green import timeouts
from .nodes import Nodes, check_acl
from .registry import close_sessions, session_for
from .session import Session, SessionListener, acl_for

__all__ = ["Liveness", "LivenessClock", "Nodes", "Session", "SessionListener", "acl_for", "check_acl",
           "close_sessions", "deadline", "remaining", "reply", "session_for", "through_blips", "timeouts"]
