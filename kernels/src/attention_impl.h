// The attention of attention.h, written once over GCC's generic vectors of 16 floats and compiled once per ISA
// path (attention_<isa>.cpp define EAGLEX_NS): each path gets its own instructions (one zmm, two ymm or four xmm
// per vector) for the same IEEE operations in the same order, hence the same bits.
#include <cstring>
#include <vector>

#include "attention.h"

namespace eaglex {
namespace EAGLEX_NS {

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef float v2 __attribute__((vector_size(8)));

#define EAGLEX_INLINE inline __attribute__((always_inline))

EAGLEX_INLINE v16 load(const float* p) {
  v16 r;
  std::memcpy(&r, p, sizeof r);
  return r;
}

// n < 16 floats, the rest zero
EAGLEX_INLINE v16 load_part(const float* p, int64_t n) {
  v16 r = {};
  std::memcpy(&r, p, size_t(n) * sizeof(float));
  return r;
}

EAGLEX_INLINE v16 splat(float x) { return v16{} + x; }

// lane l + (l + 8), then + 4, + 2, + 1
EAGLEX_INLINE float lane_tree(v16 a) {
  const v8 h = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  const v2 p = __builtin_shufflevector(q, q, 0, 1) + __builtin_shufflevector(q, q, 2, 3);
  return p[0] + p[1];
}

// lane_tree of four vectors at once: the same additions, packed (each step adds lane l and lane l + w of every
// vector, the lower lane first, as lane_tree does), so fewer shuffles and adds per key.
EAGLEX_INLINE v4 lane_tree4(v16 a, v16 b, v16 c, v16 d) {
  const v16 ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                 __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const v16 cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                 __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const v16 q = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const v8 p = __builtin_shufflevector(q, q, 0, 1, 4, 5, 8, 9, 12, 13) +
               __builtin_shufflevector(q, q, 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(p, p, 0, 2, 4, 6) + __builtin_shufflevector(p, p, 1, 3, 5, 7);
}

// e^x for x <= 0 (and NaN): Cephes' expf polynomial in plain multiplies and adds. x below -87 gives 0.
EAGLEX_INLINE v16 exp_neg(v16 x) {
  const v16 lo = splat(-87.0f);
  v16 xs = x == x ? x : splat(0.0f);              // NaN is put back at the end; the conversion never sees it
  xs = xs < lo ? lo : xs;
  const v16 magic = splat(12582912.0f);           // 1.5 * 2^23: adding it rounds to an integer, half to even
  const v16 n = (xs * 1.44269504088896341f + magic) - magic;
  v16 r = xs - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  v16 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  v16 y = (p * r) * r + r + 1.0f;
  const i16 bits = (__builtin_convertvector(n, i16) + 127) << 23;   // 2^n, n in [-126, 0]
  v16 two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  y = y * two_n;
  y = x < lo ? splat(0.0f) : y;
  return x == x ? y : x;
}

// s[i] = dot(q, key i) * scale over C chunks of 16 (the last holding `last` floats), four keys at a time.
template <int C>
void scores(const v16* q, const float* k, int64_t stride, const int32_t* idx, int64_t A, int64_t last, float scale,
            float* s) {
  auto chunk = [last](const float* p, int c) { return c + 1 < C || last == 16 ? load(p + 16 * c) : load_part(p + 16 * c, last); };
  int64_t i = 0;
  for (; i + 4 <= A; i += 4) {
    const float *k0 = k + idx[i] * stride, *k1 = k + idx[i + 1] * stride, *k2 = k + idx[i + 2] * stride,
                *k3 = k + idx[i + 3] * stride;
    v16 a0 = q[0] * chunk(k0, 0), a1 = q[0] * chunk(k1, 0), a2 = q[0] * chunk(k2, 0), a3 = q[0] * chunk(k3, 0);
    for (int c = 1; c < C; ++c) {
      a0 = a0 + q[c] * chunk(k0, c);
      a1 = a1 + q[c] * chunk(k1, c);
      a2 = a2 + q[c] * chunk(k2, c);
      a3 = a3 + q[c] * chunk(k3, c);
    }
    const v4 dots = lane_tree4(a0, a1, a2, a3) * scale;
    std::memcpy(s + i, &dots, sizeof dots);
  }
  for (; i < A; ++i) {
    const float* k0 = k + idx[i] * stride;
    v16 a0 = q[0] * chunk(k0, 0);
    for (int c = 1; c < C; ++c) a0 = a0 + q[c] * chunk(k0, c);
    s[i] = lane_tree(a0) * scale;
  }
}

// y = (e_0 v_0 + e_1 v_1 + ...) / den over C chunks of 16, y holding D floats.
template <int C>
void weighted_values(const float* v, int64_t stride, const int32_t* idx, const float* e, int64_t A, int64_t last,
                     float den, float* y) {
  auto chunk = [last](const float* p, int c) { return c + 1 < C || last == 16 ? load(p + 16 * c) : load_part(p + 16 * c, last); };
  v16 acc[C];
  const float* v0 = v + idx[0] * stride;
  for (int c = 0; c < C; ++c) acc[c] = e[0] * chunk(v0, c);
  for (int64_t i = 1; i < A; ++i) {
    const float* vi = v + idx[i] * stride;
    for (int c = 0; c < C; ++c) acc[c] = acc[c] + e[i] * chunk(vi, c);
  }
  for (int c = 0; c < C; ++c) {
    const v16 out = acc[c] / den;
    std::memcpy(y + 16 * c, &out, size_t(c + 1 < C ? 16 : last) * sizeof(float));
  }
}

template <int C>
void heads(const AttentionShape& sh, const float* q, const float* k, const float* v, const uint8_t* mask,
           int64_t u0, int64_t u1, float* y) {
  const int64_t D = sh.D, T = sh.T, N = sh.N, G = sh.Hq / sh.Hkv, stride = sh.B * sh.Hkv * D;
  const int64_t last = D - 16 * (C - 1);
  thread_local std::vector<int32_t> idx;
  thread_local std::vector<float> s;
  idx.resize(size_t(T));
  s.resize(size_t(T + 16));
  for (int64_t u = u0; u < u1; ++u) {
    const int64_t b = u / sh.Hq, hq = u % sh.Hq, h = hq / G;
    const float* kh = k + (b * sh.Hkv + h) * D;
    const float* vh = v + (b * sh.Hkv + h) * D;
    for (int64_t r = 0; r < N; ++r) {
      const uint8_t* seen = mask + (b * N + r) * T;
      float* out = y + ((b * N + r) * sh.Hq + hq) * D;
      int64_t A = 0;
      for (int64_t t = 0; t < T; ++t)
        if (seen[t]) idx[size_t(A++)] = int32_t(t);
      if (A == 0) {
        std::memset(out, 0, size_t(D) * sizeof(float));
        continue;
      }
      const float* qr = q + ((b * N + r) * sh.Hq + hq) * D;
      v16 qv[C];
      for (int c = 0; c < C; ++c) qv[c] = c + 1 < C ? load(qr + 16 * c) : load_part(qr + 16 * c, last);
      scores<C>(qv, kh, stride, idx.data(), A, last, sh.scale, s.data());
      float m = s[0];
      for (int64_t i = 1; i < A; ++i) m = m > s[size_t(i)] ? m : s[size_t(i)];
      for (int64_t i = 0; i < A; i += 16) {          // the tail's lanes past A are computed and never read
        const v16 e = exp_neg(load(s.data() + i) - m);
        std::memcpy(s.data() + i, &e, sizeof e);
      }
      float den = s[0];
      for (int64_t i = 1; i < A; ++i) den = den + s[size_t(i)];
      weighted_values<C>(vh, stride, idx.data(), s.data(), A, last, den, out);
    }
  }
}

}  // namespace

void attention_heads(const AttentionShape& sh, const float* q, const float* k, const float* v, const uint8_t* mask,
                     int64_t u0, int64_t u1, float* y) {
  switch ((sh.D + 15) / 16) {
    case 1: return heads<1>(sh, q, k, v, mask, u0, u1, y);
    case 2: return heads<2>(sh, q, k, v, mask, u0, u1, y);
    case 3: return heads<3>(sh, q, k, v, mask, u0, u1, y);
    case 4: return heads<4>(sh, q, k, v, mask, u0, u1, y);
    case 5: return heads<5>(sh, q, k, v, mask, u0, u1, y);
    case 6: return heads<6>(sh, q, k, v, mask, u0, u1, y);
    case 7: return heads<7>(sh, q, k, v, mask, u0, u1, y);
    case 8: return heads<8>(sh, q, k, v, mask, u0, u1, y);
    case 9: return heads<9>(sh, q, k, v, mask, u0, u1, y);
    case 10: return heads<10>(sh, q, k, v, mask, u0, u1, y);
    case 11: return heads<11>(sh, q, k, v, mask, u0, u1, y);
    case 12: return heads<12>(sh, q, k, v, mask, u0, u1, y);
    case 13: return heads<13>(sh, q, k, v, mask, u0, u1, y);
    case 14: return heads<14>(sh, q, k, v, mask, u0, u1, y);
    case 15: return heads<15>(sh, q, k, v, mask, u0, u1, y);
    default: return heads<16>(sh, q, k, v, mask, u0, u1, y);   // the op refuses D > kMaxHeadDim
  }
}

}  // namespace EAGLEX_NS
}  // namespace eaglex
