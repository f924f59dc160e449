// ONNX Runtime custom ops of the "eaglex" domain over the batch-invariant linear layers (linear.h):
//
//   LinearQ8  (X f32 [..., K], W uint8 [N/16, K/32, 512], S f16 [N/16, K/32, 16]; attrs K, N) -> Y f32 [..., N]
//   LinearQ4  (X f32 [..., K], W uint8 [N/16, K/32, 256], S f16 [N/16, K/32, 32]; attrs K, N) -> Y f32 [..., N]
//   LinearF32 (X f32 [..., K], W f32 [N/16, K, 16]; attrs K, N)                                 -> Y f32 [..., N]
//
// (N/16 and K/32 rounded up.) The packed weights are the graph's own initializers, read in place: nothing is
// repacked or held twice. Work is split over ONNX Runtime's intra-op pool by contiguous tile chunks; a tile's
// outputs are computed by one thread, so neither the split nor the row count changes a result.
//
// The library asks for C API version 17 (onnxruntime 1.17) and calls nothing newer.
#include <climits>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

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
__attribute__((visibility("default"))) int eaglex_kernels_version() { return 1; }
}
