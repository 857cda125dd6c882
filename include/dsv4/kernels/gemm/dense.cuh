#pragma once
//! \file
//! The unquantized linear layers (spec §4) through cuBLAS: bf16 x bf16 -> bf16 with fp32
//! accumulation (compressor wkv at ratio 1, indexer wk and weights_proj, vision), its grouped
//! (block-diagonal) form for the attention output's wo_a, and true fp32 (no TF32: the gate, the
//! hc projections, the head, the ratio-2 compressor). Host references: linear/reference.hpp.
//! Every call sets the handle's stream (leaving it set: a handle serves one stream at a time) and
//! a math mode that keeps fp32 reductions (bf16) or forbids TF32 (fp32), and restores the
//! handle's mode afterwards.

#include <cublas_v2.h>     // provides cublasGemmEx, cublasGemmStridedBatchedEx, cublasSgemm
#include <cuda_runtime.h>  // provides cudaStream_t

#include <cstddef>
#include <initializer_list>
#include <string>

#include "dsv4/core/error.hpp"
#include "dsv4/numerics/bf16.hpp"
#include "dsv4/runtime/pdl.cuh"

namespace dsv4::kernels::gemm {

namespace detail {
inline void blas_check(cublasStatus_t st, const char* what) {
  if (st != CUBLAS_STATUS_SUCCESS) throw error(std::string(what) + " failed: " + cublasGetStatusString(st));
}

//! Sets the stream and math mode for one call; restores the previous mode when it goes.
class blas_call {
 public:
  blas_call(cublasHandle_t h, cudaStream_t stream, cublasMath_t mode) : h_(h) {
    if (!h) throw error("cuBLAS call without a handle");
    blas_check(cublasGetMathMode(h, &saved_), "cublasGetMathMode");
    // cublasSetStream also resets the handle's workspace to cuBLAS's default pool (documented),
    // dropping one the caller set with cublasSetWorkspace: only switch when the stream differs.
    cudaStream_t current = nullptr;
    blas_check(cublasGetStream(h, &current), "cublasGetStream");
    if (current != stream) blas_check(cublasSetStream(h, stream), "cublasSetStream");
    blas_check(cublasSetMathMode(h, mode), "cublasSetMathMode");
  }
  ~blas_call() { cublasSetMathMode(h_, saved_); }
  blas_call(const blas_call&) = delete;
  blas_call& operator=(const blas_call&) = delete;

