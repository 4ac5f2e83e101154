"""StageRuntime: configuration, emulated compute, fork safety, overload, checksum checks."""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from quart_stage import wire
from quart_stage.app import create_app
from quart_stage.config import ConfigError, StageConfig
from quart_stage.emulated import ServiceTime, service_time_for
from quart_stage.manifest import Manifest
from quart_stage.runtime import StageRuntime
from quart_tools.partition import partition


@pytest.fixture(scope="module")
def tiny2(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("rt") / "tiny2")
    partition("tiny", 2, d, progress=False)
    return d


def test_config_from_env_defaults_and_round_trip(tiny2):
    cfg = StageConfig.from_env({"QUART_MODEL_DIR": tiny2, "QUART_STAGE_INDEX": "1", "QUART_NUM_STAGES": "2"})
    assert (cfg.compute, cfg.max_body_bytes, cfg.threads, cfg.emulated_cv) == ("cpu", 256 << 20, 1, 0.1)
    assert StageConfig.from_env(cfg.to_env()) == cfg


@pytest.mark.parametrize("env, words", [
    ({"QUART_COMPUTE": "gpu", "QUART_MODEL_DIR": "/x"}, "QUART_COMPUTE"),
    ({"QUART_COMPUTE": "cpu"}, "QUART_MODEL_DIR"),
    ({"QUART_STAGE_INDEX": "3", "QUART_NUM_STAGES": "2", "QUART_MODEL_DIR": "/x"}, "outside"),
    ({"QUART_STAGE_INDEX": "x", "QUART_MODEL_DIR": "/x"}, "integer"),
])
def test_config_errors_are_clear(env, words):
    with pytest.raises(ConfigError, match=words):
        StageConfig.from_env(env)


def test_stage_count_mismatch_and_missing_manifest(tiny2, tmp_path):
    with pytest.raises(ConfigError, match="holds 2 stages"):
        StageRuntime.load(StageConfig(model_dir=tiny2, stage_index=0, num_stages=3))
    with pytest.raises(FileNotFoundError, match="partition the model first"):
        StageRuntime.load(StageConfig(model_dir=str(tmp_path), stage_index=0))


def test_size_and_checksum_are_checked(tiny2, tmp_path):
    import shutil

    d = str(tmp_path / "copy")
    shutil.copytree(tiny2, d)
    path = os.path.join(d, "stage-1.safetensors")
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    StageRuntime.load(StageConfig(model_dir=d, stage_index=1))  # same size: only the checksum notices
    with pytest.raises(ConfigError, match="sha256"):
        StageRuntime.load(StageConfig(model_dir=d, stage_index=1, verify_checksum=True))
    with open(path, "ab") as f:
        f.write(b"\0")
    with pytest.raises(ConfigError, match="re-partition"):
        StageRuntime.load(StageConfig(model_dir=d, stage_index=1))


def test_gamma_service_time_has_the_requested_mean_and_cv():
    rng = random.Random(1)
    draws = [ServiceTime(20.0, 0.5).sample_ms(rng) for _ in range(20000)]
    mean, sd = statistics.fmean(draws), statistics.pstdev(draws)
    assert mean == pytest.approx(20.0, rel=0.03)
    assert sd / mean == pytest.approx(0.5, rel=0.05)
    assert ServiceTime(7.0, 0.0).sample_ms(rng) == 7.0


def test_profile_split_over_stages():
    st = service_time_for(mean_ms=None, cv=0.1, profile="bert-21b", stage_bytes=[0] * 8, index=3)
    assert st.mean_ms == pytest.approx(137.0 / 8)
    st = service_time_for(mean_ms=None, cv=0.1, profile="llama-7b", stage_bytes=[1, 3], index=1)
    assert st.mean_ms == pytest.approx(243.0 * 0.75)
    with pytest.raises(ValueError, match="QUART_PROFILE"):
        service_time_for(mean_ms=None, cv=0.1, profile=None, stage_bytes=[1], index=0)


