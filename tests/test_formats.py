"""Checkpoint formats and bad input: official EAGLE-3 / EAGLE-1 layouts in both file formats load unchanged and
compute the official math (checked against an independent transcription, tests/reference_eagle.py); every
malformed input gives one clear ModelError that names the problem."""
from __future__ import annotations

import json
import shutil

import pytest
import reference_eagle as ref
import torch
from helpers import attend, one_slot_cache

from eaglex.base.errors import ModelError
from eaglex.models.eagle import load_draft
from eaglex.models.seeded import make_eagle1_head, make_eagle3_head, make_llama_target
from eaglex.models.target import load_target
from eaglex.runtime.generate import SpeculativeGenerator, VanillaGenerator
from eaglex.runtime.torch_backend import TorchBackend
from eaglex.runtime.types import TreeConfig


def _draft_rows(head, hidden, ids, project):
    """Run the loaded head over T rows causally (positions 0..T-1) with a fresh cache."""
    T = ids.shape[0]
    s = head.spec
    cache = one_slot_cache(1, s.num_kv_heads, s.head_dim, T)
    return head(hidden[None], ids[None], torch.arange(T)[None], attend(cache, T), cache, project)[0]


@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
@pytest.mark.parametrize("layout", ["official", "modelopt"])
def test_eagle3_layouts_load_and_match_reference(fmt, layout, models, tmp_path, prompts):
    head_dir = make_eagle3_head(models["llama"], tmp_path / "h", fmt=fmt, draft_vocab_size=40, layout=layout)
    target = load_target(models["llama"])
    head = load_draft(head_dir, target)
    assert head.spec.kind == "eagle3" and head.spec.draft_vocab_size == 40
    hf = ref.load_target(models["llama"])
    reference = ref.Eagle3Reference(head_dir, hf.model.embed_tokens.weight)
    ids = torch.tensor(prompts[5] + prompts[6])
    feats, _ = ref.target_eagle3_features(hf, ids)
    nxt = torch.cat([ids[1:], ids[:1]])
    ours = _draft_rows(head, feats, nxt, project=True)
    theirs = reference.forward(reference.fuse(feats), nxt, torch.arange(ids.shape[0]))
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    lp = head.log_probs(ours)
    assert torch.equal(head.to_target_ids(lp.argmax(-1)), reference.top1(theirs))
    # the speculative loop runs on it and stays exact
    backend = TorchBackend(models["llama"], head_dir)
    p = prompts[2]
    assert SpeculativeGenerator(backend, TreeConfig.parse("dynamic:60/8/10")).generate(p, 20).output_ids == \
        VanillaGenerator(backend).generate(p, 20).output_ids


@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
def test_eagle1_layout_loads_and_matches_reference(fmt, models, tmp_path, prompts):
    head_dir = make_eagle1_head(models["qwen2"], tmp_path / "h", fmt=fmt)
    target = load_target(models["qwen2"])
    head = load_draft(head_dir, target)
    assert head.spec.kind == "eagle1"
    hf = ref.load_target(models["qwen2"])
    reference = ref.Eagle1Reference(head_dir, hf.lm_head.weight, hf.model.embed_tokens.weight)
    ids = torch.tensor(prompts[7] + prompts[8])
    feats, _ = ref.target_eagle1_features(hf, ids)
    nxt = torch.cat([ids[1:], ids[:1]])
    ours = _draft_rows(head, feats, nxt, project=True)
    theirs = reference.forward(feats, nxt, torch.arange(ids.shape[0]))
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_head_kind_can_be_forced(models):
    target = load_target(models["llama"])
    with pytest.raises(ModelError, match="does not match an eagle1 head"):
        load_draft(models["llama/eagle3"], target, kind="eagle1")


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def _bad_hidden(d):
    _edit_config(d, hidden_size=64)


def _bad_vocab(d):
    _edit_config(d, vocab_size=1000)


def _missing_tensor(d):
    sd = torch.load(d / "pytorch_model.bin", weights_only=True)
    del sd["midlayer.mlp.up_proj.weight"]
    torch.save(sd, d / "pytorch_model.bin")


def _extra_tensor(d):
    sd = torch.load(d / "pytorch_model.bin", weights_only=True)
    sd["midlayer.extra.weight"] = torch.zeros(3)
    torch.save(sd, d / "pytorch_model.bin")


def _wrong_shape(d):
    sd = torch.load(d / "pytorch_model.bin", weights_only=True)
    sd["fc.weight"] = sd["fc.weight"][:, :10]
    torch.save(sd, d / "pytorch_model.bin")


def _bad_d2t(d):
    sd = torch.load(d / "pytorch_model.bin", weights_only=True)
    sd["d2t"] = sd["d2t"] + 1000
    torch.save(sd, d / "pytorch_model.bin")


def _corrupt(d):
    (d / "pytorch_model.bin").write_bytes(b"not a checkpoint at all")


def _pickle_code(d):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))
    torch.save({"fc.weight": Evil()}, d / "pytorch_model.bin")


def _no_weights(d):
    (d / "pytorch_model.bin").unlink()


def _bad_json(d):
    (d / "config.json").write_text("{not json")


def _no_config(d):
    (d / "config.json").unlink()


DRAFT_ERRORS = [
    (_bad_hidden, "hidden size 64"),
    (_bad_vocab, "vocab_size 1000"),
    (_missing_tensor, r"missing \['midlayer.mlp.up_proj.weight'\]"),
    (_extra_tensor, r"unexpected \['midlayer.extra.weight'\]"),
    (_wrong_shape, "tensor fc.weight has shape"),
    (_bad_d2t, "d2t maps draft ids outside"),
    (_corrupt, "cannot read .*pytorch_model.bin"),
    (_pickle_code, "cannot read .*pytorch_model.bin"),
    (_no_weights, "holds no weights"),
    (_bad_json, "not valid JSON"),
    (_no_config, "has no config.json"),
]


@pytest.mark.parametrize("damage,message", DRAFT_ERRORS, ids=[d.__name__.strip("_") for d, _ in DRAFT_ERRORS])
def test_draft_errors(damage, message, models, tmp_path, capsys):
    d = _copy(models["llama/eagle3"], tmp_path / "head")
    damage(d)
    target = load_target(models["llama"])
    with pytest.raises(ModelError, match=message) as e:
        load_draft(d, target)
    assert "\n" not in str(e.value)
    assert "pwned" not in capsys.readouterr().out   # the pickle's code never ran


def test_head_for_another_target(models, tmp_path):
    """A head trained for a model of another width fails at load, naming both sizes."""
    other = make_llama_target(tmp_path / "wide", hidden=64)
    with pytest.raises(ModelError, match="hidden size 96 .* target's is 64"):
        TorchBackend(other, models["llama/eagle3"])


def test_target_errors(models, tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        load_target(tmp_path / "nope")
    d = _copy(models["llama"], tmp_path / "t1")
    _edit_config(d, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelError, match="GPT2LMHeadModel is not supported"):
        load_target(d)
    d = _copy(models["llama"], tmp_path / "t2")
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelError, match="holds no weights"):
        load_target(d)
    d = _copy(models["llama"], tmp_path / "t3")
    (d / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ModelError, match="cannot load the target"):
        load_target(d)
