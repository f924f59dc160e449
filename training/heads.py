"""What both head trainers share: a trainable models.eagle.DraftHead built from a config dict the way
`load_draft` builds a loaded one, the frozen target's teacher forward, and the official-layout writer."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import LlamaConfig

from eaglex.base.errors import ModelError
from eaglex.models.eagle import DraftHead, DraftSpec, load_draft
from eaglex.models.target import ConcatCache, Target, causal_mask, eagle3_taps

ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings")


def new_head(target: Target, config: dict, kind: str) -> DraftHead:
    """A freshly initialised (nn.Linear defaults), trainable float32 head of `kind` for `target`, on its device.

    Spec and RoPE come from `config` exactly as models.eagle.load_draft derives them, so the trained module and
    the one loaded back from disk compute the same function.
    """
    H, nh = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or H // nh
    vocab = config["vocab_size"]
    spec = DraftSpec(kind=kind, hidden_size=H, num_heads=nh, num_kv_heads=config.get("num_key_value_heads") or nh,
                     head_dim=head_dim, intermediate_size=config["intermediate_size"], vocab_size=vocab,
                     draft_vocab_size=config.get("draft_vocab_size") or vocab, rms_eps=config["rms_norm_eps"],
                     fc_bias=bool(config.get("bias", True)), qkv_bias=bool(config.get("qkv_bias", False)),
                     taps=eagle3_taps(target.spec.num_layers) if kind == "eagle3" else ())
    rope_cfg = LlamaConfig(hidden_size=H, num_attention_heads=nh, head_dim=head_dim,
                           **{k: config[k] for k in ROPE_KEYS if config.get(k) is not None})
    rope_cfg.max_position_embeddings = max(rope_cfg.max_position_embeddings, target.spec.max_context)
    head = DraftHead(spec, rope_cfg, target.inner.embed_tokens, target.lm_head)
    return head.float().to(target.embed_weight.device).train().requires_grad_(True)


def init_head(target: Target, path: str | Path, kind: str) -> tuple[DraftHead, dict]:
    """A trainable float32 copy of the `kind` head in `path` and its config.json, to continue training from.

    It is read by models.eagle.load_draft, as the runtime reads it (our safetensors heads, the official layouts;
    weights_only / safetensors, never arbitrary pickles), which also checks that it fits `target`: hidden size,
    vocabulary, tensor shapes, a d2t inside the target's vocabulary. A mismatch is a one-line ModelError.
    """
    head = load_draft(path, target)
    if head.spec.kind != kind:
        raise ModelError(f"--init {path} is an {head.spec.kind} head; training {kind} needs an {kind} head")
    config = json.loads((Path(path) / "config.json").read_text())
    return head.float().to(target.embed_weight.device).train().requires_grad_(True), config


def layer_config(target: Target, cfg, eos_id: int | None) -> dict:
    """The config.json keys every head shares: one Llama decoder layer sized from `cfg` (intermediate_size,
    num_heads, num_kv_heads; 0 = the target's), the target's vocabulary and EOS, the official heads' dtype."""
    t, hf = target.spec, target.hf.config
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": t.hidden_size,
        "intermediate_size": cfg.intermediate_size or hf.intermediate_size,
        "num_attention_heads": cfg.num_heads or t.num_heads,
        "num_key_value_heads": cfg.num_kv_heads or t.num_kv_heads,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-05,
        "vocab_size": t.vocab_size,
        "pad_token_id": 0,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "initializer_range": 0.02,
        "use_cache": True,
    }


