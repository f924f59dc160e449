"""The peers' servers of `make bench-serve` (eaglex/serve_peers.py): their command lines, the start/stop of a server
on loopback, and the table against eaglex's best row; no llama.cpp or vLLM needed (the real ones run in
`make bench-serve`)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from eaglex import bench_serve, serve_peers
from eaglex.base.errors import ModelError
from eaglex.llamacpp_server import Draft


def row(mode, c, tps, peer=False):
    return {"mode": mode, "concurrency": c, "aiperf_output_tokens_per_s": tps} | ({"peer": True} if peer else {})


@pytest.mark.parametrize("rows, want", [
    # eaglex's best and the best peer per concurrency, by AIPerf's output tokens/s
    ([row("vanilla", 1, 20.0), row("eagle", 1, 33.0), row("llama.cpp vanilla", 1, 18.0, True),
      row("llama.cpp EAGLE-3", 1, 22.0, True)],
     [{"concurrency": 1, "eaglex": "eagle", "eaglex_tokens_per_s": 33.0, "peer": "llama.cpp EAGLE-3",
       "peer_tokens_per_s": 22.0, "ratio": 1.5}]),
    # a peer ahead: the ratio says so
    ([row("eagle", 16, 90.0), row("vLLM vanilla", 16, 120.0, True)],
     [{"concurrency": 16, "eaglex": "eagle", "eaglex_tokens_per_s": 90.0, "peer": "vLLM vanilla",
       "peer_tokens_per_s": 120.0, "ratio": 0.75}]),
    # no peer row (it did not start) or an AIPerf error (no figure): no comparison at that concurrency
    ([row("eagle", 1, 30.0), {"mode": "llama.cpp vanilla", "concurrency": 1, "peer": True, "aiperf_error": "x"}], []),
])
def test_vs_peers(rows, want):
    assert serve_peers.vs_peers(rows, [1, 4, 16]) == want
    assert serve_peers.peers_markdown(want).count("\n") == 1 + len(want)


def test_llamacpp_commands(tmp_path, monkeypatch):
    import eaglex.export.llamacpp as exp
    import eaglex.models.gguf_derive as derive
    monkeypatch.setattr(derive, "derived_gguf", lambda src, enc, cache, sha=None: cache / f"t.{enc}.gguf")
    monkeypatch.setattr(exp, "write_eagle3_gguf", lambda head, src, out: out)
    van, spec = serve_peers.llamacpp_peers(tmp_path / "bin", tmp_path / "m.gguf", tmp_path / "eagle3", tmp_path,
                                           slots=16, threads=2, slot_context=256, draft=Draft(8, 0.5))
    for p in (van, spec):
        cmd = list(p.command)
        assert cmd[0] == str(tmp_path / "bin" / "llama-server") and p.fresh
        assert cmd[cmd.index("-np") + 1] == "16" and cmd[cmd.index("-c") + 1] == str(16 * 256)
        assert cmd[cmd.index("-m") + 1] == str(tmp_path / "t.F32.gguf")
        assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and "{port}" in cmd
    assert "-md" not in van.command
    s = list(spec.command)
    assert s[s.index("-md") + 1] == str(tmp_path / "eagle3.eagle3.F32.gguf")
    assert (s[s.index("--spec-draft-n-max") + 1], s[s.index("--spec-draft-p-min") + 1]) == ("8", "0.5")


def test_vllm_commands(tmp_path, monkeypatch):
    import eaglex.vllm_peer as vp
    monkeypatch.setattr(vp, "vllm_target", lambda target: tmp_path / "f32")
    monkeypatch.setattr(vp, "worker_env", lambda cfg, threads: ({"OMP_NUM_THREADS": str(threads)}, []))
    van, spec = serve_peers.vllm_peers(tmp_path / "py", tmp_path / "hf", tmp_path / "head", slots=16, threads=2,
                                       max_model_len=300, logs=tmp_path, k=3)
    for p in (van, spec):
        cmd = list(p.command)
        assert cmd[:3] == [str(tmp_path / "py"), "-m", "vllm.entrypoints.openai.api_server"] and not p.fresh
        assert cmd[cmd.index("--model") + 1] == str(tmp_path / "f32")
        assert cmd[cmd.index("--served-model-name") + 1] == serve_peers.MODEL_NAME
        assert cmd[cmd.index("--max-num-seqs") + 1] == "16" and "--no-enable-prefix-caching" in cmd
        assert p.env == {"OMP_NUM_THREADS": "2"}
    assert "--speculative-config" not in van.command
    cfg = json.loads(spec.command[spec.command.index("--speculative-config") + 1])
    assert cfg == {"method": "eagle3", "model": str(tmp_path / "head"), "num_speculative_tokens": 3}
    assert len(serve_peers.vllm_peers(tmp_path / "py", tmp_path / "hf", None, 4, 2, 300, tmp_path)) == 1


HEALTH = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_server_starts_and_stops(tmp_path):
    peer = serve_peers.Peer("fake", (sys.executable, "-c", HEALTH, "{port}"), tmp_path / "log", "fake", start_s=30)
    with serve_peers.PeerServer(peer) as s:
        proc = s.proc
        assert proc.poll() is None
    assert proc.poll() is not None                  # stopped on exit


def test_server_that_dies_is_one_line(tmp_path):
    peer = serve_peers.Peer("broken", (sys.executable, "-c", "print('no model file'); raise SystemExit(1)"),
                            tmp_path / "log", "broken", start_s=30)
    with pytest.raises(ModelError, match=r"broken did not start \(no model file; log .*log\)"):
        serve_peers.PeerServer(peer).__enter__()


@pytest.mark.parametrize("argv, message", [
    (["--llamacpp-server", "auto"], "the peers are measured by AIPerf"),
    (["--vllm", "py"], "the peers are measured by AIPerf"),
    (["--aiperf", "a", "--llamacpp-draft", "8/0.5,4/0"], "takes one N/P"),
    (["--aiperf", "a", "--llamacpp-draft", "x"], "--llamacpp-draft"),
])
def test_bad_peer_options(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench_serve.main(["--engine", str(Path("engines/none"))] + argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_peers_left_out_with_one_line(tmp_path, capsys):
    """What a peer needs missing (no llama-server, a target not converted from a GGUF file, no vLLM venv): no peer,
    one line each, the run goes on."""
    import argparse
    args = argparse.Namespace(concurrency=[1, 4], threads=2, max_context=300, llamacpp_server=str(tmp_path / "none"),
                              llamacpp_draft=(Draft(8, 0.5),), vllm=str(tmp_path / "no-python"), vllm_k=4,
                              out=tmp_path / "out.json")
    target = tmp_path / "hf"
    target.mkdir()
    manifest = {"sources": {"target": {"path": str(target)}, "draft": {"path": str(tmp_path / "head")}}}
    assert bench_serve.peer_deployments(args, manifest) == []
    err = capsys.readouterr().err
    assert "llama-server left out" in err and "vLLM left out (no python at" in err
    args.llamacpp_server, args.vllm = "off", None
    assert bench_serve.peer_deployments(args, {}) == []


def test_aiperf_command_streams_greedy_chat_without_scraping_metrics(tmp_path):
    """AIPerf's command: streamed greedy chat at the row's concurrency, the server's own token counts, and no
    /metrics scraping (an AIPerf service that under load on a small host voids the run)."""
    from types import SimpleNamespace

    args = SimpleNamespace(aiperf_input_tokens=64, max_tokens=32)
    cmd = bench_serve.aiperf_command("aiperf", tmp_path / "tok", 8123, 4, 12, args, tmp_path / "out")
    flags = dict(zip(cmd, cmd[1:]))
    assert cmd[:2] == ["aiperf", "profile"] and (tmp_path / "out").is_dir()
    assert {"--no-server-metrics", "--streaming", "--use-server-token-count"} <= set(cmd)
    assert (flags["--url"], flags["--concurrency"], flags["--request-count"]) == ("127.0.0.1:8123", "4", "12")
    assert (flags["--extra-inputs"], flags["--output-tokens-mean"], flags["--endpoint-type"]) == \
        ("temperature:0", "32", "chat")
