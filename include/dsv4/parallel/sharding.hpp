#pragma once
// clang-format off
//! \file
//! Tensor-parallel sharding plan (issue 7): for world size W and rank r, which slice of each
//! checkpoint tensor the rank holds, exactly as the official reference's model.py lays out its
//! parameters when world_size > 1. The plan is host code; the NCCL work consumes it.
//!
//! Rules (module in model.py -> kind), decided from the tensor's official name:
//!
//! | tensors | model.py module | kind |
//! |---|---|---|
//! | `embed.weight`, `mtp.*.markov_head.embed.weight` | ParallelEmbedding | split_rows (vocab_size % W) |
//! | `head.weight`, `mtp.*.markov_head.head.weight` | ParallelHead | split_rows (vocab_size % W) |
//! | `attn.wq_b` | ColumnParallelLinear | split_rows (n_heads % W) |
//! | `attn.attn_sink` | Attention (n_local_heads) | split_rows (n_heads % W) |
//! | `attn.wo_a` | ColumnParallelLinear, grouped | split_rows (o_groups % W: whole groups) |
//! | `attn.wo_b` | RowParallelLinear | split_cols (o_groups % W) |
//! | `attn.indexer.wq_b` | ColumnParallelLinear | split_rows (index_n_heads % W) |
//! | `attn.indexer.weights_proj` | ColumnParallelLinear (bf16) | split_rows (index_n_heads % W) |
//! | `ffn.experts.{e}.*` | MoE | expert: rank e / (n / W) holds it (n % W) |
//! | `engram.embed.{weight,scale}` | ParallelEngramEmbedding | rows_padded: ceil(rows / W) each |
//! | `attn.wq_a`, `attn.wkv`, compressor, `indexer.wk`, `engram.wkv`, `main_proj`, `confidence_head` | Linear | replicated |
//! | `ffn.shared_experts.*` | Expert of plain Linears | replicated |
//! | `ffn.gate.*` | Gate | replicated |
//! | norms, `hc_*`, `engram.{q,k}_weight`, image delimiters | RMSNorm / Block / Parameter | replicated |
//! | `vision.*`, `aligner.*` | ViT / Aligner (nn.Linear) | replicated |
//!
//! DSpark stages (`mtp.{s}.`) follow the block rules (DSparkBlock is a Block; its experts count
//! dspark_n_routed_experts, or n_routed_experts when that is 0, as get_moe_config does).
//!
//! Block scales. An FP8 weight's UE8M0 `.scale` has one entry per 32 x 32 tile; it is split along
//! the same dimension as its weight, and a rank's weight slice must be a whole number of tiles
//! (model.py allocates ceil(part / 32) scale rows per rank; the tiles of the full checkpoint line
//! up with that only if part % 32 == 0, a condition model.py does not assert: we do). `wo_a.scale`
//! may use 32 x 32 or 128 x 128 tiles (convert.py accepts both); the tile is read from the
//! scale's shape and the rank's rows must be whole tiles. FP4 expert scales travel with their
//! expert; the Engram table's scale rows are split and padded like its weight rows.
//!
//! Engram padding. Rank r holds rows [r * P, (r + 1) * P) with P = ceil(rows / W); rows past the
//! end of the table are padding (only on the last rank when rows >= (W - 1) * P, which holds for
//! every built-in model). Hash ids never reach them. convert.py fills them with weight 0 and
//! scale 1.0 (UE8M0 code 127); `tensor_shard::pad_rows` says how many a rank holds.
//!
//! Collectives the forward needs under this plan (model.py), for the NCCL work: all_reduce (sum)
//! after ParallelEmbedding (off-rank ids zeroed), after ParallelEngramEmbedding (bf16 values,
//! before the replicated wkv), of the indexer's index_score (summed over the rank's heads, before
//! the top-k), after RowParallelLinear wo_b (fp32), and of the routed-expert sum before the
//! replicated shared expert is added (fp32); all_gather (concatenated along vocab) after
//! ParallelHead, for the main head and the DSpark Markov head. Everything else (wq_a, the latent
//! KV, compressor, index keys, mHC, gate, shared expert, norms, vision) is computed redundantly on
//! every rank.
//!
//! Where spec §16's convert.py summary and model.py differ. The summary lists the dim-0 names
//! (embed, wq_b, wo_a, head, attn_sink, weights_proj) and wo_b on dim 1; model.py agrees and
//! settles what the summary leaves out: the indexer's wq_b is split too (by name it is a wq_b),
//! indexer.wk, the compressor, the gate and the shared experts are replicated, and the Markov
//! head's embed / head split like the main ones. ParallelHead floors vocab / W without asserting;
//! ParallelEmbedding asserts vocab % W on the same vocabulary, so we require it for both.
//! Attention floors n_heads / W and o_groups / W (only wq_b's and wo_a's total widths are
//! asserted); a W that does not divide them would break the reshapes, so we require them.
//! convert.py dequantizes wo_a to bf16 (no scale in its output); this plan shards the stored
//! checkpoint, so wo_a.scale is split with its weight's rows.
// clang-format on

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/io/tensor_spec.hpp"
#include "dsv4/models/checkpoint_schema.hpp"
#include "dsv4/models/model_config.hpp"
#include "dsv4/models/model_traits.hpp"

