// ONNX Runtime custom ops of the "eaglex" domain over the batch-invariant linear layers (linear.h):
//
//   LinearQ8  (X f32 [..., K], W uint8 [N/16, K/32, 512], S f16 [N/16, K/32, 16]; attrs K, N) -> Y f32 [..., N]
//   LinearQ4  (X f32 [..., K], W uint8 [N/16, K/32, 256], S f16 [N/16, K/32, 32]; attrs K, N) -> Y f32 [..., N]
//   LinearF32 (X f32 [..., K], W f32 [N/16, K, 16]; attrs K, N)                                 -> Y f32 [..., N]
//   TreeAttention (Q f32 [B, N, Hq*D], K, V f32 [B, N, Hkv*D], past_key, past_value f32 [T, B, Hkv, D],
//                  mask bool [B, 1, N, T]; attr scale) -> Y f32 [B, N, Hq*D], present_key, present_value [T, B, Hkv, D]
//     K and V are written as rows T-N..T-1 of the present buffers (in place when the caller binds present_* to the
//     memory of past_*; copied otherwise), then every query row attends to the keys its mask row allows
//     (attention.h).
//
// (N/16 and K/32 rounded up.) The packed weights are the graph's own initializers, read in place: nothing is
// repacked or held twice. Work is split over ONNX Runtime's intra-op pool by contiguous tile chunks; a tile's
// outputs are computed by one thread, so neither the split nor the row count changes a result.
//
// The library asks for C API version 17 (onnxruntime 1.17) and calls nothing newer.
#include <climits>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "attention.h"
#include "linear.h"
#include "onnxruntime_c_api.h"

namespace eaglex {
namespace {

constexpr uint32_t kApiVersion = 17;
constexpr int64_t kMaxChunks = 16;       // tile chunks a call is split into (>= threads; each chunk contiguous)
const OrtApi* g_api = nullptr;

enum class Kind { q8, q4, f32 };

bool quantized(Kind k) { return k != Kind::f32; }

const char* op_name(Kind k) { return k == Kind::q8 ? "LinearQ8" : (k == Kind::q4 ? "LinearQ4" : "LinearF32"); }

struct Op : OrtCustomOp {
  Kind kind;
  Isa isa;
};

struct Kernel {
  Kind kind;
  Isa isa;
  int64_t K, N;
};

OrtStatus* fail(const std::string& msg) { return g_api->CreateStatus(ORT_INVALID_ARGUMENT, msg.c_str()); }

#define EAGLEX_TRY(expr)                    \
  do {                                      \
    if (OrtStatus* st_ = (expr)) return st_; \
  } while (0)

OrtStatus* shape_of(const OrtValue* v, std::vector<int64_t>* dims) {
  OrtTensorTypeAndShapeInfo* info = nullptr;
  EAGLEX_TRY(g_api->GetTensorTypeAndShape(v, &info));
  size_t n = 0;
  OrtStatus* st = g_api->GetDimensionsCount(info, &n);
  if (st == nullptr) {
    dims->assign(n, 0);
    st = g_api->GetDimensions(info, dims->data(), n);
  }
  g_api->ReleaseTensorTypeAndShapeInfo(info);
  return st;
}

std::string dims_text(const std::vector<int64_t>& d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? "," : "") + std::to_string(d[i]);
  return s + "]";
}

struct Job {
  Isa isa;
  Kind kind;
  QuantRows a;
  const float* x;
  int64_t rows, K, N, tiles, chunks;
  const uint8_t* w8;
  const uint16_t* s;
  const float* w32;
  float* y;
};

void run_chunk(void* data, size_t i) {
  const Job& j = *static_cast<const Job*>(data);
  const int64_t t0 = j.tiles * int64_t(i) / j.chunks, t1 = j.tiles * int64_t(i + 1) / j.chunks;
  if (j.kind == Kind::q8)
    q8_tiles(j.isa, j.a, j.rows, j.w8, j.s, j.N, t0, t1, j.y);
  else if (j.kind == Kind::q4)
    q4_tiles(j.isa, j.a, j.rows, j.w8, j.s, j.N, t0, t1, j.y);
  else
    f32_tiles(j.isa, j.x, j.rows, j.K, j.w32, j.N, t0, t1, j.y);
}

OrtStatus* compute(Kernel* k, OrtKernelContext* ctx) {
  const OrtValue *X = nullptr, *W = nullptr, *S = nullptr;
  EAGLEX_TRY(g_api->KernelContext_GetInput(ctx, 0, &X));
  EAGLEX_TRY(g_api->KernelContext_GetInput(ctx, 1, &W));
  if (quantized(k->kind)) EAGLEX_TRY(g_api->KernelContext_GetInput(ctx, 2, &S));
  std::vector<int64_t> xd, wd, sd;
  EAGLEX_TRY(shape_of(X, &xd));
  EAGLEX_TRY(shape_of(W, &wd));
  const char* name = op_name(k->kind);
  if (xd.empty() || xd.back() != k->K)
    return fail(std::string("eaglex.") + name + ": input X " + dims_text(xd) + " must end in K=" +
                std::to_string(k->K));
  const int64_t tiles = (k->N + kTile - 1) / kTile, blocks = (k->K + kBlock - 1) / kBlock;
  const std::vector<int64_t> want_w = k->kind == Kind::q8   ? std::vector<int64_t>{tiles, blocks, kRecord}
                                     : k->kind == Kind::q4 ? std::vector<int64_t>{tiles, blocks, kRecord4}
                                                           : std::vector<int64_t>{tiles, k->K, kTile};
  if (wd != want_w)
    return fail(std::string("eaglex.") + name + ": packed weight " + dims_text(wd) + " should be " +
                dims_text(want_w) + " for K=" + std::to_string(k->K) + ", N=" + std::to_string(k->N));
  if (quantized(k->kind)) {
    EAGLEX_TRY(shape_of(S, &sd));
    const std::vector<int64_t> want_s{tiles, blocks, k->kind == Kind::q4 ? 2 * kTile : kTile};
    if (sd != want_s)
      return fail(std::string("eaglex.") + name + ": scales " + dims_text(sd) + " should be " + dims_text(want_s));
  }
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < xd.size(); ++i) rows *= xd[i];
  std::vector<int64_t> yd = xd;
  yd.back() = k->N;
  OrtValue* Y = nullptr;
  EAGLEX_TRY(g_api->KernelContext_GetOutput(ctx, 0, yd.data(), yd.size(), &Y));
  if (rows == 0 || k->N == 0) return nullptr;

