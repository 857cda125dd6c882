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
#include "dsv4/numerics/bf16.hpp"
#include "dsv4/runtime/device_buffer.cuh"
#include "support/gpu.hpp"
#include "support/random.hpp"
#include "support/wgmma.cuh"

namespace utf = boost::unit_test;
using namespace dsv4;
using numerics::bf16;
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

//! Commits the warpgroup's MMAs, waits for them and writes D (64 x N, row-major) to `d_out`.
template <int N>
__device__ void wait_and_store(float (&d)[N / 2], float* d_out) {
  wgmma::commit_group();
  wgmma::wait_group<0>();
#pragma unroll
  for (int i = 0; i < N / 2; ++i) wgmma::fence_operand(d[i]);
  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, q = threadIdx.x % 4;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    const int j = i / 4, row = 16 * warp + g + 8 * ((i % 4) / 2), col = 8 * j + 2 * q + i % 2;
    d_out[row * N + col] = d[i];
  }
}

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
  wait_and_store<N>(d, d_out);
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

//! After a probe launch: how many of the 64 x `n` outputs in `dd` differ from want(row, column)
//! (exact comparison; NaN, the poison, never passes).
template <class Want>
std::size_t wrong_outputs(const device_buffer<float>& dd, int n, Want want) {
  DSV4_CUDA_CHECK_LAUNCH();
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  const auto got = dd.download();
  std::size_t wrong = 0;
  for (int r = 0; r < 64; ++r)
    for (int c = 0; c < n; ++c) wrong += !(got[std::size_t(r) * n + c] == want(r, c));
  return wrong;
}

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
  return wrong_outputs(dd, N, [&](int r, int c) {
    float want = 0.0f;
    for (int k = 0; k < 32; ++k) want += av[r * 32 + k] * bv[c * 32 + k];
    return want;
  });
}

//! The bf16 forms sparse attention uses, on small integers (every sum exact in fp32), 64 x 16 x N:
//! `nmajor` false: m64n16k16 with A and B both in shared memory, K-major (core matrix (row
//! group, K half) at (2 group + half) x 128, leading offset 128, stride 256); true: m64n128k16
//! with A in registers (mma.m16n8k16's order) and B N-major (core matrix (K group, N group) at
//! (16 K group + N group) x 128, leading offset 2048 between K groups, stride 128 between N groups).
//! `swap_a` / `swap_b` exchange a descriptor's two offsets.
template <bool NMajor>
__global__ void bf16_probe_kernel(const bf16* a, const bf16* b, float* d_out, bool swap_a, bool swap_b) {
  constexpr int N = NMajor ? 128 : 16;
  __shared__ __align__(128) bf16 a_tile[64 * 16];
  // B with room for the swapped N-major variant, which reads 16 N groups 2048 bytes apart.
  constexpr int kBTile = NMajor ? 16 * 1024 : 16 * N;
  __shared__ __align__(128) bf16 b_tile[kBTile];
  for (int i = threadIdx.x; i < kBTile; i += blockDim.x) b_tile[i] = bf16::from_float(0.0f);
  __syncthreads();
  for (int i = threadIdx.x; i < 64 * 16; i += blockDim.x) {  // a is [64][16]
    const int r = i / 16, k = i % 16;
    a_tile[((r / 8) * 2 + k / 8) * 64 + (r % 8) * 8 + k % 8] = a[i];
  }
  for (int i = threadIdx.x; i < 16 * N; i += blockDim.x) {  // b is [16 (K)][N]
    const int k = i / N, n = i % N;
    if (NMajor)
      b_tile[((k / 8) * (N / 8) + n / 8) * 64 + (k % 8) * 8 + n % 8] = b[i];
    else
      b_tile[((n / 8) * 2 + k / 8) * 64 + (n % 8) * 8 + k % 8] = b[i];
  }
  wgmma::fence_shared_for_async();
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  float d[N / 2] = {};
#pragma unroll
  for (int i = 0; i < N / 2; ++i) wgmma::fence_operand(d[i]);
  auto desc = [](const void* p, std::uint32_t lead, std::uint32_t stride, bool swap) {
    return swap ? wgmma::smem_descriptor(p, stride, lead) : wgmma::smem_descriptor(p, lead, stride);
  };
  if constexpr (NMajor) {
    auto pair = [&](int row, int k) {
      const bf16* p = a + (16 * warp + row) * 16 + k;
      return std::uint32_t(p[0].bits) | std::uint32_t(p[1].bits) << 16;
    };
    std::uint32_t frag[4] = {pair(g, 2 * q), pair(g + 8, 2 * q), pair(g, 8 + 2 * q), pair(g + 8, 8 + 2 * q)};
#pragma unroll
    for (int i = 0; i < 4; ++i) wgmma::fence_operand(frag[i]);
    wgmma::fence();
    wgmma::mma_bf16_nmajor128(d, frag, desc(b_tile, (N / 8) * 128, 128, swap_b), false);
  } else {
    wgmma::fence();
    wgmma::mma_bf16_ss16(d, desc(a_tile, 128, 256, swap_a), desc(b_tile, 128, 256, swap_b), false);
  }
  wait_and_store<N>(d, d_out);
}

