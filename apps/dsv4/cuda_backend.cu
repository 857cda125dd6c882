//! \file
//! The CUDA backend of `dsv4 run` (cuda_backend.hpp).

#include "cuda_backend.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <string>

#include "dsv4/kernels/gemm/wgmma_gemm.cuh"
#include "dsv4/model/device_dspark.cuh"
#include "dsv4/model/device_model.cuh"
#include "dsv4/model/device_speculative.cuh"

namespace dsv4::apps {

cli::generation cuda_generate(const model::host_model<models::tiny>& m, const cli::run_request& request) {
  const auto prompt = request.prompt;
  const long long n_new = request.n_new;
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    cudaGetLastError();  // clear the sticky "no device" error for any later CUDA call
    throw error("run --backend cuda: no CUDA device is visible (check the driver, or CUDA_VISIBLE_DEVICES)");
  }
  cudaDeviceProp prop{};
  DSV4_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const long long total = static_cast<long long>(prompt.size()) + std::max(n_new, 0LL);
  if (total > models::tiny::dims.rope.max_position_embeddings)
    throw error("run --backend cuda: " + std::to_string(total) + " positions exceed the model's " +
                std::to_string(models::tiny::dims.rope.max_position_embeddings));
  model::device_model<models::tiny>::limits lim;
  lim.max_seqs = 1;
  lim.max_rows = int(std::max<std::size_t>(prompt.size(), 1));
  lim.max_tokens = std::max(total, 1LL);
  if (request.dspark) {  // a round: block + 1 rows in one call, every row's logits
    const int round = request.dspark->block + 1;
    lim.max_rows = std::max(lim.max_rows, round), lim.logit_rows = round;
  }
  lim.engram_host_tables = request.engram_host_tables;
  // --gemm wgmma: the process-wide GEMM choice for this generation (an error where wgmma cannot run).
  struct gemm_choice {
    explicit gemm_choice(bool wgmma) {
      if (wgmma) kernels::gemm::set_decode_gemm(kernels::gemm::decode_gemm::wgmma);
    }
    ~gemm_choice() { kernels::gemm::set_decode_gemm(kernels::gemm::decode_gemm::mma_sync); }
  } choice(request.wgmma_gemms);
  model::device_model<models::tiny> dm(m, lim);
  const int slot = dm.add_sequence();

  cli::generation g;
  g.device = std::string("CUDA backend on ") + prop.name +
             (request.engram_host_tables ? ", Engram tables in host memory" : "") +
             (request.wgmma_gemms ? ", wgmma GEMMs" : "");
  if (request.dspark) {  // prefill and generation in one loop, timed as the decode
    model::device_dspark<models::tiny> dd(dm, *request.dspark, lim.max_seqs);
    g.device += ", DSpark drafts on the GPU";
    const auto t0 = std::chrono::steady_clock::now();
    g.tokens = model::generate_speculative(dm, dd, slot, prompt, n_new, request.sampling, g.speculative,
                                           request.ced ? model::prompt_prefill::ced : model::prompt_prefill::exact);
    g.decode_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return g;
  }
  // Draws on the device (kernels/sampling/sampling.cuh): the decode steps' logits stay there.
  cli::run_generation_drawing(
      request, g, [&] { request.ced ? dm.prefill_ced(slot, prompt) : dm.prefill(slot, prompt); },
      [&] {  // the counter: the position of the token drawn, as the host backend's
        const kernels::sampling::row_request draw{request.sampling, 0, std::uint64_t(dm.length(slot))};
        return dm.sample(std::span(&draw, 1))[0];
      },
      [&](std::int32_t next) { dm.decode_on_device({slot}, std::span<const std::int32_t>(&next, 1)); });
  return g;
}

}  // namespace dsv4::apps
