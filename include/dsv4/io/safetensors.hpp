#pragma once
//! \file
//! Read-only access to a safetensors file, memory-mapped. Every malformed input (short file,
//! bad header, unknown dtype, shape that does not match the byte range, range outside the file)
//! is a dsv4::error naming the file and the tensor.

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/io/json.hpp"

namespace dsv4::io {

enum class st_dtype { BOOL, U8, I8, I16, U16, F16, BF16, I32, U32, F32, F64, I64, U64, F8_E4M3, F8_E5M2, F8_E8M0 };

inline int dtype_bytes(st_dtype d) {
  switch (d) {
    case st_dtype::BOOL: case st_dtype::U8: case st_dtype::I8:
    case st_dtype::F8_E4M3: case st_dtype::F8_E5M2: case st_dtype::F8_E8M0: return 1;
    case st_dtype::I16: case st_dtype::U16: case st_dtype::F16: case st_dtype::BF16: return 2;
    case st_dtype::I32: case st_dtype::U32: case st_dtype::F32: return 4;
    case st_dtype::F64: case st_dtype::I64: case st_dtype::U64: return 8;
  }
  return 0;
}

inline const std::map<std::string, st_dtype, std::less<>>& dtype_names() {
  static const std::map<std::string, st_dtype, std::less<>> names = {
      {"BOOL", st_dtype::BOOL}, {"U8", st_dtype::U8},   {"I8", st_dtype::I8},
      {"I16", st_dtype::I16},   {"U16", st_dtype::U16}, {"F16", st_dtype::F16},
      {"BF16", st_dtype::BF16}, {"I32", st_dtype::I32}, {"U32", st_dtype::U32},
      {"F32", st_dtype::F32},   {"F64", st_dtype::F64}, {"I64", st_dtype::I64},
      {"U64", st_dtype::U64},   {"F8_E4M3", st_dtype::F8_E4M3}, {"F8_E5M2", st_dtype::F8_E5M2},
      {"F8_E8M0", st_dtype::F8_E8M0}};
  return names;
}

inline std::string dtype_name(st_dtype d) {
  for (const auto& [n, v] : dtype_names())
    if (v == d) return n;
  return "?";
}

struct tensor_view {
  std::string name;
  st_dtype dtype{};
  std::vector<long long> shape;
  std::span<const std::byte> bytes;

  long long numel() const {
    long long n = 1;
    for (long long s : shape) n *= s;
    return n;
  }
};

class safetensors_file {
 public:
  explicit safetensors_file(const std::string& path) : path_(path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw error(path + ": cannot open: " + std::strerror(errno));
    struct stat st{};
    if (::fstat(fd, &st) != 0) {
      ::close(fd);
      throw error(path + ": cannot stat: " + std::strerror(errno));
    }
    size_ = static_cast<std::size_t>(st.st_size);
    if (size_ < 8) {
      ::close(fd);
      throw error(path + ": truncated: " + std::to_string(size_) + " bytes, a safetensors file needs at least 8");
    }
    void* m = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    ::close(fd);
    if (m == MAP_FAILED) throw error(path + ": cannot map: " + std::strerror(errno));
    map_ = static_cast<const std::byte*>(m);
    try {
      parse();
    } catch (...) {
      ::munmap(const_cast<std::byte*>(map_), size_);
      throw;
    }
  }
  ~safetensors_file() {
    if (map_) ::munmap(const_cast<std::byte*>(map_), size_);
  }
  safetensors_file(const safetensors_file&) = delete;
  safetensors_file& operator=(const safetensors_file&) = delete;

  const std::string& path() const { return path_; }
  bool contains(std::string_view name) const { return tensors_.find(name) != tensors_.end(); }
  std::vector<std::string> names() const {
    std::vector<std::string> n;
    for (const auto& [k, v] : tensors_) n.push_back(k);
    return n;
  }
  const std::map<std::string, std::string, std::less<>>& metadata() const { return metadata_; }

  //! The tensor `name`; throws if it is absent.
  const tensor_view& tensor(std::string_view name) const {
    auto it = tensors_.find(name);
    if (it == tensors_.end()) throw error(path_ + ": no tensor named '" + std::string(name) + "'");
    return it->second;
  }
  //! The tensor `name`, checked against an expected dtype and shape.
  const tensor_view& tensor(std::string_view name, st_dtype dtype, const std::vector<long long>& shape) const {
    const tensor_view& t = tensor(name);
    if (t.dtype != dtype)
      throw error(path_ + ": tensor '" + std::string(name) + "' has dtype " + dtype_name(t.dtype) +
                  ", expected " + dtype_name(dtype));
    if (t.shape != shape)
      throw error(path_ + ": tensor '" + std::string(name) + "' has shape " + shape_string(t.shape) +
                  ", expected " + shape_string(shape));
    return t;
  }

