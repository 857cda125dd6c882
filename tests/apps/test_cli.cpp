// The dsv4 command line, driven as a user drives it.

#include <boost/test/unit_test.hpp>

#include <filesystem>
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

// dsv4 run: the host backend's limits are errors that say so, before any weight is loaded.
BOOST_AUTO_TEST_CASE(run_rejects_what_it_cannot_do) {
  result r = run({"run", "--config", "v41-flash"});
  BOOST_TEST((r.code == 2 && has(r.err, "runs the tiny variant only")));
  r = run({"run", "--config", "v5"});
  BOOST_TEST((r.code == 2 && has(r.err, "unknown model config 'v5'")));
  r = run({"run", "--prompt", "1,x"});
  BOOST_TEST((r.code == 2 && has(r.err, "--prompt needs a non-negative integer, got 'x'")));
  r = run({"run", "--temperature", "warm"});
  BOOST_TEST((r.code == 2 && has(r.err, "--temperature needs a number")));
  r = run({"run", "extra"});
  BOOST_TEST((r.code == 2 && has(r.err, "unexpected argument 'extra'")));
}

// A user writes a random tiny checkpoint and checks it; a checkpoint of the wrong config is
// rejected with the problems listed.
BOOST_AUTO_TEST_CASE(random_checkpoint_then_check) {
  const auto dir = (std::filesystem::temp_directory_path() / "dsv4_test_cli_ckpt").string();
  std::filesystem::remove_all(dir);
  result r = run({"random-checkpoint", dir, "--config", "tiny", "--seed", "7", "--shard-mib=4"});
  BOOST_TEST(r.code == 0, r.err);
  BOOST_TEST(has(r.out, "random tensors of tiny"));
  r = run({"check-checkpoint", dir, "--config=tiny"});
  BOOST_TEST(r.code == 0, r.err);
  BOOST_TEST(has(r.out, "present with the right dtype and shape"));
  const std::string official = std::string(DSV4_TEST_DATA) + "/v41_inference_config.json";
  r = run({"check-checkpoint", dir, "--config", "tiny", "--config-json", official});
  BOOST_TEST(r.code == 2);
  BOOST_TEST(has(r.err, "does not match tiny"));
  BOOST_TEST(has(r.err, "key 'dim' is 5120.000000, the model has 256.000000"));
  // The same checkpoint runs the model.
  r = run({"run", "--checkpoint", dir, "--prompt", "3,4", "--tokens", "2", "--temperature", "0"});
  BOOST_TEST(r.code == 0, r.err);
  BOOST_TEST(has(r.out, "model: tiny from " + dir));
  BOOST_TEST(has(r.out, "prompt: 3 4\ngenerated: "));
  r = run({"run", "--checkpoint", "/nonexistent/ckpt", "--tokens", "1"});
  BOOST_TEST((r.code == 2 && has(r.err, "/nonexistent/ckpt")));
  r = run({"check-checkpoint", dir, "--config", "v41-flash"});
  BOOST_TEST(r.code == 2);
  BOOST_TEST(has(r.err, "checkpoint does not match the model"));
  BOOST_TEST(has(r.err, "has shape"));
  BOOST_TEST(run({"random-checkpoint", dir, "--seed", "x"}).code == 2);
  BOOST_TEST(has(run({"random-checkpoint", dir, "--seed", "x"}).err, "--seed needs a non-negative integer, got 'x'"));
  BOOST_TEST(has(run({"check-checkpoint"}).err, "give exactly one checkpoint path"));
  BOOST_TEST(has(run({"check-checkpoint", "/nonexistent/path.safetensors"}).err, "/nonexistent/path.safetensors: cannot open"));
  BOOST_TEST(has(run({"random-checkpoint", dir, "--config", "v9"}).err, "unknown model config 'v9'"));
  // V4.1 Flash is 510 GB: refused before anything is written. (Only tried where it cannot fit, so
  // the test never writes half a terabyte.)
  if (std::filesystem::space(std::filesystem::temp_directory_path()).available < (475ull << 30)) {
    const auto dir41 = (std::filesystem::temp_directory_path() / "dsv4_test_cli_v41").string();
    r = run({"random-checkpoint", dir41, "--config", "v41-flash"});
    BOOST_TEST(r.code == 2);
    BOOST_TEST(has(r.err, "needs 486646 MiB"));
    BOOST_TEST(std::filesystem::is_empty(dir41));
    std::filesystem::remove_all(dir41);
  }
}

BOOST_AUTO_TEST_SUITE_END()
