//! \file
//! The CUDA backend of `dsv4 run` (cuda_backend.hpp).

#include "cuda_backend.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>
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
//! logits nearly tie a sequence's token can differ from the one-sequence run's. With DSpark
//! weights a step is one speculative round of every sequence (model::speculative_batch: the
//! drafts in one drafter pass, the verification in one backbone call, the rollbacks in a second).
class device_engine final : public cli::sequence_engine {
 public:
  device_engine(const model::host_model<models::tiny>& m, const cli::engine_limits& el,
                const cudaDeviceProp& prop, const model::dspark_weights* drafter)
      : device_(std::string("CUDA backend on ") + prop.name + (drafter ? ", DSpark drafts on the GPU" : "")),
        dm_(m, limits_of(el, drafter)),
        capacity_(el.max_sequences),
        draft_block_(drafter ? drafter->block : 0),
        session_tokens_(el.sequence_tokens()) {
    // Each batch size its own graphs; with a drafter every step is a verification round (no
    // decode step), so none are made.
    if (el.decode_graphs && !drafter) {
      dm_.set_decode_graphs(true);
      device_ += ", decode graphs";
    }
    if (drafter) {
      dd_.emplace(dm_, *drafter, el.max_sequences);
      drafts_.emplace(dm_, *dd_);
    }
  }
  std::string device() const override { return device_; }
  int capacity() const override { return capacity_; }
  int draft_block() const override { return draft_block_; }
  started start(std::span<const std::int32_t> prompt, bool ced,
                const kernels::sampling::sampling_params& sp) override {
    const int slot = dm_.add_sequence();
    try {
      if (drafts_) return {slot, drafts_->start(slot, prompt, ced ? model::prompt_prefill::ced : model::prompt_prefill::exact, sp)};
      ced ? dm_.prefill_ced(slot, prompt) : dm_.prefill(slot, prompt);
      const kernels::sampling::row_request draw{sp, 0, std::uint64_t(dm_.length(slot))};
      return {slot, dm_.sample(std::span(&draw, 1))[0]};
    } catch (...) {
      if (drafts_) drafts_->forget(slot);
      dm_.release_sequence(slot);
      throw;
    }
  }
  std::vector<std::vector<std::int32_t>> step(std::span<const int> handles, std::span<const std::int32_t> ids,
                                              std::span<const kernels::sampling::sampling_params> sp,
                                              std::span<const long long> budget) override {
    if (drafts_) {  // (each sequence's input is the last token its rounds returned: ids[i])
      std::vector<model::speculative_batch<models::tiny>::request> round(handles.size());
      for (std::size_t i = 0; i < handles.size(); ++i) round[i] = {handles[i], budget[i]};
      return drafts_->round(round);
    }
    const std::vector<int> slots(handles.begin(), handles.end());
    dm_.decode_on_device(slots, ids);
    std::vector<kernels::sampling::row_request> draws(slots.size());
    for (std::size_t i = 0; i < slots.size(); ++i) draws[i] = {sp[i], 0, std::uint64_t(dm_.length(slots[i]))};
    const auto drawn = dm_.sample(draws);
    std::vector<std::vector<std::int32_t>> next(drawn.size());
    for (std::size_t i = 0; i < drawn.size(); ++i) next[i] = {drawn[i]};
    return next;
  }
  model::speculative_stats drafts(int handle) const override {
    return drafts_ ? drafts_->stats(handle) : model::speculative_stats{};
  }
  long long max_sequence_tokens() const override { return std::min(session_tokens_, dm_.max_tokens()); }
  bool can_resume() const override { return true; }
  //! A session's turn: append / append_ced (with drafts: speculative_batch::resume, which also
  //! gives the drafter the chunk's rows).
  std::int32_t resume(int handle, std::span<const std::int32_t> chunk, bool ced,
                      const kernels::sampling::sampling_params& sp) override {
    if (drafts_) return drafts_->resume(handle, chunk, ced ? model::prompt_prefill::ced : model::prompt_prefill::exact, sp);
    ced ? dm_.append_ced(handle, chunk) : dm_.append(handle, chunk);
    const kernels::sampling::row_request draw{sp, 0, std::uint64_t(dm_.length(handle))};
    return dm_.sample(std::span(&draw, 1))[0];
  }
  void release(int handle) override {
    if (drafts_) drafts_->forget(handle);
    dm_.release_sequence(handle);
  }

