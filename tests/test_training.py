"""training/: the trainers learn, TTT matches the inference chain, heads round-trip through the official loaders,
a trained head beats a random one, train-draft works end to end, and the committed default (models/tiny) loads and
decodes exactly like vanilla greedy."""
from __future__ import annotations

import functools
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import attend, one_slot_cache

from eaglex.models.eagle import load_draft
from eaglex.models.target import eagle3_taps, load_target
from eaglex.runtime.types import TreeConfig
from eaglex.training import corpus, tokenizer, tokens
from eaglex.training.draft_lm import DraftLMConfig, train_draft_lm
from eaglex.training.eagle1 import Eagle1Config, save_eagle1, train_eagle1
from eaglex.training.eagle1 import head_config as eagle1_config
from eaglex.training.eagle3 import Eagle3Config, head_config, save_eagle3, train_eagle3, ttt_layer, ttt_loss, vocab_map
from eaglex.training.heads import Teacher, new_head, teacher, teacher_outputs
from eaglex.training.loop import OptimConfig, step_generator
from eaglex.training.report import tau_table
from eaglex.training.selfdistill import SelfDistillConfig, generate
from eaglex.training.tiny_target import TargetConfig, train_target

TINY = Path(__file__).resolve().parents[1] / "models" / "tiny"
FAST = OptimConfig(steps=40, lr=3e-3, warmup=5, checkpoint_every=0)


def falls(losses: list[float], k: int = 5) -> bool:
    return sum(losses[-k:]) / k < 0.9 * sum(losses[:k]) / k


@pytest.fixture(scope="module")
def llama(models):
    return load_target(models["llama"])


@pytest.fixture(scope="module")
def selfdistill(llama):
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, llama.spec.vocab_size, (48, 8), generator=g).tolist()
    return generate(llama.hf, prompts, SelfDistillConfig(new_tokens=40, batch=48))


# ------------------------------------------------------------------------------------------------ pure parts

def test_vocab_map_is_official():
    counts = torch.tensor([5, 0, 9, 9, 1, 7])
    d2t, t2d = vocab_map(counts, 3)                 # top-3 by count, ties to the lower id: {2, 3, 5}
    assert (torch.arange(3) + d2t).tolist() == [2, 3, 5]
    assert d2t.tolist() == [2, 2, 3] and t2d.tolist() == [False, False, True, True, False, True]


def test_corpus_split_is_by_path():
    files = corpus.list_files()
    assert files == sorted(files) and not any("/test/" in f or f.startswith("test/") for f in files)
    held = [f for f in files if corpus.is_heldout(f, 50)]
    assert 0 < len(held) < len(files) / 10
    assert corpus.is_heldout(held[0], 50) and all(corpus.is_heldout(f, 50) == corpus.is_heldout(f, 50) for f in files)


def test_ttt_step_s_equals_the_inference_chain(llama):
    """Slot t of TTT step s == a draft chain of s steps after the context 0..t, run by DraftHead with a KV cache."""
    llama = llama.with_features("eagle3", eagle3_taps(llama.spec.num_layers))
    torch.manual_seed(0)
    head = new_head(llama, head_config(llama, Eagle3Config(draft_vocab_size=40), None), "eagle3")
    T, S = 10, 4
    n = T - 1
    tokens = torch.randint(0, llama.spec.vocab_size, (1, T))
    _, feats = teacher(llama, tokens)
    with torch.no_grad():
        kv, h, outs = [], head.fc(feats[:, :n]), []
        for s in range(S):
            ids = torch.zeros(1, n, dtype=torch.long)
            ids[:, :n - s] = tokens[:, 1 + s:]
            h = ttt_layer(head, h, ids, s, kv)
            outs.append(h)
        d = head.spec
        for t in range(n):
            cache = one_slot_cache(1, d.num_kv_heads, d.head_dim, 32)
            x = head(feats[:, :t + 1], tokens[:, 1:t + 2], torch.arange(t + 1)[None], attend(cache, t + 1), cache,
                     True)
            cache.commit(0, torch.arange(t + 1))
            torch.testing.assert_close(x[0, t], outs[0][0, t], atol=1e-5, rtol=1e-5)
            x = x[:, -1:]
            for s in range(1, min(S, n - t)):
                x = head(x, tokens[:, t + 1 + s:t + 2 + s], torch.tensor([[t + s]]),
                         attend(cache, 1), cache, False)
                torch.testing.assert_close(x[0, 0], outs[s][0, t], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["eagle3", "eagle1"])
