// NCCL collectives (parallel/nccl.cuh) against the host simulation's semantics
// (tensor_parallel_reference.hpp: sums in rank order), and a row-parallel FP8 linear layer (wo_b's
// split along K) on W GPUs against the host's per-rank reference GEMMs summed as model.py sums
// them. Cases labelled `gpu` run on one GPU (a world of one: every collective the identity);
// cases labelled `multigpu` (names ending in _multigpu) need two or more GPUs and are skipped,
// with a message, elsewhere.

#include <boost/test/unit_test.hpp>

#include <cmath>
#include <cstdint>
#include <exception>
#include <mutex>
#include <random>
#include <span>
#include <thread>
#include <vector>

#include "dsv4/kernels/gemm/block_scaled_gemm.cuh"
#include "dsv4/kernels/gemm/reference.hpp"
#include "dsv4/kernels/gemm/weight_tiles.hpp"
#include "dsv4/parallel/nccl.cuh"
#include "dsv4/runtime/device_buffer.cuh"
#include "support/gpu.hpp"
#include "support/random.hpp"

namespace utf = boost::unit_test;
using namespace dsv4;
using numerics::bf16;
using runtime::device_buffer;

namespace {


//! Runs fn(rank) on one thread per rank with that rank's device current; rethrows the first
//! failure after every thread has ended. A rank that throws aborts the world, so that the others
//! return from the collective they wait in instead of hanging.
template <class Fn>
void for_each_rank(const parallel::nccl_world& world, Fn fn) {
  std::vector<std::thread> threads;
  std::exception_ptr failure;
  std::mutex m;
  for (int r = 0; r < world.size(); ++r)
    threads.emplace_back([&, r] {
      try {
        DSV4_CUDA_CHECK(cudaSetDevice(world.device(r)));
        fn(r);
      } catch (...) {
        {
          std::lock_guard lock(m);
          if (!failure) failure = std::current_exception();
        }
        world.abort();
      }
    });
  for (auto& t : threads) t.join();
  if (failure) std::rethrow_exception(failure);
}

std::vector<float> random_floats(std::size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng) * std::ldexp(1.0f, int(rng() % 9) - 4);  // magnitudes over 2^-4 .. 2^4
  return v;
}

