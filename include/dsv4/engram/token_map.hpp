#pragma once
//! \file
//! The Engram compressed token map (spec §10; engram.py's `build_compressed_token_map`): token id
//! -> compressed id, where tokens whose text normalizes alike share an id (" The", "the" and "THE"
//! hash the same way). The number of compressed ids sets every hash multiplier, so it must equal the
//! config's `engram_compressed_vocab_size` (99092 for V4.1 Flash).
//!
//! For every id 0 .. len(tokenizer) - 1, in order:
//!   1. text = the token decoded on its own (tokenizers' ByteLevel decoder: the token's characters
//!      mapped back to bytes through GPT-2's byte alphabet, or the token's own UTF-8 bytes if one
//!      character is outside that alphabet; then UTF-8 with U+FFFD for invalid sequences);
//!   2. if text contains U+FFFD (a partial UTF-8 token), key = the raw token string;
//!      else key = normalize_token_text(text), or text itself if that is empty;
//!   3. a key seen for the first time gets the next compressed id (0, 1, 2, ...).
//! normalize_token_text is tokenizers' normalizer chain NFKC, NFD, StripAccents, Lowercase,
//! Replace([ \t\r\n]+ -> " "), Replace(^ $ -> U+E000), Strip, Replace(U+E000 -> " ") (unicode.hpp
//! says which Unicode version each step answers to).
//!
//! Three ways to get a map:
//!   - `build_token_map(read_tokenizer_vocabulary("tokenizer.json"))`: from the checkpoint's
//!     tokenizer.json (Hugging Face format, byte-level BPE);
//!   - `load_token_map("map.txt")`: a map written by save_token_map or by the reference (format
//!     below);
//!   - `build_token_map(tokens)` from any list of byte-level token strings by id
//!     (`build_token_map(raw_tokens, decoded_texts)` for a tokenizer with another decoder).
//! Then `token_map_for_model<Model>(map)` checks the size against the config and returns the vector
//! `model::host_model<Model>::load(checkpoint, token_map)` takes.
//!
//! Map file format (text): lines starting with '#' are comments; every other line is one decimal
//! compressed id, the k-th such line for token id k. The ids must be in first-seen order (token 0
//! has id 0, and each id is at most one more than the largest before it), which is how the reference
//! assigns them; the compressed vocabulary size is the largest id + 1. From the reference:
//!   lookup, n = build_compressed_token_map(tokenizer)
//!   open("map.txt", "w").write("".join(f"{i}\n" for i in lookup))

#include <cstdint>
#include <fstream>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/engram/unicode.hpp"
#include "dsv4/io/json.hpp"

namespace dsv4::engram {

//! A compressed token map: ids[token id] = compressed id, all in [0, compressed_vocab_size).
struct token_map {
  std::vector<std::int64_t> ids;
  std::int64_t compressed_vocab_size = 0;
};

// ----------------------------------------------------------------------------------------------
// Decoding one token, normalizing its text, its key

//! GPT-2's byte alphabet (tokenizers' `bytes_char`): the printable bytes '!'..'~', 0xA1..0xAC and
//! 0xAE..0xFF stand for themselves; the other 68 bytes, in increasing order, are U+0100, U+0101, ...
//! Returns the byte of code point `c`, or -1 if `c` is not in the alphabet.
inline int byte_level_byte(char32_t c) {
  static const std::vector<int> byte_of = [] {
    std::vector<int> t(0x100 + 68, -1);
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      t[std::size_t(printable ? b : 0x100 + n++)] = b;
    }
    return t;
  }();
  return c < byte_of.size() ? byte_of[c] : -1;
}

//! A token decoded on its own by tokenizers' ByteLevel decoder: its characters as bytes of the
//! byte alphabet (or, if any character is outside it, the token's own UTF-8 bytes: added tokens
//! such as "<｜begin▁of▁sentence｜>"), then UTF-8 decoded with U+FFFD for invalid sequences.
inline std::string byte_level_decode(std::string_view token) {
  std::string bytes;
  bytes.reserve(token.size());
  for (const char32_t c : unicode::decode_utf8_lossy(token)) {
    const int b = byte_level_byte(c);
    if (b < 0) {
      bytes.assign(token);
      break;
    }
    bytes += char(b);
  }
  return unicode::encode_utf8(unicode::decode_utf8_lossy(bytes));
}