def test_saved_head_loads_through_the_official_loader(llama, tmp_path, kind):
    torch.manual_seed(1)
    if kind == "eagle3":
        llama = llama.with_features("eagle3", eagle3_taps(llama.spec.num_layers))
        config = head_config(llama, Eagle3Config(draft_vocab_size=40), 7)
        head = new_head(llama, config, kind)
        d2t, t2d = vocab_map(torch.arange(llama.spec.vocab_size), 40)
        head.d2t.copy_(d2t)
    else:
        llama = llama.with_features("eagle1")
        config = eagle1_config(llama, Eagle1Config(), 7)
        head = new_head(llama, config, kind)
    with torch.no_grad():                             # the file stores float16: compare on representable weights
        for p in head.parameters():
            p.copy_(p.half().float())
    if kind == "eagle3":
        save_eagle3(head, config, t2d, tmp_path)
        state = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
        assert "embed_tokens.weight" not in state and state["t2d"].dtype == torch.bool and "midlayer.fc" not in state
    else:
        save_eagle1(head, config, tmp_path)
        state = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
        assert "layers.0.self_attn.q_proj.weight" in state and "embed_tokens.weight" in state and "fc.bias" in state
    loaded = load_draft(tmp_path, llama)
    assert loaded.spec.kind == kind
    n = 6
    hidden = torch.randn(1, n, llama.feature_size)
    ids = torch.randint(0, llama.spec.vocab_size, (1, n))
    d = head.spec
    caches = [one_slot_cache(1, d.num_kv_heads, d.head_dim, 8) for _ in range(2)]
    with torch.no_grad():
        want = head(hidden, ids, torch.arange(n)[None], attend(caches[0], n), caches[0], True)
        got = loaded(hidden, ids, torch.arange(n)[None], attend(caches[1], n), caches[1], True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if kind == "eagle3":
        assert torch.equal(loaded.d2t, d2t)


# ------------------------------------------------------------------------------------------------ trainers learn

def test_target_and_draft_lm_trainers_learn(tmp_path):
    files = [f for f in corpus.load() if f.path.startswith("json/")]
    tok = tokenizer.train_tokenizer([f.text for f in files], tokenizer.TokenizerConfig(vocab_size=320))
    tokenizer.save_tokenizer(tok, tmp_path / "tok")
    assert tokenizer.load_tokenizer(tmp_path / "tok").eos_token_id == tok.token_to_id(tokenizer.EOS)
    eos = tok.token_to_id(tokenizer.EOS)
    stream = tokens.encode_files(files, tok, eos)
    cfg = TargetConfig(hidden_size=64, num_layers=7, num_heads=2, num_kv_heads=1, intermediate_size=128, seq_len=64,
                       batch=8, optim=FAST)
    cfg = replace(cfg, optim=replace(FAST, checkpoint_every=10))
    model, losses = train_target(cfg, stream, tok.get_vocab_size(), eos, None, threads=1)
    assert falls(losses), losses

    # a run interrupted after its step-20 checkpoint and resumed ends exactly where the uninterrupted one does
    import eaglex.training.tiny_target as target_mod
    calls = {"n": 0}

    def crash_at_25(*args):
        calls["n"] += 1
        if calls["n"] > 25:
            raise KeyboardInterrupt
        return tokens.sample_windows(*args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(target_mod, "sample_windows", crash_at_25)
        with pytest.raises(KeyboardInterrupt):
            train_target(cfg, stream, tok.get_vocab_size(), eos, tmp_path / "t.pt", threads=1)
    assert torch.load(tmp_path / "t.pt", weights_only=True)["step"] == 20
    again, resumed = train_target(cfg, stream, tok.get_vocab_size(), eos, tmp_path / "t.pt", threads=1)
    assert resumed == losses
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))

    from eaglex.training.selfdistill import SelfDistillData
    sd = SelfDistillData(torch.stack([stream[i:i + 64] for i in range(0, 64 * 16, 64)]), torch.full((16,), 8))
    lm_cfg = DraftLMConfig(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=128,
                           batch=8, optim=FAST)
    _, lm_losses = train_draft_lm(lm_cfg, sd, stream, tok.get_vocab_size(), eos, threads=1)
    assert falls(lm_losses), lm_losses


