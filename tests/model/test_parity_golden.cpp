// Parity with the official reference (issue 6, docs/parity.md): the reference's fp32 logits on a
// scaled random tiny checkpoint, committed under tests/data/parity (produced by
// tools/parity/reference_logits.py on an H200; commands in tests/data/parity/README.md), against
// the host model's logits on the same checkpoint, regenerated here from its seed, and the same ids,
// with the reference's index-key behaviour at decode steps (cases.json "index_keys"). Tolerances
// from cases.json (measured; tools/parity/README.md). Runs anywhere (no Python, no GPU).

#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "dsv4/io/checkpoint.hpp"
#include "dsv4/io/json.hpp"
#include "dsv4/io/npy.hpp"
#include "dsv4/io/random_checkpoint.hpp"
#include "dsv4/model/dspark_reference.hpp"
#include "dsv4/model/model_reference.hpp"
#include "dsv4/models/checkpoint_schema.hpp"
#include "dsv4/models/model_traits.hpp"
#include "dsv4/models/tiny.hpp"
#include "support/data.hpp"
#include "support/parity.hpp"

namespace {
using namespace dsv4;
using tiny = models::tiny;
using test::compare_row;
using test::ids_of;
}  // namespace

BOOST_AUTO_TEST_SUITE(parity)

BOOST_AUTO_TEST_CASE(host_model_matches_the_reference_logits) {
  const auto cases = io::parse_json_file(test::data_path("parity/cases.json"));
  const auto& top = cases.object();
  BOOST_TEST_REQUIRE(top.at("config").string() == std::string(tiny::name));
  const auto seed = std::uint64_t(top.at("checkpoint_seed").integer);
  const auto init = io::parse_random_init(top.at("checkpoint_init").string());
  io::checkpoint ck = io::random_checkpoint_in_memory(models::checkpoint_schema<tiny>(), seed, init);  // = the written one
  std::vector<std::int64_t> token_map(std::size_t(tiny::dims.vocab_size));
  std::iota(token_map.begin(), token_map.end(), 0);  // tiny: compressed vocabulary = vocabulary
  const auto m = model::host_model<tiny>::load(ck, token_map);

  for (const auto& c : top.at("cases").array()) {
    const auto& o = c.object();
    const std::string name = o.at("name").string();
    const double tol_max = o.at("tolerance").object().at("max_rel").number();
    const double tol_rms = o.at("tolerance").object().at("rms_rel").number();
    const double tol_mean_rms = o.at("tolerance").object().at("mean_rms_rel").number();
    const auto prompt = ids_of(o.at("prompt").string()), decode = ids_of(o.at("decode").string());
    const auto golden = io::read_npy_f32(test::data_path("parity/" + name + ".npy"));
    BOOST_TEST_REQUIRE(golden.rows == 1 + decode.size(), name);
    BOOST_TEST_REQUIRE(golden.cols == std::size_t(tiny::dims.vocab_size), name);
    model::host_sequence seq;
    seq.index_keys = top.at("index_keys").string() == "upstream" ? schedule::index_key_policy::upstream_quirk
                                                                 : schedule::index_key_policy::follow_ownership;
    double worst_max = 0, worst_rms = 0, sum_rms = 0;
    for (std::size_t r = 0; r < golden.rows; ++r) {
      // The index-key policy matters at even decode positions once a ratio-2 source sees more
      // groups than its top-k (tiny: above position 32); there the reference's behaviour is closer.
      const long long pos = (long long)prompt.size() + (long long)r - 1;
      if (r > 0 && pos % 2 == 0 && pos > 2 * tiny::dims.indexer.index_topk &&
          seq.index_keys == schedule::index_key_policy::upstream_quirk) {
        model::host_sequence owned = seq;
        owned.index_keys = schedule::index_key_policy::follow_ownership;
        const auto own = model::forward(m, owned, std::span<const std::int32_t>(&decode[r - 1], 1));
        model::host_sequence quirk = seq;
        const auto up = model::forward(m, quirk, std::span<const std::int32_t>(&decode[r - 1], 1));
        const auto e_own = compare_row(golden.row(r), own, tol_max), e_up = compare_row(golden.row(r), up, tol_max);
        BOOST_TEST(own != up, name << " row " << r << ": the index-key policy changes nothing at position " << pos);
        BOOST_TEST(e_up.rms_rel < e_own.rms_rel, name << " row " << r << ": the reference's index keys are not closer ("
                                                      << e_up.rms_rel << " vs " << e_own.rms_rel << ")");
      }
      const auto logits = r == 0 ? model::forward(m, seq, prompt)
                                 : model::forward(m, seq, std::span<const std::int32_t>(&decode[r - 1], 1));
      const auto e = compare_row(golden.row(r), logits, tol_max);
      worst_max = std::max(worst_max, e.max_rel);
      worst_rms = std::max(worst_rms, e.rms_rel);
      sum_rms += e.rms_rel;
      const std::string where = name + " row " + std::to_string(r) + (r == 0 ? " (prefill)" : " (decode)");
      BOOST_TEST(e.max_rel <= tol_max, where << ": max relative error " << e.max_rel << " > " << tol_max);
      BOOST_TEST(e.rms_rel <= tol_rms, where << ": rms relative error " << e.rms_rel << " > " << tol_rms);
      BOOST_TEST((e.argmax_same || !e.decisive), where << ": argmax differs where the reference's top two are apart");
    }
    const double mean_rms = sum_rms / double(golden.rows);
    BOOST_TEST(mean_rms <= tol_mean_rms, name << ": mean rms relative error " << mean_rms << " > " << tol_mean_rms);
    BOOST_TEST_MESSAGE("parity " << name << ": worst max relative error " << worst_max << " (tolerance " << tol_max
                                 << "), worst rms relative error " << worst_rms << " (tolerance " << tol_rms
                                 << "), mean rms relative error " << mean_rms << " (tolerance " << tol_mean_rms << ")");
  }
}