//! engram.py's normalizer chain on `text` (UTF-8): NFKC, NFD, strip marks, lower case, runs of
//! [ \t\r\n] to one space, a lone space to U+E000, strip White_Space at both ends, U+E000 to space.
//! A token that is exactly whitespace of those four kinds keeps one space; any other U+E000 in the
//! text also becomes a space (the reference's last Replace does that too).
inline std::string normalize_token_text(std::string_view text) {
  namespace u = unicode;
  const std::u32string stripped = u::strip_marks(u::nfd(u::nfkc(u::decode_utf8_lossy(text))));
  std::u32string s;  // Lowercase, then Replace(Regex("[ \t\r\n]+"), " ")
  s.reserve(stripped.size());
  bool in_run = false;
  for (const char32_t c : u::lowercase(stripped)) {
    const bool ws = c == U' ' || c == U'\t' || c == U'\r' || c == U'\n';
    if (!ws) s += c;
    else if (!in_run) s += U' ';
    in_run = ws;
  }
  // Replace(Regex("^ $"), U+E000): in Oniguruma's default (Ruby) syntax ^ and $ are line anchors,
  // but no '\n' is left, so this matches exactly the string " ".
  constexpr char32_t sentinel = 0xE000;
  if (s == U" ") s = std::u32string(1, sentinel);
  std::size_t b = 0, e = s.size();  // Strip: White_Space at both ends
  while (b < e && u::is_white_space(s[b])) ++b;
  while (e > b && u::is_white_space(s[e - 1])) --e;
  std::u32string out = s.substr(b, e - b);
  for (char32_t& c : out)  // Replace(sentinel, " ")
    if (c == sentinel) c = U' ';
  return u::encode_utf8(out);
}

//! The dictionary key of one token (engram.py): the raw token if its decoded text holds U+FFFD,
//! else its normalized text, or the decoded text itself when that normalizes to nothing.
inline std::string compression_key(std::string_view raw_token, std::string_view text) {
  if (text.find("\xEF\xBF\xBD") != std::string_view::npos) return std::string(raw_token);  // U+FFFD
  std::string n = normalize_token_text(text);
  return n.empty() ? std::string(text) : n;
}

// ----------------------------------------------------------------------------------------------
// Building, checking

//! The map from decoded texts and raw tokens by id (any decoder): texts[id] is the token decoded
//! on its own, raw_tokens[id] its string in the vocabulary.
inline token_map build_token_map(std::span<const std::string> raw_tokens, std::span<const std::string> texts) {
  if (raw_tokens.size() != texts.size())
    throw error("build_token_map: " + std::to_string(raw_tokens.size()) + " raw tokens but " +
                std::to_string(texts.size()) + " decoded texts");
  token_map m;
  m.ids.resize(raw_tokens.size());
  std::unordered_map<std::string, std::int64_t> seen;
  seen.reserve(raw_tokens.size());
  for (std::size_t id = 0; id < raw_tokens.size(); ++id) {
    const auto [it, fresh] = seen.try_emplace(compression_key(raw_tokens[id], texts[id]), m.compressed_vocab_size);
    if (fresh) ++m.compressed_vocab_size;
    m.ids[id] = it->second;
  }
  return m;
}

//! The map of a byte-level BPE vocabulary: tokens[id] is token id's string as tokenizer.json
//! stores it (GPT-2 byte alphabet; added tokens as written). An id the tokenizer has no token for
//! is an empty string: the reference decodes it to "" and keys it by "".
inline token_map build_token_map(std::span<const std::string> tokens) {
  std::vector<std::string> texts;
  texts.reserve(tokens.size());
  for (const auto& t : tokens) texts.push_back(byte_level_decode(t));
  return build_token_map(tokens, texts);
}

//! Throws unless every id is in [0, compressed_vocab_size) and the ids are in first-seen order
//! (how the reference assigns them). `source` names the map in the message.
inline void check_first_seen_order(const token_map& m, const std::string& source) {
  std::int64_t next = 0;
  for (std::size_t t = 0; t < m.ids.size(); ++t) {
    const std::int64_t v = m.ids[t];
    if (v < 0 || v > next)
      throw error(source + ": token " + std::to_string(t) + " has compressed id " + std::to_string(v) +
                  (v < 0 ? " (negative)" : "; ids must appear in first-seen order, and the largest so far is " +
                                                 std::to_string(next - 1)));
    if (v == next) ++next;
  }
  if (next != m.compressed_vocab_size)
    throw error(source + ": " + std::to_string(next) + " distinct compressed ids, but the size says " +
                std::to_string(m.compressed_vocab_size));
}

