// The AVX2 path (with FMA and F16C): 8 output channels a ymm register. Without VNNI, u8 x s8 products are summed
// exactly through int16 (vpmovzxbw, vpmaddwd): vpmaddubsw would saturate on w + 128.
#include <immintrin.h>

#include <cstring>
#include <limits>

#include "linear.h"

namespace eaglex {
namespace avx2 {

namespace {

constexpr int kMaxRows = 2;

// NaN outputs as the one quiet NaN (linear.h)
inline __m256 canonical(__m256 v) {
  return _mm256_blendv_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

inline void quantize_block(const float* x, int8_t* q, float* d_out, int32_t* qsum_out) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  const __m256i max_finite = _mm256_set1_epi32(0x7f7fffff);
  __m256 xv[4], amax = _mm256_setzero_ps();
  __m256i bad = _mm256_setzero_si256();
#pragma GCC unroll 16
  for (int i = 0; i < 4; ++i) {
    xv[i] = _mm256_loadu_ps(x + 8 * i);
    const __m256i a = _mm256_and_si256(_mm256_castps_si256(xv[i]), abs_mask);
    bad = _mm256_or_si256(bad, _mm256_cmpgt_epi32(a, max_finite));   // a >= 0 as int32: signed compare is right
    amax = _mm256_max_ps(amax, _mm256_castsi256_ps(a));
  }
  std::memset(q, 0, kBlock);
  *qsum_out = 0;
  if (!_mm256_testz_si256(bad, bad)) {
    *d_out = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  const float d = hmax(amax) / 127.0f;
  *d_out = d;
  if (d == 0.0f) return;
  const __m256 dv = _mm256_set1_ps(d);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  alignas(32) int32_t v[kBlock];
  __m256i sum = _mm256_setzero_si256();
#pragma GCC unroll 16
  for (int i = 0; i < 4; ++i) {
    __m256i iv = _mm256_cvtps_epi32(_mm256_div_ps(xv[i], dv));   // MXCSR rounding: half to even
    iv = _mm256_min_epi32(_mm256_max_epi32(iv, lo), hi);
    sum = _mm256_add_epi32(sum, iv);
    _mm256_store_si256(reinterpret_cast<__m256i*>(v + 8 * i), iv);
  }
  for (int i = 0; i < kBlock; ++i) q[i] = int8_t(v[i]);
  alignas(32) int32_t s[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(s), sum);
  *qsum_out = s[0] + s[1] + s[2] + s[3] + s[4] + s[5] + s[6] + s[7];
}

// raw int32 sums of channels 4p..4p+3 as [c0 c0 c1 c1 | c2 c2 c3 c3] pair sums -> 8 channels in order
inline __m256i channels8(__m256i a, __m256i b) {
  return _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(a, b), _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
}

template <bool Q4, int R>
inline void quant_tile(const QuantRows& a, int64_t r0, const uint8_t* wt, const uint16_t* st, float* y, int64_t N,
                       int64_t cols) {
  const int64_t Kb = a.blocks;
  alignas(32) float acc[R][kTile] = {};
  alignas(32) uint8_t unpacked[kRecord];            // Q4: the record's nibbles as Q8's bytes
  const __m256i nibble = _mm256_set1_epi8(0x0f);
  for (int64_t b = 0; b < Kb; ++b) {
    const uint8_t* rec = wt + b * (Q4 ? kRecord4 : kRecord);
    if (Q4) {
      for (int h = 0; h < kRecord4; h += 32) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + h));
        _mm256_store_si256(reinterpret_cast<__m256i*>(unpacked + h), _mm256_and_si256(v, nibble));
        _mm256_store_si256(reinterpret_cast<__m256i*>(unpacked + kRecord4 + h),
                           _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble));
      }
      rec = unpacked;
    }
    alignas(32) int16_t q16[R][kBlock];
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const int8_t* q = a.q + ((r0 + i) * Kb + b) * kBlock;
      _mm256_store_si256(reinterpret_cast<__m256i*>(q16[i]),
                         _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
      _mm256_store_si256(reinterpret_cast<__m256i*>(q16[i] + 16),
                         _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
    }
    __m256i z[R][4];
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i)
#pragma GCC unroll 16
      for (int p = 0; p < 4; ++p) z[i][p] = _mm256_setzero_si256();
#pragma GCC unroll 16
    for (int j = 0; j < 8; ++j) {
      __m256i wz[4];
#pragma GCC unroll 16
      for (int p = 0; p < 4; ++p)
        wz[p] = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + j * 64 + p * 16)));
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) {
        int64_t qv;
        std::memcpy(&qv, q16[i] + 4 * j, 8);
        const __m256i xq = _mm256_set1_epi64x(qv);
  #pragma GCC unroll 16
        for (int p = 0; p < 4; ++p) z[i][p] = _mm256_add_epi32(z[i][p], _mm256_madd_epi16(wz[p], xq));
      }
    }
    const uint16_t* sb = st + b * kTile * (Q4 ? 2 : 1);
    const __m256 s_lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb)));
    const __m256 s_hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 8)));
    const __m256 m_lo = Q4 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + kTile)))
                           : _mm256_setzero_ps();
    const __m256 m_hi = Q4 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + kTile + 8)))
                           : _mm256_setzero_ps();
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const int64_t rb = (r0 + i) * Kb + b;
      const __m256i offset = _mm256_set1_epi32(Q4 ? 0 : 128 * a.qsum[rb]);
      const __m256 dv = _mm256_set1_ps(a.d[rb]);
      const __m256i dot_lo = _mm256_sub_epi32(channels8(z[i][0], z[i][1]), offset);
      const __m256i dot_hi = _mm256_sub_epi32(channels8(z[i][2], z[i][3]), offset);
      const __m256 u_lo = _mm256_mul_ps(_mm256_mul_ps(s_lo, dv), _mm256_cvtepi32_ps(dot_lo));
      const __m256 u_hi = _mm256_mul_ps(_mm256_mul_ps(s_hi, dv), _mm256_cvtepi32_ps(dot_hi));
      __m256 y_lo = _mm256_add_ps(_mm256_load_ps(acc[i]), u_lo);
      __m256 y_hi = _mm256_add_ps(_mm256_load_ps(acc[i] + 8), u_hi);
      if (Q4) {
        const __m256 qs = _mm256_set1_ps(float(a.qsum[rb]));
        y_lo = _mm256_add_ps(y_lo, _mm256_mul_ps(_mm256_mul_ps(m_lo, dv), qs));
        y_hi = _mm256_add_ps(y_hi, _mm256_mul_ps(_mm256_mul_ps(m_hi, dv), qs));
      }
      _mm256_store_ps(acc[i], y_lo);
      _mm256_store_ps(acc[i] + 8, y_hi);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
    _mm256_store_ps(acc[i], canonical(_mm256_load_ps(acc[i])));
    _mm256_store_ps(acc[i] + 8, canonical(_mm256_load_ps(acc[i] + 8)));
  }
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) std::memcpy(y + (r0 + i) * N, acc[i], size_t(cols) * sizeof(float));
}

