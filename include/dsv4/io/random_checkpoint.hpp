#pragma once
//! \file
//! Writes a checkpoint with random weights for a schema (tests, smoke runs, users trying a
//! variant before weights exist): every tensor in its first accepted dtype and its shape, in
//! shards of at most `shard_bytes` plus model.safetensors.index.json. Tensors whose shape the
//! schema leaves open (wo_a.scale) are written with the 32 x 32 tile shape of their weight.
//!
//! Two kinds of values (`random_init`):
//! - `codes` (the default): any finite code. FP8 codes avoid NaN, UE8M0 scales sit near 2^-6,
//!   bf16 / fp32 values are N(0, 0.02^2), FP4 bytes are any pair of codes. Exercises every code
//!   path, but the stack it builds amplifies a last-bit difference in one layer to percents of
//!   the logits a few layers later (docs/parity.md).
//! - `scaled`: weights with the statistics of a trained model, so that rounding differences stay
//!   at rounding level through the 40 layers (the parity tests' checkpoints). A linear's weight
//!   [N, K] is gain x N(0, 1) / sqrt(K), FP8 ones quantized per 32 x 32 tile with power-of-two
//!   scales (as the official quantizer does); FP4 expert codes are uniform with a per-32 scale
//!   near gain / (3.2 sqrt(K)); RMSNorm weights are mean x (1 + 0.1 N(0, 1)); the embeddings
//!   0.12 N(0, 1); Engram tables N(0, 1) quantized per row block; other vectors 0.5 N(0, 1).
//!   Gains and norm means are the released checkpoint's, as measured by Tenstorrent's reference
//!   tests (tt-metal models/demos/deepseek_v3_d_p/reference/deepseek_v41/testing.py).
//!   Normal draws are Irwin-Hall sums of 12 uniforms from mt19937_64 (exact arithmetic, no libm,
//!   no std::normal_distribution), so the values are the same with any compiler and library.
//!   Tensors of at least `parallel_elements` values (none in the tiny model; V4.1's projections,
//!   experts and tables) are drawn in chunks of `chunk_elements`, each chunk from its own
//!   xoshiro256** generator (6x cheaper than mt19937_64 here) seeded from one draw of the main
//!   one and the chunk's index, on every core: the values depend on the seed only, not on the
//!   number of threads (a 25 GB V4.1-width checkpoint took over 7 minutes on one core of the
//!   H200's host, 204 s on its 16 with mt19937_64 chunks).

#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/io/checkpoint.hpp"
#include "dsv4/io/safetensors_writer.hpp"
#include "dsv4/io/tensor_spec.hpp"
#include "dsv4/numerics/bf16.hpp"
#include "dsv4/numerics/formats.hpp"
#include "dsv4/numerics/minifloat.hpp"

