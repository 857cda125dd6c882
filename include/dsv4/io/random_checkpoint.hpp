#pragma once
//! \file
//! Writes a checkpoint with random weights for a schema (tests, smoke runs, users trying a
//! variant before weights exist): every tensor in its first accepted dtype and its shape, in
//! shards of at most `shard_bytes` plus model.safetensors.index.json. Values are finite and of
//! moderate size: FP8 codes avoid NaN, UE8M0 scales sit near 2^-6, bf16 / fp32 values are
//! N(0, 0.02^2), FP4 bytes are any pair of codes. Tensors whose shape the schema leaves open
//! (wo_a.scale) are written with the 32 x 32 tile shape of their weight.

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/io/safetensors_writer.hpp"
#include "dsv4/io/tensor_spec.hpp"
#include "dsv4/numerics/bf16.hpp"

namespace dsv4::io {

namespace detail {
inline std::vector<std::uint8_t> random_bytes(std::mt19937_64& rng, st_dtype d, long long numel) {
  std::vector<std::uint8_t> b(std::size_t(numel) * std::size_t(dtype_bytes(d)));
  std::normal_distribution<float> n(0.0f, 0.02f);
  switch (d) {
    case st_dtype::F8_E4M3:
      for (auto& x : b) x = std::uint8_t(rng() % 0x7E) | std::uint8_t((rng() & 1) << 7);  // no NaN codes
      break;
    case st_dtype::F8_E8M0:
      for (auto& x : b) x = std::uint8_t(121 + rng() % 3);  // 2^-6 .. 2^-4
      break;
    case st_dtype::BF16:
      for (std::size_t i = 0; i < b.size(); i += 2) {
        const std::uint16_t v = numerics::bf16::from_float(n(rng)).bits;
        std::memcpy(&b[i], &v, 2);
      }
      break;
    case st_dtype::F32:
      for (std::size_t i = 0; i < b.size(); i += 4) {
        const float v = n(rng);
        std::memcpy(&b[i], &v, 4);
      }
      break;
    default:
      for (auto& x : b) x = std::uint8_t(rng());
  }
  return b;
}
}  // namespace detail

//! The shape each tensor of `schema` is written with: its own, or, where the schema leaves it open
//! (a scale whose tiling convert.py does not pin), 32 x 32 tiles of the tensor written before it.
inline std::vector<std::vector<long long>> written_shapes(const std::vector<tensor_spec>& schema) {
  std::vector<std::vector<long long>> shapes;
  shapes.reserve(schema.size());
  for (const auto& t : schema) {
    if (!t.shape.empty()) {
      shapes.push_back(t.shape);
      continue;
    }
    if (shapes.empty() || shapes.back().size() != 2)
      throw error("write_random_checkpoint: cannot infer the shape of '" + t.name + "'");
    shapes.push_back({(shapes.back()[0] + 31) / 32, (shapes.back()[1] + 31) / 32});
  }
  return shapes;
}

//! Bytes the checkpoint of `schema` takes, each tensor in its first accepted dtype.
inline unsigned long long checkpoint_bytes(const std::vector<tensor_spec>& schema) {
  const auto shapes = written_shapes(schema);
  unsigned long long total = 0;
  for (std::size_t i = 0; i < schema.size(); ++i) {
    unsigned long long n = schema[i].dtypes.empty() ? 0 : unsigned(dtype_bytes(schema[i].dtypes.front()));
    for (long long s : shapes[i]) n *= static_cast<unsigned long long>(s);
    total += n;
  }
  return total;
}

inline void write_random_checkpoint(const std::vector<tensor_spec>& schema, const std::string& folder,
                                    std::size_t shard_bytes, std::uint64_t seed) {
  namespace fs = std::filesystem;
  fs::create_directories(folder);
  // Refuse up front rather than fill the disk halfway (a V4.1 Flash checkpoint is ~510 GB).
  const unsigned long long need = checkpoint_bytes(schema);
  const unsigned long long free_bytes = fs::space(folder).available;
  if (need > free_bytes)
    throw error(folder + ": a random checkpoint of this model needs " + std::to_string(need >> 20) + " MiB but only " +
                std::to_string(free_bytes >> 20) + " MiB are free");
  std::mt19937_64 rng(seed);
  std::vector<std::pair<std::string, std::string>> weight_map;
  std::vector<std::string> shard_files;
  safetensors_writer shard;
  std::vector<std::string> shard_names;
  const auto shapes = written_shapes(schema);
  auto flush = [&] {
    if (shard.empty()) return;
    const std::string name = "model-" + std::to_string(shard_files.size() + 1) + ".safetensors";
    shard.write((fs::path(folder) / name).string());
    for (const auto& t : shard_names) weight_map.emplace_back(t, name);
    shard_files.push_back(name);
    shard = safetensors_writer{};
    shard_names.clear();
  };
  for (std::size_t i = 0; i < schema.size(); ++i) {
    const tensor_spec& t = schema[i];
    if (t.dtypes.empty()) throw error("write_random_checkpoint: tensor '" + t.name + "' accepts no dtype");
    const std::vector<long long>& shape = shapes[i];
    long long numel = 1;
    for (long long s : shape) numel *= s;
    auto bytes = detail::random_bytes(rng, t.dtypes.front(), numel);
    if (shard.bytes() + bytes.size() > shard_bytes) flush();
    shard.add(t.name, t.dtypes.front(), shape, std::move(bytes));
    shard_names.push_back(t.name);
  }
  flush();
  std::ofstream idx(fs::path(folder) / "model.safetensors.index.json");
  idx << "{\"metadata\": {\"writer\": \"dsv4 random checkpoint\"}, \"weight_map\": {";
  for (std::size_t i = 0; i < weight_map.size(); ++i)
    idx << (i ? ", " : "") << "\"" << weight_map[i].first << "\": \"" << weight_map[i].second << "\"";
  idx << "}}\n";
  if (!idx) throw error(folder + ": cannot write model.safetensors.index.json");
}

}  // namespace dsv4::io
