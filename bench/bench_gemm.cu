//! \brief Block-scaled linear layers of V4.1 (FP8 32x32-tile weights, FP4 experts) at decode and
//! prefill token counts, against cuBLAS BF16 on the same shape and the weight-streaming floor.
//! Usage: bench_gemm [--json FILE] [--plans | --decode-plans | --wgmma-plans | --folded-plans]
//!                   [--layer NAME] [--m M]
//! --layer / --m: one layer / one token count of the table only (to profile one kernel).
//! --plans: instead of the table, sweep the MMA kernel's launch plans (tokens per CTA, the cap on
//! the split-K reduction) at mid-size M, to choose make_plan's defaults. --decode-plans: the same
//! at M = 1, 2, 8 (K blocks a stage, CTAs per SM the K split aims at). --wgmma-plans: the same
//! for the wgmma kernel (CTAs per SM the K split aims at, the reduction cap), M = 1 .. 128.
//! --folded-plans: the same for the folded FP8 kernel (tokens per CTA, K slices), M = 32 .. 128.
//!
//! Times are per call of back-to-back calls replayed as a CUDA graph (bench_util.cuh:
//! median_ms_per_call), as a model's decode graph runs them. Each call reads a different copy
//! of the weights (copies rotate through more than 256 MiB,
//! five times the L2), so decode shapes stream from HBM as they do in a model; cuBLAS gets the
//! same treatment with bf16 weights. Bytes = weight codes + scales + activations + output.
//! Floor = max(2MNK / cuBLAS bf16 8192^3 rate, bytes / copy bandwidth), both measured here.
//! wo_a at decode (1-16 tokens): cuBLAS bf16 on the reference's weight against the FP8 kernel on its
//! FP8 form (output/wo_a_fp8.cuh), floor = the FP8 bytes / copy.
//! RMSNorm (5120 wide) is listed with its bytes (read + write) against the copy ceiling.

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

#include "bench_util.cuh"
#include "dsv4/kernels/gemm/dense.cuh"
#include "dsv4/kernels/gemm/dequant_gemm.cuh"
#include "dsv4/kernels/gemm/folded_gemm.cuh"
#include "dsv4/kernels/gemm/wgmma_gemm.cuh"
#include "dsv4/kernels/norm/rmsnorm.cuh"
#include "dsv4/kernels/output/wo_a_fp8.cuh"

using namespace dsv4;
using kernels::gemm::weight_format;
using numerics::bf16;

