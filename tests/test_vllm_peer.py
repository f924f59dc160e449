"""vLLM's CPU build as a bench peer, without vLLM: the preloads found on a fake venv and system, the worker's command
line and environment, the JSON-lines protocol, the float32 target copy, the K sweep and the rows assembled from a
fake worker that speaks the protocol (tests/fake_vllm_worker.py), the real worker script's protocol on a stand-in
`vllm` package; and, where `make vllm-venv` has built build/vllm-venv (slow), vLLM itself on the default model."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from eaglex import vllm_env as E
from eaglex import vllm_peer as V
from eaglex.base.errors import ModelError

REPO_ROOT = Path(__file__).resolve().parents[1]

FAKE = Path(__file__).with_name("fake_vllm_worker.py")
VENV_PYTHON = REPO_ROOT / "build" / "vllm-venv" / "bin" / "python"
HEAD = REPO_ROOT / "models" / "smollm2-135m" / "eagle3"


def _fake_venv(tmp_path: Path, iomp_at: str | None = "lib") -> Path:
    """VENV/bin/python (a link to this interpreter, as in a venv) with libiomp5.so under VENV/`iomp_at`."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    if iomp_at is not None:
        (venv / iomp_at).mkdir(parents=True, exist_ok=True)
        (venv / iomp_at / E.IOMP).write_bytes(b"")
    return venv / "bin" / "python"


def _fake_system(tmp_path: Path, with_tcmalloc: bool = True) -> tuple[str, ...]:
    lib = tmp_path / "system-lib"
    lib.mkdir()
    if with_tcmalloc:
        (lib / E.TCMALLOC).write_bytes(b"")
    return (str(tmp_path / "absent"), str(lib))


# --------------------------------------------------------------------------- preloads


def test_preloads_are_found_in_the_venv_and_the_system(tmp_path):
    python = _fake_venv(tmp_path)
    lib_dirs = _fake_system(tmp_path)
    venv = tmp_path / "venv"
    assert E.venv_root(python) == venv                   # not the base interpreter the link points at
    assert E.preloads(python, lib_dirs) == [venv / "lib" / E.IOMP, tmp_path / "system-lib" / E.TCMALLOC]


def test_iomp_below_lib_and_missing_pieces(tmp_path):
    python = _fake_venv(tmp_path, iomp_at="lib/python3.11/site-packages/intel")
    assert E.find_iomp(python) == tmp_path / "venv/lib/python3.11/site-packages/intel" / E.IOMP
    assert E.preloads(python, _fake_system(tmp_path, with_tcmalloc=False)) == [E.find_iomp(python)]
    bare = tmp_path / "bare"
    assert E.preloads(_fake_venv(bare, iomp_at=None), (str(bare),)) == []


@pytest.mark.parametrize("paths,existing,want", [
    (["/a/libiomp5.so", "/b/libtc.so"], None, "/a/libiomp5.so:/b/libtc.so"),
    (["/a/libiomp5.so"], "/x/other.so /a/libiomp5.so", "/a/libiomp5.so:/x/other.so"),   # no repeats, ours first
    ([], "", ""),
])
def test_ld_preload_value(paths, existing, want):
    assert E.ld_preload([Path(p) for p in paths], existing) == want