def test_emulated_with_model_dir_loads_parameters_and_moves_real_bytes(tiny2):
    real = StageRuntime.load(StageConfig(model_dir=tiny2, stage_index=0))
    emu = StageRuntime.load(StageConfig(model_dir=tiny2, stage_index=0, compute="emulated",
                                        emulated_mean_ms=30.0, emulated_cv=0.0))
    assert emu.module is not None and emu.parameter_bytes == real.parameter_bytes > 0
    body = wire.encode_bytes({"input_ids": torch.tensor([[1, 2, 3]])})
    r = emu.handle(body, {})
    assert r.status == 200 and r.headers["X-Quart-Compute-Mode"] == "emulated"
    assert 30.0 <= float(r.headers["X-Quart-Compute-Ms"]) < 30.0 + 200.0
    out = wire.decode(r.body).tensors["hidden_states"]
    assert out.shape == (1, 3, 64) and out.dtype == torch.float32
    # the next real stage accepts what the emulated one produced
    nxt = StageRuntime.load(StageConfig(model_dir=tiny2, stage_index=1))
    assert nxt.handle(r.body, {}).status == 200


def test_parameter_free_emulated_stage_from_a_profile():
    rt = StageRuntime.load(StageConfig(compute="emulated", profile="bert-21b", stage_index=3, num_stages=8, seed=1))
    assert rt.module is None and rt.model == "bert-21b"
    assert rt.service_time.mean_ms == pytest.approx(137.0 / 8)
    bad = rt.handle(wire.encode_bytes({"hidden_states": torch.zeros(1, 4, 6144)}), {})
    assert bad.status == 400 and b"float16" in bad.body
    r = rt.handle(wire.encode_bytes({"hidden_states": torch.zeros(1, 4, 6144, dtype=torch.float16)}), {})
    assert r.status == 200, r.body
    assert wire.decode(r.body).tensors["hidden_states"].shape == (1, 4, 6144)


def test_emulated_activation_size_override():
    rt = StageRuntime.load(StageConfig(compute="emulated", profile="whisper-9b", stage_index=0, num_stages=2,
                                       emulated_mean_ms=0.0, emulated_activation_bytes=1 << 20))
    r = rt.handle(b'{"input_ids": [[1, 2, 3, 4]]}', {"Content-Type": "application/json"})
    assert r.status == 200
    out = wire.decode(r.body).tensors["hidden_states"]
    assert (1 << 20) <= out.numel() * out.element_size() < (1 << 20) + 4 * 2 * 4
    nxt = StageRuntime.load(StageConfig(compute="emulated", profile="whisper-9b", stage_index=1, num_stages=2,
                                        emulated_mean_ms=0.0, emulated_activation_bytes=1 << 20))
    assert nxt.handle(r.body, {}).status == 200


