// The AVX-512 path (F, BW, VL, VNNI): 16 output channels a zmm register, vpdpbusd for the int8 blocks.
#include <immintrin.h>

#include <cstring>
#include <limits>

#include "linear.h"

namespace eaglex {
namespace avx512 {

namespace {

constexpr int kMaxRows = 8;             // rows that share one load of a weight record
constexpr int kPrefetchAhead = 16 * kRecord;   // bytes ahead of the record being read (~9 KB of the stream)
constexpr int kPrefetchFromRows = 4;    // below this the hardware prefetcher keeps up (and prefetching cost)

inline void quantize_block(const float* x, int8_t* q, float* d_out, int32_t* qsum_out) {
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  const __m512i inf_bits = _mm512_set1_epi32(0x7f800000);
  const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
  const __m512i a0 = _mm512_and_si512(_mm512_castps_si512(x0), abs_mask);
  const __m512i a1 = _mm512_and_si512(_mm512_castps_si512(x1), abs_mask);
  const __mmask16 bad = _mm512_cmpge_epu32_mask(a0, inf_bits) | _mm512_cmpge_epu32_mask(a1, inf_bits);
  std::memset(q, 0, kBlock);
  *qsum_out = 0;
  if (bad) {
    *d_out = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_castsi512_ps(a0), _mm512_castsi512_ps(a1)));
  const float d = amax / 127.0f;
  *d_out = d;
  if (d == 0.0f) return;
  const __m512 dv = _mm512_set1_ps(d);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  __m512i i0 = _mm512_cvtps_epi32(_mm512_div_ps(x0, dv));     // MXCSR rounding: half to even
  __m512i i1 = _mm512_cvtps_epi32(_mm512_div_ps(x1, dv));
  i0 = _mm512_min_epi32(_mm512_max_epi32(i0, lo), hi);
  i1 = _mm512_min_epi32(_mm512_max_epi32(i1, lo), hi);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(i0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(i1));
  *qsum_out = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
}

// NaN outputs as the one quiet NaN (linear.h)
inline __m512 canonical(__m512 v) {
  return _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_castsi512_ps(_mm512_set1_epi32(0x7fc00000)));
}

inline __m512i bcast4(const int8_t* q) {
  int32_t v;
  std::memcpy(&v, q, 4);
  return _mm512_set1_epi32(v);
}

inline __mmask16 cols_of(int64_t N, int64_t t) {
  const int64_t n = N - t * kTile;
  return n >= kTile ? __mmask16(0xffff) : __mmask16((1u << n) - 1);
}

// R rows (r0..r0+R) of one tile, Q8 or Q4 weights: every row runs the same sequence whatever R.
template <bool Q4, int R>
inline void quant_tile(const QuantRows& a, int64_t r0, const uint8_t* wt, const uint16_t* st, float* y, int64_t N,
                       __mmask16 cols, bool prefetch) {
  constexpr int record = Q4 ? kRecord4 : kRecord;
  const int64_t Kb = a.blocks;
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  __m512 acc[R];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < Kb; ++b) {
    const uint8_t* rec = wt + b * record;
    if (prefetch)
#pragma GCC unroll 16
      for (int l = 0; l < record; l += 64) _mm_prefetch(reinterpret_cast<const char*>(rec + kPrefetchAhead + l),
                                                        _MM_HINT_T1);
    __m512i wv[8];
    if (Q4) {
#pragma GCC unroll 16
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(rec + j * 64);
        wv[j] = _mm512_and_si512(v, nibble);
        wv[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      }
    } else {
#pragma GCC unroll 16
      for (int j = 0; j < 8; ++j) wv[j] = _mm512_loadu_si512(rec + j * 64);
    }
    const uint16_t* sb = st + b * kTile * (Q4 ? 2 : 1);
    const __m512 sv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb)));
    const __m512 mv = Q4 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + kTile)))
                         : _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const int64_t rb = (r0 + i) * Kb + b;
      const int8_t* q = a.q + rb * kBlock;
      __m512i z0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[0], bcast4(q));
      __m512i z1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[1], bcast4(q + 4));
      z0 = _mm512_dpbusd_epi32(z0, wv[2], bcast4(q + 8));
      z1 = _mm512_dpbusd_epi32(z1, wv[3], bcast4(q + 12));
      z0 = _mm512_dpbusd_epi32(z0, wv[4], bcast4(q + 16));
      z1 = _mm512_dpbusd_epi32(z1, wv[5], bcast4(q + 20));
      z0 = _mm512_dpbusd_epi32(z0, wv[6], bcast4(q + 24));
      z1 = _mm512_dpbusd_epi32(z1, wv[7], bcast4(q + 28));
      const __m512 dv = _mm512_set1_ps(a.d[rb]);
      if (Q4) {
        const __m512i dot = _mm512_add_epi32(z0, z1);
        const __m512 t1 = _mm512_mul_ps(_mm512_mul_ps(sv, dv), _mm512_cvtepi32_ps(dot));
        const __m512 t2 = _mm512_mul_ps(_mm512_mul_ps(mv, dv), _mm512_set1_ps(float(a.qsum[rb])));
        acc[i] = _mm512_add_ps(_mm512_add_ps(acc[i], t1), t2);
      } else {
        const __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(z0, z1), _mm512_set1_epi32(128 * a.qsum[rb]));
        acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(_mm512_mul_ps(sv, dv), _mm512_cvtepi32_ps(dot)));
      }
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) _mm512_mask_storeu_ps(y + (r0 + i) * N, cols, canonical(acc[i]));
}

