#pragma once
//! \file
//! `dsv4 run --backend cuda`: the tiny model on model::device_model (cuda_backend.cu, compiled
//! only when the app is built with CUDA; main.cpp registers it).

#include "dsv4/cli.hpp"

namespace dsv4::apps {

//! Uploads the model, prefills the prompt (exact or CED) and decodes `n_new` tokens, sampling on
//! the host at the position counters the host backend uses. Throws dsv4::error when no CUDA
//! device is visible.
cli::generation cuda_generate(const model::host_model<models::tiny>& m, std::span<const std::int32_t> prompt, long long n_new,
                              const kernels::sampling::sampling_params& sp, bool ced);

}  // namespace dsv4::apps
