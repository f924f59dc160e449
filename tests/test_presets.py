"""Where preset weights come from: an explicit folder, the local Hugging Face cache, a download, or a clear
error offline. The download itself needs the network; the cache path is tested with a cache laid out here."""
from __future__ import annotations

import shutil

import pytest

from eaglex.base.errors import ModelError
from eaglex.presets import PRESETS, get_preset, resolve_weights


def test_every_preset_names_its_hardware():
    for p in PRESETS.values():
        assert p.hardware and p.target_repo and p.draft_repo


def test_check_and_demo_prompts_come_from_the_whole_prompt_file():
    """`make engine` checks the first check_prompts prompts and demos demo_prompt, which may lie beyond them (the
    default's demo prompt 72 once indexed the 16 checked prompts: `make engine` ended with an IndexError)."""
    from dataclasses import replace

    from eaglex.make_engine import check_and_demo
    from eaglex.presets import DATA
    for p in PRESETS.values():
        if p.prompts is None:
            continue
        lines = [ln for ln in (DATA / p.prompts).read_text().splitlines() if ln.strip()]
        assert p.demo_prompt < len(lines) and p.check_prompts <= len(lines), p.name
    every = [[i] for i in range(20)]
    texts = [f"q{i}" for i in range(20)]
    smol = get_preset("smollm2-135m")
    for check, demo in ((4, 10), (0, 3), (16, 0)):
        preset = replace(smol, check_prompts=check, demo_prompt=demo)
        prompts, demo_ids, demo_text = check_and_demo(preset, every, texts)
        assert prompts == every[:check or None] and (demo_ids, demo_text) == ([demo], f"q{demo}")


def test_tuning_prompts_are_a_file_of_their_own():
    """`make engine` tunes the tree on the preset's tuning prompts: a file apart from the prompts it checks and from
    the hand-written ones the bench measures on, long enough for tuning's runoff. Without one it tunes on the
    checked prompts ([] here)."""
    from dataclasses import replace
    from types import SimpleNamespace

    from eaglex.base.prompts import read_records
    from eaglex.engines.tune import TUNE_PROMPTS
    from eaglex.make_engine import tuning_prompts
    from eaglex.presets import DATA

    smol = get_preset("smollm2-135m")
    ids = SimpleNamespace(tokenizer=None)          # the files carry input_ids: no tokenizer needed
    tune = tuning_prompts(smol, ids)
    assert len(tune) >= TUNE_PROMPTS
    measured = [r["input_ids"] for name in (smol.prompts, "smollm2-135m/heldout_honest.jsonl")
                for _, r in read_records(DATA / name)]
    assert not {tuple(t) for t in tune} & {tuple(m) for m in measured}
    assert tuning_prompts(replace(smol, tune_prompts=None), ids) == []


def test_unknown_preset():
    with pytest.raises(ModelError, match="unknown MODEL=nope; presets: smollm2-135m, tiny"):
        get_preset("nope")


def test_explicit_folder(models):
    assert resolve_weights("org/x", models["llama"], "target", "MODEL_DIR") == models["llama"]


def test_explicit_folder_without_config(tmp_path):
    with pytest.raises(ModelError, match="MODEL_DIR=.* has no config.json: place the Hugging Face folder of org/x"):
        resolve_weights("org/x", tmp_path, "target", "MODEL_DIR")


def test_local_hf_cache(models, tmp_path, monkeypatch):
    """A repository already in the HF cache (models--org--name/snapshots/<rev>, refs/main) is used offline."""
    cache = tmp_path / "hub"
    snap = cache / "models--org--tiny" / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(models["llama"], snap)
    (cache / "models--org--tiny" / "refs").mkdir(parents=True)
    (cache / "models--org--tiny" / "refs" / "main").write_text(snap.name)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    got = resolve_weights("org/tiny", None, "target", "MODEL_DIR")
    assert (got / "config.json").is_file() and got.name == snap.name


def test_offline_without_weights_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelError, match="not in the local Hugging Face cache .* MODEL_DIR=/path/to/folder"):
        resolve_weights("meta-llama/Llama-3.1-8B-Instruct", None, "target", "MODEL_DIR")