 private:
  cublasHandle_t h_;
  cublasMath_t saved_{};
};

//! Issues one cuBLAS GEMM on `stream` through the thread's launch log (runtime/launch_log.hpp),
//! which records it with its shape and operands (what a captured graph would replay) or,
//! checking, skips it (a graph or the log's owner issues it). `gemm(s)` issues the call on stream
//! s and sets up its own blas_call: a log may issue it again, later, on another stream.
template <class Issue>
void issue_blas(const char* entry, long long m, long long n, long long k, long long batch,
                std::initializer_list<const void*> operands, cudaStream_t stream, Issue&& gemm) {
  ++runtime::thread_launch_counts().blas_calls;
  if (runtime::launch_log* log = runtime::launch_log::installed())
    if (log->blas(entry, m, n, k, batch, static_cast<const void*>(stream), operands,
                  [gemm](void* s) { gemm(static_cast<cudaStream_t>(s)); }))
      return;
  gemm(stream);
}

//! Bytes of the workspace a long-lived handle owns (cublasSetWorkspace, set once beside its
//! stream): cuBLAS then allocates nothing inside a captured graph (runtime/segment_graph.cuh),
//! and captured and plain calls see the same workspace, hence choose the same algorithms. 32 MiB:
//! what cuBLAS documents as enough for Hopper.
inline constexpr std::size_t owned_workspace_bytes = std::size_t(32) << 20;

inline constexpr cublasMath_t bf16_math = cublasMath_t(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION);

inline void check_dims(const char* what, long long m, long long n, long long k) {
  if (m < 0 || n < 0 || k <= 0 || m > 2147483647LL || n > 2147483647LL || k > 2147483647LL)
    throw error(std::string(what) + ": bad shape (M " + std::to_string(m) + ", N " + std::to_string(n) + ", K " +
                std::to_string(k) + ")");
}
}  // namespace detail

namespace detail {
//! y[M, N] = x[M, K] w[N, K]^T on bf16 operands with fp32 accumulation, y of type `out_type`.
inline void bf16_operands_gemm(const char* what, cublasHandle_t blas, const numerics::bf16* x, const numerics::bf16* w,
                               void* y, cudaDataType_t out_type, int m, int n, int k, cudaStream_t stream) {
  check_dims(what, m, n, k);
  if (m == 0 || n == 0) return;
  if (!x || !w || !y) throw error(std::string(what) + ": null pointer argument");
  issue_blas(what, m, n, k, 1, {x, w, y}, stream, [=](cudaStream_t s) {
    const blas_call call(blas, s, bf16_math);
    const float one = 1.0f, zero = 0.0f;
    blas_check(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, w, CUDA_R_16BF, k, x, CUDA_R_16BF,
                            k, &zero, y, out_type, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
               (std::string(what) + ": cublasGemmEx").c_str());
  });
}
}  // namespace detail

//! y[M, N] = x[M, K] w[N, K]^T, bf16 in and out, fp32 accumulation, one rounding.
inline void linear_bf16(cublasHandle_t blas, const numerics::bf16* x, const numerics::bf16* w, numerics::bf16* y, int m,
                        int n, int k, cudaStream_t stream = nullptr) {
  detail::bf16_operands_gemm("linear_bf16", blas, x, w, y, CUDA_R_16BF, m, n, k, stream);
}

//! y[M, N] (fp32) = x[M, K] w[N, K]^T for bf16-valued operands, fp32 accumulation, fp32 out: the
//! fp32 GEMM of spec §4 wherever both operands hold bf16 values (the head: the final norm's bf16
//! output times a weight the checkpoint stores in bf16), since every product of two bf16 values is
//! exact in fp32; only the order of the fp32 sum differs from a true fp32 GEMM's, as between any
//! two fp32 GEMMs. Half the weight bytes and the tensor cores (linear_fp32 reads an fp32 copy).
inline void linear_bf16_f32out(cublasHandle_t blas, const numerics::bf16* x, const numerics::bf16* w, float* y, int m,
                               int n, int k, cudaStream_t stream = nullptr) {
  detail::bf16_operands_gemm("linear_bf16_f32out", blas, x, w, y, CUDA_R_32F, m, n, k, stream);
}

//! The block-diagonal form: x [M, groups, k] (row-major, groups side by side), w [groups, n, k],
//! y [M, groups, n]; group g of y = group g of x times w[g]^T (the einsum "bsgd,grd->bsgr").
inline void grouped_linear_bf16(cublasHandle_t blas, const numerics::bf16* x, const numerics::bf16* w, numerics::bf16* y,
                                int m, int groups, int n, int k, cudaStream_t stream = nullptr) {
  detail::check_dims("grouped_linear_bf16", m, n, k);
  if (groups <= 0) throw error("grouped_linear_bf16: groups must be positive");
  if (m == 0 || n == 0) return;
  if (!x || !w || !y) throw error("grouped_linear_bf16: null pointer argument");
  detail::issue_blas("grouped_linear_bf16", m, n, k, groups, {x, w, y}, stream, [=](cudaStream_t s) {
    const detail::blas_call call(blas, s, detail::bf16_math);
    const float one = 1.0f, zero = 0.0f;
    // Column-major per group: C_g^T [n, m] (ld groups * n, stride n) = W_g [n, k] (op T of a
    // k x n column-major block, stride n * k) times X_g^T [k, m] (ld groups * k, stride k).
    detail::blas_check(
        cublasGemmStridedBatchedEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, w, CUDA_R_16BF, k,
                                   (long long)n * k, x, CUDA_R_16BF, groups * k, k, &zero, y, CUDA_R_16BF,
                                   groups * n, n, groups, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        "grouped_linear_bf16: cublasGemmStridedBatchedEx");
  });
}

//! y[M, N] = x[M, K] w[N, K]^T in true fp32 (pedantic math: no TF32, no reduced precision).
inline void linear_fp32(cublasHandle_t blas, const float* x, const float* w, float* y, int m, int n, int k,
                        cudaStream_t stream = nullptr) {
  detail::check_dims("linear_fp32", m, n, k);
  if (m == 0 || n == 0) return;
  if (!x || !w || !y) throw error("linear_fp32: null pointer argument");
  detail::issue_blas("linear_fp32", m, n, k, 1, {x, w, y}, stream, [=](cudaStream_t s) {
    const detail::blas_call call(blas, s, CUBLAS_PEDANTIC_MATH);
    const float one = 1.0f, zero = 0.0f;
    detail::blas_check(cublasSgemm(blas, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, w, k, x, k, &zero, y, n),
                       "linear_fp32: cublasSgemm");
  });
}

}  // namespace dsv4::kernels::gemm
