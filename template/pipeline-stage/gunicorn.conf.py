"""gunicorn settings of a pipeline stage (read from ./gunicorn.conf.py, overridable from the environment).

preload_app: the stage's parameters load once in the gunicorn master (fork-safe: no threads, no GPU)
and the workers fork from it, sharing them copy-on-write.
"""

from quart_stage.settings import setting

bind = setting("QUART_BIND", str, "127.0.0.1:5000")  # of-watchdog's upstream_url
workers = setting("QUART_WORKERS", int, 1)
threads = setting("QUART_WORKER_THREADS", int, 1)
preload_app = setting("QUART_PRELOAD", bool, True)
timeout = setting("QUART_WORKER_TIMEOUT", int, 120)
graceful_timeout = 30
keepalive = 75
limit_request_field_size = 1 << 18  # X-Quart-Sample carries the ids a repetition penalty reads (5.3 B a token)
accesslog = None
errorlog = "-"
loglevel = setting("QUART_LOG_LEVEL", str, "info")


def post_fork(server, worker):
    """A worker serves under RLIMIT_DATA (quart_stage.memlimit): one request cannot take the host."""
    from quart_stage.config import StageConfig
    from quart_stage.memlimit import bound_replica

    limit = bound_replica(StageConfig.from_env().memory_headroom_bytes, 0)
    server.log.info("worker %s: private memory bounded at %s bytes (QUART_MEMORY_HEADROOM_BYTES)", worker.pid, limit)
