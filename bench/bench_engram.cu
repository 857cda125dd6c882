//! \brief One Engram module at V4.1 widths (4 streams x 5120, 24 rows of 256 E4M3 codes a token):
//! lookup + wkv projection + gate per call, with the table in device memory and in host memory
//! (issue 5: the rows of a call gathered on the host and copied, engram/host_fetch.cuh).
//! Usage: bench_engram [--json FILE]
//!
//! The table is 16 GiB (about 65 million rows; V4.1's are ~100 GB, which the device side could
//! not hold beside a model anyway). Device path: CUDA events, median of 30. Host path: wall time
//! of start + wait + forward + synchronize per call, median of 30 (what a call pays when nothing
//! hides the fetch), and of the fetch alone. Floors: the device path reads the rows and the wkv
//! weight (5120 x 5 x 6144 FP8 + scales: the projection dominates at small batch) at the copy
//! bandwidth; the fetch moves its pack at the pinned host-to-device bandwidth, both measured here.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench_util.cuh"
#include "dsv4/engram/engram.cuh"
#include "dsv4/engram/host_fetch.cuh"
#include "dsv4/kernels/gemm/weight_tiles.hpp"
#include "dsv4/runtime/pinned_buffer.cuh"

using namespace dsv4;
using numerics::bf16;

namespace {

//! Pinned host-to-device bandwidth in bytes/s over `bytes`.
double h2d_bandwidth(std::size_t bytes) {
  runtime::pinned_buffer<unsigned char> h(bytes);
  runtime::device_buffer<unsigned char> d(bytes);
  std::fill(h.data(), h.data() + bytes, 1);
  const double ms = bench::median_ms([&] { DSV4_CUDA_CHECK(cudaMemcpyAsync(d.data(), h.data(), bytes, cudaMemcpyHostToDevice)); },
                                     2, 10);
  return double(bytes) / (ms * 1e-3);
}

//! Fills `n` bytes at `p` with finite E4M3 codes (or UE8M0 scales near 1 with `scales`), on all cores.
void fill_host(std::uint8_t* p, std::size_t n, bool scales) {
  const unsigned parts = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < parts; ++t)
    pool.emplace_back([=] {
      std::uint64_t x = 0x9E3779B97F4A7C15ull * (t + 1);
      for (std::size_t i = n * t / parts; i < n * (t + 1) / parts; ++i) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        p[i] = scales ? std::uint8_t(120 + (x >> 32) % 8) : std::uint8_t((x >> 24) & 0x77u);
      }
    });
  for (auto& th : pool) th.join();
}

}  // namespace