def test_the_script_prints_ld_preload_for_the_makefile(tmp_path):
    python = _fake_venv(tmp_path)
    out = subprocess.run([sys.executable, str(Path(E.__file__)), str(python)], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip().split(":")[0] == str(tmp_path / "venv" / "lib" / E.IOMP)


# --------------------------------------------------------------------------- command line, environment, protocol


def _cfg(tmp_path, **kw) -> V.VllmConfig:
    defaults = dict(python=Path(sys.executable), target=tmp_path / "target", head=tmp_path / "head",
                    logs=tmp_path / "logs", worker=FAKE, lib_dirs=(str(tmp_path / "no-libs"),), settle_s=0.0)
    return V.VllmConfig(**{**defaults, **kw})


def test_worker_command(tmp_path):
    cfg = _cfg(tmp_path)
    base = [sys.executable, str(FAKE), "--model", str(tmp_path / "m"), "--eos", "2,0", "--max-model-len", "8192"]
    assert V.worker_command(cfg, tmp_path / "m", [2, 0], 8192) == base
    assert V.worker_command(cfg, tmp_path / "m", (2, 0), 8192, k=3) == base + ["--head", str(tmp_path / "head"),
                                                                              "--k", "3"]
    eager = _cfg(tmp_path, enforce_eager=True)
    assert V.worker_command(eager, tmp_path / "m", [2], 64)[-1] == "--enforce-eager"
    assert V.WORKER.is_file() and V.WORKER.parent == Path(V.__file__).parent


def test_worker_env(tmp_path):
    python = _fake_venv(tmp_path)
    cfg = _cfg(tmp_path, python=python, lib_dirs=_fake_system(tmp_path))
    env, found = V.worker_env(cfg, 2, base={"LD_PRELOAD": "/x/mine.so", "PYTHONPATH": "/eaglex", "HOME": "/h"},
                              cpus=[0, 2])
    assert found == [tmp_path / "venv/lib" / E.IOMP, tmp_path / "system-lib" / E.TCMALLOC]
    assert env["LD_PRELOAD"] == f"{found[0]}:{found[1]}:/x/mine.so"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0,2" and env["OMP_NUM_THREADS"] == "2"
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_NO_USAGE_STATS"] == "1" and env["HOME"] == "/h"
    assert "PYTHONPATH" not in env
    bare, _ = V.worker_env(_cfg(tmp_path), 1, base={}, cpus=[0])
    assert "LD_PRELOAD" not in bare                        # nothing found: nothing preloaded


@pytest.mark.parametrize("allowed,cores,threads,want", [
    ([0, 1, 2, 3], {0: 0, 1: 1, 2: 0, 3: 1}, 2, [0, 1]),      # siblings 0/2, 1/3: one per core first
    ([0, 1, 2, 3], {0: 0, 1: 0, 2: 1, 3: 1}, 2, [0, 2]),
    ([0, 1, 2, 3], {0: 0, 1: 0, 2: 1, 3: 1}, 3, [0, 2, 1]),   # more threads than cores: then the siblings
    ([4, 5], {4: 0, 5: 1}, 8, [4, 5]),                        # never more than this process may use
    ([3], {3: 0}, 0, [3]),
])
def test_pick_cpus(allowed, cores, threads, want):
    assert V.pick_cpus(threads, allowed, cores.get) == want


def test_protocol_lines():
    assert json.loads(V.request_line([1, 2], 16)) == {"ids": [1, 2], "max_new_tokens": 16}
    assert V.request_line([1], 4).endswith("\n")
    assert V.parse_reply('{"ready": true, "vllm": "0.32.0"}\n')["vllm"] == "0.32.0"
    assert V.parse_reply('{"ids": [5, 6], "seconds": 0.5, "drafts": 1}')["ids"] == [5, 6]
    for line, message in [('{"error": "RuntimeError: boom"}', "RuntimeError: boom"),
                          ("INFO 12-06 starting", "not a JSON"), ("[1, 2]", "not a JSON object"),
                          ('{"ids": [1]}', "no ids and seconds")]:
        with pytest.raises(V.WorkerError, match=message):
            V.parse_reply(line)


@pytest.mark.parametrize("text,want", [(None, (1, 2, 3, 4)), ("3", (3,)), (" 4, 2,4 ", (4, 2))])
def test_parse_ks(text, want):
    assert V.parse_ks(text) == want


@pytest.mark.parametrize("text", ["", "0", "a", "2,-1", "1.5"])
def test_parse_ks_refuses(text):
    with pytest.raises(ModelError, match="vLLM speculative tokens|no vLLM"):
        V.parse_ks(text)


def test_find_python(tmp_path):
    lines = []
    assert V.find_python(None, lines.append) is None and not lines
    assert V.find_python(tmp_path / "nope" / "python", lines.append) is None
    assert len(lines) == 1 and V.INSTALL in lines[0] and lines[0].startswith("vLLM peers: skipped")
    assert V.find_python(sys.executable, lines.append) == Path(sys.executable)


def test_cli_leaves_the_rows_out_in_one_line(tmp_path, capsys):
    from eaglex.cli import _vllm_from_args
    args = SimpleNamespace(vllm=str(tmp_path / "python"), vllm_ks=None, target=tmp_path, draft=None)
    assert _vllm_from_args(args, []) is None
    assert capsys.readouterr().err.count("\n") == 1
    args.vllm, args.vllm_ks = sys.executable, "x"
    with pytest.raises(ModelError, match="speculative tokens 'x'"):
        _vllm_from_args(args, [])
    args.vllm_ks = "2"
    assert _vllm_from_args(args, []) is None              # a folder without config.json
    assert "no Hugging Face target folder" in capsys.readouterr().err


# --------------------------------------------------------------------------- the target folder and the head


def _hf_folder(path: Path, dtype=torch.float16, marker: dict | None = None) -> Path:
    from safetensors.torch import save_file
    path.mkdir(parents=True)
    save_file({"w": torch.ones(2, 3, dtype=dtype), "step": torch.tensor([1])}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "float16"}))
    (path / "tokenizer.json").write_text("{}")
    if marker is not None:
        (path / "eaglex_gguf.json").write_text(json.dumps(marker))
    return path


