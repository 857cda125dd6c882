#pragma once
//! \file
//! A checkpoint: one safetensors file, or a folder of shards with model.safetensors.index.json
//! (its "weight_map" names the shard of every tensor). Shards are opened (memory-mapped) on first
//! use. `validate` checks every tensor of a schema and reports all problems at once, each naming
//! the tensor and the file. A checkpoint can also hold its tensors in memory (`in_memory`, `add`):
//! random models for benchmarks and tests, without writing files first.

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <ostream>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/io/json.hpp"
#include "dsv4/io/safetensors.hpp"
#include "dsv4/io/tensor_spec.hpp"

namespace dsv4::io {

//! The official module name of an HF-style tensor name, as convert.py maps them (spec §16): strip
//! "model.", "self_attn" -> "attn", "mlp" -> "ffn" (not under "vision."), "weight_scale_inv" ->
//! "scale", "e_score_correction_bias" -> "bias". Official names map to themselves.
inline std::string official_tensor_name(std::string name) {
  auto replace_part = [&](const std::string& from, const std::string& to) {
    std::string out;
    std::size_t start = 0;
    while (start <= name.size()) {
      std::size_t dot = name.find('.', start);
      if (dot == std::string::npos) dot = name.size();
      const std::string part = name.substr(start, dot - start);
      out += (part == from ? to : part);
      if (dot < name.size()) out += '.';
      start = dot + 1;
    }
    name = out;
  };
  if (name.rfind("model.", 0) == 0) name = name.substr(6);
  replace_part("self_attn", "attn");
  if (name.rfind("vision.", 0) != 0) replace_part("mlp", "ffn");
  replace_part("weight_scale_inv", "scale");
  replace_part("e_score_correction_bias", "bias");
  return name;
}

class checkpoint {
 public:
  //! `path`: a .safetensors file, or a folder holding model.safetensors.index.json (or exactly one
  //! .safetensors file).
  explicit checkpoint(const std::string& path) {
    namespace fs = std::filesystem;
    if (fs::is_directory(path)) {
      const fs::path index = fs::path(path) / "model.safetensors.index.json";
      if (fs::exists(index)) {
        const json j = parse_json_file(index.string());
        if (!j.is_object() || !j.object().count("weight_map") || !j.object().at("weight_map").is_object())
          throw error(index.string() + ": no \"weight_map\" object");
        for (const auto& [name, file] : j.object().at("weight_map").object()) {
          if (!file.is_string()) throw error(index.string() + ": weight_map entry '" + name + "' is not a file name");
          add_name(name, (fs::path(path) / file.string()).string(), index.string());
        }
        return;
      }
      std::vector<std::string> files;
      for (const auto& e : fs::directory_iterator(path))
        if (e.path().extension() == ".safetensors") files.push_back(e.path().string());
      if (files.size() != 1)
        throw error(path + ": a checkpoint folder needs model.safetensors.index.json or exactly one .safetensors file (found " +
                    std::to_string(files.size()) + ")");
      add_single(files[0]);
      return;
    }
    add_single(path);
  }

  //! An empty checkpoint whose tensors live in memory (`add` them).
  static checkpoint in_memory() { return checkpoint(); }
  //! Adds a tensor held in memory under its official name (a checkpoint built by `in_memory`).
  void add(const std::string& name, st_dtype dtype, std::vector<long long> shape, std::vector<std::uint8_t> bytes) {
    long long numel = 1;
    for (long long x : shape) numel *= x;
    if (static_cast<unsigned long long>(numel) * static_cast<unsigned long long>(dtype_bytes(dtype)) != bytes.size())
      throw error("checkpoint::add: tensor '" + name + "' of shape " + safetensors_file::shape_string(shape) + " and dtype " +
                  dtype_name(dtype) + " needs " + std::to_string(numel * dtype_bytes(dtype)) + " bytes, got " +
                  std::to_string(bytes.size()));
    add_name(name, memory_file, "checkpoint::add");
    auto held = std::make_unique<memory_tensor>();
    held->bytes = std::move(bytes);
    held->view = tensor_view{name, dtype, std::move(shape),
                             std::span<const std::byte>(reinterpret_cast<const std::byte*>(held->bytes.data()), held->bytes.size())};
    memory_.emplace(name, std::move(held));
    total_bytes_.reset();
  }

  bool contains(const std::string& name) const { return where_.count(name) != 0; }
  std::size_t size() const { return where_.size(); }
  //! The file that holds `name` (throws if the checkpoint has no such tensor).
  const std::string& file_of(const std::string& name) const {
    auto it = where_.find(name);
    if (it == where_.end()) throw error("checkpoint: no tensor named '" + name + "'");
    return it->second;
  }
  //! Tensor `name` (its bytes in place). Safe to call from several threads at once (the models'
  //! loaders read layers in parallel); add() and on_progress() are not.
  const tensor_view& tensor(const std::string& name) {
    const std::lock_guard<std::mutex> hold(*lock_);
    const tensor_view& v = view(name, file_of(name));
    if (progress_ && taken_.insert(name).second) {
      taken_bytes_ += v.bytes.size();
      progress_(taken_bytes_, total_bytes_locked());
    }
    return v;
  }