  Job job{};
  job.isa = k->isa;
  job.kind = k->kind;
  job.rows = rows;
  job.K = k->K;
  job.N = k->N;
  job.tiles = tiles;
  job.chunks = tiles < kMaxChunks ? tiles : kMaxChunks;
  void* p = nullptr;
  EAGLEX_TRY(g_api->GetTensorMutableData(const_cast<OrtValue*>(X), &p));
  job.x = static_cast<const float*>(p);
  EAGLEX_TRY(g_api->GetTensorMutableData(Y, &p));
  job.y = static_cast<float*>(p);
  EAGLEX_TRY(g_api->GetTensorMutableData(const_cast<OrtValue*>(W), &p));
  // the activation rows' quantized form: made once per call, read by every chunk
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> d;
  thread_local std::vector<int32_t> qsum;
  if (quantized(k->kind)) {
    job.w8 = static_cast<const uint8_t*>(p);
    EAGLEX_TRY(g_api->GetTensorMutableData(const_cast<OrtValue*>(S), &p));
    job.s = static_cast<const uint16_t*>(p);
    q.resize(size_t(rows * blocks * kBlock));
    d.resize(size_t(rows * blocks));
    qsum.resize(size_t(rows * blocks));
    quantize_rows(k->isa, job.x, rows, k->K, q.data(), d.data(), qsum.data());
    job.a = QuantRows{q.data(), d.data(), qsum.data(), blocks};
  } else {
    job.w32 = static_cast<const float*>(p);
  }
  if (job.chunks == 1) {
    run_chunk(&job, 0);
    return nullptr;
  }
  return g_api->KernelContext_ParallelFor(ctx, run_chunk, size_t(job.chunks), 0, &job);
}

// --- TreeAttention ---------------------------------------------------------------------------------------------

struct AttentionKernel {
  Isa isa;
  float scale;
};

struct AttentionJob {
  Isa isa;
  AttentionShape shape;
  const float *q, *k, *v;
  const uint8_t* mask;
  float* y;
  int64_t units, chunks;
};

void run_attention_chunk(void* data, size_t i) {
  const AttentionJob& j = *static_cast<const AttentionJob*>(data);
  attention_heads(j.isa, j.shape, j.q, j.k, j.v, j.mask, j.units * int64_t(i) / j.chunks,
                  j.units * int64_t(i + 1) / j.chunks, j.y);
}

OrtStatus* attention_fail(const std::string& msg) { return fail("eaglex.TreeAttention: " + msg); }

