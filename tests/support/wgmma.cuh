#pragma once
// Cases that run the wgmma kernels carry `*utf::precondition(dsv4::test::has_wgmma_device{})`:
// skipped with this message where no CUDA device is visible, or the device or the build cannot
// run wgmma (a kernel compiled without sm_90a would trap and take the context with it).

#include <boost/test/unit_test.hpp>

#include "dsv4/kernels/gemm/wgmma_gemm.cuh"
#include "dsv4/runtime/cuda_check.cuh"

namespace dsv4::test {
struct has_wgmma_device {
  boost::test_tools::assertion_result operator()(boost::unit_test::test_unit_id) const {
    if (runtime::cuda_device_count() == 0) {
      boost::test_tools::assertion_result r(false);
      r.message() << "no CUDA device visible";
      return r;
    }
    boost::test_tools::assertion_result r(kernels::gemm::wgmma_supported());
    if (!r)
      r.message() << "the device or the build has no wgmma (needs compute capability 9.x and sm_90a code)";
    return r;
  }
};
}  // namespace dsv4::test
