// The wgmma building blocks (kernels/wgmma.cuh) against the hardware: one m64nNk32 E4M3 product
// of small exact values, computed under every candidate operand layout (the A register order,
// the placement of B's core matrices, the descriptor's two byte offsets either way round). The
// test names every combination the hardware agrees with and requires the one wgmma.cuh (and so
// the wgmma GEMM) uses to be among them: if it fails, the message says which constants to change.

#include <boost/test/unit_test.hpp>

#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "dsv4/kernels/wgmma.cuh"
#include "dsv4/runtime/device_buffer.cuh"
#include "support/gpu.hpp"
#include "support/random.hpp"
#include "support/wgmma.cuh"

namespace utf = boost::unit_test;
using namespace dsv4;
using runtime::device_buffer;
namespace wgmma = dsv4::kernels::wgmma;

namespace {

//! One candidate layout. a_order 0: registers (row g, K 4q..), (row g + 8, K 4q..), (row g, K 16 +
//! 4q..), (row g + 8, K 16 + 4q..), as mma.m16n8k32; 1: (g, 4q), (g, 16 + 4q), (g + 8, 4q), (g + 8,
//! 16 + 4q). b_place 0: core matrix (token group, K half) at (2 ng + kh) x 128 (wgmma.cuh); 1: at
//! (kh x N/8 + ng) x 128. swap: the descriptor's leading and stride offsets exchanged.
struct layout {
  int a_order, b_place;
  bool swap;
  std::string name() const {
    std::ostringstream s;
    s << "A order " << a_order << ", B placement " << b_place
      << (swap ? ", offsets swapped" : ", offsets as placed");
    return s.str();
  }
};

template <int N>
__global__ void probe_kernel(const std::uint8_t* a, const std::uint8_t* b, float* d_out, layout l) {
  __shared__ __align__(128) std::uint8_t b_tile[N * 32];
  const int groups = N / 8;
  for (int i = threadIdx.x; i < N * 32; i += blockDim.x) {
    const int t = i / 32, k = i % 32, ng = t / 8, kh = k / 16;
    const int core = l.b_place == 0 ? wgmma::b_core_offset(ng, kh) : (kh * groups + ng) * 128;
    b_tile[core + (t % 8) * 16 + k % 16] = b[i];
  }
  wgmma::fence_shared_for_async();
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  auto word = [&](int row, int k0) {
    const std::uint8_t* p = a + (16 * warp + row) * 32 + k0;
    return std::uint32_t(p[0]) | std::uint32_t(p[1]) << 8 | std::uint32_t(p[2]) << 16 |
           std::uint32_t(p[3]) << 24;
  };
  std::uint32_t frag[4];
  if (l.a_order == 0)
    frag[0] = word(g, 4 * q), frag[1] = word(g + 8, 4 * q), frag[2] = word(g, 16 + 4 * q),
    frag[3] = word(g + 8, 16 + 4 * q);
  else
    frag[0] = word(g, 4 * q), frag[1] = word(g, 16 + 4 * q), frag[2] = word(g + 8, 4 * q),
    frag[3] = word(g + 8, 16 + 4 * q);
  std::uint32_t lead = l.b_place == 0 ? wgmma::b_leading_byte_offset : groups * 128;
  std::uint32_t stride = l.b_place == 0 ? wgmma::b_stride_byte_offset : 128;
  if (l.swap) {
    const std::uint32_t t = lead;
    lead = stride, stride = t;
  }
  float d[N / 2] = {};
  wgmma::fence();
  wgmma::mma_e4m3<N>(d, frag, wgmma::smem_descriptor(b_tile, lead, stride), false);
  wgmma::commit_group();
  wgmma::wait_group<0>();
#pragma unroll
  for (int i = 0; i < N / 2; ++i) wgmma::fence_operand(d[i]);
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    const int j = i / 4, row = 16 * warp + g + 8 * ((i % 4) / 2), col = 8 * j + 2 * q + i % 2;
    d_out[row * N + col] = d[i];
  }
}

