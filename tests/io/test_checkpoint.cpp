// Checkpoints: writer, sharded reader, validation against the schema with errors that name the
// tensor and the file; a random tiny checkpoint round trip.

#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "dsv4/io/checkpoint.hpp"
#include "dsv4/io/random_checkpoint.hpp"
#include "dsv4/models/checkpoint_schema.hpp"
#include "dsv4/models/tiny.hpp"
#include "support/errors.hpp"

using namespace dsv4;
using dsv4::test::throws_with;
namespace fs = std::filesystem;

namespace {
std::string scratch(const std::string& name) {
  const auto p = fs::temp_directory_path() / "dsv4_test_checkpoint" / name;
  fs::remove_all(p);
  return p.string();
}
}  // namespace

BOOST_AUTO_TEST_SUITE(checkpoint_io)

BOOST_AUTO_TEST_CASE(random_tiny_checkpoint_round_trips_and_validates) {
  const auto schema = models::checkpoint_schema<models::tiny>();
  const std::string dir = scratch("tiny");
  io::write_random_checkpoint(schema, dir, 8u << 20, 1234);
  io::checkpoint ck(dir);
  BOOST_TEST(ck.size() == schema.size());
  BOOST_CHECK_NO_THROW(ck.validate(schema));
  int shards = 0;
  for (const auto& e : fs::directory_iterator(dir)) shards += e.path().extension() == ".safetensors";
  BOOST_TEST(shards > 2);  // sharded by the 8 MiB limit
  const auto& t = ck.tensor("layers.20.attn.indexer.wk.weight");
  BOOST_TEST((t.shape == std::vector<long long>{64, 128}));
  BOOST_TEST(ck.file_of("embed.weight").find("model-1.safetensors") != std::string::npos);
  // The same seed writes the same bytes.
  const std::string dir2 = scratch("tiny2");
  io::write_random_checkpoint(schema, dir2, 8u << 20, 1234);
  io::checkpoint ck2(dir2);
  const auto& a = ck.tensor("layers.3.ffn.experts.2.w1.weight");
  const auto& b = ck2.tensor("layers.3.ffn.experts.2.w1.weight");
  BOOST_TEST(std::equal(a.bytes.begin(), a.bytes.end(), b.bytes.begin(), b.bytes.end()));
}

// The in-memory random checkpoint holds exactly the tensors the writer writes (both kinds of
// values), validates like a file, and refuses a tensor whose bytes do not fit its shape.
BOOST_AUTO_TEST_CASE(in_memory_random_checkpoint_equals_the_written_one) {
  const auto schema = models::checkpoint_schema<models::tiny>();
  for (const auto init : {io::random_init::codes, io::random_init::scaled}) {
    const std::string dir = scratch("in_memory");
    io::write_random_checkpoint(schema, dir, 8u << 20, 77, init);
    io::checkpoint file(dir);
    io::checkpoint mem = io::random_checkpoint_in_memory(schema, 77, init);
    BOOST_TEST(mem.size() == file.size());
    BOOST_CHECK_NO_THROW(mem.validate(schema));
    for (const auto& t : schema) {
      const auto& a = file.tensor(t.name);
      const auto& b = mem.tensor(t.name);
      BOOST_TEST((a.shape == b.shape && a.dtype == b.dtype), t.name);
      BOOST_TEST(std::equal(a.bytes.begin(), a.bytes.end(), b.bytes.begin(), b.bytes.end()), t.name);
    }
    BOOST_TEST(mem.file_of("embed.weight") == "(in memory)");
  }
  io::checkpoint ck = io::checkpoint::in_memory();
  BOOST_TEST(throws_with([&] { ck.add("norm.weight", io::st_dtype::BF16, {4, 3}, std::vector<std::uint8_t>(20)); },
                         "tensor 'norm.weight' of shape [4, 3] and dtype BF16 needs 24 bytes, got 20"));
  ck.add("norm.weight", io::st_dtype::BF16, {4, 3}, std::vector<std::uint8_t>(24));
  BOOST_TEST(throws_with([&] { ck.add("norm.weight", io::st_dtype::BF16, {4, 3}, std::vector<std::uint8_t>(24)); },
                         "two tensors map to 'norm.weight'"));
  BOOST_TEST(throws_with([&] { ck.validate(schema); }, "missing tensor 'embed.weight'"));
}

