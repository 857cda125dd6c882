#pragma once
// How close one model's fp32 logit rows are to another's (the CUDA model against the host model,
// W ranks against one): the worst |difference| relative to the row's largest reference logit, the
// smallest cosine, and how often the argmax agrees. A non-finite logit fails the test.

#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>
#include <sstream>
#include <string>
#include <vector>

namespace dsv4::test {

struct logit_stats {
  std::size_t rows = 0, argmax_same = 0;
  double worst = 0;         // largest |got - want| relative to the row's largest |want|
  double min_cosine = 1.0;  // smallest cosine similarity of a row with the reference's
  std::vector<double> row_worst;  // each row's |got - want| relative to its largest |want|, in order
  void add(std::span<const float> got, std::span<const float> want) {
    double d = 0, peak = 0, gg = 0, ww = 0, gw = 0;
    for (std::size_t i = 0; i < got.size(); ++i) {
      BOOST_REQUIRE_MESSAGE(std::isfinite(got[i]), "non-finite logit");
      d = std::max(d, double(std::fabs(got[i] - want[i])));
      peak = std::max(peak, double(std::fabs(want[i])));
      gg += double(got[i]) * got[i], ww += double(want[i]) * want[i], gw += double(got[i]) * want[i];
    }
    ++rows;
    row_worst.push_back(d / peak);
    worst = std::max(worst, d / peak);
    min_cosine = std::min(min_cosine, gw / std::sqrt(gg * ww));
    argmax_same += std::max_element(got.begin(), got.end()) - got.begin() ==
                   std::max_element(want.begin(), want.end()) - want.begin();
  }
  //! The `n` largest row errors with their row numbers, and how many rows exceed `above`: whether
  //! a large worst is one row (a near-tie that moved one FP8 code or route) or most of them.
  std::string worst_rows(std::size_t n, double above) const {
    std::vector<std::size_t> order(row_worst.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(),
              [&](std::size_t a, std::size_t b) { return row_worst[a] > row_worst[b]; });
    std::ostringstream os;
    os << "largest row errors:";
    for (std::size_t i = 0; i < std::min(n, order.size()); ++i)
      os << " row " << order[i] << " " << row_worst[order[i]];
    os << "; " << std::count_if(row_worst.begin(), row_worst.end(), [&](double v) { return v > above; })
       << " of " << row_worst.size() << " rows above " << above;
    return os.str();
  }
};

}  // namespace dsv4::test