// The new rows [B, N, Hkv, D] into rows T-N.. of the buffer [T, B, Hkv, D]; the past rows copied first when the
// output is not the input's memory.
void write_rows(const float* past, const float* rows, const AttentionShape& s, float* present) {
  const int64_t row = s.B * s.Hkv * s.D;
  if (present != past) std::memcpy(present, past, size_t((s.T - s.N) * row) * sizeof(float));
  for (int64_t n = 0; n < s.N; ++n)
    for (int64_t b = 0; b < s.B; ++b)
      std::memcpy(present + (s.T - s.N + n) * row + b * s.Hkv * s.D, rows + (b * s.N + n) * s.Hkv * s.D,
                  size_t(s.Hkv * s.D) * sizeof(float));
}

OrtStatus* compute_attention(AttentionKernel* k, OrtKernelContext* ctx) {
  const OrtValue* in[6] = {};
  std::vector<int64_t> d[6];
  for (size_t i = 0; i < 6; ++i) {
    EAGLEX_TRY(g_api->KernelContext_GetInput(ctx, i, &in[i]));
    EAGLEX_TRY(shape_of(in[i], &d[i]));
  }
  if (d[3].size() != 4 || d[4] != d[3])
    return attention_fail("past_key " + dims_text(d[3]) + " and past_value " + dims_text(d[4]) +
                          " must be one shape [T, B, Hkv, D]");
  if (d[5].size() != 4 || d[5][1] != 1)
    return attention_fail("mask " + dims_text(d[5]) + " must be [B, 1, N, T]");
  const int64_t T = d[3][0], B = d[3][1], Hkv = d[3][2], D = d[3][3], N = d[5][2];
  const std::vector<int64_t> mask{B, 1, N, T}, kv{B, N, Hkv * D};
  if (d[5] != mask) return attention_fail("mask " + dims_text(d[5]) + " must be [B, 1, N, T] = " + dims_text(mask));
  if (D <= 0 || D > kMaxHeadDim || Hkv <= 0)
    return attention_fail("the buffers' head dim must be 1.." + std::to_string(kMaxHeadDim) + " with a KV head, got " +
                          dims_text(d[3]));
  if (d[0].size() != 3 || d[0][0] != B || d[0][1] != N || d[0][2] % (Hkv * D) != 0)
    return attention_fail("Q " + dims_text(d[0]) + " must be [B, N, Hq * D] = [" + std::to_string(B) + "," +
                          std::to_string(N) + ", a multiple of " + std::to_string(Hkv * D) + "]");
  if (d[1] != kv || d[2] != kv)
    return attention_fail("K " + dims_text(d[1]) + " and V " + dims_text(d[2]) + " must be [B, N, Hkv * D] = " +
                          dims_text(kv));
  if (T < N) return attention_fail("the buffers' " + std::to_string(T) + " rows cannot hold " + std::to_string(N) +
                                   " new rows");
  const int64_t Hq = d[0][2] / D;
  const AttentionShape shape{B, Hq, Hkv, N, T, D, k->scale};
  OrtValue* out[3] = {};
  EAGLEX_TRY(g_api->KernelContext_GetOutput(ctx, 0, d[0].data(), 3, &out[0]));
  EAGLEX_TRY(g_api->KernelContext_GetOutput(ctx, 1, d[3].data(), 4, &out[1]));
  EAGLEX_TRY(g_api->KernelContext_GetOutput(ctx, 2, d[3].data(), 4, &out[2]));
  void* p[6] = {};
  for (size_t i = 0; i < 6; ++i) EAGLEX_TRY(g_api->GetTensorMutableData(const_cast<OrtValue*>(in[i]), &p[i]));
  void* o[3] = {};
  for (size_t i = 0; i < 3; ++i) EAGLEX_TRY(g_api->GetTensorMutableData(out[i], &o[i]));
  if (B * Hkv * D == 0) return nullptr;
  write_rows(static_cast<const float*>(p[3]), static_cast<const float*>(p[1]), shape, static_cast<float*>(o[1]));
  write_rows(static_cast<const float*>(p[4]), static_cast<const float*>(p[2]), shape, static_cast<float*>(o[2]));
  if (N == 0) return nullptr;

  AttentionJob job{k->isa, shape, static_cast<const float*>(p[0]), static_cast<const float*>(o[1]),
                   static_cast<const float*>(o[2]), static_cast<const uint8_t*>(p[5]), static_cast<float*>(o[0]),
                   B * Hq, 1};
  // threads only where the work outweighs waking them; a head's rows are one thread's whatever the split
  if (B * Hq * N * T * D >= (int64_t(1) << 16)) job.chunks = job.units < kMaxChunks ? job.units : kMaxChunks;
  if (job.chunks == 1) {
    run_attention_chunk(&job, 0);
    return nullptr;
  }
  return g_api->KernelContext_ParallelFor(ctx, run_attention_chunk, size_t(job.chunks), 0, &job);
}

