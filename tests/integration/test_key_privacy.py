"""Task arguments never reach ZooKeeper under hashed key names, and nothing is readable by
others under zklock_acl='private': checked on the whole tree, the server's transaction log
(read with ZooKeeper's own TxnLogToolkit, and as raw bytes) and the worker's log."""

from __future__ import annotations

import glob
import json
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from typing import Dict, Iterator, List

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError

import celery_zklock
from celery_zklock.exceptions import ConfigurationError
from celery_zklock.glue.api import claim_scheme
from celery_zklock.layout import Layout
from celery_zklock.testing import violations
from celery_zklock.testing.server import SLF4J_SIMPLE_JAR, find_zookeeper_jar
from harness import CeleryWorker, Op, TcpProxy
from tests.apps import worker_app
from tests.util import children, events, holds, send, wait_until

pytestmark = pytest.mark.slow
SECRET = "tests-key-secret-0123456789"


def tree(kazoo: KazooClient, path: str) -> Iterator[tuple]:
    """(path, data) of ``path`` and everything below it."""
    try:
        data, _ = kazoo.get(path)
        children = kazoo.get_children(path)
    except Exception:  # gone while we walked (a lock released, a container reaped)
        return
    yield path, data
    for child in children:
        yield from tree(kazoo, f"{path}/{child}")


def txn_log(zk_server) -> str:
    """The server's transaction log as ZooKeeper's TxnLogToolkit prints it, plus the raw bytes."""
    out = []
    for log in sorted(glob.glob(str(zk_server.dir / "data" / "version-2" / "log.*"))):
        dump = subprocess.run(["java", "-cp", f"{find_zookeeper_jar()}{os.pathsep}{SLF4J_SIMPLE_JAR}",
                               "org.apache.zookeeper.server.persistence.TxnLogToolkit", "-d", log],
                              capture_output=True, text=True, timeout=120)
        assert "ZooKeeper Transactional Log File" in dump.stdout, dump.stderr[-2000:]
        with open(log, "rb") as raw:
            out += [dump.stdout, raw.read().decode("latin-1")]
    return "\n".join(out)


@pytest.mark.parametrize("acl", ["open", "creator"])
def test_hashed_names_leak_no_argument_anywhere(acl, workers, queue, redis_server, zk_server, kazoo,  # noqa: F811
                                                zk_root):
    email = f"leak-{uuid.uuid4().hex[:8]}@example.com"
    card = "".join(random.choice("0123456789") for _ in range(16))
    secrets = [email, card, email.split("@")[0]]
    w1 = workers("w1", concurrency=4, ZKT_KEY_SECRET=SECRET, ZKT_ACL=acl,
                 **({"ZKT_AUTH": "app:pw-one"} if acl != "open" else {}))
    results = [send(t, queue, email, card, 1.5) for t in (worker_app.by_default_key, worker_app.by_template)]
    results += [send(worker_app.by_template, queue, email, card, 0.2)]  # waits behind the first
    # While two hold and one waits: every name and every node's data.
    wait_until(lambda: sum("__lock__" in p for p, _ in tree(kazoo, zk_root)) == 3, timeout=30)
    seen = [f"{p}\n{d.decode('latin-1')}" for p, d in tree(kazoo, zk_root)]
    for r in results:
        r.get(timeout=60)
    seen += [f"{p}\n{d.decode('latin-1')}" for p, d in tree(kazoo, zk_root)]
    assert violations(holds(redis_server.url)) == []
    assert json.loads(kazoo.get(zk_root)[0])["key_names"].startswith("hashed:")
    everything = "\n".join(seen) + txn_log(zk_server) + w1.log_text()
    for secret in secrets:
        assert secret not in everything, f"{secret!r} reached ZooKeeper or the log"
    assert "lock on all their arguments" not in w1.log_text()  # hashed: nothing to warn about


def test_hashed_workers_exclude_each_other(workers, queue, redis_server):  # noqa: F811
    for name in ("w1", "w2"):
        workers(name, concurrency=2, ZKT_KEY_SECRET=SECRET)
    results = [send(worker_app.by_template, queue, "a@example.com", "1", 0.05) for _ in range(20)]
    for r in results:
        r.get(timeout=60)
    ran = holds(redis_server.url)
    assert len(ran) == 20 and violations(ran) == []
    assert len({h.who.split("/")[0] for h in ran}) == 2  # both workers took part