def test_text_input_uses_the_tokenizer_and_json_output(tiny2):
    rt = StageRuntime.load(StageConfig(model_dir=tiny2, stage_index=0))
    assert Manifest.load(tiny2).tokenizer == "tokenizer.json"
    r = rt.handle(b'{"text": "abc"}', {"Content-Type": "application/json"})
    assert r.status == 200
    assert wire.decode(r.body).tensors["hidden_states"].shape == (1, 3, 64)
    # texts of different lengths: padded on the right, with an attention_mask that travels to the next stage
    r = rt.handle(b'{"text": ["ab", "abc"]}', {"Content-Type": "application/json"})
    assert r.status == 200, r.body
    out = wire.decode(r.body).tensors
    assert out["hidden_states"].shape == (2, 3, 64)
    assert out["attention_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]


def test_a_padded_batch_gives_each_text_what_it_gets_alone(tiny2):
    """Through both stages, a padded batch's real positions equal each text run unpadded (right padding)."""
    rts = [StageRuntime.load(StageConfig(model_dir=tiny2, stage_index=i)) for i in range(2)]

    def run(body: bytes, ctype: str) -> dict:
        for rt in rts:
            r = rt.handle(body, {"Content-Type": ctype})
            assert r.status == 200, r.body
            body, ctype = r.body, wire.CONTENT_TYPE
        return wire.decode(body).tensors

    batch = run(b'{"text": ["a", "abcd", "ab"]}', "application/json")
    assert batch["attention_mask"].tolist() == [[1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]]
    for row, text in enumerate(["a", "abcd", "ab"]):
        alone = run(json.dumps({"text": text}).encode(), "application/json")["logits"][0]
        assert (batch["logits"][row, : len(text)] - alone).abs().max().item() <= 1e-5


@pytest.mark.parametrize("mask, field_error", [
    ([[1, 1]], "shape must be [1, 3]"),
    ([[1, 2, 0]], "0 (padding) or 1"),
    ([[0, 0, 0]], "at least one token"),
])
def test_bad_attention_masks_are_400_naming_the_field(tiny2, mask, field_error):
    rt = StageRuntime.load(StageConfig(model_dir=tiny2, stage_index=0))
    r = rt.handle(json.dumps({"input_ids": [[1, 2, 3]], "attention_mask": mask}).encode(),
                  {"Content-Type": "application/json"})
    assert r.status == 400, r.body
    doc = json.loads(r.body)
    assert doc["field"] == "attention_mask" and field_error in doc["error"]
    r = rt.handle(b'{"input_ids": [[1, 2], [3]]}', {"Content-Type": "application/json"})
    assert r.status == 400 and b"attention_mask" in r.body  # ragged rows: the error says how to pad


FORK_SCRIPT = textwrap.dedent("""
    import quart_stage  # first: keeps numpy's BLAS pool from starting (see quart_stage/__init__.py)
    import os, sys, threading, torch
    from quart_stage.config import StageConfig
    from quart_stage.runtime import StageRuntime
    from quart_stage import wire
    rt = StageRuntime.load(StageConfig(model_dir=sys.argv[1], stage_index=0))
    threads = int([l for l in open("/proc/self/status") if l.startswith("Threads:")][0].split()[1])
    assert threads == 1, f"load started {threads - 1} threads"
    assert threading.active_count() == 1
    assert not torch.cuda.is_initialized()
    pid = os.fork()
    if pid == 0:
        rt.prepare_device()
        r = rt.handle(wire.encode_bytes({"input_ids": torch.tensor([[1, 2, 3]])}), {})
        os._exit(0 if r.status == 200 else 3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    print("ok")
""")


def test_load_is_fork_safe(tiny2):
    out = subprocess.run([sys.executable, "-c", FORK_SCRIPT, tiny2], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


def test_overload_answers_429_with_retry_after(tiny2):
    rt = StageRuntime.load(StageConfig(model_dir=tiny2, stage_index=1, compute="emulated", emulated_mean_ms=400.0,
                                       emulated_cv=0.0, max_inflight=1))
    app = create_app(rt)
    body = wire.encode_bytes({"hidden_states": torch.zeros(1, 2, 64)})
    results = []
    slow = threading.Thread(target=lambda: results.append(app.test_client().post("/", data=body).status_code))
    slow.start()
    import time

    time.sleep(0.15)
    r = app.test_client().post("/", data=body)
    slow.join()
    assert r.status_code == 429 and r.headers["Retry-After"] == "1"
    assert results == [200]
    assert app.test_client().get("/_/health").status_code == 200


def test_compute_failure_is_500_json_and_runtime_keeps_serving(tiny2, monkeypatch):
    rt = StageRuntime.load(StageConfig(model_dir=tiny2, stage_index=1))
    body = wire.encode_bytes({"hidden_states": torch.zeros(1, 2, 64)})
    original = rt.module.forward
    monkeypatch.setattr(rt.module, "forward", lambda inputs: (_ for _ in ()).throw(RuntimeError("boom")))
    r = rt.handle(body, {})
    assert r.status == 500 and b"boom" in r.body
    monkeypatch.setattr(rt.module, "forward", original)
    assert rt.handle(body, {}).status == 200


def test_forked_replicas_draw_different_service_times():
    cfg = StageConfig(compute="emulated", profile="llama-7b", num_stages=8, emulated_cv=1.0)
    rt, twin = StageRuntime.load(cfg), StageRuntime.load(cfg)
    twin._rng.setstate(rt._rng.getstate())  # what a fork gives the replicas: the zygote's RNG state
    rt.prepare_device()
    twin.prepare_device()
    draws = [[r.service_time.sample_ms(r._rng) for _ in range(3)] for r in (rt, twin)]
    assert draws[0] != draws[1]
    seeded = [StageRuntime.load(StageConfig(compute="emulated", profile="llama-7b", num_stages=8, seed=4))
              for _ in range(2)]
    for r in seeded:
        r.prepare_device()
    assert seeded[0].service_time.sample_ms(seeded[0]._rng) == seeded[1].service_time.sample_ms(seeded[1]._rng)
