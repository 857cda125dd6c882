#pragma once
//! \file
//! Rotary position embedding as the reference applies it (spec §4): interleaved adjacent pairs
//! (x[2k], x[2k+1]) of the last `rope_dim` channels of a vector, rotated by angle t * f_k where
//! f_k comes from `precompute_freqs_cis` (with the YaRN blend on compressed layers, and no
//! attention-temperature correction), and written back in bf16. The inverse uses -sin.
//!
//! Frequencies and angles are fp32 as in the reference (theta = fp32(t) * f_k, one rounding). The
//! cosine and sine come from the platform's fp32 functions, which may differ from PyTorch's by an
//! ulp; after the bf16 write-back that is rarely visible (tests bound it).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/numerics/bf16.hpp"
#include "dsv4/numerics/bits.hpp"

namespace dsv4::kernels::rope {

//! One RoPE table: the frequencies of `rope_dim / 2` pairs.
struct rope_params {
  int rope_dim = 64;
  float base = 10000.0f;
  int original_seq_len = 0;  //!< > 0 enables YaRN
  float factor = 1.0f, beta_fast = 32.0f, beta_slow = 1.0f;
};

//! YaRN correction range [low, high] in units of the full rope dim (spec §4: 15 and 25 for the
//! compressed layers of V4.1). Computed in double, as the reference's Python math does.
struct yarn_range {
  int low = 0, high = 0;
};
inline yarn_range yarn_correction_range(const rope_params& p) {
  const auto cd = [&](double r) {
    return p.rope_dim * std::log(double(p.original_seq_len) / (r * 2.0 * 3.14159265358979323846)) /
           (2.0 * std::log(double(p.base)));
  };
  yarn_range r;
  r.low = std::max(int(std::floor(cd(p.beta_fast))), 0);
  r.high = std::min(int(std::ceil(cd(p.beta_slow))), p.rope_dim - 1);
  return r;
}

//! The rope_dim / 2 frequencies f_k, fp32 (spec §4 precompute_freqs_cis).
inline std::vector<float> frequencies(const rope_params& p) {
  if (p.rope_dim <= 0 || p.rope_dim % 2) throw error("rope: rope_dim must be positive and even");
  const int pairs = p.rope_dim / 2;
  std::vector<float> f(static_cast<std::size_t>(pairs));
  for (int k = 0; k < pairs; ++k) {
    const float expo = float(2 * k) / float(p.rope_dim);  // exact: a dyadic fraction
    f[std::size_t(k)] = 1.0f / std::pow(p.base, expo);
  }
  if (p.original_seq_len > 0) {
    const yarn_range r = yarn_correction_range(p);
    const float span = std::max(float(r.high - r.low), 1e-3f);
    for (int k = 0; k < pairs; ++k) {
      const float ramp = std::clamp((float(k) - float(r.low)) / span, 0.0f, 1.0f);
      const float smooth = 1.0f - ramp;
      const float fk = f[std::size_t(k)];
      f[std::size_t(k)] = numerics::mul_rn(fk / p.factor, 1.0f - smooth) + numerics::mul_rn(fk, smooth);
    }
  }
  return f;
}

//! Rotate one pair in fp32 (separate roundings, no fused multiply-add) and round to bf16.
DSV4_HOST_DEVICE void rotate_pair(numerics::bf16& re, numerics::bf16& im, float c, float s) {
  const float a = re.to_float(), b = im.to_float();
  re = numerics::bf16::from_float(numerics::mul_rn(a, c) - numerics::mul_rn(b, s));
  im = numerics::bf16::from_float(numerics::mul_rn(a, s) + numerics::mul_rn(b, c));
}

//! Host reference: rotate (or un-rotate) the last rope_dim channels of each of `vectors` vectors of
//! `dim` channels in place; vector v is at position positions[v / vectors_per_position].
inline void apply_rope_reference(std::span<numerics::bf16> x, int dim, int vectors_per_position,
                                 std::span<const std::int64_t> positions, std::span<const float> freqs,
                                 bool inverse) {
  const int pairs = int(freqs.size());
  if (dim < 2 * pairs) throw error("rope: vector width " + std::to_string(dim) + " is smaller than rope_dim");
  if (x.size() != positions.size() * std::size_t(vectors_per_position) * std::size_t(dim))
    throw error("rope: x has " + std::to_string(x.size()) + " values, expected positions x vectors x dim");
  for (std::size_t v = 0; v < x.size() / std::size_t(dim); ++v) {
    const float t = float(positions[v / std::size_t(vectors_per_position)]);
    numerics::bf16* r = x.data() + v * std::size_t(dim) + (dim - 2 * pairs);
    for (int k = 0; k < pairs; ++k) {
      const float theta = numerics::mul_rn(t, freqs[std::size_t(k)]);
      const float c = std::cos(theta), s = std::sin(theta);
      rotate_pair(r[2 * k], r[2 * k + 1], c, inverse ? -s : s);
    }
  }
}

}  // namespace dsv4::kernels::rope
