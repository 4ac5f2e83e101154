#!/usr/bin/env python
"""WSGI entrypoint of the pipeline-stage template (the python3-http contract, served by gunicorn).

Every request becomes an `Event` (body, headers, method, query, path) and a `Context` (hostname) and is
passed to ``function/handler.py: handle(event, context)``, which returns ``{"statusCode", "body",
"headers"}``. Bodies may be bytes (activations), str or dict (JSON). Request bodies over
QUART_MAX_BODY_BYTES are refused with 413 from their Content-Length, before they are read.
"""


from flask import Flask, jsonify, request
from function import handler
from quart_stage.logs import AccessLog
from quart_stage.settings import setting
from werkzeug.exceptions import HTTPException

DEFAULT_MAX_BODY_BYTES = 256 * 1024 * 1024

app = Flask(__name__)
app.config["MAX_CONTENT_LENGTH"] = setting("QUART_MAX_BODY_BYTES", int, DEFAULT_MAX_BODY_BYTES)
app.wsgi_app = AccessLog(app.wsgi_app)  # an access line per request on stderr: the function's log


class Event:
    def __init__(self):
        self.body = request.get_data()
        self.headers = request.headers
        self.method = request.method
        self.query = request.args
        self.path = request.path


class Context:
    def __init__(self):
        self.hostname = setting("HOSTNAME", str, "localhost")


def format_status_code(resp):
    if "statusCode" in resp:
        return resp["statusCode"]
    return 200


def format_body(resp):
    if "body" not in resp:
        return ""
    body = resp["body"]
    if isinstance(body, dict):
        return jsonify(body)
    if isinstance(body, (bytes, bytearray, memoryview)):
        return bytes(body)
    return str(body)


def format_headers(resp):
    if "headers" not in resp:
        return []
    if isinstance(resp["headers"], dict):
        return list(resp["headers"].items())
    return resp["headers"]


def format_response(resp):
    if resp is None:
        return ("", 200)
    if isinstance(resp, dict):
        return (format_body(resp), format_status_code(resp), format_headers(resp))
    return resp


@app.errorhandler(HTTPException)
def http_error(exc):
    """Errors raised before the handler runs (413 body too large, 405) as JSON naming the field."""
    field = "body" if exc.code == 413 else "request"
    message = exc.description
    if exc.code == 413:
        message = (f"body of {request.content_length} bytes is over the limit of "
                   f"{app.config['MAX_CONTENT_LENGTH']} bytes (QUART_MAX_BODY_BYTES)")
    resp = jsonify({"error": message, "field": field})
    resp.status_code = exc.code
    if exc.code == 413:
        resp.headers["Connection"] = "close"
    return resp


@app.route("/", defaults={"path": ""}, methods=["GET", "PUT", "POST", "PATCH", "DELETE"])
@app.route("/<path:path>", methods=["GET", "PUT", "POST", "PATCH", "DELETE"])
def call_handler(path):
    event = Event()
    context = Context()
    response_data = handler.handle(event, context)
    return format_response(response_data)


if __name__ == "__main__":
    from gunicorn.app.wsgiapp import run

    run()
