#pragma once
//! \file
//! What a checkpoint must hold for one tensor: name, shape and the stored dtypes accepted.

#include <string>
#include <vector>

#include "dsv4/io/safetensors.hpp"

namespace dsv4::io {

struct tensor_spec {
  std::string name;
  std::vector<long long> shape;   //!< empty: the shape is checked elsewhere
  std::vector<st_dtype> dtypes;   //!< accepted stored dtypes (the first is the one writers use)
  bool optional = false;          //!< may be absent
};

}  // namespace dsv4::io
