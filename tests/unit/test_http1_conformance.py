"""Conformance and fuzz suite of the two hand-written HTTP/1.1 codecs, h11 the oracle (issue 42, point 6).

The ``/function`` front (server, ``quart_provider.front``) and the lean client to replicas
(``quart_transport.upstream`` over ``.http1``) read the same bytes as h11, split anywhere, pipelined, chunked
or with bad framing. The contract:

- server: every request the front serves is the one h11 reads (method, target, headers as sent, body);
  where h11 refuses, the front never serves: it hands the connection, unread from that request on, to
  aiohttp (which answers) or answers 400 itself; a request h11 reads whole is served or handed over,
  never refused by the front;
- client: the answer (status, end-to-end headers, body) is h11's, and where h11 refuses the client fails
  with an :class:`~quart_transport.upstream.UpstreamError`.

The fuzz part runs with hypothesis, bounded (``max_examples``) and derandomised (the same examples in
every CI run); ``HYPOTHESIS_PROFILE=long`` runs many more.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.http1_oracle import client_reads, front_reads, oracle_requests, oracle_response

settings.register_profile("ci", max_examples=150, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=5000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")

# ---------------------------------------------------------------------------------------------- messages

TOKEN = st.text("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.!#$%&'*+^`|~", min_size=1,
                max_size=12)
VALUE = st.text("abc xyz=;,/\t0123456789\"'()<>@", max_size=20)
ODD_VALUE = st.sampled_from(["a\x00b", "a\rb", "a\nb", "\x7f", "é", "a\x01", "a\x0bb", "\x0c", "a \t b"])
ODD_NAME = st.sampled_from(["X A", "X-A ", " X-A", "X(A)", "", "X\x00"])


def field_lines() -> st.SearchStrategy[list[str]]:
    plain = st.tuples(TOKEN, VALUE).map(lambda kv: f"{kv[0]}: {kv[1]}")
    odd = st.one_of(
        st.tuples(ODD_NAME, VALUE).map(lambda kv: f"{kv[0]}: {kv[1]}"),
        st.tuples(TOKEN, ODD_VALUE).map(lambda kv: f"{kv[0]}: {kv[1]}"),
        st.just("no colon here"),
        st.just(" folded continuation"),
        st.tuples(TOKEN, VALUE).map(lambda kv: f"{kv[0]}:{kv[1]}"),  # no space after the colon: valid
    )
    return st.lists(st.one_of(plain, plain, plain, odd), max_size=4)


CHUNK_SIZES_BAD = st.sampled_from([" 5", "5 ", "g", "-1", "0x5", "+5", "1" * 21, "", "5;", "5 ;x"])
LENGTHS_BAD = st.sampled_from(["+5", "5x", "-5", "0x5", "1_0", "5, 6", "5, 5", " ", "٣", "5\t", "1" * 20])


@st.composite
def body_framing(draw) -> tuple[list[str], bytes]:
    """Headers that frame a body, and the body's bytes on the wire."""
    body = draw(st.binary(max_size=40))
    kind = draw(st.sampled_from(["length", "length", "chunked", "chunked", "none", "conflict", "both",
                                 "bad-length", "te-other", "bad-chunk", "chunk-no-crlf", "two-te"]))
    length = f"{len(body)}"
    if kind == "length":
        return [f"Content-Length: {length}"], body
    if kind == "none":
        return [], b""
    if kind == "conflict":
        return [f"Content-Length: {length}", f"Content-Length: {len(body) + 1}"], body
    if kind == "bad-length":
        return [f"Content-Length: {draw(LENGTHS_BAD)}"], body
    cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=3)))
    pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True) if b > a]
    ext = draw(st.sampled_from(["", ";x=1", ";name", ' ;q="a"']))
    wire = b"".join(f"{len(p):x}{ext}\r\n".encode() + p + b"\r\n" for p in pieces)
    trailer = draw(st.sampled_from([b"", b"X-Trailer: t\r\n"]))
    last = b"0\r\n" + trailer + b"\r\n"
    if kind == "bad-chunk":
        return ["Transfer-Encoding: chunked"], f"{draw(CHUNK_SIZES_BAD)}\r\nhello\r\n".encode() + last
    if kind == "chunk-no-crlf":
        return ["Transfer-Encoding: chunked"], b"3\r\nabcX\r\n" + last
    headers = ["Transfer-Encoding: chunked"]
    if kind == "both":
        headers.append(f"Content-Length: {length}")
    elif kind == "te-other":
        headers = [f"Transfer-Encoding: {draw(st.sampled_from(['gzip, chunked', 'chunked, gzip', 'identity']))}"]
    elif kind == "two-te":
        headers = ["Transfer-Encoding: chunked", "Transfer-Encoding: chunked"]
    return headers, wire + last


