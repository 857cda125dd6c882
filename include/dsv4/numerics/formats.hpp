#pragma once
//! \file
//! The formats V4.1 Flash uses, by role (spec §3, §4, §9, §15), and their packed layout.
//!
//! A packed vector of C channels is laid out as all element codes first (C * bits / 8 bytes;
//! for 4-bit codes, element 2i sits in the low nibble of byte i, as float4_e2m1fn_x2), then the
//! C / N scale bytes in block order. Keeping the codes contiguous lets a kernel load them with
//! wide aligned loads and fetch the few scale bytes separately.

#include "dsv4/numerics/block_format.hpp"

namespace dsv4::numerics {

//! Compressed main KV: E2M1 with one E4M3 scale per 16 channels (NVFP4 without its global scale).
using main_kv_format = block_scaled<e2m1, e4m3, 16>;
//! Indexer keys and queries: MXFP4 (E2M1, UE8M0 per 32).
using index_key_format = block_scaled<e2m1, ue8m0, 32>;
//! Local sliding-window KV and every FP8 GEMM activation: MXFP8 (E4M3, UE8M0 per 32).
using fp8_act_format = block_scaled<e4m3, ue8m0, 32>;
//! FP8 projection weights: E4M3 with one UE8M0 scale per 32 x 32 tile.
using fp8_weight_format = tile_scaled<e4m3, ue8m0, 32, 32>;
//! Routed-expert weights: E2M1 with one UE8M0 scale per 32 along K.
using fp4_expert_weight_format = block_scaled<e2m1, ue8m0, 32>;

//! Byte layout of one packed vector of `Channels` values in format `Format`.
template <class Format, int Channels>
struct packed_vector {
  static_assert(BlockFormat<Format>, "packed_vector<Format,C>: Format must be a numerics::block_scaled");
  static_assert(Channels > 0 && Channels % Format::block_size == 0,
                "packed_vector<Format,C>: C must be a positive multiple of the format's block size");
  using format = Format;
  static constexpr int channels = Channels;
  static constexpr int blocks = Channels / Format::block_size;
  static constexpr int code_bytes = blocks * Format::code_bytes_per_block;
  static constexpr int scale_bytes = blocks * Format::scale_bytes_per_block;
  static constexpr int scale_offset = code_bytes;
  static constexpr int bytes = code_bytes + scale_bytes;
};

//! Runtime form of packed_vector, for channel counts known only at run time.
template <class Format>
constexpr long long packed_bytes(long long channels) {
  return channels / Format::block_size * Format::bytes_per_block;
}

static_assert(packed_vector<main_kv_format, 512>::bytes == 288,
              "main KV entry: 512 x 4 bits + 32 E4M3 scales must be 288 bytes (spec §15)");
static_assert(packed_vector<index_key_format, 128>::bytes == 68,
              "index-key entry: 128 x 4 bits + 4 UE8M0 scales must be 68 bytes (spec §15)");
static_assert(packed_vector<fp8_act_format, 512>::bytes == 528,
              "local KV entry: 512 x 8 bits + 16 UE8M0 scales must be 528 bytes (spec §15)");

}  // namespace dsv4::numerics
