#pragma once
//! \file
//! The model variants that ship with dsv4, selectable by name at run time (`--config NAME`).

#include <string>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/models/describe.hpp"
#include "dsv4/models/tiny.hpp"
#include "dsv4/models/v41_flash.hpp"

namespace dsv4::models {

inline std::vector<std::string> builtin_names() { return {v41_flash::name, tiny::name}; }

//! Description of a built-in variant; throws dsv4::error naming the valid choices otherwise.
inline model_description describe_builtin(const std::string& name) {
  if (name == v41_flash::name) return describe<v41_flash>();
  if (name == tiny::name) return describe<tiny>();
  std::string valid;
  for (const auto& n : builtin_names()) valid += (valid.empty() ? "" : ", ") + n;
  throw error("unknown model config '" + name + "'; built-in configs are: " + valid);
}

}  // namespace dsv4::models
