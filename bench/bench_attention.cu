//! \brief Sparse decode attention with sink, reading the packed caches (FP8 window + FP4 global).
//! Usage: bench_attention [--json FILE] | bench_attention --profile | bench_attention --head-tiles
//! `--head-tiles` only times the decode launch (8K context, batch 1 to 64) at each head-tile count
//! (16, 32 or 64 heads per CTA; sparse_attention_args::head_tiles) as graph replays, for the
//! launcher's choice.
//! `--profile` makes no measurement: one engine launch and one unsplit launch at batch 1 and 64
//! (8K context) and exits, for ncu (`-k regex:sparse_attention`).
//!
//! V4.1 widths: 64 heads of 512, one query per sequence, 128 window entries + 512 selected global
//! entries per step. Reports time, FLOPs, bytes, and the ratio to the roofline floor
//! max(FLOPs / bf16 GEMM rate, bytes / copy bandwidth), both ceilings measured in this run; the
//! same launch with the global entries in pages found through a block table (`paged us`: the
//! engine's layout, one more dependent load per entry); and a prefill-shaped call (2,048 query
//! rows of one sequence, each with its own 640 indices). Built with DSV4_FLASHMLA_DIR (bench/CMakeLists.txt),
//! a last table puts FlashMLA's SM90 sparse FP8 decode beside ours on the same shapes, in its V4
//! "MODEL1" format (584 B per entry, window and selected entries alike: it has no FP4 path on this
//! GPU), measured in the same process (bench/flashmla_model1.hpp), both timed as graph replays of
//! back-to-back calls (device time: FlashMLA's launch builds TMA descriptors on the host every
//! call). Both read the same indices every call, so at batch 64 both working sets (14 / 24 MB) sit
//! in L2: a comparison of the kernels, not of HBM streaming. It runs after our rows are printed,
//! so that a failure of the foreign kernel cannot cost them (its checks exit the process).

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bench_util.cuh"
#include "dsv4/kernels/attention/sparse_attention.cuh"
#include "dsv4/numerics/formats.hpp"
#if DSV4_BENCH_FLASHMLA
#include "flashmla_model1.hpp"
#endif

using namespace dsv4;
using namespace dsv4::kernels::attention;
using numerics::bf16;

namespace {
using wf = numerics::fp8_act_format;
using gf = numerics::main_kv_format;
constexpr int dim = 512, heads = 64, window = 128, selected = 512, topk = window + selected;
using wl = numerics::packed_vector<wf, dim>;
using gl = numerics::packed_vector<gf, dim>;

//! `sequences` sequences of `rows` query rows each, every sequence with its window ring and
//! `global` FP4 entries, every row with the whole window and `selected` random global entries.
struct operands {
  runtime::device_buffer<std::uint8_t> window_cache, global_cache;
  runtime::device_buffer<bf16> q, out;
  runtime::device_buffer<std::int32_t> idx;
  runtime::device_buffer<float> sink;
  packed_kv<wf, gf, dim> kv;
  sparse_attention_args args;

