"""Settings of the example app. ``demo.py`` fills in the private ports of the servers it starts."""

import os

broker_url = os.environ.get("DEMO_BROKER_URL", "redis://127.0.0.1:6379/0")
zklock_hosts = os.environ.get("DEMO_ZK_HOSTS", "127.0.0.1:2181")
zklock_root = "/celery-zklock-demo"
zklock_session_timeout = 6
zklock_connect_timeout = 10
