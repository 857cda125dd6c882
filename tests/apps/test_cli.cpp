// The dsv4 command line, driven as a user drives it.

#include <boost/test/unit_test.hpp>

#include <sstream>
#include <string>
#include <vector>

#include "dsv4/cli.hpp"

namespace {
struct result {
  int code;
  std::string out, err;
};
result run(std::vector<std::string> args) {
  std::ostringstream out, err;
  const int code = dsv4::cli::run(args, out, err);
  return {code, out.str(), err.str()};
}
bool has(const std::string& text, const std::string& needle) { return text.find(needle) != std::string::npos; }
}  // namespace

BOOST_AUTO_TEST_SUITE(cli)

// The acceptance line: 890 B/token, 288 + 68, owners, producers, candidate source, 528 B.
BOOST_AUTO_TEST_CASE(info_v41_flash_reports_the_cache_accounting) {
  const result r = run({"info", "--config", "v41-flash"});
  BOOST_TEST(r.code == 0);
  BOOST_TEST(r.err.empty());
  BOOST_TEST(has(r.out, "global KV: 890 bytes per token (main 720 + index keys 170)"));
  BOOST_TEST(has(r.out, "global entry: 288 + 68 = 356 bytes"));
  BOOST_TEST(has(r.out, "global KV owners: 2, 8, 14, 20\n"));
  BOOST_TEST(has(r.out, "index producers: 2, 8, 14, 20, 24, 28, 32, 36\n"));
  BOOST_TEST(has(r.out, "candidate source: 20 (pool of 2048 blocks x 8 = 16384 candidates)"));
  BOOST_TEST(has(r.out, "local window: 528 bytes per position per layer"));
  BOOST_TEST(has(r.out, "paged global cache: pages of 256 tokens = 227840 bytes"));
  BOOST_TEST(has(r.out, "   24  decoder  Reindex      1        20          24"));
  BOOST_TEST(has(r.out, "    7  encoder  Reuse        2         2           2"));
}

BOOST_AUTO_TEST_CASE(info_tiny_and_default) {
  BOOST_TEST(has(run({"info", "--config=tiny"}).out, "global KV: 265 bytes per token"));
  BOOST_TEST(has(run({"info"}).out, "global KV: 890 bytes per token"));
}

BOOST_AUTO_TEST_CASE(bad_input_is_a_clear_error) {
  result r = run({"info", "--config", "v5"});
  BOOST_TEST(r.code == 2);
  BOOST_TEST(has(r.err, "unknown model config 'v5'; built-in configs are: v41-flash, tiny"));
  r = run({"info", "--config"});
  BOOST_TEST((r.code == 2 && has(r.err, "--config needs a value")));
  r = run({"info", "--bogus"});
  BOOST_TEST((r.code == 2 && has(r.err, "unknown option '--bogus'")));
  r = run({"frobnicate"});
  BOOST_TEST((r.code == 2 && has(r.err, "unknown command 'frobnicate'")));
  r = run({});
  BOOST_TEST((r.code == 2 && has(r.err, "usage: dsv4")));
  BOOST_TEST(run({"version"}).out == "dsv4 0.1.0\n");
}

BOOST_AUTO_TEST_SUITE_END()
