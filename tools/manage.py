"""``quartctl status | list | logs | invoke | scale | rm``: manage a running gateway over its REST API.

The gateway is ``--gateway``, else ``OPENFAAS_URL``, else the one ``quartctl up`` started on ``--state-dir``
(its ``up.json``), else http://127.0.0.1:8080; credentials are ``OPENFAAS_PASSWORD`` (user ``-u``, default
admin) or the ``secrets/`` folder ``quartctl up`` wrote. Every command talks to the same endpoints faas-cli
does (``/system/functions``, ``/system/logs``, ``/system/scale-function``, ``/function``), plus the status
page's JSON (``/ui/api/status``) for ``status``. Errors are one line on stderr: exit 2 for bad input, 1 when
the gateway cannot be reached or refuses.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import requests

DEFAULT_STATE_DIR = Path(".quart")
STATE_FILE = "up.json"


class GatewayError(click.ClickException):
    """The gateway could not be reached or refused: exit 1, one line."""

    exit_code = 1


@dataclass(frozen=True)
class Gateway:
    url: str
    auth: tuple[str, str] | None

    @classmethod
    def locate(cls, gateway: str | None, state_dir: Path, username: str) -> Gateway:
        state: dict[str, Any] = {}
        try:
            state = json.loads((state_dir / STATE_FILE).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        url = (gateway or os.environ.get("OPENFAAS_URL") or state.get("url") or "http://127.0.0.1:8080").rstrip("/")
        return cls(url, _credentials(state_dir, username))

    def request(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        kwargs.setdefault("timeout", 30)
        try:
            return requests.request(method, self.url + path, auth=self.auth, **kwargs)
        except requests.ConnectionError:
            raise GatewayError(f"cannot reach the gateway at {self.url} (is `quartctl up` running? "
                               "--gateway or OPENFAAS_URL point elsewhere)") from None
        except requests.RequestException as exc:
            raise GatewayError(f"{method} {self.url}{path} failed: {exc}") from None

    def json(self, method: str, path: str, **kwargs: Any) -> Any:
        res = self.request(method, path, **kwargs)
        refused(res)
        return res.json() if res.content else None


def _credentials(state_dir: Path, username: str) -> tuple[str, str] | None:
    if os.environ.get("OPENFAAS_PASSWORD"):
        return username, os.environ["OPENFAAS_PASSWORD"]
    secrets = state_dir / "secrets"
    try:
        return ((secrets / "basic-auth-user").read_text().strip(), (secrets / "basic-auth-password").read_text().strip())
    except FileNotFoundError:
        return None


def refused(res: requests.Response) -> None:
    """A one-line GatewayError for an answer that is not a success (the gateway's JSON error when it sent one)."""
    if res.status_code < 400:
        return
    try:
        message = res.json().get("error") or res.text
    except ValueError:
        message = res.text.strip() or res.reason
    if res.status_code == 401:
        message += " (set OPENFAAS_PASSWORD, or run from the folder `quartctl up` ran in)"
    raise GatewayError(f"{res.status_code}: {message}")


def gateway_options(func):
    """--gateway, --state-dir and --username, read into a :class:`Gateway` passed as ``gateway``."""
    func = click.option("-u", "--username", default="admin", show_default=True, help="basic-auth user")(func)
    func = click.option("--state-dir", type=click.Path(path_type=Path), default=DEFAULT_STATE_DIR,
                        show_default=True, help="where `quartctl up` keeps its state and secrets")(func)
    func = click.option("-g", "--gateway", default=None, help="gateway URL (default: OPENFAAS_URL, the running "
                        "`quartctl up`, http://127.0.0.1:8080)")(func)
    return func


def _gateway(gateway: str | None, state_dir: Path, username: str) -> Gateway:
    return Gateway.locate(gateway, state_dir.resolve(), username)


# ---------------------------------------------------------------------------------------------- commands


@click.command("list")
@gateway_options
@click.option("--json", "as_json", is_flag=True, help="print the gateway's JSON")
def list_functions(gateway: str | None, state_dir: Path, username: str, as_json: bool) -> None:
    """list deployed functions: replicas, readiness, invocations (as `faas-cli list`)"""
    functions = _gateway(gateway, state_dir, username).json("GET", "/system/functions")
    if as_json:
        click.echo(json.dumps(functions, indent=1))
        return
    from quart_tools.tables import print_table

    rows = [(f["name"], f.get("labels", {}).get("com.quart.model", ""), f.get("replicas", 0),
             f.get("availableReplicas", 0), int(f.get("invocationCount", 0)), f.get("status", ""),
             f.get("reason", "")) for f in sorted(functions, key=lambda f: f["name"])]
    print_table("Functions", ("function", "model", "desired", "ready", "invocations", "status", "reason"), rows)


@click.command("status")
@gateway_options
@click.option("--model", default=None, help="only this pipeline")
@click.option("--json", "as_json", is_flag=True, help="print the status JSON (/ui/api/status)")
def status(gateway: str | None, state_dir: Path, username: str, model: str | None, as_json: bool) -> None:
    """pipelines, stages, queues, replicas and hosts, start sources, key stages, last decisions (as /ui/)"""
    target = _gateway(gateway, state_dir, username)
    res = target.request("GET", "/ui/api/status")
    if res.status_code == 404:
        raise GatewayError(f"{target.url} has no QUART plugin attached (no /ui/api/status); `quartctl list` shows "
                           "its functions")
    refused(res)
    doc = res.json()
    if model is not None:
        known = [p["model"] for p in doc["pipelines"]]
        if model not in known:
            raise click.BadParameter(f"no pipeline {model!r}; deployed: {', '.join(known) or 'none'}",
                                     param_hint="--model")
        doc["pipelines"] = [p for p in doc["pipelines"] if p["model"] == model]
    if as_json:
        click.echo(json.dumps(doc, indent=1))
        return
    from quart_tools.tables import print_status

    print_status(doc, target.url)


@click.command("logs")
@gateway_options
@click.argument("name")
@click.option("--tail", type=click.IntRange(min=0), default=0, help="the last N lines (0: all)")
@click.option("--since", default=None, help="only lines after this RFC3339 time")
@click.option("--instance", default="", help="one replica")
@click.option("-f", "--follow", is_flag=True, help="keep streaming new lines (Ctrl-C stops)")
def logs(gateway: str | None, state_dir: Path, username: str, name: str, tail: int, since: str | None,
         instance: str, follow: bool) -> None:
    """a function's replica logs: access lines, errors (as `faas-cli logs`)"""
    params = {"name": name, "tail": str(tail), "follow": "true" if follow else "false", "instance": instance}
    if since:
        params["since"] = since
    res = _gateway(gateway, state_dir, username).request("GET", "/system/logs", params=params, stream=True,
                                                         timeout=None if follow else 30)
    refused(res)
    try:
        for line in res.iter_lines():
            if line:
                msg = json.loads(line)
                click.echo(f"{msg['timestamp']} {msg['instance']} {msg['text']}")
    except KeyboardInterrupt:
        pass
    finally:
        res.close()


def _chunks(res: requests.Response) -> Iterator[bytes]:
    yield from res.iter_content(chunk_size=None)


@click.command("invoke")
@gateway_options
@click.argument("name")
@click.option("-d", "--data", default=None, help="request body (default: read stdin)")
@click.option("--content-type", default="application/json", show_default=True)
@click.option("-H", "--header", "headers", multiple=True, help="extra header NAME:VALUE (repeatable)")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=300.0, show_default=True,
              help="seconds to wait for the answer")
