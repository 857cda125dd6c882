#pragma once
// The golden-logits comparison of the parity tests (tools/parity/compare.py's metrics), shared by
// the host model's test (model/test_parity_golden.cpp) and the CUDA model's
// (model/test_device_model_cuda.cu): the cases of tests/data/parity/cases.json, their id lists
// and the per-row errors against the reference's fp32 logits.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

namespace dsv4::test {

//! "1,2,3" -> {1, 2, 3} (cases.json's prompt and decode lists).
inline std::vector<std::int32_t> ids_of(const std::string& text) {
  std::vector<std::int32_t> ids;
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, ',');) ids.push_back(std::int32_t(std::stol(item)));
  return ids;
}

struct row_error {
  double max_rel = 0, rms_rel = 0;
  bool argmax_same = true, decisive = false;
};

//! One row: the largest and the RMS difference relative to the reference row's largest |logit| and
//! RMS; whether the argmax agrees, and whether the reference's top two are more than `tol` (of the
//! row's scale) apart (only then must it).
inline row_error compare_row(const float* ref, const std::vector<float>& ours, double tol) {
  const std::size_t n = ours.size();
  double scale = 0, err = 0, sq_ref = 0, sq_diff = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const double d = double(ref[i]) - double(ours[i]);
    scale = std::max(scale, std::fabs(double(ref[i])));
    err = std::max(err, std::fabs(d));
    sq_ref += double(ref[i]) * ref[i];
    sq_diff += d * d;
  }
  std::vector<std::size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + 2, order.end(), [&](std::size_t a, std::size_t b) { return ref[a] > ref[b]; });
  const auto ours_max = std::size_t(std::max_element(ours.begin(), ours.end()) - ours.begin());
  row_error e;
  e.max_rel = err / scale;
  e.rms_rel = std::sqrt(sq_diff / sq_ref);
  e.argmax_same = ours_max == order[0];
  e.decisive = double(ref[order[0]]) - double(ref[order[1]]) > tol * scale;
  return e;
}

}  // namespace dsv4::test