//! The check engram.py asserts: the compressed vocabulary must have the config's size (every
//! hash multiplier is derived from it), and the map must cover no more ids than the model has.
template <class Model>
void check_token_map(const token_map& m) {
  constexpr auto c = Model::dims;
  const std::int64_t want = c.engram.engram_compressed_vocab_size;
  if (m.compressed_vocab_size != want)
    throw error(std::string("engram token map: ") + std::to_string(m.compressed_vocab_size) +
                " compressed ids, but " + Model::name + "'s config has engram_compressed_vocab_size " +
                std::to_string(want) + " (the hash multipliers derive from it; is this the model's tokenizer?)");
  if (m.ids.size() > std::size_t(c.vocab_size))
    throw error(std::string("engram token map: ") + std::to_string(m.ids.size()) + " token ids, more than " +
                Model::name + "'s vocabulary of " + std::to_string(c.vocab_size));
  if (m.ids.size() <= std::size_t(c.engram.engram_pad_id))
    throw error(std::string("engram token map: ") + std::to_string(m.ids.size()) +
                " token ids do not include the Engram pad id " + std::to_string(c.engram.engram_pad_id));
}

//! The map as `model::host_model<Model>::load` takes it (one entry per vocabulary row), after
//! check_token_map. The embedding has more rows than the tokenizer has tokens (V4.1: 129280); the
//! reference has no compressed id for those rows (indexing its map with one fails), dsv4 gives
//! them the pad token's compressed id, so a sampled padding id hashes like the pad token.
template <class Model>
std::vector<std::int64_t> token_map_for_model(const token_map& m) {
  check_token_map<Model>(m);
  std::vector<std::int64_t> ids = m.ids;
  ids.resize(std::size_t(Model::dims.vocab_size), m.ids[std::size_t(Model::dims.engram.engram_pad_id)]);
  return ids;
}

// ----------------------------------------------------------------------------------------------
// tokenizer.json

namespace detail {
[[noreturn]] inline void fail_at(const std::string& source, const std::string& why) { throw error(source + ": " + why); }
}  // namespace detail

//! The raw token strings by id of a Hugging Face tokenizer.json (`doc`, read from `source`), as
//! `len(tokenizer)` ids: tokenizers counts the distinct strings of the model vocabulary and the
//! added tokens; an added token's content takes precedence over the model's string for its id (as
//! tokenizers' id_to_token does); an id with no string stays empty. Only what engram.py relies on
//! is accepted: a BPE model and the ByteLevel decoder. Errors name the file and the field.
inline std::vector<std::string> tokenizer_vocabulary(const io::json& doc, const std::string& source) {
  const auto fail = [&](const std::string& why) { detail::fail_at(source, why); };
  if (!doc.is_object()) fail("not a JSON object");
  const auto& top = doc.object();
  const auto field = [](const io::json_object& o, std::string_view key) -> const io::json* {
    const auto it = o.find(key);
    return it == o.end() ? nullptr : &it->second;
  };
  const io::json* model = field(top, "model");
  if (!model || !model->is_object()) { fail("no \"model\" object"); }
  if (const io::json* type = field(model->object(), "type"); type && (!type->is_string() || type->string() != "BPE"))
    fail("model.type is " + (type->is_string() ? "\"" + type->string() + "\"" : std::string("not a string")) +
         "; the Engram token map supports byte-level BPE tokenizers only");
  const io::json* vocab = field(model->object(), "vocab");
  if (!vocab || !vocab->is_object()) fail("no model.vocab object");
  const io::json* decoder = field(top, "decoder");
  const io::json* dtype = decoder && decoder->is_object() ? field(decoder->object(), "type") : nullptr;
  if (!dtype || !dtype->is_string() || dtype->string() != "ByteLevel")
    fail("decoder is not {\"type\": \"ByteLevel\"}; the Engram token map decodes tokens as tokenizers' "
         "ByteLevel decoder does and supports no other");
  const io::json* normalizer = field(top, "normalizer");
  const bool trivial_normalizer =
      !normalizer || std::holds_alternative<std::nullptr_t>(normalizer->value) ||
      (normalizer->is_object() && [&] {
        const io::json* t = field(normalizer->object(), "type");
        const io::json* list = field(normalizer->object(), "normalizers");
        return t && t->is_string() && t->string() == "Sequence" && list && list->is_array() && list->array().empty();
      }());

  struct entry { std::string token; std::int64_t id; };
  std::vector<entry> model_tokens, added;
  std::unordered_set<std::string> distinct;
  for (const auto& [token, id] : vocab->object()) {
    if (!id.is_number() || !id.integral || id.integer < 0)
      fail("model.vocab[\"" + token + "\"] is not a non-negative integer id");
    model_tokens.push_back({token, id.integer});
    distinct.insert(token);
  }
  if (const io::json* list = field(top, "added_tokens"); list && !std::holds_alternative<std::nullptr_t>(list->value)) {
    if (!list->is_array()) fail("added_tokens is not an array");
    for (std::size_t i = 0; i < list->array().size(); ++i) {
      const io::json& a = list->array()[i];
      const std::string where = "added_tokens[" + std::to_string(i) + "]";
      if (!a.is_object()) fail(where + " is not an object");
      const io::json* id = field(a.object(), "id");
      const io::json* content = field(a.object(), "content");
      if (!id || !id->is_number() || !id->integral || id->integer < 0) fail(where + ".id is not a non-negative integer");
      if (!content || !content->is_string()) fail(where + ".content is not a string");
      const io::json* normalized = field(a.object(), "normalized");
      if (!trivial_normalizer && normalized && std::holds_alternative<bool>(normalized->value) &&
          std::get<bool>(normalized->value))
        fail(where + " (\"" + content->string() + "\") is normalized by the tokenizer's own normalizer, which "
             "recent tokenizers versions apply before decoding it; the Engram token map does not support that");
      added.push_back({content->string(), id->integer});
      distinct.insert(content->string());
    }
  }
  const std::size_t n = distinct.size();  // len(tokenizer): get_vocab_size(with_added_tokens=True)
  std::vector<std::string> tokens(n);
  std::vector<char> from_added(n, 0), filled(n, 0);
  const auto place = [&](const entry& e, bool is_added, const char* what) {
    if (std::uint64_t(e.id) >= n)
      fail(std::string(what) + " \"" + e.token + "\" has id " + std::to_string(e.id) + ", but the tokenizer has " +
           std::to_string(n) + " distinct tokens (len(tokenizer)); the reference would give it no compressed id");
    const std::size_t i = std::size_t(e.id);
    if (filled[i] && from_added[i] == char(is_added) && tokens[i] != e.token)
      fail(std::string("id ") + std::to_string(e.id) + " belongs to two " + what + "s: \"" + tokens[i] + "\" and \"" +
           e.token + "\"");
    if (is_added || !from_added[i]) tokens[i] = e.token;
    from_added[i] = char(from_added[i] || is_added);
    filled[i] = 1;
  };
  for (const auto& e : model_tokens) place(e, false, "model token");
  for (const auto& e : added) place(e, true, "added token");
  return tokens;
}

