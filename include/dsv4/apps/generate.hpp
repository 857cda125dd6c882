#pragma once
//! \file
//! What a front end (the `dsv4` command line, the HTTP server) asks of a backend, and the host
//! reference backend itself: prefill a prompt (exact or CED), then draw tokens one decode step
//! at a time with the host sampler at the position counters. Other backends (CUDA: apps/dsv4)
//! plug in through `generate_fn`.

#include <chrono>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "dsv4/kernels/sampling/reference.hpp"
#include "dsv4/model/model_reference.hpp"
#include "dsv4/model/speculative_reference.hpp"
#include "dsv4/models/tiny.hpp"

namespace dsv4::cli {

//! What a backend returns: the drawn tokens, the prefill and decode wall times, its name.
struct generation {
  std::vector<std::int32_t> tokens;
  double prefill_s = 0, decode_s = 0;
  std::string device;  //!< printed: "CUDA backend on <device name>"
  bool cancelled = false;  //!< run_request::cancelled said stop: `tokens` holds what was drawn by then
  model::speculative_stats speculative{};  //!< run_request::dspark: how the drafts fared
};

//! What a front end asks of a backend besides the model.
struct run_request {
  std::span<const std::int32_t> prompt;
  long long n_new = 0;                        //!< tokens to generate
  kernels::sampling::sampling_params sampling;
  bool ced = false;                           //!< --prefill ced
  bool engram_host_tables = false;            //!< --engram-tables host: the tables stay in host memory
  bool wgmma_gemms = false;                   //!< --gemm wgmma: few-token GEMMs on wgmma (CUDA backend)
  //! --speculative dspark on the CUDA backend: draft with these weights (null: plain decoding).
  //! Prefill and generation are then one loop, timed as the decode.
  const model::dspark_weights* dspark = nullptr;
  //! Asked before each decode step (empty: never): true stops the generation there (a server's
  //! client went away; nobody would read the rest).
  std::function<bool()> cancelled;
};

//! True when the request says stop (before a decode step).
inline bool stop_requested(const run_request& r) { return r.cancelled && r.cancelled(); }

//! A backend: the loaded (and checked) host model and the request. Tokens are drawn with the
//! host sampler at the same counters as the host backend's (the position), so backends differ
//! only where their logits do. With request.engram_host_tables the model's Engram tables are read
//! in place from the checkpoint (model::engram_tables::mapped).
using generate_fn = std::function<generation(const model::host_model<models::tiny>&, const run_request&)>;

//! The backends an app links in besides the host reference (apps/dsv4: CUDA when built with it).
struct backends {
  generate_fn cuda;
};

//! What every backend's generation shares: `prefill()` timed as the prefill, then request.n_new
//! tokens, each from `draw()`, one decode step `step(token)` between draws, timed as the decode;
//! fewer tokens, with g.cancelled, if request.cancelled says stop before a step. Draws use the
//! sampler's counters (sequence 0, the position of the token drawn) on every backend, so backends
//! differ only where their logits do.
template <class Prefill, class Draw, class Step>
void run_generation_drawing(const run_request& r, generation& g, Prefill prefill, Draw draw, Step step) {
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  prefill();
  const auto t1 = clock::now();
  for (long long i = 0; i < r.n_new; ++i) {
    const std::int32_t next = draw();
    g.tokens.push_back(next);
    if (i + 1 == r.n_new) break;
    if (stop_requested(r)) {
      g.cancelled = true;
      break;
    }
    step(next);
  }
  const auto t2 = clock::now();
  g.prefill_s = std::chrono::duration<double>(t1 - t0).count();
  g.decode_s = std::chrono::duration<double>(t2 - t1).count();
}

//! run_generation_drawing with the host sampler: `prefill()` and `step(token)` return the logits
//! of the position to draw, drawn at the sequence's length `position()`.
template <class Prefill, class Position, class Step>
void run_generation(const run_request& r, generation& g, Prefill prefill, Position position, Step step) {
  std::vector<float> logits;
  run_generation_drawing(
      r, g, [&] { logits = prefill(); },
      [&] { return kernels::sampling::sample_reference(logits, r.sampling, 0, std::uint64_t(position())); },
      [&](std::int32_t next) { logits = step(next); });
}

//! The host reference backend: a fresh sequence, the prompt's prefill (exact or CED), then
//! request.n_new tokens, each later one after a decode step (fewer if request.cancelled says stop).
inline generation host_generate(const model::host_model<models::tiny>& m, const run_request& r) {
  generation g;
  g.device = "host reference backend";
  model::host_sequence seq;
  run_generation(
      r, g, [&] { return r.ced ? model::forward_ced(m, seq, r.prompt) : model::forward(m, seq, r.prompt); },
      [&] { return seq.length; }, [&](std::int32_t next) { return model::forward(m, seq, std::span<const std::int32_t>(&next, 1)); });
  return g;
}

}  // namespace dsv4::cli
