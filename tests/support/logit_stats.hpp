#pragma once
// How close one model's fp32 logit rows are to another's (the CUDA model against the host model,
// W ranks against one): the worst |difference| relative to the row's largest reference logit, the
// smallest cosine, and how often the argmax agrees. A non-finite logit fails the test.

#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>

namespace dsv4::test {

struct logit_stats {
  std::size_t rows = 0, argmax_same = 0;
  double worst = 0;         // largest |got - want| relative to the row's largest |want|
  double min_cosine = 1.0;  // smallest cosine similarity of a row with the reference's
  void add(std::span<const float> got, std::span<const float> want) {
    double d = 0, peak = 0, gg = 0, ww = 0, gw = 0;
    for (std::size_t i = 0; i < got.size(); ++i) {
      BOOST_REQUIRE_MESSAGE(std::isfinite(got[i]), "non-finite logit");
      d = std::max(d, double(std::fabs(got[i] - want[i])));
      peak = std::max(peak, double(std::fabs(want[i])));
      gg += double(got[i]) * got[i], ww += double(want[i]) * want[i], gw += double(got[i]) * want[i];
    }
    ++rows;
    worst = std::max(worst, d / peak);
    min_cosine = std::min(min_cosine, gw / std::sqrt(gg * ww));
    argmax_same += std::max_element(got.begin(), got.end()) - got.begin() ==
                   std::max_element(want.begin(), want.end()) - want.begin();
  }
};

}  // namespace dsv4::test