//! The collectives on every rank of `world` against the host's rank-order sums: bit for bit with
//! up to two ranks (one addition per element), else within fp32 rounding of the sum's magnitude.
void check_collectives(const parallel::nccl_world& world) {
  const int W = world.size();
  const std::size_t n = 100003;  // odd: no vector-width luck
  auto rng = test::make_rng(100 + W);
  std::vector<std::vector<float>> f(W);
  std::vector<std::vector<bf16>> b(W);
  for (int r = 0; r < W; ++r) {
    f[r] = random_floats(n, rng);
    const auto g = random_floats(n, rng);
    b[r].resize(n);
    for (std::size_t i = 0; i < n; ++i) b[r][i] = bf16::from_float(g[i]);
  }
  // Host: sums in rank order, as host_communicator adds them.
  std::vector<float> f_sum(n), f_mag(n), partial_sum(n);
  std::vector<bf16> b_sum(n);
  for (std::size_t i = 0; i < n; ++i) {
    float s = f[0][i], m = std::fabs(f[0][i]), p = b[0][i].to_float();
    bf16 bs = b[0][i];
    for (int r = 1; r < W; ++r) {
      s += f[r][i], m += std::fabs(f[r][i]);
      p += b[r][i].to_float();
      bs = bf16::from_float(bs.to_float() + b[r][i].to_float());
    }
    f_sum[i] = s, f_mag[i] = m, partial_sum[i] = p, b_sum[i] = bs;
  }
  std::vector<std::vector<float>> got_f(W), got_gather(W);
  std::vector<std::vector<bf16>> got_b(W), got_partials(W);
  for_each_rank(world, [&](int r) {
    const auto comm = world.rank(r);
    cudaStream_t st;
    DSV4_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    device_buffer<float> df{std::span<const float>(f[r])}, gather(n * W), scratch(n);
    device_buffer<bf16> db{std::span<const bf16>(b[r])}, partial{std::span<const bf16>(b[r])}, out(n);
    gather.fill_bytes(0xFF), out.fill_bytes(0xFF);  // NaN: every element must be written
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
    comm.all_gather(df.data(), n, gather.data(), st);
    comm.all_reduce_sum(df.data(), n, st);
    comm.all_reduce_sum(db.data(), n, st);
    comm.all_reduce_partials(partial.data(), scratch.data(), out.data(), n, st);
    DSV4_CUDA_CHECK(cudaStreamSynchronize(st));
    DSV4_CUDA_CHECK(cudaStreamDestroy(st));
    got_f[r] = df.download(), got_b[r] = db.download(), got_gather[r] = gather.download(),
    got_partials[r] = out.download();
  });
  for (int r = 0; r < W; ++r) {
    std::size_t f_bad = 0, f_differ = 0, b_bad = 0, b_differ = 0, p_bad = 0, p_differ = 0, g_differ = 0;
    for (std::size_t i = 0; i < n; ++i) {
      // fp32: rank order and another order each round W - 1 times, by at most half an ulp
      // (2^-24) of the magnitudes' sum each time.
      const double f_tol = (W - 1) * std::ldexp(double(f_mag[i]), -23);
      f_differ += got_f[r][i] != f_sum[i];
      f_bad += !(std::fabs(double(got_f[r][i]) - f_sum[i]) <= f_tol);
      // bf16: each addition rounds to bf16 (half an ulp: 2^-9), in either order.
      double b_mag = 0;
      for (int q = 0; q < W; ++q) b_mag += std::fabs(b[q][i].to_float());
      b_differ += got_b[r][i].bits != b_sum[i].bits;
      b_bad += !(std::fabs(double(got_b[r][i].to_float()) - b_sum[i].to_float()) <=
                 (W - 1) * std::ldexp(b_mag, -8));
      // Partials: fp32 sum (order as above), then one rounding, which a different fp32 sum can
      // move by one bf16 ulp (at most 2^-7 of the value).
      const bf16 want_p = bf16::from_float(partial_sum[i]);
      p_differ += got_partials[r][i].bits != want_p.bits;
      p_bad += !(std::fabs(double(got_partials[r][i].to_float()) - want_p.to_float()) <=
                 std::ldexp(std::fabs(double(want_p.to_float())), -7) + (W - 1) * std::ldexp(b_mag, -23));
      for (int q = 0; q < W; ++q) g_differ += got_gather[r][q * n + i] != f[q][i];
    }
    BOOST_TEST_MESSAGE("world " << W << " rank " << r << ": fp32 sums differing from rank order " << f_differ
                                << ", bf16 " << b_differ << ", partials " << p_differ << " of " << n);
    BOOST_TEST(g_differ == 0u, "rank " << r << ": " << g_differ << " gathered values differ");
    BOOST_TEST(f_bad == 0u, "rank " << r << ": " << f_bad << " fp32 sums beyond rounding");
    BOOST_TEST(b_bad == 0u, "rank " << r << ": " << b_bad << " bf16 sums beyond rounding");
    BOOST_TEST(p_bad == 0u, "rank " << r << ": " << p_bad << " partial sums beyond rounding");
    if (W <= 2) {  // one addition per element: the order cannot matter
      BOOST_TEST(f_differ == 0u);
      BOOST_TEST(b_differ == 0u);
      BOOST_TEST(p_differ == 0u);
    }
    for (int q = 0; q < r; ++q) {  // every rank receives the same bits
      std::size_t differ = 0;
      for (std::size_t i = 0; i < n; ++i)
        differ += got_f[r][i] != got_f[q][i] || got_b[r][i].bits != got_b[q][i].bits ||
                  got_partials[r][i].bits != got_partials[q][i].bits;
      BOOST_TEST(differ == 0u,
                 "ranks " << q << " and " << r << " received different sums at " << differ << " elements");
    }
  }
}

