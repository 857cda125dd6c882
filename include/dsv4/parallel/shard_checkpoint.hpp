#pragma once
//! \file
//! Rank r's checkpoint under tensor parallelism of world size W: every tensor of the schema that
//! the rank holds (parallel/sharding.hpp decides which slice), cut from a full checkpoint into an
//! in-memory one with the same official names and the rank's local shapes. Rows split: the rows
//! [offset, offset + part); columns split: those columns of every row; experts: whole, on their
//! rank only; Engram tables: ceil(rows / W) rows, the tail padded with zero codes and scale 1.0
//! (UE8M0 code 127), as convert.py pads them. What a per-GPU loader reads, and what a converter
//! writes out per rank.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/io/checkpoint.hpp"
#include "dsv4/io/tensor_spec.hpp"
#include "dsv4/parallel/sharding.hpp"

namespace dsv4::parallel {

//! The bytes of rank `s`'s slice of a tensor stored as `v` (shape and dtype as stored).
inline std::vector<std::uint8_t> slice_bytes(const io::tensor_view& v, const tensor_shard& s) {
  const std::size_t elem = std::size_t(io::dtype_bytes(v.dtype));
  const auto* src = reinterpret_cast<const std::uint8_t*>(v.bytes.data());
  long long row_elems = 1;  // elements of one row (everything after dim 0)
  for (std::size_t d = 1; d < v.shape.size(); ++d) row_elems *= v.shape[d];
  const std::size_t row_bytes = std::size_t(row_elems) * elem;
  switch (s.kind) {
    case shard_kind::replicated:
    case shard_kind::expert:
      return {src, src + v.bytes.size()};
    case shard_kind::split_rows: {
      const std::size_t first = std::size_t(s.offset) * row_bytes, n = std::size_t(s.shape[0]) * row_bytes;
      if (first + n > v.bytes.size()) throw error("shard_checkpoint: tensor '" + s.name + "': the row slice runs past its bytes");
      return {src + first, src + first + n};
    }
    case shard_kind::split_cols: {
      if (v.shape.size() != 2) throw error("shard_checkpoint: tensor '" + s.name + "': a column split needs a matrix");
      const std::size_t rows = std::size_t(v.shape[0]), cols = std::size_t(v.shape[1]);
      const std::size_t first = std::size_t(s.offset), n = std::size_t(s.shape[1]);
      if (first + n > cols) throw error("shard_checkpoint: tensor '" + s.name + "': the column slice runs past its columns");
      std::vector<std::uint8_t> out(rows * n * elem);
      for (std::size_t r = 0; r < rows; ++r) std::memcpy(out.data() + r * n * elem, src + (r * cols + first) * elem, n * elem);
      return out;
    }
    case shard_kind::rows_padded: {
      const std::size_t real = std::size_t(s.shape[0] - s.pad_rows);
      // Padding: zero codes for the table, 1.0 (UE8M0 127) for its scales.
      std::vector<std::uint8_t> out(std::size_t(s.shape[0]) * row_bytes, v.dtype == io::st_dtype::F8_E8M0 ? std::uint8_t(127) : 0);
      const std::size_t first = std::size_t(s.offset) * row_bytes;
      if (real && first + real * row_bytes > v.bytes.size())
        throw error("shard_checkpoint: tensor '" + s.name + "': the row slice runs past its bytes");
      if (real) std::memcpy(out.data(), src + first, real * row_bytes);
      return out;
    }
  }
  throw error("shard_checkpoint: tensor '" + s.name + "': unknown shard kind");
}

//! Rank `rank`'s tensors of `schema` (world size `world`, model configuration `c`) from the full
//! checkpoint `ck`, in memory. Optional tensors the checkpoint lacks are skipped; every other
//! problem (a missing tensor, a split that does not divide) is an error naming the tensor.
inline io::checkpoint shard_checkpoint(io::checkpoint& ck, const std::vector<io::tensor_spec>& schema, int world, int rank,
                                       const models::model_config& c) {
  io::checkpoint out = io::checkpoint::in_memory();
  for (const auto& t : schema) {
    if (!ck.contains(t.name)) {
      if (t.optional) continue;
      throw error("shard_checkpoint: the checkpoint has no tensor '" + t.name + "'");
    }
    const io::tensor_view& v = ck.tensor(t.name);
    const tensor_shard s = shard_of(t, v.shape, world, rank, c);
    if (!s.held) continue;
    out.add(t.name, v.dtype, s.shape, slice_bytes(v, s));
  }
  return out;
}

}  // namespace dsv4::parallel