def test_teacher_cache_matches_the_per_step_forward(llama, selfdistill):
    llama = llama.with_features("eagle3", eagle3_taps(llama.spec.num_layers))
    keep = torch.arange(0, llama.spec.vocab_size, 2)                     # a draft vocabulary of every other id
    cached = Teacher(llama, selfdistill.tokens, keep, cache_gb=1.0, batch=3)
    direct = Teacher(llama, selfdistill.tokens, keep, cache_gb=0.0)
    assert cached.cached and not direct.cached
    idx = torch.tensor([5, 0, 3, 3])
    (lc, tc, fc), (ld, td, fd) = cached(idx), direct(idx)
    assert lc.shape == ld.shape == (4, selfdistill.tokens.shape[1], keep.numel())
    torch.testing.assert_close(lc, ld, rtol=1e-2, atol=1e-2)             # cached logits are bfloat16
    assert torch.equal(tc, td)
    torch.testing.assert_close(fc, fd, rtol=1e-5, atol=1e-5)
    full, _ = teacher(llama, selfdistill.tokens[idx])
    assert torch.equal(td, full.argmax(-1)) and torch.equal(ld, full[..., keep])


def test_teacher_cache_in_parts_equals_the_whole(llama, selfdistill):
    """make tiny computes halves of the EAGLE-3 teacher cache in two processes: rows from a batch boundary on must
    be bit for bit the whole's, and Teacher must take the joined parts."""
    llama = llama.with_features("eagle3", eagle3_taps(llama.spec.num_layers))
    keep = torch.arange(0, llama.spec.vocab_size, 2)
    tokens = selfdistill.tokens
    whole = teacher_outputs(llama, tokens, keep, batch=3)
    parts = [teacher_outputs(llama, tokens[a:b], keep, batch=3) for a, b in ((0, 6), (6, tokens.shape[0]))]
    joined = tuple(torch.cat(p) for p in zip(*parts))
    assert all(torch.equal(w, j) for w, j in zip(whole, joined))
    given = Teacher(llama, tokens, keep, batch=3, outputs=joined)
    idx = torch.tensor([1, 7])
    assert all(torch.equal(a, b) for a, b in zip(given(idx), Teacher(llama, tokens, keep, 1.0, 3)(idx)))
    with pytest.raises(ValueError, match="do not fit"):
        Teacher(llama, tokens[:4], keep, outputs=joined)


def test_eagle3_and_eagle1_trainers_learn(llama, selfdistill):
    _, _, _, l3 = train_eagle3(llama, selfdistill, Eagle3Config(draft_vocab_size=40, ttt_steps=3, batch=8, optim=FAST),
                               threads=1)
    assert falls(l3), l3
    _, _, l1 = train_eagle1(llama, selfdistill, Eagle1Config(batch=8, optim=FAST), threads=1)
    assert falls(l1), l1


def test_trained_head_beats_a_random_head(llama, selfdistill, models, tmp_path):
    cfg = Eagle3Config(draft_vocab_size=40, ttt_steps=3, batch=8, optim=replace(FAST, steps=60))
    head, config, t2d, _ = train_eagle3(llama, selfdistill, cfg, threads=1)
    save_eagle3(head, config, t2d, tmp_path / "trained")
    torch.manual_seed(3)
    random_head = new_head(llama, config, "eagle3")
    random_head.d2t.copy_(head.d2t)
    save_eagle3(random_head, config, t2d, tmp_path / "random")
    prompts = selfdistill.tokens[:4, :8].tolist()
    rows = tau_table(models["llama"], {"trained": tmp_path / "trained", "random": tmp_path / "random"}, prompts,
                     {"chain": TreeConfig.chain(4)}, max_new_tokens=24, progress=False)
    tau = {r.draft: r.tau for r in rows}
    assert all(r.identical == r.prompts for r in rows)
    assert tau["trained"] > tau["random"] + 0.5, tau


def test_train_draft_end_to_end(models, tmp_path, monkeypatch):
    from eaglex.cli import main
    from eaglex.training import train_draft as td

    g = torch.Generator().manual_seed(5)
    with open(tmp_path / "data.jsonl", "w") as f:
        for _ in range(20):
            f.write(json.dumps({"input_ids": torch.randint(0, 48, (10,), generator=g).tolist()}) + "\n")
    small = functools.partial(td.TrainDraftConfig, eval_prompts=2, eval_new_tokens=8,
                              selfdistill=SelfDistillConfig(new_tokens=16))
    monkeypatch.setattr(td, "TrainDraftConfig", small)
    monkeypatch.setattr(td, "SHAPES", {"chain": TreeConfig.chain(3)})
    out = tmp_path / "head"
    assert main(["train-draft", "--target", str(models["llama"]), "--data", str(tmp_path / "data.jsonl"),
                 "--out", str(out), "--method", "eagle1", "--steps", "3"]) == 0
    assert load_draft(out, load_target(models["llama"])).spec.kind == "eagle1"
    report = json.loads((out / "train_report.json").read_text())
    assert report["steps"] == 3 and report["tau"][0]["identical"] == 2
    assert (out / "checkpoints" / "eagle1.pt").is_file()