namespace dsv4::parallel {

//! How a tensor is laid out over the ranks.
enum class shard_kind : std::uint8_t {
  replicated,   //!< every rank holds the whole tensor
  split_rows,   //!< dim 0 in W equal contiguous slices
  split_cols,   //!< dim 1 in W equal contiguous slices
  expert,       //!< the whole tensor on one rank (its routed expert's owner)
  rows_padded,  //!< dim 0 in ceil(rows / W) slices, the tail padded (Engram tables)
};

inline const char* to_string(shard_kind k) {
  switch (k) {
    case shard_kind::replicated:
      return "replicated";
    case shard_kind::split_rows:
      return "split_rows";
    case shard_kind::split_cols:
      return "split_cols";
    case shard_kind::expert:
      return "expert";
    case shard_kind::rows_padded:
      return "rows_padded";
  }
  return "?";
}

//! One rank's part of one tensor.
struct tensor_shard {
  std::string name;
  shard_kind kind = shard_kind::replicated;
  const char* module = "";       //!< the model.py module that owns it (the rule's name)
  std::vector<long long> shape;  //!< the rank's local shape (expert: the whole tensor's)
  long long offset = 0;          //!< first row / column of the slice; expert: the expert index
  bool held = true;              //!< false: another rank holds it (experts only)
  long long pad_rows = 0;        //!< rows_padded: rows of the slice past the table's end

