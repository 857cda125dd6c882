//! \brief The MoE layer of V4.1 (384 FP4 experts, top-6, FP8 shared expert, 5120 -> 2304 -> 5120)
//! at decode and prefill token counts.
//! Usage: bench_moe [--ab-early-stream] [--json FILE] | bench_moe --profile TOKENS
//! `--profile TOKENS` makes no measurement: one warm-up call, then one call at TOKENS tokens between
//! cudaProfilerStart and cudaProfilerStop (for `ncu --profile-from-start off`: the layer's kernels).
//!
//! Decode floor: the bytes of the weights the routing actually touches (distinct chosen experts x
//! 3 FP4 matrices + the shared expert + the gate) over the copy bandwidth; prefill: FLOPs
//! (tokens x 7 experts x 3 GEMMs x 2 x 5120 x 2304) over the cuBLAS bf16 rate. Both ceilings are
//! measured in the same run; times per call, graph-replayed. "cuBLAS path": the same call given a
//! cuBLAS handle where moe_forward then takes its prefill path (>= 32 rows per expert: bf16 copies
//! and per-expert cuBLAS GEMMs; one stream synchronization per call, so timed call by call with
//! CUDA events instead of a graph). "wgmma us" (up to 64 tokens): the same call with the grouped
//! expert GEMMs and the shared expert's linears on the wgmma kernel (gemm::set_decode_gemm).
//! "per-tile us" (up to 64 tokens): the grouped expert GEMMs on the per-tile mma.sync kernel
//! instead of the streamed one (gemm::set_expert_gemm), the rest unchanged.

#include <cuda_profiler_api.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "bench_util.cuh"
#include "dsv4/kernels/moe/moe.cuh"

using namespace dsv4;
using namespace dsv4::kernels;
using numerics::bf16;