@st.composite
def request(draw) -> bytes:
    method = draw(st.sampled_from(["POST", "POST", "PUT", "GET", "DELETE", "PATCH", "P@ST", "HEAD"]))
    target = draw(st.sampled_from(["/function/f", "/function/f/a/b", "/function/f?x=1&y", "/function/f/",
                                   "/function/g", "/system/info", "/function/f%41", "/function/f#frag",
                                   "/function/f x"]))
    version = draw(st.sampled_from(["HTTP/1.1", "HTTP/1.1", "HTTP/1.1", "HTTP/1.0", "HTTP/1.2", "http/1.1"]))
    framing, body = draw(body_framing())
    lines = [*draw(field_lines()), "Host: gw", *framing, *draw(st.sampled_from([[], ["Connection: close"],
                                                                             ["Expect: 100-continue"]]))]
    lines = draw(st.permutations(lines))
    eol = draw(st.sampled_from(["\r\n"] * 6 + ["\n"]))
    head = f"{method} {target} {version}{eol}" + "".join(f"{line}{eol}" for line in lines) + eol
    return head.encode("utf-8") + body


def split(stream: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(stream) + 1) for c in cuts})
    return [stream[a:b] for a, b in zip([0, *points], [*points, len(stream)], strict=True) if b > a]


# ---------------------------------------------------------------------------------------------- the server


def check_front(stream: bytes, pieces: list[bytes], starts: list[int]) -> None:
    """The front's reading of ``pieces`` (``stream`` split) against h11's; ``starts``: each request's offset."""
    oracle, front = oracle_requests(stream), front_reads(pieces)
    where = f"\nstream {stream!r} in pieces of {[len(p) for p in pieces]}; h11: {oracle}; front: {front}"
    served = front.requests
    assert served == oracle.requests[:len(served)], "the front served what h11 did not read" + where
    stopped = front.handover is not None or front.refused is not None
    if oracle.refused is not None:
        assert len(served) <= len(oracle.requests), "the front served past a request h11 refused" + where
        assert stopped or front.out.endswith(b"Connection: close\r\n\r\nok"), \
            f"h11 refused request {len(oracle.requests)}; the front neither handed it over nor refused it" + where
    if front.refused is not None:
        assert front.refused == 400 and oracle.refused is not None and len(served) == len(oracle.requests), \
            "the front refused a request h11 reads" + where
    if front.handover is not None:
        assert front.handover == stream[starts[len(served)]:], "the front consumed bytes of what it handed over" + where
    if not stopped and oracle.refused is None and not front.out.endswith(b"Connection: close\r\n\r\nok"):
        assert len(served) == len(oracle.requests), "h11 read a whole request the front did not serve" + where


def offsets(requests: list[bytes]) -> list[int]:
    starts, at = [], 0
    for raw in requests:
        starts.append(at)
        at += len(raw)
    return [*starts, at]


@settings.get_profile(PROFILE)
@given(st.lists(request(), min_size=1, max_size=3), st.lists(st.integers(0, 10_000), max_size=6))
def test_the_front_reads_pipelined_requests_split_anywhere_as_h11_does(requests, cuts):
    stream = b"".join(requests)
    check_front(stream, split(stream, cuts), offsets(requests))


VALID = [
    b"POST /function/f HTTP/1.1\r\nHost: gw\r\nContent-Length: 5\r\nX-A:  spaced \t\r\n\r\nhello",
    b"PUT /function/f/a?b=1 HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"3;ext=1\r\nabc\r\n2\r\nde\r\n0\r\nX-Trailer: t\r\n\r\n",
    b"GET /function/f HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n",
]
BAD = [
    b"POST /function/f HTTP/1.1\r\nHost: gw\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!",
    b"POST /function/f HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n",
    b"POST /function/f HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n0\r\n\r\n",
    b"POST /function/f HTTP/1.1\r\nHost: gw\r\nX: " + b"v" * 70_000 + b"\r\n\r\n",
    b"POST /function/f HTTP/1.1\r\nHost: gw\r\nX-A : 1\r\n\r\n",
    b"POST /function/f HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n 3\r\nabc\r\n0\r\n\r\n",
    b"POST /function/f HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n3 ;x\r\nabc\r\n0\r\n\r\n",
    b"POST /function/f HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n0x3\r\nabc\r\n0\r\n\r\n",
    b"POST /function/f HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\nbad trailer\r\n\r\n",
    b"POST /function/f HTTP/1.1\r\nHost: gw\r\nX-A: a\x0bb\r\nContent-Length: 0\r\n\r\n",
    b"POST /function/f/\x01 HTTP/1.1\r\nHost: gw\r\nContent-Length: 0\r\n\r\n",
    b"POST /function/f HTTP/1.1\nHost: gw\nContent-Length: 0\n\n",
    b"POST /function/f HTTP/1.1\r\n0: \xc3\xa9 \xff\r\nHost: gw\r\nContent-Length: 0\r\n\r\n",  # found by the long run
]


