"""The KV-cache migration routes of a stage replica: ``GET`` / ``PUT /_/sessions/<id>/kv`` (the format and its
checks: `quart_stage.kvmigrate`; docs/generation.md)."""

from __future__ import annotations

from collections.abc import Mapping

from quart_stage import kvmigrate
from quart_stage.errors import QuartError, invalid
from quart_stage.layers import parse_layers
from quart_stage.response import StageResponse
from quart_stage.sessions import SESSION_ID, count_header


def export_response(runtime, session_id: str, layers: str | None):
    """``GET /_/sessions/<id>/kv[?layers=A-B]``: the session's cache for the blocks of ``layers`` (default:
    what the replica holds), as `encode` writes it; 404 when the replica does not hold the session."""
    gen = runtime.generation
    try:
        span = parse_layers(layers, runtime.stage_range) if runtime.stage_range else (0, 0)
        with gen.table.holding(session_id) as s:
            body = kvmigrate.encode(session_id, s.tokens, span, kvmigrate.cache_tensors(s.state, span, runtime.total_layers),
                          getattr(s.state, "seed", 0))
    except QuartError as exc:
        return StageResponse.error(exc, exc.headers)
    return StageResponse(200, [body], {"Content-Type": kvmigrate.KV_TYPE, "X-Quart-Session-Pos": str(s.tokens)})


def import_response(runtime, session_id: str, body: bytes, headers: Mapping[str, str]):
    """``PUT /_/sessions/<id>/kv`` (``X-Quart-Session-Pos``: the positions the export holds, optional
    ``X-Quart-Session-Reserve``): verify every tensor (400 ``field kv``, nothing changed), then install it
    into the session (a new one at that many positions, or one holding exactly that many: 409 otherwise)."""
    gen = runtime.generation
    lower = {k.lower(): v for k, v in headers.items()}
    try:
        if not SESSION_ID.fullmatch(session_id):
            raise invalid("session", f"session id must be 1..128 characters of A-Z a-z 0-9 . _ : -, got "
                                     f"{session_id[:140]!r}")
        if not gen.decoder:
            raise invalid("session", f"model {runtime.model!r} is not a decoder: it has no KV cache")
        tokens = count_header(lower.get("x-quart-session-pos"), "X-Quart-Session-Pos", required=True)
        reserve = count_header(lower.get("x-quart-session-reserve"), "X-Quart-Session-Reserve")
        tensors, meta = kvmigrate.decode(body, session_id, tokens)
        seed = meta.get("seed", 0)
        gen.table.adopt(session_id, tokens, reserve, lambda: gen.new_state(seed if isinstance(seed, int) else 0),
                        lambda state: kvmigrate.install(state, tensors, tokens))
    except QuartError as exc:
        return StageResponse.error(exc, {**exc.headers, **gen.headers(session_id)})
    except ValueError as exc:
        return StageResponse.error(invalid(kvmigrate.FIELD, str(exc)), gen.headers(session_id))
    return StageResponse(204, [], gen.headers(session_id))
