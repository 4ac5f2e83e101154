"""Zygote and cold-replica processes (``python -m keysmanager.zygote``), started by the KeysManager.

Zygote: load the stage's checkpoint into a shared-memory segment, build the stage runtime and its WSGI
app over tensors mapped copy-on-write from it, then wait for ``fork`` commands on the control socket.
It starts no thread and touches no GPU, so forking it is safe. Per ``fork``: bind the order's ``host``
(the KeysManager's ``host_address``, 127.0.0.1 by default) on port 0, fork; the child (the replica) sets
its CPU budget and environment, copies the parameters in isolated mode, calls ``prepare_device()`` and
serves; the zygote answers ``{pid, port}`` and reaps the children it forked.

Preloader (``--preloader``): a fork server that imported torch, flask, transformers and the stage runtime
once and forks a new zygote per ``spawn`` order (its control socket arrives as a passed descriptor).

Cold replica (``--cold``): a fresh interpreter that loads the stage from disk with the stage runtime's own
loader and serves on the listening socket the KeysManager bound for it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import importlib
import json
import os
import select
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

from quart_stage.memlimit import bound_replica
from quart_stage.privdrop import drop_from_env
from quart_stage.settings import setting

from keysmanager.protocol import LineReader, encode
from keysmanager.sysutil import die_with_parent, listen_socket, reap_children, set_cpu_budget, thread_count


def _replica_setup(env: dict[str, str], cores: list[int], threads: int) -> None:
    os.environ.update(env)
    set_cpu_budget(cores or None, threads)


def _run_child(runtime, app, listen: socket.socket, mm, order: dict, lifeline_fd: int, drain_s: float) -> None:
    """The replica, in the forked child. Never returns."""
    from keysmanager.serve import serve_forever
    from keysmanager.shm_store import privatize

    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if order.get("survive"):
            os.close(lifeline_fd)
            os.setsid()  # leaves the KeysManager's process group: survives its terminal's signals too
            lifeline = None
        else:
            lifeline = lifeline_fd
        _replica_setup(order.get("env", {}), order.get("cores", []), int(order.get("threads", 1)))
        if order.get("mode") == "isolated" and mm is not None:
            privatize(mm)
        runtime.prepare_device()
        set_cpu_budget(None, int(order.get("threads", 1)))  # prepare_device may have set its own default
        bound_replica(runtime.cfg.memory_headroom_bytes, runtime.parameter_bytes)  # RLIMIT_DATA
        drop_from_env(os.environ)  # QUART_RUN_AS: requests are served as the function's own user
        serve_forever(app, listen.detach(), lifeline, drain_s)
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(1)


def run_zygote(args: argparse.Namespace) -> int:
    die_with_parent(args.parent_pid)
    ctrl = socket.socket(fileno=args.control_fd)
    started = time.perf_counter()
    phases = {"spawned": time.monotonic()}  # monotonic times (one clock with the KeysManager's): diagnostics
    try:
        from quart_stage.segment import map_segment

        from keysmanager.live import LIVE_FILE_ENV, build_live
        from keysmanager.shm_store import write_segment
        from keysmanager.stage import build_runtime, stage_checkpoint, warm_up

        live = bool(setting(LIVE_FILE_ENV, str, ""))  # a live start: the stage file is still arriving
        checkpoint = None if live else stage_checkpoint(os.environ)
        if live:  # keysmanager.live
            mm, runtime, app, param_bytes = build_live(os.environ, phases)
            tensors, index = None, None
        elif checkpoint is None:  # a parameter-free (emulated) stage: nothing to share
            mm, tensors, param_bytes, index = None, None, 0, None
        else:
            index = write_segment(checkpoint, Path(args.shm_path))
            mm, tensors = map_segment(index)
            param_bytes = index.total_bytes
        if not live:
            runtime, app = build_runtime(os.environ, tensors)
        warm_up(app)
        phases["warm"] = time.monotonic()
    except BaseException as exc:
        traceback.print_exc()
        ctrl.sendall(encode({"op": "failed", "error": f"{type(exc).__name__}: {exc}"}))
        return 1
    del tensors
    gc.collect()
    gc.freeze()  # objects inherited by replicas are not rewritten by their garbage collector (less CoW)
    ctrl.sendall(encode({"op": "ready", "load_ms": (time.perf_counter() - started) * 1e3,
                         "param_bytes": param_bytes, "threads": thread_count(), "phases": phases,
                         "index": index.to_dict() if index is not None else None}))
    reader = LineReader(ctrl)
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([ctrl], [], [], 0.02)
        if readable:
            messages = reader.read_available()
            if messages is None:  # the KeysManager closed the channel: it is gone or dropped us
                return 0
            for order in messages:
                if order.get("op") == "exit":
                    return 0
                if order.get("op") != "fork":
                    ctrl.sendall(encode({"op": "error", "id": order.get("id"), "error": "unknown op"}))
                    continue
                try:
                    listen = listen_socket(order.get("host", "127.0.0.1"), order.get("unix"))
                    port = 0 if order.get("unix") else listen.getsockname()[1]
                    pid = os.fork()
                except OSError as exc:
                    ctrl.sendall(encode({"op": "error", "id": order.get("id"), "error": str(exc)}))
                    continue
                if pid == 0:
                    ctrl.close()
                    _run_child(runtime, app, listen, mm, order, args.lifeline_fd, args.drain_timeout)
                listen.close()
                children.add(pid)
                ctrl.sendall(encode({"op": "forked", "id": order.get("id"), "pid": pid, "port": port}))
        for pid, code in reap_children() if children else ():  # every child that ended, reported
            children.discard(pid)
            ctrl.sendall(encode({"op": "exited", "pid": pid, "status": code}))


def preload() -> None:
    """Import what every zygote needs (torch, flask, transformers' top level, the stage runtime). No threads.

    A model class's module (e.g. modeling_llama) is not imported here: preloading every family would make the
    preloader slower to be ready than a fresh interpreter. The preloader imports them afterwards, one at a time
    while it is idle (:func:`warm_up_modules`), so later zygotes (a live start's above all) fork with them.
    """
    import flask  # noqa: F401
    import numpy  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    import werkzeug.serving  # noqa: F401
    from quart_stage import app, families, runtime, segment  # noqa: F401

    import keysmanager.serve  # noqa: F401
    import keysmanager.shm_store  # noqa: F401
    import keysmanager.stage  # noqa: F401


def warm_up_modules() -> collections.deque[str]:
    """The model-class modules of every supported family (``transformers.models.<type>.modeling_<type>``)."""
    from quart_stage.families import PLANS

    return collections.deque(f"transformers.models.{t}.modeling_{t}" for t in PLANS)


def run_preloader(args: argparse.Namespace) -> int:
    """A fork server for zygotes: imports once, then forks a zygote per ``spawn`` order.

    Each order comes with the new zygote's control socket as an SCM_RIGHTS file descriptor. Caching a
    stage then costs a fork plus copying its parameters, not an interpreter start plus seconds of imports.
    """
    die_with_parent(args.parent_pid)
    ctrl = socket.socket(fileno=args.control_fd)
    try:
        preload()
    except BaseException as exc:
        traceback.print_exc()
        ctrl.sendall(encode({"op": "failed", "error": f"{type(exc).__name__}: {exc}"}))
        return 1
    gc.collect()
    gc.freeze()
    ctrl.sendall(encode({"op": "ready", "threads": thread_count()}))
    fds: collections.deque[int] = collections.deque()
    buffer = b""
    children: set[int] = set()
    warm = warm_up_modules()
    while True:
        readable, _, _ = select.select([ctrl], [], [], 0.02)
        if not readable and warm:  # idle: import one family's model code (an order waits at most this long)
            with contextlib.suppress(Exception):
                importlib.import_module(warm.popleft())
            if not warm:
                gc.collect()
                gc.freeze()
                ctrl.sendall(encode({"op": "warm"}))  # every family's model code imported: zygotes build at once
        elif readable:
            data, new_fds, _, _ = socket.recv_fds(ctrl, 1 << 16, 16)
            if not data:
                return 0
            fds.extend(new_fds)
            buffer += data
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                if not line.strip():
                    continue
                order = json.loads(line)
                if order.get("op") == "exit":
                    return 0
                if order.get("op") != "spawn" or not fds:
                    ctrl.sendall(encode({"op": "error", "id": order.get("id"), "error": "bad spawn order"}))
                    continue
                zygote_fd = fds.popleft()
                pid = os.fork()
                if pid == 0:
                    code = 1
                    try:
                        ctrl.close()
                        for fd in fds:
                            os.close(fd)
                        log_fd = os.open(order["log_path"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                        os.dup2(log_fd, 1)
                        os.dup2(log_fd, 2)
                        os.close(log_fd)
                        os.environ.clear()
                        os.environ.update(order["env"])
                        zargs = argparse.Namespace(**{**vars(args), "parent_pid": os.getppid(),
                                                      "control_fd": zygote_fd, "shm_path": order["shm_path"]})
                        code = run_zygote(zargs)
                    except BaseException:
                        traceback.print_exc()
                    finally:
                        os._exit(code)
                os.close(zygote_fd)
                children.add(pid)
                ctrl.sendall(encode({"op": "spawned", "id": order.get("id"), "pid": pid}))
        for pid, code in reap_children() if children else ():
            children.discard(pid)
            ctrl.sendall(encode({"op": "exited", "pid": pid, "status": code}))


def run_cold(args: argparse.Namespace) -> int:
    from keysmanager.serve import serve_forever
    from keysmanager.stage import build_runtime

    if not args.survive:
        die_with_parent(args.parent_pid)
    else:
        os.close(args.lifeline_fd)
        os.setsid()
    threads = args.threads
    set_cpu_budget([int(c) for c in args.cores.split(",")] if args.cores else None, threads)
    runtime, app = build_runtime(os.environ, None)
    runtime.prepare_device()
    set_cpu_budget(None, threads)
    bound_replica(runtime.cfg.memory_headroom_bytes, runtime.parameter_bytes)  # RLIMIT_DATA
    drop_from_env(os.environ)  # QUART_RUN_AS
    serve_forever(app, args.listen_fd, None if args.survive else args.lifeline_fd, args.drain_timeout)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m keysmanager.zygote")
    parser.add_argument("--cold", action="store_true", help="serve one cold replica instead of being a zygote")
    parser.add_argument("--preloader", action="store_true", help="be the fork server of zygotes")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--control-fd", type=int)
    parser.add_argument("--listen-fd", type=int)
    parser.add_argument("--lifeline-fd", type=int, required=True)
    parser.add_argument("--shm-path")
    parser.add_argument("--drain-timeout", type=float, default=30.0)
    parser.add_argument("--cores", default="")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--survive", action="store_true")
    args = parser.parse_args(argv)
    if args.preloader:
        return run_preloader(args)
    return run_cold(args) if args.cold else run_zygote(args)


if __name__ == "__main__":
    sys.exit(main())
