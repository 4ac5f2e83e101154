"""Validation of a stage request's tensors against the shape of the layer range it runs (4xx naming the field)."""

from __future__ import annotations

import torch

from quart_stage.config import StageConfig
from quart_stage.errors import invalid
from quart_stage.layers import Shape

INPUT_IDS, TOKEN_TYPE_IDS, HIDDEN, LOGITS = "input_ids", "token_type_ids", "hidden_states", "logits"
ATTENTION_MASK = "attention_mask"  # batch × sequence, 1 = token, 0 = padding; every stage passes it on
SEGMENT_LENGTHS = "segment_lengths"  # a packed batch: one row, these sequences end to end; every stage passes it on


def validate(inputs: dict[str, torch.Tensor], s: Shape, cfg: StageConfig, stage_index: int) -> None:
    """Check (and normalize in place) a request's tensors against the shape of the range it runs."""
    if s.takes_ids:
        allowed = {INPUT_IDS, ATTENTION_MASK, SEGMENT_LENGTHS} | ({TOKEN_TYPE_IDS} if s.type_vocab_size else set())
        if INPUT_IDS not in inputs:
            raise invalid(INPUT_IDS, f"missing; stage {stage_index} takes token ids")
    else:
        allowed = {HIDDEN, ATTENTION_MASK, SEGMENT_LENGTHS}
        if HIDDEN not in inputs:
            raise invalid(HIDDEN, f"missing; stage {stage_index} takes {HIDDEN}")
    for name in inputs:
        if name not in allowed:
            raise invalid(name, f"unexpected tensor; stage {stage_index} takes {sorted(allowed)}")
    if s.takes_ids:
        for name in (INPUT_IDS, TOKEN_TYPE_IDS):
            if name not in inputs:
                continue
            t = inputs[name]
            if t.dtype not in (torch.int64, torch.int32):
                raise invalid(name, f"dtype must be int64 or int32, got {dt(t.dtype)}")
            if t.dim() != 2:
                raise invalid(name, f"rank must be 2 (batch, sequence), got shape {list(t.shape)}")
            limit = s.vocab_size if name == INPUT_IDS else s.type_vocab_size
            if t.numel() and (int(t.min()) < 0 or (limit is not None and int(t.max()) >= limit)):
                raise invalid(name, f"values must be in [0, {limit}), got [{int(t.min())}, {int(t.max())}]")
            inputs[name] = t.long()
        if TOKEN_TYPE_IDS in inputs and inputs[TOKEN_TYPE_IDS].shape != inputs[INPUT_IDS].shape:
            raise invalid(TOKEN_TYPE_IDS, "shape must equal input_ids' shape")
        batch, seq = inputs[INPUT_IDS].shape
        name = INPUT_IDS
    else:
        t = inputs[HIDDEN]
        if t.dtype != s.dtype:
            raise invalid(HIDDEN, f"dtype must be {dt(s.dtype)}, got {dt(t.dtype)}")
        if t.dim() != 3:
            raise invalid(HIDDEN, f"rank must be 3 (batch, sequence, hidden), got shape {list(t.shape)}")
        batch, seq, width = t.shape
        if width != s.in_width and not (cfg.compute == "emulated" and cfg.emulated_activation_bytes):
            raise invalid(HIDDEN, f"shape {list(t.shape)} must end in the hidden size {s.in_width}")
        name = HIDDEN
    if not 1 <= batch <= cfg.max_batch:
        raise invalid(name, f"batch size must be 1..{cfg.max_batch}, got {batch}")
    if seq < 1 or (s.max_seq is not None and seq > s.max_seq):
        raise invalid(name, f"sequence length must be 1..{s.max_seq}, got {seq}")
    if ATTENTION_MASK in inputs:
        inputs[ATTENTION_MASK] = padding_mask(inputs[ATTENTION_MASK], (batch, seq), name)
    if SEGMENT_LENGTHS in inputs:
        inputs[SEGMENT_LENGTHS] = segment_lengths(inputs, batch, seq, cfg.max_batch)


def segment_lengths(inputs: dict[str, torch.Tensor], batch: int, seq: int, most: int) -> torch.Tensor:
    """A packed batch's ``segment_lengths`` (1-D, each ≥ 1, summing to the one row's sequence) as int64."""
    t = inputs[SEGMENT_LENGTHS]
    if ATTENTION_MASK in inputs:
        raise invalid(SEGMENT_LENGTHS, "a packed batch has no padding: send segment_lengths or attention_mask, not both")
    if t.dtype not in (torch.int64, torch.int32) or t.dim() != 1 or not 1 <= t.numel() <= most:
        raise invalid(SEGMENT_LENGTHS, f"must be 1..{most} int64 lengths (rank 1), got {dt(t.dtype)} {list(t.shape)}")
    if batch != 1:
        raise invalid(SEGMENT_LENGTHS, f"a packed batch is one row of sequences end to end, got {batch} rows")
    if int(t.min()) < 1 or int(t.sum()) != seq:
        raise invalid(SEGMENT_LENGTHS, f"lengths must be ≥ 1 and sum to the sequence length {seq}, got {t.tolist()}")
    return t.long()