  operands(std::mt19937& rng, int sequences, int rows, long long global) {
    std::vector<std::uint8_t> wc(std::size_t(sequences) * window * wl::bytes), gc(std::size_t(sequences) * global * gl::bytes);
    for (auto& b : wc) b = std::uint8_t(rng() & 0x77);  // finite codes and moderate scales
    for (auto& b : gc) b = std::uint8_t(rng() & 0x37);
    std::vector<bf16> hq(std::size_t(sequences) * rows * heads * dim);
    for (auto& x : hq) x = bf16::from_float(float(rng() % 200) / 100.0f - 1.0f);
    std::vector<std::int32_t> hidx(std::size_t(sequences) * rows * topk);
    for (std::size_t r = 0; r < hidx.size() / topk; ++r)
      for (int k = 0; k < topk; ++k)
        hidx[r * topk + std::size_t(k)] = k < window ? k : window + std::int32_t(rng() % std::uint32_t(global));
    window_cache = runtime::device_buffer<std::uint8_t>{std::span<const std::uint8_t>(wc)};
    global_cache = runtime::device_buffer<std::uint8_t>{std::span<const std::uint8_t>(gc)};
    q = runtime::device_buffer<bf16>{std::span<const bf16>(hq)};
    out = runtime::device_buffer<bf16>(hq.size());
    idx = runtime::device_buffer<std::int32_t>{std::span<const std::int32_t>(hidx)};
    sink = runtime::device_buffer<float>{std::span<const float>(std::vector<float>(heads, 0.0f))};
    kv.window.base = window_cache.data();
    kv.window.rows = window;
    kv.window.seq_stride = static_cast<long long>(window) * wl::bytes;
    kv.global = global_cache.data();
    kv.global_rows = int(global);
    kv.global_seq_stride = global * gl::bytes;
    args = {q.data(), idx.data(), sink.data(), out.data(), sequences, rows, heads, topk, 1.0f / std::sqrt(float(dim))};
  }
};
//! The decode launch at each head-tile count, per call of back-to-back calls replayed as a graph
//! (how a decode step runs it), with the splits each count gets from the launcher.
void sweep_head_tiles() {
  auto ws = sparse_attention_workspace::for_device<dim>();
  std::mt19937 rng(1);
  std::printf("decode launch, 8K context, us per call (graph replay); splits in brackets\n");
  std::printf("%6s %14s %14s %14s %14s %14s\n", "batch", "auto", "16 heads", "32 heads", "64 mma.sync",
              "64 wgmma");
  for (int batch : {1, 2, 4, 8, 16, 32, 64}) {
    operands op(rng, batch, 1, 8192);
    std::printf("%6d", batch);
    for (int variant = 0; variant < 5; ++variant) {
      sparse_attention_args a = op.args;
      constexpr int head_tiles[] = {0, 1, 2, 4, 4};  // auto, 16, 32, 64 mma.sync, 64 wgmma
      a.head_tiles = head_tiles[variant];
      a.allow_wgmma = variant != 3;
      const int splits = detail::choose_split<dim>(a, &ws, runtime::sm_count()).splits;
      double us = 0;
      try {
        us = 1e3 *
             bench::median_ms_per_call([&](cudaStream_t st) { sparse_attention<dim>(a, op.kv, st, &ws); });
      } catch (const std::exception& e) {
        std::fprintf(stderr, "bench_attention --head-tiles: batch %d variant %d: %s\n", batch, variant,
                     e.what());
      }
      std::printf(" %9.1f [%2d]", us, splits);
    }
    std::printf("\n");
  }
}
}  // namespace

