// JSON and safetensors readers (io/): valid input round-trips; every malformed input is an error
// that names the file and the problem.

#include <boost/test/unit_test.hpp>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "dsv4/io/json.hpp"
#include "dsv4/io/safetensors.hpp"
#include "support/data.hpp"
#include "support/errors.hpp"

using namespace dsv4;
using dsv4::test::throws_with;

namespace {

// Writes a safetensors file from a header string and raw data.
std::string write_file(const std::string& name, const std::string& header, const std::vector<std::uint8_t>& data,
                       long long header_len_override = -1) {
  const auto dir = std::filesystem::temp_directory_path() / "dsv4_test_io";
  std::filesystem::create_directories(dir);
  const std::string path = (dir / name).string();
  std::ofstream f(path, std::ios::binary);
  const std::uint64_t len = header_len_override >= 0 ? std::uint64_t(header_len_override) : header.size();
  f.write(reinterpret_cast<const char*>(&len), 8);
  f.write(header.data(), std::streamsize(header.size()));
  f.write(reinterpret_cast<const char*>(data.data()), std::streamsize(data.size()));
  return path;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(io_suite)

BOOST_AUTO_TEST_CASE(json_parses_documents) {
  const auto j = io::parse_json(R"({"a": [1, -2.5e3, true, null], "s": "x\"\u00e9\ud83d\ude00", "big": 510286023000})",
                                "test");
  const auto& o = j.object();
  BOOST_TEST(o.at("a").array().size() == 4u);
  BOOST_TEST(o.at("a").array()[0].integer == 1);
  BOOST_TEST(o.at("a").array()[1].number() == -2500.0);
  BOOST_TEST(!o.at("a").array()[1].integral);
  BOOST_TEST(o.at("s").string() == "x\"\xc3\xa9\xf0\x9f\x98\x80");
  BOOST_TEST(o.at("big").integer == 510286023000ll);
}

BOOST_AUTO_TEST_CASE(json_errors_name_source_and_offset) {
  BOOST_TEST(throws_with([] { io::parse_json("{\"a\": 1} x", "cfg.json"); }, "cfg.json: invalid JSON at byte 9"));
  BOOST_TEST(throws_with([] { io::parse_json("{\"a\": 1, \"a\": 2}", "cfg.json"); }, "duplicate key \"a\""));
  BOOST_TEST(throws_with([] { io::parse_json("\"abc", "cfg.json"); }, "unterminated string"));
  BOOST_TEST(throws_with([] { io::parse_json("[1,", "cfg.json"); }, "unexpected end of input"));
  BOOST_TEST(throws_with([] { io::parse_json("99999999999999999999", "cfg.json"); }, "does not fit in 64 bits"));
  // JSON's number grammar, and double's range (a value below it is a subnormal or zero, as strtod
  // gives; one above it is an error that names the number).
  BOOST_TEST(throws_with([] { io::parse_json("01", "cfg.json"); }, "must not have leading zeros"));
  BOOST_TEST(throws_with([] { io::parse_json("[1.]", "cfg.json"); }, "expected digits after the decimal point"));
  BOOST_TEST(throws_with([] { io::parse_json("[1e]", "cfg.json"); }, "expected digits in the exponent"));
  BOOST_TEST(throws_with([] { io::parse_json("-1e999", "cfg.json"); }, "number -1e999 is out of range"));
  BOOST_TEST(io::parse_json("1e-310", "cfg.json").number() == 1e-310);
  BOOST_TEST(io::parse_json("1e-999", "cfg.json").number() == 0.0);
  BOOST_TEST(io::parse_json("0.5", "cfg.json").number() == 0.5);
  // Strings must be well-formed UTF-8; a \u escape must not leave a lone surrogate.
  BOOST_TEST(throws_with([] { io::parse_json("\"a\xff\"", "cfg.json"); }, "invalid UTF-8 in string"));
  BOOST_TEST(throws_with([] { io::parse_json("\"\xc0\xaf\"", "cfg.json"); }, "invalid UTF-8 in string"));  // overlong '/'
  BOOST_TEST(throws_with([] { io::parse_json("\"\xed\xa0\x80\"", "cfg.json"); }, "invalid UTF-8 in string"));  // a surrogate
  BOOST_TEST(throws_with([] { io::parse_json(R"("\udc00")", "cfg.json"); }, "unpaired low surrogate"));
  BOOST_TEST(io::parse_json("\"\xef\xbf\xbd\xf0\x9f\x98\x80\"", "cfg.json").string() == "\xef\xbf\xbd\xf0\x9f\x98\x80");
}

BOOST_AUTO_TEST_CASE(safetensors_reads_the_reference_vectors) {
  io::safetensors_file f(test::data_path("reference/sparse_attn.safetensors"));
  const auto& kv = f.tensor("kv", io::st_dtype::BF16, {2, 700, 512});
  BOOST_TEST(kv.numel() == 2 * 700 * 512);
  BOOST_TEST(f.contains("topk_idxs"));
  BOOST_TEST(throws_with([&] { f.tensor("kv", io::st_dtype::F32, {2, 700, 512}); },
                         "tensor 'kv' has dtype BF16, expected F32"));
  BOOST_TEST(throws_with([&] { f.tensor("kv", io::st_dtype::BF16, {2, 512}); },
                         "tensor 'kv' has shape [2, 700, 512], expected [2, 512]"));
  BOOST_TEST(throws_with([&] { f.tensor("missing"); }, "no tensor named 'missing'"));
}

BOOST_AUTO_TEST_CASE(safetensors_rejects_malformed_files) {
  const std::vector<std::uint8_t> data(8, 0);
  const std::string ok = R"({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "__metadata__": {"format": "pt"}})";
  {
    io::safetensors_file f(write_file("ok.safetensors", ok, data));
    BOOST_TEST(f.tensor("t").numel() == 2);
    BOOST_TEST(f.metadata().at("format") == "pt");
  }
  BOOST_TEST(throws_with([&] { io::safetensors_file f(write_file("short.safetensors", "", {}, 1000)); },
                         "truncated: header claims 1000 bytes"));
  BOOST_TEST(throws_with(
      [&] { io::safetensors_file f(write_file("dtype.safetensors", R"({"t": {"dtype": "F7", "shape": [2], "data_offsets": [0, 8]}})", data)); },
      "tensor 't': unknown dtype 'F7'"));
  BOOST_TEST(throws_with(
      [&] { io::safetensors_file f(write_file("shape.safetensors", R"({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", data)); },
      "shape [3] of F32 needs 12 bytes but data_offsets span 8"));
  BOOST_TEST(throws_with(
      [&] { io::safetensors_file f(write_file("range.safetensors", R"({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", data)); },
      "lies beyond the data section"));
  BOOST_TEST(throws_with([&] { io::safetensors_file f(write_file("json.safetensors", "{\"t\": ", data)); }, "invalid JSON"));
  BOOST_TEST(throws_with([&] { io::safetensors_file f("/nonexistent/x.safetensors"); }, "/nonexistent/x.safetensors: cannot open"));
}

BOOST_AUTO_TEST_SUITE_END()