  //! Loading progress: after a loader takes a tensor through tensor() for the first time (the
  //! loaders copy each tensor once), `report(bytes taken so far, bytes of every tensor)`.
  void on_progress(std::function<void(std::uint64_t taken, std::uint64_t total)> report) {
    progress_ = std::move(report);
    taken_.clear(), taken_bytes_ = 0;
  }
  //! Bytes of every tensor in the checkpoint (the headers say; nothing is read).
  std::uint64_t total_bytes() {
    const std::lock_guard<std::mutex> hold(*lock_);
    return total_bytes_locked();
  }

  //! Checks every tensor of `schema`: present (unless optional), an accepted dtype, the shape.
  //! Throws one error listing up to 20 problems, each with tensor and file.
  void validate(const std::vector<tensor_spec>& schema) {
    std::vector<std::string> problems;
    for (const auto& t : schema) {
      auto it = where_.find(t.name);
      if (it == where_.end()) {
        if (!t.optional) problems.push_back("missing tensor '" + t.name + "'");
        continue;
      }
      try {
        const tensor_view& v = view(t.name, it->second);
        bool dtype_ok = false;
        for (st_dtype d : t.dtypes) dtype_ok |= d == v.dtype;
        if (!dtype_ok) {
          std::string want;
          for (st_dtype d : t.dtypes) want += (want.empty() ? "" : " or ") + dtype_name(d);
          problems.push_back(it->second + ": tensor '" + t.name + "' has dtype " + dtype_name(v.dtype) + ", expected " + want);
        } else if (!t.shape.empty() && v.shape != t.shape) {
          problems.push_back(it->second + ": tensor '" + t.name + "' has shape " + safetensors_file::shape_string(v.shape) +
                             ", expected " + safetensors_file::shape_string(t.shape));
        }
      } catch (const error& e) {
        problems.push_back(e.what());
      }
    }
    if (problems.empty()) return;
    std::string msg = "checkpoint does not match the model: " + std::to_string(problems.size()) + " problem(s)";
    for (std::size_t i = 0; i < problems.size() && i < 20; ++i) msg += "\n  " + problems[i];
    if (problems.size() > 20) msg += "\n  ...";
    throw error(msg);
  }

 private:
  checkpoint() = default;
  //! The "file" of tensors held in memory.
  static constexpr const char* memory_file = "(in memory)";
  struct memory_tensor {
    std::vector<std::uint8_t> bytes;
    tensor_view view;
  };
  std::map<std::string, std::unique_ptr<memory_tensor>> memory_;
  std::map<std::string, std::string> where_;   // official tensor name -> file
  std::map<std::string, std::string> stored_;  // official name -> name as stored, where they differ
  std::map<std::string, std::unique_ptr<safetensors_file>> open_;
  std::function<void(std::uint64_t, std::uint64_t)> progress_;
  std::set<std::string> taken_;
  std::uint64_t taken_bytes_ = 0;
  std::optional<std::uint64_t> total_bytes_;
  std::unique_ptr<std::mutex> lock_ = std::make_unique<std::mutex>();  // (a pointer: checkpoints move)

  std::uint64_t total_bytes_locked() {
    if (!total_bytes_) {
      std::uint64_t sum = 0;
      for (const auto& [name, file] : where_) sum += view(name, file).bytes.size();
      total_bytes_ = sum;
    }
    return *total_bytes_;
  }

  void add_name(const std::string& stored, const std::string& file, const std::string& source) {
    const std::string official = official_tensor_name(stored);
    if (!where_.emplace(official, file).second)
      throw error(source + ": two tensors map to '" + official + "' (one of them is '" + stored + "')");
    if (official != stored) stored_[official] = stored;
  }
  const std::string& stored_name(const std::string& official) const {
    auto it = stored_.find(official);
    return it == stored_.end() ? official : it->second;
  }
  void add_single(const std::string& file) {
    safetensors_file& f = open(file);
    for (const auto& n : f.names()) add_name(n, file, file);
  }
  const tensor_view& view(const std::string& name, const std::string& file) {
    if (file == memory_file) return memory_.at(name)->view;
    return open(file).tensor(stored_name(name));
  }
  safetensors_file& open(const std::string& file) {
    auto it = open_.find(file);
    if (it == open_.end()) it = open_.emplace(file, std::make_unique<safetensors_file>(file)).first;
    return *it->second;
  }
};

//! A checkpoint::on_progress callback that prints "<what>: 30% (7.5 of 25.0 GB)" to `os` at every
//! tenth of the way; silent for checkpoints under `min_total` bytes (a tiny model loads at once).
inline std::function<void(std::uint64_t, std::uint64_t)> load_progress_printer(std::ostream& os, std::string what,
                                                                                std::uint64_t min_total = 256ull << 20) {
  return [&os, what = std::move(what), min_total, shown = -1](std::uint64_t taken, std::uint64_t total) mutable {
    if (total < min_total || total == 0) return;
    const int tenth = int(10 * taken / total);
    if (tenth <= shown) return;
    shown = tenth;
    char line[64];
    std::snprintf(line, sizeof line, "%d%% (%.1f of %.1f GB)", 10 * tenth, double(taken) / 1e9, double(total) / 1e9);
    os << what << ": " << line << std::endl;
  };
}

}  // namespace dsv4::io