def test_switching_key_names_with_live_holders_is_refused_in_one_line(env, workers, queue, redis_server,  # noqa: F811
                                                                       kazoo, zk_root):
    readable = workers("w1", concurrency=1)
    assert ("celery-zklock: tests.apps.worker_app.by_default_key lock on all their arguments, which ZooKeeper shows "
            "in clear as node names") in readable.log_text()
    send(worker_app.long_body, queue, "live", 30)
    wait_until(lambda: any(e["event"] == "started" for e in events(redis_server.url)), timeout=30)
    refused = CeleryWorker("tests.apps.worker_app", name="w2", env={**env, "ZKT_KEY_SECRET": SECRET},
                           extra_args=["-Q", queue]).start(wait=False)
    try:
        assert refused.proc.wait(60) != 0
        log = refused.log_text()
    finally:
        refused.close()
    assert (f"zklock_key_names: {zk_root} is in use with readable key names and a process of it is alive "
            "(ZooKeeper session 0x") in log and "; this process names keys as hashed" in log
    assert "Traceback" not in log
    readable.close()  # SIGKILL: its session goes, and its lock with it
    wait_until(lambda: not children(kazoo, f"{zk_root}/locks/k-k:live"), timeout=30)  # reaped once empty
    workers("w3", ZKT_KEY_SECRET=SECRET)  # drained: the switch is taken
    assert json.loads(kazoo.get(zk_root)[0])["key_names"].startswith("hashed:")


def test_an_idle_process_of_the_old_key_names_keeps_the_new_ones_out_for_its_whole_life(new_session, zk_root):
    # A rolling switch: the old worker holds no lock at this instant, and was invisible.
    old, new = Layout(zk_root), Layout(zk_root, SECRET.encode())
    idle = new_session()
    claim_scheme(idle, old, 10)
    with pytest.raises(ConfigurationError, match=r"in use with readable key names and a process of it is alive"):
        claim_scheme(new_session(), new, 10)
    idle.close()  # its session ends: now the switch is safe
    switched = new_session()
    claim_scheme(switched, new, 10)
    # The old scheme's next session (a restarted process, or one whose session expired) is refused.
    with pytest.raises(ConfigurationError, match=r"in use with hashed key names"):
        claim_scheme(new_session(), old, 10)


def test_two_first_claims_read_at_once_only_one_scheme_wins(new_session, zk_server, zk_root, kazoo):
    # Both read the root before either writes: the reply to one claim's read is held back
    # until the other has claimed.
    old, new = Layout(zk_root), Layout(zk_root, SECRET.encode())
    with TcpProxy(zk_server.port) as proxy:
        late = new_session(hosts=proxy.hosts)
        new_session().nodes.ensure_path(f"{zk_root}/members", 10)  # so the late claim's first read is the root's
        held = proxy.hold_reply(Op.GET_DATA)
        outcome: List[object] = []
        claimer = threading.Thread(target=lambda: outcome.append(_claim(late, old)))
        claimer.start()
        held.wait_matched()
        early = new_session()
        claim_scheme(early, new, 10)
        held.release()
        claimer.join(15)
    assert len(outcome) == 1 and isinstance(outcome[0], ConfigurationError), outcome
    assert json.loads(kazoo.get(zk_root)[0])["key_names"] == new.scheme


def _claim(session, layout) -> object:
    try:
        claim_scheme(session, layout, 10)
        return "claimed"
    except ConfigurationError as exc:
        return exc


