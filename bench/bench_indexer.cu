//! \brief Lightning-indexer scan (MXFP4 keys, 32 heads x 128) and top-512 selection, decode shapes.
//! Usage: bench_indexer [--json FILE]
//!
//! Scan: FLOPs = rows x keys x heads x 128 x 2; bytes = keys x 68 (read) + rows x keys x 2 (scores).
//! Top-k: bytes = rows x keys x 2 (one read of the scores; the kernel reads them three times);
//! "top-k/N" is the same selection given scratch, several CTAs per row when the rows are long.
//! "scan" is the tiled kernel (one CTA per 64 keys and 4 rows), "scan/s" the streamed one (warps
//! streaming 16-key tiles over a grid sized to the GPU), which the model runs
//! (scan_method::automatic). "reindex" and "reindex/s" likewise.
//! Reindex: a gathered scan of the 16,384 pool positions plus top-512 among them, per row.
//! Ratios are to max(FLOPs / bf16 GEMM rate, bytes / copy bandwidth), both measured in this run.

#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bench_util.cuh"
#include "dsv4/kernels/indexer/indexer.cuh"
#include "dsv4/numerics/formats.hpp"
#include "dsv4/numerics/quantize.hpp"

using namespace dsv4;
using namespace dsv4::kernels::indexer;
using numerics::bf16;

namespace {

//! Query values -3 .. 3 in steps of 1/2, MXFP4 quantize-dequantized per `dim` channels as the
//! model's queries are (the scans' exactness assumes it).
void random_queries(std::mt19937& rng, std::vector<bf16>& q, int dim) {
  for (auto& v : q) v = bf16::from_float(float(int(rng() % 13)) / 2.0f - 3.0f);
  for (std::size_t h = 0; h < q.size() / std::size_t(dim); ++h)
    numerics::qdq_vector<numerics::index_key_format>(std::span(q).subspan(h * std::size_t(dim), std::size_t(dim)));
}

}  // namespace

