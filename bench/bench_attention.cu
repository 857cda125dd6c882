//! \brief Sparse decode attention with sink, reading the packed caches (FP8 window + FP4 global).
//! Usage: bench_attention [--json FILE]
//!
//! V4.1 widths: 64 heads of 512, one query per sequence, 128 window entries + 512 selected global
//! entries per step. Reports time, FLOPs, bytes, and the ratio to the roofline floor
//! max(FLOPs / bf16 GEMM rate, bytes / copy bandwidth), both ceilings measured in this run; the
//! same launch with the global entries in pages found through a block table (`paged us`: the
//! engine's layout, one more dependent load per entry); and a prefill-shaped call (2,048 query
//! rows of one sequence, each with its own 640 indices).

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bench_util.cuh"
#include "dsv4/kernels/attention/sparse_attention.cuh"
#include "dsv4/numerics/formats.hpp"

using namespace dsv4;
using namespace dsv4::kernels::attention;
using numerics::bf16;

int main(int argc, char** argv) {
  std::string json;
  if (!bench::parse_json_option(argc, argv, "bench_attention", json)) return 2;
  try {
    using wf = numerics::fp8_act_format;
    using gf = numerics::main_kv_format;
    constexpr int dim = 512, heads = 64, window = 128, selected = 512, topk = window + selected;
    using wl = numerics::packed_vector<wf, dim>;
    using gl = numerics::packed_vector<gf, dim>;
    cudaDeviceProp prop{};
    DSV4_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("device: %s\n", prop.name);
    const bench::ceilings ceil = bench::ceilings::measure();
    const double copy_bps = ceil.copy_bps, gemm_fps = ceil.gemm_fps;
    std::printf("%6s %9s %10s %10s %10s %10s %9s %7s %11s %9s\n", "batch", "context", "median us", "TFLOP/s", "GB/s", "floor us",
                "vs floor", "splits", "unsplit us", "paged us");
    FILE* jf = json.empty() ? nullptr : std::fopen(json.c_str(), "w");
    if (jf) std::fprintf(jf, "{\"device\": \"%s\", \"copy_gbps\": %.1f, \"gemm_tflops\": %.1f, \"results\": [\n", prop.name,
                         copy_bps / 1e9, gemm_fps / 1e12);
    bool first = true;
    auto ws = sparse_attention_workspace::for_device<dim>();
    std::mt19937 rng(1);
    for (long long context : {8192ll, 131072ll}) {
      for (int batch : {1, 8, 64}) {
        const long long global = context;  // decoder owner: ratio 1, one entry per token
        std::vector<std::uint8_t> wc(std::size_t(batch) * window * wl::bytes), gc(std::size_t(batch) * global * gl::bytes);
        for (auto& b : wc) b = std::uint8_t(rng() & 0x77);  // finite codes and moderate scales
        for (auto& b : gc) b = std::uint8_t(rng() & 0x37);
        std::vector<bf16> q(std::size_t(batch) * heads * dim);
        for (auto& x : q) x = bf16::from_float(float(rng() % 200) / 100.0f - 1.0f);
        std::vector<std::int32_t> idx(std::size_t(batch) * topk);
        for (int b = 0; b < batch; ++b)
          for (int k = 0; k < topk; ++k)
            idx[std::size_t(b) * topk + k] = k < window ? k : window + std::int32_t(rng() % std::uint32_t(global));
        std::vector<float> sink(heads, 0.0f);
        runtime::device_buffer<std::uint8_t> dw{std::span<const std::uint8_t>(wc)}, dg{std::span<const std::uint8_t>(gc)};
        runtime::device_buffer<bf16> dq{std::span<const bf16>(q)}, dout(q.size());
        runtime::device_buffer<std::int32_t> didx{std::span<const std::int32_t>(idx)};
        runtime::device_buffer<float> dsink{std::span<const float>(sink)};
        packed_kv<wf, gf, dim> kv;
        kv.window.base = dw.data();
        kv.window.rows = window;
        kv.window.seq_stride = static_cast<long long>(window) * wl::bytes;
        kv.global = dg.data();
        kv.global_rows = int(global);
        kv.global_seq_stride = global * gl::bytes;
        sparse_attention_args a{dq.data(), didx.data(), dsink.data(), dout.data(), batch, 1, heads, topk,
                                1.0f / std::sqrt(float(dim))};
        // The engine's launch (split KV at small batch, with a workspace) and the one-pass kernel.
        const double ms = bench::median_ms([&] { sparse_attention<dim>(a, kv, nullptr, &ws); });
        const double ms_unsplit = bench::median_ms([&] { sparse_attention<dim>(a, kv); });
        // The same entries as pages of 256 in a pool (each sequence's own pages, in shuffled order).
        constexpr int page_entries = 256;
        const int pages_per_seq = int(global / page_entries);
        std::vector<std::int32_t> tables(std::size_t(batch) * pages_per_seq);
        for (int b = 0; b < batch; ++b) {
          std::vector<std::int32_t> perm(static_cast<std::size_t>(pages_per_seq));
          for (int i = 0; i < pages_per_seq; ++i) perm[std::size_t(i)] = b * pages_per_seq + i;
          std::shuffle(perm.begin(), perm.end(), rng);
          std::copy(perm.begin(), perm.end(), tables.begin() + std::ptrdiff_t(b) * pages_per_seq);
        }
        runtime::device_buffer<std::int32_t> dtables{std::span<const std::int32_t>(tables)};
        paged_kv<wf, gf, dim> pkv;
        pkv.window = kv.window;
        pkv.pool = dg.data();
        pkv.block_tables = dtables.data();
        pkv.max_pages = pages_per_seq;
        pkv.page_bytes = static_cast<long long>(page_entries) * gl::bytes;
        pkv.entries_per_page = page_entries;
        const double ms_paged = bench::median_ms([&] { sparse_attention<dim>(a, pkv, nullptr, &ws); });
        const int splits = detail::choose_split<dim>(a, &ws, runtime::sm_count()).splits;
        const double flops = 4.0 * batch * heads * double(topk) * dim;  // QK^T and PV
        const double bytes = double(batch) * (window * wl::bytes + selected * gl::bytes + 2.0 * heads * dim * 2 +
                                              topk * 4.0);
        const double floor_s = ceil.floor_s(flops, bytes);
        std::printf("%6d %9lld %10.1f %10.1f %10.1f %10.2f %8.1f%% %7d %11.1f %9.1f\n", batch, context, ms * 1e3,
                    flops / (ms * 1e-3) / 1e12, bytes / (ms * 1e-3) / 1e9, floor_s * 1e6, 100 * floor_s / (ms * 1e-3), splits,
                    ms_unsplit * 1e3, ms_paged * 1e3);
        if (jf)
          std::fprintf(jf, "%s  {\"batch\": %d, \"context\": %lld, \"splits\": %d, \"unsplit_us\": %.2f, \"us\": %.2f, \"paged_us\": %.2f, \"tflops\": %.2f, \"gbps\": %.1f, \"floor_us\": %.3f, \"ratio\": %.4f}",
                       first ? "" : ",\n", batch, context, splits, ms_unsplit * 1e3, ms * 1e3, ms_paged * 1e3, flops / (ms * 1e-3) / 1e12, bytes / (ms * 1e-3) / 1e9,
                       floor_s * 1e6, floor_s / (ms * 1e-3));
        first = false;
      }
    }
    {  // A prefill-shaped call: one sequence, many query rows, each with its own window + selection.
      constexpr int rows = 2048;
      constexpr long long global = 8192;
      std::vector<std::uint8_t> wc(std::size_t(window) * wl::bytes), gc(std::size_t(global) * gl::bytes);
      for (auto& b : wc) b = std::uint8_t(rng() & 0x77);
      for (auto& b : gc) b = std::uint8_t(rng() & 0x37);
      std::vector<bf16> q(std::size_t(rows) * heads * dim);
      for (auto& x : q) x = bf16::from_float(float(rng() % 200) / 100.0f - 1.0f);
      std::vector<std::int32_t> idx(std::size_t(rows) * topk);
      for (int r = 0; r < rows; ++r)
        for (int k = 0; k < topk; ++k)
          idx[std::size_t(r) * topk + k] = k < window ? k : window + std::int32_t(rng() % std::uint32_t(global));
      std::vector<float> sink(heads, 0.0f);
      runtime::device_buffer<std::uint8_t> dw{std::span<const std::uint8_t>(wc)}, dg{std::span<const std::uint8_t>(gc)};
      runtime::device_buffer<bf16> dq{std::span<const bf16>(q)}, dout(q.size());
      runtime::device_buffer<std::int32_t> didx{std::span<const std::int32_t>(idx)};
      runtime::device_buffer<float> dsink{std::span<const float>(sink)};
      packed_kv<wf, gf, dim> kv;
      kv.window.base = dw.data();
      kv.window.rows = window;
      kv.global = dg.data();
      kv.global_rows = int(global);
      sparse_attention_args a{dq.data(), didx.data(), dsink.data(), dout.data(), 1, rows, heads, topk, 1.0f / std::sqrt(float(dim))};
      const double ms = bench::median_ms([&] { sparse_attention<dim>(a, kv, nullptr, &ws); });
      const double flops = 4.0 * rows * heads * double(topk) * dim;
      std::printf("\nprefill-shaped: %d query rows x %d heads x %d indices: %.1f us, %.1f TFLOP/s (%.1f%% of the bf16 GEMM rate)\n",
                  rows, heads, topk, ms * 1e3, flops / (ms * 1e-3) / 1e12, 100 * flops / (ms * 1e-3) / gemm_fps);
      if (jf)
        std::fprintf(jf, ",\n  {\"prefill_rows\": %d, \"us\": %.2f, \"tflops\": %.2f}", rows, ms * 1e3, flops / (ms * 1e-3) / 1e12);
    }
    if (jf) {
      std::fprintf(jf, "\n]}\n");
      std::fclose(jf);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_attention: %s\n", e.what());
    return 1;
  }
}
