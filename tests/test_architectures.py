"""Every supported target architecture runs through the same forward: Mistral and Qwen3 (q/k norms) with random
weights, vanilla == transformers greedy, and speculative == vanilla with a random EAGLE-3 head (acceptance is not the
point here, exactness is)."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM

from eaglex.runtime.generate import SpeculativeGenerator, VanillaGenerator
from eaglex.runtime.torch_backend import TorchBackend
from eaglex.runtime.types import TreeConfig

COMMON = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=7, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, eos_token_id=3, tie_word_embeddings=False)
ARCHS = {
    "mistral": (MistralConfig, MistralForCausalLM, dict(sliding_window=128)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=24)),
}


def _random_eagle3_head(folder, H=64, V=64, Vd=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.05  # noqa: E731
    hd, nh, nkv, inter = 16, 4, 2, 128
    sd = {"fc.weight": r(H, 3 * H), "norm.weight": torch.ones(H), "lm_head.weight": r(Vd, H) * 20}
    for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm"):
        sd[f"midlayer.{n}.weight"] = torch.ones(H)
    sd.update({"midlayer.self_attn.q_proj.weight": r(nh * hd, 2 * H), "midlayer.self_attn.k_proj.weight":
               r(nkv * hd, 2 * H), "midlayer.self_attn.v_proj.weight": r(nkv * hd, 2 * H),
               "midlayer.self_attn.o_proj.weight": r(H, nh * hd), "midlayer.mlp.gate_proj.weight": r(inter, H),
               "midlayer.mlp.up_proj.weight": r(inter, H), "midlayer.mlp.down_proj.weight": r(H, inter)})
    used = torch.arange(V)[torch.randperm(V, generator=g)[:Vd]].sort().values
    sd["d2t"], sd["t2d"] = used - torch.arange(Vd), torch.zeros(V, dtype=torch.bool).index_fill_(0, used, True)
    folder.mkdir()
    torch.save(sd, folder / "pytorch_model.bin")
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": H, "intermediate_size": inter, "num_attention_heads": nh,
        "num_key_value_heads": nkv, "num_hidden_layers": 1, "vocab_size": V, "draft_vocab_size": Vd,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 2048}))
    return folder


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_architecture_exact(arch, tmp_path):
    config_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(0)
    model = model_cls(config_cls(**COMMON, **extra, architectures=[model_cls.__name__]))
    model.save_pretrained(tmp_path / "target")
    head = _random_eagle3_head(tmp_path / "head")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "target", dtype=torch.float32).eval()
    backend = TorchBackend(tmp_path / "target", head)
    vanilla, spec = VanillaGenerator(backend), SpeculativeGenerator(backend, TreeConfig.parse("dynamic:16/5/4"))
    g = torch.Generator().manual_seed(1)
    for n in (1, 5, 17):
        p = torch.randint(4, 64, (n,), generator=g).tolist()
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=24, pad_token_id=3)[0, n:].tolist()
        assert vanilla.generate(p, 24).output_ids == ref
        assert spec.generate(p, 24).output_ids == ref
