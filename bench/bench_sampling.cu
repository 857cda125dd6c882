//! \brief Drawing a decode step's tokens: on the GPU (kernels::sampling::device_sampler) against the
//! way the engine took before, the logits copied to the host and drawn by sample_reference.
//! Usage: bench_sampling
//!
//! V4.1's vocabulary (129,280), 1 / 8 / 64 rows of logits resident in device memory (normal(0, 2)
//! with a few strong tokens, like a trained model's peaked rows), greedy, temperature 1 without
//! filters, temperature 0.8 with top-k 50 and with top-p 0.95. Both paths are timed end to end as a decode
//! loop sees them (ids on the host), median of 30 after warm-up; beside them the pinned device-to-host copy
//! of the logits alone and the device sampler's floor (its passes' reads of the logits at the copy bandwidth
//! measured in the same run).

#include <cstdio>
#include <random>
#include <vector>

#include "bench_util.cuh"
#include "dsv4/kernels/sampling/sampling.cuh"
#include "dsv4/runtime/pinned_buffer.cuh"

using namespace dsv4;
using namespace dsv4::kernels::sampling;

int main() {
  try {
    cudaDeviceProp prop{};
    DSV4_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("device: %s\n", prop.name);
    const double copy_bps = bench::copy_bandwidth(std::size_t(1) << 30);
    std::printf("ceiling: device copy %.0f GB/s (read + write)\n", copy_bps / 1e9);
    constexpr long long vocab = 129280;
    constexpr int max_rows = 64;
    std::mt19937_64 rng(5);
    std::normal_distribution<float> n(0.0f, 2.0f);
    std::vector<float> x(std::size_t(max_rows) * vocab);
    for (auto& v : x) v = n(rng);
    for (int r = 0; r < max_rows; ++r)
      for (int k = 0; k < 8; ++k) x[std::size_t(r) * vocab + rng() % vocab] = 12.0f + float(k);
    runtime::device_buffer<float> dx{std::span<const float>(x)};
    runtime::pinned_buffer<float> host(x.size());
    device_sampler sampler(max_rows);
    std::printf("%5s %-16s %12s %12s %12s %12s %9s\n", "rows", "sampling", "GPU us", "copy+host us",
                "copy us", "GPU floor us", "speedup");
    for (int rows : {1, 8, 64})
      for (const sampling_params p :
           {sampling_params{0.0f, 0, 1.0f, 1}, sampling_params{1.0f, 0, 1.0f, 1},
            sampling_params{0.8f, 50, 1.0f, 1}, sampling_params{0.8f, 0, 0.95f, 1}}) {
        std::vector<row_request> req(static_cast<std::size_t>(rows));
        for (int r = 0; r < rows; ++r) req[std::size_t(r)] = {p, std::uint64_t(r), 100};
        std::vector<std::int32_t> gpu_ids, host_ids(static_cast<std::size_t>(rows));
        const double gpu_ms = bench::median_ms([&] { gpu_ids = sampler.sample(dx.data(), vocab, req); });
        const std::size_t bytes = std::size_t(rows) * vocab * sizeof(float);
        const double copy_ms = bench::median_ms(
            [&] { DSV4_CUDA_CHECK(cudaMemcpy(host.data(), dx.data(), bytes, cudaMemcpyDeviceToHost)); });
        const double host_ms = bench::median_ms(
            [&] {
              DSV4_CUDA_CHECK(cudaMemcpy(host.data(), dx.data(), bytes, cudaMemcpyDeviceToHost));
              for (int r = 0; r < rows; ++r)
                host_ids[std::size_t(r)] =
                    sample_reference(std::span<const float>(host.data() + std::size_t(r) * vocab, vocab), p,
                                     std::uint64_t(r), 100);
            },
            2, 10);
        if (gpu_ids != host_ids) throw error("bench_sampling: the GPU's draws differ from the host's");
        // Row-sized passes: greedy reads the logits once; with a temperature they are read twice and
        // the exponentials written once, then read once to draw, or twice with filters (bins, gather).
        const bool filtered = p.top_k > 0 || p.top_p < 1.0f;
        const int passes = p.temperature == 0.0f ? 1 : filtered ? 5 : 4;
        const double floor_us = double(bytes) * passes / (copy_bps / 2) * 1e6;
        const char* name = p.temperature == 0.0f ? "greedy"
                           : p.top_k > 0         ? "T 0.8, top-k 50"
                           : filtered            ? "T 0.8, top-p .95"
                                                 : "T 1";
        std::printf("%5d %-16s %12.1f %12.1f %12.1f %12.2f %8.1fx\n", rows, name, gpu_ms * 1e3, host_ms * 1e3,
                    copy_ms * 1e3, floor_us, host_ms / gpu_ms);
      }
    std::printf("rows drawn on the host by the GPU sampler (too flat): %lld\n", sampler.fallback_rows());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_sampling: %s\n", e.what());
    return 1;
  }
}