//! wo_b as model.py runs it on W ranks (RowParallelLinear): rank r holds columns
//! [r K / W, (r + 1) K / W) of the FP8 weight and its scales, multiplies its slice of the
//! activations into a bf16 partial, and the partials are summed in fp32 and rounded once.
void check_row_parallel_linear(const parallel::nccl_world& world, int m, int n, int k) {
  const int W = world.size();
  BOOST_REQUIRE(k % (32 * W) == 0);
  const int kr = k / W;
  auto rng = test::make_rng(200 + W);
  auto e4m3 = [&] {
    auto c = std::uint8_t(rng());
    return (c & 0x7F) == 0x7F ? std::uint8_t(0x38) : c;  // no NaN codes
  };
  std::vector<std::uint8_t> a(std::size_t(m) * k), a_s(std::size_t(m) * (k / 32)), w(std::size_t(n) * k),
      w_s(std::size_t((n + 31) / 32) * (k / 32));
  for (auto& v : a) v = e4m3();
  for (auto& v : w) v = e4m3();
  for (auto& v : a_s) v = std::uint8_t(120 + rng() % 12);
  for (auto& v : w_s) v = std::uint8_t(118 + rng() % 12);
  // Rank r's slices, checkpoint layout (rows of K/W columns).
  auto columns = [](const std::vector<std::uint8_t>& x, int rows, int cols, int c0, int c1) {
    std::vector<std::uint8_t> y(std::size_t(rows) * (c1 - c0));
    for (int i = 0; i < rows; ++i)
      for (int j = c0; j < c1; ++j) y[std::size_t(i) * (c1 - c0) + (j - c0)] = x[std::size_t(i) * cols + j];
    return y;
  };
  const kernels::gemm::gemm_shape part{m, n, kr};
  std::vector<std::vector<std::uint8_t>> ra(W), ras(W), rw(W), rws(W);
  std::vector<std::vector<bf16>> host_partial(W);
  for (int r = 0; r < W; ++r) {
    ra[r] = columns(a, m, k, r * kr, (r + 1) * kr);
    ras[r] = columns(a_s, m, k / 32, r * kr / 32, (r + 1) * kr / 32);
    rw[r] = columns(w, n, k, r * kr, (r + 1) * kr);
    rws[r] = columns(w_s, (n + 31) / 32, k / 32, r * kr / 32, (r + 1) * kr / 32);
    host_partial[r] = kernels::gemm::fp8_gemm_reference(part, ra[r], ras[r], rw[r], rws[r]);
  }
  // The host simulation: fp32 sum of the bf16 partials in rank order, one rounding.
  std::vector<bf16> want(std::size_t(m) * n);
  std::vector<double> mag(want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    float s = host_partial[0][i].to_float();
    double g = std::fabs(s);
    for (int r = 1; r < W; ++r)
      s += host_partial[r][i].to_float(), g += std::fabs(host_partial[r][i].to_float());
    want[i] = bf16::from_float(s), mag[i] = g;
  }
  std::vector<std::vector<bf16>> got(W), got_partial(W);
  for_each_rank(world, [&](int r) {
    const auto comm = world.rank(r);
    cudaStream_t st;
    DSV4_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    const auto tiled =
        kernels::gemm::tile_weight(kernels::gemm::weight_format::fp8_tile32, n, kr, rw[r], rws[r]);
    device_buffer<std::uint8_t> da{std::span<const std::uint8_t>(ra[r])},
        das{std::span<const std::uint8_t>(ras[r])}, dw{std::span<const std::uint8_t>(tiled.codes)},
        dws{std::span<const std::uint8_t>(tiled.scales)};
    device_buffer<bf16> c(std::size_t(m) * n), out(std::size_t(m) * n);
    device_buffer<float> scratch(std::size_t(m) * n);
    c.fill_bytes(0xFF), out.fill_bytes(0xFF);
    kernels::gemm::gemm_workspace work(std::max<std::size_t>(1, kernels::gemm::gemm_partial_floats(part)));
    kernels::gemm::block_scaled_gemm({part, da.data(), das.data(), dw.data(), dws.data(), c.data()},
                                     kernels::gemm::weight_format::fp8_tile32, &work, st);
    comm.all_reduce_partials(c.data(), scratch.data(), out.data(), std::size_t(m) * n, st);
    DSV4_CUDA_CHECK(cudaStreamSynchronize(st));
    DSV4_CUDA_CHECK(cudaStreamDestroy(st));
    got[r] = out.download(), got_partial[r] = c.download();
  });
  for (int r = 0; r < W; ++r) {
    std::size_t bad = 0, exact = 0, collective_differs = 0;
    double worst = 0;
    for (std::size_t i = 0; i < want.size(); ++i) {
      // The collective alone: the device partials summed on the host (two ranks: any order).
      float s = got_partial[0][i].to_float();
      for (int q = 1; q < W; ++q) s += got_partial[q][i].to_float();
      collective_differs += W <= 2 && got[r][i].bits != bf16::from_float(s).bits;
      // Against the host: each device partial may sit one bf16 ulp (at most 2^-7 of it) from the
      // host's (fp32 order inside the GEMM), and the result one more ulp.
      const double err = std::fabs(double(got[r][i].to_float()) - want[i].to_float());
      const double tol = std::ldexp(mag[i], -7) + std::ldexp(std::fabs(double(want[i].to_float())), -7);
      worst = std::max(worst, err / std::max(tol, 1e-30));
      bad += !(err <= tol);
      exact += got[r][i].bits == want[i].bits;
    }
    BOOST_TEST_MESSAGE("row-parallel FP8 linear M"
                       << m << " N" << n << " K" << k << " on " << W << " ranks, rank " << r << ": " << exact
                       << " of " << want.size()
                       << " bit-equal to the host simulation, worst error / tolerance " << worst);
    BOOST_TEST(collective_differs == 0u,
               collective_differs << " outputs differ from the device partials' sum");
    BOOST_TEST(bad == 0u, bad << " outputs beyond the tolerance");
    BOOST_TEST(exact * 10 >= want.size() * 9,
               "fewer than 90% of the outputs are bit-equal to the host simulation");
  }
}