CHARS_PER_POSITION = 16  # a text this many times longer than the model's positions can never fit
DEFAULT_MAX_TEXT_CHARS = 65_536  # a model that does not say how many positions it has


def text_limit(cfg: StageConfig, max_seq: int | None) -> int:
    """Most characters of ``text`` (a batch's texts together) a stage reads before tokenizing them."""
    if cfg.max_text_chars > 0:
        return cfg.max_text_chars
    return CHARS_PER_POSITION * max_seq if max_seq else DEFAULT_MAX_TEXT_CHARS


def check_text(text, cfg: StageConfig, max_seq: int | None) -> list[str]:
    """``text`` (one string or a list) as a list, bounded before anything expands it: the batch size, then the
    characters (413 naming the limit, ``QUART_MAX_TEXT_CHARS``); tokenizing a 4 MB text took gigabytes."""
    texts = [text] if isinstance(text, str) else text
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
        raise invalid("text", "text must be a non-empty string or a list of them")
    if len(texts) > cfg.max_batch:
        raise invalid("text", f"batch size must be 1..{cfg.max_batch}, got {len(texts)} texts")
    limit, chars = text_limit(cfg, max_seq), sum(len(t) for t in texts)
    if chars > limit:
        raise invalid("text", f"text of {chars} characters is over the limit of {limit} (QUART_MAX_TEXT_CHARS)",
                      status=413)
    return texts


JSON_BYTES_PER_ID = 24  # "123456, " with room: a JSON body larger than the ids it may carry is refused unread
JSON_FIELDS = 3  # input_ids, token_type_ids, attention_mask


def json_limit(cfg: StageConfig, max_seq: int | None) -> int:
    """Most bytes of a JSON input a stage parses: its largest batch of ids (every field), or its text limit
    written as six-character escapes, and never under 1 MiB."""
    ids = JSON_FIELDS * cfg.max_batch * (max_seq or 4096) * JSON_BYTES_PER_ID
    return max(1 << 20, ids, 6 * text_limit(cfg, max_seq) + 1024)


def check_json_size(size: int, cfg: StageConfig, max_seq: int | None) -> None:
    """413 before parsing a JSON body no valid input of this stage needs (parsing expands it ~10 ×)."""
    limit = json_limit(cfg, max_seq)
    if size > limit:
        raise invalid("body", f"JSON body of {size} bytes is over this stage's limit of {limit} bytes (the largest "
                              "batch of ids, QUART_MAX_BATCH × the model's positions, or QUART_MAX_TEXT_CHARS)",
                      status=413)


def int_matrix(value, name: str, max_batch: int | None = None, max_seq: int | None = None) -> torch.Tensor:
    """A batch × sequence list of integers as int64, its shape checked before the tensor is allocated."""
    if not isinstance(value, list) or not value or not all(isinstance(r, list) for r in value):
        raise invalid(name, "must be a non-empty list of lists of integers (batch, sequence)")
    if max_batch is not None and len(value) > max_batch:
        raise invalid(name, f"batch size must be 1..{max_batch}, got {len(value)}")
    if max_seq is not None and len(value[0]) > max_seq:
        raise invalid(name, f"sequence length must be 1..{max_seq}, got {len(value[0])}")
    if len({len(r) for r in value}) != 1:
        raise invalid(name, "rows must all have the same length: pad the shorter ones and send an "
                                    "attention_mask (1 = token, 0 = padding)")
    if not all(isinstance(x, int) and not isinstance(x, bool) for r in value for x in r):
        raise invalid(name, "values must be integers")
    try:
        return torch.tensor(value, dtype=torch.int64)
    except (OverflowError, RuntimeError, ValueError):  # torch: "Overflow when unpacking long long" (2**70)
        raise invalid(name, "values must fit in int64") from None


def padding_mask(mask: torch.Tensor, shape: tuple[int, int], against: str) -> torch.Tensor:
    """An ``attention_mask`` checked against the batch × sequence of ``against``; as int64 0/1."""
    if mask.dtype not in (torch.int64, torch.int32, torch.uint8, torch.bool):
        raise invalid(ATTENTION_MASK, f"dtype must be int64, int32, uint8 or bool, got {dt(mask.dtype)}")
    if tuple(mask.shape) != shape:
        raise invalid(ATTENTION_MASK, f"shape must be {list(shape)} (batch, sequence of {against}), got "
                                              f"{list(mask.shape)}")
    mask = mask.long()
    if bool(((mask != 0) & (mask != 1)).any()):
        raise invalid(ATTENTION_MASK, "values must be 0 (padding) or 1 (token)")
    if not bool(mask.any(dim=1).all()):
        raise invalid(ATTENTION_MASK, "every sequence needs at least one token (a row of 1s somewhere)")
    return mask


def dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