def causal_cache(target_or_head_kv: tuple[int, int, int], batch: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> ConcatCache:
    """An empty functional cache for a full-sequence forward: (layers, kv heads, head dim)."""
    layers, kv_heads, head_dim = target_or_head_kv
    empty = torch.zeros(batch, kv_heads, 0, head_dim, dtype=dtype, device=device)
    return ConcatCache([(empty, empty)] * layers)


@torch.no_grad()
def teacher(target: Target, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [B,T] -> the target's logits [B,T,V] float32 and the features its head reads [B,T,F]
    (whatever the target view was made with), from the same forward the runtime runs, on the target's device."""
    B, T = tokens.shape
    t, dev = target.spec, target.embed_weight.device
    cache = causal_cache((t.num_layers, t.num_kv_heads, t.head_dim), B, target.embed_weight.dtype, dev)
    return target(tokens.to(dev), torch.arange(T, device=dev).expand(B, T), causal_mask(T, 0, B, dev), cache)


class Teacher:
    """What a head trainer reads from the frozen target for the sequences `idx`: logits over `keep` (the draft
    vocabulary; None: all), the full-vocabulary argmax, and the head's input features.

    When the whole data set's outputs fit in `cache_gb`, they are computed once, in float32 as inference runs the
    target (features float32, logits bfloat16: they only feed a softmax target), and every step slices them
    (on models/tiny: EAGLE-3 steps 1.6x, EAGLE-1/2 steps 4x faster). `outputs` hands in that cache computed
    elsewhere (teacher_outputs over row ranges in parallel processes: the same batches, the same numbers). Larger
    data (a real target) runs the forward per step, under the trainer's autocast.
    """

    def __init__(self, target: Target, tokens: torch.Tensor, keep: torch.Tensor | None = None,
                 cache_gb: float = 0.0, batch: int = 8, outputs: tuple | None = None):
        self.target, self.tokens, self.keep = target, tokens, keep
        N, T = tokens.shape
        V = target.spec.vocab_size if keep is None else keep.numel()
        F = target.feature_size
        self.cached = outputs is not None or N * T * (2 * V + 4 * F + 8) <= cache_gb * 2 ** 30
        if outputs is not None:
            self.logits, self.top, self.feats = outputs
            if self.logits.shape != (N, T, V) or self.feats.shape != (N, T, F):
                raise ValueError(f"teacher outputs {tuple(self.logits.shape)}/{tuple(self.feats.shape)} do not fit "
                                 f"{N} sequences of {T} tokens, {V} logits and {F} features")
        elif self.cached:
            self.logits, self.top, self.feats = teacher_outputs(target, tokens, keep, batch)

    def __call__(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """idx [B] -> logits [B,T,V'] float32, argmax [B,T] int64, features [B,T,F] float32, on the target's
        device (the cache itself stays in host memory)."""
        if self.cached:
            dev = self.target.embed_weight.device
            return self.logits[idx].to(dev).float(), self.top[idx].to(dev), self.feats[idx].to(dev)
        logits, top, feats = _forward(self.target, self.tokens[idx], self.keep)
        return logits.float(), top, feats.float()


def _forward(target: Target, tokens: torch.Tensor, keep: torch.Tensor | None):
    logits, feats = teacher(target, tokens)
    return (logits if keep is None else logits[..., keep.to(logits.device)]), logits.argmax(-1), feats


@torch.no_grad()
def teacher_outputs(target: Target, tokens: torch.Tensor, keep: torch.Tensor | None = None, batch: int = 8
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher's cache for tokens [N,T], in float32, `batch` rows per forward: logits [N,T,V'] bfloat16, argmax
    [N,T] int64, features [N,T,F] float32. Rows [a, b) with a a multiple of `batch` give the same numbers as
    rows a..b-1 of the whole (the forwards see the same batches)."""
    from tqdm import tqdm

    N, T = tokens.shape
    V = target.spec.vocab_size if keep is None else keep.numel()
    logits = torch.empty(N, T, V, dtype=torch.bfloat16)
    top = torch.empty(N, T, dtype=torch.long)
    feats = torch.empty(N, T, target.feature_size)
    with torch.autocast(target.embed_weight.device.type, enabled=False):
        for i in tqdm(range(0, N, batch), desc="teacher outputs", leave=False):
            logits[i:i + batch], top[i:i + batch], feats[i:i + batch] = _forward(target, tokens[i:i + batch], keep)
    return logits, top, feats


def save_head(head: DraftHead, config: dict, out: str | Path, extra: dict[str, torch.Tensor]) -> None:
    """config.json + pytorch_model.bin: the head's floating tensors in float16 (like the official heads), plus
    `extra` (t2d, EAGLE-1's embed_tokens copy)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: (v.detach().to(torch.float16) if v.is_floating_point() else v.detach()).clone().contiguous()
             for k, v in head.state_dict().items()}
    for k, v in extra.items():   # copies of target tensors: float16 only where that is exact
        v = v.detach()
        lossless = v.is_floating_point() and torch.equal(v.to(torch.float16).to(v.dtype), v)
        state[k] = (v.to(torch.float16) if lossless else v).clone().contiguous()
    torch.save(state, out / "pytorch_model.bin")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
