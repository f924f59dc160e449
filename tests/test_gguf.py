"""GGUF targets: a tiny Llama written as llama.cpp writes it converts to a folder with the same logits, tokenizer and
chat template; every wrong file fails with one ModelError line."""
import os
import shutil

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from eaglex.base.errors import ModelError  # noqa: E402
from eaglex.base.prompts import encode, load_tokenizer  # noqa: E402
from eaglex.models import gguf as G  # noqa: E402

Q = gguf.GGMLQuantizationType
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "e r", "Ġ a", "o n", "Ġ w", "o r", "Ġ s"]
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                 "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")
DIMS = dict(hidden=64, ffn=128, layers=2, heads=4, kv_heads=2, ctx=256)


def _byte_chars() -> list[str]:
    """GPT-2's byte-to-unicode table (what byte-level BPE vocabularies are written in)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def _tokens() -> list[str]:
    return SPECIALS + _byte_chars() + [m.replace(" ", "") for m in MERGES]


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of the Q/K rows (interleaved rotary halves)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _qtype(hf_name: str):
    if "norm" in hf_name:
        return Q.F32
    if "embed_tokens" in hf_name:
        return Q.F16
    return Q.Q8_0 if "mlp" in hf_name or "o_proj" in hf_name else Q.F32


def _roundtrip(w: np.ndarray, qtype) -> np.ndarray:
    """What the file holds once read back: quantization is row-wise, so it commutes with the Q/K row permutation."""
    if qtype == Q.F32:
        return w
    if qtype == Q.F16:
        return w.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).reshape(w.shape)


def _gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    i, rest = hf.split(".")[2], ".".join(hf.split(".")[3:])
    return f"blk.{i}." + {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
                          "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
                          "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
                          "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
                          "mlp.down_proj.weight": "ffn_down.weight"}[rest]


def _reference_model(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=len(_tokens()), hidden_size=DIMS["hidden"], intermediate_size=DIMS["ffn"],
                      num_hidden_layers=DIMS["layers"], num_attention_heads=DIMS["heads"],
                      num_key_value_heads=DIMS["kv_heads"], max_position_embeddings=DIMS["ctx"], rms_norm_eps=1e-5,
                      rope_theta=10000.0, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():     # weights large enough that logits are far from uniform
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in name
                    else torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model


def write_tiny_gguf(path, tied: bool = True, arch: str = "llama", tokenizer: bool = True):
    """A tiny Llama GGUF laid out as llama.cpp writes one; returns the reference model holding its exact weights."""
    model = _reference_model(tied)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-llama")
    w.add_block_count(DIMS["layers"])
    w.add_context_length(DIMS["ctx"])
    w.add_embedding_length(DIMS["hidden"])
    w.add_feed_forward_length(DIMS["ffn"])
    w.add_head_count(DIMS["heads"])
    w.add_head_count_kv(DIMS["kv_heads"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(DIMS["hidden"] // DIMS["heads"])
    w.add_vocab_size(len(_tokens()))
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm")
        w.add_token_list(_tokens())
        w.add_token_types([3] * len(SPECIALS) + [1] * (len(_tokens()) - len(SPECIALS)))
        w.add_token_merges(MERGES)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_pad_token_id(2)
        w.add_add_bos_token(False)
        w.add_add_space_prefix(False)
        w.add_chat_template(CHAT_TEMPLATE)
    state = {}
    with torch.no_grad():
        for name, p in model.state_dict().items():
            if tied and name == "lm_head.weight":
                continue
            qtype = _qtype(name)
            ref = _roundtrip(p.numpy().astype(np.float32), qtype)
            state[name] = torch.from_numpy(ref.copy())
            data = ref if qtype != Q.Q8_0 else p.numpy().astype(np.float32)
            if name.endswith("q_proj.weight"):
                data = _permute(data, DIMS["heads"])
            elif name.endswith("k_proj.weight"):
                data = _permute(data, DIMS["kv_heads"])
            if qtype == Q.Q8_0:
                qd = gguf.quants.quantize(data, qtype)
                w.add_tensor(_gguf_name(name), qd, raw_shape=qd.shape, raw_dtype=qtype)
            else:
                w.add_tensor(_gguf_name(name), data.astype(np.float16 if qtype == Q.F16 else np.float32))
        model.load_state_dict(state, strict=False)
        if tied:
            model.tie_weights()
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    model = write_tiny_gguf(d / "tiny.gguf", tied=True)
    out = G.convert_gguf(d / "tiny.gguf", d / "hf")
    return d / "tiny.gguf", out, model


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("tied", [True, False])
def test_converted_logits_equal_the_file_weights(tmp_path, tied, tiny):
    from transformers import AutoModelForCausalLM
    if tied:
        src, out, ref = tiny
    else:
        src = tmp_path / "untied.gguf"
        ref = write_tiny_gguf(src, tied=False)
        out = G.convert_gguf(src, tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings is tied
    assert (model.config.num_hidden_layers, model.config.num_key_value_heads) == (DIMS["layers"], DIMS["kv_heads"])
    ids = torch.randint(0, len(_tokens()), (40,), generator=torch.Generator().manual_seed(3)).tolist()
    a, b = _logits(model, ids), _logits(ref, ids)
    assert a.std() > 0.5                                   # not a degenerate near-uniform model
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert a.argmax(-1).tolist() == b.argmax(-1).tolist()
    names = sorted(p.name for p in out.iterdir())
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", G.MARKER} <= set(names)
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]   # no staging folder left behind


def test_converted_folder_is_an_eaglex_target(tiny):
    from eaglex.models.target import load_target
    target = load_target(tiny[1])
    assert target.spec.num_layers == DIMS["layers"] and target.spec.eos_ids == (2,)


def test_tokenizer_and_chat_template(tiny):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny[1])
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert tok.chat_template == CHAT_TEMPLATE
    ids = tok(" the weather")["input_ids"]
    assert tok.convert_ids_to_tokens(ids)[:3] == ["Ġthe", "Ġw", "e"]                 # byte-level BPE merges
    assert tok.decode(ids) == " the weather"
    # The chat path of prompt files: token ids (ints), equal to tokenizing the rendered template.
    got = encode({"prompt": "on the water"}, tok, True, "x")
    assert all(type(i) is int for i in got)
    text = tok.apply_chat_template([{"role": "user", "content": "on the water"}], add_generation_prompt=True,
                                   tokenize=False)
    assert text.startswith("<|im_start|>user\non the water<|im_end|>\n<|im_start|>assistant\n")
    assert got == tok(text, add_special_tokens=False)["input_ids"]
    assert got[0] == 1 and got.count(2) == 1


def test_tokenizer_loads_by_the_class_its_engine_records_as_autotokenizer_loads_it(tiny, tmp_path):
    """An engine records the tokenizer class AutoTokenizer resolves for its files; loading that class directly (no
    AutoTokenizer imports) gives the same tokenizer. A name that is not a tokenizer class falls back."""
    from transformers import AutoTokenizer

    from eaglex.engines.build import build_engine
    from eaglex.runtime.engine import open_engine
    from eaglex.runtime.manifest import read_manifest

    auto = AutoTokenizer.from_pretrained(tiny[1])
    build_engine(tiny[1], None, tmp_path / "e", progress=False)
    name = read_manifest(tmp_path / "e")["tokenizer_class"]
    assert name == type(auto).__name__
    texts = [" the weather", "on the water<|im_end|>\n", "<|im_start|>user\nhi", "ünï 🙂  x"]
    chat = [{"role": "user", "content": "on the water"}]

    def settings(tok):                       # what from_pretrained was given, less the folder it read
        return {k: v for k, v in tok.init_kwargs.items() if k != "name_or_path"}
    for tok in (open_engine(tmp_path / "e").tokenizer, load_tokenizer(tiny[1], name),
                load_tokenizer(tiny[1], "AutoModel"), load_tokenizer(tiny[1], "no such class")):
        assert type(tok) is type(auto) and settings(tok) == settings(auto)
        assert [tok(t)["input_ids"] for t in texts] == [auto(t)["input_ids"] for t in texts]
        assert encode({"messages": chat}, tok, True, "x") == encode({"messages": chat}, auto, True, "x")
        assert (tok.all_special_ids, tok.eos_token_id, tok.chat_template) == \
            (auto.all_special_ids, auto.eos_token_id, auto.chat_template)


def test_existing_output_is_refused_then_overwritten(tiny, tmp_path):
    src, _, _ = tiny
    out = tmp_path / "hf"
    out.mkdir()
    (out / "stale.txt").write_text("x")
    with pytest.raises(ModelError, match="already exists"):
        G.convert_gguf(src, out)
    G.convert_gguf(src, out, overwrite=True)
    assert (out / "config.json").is_file() and not (out / "stale.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def _bad(tmp_path, tiny, kind):
    p = tmp_path / "bad.gguf"
    data = tiny[0].read_bytes()
    if kind == "missing":
        return tmp_path / "nope.gguf", "no such GGUF file"
    if kind == "directory":
        p.mkdir()
        return p, "not a file"
    if kind == "text":
        p.write_text("hello, I am not a model\n")
        return p, "not a GGUF file"
    if kind == "empty":
        p.write_bytes(b"")
        return p, "not a GGUF file"
    if kind == "header-truncated":
        p.write_bytes(data[:100])
        return p, "truncated or corrupt"
    if kind == "data-truncated":
        p.write_bytes(data[: len(data) - 1000])
        return p, "truncated"
    if kind == "garbage":
        p.write_bytes(b"GGUF" + np.random.default_rng(0).integers(0, 256, 4000, dtype=np.uint8).tobytes())
        return p, "truncated or corrupt"
    if kind == "architecture":
        write_tiny_gguf(p, arch="gpt2")
        return p, "architecture 'gpt2' is not supported"
    if kind == "no-tokenizer":
        write_tiny_gguf(p, tokenizer=False)
        return p, "no tokenizer"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["missing", "directory", "text", "empty", "header-truncated", "data-truncated",
                                  "garbage", "architecture", "no-tokenizer"])
def test_wrong_files_fail_with_one_line(tmp_path, tiny, kind):
    src, match = _bad(tmp_path, tiny, kind)
    for call in (lambda: G.convert_gguf(src, tmp_path / "out"), lambda: G.resolve_target(src, tmp_path / "cache")):
        with pytest.raises(ModelError, match=match) as e:
            call()
        assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    if (tmp_path / "cache").exists():
        assert not [p for p in (tmp_path / "cache").rglob("*") if p.name.startswith(".")]


def test_resolve_target_caches_by_file(tiny, tmp_path, monkeypatch):
    src = tmp_path / "model.gguf"
    shutil.copy(tiny[0], src)
    assert G.resolve_target(tmp_path / "folder", tmp_path / "c") == tmp_path / "folder"   # not a .gguf: unchanged
    first = G.resolve_target(src, tmp_path / "c")
    assert first.parent == tmp_path / "c" / "gguf" and (first / "config.json").is_file()
    calls = []
    real = G.convert_gguf
    monkeypatch.setattr(G, "convert_gguf", lambda *a, **k: calls.append(a) or real(*a, **k))
    assert G.resolve_target(str(src), tmp_path / "c") == first and not calls           # cached: no conversion
    st = src.stat()
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))                        # the file changed
    second = G.resolve_target(src, tmp_path / "c")
    assert second != first and len(calls) == 1 and (second / "config.json").is_file()
    monkeypatch.setenv(G.CACHE_ENV, str(tmp_path / "env"))
    assert G.cached_folder(src).parent == tmp_path / "env" / "gguf"


def test_cli_import_and_gguf_as_target(tiny, tmp_path, monkeypatch, capsys):
    """`eaglex import --gguf F --out D` writes the folder; every --target also takes the .gguf file itself (converted
    once into the cache) and decodes like the converted folder."""
    import json as _json

    from eaglex.cli import main
    gguf = tiny[0]
    monkeypatch.setenv("EAGLEX_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["import", "--gguf", str(gguf), "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "config.json").is_file()
    assert main(["import", "--gguf", str(gguf), "--out", str(tmp_path / "hf")]) == 2          # exists, no --force
    assert "already exists" in capsys.readouterr().err
    outs = []
    for target in (tmp_path / "hf", gguf):
        out = tmp_path / f"o{len(outs)}.jsonl"
        assert main(["generate", "--target", str(target), "--prompt", "hello", "--max-new-tokens", "6",
                     "--out", str(out)]) == 0
        outs.append(_json.loads(out.read_text())["output_ids"])
    assert outs[0] == outs[1] and len(outs[0]) >= 1
