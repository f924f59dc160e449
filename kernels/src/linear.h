// eaglex's batch-invariant linear layers: the arithmetic shared by every ISA path, and the packed weight layouts.
//
// A row's result is a function of that row's inputs alone: every row runs the same instruction sequence whatever
// the row count, the grouping of rows, the threads or the ISA path (integer sums are exact; every float step
// happens in one fixed order, no FMA contraction except where the arithmetic is an FMA chain by definition).
//
// int8 (Q8): weights in blocks of 32 along K with an fp16 scale per (output channel, block); each activation row
// quantized per block of 32: d = amax / 127, q = clamp(round_half_even(x / d), -127, 127), d = 0 gives q = 0, a
// block holding NaN or inf gives d = NaN. Per output: y = 0; for each block b in order: y = y + (s_b * d_b) * dot_b,
// dot_b the exact int32 sum of q * w.
//   Packed: W  uint8 [N/16, Kb, 8, 16, 4]: tile of 16 output channels, block, k-quad j, channel, 4 consecutive k;
//               the byte is w + 128 (VNNI multiplies u8 by s8)
//           S  fp16  [N/16, Kb, 16]
//   N padded to a multiple of 16 and K to a multiple of 32 with zero weights and zero scales.
//
// int4 (Q4, llama.cpp's Q4_1 numbers): weights in blocks of 32 along K as w = d * q + m with q in [0, 15] and an
// fp16 d and m per (output channel, block); activation rows quantized as for Q8. Per output: y = 0; for each block b
// in order: y = y + (d_b * dx_b) * dot_b; y = y + (m_b * dx_b) * qsum_b, dot_b the exact int32 sum of q * qx and
// qsum_b the row's sum of qx over the block.
//   Packed: W  uint8 [N/16, Kb, 4, 16, 4]: k-quad jj < 4, channel, 4 consecutive k; the low nibble is
//               k = 4 jj + e, the high nibble k = 16 + 4 jj + e
//           S  fp16  [N/16, Kb, 32]: the 16 channels' d, then their m
//
// Outputs that are NaN are written as the one quiet NaN 0x7fc00000: which NaN an operation passes on depends on
// its operand order, which the compiler may swap.
//
// fp32: per output one FMA chain over k = 0..K-1 starting from 0: y = fma(x_k, w_k, y).
//   Packed: W  f32 [N/16, K, 16]
#pragma once
#include <cstddef>
#include <cstdint>

namespace eaglex {

constexpr int kTile = 16;     // output channels per tile
constexpr int kBlock = 32;    // K per int8 block
constexpr int kRecord = kTile * kBlock;   // weight bytes per (tile, block)
constexpr int kRecord4 = kRecord / 2;     // Q4: two weights a byte

enum class Isa { portable = 0, avx2 = 1, avx512 = 2 };
const char* isa_name(Isa isa);
Isa best_isa();                                  // the fastest path this CPU (and its OS) runs
// The path EAGLEX_ISA asks for (unset or "auto": best_isa()); false with a message when the name is unknown or
// the CPU cannot run it.
bool isa_from_env(Isa* out, const char** error);

// Activation rows quantized per block: q [rows, blocks * 32], d [rows, blocks], qsum [rows, blocks].
struct QuantRows {
  const int8_t* q;
  const float* d;
  const int32_t* qsum;
  int64_t blocks;
};

// x [rows, K] -> q, d, qsum (sized as QuantRows says, blocks = ceil(K / 32)).
void quantize_rows(Isa isa, const float* x, int64_t rows, int64_t K, int8_t* q, float* d, int32_t* qsum);

// y [rows, N] columns of tiles [t0, t1): the int8 linear layer over quantized rows.
void q8_tiles(Isa isa, const QuantRows& a, int64_t rows, const uint8_t* w, const uint16_t* s, int64_t N,
              int64_t t0, int64_t t1, float* y);

// y [rows, N] columns of tiles [t0, t1): the int4 linear layer over quantized rows.
void q4_tiles(Isa isa, const QuantRows& a, int64_t rows, const uint8_t* w, const uint16_t* s, int64_t N,
              int64_t t0, int64_t t1, float* y);

// y [rows, N] columns of tiles [t0, t1): the fp32 linear layer, x [rows, K].
void f32_tiles(Isa isa, const float* x, int64_t rows, int64_t K, const float* w, int64_t N, int64_t t0, int64_t t1,
               float* y);

// Per-ISA implementations (linear_<isa>.cpp), each compiled for its instruction set.
namespace portable {
void quantize_rows(const float* x, int64_t rows, int64_t K, int8_t* q, float* d, int32_t* qsum);
void q8_tiles(const QuantRows& a, int64_t rows, const uint8_t* w, const uint16_t* s, int64_t N, int64_t t0,
              int64_t t1, float* y);
void q4_tiles(const QuantRows& a, int64_t rows, const uint8_t* w, const uint16_t* s, int64_t N, int64_t t0,
              int64_t t1, float* y);
void f32_tiles(const float* x, int64_t rows, int64_t K, const float* w, int64_t N, int64_t t0, int64_t t1, float* y);
float half_to_float(uint16_t h);
}  // namespace portable
namespace avx2 {
void quantize_rows(const float* x, int64_t rows, int64_t K, int8_t* q, float* d, int32_t* qsum);
void q8_tiles(const QuantRows& a, int64_t rows, const uint8_t* w, const uint16_t* s, int64_t N, int64_t t0,
              int64_t t1, float* y);
void q4_tiles(const QuantRows& a, int64_t rows, const uint8_t* w, const uint16_t* s, int64_t N, int64_t t0,
              int64_t t1, float* y);
void f32_tiles(const float* x, int64_t rows, int64_t K, const float* w, int64_t N, int64_t t0, int64_t t1, float* y);
}  // namespace avx2
namespace avx512 {
void quantize_rows(const float* x, int64_t rows, int64_t K, int8_t* q, float* d, int32_t* qsum);
void q8_tiles(const QuantRows& a, int64_t rows, const uint8_t* w, const uint16_t* s, int64_t N, int64_t t0,
              int64_t t1, float* y);
void q4_tiles(const QuantRows& a, int64_t rows, const uint8_t* w, const uint16_t* s, int64_t N, int64_t t0,
              int64_t t1, float* y);
void f32_tiles(const float* x, int64_t rows, int64_t K, const float* w, int64_t N, int64_t t0, int64_t t1, float* y);
}  // namespace avx512

}  // namespace eaglex