@pytest.mark.parametrize("hashed", [False, True])
def test_private_acl_lets_no_one_else_list_or_read(hashed, app, zk_server, zk_root):
    app.conf.update(zklock_auth="app:pw-one", zklock_acl="private")
    if hashed:
        app.conf.update(zklock_key_names="hashed", zklock_key_secret=SECRET)
    with celery_zklock.lock(app, "user:42", task="t", task_id="id-1") as held:
        ours = [p for p, _ in tree(authed(zk_server, "app:pw-one"), zk_root)]
        assert f"{held.path}/{held.node}" in ours and len(ours) >= 4
        for who in (None, "app:wrong", "other:pw"):
            outsider = authed(zk_server, who)
            for path in ours:
                with pytest.raises(NoAuthError):
                    outsider.get_children(path)
                with pytest.raises(NoAuthError):
                    outsider.get(path)
            # ZooKeeper checks no ACL on exists: a guessed key is confirmed under readable
            # names (the docs' table says so); under hashed ones the guess needs the secret.
            guessed = f"{zk_root}/locks/{Layout(zk_root).name('user:42')}"
            assert (outsider.exists(guessed) is not None) == (not hashed)
            outsider.stop()
        # The same app's CLI, with the app's credential, still shows the holder.
        env: Dict[str, str] = {**os.environ, "ZKT_HOSTS": zk_server.hosts, "ZKT_ROOT": zk_root,
                               "ZKT_AUTH": "app:pw-one", "ZKT_ACL": "private", "PYTHONPATH": os.getcwd(),
                               **({"ZKT_KEY_SECRET": SECRET} if hashed else {})}

        def locks(*args: str) -> List[dict]:
            out = subprocess.run([sys.executable, "-m", "celery", "-A", "tests.apps.worker_app", "zklock", "locks",
                                  "--json", *args], env=env, capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            return json.loads(out.stdout)["locks"]

        [row] = locks()
        assert row["holders"][0]["task_id"] == "id-1"
        # Under hashed names the CLI lists the name, and finds a key by computing its name.
        assert row["key"] == (held.path.rsplit("/", 1)[1] if hashed else "user:42")
        [row] = locks("--key", "user:42")
        assert row["key"] == "user:42" and row["holders"][0]["task_id"] == "id-1"
        assert locks("--key", "user:43") == []
        # Without the credential, one line that names the setting (the new-user trial: a traceback).
        for command in ("locks", "status"):
            out = subprocess.run([sys.executable, "-m", "celery", "-A", "tests.apps.worker_app", "zklock", command],
                                 env={**env, "ZKT_AUTH": "app:wrong"}, capture_output=True, text=True, timeout=60)
            assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
            assert "refused to let this client read" in out.stderr and "zklock_auth" in out.stderr


def authed(zk_server, credential) -> KazooClient:
    client = KazooClient(zk_server.hosts, auth_data=[("digest", credential)] if credential else None)
    client.start()
    return client


@pytest.mark.parametrize("op", [Op.GET_DATA, Op.MULTI])
def test_a_blip_as_a_session_claims_its_scheme_is_ridden_through(new_session, zk_server, zk_root, kazoo, op):
    # The first task of a pool process claims the scheme: a connection that breaks under the
    # claim's read (or its commit) and comes back at once must not fail that task.
    layout = Layout(zk_root)
    with TcpProxy(zk_server.port) as proxy:
        session = new_session(hosts=proxy.hosts)
        session.nodes.ensure_path(f"{zk_root}/members", 10)
        sid = session.client.client_id[0]
        cut = proxy.cut_after(op)  # the request reaches the server; its reply never comes back
        claim_scheme(session, layout, 10)
        assert cut.done.is_set(), "the fault never struck the claim"
    members = children(kazoo, f"{zk_root}/members")
    assert members == [f"readable-{sid:016x}"], members
    assert json.loads(kazoo.get(zk_root)[0])["key_names"] == layout.scheme


def test_a_session_that_claims_its_scheme_while_its_connection_is_down_waits_for_it(new_session, zk_server, zk_root,
                                                                                  kazoo):
    # kazoo reads a session's id live: None while the connection is down. The claim named its
    # member by it, and a pool process's first task, begun in a blip, failed with TypeError
    # ('NoneType' object is not subscriptable; a CI run's blip test). It waits for the
    # connection now, as through any blip, within its deadline.
    layout = Layout(zk_root)
    with TcpProxy(zk_server.port) as proxy:
        session = new_session(hosts=proxy.hosts)
        session.nodes.ensure_path(f"{zk_root}/members", 10)
        sid = session.client.client_id[0]
        proxy.mode = "blackhole"
        proxy.reset()
        wait_until(lambda: session.client.client_id is None, timeout=10)
        errors: list = []
        claimer = threading.Thread(target=lambda: _catching(errors, lambda: claim_scheme(session, layout, 20)))
        claimer.start()
        time.sleep(0.5)  # the claim meets the connection down (nothing to wait for: it must wait itself)
        proxy.mode = "pass"
        claimer.join(20)
        assert not claimer.is_alive() and errors == [], errors
    assert children(kazoo, f"{zk_root}/members") == [f"readable-{sid:016x}"]


def _catching(errors: list, call) -> None:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test reports it
        errors.append(exc)