int main(int argc, char** argv) {
  std::string json;
  long long profile_tokens = 0;
  // --ab-early-stream (first): also each decode size with w2's weight stream started before the
  // wait for SwiGLU off and on (gemm::set_early_expert_stream), alternating, twice.
  const bool ab_early = argc >= 2 && std::strcmp(argv[1], "--ab-early-stream") == 0;
  if (ab_early) --argc, ++argv;
  if (argc == 3 && std::strcmp(argv[1], "--profile") == 0) {
    profile_tokens = std::atoll(argv[2]);
    if (profile_tokens < 1) {
      std::fprintf(stderr, "bench_moe --profile TOKENS: TOKENS must be a positive count, not '%s'\n", argv[2]);
      return 2;
    }
  } else if (!bench::parse_json_option(argc, argv, "bench_moe", json)) {
    return 2;
  }
  try {
    const moe::moe_shape s{384, 6, 5120, 2304};
    const gemm::weight_tile_shape up{s.inter, s.dim, gemm::weight_format::fp4_row32},
        down{s.dim, s.inter, gemm::weight_format::fp4_row32};
    const gemm::weight_tile_shape sup{s.inter, s.dim, gemm::weight_format::fp8_tile32},
        sdown{s.dim, s.inter, gemm::weight_format::fp8_tile32};
    const std::size_t expert_bytes = 2 * (up.code_bytes() + up.scale_bytes()) + down.code_bytes() + down.scale_bytes();
    const std::size_t shared_bytes = 2 * (sup.code_bytes() + sup.scale_bytes()) + sdown.code_bytes() + sdown.scale_bytes();
    runtime::device_buffer<std::uint8_t> w1(up.code_bytes() * s.experts), w1s(up.scale_bytes() * s.experts),
        w3(w1.size()), w3s(w1s.size()), w2(down.code_bytes() * s.experts), w2s(down.scale_bytes() * s.experts);
    runtime::device_buffer<std::uint8_t> s1(sup.code_bytes()), s1s(sup.scale_bytes()), s3(s1.size()), s3s(s1s.size()),
        s2(sdown.code_bytes()), s2s(sdown.scale_bytes());
    for (auto* b : {&w1, &w3, &w2, &s1, &s3, &s2}) bench::fill_codes(b->data(), b->size(), 7);
    for (auto* b : {&w1s, &w3s, &w2s, &s1s, &s3s, &s2s}) b->fill_bytes(120);
    runtime::device_buffer<bf16> gate(std::size_t(s.experts) * s.dim);
    bench::fill_bf16(gate.data(), gate.size(), 9, 0.05f);
    runtime::device_buffer<float> bias(s.experts);
    bias.fill_bytes(0);
    const moe::moe_weights w{gate.data(), bias.data(), nullptr, w1.data(), w1s.data(), w3.data(), w3s.data(), w2.data(),
                             w2s.data(),  s1.data(),   s1s.data(), s3.data(), s3s.data(), s2.data(), s2s.data()};
    if (profile_tokens > 0) {
      runtime::device_buffer<bf16> x(std::size_t(profile_tokens) * s.dim), y(x.size());
      bench::fill_bf16(x.data(), x.size(), 11 + unsigned(profile_tokens), 2.0f);
      moe::moe_workspace ws(s, profile_tokens);
      moe::moe_forward(x.data(), profile_tokens, nullptr, w, y.data(), ws);
      DSV4_CUDA_CHECK(cudaDeviceSynchronize());
      DSV4_CUDA_CHECK(cudaProfilerStart());
      moe::moe_forward(x.data(), profile_tokens, nullptr, w, y.data(), ws);
      DSV4_CUDA_CHECK(cudaDeviceSynchronize());
      DSV4_CUDA_CHECK(cudaProfilerStop());
      std::printf("bench_moe --profile %lld: done\n", profile_tokens);
      return 0;
    }
    const bench::ceilings ceil = bench::ceilings::measure();
    std::printf("%7s %10s %9s %11s %9s %9s %9s %11s %10s %14s %9s\n", "tokens", "median us", "experts",
                "weight GB/s", "vs copy", "TFLOP/s", "vs gemm", "per-tile us", "wgmma us", "cuBLAS path us",
                "vs gemm");
    cublasHandle_t blas = nullptr;
    gemm::detail::blas_check(cublasCreate(&blas), "bench_moe: cublasCreate");
    FILE* jf = json.empty() ? nullptr : std::fopen(json.c_str(), "w");
    if (jf) std::fprintf(jf, "{\"copy_gbps\": %.1f, \"gemm_tflops\": %.1f, \"results\": [\n", ceil.copy_bps / 1e9, ceil.gemm_fps / 1e12);
    bool first = true;
    for (long long tokens : {1LL, 8LL, 64LL, 4096LL, 8192LL}) {
      runtime::device_buffer<bf16> x(std::size_t(tokens) * s.dim), y(x.size());
      bench::fill_bf16(x.data(), x.size(), 11 + unsigned(tokens), 2.0f);
      moe::moe_workspace ws(s, tokens);
      moe::moe_forward(x.data(), tokens, nullptr, w, y.data(), ws);
      DSV4_CUDA_CHECK(cudaDeviceSynchronize());
      const auto sel = ws.sel_expert.download();
      const std::set<int> distinct(sel.begin(), sel.begin() + tokens * s.k);
      const double ms = bench::median_ms_per_call([&](cudaStream_t st) { moe::moe_forward(x.data(), tokens, nullptr, w, y.data(), ws, st); },
                                                  tokens >= 4096 ? 2 : 10);
      const double bytes = double(distinct.size()) * expert_bytes + shared_bytes + gate.bytes();
      const double flops = double(tokens) * (s.k + 1) * 3 * 2.0 * s.dim * s.inter;
      double ms_wgmma = 0.0, ms_per_tile = 0.0;
      if (tokens <= 64) {
        gemm::set_expert_gemm(gemm::expert_gemm::per_tile);
        ms_per_tile = bench::median_ms_per_call(
            [&](cudaStream_t st) { moe::moe_forward(x.data(), tokens, nullptr, w, y.data(), ws, st); }, 10);
        gemm::set_expert_gemm(gemm::expert_gemm::streamed);
        gemm::set_decode_gemm(gemm::decode_gemm::wgmma);  // read when the graph is captured
        ms_wgmma = bench::median_ms_per_call([&](cudaStream_t st) { moe::moe_forward(x.data(), tokens, nullptr, w, y.data(), ws, st); }, 10);
        gemm::set_decode_gemm(gemm::decode_gemm::mma_sync);
      }
      if (ab_early && tokens <= 64) {
        for (int round = 0; round < 2; ++round)
          for (const bool on : {false, true}) {
            gemm::set_early_expert_stream(on);  // read when the graph is captured
            const double t = bench::median_ms_per_call(
                [&](cudaStream_t st) { moe::moe_forward(x.data(), tokens, nullptr, w, y.data(), ws, st); }, 10);
            std::printf("        %lld tokens, w2's stream started %s: %.1f us\n", tokens,
                        on ? "before the wait" : "after the wait", t * 1e3);
          }
        gemm::set_early_expert_stream(false);
      }
      const bool dense = tokens * s.k >= moe::dense_min_rows_per_expert * s.experts;
      const double ms_dense =
          dense ? bench::median_ms([&] { moe::moe_forward(x.data(), tokens, nullptr, w, y.data(), ws, nullptr, blas); }, 2, 10)
                : 0.0;
      std::printf("%7lld %10.1f %9zu %11.0f %8.1f%% %9.1f %8.1f%%", tokens, ms * 1e3, distinct.size(),
                  bytes / (ms * 1e-3) / 1e9, 100 * bytes / ceil.copy_bps / (ms * 1e-3), flops / (ms * 1e-3) / 1e12,
                  100 * flops / ceil.gemm_fps / (ms * 1e-3));
      if (ms_wgmma > 0)
        std::printf(" %11.1f %10.1f", ms_per_tile * 1e3, ms_wgmma * 1e3);
      else
        std::printf(" %11s %10s", "-", "-");
      if (dense)
        std::printf(" %14.1f %8.1f%%\n", ms_dense * 1e3, 100 * flops / ceil.gemm_fps / (ms_dense * 1e-3));
      else
        std::printf(" %14s %9s\n", "-", "-");
      if (jf)
        std::fprintf(jf,
                     "%s  {\"tokens\": %lld, \"us\": %.2f, \"experts\": %zu, \"copy_ratio\": %.4f, "
                     "\"gemm_ratio\": %.4f, "
                     "\"per_tile_us\": %.2f, \"wgmma_us\": %.2f, \"cublas_path_us\": %.2f}",
                     first ? "" : ",\n", tokens, ms * 1e3, distinct.size(),
                     bytes / ceil.copy_bps / (ms * 1e-3), flops / ceil.gemm_fps / (ms * 1e-3),
                     ms_per_tile * 1e3, ms_wgmma * 1e3, ms_dense * 1e3);
      first = false;
    }
    cublasDestroy(blas);
    if (jf) {
      std::fprintf(jf, "\n]}\n");
      std::fclose(jf);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_moe: %s\n", e.what());
    return 1;
  }
}
