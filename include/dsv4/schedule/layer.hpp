#pragma once
//! \file
//! One layer of the backbone, as a structural value usable as a template argument (spec §2).
//!
//! Every layer has local sliding-window attention and an FFN; the role says what it does with
//! global (compressed) memory, following CSA2:
//! - local:   no global memory at all (layers 0-1 of V4.1, ratio 0);
//! - full:    owns a compressed global KV cache and its index keys, and selects its own top-k;
//! - reuse:   reads the latest owner's cache through the latest index producer's top-k;
//! - reindex: reads the latest owner's cache but selects its own top-k inside that owner's
//!            candidate pool.

#include <cstdint>

namespace dsv4::schedule {

enum class attn_role : std::uint8_t { local, full, reuse, reindex };

//! Compression ratios the compressor supports (spec §6): 1 (one entry per token) and 2 (a
//! gated softmax over each pair of tokens). Ratio 0 means "no global memory" (local layers).
inline constexpr int supported_ratios[] = {1, 2};

constexpr bool is_supported_ratio(int r) {
  for (int s : supported_ratios)
    if (s == r) return true;
  return false;
}

struct layer {
  attn_role role = attn_role::local;
  int ratio = 0;

  constexpr bool owns_global_kv() const { return role == attn_role::full; }
  constexpr bool produces_topk() const { return role == attn_role::full || role == attn_role::reindex; }
  constexpr bool reads_global_kv() const { return role != attn_role::local; }
  friend constexpr bool operator==(layer, layer) = default;
};

//! Local-only sliding-window layer.
inline constexpr layer swa{attn_role::local, 0};
//! Full: KV owner + index producer at compression ratio R.
template <int R>
inline constexpr layer full{attn_role::full, R};
//! Reuse: the latest owner's cache and the latest index producer's top-k, at ratio R.
template <int R>
inline constexpr layer reuse{attn_role::reuse, R};
//! Reindex: the latest owner's cache, own top-k chosen within that owner's candidate pool.
template <int R>
inline constexpr layer reindex{attn_role::reindex, R};

//! `count` consecutive layers of the same kind (the schedule is run-length encoded).
struct run {
  int count = 0;
  layer kind{};
};

constexpr const char* role_name(attn_role r) {
  switch (r) {
    case attn_role::local: return "SWA";
    case attn_role::full: return "Full";
    case attn_role::reuse: return "Reuse";
    case attn_role::reindex: return "Reindex";
  }
  return "?";
}

}  // namespace dsv4::schedule
