"""gunicorn settings of a pipeline stage (read from ./gunicorn.conf.py, overridable from the environment).

preload_app: the stage's parameters load once in the gunicorn master (fork-safe: no threads, no GPU)
and the workers fork from it, sharing them copy-on-write.
"""

import os

bind = os.getenv("QUART_BIND", "127.0.0.1:5000")  # of-watchdog's upstream_url
workers = int(os.getenv("QUART_WORKERS", "1"))
threads = int(os.getenv("QUART_WORKER_THREADS", "1"))
preload_app = os.getenv("QUART_PRELOAD", "1") == "1"
timeout = int(os.getenv("QUART_WORKER_TIMEOUT", "120"))
graceful_timeout = 30
keepalive = 75
accesslog = None
errorlog = "-"
loglevel = os.getenv("QUART_LOG_LEVEL", "info")
