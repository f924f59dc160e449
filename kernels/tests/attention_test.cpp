// The attention without ONNX Runtime: every ISA path this CPU runs equals the portable one bit for bit, and a row
// equals itself computed alone at the front of a buffer that holds only its keys, wherever its keys sit in the
// call's buffer, whatever the other rows, the batch, the heads' split or the context (across the 16-key groups).
// NaN / inf / denormal inputs and rows that see no key. Exit status 1 on a mismatch.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "attention.h"

using namespace eaglex;

namespace {

int failures = 0;

void check(bool ok, const char* what, const AttentionShape& s, const char* isa) {
  if (!ok) {
    ++failures;
    std::printf("FAIL %s: B=%lld Hq=%lld Hkv=%lld N=%lld T=%lld D=%lld isa=%s\n", what, (long long)s.B,
                (long long)s.Hq, (long long)s.Hkv, (long long)s.N, (long long)s.T, (long long)s.D, isa);
  }
}

bool same_bits(const float* a, const float* b, size_t n) { return std::memcmp(a, b, n * sizeof(float)) == 0; }

struct Case {
  AttentionShape s;
  std::vector<float> q, k, v, y;
  std::vector<uint8_t> mask;
};

Case random_case(AttentionShape s, std::mt19937& rng, double density) {
  Case c{s, {}, {}, {}, {}, {}};
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::bernoulli_distribution seen(density);
  c.q.resize(size_t(s.B * s.Hq * s.N * s.D));
  c.k.resize(size_t(s.T * s.B * s.Hkv * s.D));
  c.v.resize(c.k.size());
  c.mask.resize(size_t(s.B * s.N * s.T));
  c.y.assign(c.q.size(), -1.0f);
  for (auto& x : c.q) x = nd(rng);
  for (auto& x : c.k) x = nd(rng);
  for (auto& x : c.v) x = nd(rng);
  for (auto& m : c.mask) m = seen(rng) ? 1 : 0;
  return c;
}

void run(Isa isa, Case& c) {
  c.y.assign(c.q.size(), -1.0f);
  attention_heads(isa, c.s, c.q.data(), c.k.data(), c.v.data(), c.mask.data(), 0, c.s.B * c.s.Hq, c.y.data());
}

// Row (b, r) of case c alone: B = 1, N = 1, a buffer holding only the keys the row sees, in order.
std::vector<float> alone(Isa isa, const Case& c, int64_t b, int64_t r) {
  const AttentionShape& s = c.s;
  std::vector<int64_t> seen;
  for (int64_t t = 0; t < s.T; ++t)
    if (c.mask[size_t((b * s.N + r) * s.T + t)]) seen.push_back(t);
  const int64_t A = int64_t(seen.size());
  Case one{{1, s.Hq, s.Hkv, 1, A, s.D, s.scale}, {}, {}, {}, {}, {}};
  one.q.resize(size_t(s.Hq * s.D));
  for (int64_t h = 0; h < s.Hq; ++h)
    std::memcpy(&one.q[size_t(h * s.D)], &c.q[size_t(((b * s.N + r) * s.Hq + h) * s.D)], size_t(s.D) * 4);
  one.k.resize(size_t(A * s.Hkv * s.D));
  one.v.resize(one.k.size());
  for (int64_t i = 0; i < A; ++i)
    for (int64_t h = 0; h < s.Hkv; ++h) {
      const size_t from = size_t(((seen[size_t(i)] * s.B + b) * s.Hkv + h) * s.D), to = size_t((i * s.Hkv + h) * s.D);
      std::memcpy(&one.k[to], &c.k[from], size_t(s.D) * 4);
      std::memcpy(&one.v[to], &c.v[from], size_t(s.D) * 4);
    }
  one.mask.assign(size_t(A), 1);
  run(isa, one);
  return one.y;
}

// The attention in double with libm's exp: the kernel's arithmetic is a float32 rounding of it.
bool near_double(const Case& c, const std::vector<float>& y) {
  const AttentionShape& s = c.s;
  const int64_t G = s.Hq / s.Hkv;
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t hq = 0; hq < s.Hq; ++hq)
      for (int64_t r = 0; r < s.N; ++r) {
        std::vector<double> sc(size_t(s.T), -INFINITY);
        double m = -INFINITY;
        for (int64_t t = 0; t < s.T; ++t) {
          if (!c.mask[size_t((b * s.N + r) * s.T + t)]) continue;
          double dot = 0;
          for (int64_t d = 0; d < s.D; ++d)
            dot += double(c.q[size_t(((b * s.N + r) * s.Hq + hq) * s.D + d)]) *
                   c.k[size_t(((t * s.B + b) * s.Hkv + hq / G) * s.D + d)];
          sc[size_t(t)] = dot * s.scale;
          m = std::max(m, sc[size_t(t)]);
        }
        for (int64_t d = 0; d < s.D; ++d) {
          double num = 0, den = 0;
          for (int64_t t = 0; t < s.T; ++t) {
            if (sc[size_t(t)] == -INFINITY) continue;
            const double e = std::exp(sc[size_t(t)] - m);
            den += e;
            num += e * c.v[size_t(((t * s.B + b) * s.Hkv + hq / G) * s.D + d)];
          }
          const double want = den > 0 ? num / den : 0.0;
          if (std::fabs(want - y[size_t(((b * s.N + r) * s.Hq + hq) * s.D + d)]) > 1e-4) return false;
        }
      }
  return true;
}