def test_vllm_target_is_a_float32_copy_written_once(tmp_path):
    from safetensors.torch import load_file
    src = _hf_folder(tmp_path / "t16")
    out = V.vllm_target(src, tmp_path / "cache")
    assert out.parent == tmp_path / "cache" / "targets" and out.name.startswith("t16-")
    state = load_file(str(out / "model.safetensors"))
    assert state["w"].dtype == torch.float32 and state["step"].dtype == torch.int64
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dtype"] == "float32" and "torch_dtype" not in cfg and (out / "tokenizer.json").is_file()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]      # no partial folder left behind
    (out / "tokenizer.json").write_text("kept")
    assert V.vllm_target(src, tmp_path / "cache") == out and (out / "tokenizer.json").read_text() == "kept"


def test_vllm_target_of_a_gguf_conversion_links_its_float32_weights(tmp_path):
    marker = {"source": "Model.Q4_1.gguf", "sha256": "ab" * 32}
    src = _hf_folder(tmp_path / "conv", dtype=torch.float32, marker=marker)
    out = V.vllm_target(src, tmp_path / "cache")
    assert out.name == f"Model.Q4_1-{'ab' * 8}"
    assert (out / "model.safetensors").stat().st_ino == (src / "model.safetensors").stat().st_ino
    with pytest.raises(ModelError, match="not a Hugging Face model folder"):
        V.vllm_target(tmp_path / "cache", tmp_path / "cache2")


