// Run-time choice of the ISA path, and the dispatching entry points.
#include <cstdlib>
#include <cstring>
#include <initializer_list>

#include "attention.h"
#include "linear.h"

namespace eaglex {

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    default: return "portable";
  }
}

static bool cpu_runs(Isa isa) {
#ifdef EAGLEX_X86
  __builtin_cpu_init();
  // libgcc's checks include the OS's support for the AVX / AVX-512 register state (XGETBV)
  if (isa == Isa::avx512)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("fma");
  if (isa == Isa::avx2)
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#endif
  return isa == Isa::portable;
}

Isa best_isa() {
  if (cpu_runs(Isa::avx512)) return Isa::avx512;
  if (cpu_runs(Isa::avx2)) return Isa::avx2;
  return Isa::portable;
}

bool isa_from_env(Isa* out, const char** error) {
  const char* want = std::getenv("EAGLEX_ISA");
  if (want == nullptr || *want == '\0' || std::strcmp(want, "auto") == 0) {
    *out = best_isa();
    return true;
  }
  for (Isa isa : {Isa::portable, Isa::avx2, Isa::avx512}) {
    if (std::strcmp(want, isa_name(isa)) == 0) {
      if (!cpu_runs(isa)) {
        *error = "EAGLEX_ISA names a path this CPU cannot run";
        return false;
      }
      *out = isa;
      return true;
    }
  }
  *error = "EAGLEX_ISA must be auto, avx512, avx2 or portable";
  return false;
}

void quantize_rows(Isa isa, const float* x, int64_t rows, int64_t K, int8_t* q, float* d, int32_t* qsum) {
  switch (isa) {
#ifdef EAGLEX_X86
    case Isa::avx512: return avx512::quantize_rows(x, rows, K, q, d, qsum);
    case Isa::avx2: return avx2::quantize_rows(x, rows, K, q, d, qsum);
#endif
    default: return portable::quantize_rows(x, rows, K, q, d, qsum);
  }
}

void q8_tiles(Isa isa, const QuantRows& a, int64_t rows, const uint8_t* w, const uint16_t* s, int64_t N,
              int64_t t0, int64_t t1, float* y) {
  switch (isa) {
#ifdef EAGLEX_X86
    case Isa::avx512: return avx512::q8_tiles(a, rows, w, s, N, t0, t1, y);
    case Isa::avx2: return avx2::q8_tiles(a, rows, w, s, N, t0, t1, y);
#endif
    default: return portable::q8_tiles(a, rows, w, s, N, t0, t1, y);
  }
}

void q4_tiles(Isa isa, const QuantRows& a, int64_t rows, const uint8_t* w, const uint16_t* s, int64_t N,
              int64_t t0, int64_t t1, float* y) {
  switch (isa) {
#ifdef EAGLEX_X86
    case Isa::avx512: return avx512::q4_tiles(a, rows, w, s, N, t0, t1, y);
    case Isa::avx2: return avx2::q4_tiles(a, rows, w, s, N, t0, t1, y);
#endif
    default: return portable::q4_tiles(a, rows, w, s, N, t0, t1, y);
  }
}

void f32_tiles(Isa isa, const float* x, int64_t rows, int64_t K, const float* w, int64_t N, int64_t t0, int64_t t1,
               float* y) {
  switch (isa) {
#ifdef EAGLEX_X86
    case Isa::avx512: return avx512::f32_tiles(x, rows, K, w, N, t0, t1, y);
    case Isa::avx2: return avx2::f32_tiles(x, rows, K, w, N, t0, t1, y);
#endif
    default: return portable::f32_tiles(x, rows, K, w, N, t0, t1, y);
  }
}

void attention_heads(Isa isa, const AttentionShape& s, const float* q, const float* k, const float* v,
                     const uint8_t* mask, int64_t u0, int64_t u1, float* y) {
  switch (isa) {
#ifdef EAGLEX_X86
    case Isa::avx512: return avx512::attention_heads(s, q, k, v, mask, u0, u1, y);
    case Isa::avx2: return avx2::attention_heads(s, q, k, v, mask, u0, u1, y);
#endif
    default: return portable::attention_heads(s, q, k, v, mask, u0, u1, y);
  }
}

}  // namespace eaglex