// Loading progress: each tensor counts once, when a loader first takes it; the printer speaks at
// tenths of the way and stays silent for small checkpoints.
BOOST_AUTO_TEST_CASE(loading_progress_counts_each_tensor_once) {
  auto ck = dsv4::io::checkpoint::in_memory();
  ck.add("a", dsv4::io::st_dtype::F32, {10}, std::vector<std::uint8_t>(40));
  ck.add("b", dsv4::io::st_dtype::BF16, {30}, std::vector<std::uint8_t>(60));
  BOOST_TEST(ck.total_bytes() == 100u);
  std::vector<std::pair<std::uint64_t, std::uint64_t>> calls;
  ck.on_progress([&](std::uint64_t taken, std::uint64_t total) { calls.emplace_back(taken, total); });
  ck.tensor("b"), ck.tensor("b"), ck.tensor("a");
  BOOST_TEST(calls.size() == 2u);
  BOOST_TEST((calls.at(0) == std::pair<std::uint64_t, std::uint64_t>{60, 100}));
  BOOST_TEST((calls.at(1) == std::pair<std::uint64_t, std::uint64_t>{100, 100}));

  std::ostringstream os;
  auto print = dsv4::io::load_progress_printer(os, "loading x", 1000);
  print(50, 999);  // under the threshold: silent
  BOOST_TEST(os.str().empty());
  print(0, 2'000'000'000), print(100'000'000, 2'000'000'000), print(250'000'000, 2'000'000'000), print(2'000'000'000, 2'000'000'000);
  BOOST_TEST(os.str() == "loading x: 0% (0.0 of 2.0 GB)\nloading x: 10% (0.2 of 2.0 GB)\nloading x: 100% (2.0 of 2.0 GB)\n");
}

// Loaders read layers on several threads (host_model::load): every tensor found, each counted
// once, the progress calls in increasing order ending at the total.
BOOST_AUTO_TEST_CASE(tensors_taken_from_several_threads_count_once) {
  const auto schema = models::checkpoint_schema<models::tiny>();
  const std::string dir = scratch("threads");
  io::write_random_checkpoint(schema, dir, 8u << 20, 5);
  io::checkpoint ck(dir);
  std::vector<std::uint64_t> taken;
  std::uint64_t total = 0;
  ck.on_progress([&](std::uint64_t t, std::uint64_t all) { taken.push_back(t), total = all; });
  std::vector<std::thread> pool;
  std::atomic<std::uint64_t> found{0};
  for (int w = 0; w < 6; ++w)
    pool.emplace_back([&, w] {
      for (std::size_t i = 0; i < schema.size(); ++i)  // each thread takes all, in its own order
        found += ck.tensor(schema[(i + std::size_t(w) * 7) % schema.size()].name).bytes.size();
    });
  for (auto& t : pool) t.join();
  BOOST_TEST(found.load() == 6 * ck.total_bytes());
  BOOST_TEST(taken.size() == schema.size());
  BOOST_TEST(std::is_sorted(taken.begin(), taken.end()));
  BOOST_TEST(taken.back() == total);
  BOOST_TEST(total == ck.total_bytes());
}

BOOST_AUTO_TEST_CASE(validation_names_tensor_and_file) {
  auto schema = models::checkpoint_schema<models::tiny>();
  const std::string dir = scratch("bad");
  auto written = schema;
  auto find = [&](const std::string& name) {
    for (std::size_t i = 0; i < written.size(); ++i)
      if (written[i].name == name) return i;
    BOOST_FAIL("no tensor " << name);
    return std::size_t(0);
  };
  written.erase(written.begin() + std::ptrdiff_t(find("layers.0.attn.wq_b.scale")));  // missing
  written[find("layers.0.attn.wkv.weight")].dtypes = {io::st_dtype::F32};             // wrong dtype
  written[find("layers.0.ffn.experts.0.w1.scale")].shape[0] += 1;                     // wrong shape
  io::write_random_checkpoint(written, dir, 64u << 20, 1);
  io::checkpoint ck(dir);
  try {
    ck.validate(schema);
    BOOST_FAIL("expected a validation error");
  } catch (const dsv4::error& e) {
    const std::string m = e.what();
    BOOST_TEST(m.find("3 problem(s)") != std::string::npos, m);
    BOOST_TEST(m.find("missing tensor 'layers.0.attn.wq_b.scale'") != std::string::npos, m);
    BOOST_TEST(m.find("model-1.safetensors: tensor 'layers.0.attn.wkv.weight' has dtype F32, expected F8_E4M3") !=
                   std::string::npos, m);
    BOOST_TEST(m.find("tensor 'layers.0.ffn.experts.0.w1.scale' has shape [129, 8], expected [128, 8]") != std::string::npos, m);
  }
}

BOOST_AUTO_TEST_CASE(broken_files_are_clear_errors) {
  const std::string dir = scratch("broken");
  fs::create_directories(dir);
  { std::ofstream(fs::path(dir) / "model.safetensors.index.json") << "{\"weight_map\": {\"x\": \"gone.safetensors\"}}"; }
  io::checkpoint ck(dir);
  BOOST_TEST(throws_with([&] { ck.tensor("x"); }, "gone.safetensors: cannot open"));
  BOOST_TEST(throws_with([&] { ck.tensor("y"); }, "no tensor named 'y'"));
  const std::string dir2 = scratch("empty");
  fs::create_directories(dir2);
  BOOST_TEST(throws_with([&] { io::checkpoint c(dir2); }, "needs model.safetensors.index.json or exactly one .safetensors file"));
  // A truncated shard.
  const std::string dir3 = scratch("truncated");
  io::write_random_checkpoint({{"w", {1000}, {io::st_dtype::F32}, false}}, dir3, 1u << 20, 3);
  const auto shard = fs::path(dir3) / "model-1.safetensors";
  fs::resize_file(shard, fs::file_size(shard) - 100);
  io::checkpoint ck3(dir3);
  BOOST_TEST(throws_with([&] { ck3.tensor("w"); }, "the file is truncated"));
}

// convert.py's renames (spec §16): HF-style names are found under their official names.
BOOST_AUTO_TEST_CASE(hf_style_names_map_to_official_names) {
  BOOST_TEST(io::official_tensor_name("model.layers.3.self_attn.wq_a.weight_scale_inv") == "layers.3.attn.wq_a.scale");
  BOOST_TEST(io::official_tensor_name("model.layers.3.mlp.gate.e_score_correction_bias") == "layers.3.ffn.gate.bias");
  BOOST_TEST(io::official_tensor_name("vision.blocks.0.mlp.w1.weight") == "vision.blocks.0.mlp.w1.weight");
  BOOST_TEST(io::official_tensor_name("layers.0.attn.wkv.weight") == "layers.0.attn.wkv.weight");
  BOOST_TEST(io::official_tensor_name("layers.0.attn.mlpx.weight") == "layers.0.attn.mlpx.weight");  // whole parts only
  const std::string dir = scratch("hf");
  io::write_random_checkpoint({{"model.layers.0.self_attn.wkv.weight_scale_inv", {2, 3}, {io::st_dtype::F8_E8M0}, false},
                               {"layers.0.attn.wkv.scale", {1}, {io::st_dtype::F32}, false}},
                              dir, 1u << 20, 5);
  BOOST_TEST(throws_with([&] { io::checkpoint c(dir); }, "two tensors map to 'layers.0.attn.wkv.scale'"));
  const std::string dir2 = scratch("hf2");
  io::write_random_checkpoint({{"model.layers.0.self_attn.wkv.weight_scale_inv", {2, 3}, {io::st_dtype::F8_E8M0}, false}},
                              dir2, 1u << 20, 5);
  io::checkpoint ck(dir2);
  BOOST_TEST((ck.tensor("layers.0.attn.wkv.scale").shape == std::vector<long long>{2, 3}));
  BOOST_CHECK_NO_THROW(ck.validate({{"layers.0.attn.wkv.scale", {2, 3}, {io::st_dtype::F8_E8M0}, false}}));
}

BOOST_AUTO_TEST_SUITE_END()