//! Outputs of bf16_probe_kernel that differ from the host product (NaN-poisoned beforehand).
template <bool NMajor>
std::size_t bf16_mismatches(bool swap_a, bool swap_b, std::uint64_t salt) {
  constexpr int N = NMajor ? 128 : 16;
  auto rng = test::make_rng(salt);
  std::vector<bf16> a(64 * 16), b(16 * N);
  for (auto& x : a) x = bf16::from_float(float(int(rng() % 9) - 4));
  for (auto& x : b) x = bf16::from_float(float(int(rng() % 9) - 4));
  device_buffer<bf16> da{std::span<const bf16>(a)}, db{std::span<const bf16>(b)};
  device_buffer<float> dd(64 * N);
  dd.fill_bytes(0xFF);
  bf16_probe_kernel<NMajor><<<1, 128>>>(da.data(), db.data(), dd.data(), swap_a, swap_b);
  return wrong_outputs(dd, N, [&](int r, int c) {
    float want = 0.0f;
    for (int k = 0; k < 16; ++k) want += a[r * 16 + k].to_float() * b[k * N + c].to_float();
    return want;
  });
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

// The bf16 forms of sparse attention (both operands in shared memory; B N-major): the layouts
// wgmma.cuh documents must be the ones the hardware agrees with; the message lists every variant.
BOOST_AUTO_TEST_CASE(bf16_shared_and_n_major_layouts,
                     *utf::label("gpu") * utf::precondition(test::has_wgmma_device{})) {
  for (bool swap_a : {false, true})
    for (bool swap_b : {false, true})
      BOOST_TEST_MESSAGE(
          "m64n16k16 both in shared memory, A offsets "
          << (swap_a ? "swapped" : "as placed") << ", B offsets " << (swap_b ? "swapped" : "as placed")
          << ": " << bf16_mismatches<false>(swap_a, swap_b, 900 + 2 * swap_a + swap_b) << " of 1024 differ");
  for (bool swap_b : {false, true})
    BOOST_TEST_MESSAGE("m64n128k16 B N-major, offsets " << (swap_b ? "swapped" : "as placed") << ": "
                                                        << bf16_mismatches<true>(false, swap_b, 910 + swap_b)
                                                        << " of 8192 differ");
  BOOST_TEST(bf16_mismatches<false>(false, false, 920) == 0u,
             "mma_bf16_ss16: leading offset = K-half distance, stride = row-group distance disagrees with "
             "the hardware");
  BOOST_TEST(bf16_mismatches<true>(false, false, 921) == 0u,
             "mma_bf16_nmajor128: leading offset = K-group distance, stride = N-group distance disagrees "
             "with the hardware");
}

BOOST_AUTO_TEST_SUITE_END()