int main(int argc, char** argv) {
  std::string json;
  const bool profile = argc == 2 && std::strcmp(argv[1], "--profile") == 0;
  if (argc == 2 && std::strcmp(argv[1], "--head-tiles") == 0) {
    try {
      sweep_head_tiles();
      return 0;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "bench_attention: %s\n", e.what());
      return 1;
    }
  }
  if (!profile && !bench::parse_json_option(argc, argv, "bench_attention", json)) return 2;
  try {
    if (profile) {  // one launch of each kind, nothing timed: for ncu
      auto ws = sparse_attention_workspace::for_device<dim>();
      std::mt19937 rng(1);
      for (int batch : {1, 64}) {
        operands op(rng, batch, 1, 8192);
        sparse_attention<dim>(op.args, op.kv, nullptr, &ws);
        sparse_attention<dim>(op.args, op.kv);
      }
      DSV4_CUDA_CHECK(cudaDeviceSynchronize());
      std::printf("bench_attention --profile: done\n");
      return 0;
    }
    cudaDeviceProp prop{};
    DSV4_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("device: %s\n", prop.name);
    const bench::ceilings ceil = bench::ceilings::measure();
    const double copy_bps = ceil.copy_bps, gemm_fps = ceil.gemm_fps;
    std::printf("%6s %9s %10s %10s %10s %10s %9s %7s %11s %11s %9s %12s\n", "batch", "context", "median us",
                "TFLOP/s", "GB/s", "floor us", "vs floor", "splits", "3-launch us", "unsplit us", "paged us",
                "mma.sync us");
    std::printf(
        "(median: the engine's launch, on wgmma where the device has it; mma.sync: the same launch "
        "without)\n");
    FILE* jf = json.empty() ? nullptr : std::fopen(json.c_str(), "w");
    if (jf) std::fprintf(jf, "{\"device\": \"%s\", \"copy_gbps\": %.1f, \"gemm_tflops\": %.1f, \"results\": [\n", prop.name,
                         copy_bps / 1e9, gemm_fps / 1e12);
    bool first = true;
    auto ws = sparse_attention_workspace::for_device<dim>();
    std::mt19937 rng(1);
    struct row {
      int batch;
      long long context;
      double graph_us;  // per call of back-to-back calls replayed as a graph; 0: not capturable
    };
    std::vector<row> ours;
    for (long long context : {8192ll, 131072ll}) {
      for (int batch : {1, 8, 64}) {
        const long long global = context;  // decoder owner: ratio 1, one entry per token
        operands op(rng, batch, 1, global);
        const auto& kv = op.kv;
        const auto& a = op.args;
        // The engine's launch (split KV at small batch, with a workspace) and the one-pass kernel.
        const double ms = bench::median_ms([&] { sparse_attention<dim>(a, kv, nullptr, &ws); });
        const double ms_unsplit = bench::median_ms([&] { sparse_attention<dim>(a, kv); });
        // Where the splits hold one chunk each, the engine's launch is one cooperative kernel;
        // the same split as three launches (maximum pass, split pass, merge) for comparison.
        ws.set_single_launch(false);
        const double ms_three = bench::median_ms([&] { sparse_attention<dim>(a, kv, nullptr, &ws); });
        ws.set_single_launch(true);
        sparse_attention_args a_sync = a;
        a_sync.allow_wgmma = false;
        const double ms_sync = bench::median_ms([&] { sparse_attention<dim>(a_sync, kv, nullptr, &ws); });
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
        pkv.pool = op.global_cache.data();
        pkv.block_tables = dtables.data();
        pkv.max_pages = pages_per_seq;
        pkv.page_bytes = static_cast<long long>(page_entries) * gl::bytes;
        pkv.entries_per_page = page_entries;
        const double ms_paged = bench::median_ms([&] { sparse_attention<dim>(a, pkv, nullptr, &ws); });
        double graph_ms = 0.0;  // for FlashMLA's table (0: this launch could not be captured)
#if DSV4_BENCH_FLASHMLA
        try {
          graph_ms = bench::median_ms_per_call([&](cudaStream_t st) { sparse_attention<dim>(a, kv, st, &ws); });
        } catch (const std::exception& e) {
          std::fprintf(stderr, "bench_attention: our launch as a graph: %s\n", e.what());
        }
#endif
        ours.push_back({batch, context, graph_ms * 1e3});
        const int splits = detail::choose_split<dim>(a, &ws, runtime::sm_count()).splits;
        const double flops = 4.0 * batch * heads * double(topk) * dim;  // QK^T and PV
        const double bytes = double(batch) * (window * wl::bytes + selected * gl::bytes + 2.0 * heads * dim * 2 +
                                              topk * 4.0);
        const double floor_s = ceil.floor_s(flops, bytes);
        std::printf("%6d %9lld %10.1f %10.1f %10.1f %10.2f %8.1f%% %7d %11.1f %11.1f %9.1f %12.1f\n", batch,
                    context, ms * 1e3, flops / (ms * 1e-3) / 1e12, bytes / (ms * 1e-3) / 1e9, floor_s * 1e6,
                    100 * floor_s / (ms * 1e-3), splits, ms_three * 1e3, ms_unsplit * 1e3, ms_paged * 1e3,
                    ms_sync * 1e3);
        if (jf)
          std::fprintf(jf,
                       "%s  {\"batch\": %d, \"context\": %lld, \"splits\": %d, \"three_launch_us\": %.2f, "
                       "\"unsplit_us\": %.2f, \"us\": %.2f, \"paged_us\": %.2f, \"mma_sync_us\": %.2f, "
                       "\"tflops\": %.2f, \"gbps\": %.1f, \"floor_us\": %.3f, \"ratio\": %.4f}",
                       first ? "" : ",\n", batch, context, splits, ms_three * 1e3, ms_unsplit * 1e3, ms * 1e3,
                       ms_paged * 1e3, ms_sync * 1e3, flops / (ms * 1e-3) / 1e12, bytes / (ms * 1e-3) / 1e9,
                       floor_s * 1e6, floor_s / (ms * 1e-3));
        first = false;
      }
    }
    {  // A prefill-shaped call: one sequence, many query rows, each with its own window + selection.
      constexpr int rows = 2048;
      operands op(rng, 1, rows, 8192);
      const double ms = bench::median_ms([&] { sparse_attention<dim>(op.args, op.kv, nullptr, &ws); });
      sparse_attention_args a_sync = op.args;
      a_sync.allow_wgmma = false;
      const double ms_sync = bench::median_ms([&] { sparse_attention<dim>(a_sync, op.kv, nullptr, &ws); });
      const double flops = 4.0 * rows * heads * double(topk) * dim;
      std::printf(
          "\nprefill-shaped: %d query rows x %d heads x %d indices: %.1f us, %.1f TFLOP/s (%.1f%% of the "
          "bf16 GEMM rate); "
          "mma.sync %.1f us\n",
          rows, heads, topk, ms * 1e3, flops / (ms * 1e-3) / 1e12, 100 * flops / (ms * 1e-3) / gemm_fps,
          ms_sync * 1e3);
      if (jf)
        std::fprintf(jf, ",\n  {\"prefill_rows\": %d, \"us\": %.2f, \"mma_sync_us\": %.2f, \"tflops\": %.2f}",
                     rows, ms * 1e3, ms_sync * 1e3, flops / (ms * 1e-3) / 1e12);
    }
#if DSV4_BENCH_FLASHMLA
    // FlashMLA on the same shapes: window 128 + 512 selected of `context` compressed entries, 64
    // heads, one query per sequence, the sink; its split-KV kernel and combine, the schedule made once.
    std::printf("\nFlashMLA SM90 sparse FP8 decode (MODEL1, 584 B per entry) on the same shapes:\n");
    std::printf("%6s %9s %12s %10s %10s %12s\n", "batch", "context", "FlashMLA us", "GB/s", "ours us", "ours / theirs");
    std::printf("(per call in a graph replay of back-to-back calls, both)\n");
    for (const auto& r : ours) {
      bench::flashmla_model1_decode fm(r.batch, window, selected, r.context, 7);
      const double ms_fm = bench::median_ms_per_call([&](cudaStream_t st) { fm.run(st); });
      const double bytes_fm = double(r.batch) * (double(topk) * bench::flashmla_model1_decode::bytes_per_token +
                                                 2.0 * heads * dim * 2 + topk * 4.0);
      std::printf("%6d %9lld %12.1f %10.1f", r.batch, r.context, ms_fm * 1e3, bytes_fm / (ms_fm * 1e-3) / 1e9);
      if (r.graph_us > 0)
        std::printf(" %10.1f %12.2f\n", r.graph_us, r.graph_us / (ms_fm * 1e3));
      else
        std::printf(" %10s %12s\n", "n/a", "n/a");
      if (jf)
        std::fprintf(jf, ",\n  {\"flashmla_batch\": %d, \"context\": %lld, \"flashmla_us\": %.2f, \"ours_us\": %s}", r.batch,
                     r.context, ms_fm * 1e3, r.graph_us > 0 ? std::to_string(r.graph_us).c_str() : "null");
    }
#endif
    if (jf) {
      std::fprintf(jf, "\n]}\n");
      std::fclose(jf);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_attention: %s\n", e.what());
    return 1;
  }
}
