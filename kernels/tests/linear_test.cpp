// The linear layers without ONNX Runtime: every ISA path this CPU runs equals the portable one bit for bit, every
// row equals itself computed alone, whatever the tile chunks; odd shapes, no rows, NaN / inf / denormal inputs.
// Built by CMake as eaglex_linear_test; `make kernels-asan` runs it under AddressSanitizer. Exit status 1 on a
// mismatch.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "linear.h"

using namespace eaglex;

namespace {

int failures = 0;

void check(bool ok, const char* what, int64_t M, int64_t K, int64_t N, const char* isa) {
  if (!ok) {
    ++failures;
    std::printf("FAIL %s: M=%lld K=%lld N=%lld isa=%s\n", what, (long long)M, (long long)K, (long long)N, isa);
  }
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) {
      if (std::getenv("EAGLEX_TEST_VERBOSE")) std::printf("  at %zu: %a vs %a\n", i, double(a[i]), double(b[i]));
      return false;
    }
  return true;
}

struct Q8Weights {
  std::vector<uint8_t> w;
  std::vector<uint16_t> s;
};

// Random packed weights: bytes w + 128 with w in [-127, 127], fp16 scales of normal magnitude.
Q8Weights random_q8(int64_t K, int64_t N, std::mt19937& rng) {
  const int64_t tiles = (N + kTile - 1) / kTile, blocks = (K + kBlock - 1) / kBlock;
  Q8Weights out{std::vector<uint8_t>(size_t(tiles * blocks * kRecord), 128),
                std::vector<uint16_t>(size_t(tiles * blocks * kTile), 0)};
  std::uniform_int_distribution<int> wd(-127, 127), sd(0x1c00, 0x2c00);   // scales ~ 2^-8 .. 2^-4
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t b = 0; b < blocks; ++b)
      for (int c = 0; c < kTile; ++c) {
        if (t * kTile + c >= N) continue;        // padded channels stay zero
        out.s[size_t((t * blocks + b) * kTile + c)] = uint16_t(sd(rng));
        for (int k = 0; k < kBlock; ++k) {
          if (b * kBlock + k >= K) continue;     // padded K stays zero
          out.w[size_t((t * blocks + b) * kRecord + ((k / 4) * kTile + c) * 4 + k % 4)] = uint8_t(wd(rng) + 128);
        }
      }
  return out;
}

// Random packed Q4 weights: nibbles q in [0, 15], fp16 d and m of normal magnitude (m negative or positive).
Q8Weights random_q4(int64_t K, int64_t N, std::mt19937& rng) {
  const int64_t tiles = (N + kTile - 1) / kTile, blocks = (K + kBlock - 1) / kBlock;
  Q8Weights out{std::vector<uint8_t>(size_t(tiles * blocks * kRecord4), 0),
                std::vector<uint16_t>(size_t(tiles * blocks * 2 * kTile), 0)};
  std::uniform_int_distribution<int> qd(0, 15), sd(0x1c00, 0x2c00), sign(0, 1);
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t b = 0; b < blocks; ++b)
      for (int c = 0; c < kTile; ++c) {
        if (t * kTile + c >= N) continue;
        uint16_t* sc = &out.s[size_t((t * blocks + b) * 2 * kTile)];
        sc[c] = uint16_t(sd(rng));
        sc[kTile + c] = uint16_t(sd(rng) | (sign(rng) << 15));
        for (int k = 0; k < kBlock && b * kBlock + k < K; ++k) {
          const int jj = (k % 16) / 4, e = k % 4;
          uint8_t& byte = out.w[size_t((t * blocks + b) * kRecord4 + (jj * kTile + c) * 4 + e)];
          byte = uint8_t(k < 16 ? (byte & 0xf0) | qd(rng) : (byte & 0x0f) | (qd(rng) << 4));
        }
      }
  return out;
}

std::vector<float> random_f32_packed(int64_t K, int64_t N, std::mt19937& rng) {
  const int64_t tiles = (N + kTile - 1) / kTile;
  std::vector<float> w(size_t(tiles * K * kTile), 0.0f);
  std::normal_distribution<float> nd(0.0f, 0.05f);
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t k = 0; k < K; ++k)
      for (int c = 0; c < kTile && t * kTile + c < N; ++c) w[size_t((t * K + k) * kTile + c)] = nd(rng);
  return w;
}

std::vector<float> q8(Isa isa, const std::vector<float>& x, int64_t M, int64_t K, const Q8Weights& W, int64_t N,
                      int64_t chunks) {
  const int64_t blocks = (K + kBlock - 1) / kBlock, tiles = (N + kTile - 1) / kTile;
  std::vector<int8_t> q(size_t(M * blocks * kBlock) + 1);
  std::vector<float> d(size_t(M * blocks) + 1);
  std::vector<int32_t> qs(size_t(M * blocks) + 1);
  quantize_rows(isa, x.data(), M, K, q.data(), d.data(), qs.data());
  std::vector<float> y(size_t(M * N));
  const QuantRows a{q.data(), d.data(), qs.data(), blocks};
  for (int64_t i = 0; i < chunks; ++i)
    q8_tiles(isa, a, M, W.w.data(), W.s.data(), N, tiles * i / chunks, tiles * (i + 1) / chunks, y.data());
  return y;
}