//! tokenizer_vocabulary of the tokenizer.json file at `path`.
inline std::vector<std::string> read_tokenizer_vocabulary(const std::string& path) {
  return tokenizer_vocabulary(io::parse_json_file(path), path);
}

// ----------------------------------------------------------------------------------------------
// Map files

//! Parse a map file's text (format in the file comment); `source` names it in errors, with the line.
inline token_map parse_token_map(std::string_view text, const std::string& source) {
  token_map m;
  std::size_t line_no = 0, pos = 0;
  while (pos < text.size()) {
    std::size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (!line.empty() && line.front() == '#') continue;
    const auto bad = [&](const std::string& why) {
      throw error(source + ":" + std::to_string(line_no) + ": " + why + " (line \"" +
                  std::string(line.substr(0, 40)) + "\")");
    };
    if (line.empty()) bad("empty line; expected one compressed id");
    std::int64_t v = 0;
    for (const char ch : line) {
      if (ch < '0' || ch > '9') bad("not a non-negative decimal integer");
      if (v > (INT64_MAX - (ch - '0')) / 10) bad("number too large");
      v = v * 10 + (ch - '0');
    }
    const std::int64_t token = std::int64_t(m.ids.size());
    if (v > m.compressed_vocab_size)
      bad("token " + std::to_string(token) + " has compressed id " + std::to_string(v) +
          "; ids must appear in first-seen order (the next new id is " + std::to_string(m.compressed_vocab_size) + ")");
    if (v == m.compressed_vocab_size) ++m.compressed_vocab_size;
    m.ids.push_back(v);
  }
  if (m.ids.empty()) throw error(source + ": no compressed ids (an empty token map)");
  return m;
}

//! Read a map file (format in the file comment).
inline token_map load_token_map(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw error(path + ": cannot open the token map");
  std::stringstream ss;
  ss << f.rdbuf();
  return parse_token_map(ss.str(), path);
}

//! Write `m` in the map file format, with a comment line that says what it is.
inline void save_token_map(const std::string& path, const token_map& m) {
  check_first_seen_order(m, "save_token_map");
  std::ofstream f(path, std::ios::binary);
  if (!f) throw error(path + ": cannot write the token map");
  f << "# dsv4 Engram compressed token map: line k (after comments) = compressed id of token k; " << m.ids.size()
    << " tokens, " << m.compressed_vocab_size << " compressed ids\n";
  for (const std::int64_t v : m.ids) f << v << '\n';
  if (!f) throw error(path + ": write failed");
}

}  // namespace dsv4::engram
