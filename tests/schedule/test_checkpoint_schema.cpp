// The checkpoint schema derived from the types (spec §16).

#include <boost/test/unit_test.hpp>

#include <map>
#include <set>

#include "dsv4/io/random_checkpoint.hpp"
#include "dsv4/models/checkpoint_schema.hpp"
#include "dsv4/models/tiny.hpp"
#include "dsv4/models/v41_flash.hpp"

using namespace dsv4;

namespace {
std::map<std::string, models::tensor_spec> by_name(const std::vector<models::tensor_spec>& v) {
  std::map<std::string, models::tensor_spec> m;
  for (const auto& t : v) BOOST_REQUIRE_MESSAGE(m.emplace(t.name, t).second, "duplicate tensor " << t.name);
  return m;
}
}  // namespace

BOOST_AUTO_TEST_SUITE(checkpoint_schema)

// The official index reports 96,085 tensors (spec §1.2); the schema built from the types agrees.
BOOST_AUTO_TEST_CASE(v41_lists_every_tensor_of_the_official_index) {
  const auto schema = models::checkpoint_schema<models::v41_flash>();
  BOOST_TEST(schema.size() == 96085u);
  // ... and the index's total_size, 510,286,023,000 bytes, to the byte: every stored dtype and shape.
  BOOST_TEST(io::checkpoint_bytes(schema) == 510286023000ull);
  const auto m = by_name(schema);
  // Spot checks against the spec's tables.
  BOOST_TEST((m.at("layers.0.attn.wq_b.weight").shape == std::vector<long long>{32768, 1280}));
  BOOST_TEST((m.at("layers.0.attn.wq_b.scale").shape == std::vector<long long>{1024, 40}));
  BOOST_TEST((m.at("layers.5.ffn.experts.383.w2.weight").shape == std::vector<long long>{5120, 1152}));
  BOOST_TEST((m.at("layers.5.ffn.experts.383.w2.scale").shape == std::vector<long long>{5120, 72}));
  BOOST_TEST((m.at("layers.2.attn.compressor.wgate.weight").shape == std::vector<long long>{512, 5120}));
  BOOST_TEST(m.count("layers.20.attn.compressor.wgate.weight") == 0u);  // ratio 1: no gate
  BOOST_TEST(m.count("layers.24.attn.indexer.wq_b.weight") == 1u);     // Reindex: own queries
  BOOST_TEST(m.count("layers.24.attn.indexer.wk.weight") == 0u);       // ... but no keys of its own
  BOOST_TEST(m.count("layers.21.attn.indexer.weights_proj.weight") == 0u);
  BOOST_TEST((m.at("layers.14.engram.embed.weight").shape == std::vector<long long>{384016682, 256}));
  BOOST_TEST((m.at("layers.1.engram.wkv.scale").shape == std::vector<long long>{800, 192}));
  BOOST_TEST((m.at("mtp.0.main_proj.weight").shape == std::vector<long long>{5120, 15360}));
  BOOST_TEST((m.at("mtp.1.ffn.gate.weight").shape == std::vector<long long>{128, 5120}));
  BOOST_TEST((m.at("mtp.2.confidence_head.proj.weight").shape == std::vector<long long>{1, 5376}));
  BOOST_TEST((m.at("vision.blocks.31.mlp.w1.weight").shape == std::vector<long long>{5632, 1024}));
  BOOST_TEST((m.at("aligner.w1.weight").shape == std::vector<long long>{5120, 9216}));
  BOOST_TEST(m.at("layers.7.ffn.gate.bias_vl").optional);
}

BOOST_AUTO_TEST_CASE(tiny_schema_follows_its_own_widths) {
  const auto m = by_name(models::checkpoint_schema<models::tiny>());
  BOOST_TEST((m.at("layers.0.attn.wq_b.weight").shape == std::vector<long long>{4 * 128, 64}));
  BOOST_TEST((m.at("layers.3.ffn.experts.7.w1.weight").shape == std::vector<long long>{128, 128}));
  BOOST_TEST(m.count("layers.3.ffn.experts.8.w1.weight") == 0u);
}

BOOST_AUTO_TEST_SUITE_END()