int main(int argc, char** argv) {
  std::string json;
  if (!bench::parse_json_option(argc, argv, "bench_indexer", json)) return 2;
  try {
    constexpr int dim = 128, heads = 32, topk = 512, entry = 68;
    const bench::ceilings ceil = bench::ceilings::measure();
    const double copy_bps = ceil.copy_bps, gemm_fps = ceil.gemm_fps;
    std::printf("%-8s %6s %9s %10s %10s %10s %9s\n", "kernel", "rows", "keys", "median us", "TFLOP/s", "GB/s", "vs floor");
    FILE* jf = json.empty() ? nullptr : std::fopen(json.c_str(), "w");
    if (jf) std::fprintf(jf, "{\"copy_gbps\": %.1f, \"gemm_tflops\": %.1f, \"results\": [\n", copy_bps / 1e9, gemm_fps / 1e12);
    bool first = true;
    std::mt19937 rng(1);
    for (long long keys : {131072ll, 1048576ll}) {
      std::vector<std::uint8_t> cache(std::size_t(keys) * entry);
      for (std::size_t i = 0; i < cache.size(); ++i) cache[i] = (i % entry) < 64 ? std::uint8_t(rng()) : std::uint8_t(120 + rng() % 8);
      runtime::device_buffer<std::uint8_t> dkeys{std::span<const std::uint8_t>(cache)};
      for (int rows : {1, 8, 64}) {
        std::vector<bf16> q(std::size_t(rows) * heads * dim), w(std::size_t(rows) * heads);
        random_queries(rng, q, dim);
        for (auto& v : w) v = bf16::from_float(float(int(rng() % 9) - 4) / 64.0f);
        std::vector<long long> visible(std::size_t(rows), keys);
        runtime::device_buffer<bf16> dq{std::span<const bf16>(q)}, dw{std::span<const bf16>(w)},
            ds(std::size_t(rows) * keys);
        runtime::device_buffer<long long> dv{std::span<const long long>(visible)};
        runtime::device_buffer<std::int32_t> dout(std::size_t(rows) * topk);
        index_scan_args sa{dq.data(), dw.data(), dkeys.data(), entry, ds.data(), dv.data(), rows, heads, keys};
        sa.method = scan_method::streamed;
        const double ms_stream = bench::median_ms([&] { index_scan<dim>(sa); }, 3, 15);
        sa.method = scan_method::tiled;
        const topk_args ta{ds.data(), keys, rows, topk, dv.data(), 128, dout.data()};
        const double ms_scan = bench::median_ms([&] { index_scan<dim>(sa); }, 3, 15);
        const double ms_topk = bench::median_ms([&] { select_topk(ta); }, 3, 15);
        // The same selection with scratch: several CTAs per row where the rows are long and few.
        runtime::device_buffer<unsigned> scratch(std::max<std::size_t>(1, topk_scratch_words(rows, keys)));
        topk_args tsplit = ta;
        tsplit.scratch = scratch.data(), tsplit.scratch_words = topk_scratch_words(rows, keys);
        const double ms_split = bench::median_ms([&] { select_topk(tsplit); }, 3, 15);
        // A Reindex layer: score only 16,384 candidate positions (2048 blocks of 8), then select.
        constexpr int cand = 16384;
        std::vector<std::int32_t> pos(std::size_t(rows) * cand);
        for (int r = 0; r < rows; ++r)
          for (int c = 0; c < cand; ++c)
            pos[std::size_t(r) * cand + c] = std::int32_t((long long)(c / 8) * (keys / 2048) + c % 8);  // ascending
        runtime::device_buffer<std::int32_t> dpos{std::span<const std::int32_t>(pos)};
        runtime::device_buffer<bf16> dcs(std::size_t(rows) * cand);
        gathered_scan_args ga{{dq.data(), dw.data(), dkeys.data(), entry, dcs.data(), dv.data(), rows, heads, cand},
                              dpos.data()};
        ga.scan.method = scan_method::tiled;
        const topk_args ra{dcs.data(), cand, rows, topk, dv.data(), 128, dout.data(), dpos.data()};
        const double ms_reindex = bench::median_ms([&] {
          index_scan_gathered<dim>(ga);
          select_topk(ra);
        }, 3, 15);
        ga.scan.method = scan_method::streamed;
        const double ms_reindex_s = bench::median_ms([&] {
          index_scan_gathered<dim>(ga);
          select_topk(ra);
        }, 3, 15);
        const double flops = 2.0 * rows * double(keys) * heads * dim;
        const double scan_bytes = double(keys) * entry + 2.0 * rows * double(keys);
        const double topk_bytes = 2.0 * rows * double(keys);
        const double re_flops = 2.0 * rows * double(cand) * heads * dim;
        const double re_bytes = double(rows) * cand * (entry + 4.0 + 2.0 * 2);
        struct { const char* name; double ms, flops, bytes; } res[6] = {{"scan", ms_scan, flops, scan_bytes},
                                                                         {"scan/s", ms_stream, flops, scan_bytes},
                                                                         {"top-k", ms_topk, 0.0, topk_bytes},
                                                                         {"top-k/N", ms_split, 0.0, topk_bytes},
                                                                         {"reindex", ms_reindex, re_flops, re_bytes},
                                                                         {"reindex/s", ms_reindex_s, re_flops, re_bytes}};
        for (auto& r : res) {
          const double floor_s = ceil.floor_s(r.flops, r.bytes);
          std::printf("%-8s %6d %9lld %10.1f %10.2f %10.1f %8.1f%%\n", r.name, rows, keys, r.ms * 1e3,
                      r.flops / (r.ms * 1e-3) / 1e12, r.bytes / (r.ms * 1e-3) / 1e9, 100 * floor_s / (r.ms * 1e-3));
          if (jf)
            std::fprintf(jf, "%s  {\"kernel\": \"%s\", \"rows\": %d, \"keys\": %lld, \"us\": %.2f, \"ratio\": %.4f}",
                         first ? "" : ",\n", r.name, rows, keys, r.ms * 1e3, floor_s / (r.ms * 1e-3));
          first = false;
        }
      }
    }
    {  // A causal prefill's scan: 4,096 rows over their own 4,096 keys, row i seeing keys [0, i].
      constexpr int rows = 4096;
      constexpr long long keys = rows;
      std::vector<std::uint8_t> cache(std::size_t(keys) * entry);
      for (std::size_t i = 0; i < cache.size(); ++i) cache[i] = (i % entry) < 64 ? std::uint8_t(rng()) : std::uint8_t(120 + rng() % 8);
      std::vector<bf16> q(std::size_t(rows) * heads * dim), w(std::size_t(rows) * heads);
      random_queries(rng, q, dim);
      for (auto& v : w) v = bf16::from_float(float(int(rng() % 9) - 4) / 64.0f);
      std::vector<long long> visible(static_cast<std::size_t>(rows));
      for (int r = 0; r < rows; ++r) visible[std::size_t(r)] = r + 1;
      runtime::device_buffer<std::uint8_t> dkeys{std::span<const std::uint8_t>(cache)};
      runtime::device_buffer<bf16> dq{std::span<const bf16>(q)}, dw{std::span<const bf16>(w)}, ds(std::size_t(rows) * keys);
      runtime::device_buffer<long long> dv{std::span<const long long>(visible)};
      index_scan_args sa{dq.data(), dw.data(), dkeys.data(), entry, ds.data(), dv.data(), rows, heads, keys};
      const double pairs = double(rows) * (rows + 1) / 2;  // the visible (row, key) pairs
      const double flops = 2.0 * pairs * heads * dim;
      for (const scan_method m : {scan_method::tiled, scan_method::streamed}) {
        sa.method = m;
        const double ms = bench::median_ms([&] { index_scan<dim>(sa); }, 3, 15);
        const char* name = m == scan_method::tiled ? "tiled" : "streamed";
        std::printf("%scausal prefill scan (%s): %d rows x %lld keys (row i sees i + 1): %.1f us, %.2f TFLOP/s on the visible pairs\n",
                    m == scan_method::tiled ? "\n" : "", name, rows, keys, ms * 1e3, flops / (ms * 1e-3) / 1e12);
        if (jf)
          std::fprintf(jf, ",\n  {\"kernel\": \"scan-causal-%s\", \"rows\": %d, \"keys\": %lld, \"us\": %.2f}", name, rows, keys,
                       ms * 1e3);
      }
    }
    if (jf) {
      std::fprintf(jf, "\n]}\n");
      std::fclose(jf);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_indexer: %s\n", e.what());
    return 1;
  }
}