 private:
  static model::device_model<models::tiny>::limits limits_of(const cli::engine_limits& el, const model::dspark_weights* drafter) {
    if (el.max_sequences < 1) throw error("serve --backend cuda: max_sequences must be >= 1");
    model::device_model<models::tiny>::limits lim;
    lim.max_seqs = el.max_sequences;
    // A round of every sequence in one call: block + 1 rows each, every row's logits.
    const int round_rows = drafter ? el.max_sequences * (drafter->block + 1) : el.max_sequences;
    // A session's turn appends its prompt after the last token (one more row), and a CED turn
    // replays the decoder over the last window positions in one call.
    lim.max_rows = int(std::max<long long>(
        {el.max_prompt_tokens + 1, round_rows, models::tiny::dims.attn.window_size}));
    if (drafter) lim.logit_rows = round_rows;
    // Every request fits (prompt + new tokens), and a session's conversation up to its cap.
    lim.max_tokens = std::max({el.sequence_tokens(), el.max_prompt_tokens + el.max_new_tokens, 1LL});
    lim.ced_appends = true;  // (sessions' CED turns: the first decoder layer's input kept per sequence)
    return lim;
  }
  std::string device_;
  model::device_model<models::tiny> dm_;
  std::optional<model::device_dspark<models::tiny>> dd_;
  std::optional<model::speculative_batch<models::tiny>> drafts_;  // (after dd_: it refers to it)
  int capacity_;
  int draft_block_;  //!< the drafter's block (0: plain decoding)
  long long session_tokens_;  //!< engine_limits::sequence_tokens(): a session's cap
};
}  // namespace

std::unique_ptr<cli::sequence_engine> cuda_engine(const model::host_model<models::tiny>& m,
                                                  const cli::engine_limits& limits,
                                                  const model::dspark_weights* drafter) {
  const cudaDeviceProp prop = visible_device("serve --backend cuda");
  const long long total = limits.max_prompt_tokens + limits.max_new_tokens;
  if (total > models::tiny::dims.rope.max_position_embeddings)
    throw error("serve --backend cuda: --max-prompt-tokens plus --max-tokens (" + std::to_string(total) +
                ") exceed the model's " + std::to_string(models::tiny::dims.rope.max_position_embeddings) +
                " positions");
  if (limits.sequence_tokens() > models::tiny::dims.rope.max_position_embeddings)
    throw error("serve --backend cuda: --max-session-tokens (" + std::to_string(limits.sequence_tokens()) +
                ") exceeds the model's " + std::to_string(models::tiny::dims.rope.max_position_embeddings) + " positions");
  return std::make_unique<device_engine>(m, limits, prop, drafter);
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
  // (DSpark rounds are verifications, not decode steps: no graphs to make.)
  if (request.decode_graphs && !request.dspark) dm.set_decode_graphs(true);

  cli::generation g;
  g.device = std::string("CUDA backend on ") + prop.name +
             (request.engram_host_tables ? ", Engram tables in host memory" : "") +
             (request.wgmma_gemms ? ", wgmma GEMMs" : "") + (dm.decode_graphs() ? ", decode graphs" : "");
  if (request.dspark) {  // the prefill, then speculative rounds until n_new tokens (or a cancel)
    model::device_dspark<models::tiny> dd(dm, *request.dspark, lim.max_seqs);
    model::speculative_batch<models::tiny> drafts(dm, dd);
    g.device += ", DSpark drafts on the GPU";
    g.draft_block = request.dspark->block;
    cli::run_generation_rounds(
        request, g,
        [&] {
          return drafts.start(slot, prompt, request.ced ? model::prompt_prefill::ced : model::prompt_prefill::exact,
                              request.sampling);
        },
        [&](long long budget) {
          const model::speculative_batch<models::tiny>::request r{slot, budget};
          return drafts.round(std::span(&r, 1))[0];
        });
    g.speculative = drafts.stats(slot);
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