void check_case(Case c, const std::vector<Isa>& isas, bool finite = true) {
  run(Isa::portable, c);
  const std::vector<float> want = c.y;
  if (finite) check(near_double(c, want), "near the attention in double", c.s, "portable");
  for (Isa isa : isas) {
    run(isa, c);
    check(same_bits(c.y.data(), want.data(), want.size()), "path equals portable", c.s, isa_name(isa));
    // heads split over chunks as the op's threads would
    std::vector<float> split(want.size(), -1.0f);
    const int64_t units = c.s.B * c.s.Hq;
    for (int64_t u = 0; u < units; u += 3)
      attention_heads(isa, c.s, c.q.data(), c.k.data(), c.v.data(), c.mask.data(), u, std::min(units, u + 3),
                      split.data());
    check(same_bits(split.data(), want.data(), want.size()), "heads split", c.s, isa_name(isa));
  }
  const AttentionShape& s = c.s;
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t r = 0; r < s.N; ++r) {
      const std::vector<float> y = alone(isas.back(), c, b, r);
      bool ok = true;
      for (int64_t h = 0; h < s.Hq; ++h)
        ok = ok && same_bits(&y[size_t(h * s.D)], &want[size_t(((b * s.N + r) * s.Hq + h) * s.D)], size_t(s.D));
      check(ok, "row alone", s, isa_name(isas.back()));
    }
}

}  // namespace

int main() {
  std::vector<Isa> isas{Isa::portable};
  for (Isa isa : {Isa::avx2, Isa::avx512})
    if (best_isa() >= isa) isas.push_back(isa);
  std::mt19937 rng(7);
  // (B, Hq, Hkv, N, T, D): GQA and MHA, head dims that are and are not multiples of 16, chains and trees, contexts
  // across the 4-key and 16-key groups
  const int64_t shapes[][6] = {{1, 9, 3, 1, 1, 64},  {1, 9, 3, 1, 37, 64},  {1, 9, 3, 8, 70, 64}, {2, 4, 4, 5, 33, 8},
                               {3, 6, 2, 4, 17, 80}, {1, 2, 1, 16, 300, 128}, {2, 8, 2, 3, 9, 5},   {1, 4, 2, 64, 129, 32},
                               {1, 2, 2, 2, 1030, 256}};
  for (const auto& d : shapes)
    for (double density : {1.0, 0.6, 0.1}) {
      Case c = random_case({d[0], d[1], d[2], d[3], d[4], d[5], 1.0f / std::sqrt(float(d[5]))}, rng, density);
      check_case(c, isas);
    }
  // special values: NaN, inf and denormal queries, keys and values; rows that see nothing or one key
  Case c = random_case({2, 4, 2, 6, 40, 24, 0.2f}, rng, 0.7);
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  c.q[5] = nan;
  c.q[100] = inf;
  c.q[200] = 1e-41f;
  c.k[33] = -inf;
  c.k[400] = 1e-40f;
  c.v[77] = nan;
  c.v[500] = inf;
  c.q[300] = 1e30f;
  std::fill(c.mask.begin(), c.mask.begin() + 40, 0);                   // row 0 of batch 0 sees no key
  std::fill(c.mask.begin() + 40, c.mask.begin() + 80, 0);
  c.mask[60] = 1;                                                         // row 1 sees one key
  check_case(c, isas, false);
  run(isas.back(), c);
  bool zeros = true;
  for (int64_t h = 0; h < 4; ++h)
    for (int64_t d = 0; d < 24; ++d) zeros = zeros && c.y[size_t(h * 24 + d)] == 0.0f;      // b = 0, row 0
  check(zeros, "a row that sees no key is zero", c.s, isa_name(isas.back()));
  std::printf("%s: %d failures (paths:", failures ? "FAILED" : "ok", failures);
  for (Isa isa : isas) std::printf(" %s", isa_name(isa));
  std::printf(")\n");
  return failures ? 1 : 0;
}
