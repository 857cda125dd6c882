#pragma once
// An independent, deliberately naive model of the encodings, used to check the library's codecs:
// values come from std::ldexp over the bit fields, and encoding searches all codes for the
// nearest value (ties to the even code, saturating). It shares no code with dsv4/numerics.

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace dsv4::test {

struct ref_encoding {
  int exp_bits, man_bits, bias;
  bool is_signed, nan_all_ones, pow2;

  int code_count() const { return 1 << ((is_signed ? 1 : 0) + exp_bits + man_bits); }
  double value(unsigned code) const {
    if (pow2) return code == 0xFF ? std::numeric_limits<double>::quiet_NaN() : std::ldexp(1.0, int(code) - 127);
    const unsigned man = code & ((1u << man_bits) - 1);
    const unsigned ex = (code >> man_bits) & ((1u << exp_bits) - 1);
    const bool neg = is_signed && ((code >> (exp_bits + man_bits)) & 1);
    if (nan_all_ones && ex == (1u << exp_bits) - 1 && man == (1u << man_bits) - 1)
      return std::numeric_limits<double>::quiet_NaN();
    const double mag = ex == 0 ? std::ldexp(double(man), 1 - bias - man_bits)
                               : std::ldexp(1.0 + double(man) / double(1u << man_bits), int(ex) - bias);
    return neg ? -mag : mag;
  }
  //! Nearest finite code; ties go to the code with an even mantissa LSB (even code); saturating.
  double max_finite() const {
    double m = 0;
    for (unsigned c = 0; c < unsigned(code_count()); ++c)
      if (!std::isnan(value(c))) m = std::fmax(m, value(c));
    return m;
  }
  unsigned nearest(double x) const {
    if (std::fabs(x) > max_finite()) x = std::copysign(max_finite(), x);
    unsigned best = 0;
    double best_err = std::numeric_limits<double>::infinity();
    for (unsigned c = 0; c < unsigned(code_count()); ++c) {
      const double v = value(c);
      if (std::isnan(v)) continue;
      if (std::signbit(v) != std::signbit(x) && v != 0.0) continue;  // same sign side (zero: keep sign below)
      const double err = std::fabs(v - x);
      if (err < best_err || (err == best_err && (c & 1) == 0 && (best & 1) == 1)) {
        best = c;
        best_err = err;
      }
    }
    // Zero keeps the sign of x.
    if (value(best) == 0.0 && is_signed) best = std::signbit(x) ? (1u << (exp_bits + man_bits)) : 0u;
    return best;
  }
};

inline const ref_encoding ref_e2m1{2, 1, 1, true, false, false};
inline const ref_encoding ref_e4m3{4, 3, 7, true, true, false};
inline const ref_encoding ref_ue8m0{8, 0, 127, false, false, true};

}  // namespace dsv4::test
