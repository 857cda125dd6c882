// config.json against the types: the official V4.1 file (spec §1.1) agrees key by key.

#include <boost/test/unit_test.hpp>


#include "dsv4/models/config_json.hpp"
#include "dsv4/models/tiny.hpp"
#include "dsv4/models/v41_flash.hpp"
#include "support/data.hpp"

using namespace dsv4;

namespace {
io::json load(const std::string& rel) { return io::parse_json_file(test::data_path(rel)); }
}  // namespace

BOOST_AUTO_TEST_SUITE(config_json)

BOOST_AUTO_TEST_CASE(official_v41_config_matches_the_types) {
  const auto problems = models::compare_config_json<models::v41_flash>(load("v41_inference_config.json"));
  for (const auto& p : problems) BOOST_TEST_MESSAGE(p);
  BOOST_TEST(problems.empty());
}

BOOST_AUTO_TEST_CASE(mismatches_are_named) {
  const auto problems = models::compare_config_json<models::tiny>(load("v41_inference_config.json"));
  auto has = [&](const std::string& s) {
    for (const auto& p : problems)
      if (p.find(s) != std::string::npos) return true;
    return false;
  };
  BOOST_TEST(has("key 'dim' is 5120.000000, the model has 256.000000"));
  BOOST_TEST(has("key 'index_topk' is 512.000000, the model has 16.000000"));
  BOOST_TEST(!has("kv_source_layers"));  // tiny shares the schedule
  const auto missing = models::compare_config_json<models::v41_flash>(io::parse_json("{\"dim\": 5120}", "x"));
  BOOST_TEST(missing.size() > 50u);
  BOOST_TEST(missing.front().find("missing key") != std::string::npos);
}

BOOST_AUTO_TEST_SUITE_END()