// --- OrtCustomOp callbacks -------------------------------------------------------------------------------------

OrtStatus* ORT_API_CALL create_kernel(const OrtCustomOp* base, const OrtApi* api, const OrtKernelInfo* info,
                                      void** out) {
  const Op* op = static_cast<const Op*>(base);
  int64_t K = 0, N = 0;
  EAGLEX_TRY(api->KernelInfoGetAttribute_int64(info, "K", &K));
  EAGLEX_TRY(api->KernelInfoGetAttribute_int64(info, "N", &N));
  if (K <= 0 || N <= 0) return fail("eaglex linear op: attributes K and N must be positive");
  *out = new Kernel{op->kind, op->isa, K, N};
  return nullptr;
}

OrtStatus* ORT_API_CALL compute_kernel(void* kernel, OrtKernelContext* ctx) {
  try {
    return compute(static_cast<Kernel*>(kernel), ctx);
  } catch (const std::exception& e) {            // allocation failure: an error, not a crash
    return g_api->CreateStatus(ORT_FAIL, e.what());
  }
}

void ORT_API_CALL destroy_kernel(void* kernel) { delete static_cast<Kernel*>(kernel); }

OrtStatus* ORT_API_CALL create_attention(const OrtCustomOp* base, const OrtApi* api, const OrtKernelInfo* info,
                                         void** out) {
  float scale = 0.0f;
  EAGLEX_TRY(api->KernelInfoGetAttribute_float(info, "scale", &scale));
  if (!(scale > 0.0f) || scale == std::numeric_limits<float>::infinity())
    return fail("eaglex.TreeAttention: attribute scale must be positive and finite");
  *out = new AttentionKernel{static_cast<const Op*>(base)->isa, scale};
  return nullptr;
}

OrtStatus* ORT_API_CALL compute_attention_kernel(void* kernel, OrtKernelContext* ctx) {
  try {
    return compute_attention(static_cast<AttentionKernel*>(kernel), ctx);
  } catch (const std::exception& e) {
    return g_api->CreateStatus(ORT_FAIL, e.what());
  }
}

void ORT_API_CALL destroy_attention(void* kernel) { delete static_cast<AttentionKernel*>(kernel); }

const char* ORT_API_CALL attention_name(const OrtCustomOp*) { return "TreeAttention"; }
ONNXTensorElementDataType ORT_API_CALL attention_input_type(const OrtCustomOp*, size_t i) {
  return i == 5 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
size_t ORT_API_CALL six(const OrtCustomOp*) { return 6; }
size_t ORT_API_CALL three(const OrtCustomOp*) { return 3; }

const char* ORT_API_CALL q8_name(const OrtCustomOp*) { return "LinearQ8"; }
const char* ORT_API_CALL q4_name(const OrtCustomOp*) { return "LinearQ4"; }
const char* ORT_API_CALL f32_name(const OrtCustomOp*) { return "LinearF32"; }
const char* ORT_API_CALL cpu_provider(const OrtCustomOp*) { return "CPUExecutionProvider"; }

ONNXTensorElementDataType ORT_API_CALL input_type(const OrtCustomOp* base, size_t i) {
  if (i == 0) return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  if (static_cast<const Op*>(base)->kind == Kind::f32) return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  return i == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
}
size_t ORT_API_CALL input_count(const OrtCustomOp* base) {
  return quantized(static_cast<const Op*>(base)->kind) ? 3 : 2;
}
ONNXTensorElementDataType ORT_API_CALL output_type(const OrtCustomOp*, size_t) {
  return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
size_t ORT_API_CALL output_count(const OrtCustomOp*) { return 1; }
OrtCustomOpInputOutputCharacteristic ORT_API_CALL required(const OrtCustomOp*, size_t) {
  return INPUT_OUTPUT_REQUIRED;
}
OrtMemType ORT_API_CALL memory_type(const OrtCustomOp*, size_t) { return OrtMemTypeDefault; }
int ORT_API_CALL one(const OrtCustomOp*) { return 1; }
int ORT_API_CALL latest(const OrtCustomOp*) { return INT_MAX; }

Op* make_op(Kind kind, Isa isa) {
  Op* op = new Op{};
  op->version = kApiVersion;
  op->GetName = kind == Kind::q8 ? q8_name : (kind == Kind::q4 ? q4_name : f32_name);
  op->GetExecutionProviderType = cpu_provider;
  op->GetInputType = input_type;
  op->GetInputTypeCount = input_count;
  op->GetOutputType = output_type;
  op->GetOutputTypeCount = output_count;
  op->KernelDestroy = destroy_kernel;
  op->GetInputCharacteristic = required;
  op->GetOutputCharacteristic = required;
  op->GetInputMemoryType = memory_type;
  op->GetVariadicInputMinArity = one;
  op->GetVariadicInputHomogeneity = one;
  op->GetVariadicOutputMinArity = one;
  op->GetVariadicOutputHomogeneity = one;
  op->CreateKernelV2 = create_kernel;
  op->KernelComputeV2 = compute_kernel;
  op->GetStartVersion = one;
  op->GetEndVersion = latest;
  op->kind = kind;
  op->isa = isa;
  return op;
}

Op* make_attention_op(Isa isa) {
  Op* op = make_op(Kind::f32, isa);
  op->GetName = attention_name;
  op->GetInputType = attention_input_type;
  op->GetInputTypeCount = six;
  op->GetOutputTypeCount = three;
  op->KernelDestroy = destroy_attention;
  op->CreateKernelV2 = create_attention;
  op->KernelComputeV2 = compute_attention_kernel;
  return op;
}

}  // namespace
}  // namespace eaglex

