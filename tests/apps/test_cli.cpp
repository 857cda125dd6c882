// The dsv4 command line, driven as a user drives it.

#include <boost/test/unit_test.hpp>

#include <cmath>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "dsv4/cli.hpp"
#include "dsv4/io/json.hpp"
#include "dsv4/io/npy.hpp"
#include "dsv4/models/config_json.hpp"

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
  r = run({"run", "--backend", "gpu"});
  BOOST_TEST((r.code == 2 && has(r.err, "--backend must be 'host' or 'cuda', got 'gpu'")));
  r = run({"run", "--backend", "cuda"});  // no backend registered: a build without CUDA
  BOOST_TEST((r.code == 2 && has(r.err, "built without CUDA")));
  r = run({"run", "--engram-tables", "host"});
  BOOST_TEST((r.code == 2 && has(r.err, "--engram-tables applies to --backend cuda")));
  r = run({"run", "--engram-tables", "disk"});
  BOOST_TEST((r.code == 2 && has(r.err, "--engram-tables must be 'device' or 'host', got 'disk'")));
  r = run({"run", "--gemm", "wgmma"});
  BOOST_TEST((r.code == 2 && has(r.err, "--gemm applies to --backend cuda")));
  r = run({"run", "--gemm", "tcgen05"});
  BOOST_TEST((r.code == 2 && has(r.err, "--gemm must be 'mma' or 'wgmma', got 'tcgen05'")));
  r = run({"run", "--decode-graphs", "on"});
  BOOST_TEST((r.code == 2 && has(r.err, "--decode-graphs applies to --backend cuda")));
  r = run({"run", "--decode-graphs", "yes"});
  BOOST_TEST((r.code == 2 && has(r.err, "--decode-graphs must be 'off' or 'on', got 'yes'")));
}

// The backend plumbing of `run`: a registered backend gets the loaded model, the prompt, the
// count, the sampling parameters and the prefill mode, and its tokens and device are printed.
BOOST_AUTO_TEST_CASE(run_hands_the_request_to_another_backend) {
  dsv4::cli::backends extra;
  int calls = 0;
  bool want_host_tables = false, want_drafter = false;
  extra.cuda = [&](const dsv4::model::host_model<dsv4::models::tiny>& m, const dsv4::cli::run_request& r) {
    ++calls;
    BOOST_TEST((r.dspark != nullptr) == want_drafter);
    BOOST_TEST(m.blocks.size() == std::size_t(dsv4::models::model_traits<dsv4::models::tiny>::schedule::num_layers));
    BOOST_TEST((std::vector<std::int32_t>(r.prompt.begin(), r.prompt.end()) == std::vector<std::int32_t>{5, 6, 7}));
    BOOST_TEST(r.n_new == 2);
    BOOST_TEST(r.sampling.seed == 9u);
    BOOST_TEST(r.ced);
    BOOST_TEST(r.engram_host_tables == want_host_tables);
    // Host tables: the model reads them in place from the checkpoint (no copy of its own).
    BOOST_TEST(!m.engrams.empty());
    for (const auto& e : m.engrams) BOOST_TEST((e.mapped_embed.data() != nullptr) == want_host_tables);
    if (r.dspark) {  // --speculative dspark: the drafter's weights, and its counts printed
      BOOST_TEST(r.dspark->block == dsv4::models::tiny::dims.dspark.dspark_block_size);
      dsv4::cli::generation g{{11, 12, 13}, 0, 0.75, "fake device"};
      g.speculative.rounds = 2, g.speculative.drafted = 5, g.speculative.accepted = 1;
      return g;
    }
    return dsv4::cli::generation{{11, 12}, 0.5, 0.25, "fake device"};
  };
  std::ostringstream out, err;
  const int code = dsv4::cli::run({"run", "--backend", "cuda", "--prompt", "5,6,7", "--tokens", "2", "--seed", "9", "--prefill", "ced"},
                                  out, err, extra);
  BOOST_TEST(code == 0, err.str());
  BOOST_TEST(calls == 1);
  BOOST_TEST(has(out.str(), ", fake device\n"));
  BOOST_TEST(has(out.str(), "generated: 11 12\n"));
  want_host_tables = true;
  std::ostringstream out1, err1;
  BOOST_TEST(dsv4::cli::run({"run", "--backend", "cuda", "--prompt", "5,6,7", "--tokens", "2", "--seed", "9", "--prefill", "ced",
                             "--engram-tables", "host"},
                            out1, err1, extra) == 0,
             err1.str());
  BOOST_TEST(calls == 2);
  want_drafter = true, want_host_tables = false;
  std::ostringstream out2, err2;
  BOOST_TEST(dsv4::cli::run({"run", "--backend", "cuda", "--speculative", "dspark", "--prompt", "5,6,7", "--tokens", "2", "--seed",
                             "9", "--prefill", "ced"},
                            out2, err2, extra) == 0,
             err2.str());
  BOOST_TEST(calls == 3);
  BOOST_TEST(has(out2.str(), "generated: 11 12 13\n"));
  BOOST_TEST(has(out2.str(), "2 rounds, 1 of 5 checked drafts accepted"));
}

