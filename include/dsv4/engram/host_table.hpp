#pragma once
//! \file
//! Engram tables that stay in host memory (issue 5, item 5; spec §10). V4.1's two tables hold
//! ~384 million rows of 256 E4M3 codes each (~100 GB a table), more than fits beside the model on
//! one GPU. A row's address depends only on token ids, known before the forward starts, so the
//! host gathers the rows a call needs into a compact pack and ships that alone: rows x (head_dim
//! codes + head_dim / 32 scales) bytes, 6.3 KB per token per V4.1 module.
//!
//! The pack is laid out like a table of its own (codes [n, head_dim], scales [n, head_dim / 32])
//! and each (token, column) gets the index of its row in the pack, so the device gather reads it
//! with the same kernel and the same bytes as a whole table in device memory: the results are the
//! device path's, bit for bit. An id outside the table maps to -1, which the device gather turns
//! into NaN, as it does for a table in device memory.
//!
//! This file is the host half (no CUDA): host_fetch.cuh moves the pack to the device on a side
//! stream.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "dsv4/core/error.hpp"

namespace dsv4::engram {

//! One module's embedding table in host memory (a loaded model's vectors, a memory-mapped file).
struct host_table {
  const std::uint8_t* embed = nullptr;        //!< [rows, head_dim] E4M3
  const std::uint8_t* embed_scale = nullptr;  //!< [rows, head_dim / 32] UE8M0
  long long rows = 0;
  int head_dim = 0;

  std::size_t row_bytes() const { return std::size_t(head_dim) + std::size_t(head_dim / 32); }
};

//! Copies the rows named by `ids` (one per (token, column), n of them) into `codes` [n, head_dim]
//! and `scales` [n, head_dim / 32], in order, and writes the index of each row in the pack to
//! `packed_ids` (its position, or -1 for an id outside the table: that row is left as zeros).
//! Large packs are split over up to `threads` threads (the rows are random reads of a table far
//! larger than any cache, so the copy is latency-bound and spreads well).
inline void gather_rows(const host_table& t, std::span<const std::int64_t> ids, std::uint8_t* codes, std::uint8_t* scales,
                        std::int64_t* packed_ids, unsigned threads = 1) {
  if (!t.embed || !t.embed_scale || t.rows <= 0 || t.head_dim <= 0 || t.head_dim % 32)
    throw error("engram host table: need embed and scale pointers, rows > 0 and head_dim a positive multiple of 32");
  if (!ids.empty() && (!codes || !scales || !packed_ids)) throw error("engram host table: null pack pointer");
  const std::size_t hd = std::size_t(t.head_dim), sd = hd / 32, n = ids.size();
  auto copy_range = [&](std::size_t first, std::size_t last) {
    for (std::size_t i = first; i < last; ++i) {
      const std::int64_t row = ids[i];
      if (row < 0 || row >= t.rows) {
        packed_ids[i] = -1;
        std::memset(codes + i * hd, 0, hd);
        std::memset(scales + i * sd, 0, sd);
        continue;
      }
      packed_ids[i] = std::int64_t(i);
      std::memcpy(codes + i * hd, t.embed + std::size_t(row) * hd, hd);
      std::memcpy(scales + i * sd, t.embed_scale + std::size_t(row) * sd, sd);
    }
  };
  constexpr std::size_t rows_per_thread = 4096;  // below this a thread's start-up outweighs the copy
  const std::size_t parts = std::min<std::size_t>(std::max(1u, threads), (n + rows_per_thread - 1) / rows_per_thread);
  if (parts <= 1) return copy_range(0, n);
  std::vector<std::thread> pool;
  const std::size_t step = (n + parts - 1) / parts;
  std::size_t p = 1;
  try {
    for (; p < parts; ++p) pool.emplace_back(copy_range, p * step, std::min(n, (p + 1) * step));
  } catch (...) {  // no more threads to be had: this one copies the parts left
    for (; p < parts; ++p) copy_range(p * step, std::min(n, (p + 1) * step));
  }
  copy_range(0, std::min(n, step));
  for (auto& th : pool) th.join();
}

}  // namespace dsv4::engram
