#pragma once
//! \file
//! What a front end (the `dsv4` command line, the HTTP server) asks of a backend, and the host
//! reference backend itself: prefill a prompt (exact or CED), then draw tokens one decode step
//! at a time with the host sampler at the position counters. Other backends (CUDA: apps/dsv4)
//! plug in through `generate_fn` (one generation at a time) and `engine_fn` (a `sequence_engine`
//! that holds many sequences and steps them together, for the server's batches: apps/batching.hpp).

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "dsv4/core/error.hpp"
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
  int draft_block = 0;  //!< the drafter's block when the backend drafted (0: plain decoding)
  //! run_request::session: the tokens the session holds after this answer (every prompt and
  //! generated token of its turns so far), 0 for a request without a session.
  long long session_tokens = 0;
};

//! What a front end asks of a backend besides the model.
struct run_request {
  std::span<const std::int32_t> prompt;
  long long n_new = 0;                        //!< tokens to generate
  kernels::sampling::sampling_params sampling;
  bool ced = false;                           //!< --prefill ced
  bool engram_host_tables = false;            //!< --engram-tables host: the tables stay in host memory
  bool wgmma_gemms = false;                   //!< --gemm wgmma: few-token GEMMs on wgmma (CUDA backend)
  bool decode_graphs = false;  //!< captured decode segments (CUDA backend; `run`'s default there)
  //! --speculative dspark: draft with these weights (null: plain decoding); the tokens are the
  //! same, the counts land in generation::speculative.
  const model::dspark_weights* dspark = nullptr;
  //! Asked before each decode step (empty: never): true stops the generation there (a server's
  //! client went away; nobody would read the rest).
  std::function<bool()> cancelled;
  //! Called with each token as soon as it is drawn, on the drawing thread (empty: never); it must
  //! not block (a batch's other sequences wait on it): a streaming server queues the token.
  std::function<void(std::int32_t)> on_token;
  //! A server session (apps/batching.hpp; empty: none): the sequence stays alive under this name
  //! after the answer, so a later turn appends to it instead of prefilling the conversation again.
  //! Without `continue_session` the session is new (its name must be free) and `prompt` is the
  //! whole prompt; with it, `prompt` is the next turn's tokens, appended after the session's
  //! (its last generated token first), exact or CED as `ced` says.
  std::string session;
  bool continue_session = false;
};

//! True when the request says stop (before a decode step).
inline bool stop_requested(const run_request& r) { return r.cancelled && r.cancelled(); }

//! A backend: the loaded (and checked) host model and the request. Tokens are drawn with the
//! host sampler at the same counters as the host backend's (the position), so backends differ
//! only where their logits do. With request.engram_host_tables the model's Engram tables are read
//! in place from the checkpoint (model::engram_tables::mapped).
using generate_fn = std::function<generation(const model::host_model<models::tiny>&, const run_request&)>;

//! Many sequences alive at once, stepped together: what a batching front end (apps/batching.hpp)
//! asks of a backend. A handle names a sequence from start() to release(). Every token is drawn
//! at the sampler's counters of a one-sequence generation (sequence 0, the token's position), so a
//! sequence's tokens depend on its own request only, and where the backend's logits do not depend
//! on the batch (the host reference), they are `run`'s tokens. An engine that drafts (DSpark
//! speculative decoding) returns several tokens from a step: still the tokens plain decoding draws.
class sequence_engine {
 public:
  virtual ~sequence_engine() = default;
  virtual std::string device() const = 0;
  //! Sequences alive at once.
  virtual int capacity() const = 0;
  //! The drafter's block when steps verify drafts (0: plain decoding, one token a step).
  virtual int draft_block() const { return 0; }
  //! A new sequence: the prefill of `prompt` (CED if `ced`) and the first token, drawn with `sampling`.
  struct started {
    int handle;
    std::int32_t token;
  };
  virtual started start(std::span<const std::int32_t> prompt, bool ced,
                        const kernels::sampling::sampling_params& sampling) = 0;
  //! One step of the sequences `handles` together, sequence i fed ids[i] (the last token it was
  //! given): the next tokens of each, drawn with sampling[i]. A plain engine returns one token per
  //! sequence; a drafting engine 1 .. draft_block() + 1, never more than budget[i] (>= 1: the
  //! tokens the sequence still wants).
  virtual std::vector<std::vector<std::int32_t>> step(std::span<const int> handles, std::span<const std::int32_t> ids,
                                                      std::span<const kernels::sampling::sampling_params> sampling,
                                                      std::span<const long long> budget) = 0;
  //! How the drafts of sequence `handle` fared so far (empty counts for a plain engine).
  virtual model::speculative_stats drafts(int /*handle*/) const { return {}; }
  //! Whether resume() works (a server session's later turns).
  virtual bool can_resume() const { return false; }
  //! The most tokens a sequence may hold (its prompts and generated tokens over every turn).
  virtual long long max_sequence_tokens() const = 0;
  //! Sequence `handle` takes `chunk` after the tokens it holds (appended in exact mode, or CED:
  //! the encoder over the chunk and the decoder's replay), and its next token is drawn with
  //! `sampling`: a session's next turn. `chunk` starts with the token the sequence's last step
  //! returned when that one was never fed.
  virtual std::int32_t resume(int /*handle*/, std::span<const std::int32_t> /*chunk*/, bool /*ced*/,
                              const kernels::sampling::sampling_params& /*sampling*/) {
    throw error(device() + " cannot continue a sequence (no session support)");
  }
  //! The sequence is done: its caches go back to the pool.
  virtual void release(int handle) = 0;
};