# ------------------------------------------------------------------------------------------------ --init

def _head_out(head, seed: int = 0) -> torch.Tensor:
    """One draft step of `head` over random features and tokens (the function a head computes)."""
    g = torch.Generator().manual_seed(seed)
    n, d = 6, head.spec
    hidden = torch.randn(1, n, max(1, len(d.taps)) * d.hidden_size, generator=g)   # EAGLE-3: 3 fused layers
    ids = torch.randint(0, d.vocab_size, (1, n), generator=g)
    with torch.no_grad():
        cache = one_slot_cache(1, d.num_kv_heads, d.head_dim, 8)
        return head(hidden, ids, torch.arange(n)[None], attend(cache, n), cache, True)


def test_eagle3_init_first_loss_is_the_loaded_heads(llama, selfdistill, models):
    """Training from --init starts at the head it loads: the first step's loss is that head's TTT loss on the same
    batch (computed here without the trainer's fc preconditioning), well below a fresh head's."""
    path = models["llama/eagle3"]
    cfg = Eagle3Config(ttt_steps=3, batch=8, init=str(path), optim=replace(FAST, steps=1, bf16=False))
    _, _, _, losses = train_eagle3(llama, selfdistill, cfg, threads=1)
    loaded = load_draft(path, llama)
    view = llama.with_features("eagle3", loaded.spec.taps)
    keep = torch.arange(loaded.spec.draft_vocab_size) + loaded.d2t
    t2d = torch.zeros(llama.spec.vocab_size, dtype=torch.bool)
    t2d[keep] = True
    tokens, mask = selfdistill.tokens, selfdistill.loss_mask(True)
    idx = torch.randint(tokens.shape[0], (8,), generator=step_generator(0, 0))
    with torch.no_grad():
        want, _ = ttt_loss(loaded, *Teacher(view, tokens, keep, 4.0, 8)(idx), tokens[idx], mask[idx], t2d, 3, 0.8)
    assert losses[0] == pytest.approx(want.item(), rel=1e-4)
    _, _, _, fresh = train_eagle3(llama, selfdistill, replace(cfg, init=None, draft_vocab_size=40), threads=1)
    assert fresh[0] > 1.5 * losses[0], (fresh[0], losses[0])


@pytest.mark.parametrize("kind", ["eagle3", "eagle1"])
def test_init_at_zero_learning_rate_keeps_the_head(llama, selfdistill, models, tmp_path, kind):
    """With nothing learnt, the trained head is the loaded one (EAGLE-3's fc preconditioning folds back) and saves
    with the loaded head's config and draft vocabulary."""
    path = models[f"llama/{kind}"]
    still = replace(FAST, steps=2, lr=0.0)
    if kind == "eagle3":
        head, config, t2d, _ = train_eagle3(llama, selfdistill, Eagle3Config(ttt_steps=2, batch=4, init=str(path),
                                                                             optim=still), threads=1)
        save_eagle3(head, config, t2d, tmp_path)
    else:
        head, config, _ = train_eagle1(llama, selfdistill, Eagle1Config(batch=4, init=str(path), optim=still),
                                       threads=1)
        save_eagle1(head, config, tmp_path)
    loaded = load_draft(path, llama)
    torch.testing.assert_close(_head_out(head), _head_out(loaded), atol=1e-5, rtol=1e-5)
    assert config == json.loads((path / "config.json").read_text())
    saved = load_draft(tmp_path, llama)
    assert saved.spec == loaded.spec
    if kind == "eagle3":
        assert torch.equal(saved.d2t, loaded.d2t) and int(t2d.sum()) == loaded.spec.draft_vocab_size


def _prompt_file(tmp_path) -> Path:
    g = torch.Generator().manual_seed(5)
    with open(tmp_path / "data.jsonl", "w") as f:
        for _ in range(20):
            f.write(json.dumps({"input_ids": torch.randint(0, 48, (10,), generator=g).tolist()}) + "\n")
    return tmp_path / "data.jsonl"


