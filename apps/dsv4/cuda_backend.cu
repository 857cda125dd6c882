//! \file
//! The CUDA backend of `dsv4 run` (cuda_backend.hpp).

#include "cuda_backend.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "dsv4/kernels/gemm/wgmma_gemm.cuh"
#include "dsv4/model/device_dspark.cuh"
#include "dsv4/model/device_model.cuh"
#include "dsv4/model/device_speculative.cuh"

namespace dsv4::apps {

namespace {
//! The device's properties; dsv4::error naming `who` when no CUDA device is visible.
cudaDeviceProp visible_device(const std::string& who) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    cudaGetLastError();  // clear the sticky "no device" error for any later CUDA call
    throw error(who + ": no CUDA device is visible (check the driver, or CUDA_VISIBLE_DEVICES)");
  }
  cudaDeviceProp prop{};
  DSV4_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  return prop;
}

//! A device_model of `limits.max_sequences` sequences; start() prefills one and draws its first
//! token, step() decodes the given ones together and draws on the device. Batched decode is not
//! batch-invariant (GEMM splits and tiles follow the batch; docs/decisions.md), so where two
//! logits nearly tie a sequence's token can differ from the one-sequence run's.
class device_engine final : public cli::sequence_engine {
 public:
  device_engine(const model::host_model<models::tiny>& m, const cli::engine_limits& el,
                const cudaDeviceProp& prop)
      : device_(std::string("CUDA backend on ") + prop.name),
        dm_(m, limits_of(el)),
        capacity_(el.max_sequences) {}
  std::string device() const override { return device_; }
  int capacity() const override { return capacity_; }
  started start(std::span<const std::int32_t> prompt, bool ced,
                const kernels::sampling::sampling_params& sp) override {
    const int slot = dm_.add_sequence();
    try {
      ced ? dm_.prefill_ced(slot, prompt) : dm_.prefill(slot, prompt);
      const kernels::sampling::row_request draw{sp, 0, std::uint64_t(dm_.length(slot))};
      return {slot, dm_.sample(std::span(&draw, 1))[0]};
    } catch (...) {
      dm_.release_sequence(slot);
      throw;
    }
  }
  std::vector<std::int32_t> step(std::span<const int> handles, std::span<const std::int32_t> ids,
                                 std::span<const kernels::sampling::sampling_params> sp) override {
    const std::vector<int> slots(handles.begin(), handles.end());
    dm_.decode_on_device(slots, ids);
    std::vector<kernels::sampling::row_request> draws(slots.size());
    for (std::size_t i = 0; i < slots.size(); ++i) draws[i] = {sp[i], 0, std::uint64_t(dm_.length(slots[i]))};
    return dm_.sample(draws);
  }
  void release(int handle) override { dm_.release_sequence(handle); }

 private:
  static model::device_model<models::tiny>::limits limits_of(const cli::engine_limits& el) {
    if (el.max_sequences < 1) throw error("serve --backend cuda: max_sequences must be >= 1");
    model::device_model<models::tiny>::limits lim;
    lim.max_seqs = el.max_sequences;
    lim.max_rows = int(std::max<long long>({el.max_prompt_tokens, el.max_sequences, 1}));
    lim.max_tokens = std::max(el.max_prompt_tokens + el.max_new_tokens, 1LL);
    return lim;
  }
  std::string device_;
  model::device_model<models::tiny> dm_;
  int capacity_;
};
}  // namespace

std::unique_ptr<cli::sequence_engine> cuda_engine(const model::host_model<models::tiny>& m,
                                                  const cli::engine_limits& limits) {
  const cudaDeviceProp prop = visible_device("serve --backend cuda");
  const long long total = limits.max_prompt_tokens + limits.max_new_tokens;
  if (total > models::tiny::dims.rope.max_position_embeddings)
    throw error("serve --backend cuda: --max-prompt-tokens plus --max-tokens (" + std::to_string(total) +
                ") exceed the model's " + std::to_string(models::tiny::dims.rope.max_position_embeddings) +
                " positions");
  return std::make_unique<device_engine>(m, limits, prop);
}

cli::generation cuda_generate(const model::host_model<models::tiny>& m, const cli::run_request& request) {
  const auto prompt = request.prompt;
  const long long n_new = request.n_new;
  const cudaDeviceProp prop = visible_device("run --backend cuda");
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
    if (request.on_token)  // the loop returns its tokens together: a stream gets them at the end
      for (const std::int32_t t : g.tokens) request.on_token(t);
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
