//! \file
//! Layer-by-layer parity of the host model with the official reference, each block fed the
//! reference's own input (teacher forcing), so that a difference in one layer does not carry into
//! the next. The reference side comes from `reference_logits.py --dump-dir DIR` (per case:
//! <case>_x.npy = every block's output residual of the prefill, <case>_pre.npy = the pre-mix it
//! hands on, <case>_topk.npy = the top-k lists published so far). Block l gets the reference's
//! output of block l - 1 and its pre-mix (block 0 gets the embedding, as in the model), runs with
//! this sequence's own caches (filled by the earlier teacher-forced blocks), and its output and
//! published top-k lists are compared with the reference's.
//!
//! Pass (exit 0): every top-k list equals the reference's (as a set), and every output value is
//! within 1/64 of its token's largest |value| (4 bf16 ulps at that magnitude). Prints one line per
//! layer: values that differ, the worst relative difference, top-k rows that differ.
//!
//! usage: dsv4_layer_parity --checkpoint DIR --prompt IDS --dump-dir DIR --case NAME

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/io/checkpoint.hpp"
#include "dsv4/io/npy.hpp"
#include "dsv4/model/model_reference.hpp"
#include "dsv4/models/checkpoint_schema.hpp"
#include "dsv4/models/tiny.hpp"

namespace {
using namespace dsv4;
using tiny = models::tiny;
using numerics::bf16;

constexpr double tolerance = 1.0 / 64;

int run(int argc, char** argv) {
  std::string checkpoint, prompt_text, dump_dir, name;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--checkpoint") checkpoint = v;
    else if (k == "--prompt") prompt_text = v;
    else if (k == "--dump-dir") dump_dir = v;
    else if (k == "--case") name = v;
    else throw error("unknown option " + k);
  }
  if (checkpoint.empty() || prompt_text.empty() || dump_dir.empty() || name.empty() || argc % 2 == 0)
    throw error("usage: dsv4_layer_parity --checkpoint DIR --prompt IDS --dump-dir DIR --case NAME");
  std::vector<std::int32_t> ids;
  std::stringstream ss(prompt_text);
  for (std::string item; std::getline(ss, item, ',');) ids.push_back(std::int32_t(std::stol(item)));

  using sched = models::model_traits<tiny>::schedule;
  constexpr models::model_config c = tiny::dims;
  constexpr int hc = kernels::mhc::hc;
  const std::size_t dim = std::size_t(c.dim), width = hc * dim, s = ids.size(), k_max = std::size_t(c.indexer.index_topk);
  const auto ref_x = io::read_npy_f32(dump_dir + "/" + name + "_x.npy");
  const auto ref_pre = io::read_npy_f32(dump_dir + "/" + name + "_pre.npy");
  const auto ref_topk = io::read_npy_f32(dump_dir + "/" + name + "_topk.npy");
  const std::size_t layers = std::size_t(sched::num_layers);
  if (ref_x.rows != layers || ref_x.cols != s * width || ref_pre.rows != layers || ref_pre.cols != s * hc ||
      ref_topk.rows != layers || ref_topk.cols != s * k_max)
    throw error("the dump of case " + name + " does not fit a prefill of " + std::to_string(s) + " tokens of tiny");

  io::checkpoint ck(checkpoint);
  ck.validate(models::checkpoint_schema<tiny>());
  std::vector<std::int64_t> token_map(std::size_t(c.vocab_size));
  std::iota(token_map.begin(), token_map.end(), 0);  // tiny: compressed vocabulary = vocabulary
  const auto m = model::host_model<tiny>::load(ck, token_map);

  // As model::forward, but each block's input and pre-mix are the reference's.
  model::host_sequence seq;
  seq.engram_history.resize(m.engrams.size());
  std::vector<std::vector<std::int64_t>> hashes(m.engrams.size());
  for (std::size_t j = 0; j < m.engrams.size(); ++j) {
    const std::vector<std::int64_t> mult(tiny::engram_multipliers[j].begin(), tiny::engram_multipliers[j].end());
    hashes[j] = engram::hash_tokens(m.hashes, int(j), mult, ids, {}, m.token_map, c.engram.engram_pad_id,
                                    seq.engram_history[j], 0);
  }
  std::vector<bf16> x(s * width);
  for (std::size_t t = 0; t < s; ++t)
    for (int r = 0; r < hc; ++r)
      for (std::size_t d = 0; d < dim; ++d)
        x[t * width + std::size_t(r) * dim + d] = bf16::from_float(m.embed[std::size_t(ids[t]) * dim + d]);
  std::vector<float> pre(s * hc, 0.0f);
  for (std::size_t t = 0; t < s; ++t) pre[t * hc] = 1.0f;
  constexpr auto shape = model::attention_shape<tiny>();