//! What an engine is built for: sequences alive at once, and the longest prompt and generation.
struct engine_limits {
  int max_sequences = 8;
  long long max_prompt_tokens = 4096, max_new_tokens = 4096;
  //! The most tokens one sequence holds over a session's turns (0: max_prompt_tokens + max_new_tokens).
  long long max_sequence_tokens = 0;
  long long sequence_tokens() const { return max_sequence_tokens > 0 ? max_sequence_tokens : max_prompt_tokens + max_new_tokens; }
  //! Decode steps through captured graphs where the backend has them (run_request::decode_graphs).
  bool decode_graphs = false;
};
//! The model, the limits, and the drafter's weights (null: plain decoding), which must outlive the engine.
using engine_fn = std::function<std::unique_ptr<sequence_engine>(
    const model::host_model<models::tiny>&, const engine_limits&, const model::dspark_weights*)>;

//! The backends an app links in besides the host reference (apps/dsv4: CUDA when built with it).
struct backends {
  generate_fn cuda;
  engine_fn cuda_engine;  //!< the CUDA backend as a sequence_engine (`dsv4 serve --backend cuda`)
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
    if (r.on_token) r.on_token(next);
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

//! The speculative form of run_generation_drawing: `start()` (the prefill) returns the first
//! token, timed as the prefill; then rounds, each `round(budget)` returning 1 .. budget tokens
//! (budget: the tokens still wanted), request.cancelled asked before each round, timed as the
//! decode.
template <class Start, class Round>
void run_generation_rounds(const run_request& r, generation& g, Start start, Round round) {
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  const std::int32_t first = start();
  const auto t1 = clock::now();
  auto take = [&](std::int32_t t) {
    g.tokens.push_back(t);
    if (r.on_token) r.on_token(t);
  };
  if (r.n_new > 0) take(first);
  while ((long long)g.tokens.size() < r.n_new) {
    if (stop_requested(r)) {
      g.cancelled = true;
      break;
    }
    for (const std::int32_t t : round(r.n_new - (long long)g.tokens.size())) take(t);
  }
  g.prefill_s = std::chrono::duration<double>(t1 - t0).count();
  g.decode_s = std::chrono::duration<double>(clock::now() - t1).count();
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
//! With request.dspark, the later tokens come from speculative rounds (model::speculative_decoder:
//! the same tokens, drafts verified position by position), request.cancelled asked before each.
inline generation host_generate(const model::host_model<models::tiny>& m, const run_request& r) {
  generation g;
  g.device = "host reference backend";
  model::host_sequence seq;
  if (r.dspark) {
    g.device += ", DSpark drafts";
    g.draft_block = r.dspark->block;
    model::speculative_decoder<models::tiny> d(m, *r.dspark, seq, r.sampling);
    run_generation_rounds(
        r, g, [&] { return d.start(r.prompt, r.ced ? model::prompt_prefill::ced : model::prompt_prefill::exact); },
        [&](long long budget) { return d.round(budget); });
    g.speculative = d.stats();
    return g;
  }
  run_generation(
      r, g, [&] { return r.ced ? model::forward_ced(m, seq, r.prompt) : model::forward(m, seq, r.prompt); },
      [&] { return seq.length; }, [&](std::int32_t next) { return model::forward(m, seq, std::span<const std::int32_t>(&next, 1)); });
  return g;
}

}  // namespace dsv4::cli
