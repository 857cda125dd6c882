#pragma once
//! \file
//! CUDA RoPE, in place on bf16 vectors: the same pair rotation as rope.hpp, one thread per pair,
//! angle fp32(t) * f_k and sincosf (full precision) on the device.

#include <cuda_runtime.h>  // provides cudaStream_t

#include <cstdint>
#include <string>

#include "dsv4/core/error.hpp"
#include "dsv4/kernels/rope/rope.hpp"
#include "dsv4/runtime/cuda_check.cuh"
#include "dsv4/runtime/pdl.cuh"

namespace dsv4::kernels::rope {

struct rope_args {
  numerics::bf16* x = nullptr;         //!< [positions][vectors_per_position][dim], rotated in place
  const std::int64_t* positions = nullptr;
  const float* freqs = nullptr;        //!< rope_dim / 2 frequencies (device memory)
  long long n_positions = 0;
  int vectors_per_position = 1;        //!< heads (q), 1 (kv), index heads (indexer q)
  int dim = 0;                         //!< channels per vector; RoPE acts on the last 2 * pairs
  int pairs = 0;
  bool inverse = false;
};

//! Pairs a call rotates: one thread each.
DSV4_HOST_DEVICE long long pairs_of(const rope_args& a) {
  return a.n_positions * a.vectors_per_position * a.pairs;
}

namespace detail {
//! Rotates pair t of the call (t < pairs_of(a)) with its frequency `freq` (= a.freqs[t % a.pairs]).
//! Kernels that rotate queries on the side of other work (the attention's index-list launch) call
//! it for their share of the pairs.
DSV4_DEVICE void rotate_pair_at(const rope_args& a, long long t, float freq) {
  const long long v = t / a.pairs;
  const int k = int(t % a.pairs);
  const float pos = float(a.positions[v / a.vectors_per_position]);
  const float theta = __fmul_rn(pos, freq);
  float s, c;
  sincosf(theta, &s, &c);
  numerics::bf16* r = a.x + v * a.dim + (a.dim - 2 * a.pairs);
  rotate_pair(r[2 * k], r[2 * k + 1], c, a.inverse ? -s : s);
}

DSV4_KERNEL void rope_kernel(rope_args a) {
  const long long t = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const long long total = pairs_of(a);
  // The frequency (a table no kernel writes) is read before the wait, off the step's chain.
  const float freq = t < total ? a.freqs[t % a.pairs] : 0.0f;
  runtime::start_after_previous_grid();
  if (t < total) rotate_pair_at(a, t, freq);
}
}  // namespace detail

inline void apply_rope(const rope_args& a, cudaStream_t stream = nullptr) {
  if (a.n_positions < 0 || a.vectors_per_position <= 0 || a.pairs <= 0 || a.dim < 2 * a.pairs)
    throw error("apply_rope: need n_positions >= 0, vectors_per_position > 0, 0 < 2 * pairs <= dim (got pairs " +
                std::to_string(a.pairs) + ", dim " + std::to_string(a.dim) + ")");
  const long long total = pairs_of(a);
  if (total == 0) return;
  if (!a.x || !a.positions || !a.freqs) throw error("apply_rope: null pointer argument");
  runtime::launch_programmatic(detail::rope_kernel, dim3(unsigned((total + 255) / 256)), dim3(256), 0, stream, a);
  DSV4_CUDA_CHECK_LAUNCH();
}

}  // namespace dsv4::kernels::rope
