#pragma once
//! \file
//! A small, strict JSON reader for the files dsv4 reads: safetensors headers, config.json,
//! model.safetensors.index.json. Errors name the source and the byte offset.

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/core/utf8.hpp"

namespace dsv4::io {

struct json;
using json_object = std::map<std::string, json, std::less<>>;
using json_array = std::vector<json>;

struct json {
  std::variant<std::nullptr_t, bool, double, std::string, std::shared_ptr<json_array>,
               std::shared_ptr<json_object>>
      value = nullptr;
  bool integral = false;   //!< the number was written without fraction or exponent
  long long integer = 0;   //!< its exact value when integral (safetensors offsets exceed 2^53)

  bool is_object() const { return std::holds_alternative<std::shared_ptr<json_object>>(value); }
  bool is_array() const { return std::holds_alternative<std::shared_ptr<json_array>>(value); }
  bool is_string() const { return std::holds_alternative<std::string>(value); }
  bool is_number() const { return std::holds_alternative<double>(value); }
  const json_object& object() const { return *std::get<std::shared_ptr<json_object>>(value); }
  const json_array& array() const { return *std::get<std::shared_ptr<json_array>>(value); }
  const std::string& string() const { return std::get<std::string>(value); }
  double number() const { return std::get<double>(value); }
};

namespace detail {
class json_parser {
 public:
  json_parser(std::string_view text, std::string source) : s_(text), source_(std::move(source)) {}

  json parse_document() {
    json v = parse_value(0);
    skip_ws();
    if (pos_ != s_.size()) fail("unexpected text after the JSON value");
    return v;
  }

 private:
  std::string_view s_;
  std::string source_;
  std::size_t pos_ = 0;

  [[noreturn]] void fail(const std::string& why) const {
    throw error(source_ + ": invalid JSON at byte " + std::to_string(pos_) + ": " + why);
  }
  void skip_ws() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) ++pos_;
  }
  char peek() {
    skip_ws();
    if (pos_ >= s_.size()) fail("unexpected end of input");
    return s_[pos_];
  }
  void expect(char c) {
    if (peek() != c) fail(std::string("expected '") + c + "'");
    ++pos_;
  }
  bool consume_literal(std::string_view lit) {
    if (s_.substr(pos_, lit.size()) == lit) {
      pos_ += lit.size();
      return true;
    }
    return false;
  }
  json parse_value(int depth) {
    if (depth > 64) fail("nesting deeper than 64 levels");
    json v;
    const char c = peek();
    if (c == '{') {
      ++pos_;
      auto obj = std::make_shared<json_object>();
      if (peek() == '}') {
        ++pos_;
      } else {
        for (;;) {
          if (peek() != '"') fail("expected a string key");
          std::string key = parse_string();
          expect(':');
          json item = parse_value(depth + 1);
          if (!obj->emplace(key, std::move(item)).second) fail("duplicate key \"" + key + "\"");
          if (peek() == ',') { ++pos_; continue; }
          expect('}');
          break;
        }
      }
      v.value = obj;
    } else if (c == '[') {
      ++pos_;
      auto arr = std::make_shared<json_array>();
      if (peek() == ']') {
        ++pos_;
      } else {
        for (;;) {
          arr->push_back(parse_value(depth + 1));
          if (peek() == ',') { ++pos_; continue; }
          expect(']');
          break;
        }
      }
      v.value = arr;
    } else if (c == '"') {
      v.value = parse_string();
    } else if (consume_literal("true")) {
      v.value = true;
    } else if (consume_literal("false")) {
      v.value = false;
    } else if (consume_literal("null")) {
      v.value = nullptr;
    } else {
      parse_number(v);
    }
    return v;
  }
  //! A number in JSON's grammar (no leading zeros, digits after '.' and in an exponent). Values
  //! beyond double's range are errors; values below it round to subnormals or zero, as strtod does.
  void parse_number(json& v) {
    const std::size_t start = pos_;
    auto digit = [&] { return pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9'; };
    auto digits = [&] {
      const std::size_t from = pos_;
      while (digit()) ++pos_;
      return pos_ > from;
    };
    if (pos_ < s_.size() && s_[pos_] == '-') ++pos_;
    const std::size_t int_start = pos_;
    if (!digits()) { pos_ = start; fail("expected a value"); }
    if (s_[int_start] == '0' && pos_ - int_start > 1) { pos_ = start; fail("a number must not have leading zeros"); }
    bool integral = true;
    if (pos_ < s_.size() && s_[pos_] == '.') {
      integral = false;
      ++pos_;
      if (!digits()) fail("expected digits after the decimal point");
    }
    if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      integral = false;
      ++pos_;
      if (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
      if (!digits()) fail("expected digits in the exponent");
    }
    const std::string text(s_.substr(start, pos_ - start));
    errno = 0;
    const double d = std::strtod(text.c_str(), nullptr);
    if (errno == ERANGE && std::fabs(d) > 1.0) { pos_ = start; fail("number " + text.substr(0, 40) + " is out of range"); }
    v.value = d;
    v.integral = integral;
    if (integral) {
      try {
        v.integer = std::stoll(text);
      } catch (const std::out_of_range&) {
        pos_ = start;
        fail("integer " + text + " does not fit in 64 bits");
      }
    }
  }
  std::uint32_t parse_hex4() {
    if (pos_ + 4 > s_.size()) fail("truncated \\u escape");
    std::uint32_t cp = 0;
    for (int i = 0; i < 4; ++i) {
      const char h = s_[pos_++];
      cp <<= 4;
      if (h >= '0' && h <= '9') cp |= std::uint32_t(h - '0');
      else if (h >= 'a' && h <= 'f') cp |= std::uint32_t(h - 'a' + 10);
      else if (h >= 'A' && h <= 'F') cp |= std::uint32_t(h - 'A' + 10);
      else fail("bad hex digit in \\u escape");
    }
    return cp;
  }
  std::string parse_string() {
    expect('"');
    std::string out;
    for (;;) {
      if (pos_ >= s_.size()) fail("unterminated string");
      const char c = s_[pos_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in string");
      if (static_cast<unsigned char>(c) >= 0x80) {  // a UTF-8 sequence: copied whole if it is valid
        --pos_;
        const std::size_t n = text::well_formed_length(s_.substr(pos_));
        if (n == 0) fail("invalid UTF-8 in string");
        out.append(s_.substr(pos_, n));
        pos_ += n;
        continue;
      }
      if (c != '\\') { out += c; continue; }
      if (pos_ >= s_.size()) fail("unterminated escape");
      const char e = s_[pos_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          std::uint32_t cp = parse_hex4();
          if (cp >= 0xDC00 && cp <= 0xDFFF) fail("unpaired low surrogate");
          if (cp >= 0xD800 && cp < 0xDC00) {
            if (!consume_literal("\\u")) fail("unpaired surrogate");
            const std::uint32_t lo = parse_hex4();
            if (lo < 0xDC00 || lo > 0xDFFF) fail("bad low surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          }
          text::append_utf8(out, char32_t(cp));
          break;
        }
        default: fail(std::string("unknown escape \\") + e);
      }
    }
  }
};
}  // namespace detail

//! Parse `text`; `source` (a file name) prefixes every error message.
inline json parse_json(std::string_view text, const std::string& source) {
  return detail::json_parser(text, source).parse_document();
}

//! Read and parse a JSON file; errors name the file.
inline json parse_json_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw error(path + ": cannot open");
  std::stringstream ss;
  ss << f.rdbuf();
  return parse_json(ss.str(), path);
}

}  // namespace dsv4::io