template <int T, int R>
inline void f32_tiles_rows(const float* x, int64_t r0, int64_t K, const float* wt, float* y, int64_t N,
                           int64_t last_cols) {
  __m256 acc[T][R][2];
#pragma GCC unroll 16
  for (int t = 0; t < T; ++t)
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) acc[t][i][0] = acc[t][i][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 wv[T][2];
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) {
      wv[t][0] = _mm256_loadu_ps(wt + (t * K + k) * kTile);
      wv[t][1] = _mm256_loadu_ps(wt + (t * K + k) * kTile + 8);
    }
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const __m256 xv = _mm256_set1_ps(x[(r0 + i) * K + k]);
#pragma GCC unroll 16
      for (int t = 0; t < T; ++t) {
        acc[t][i][0] = _mm256_fmadd_ps(wv[t][0], xv, acc[t][i][0]);
        acc[t][i][1] = _mm256_fmadd_ps(wv[t][1], xv, acc[t][i][1]);
      }
    }
  }
#pragma GCC unroll 16
  for (int t = 0; t < T; ++t)
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      alignas(32) float out[kTile];
      _mm256_store_ps(out, canonical(acc[t][i][0]));
      _mm256_store_ps(out + 8, canonical(acc[t][i][1]));
      std::memcpy(y + (r0 + i) * N + t * kTile, out, size_t(t == T - 1 ? last_cols : kTile) * sizeof(float));
    }
}

inline int64_t cols_of(int64_t N, int64_t t) { return N - t * kTile < kTile ? N - t * kTile : kTile; }

template <int T>
void f32_group(const float* x, int64_t rows, int64_t K, const float* wt, float* y, int64_t N, int64_t last) {
  int64_t r = 0;
  for (; r + 2 <= rows; r += 2) f32_tiles_rows<T, 2>(x, r, K, wt, y, N, last);
  if (r < rows) f32_tiles_rows<T, 1>(x, r, K, wt, y, N, last);
}

}  // namespace

void quantize_rows(const float* x, int64_t rows, int64_t K, int8_t* q, float* d, int32_t* qsum) {
  const int64_t blocks = (K + kBlock - 1) / kBlock;
  alignas(32) float pad[kBlock];
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

template <bool Q4>
void quant_tiles(const QuantRows& a, int64_t rows, const uint8_t* w, const uint16_t* s, int64_t N, int64_t t0,
                 int64_t t1, float* y) {
  const int64_t Kb = a.blocks;
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* wt = w + t * Kb * (Q4 ? kRecord4 : kRecord);
    const uint16_t* st = s + t * Kb * kTile * (Q4 ? 2 : 1);
    int64_t r = 0;
    for (; r + kMaxRows <= rows; r += kMaxRows) quant_tile<Q4, kMaxRows>(a, r, wt, st, y + t * kTile, N, cols_of(N, t));
    if (r < rows) quant_tile<Q4, 1>(a, r, wt, st, y + t * kTile, N, cols_of(N, t));
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
  const int64_t T = rows == 1 ? 2 : 1;     // 16 ymm registers: 2 tiles x 1 row or 1 tile x 2 rows
  int64_t t = t0;
  if (T == 2)
    for (; t + 2 <= t1; t += 2) f32_group<2>(x, rows, K, w + t * K * kTile, y + t * kTile, N, cols_of(N, t + 1));
  for (; t < t1; ++t) f32_group<1>(x, rows, K, w + t * K * kTile, y + t * kTile, N, cols_of(N, t));
}

}  // namespace avx2
}  // namespace eaglex