@pytest.mark.parametrize("raw", VALID + BAD, ids=[f"valid{i}" for i in range(len(VALID))]
                         + [f"bad{i}" for i in range(len(BAD))])
def test_the_front_reads_a_request_split_at_every_byte_as_h11_does(raw):
    stream = VALID[0] + raw  # pipelined behind a good one
    starts = offsets([VALID[0], raw])
    for cut in range(1, len(stream), 1 if len(stream) < 2000 else 997):
        check_front(stream, [stream[:cut], stream[cut:]], starts)
    if len(stream) < 2000:
        check_front(stream, [stream[i:i + 1] for i in range(len(stream))], starts)


# ---------------------------------------------------------------------------------------------- the client


@st.composite
def answer(draw) -> tuple[str, bytes, bool]:
    """A request's method, the replica's answer to it (maybe after interim 1xx answers), and whether the replica
    closes the connection after it."""
    method = draw(st.sampled_from(["POST", "GET", "HEAD"]))
    status = draw(st.sampled_from(["200", "201", "204", "304", "404", "500", "599", "20", "2000", "abc", "200 "]))
    version = draw(st.sampled_from(["HTTP/1.1"] * 5 + ["HTTP/1.0", "HTTP/2", "HTTP/1.1x"]))
    reason = draw(st.sampled_from([" OK", "", " Not Found", " weird reason"]))
    framing, body = draw(body_framing())
    lines = draw(st.permutations([*draw(field_lines()), *framing,
                                  *draw(st.sampled_from([[], ["Connection: close"], ["Connection: keep-alive"]]))]))
    interim = draw(st.sampled_from([b"", b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 103 Early Hints\r\nLink: x\r\n\r\n"]))
    eol = draw(st.sampled_from(["\r\n"] * 6 + ["\n"]))
    head = f"{version} {status}{reason}{eol}" + "".join(f"{line}{eol}" for line in lines) + eol
    return method, interim + head.encode("utf-8") + body, draw(st.booleans())


def check_client(method: str, stream: bytes, pieces: list[bytes], eof: bool) -> None:
    oracle, ours = oracle_response(method, stream, eof), client_reads(method, pieces, eof)
    where = f"\n{method}: {stream!r} in pieces of {[len(p) for p in pieces]}, eof {eof}; h11: {oracle}; ours: {ours}"
    if oracle == "refused":
        assert ours == "refused", f"h11 refuses the answer; the client read {ours!r}" + where
    elif oracle == "waiting":
        assert ours in ("waiting", "refused"), f"h11 waits for more; the client read {ours!r}" + where
    else:
        assert ours == oracle, where


@settings.get_profile(PROFILE)
@given(answer(), st.lists(st.integers(0, 10_000), max_size=6))
def test_the_client_reads_an_answer_split_anywhere_as_h11_does(drawn, cuts):
    method, stream, eof = drawn
    check_client(method, stream, split(stream, cuts), eof)


ANSWERS = [
    ("POST", b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: 1\r\nSet-Cookie: a\r\nSet-Cookie: b\r\n\r\nhello", False),
    ("POST", b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n"
             b"3;ext=1\r\nabc\r\n2\r\nde\r\n0\r\nTrailer: x\r\n\r\n", False),
    ("HEAD", b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n", False),
    ("POST", b"HTTP/1.0 200 OK\r\n\r\nup to the close", True),
    ("POST", b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!", False),
    ("POST", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n", False),
    ("POST", b"HTTP/1.1 200 OK\r\nContent-Length: +5\r\n\r\nhello", False),
    ("POST", b"HTTP/1.1 200 OK\r\nX: " + b"v" * 70_000 + b"\r\n\r\n", False),
    ("POST", b"HTTP/1.1 200 OK\nX-A: 1\n folded\nContent-Length: 2\n\nok", False),
    ("POST", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x3\r\nabc\r\n0\r\n\r\n", False),
    ("POST", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n", False),
    ("POST", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\nbad\r\n\r\n", False),
    ("POST", b"HTTP/2 200 OK\r\nContent-Length: 0\r\n\r\n", False),
    ("POST", b"HTTP/1.1 099 Low\r\nContent-Length: 0\r\n\r\n", False),
]


@pytest.mark.parametrize("method,stream,eof", ANSWERS, ids=[f"answer{i}" for i in range(len(ANSWERS))])
def test_the_client_reads_an_answer_split_at_every_byte_as_h11_does(method, stream, eof):
    for cut in range(1, len(stream), 1 if len(stream) < 2000 else 997):
        check_client(method, stream, [stream[:cut], stream[cut:]], eof)
    if len(stream) < 2000:
        check_client(method, stream, [stream[i:i + 1] for i in range(len(stream))], eof)