//! Small E4M3 values (0, +-0.5 .. +-4): every product and every sum of 32 is exact in fp32.
struct small_e4m3 {
  static constexpr std::uint8_t codes[7] = {0x00, 0x30, 0x38, 0x3C, 0x40, 0x44, 0x48};
  static constexpr float values[7] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f};
  std::uint8_t code;
  float value;
  static small_e4m3 draw(std::mt19937_64& rng) {
    const int i = int(rng() % 7);
    const bool negative = rng() & 1;
    return {std::uint8_t(codes[i] | (negative ? 0x80 : 0)), negative ? -values[i] : values[i]};
  }
};

//! Runs one layout at width N; returns how many of the 64 x N outputs differ from the host.
template <int N>
std::size_t mismatches(const layout& l, std::uint64_t salt) {
  auto rng = test::make_rng(salt);
  std::vector<std::uint8_t> a(64 * 32), b(N * 32);
  std::vector<float> av(a.size()), bv(b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    const auto v = small_e4m3::draw(rng);
    a[i] = v.code, av[i] = v.value;
  }
  for (std::size_t i = 0; i < b.size(); ++i) {
    const auto v = small_e4m3::draw(rng);
    b[i] = v.code, bv[i] = v.value;
  }
  device_buffer<std::uint8_t> da{std::span<const std::uint8_t>(a)}, db{std::span<const std::uint8_t>(b)};
  device_buffer<float> dd(64 * N);
  dd.fill_bytes(0xFF);  // NaN: every output must be written
  probe_kernel<N><<<1, 128>>>(da.data(), db.data(), dd.data(), l);
  DSV4_CUDA_CHECK_LAUNCH();
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  const auto got = dd.download();
  std::size_t wrong = 0;
  for (int r = 0; r < 64; ++r)
    for (int c = 0; c < N; ++c) {
      float want = 0.0f;
      for (int k = 0; k < 32; ++k) want += av[r * 32 + k] * bv[c * 32 + k];
      wrong += !(got[r * N + c] == want);  // NaN never passes
    }
  return wrong;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(wgmma_cuda)

// Which layouts the hardware agrees with, at N = 16 (two token groups, so the two byte offsets
// are told apart); the one wgmma.cuh uses must be among them.
BOOST_AUTO_TEST_CASE(operand_layouts_probe,
                     *utf::label("gpu") * utf::precondition(test::has_wgmma_device{})) {
  std::vector<std::string> agree;
  bool ours = false;
  for (int a_order : {0, 1})
    for (int b_place : {0, 1})
      for (bool swap : {false, true}) {
        const layout l{a_order, b_place, swap};
        const std::size_t wrong = mismatches<16>(l, 700 + 4 * a_order + 2 * b_place + swap);
        BOOST_TEST_MESSAGE(l.name() << ": " << wrong << " of 1024 outputs differ");
        if (wrong == 0) agree.push_back(l.name());
        if (wrong == 0 && a_order == 0 && b_place == 0 && !swap) ours = true;
      }
  std::string list;
  for (const auto& s : agree) list += "\n  " + s;
  BOOST_TEST_MESSAGE("layouts the hardware agrees with:" << (list.empty() ? std::string(" none") : list));
  BOOST_TEST(
      ours,
      "wgmma.cuh's layout (A order 0, B placement 0, offsets as placed) disagrees with the hardware; "
      "the layouts that agree:"
          << (list.empty() ? std::string(" none (check the descriptor's bit fields)") : list)
          << "\nchange wgmma.cuh's b_core_offset / b_*_byte_offset or the A register order to one of them");
}

// wgmma.cuh's layout at every width the GEMM uses.
BOOST_AUTO_TEST_CASE(every_width_matches_host,
                     *utf::label("gpu") * utf::precondition(test::has_wgmma_device{})) {
  const layout ours{0, 0, false};
  BOOST_TEST(mismatches<8>(ours, 801) == 0u);
  BOOST_TEST(mismatches<16>(ours, 802) == 0u);
  BOOST_TEST(mismatches<32>(ours, 803) == 0u);
  BOOST_TEST(mismatches<64>(ours, 804) == 0u);
}

BOOST_AUTO_TEST_SUITE_END()
