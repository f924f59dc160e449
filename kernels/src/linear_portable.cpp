// The portable path: plain C++, the reference every ISA path equals bit for bit.
#include <cmath>
#include <cstring>
#include <limits>

#include "linear.h"

namespace eaglex {
namespace portable {

float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);                  // inf, NaN
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);        // normal: rebias 15 -> 127
  } else if (man == 0) {
    bits = sign;                                             // zero
  } else {                                                   // subnormal half: normal float
    int e = -1;
    do { man <<= 1; ++e; } while ((man & 0x400u) == 0);
    bits = sign | (uint32_t(112 - e) << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// NaN outputs as the one quiet NaN (linear.h)
static float canonical(float v) {
  if (!std::isnan(v)) return v;
  const uint32_t bits = 0x7fc00000u;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// One block: n <= 32 values of x; q zero padded to 32.
static void quantize_block(const float* x, int n, int8_t* q, float* d_out, int32_t* qsum_out) {
  float amax = 0.0f;
  bool finite = true;
  for (int i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &x[i], 4);
    bits &= 0x7fffffffu;
    finite &= bits < 0x7f800000u;
    float a;
    std::memcpy(&a, &bits, 4);
    amax = a > amax ? a : amax;
  }
  std::memset(q, 0, kBlock);
  *qsum_out = 0;
  if (!finite) {
    *d_out = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  const float d = amax / 127.0f;
  *d_out = d;
  if (d == 0.0f) return;
  int32_t sum = 0;
  for (int i = 0; i < n; ++i) {
    float v = std::nearbyint(x[i] / d);                      // the current rounding mode: half to even
    v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
    q[i] = int8_t(v);
    sum += q[i];
  }
  *qsum_out = sum;
}

void quantize_rows(const float* x, int64_t rows, int64_t K, int8_t* q, float* d, int32_t* qsum) {
  const int64_t blocks = (K + kBlock - 1) / kBlock;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t k0 = b * kBlock;
      const int n = int(K - k0 < kBlock ? K - k0 : kBlock);
      quantize_block(x + r * K + k0, n, q + (r * blocks + b) * kBlock, d + r * blocks + b, qsum + r * blocks + b);
    }
}

void q8_tiles(const QuantRows& a, int64_t rows, const uint8_t* w, const uint16_t* s, int64_t N, int64_t t0,
              int64_t t1, float* y) {
  const int64_t Kb = a.blocks;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t cols = N - t * kTile < kTile ? N - t * kTile : kTile;
    for (int64_t r = 0; r < rows; ++r) {
      float acc[kTile] = {0};
      for (int64_t b = 0; b < Kb; ++b) {
        const uint8_t* rec = w + (t * Kb + b) * kRecord;
        const int8_t* q = a.q + (r * Kb + b) * kBlock;
        const float d = a.d[r * Kb + b];
        const int32_t offset = 128 * a.qsum[r * Kb + b];
        for (int c = 0; c < kTile; ++c) {
          int32_t raw = 0;
          for (int j = 0; j < kBlock / 4; ++j)
            for (int e = 0; e < 4; ++e) raw += int32_t(rec[(j * kTile + c) * 4 + e]) * q[j * 4 + e];
          const float sd = half_to_float(s[(t * Kb + b) * kTile + c]) * d;
          const float u = sd * float(raw - offset);
          acc[c] = acc[c] + u;
        }
      }
      for (int64_t c = 0; c < cols; ++c) y[r * N + t * kTile + c] = canonical(acc[c]);
    }
  }
}

void q4_tiles(const QuantRows& a, int64_t rows, const uint8_t* w, const uint16_t* s, int64_t N, int64_t t0,
              int64_t t1, float* y) {
  const int64_t Kb = a.blocks;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t cols = N - t * kTile < kTile ? N - t * kTile : kTile;
    for (int64_t r = 0; r < rows; ++r) {
      float acc[kTile] = {0};
      for (int64_t b = 0; b < Kb; ++b) {
        const uint8_t* rec = w + (t * Kb + b) * kRecord4;
        const uint16_t* sc = s + (t * Kb + b) * 2 * kTile;
        const int8_t* q = a.q + (r * Kb + b) * kBlock;
        const float d = a.d[r * Kb + b];
        const float qsum = float(a.qsum[r * Kb + b]);
        for (int c = 0; c < kTile; ++c) {
          int32_t dot = 0;
          for (int jj = 0; jj < 4; ++jj)
            for (int e = 0; e < 4; ++e) {
              const uint8_t byte = rec[(jj * kTile + c) * 4 + e];
              dot += int32_t(byte & 0x0f) * q[jj * 4 + e] + int32_t(byte >> 4) * q[16 + jj * 4 + e];
            }
          const float t1 = (half_to_float(sc[c]) * d) * float(dot);
          const float t2 = (half_to_float(sc[kTile + c]) * d) * qsum;
          acc[c] = acc[c] + t1;
          acc[c] = acc[c] + t2;
        }
      }
      for (int64_t c = 0; c < cols; ++c) y[r * N + t * kTile + c] = canonical(acc[c]);
    }
  }
}

void f32_tiles(const float* x, int64_t rows, int64_t K, const float* w, int64_t N, int64_t t0, int64_t t1, float* y) {
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t cols = N - t * kTile < kTile ? N - t * kTile : kTile;
    for (int64_t r = 0; r < rows; ++r) {
      float acc[kTile] = {0};
      const float* wt = w + t * K * kTile;
      for (int64_t k = 0; k < K; ++k) {
        const float xv = x[r * K + k];
        for (int c = 0; c < kTile; ++c) acc[c] = std::fma(xv, wt[k * kTile + c], acc[c]);
      }
      for (int64_t c = 0; c < cols; ++c) y[r * N + t * kTile + c] = canonical(acc[c]);
    }
  }
}

}  // namespace portable
}  // namespace eaglex
