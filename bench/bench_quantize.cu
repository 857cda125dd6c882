//! \brief Block quantizer throughput on the GPU, against the device copy ceiling of the same run.
//! Usage: bench_quantize [--rows N] [--json FILE]
//!
//! The quantizer is memory-bound: it reads bf16 rows and writes packed codes and scales. The
//! figure of merit is bytes moved per second over the copy bandwidth measured in the same process.

#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bench_util.cuh"
#include "dsv4/numerics/quantize.cuh"

using namespace dsv4;
using namespace dsv4::numerics;

namespace {

struct row_result {
  std::string what;
  long long rows;
  int channels;
  double ms, bytes, gbps, ratio;
};

template <class F>
row_result run_quantize(const char* name, long long rows, int channels, double copy_bps, bool dequant) {
  std::vector<bf16> x(std::size_t(rows) * channels);
  std::mt19937 rng(1);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (auto& v : x) v = bf16::from_float(n(rng));
  runtime::device_buffer<bf16> dx{std::span<const bf16>(x)}, dout(x.size());
  const long long cb = channels * F::element::storage_bits / 8, sb = channels / F::block_size;
  runtime::device_buffer<std::uint8_t> dc(std::size_t(rows * cb)), ds(std::size_t(rows * sb));
  quantize_args q{dx.data(), rows, channels, channels, dc.data(), cb, ds.data(), sb};
  dequantize_args d{dc.data(), cb, ds.data(), sb, rows, channels, dout.data(), channels};
  const double ms = dequant ? bench::median_ms([&] { dequantize<F>(d); }) : bench::median_ms([&] { quantize<F>(q); });
  const double bytes = double(rows) * (channels * 2.0 + double(cb + sb));
  const double gbps = bytes / (ms * 1e-3);
  return {std::string(dequant ? "dequantize " : "quantize ") + name, rows, channels, ms, bytes, gbps / 1e9, gbps / copy_bps};
}

}  // namespace

int main(int argc, char** argv) {
  long long rows = 1 << 20;
  std::string json;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--rows") && i + 1 < argc) rows = std::atoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--json") && i + 1 < argc) json = argv[++i];
    else {
      std::fprintf(stderr, "usage: bench_quantize [--rows N] [--json FILE]\n");
      return 2;
    }
  }
  try {
    cudaDeviceProp prop{};
    DSV4_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    const double copy_bps = bench::copy_bandwidth(std::size_t(1) << 30);
    std::printf("device: %s, copy ceiling %.0f GB/s (read + write, 1 GiB cudaMemcpy D2D)\n", prop.name, copy_bps / 1e9);
    std::vector<row_result> results;
    for (bool deq : {false, true}) {
      results.push_back(run_quantize<main_kv_format>("main KV E2M1/E4M3/16", rows, 512, copy_bps, deq));
      results.push_back(run_quantize<index_key_format>("index key E2M1/UE8M0/32", rows * 4, 128, copy_bps, deq));
      results.push_back(run_quantize<fp8_act_format>("local KV E4M3/UE8M0/32", rows, 512, copy_bps, deq));
    }
    std::printf("%-36s %10s %8s %10s %10s %8s\n", "what", "rows", "channels", "median ms", "GB/s", "vs copy");
    for (const auto& r : results)
      std::printf("%-36s %10lld %8d %10.4f %10.1f %7.1f%%\n", r.what.c_str(), r.rows, r.channels, r.ms, r.gbps, 100 * r.ratio);
    if (!json.empty()) {
      FILE* f = std::fopen(json.c_str(), "w");
      if (!f) throw error("cannot write " + json);
      std::fprintf(f, "{\"device\": \"%s\", \"copy_gbps\": %.1f, \"results\": [\n", prop.name, copy_bps / 1e9);
      for (std::size_t i = 0; i < results.size(); ++i)
        std::fprintf(f, "  {\"what\": \"%s\", \"rows\": %lld, \"channels\": %d, \"ms\": %.5f, \"gbps\": %.1f, \"ratio\": %.3f}%s\n",
                     results[i].what.c_str(), results[i].rows, results[i].channels, results[i].ms, results[i].gbps,
                     results[i].ratio, i + 1 < results.size() ? "," : "");
      std::fprintf(f, "]}\n");
      std::fclose(f);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_quantize: %s\n", e.what());
    return 1;
  }
}