std::vector<float> q4(Isa isa, const std::vector<float>& x, int64_t M, int64_t K, const Q8Weights& W, int64_t N,
                      int64_t chunks) {
  const int64_t blocks = (K + kBlock - 1) / kBlock, tiles = (N + kTile - 1) / kTile;
  std::vector<int8_t> q(size_t(M * blocks * kBlock) + 1);
  std::vector<float> d(size_t(M * blocks) + 1);
  std::vector<int32_t> qs(size_t(M * blocks) + 1);
  quantize_rows(isa, x.data(), M, K, q.data(), d.data(), qs.data());
  std::vector<float> y(size_t(M * N));
  const QuantRows a{q.data(), d.data(), qs.data(), blocks};
  for (int64_t i = 0; i < chunks; ++i)
    q4_tiles(isa, a, M, W.w.data(), W.s.data(), N, tiles * i / chunks, tiles * (i + 1) / chunks, y.data());
  return y;
}

std::vector<float> f32(Isa isa, const std::vector<float>& x, int64_t M, int64_t K, const std::vector<float>& W,
                       int64_t N, int64_t chunks) {
  const int64_t tiles = (N + kTile - 1) / kTile;
  std::vector<float> y(size_t(M * N));
  for (int64_t i = 0; i < chunks; ++i)
    f32_tiles(isa, x.data(), M, K, W.data(), N, tiles * i / chunks, tiles * (i + 1) / chunks, y.data());
  return y;
}

std::vector<float> row(const std::vector<float>& y, int64_t r, int64_t N) {
  return std::vector<float>(y.begin() + r * N, y.begin() + (r + 1) * N);
}

void fill_specials(std::vector<float>& x, std::mt19937& rng) {
  const float specials[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::denorm_min(),
                            -1e-40f, 0.0f, -0.0f, 3.0e38f};
  std::uniform_int_distribution<size_t> at(0, x.size() - 1);
  for (size_t i = 0; i < x.size() / 7 + 1; ++i) x[at(rng)] = specials[i % 8];
}

}  // namespace

int main() {
  std::mt19937 rng(1234);
  std::vector<Isa> isas{Isa::portable};
  if (best_isa() != Isa::portable) isas.push_back(Isa::avx2);
  if (best_isa() == Isa::avx512) isas.push_back(Isa::avx512);
  const int64_t Ks[] = {1, 5, 31, 32, 33, 64, 100, 576};
  const int64_t Ns[] = {1, 15, 16, 17, 40, 130};
  const int64_t Ms[] = {0, 1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33};
  for (int64_t K : Ks)
    for (int64_t N : Ns) {
      const Q8Weights W8 = random_q8(K, N, rng);
      const Q8Weights W4 = random_q4(K, N, rng);
      const std::vector<float> W32 = random_f32_packed(K, N, rng);
      for (int64_t M : Ms)
        for (int special = 0; special < 2; ++special) {
          std::normal_distribution<float> nd(0.0f, 1.0f);
          std::vector<float> x(size_t(M * K) + 1);
          for (float& v : x) v = nd(rng);
          if (special && M > 0) fill_specials(x, rng);
          const std::vector<float> ref8 = q8(Isa::portable, x, M, K, W8, N, 1);
          const std::vector<float> ref4 = q4(Isa::portable, x, M, K, W4, N, 1);
          const std::vector<float> ref32 = f32(Isa::portable, x, M, K, W32, N, 1);
          for (Isa isa : isas) {
            for (int64_t chunks : {int64_t(1), int64_t(3)}) {
              check(same_bits(q8(isa, x, M, K, W8, N, chunks), ref8), "q8 equals portable", M, K, N, isa_name(isa));
              check(same_bits(q4(isa, x, M, K, W4, N, chunks), ref4), "q4 equals portable", M, K, N, isa_name(isa));
              check(same_bits(f32(isa, x, M, K, W32, N, chunks), ref32), "f32 equals portable", M, K, N,
                    isa_name(isa));
            }
            for (int64_t r = 0; r < M; ++r) {        // each row alone
              std::vector<float> xr(x.begin() + r * K, x.begin() + (r + 1) * K);
              xr.push_back(0.0f);
              check(same_bits(q8(isa, xr, 1, K, W8, N, 1), row(ref8, r, N)), "q8 row alone", M, K, N, isa_name(isa));
              check(same_bits(q4(isa, xr, 1, K, W4, N, 1), row(ref4, r, N)), "q4 row alone", M, K, N, isa_name(isa));
              check(same_bits(f32(isa, xr, 1, K, W32, N, 1), row(ref32, r, N)), "f32 row alone", M, K, N,
                    isa_name(isa));
            }
          }
        }
    }
  std::printf("%s: %d failures (paths:", failures ? "FAIL" : "ok", failures);
  for (Isa isa : isas) std::printf(" %s", isa_name(isa));
  std::printf(")\n");
  return failures ? 1 : 0;
}
