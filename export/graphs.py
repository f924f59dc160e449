"""The graphs an engine holds, as torch modules with the exact ONNX interface, plus their example inputs.

target:    input_ids [B,N] i64, position_ids [B,N] i64, attn_mask [B,1,N,P+N] bool, logits_rows [R] i64,
           past_key_i / past_value_i [P+N,B,Hkv,D]
        -> logits [B,R,V] f32, features [B,N,F] (omitted for a vanilla engine), present_key_i / present_value_i
draft:     hidden [B,N,H], input_ids, position_ids, attn_mask, logits_rows, top_k [] i64, past_key_0 / past_value_0
        -> hidden_out [B,N,H], top_logp [B,R,k] f32, top_ids [B,R,k] i64 (target ids), present_key_0 / present_value_0
draft_fc:  features [B,N,3H] -> hidden [B,N,H]   (EAGLE-3 only)

The KV tensors are rows-first buffers: past_* holds the P cached rows, then N slots that the graph fills with this
call's new rows, and present_* is that buffer with them written (in place when bound to the past's memory). The
torch modules here take and return the plain [B,Hkv,P,D] / [B,Hkv,P+N,D] tensors; export/row_attention.py turns
the exported Concat + Attention into the buffers (export_graph runs it; `heads` says which heads to group).

`logits_rows` picks the rows that get logits: a prefill needs one row, not a [N, V] product. LogSoftmax, TopK and
the draft-to-target id map (d2t) run in the draft graph, so only k ids per row leave it.

EAGLE-3's first draft step reads the target's 3H-wide features through `fc`, later steps its own H-wide output.
Rather than two draft graphs that would each carry the decoder layer, lm_head and embedding, `fc` is a graph of
its own: the first step runs draft_fc then draft, binding fc's output OrtValue straight into the draft graph (one
extra session call per cycle, no weight held twice). EAGLE-1 applies its fc on every step, inside `draft`.

The attention mask is bool (True = attend), which ORT's `Attention` takes directly. Measured on whole graphs
against an additive float mask (same process, interleaved, loaded 2-core host): 155M target at P=256, N=1/8/60:
81.6/114/257 ms bool vs 80.4/118/259 ms float; the fixture target at N=60: 3.4 vs 6.7 ms. Equal within noise, and a
bool mask is 4x smaller to build and bind.

Known duplication: the draft graph carries its own copy of the target's embedding (and EAGLE-1 also of the target's
lm_head), V x H each. For a 128k-vocabulary 8B target that is 2 GB of fp32 on disk and in RAM; sharing it would
need ORT's `SessionOptions.add_initializer` with one OrtValue for both sessions (not done yet).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.export import Dim

from eaglex.models.eagle import DraftHead
from eaglex.models.target import ConcatCache, Target, causal_mask

# Example sizes: never 0 or 1, so that the exporter keeps every axis symbolic.
EXAMPLE_B, EXAMPLE_N, EXAMPLE_P = 2, 7, 13
BATCH, SEQ, PAST, ROWS = Dim("batch"), Dim("seq"), Dim("past"), Dim("rows")


@dataclass
class GraphSpec:
    """What the exporter needs for one graph: the module, example args, names and dynamic axes."""
    name: str
    module: nn.Module
    args: tuple
    input_names: list[str]
    output_names: list[str]
    dynamic_shapes: tuple
    attention_nodes: int          # Attention nodes the graph must contain (one per layer)
    heads: tuple[int, int, int] | None = None    # (query heads, KV heads, head dim) of those Attention nodes
    vocab_size: int = 0           # token ids the graph reads (target vocabulary)
    top_k_max: int = 0            # draft graph: the largest top_k it accepts (draft vocabulary)


def past_names(layers: int, kind: str = "past") -> list[str]:
    return [f"{kind}_{kv}_{i}" for i in range(layers) for kv in ("key", "value")]


def _mask_and_rows(B: int, N: int, P: int) -> tuple[torch.Tensor, torch.Tensor]:
    return causal_mask(N, P, B), torch.arange(N)


SEQ_AXES = {0: BATCH, 1: SEQ}
# The mask's last axis is P + N; Dim.AUTO lets the exporter derive it instead of asking for a third root dim.
MASK_AXES = {0: BATCH, 2: SEQ, 3: Dim.AUTO}
PAST_AXES = {0: BATCH, 2: PAST}


class TargetGraph(nn.Module):
    def __init__(self, target: Target):
        super().__init__()
        self.target = target
        self.layers = target.spec.num_layers

    def forward(self, input_ids, position_ids, attn_mask, logits_rows, *past):
        cache = ConcatCache([(past[2 * i], past[2 * i + 1]) for i in range(self.layers)])
        logits, feats = self.target(input_ids, position_ids, attn_mask, cache, logits_rows)
        presents = [t for kv in cache.present for t in kv]
        if self.target.features == "none":
            return (logits, *presents)
        return (logits, feats, *presents)


def target_graph(target: Target) -> GraphSpec:
    s, B, N, P = target.spec, EXAMPLE_B, EXAMPLE_N, EXAMPLE_P
    dtype = target.embed_weight.dtype
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, s.vocab_size, (B, N), generator=g)
    pos = torch.arange(P, P + N).expand(B, N).contiguous()
    mask, rows = _mask_and_rows(B, N, P)
    past = tuple(torch.randn(B, s.num_kv_heads, P, s.head_dim, generator=g).to(dtype) for _ in range(2 * s.num_layers))
    outputs = ["logits"] + (["features"] if target.features != "none" else []) + past_names(s.num_layers, "present")
    return GraphSpec("target", TargetGraph(target), (ids, pos, mask, rows) + past,
                     ["input_ids", "position_ids", "attn_mask", "logits_rows"] + past_names(s.num_layers),
                     outputs, (SEQ_AXES, SEQ_AXES, MASK_AXES, {0: ROWS}, (PAST_AXES,) * (2 * s.num_layers)),
                     s.num_layers, (s.num_heads, s.num_kv_heads, s.head_dim),
                     s.vocab_size)   # *past takes one nested tuple (a flat one fails)


class DraftGraph(nn.Module):
    def __init__(self, head: DraftHead):
        super().__init__()
        self.head = head
        # DraftHead keeps the target's embedding (and EAGLE-1's target lm_head) out of its own parameters;
        # registering them here makes them weights of this graph with readable initializer names.
        self.embed = head._embed[0]
        if head.spec.kind == "eagle1":
            self.target_lm_head = head.target_lm_head[0]

    def forward(self, hidden, input_ids, position_ids, attn_mask, logits_rows, top_k, past_key_0, past_value_0):
        cache = ConcatCache([(past_key_0, past_value_0)])
        h = self.head(hidden, input_ids, position_ids, attn_mask, cache, project=False)   # [B,N,H]
        logp = self.head.log_probs(h.index_select(1, logits_rows))                          # [B,R,Vd] f32
        k = top_k.item()
        torch._check(k >= 1)
        torch._check(k <= logp.shape[-1])
        top_logp, top = logp.topk(k, -1)
        return (h, top_logp, self.head.to_target_ids(top), *cache.present[0])


class DraftFcGraph(nn.Module):
    def __init__(self, head: DraftHead):
        super().__init__()
        self.fc = head.fc

    def forward(self, features):
        return self.fc(features)


def draft_graphs(head: DraftHead) -> list[GraphSpec]:
    d, B, N, P = head.spec, EXAMPLE_B, EXAMPLE_N, EXAMPLE_P
    dtype = head.fc.weight.dtype
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, d.vocab_size, (B, N), generator=g)
    pos = torch.arange(P, P + N).expand(B, N).contiguous()
    mask, rows = _mask_and_rows(B, N, P)
    hidden = torch.randn(B, N, d.hidden_size, generator=g).to(dtype)
    past = tuple(torch.randn(B, d.num_kv_heads, P, d.head_dim, generator=g).to(dtype) for _ in range(2))
    top_k = torch.tensor(4)
    step = GraphSpec("draft", DraftGraph(head), (hidden, ids, pos, mask, rows, top_k) + past,
                     ["hidden", "input_ids", "position_ids", "attn_mask", "logits_rows", "top_k"] + past_names(1),
                     ["hidden_out", "top_logp", "top_ids"] + past_names(1, "present"),
                     (SEQ_AXES, SEQ_AXES, SEQ_AXES, MASK_AXES, {0: ROWS}, None, PAST_AXES, PAST_AXES), 1,
                     (d.num_heads, d.num_kv_heads, d.head_dim), d.vocab_size, d.draft_vocab_size)
    if d.kind != "eagle3":
        return [step]
    feats = torch.randn(B, N, len(d.taps) * d.hidden_size, generator=g).to(dtype)
    fc = GraphSpec("draft_fc", DraftFcGraph(head), (feats,), ["features"], ["hidden"], (SEQ_AXES,), 0,
                   vocab_size=d.vocab_size)
    return [fc, step]