  bool pass = true;
  std::size_t total_diff = 0, topk_rows_diff = 0;
  double worst_all = 0;
  for (std::size_t l = 0; l < layers; ++l) {
    if (l > 0) {
      for (std::size_t i = 0; i < x.size(); ++i) x[i] = bf16::from_float(ref_x.row(l - 1)[i]);
      std::copy(ref_pre.row(l - 1), ref_pre.row(l - 1) + pre.size(), pre.begin());
    }
    for (std::size_t j = 0; j < m.engrams.size(); ++j)
      if (std::size_t(sched::engram::values[j]) == l)
        for (std::size_t t = 0; t < s; ++t)
          engram::engram_forward_reference(m.engrams[j], std::span<bf16>(x).subspan(t * width, width),
                                           std::span<const std::int64_t>(hashes[j]).subspan(t * m.engrams[j].columns,
                                                                                            std::size_t(m.engrams[j].columns)),
                                           false);
    x = model::block_forward_chunk(int(l), m.wiring[l], m.blocks[l], shape, m.freqs[l], x, pre, 0, seq.attention);
    std::size_t diff = 0, tokens = 0;
    double worst = 0;
    for (std::size_t t = 0; t < s; ++t) {
      double scale = 0, err = 0;
      std::size_t d = 0;
      for (std::size_t i = t * width; i < (t + 1) * width; ++i) {
        const double r = ref_x.row(l)[i], o = x[i].to_float();
        scale = std::max(scale, std::fabs(r));
        err = std::max(err, std::fabs(r - o));
        d += r != o;
      }
      diff += d;
      tokens += d > 0;
      worst = std::max(worst, scale > 0 ? err / scale : err);
    }
    // Top-k lists: the reference's rows, padded with -2; window-only layers have none.
    std::size_t rows_diff = 0;
    const float* rk = ref_topk.row(l);
    const bool has_topk = std::any_of(rk, rk + s * k_max, [](float v) { return v != -2.0f; });
    if (has_topk) {
      const auto& st = seq.attention;
      for (std::size_t r = 0; r < s; ++r) {
        std::vector<int> a, b;
        for (std::size_t j = 0; j < k_max; ++j)
          if (rk[r * k_max + j] != -2.0f) a.push_back(int(rk[r * k_max + j]));
        if (st.topk.size() == s * std::size_t(st.topk_width))
          b.assign(st.topk.begin() + std::ptrdiff_t(r * st.topk_width), st.topk.begin() + std::ptrdiff_t((r + 1) * st.topk_width));
        std::sort(a.begin(), a.end());
        std::sort(b.begin(), b.end());
        rows_diff += a != b;
      }
    }
    total_diff += diff;
    topk_rows_diff += rows_diff;
    worst_all = std::max(worst_all, worst);
    const bool ok = rows_diff == 0 && worst <= tolerance;
    pass &= ok;
    std::printf("layer %2zu: %6zu of %zu values differ (%zu tokens), worst %.3e of the token's max%s%s\n", l, diff, s * width,
                tokens, worst, has_topk ? (", top-k rows differing: " + std::to_string(rows_diff)).c_str() : "",
                ok ? "" : "  FAIL");
  }
  std::printf("%s: %zu of %zu values bit-equal (%.2f%%), worst %.3e (tolerance %.3e), top-k rows differing: %zu -> %s\n",
              name.c_str(), layers * s * width - total_diff, layers * s * width,
              100.0 * double(layers * s * width - total_diff) / double(layers * s * width), worst_all, tolerance,
              topk_rows_diff, pass ? "PASS" : "FAIL");
  return pass ? 0 : 1;
}
}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "dsv4_layer_parity: " << e.what() << "\n";
    return 2;
  }
}
