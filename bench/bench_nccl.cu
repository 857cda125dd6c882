//! \brief The tensor-parallel collectives (parallel/nccl.cuh) on every visible GPU: the sum after
//! a row-parallel layer (`all_reduce_partials`: bf16 partials, fp32 all-reduce, one rounding) and
//! a plain fp32 all-reduce, at the sizes a V4.1 layer sums (5120 values per token: decode batches
//! 1 .. 32, prefill chunks up to 8192 tokens).
//! Usage: bench_nccl [--json FILE]
//!
//! One thread per GPU; rank 0 times 50 back-to-back calls with CUDA events (median of 7 after a
//! warm-up). Bus bandwidth as nccl-tests counts it (2 (W - 1) / W x bytes / time) against the
//! ceiling measured in the same run: a device-to-device peer copy between GPUs 0 and 1.

#include <algorithm>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "bench_util.cuh"
#include "dsv4/parallel/nccl.cuh"

using namespace dsv4;
using numerics::bf16;

namespace {

double peer_copy_bandwidth(std::size_t bytes) {
  DSV4_CUDA_CHECK(cudaSetDevice(0));
  runtime::device_buffer<std::uint8_t> a(bytes);
  DSV4_CUDA_CHECK(cudaSetDevice(1));
  runtime::device_buffer<std::uint8_t> b(bytes);
  DSV4_CUDA_CHECK(cudaSetDevice(0));
  int can = 0;
  DSV4_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, 0, 1));
  if (can) (void)cudaDeviceEnablePeerAccess(1, 0), (void)cudaGetLastError();  // already enabled is fine
  const double ms =
      bench::median_ms([&] { DSV4_CUDA_CHECK(cudaMemcpyPeerAsync(b.data(), 1, a.data(), 0, bytes)); });
  return double(bytes) / (ms * 1e-3);
}

}  // namespace

int main(int argc, char** argv) {
  std::string json;
  if (!bench::parse_json_option(argc, argv, "bench_nccl", json)) return 2;
  try {
    const int W = runtime::cuda_device_count();
    if (W < 2) {
      std::printf("bench_nccl: needs 2 or more CUDA devices, %d visible\n", W);
      return 1;
    }
    const double peer = peer_copy_bandwidth(std::size_t(256) << 20);
    std::printf("GPUs: %d; ceiling: peer copy GPU 0 -> 1 %.0f GB/s (256 MiB)\n", W, peer / 1e9);
    const auto world = parallel::nccl_world::first(W);
    FILE* jf = json.empty() ? nullptr : std::fopen(json.c_str(), "w");
    if (jf) std::fprintf(jf, "{\"gpus\": %d, \"peer_copy_gbps\": %.1f, \"results\": [\n", W, peer / 1e9);
    std::printf("%-22s %8s %10s %10s %10s %9s\n", "collective", "tokens", "bytes", "median us", "bus GB/s",
                "vs peer");
    bool first = true;
    for (const bool partials : {true, false})
      for (const long long tokens : {1LL, 8LL, 32LL, 512LL, 8192LL}) {
        const std::size_t n = std::size_t(tokens) * 5120;
        std::vector<double> per_call_ms;
        std::vector<std::thread> threads;
        std::vector<std::string> failures(static_cast<std::size_t>(W));
        for (int r = 0; r < W; ++r)
          threads.emplace_back([&, r] {
            try {
              DSV4_CUDA_CHECK(cudaSetDevice(world.device(r)));
              const auto comm = world.rank(r);
              cudaStream_t st;
              DSV4_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
              runtime::device_buffer<bf16> part(n), out(n);
              runtime::device_buffer<float> scratch(n);
              part.fill_bytes(0x3c), scratch.fill_bytes(0);
              DSV4_CUDA_CHECK(cudaDeviceSynchronize());
              auto call = [&] {
                if (partials)
                  comm.all_reduce_partials(part.data(), scratch.data(), out.data(), n, st);
                else
                  comm.all_reduce_sum(scratch.data(), n, st);
              };
              for (int i = 0; i < 5; ++i) call();
              cudaEvent_t e0, e1;
              DSV4_CUDA_CHECK(cudaEventCreate(&e0));
              DSV4_CUDA_CHECK(cudaEventCreate(&e1));
              std::vector<double> reps;
              for (int rep = 0; rep < 7; ++rep) {
                DSV4_CUDA_CHECK(cudaEventRecord(e0, st));
                for (int i = 0; i < 50; ++i) call();
                DSV4_CUDA_CHECK(cudaEventRecord(e1, st));
                DSV4_CUDA_CHECK(cudaEventSynchronize(e1));
                float ms = 0;
                DSV4_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
                reps.push_back(ms / 50);
              }
              std::sort(reps.begin(), reps.end());
              if (r == 0) per_call_ms.push_back(reps[reps.size() / 2]);
              DSV4_CUDA_CHECK(cudaEventDestroy(e0));
              DSV4_CUDA_CHECK(cudaEventDestroy(e1));
              DSV4_CUDA_CHECK(cudaStreamDestroy(st));
            } catch (const std::exception& e) {
              failures[std::size_t(r)] = "rank " + std::to_string(r) + ": " + e.what();
            }
          });
        for (auto& t : threads) t.join();
        for (const auto& f : failures)
          if (!f.empty()) throw error(f);
        const double ms = per_call_ms.at(0), bytes = 4.0 * double(n);
        const double bus = 2.0 * (W - 1) / W * bytes / (ms * 1e-3);
        const char* name = partials ? "all_reduce_partials" : "all_reduce_sum fp32";
        std::printf("%-22s %8lld %10.0f %10.1f %10.1f %8.1f%%\n", name, tokens, bytes, ms * 1e3, bus / 1e9,
                    100 * bus / peer);
        if (jf)
          std::fprintf(jf,
                       "%s  {\"collective\": \"%s\", \"tokens\": %lld, \"bytes\": %.0f, \"us\": %.2f, "
                       "\"bus_gbps\": %.1f}",
                       first ? "" : ",\n", name, tokens, bytes, ms * 1e3, bus / 1e9);
        first = false;
      }
    if (jf) {
      std::fprintf(jf, "\n]}\n");
      std::fclose(jf);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_nccl: %s\n", e.what());
    return 1;
  }
  return 0;
}