int main(int argc, char** argv) {
  std::string json;
  if (!bench::parse_json_option(argc, argv, "bench_engram", json)) return 2;
  try {
    constexpr int hc = 4, dim = 5120, head_dim = 256, columns = 24;
    const long long rows = (16ll << 30) / (head_dim + head_dim / 32);
    cudaDeviceProp prop{};
    DSV4_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    const double copy_bps = bench::copy_bandwidth(std::size_t(1) << 30), h2d_bps = h2d_bandwidth(std::size_t(1) << 30);
    std::printf("device: %s\nceilings: copy %.0f GB/s (1 GiB D2D, read + write), pinned host-to-device %.1f GB/s\n", prop.name,
                copy_bps / 1e9, h2d_bps / 1e9);
    std::printf("table: %lld rows x %d codes (%.1f GiB)\n", rows, head_dim, double(rows) * (head_dim + head_dim / 32) / (1 << 30));

    // The table, in host memory and in device memory (the same bytes).
    std::vector<std::uint8_t> embed(std::size_t(rows) * head_dim), scale(std::size_t(rows) * head_dim / 32);
    fill_host(embed.data(), embed.size(), false);
    fill_host(scale.data(), scale.size(), true);
    runtime::device_buffer<std::uint8_t> d_embed{std::span<const std::uint8_t>(embed)}, d_scale{std::span<const std::uint8_t>(scale)};
    // The projection (FP8, 32 x 32 tiles, MMA-tile layout) and the per-stream weights.
    const int n = dim * (hc + 1), k = columns * head_dim;
    std::vector<std::uint8_t> wkv(std::size_t(n) * k), wkv_s(std::size_t((n + 31) / 32) * (k / 32));
    fill_host(wkv.data(), wkv.size(), false);
    fill_host(wkv_s.data(), wkv_s.size(), true);
    const auto tiled = kernels::gemm::tile_weight(kernels::gemm::weight_format::fp8_tile32, n, k, wkv, wkv_s);
    runtime::device_buffer<std::uint8_t> d_wkv{std::span<const std::uint8_t>(tiled.codes)},
        d_wkv_s{std::span<const std::uint8_t>(tiled.scales)};
    std::vector<float> qk(std::size_t(hc) * dim, 0.01f);
    runtime::device_buffer<float> d_qk{std::span<const float>(qk)};
    engram::engram_device_weights w;
    w.hc = hc, w.dim = dim, w.head_dim = head_dim, w.columns = columns, w.rows = rows;
    w.embed = d_embed.data(), w.embed_scale = d_scale.data(), w.wkv = d_wkv.data(), w.wkv_scale = d_wkv_s.data();
    w.qk_weight = d_qk.data();
    constexpr int max_tokens = 64;
    engram::engram_workspace ws(w, max_tokens);
    engram::host_table_fetch fetch(engram::host_table{embed.data(), scale.data(), rows, head_dim}, 1ll * max_tokens * columns);
    cublasHandle_t blas;
    kernels::gemm::detail::blas_check(cublasCreate(&blas), "bench_engram: cublasCreate");
    runtime::device_buffer<bf16> x(std::size_t(max_tokens) * hc * dim);
    x.fill_bytes(0x3c);

    std::printf("%6s %12s %10s %8s %12s %12s %12s %10s\n", "tokens", "device us", "floor us", "ratio", "host us", "fetch us",
                "fetch floor", "KB/token");
    FILE* jf = json.empty() ? nullptr : std::fopen(json.c_str(), "w");
    if (jf)
      std::fprintf(jf, "{\"device\": \"%s\", \"copy_gbps\": %.1f, \"h2d_gbps\": %.1f, \"table_rows\": %lld, \"results\": [\n",
                   prop.name, copy_bps / 1e9, h2d_bps / 1e9, rows);
    std::mt19937_64 rng(7);
    bool first = true;
    for (int tokens : {1, 8, 64}) {
      std::vector<std::int64_t> ids(std::size_t(tokens) * columns);
      for (auto& id : ids) id = std::int64_t(rng() % std::uint64_t(rows));
      runtime::device_buffer<std::int64_t> d_ids{std::span<const std::int64_t>(ids)};
      const double dev_ms =
          bench::median_ms([&] { engram::engram_forward(x.data(), d_ids.data(), nullptr, tokens, w, ws, blas); });
      auto wall_median = [&](auto&& fn) {
        std::vector<double> us;
        for (int i = 0; i < 35; ++i) {
          const auto t0 = std::chrono::steady_clock::now();
          fn();
          DSV4_CUDA_CHECK(cudaDeviceSynchronize());
          if (i >= 5) us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
        }
        std::sort(us.begin(), us.end());
        return us[us.size() / 2];
      };
      const double host_us = wall_median([&] {
        fetch.start(ids, nullptr);
        fetch.wait(nullptr);
        engram::engram_forward(x.data(), fetch.ids(), nullptr, tokens, fetch.view(w), ws, blas);
      });
      const double fetch_us = wall_median([&] {
        fetch.start(ids, nullptr);
        fetch.wait(nullptr);
      });
      const double row_bytes = head_dim + head_dim / 32;
      const double dev_bytes = double(ids.size()) * row_bytes + double(n) * k + double(tiled.scales.size()) +
                               double(tokens) * hc * dim * 2 * 2;
      const double floor_us = dev_bytes / copy_bps * 1e6;
      const double pack_bytes = double(ids.size()) * (row_bytes + 8);
      const double fetch_floor_us = pack_bytes / h2d_bps * 1e6;
      std::printf("%6d %12.1f %10.1f %7.1f%% %12.1f %12.1f %12.2f %10.2f\n", tokens, dev_ms * 1e3, floor_us,
                  100 * floor_us / (dev_ms * 1e3), host_us, fetch_us, fetch_floor_us, pack_bytes / tokens / 1e3);
      if (jf)
        std::fprintf(jf,
                     "%s  {\"tokens\": %d, \"device_us\": %.2f, \"floor_us\": %.2f, \"host_us\": %.2f, \"fetch_us\": %.2f, "
                     "\"fetch_floor_us\": %.3f, \"pack_bytes_per_token\": %.0f}",
                     first ? "" : ",\n", tokens, dev_ms * 1e3, floor_us, host_us, fetch_us, fetch_floor_us, pack_bytes / tokens);
      first = false;
    }
    if (jf) std::fprintf(jf, "\n]}\n"), std::fclose(jf);
    cublasDestroy(blas);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_engram: %s\n", e.what());
    return 1;
  }
}