extern "C" {

// Registers the "eaglex" domain's ops on a session's options; the ISA path is EAGLEX_ISA's (default: the best).
// The domain and its ops must outlive every session that uses them: they are never freed.
__attribute__((visibility("default"))) OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options,
                                                                                const OrtApiBase* base) {
  using namespace eaglex;
  const OrtApi* api = base->GetApi(kApiVersion);
  if (api == nullptr) {
    std::fprintf(stderr, "eaglex kernels: this ONNX Runtime predates C API version %u (onnxruntime 1.17)\n",
                 kApiVersion);
    return nullptr;
  }
  g_api = api;
  Isa isa;
  const char* error = nullptr;
  if (!isa_from_env(&isa, &error)) return api->CreateStatus(ORT_INVALID_ARGUMENT, error);
  OrtCustomOpDomain* domain = nullptr;
  EAGLEX_TRY(api->CreateCustomOpDomain("eaglex", &domain));
  EAGLEX_TRY(api->CustomOpDomain_Add(domain, make_op(Kind::q8, isa)));
  EAGLEX_TRY(api->CustomOpDomain_Add(domain, make_op(Kind::q4, isa)));
  EAGLEX_TRY(api->CustomOpDomain_Add(domain, make_op(Kind::f32, isa)));
  EAGLEX_TRY(api->CustomOpDomain_Add(domain, make_attention_op(isa)));
  return api->AddCustomOpDomain(options, domain);
}

// The ISA path EAGLEX_ISA selects on this CPU ("avx512", "avx2", "portable"), or an error text starting "error:".
__attribute__((visibility("default"))) const char* eaglex_kernels_isa() {
  eaglex::Isa isa;
  const char* error = nullptr;
  if (!eaglex::isa_from_env(&isa, &error)) {
    static thread_local std::string text;
    text = std::string("error: ") + error;
    return text.c_str();
  }
  return eaglex::isa_name(isa);
}

// Reads n bytes from p with independent 8-byte loads (XOR of them): a read of weight-sized memory for the read
// floor the benchmarks report beside the kernels' times (tools/step_rows.py).
__attribute__((visibility("default"))) uint64_t eaglex_read_bytes(const uint8_t* p, size_t n) {
  uint64_t acc[8] = {0};
  size_t i = 0;
  for (; i + 64 <= n; i += 64)
    for (int j = 0; j < 8; ++j) {
      uint64_t v;
      std::memcpy(&v, p + i + 8 * j, 8);
      acc[j] ^= v;
    }
  for (; i < n; ++i) acc[0] ^= p[i];
  return acc[0] ^ acc[1] ^ acc[2] ^ acc[3] ^ acc[4] ^ acc[5] ^ acc[6] ^ acc[7];
}

// Bumped whenever an op's inputs, attributes or arithmetic change: engines record the version they were built for.
__attribute__((visibility("default"))) int eaglex_kernels_version() { return 2; }
}