template <bool Q4>
void quant_tiles(const QuantRows& a, int64_t rows, const uint8_t* w, const uint16_t* s, int64_t N, int64_t t0,
                 int64_t t1, float* y) {
  const int64_t Kb = a.blocks;
  const bool prefetch = rows >= kPrefetchFromRows;
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* wt = w + t * Kb * (Q4 ? kRecord4 : kRecord);
    const uint16_t* st = s + t * Kb * kTile * (Q4 ? 2 : 1);
    float* yt = y + t * kTile;
    const __mmask16 cols = cols_of(N, t);
    int64_t r = 0;
    for (; r + kMaxRows <= rows; r += kMaxRows) quant_tile<Q4, kMaxRows>(a, r, wt, st, yt, N, cols, prefetch && !r);
    const bool pf = prefetch && r == 0;
    switch (rows - r) {
      case 7: quant_tile<Q4, 7>(a, r, wt, st, yt, N, cols, pf); break;
      case 6: quant_tile<Q4, 6>(a, r, wt, st, yt, N, cols, pf); break;
      case 5: quant_tile<Q4, 5>(a, r, wt, st, yt, N, cols, pf); break;
      case 4: quant_tile<Q4, 4>(a, r, wt, st, yt, N, cols, pf); break;
      case 3: quant_tile<Q4, 3>(a, r, wt, st, yt, N, cols, pf); break;
      case 2: quant_tile<Q4, 2>(a, r, wt, st, yt, N, cols, pf); break;
      case 1: quant_tile<Q4, 1>(a, r, wt, st, yt, N, cols, pf); break;
      default: break;
    }
  }
}

template <int T, int R>
inline void f32_tiles_rows(const float* x, int64_t r0, int64_t K, const float* wt, float* y, int64_t N,
                           __mmask16 last_cols) {
  __m512 acc[T][R];
  #pragma GCC unroll 16
  for (int t = 0; t < T; ++t)
    #pragma GCC unroll 16
    for (int i = 0; i < R; ++i) acc[t][i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv[T];
    #pragma GCC unroll 16
    for (int t = 0; t < T; ++t) wv[t] = _mm512_loadu_ps(wt + (t * K + k) * kTile);
    #pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const __m512 xv = _mm512_set1_ps(x[(r0 + i) * K + k]);
      #pragma GCC unroll 16
      for (int t = 0; t < T; ++t) acc[t][i] = _mm512_fmadd_ps(wv[t], xv, acc[t][i]);
    }
  }
  #pragma GCC unroll 16
  for (int t = 0; t < T; ++t)
    #pragma GCC unroll 16
    for (int i = 0; i < R; ++i)
      _mm512_mask_storeu_ps(y + (r0 + i) * N + t * kTile, t == T - 1 ? last_cols : __mmask16(0xffff),
                            canonical(acc[t][i]));
}

template <int T>
void f32_group(const float* x, int64_t rows, int64_t K, const float* wt, float* y, int64_t N, __mmask16 last) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) f32_tiles_rows<T, 4>(x, r, K, wt, y, N, last);
  switch (rows - r) {
    case 3: f32_tiles_rows<T, 3>(x, r, K, wt, y, N, last); break;
    case 2: f32_tiles_rows<T, 2>(x, r, K, wt, y, N, last); break;
    case 1: f32_tiles_rows<T, 1>(x, r, K, wt, y, N, last); break;
    default: break;
  }
}

}  // namespace

void quantize_rows(const float* x, int64_t rows, int64_t K, int8_t* q, float* d, int32_t* qsum) {
  const int64_t blocks = (K + kBlock - 1) / kBlock;
  alignas(64) float pad[kBlock];
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + r * K + b * kBlock;
      const int64_t n = K - b * kBlock;
      if (n < kBlock) {                          // the last, partial block: zero padded
        std::memset(pad, 0, sizeof pad);
        std::memcpy(pad, xb, size_t(n) * sizeof(float));
        xb = pad;
      }
      quantize_block(xb, q + (r * blocks + b) * kBlock, d + r * blocks + b, qsum + r * blocks + b);
    }
}

void q8_tiles(const QuantRows& a, int64_t rows, const uint8_t* w, const uint16_t* s, int64_t N, int64_t t0,
              int64_t t1, float* y) {
  quant_tiles<false>(a, rows, w, s, N, t0, t1, y);
}

void q4_tiles(const QuantRows& a, int64_t rows, const uint8_t* w, const uint16_t* s, int64_t N, int64_t t0,
              int64_t t1, float* y) {
  quant_tiles<true>(a, rows, w, s, N, t0, t1, y);
}

void f32_tiles(const float* x, int64_t rows, int64_t K, const float* w, int64_t N, int64_t t0, int64_t t1, float* y) {
  // one row: 8 tiles in flight hide the FMA latency; more rows: fewer tiles, each weight load shared by the rows
  const int64_t T = rows == 1 ? 8 : (rows == 2 ? 4 : 2);
  int64_t t = t0;
  for (; t + T <= t1; t += T) {
    const float* wt = w + t * K * kTile;
    const __mmask16 last = cols_of(N, t + T - 1);
    if (T == 8) f32_group<8>(x, rows, K, wt, y + t * kTile, N, last);
    else if (T == 4) f32_group<4>(x, rows, K, wt, y + t * kTile, N, last);
    else f32_group<2>(x, rows, K, wt, y + t * kTile, N, last);
  }
  for (; t < t1; ++t) f32_group<1>(x, rows, K, w + t * K * kTile, y + t * kTile, N, cols_of(N, t));
}

}  // namespace avx512
}  // namespace eaglex