// `run --speculative dspark` on the host backend: plain decoding's tokens, the prefill timed on its
// own, and the drafts' counts printed.
BOOST_AUTO_TEST_CASE(run_with_drafts_prints_plain_decodings_tokens_and_the_counts) {
  const result plain = run({"run", "--prompt", "3,1,4,1,5", "--tokens", "7", "--temperature", "0.7", "--seed", "2"});
  const result drafted =
      run({"run", "--prompt", "3,1,4,1,5", "--tokens", "7", "--temperature", "0.7", "--seed", "2", "--speculative", "dspark"});
  BOOST_TEST(plain.code == 0, plain.err);
  BOOST_TEST(drafted.code == 0, drafted.err);
  auto generated = [](const std::string& out) {
    const auto at = out.find("generated:");
    return at == std::string::npos ? std::string("(none)") : out.substr(at, out.find('\n', at) - at);
  };
  BOOST_TEST(generated(drafted.out) == generated(plain.out));
  BOOST_TEST(has(drafted.out, "host reference backend, DSpark drafts\n"), drafted.out);
  BOOST_TEST(has(drafted.out, "prefill: 5 tokens in "), drafted.out);
  BOOST_TEST(has(drafted.out, "decode: 6 tokens in "), drafted.out);
  BOOST_TEST(has(drafted.out, "speculative: DSpark drafts of " + std::to_string(dsv4::models::tiny::dims.dspark.dspark_block_size) +
                                  " tokens, "),
             drafted.out);
  BOOST_TEST(has(plain.out, "decode: 6 steps in "), plain.out);
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

// dsv4 logits: prefill then teacher-forced decode, one row of fp32 logits per step, as .npy; the
// decode rows equal a prefill of the longer prompt (the host model's decode = prefill property).
BOOST_AUTO_TEST_CASE(logits_writes_one_row_per_step) {
  const auto tmp = std::filesystem::temp_directory_path();
  const auto dir = (tmp / "dsv4_test_cli_logits_ckpt").string();
  const auto out = (tmp / "dsv4_test_cli_logits.npy").string(), out2 = (tmp / "dsv4_test_cli_logits2.npy").string();
  std::filesystem::remove_all(dir);
  result r = run({"random-checkpoint", dir, "--config", "tiny", "--seed", "3", "--init", "scaled"});
  BOOST_TEST(r.code == 0, r.err);
  BOOST_TEST(has(r.out, "(scaled init)"));
  r = run({"logits", "--checkpoint", dir, "--prompt", "5,6,7", "--decode", "8,9", "--out", out});
  BOOST_TEST(r.code == 0, r.err);
  BOOST_TEST(has(r.out, "wrote 3 x 1024 fp32 logits (prefill of 3 tokens, 2 decode steps) to " + out));
  const auto a = dsv4::io::read_npy_f32(out);
  BOOST_TEST((a.rows == 3 && a.cols == 1024));
  r = run({"logits", "--checkpoint", dir, "--prompt", "5,6,7,8", "--out", out2});
  BOOST_TEST(r.code == 0, r.err);
  const auto b = dsv4::io::read_npy_f32(out2);
  BOOST_TEST((b.rows == 1 && b.cols == 1024));
  bool same = true, finite = true;
  for (std::size_t i = 0; i < 1024; ++i) {
    same &= a.row(1)[i] == b.row(0)[i];
    for (std::size_t row = 0; row < 3; ++row) finite &= std::isfinite(a.row(row)[i]);
  }
  BOOST_TEST(same);
  BOOST_TEST(finite);
  // Bad input: each error names the problem, before any weight is read where it can.
  r = run({"logits", "--checkpoint", dir, "--prompt", "5,6", "--decode", "1024", "--out", out});
  BOOST_TEST((r.code == 2 && has(r.err, "token id 1024 is outside the vocabulary of tiny (1024 ids)")));
  r = run({"logits", "--checkpoint", dir, "--decode", "1", "--out", out});
  BOOST_TEST((r.code == 2 && has(r.err, "--prompt is required")));
  r = run({"logits", "--prompt", "1", "--out", out});
  BOOST_TEST((r.code == 2 && has(r.err, "--checkpoint is required")));
  r = run({"logits", "--checkpoint", dir, "--prompt", "1"});
  BOOST_TEST((r.code == 2 && has(r.err, "--out is required")));
  r = run({"logits", "--checkpoint", dir, "--prompt", "", "--out", out});
  BOOST_TEST((r.code == 2 && has(r.err, "--prompt needs at least one token id")));
  r = run({"logits", "--checkpoint", dir, "--prompt", "1,-2", "--out", out});
  BOOST_TEST((r.code == 2 && has(r.err, "--prompt needs a non-negative integer, got '-2'")));
  r = run({"logits", "--checkpoint", dir, "--prompt", "1", "--decode", "2,,3", "--out", out});
  BOOST_TEST((r.code == 2 && has(r.err, "--decode needs a non-negative integer, got ''")));
  r = run({"logits", "--config", "v41-flash", "--checkpoint", dir, "--prompt", "1", "--out", out});
  BOOST_TEST((r.code == 2 && has(r.err, "runs the tiny variant only")));
  r = run({"logits", "--checkpoint", dir, "--prompt", "1", "--out", out, "--index-keys", "sideways"});
  BOOST_TEST((r.code == 2 && has(r.err, "--index-keys is 'ownership' or 'upstream', got 'sideways'")));
  r = run({"logits", "--checkpoint", "/nonexistent/ckpt", "--prompt", "1", "--out", out});
  BOOST_TEST((r.code == 2 && has(r.err, "/nonexistent/ckpt")));
  r = run({"logits", "--checkpoint", dir, "--prompt", "1", "--out", "/nonexistent/dir/x.npy"});
  BOOST_TEST((r.code == 2 && has(r.err, "/nonexistent/dir/x.npy: cannot open for writing")));
  BOOST_TEST(has(run({"random-checkpoint", dir, "--init", "fancy"}).err, "unknown random initialisation 'fancy' (codes or scaled)"));
  std::filesystem::remove_all(dir);
  std::filesystem::remove(out);
  std::filesystem::remove(out2);
}

// dsv4 config-json writes the official file's format from the types: for V4.1 Flash the official
// file's keys in its order with its values; for tiny a file its own comparison accepts.
BOOST_AUTO_TEST_CASE(config_json_round_trips) {
  result r = run({"config-json", "--config", "v41-flash"});
  BOOST_TEST(r.code == 0, r.err);
  const auto written = dsv4::io::parse_json(r.out, "config-json output");
  const auto official = dsv4::io::parse_json_file(std::string(DSV4_TEST_DATA) + "/v41_inference_config.json");
  BOOST_TEST(dsv4::models::compare_config_json<dsv4::models::v41_flash>(written).empty());
  BOOST_TEST(written.object().size() == official.object().size());
  for (const auto& [key, value] : official.object()) BOOST_TEST(written.object().count(key) == 1, key);
  BOOST_TEST(has(r.out, "\"norm_eps\": 1e-20,\n"));
  BOOST_TEST(has(r.out, "\"vision_max_wh_ratio\": null,\n"));
  const auto tmp = std::filesystem::temp_directory_path();
  const auto cfg = (tmp / "dsv4_test_cli_tiny_config.json").string(), mult = (tmp / "dsv4_test_cli_tiny_mult.json").string();
  r = run({"config-json", "--out", cfg, "--multipliers", mult});
  BOOST_TEST(r.code == 0, r.err);
  BOOST_TEST(has(r.out, "wrote the config.json of tiny to " + cfg));
  BOOST_TEST(dsv4::models::compare_config_json<dsv4::models::tiny>(dsv4::io::parse_json_file(cfg)).empty());
  const auto m = dsv4::io::parse_json_file(mult);
  const auto& rows = m.object().at("engram_hash_multipliers").array();
  BOOST_TEST(rows.size() == 2u);
  BOOST_TEST(rows[1].array()[3].integer == dsv4::models::tiny::engram_multipliers[1][3]);
  BOOST_TEST(has(run({"config-json", "--config", "v9"}).err, "unknown model config 'v9'"));
  BOOST_TEST(has(run({"config-json", "extra"}).err, "unexpected argument 'extra'"));
  std::filesystem::remove(cfg);
  std::filesystem::remove(mult);
}

// token-map: the synthetic DeepSeek-shaped tokenizer (348 tokens, 270 compressed ids), its map file
// read back, the config check's message, and the missing option.
BOOST_AUTO_TEST_CASE(token_map_builds_checks_and_writes) {
  const std::string tok = std::string(DSV4_TEST_DATA) + "/engram/tokenizer.json";
  const auto path = (std::filesystem::temp_directory_path() / "dsv4_test_cli_token_map.txt").string();
  result r = run({"token-map", "--tokenizer", tok, "--out", path});
  BOOST_TEST(r.code == 0, r.err);
  BOOST_TEST(has(r.out, ": 348 tokens, 270 compressed ids\n"), r.out);
  BOOST_TEST(has(r.out, "wrote the map to " + path));
  const auto m = dsv4::engram::load_token_map(path);
  BOOST_TEST(m.compressed_vocab_size == 270);
  BOOST_TEST(m.ids == dsv4::engram::build_token_map(dsv4::engram::read_tokenizer_vocabulary(tok)).ids);
  r = run({"token-map", "--tokenizer", tok, "--config", "v41-flash"});
  BOOST_TEST(r.code == 2);
  BOOST_TEST(has(r.err, "270 compressed ids, but v41-flash's config has engram_compressed_vocab_size 99092"),
             r.err);
  BOOST_TEST(has(run({"token-map"}).err, "--tokenizer FILE (a tokenizer.json) is required"));
  BOOST_TEST(
      has(run({"token-map", "--tokenizer", "/nonexistent.json"}).err, "/nonexistent.json: cannot open"));
  std::filesystem::remove(path);
}

BOOST_AUTO_TEST_SUITE_END()
