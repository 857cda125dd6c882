#pragma once
//! \file
//! Model variants the benchmarks run besides the built-in ones.

#include <array>

#include "dsv4/engram/table_layout.hpp"
#include "dsv4/models/v41_flash.hpp"

namespace bench_variants {

//! V4.1 Flash with 16 routed experts (8 in the DSpark stages) and small Engram tables: the
//! per-layer shapes of attention, mHC and the MoE's GEMMs are V4.1's, the weights fit one GPU.
struct v41_width : dsv4::models::v41_flash {
  static constexpr const char* name = "v41-width-16-experts";
  static constexpr const char* title = "V4.1 Flash widths, 16 routed experts (benchmark variant)";
  static constexpr dsv4::models::model_config dims = [] {
    dsv4::models::model_config d = dsv4::models::v41_flash::dims;
    d.moe.n_routed_experts = 16;
    d.dspark.dspark_n_routed_experts = 8;
    d.engram.engram_vocab_size = 100000;
    return d;
  }();
  static constexpr std::array<long long, 2> engram_num_embeddings = dsv4::engram::table_rows<2>(
      dims.engram.engram_vocab_size, dims.engram.engram_max_ngram_size, dims.engram.engram_n_heads);
};

}  // namespace bench_variants
