"""Digest auth and ACLs, TLS, and secrets kept out of logs and node data: against a real server."""

from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError

from celery_zklock import ConfigurationError, lock
from celery_zklock.conf import Settings
from celery_zklock.recipes.election import Election
from celery_zklock.zk import Session
from harness import ZooKeeperPeer
from tests.util import started_clients

SECRET = "s3cret-pw"


@pytest.fixture
def secure_app(app):
    app.conf.zklock_auth = f"worker:{SECRET}"
    app.conf.zklock_acl = "creator"
    return app


@pytest.fixture
def outsider(zk_server):
    """A client without the credential (or with another one)."""
    yield from started_clients(
        lambda auth=None: KazooClient(hosts=zk_server.hosts, auth_data=[("digest", auth)] if auth else None))


@pytest.mark.parametrize("auth", [None, "worker:wrong-password", "mallory:x"])
def test_held_lock_can_be_read_but_not_deleted_changed_or_joined_by_others(secure_app, outsider, auth):
    with lock(secure_app, "invoice:1", timeout=5) as held:
        intruder = outsider(auth)
        node = f"{held.path}/{held.node}"
        data, stat = intruder.get(node)  # reading who holds it is allowed
        assert b'"key": "invoice:1"' in data
        with pytest.raises(NoAuthError):
            intruder.delete(node)
        with pytest.raises(NoAuthError):
            intruder.set(node, b"forged")
        with pytest.raises(NoAuthError):  # a forged contender that would sort first
            intruder.create(f"{held.path}/forged__lock__0000000000")
        with pytest.raises(NoAuthError):
            intruder.delete(held.path.rsplit("/", 1)[0])
        assert held.is_held and intruder.get(node)[1].version == stat.version == 0


def test_the_same_credential_shares_the_locks(secure_app, new_session, settings):
    colleague = new_session(auth=("worker", SECRET), acl="creator")
    with lock(secure_app, "invoice:2", timeout=5) as held:
        other = lock(secure_app, "invoice:2", session=colleague)
        assert not other.acquire(timeout=0.5)  # contends normally: it waits behind us
        token = held.fencing_token
    assert other.acquire(timeout=5) and other.fencing_token > token
    other.release()


def test_election_cannot_be_joined_or_broken_by_a_forged_node(secure_app, new_session, settings, outsider):
    session = new_session(auth=("worker", SECRET), acl="creator")
    path = f"{settings.root}/beat/app/election"
    election = Election(session, path, data=b'{"pid": 1}').start()
    try:
        assert election.wait_leader(10)
        intruder = outsider()
        with pytest.raises(NoAuthError):
            intruder.create(f"{path}/forged__lock__0000000000", b'{"pid": 666}')
        with pytest.raises(NoAuthError):
            intruder.delete(election.node_path)
        assert election.is_leader and election.leader() == '{"pid": 1}'
    finally:
        election.close()


def test_a_root_open_to_anyone_is_refused(secure_app, outsider, zk_root):
    outsider().ensure_path(f"{zk_root}/locks")  # created by someone else, world-writable
    with pytest.raises(ConfigurationError, match=f"zklock_acl='creator': {zk_root}.* writable by anyone"):
        lock(secure_app, "invoice:3", timeout=5).acquire()


def test_no_secret_in_logs_node_data_or_errors(secure_app, caplog, outsider, zk_server):
    caplog.set_level(logging.DEBUG)
    with lock(secure_app, "invoice:4", timeout=5) as held:
        data, _ = outsider().get(f"{held.path}/{held.node}")
    assert SECRET not in data.decode()
    bad = Settings(hosts="127.0.0.1:1", auth=("worker", SECRET), connect_timeout=0.5)
    with pytest.raises(Exception) as err:
        Session(bad).start()
    assert SECRET not in str(err.value) and SECRET not in repr(bad)
    assert caplog.records and SECRET not in caplog.text


