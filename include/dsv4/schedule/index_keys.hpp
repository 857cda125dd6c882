#pragma once
//! \file
//! Whose index keys an index producer scores against at a decode step (spec §7).
//!
//! dsv4 follows ownership: a layer scores against its KV owner's index keys, `(pos + 1) / ratio`
//! rows. The official reference differs at one point (spec §7, "upstream quirk"): its shared
//! `index_k` slot is only refreshed by a KV source whose compressor emitted a latent this step, so
//! a ratio-2 Full layer at an even decode position scores against whatever source refreshed the
//! slot last, in execution order wrapping into the previous forward: for V4.1, layer 20's
//! ratio-1 keys, truncated to its own row count. `index_key_policy::upstream_quirk` reproduces
//! that, for bit-level parity with the reference above position 1024; it is never the default.

#include "dsv4/schedule/model_schedule.hpp"

namespace dsv4::schedule {

enum class index_key_policy { follow_ownership, upstream_quirk };

struct index_key_source {
  int owner = -1;       //!< the KV owner whose index-key cache is read
  long long rows = 0;   //!< how many rows of it (the reading layer's own compress_len)
};

//! Keys read by index producer `layer` at the decode step of position `pos` (end_pos = pos + 1).
//! For upstream_quirk, the previous forward is assumed to have refreshed every source (a decode
//! step at pos - 1, or a prefill of at least `ratio` tokens).
template <class Schedule>
constexpr index_key_source decode_index_keys(int layer, long long pos, index_key_policy policy) {
  const int own = Schedule::kv_owner[std::size_t(layer)];
  const int ratio = Schedule::ratio(layer);
  const index_key_source owned{own, (pos + 1) / ratio};
  if (policy == index_key_policy::follow_ownership || own < 0) return owned;
  // Did Full layer j refresh the slot during the step at position q?
  const auto refreshed = [](int j, long long q) { return (q + 1) % Schedule::ratio(j) == 0; };
  // This step, layers up to and including `layer`, latest first...
  for (int j = layer; j >= 0; --j)
    if (Schedule::role(j) == attn_role::full && refreshed(j, pos)) return {j, owned.rows};
  // ... then the previous forward, from the last layer down.
  for (int j = Schedule::num_layers - 1; j > layer; --j)
    if (Schedule::role(j) == attn_role::full && refreshed(j, pos - 1)) return {j, owned.rows};
  return owned;
}

}  // namespace dsv4::schedule
