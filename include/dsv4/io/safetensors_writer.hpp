#pragma once
//! \file
//! Writes safetensors files: an 8-byte little-endian header length, a JSON header (names sorted,
//! padded with spaces to a multiple of 8 so the data is 8-byte aligned), then the tensors' bytes
//! in header order. Readable by io::safetensors_file and by the reference tooling.

#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/io/safetensors.hpp"

namespace dsv4::io {

class safetensors_writer {
 public:
  //! Adds a tensor; `bytes` must hold exactly numel x dtype size bytes.
  void add(const std::string& name, st_dtype dtype, std::vector<long long> shape, std::vector<std::uint8_t> bytes) {
    long long numel = 1;
    for (long long s : shape) numel *= s;
    if (static_cast<long long>(bytes.size()) != numel * dtype_bytes(dtype))
      throw error("safetensors_writer: tensor '" + name + "' has " + std::to_string(bytes.size()) + " bytes, its shape " +
                  safetensors_file::shape_string(shape) + " of " + dtype_name(dtype) + " needs " +
                  std::to_string(numel * dtype_bytes(dtype)));
    if (!tensors_.emplace(name, entry{dtype, std::move(shape), std::move(bytes)}).second)
      throw error("safetensors_writer: duplicate tensor '" + name + "'");
  }
  void metadata(const std::string& key, const std::string& value) { metadata_[key] = value; }
  std::size_t bytes() const {
    std::size_t n = 0;
    for (const auto& [k, v] : tensors_) n += v.bytes.size();
    return n;
  }
  bool empty() const { return tensors_.empty(); }

  void write(const std::string& path) const {
    std::string header = "{";
    auto quote = [](const std::string& s) {
      std::string q(1, '"');
      for (char c : s) {
        if (c == '"' || c == '\\') q += '\\';
        q += c;
      }
      q += '"';
      return q;
    };
    bool first = true;
    if (!metadata_.empty()) {
      header += "\"__metadata__\":{";
      bool f2 = true;
      for (const auto& [k, v] : metadata_) {
        if (!f2) header += ',';
        header += quote(k);
        header += ':';
        header += quote(v);
        f2 = false;
      }
      header += '}';
      first = false;
    }
    std::size_t offset = 0;
    for (const auto& [name, t] : tensors_) {
      if (!first) header += ',';
      header += quote(name);
      header += ":{\"dtype\":\"";
      header += dtype_name(t.dtype);
      header += "\",\"shape\":[";
      for (std::size_t i = 0; i < t.shape.size(); ++i) {
        if (i) header += ',';
        header += std::to_string(t.shape[i]);
      }
      header += "],\"data_offsets\":[";
      header += std::to_string(offset);
      header += ',';
      header += std::to_string(offset + t.bytes.size());
      header += "]}";
      offset += t.bytes.size();
      first = false;
    }
    header += "}";
    while (header.size() % 8) header += ' ';
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    if (!f) throw error(path + ": cannot create");
    const std::uint64_t len = header.size();
    f.write(reinterpret_cast<const char*>(&len), 8);
    f.write(header.data(), std::streamsize(header.size()));
    for (const auto& [name, t] : tensors_) f.write(reinterpret_cast<const char*>(t.bytes.data()), std::streamsize(t.bytes.size()));
    if (!f) throw error(path + ": write failed (disk full?)");
  }

 private:
  struct entry {
    st_dtype dtype;
    std::vector<long long> shape;
    std::vector<std::uint8_t> bytes;
  };
  std::map<std::string, entry> tensors_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace dsv4::io