// One thread driving every rank: collectives grouped (nccl_group), each on its rank's device
// whatever device is current; all_reduce_partials refuses to run inside a group.
void check_one_thread(const parallel::nccl_world& world) {
  const int W = world.size();
  const std::size_t n = 4099;
  auto rng = test::make_rng(300 + W);
  std::vector<std::vector<float>> v(W);
  std::vector<float> want(n, 0.0f);
  for (int r = 0; r < W; ++r) {
    v[r] = random_floats(n, rng);
    for (std::size_t i = 0; i < n; ++i) want[i] = r == 0 ? v[r][i] : want[i] + v[r][i];
  }
  std::vector<device_buffer<float>> bufs;
  std::vector<cudaStream_t> streams(W);
  for (int r = 0; r < W; ++r) {
    DSV4_CUDA_CHECK(cudaSetDevice(world.device(r)));
    bufs.emplace_back(std::span<const float>(v[r]));
    DSV4_CUDA_CHECK(cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking));
  }
  DSV4_CUDA_CHECK(cudaSetDevice(world.device(0)));
  {
    parallel::nccl_group group;
    device_buffer<bf16> dummy(1);
    BOOST_CHECK_THROW(
        world.rank(0).all_reduce_partials(dummy.data(), bufs[0].data(), dummy.data(), 1, streams[0]), error);
    for (int r = 0; r < W; ++r) world.rank(r).all_reduce_sum(bufs[r].data(), n, streams[r]);
    group.end();
  }
  for (int r = 0; r < W; ++r) {
    DSV4_CUDA_CHECK(cudaSetDevice(world.device(r)));
    DSV4_CUDA_CHECK(cudaStreamSynchronize(streams[r]));
    DSV4_CUDA_CHECK(cudaStreamDestroy(streams[r]));
    const auto got = bufs[r].download();
    std::size_t bad = 0;
    for (std::size_t i = 0; i < n; ++i)
      bad += W <= 2 ? got[i] != want[i] : !(std::fabs(got[i] - want[i]) <= 1e-5f * (1 + std::fabs(want[i])));
    BOOST_TEST(bad == 0u, "one thread, rank " << r << ": " << bad << " sums differ");
  }
  DSV4_CUDA_CHECK(cudaSetDevice(world.device(0)));
}

}  // namespace

BOOST_AUTO_TEST_SUITE(nccl_cuda)

BOOST_AUTO_TEST_CASE(world_of_one, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  const auto world = parallel::nccl_world::first(1);
  check_collectives(world);
  check_row_parallel_linear(world, 3, 160, 1024);
  check_one_thread(world);
}

BOOST_AUTO_TEST_CASE(bad_worlds_are_refused,
                     *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  const int visible = runtime::cuda_device_count();
  BOOST_CHECK_THROW(parallel::nccl_world(std::vector<int>{}), error);
  BOOST_CHECK_THROW(parallel::nccl_world(std::vector<int>{visible}), error);
  BOOST_CHECK_THROW(parallel::nccl_world(std::vector<int>{0, 0}), error);
  const auto world = parallel::nccl_world::first(1);
  BOOST_CHECK_THROW((void)world.rank(1), error);
  BOOST_CHECK_THROW(world.rank(0).all_reduce_sum(static_cast<float*>(nullptr), 4, nullptr), error);
  BOOST_CHECK_THROW((void)world.device(1), error);
}

BOOST_AUTO_TEST_CASE(every_gpu_multigpu, *utf::label("multigpu") * utf::precondition(test::has_cuda_devices{2})) {
  const auto world = parallel::nccl_world::first(runtime::cuda_device_count());
  check_collectives(world);
  // wo_b's shape with a few tokens (5120 x 8192 would do too; smaller keeps the host reference quick).
  check_row_parallel_linear(world, 5, 640, 2048);
  check_one_thread(world);
  // Two of the GPUs, in reverse order: rank 0 on device 1.
  const parallel::nccl_world reversed(std::vector<int>{1, 0});
  check_collectives(reversed);
  check_one_thread(reversed);
}

BOOST_AUTO_TEST_SUITE_END()
