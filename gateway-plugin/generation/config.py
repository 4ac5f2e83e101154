"""Settings of token generation on the gateway (``QUART_GEN_*``; docs/configuration.md)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from quart_kernel.scheduling.live_split import REJOIN_MODES
from quart_stage.labels import MAX_DECODE_BATCH
from quart_stage.settings import ConfigError, settings_from_env


@dataclass(frozen=True, slots=True)
class GenerationConfig:
    max_body_bytes: int = 1 << 20  # [QUART_GEN_MAX_BODY_BYTES] a generation request's JSON body, checked before parsing
    max_prompt_chars: int = 200_000  # [QUART_GEN_MAX_PROMPT_CHARS] prompt / messages text, checked before tokenizing
    max_messages: int = 256  # [QUART_GEN_MAX_MESSAGES] chat messages in one request
    default_max_tokens: int = 0  # [QUART_GEN_DEFAULT_MAX_TOKENS] bounds a chat or /function request that names none (0 = the rest of the context, as vLLM)
    kv_tokens: int = 16384  # [QUART_GEN_KV_TOKENS] KV positions a replica holds until it reports its own cap
    max_replays: int = 3  # [QUART_GEN_MAX_REPLAYS] failovers of one session before its stream ends with an error
    replica_wait_s: float = 30.0  # [QUART_GEN_REPLICA_WAIT_S] wait for a ready replica (scale from zero, a replacement)
    step_timeout_s: float = 60.0  # [QUART_GEN_STEP_TIMEOUT_S] one stage call of a session before failing over
    retry_after_s: int = 1  # [QUART_GEN_RETRY_AFTER_S] Retry-After of a session refused for lack of KV room
    room_wait_s: float = 10.0  # [QUART_GEN_ROOM_WAIT_S] most a new session waits in line at the entry for KV room before a 429 (0 = 429 at once)
    room_queue: int = 256  # [QUART_GEN_ROOM_QUEUE] sessions that may wait for KV room at one stage; more get a 429 at once
    cooperative: bool = True  # [QUART_GEN_COOPERATIVE] split new sessions with a live replica's held layers
    recut: bool = True  # [QUART_GEN_RECUT] re-cut a split at its live replica's layers while new sessions wait for room
    rejoin: str = "auto"  # [QUART_GEN_REJOIN] a split session once its live replica is whole: auto | migrate | shadow | replay | keep
    decode_batch_max: int = 64  # [QUART_GEN_DECODE_BATCH_MAX] sessions per batched decode step without a com.quart.batch.decode-max label (1 = off)
    prefill_chunk: int = 128  # [QUART_GEN_PREFILL_CHUNK] prompt positions per prefill call where decode batches (0 = whole prompt)
    tokenizer_cache: str = ""  # [QUART_GEN_TOKENIZER_CACHE] where a registry-only model's tokenizer is fetched ("" = ~/.cache/quart-faas/tokenizers)
    decode_hold_ms: float = 250.0  # [QUART_GEN_DECODE_HOLD_MS] most a free replica holds its decode batch for its sessions' steps on their way (0 = never)

    def __post_init__(self) -> None:
        if self.rejoin not in REJOIN_MODES:
            raise ConfigError(f"QUART_GEN_REJOIN must be one of {', '.join(REJOIN_MODES)}, got {self.rejoin!r}")
        if not 1 <= self.decode_batch_max <= MAX_DECODE_BATCH:
            raise ConfigError(f"QUART_GEN_DECODE_BATCH_MAX must be in [1, {MAX_DECODE_BATCH}], got {self.decode_batch_max}")
        if not 0 <= self.room_wait_s <= 3600:
            raise ConfigError(f"QUART_GEN_ROOM_WAIT_S must be in [0, 3600], got {self.room_wait_s}")
        if self.room_queue < 0:
            raise ConfigError(f"QUART_GEN_ROOM_QUEUE must be >= 0, got {self.room_queue}")
        if self.default_max_tokens < 0:
            raise ConfigError(f"QUART_GEN_DEFAULT_MAX_TOKENS must be >= 0, got {self.default_max_tokens}")
        if self.prefill_chunk < 0:
            raise ConfigError(f"QUART_GEN_PREFILL_CHUNK must be >= 0, got {self.prefill_chunk}")
        if not 0 <= self.decode_hold_ms <= 10_000:
            raise ConfigError(f"QUART_GEN_DECODE_HOLD_MS must be in [0, 10000], got {self.decode_hold_ms}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> GenerationConfig:
        return settings_from_env(cls, "QUART_GEN_", env)
