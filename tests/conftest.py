"""Session-wide seeded models, built once per test run into a temporary folder (no network, no training)."""
from __future__ import annotations

import pytest
import torch

from eaglex.models.seeded import make_eagle1_head, make_eagle3_head, make_llama_target, make_prompts, make_qwen2_target

torch.set_num_threads(1)   # CI has 2 cores; tiny models run faster single-threaded and deterministically

TARGETS = {"llama": make_llama_target, "qwen2": make_qwen2_target}


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """{name: folder} for both targets and their heads (EAGLE-3 with a smaller draft vocab, EAGLE-1/2)."""
    root = tmp_path_factory.mktemp("models")
    out = {}
    for name, make in TARGETS.items():
        t = make(root / name)
        out[name] = t
        out[f"{name}/eagle3"] = make_eagle3_head(t, root / f"{name}-eagle3", fmt="bin", draft_vocab_size=40)
        out[f"{name}/eagle1"] = make_eagle1_head(t, root / f"{name}-eagle1", fmt="safetensors")
    return out


@pytest.fixture(scope="session")
def prompts():
    """24 prompts of 1..40 tokens over the fixtures' 48-token vocabulary."""
    return make_prompts(24, 48, seed=1)


@pytest.fixture()
def trees_run(monkeypatch):
    """Every tree the generator core drafts a step with during the test."""
    from eaglex.runtime.batch import BatchedGenerator
    seen = []
    real = BatchedGenerator._speculate

    def spy(self, rows, cfg, limit):
        seen.append(cfg)
        return real(self, rows, cfg, limit)
    monkeypatch.setattr(BatchedGenerator, "_speculate", spy)
    return seen