namespace {

struct layer_shape {
  const char* name;
  int n, k;
  weight_format wf;
};

//! What a plan sweep times, per layer and M: rotated weight copies (as below), the activations,
//! C, a workspace of K / `k_per_partial` (64 at most) x M x N partial floats, and the floor.
struct sweep_case {
  const layer_shape& layer;
  kernels::gemm::gemm_shape s;
  int copies;
  std::function<kernels::gemm::block_scaled_gemm_args(int)> args;  //!< the GEMM on weight copy i
  kernels::gemm::gemm_workspace& work;
  double floor_s;
  const char* format() const { return layer.wf == weight_format::fp8_tile32 ? "fp8" : "fp4"; }
  //! Per call of back-to-back calls, each on the next weight copy.
  template <class Launch>
  double per_call_ms(Launch launch) const {
    int it = 0;
    return bench::median_ms_per_call([&](cudaStream_t st) { launch(args(it++ % copies), st); }, std::max(20, copies));
  }
};
template <std::size_t L, class Sweep>
void for_each_sweep_case(const layer_shape (&layers)[L], const bench::ceilings& ceil, std::initializer_list<int> ms,
                         int k_per_partial, Sweep sweep) {
  namespace g = kernels::gemm;
  for (const auto& layer : layers) {
    const g::weight_tile_shape tiles{layer.n, layer.k, layer.wf};
    const std::size_t w_bytes = tiles.code_bytes(), ws_bytes = tiles.scale_bytes();
    const int copies = int(std::max<std::size_t>(1, ((std::size_t(256) << 20) + w_bytes - 1) / w_bytes));
    runtime::device_buffer<std::uint8_t> w(w_bytes * copies), w_s(ws_bytes * copies);
    bench::fill_codes(w.data(), w.size(), 1);
    w_s.fill_bytes(127);
    for (int m : ms) {
      const g::gemm_shape s{m, layer.n, layer.k};
      runtime::device_buffer<std::uint8_t> a(std::size_t(m) * layer.k), a_s(std::size_t(m) * (layer.k / 32));
      bench::fill_codes(a.data(), a.size(), 2);
      a_s.fill_bytes(127);
      runtime::device_buffer<bf16> c(std::size_t(m) * layer.n);
      // (at most 64 slices' partials; the folded sweep's activations always, M x K bf16)
      g::gemm_workspace work(std::size_t(std::clamp(layer.k / k_per_partial, 1, 64)) * m * layer.n, 0,
                             g::folded_scratch_bytes(s));
      const double bytes = double(w_bytes + ws_bytes) + double(m) * (layer.k + layer.k / 32) + 2.0 * m * layer.n;
      sweep(sweep_case{layer, s, copies,
                       [&](int i) {
                         return g::block_scaled_gemm_args{s, a.data(), a_s.data(), w.data() + w_bytes * i,
                                                          w_s.data() + ws_bytes * i, c.data()};
                       },
                       work, ceil.floor_s(2.0 * m * double(layer.n) * layer.k, bytes)});
    }
  }
}

//! The MMA kernel under every plan of a small grid, M = 16, 32, 64.
template <std::size_t L>
void sweep_plans(const layer_shape (&layers)[L], const bench::ceilings& ceil) {
  namespace g = kernels::gemm;
  std::printf("%-10s %4s %5s %6s %7s %7s %9s %9s\n", "layer", "fmt", "M", "tokens", "reduce", "slices", "us",
              "vs floor");
  for_each_sweep_case(layers, ceil, {16, 32, 64}, 128, [](const sweep_case& k) {
    for (int tt : {1, 2, 4, 8})
      for (int reduce : {64, 512}) {
        const auto p = g::detail::make_plan(k.s, g::detail::sm_count(), k.work.partial_floats(), {tt, reduce});
        const double ms = k.per_call_ms([&](const g::block_scaled_gemm_args& args, cudaStream_t st) {
          g::detail::launch(k.layer.wf, args, p, &k.work, st);
        });
        std::printf("%-10s %4s %5d %6d %7d %7d %9.1f %8.1f%%\n", k.layer.name, k.format(), k.s.m, tt * 8, reduce, p.slices,
                    ms * 1e3, 100 * k.floor_s / (ms * 1e-3));
      }
  });
}

//! The MMA kernel at decode sizes (M = 1, 2, 8: one token tile) under stages of 4, 6 or 8 K blocks
//! and K splits aimed at 2, 3, 4 or 6 CTAs per SM ("<-": make_plan's default).
template <std::size_t L>
void sweep_decode_plans(const layer_shape (&layers)[L], const bench::ceilings& ceil) {
  namespace g = kernels::gemm;
  std::printf("%-10s %4s %5s %7s %8s %7s %9s %9s %8s\n", "layer", "fmt", "M", "unroll", "ctas/SM", "slices",
              "us", "vs floor", "default");
  for_each_sweep_case(layers, ceil, {1, 2, 8}, 32, [](const sweep_case& k) {
    const int sms = g::detail::sm_count();
    for (int unroll : {4, 6, 8})
      for (int per_sm : {2, 3, 4, 6}) {
        const auto p = g::detail::make_plan(k.s, sms, k.work.partial_floats(), {1, 64, unroll, per_sm});
        const double ms = k.per_call_ms([&](const g::block_scaled_gemm_args& args, cudaStream_t st) {
          g::detail::launch(k.layer.wf, args, p, &k.work, st);
        });
        std::printf("%-10s %4s %5d %7d %8d %7d %9.1f %8.1f%% %8s\n", k.layer.name, k.format(), k.s.m, unroll,
                    per_sm, p.slices, ms * 1e3, 100 * k.floor_s / (ms * 1e-3),
                    unroll == 4 && per_sm == 3 ? "<-" : "");
      }
  });
}

//! The wgmma kernel under a grid of plan options, M = 1, 8, 32, 64, 128.
template <std::size_t L>
void sweep_wgmma_plans(const layer_shape (&layers)[L], const bench::ceilings& ceil) {
  namespace g = kernels::gemm;
  std::printf("%-10s %4s %5s %6s %8s %7s %7s %9s %9s\n", "layer", "fmt", "M", "tokens", "ctas/SM", "reduce", "slices", "us",
              "vs floor");
  for_each_sweep_case(layers, ceil, {1, 8, 32, 64, 128}, 256, [](const sweep_case& k) {
    for (int per_sm : {1, 2, 3, 6})
      for (int reduce : {128, 1024}) {
        const auto p = g::detail::make_wgmma_plan(k.s, g::detail::sm_count(), k.work.partial_floats(), {per_sm, reduce});
        const double ms = k.per_call_ms([&](const g::block_scaled_gemm_args& args, cudaStream_t st) {
          if (k.layer.wf == weight_format::fp8_tile32)
            g::detail::launch_wgmma<weight_format::fp8_tile32>(args, p, &k.work, st);
          else
            g::detail::launch_wgmma<weight_format::fp4_row32>(args, p, &k.work, st);
        });
        std::printf("%-10s %4s %5d %6d %8d %7d %7d %9.1f %8.1f%%\n", k.layer.name, k.format(), k.s.m, p.tokens, per_sm,
                    reduce, p.slices, ms * 1e3, 100 * k.floor_s / (ms * 1e-3));
      }
  });
}

//! The folded kernel under every plan of a small grid (tokens per CTA, K slices), FP8 layers at
//! M = 32, 64, 128; "waves": CTAs over three per SM (the kernel's occupancy).
template <std::size_t L>
void sweep_folded_plans(const layer_shape (&layers)[L], const bench::ceilings& ceil) {
  namespace g = kernels::gemm;
  std::printf("%-10s %5s %6s %7s %5s %6s %7s %9s %9s %8s\n", "layer", "M", "tokens", "slices", "kbps", "CTAs",
              "waves", "us", "vs floor", "default");
  for_each_sweep_case(layers, ceil, {32, 64, 128}, 32, [](const sweep_case& k) {
    if (k.layer.wf != weight_format::fp8_tile32) return;
    const int sms = g::detail::sm_count();
    const auto chosen = g::detail::make_folded_plan(k.s, sms, k.work.partial_floats());
    for (int tokens : {16, 32, 64, 128}) {
      if (tokens > g::detail::folded_first_tokens(k.s.m)) continue;
      int last_slices = -1;
      for (int slices : {1, 2, 3, 4, 5, 6, 8, 10, 12, 16}) {
        const auto p = g::detail::make_folded_plan(k.s, sms, k.work.partial_floats(), {tokens, slices});
        if (p.slices == last_slices) continue;  // capped to the same split
        last_slices = p.slices;
        const double ms = k.per_call_ms([&](const g::block_scaled_gemm_args& args, cudaStream_t st) {
          g::detail::launch_folded(args, p, k.work, st);
        });
        const long long ctas = (long long)p.token_groups * p.row_groups * p.slices;
        const bool is_default = p.tokens == chosen.tokens && p.slices == chosen.slices;
        std::printf("%-10s %5d %6d %7d %5d %6lld %7.2f %9.1f %8.1f%% %8s\n", k.layer.name, k.s.m, p.tokens,
                    p.slices, p.kbps, ctas, double(ctas) / (3.0 * sms), ms * 1e3, 100 * k.floor_s / (ms * 1e-3),
                    is_default ? "<-" : "");
      }
    }
  });
}

}  // namespace

