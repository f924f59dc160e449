"""llama.cpp as a bench peer: F32 / Q8_0 copies of a GGUF file hold the same weights and metadata, the --llamacpp
option resolves (or skips with one line), and, where llama-cpp-python is installed, llama.cpp's greedy F32 tokens
equal eaglex vanilla on a tiny GGUF target."""
import json
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from eaglex import llamacpp_peer as P  # noqa: E402
from eaglex.base.errors import ModelError  # noqa: E402
from eaglex.models import gguf as G  # noqa: E402
from eaglex.models import gguf_derive as D  # noqa: E402

Q = gguf.GGMLQuantizationType
TOKENS = ["<s>", "</s>", "a", "b"]


def _write(path: Path, tensors: dict, alignment: int = 64) -> None:
    """A small GGUF of `tensors` (name -> (float32 array, type)) with one metadata field of every kind."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(alignment)
    w.add_name("odd")
    w.add_block_count(1)
    w.add_uint32("llama.context_length", 128)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_token_list(TOKENS)
    w.add_token_types([3, 3, 1, 1])
    w.add_array("general.languages", ["en", "fr"])
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q4_1))
    for name, (data, qtype) in tensors.items():
        if qtype in (Q.F32, Q.F16):
            w.add_tensor(name, data.astype(np.float32 if qtype == Q.F32 else np.float16))
        else:
            q = gguf.quants.quantize(data, qtype)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def odd(tmp_path_factory):
    """Every case the writer distinguishes: F16, Q4_1 and Q8_0 matrices, a 1-D norm, rows of 48 (not 32-divisible)."""
    rng = np.random.default_rng(0)
    r = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    path = tmp_path_factory.mktemp("odd") / "odd.Q4_1.gguf"
    _write(path, {"token_embd.weight": (r(4, 64), Q.F16), "blk.0.attn_q.weight": (r(64, 64), Q.Q4_1),
                  "blk.0.ffn_down.weight": (r(64, 128), Q.Q8_0), "blk.0.attn_norm.weight": (r(64), Q.F32),
                  "blk.0.odd.weight": (r(8, 48), Q.F32)})
    return path


def _fields(reader) -> dict:
    return {k: (f.types, f.contents()) for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _floats(t) -> np.ndarray:
    return gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32).reshape(
        tuple(reversed(t.shape.tolist())))


def test_f32_copy_holds_the_dequantized_weights_and_every_field(odd, tmp_path):
    out = D.write_gguf_as(odd, tmp_path / "f32.gguf", "F32")
    src, got = gguf.GGUFReader(odd), gguf.GGUFReader(out)
    want = _fields(src)
    want["general.file_type"] = (want["general.file_type"][0], int(gguf.LlamaFileType.ALL_F32))
    assert _fields(got) == want
    assert [t.name for t in got.tensors] == [t.name for t in src.tensors]
    for s, g in zip(src.tensors, got.tensors):
        assert g.tensor_type == Q.F32
        np.testing.assert_array_equal(_floats(g), _floats(s))
    assert [p.name for p in tmp_path.iterdir()] == ["f32.gguf"]           # no temporary file left behind


def test_q8_0_copy_follows_llama_cpp_rules(odd, tmp_path):
    out = D.write_gguf_as(odd, tmp_path / "q8.gguf", "Q8_0")
    src = {t.name: t for t in gguf.GGUFReader(odd).tensors}
    got = gguf.GGUFReader(out)
    assert got.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_Q8_0)
    assert got.fields["general.alignment"].contents() == 64
    types = {t.name: t.tensor_type for t in got.tensors}
    assert types == {"token_embd.weight": Q.Q8_0, "blk.0.attn_q.weight": Q.Q8_0, "blk.0.ffn_down.weight": Q.Q8_0,
                     "blk.0.attn_norm.weight": Q.F32, "blk.0.odd.weight": Q.F32}
    for t in got.tensors:
        s = src[t.name]
        if s.tensor_type == Q.Q8_0:                                       # copied, not re-rounded
            np.testing.assert_array_equal(np.asarray(t.data), np.asarray(s.data))
        elif t.tensor_type == Q.Q8_0:
            np.testing.assert_array_equal(np.asarray(t.data), gguf.quants.quantize(_floats(s), Q.Q8_0))
        else:
            np.testing.assert_array_equal(_floats(t), _floats(s))


def test_derived_files_are_cached_by_content(odd, tmp_path, monkeypatch):
    first = D.derived_gguf(odd, "Q8_0", tmp_path)
    assert first.name == f"odd-{G.file_sha256(odd)[:16]}.Q8_0.gguf"
    monkeypatch.setattr(D, "write_gguf_as", lambda *a: pytest.fail("rewritten"))
    assert D.derived_gguf(odd, "Q8_0", tmp_path) == first


def test_bad_requests_fail_in_one_line(odd, tmp_path):
    with pytest.raises(ModelError, match="Q4_K"):
        D.write_gguf_as(odd, tmp_path / "x.gguf", "Q4_K")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file")
    with pytest.raises(ModelError, match="not a GGUF file"):
        D.write_gguf_as(junk, tmp_path / "y.gguf", "F32")


def _converted(tmp_path, src: Path) -> Path:
    """A folder with the marker convert_gguf writes (no weights: resolve reads only the marker)."""
    folder = tmp_path / "target"
    folder.mkdir()
    (folder / G.MARKER).write_text(json.dumps({"source": src.name, "size": src.stat().st_size,
                                               "sha256": G.file_sha256(src)}))
    return folder


def test_option_resolves_or_skips_with_one_line(odd, tmp_path, monkeypatch):
    lines = []
    assert P.resolve("off", None, log=lines.append) is None and lines == []
    plain = tmp_path / "plain"
    plain.mkdir()
    assert P.resolve("auto", plain, log=lines.append) is None
    assert len(lines) == 1 and "not converted from a GGUF file" in lines[0]

    folder = _converted(tmp_path, odd)                  # the marker's file is not beside the folder
    lines.clear()
    assert P.resolve("auto", folder, log=lines.append) is None and "--llamacpp FILE.gguf" in lines[0]

    monkeypatch.setattr(P, "available", lambda: False)
    lines.clear()
    assert P.resolve("auto", folder, gguf_hint=odd, log=lines.append) is None
    assert lines == [f"llama.cpp peers: skipped (llama-cpp-python is not installed: {P.INSTALL})"]

    monkeypatch.setattr(P, "available", lambda: True)
    cfg = P.resolve("auto", folder, gguf_hint=odd, log=lines.append)
    assert cfg.source == odd and cfg.cache_dir == folder.resolve().with_name("target.llamacpp")
    assert P.resolve(str(odd), folder).source == odd
    monkeypatch.setattr(P, "_packaged", lambda name: [odd] if name == odd.name else [])   # a preset's pip package
    assert P.resolve("auto", folder).source == odd
    other = tmp_path / "other.gguf"
    _write(other, {"token_embd.weight": (np.ones((4, 64), np.float32), Q.F32)})
    with pytest.raises(ModelError, match="not the file"):
        P.resolve(str(other), folder)
    with pytest.raises(ModelError, match="auto, off or a .gguf file"):
        P.resolve("on", folder)


def test_the_probe_reports_how_the_child_died(monkeypatch, tmp_path):
    monkeypatch.setattr(P, "PROBE", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    assert P._crash(tmp_path / "x.gguf", 1) == "killed by signal 11"
    monkeypatch.setattr(P, "PROBE", "raise SystemExit('cannot load ' + __import__('sys').argv[1])")
    assert P._crash(tmp_path / "x.gguf", 1) == f"cannot load {tmp_path / 'x.gguf'}"
    monkeypatch.setattr(P, "PROBE", "pass")
    assert P._crash(tmp_path / "x.gguf", 1) is None


@pytest.mark.parametrize("row, peer, alongside, expected", [
    # (method, tokens/s, its engine's vanilla in the same section); (peer method, device, tokens/s); beside the peer
    # an engine's vanilla over a peer row: that vanilla's rate beside the peer over the peer's rate
    (("vanilla", 40.0, 40.0), ("vanilla", "cpu F32", 50.0), {"a": 60.0}, {"F32": 1.2}),
    # a tree row: its ratio over its own vanilla (its section) times the vanilla's beside the peer
    (("eagle3", 60.0, 40.0), ("eagle3", "cpu F32 +F32 head", 50.0), {"a": 60.0}, {"F32+E3": 1.8}),
    # the section ran in a slow phase of the host: the same ratio over vanilla, the same answer
    (("eagle3", 30.0, 20.0), ("eagle3", "cpu F32 +F32 head", 50.0), {"a": 60.0}, {"F32+E3": 1.8}),
    (("eagle3", 60.0, 40.0), ("prompt-lookup", "cpu F32", 30.0), {"a": 45.0}, {"py lookup F32": 2.25}),
    (("eagle3", 60.0, 40.0), ("greedy", "cpu Q8_0", 90.0), {"a": 45.0, "b": 1.0}, {"py Q8_0": 0.75}),
    # a peer run without this engine beside it gives it no anchored ratio
    (("eagle3", 60.0, 40.0), ("greedy", "cpu Q8_0", 80.0), {"b": 60.0}, None),
])
def test_anchored_ratios(row, peer, alongside, expected):
    from eaglex.bench import anchor
    method, rate, own_vanilla = row
    rows = [{"engine": "a", "method": "vanilla", "tree": "-", "tokens_per_s": own_vanilla},
            {"engine": "a", "method": method, "tree": "chain:3", "tokens_per_s": rate},
            {"engine": "llama.cpp", "method": peer[0], "device": peer[1], "tokens_per_s": peer[2],
             "alongside_tokens_per_s": alongside}]
    anchor(rows)
    assert rows[1].get("vs_llamacpp_anchored") == expected
    assert "vs_llamacpp_anchored" not in rows[2]


def test_the_anchored_table_has_every_peer_any_row_was_beside():
    """Columns: every llama.cpp row some eaglex row has a ratio over, in the order first met; rows without ratios
    (llama.cpp's, transformers') are not in the table."""
    from eaglex.bench_row import anchored_table
    rows = [{"engine": "a", "vs_llamacpp_anchored": {"F32": 1.1}}, {"engine": "transformers"},
            {"engine": "b", "vs_llamacpp_anchored": {"Q8_0": 1.3, "F32": 1.2}}, {"engine": "llama.cpp"}]
    assert anchored_table(rows) == ([rows[0], rows[2]], ["F32", "Q8_0"])
    assert anchored_table(rows[1:2]) == ([], [])


def test_the_plot_draws_the_anchored_table_beside_the_rows(tmp_path):
    """With llama.cpp rows the picture has two panels (tokens/s; the anchored ratios), without them one."""
    import struct

    from eaglex.bench import anchor
    from eaglex.bench_plot import plot, row_label
    rows = [{"engine": "ort:a", "method": "vanilla", "tree": "-", "tokens_per_s": 40.0, "tau": 1.0},
            {"engine": "ort:a", "method": "eagle3", "tree": "chain:3 (tuned)", "tokens_per_s": 60.0, "tau": 1.9},
            {"engine": "llama.cpp", "method": "eagle3", "tree": "n-max 8 / p-min 0.5", "device": "cpu F32 +F32 head",
             "tokens_per_s": 50.0, "tau": 1.5, "alongside_tokens_per_s": {"ort:a": 45.0}}]
    anchor(rows)
    assert [row_label(r) for r in rows] == ["a vanilla", "a eagle3 chain:3 (tuned)", "llama.cpp F32+E3 8/0.5"]
    width = {}
    alone = [{k: v for k, v in r.items() if k != "vs_llamacpp_anchored"} for r in rows[:2]]
    for name, got in (("both", rows), ("alone", alone)):
        plot(got, tmp_path / f"{name}.png")
        head = (tmp_path / f"{name}.png").read_bytes()[:24]
        assert head[:8] == b"\x89PNG\r\n\x1a\n"
        width[name] = struct.unpack(">I", head[16:20])[0]
    assert width["both"] > 1.5 * width["alone"]
    from eaglex.bench_plot import plot_file
    for text in ("{}", "not json", '{"rows": []}'):
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(ValueError, match="not an `eaglex bench --out` file"):
            plot_file(tmp_path / "bad.json", tmp_path / "bad.png")


# --------------------------------------------------------------------------- with llama-cpp-python installed

@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    """The tiny Llama GGUF of test_gguf (a complete model llama.cpp loads) and its converted folder."""
    pytest.importorskip("llama_cpp")
    from test_gguf import write_tiny_gguf
    d = tmp_path_factory.mktemp("llamacpp")
    write_tiny_gguf(d / "tiny.gguf", tied=True)
    return d / "tiny.gguf", G.convert_gguf(d / "tiny.gguf", d / "target")


def test_llamacpp_f32_greedy_equals_eaglex_vanilla(tiny_target):
    from eaglex.runtime.engine import open_models
    from eaglex.runtime.generate import VanillaGenerator

    src, folder = tiny_target
    engine = open_models(folder, None)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 260, n).tolist() for n in (5, 17, 30)]
    reference = [VanillaGenerator(engine.backend).generate(p, 12).output_ids for p in prompts]
    cfg = P.resolve("auto", folder, gguf_hint=src)
    rows = {(r.method, r.device): r for r in P.run_llamacpp_peers(cfg, prompts, 12, 1, engine.spec.eos_ids,
                                                                   engine.spec.max_context, reference)}
    assert set(rows) == {("greedy", "cpu F32"), ("greedy", "cpu Q8_0"), ("greedy", "cpu source"),
                         ("prompt-lookup", "cpu F32")}
    for r in rows.values():
        assert r.threads == "llama.cpp 1" and r.requests == 3 and not r.enforced
        assert 0 < r.tokens <= 36 and r.seconds > 0
    f32 = rows[("greedy", "cpu F32")]
    assert f32.identical, f32.note
    assert f32.note == "3/3 prompts identical to eaglex vanilla; e2e: vs llama.cpp greedy F32"
    assert "expected to differ" in rows[("greedy", "cpu Q8_0")].note
    assert sorted(p.name.split(".")[-2] for p in cfg.cache_dir.iterdir()) == ["F32", "Q8_0"]


def test_bench_cli_runs_the_llamacpp_rows(tiny_target, tmp_path, monkeypatch, capsys):
    from eaglex.cli import main

    monkeypatch.setenv(G.CACHE_ENV, str(tmp_path / "cache"))
    src, _ = tiny_target
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": list(range(3, 3 + n))}) + "\n" for n in (6, 11)))
    out = tmp_path / "bench.json"
    assert main(["bench", "--target", str(src), "--prompts", str(prompts), "--max-new-tokens", "8", "--no-peers",
                 "--threads", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    mine = [r for r in rows if r["engine"] == "llama.cpp"]
    assert {r["threads"] for r in mine} == {"llama.cpp 1"} and len(mine) == 4
    assert all(r["note"].endswith("e2e: vs eaglex vanilla, run alongside") and r["speedup"] > 0 for r in mine)
    assert "prompts identical to eaglex vanilla" in capsys.readouterr().out


def test_every_engine_runs_beside_the_llamacpp_rows(tiny_target, tmp_path, capsys):
    """With two engines, each one's vanilla runs interleaved with llama.cpp's rows: every llama.cpp row records
    both rates, every eaglex row gets a ratio over every llama.cpp row, and the table prints them."""
    from eaglex import bench
    from eaglex.runtime.engine import open_models

    src, folder = tiny_target
    engines = [("one", open_models(folder, None)), ("two", open_models(folder, None))]
    prompts = [[5, 6, 7, 8], list(range(3, 20))]
    rows = bench.run(engines, prompts, [], 8, threads=1, llamacpp=P.resolve("auto", folder, gguf_hint=src),
                     out=tmp_path / "b.json")
    peers = [r for r in rows if r["engine"] == "llama.cpp"]
    assert len(peers) == 4 and all(set(r["alongside_tokens_per_s"]) == {"one", "two"} for r in peers)
    mine = {r["engine"]: r for r in rows if r["engine"] != "llama.cpp"}
    labels = {"F32", "Q8_0", "source"}
    assert {bench.peer_label(r) for r in peers} == {f"py {w}" for w in labels} | {"py lookup F32"}
    for name, r in mine.items():
        assert r["method"] == "vanilla" and set(r["vs_llamacpp_anchored"]) == {bench.peer_label(p) for p in peers}
        for p in peers:     # a vanilla row over a peer row: its own rate beside that peer over the peer's
            want = p["alongside_tokens_per_s"][name] / p["tokens_per_s"]
            assert r["vs_llamacpp_anchored"][bench.peer_label(p)] == pytest.approx(want, abs=2e-3)
    out = capsys.readouterr().out
    assert "anchored on the engine's vanilla run beside llama.cpp" in out and "py lookup F32" in out
    assert json.loads((tmp_path / "b.json").read_text())["rows"] == rows


def test_a_file_llama_cpp_dies_on_loses_its_rows_only(tiny_target, monkeypatch):
    src, folder = tiny_target
    monkeypatch.setattr(P, "_crash", lambda path, threads: "killed by signal 11" if ".Q8_0." in path.name else None)
    lines = []
    rows = P.run_llamacpp_peers(P.resolve("auto", folder, gguf_hint=src), [[5, 6, 7]], 4, 1, (2,), 256, None,
                                log=lines.append)
    assert sorted(r.device for r in rows) == ["cpu F32", "cpu F32", "cpu source"]
    assert len(lines) == 1 and "Q8_0 rows skipped" in lines[0] and "signal 11" in lines[0]


def test_prompt_lookup_decodes_past_its_batch_rows(tiny_target):
    """llama-cpp-python sizes its score buffer by n_batch (512 rows) unless logits_all, though a draft model keeps
    every row's logits: past 512 tokens of context its Llama.eval overflowed (the long hand-written prompts)."""
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    src, _ = tiny_target
    rng = np.random.default_rng(1)
    prompt = (rng.integers(3, 260, 40).tolist() * 15)[:600]      # repeats, so that the lookup drafts
    greedy = P._generate(P._load(src, 700, 1), prompt, 12, set())
    lookup = P._generate(P._load(src, 700, 1, draft=LlamaPromptLookupDecoding(num_pred_tokens=10)), prompt, 12,
                         set())
    assert len(greedy[0]) == 12 and lookup[0] == greedy[0]
