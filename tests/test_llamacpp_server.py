"""llama.cpp's own EAGLE-3 as a bench peer: the GGUF head `eaglex export --to llama.cpp` writes (read back with the
`gguf` package: names, shapes, types, metadata, the permuted Q/K rows, d2t), the option and draft-setting parsing,
the τ arithmetic, and, where tools/build_llamacpp.sh has built llama-server, llama.cpp running that head on the
default model's packaged target with every EAGLE-3 output equal to its own vanilla."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from eaglex import llamacpp_server as S  # noqa: E402
from eaglex.base.errors import ModelError  # noqa: E402
from eaglex.bench_row import eos_stop  # noqa: E402
from eaglex.cli import main  # noqa: E402
from eaglex.export import llamacpp as X  # noqa: E402
from eaglex.presets import get_preset, packaged_file  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]

HEAD = REPO_ROOT / "models" / "smollm2-135m" / "eagle3"
BIN = REPO_ROOT / "build" / "llama.cpp" / "bin"


@pytest.fixture(scope="module")
def target_gguf():
    if not (HEAD / "config.json").is_file():
        pytest.skip("models/smollm2-135m not published (make smollm2)")
    preset = get_preset("smollm2-135m")
    try:
        return packaged_file(*preset.package, preset.target_repo)
    except ModelError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def written(target_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("head") / "head.gguf"
    return X.write_eagle3_gguf(HEAD, target_gguf, out)


def _state():
    from safetensors.torch import load_file
    return load_file(str(HEAD / "model.safetensors"))


@pytest.mark.parametrize("n_head,head_dim", [(1, 4), (2, 4), (3, 8)])
def test_permute_rows_interleaves_each_heads_halves(n_head, head_dim):
    w = np.arange(n_head * head_dim * 2, dtype=np.float32).reshape(n_head * head_dim, 2)
    got = X.permute_rows(w, n_head)
    half = head_dim // 2
    for h in range(n_head):
        for i in range(half):              # ggml's pair (2i, 2i+1) is Hugging Face's rows (i, i + d/2)
            assert (got[h * head_dim + 2 * i] == w[h * head_dim + i]).all()
            assert (got[h * head_dim + 2 * i + 1] == w[h * head_dim + half + i]).all()


def test_head_gguf_has_llama_cpps_names_shapes_and_metadata(written, target_gguf):
    cfg = json.loads((HEAD / "config.json").read_text())
    r, t = gguf.GGUFReader(written), gguf.GGUFReader(target_gguf)
    f = {k: v.contents() for k, v in r.fields.items()}
    assert f["general.architecture"] == "eagle3"
    assert f["eagle3.target_layers"] == [2, 15, 27]          # layer inputs, as eaglex taps a 30-layer target
    assert f["eagle3.target_hidden_size"] == 576 and f["eagle3.embedding_length"] == 576
    assert f["eagle3.block_count"] == 1 and f["eagle3.vocab_size"] == 49152
    assert f["eagle3.attention.head_count"] == cfg["num_attention_heads"]
    assert f["eagle3.attention.head_count_kv"] == cfg["num_key_value_heads"]
    assert f["eagle3.feed_forward_length"] == cfg["intermediate_size"]
    assert f["eagle3.rope.dimension_count"] == 64 and f["eagle3.rope.freq_base"] == 10000.0
    assert f["eagle3.norm_before_fc"] is False and f["eagle3.norm_before_residual"] is False
    assert f["general.file_type"] == 0
    tok = {k: v.contents() for k, v in t.fields.items() if k.startswith("tokenizer.")}
    assert tok and {k: v for k, v in f.items() if k.startswith("tokenizer.")} == tok   # the target's, exactly
    tensors = {x.name: x for x in r.tensors}
    shapes = {n: tuple(int(s) for s in reversed(x.shape.tolist())) for n, x in tensors.items()}  # numpy order
    state = _state()
    assert set(tensors) == set(X.NAMES.values()) | {"d2t"}
    for src, dst in X.NAMES.items():
        assert shapes[dst] == tuple(state[src].shape), dst
        assert tensors[dst].tensor_type == gguf.GGMLQuantizationType.F32
    q = np.asarray(tensors["blk.0.attn_q.weight"].data).reshape(shapes["blk.0.attn_q.weight"])
    assert np.array_equal(q, X.permute_rows(state["midlayer.self_attn.q_proj.weight"].float().numpy(), 9))
    k = np.asarray(tensors["blk.0.attn_k.weight"].data).reshape(shapes["blk.0.attn_k.weight"])
    assert np.array_equal(k, X.permute_rows(state["midlayer.self_attn.k_proj.weight"].float().numpy(), 3))
    v = np.asarray(tensors["blk.0.attn_v.weight"].data).reshape(shapes["blk.0.attn_v.weight"])
    assert np.array_equal(v, state["midlayer.self_attn.v_proj.weight"].float().numpy())
    d2t = tensors["d2t"]
    assert d2t.tensor_type == gguf.GGMLQuantizationType.I64
    assert np.array_equal(np.asarray(d2t.data), state["d2t"].numpy() + np.arange(4096))


def test_f16_head_keeps_norms_f32(target_gguf, tmp_path):
    r = gguf.GGUFReader(X.write_eagle3_gguf(HEAD, target_gguf, tmp_path / "h16.gguf", "F16"))
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["fc.weight"] == types["blk.0.attn_q.weight"] == "F16"
    assert types["blk.0.attn_norm.weight"] == types["output_norm.weight"] == "F32" and types["d2t"] == "I64"
    assert r.fields["general.file_type"].contents() == 1


def _head_copy(tmp_path, **config) -> Path:
    head = tmp_path / "head"
    shutil.copytree(HEAD, head)
    cfg = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps({**cfg, **config}))
    return head


@pytest.mark.parametrize("config,message", [
    ({"hidden_size": 512}, "hidden size 512"),
    ({"vocab_size": 32000}, "vocab_size 32000"),
    ({"norm_before_fc": True}, "norm_before_fc"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope scaling"),
])
def test_heads_it_cannot_write_fail_in_one_line(target_gguf, tmp_path, config, message):
    # (hidden size and vocabulary are checked against the target; the rest before it is read)
    with pytest.raises(ModelError, match=message):
        X.write_eagle3_gguf(_head_copy(tmp_path, **config), target_gguf, tmp_path / "out.gguf")
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".out.gguf*"))


def test_export_cli(target_gguf, tmp_path, capsys):
    out = tmp_path / "h.gguf"
    args = ["export", "--to", "llama.cpp", "--draft", str(HEAD), "--target", str(target_gguf), "--out", str(out)]
    assert main(args) == 0 and out.is_file() and "--spec-type draft-eagle3" in capsys.readouterr().out
    assert main(args) == 2 and "--force" in capsys.readouterr().err
    eagle1 = ["export", "--to", "llama.cpp", "--draft", str(HEAD.parent / "eagle1"), "--target", str(target_gguf),
              "--out", str(tmp_path / "e1.gguf")]
    assert main(eagle1) == 2 and "EAGLE-3 heads only" in capsys.readouterr().err
    (tmp_path / "t.gguf").write_text("not gguf")
    bad = ["export", "--to", "llama.cpp", "--draft", str(HEAD), "--target", str(tmp_path / "t.gguf"), "--out",
           str(tmp_path / "b.gguf")]
    assert main(bad) == 2 and "not a readable GGUF file" in capsys.readouterr().err


@pytest.mark.parametrize("text,want", [
    ("8/0.5", ((8, 0.5),)),
    ("2/0, 4/0.75 ,4", ((2, 0.0), (4, 0.75), (4, 0.0))),
    ("4/0,4/0", ((4, 0.0),)),                               # repeats collapse
    (None, tuple((n, p) for p in (0.0, 0.5, 0.75) for n in (2, 4, 8))),
])
def test_parse_drafts(text, want):
    assert tuple((d.n_max, d.p_min) for d in S.parse_drafts(text)) == want


@pytest.mark.parametrize("text", ["", ",", "x/1", "0/0.5", "2/1.5", "2/-0.1", "2/a"])
def test_parse_drafts_refuses(text):
    with pytest.raises(ModelError):
        S.parse_drafts(text)


@pytest.mark.parametrize("generated,accepted,want", [
    (1, 0, 1.0),          # the prefill's token only
    (10, 0, 1.0),         # vanilla: one token per forward
    (10, 6, 3.0),         # 9 tokens after the prefill in 3 forwards
    (129, 96, 128 / 32),
])
def test_tau_counts_tokens_per_target_forward(generated, accepted, want):
    assert S.tau(generated, accepted) == pytest.approx(want)


@pytest.mark.parametrize("ids,limit,want", [
    ([5, 6, 7], 8, [5, 6, 7]),
    ([5, 2, 7], 8, [5, 2]),               # EOS kept, as eaglex keeps it
    ([5, 6, 7], 2, [5, 6]),
    ([2], 8, [2]),
])
def test_eos_stop(ids, limit, want):
    assert eos_stop(ids, limit, {2}) == want


def test_find_bin(tmp_path, monkeypatch):
    lines = []
    assert S.find_bin("off", lines.append) is None and not lines
    assert S.find_bin(str(tmp_path), lines.append) is None
    assert len(lines) == 1 and "tools/build_llamacpp.sh" in lines[0]
    for name in ("llama-server", "llama-quantize"):
        (tmp_path / name).write_text("")
    assert S.find_bin(str(tmp_path), lines.append) == tmp_path
    monkeypatch.chdir(tmp_path)                             # auto: build/llama.cpp/bin, else PATH
    monkeypatch.setenv("PATH", "")
    assert S.find_bin("auto", lines.append) is None and len(lines) == 2


def test_server_rows_asked_for_with_llamacpp_off_are_skipped_in_one_line(tmp_path, capsys, monkeypatch):
    """The server peers run on --llamacpp's GGUF file: `--llamacpp off` with an explicit --llamacpp-server says
    why they are not run instead of leaving them out silently."""
    from types import SimpleNamespace

    from eaglex.cli import _llamacpp_from_args
    for name in ("llama-server", "llama-quantize"):
        (tmp_path / name).write_text("")
    args = SimpleNamespace(target=tmp_path, llamacpp="off", llamacpp_server=str(tmp_path), llamacpp_drafts=None,
                           draft=tmp_path)
    assert _llamacpp_from_args(args, []) == (None, None)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "llama.cpp EAGLE-3 peers: skipped (--llamacpp off" in err
    monkeypatch.setattr(S, "DEFAULT_BIN", tmp_path)   # auto finds them there, but was not asked for by name
    args.llamacpp_server = "auto"
    _llamacpp_from_args(args, [])
    assert capsys.readouterr().err == ""


@pytest.mark.slow
@pytest.mark.skipif(not (BIN / "llama-server").is_file(), reason="llama-server not built (tools/build_llamacpp.sh)")
def test_llama_server_runs_the_exported_head_losslessly(target_gguf, tmp_path):
    """The real llama-server loads the head eaglex wrote, accepts drafts (τ > 1) and, greedy, returns its own
    vanilla tokens; the bench rows say so."""
    from eaglex.base.prompts import read_prompts
    prompts = read_prompts(HEAD.parent / "prompts.jsonl", None)[-3:]
    cfg = S.ServerPeerConfig(bin_dir=BIN, source=target_gguf, head=HEAD, cache_dir=tmp_path,
                             encodings=(), drafts=S.parse_drafts("4/0"))
    rows = S.run_server_peers(cfg, prompts, 48, 2, [2], 8192)
    by = {r.method: r for r in rows}
    assert set(by) == {"vanilla", "eagle3"} and by["eagle3"].device == "cpu Q4_1 +Q8_0 head"
    assert by["eagle3"].identical, by["eagle3"].note
    assert by["eagle3"].tau > 1.3 and by["eagle3"].tokens == by["vanilla"].tokens