def test_is_eagle3(tmp_path):
    if (HEAD / "config.json").is_file():
        assert V.is_eagle3(HEAD) and not V.is_eagle3(HEAD.parent / "eagle1")
    from safetensors.torch import save_file
    head = tmp_path / "h"
    head.mkdir()
    save_file({"midlayer.fc.weight": torch.zeros(1)}, str(head / "model.safetensors"))
    assert V.is_eagle3(head)
    (head / "model.safetensors").unlink()
    (head / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    assert V.is_eagle3(head)


# --------------------------------------------------------------------------- rows from the fake worker

PROMPTS = [[5, 1, 1], [7, 2], [9, 9, 9, 9], [5, 3]]


def _reference(eos=frozenset({2})):
    """eaglex vanilla's tokens as the fake computes them, one prompt changed (kernels drift)."""
    sys.path.insert(0, str(FAKE.parent))
    try:
        import fake_vllm_worker as F
    finally:
        sys.path.pop(0)
    ref = [F.answer(p, 6, set(eos), 0) for p in PROMPTS]
    ref[2] = ref[2][:-1] + [99]
    return ref


def _head(tmp_path) -> Path:
    head = tmp_path / "head"
    head.mkdir(exist_ok=True)
    (head / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    return head


def test_rows_from_the_fake_worker(tmp_path, monkeypatch):
    """The sweep keeps the fastest K (2); vanilla, EAGLE-3 and eaglex vanilla run interleaved; the rows carry the
    counts against vLLM vanilla and eaglex vanilla, τ, the version and the preloads."""
    monkeypatch.setenv("FAKE_VLLM_ENV", str(tmp_path / "runs.jsonl"))
    calls = []

    def eaglex_vanilla(p, n):
        calls.append(p)
        return _reference()[PROMPTS.index(p)] if p in PROMPTS else [3] * n, 0.02

    lines = []
    cfg = _cfg(tmp_path, head=_head(tmp_path), sweep_prompts=2)
    rows = V.run_vllm_peers(cfg, PROMPTS, 6, 2, [2], 64, reference=_reference(), baselines={"ort:x": eaglex_vanilla},
                            log=lines.append)
    by = {r.method: r for r in rows}
    assert set(by) == {"vanilla", "eagle3"} and lines == ["vLLM EAGLE-3: sweeping K in 1,2,3,4 on 2 prompts"]
    v, e = by["vanilla"].as_dict(), by["eagle3"].as_dict()
    assert e["tree"] == "K=2" and "K=1 1.11x, K=2 2.00x, K=3 1.43x, K=4 1.25x" in e["note"]
    assert e["identical_to_vanilla"] and "4/4 prompts identical to vLLM vanilla" in e["note"]
    assert "3/4 identical to eaglex vanilla" in e["note"] and "3/4 identical to eaglex vanilla" in v["note"]
    assert not v["identical_to_vanilla"] and not v["identical_enforced"] and not e["identical_enforced"]
    assert v["tokens"] == e["tokens"] == 6 + 4 + 6 + 6                  # the prompt starting with 7 ends at EOS
    assert e["tau"] == pytest.approx((22 + 11) / 22, abs=1e-3) and v["tau"] == 1.0
    assert set(v["alongside_tokens_per_s"]) == {"ort:x"}
    assert e["speedup"] == pytest.approx(0.02 * 4 / (0.005 * 22), abs=1e-3)      # against eaglex vanilla
    assert "vllm 0.32.0-fake" in e["build"] and "LD_PRELOAD none" in e["build"] and "OpenMP on cpus" in e["build"]
    assert e["threads"] == "vLLM 2" and e["device"] == "cpu float32 +float32 head"
    assert calls.count(PROMPTS[0]) == 2                                 # warm-up, then its measured run
    runs = [json.loads(x) for x in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert [r["argv"][r["argv"].index("--k") + 1] if "--k" in r["argv"] else None for r in runs] == \
        [None, "1", "2", "3", "4"]                                      # vanilla, then one worker per K
    assert all(r["env"]["OMP_NUM_THREADS"] == str(len(r["env"]["VLLM_CPU_OMP_THREADS_BIND"].split(",")))
               for r in runs)
    assert (tmp_path / "logs" / "vllm-eagle3-k2.log").read_text().startswith("INFO a log line")


def test_a_worker_rests_after_each_reply_outside_the_timed_window(tmp_path):
    import time
    cmd = V.worker_command(_cfg(tmp_path), tmp_path, [2], 64)
    with V.Worker(cmd, dict(os.environ), tmp_path / "w.log", settle_s=0.3) as w:
        t = time.monotonic()
        reply = w.generate([9, 9], 3)
        assert time.monotonic() - t >= 0.3 and reply["seconds"] == pytest.approx(0.03)


def test_a_speculative_mismatch_is_counted_and_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_DIFFER", "3")
    cfg = _cfg(tmp_path, head=_head(tmp_path), ks=(3,))
    rows = V.run_vllm_peers(cfg, PROMPTS, 6, 1, [2], 64, log=lambda line: None)
    e = next(r for r in rows if r.method == "eagle3").as_dict()
    assert not e["identical_to_vanilla"] and "2/4 prompts identical to vLLM vanilla" in e["note"]
    assert "K=3 given (no sweep)" in e["note"] and "e2e: vs vLLM vanilla" in e["note"]


def test_a_vllm_that_does_not_start_leaves_its_rows_out_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_FAIL", "start")
    lines = []
    assert V.run_vllm_peers(_cfg(tmp_path, head=None), PROMPTS, 6, 1, [2], 64, log=lines.append) == []
    assert len(lines) == 1 and lines[0].startswith("vLLM peers: rows left out (vLLM did not start (")
    assert "Engine core initialization failed" in lines[0] and str(tmp_path / "logs") in lines[0]


def test_a_head_that_is_not_eagle3_runs_vanilla_only(tmp_path):
    lines = []
    rows = V.run_vllm_peers(_cfg(tmp_path, head=tmp_path), PROMPTS[:1], 4, 1, [2], 64, log=lines.append)
    assert [r.method for r in rows] == ["vanilla"] and "not an EAGLE-3 head" in lines[0]


def test_a_worker_that_dies_mid_run_is_one_line(tmp_path):
    crash = tmp_path / "crash.py"
    crash.write_text("import json, sys\nprint(json.dumps({'ready': True}), flush=True)\nsys.stdin.readline()\n"
                     "print('Segmentation fault', file=sys.stderr)\nsys.exit(139)\n")
    lines = []
    assert V.run_vllm_peers(_cfg(tmp_path, worker=crash, head=None), PROMPTS, 6, 1, [2], 64, log=lines.append) == []
    assert len(lines) == 1 and "exited with status 139: Segmentation fault" in lines[0]


def test_the_anchored_table_labels_vllm_rows():
    from eaglex.bench import anchor
    rows = [{"engine": "a", "method": "vanilla", "tree": "-", "tokens_per_s": 40.0},
            {"engine": "a", "method": "eagle3", "tree": "chain:3", "tokens_per_s": 60.0},
            {"engine": "vLLM", "method": "vanilla", "device": "cpu float32", "tokens_per_s": 30.0,
             "alongside_tokens_per_s": {"a": 45.0}},
            {"engine": "vLLM", "method": "eagle3", "device": "cpu float32 +float32 head", "tokens_per_s": 45.0,
             "alongside_tokens_per_s": {"a": 45.0}}]
    anchor(rows)
    assert rows[1]["vs_llamacpp_anchored"] == {"vLLM": 2.25, "vLLM+E3": 1.5}
    assert not any("vs_llamacpp_anchored" in r for r in rows[2:])


# --------------------------------------------------------------------------- the real worker script, stand-in vllm

FAKE_VLLM = '''
import sys
__version__ = "9.9.9"
class SamplingParams:
    def __init__(self, **kw):
        self.kw = kw
class _Out:
    def __init__(self, ids):
        self.token_ids = ids
class _Req:
    def __init__(self, ids):
        self.outputs = [_Out(ids)]
class _M:
    def __init__(self, name, value):
        self.name, self.value = name, value
class LLM:
    def __init__(self, **kw):
        print("vLLM banner on stdout")          # must not reach the protocol
        self.kw, self.n = kw, 0
        open(kw["model"] + "/llm_kwargs.json", "w").write(__import__("json").dumps(
            {k: v for k, v in kw.items() if k != "speculative_config"} | {"spec": kw.get("speculative_config")}))
    def get_metrics(self):
        return [_M("vllm:spec_decode_num_drafts", self.n), _M("vllm:spec_decode_num_accepted_tokens", 2 * self.n)]
    def generate(self, prompts, params, use_tqdm=True):
        print("progress on stdout")
        p = params.kw
        assert p["temperature"] == 0.0 and not p["ignore_eos"], p
        self.n += 3
        ids = prompts[0]["prompt_token_ids"]
        return [_Req([i + 1 for i in ids][: p["max_tokens"]] + p["stop_token_ids"][:1])]
'''


def test_the_worker_script_speaks_the_protocol(tmp_path):
    pkg = tmp_path / "site" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_VLLM)
    (pkg / "inputs.py").write_text("def TokensPrompt(prompt_token_ids):\n    return {'prompt_token_ids': "
                                   "prompt_token_ids}\n")
    model = tmp_path / "model"
    model.mkdir()
    reqs = V.request_line([1, 2, 3], 2) + "\n" + V.request_line([4], 0) + '{"ids": "x"}\n'
    r = subprocess.run([sys.executable, str(V.WORKER), "--model", str(model), "--head", "H", "--k", "3", "--eos", "2"],
                       input=reqs, capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert lines[0] == {"ready": True, "vllm": "9.9.9", "torch": torch.__version__, "method": "eagle3", "k": 3}
    assert lines[1]["ids"] == [2, 3, 2] and lines[1]["drafts"] == 3 and lines[1]["accepted"] == 6
    assert lines[2] == {"ids": [], "seconds": 0.0}
    assert lines[3]["error"].startswith("ValueError") and len(lines) == 4
    assert "vLLM banner on stdout" in r.stderr and "progress on stdout" in r.stderr
    kw = json.loads((model / "llm_kwargs.json").read_text())
    assert kw["dtype"] == "float32" and kw["enable_prefix_caching"] is False and kw["max_num_seqs"] == 1
    assert kw["spec"] == {"method": "eagle3", "model": "H", "num_speculative_tokens": 3}


def test_the_worker_script_reports_a_failed_start(tmp_path):
    pkg = tmp_path / "site" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("__version__ = '0'\nclass LLM:\n    def __init__(self, **kw):\n        raise "
                                     "RuntimeError('Engine core initialization failed. See root cause')\n")
    r = subprocess.run([sys.executable, str(V.WORKER), "--model", "m"], input="", capture_output=True, text=True,
                       timeout=120, env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 1
    assert json.loads(r.stdout) == {"error": "RuntimeError: Engine core initialization failed. See root cause"}


# --------------------------------------------------------------------------- with vLLM's venv (make vllm-venv)


@pytest.mark.slow
@pytest.mark.skipif(not VENV_PYTHON.is_file(), reason="build/vllm-venv not built (make vllm-venv)")
def test_vllm_eagle3_reproduces_vllm_vanilla_on_the_default_model(tmp_path):
    """The real vLLM loads the float32 target and our head unchanged, drafts with it (τ > 1) and, greedy, returns
    its own vanilla tokens; 2 prompts x 16 tokens, K=3, on 2 cores."""
    from eaglex.base.prompts import read_prompts
    from eaglex.models.gguf import resolve_target
    from eaglex.presets import preset_target_file
    if not (HEAD / "config.json").is_file():
        pytest.skip("models/smollm2-135m not published (make smollm2)")
    try:
        target = resolve_target(preset_target_file("smollm2-135m"))
    except ModelError as e:
        pytest.skip(str(e))
    prompts = read_prompts(HEAD.parent / "heldout_honest.jsonl", None)[:2]
    cfg = V.VllmConfig(python=VENV_PYTHON, target=V.vllm_target(target, REPO_ROOT / "build" / "vllm"), head=HEAD,
                       ks=(3,), logs=tmp_path)
    lines = []
    rows = V.run_vllm_peers(cfg, prompts, 16, 2, [2], 8192, log=lines.append)
    by = {r.method: r for r in rows}
    assert set(by) == {"vanilla", "eagle3"}, lines
    assert by["eagle3"].identical, by["eagle3"].note
    assert by["eagle3"].tau > 1.0 and by["eagle3"].tokens == by["vanilla"].tokens
    assert by["eagle3"].build.startswith("vllm 0.32.0") and "libiomp5.so" in by["eagle3"].build