int main(int argc, char** argv) {
  std::string json;
  bool plans = false, wgmma_plans = false, folded_plans = false, decode_plans = false;
  std::string only_layer;  // --layer NAME: that layer only (for a profiler)
  int only_m = 0;          // --m M: that token count only
  std::vector<char*> args_left{argv[0]};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--layer" && i + 1 < argc)
      only_layer = argv[++i];
    else if (a == "--m" && i + 1 < argc)
      only_m = std::atoi(argv[++i]);
    else if (a == "--plans")
      plans = true;
    else if (a == "--decode-plans")
      decode_plans = true;
    else if (a == "--wgmma-plans")
      wgmma_plans = true;
    else if (a == "--folded-plans")
      folded_plans = true;
    else
      args_left.push_back(argv[i]);
  }
  if (!bench::parse_json_option(
          int(args_left.size()), args_left.data(),
          "bench_gemm [--plans | --decode-plans | --wgmma-plans | --folded-plans] [--layer NAME] [--m M]",
          json))
    return 2;
  try {
    const bench::ceilings ceil = bench::ceilings::measure();
    const layer_shape layers[] = {
        {"wq_a", 1280, 5120, weight_format::fp8_tile32},         {"wkv", 512, 5120, weight_format::fp8_tile32},
        {"wq_b", 32768, 1280, weight_format::fp8_tile32},        {"idx.wq_b", 4096, 1280, weight_format::fp8_tile32},
        {"wo_b", 5120, 8192, weight_format::fp8_tile32},         {"shared.w1", 2304, 5120, weight_format::fp8_tile32},
        {"shared.w2", 5120, 2304, weight_format::fp8_tile32},    {"expert.w1", 2304, 5120, weight_format::fp4_row32},
        {"expert.w2", 5120, 2304, weight_format::fp4_row32},
    };
    if (wgmma_plans) {
      kernels::gemm::detail::require_wgmma("bench_gemm --wgmma-plans");
      sweep_wgmma_plans(layers, ceil);
      return 0;
    }
    if (folded_plans) {
      kernels::gemm::detail::require_wgmma("bench_gemm --folded-plans");
      sweep_folded_plans(layers, ceil);
      return 0;
    }
    if (plans) {
      sweep_plans(layers, ceil);
      return 0;
    }
    if (decode_plans) {
      sweep_decode_plans(layers, ceil);
      return 0;
    }
    cublasHandle_t h;
    if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) throw error("cublasCreate failed");
    FILE* jf = json.empty() ? nullptr : std::fopen(json.c_str(), "w");
    if (jf) std::fprintf(jf, "{\"copy_gbps\": %.1f, \"gemm_tflops\": %.1f, \"results\": [\n", ceil.copy_bps / 1e9, ceil.gemm_fps / 1e12);
    bool first = true;
    // "mma us": the mma.sync kernel (split-K); "wgmma us": the wgmma kernel (M <= 256 only);
    // "folded us": the folded kernel (FP8, 16 <= M <= 256 only);
    // "dq+cuBLAS": dequantize to bf16 + cuBLAS (M >= 64 only); TFLOP/s, GB/s and the floor ratio
    // are of the fastest; "cuBLAS us" is a plain bf16 GEMM on bf16 weights of the same shape,
    // "speedup" its time over ours.
    std::printf("%-10s %4s %6s %6s %5s %9s %9s %9s %9s %9s %9s %9s %11s %9s\n", "layer", "fmt", "N", "K", "M", "mma us",
                "wgmma us", "folded us", "dq+cuBLAS", "TFLOP/s", "GB/s", "vs floor", "cuBLAS us", "speedup");
    for (const auto& L : layers) {
      if (!only_layer.empty() && only_layer != L.name) continue;
      const bool fp8 = L.wf == weight_format::fp8_tile32;
      const kernels::gemm::weight_tile_shape tiles{L.n, L.k, L.wf};  // the MMA-tile layout's sizes
      const std::size_t w_bytes = tiles.code_bytes(), ws_bytes = tiles.scale_bytes();
      const std::size_t bf_bytes = std::size_t(L.n) * L.k * 2;
      const int copies = int(std::max<std::size_t>(1, ((std::size_t(256) << 20) + w_bytes - 1) / w_bytes));
      const int bf_copies = int(std::max<std::size_t>(1, ((std::size_t(256) << 20) + bf_bytes - 1) / bf_bytes));
      runtime::device_buffer<std::uint8_t> w(w_bytes * copies), w_s(ws_bytes * copies);
      runtime::device_buffer<unsigned short> wbf(bf_bytes / 2 * bf_copies);
      bench::fill_codes(w.data(), w.size(), 1);
      w_s.fill_bytes(127);
      wbf.fill_bytes(0x3c);
      DSV4_CUDA_CHECK(cudaDeviceSynchronize());
      for (int m : {1, 8, 16, 32, 64, 128, 256, 4096}) {
        if (only_m && m != only_m) continue;
        const kernels::gemm::gemm_shape s{m, L.n, L.k};
        runtime::device_buffer<std::uint8_t> a(std::size_t(m) * L.k), a_s(std::size_t(m) * (L.k / 32));
        bench::fill_codes(a.data(), a.size(), 2);
        a_s.fill_bytes(127);
        runtime::device_buffer<bf16> c(std::size_t(m) * L.n);
        runtime::device_buffer<unsigned short> abf(std::size_t(m) * L.k), cbf(std::size_t(m) * L.n);
        abf.fill_bytes(0x3c);
        kernels::gemm::gemm_workspace work(std::max<std::size_t>({1, kernels::gemm::gemm_partial_floats(s),
                                                                  kernels::gemm::wgmma_partial_floats(s),
                                                                  kernels::gemm::folded_partial_floats(s)}),
                                           m >= 64 ? kernels::gemm::dequant_elems(s) : 0,
                                           // the engine's sizing (folded_bytes_for) covers only the
                                           // tokens it folds; this table times the kernel beyond them
                                           kernels::gemm::folded_scratch_bytes(s));
        int it = 0;
        auto args = [&](int i) {
          return kernels::gemm::block_scaled_gemm_args{s, a.data(), a_s.data(), w.data() + w_bytes * i,
                                                       w_s.data() + ws_bytes * i, c.data()};
        };
        const int calls = std::max(20, copies);  // every copy once per replay: no weight stays in L2
        const double ms = bench::median_ms_per_call([&](cudaStream_t st) {
          kernels::gemm::block_scaled_gemm(args(it++ % copies), L.wf, &work, st);
        }, calls);
        const double ms_wgmma = m > 256 ? 0.0 : bench::median_ms_per_call([&](cudaStream_t st) {
          kernels::gemm::wgmma_gemm(args(it++ % copies), L.wf, &work, st);
        }, calls);
        const bool folds =
            fp8 && m >= 16 && m <= 256;  // wider than block_scaled_linear's range: to choose it
        const double ms_folded = !folds ? 0.0 : bench::median_ms_per_call([&](cudaStream_t st) {
          kernels::gemm::folded_gemm(args(it++ % copies), work, st);
        }, calls);
        const double ms_dq = m < 64 ? 0.0 : bench::median_ms_per_call([&](cudaStream_t st) {
          kernels::gemm::dequant_gemm(args(it++ % copies), L.wf, work, h, st);
        }, calls);
        int jt = 0;
        const float one = 1.0f, zero = 0.0f;
        const double ms_cublas = bench::median_ms_per_call([&](cudaStream_t st) {
          const int i = jt++ % bf_copies;
          cublasSetStream(h, st);
          // Row-major C[M,N] = A[M,K] W[N,K]^T is column-major C^T = W A^T.
          if (cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, L.n, m, L.k, &one, wbf.data() + bf_bytes / 2 * i, CUDA_R_16BF, L.k,
                           abf.data(), CUDA_R_16BF, L.k, &zero, cbf.data(), CUDA_R_16BF, L.n, CUBLAS_COMPUTE_32F,
                           CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS)
            throw error("cublasGemmEx failed");
        }, std::max(20, bf_copies));
        const double flops = 2.0 * m * double(L.n) * L.k;
        const double bytes = double(w_bytes + ws_bytes) + double(m) * (L.k + L.k / 32) + 2.0 * m * L.n;
        const double floor_s = ceil.floor_s(flops, bytes);
        double best = ms_dq > 0 ? std::min(ms, ms_dq) : ms;
        if (ms_wgmma > 0) best = std::min(best, ms_wgmma);
        if (ms_folded > 0) best = std::min(best, ms_folded);
        std::printf("%-10s %4s %6d %6d %5d %9.1f %9.1f %9.1f %9.1f %9.1f %9.0f %8.1f%% %11.1f %8.2fx\n", L.name,
                    fp8 ? "fp8" : "fp4", L.n, L.k, m, ms * 1e3, ms_wgmma * 1e3, ms_folded * 1e3, ms_dq * 1e3, flops / (best * 1e-3) / 1e12, bytes / (best * 1e-3) / 1e9,
                    100 * floor_s / (best * 1e-3), ms_cublas * 1e3, ms_cublas / best);
        if (jf)
          std::fprintf(jf,
                       "%s  {\"layer\": \"%s\", \"format\": \"%s\", \"n\": %d, \"k\": %d, \"m\": %d, \"us\": %.2f, "
                       "\"wgmma_us\": %.2f, \"folded_us\": %.2f, \"dequant_cublas_us\": %.2f, \"tflops\": %.2f, \"ratio\": %.4f, \"cublas_bf16_us\": %.2f}",
                       first ? "" : ",\n", L.name, fp8 ? "fp8" : "fp4", L.n, L.k, m, ms * 1e3, ms_wgmma * 1e3, ms_folded * 1e3, ms_dq * 1e3,
                       flops / (best * 1e-3) / 1e12, floor_s / (best * 1e-3), ms_cublas * 1e3);
        first = false;
      }
    }
    // wo_a at decode (V4.1: 8 groups of 1024 outputs over 8 heads x 512): the grouped bf16 GEMM
    // through cuBLAS on the weight as the reference holds it (67 MB) against the FP8 kernel on its
    // FP8 form (output/wo_a_fp8.cuh: 33.5 MB), six weight copies each in rotation (past L2).
    // Floor: the FP8 form's bytes / copy.
    {
      const int groups = 8, n = 1024, kg = 4096, copies = 6;
      const std::size_t welems = std::size_t(groups) * n * kg;
      std::vector<runtime::device_buffer<bf16>> wb;
      std::vector<runtime::device_buffer<std::uint8_t>> wc, wsc;
      for (int i = 0; i < copies; ++i) {
        wb.emplace_back(welems), wc.emplace_back(welems), wsc.emplace_back(welems / 1024);
        wb.back().fill_bytes(0x3c), wc.back().fill_bytes(0x38), wsc.back().fill_bytes(127);
      }
      runtime::device_buffer<bf16> x(std::size_t(16) * groups * kg), y(std::size_t(16) * groups * n);
      x.fill_bytes(0x3f);
      const double floor_us = double(welems) / ceil.copy_bps * 1e6;
      std::printf("\n%-10s %5s %12s %9s %9s %9s %9s\n", "wo_a", "M", "cuBLAS bf16", "FP8 us", "floor us", "vs floor",
                  "speedup");
      for (const int m : {1, 2, 4, 8, 16}) {
        int it = 0;
        const double ms_b = bench::median_ms_per_call([&](cudaStream_t st) {
          kernels::gemm::grouped_linear_bf16(h, x.data(), wb[std::size_t(it++ % copies)].data(), y.data(), m, groups, n, kg, st);
        }, 2 * copies);
        auto fp8_ms = [&](int batch) {
          kernels::output::set_wo_a_fp8_batch(batch);
          it = 0;
          return bench::median_ms_per_call(
              [&](cudaStream_t st) {
                const int c = it++ % copies;
                kernels::output::wo_a_fp8({x.data(), wc[std::size_t(c)].data(), wsc[std::size_t(c)].data(),
                                           y.data(), m, groups, n, kg},
                                          st);
              },
              2 * copies);
        };
        double ms_b4 = 0, ms_b8 = 0;
        if (m <= 8) ms_b4 = fp8_ms(4), ms_b8 = fp8_ms(8);
        const double ms_f = fp8_ms(6);
        std::printf(
            "%-10s %5d %12.1f %9.1f %9.1f %8.1f%% %8.2fx   (batches of 4 / 8 steps: %.1f / %.1f us)\n", "", m,
            ms_b * 1e3, ms_f * 1e3, floor_us, 100 * floor_us / (ms_f * 1e3), ms_b / ms_f, ms_b4 * 1e3,
            ms_b8 * 1e3);
        if (jf)
          std::fprintf(jf, ",\n  {\"layer\": \"wo_a\", \"m\": %d, \"cublas_bf16_us\": %.2f, \"fp8_us\": %.2f, \"ratio\": %.4f}", m,
                       ms_b * 1e3, ms_f * 1e3, floor_us / (ms_f * 1e3));
      }
    }
    cublasDestroy(h);
    // RMSNorm over 5120-wide rows (bf16 weight), read x + write y.
    std::printf("\n%-10s %6s %10s %9s %9s\n", "rmsnorm", "rows", "median us", "GB/s", "vs copy");
    runtime::device_buffer<bf16> wn(5120);
    wn.fill_bytes(0x3f);
    for (long long rows : {1LL, 64LL, 4096LL, 32768LL}) {
      runtime::device_buffer<bf16> x(std::size_t(rows) * 5120), y(std::size_t(rows) * 5120);
      x.fill_bytes(0x3f);
      const double ms = bench::median_ms_per_call([&](cudaStream_t st) {
        kernels::norm::rmsnorm<bf16>({x.data(), 5120, wn.data(), y.data(), 5120, rows, 5120, 1e-20f}, st);
      });
      const double bytes = 2.0 * 2.0 * double(rows) * 5120;
      std::printf("%-10s %6lld %10.1f %9.0f %8.1f%%\n", "", rows, ms * 1e3, bytes / (ms * 1e-3) / 1e9,
                  100 * bytes / ceil.copy_bps / (ms * 1e-3));
      if (jf)
        std::fprintf(jf, ",\n  {\"layer\": \"rmsnorm\", \"rows\": %lld, \"us\": %.2f, \"ratio\": %.4f}", rows, ms * 1e3,
                     bytes / ceil.copy_bps / (ms * 1e-3));
    }
    if (jf) {
      std::fprintf(jf, "\n]}\n");
      std::fclose(jf);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_gemm: %s\n", e.what());
    return 1;
  }
}