def test_train_draft_init_end_to_end(models, tmp_path, monkeypatch):
    from eaglex.cli import main
    from eaglex.training import train_draft as td

    small = functools.partial(td.TrainDraftConfig, eval_prompts=2, eval_new_tokens=8,
                              selfdistill=SelfDistillConfig(new_tokens=16))
    monkeypatch.setattr(td, "TrainDraftConfig", small)
    monkeypatch.setattr(td, "SHAPES", {"chain": TreeConfig.chain(3)})
    out, init = tmp_path / "head", models["llama/eagle3"]
    assert main(["train-draft", "--target", str(models["llama"]), "--data", str(_prompt_file(tmp_path)),
                 "--out", str(out), "--init", str(init), "--lr", "3e-4", "--steps", "3"]) == 0
    target = load_target(models["llama"])
    assert torch.equal(load_draft(out, target).d2t, load_draft(init, target).d2t)   # not the data's vocabulary
    report = json.loads((out / "train_report.json").read_text())
    assert report["init"] == str(init) and report["config"]["lr"] == 3e-4 and report["tau"][0]["identical"] == 2


def _other_hidden_size(head: Path, dest: Path) -> Path:
    shutil.copytree(head, dest)
    cfg = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**cfg, "hidden_size": 64}))
    return dest


@pytest.mark.parametrize("bad, message", [
    (lambda m, tmp: m["llama/eagle1"], "is an eagle1 head; training eagle3 needs an eagle3 head"),
    (lambda m, tmp: _other_hidden_size(m["llama/eagle3"], tmp / "h64"), "has hidden size 64"),
    (lambda m, tmp: tmp / "missing", "does not exist"),
])
def test_train_draft_init_refuses_a_head_that_does_not_fit(models, tmp_path, capsys, bad, message):
    """In one line, before any data is generated."""
    from eaglex.cli import main

    out = tmp_path / "head"
    assert main(["train-draft", "--target", str(models["llama"]), "--data", str(_prompt_file(tmp_path)),
                 "--out", str(out), "--init", str(bad(models, tmp_path)), "--steps", "3"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (out / "checkpoints" / "selfdistill.pt").exists()


# ------------------------------------------------------------------------------------------------ the default

@pytest.mark.skipif(not (TINY / "target" / "config.json").is_file(), reason="models/tiny not built (make tiny)")
@pytest.mark.parametrize("head", ["eagle3", "eagle1"])
def test_committed_default_is_lossless(head):
    from eaglex.base.prompts import read_prompts
    from eaglex.runtime.equivalence import check_identical
    from eaglex.runtime.torch_backend import TorchBackend

    backend = TorchBackend(TINY / "target", TINY / head)
    assert backend.draft_kind == head
    prompts = read_prompts(TINY / "prompts.jsonl", None)[:3]
    tree = TreeConfig.parse("dynamic:16/6/4")
    rows = check_identical(backend, tree, prompts, 48)
    assert all(r.identical for r in rows)
    assert sum(r.tau for r in rows) / len(rows) > (2.0 if head == "eagle3" else 1.5)


@pytest.mark.skipif(not (TINY / "draft_lm" / "config.json").is_file(), reason="models/tiny not built (make tiny)")
def test_committed_draft_lm_and_tokenizer_load():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY / "target")
    assert tok.decode(tok("def f(x):\n    return x")["input_ids"]) == "def f(x):\n    return x"
    lm = AutoModelForCausalLM.from_pretrained(TINY / "draft_lm")
    assert lm.config.vocab_size == len(tok) and lm.config.num_hidden_layers <= 2


def test_train_draft_builtin_chat_prompts_hold_out_the_last_ones():
    """`--data builtin-chat`: every training instruction in the chat template, then held-out ones (never trained
    on) as the τ prompts; a target without a chat template is refused in one line."""
    from test_calibration_data import FakeTokenizer

    from eaglex.base import chat_prompts
    from eaglex.base.errors import ModelError
    from eaglex.training.train_draft import builtin_chat

    tok = FakeTokenizer()
    prompts = builtin_chat(tok, 8)
    train, held = chat_prompts.train_prompts(), chat_prompts.heldout_prompts()
    assert len(prompts) == len(train) + 8
    assert tok.seen[:len(train)] == train and tok.seen[-8:] == held[:8]
    assert all(p[:2] == [1, 4] and p[-2:] == [1, 5] for p in prompts)      # a user turn, then the generation prompt
    with pytest.raises(ModelError, match="chat template"):
        builtin_chat(FakeTokenizer(chat=False), 8)