# -- TLS ---------------------------------------------------------------------------------
def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate, all PEM."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (make test installs it): cannot make a test CA")
    d = tmp_path_factory.mktemp("tls")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=zklock-test-ca",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=d)
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
                 "-out", f"{name}.csr", cwd=d)
        (d / f"{name}.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=d)
    # ZooKeeper's PEM key store wants the key and its certificate in one file.
    (d / "server-bundle.pem").write_text((d / "server.key").read_text() + (d / "server.pem").read_text())
    return d


@pytest.fixture(scope="module")
def tls_server(tls):
    server = ZooKeeperPeer(secure=True, extra_config={
        "ssl.keyStore.location": str(tls / "server-bundle.pem"),
        "ssl.keyStore.type": "PEM",
        "ssl.trustStore.location": str(tls / "ca.pem"),
        "ssl.trustStore.type": "PEM",
        "ssl.clientAuth": "need",
    })
    with server:
        yield server


def _tls_settings(tls, server, root, **kw):
    return Settings(hosts=server.secure_hosts, root=root, use_ssl=True, ca=str(tls / "ca.pem"),
                    certfile=str(tls / "client.pem"), keyfile=str(tls / "client.key"), connect_timeout=10, **kw)


def test_locks_over_tls(tls, tls_server, zk_root):
    session = Session(_tls_settings(tls, tls_server, zk_root)).start()
    try:
        from celery_zklock.recipes.lock import Lock
        with Lock(session, f"{zk_root}/locks/k-tls", timeout=5) as held:
            assert held.is_held and held.fencing_token
        assert session.client.get_children(f"{zk_root}/locks/k-tls") == []
    finally:
        session.close()


def test_tls_without_a_client_certificate_is_refused(tls, tls_server, zk_root):
    no_cert = Settings(hosts=tls_server.secure_hosts, root=zk_root, use_ssl=True, ca=str(tls / "ca.pem"),
                       connect_timeout=3)
    with pytest.raises(Exception, match="could not reach ZooKeeper"):
        Session(no_cert).start()


def test_tls_with_an_untrusted_server_is_refused(tls, tls_server, zk_root):
    wrong_ca = Settings(hosts=tls_server.secure_hosts, root=zk_root, use_ssl=True, ca=str(tls / "client.pem"),
                        certfile=str(tls / "client.pem"), keyfile=str(tls / "client.key"), connect_timeout=3)
    with pytest.raises(Exception, match="could not reach ZooKeeper"):
        Session(wrong_ca).start()


@pytest.mark.parametrize("auth", [None, "bob:pw"])
def test_a_client_the_roots_acl_refuses_is_told_so_not_that_the_root_kept_changing(secure_app, zk_server, zk_root,
                                                                                    auth):
    # The second new-user trial: a publish (or a lock) by a client without write access to a
    # root another credential made said "could not claim ...: it kept changing", five tries later.
    with lock(secure_app, "made", timeout=5):
        pass  # the root, made under the worker's credential
    from celery import Celery

    other = Celery("bob", set_as_current=False)
    other.conf.update(zklock_hosts=zk_server.hosts, zklock_root=zk_root, zklock_connect_timeout=5,
                      **({"zklock_auth": auth} if auth else {}))
    with pytest.raises(ConfigurationError, match=rf"^zklock_auth: ZooKeeper refused this client a write under "
                                                 rf"zklock_root='{zk_root}' \(NoAuth\)"):
        with lock(other, "theirs", timeout=5):
            pass


def test_a_credential_a_private_roots_acl_refuses_is_a_configuration_error(app, zk_server, zk_root):
    # The third new-user trial: under zklock_acl='private' another credential may not even read
    # the root, and each locked task failed with ZooKeeperUnavailable, "could not read the
    # key-name scheme ... within zklock_connect_timeout=5s", an answer that had come at once.
    app.conf.update(zklock_auth=f"worker:{SECRET}", zklock_acl="private")
    with lock(app, "made", timeout=5):
        pass  # the root, made under the worker's credential, unreadable by anyone else
    from celery import Celery

    other = Celery("other", set_as_current=False)
    other.conf.update(zklock_hosts=zk_server.hosts, zklock_root=zk_root, zklock_connect_timeout=5,
                      zklock_acl="private", zklock_auth=f"other:{SECRET}-2")
    with pytest.raises(ConfigurationError, match=rf"^zklock_auth: ZooKeeper refused to let this client read "
                                                 rf"under zklock_root='{zk_root}' \(NoAuth\)") as refused:
        lock(other, "theirs", timeout=5)
    assert "within" not in str(refused.value) and SECRET not in str(refused.value)