namespace dsv4::io {

//! The values a random checkpoint holds (see the file comment).
enum class random_init { codes, scaled };

inline random_init parse_random_init(const std::string& name) {
  if (name == "codes") return random_init::codes;
  if (name == "scaled") return random_init::scaled;
  throw error("unknown random initialisation '" + name + "' (codes or scaled)");
}

namespace detail {
constexpr std::size_t parallel_elements = std::size_t(1) << 22;
constexpr std::size_t chunk_elements = std::size_t(1) << 20;

//! splitmix64: the seed of chunk c from the tensor's draw (well-mixed, so neighbouring chunks'
//! generators start far apart).
inline std::uint64_t chunk_seed(std::uint64_t base, std::uint64_t c) {
  std::uint64_t z = base + (c + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

//! xoshiro256** (Blackman and Vigna), seeded through splitmix64: the chunks' generator.
class xoshiro256ss {
 public:
  using result_type = std::uint64_t;
  explicit xoshiro256ss(std::uint64_t seed) {
    for (int i = 0; i < 4; ++i) s_[i] = chunk_seed(seed, std::uint64_t(i));
  }
  static constexpr result_type min() { return 0; }
  static constexpr result_type max() { return ~result_type(0); }
  result_type operator()() {
    const std::uint64_t result = rotl(s_[1] * 5, 7) * 9, t = s_[1] << 17;
    s_[2] ^= s_[0], s_[3] ^= s_[1], s_[1] ^= s_[2], s_[0] ^= s_[3], s_[2] ^= t, s_[3] = rotl(s_[3], 45);
    return result;
  }

 private:
  static std::uint64_t rotl(std::uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  std::uint64_t s_[4];
};

//! Calls fill(generator, begin, end) over [0, n): below `parallel_elements` once, with `rng`
//! itself (the values small tensors always had); above, per chunk with its own generator, the
//! chunks spread over the cores. `fill` takes the generator as `auto&`.
template <class Fill>
void fill_chunks(std::mt19937_64& rng, std::size_t n, Fill&& fill) {
  if (n < parallel_elements) {
    fill(rng, std::size_t(0), n);
    return;
  }
  const std::uint64_t base = rng();
  const std::size_t chunks = (n + chunk_elements - 1) / chunk_elements;
  const std::size_t threads = std::max<std::size_t>(1, std::min<std::size_t>(std::thread::hardware_concurrency(), chunks));
  auto work = [&](std::size_t t) {
    for (std::size_t c = t; c < chunks; c += threads) {
      xoshiro256ss g(chunk_seed(base, c));
      fill(g, c * chunk_elements, std::min(n, (c + 1) * chunk_elements));
    }
  };
  std::vector<std::thread> pool;
  for (std::size_t t = 1; t < threads; ++t) pool.emplace_back(work, t);
  work(0);
  for (auto& th : pool) th.join();
}

//! Calls f(i) for i in [0, n) on every core (f writes disjoint data; the order does not matter).
template <class F>
void parallel_for(std::size_t n, F&& f) {
  const std::size_t threads = std::max<std::size_t>(1, std::min<std::size_t>(std::thread::hardware_concurrency(), n / 64 + 1));
  auto work = [&](std::size_t t) {
    for (std::size_t i = t; i < n; i += threads) f(i);
  };
  std::vector<std::thread> pool;
  for (std::size_t t = 1; t < threads; ++t) pool.emplace_back(work, t);
  work(0);
  for (auto& th : pool) th.join();
}

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
//! Approximately N(0, 1): the sum of 12 uniforms on [0, 1) with 24-bit resolution, minus 6.
//! Every step is exact in double, so the value depends on the generator's output only.
template <class Generator>
double irwin_hall_normal(Generator& rng) {
  double sum = 0;
  for (int i = 0; i < 6; ++i) {
    const std::uint64_t r = rng();
    sum += double(r >> 40) * 0x1p-24 + double((r >> 8) & 0xffffff) * 0x1p-24;
  }
  return sum - 6.0;
}

//! The last name component of a tensor's owner module ("layers.0.attn.wq_a.weight" -> "wq_a").
inline std::string owner_leaf(const std::string& name) {
  std::string owner = name.substr(0, name.rfind('.'));
  return owner.substr(owner.rfind('.') + 1);
}
inline bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}
//! Weight std multiplier of a linear by its name (trained V4.1 statistics).
inline double projection_gain(const std::string& leaf) {
  static const std::map<std::string, double> gains = {{"wq_a", 1.6}, {"wq_b", 0.95}, {"wkv", 1.8}, {"wo_a", 1.6}, {"wo_b", 1.9},
                                                      {"gate", 2.9}, {"w1", 1.5},    {"w3", 1.5},   {"w2", 1.05}};
  const auto it = gains.find(leaf);
  return it == gains.end() ? 1.0 : it->second;
}
//! Mean of an RMSNorm weight by its owner (trained V4.1 statistics); 1 for the others.
inline double norm_mean(const std::string& name) {
  const std::string owner = name.substr(0, name.rfind('.'));
  static const std::pair<const char*, double> means[] = {{"attn_norm", 0.025}, {"ffn_norm", 0.2}, {"q_norm", 0.97},
                                                         {"kv_norm", 0.4},     {"compressor.norm", 0.6}, {"k_norm", 0.5}};
  for (const auto& [key, mean] : means)
    if (owner == key || ends_with(owner, std::string(".") + key)) return mean;
  return 1.0;
}
//! ceil(log2(x)) for x > 0, exactly (frexp), as the quantizers' power-of-two scale rounding.
inline int ceil_log2(double x) {
  int e = 0;
  const double m = std::frexp(x, &e);  // x = m 2^e, m in [0.5, 1)
  return m == 0.5 ? e - 1 : e;
}
//! round(log2(x)) for x > 0, exactly: log2(m) >= -1/2 iff m >= sqrt(1/2).
inline int round_log2(double x) {
  int e = 0;
  const double m = std::frexp(x, &e);
  return m >= std::sqrt(0.5) ? e : e - 1;
}
//! The tile edge a scale tensor of `scale_extent` entries implies for a weight extent.
inline long long tile_edge(long long extent, long long scale_extent) {
  for (long long t : {32ll, 1ll, 128ll})
    if ((extent + t - 1) / t == scale_extent) return t;
  throw error("write_random_checkpoint: a scale extent of " + std::to_string(scale_extent) + " tiles no weight extent of " +
              std::to_string(extent));
}

//! `scaled` values of tensor i (and, for a quantized weight, of its scale at i + 1, returned in
//! `scale_bytes`).
inline std::vector<std::uint8_t> scaled_bytes(std::mt19937_64& rng, const std::vector<tensor_spec>& schema,
                                              const std::vector<std::vector<long long>>& shapes, std::size_t i,
                                              std::vector<std::uint8_t>& scale_bytes) {
  const tensor_spec& t = schema[i];
  const st_dtype d = t.dtypes.front();
  const std::vector<long long>& shape = shapes[i];
  long long numel = 1;
  for (long long x : shape) numel *= x;
  const bool has_scale = i + 1 < schema.size() && schema[i + 1].dtypes.front() == st_dtype::F8_E8M0 &&
                         schema[i + 1].name == t.name.substr(0, t.name.rfind('.')) + ".scale" && shape.size() == 2 &&
                         shapes[i + 1].size() == 2;
  const std::string leaf = owner_leaf(t.name);
  if (d == st_dtype::F8_E4M3 && has_scale) {
    const long long n = shape[0], k = shape[1], tr = tile_edge(n, shapes[i + 1][0]), tc = tile_edge(k, shapes[i + 1][1]);
    const bool engram_table = t.name.find(".engram.embed.") != std::string::npos;
    const double stdev = engram_table ? 1.0 : projection_gain(leaf) / std::sqrt(double(k));
    std::vector<float> w(std::size_t(n * k));
    fill_chunks(rng, w.size(), [&](auto& g, std::size_t b, std::size_t e) {
      for (std::size_t j = b; j < e; ++j) w[j] = float(irwin_hall_normal(g) * stdev);
    });
    std::vector<std::uint8_t> codes(w.size());
    const long long sr = shapes[i + 1][0], sc = shapes[i + 1][1];
    scale_bytes.assign(std::size_t(sr * sc), 0);
    parallel_for(std::size_t(sr), [&](std::size_t row_block) {
      const long long br = static_cast<long long>(row_block);
      for (long long bc = 0; bc < sc; ++bc) {
        float amax = 1e-4f;
        for (long long r = br * tr; r < std::min(n, (br + 1) * tr); ++r)
          for (long long c = bc * tc; c < std::min(k, (bc + 1) * tc); ++c) amax = std::max(amax, std::fabs(w[std::size_t(r * k + c)]));
        const int e = ceil_log2(double(amax) / 448.0);
        scale_bytes[std::size_t(br * sc + bc)] = std::uint8_t(e + 127);
        for (long long r = br * tr; r < std::min(n, (br + 1) * tr); ++r)
          for (long long c = bc * tc; c < std::min(k, (bc + 1) * tc); ++c)
            codes[std::size_t(r * k + c)] = numerics::encode<numerics::e4m3>(std::ldexp(w[std::size_t(r * k + c)], -e));
      }
    });
    return codes;
  }
  if (d == st_dtype::I8 && has_scale) {  // FP4 expert weight [N, K/2], two codes a byte; scale [N, K/32]
    const double k = double(shape[1]) * 2;
    std::vector<std::uint8_t> codes(static_cast<std::size_t>(numel));
    fill_chunks(rng, codes.size(), [&](auto& g, std::size_t b, std::size_t e) {
      for (std::size_t j = b; j < e; ++j) codes[j] = std::uint8_t(g());  // any pair of FP4 codes
    });
    const int e = round_log2(projection_gain(leaf) / std::sqrt(k) / 3.2);
    scale_bytes.assign(std::size_t(shapes[i + 1][0] * shapes[i + 1][1]), 0);
    for (auto& b : scale_bytes) b = std::uint8_t(127 + e + int(rng() % 3) - 1);
    return codes;
  }
  if (d != st_dtype::BF16 && d != st_dtype::F32) return random_bytes(rng, d, numel);
  std::vector<float> v(static_cast<std::size_t>(numel));
  const bool norm = ends_with(t.name, ".weight") && leaf.find("norm") != std::string::npos;
  // Norm weights: mean (1 + 0.1 N(0, 1)); the others: stdev N(0, 1) (the same expressions as
  // always, so the tiny model's checkpoints keep their values bit for bit).
  const double mean = norm ? norm_mean(t.name) : 0.0;
  const double stdev = t.name == "embed.weight" || ends_with(t.name, "markov_head.embed.weight") ? 0.12
                       : shape.size() >= 2 ? projection_gain(leaf) / std::sqrt(double(shape.back()))
                                           : 0.5;
  fill_chunks(rng, v.size(), [&](auto& g, std::size_t b, std::size_t e) {
    if (norm)
      for (std::size_t j = b; j < e; ++j) v[j] = float(mean * (1.0 + 0.1 * irwin_hall_normal(g)));
    else
      for (std::size_t j = b; j < e; ++j) v[j] = float(stdev * irwin_hall_normal(g));
  });
  std::vector<std::uint8_t> b(std::size_t(numel) * std::size_t(dtype_bytes(d)));
  for (std::size_t j = 0; j < v.size(); ++j) {
    if (d == st_dtype::BF16) {
      const std::uint16_t bits = numerics::bf16::from_float(v[j]).bits;
      std::memcpy(&b[2 * j], &bits, 2);
    } else {
      std::memcpy(&b[4 * j], &v[j], 4);
    }
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

//! Calls emit(spec, shape, bytes) for every tensor of `schema` in order, with the random values
//! of `seed` and `init` (the one generator both the writer and the in-memory checkpoint use).
template <class Emit>
void for_each_random_tensor(const std::vector<tensor_spec>& schema, std::uint64_t seed, random_init init, Emit&& emit) {
  std::mt19937_64 rng(seed);
  const auto shapes = written_shapes(schema);
  std::vector<std::uint8_t> pending;  // `scaled`: the scale bytes of the weight just made
  std::size_t pending_index = schema.size();
  for (std::size_t i = 0; i < schema.size(); ++i) {
    const tensor_spec& t = schema[i];
    if (t.dtypes.empty()) throw error("random checkpoint: tensor '" + t.name + "' accepts no dtype");
    const std::vector<long long>& shape = shapes[i];
    long long numel = 1;
    for (long long s : shape) numel *= s;
    std::vector<std::uint8_t> bytes;
    if (init == random_init::codes) {
      bytes = detail::random_bytes(rng, t.dtypes.front(), numel);
    } else if (pending_index == i) {  // a scale, computed with its weight
      bytes = std::move(pending);
      pending_index = schema.size();
    } else {
      std::vector<std::uint8_t> scale;
      bytes = detail::scaled_bytes(rng, schema, shapes, i, scale);
      if (!scale.empty()) pending = std::move(scale), pending_index = i + 1;
    }
    emit(t, shape, std::move(bytes));
  }
}

inline void write_random_checkpoint(const std::vector<tensor_spec>& schema, const std::string& folder,
                                    std::size_t shard_bytes, std::uint64_t seed, random_init init = random_init::codes) {
  namespace fs = std::filesystem;
  fs::create_directories(folder);
  // Refuse up front rather than fill the disk halfway (a V4.1 Flash checkpoint is ~510 GB).
  const unsigned long long need = checkpoint_bytes(schema);
  const unsigned long long free_bytes = fs::space(folder).available;
  if (need > free_bytes)
    throw error(folder + ": a random checkpoint of this model needs " + std::to_string(need >> 20) + " MiB but only " +
                std::to_string(free_bytes >> 20) + " MiB are free");
  std::vector<std::pair<std::string, std::string>> weight_map;
  std::vector<std::string> shard_files;
  safetensors_writer shard;
  std::vector<std::string> shard_names;
  auto flush = [&] {
    if (shard.empty()) return;
    const std::string name = "model-" + std::to_string(shard_files.size() + 1) + ".safetensors";
    shard.write((fs::path(folder) / name).string());
    for (const auto& t : shard_names) weight_map.emplace_back(t, name);
    shard_files.push_back(name);
    shard = safetensors_writer{};
    shard_names.clear();
  };
  for_each_random_tensor(schema, seed, init, [&](const tensor_spec& t, const std::vector<long long>& shape, std::vector<std::uint8_t> bytes) {
    if (shard.bytes() + bytes.size() > shard_bytes) flush();
    shard.add(t.name, t.dtypes.front(), shape, std::move(bytes));
    shard_names.push_back(t.name);
  });
  flush();
  std::ofstream idx(fs::path(folder) / "model.safetensors.index.json");
  idx << "{\"metadata\": {\"writer\": \"dsv4 random checkpoint\"}, \"weight_map\": {";
  for (std::size_t i = 0; i < weight_map.size(); ++i)
    idx << (i ? ", " : "") << "\"" << weight_map[i].first << "\": \"" << weight_map[i].second << "\"";
  idx << "}}\n";
  if (!idx) throw error(folder + ": cannot write model.safetensors.index.json");
}

//! The same tensors as write_random_checkpoint(schema, .., seed, init), held in memory: a random
//! model without a file (benchmarks at V4.1 widths skip writing tens of GB first). Needs the
//! checkpoint's bytes in host memory.
inline checkpoint random_checkpoint_in_memory(const std::vector<tensor_spec>& schema, std::uint64_t seed,
                                              random_init init = random_init::codes) {
  checkpoint ck = checkpoint::in_memory();
  for_each_random_tensor(schema, seed, init, [&](const tensor_spec& t, const std::vector<long long>& shape, std::vector<std::uint8_t> bytes) {
    ck.add(t.name, t.dtypes.front(), shape, std::move(bytes));
  });
  return ck;
}

}  // namespace dsv4::io
