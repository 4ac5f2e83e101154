"""A batched decode step on a stage replica: one position for each of several sessions, run as one batch.

The gateway forms the batch where the sessions' steps wait for this replica (docs/batching.md#decode); the
wire is :mod:`quart_stage.batchwire`. Every session is checked and held on its own first (its lock, its
position, its KV room: a 409 / 429 / 400 is that session's answer only, the others run); the sessions held
then run as one batch (:class:`quart_stage.ragged.RaggedCache`: batched projections, attention per session
against its own cache); the last stage samples each session's token from its own row with its own parameters
at its own position, exactly as an unbatched step. A compute failure frees every session of the batch (their
caches may be half-updated; each answers 500 and the gateway replays it). Emulated compute sleeps one decode
step for the whole batch (an accelerator's batch costs about one step) and answers each session's own token.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from contextlib import ExitStack

import torch

from quart_stage import batchwire, wire
from quart_stage.batchwire import META_RESULTS, META_SESSIONS, BatchEntry
from quart_stage.errors import QuartError, invalid
from quart_stage.inputs import HIDDEN, INPUT_IDS
from quart_stage.kvcache import FIELD, H_KV_TOKENS
from quart_stage.response import H_COMPUTE, H_DESER, H_REQUEST_ID, H_SER, JSON_TYPE, StageResponse, elapsed_ms
from quart_stage.sampling import GREEDY, SampleParams, answer, sample_from


def _error_doc(entry: BatchEntry, exc: QuartError) -> dict:
    doc = {"id": entry.id, "status": exc.status, "error": exc.message, "field": exc.field}
    doc.update(exc.detail or {})
    if "Retry-After" in exc.headers:
        doc["retry_after"] = int(exc.headers["Retry-After"])
    return doc


class BatchedSteps:
    """The batched decode steps of one replica's :class:`quart_stage.sessions.Generation`."""

    def __init__(self, generation) -> None:
        self.gen = generation

    def parse(self, body, headers: Mapping[str, str]) -> tuple[list[BatchEntry], torch.Tensor]:
        """The table and the stacked rows of a batched step (lower-case headers); 400 naming what is wrong."""
        rt, gen = self.gen.rt, self.gen
        count = batchwire.parse_count(headers[batchwire.H_SESSION_BATCH.lower()], rt.cfg.max_batch)
        if not gen.decoder:
            raise invalid(FIELD, f"model {rt.model!r} is not a decoder: it has no generation sessions")
        if headers.get("x-quart-layers") is not None:
            raise invalid(FIELD, "a session request runs the whole stage; drop X-Quart-Layers")
        ctype = headers.get("content-type", wire.CONTENT_TYPE).split(";")[0].strip().lower()
        if ctype != wire.CONTENT_TYPE:
            raise invalid("content-type", f"a batched step is {wire.CONTENT_TYPE} (safetensors)", status=415)
        decoded = wire.decode(body)
        entries = batchwire.parse_table(decoded.metadata.get(META_SESSIONS), count)
        name = INPUT_IDS if rt.shape.takes_ids else HIDDEN
        if set(decoded.tensors) != {name}:
            raise invalid(FIELD, f"a batched step at stage {rt.stage_index} carries exactly one tensor, {name}")
        rows = decoded.tensors[name]
        width = () if name == INPUT_IDS else (rt.shape.in_width,)
        if tuple(rows.shape) != (count, 1, *width):
            raise invalid(name, f"a batched step of {count} sessions carries shape {[count, 1, *width]}, "
                                f"got {list(rows.shape)}")
        if name == INPUT_IDS:
            rows = rows.long()
            vocab = rt.shape.vocab_size or gen.vocab
            if rows.min() < 0 or rows.max() >= vocab:
                raise invalid(INPUT_IDS, f"token ids must be in [0, {vocab})")
        elif rows.dtype != rt.shape.dtype:
            raise invalid(HIDDEN, f"hidden_states must be {rt.shape.dtype}, got {rows.dtype}")
        return entries, rows

    def step(self, entries: list[BatchEntry], rows: torch.Tensor, base: dict[str, str], t0: float) -> StageResponse:
        """Hold every session that can step, run them as one batch, answer each one's result."""
        gen, rt = self.gen, self.gen.rt
        t1 = time.perf_counter()
        results: list[dict | None] = [None] * len(entries)
        samples: dict[int, SampleParams] = {}
        held: list[tuple[int, object]] = []
        output = None
        rt.prepare_device()
        emulated = rt.cfg.compute == "emulated"
        try:
            with ExitStack() as stack:
                for row in sorted(range(len(entries)), key=lambda r: entries[r].id):  # one lock order: no deadlock
                    e = entries[row]
                    try:
                        samples[row] = sample_from(dict(e.sample)) if e.sample else GREEDY
                        samples[row].check_logits(emulated and gen.last)
                        gen.check_reach(e.pos + 1)
                        session = stack.enter_context(gen.table.step(e.id, e.pos, 1, 0, lambda: None))
                    except QuartError as exc:
                        results[row] = _error_doc(e, exc)
                        continue
                    held.append((row, session))
                held.sort(key=lambda h: h[0])
                if held:
                    output = self._compute([entries[r] for r, _ in held], [samples[r] for r, _ in held],
                                           rows[[r for r, _ in held]], [s.state for _, s in held], emulated)
        except Exception as exc:  # noqa: BLE001 - the held sessions were freed on the way out; each answers 500
            err = QuartError(500, f"stage compute failed: {exc}", "compute")
            for row, _ in held:
                results[row] = _error_doc(entries[row], err)
            output = None
        t2 = time.perf_counter()
        ok = [r for r, _ in held if results[r] is None]
        for k, row in enumerate(ok):
            e = entries[row]
            results[row] = {"id": e.id, "status": 200, "pos": e.pos + 1}
            if gen.last:
                results[row].update(output[k])
            if e.end:
                gen.table.drop(e.id)
        headers = {**base, H_KV_TOKENS: gen.table.occupancy(), H_DESER: elapsed_ms(t0, t1),
                   H_COMPUTE: elapsed_ms(t1, t2)}
        if gen.last:
            chunks, ctype = [json.dumps({META_RESULTS: results}).encode()], JSON_TYPE
        else:
            meta = {**rt.next_hop_meta(base[H_REQUEST_ID], False), META_RESULTS: json.dumps(results),
                    META_SESSIONS: json.dumps([entries[r].doc() for r in ok])}
            hidden = output if output is not None else torch.empty((0, 1, rt.shape.out_width), dtype=rt.shape.dtype)
            chunks, ctype = wire.encode_chunks({HIDDEN: hidden}, meta), wire.CONTENT_TYPE
        headers.update({"Content-Type": ctype, H_SER: elapsed_ms(t2)})
        return StageResponse(200, chunks, headers)

    def _compute(self, entries: list[BatchEntry], samples: list[SampleParams], rows: torch.Tensor, states: list,
                 emulated: bool):
        gen, rt = self.gen, self.gen.rt
        if emulated:
            ids = gen.emulated_ids({INPUT_IDS if rt.shape.takes_ids else HIDDEN: rows})
            time.sleep(rt.step_time.sample_ms(1, rt._rng) / 1000.0)
            for state, row_ids in zip(states, ids, strict=True):
                gen.emulated_append(state, row_ids)
            if gen.last:
                return [{"token": state.token(gen.vocab)} for state in states]
            return gen.emulated_activation(ids)
        from quart_stage.ragged import RaggedCache

        name = INPUT_IDS if rt.shape.takes_ids else HIDDEN
        past = torch.tensor([e.pos for e in entries], dtype=torch.long)
        out = rt.module({name: rows.to(rt._device)}, cache=RaggedCache(states), past=past)
        if not gen.last:
            return out.cpu() if out.device.type != "cpu" else out
        return [answer(out[k, -1], samples[k], e.pos + 1) for k, e in enumerate(entries)]
