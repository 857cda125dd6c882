#pragma once
//! \file
//! Two-dimensional little-endian float32 arrays in NumPy's .npy format (version 1.0): the magic
//! "\x93NUMPY", version 1.0, a 2-byte header length, then a Python-literal header
//! `{'descr': '<f4', 'fortran_order': False, 'shape': (R, C), }` padded with spaces and ended by a
//! newline so that the data starts at a multiple of 64 bytes, then R x C floats, row-major.
//! `numpy.load` reads what `write_npy_f32` writes and vice versa. Used for logits files
//! (`dsv4 logits`, tools/parity, the golden files under tests/data/parity).

#include <bit>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "dsv4/core/error.hpp"

namespace dsv4::io {

static_assert(std::endian::native == std::endian::little, "npy: written for little-endian hosts");

//! A row-major rows x cols float32 matrix.
struct npy_matrix {
  std::size_t rows = 0, cols = 0;
  std::vector<float> data;
  const float* row(std::size_t r) const { return data.data() + r * cols; }
};

inline void write_npy_f32(const std::string& path, const npy_matrix& m) {
  if (m.data.size() != m.rows * m.cols)
    throw error("write_npy_f32: " + std::to_string(m.data.size()) + " values for a " + std::to_string(m.rows) + " x " +
                std::to_string(m.cols) + " array");
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + std::to_string(m.rows) + ", " +
                       std::to_string(m.cols) + "), }";
  const std::size_t preamble = 10;  // magic (6) + version (2) + header length (2)
  while ((preamble + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::ofstream f(path, std::ios::binary);
  if (!f) throw error(path + ": cannot open for writing");
  const char magic[8] = {'\x93', 'N', 'U', 'M', 'P', 'Y', 1, 0};
  f.write(magic, 8);
  const std::uint16_t len = static_cast<std::uint16_t>(header.size());
  const char len_bytes[2] = {char(len & 0xff), char(len >> 8)};
  f.write(len_bytes, 2);
  f.write(header.data(), std::streamsize(header.size()));
  f.write(reinterpret_cast<const char*>(m.data.data()), std::streamsize(m.data.size() * sizeof(float)));
  if (!f) throw error(path + ": write failed");
}

//! Reads a 2-D '<f4' C-order array (a 1-D one becomes one row); anything else is an error that
//! says what the file holds.
inline npy_matrix read_npy_f32(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw error(path + ": cannot open");
  const std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (bytes.size() < 10 || std::memcmp(bytes.data(), "\x93NUMPY", 6) != 0) throw error(path + ": not a .npy file");
  const int major = bytes[6];
  std::size_t header_len = 0, start = 0;
  if (major == 1) {
    header_len = std::size_t(std::uint8_t(bytes[8])) | std::size_t(std::uint8_t(bytes[9])) << 8;
    start = 10;
  } else if (major == 2 || major == 3) {
    if (bytes.size() < 12) throw error(path + ": truncated .npy header");
    for (int i = 0; i < 4; ++i) header_len |= std::size_t(std::uint8_t(bytes[8 + i])) << (8 * i);
    start = 12;
  } else {
    throw error(path + ": unsupported .npy version " + std::to_string(major));
  }
  if (bytes.size() < start + header_len) throw error(path + ": truncated .npy header");
  const std::string header(bytes.data() + start, header_len);
  auto value_of = [&](const std::string& key) {
    const auto k = header.find("'" + key + "'");
    if (k == std::string::npos) throw error(path + ": .npy header has no '" + key + "'");
    const auto colon = header.find(':', k);
    return header.substr(colon + 1);
  };
  const std::string descr = value_of("descr");
  if (descr.find("'<f4'") != descr.find_first_not_of(' '))
    throw error(path + ": holds " + descr.substr(0, descr.find(',')) + ", expected little-endian float32 '<f4'");
  if (value_of("fortran_order").find("False") != value_of("fortran_order").find_first_not_of(' '))
    throw error(path + ": Fortran-order arrays are not supported");
  const std::string shape_text = value_of("shape");
  const auto open = shape_text.find('('), close = shape_text.find(')');
  if (open == std::string::npos || close == std::string::npos) throw error(path + ": .npy header has no shape tuple");
  std::vector<std::size_t> shape;
  std::string item;
  for (char c : shape_text.substr(open + 1, close - open - 1) + ",") {
    if (c == ',') {
      if (item.find_first_not_of(' ') != std::string::npos) shape.push_back(std::stoull(item));
      item.clear();
    } else {
      item += c;
    }
  }
  npy_matrix m;
  if (shape.size() == 2) {
    m.rows = shape[0];
    m.cols = shape[1];
  } else if (shape.size() == 1) {
    m.rows = 1;
    m.cols = shape[0];
  } else {
    throw error(path + ": a " + std::to_string(shape.size()) + "-D array, expected 2-D (rows x vocabulary)");
  }
  const std::size_t data_start = start + header_len, need = m.rows * m.cols * sizeof(float);
  if (bytes.size() - data_start != need)
    throw error(path + ": " + std::to_string(bytes.size() - data_start) + " data bytes, the shape needs " + std::to_string(need));
  m.data.resize(m.rows * m.cols);
  std::memcpy(m.data.data(), bytes.data() + data_start, need);
  return m;
}

}  // namespace dsv4::io