def invoke(gateway: str | None, state_dir: Path, username: str, name: str, data: str | None, content_type: str,
           headers: tuple[str, ...], timeout: float) -> None:
    """call a function or pipeline, print the answer as it arrives (streams generation)"""
    sent = {"Content-Type": content_type}
    for header in headers:
        key, sep, value = header.partition(":")
        if not sep or not key.strip():
            raise click.BadParameter(f"{header!r} must be NAME:VALUE", param_hint="--header")
        sent[key.strip()] = value.strip()
    body = data.encode() if data is not None else sys.stdin.buffer.read()
    res = _gateway(gateway, state_dir, username).request("POST", f"/function/{name}", data=body, headers=sent,
                                                         stream=True, timeout=timeout)
    refused(res)
    out = sys.stdout.buffer
    last = b""
    for chunk in _chunks(res):  # server-sent events of a generation arrive token by token
        out.write(chunk)
        out.flush()
        last = chunk or last
    if last and not last.endswith(b"\n") and out.isatty():
        out.write(b"\n")


@click.command("scale")
@gateway_options
@click.argument("name")
@click.option("-r", "--replicas", type=click.IntRange(min=0), required=True, help="desired replicas (0: none)")
def scale(gateway: str | None, state_dir: Path, username: str, name: str, replicas: int) -> None:
    """set the desired replicas of a function, or of every stage of a pipeline"""
    _gateway(gateway, state_dir, username).json("POST", f"/system/scale-function/{name}",
                                                json={"serviceName": name, "replicas": replicas})
    click.echo(f"{name}: scaling to {replicas} replica(s)")


@click.command("rm")
@gateway_options
@click.argument("names", nargs=-1, required=True)
def remove(gateway: str | None, state_dir: Path, username: str, names: tuple[str, ...]) -> None:
    """remove functions; a pipeline's name removes all its stages"""
    target = _gateway(gateway, state_dir, username)
    for name in names:
        res = target.request("DELETE", "/system/functions", json={"functionName": name})
        if res.status_code == 404:
            stages = _stage_functions(target, name)
            if stages:
                for stage in stages:
                    refused(target.request("DELETE", "/system/functions", json={"functionName": stage}))
                click.echo(f"Removed pipeline {name}: {', '.join(stages)}")
                continue
        refused(res)
        click.echo(f"Removed {name}")


def _stage_functions(target: Gateway, model: str) -> list[str]:
    """The stage functions of pipeline ``model`` (its model status' annotation), or [] if it is none."""
    res = target.request("GET", f"/system/function/{model}")
    if res.status_code != 200:
        return []
    annotation = (res.json().get("annotations") or {}).get("com.quart.stage-functions", "")
    return [s for s in annotation.split(",") if s]


COMMANDS = (status, list_functions, logs, invoke, scale, remove)
