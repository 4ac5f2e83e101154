"""quartctl as an operator meets it: --version, consistent help, one-line errors with exit 2 for bad input
(no traceback), and the commands that manage a running gateway (list, status, logs, invoke, scale, rm)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from quart_tools.cli import main
from support.embedded_system import deploy_echo_pipeline, plugin_system


def quartctl(*args: str, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quart_tools.cli", *args], capture_output=True, text=True,
                          timeout=timeout, **kwargs)


def assert_one_line_usage_error(res: subprocess.CompletedProcess, *needles: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_version_and_help_are_consistent():
    res = quartctl("--version")
    assert res.returncode == 0 and res.stdout.startswith("quartctl ") and res.stdout.split()[1][0].isdigit()
    res = quartctl("--help")
    assert res.returncode == 0
    for command in ("status", "list", "logs", "invoke", "scale", "rm", "up", "down", "partition", "plugin"):
        assert f"  {command} " in res.stdout, command
    res = quartctl("plugin", "--help")
    assert res.returncode == 0 and "usage: quartctl plugin" in res.stdout and "python -m" not in res.stdout
    for command in ("up", "demo", "partition", "load", "simulate", "status", "logs"):
        res = quartctl(command, "--help")
        assert res.returncode == 0 and f"quartctl {command}" in res.stdout.lower(), (command, res.stdout[:200])


@pytest.mark.parametrize("args,needles", [
    (("demo", "--model", "nope"), ("quartctl demo", "nope", "minilm", "smollm2")),
    (("up", "--placer", "bogus"), ("quartctl up", "bogus", "cache-aware")),
    (("up", "--port", "99999"), ("quartctl up", "--port", "65535")),
    (("up", "--hosts", "0"), ("quartctl up", "--hosts")),
    (("nope",), ("No such command",)),
    (("scale", "f", "--replicas", "-1"), ("quartctl scale", "--replicas")),
    (("invoke",), ("quartctl invoke", "NAME")),
    (("simulate", "--experiment", "fig2", "--plots", "x"), ("quartctl simulate", "--plots")),
])
def test_bad_input_is_one_line_and_exit_2(args, needles, tmp_path):
    assert_one_line_usage_error(quartctl(*args, "--state-dir", str(tmp_path)) if args[0] in ("demo", "up")
                                else quartctl(*args), *needles)


def test_partition_of_an_unknown_model_names_the_packaged_ones_and_deepspeed_is_quiet(tmp_path):
    res = quartctl("partition", "--model", "nope", "--stages", "2", "--out", str(tmp_path / "x"))
    assert_one_line_usage_error(res, "nope", "minilm", "smollm2", "tiny")
    res = quartctl("partition", "--model", "tiny", "--stages", "2", "--out", str(tmp_path / "tiny"))
    assert res.returncode == 0, res.stderr
    assert "Setting accelerator" not in res.stderr + res.stdout and "WARNING" not in res.stderr, res.stderr


def test_load_at_a_dead_url_fails(tmp_path):
    res = quartctl("load", "http://127.0.0.1:9/function/x", "--rate", "5", "--duration", "0.5",
                   "--out", str(tmp_path / "r.jsonl"))
    assert res.returncode == 1 and "no request got an answer" in res.stderr and "Traceback" not in res.stderr


def test_simulate_fig7_writes_its_plots(tmp_path):
    plots = tmp_path / "plots"
    res = quartctl("simulate", "--experiment", "fig7", "--models", "bert-21b", "--cvs", "1,4", "--systems",
                   "quart,openfaas-ce", "--duration", "20", "--workers", "1", "--plots", str(plots),
                   "--out", str(tmp_path / "fig7.json"))
    assert res.returncode == 0, res.stderr[-2000:]
    assert [p.name for p in plots.iterdir()] == ["fig7-bert-21b.png"]
    assert json.loads((tmp_path / "fig7.json").read_text())["plots"] == [str(plots / "fig7-bert-21b.png")]


def test_the_management_commands_on_a_running_gateway(tmp_path, monkeypatch, capsys):
    system = plugin_system(tmp_path, monkeypatch, "0.2")
    try:
        monkeypatch.setenv("OPENFAAS_PASSWORD", system.auth[1])
        gw = ["--gateway", system.url]
        deploy_echo_pipeline(system, "m", 2)
        capsys.readouterr()
        assert main(["invoke", "m", *gw, "-d", "through the pipeline"]) == 0
        assert capsys.readouterr().out == "through the pipeline"
        time.sleep(0.5)
        assert main(["list", *gw]) == 0
        out = capsys.readouterr().out
        assert "m-stage-0" in out and "m-stage-1" in out
        assert main(["status", *gw]) == 0
        out = capsys.readouterr().out
        assert "m-stage-0" in out and "host-0:cold" in out and "last decisions" in out, out
        assert main(["status", *gw, "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert [s["name"] for s in doc["pipelines"][0]["stages"]] == ["m-stage-0", "m-stage-1"]
        assert main(["status", *gw, "--model", "nope"]) == 2
        assert "no pipeline 'nope'" in capsys.readouterr().err
        deadline = time.monotonic() + 10
        while True:
            assert main(["logs", "m-stage-1", *gw]) == 0
            out = capsys.readouterr().out
            if "INFO access" in out or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert "INFO access" in out and "status=200" in out, out
        assert main(["scale", "m-stage-1", *gw, "--replicas", "2"]) == 0
        assert requests.get(f"{system.url}/system/function/m-stage-1", auth=system.auth,
                            timeout=10).json()["replicas"] == 2
        assert main(["invoke", "nofunction", *gw, "-d", "x"]) == 1
        assert capsys.readouterr().err.startswith("quartctl invoke: 404")
        assert main(["rm", "m", *gw]) == 0
        assert "Removed pipeline m: m-stage-0, m-stage-1" in capsys.readouterr().out
        assert requests.get(f"{system.url}/system/functions", auth=system.auth, timeout=10).json() == []
    finally:
        system.close()
    assert main(["list", "--gateway", system.url]) == 1
    assert "cannot reach the gateway" in capsys.readouterr().err


def test_invoke_prints_a_streamed_answer_as_it_arrives():
    """A generation answers as a stream (server-sent events): each chunk is on stdout before the next is sent."""
    import http.server
    import os
    import select
    import threading

    release = threading.Event()

    class Streaming(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for event in (b"data: Hello\n\n", b"data: world\n\n"):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                self.wfile.flush()
                release.wait(30)  # the second token waits until the client printed the first
            self.wfile.write(b"0\r\n\r\n")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Streaming)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "quart_tools.cli", "invoke", "gen", "--gateway",
                                 f"http://127.0.0.1:{server.server_port}", "-d", '{"generate": true}'],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        ready, _, _ = select.select([proc.stdout], [], [], 20)  # a buffered client prints nothing before 30 s
        assert ready and os.read(proc.stdout.fileno(), 100) == b"data: Hello\n\n"  # while the server holds the rest
        release.set()
        rest, err = proc.communicate(timeout=60)
        assert proc.returncode == 0 and rest == b"data: world\n\n", err
    finally:
        release.set()
        server.shutdown()


def test_the_gguf_dequantisation_reports_its_steps(tmp_path, monkeypatch, capsys):
    """SmolLM2's first partition dequantises its GGUF (about a minute): it says so, and each step as it starts."""
    import torch
    import transformers
    from quart_tools import realmodels

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(realmodels, "load_gguf", lambda path: ({"model_type": "llama"}, {"w": torch.zeros(2)}))

    class Tokenizer:
        def save_pretrained(self, folder):
            (Path(folder) / "tokenizer.json").write_text("{}")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: Tokenizer())
    folder = realmodels.gguf_folder(gguf, cache=tmp_path / "cache")
    err = capsys.readouterr().err
    assert "dequantising model.gguf to float32 (once, about a minute" in err
    steps = re.findall(r"\[\s*[\d.]+ s\] (\d/3) ", err)
    assert steps == ["1/3", "2/3", "3/3"] and "dequantised in" in err, err
    assert (folder / "model.safetensors").exists()
