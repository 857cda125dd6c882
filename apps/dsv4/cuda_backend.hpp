#pragma once
//! \file
//! `dsv4 run --backend cuda`: the tiny model on model::device_model (cuda_backend.cu, compiled
//! only when the app is built with CUDA; main.cpp registers it).

#include "dsv4/apps/generate.hpp"

namespace dsv4::apps {

//! Uploads the model (its Engram tables too, unless request.engram_host_tables keeps them in host
//! memory), prefills the prompt (exact or CED) and decodes request.n_new tokens, sampling on the
//! host at the position counters the host backend uses. Throws dsv4::error when no CUDA device
//! is visible.
cli::generation cuda_generate(const model::host_model<models::tiny>& m, const cli::run_request& request);

//! `dsv4 serve --backend cuda`: the model uploaded once, `limits.max_sequences` sequences decoded
//! together (model::device_model's batched decode), tokens drawn on the device; with `drafter`
//! (which must outlive the engine) each step is a speculative round of every sequence. Throws
//! dsv4::error when no CUDA device is visible.
std::unique_ptr<cli::sequence_engine> cuda_engine(const model::host_model<models::tiny>& m,
                                                  const cli::engine_limits& limits,
                                                  const model::dspark_weights* drafter = nullptr);

}  // namespace dsv4::apps
