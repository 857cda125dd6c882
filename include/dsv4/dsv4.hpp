#pragma once
//! \file
//! Umbrella header for applications and examples. Library headers never include it: each
//! includes exactly what it uses.
//!
//! Host-compilable parts only; CUDA headers (`*.cuh`) are included explicitly by CUDA code.

#include "dsv4/config.hpp"
#include "dsv4/core/diagnostics.hpp"
#include "dsv4/core/error.hpp"
#include "dsv4/engram/table_layout.hpp"
#include "dsv4/io/json.hpp"
#include "dsv4/io/safetensors.hpp"
#include "dsv4/models/builtin.hpp"
#include "dsv4/models/describe.hpp"
#include "dsv4/models/model_config.hpp"
#include "dsv4/models/model_traits.hpp"
#include "dsv4/models/tiny.hpp"
#include "dsv4/models/v41_flash.hpp"
#include "dsv4/numerics/bf16.hpp"
#include "dsv4/numerics/bits.hpp"
#include "dsv4/numerics/block_format.hpp"
#include "dsv4/numerics/formats.hpp"
#include "dsv4/numerics/minifloat.hpp"
#include "dsv4/numerics/quantize.hpp"
#include "dsv4/schedule/layer.hpp"
#include "dsv4/schedule/model_schedule.hpp"
