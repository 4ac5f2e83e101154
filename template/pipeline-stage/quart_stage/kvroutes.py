"""The KV-cache migration routes of a stage replica: ``GET`` / ``PUT /_/sessions/<id>/kv`` (the format and its
checks: `quart_stage.kvmigrate`; docs/generation.md), and ``DELETE /_/sessions/<id>/kv?layers=A-B`` (a re-cut)."""

from __future__ import annotations

from collections.abc import Mapping

from quart_stage import kvmigrate
from quart_stage.errors import QuartError, invalid
from quart_stage.layers import H_LAYERS, not_held, parse_layers
from quart_stage.response import StageResponse
from quart_stage.sessions import SESSION_ID, count_header

H_FROM, H_STAGED = "X-Quart-Session-From", "X-Quart-KV-Staged"


def export_response(runtime, session_id: str, layers: str | None, start: str | None = None):
    """``GET /_/sessions/<id>/kv[?layers=A-B][&from=P]``: the session's cache for the blocks of ``layers`` (default:
    what the replica holds), positions ``P`` on (default all), as `encode` writes it; 404 when the replica does not
    hold the session, 409 when it holds fewer than ``P`` positions."""
    gen = runtime.generation
    try:
        span = parse_layers(layers, runtime.stage_range) if runtime.stage_range else (0, 0)
        first = count_header(start, "from")
        with gen.table.holding(session_id) as s:  # the session's steps wait only for taking the tensors
            if first > s.tokens:
                raise QuartError(409, f"the session holds {s.tokens} positions here, not {first} or more", "from")
            tokens, seed = s.tokens, getattr(s.state, "seed", 0)
            tensors = kvmigrate.cache_tensors(s.state, span, runtime.total_layers, first)
        # encoded (sha256, safetensors) outside the lock: a step appends past these positions (a paged buffer) or
        # builds new tensors (transformers' cache), so the ones taken do not change
        body = kvmigrate.encode(session_id, tokens, span, tensors, seed, first)
    except QuartError as exc:
        return StageResponse.error(exc, exc.headers)
    return StageResponse(200, [body], {"Content-Type": kvmigrate.KV_TYPE, "X-Quart-Session-Pos": str(tokens)})


def import_response(runtime, session_id: str, body: bytes, headers: Mapping[str, str]):
    """``PUT /_/sessions/<id>/kv`` (``X-Quart-Session-Pos``: the positions the export holds, optional
    ``X-Quart-Session-Reserve``): verify every tensor (400 ``field kv``, nothing changed), then install it
    into the session (a new one at that many positions, or one holding exactly that many: 409 otherwise). With
    ``X-Quart-Layers: A-B`` the session runs those layers afterwards (a re-cut widens a live replica's part; 503
    while the replica does not hold them all), else its whole stage. A re-cut comes in two: the pre-copy
    (``X-Quart-KV-Staged: 1``: the layers wait beside the part, which goes on stepping) and the positions since
    (``X-Quart-Session-From``: the first of them), which widen the part."""
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
        start = count_header(lower.get(H_FROM.lower()), H_FROM)
        staged = lower.get(H_STAGED.lower()) == "1"
        span = after_install(runtime, lower.get(H_LAYERS.lower()))
        if staged and span is None:
            raise invalid("layers", f"{H_STAGED} needs {H_LAYERS} (the part the session will run)")
        tensors, meta = kvmigrate.decode(body, session_id, tokens, start)
        cover = kvmigrate.block_layers(span, runtime.total_layers) if span is not None and not staged else None
        seed = meta.get("seed", 0)
        gen.table.adopt(session_id, tokens, reserve, lambda: gen.new_state(seed if isinstance(seed, int) else 0),
                        lambda state: kvmigrate.install(state, tensors, tokens, cover, start), span,
                        runtime.stage_range if span is not None else None, staged)
    except QuartError as exc:
        return StageResponse.error(exc, {**exc.headers, **gen.headers(session_id)})
    except ValueError as exc:
        return StageResponse.error(invalid(kvmigrate.FIELD, str(exc)), gen.headers(session_id))
    return StageResponse(204, [], gen.headers(session_id))


def after_install(runtime, value: str | None) -> tuple[int, int] | None:
    """The layers a session runs after an install with ``X-Quart-Layers: value``: None for the whole stage."""
    if value is None or runtime.stage_range is None:
        return None
    span = parse_layers(value, runtime.stage_range)
    held = runtime.held()
    if held is None or not held[0] <= span[0] < span[1] <= held[1]:
        raise not_held(span, held or (span[0], span[0]))
    return None if span == runtime.stage_range else span


def trim_response(runtime, session_id: str, layers: str | None):
    """``DELETE /_/sessions/<id>/kv?layers=A-B``: the session stops running the first layers ``A-B`` of its part
    here, their cache is freed (a re-cut moved it to the replica that runs the part before); 204, 404 unknown,
    409 when ``A-B`` is not a proper first part of what it runs."""
    gen = runtime.generation
    try:
        if layers is None or runtime.stage_range is None:
            raise invalid("layers", "DELETE /_/sessions/<id>/kv needs ?layers=A-B (the first layers to drop)")
        drop = parse_layers(layers, runtime.stage_range)
        gen.table.trim(session_id, drop, runtime.stage_range,
                       lambda state: kvmigrate.drop(state, drop, runtime.total_layers))
    except QuartError as exc:
        return StageResponse.error(exc, {**exc.headers, **gen.headers(session_id)})
    return StageResponse(204, [], gen.headers(session_id))