  static std::string shape_string(const std::vector<long long>& s) {
    std::string r = "[";
    for (std::size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
    return r + "]";
  }

 private:
  std::string path_;
  const std::byte* map_ = nullptr;
  std::size_t size_ = 0;
  std::map<std::string, tensor_view, std::less<>> tensors_;
  std::map<std::string, std::string, std::less<>> metadata_;

  void parse() {
    std::uint64_t header_len = 0;
    std::memcpy(&header_len, map_, 8);  // little-endian, as the format specifies (x86, Arm)
    if (header_len > size_ - 8)
      throw error(path_ + ": truncated: header claims " + std::to_string(header_len) + " bytes but the file has " +
                  std::to_string(size_ - 8) + " after the length field");
    const std::string_view text(reinterpret_cast<const char*>(map_ + 8), header_len);
    const json root = parse_json(text, path_ + " (header)");
    if (!root.is_object()) throw error(path_ + ": header is not a JSON object");
    const std::size_t data_begin = 8 + header_len;
    const std::size_t data_size = size_ - data_begin;
    for (const auto& [name, entry] : root.object()) {
      if (name == "__metadata__") {
        if (!entry.is_object()) throw error(path_ + ": __metadata__ is not an object");
        for (const auto& [k, v] : entry.object()) {
          if (!v.is_string()) throw error(path_ + ": __metadata__ value '" + k + "' is not a string");
          metadata_[k] = v.string();
        }
        continue;
      }
      const std::string where = path_ + ": tensor '" + name + "'";
      if (!entry.is_object()) throw error(where + ": entry is not an object");
      const auto& o = entry.object();
      auto dt = o.find("dtype");
      auto sh = o.find("shape");
      auto off = o.find("data_offsets");
      if (dt == o.end() || !dt->second.is_string()) throw error(where + ": missing string field 'dtype'");
      if (sh == o.end() || !sh->second.is_array()) throw error(where + ": missing array field 'shape'");
      if (off == o.end() || !off->second.is_array() || off->second.array().size() != 2)
        throw error(where + ": missing field 'data_offsets' [begin, end]");
      auto dn = dtype_names().find(dt->second.string());
      if (dn == dtype_names().end()) throw error(where + ": unknown dtype '" + dt->second.string() + "'");
      tensor_view t;
      t.name = name;
      t.dtype = dn->second;
      long long numel = 1;
      for (const json& d : sh->second.array()) {
        if (!d.is_number() || !d.integral || d.integer < 0)
          throw error(where + ": shape entries must be non-negative integers");
        t.shape.push_back(d.integer);
        if (d.integer != 0 && numel > (1ll << 62) / d.integer) throw error(where + ": shape is too large");
        numel *= d.integer;
      }
      const json& b = off->second.array()[0];
      const json& e = off->second.array()[1];
      if (!b.is_number() || !e.is_number() || !b.integral || !e.integral || b.integer < 0 || e.integer < b.integer)
        throw error(where + ": data_offsets must be integers with 0 <= begin <= end");
      if (static_cast<std::uint64_t>(e.integer) > data_size)
        throw error(where + ": data_offsets end " + std::to_string(e.integer) + " lies beyond the data section (" +
                    std::to_string(data_size) + " bytes); the file is truncated");
      const long long nbytes = e.integer - b.integer;
      if (nbytes != numel * dtype_bytes(t.dtype))
        throw error(where + ": shape " + shape_string(t.shape) + " of " + dtype_name(t.dtype) + " needs " +
                    std::to_string(numel * dtype_bytes(t.dtype)) + " bytes but data_offsets span " +
                    std::to_string(nbytes));
      t.bytes = std::span<const std::byte>(map_ + data_begin + b.integer, static_cast<std::size_t>(nbytes));
      tensors_.emplace(name, std::move(t));
    }
  }
};

//! Copy a tensor's bytes into a vector of T (size checked).
template <class T>
std::vector<T> copy_as(const tensor_view& t) {
  if (t.bytes.size() % sizeof(T) != 0)
    throw error("tensor '" + t.name + "': " + std::to_string(t.bytes.size()) + " bytes is not a whole number of " +
                std::to_string(sizeof(T)) + "-byte elements");
  std::vector<T> out(t.bytes.size() / sizeof(T));
  std::memcpy(out.data(), t.bytes.data(), t.bytes.size());
  return out;
}

}  // namespace dsv4::io
