#pragma once
// GPU test cases carry `*utf::precondition(dsv4::test::has_cuda_device{})`: where no device is
// visible they are reported as skipped with this message, and pass.

#include <boost/test/unit_test.hpp>

#include "dsv4/runtime/cuda_check.cuh"

namespace dsv4::test {
struct has_cuda_device {
  boost::test_tools::assertion_result operator()(boost::unit_test::test_unit_id) const {
    boost::test_tools::assertion_result r(runtime::cuda_device_count() > 0);
    if (!r) r.message() << "no CUDA device visible";
    return r;
  }
};
//! Cases that need `n` GPUs (label multigpu): skipped with this message where fewer are visible.
struct has_cuda_devices {
  int n;
  boost::test_tools::assertion_result operator()(boost::unit_test::test_unit_id) const {
    const int visible = runtime::cuda_device_count();
    boost::test_tools::assertion_result r(visible >= n);
    if (!r) r.message() << "needs " << n << " CUDA devices, " << visible << " visible";
    return r;
  }
};
}  // namespace dsv4::test