  //! The dimension split across ranks, or -1.
  int split_dim() const {
    switch (kind) {
      case shard_kind::split_rows:
      case shard_kind::rows_padded:
        return 0;
      case shard_kind::split_cols:
        return 1;
      default:
        return -1;
    }
  }
};

namespace detail {

//! A sharding rule: what splits and by which configuration quantity.
struct rule {
  shard_kind kind = shard_kind::replicated;
  const char* module = "";
  int dim = 0;                  //!< split dimension (split_rows / split_cols)
  long long count = 1;          //!< indivisible units along dim: vocab rows, heads, groups, experts
  long long unit = 1;           //!< weight elements per unit along dim
  const char* count_name = "";  //!< the config field `count` comes from, for messages
  bool scale = false;           //!< the tensor is the block scale of a split weight
  bool any_tile = false;        //!< scale tiles may be 32 or 128 (wo_a)
  long long expert = -1;        //!< expert index (kind expert)
};

inline bool starts_with(std::string_view s, std::string_view p) {
  return s.substr(0, p.size()) == p;
}

//! Strips "<head><number>." from `name`; false if it does not start that way.
inline bool strip_indexed(std::string_view name, std::string_view head, std::string_view& rest,
                          long long& index) {
  if (!starts_with(name, head)) return false;
  std::size_t i = head.size();
  long long v = 0;
  const std::size_t first = i;
  while (i < name.size() && name[i] >= '0' && name[i] <= '9') v = v * 10 + (name[i++] - '0');
  if (i == first || i >= name.size() || name[i] != '.') return false;
  rest = name.substr(i + 1);
  index = v;
  return true;
}

[[noreturn]] inline void no_rule(std::string_view name) {
  throw error("sharding: no tensor-parallel rule for tensor '" + std::string(name) +
              "' (not a parameter name of the official model.py)");
}

inline rule replicated(const char* module) {
  return rule{shard_kind::replicated, module};
}
inline rule split(shard_kind k, const char* module, long long count, long long unit, const char* count_name) {
  rule r{k, module, k == shard_kind::split_cols ? 1 : 0, count, unit, count_name};
  return r;
}

//! The rule for a tensor, by its official name (spec §16 / checkpoint_schema.hpp).
inline rule classify(std::string_view name, const models::model_config& c) {
  const auto& a = c.attn;
  const auto& ix = c.indexer;
  constexpr auto rows = shard_kind::split_rows;
  if (name == "embed.weight") return split(rows, "ParallelEmbedding", c.vocab_size, 1, "vocab_size");
  if (name == "head.weight") return split(rows, "ParallelHead", c.vocab_size, 1, "vocab_size");
  if (name == "norm.weight") return replicated("RMSNorm");
  if (name == "image_start" || name == "image_end" || name == "image_newline") return replicated("Parameter");
  if (starts_with(name, "vision.") || starts_with(name, "aligner."))
    return replicated("ViT / Aligner (nn.Linear)");

  std::string_view rest;
  long long index = 0;
  bool mtp = false;
  if (strip_indexed(name, "mtp.", rest, index))
    mtp = true;
  else if (!strip_indexed(name, "layers.", rest, index))
    no_rule(name);

  // Routed experts: "ffn.experts.<e>.w{1,2,3}.{weight,scale}".
  std::string_view tail;
  long long e = 0;
  if (strip_indexed(rest, "ffn.experts.", tail, e)) {
    if (tail != "w1.weight" && tail != "w1.scale" && tail != "w2.weight" && tail != "w2.scale" &&
        tail != "w3.weight" && tail != "w3.scale")
      no_rule(name);
    const long long n =
        mtp && c.dspark.dspark_n_routed_experts ? c.dspark.dspark_n_routed_experts : c.moe.n_routed_experts;
    rule r{shard_kind::expert,
           "MoE (routed expert)",
           0,
           n,
           1,
           mtp ? "dspark_n_routed_experts" : "n_routed_experts"};
    r.expert = e;
    return r;
  }
  if (rest == "attn.attn_sink") return split(rows, "Attention (attn_sink)", a.n_heads, 1, "n_heads");
  if (starts_with(rest, "hc_")) return replicated("Block (mHC)");
  if (starts_with(rest, "ffn.gate.")) return replicated("Gate");
  if (starts_with(rest, "ffn.shared_experts.")) return replicated("Expert (shared, Linear)");
  if (rest == "engram.q_weight" || rest == "engram.k_weight") return replicated("Engram");

  // Modules with ".weight" / ".scale" leaves.
  const bool is_scale = rest.ends_with(".scale");
  if (!is_scale && !rest.ends_with(".weight")) no_rule(name);
  const std::string_view base = rest.substr(0, rest.size() - (is_scale ? 6 : 7));
  rule r;
  if (base == "attn.wq_b") {
    r = split(rows, "ColumnParallelLinear", a.n_heads, a.head_dim, "n_heads");
  } else if (base == "attn.wo_a") {
    r = split(rows, "ColumnParallelLinear (grouped wo_a)", a.o_groups, a.o_lora_rank, "o_groups");
    r.any_tile = true;
  } else if (base == "attn.wo_b") {
    r = split(shard_kind::split_cols, "RowParallelLinear", a.o_groups, a.o_lora_rank, "o_groups");
  } else if (base == "attn.indexer.wq_b") {
    r = split(rows, "ColumnParallelLinear (indexer)", ix.index_n_heads, ix.index_head_dim, "index_n_heads");
  } else if (base == "attn.indexer.weights_proj" && !is_scale) {
    r = split(rows, "ColumnParallelLinear (indexer, bf16)", ix.index_n_heads, 1, "index_n_heads");
  } else if (base == "engram.embed") {
    return rule{shard_kind::rows_padded, "ParallelEngramEmbedding"};
  } else if (mtp && base == "markov_head.embed" && !is_scale) {
    r = split(rows, "ParallelEmbedding (Markov head)", c.vocab_size, 1, "vocab_size");
  } else if (mtp && base == "markov_head.head" && !is_scale) {
    r = split(rows, "ParallelHead (Markov head)", c.vocab_size, 1, "vocab_size");
  } else if (base == "attn.wq_a" || base == "attn.wkv" || base == "engram.wkv" ||
             (mtp && base == "main_proj")) {
    return replicated("Linear");
  } else if (base == "attn.compressor.wkv" || base == "attn.compressor.wgate") {
    return replicated("Compressor (Linear)");
  } else if (base == "attn.indexer.wk") {
    return replicated("Indexer (Linear wk)");
  } else if (mtp && base == "confidence_head.proj") {
    return replicated("DSparkConfidenceHead (Linear)");
  } else if (!is_scale &&
             (base == "attn.q_norm" || base == "attn.kv_norm" || base == "attn_norm" || base == "ffn_norm" ||
              base == "attn.compressor.norm" || base == "attn.indexer.k_norm" ||
              (mtp && (base == "main_norm" || base == "norm")))) {
    return replicated("RMSNorm");
  } else {
    no_rule(name);
  }
  r.scale = is_scale;
  return r;
}

inline std::string where(std::string_view name, int dim, int world) {
  return "sharding: tensor '" + std::string(name) + "', dim " + std::to_string(dim) + ", world size " +
         std::to_string(world) + ": ";
}

}  // namespace detail

//! Rank `rank`'s part of tensor `t` (whose shape in the checkpoint is `full_shape`) under world
//! size `world`, for a model of configuration `c`. Throws dsv4::error naming the tensor, the
//! dimension and W when the split does not divide, when the shape disagrees with the
//! configuration, or when the name has no rule.
inline tensor_shard shard_of(const io::tensor_spec& t, const std::vector<long long>& full_shape, int world,
                             int rank, const models::model_config& c) {
  if (world < 1 || rank < 0 || rank >= world)
    throw error("sharding: rank " + std::to_string(rank) + " is not in world size " + std::to_string(world));
  const detail::rule r = detail::classify(t.name, c);
  tensor_shard s{t.name, r.kind, r.module, full_shape};
  switch (r.kind) {
    case shard_kind::replicated:
      return s;
    case shard_kind::expert: {
      if (r.count % world != 0)
        throw error(detail::where(t.name, 0, world) + "the experts of its layer (" + r.count_name + " = " +
                    std::to_string(r.count) +
                    ") do not divide evenly over the ranks (MoE asserts n % W == 0)");
      if (r.expert >= r.count)
        throw error("sharding: tensor '" + t.name + "': expert " + std::to_string(r.expert) + " is past " +
                    r.count_name + " = " + std::to_string(r.count));
      const long long per_rank = r.count / world;
      s.offset = r.expert;
      s.held = r.expert / per_rank == rank;
      return s;
    }
    case shard_kind::rows_padded: {
      if (full_shape.empty()) throw error(detail::where(t.name, 0, world) + "an Engram table needs a shape");
      const long long rows = full_shape[0];
      const long long part = (rows + world - 1) / world;
      s.offset = rank * part;
      const long long real = std::clamp(rows - s.offset, 0ll, part);
      s.pad_rows = part - real;
      s.shape[0] = part;
      return s;
    }
    case shard_kind::split_rows:
    case shard_kind::split_cols:
      break;
  }
  const int dim = r.dim;
  const std::string at = detail::where(t.name, dim, world);
  if (static_cast<int>(full_shape.size()) <= dim)
    throw error(at + "the tensor has only " + std::to_string(full_shape.size()) + " dimensions");
  if (r.count % world != 0)
    throw error(at + "it splits " + r.count_name + " = " + std::to_string(r.count) + " over the ranks (" +
                r.module + "), which world size " + std::to_string(world) + " does not divide");
  const long long weight_extent = r.count * r.unit;
  const long long weight_part = weight_extent / world;
  const long long extent = full_shape[dim];
  long long part = weight_part;
  if (!r.scale) {
    if (extent != weight_extent)
      throw error(at + "extent " + std::to_string(extent) + " disagrees with the configuration (" +
                  r.count_name + " x " + std::to_string(r.unit) + " = " + std::to_string(weight_extent) +
                  ")");
  } else {
    // One scale per tile of `tile` weight rows / columns: 32, or 32 / 128 for wo_a (from the shape).
    long long tile = 32;
    if (r.any_tile && extent != (weight_extent + 31) / 32) tile = 128;
    if (extent != (weight_extent + tile - 1) / tile)
      throw error(at + "scale extent " + std::to_string(extent) + " is not one per " + std::to_string(tile) +
                  "-element tile of the weight's " + std::to_string(weight_extent) +
                  (r.any_tile ? " (32 x 32 or 128 x 128 tiles)" : ""));
    if (weight_part % tile != 0)
      throw error(at + "a rank's " + std::to_string(weight_part) + " weight " +
                  (dim == 0 ? "rows" : "columns") + " are not a whole number of " + std::to_string(tile) +
                  "-element scale tiles, so a tile would straddle two ranks");
    part = weight_part / tile;
  }
  s.offset = rank * part;
  s.shape[dim] = part;
  return s;
}

//! The full shape a tensor of the schema has in a checkpoint: the schema's, or for the one
//! tensor it leaves open (wo_a.scale) the 32 x 32 tile shape the writers use.
inline std::vector<long long> default_full_shape(const io::tensor_spec& t, const models::model_config& c) {
  if (!t.shape.empty()) return t.shape;
  if (t.name.ends_with("attn.wo_a.scale")) {
    const auto& a = c.attn;
    const long long n = 1ll * a.o_groups * a.o_lora_rank, k = 1ll * a.n_heads / a.o_groups * a.head_dim;
    return {(n + 31) / 32, (k + 31) / 32};
  }
  throw error("sharding: tensor '" + t.name +
              "' has no shape in the schema; pass its checkpoint shape to shard_of");
}

//! Rank `rank`'s part of every tensor of `schema`, in schema order.
inline std::vector<tensor_shard> shard_plan(const std::vector<io::tensor_spec>& schema, int world, int rank,
                                            const models::model_config& c) {
  std::vector<tensor_shard> out;
  out.reserve(schema.size());
  for (const auto& t : schema) out.push_back(shard_of(t, default_full_shape(t, c), world, rank, c));
  return out;
}

template <class Model>
std::vector<tensor_shard> shard_plan(int world, int rank) {
  return shard_plan(models::checkpoint_schema<Model>(), world, rank, Model::dims);
}

//! One divisibility condition a world size must meet.
struct divisibility_check {
  const char* what;     //!< the config field and the tensors that split by it
  long long count = 0;  //!< must be a multiple of W
  long long unit = 1;   //!< elements per counted unit
  long long tile = 0;   //!< > 0: count / W x unit must be a multiple of it (FP8 scale tiles)
  constexpr bool fits(int world) const {
    return world >= 1 && count % world == 0 && (tile == 0 || (count / world * unit) % tile == 0);
  }
};

//! Every condition a world size must meet for a model (the rules above; wo_a with 32 x 32 tiles).
template <class Model>
constexpr auto divisibility_checks() {
  constexpr models::model_config c = Model::dims;
  constexpr bool drafter = models::model_traits<Model>::schedule::drafter::stages > 0;
  constexpr long long dspark =
      c.dspark.dspark_n_routed_experts ? c.dspark.dspark_n_routed_experts : c.moe.n_routed_experts;
  return std::array<divisibility_check, 6>{{
      {"vocab_size (embed, head, markov_head rows)", c.vocab_size, 1, 0},
      {"n_heads (wq_b rows in 32-row scale tiles, attn_sink)", c.attn.n_heads, c.attn.head_dim, 32},
      {"o_groups (wo_a rows, wo_b columns, in 32-element scale tiles)", c.attn.o_groups, c.attn.o_lora_rank,
       32},
      {"index_n_heads (indexer wq_b rows in 32-row scale tiles, weights_proj)", c.indexer.index_n_heads,
       c.indexer.index_head_dim, 32},
      {"n_routed_experts (routed experts)", c.moe.n_routed_experts, 1, 0},
      {"dspark_n_routed_experts (DSpark routed experts)", drafter ? dspark : 1, 1, 0},
  }};
}

//! True when every tensor of the model splits over `world` ranks (usable in static_assert).
template <class Model>
constexpr bool world_size_fits(int world) {
  for (const auto& k : divisibility_checks<Model>())
    if (!k.fits(world)) return false;
  return world >= 1;
}

//! The conditions `world` violates, in words (empty: it fits).
template <class Model>
std::vector<std::string> world_size_violations(int world) {
  std::vector<std::string> out;
  for (const auto& k : divisibility_checks<Model>())
    if (!k.fits(world))
      out.push_back(std::string(k.what) + ": " + std::to_string(k.count) +
                    " does not split over world size " + std::to_string(world) +
                    (k.tile ? " in whole " + std::to_string(k.tile) + "-element scale tiles" : ""));
  return out;
}

}  // namespace dsv4::parallel