// The DSpark drafter (spec §14) against the reference's forward_spec, teacher forced: the
// reference's main_hidden, input ids and drafts (long_dspark_*.npy, tools/parity/reference_dspark.py
// on the H200, README.md here) go into the host drafter, so the comparison covers the drafter alone
// (three stages, Markov head, confidence), not the backbone's spread. Measured (2026-11-30): worst
// max relative error of a draft logit row 3.1e-3 (one step; the others 2-3e-7), every draft the
// reference's, confidence within 1.5e-3. Bounds: about 6x those.
BOOST_AUTO_TEST_CASE(dspark_drafter_matches_the_reference) {
  const auto cases = io::parse_json_file(test::data_path("parity/cases.json"));
  const auto& top = cases.object();
  const auto seed = std::uint64_t(top.at("checkpoint_seed").integer);
  const auto init = io::parse_random_init(top.at("checkpoint_init").string());
  io::checkpoint ck = io::random_checkpoint_in_memory(models::checkpoint_schema<tiny>(), seed, init);
  std::vector<std::int64_t> token_map(std::size_t(tiny::dims.vocab_size));
  std::iota(token_map.begin(), token_map.end(), 0);
  const auto m = model::host_model<tiny>::load(ck, token_map);
  const auto w = model::dspark_weights_of<tiny>(ck);
  constexpr int T = models::model_traits<tiny>::schedule::drafter::targets::size, block = tiny::dims.dspark.dspark_block_size;
  const std::size_t row = std::size_t(T) * std::size_t(tiny::dims.dim), V = std::size_t(tiny::dims.vocab_size);
  const auto it = std::find_if(top.at("cases").array().begin(), top.at("cases").array().end(),
                               [](const auto& c) { return c.object().at("name").string() == "long"; });
  BOOST_TEST_REQUIRE((it != top.at("cases").array().end()));
  const auto prompt = ids_of(it->object().at("prompt").string()), decode = ids_of(it->object().at("decode").string());
  const auto file = [&](const char* what) { return io::read_npy_f32(test::data_path(std::string("parity/long_dspark_") + what + ".npy")); };
  const auto hidden = file("hidden"), ids = file("ids"), logits = file("logits"), conf = file("confidence");
  BOOST_TEST_REQUIRE(hidden.rows == prompt.size() + decode.size());
  BOOST_TEST_REQUIRE(hidden.cols == row);
  BOOST_TEST_REQUIRE(ids.rows == decode.size());
  BOOST_TEST_REQUIRE(ids.cols == std::size_t(block + 1));
  BOOST_TEST_REQUIRE(logits.rows == decode.size() * block);
  BOOST_TEST_REQUIRE(logits.cols == V);
  BOOST_TEST_REQUIRE(conf.rows == decode.size());
  std::vector<numerics::bf16> ref_hidden(hidden.data.size());
  for (std::size_t i = 0; i < ref_hidden.size(); ++i) ref_hidden[i] = numerics::bf16::from_float(hidden.data[i]);  // bf16 values
  auto max_rel = [](const float* ref, const float* ours, std::size_t n) {
    double scale = 0, err = 0;
    for (std::size_t i = 0; i < n; ++i)
      scale = std::max(scale, std::fabs(double(ref[i]))), err = std::max(err, std::fabs(double(ref[i]) - double(ours[i])));
    return scale > 0 ? err / scale : err;
  };
  model::dspark_state st;
  model::dspark_prefill<tiny>(w, st, std::span<const numerics::bf16>(ref_hidden).first(prompt.size() * row));
  double worst = 0, worst_conf = 0;
  for (std::size_t k = 0; k < decode.size(); ++k) {
    std::vector<std::int32_t> forced(std::size_t(block + 1));
    for (int j = 0; j <= block; ++j) forced[std::size_t(j)] = std::int32_t(ids.row(k)[j]);
    const auto d = model::dspark_decode<tiny>(m, w, st, forced[0],
                                              std::span<const numerics::bf16>(ref_hidden).subspan((prompt.size() + k) * row, row),
                                              {0.0f}, 0, forced);
    BOOST_TEST_REQUIRE(d.logits.size() == std::size_t(block) * V);
    for (int j = 0; j < block; ++j) {
      const float* ours = d.logits.data() + std::size_t(j) * V;
      const double e = max_rel(logits.row(k * block + std::size_t(j)), ours, V);
      worst = std::max(worst, e);
      BOOST_TEST(!std::isnan(e));
      BOOST_TEST(std::max_element(ours, ours + V) - ours == forced[std::size_t(j + 1)],
                 "step " << k << " draft " << j << ": not the reference's draft");
    }
    worst_conf = std::max(worst_conf, max_rel(conf.row(k), d.confidence.data(), std::size_t(block)));
  }
  BOOST_TEST_MESSAGE("DSpark vs reference (long case, " << decode.size() << " steps): worst max relative error " << worst
                                                        << ", confidence " << worst_conf);
  BOOST_TEST(worst < 0.02);
  BOOST_TEST(worst_conf < 0.01);
}

BOOST_AUTO_TEST_SUITE_END()
