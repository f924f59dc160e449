// eaglex's batch-invariant attention over the rows-first KV buffers: the arithmetic every ISA path shares.
//
// Shapes: q [B, N, Hq, D] (the projections' own layout); the KV buffers k, v [T, B, Hkv, D] (rows T-N..T-1 are
// this call's new rows, already written); mask [B, 1, N, T] bytes (nonzero = the row may see the key);
// y [B, N, Hq, D]. Query head hq reads KV head hq / (Hq / Hkv).
//
// Per (b, hq, row): the keys the row may see, in buffer order t0 < t1 < ... (A of them), and nothing else:
//   dot(q, k)  16 lanes, lane l summing the products of d = l, l + 16, ... in order (the first product starts the
//              sum; D padded with zeros to a multiple of 16), then the lanes added as a tree: l + (l + 8), then
//              + 4, + 2, + 1
//   s_i = dot(q, k_ti) * scale
//   m   = the running max over s_0..s_{A-1} in order, m = (m > s) ? m : s
//   e_i = expf_eaglex(s_i - m)           (a polynomial in mul and add, the same on every path: attention_impl.h)
//   den = e_0 + e_1 + ... in order;  num[d] = e_0 v_t0[d] + e_1 v_t1[d] + ... in order (each product rounded)
//   y[d] = num[d] / den;  a row that may see no key gets y = 0
// A row's result is then a function of its query and the ordered keys and values it may see: not of the row
// count, of where the keys sit in the buffer (masked rows, padding, tree siblings), of the other rows or of the
// threads. Every step is an IEEE multiply, add, divide, compare or conversion (no FMA), so every ISA path, each
// compiled from the same source with its own vector width (attention_impl.h), gives the same bits.
#pragma once
#include <cstdint>

#include "linear.h"

namespace eaglex {

constexpr int64_t kMaxHeadDim = 256;

struct AttentionShape {
  int64_t B, Hq, Hkv, N, T, D;
  float scale;
};

// y for the query heads u = b * Hq + hq in [u0, u1), every row.
void attention_heads(Isa isa, const AttentionShape& s, const float* q, const float* k, const float* v,
                     const uint8_t* mask, int64_t u0, int64_t u1, float* y);

namespace portable {
void attention_heads(const AttentionShape& s, const float* q, const float* k, const float* v, const uint8_t* mask,
                     int64_t u0, int64_t u1, float* y);
}
namespace avx2 {
void attention_heads(const AttentionShape& s, const float* q, const float* k, const float* v, const uint8_t* mask,
                     int64_t u0, int64_t u1, float* y);
}
namespace avx512 {
void attention_heads(const AttentionShape& s, const float* q, const float* k, const float* v, const uint8_t* mask,
                     int64_t u0, int64_t u1, float* y);
}

}  // namespace eaglex
