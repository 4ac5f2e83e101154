"""The built-in quart/echo replica's parser: the same answers whatever the segmenting of the byte stream."""

from __future__ import annotations

import random

from quart_provider.echo import EchoProtocol


class Transport:
    def __init__(self) -> None:
        self.out = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.out += data

    def close(self) -> None:
        self.closed = True


def feed(stream: bytes, cuts: list[int]) -> Transport:
    transport, protocol = Transport(), EchoProtocol()
    protocol.connection_made(transport)
    last = 0
    for cut in [*sorted(cuts), len(stream)]:
        if cut > last:
            protocol.data_received(stream[last:cut])
            last = cut
    return transport


def test_pipelined_requests_are_answered_in_order_however_the_stream_is_cut():
    stream = (b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello"
              b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3;e=1\r\nabc\r\n2\r\nde\r\n0\r\nT: 1\r\n\r\n"
              b"GET /_/health HTTP/1.1\r\ncontent-length: 2\r\n\r\nzz"
              b"POST / HTTP/1.1\r\nConnection: keep-alive\r\nContent-Length: 0\r\n\r\n"
              b"POST / HTTP/1.1\r\nContent-Length: 3\r\nConnection: close\r\n\r\nbye")
    whole = feed(stream, [])
    assert whole.out.count(b"HTTP/1.1 200 OK") == 5 and whole.closed
    bodies = [part.split(b"\r\n\r\n", 1)[1] for part in whole.out.split(b"HTTP/1.1 200 OK")[1:]]
    assert bodies == [b"hello", b"abcde", b"", b"", b"bye"]
    rng = random.Random(7)
    for _ in range(300):
        cuts = rng.sample(range(1, len(stream)), rng.randint(1, 12))
        assert feed(stream, cuts).out == whole.out, cuts
    for i in range(1, len(stream)):  # every single cut point
        assert feed(stream, [i]).out == whole.out, i


def test_malformed_heads_are_400_and_close():
    for bad in (b"POST / HTTP/1.1\r\nContent-Length: 1x\r\n\r\n", b"POST / HTTP/1.1\r\nContent-Length: 1\r\n"
                b"Content-Length: 2\r\n\r\nab", b"POST /\r\n\r\n",
                b"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"):
        t = feed(bad, [])
        assert t.out.startswith(b"HTTP/1.1 400") and t.closed, bad
    assert feed(b"POST / HTTP/1.0\r\nContent-Length: 1\r\n\r\nx", []).closed  # HTTP/1.0: close after
