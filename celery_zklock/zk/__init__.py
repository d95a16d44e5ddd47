"""ZooKeeper plumbing under the recipes: no Celery here.

- :mod:`.session`: the kazoo client (hosts, auth, TLS, its handler) and one session per process;
- :mod:`.clock`: :class:`LivenessClock`, the pure rule for when a session's nodes count as lost;
- :mod:`.nodes`: persistent paths, key containers, and deletes nobody waits for;
- :mod:`.green`: the gevent or eventlet handler, when one of them patched the process.
"""

from .clock import Liveness, LivenessClock
from .green import timeouts
from .nodes import Nodes, check_acl, remaining
from .session import Session, SessionState, acl_for, close_sessions, session_for

__all__ = ["Liveness", "LivenessClock", "Nodes", "Session", "SessionState", "acl_for", "check_acl",
           "close_sessions", "remaining", "session_for", "timeouts"]
