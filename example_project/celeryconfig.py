"""Settings of the example app. ``demo.py`` fills in the private ports of the servers it starts."""

import os

from celery.schedules import crontab

broker_url = os.environ.get("DEMO_BROKER_URL", "redis://127.0.0.1:6379/0")
result_backend = broker_url
zklock_hosts = os.environ.get("DEMO_ZK_HOSTS", "127.0.0.1:2181")
zklock_root = "/celery-zklock-demo"
zklock_session_timeout = 4  # how long a crashed worker's locks, or a dead beat leader, block others
zklock_connect_timeout = 10
zklock_default_timeout = 60
# Each worker and beat of the demo serves its metrics on a port of its own (demo.py picks them).
zklock_metrics_port = int(os.environ["DEMO_METRICS_PORT"]) if os.environ.get("DEMO_METRICS_PORT") else None

worker_prefetch_multiplier = 1
broker_connection_retry_on_startup = True
beat_scheduler = "celery_zklock.beat:LeaderScheduler"
beat_max_loop_interval = 1
beat_schedule = {
    "heartbeat": {"task": "example_project.maintenance.heartbeat", "schedule": 2.0},
    "cleanup": {"task": "example_project.maintenance.cleanup", "schedule": crontab(minute="*")},
}
