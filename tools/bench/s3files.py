"""A read-only S3 endpoint over a folder, for benchmarks whose registry must serve ranged reads at line rate.

``python -m quart_tools.bench.s3files --root DIR --host ADDR --port N``: ``GET``/``HEAD /<bucket>/<key>`` answer
the file ``DIR/<bucket>/<key>`` as S3's GetObject/HeadObject do (``Range: bytes=a-b`` → 206 with
``Content-Range``; the bytes go by ``sendfile`` from the page cache), ``HEAD /<bucket>`` answers 200 for a
folder, anything missing answers S3's ``NoSuchKey`` / ``NoSuchBucket`` XML; nothing can be written (the
benchmark places the model folder under ``DIR`` itself). Requests are not authenticated: boto3's signatures
are accepted unread. It stands in for an object store (S3, MinIO) that serves a ranged read without reading
the whole object — moto reads the whole object for every GET (``quart_tools.bench.paraserve``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from aiohttp import web
from quart_stage import cliargs

_XML = '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message></Error>'


def _error(status: int, code: str, message: str) -> web.Response:
    return web.Response(status=status, text=_XML.format(code=code, message=message), content_type="application/xml")


def make_app(root: Path) -> web.Application:
    """The endpoint's aiohttp application over ``root`` (a folder per bucket)."""
    root = root.resolve()

    async def handle(request: web.Request) -> web.StreamResponse:
        path = request.match_info["path"].strip("/")
        bucket, _, key = path.partition("/")
        if not bucket or not (root / bucket).is_dir():
            return _error(404, "NoSuchBucket", f"bucket {bucket!r} does not exist")
        if not key:
            return web.Response(status=200)  # HeadBucket / a bucket listing is not needed by the registry
        target = (root / bucket / key).resolve()
        if root not in target.parents or not target.is_file():
            return _error(404, "NoSuchKey", f"no object {key!r}")
        return web.FileResponse(target, headers={"Content-Type": "application/octet-stream"})

    app = web.Application()
    app.router.add_route("GET", "/{path:.*}", handle)
    app.router.add_route("HEAD", "/{path:.*}", handle)
    return app


def main(argv: list[str]) -> int:
    p = cliargs.ArgumentParser(prog="python -m quart_tools.bench.s3files", description=__doc__.split("\n\n")[0])
    p.add_argument("--root", required=True, help="folder holding one folder per bucket")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    web.run_app(make_app(Path(args.root)), host=args.host, port=args.port, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
