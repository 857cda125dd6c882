#pragma once
//! \file
//! Layer-token work of a prefill (issue 6, the article's CED work model): how many (layer, token)
//! pairs each mode computes for a prompt of N tokens on a schedule with L layers, E of them in
//! the causal encoder, and a decoder replay window W.
//!   exact: every layer over every token                        N L
//!   ced:   encoder over every token, decoder over the last W    N E + min(N, W) (L - E)
//! With E = L/2 the ced figure is the article's N L/2 + W L/2 (about 0.500064 of exact at
//! N = 1,000,000 and W = 128). An appended chunk of C tokens after a history of H costs C L
//! (exact) or C E + min(H + C, W) (L - E) (ced: encoder over the chunk, decoder replay over the
//! last W positions).

#include <algorithm>

namespace dsv4::schedule {

enum class prefill_mode { exact, ced };

struct prefill_work {
  long long encoder_layer_tokens = 0, decoder_layer_tokens = 0;
  constexpr long long total() const { return encoder_layer_tokens + decoder_layer_tokens; }
};

//! Work of prefilling `chunk` new tokens after `history` tokens already in the caches.
template <class Schedule>
constexpr prefill_work prefill_layer_tokens(long long chunk, prefill_mode mode, int replay_window, long long history = 0) {
  constexpr long long enc = Schedule::encoder_layers, dec = Schedule::num_layers - Schedule::encoder_layers;
  if (chunk <= 0) return {};
  if (mode == prefill_mode::exact) return {chunk * enc, chunk * dec};
  return {chunk * enc, std::min<long long>(history + chunk, replay_window) * dec};
}

}  // namespace dsv4::schedule
