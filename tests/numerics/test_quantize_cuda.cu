// CUDA codecs and block quantizers against the host reference (bit for bit) and against CUDA's
// own cuda_fp8.h / cuda_fp4.h conversions where they define the same operation.

#include <boost/test/unit_test.hpp>

#include <cuda_fp4.h>
#include <cuda_fp8.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "dsv4/io/safetensors.hpp"
#include "dsv4/numerics/fast_codec.cuh"
#include "dsv4/numerics/quantize.cuh"
#include "dsv4/runtime/device_buffer.cuh"
#include "support/data.hpp"
#include "support/gpu.hpp"
#include "support/random.hpp"

namespace utf = boost::unit_test;
using namespace dsv4;
using namespace dsv4::numerics;
using runtime::device_buffer;

namespace {

// Inputs that exercise every rounding path: all bf16 bit patterns, the same scaled by 1/16 (so
// bf16's grid falls between E2M1 codes), and random fp32 across the formats' ranges.
std::vector<float> codec_inputs() {
  std::vector<float> v;
  for (unsigned b = 0; b < 65536; ++b) {
    const float x = bf16::from_bits(std::uint16_t(b)).to_float();
    v.push_back(x);
    v.push_back(x * 0.0625f);
  }
  auto rng = test::make_rng(100);
  std::uniform_real_distribution<float> mant(-1.0f, 1.0f);
  std::uniform_int_distribution<int> ex(-20, 12);
  for (int i = 0; i < 1 << 20; ++i) v.push_back(std::ldexp(mant(rng), ex(rng)));
  return v;
}

// Host side of the cuda_fp8.h / cuda_fp4.h conversions (they are __host__ __device__).
__host__ __device__ std::uint8_t cuda_e4m3(float x) { return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3); }
__host__ __device__ std::uint8_t cuda_e2m1(float x) { return __nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest); }
__host__ __device__ std::uint8_t cuda_e8m0_ceil(float x) { return __nv_cvt_float_to_e8m0(x, __NV_SATFINITE, cudaRoundPosInf); }

__global__ void codec_kernel(const float* in, long long n, std::uint8_t* ours_e2m1, std::uint8_t* ours_e4m3,
                             std::uint8_t* ours_e8m0, std::uint8_t* cuda_fp4, std::uint8_t* cuda_fp8,
                             std::uint8_t* cuda_e8m0, std::uint8_t* fast_e2m1, std::uint8_t* fast_e4m3) {
  const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float x = in[i];
  fast_e2m1[i] = fast_encode<e2m1>(x);
  fast_e4m3[i] = fast_encode<e4m3>(x);
  ours_e2m1[i] = encode<e2m1>(x);
  ours_e4m3[i] = encode<e4m3>(x);
  ours_e8m0[i] = detail::pow2_ceil_scale_code(fabsf(x), 1.0f);
  cuda_fp4[i] = cuda_e2m1(x);
  cuda_fp8[i] = cuda_e4m3(x);
  cuda_e8m0[i] = cuda_e8m0_ceil(fabsf(x));
}

__global__ void decode_kernel(float* e2m1_out, float* e4m3_out, float* ue8m0_out, float* fast_e2m1_out,
                              float* fast_e4m3_out) {
  const int c = threadIdx.x;
  e4m3_out[c] = decode<e4m3>(std::uint8_t(c));
  fast_e4m3_out[c] = fast_decode<e4m3>(std::uint8_t(c));
  ue8m0_out[c] = decode<ue8m0>(std::uint8_t(c));
  if (c < 16) {
    e2m1_out[c] = decode<e2m1>(std::uint8_t(c));
    fast_e2m1_out[c] = fast_decode<e2m1>(std::uint8_t(c));
  }
}

bool same_bits_or_both_nan(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || float_to_bits(a) == float_to_bits(b);
}

// E8M0 round-up agrees with fast_round_scale for normal, finite inputs; both saturate above.
bool e8m0_comparable(float x) { return std::isfinite(x) && std::fabs(x) >= std::ldexp(1.0f, -126); }

// Rows of bf16 with per-row magnitudes from 2^-130 to 2^120 and some special rows.
std::vector<bf16> make_rows(std::mt19937_64& rng, long long rows, int channels) {
  std::vector<bf16> x(std::size_t(rows * channels));
  std::uniform_real_distribution<float> mant(-1.0f, 1.0f);
  const float inf = std::numeric_limits<float>::infinity();
  for (long long r = 0; r < rows; ++r) {
    bf16* row = x.data() + r * channels;
    const int base = int(rng() % 250) - 130;
    for (int c = 0; c < channels; ++c) row[c] = bf16::from_float(std::ldexp(mant(rng), base - int(rng() % 8)));
    switch (r % 9) {
      case 1: for (int c = 0; c < channels; ++c) row[c] = bf16::from_float((c & 1) ? -0.0f : 0.0f); break;
      case 2: row[rng() % channels] = bf16::from_float(std::numeric_limits<float>::quiet_NaN()); break;
      case 3: row[rng() % channels] = bf16::from_float((rng() & 1) ? inf : -inf); break;
      case 4: row[rng() % channels] = bf16::from_bits(0x7F7F); break;                   // bf16 max
      case 5: for (int c = 0; c < channels; ++c) row[c] = bf16::from_bits(std::uint16_t(rng() % 128)); break;  // subnormals
      default: break;
    }
  }
  return x;
}

template <class F>
struct host_packed {
  std::vector<std::uint8_t> codes, scales;
};

template <class F>
host_packed<F> host_quantize(const std::vector<bf16>& x, long long rows, int channels) {
  const std::size_t cb = std::size_t(channels) * F::element::storage_bits / 8, sb = std::size_t(channels / F::block_size);
  host_packed<F> p{std::vector<std::uint8_t>(cb * rows), std::vector<std::uint8_t>(sb * rows)};
  for (long long r = 0; r < rows; ++r)
    quantize_vector<F>(std::span(x).subspan(r * channels, channels), std::span(p.codes).subspan(r * cb, cb),
                       std::span(p.scales).subspan(r * sb, sb));
  return p;
}

template <class F>
void check_quantize_shape(long long rows, int channels, std::uint64_t salt) {
  BOOST_TEST_CONTEXT("rows " << rows << " channels " << channels) {
    auto rng = test::make_rng(salt);
    const auto x = make_rows(rng, rows, channels);
    const auto want = host_quantize<F>(x, rows, channels);
    device_buffer<bf16> dx{std::span<const bf16>(x)};
    device_buffer<std::uint8_t> dcodes(want.codes.size()), dscales(want.scales.size());
    dcodes.fill_bytes(0xAB);  // poison: an unwritten byte cannot match by accident everywhere
    dscales.fill_bytes(0xCD);
    quantize_args a;
    a.x = dx.data();
    a.rows = rows;
    a.channels = channels;
    a.x_row_stride = channels;
    a.codes = dcodes.data();
    a.codes_row_stride = channels * F::element::storage_bits / 8;
    a.scales = dscales.data();
    a.scales_row_stride = channels / F::block_size;
    // E4M3 codes: also their values as f16 (codes_f16), poisoned first.
    constexpr bool kF16 = std::is_same_v<typename F::element, e4m3>;
    device_buffer<std::uint16_t> df16(kF16 ? std::size_t(rows) * channels : 1);
    df16.fill_bytes(0xFF);
    if (kF16) a.codes_f16 = df16.data(), a.codes_f16_row_stride = channels;
    quantize<F>(a);
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
    BOOST_TEST(dcodes.download() == want.codes);
    BOOST_TEST(dscales.download() == want.scales);
    if constexpr (kF16) {
      const auto f16 = df16.download();
      std::size_t bad = 0;
      for (std::size_t i = 0; i < f16.size(); ++i) bad += f16[i] != e4m3_code_as_f16(want.codes[i]);
      BOOST_TEST(bad == 0u, bad << " f16 copies of the codes differ from e4m3_code_as_f16");
    }

    // Dequantize back on the device and compare every bf16 bit pattern with the host.
    std::vector<bf16> host_out(x.size());
    for (long long r = 0; r < rows; ++r)
      dequantize_vector<F>(std::span<const std::uint8_t>(want.codes).subspan(r * a.codes_row_stride, a.codes_row_stride),
                           std::span<const std::uint8_t>(want.scales).subspan(r * a.scales_row_stride, a.scales_row_stride),
                           std::span(host_out).subspan(r * channels, channels));
    device_buffer<bf16> dout(x.size());
    dout.fill_bytes(0xFF);  // NaN poison
    dequantize_args d;
    d.codes = dcodes.data();
    d.codes_row_stride = a.codes_row_stride;
    d.scales = dscales.data();
    d.scales_row_stride = a.scales_row_stride;
    d.rows = rows;
    d.channels = channels;
    d.out = dout.data();
    d.out_row_stride = channels;
    dequantize<F>(d);
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
    const auto got = dout.download();
    std::size_t bad = 0;
    for (std::size_t i = 0; i < got.size(); ++i) bad += got[i].bits != host_out[i].bits;
    BOOST_TEST(bad == 0u, bad << " dequantized values differ");
  }
}

using all_formats = std::tuple<main_kv_format, index_key_format, fp8_act_format>;

// Per (entry, 8-channel group): dequantize8 packed into bf16x2 words, and dequantize8_packed.
template <class F, int Channels>
__global__ void packed_dequantize_kernel(const std::uint8_t* entries, int count, uint4* generic, uint4* fast) {
  using layout = packed_vector<F, Channels>;
  const int t = int(blockIdx.x * blockDim.x + threadIdx.x), groups = Channels / 8;
  if (t >= count * groups) return;
  const std::uint8_t* entry = entries + std::size_t(t / groups) * layout::bytes;
  const int c0 = (t % groups) * 8;
  bf16 v[8];
  dequantize8<F, Channels>(entry, c0, v);
  std::uint32_t w[4];
  for (int i = 0; i < 4; ++i) w[i] = std::uint32_t(v[2 * i].bits) | (std::uint32_t(v[2 * i + 1].bits) << 16);
  generic[t] = make_uint4(w[0], w[1], w[2], w[3]);
  fast[t] = dequantize8_packed<F, Channels>(entry, c0);
}

// Every scale code in every scale slot, random element codes (NaN codes included): the packed
// fast paths must return dequantize8's bits exactly.
template <class F>
void check_packed_dequantize(std::uint64_t salt) {
  constexpr int channels = 512;
  using layout = packed_vector<F, channels>;
  auto rng = test::make_rng(salt);
  const int count = 512;
  std::vector<std::uint8_t> entries(std::size_t(count) * layout::bytes);
  for (auto& b : entries) b = std::uint8_t(rng());
  for (int e = 0; e < count; ++e)
    for (int j = 0; j < channels / F::block_size; ++j)
      entries[std::size_t(e) * layout::bytes + layout::scale_offset + j] = std::uint8_t(e + 7 * j);
  device_buffer<std::uint8_t> d{std::span<const std::uint8_t>(entries)};
  const int n = count * channels / 8;
  device_buffer<uint4> generic(n), fast(n);
  fast.fill_bytes(0x5A);
  packed_dequantize_kernel<F, channels><<<(n + 255) / 256, 256>>>(d.data(), count, generic.data(), fast.data());
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  const auto g = generic.download(), f = fast.download();
  std::size_t bad = 0;
  for (int i = 0; i < n; ++i) {
    const bool same = g[i].x == f[i].x && g[i].y == f[i].y && g[i].z == f[i].z && g[i].w == f[i].w;
    if (!same && ++bad <= 5)
      BOOST_ERROR("group " << i << ": generic " << std::hex << g[i].x << " " << g[i].y << " " << g[i].z << " " << g[i].w
                           << ", packed " << f[i].x << " " << f[i].y << " " << f[i].z << " " << f[i].w);
  }
  BOOST_TEST(bad == 0u, bad << " of " << n << " groups differ");
}

}  // namespace

BOOST_AUTO_TEST_SUITE(numerics_cuda)

// Runs without a GPU: the host codec against cuda_fp8.h / cuda_fp4.h's host implementations.
BOOST_AUTO_TEST_CASE(host_codec_matches_cuda_conversions) {
  std::size_t bad = 0;
  for (float x : codec_inputs()) {
    bool ok = encode<e4m3>(x) == cuda_e4m3(x);
    if (!std::isnan(x)) ok = ok && encode<e2m1>(x) == cuda_e2m1(x);
    if (e8m0_comparable(x)) ok = ok && detail::pow2_ceil_scale_code(std::fabs(x), 1.0f) == cuda_e8m0_ceil(std::fabs(x));
    if (!ok && ++bad <= 10) BOOST_ERROR("x = " << x << " (bits 0x" << std::hex << float_to_bits(x) << ")");
  }
  BOOST_TEST(bad == 0u);
  for (unsigned c = 0; c < 256; ++c) {
    const float cuda8 = __half2float(__half(__nv_cvt_fp8_to_halfraw(std::uint8_t(c), __NV_E4M3)));
    BOOST_TEST(same_bits_or_both_nan(decode<e4m3>(std::uint8_t(c)), cuda8), "e4m3 code " << c);
    if (c < 16) {
      const float cuda4 = __half2float(__half(__nv_cvt_fp4_to_halfraw(std::uint8_t(c), __NV_E2M1)));
      BOOST_TEST(same_bits_or_both_nan(decode<e2m1>(std::uint8_t(c)), cuda4), "e2m1 code " << c);
    }
  }
}

__global__ void round_to_bf16_kernel(const float* in, long long n, float* one, float* pair) {
  const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i >= n) return;
  one[i] = fast_round_to_bf16(in[i]);
  // Pairs (2k, 2k + 1), n even: even elements as the low half, odd ones as the high half.
  const float2 p = fast_round_to_bf16x2(in[i & ~1ll], in[i | 1]);
  pair[i] = (i & 1) ? p.y : p.x;
}

// fast_round_to_bf16(x2) against the host's round_to_bf16 over random fp32 bit patterns (every
// exponent: subnormals, near overflow, inf, NaN) and the rounding ties of each binade.
BOOST_AUTO_TEST_CASE(fast_round_to_bf16_matches_host, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  auto rng = test::make_rng(44);
  std::vector<float> in;
  for (int i = 0; i < 1 << 20; ++i) in.push_back(bits_to_float(std::uint32_t(rng())));
  for (std::uint32_t e = 0; e < 255; ++e)  // ties (low half 0x8000) with even and odd kept bits, and their neighbours
    for (std::uint32_t m : {0x8000u, 0x18000u, 0x7FFFu, 0x8001u, 0x7F8000u, 0x7FFFFFu, 0u, 1u})
      for (std::uint32_t sign : {0u, 0x80000000u}) in.push_back(bits_to_float(sign | e << 23 | m));
  if (in.size() % 2) in.push_back(0.0f);
  const long long n = (long long)in.size();
  device_buffer<float> din{std::span<const float>(in)}, one(in.size()), pair(in.size());
  one.fill_bytes(0x5A), pair.fill_bytes(0x5A);
  round_to_bf16_kernel<<<unsigned((n + 255) / 256), 256>>>(din.data(), n, one.data(), pair.data());
  DSV4_CUDA_CHECK_LAUNCH();
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  const auto h1 = one.download(), h2 = pair.download();
  std::size_t bad = 0;
  for (std::size_t i = 0; i < in.size(); ++i) {
    const float want = round_to_bf16(in[i]);
    const bool ok = std::isnan(want) ? std::isnan(h1[i]) && std::isnan(h2[i])
                                     : float_to_bits(h1[i]) == float_to_bits(want) &&
                                           float_to_bits(h2[i]) == float_to_bits(want);
    if (!ok && ++bad <= 10)
      BOOST_ERROR("fast bf16 rounding of 0x" << std::hex << float_to_bits(in[i]) << ": 0x" << float_to_bits(h1[i])
                                             << " / 0x" << float_to_bits(h2[i]) << ", host 0x" << float_to_bits(want)
                                             << std::dec);
  }
  BOOST_TEST(bad == 0u);
}

BOOST_AUTO_TEST_CASE(packed_dequantize_matches_dequantize8, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  check_packed_dequantize<main_kv_format>(41);  // the E2M1 / E4M3-per-16 fast path
  check_packed_dequantize<fp8_act_format>(42);  // the E4M3 / UE8M0-per-32 fast path (window entries)
  check_packed_dequantize<index_key_format>(43);  // no fast path: dequantize8 itself
}

BOOST_AUTO_TEST_CASE(device_codec_matches_host, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  const auto in = codec_inputs();
  const long long n = (long long)in.size();
  device_buffer<float> din{std::span<const float>(in)};
  std::vector<device_buffer<std::uint8_t>> outs;
  for (int i = 0; i < 8; ++i) {
    outs.emplace_back(in.size());
    outs.back().fill_bytes(0x5A);
  }
  codec_kernel<<<unsigned((n + 255) / 256), 256>>>(din.data(), n, outs[0].data(), outs[1].data(), outs[2].data(),
                                                   outs[3].data(), outs[4].data(), outs[5].data(), outs[6].data(),
                                                   outs[7].data());
  DSV4_CUDA_CHECK_LAUNCH();
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  const auto e2 = outs[0].download(), e4 = outs[1].download(), e8 = outs[2].download();
  const auto c4 = outs[3].download(), c8 = outs[4].download(), ce8 = outs[5].download();
  const auto f2 = outs[6].download(), f4 = outs[7].download();
  std::size_t bad = 0;
  for (std::size_t i = 0; i < in.size(); ++i) {
    const float x = in[i];
    bool ok = e2[i] == encode<e2m1>(x) && e4[i] == encode<e4m3>(x) &&
              e8[i] == detail::pow2_ceil_scale_code(std::fabs(x), 1.0f) && c8[i] == e4[i] && f2[i] == e2[i] &&
              f4[i] == e4[i];
    if (!std::isnan(x)) ok = ok && c4[i] == e2[i];
    if (e8m0_comparable(x)) ok = ok && ce8[i] == e8[i];
    if (!ok && ++bad <= 10) BOOST_ERROR("device codec differs at x = " << x);
  }
  BOOST_TEST(bad == 0u);

  device_buffer<float> d2(16), d4(256), d8(256), df2(16), df4(256);
  decode_kernel<<<1, 256>>>(d2.data(), d4.data(), d8.data(), df2.data(), df4.data());
  DSV4_CUDA_CHECK_LAUNCH();
  const auto h2 = d2.download(), h4 = d4.download(), h8 = d8.download(), hf2 = df2.download(), hf4 = df4.download();
  for (unsigned c = 0; c < 256; ++c) {
    BOOST_TEST(same_bits_or_both_nan(h4[c], decode<e4m3>(std::uint8_t(c))), "e4m3 code " << c);
    BOOST_TEST(same_bits_or_both_nan(hf4[c], decode<e4m3>(std::uint8_t(c))), "fast e4m3 code " << c);
    BOOST_TEST(same_bits_or_both_nan(h8[c], decode<ue8m0>(std::uint8_t(c))), "ue8m0 code " << c);
    if (c < 16) {
      BOOST_TEST(same_bits_or_both_nan(h2[c], decode<e2m1>(std::uint8_t(c))), "e2m1 code " << c);
      BOOST_TEST(same_bits_or_both_nan(hf2[c], decode<e2m1>(std::uint8_t(c))), "fast e2m1 code " << c);
    }
  }
}

BOOST_TEST_DECORATOR(*utf::label("gpu") * utf::precondition(test::has_cuda_device{}))
BOOST_AUTO_TEST_CASE_TEMPLATE(quantize_kernel_matches_host, F, all_formats) {
  check_quantize_shape<F>(1, F::block_size, 1);
  check_quantize_shape<F>(7, 512, 2);
  check_quantize_shape<F>(1000, 128, 3);
  check_quantize_shape<F>(33, 4096, 4);
  check_quantize_shape<F>(9 * 1024, 512, 5);
}

// Main-KV cache entries: codes and scales interleaved in one 288-byte entry per position.
BOOST_AUTO_TEST_CASE(quantize_into_cache_entries, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  using F = main_kv_format;
  using entry = packed_vector<F, 512>;
  const long long rows = 513;
  auto rng = test::make_rng(7);
  const auto x = make_rows(rng, rows, 512);
  const auto want = host_quantize<F>(x, rows, 512);
  std::vector<std::uint8_t> want_entries(std::size_t(rows * entry::bytes));
  for (long long r = 0; r < rows; ++r) {
    std::memcpy(&want_entries[r * entry::bytes], &want.codes[r * entry::code_bytes], entry::code_bytes);
    std::memcpy(&want_entries[r * entry::bytes + entry::scale_offset], &want.scales[r * entry::blocks], entry::scale_bytes);
  }
  device_buffer<bf16> dx{std::span<const bf16>(x)};
  device_buffer<std::uint8_t> cache(want_entries.size());
  cache.fill_bytes(0xEE);
  quantize_args a;
  a.x = dx.data();
  a.rows = rows;
  a.channels = 512;
  a.x_row_stride = 512;
  a.codes = cache.data();
  a.codes_row_stride = entry::bytes;
  a.scales = cache.data() + entry::scale_offset;
  a.scales_row_stride = entry::bytes;
  quantize<F>(a);
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  BOOST_TEST(cache.download() == want_entries);
}

// The reference vectors through the device path: codes, scales and QDQ bits.
BOOST_AUTO_TEST_CASE(device_matches_reference_vectors, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  io::safetensors_file f(test::data_path("reference/quant.safetensors"));
  auto run = [&]<class F>(F, const std::string& prefix, const std::string& codes_name, const std::string& scales_name) {
    const auto& xt = f.tensor(prefix + ".x");
    const long long rows = xt.shape[0];
    const int channels = int(xt.shape[1]);
    const auto x = io::copy_as<bf16>(xt);
    device_buffer<bf16> dx{std::span<const bf16>(x)};
    device_buffer<std::uint8_t> dc(std::size_t(rows * channels * F::element::storage_bits / 8)),
        ds(std::size_t(rows * channels / F::block_size));
    quantize_args a{dx.data(), rows, channels, channels, dc.data(), channels * F::element::storage_bits / 8,
                    ds.data(), channels / F::block_size};
    quantize<F>(a);
    device_buffer<bf16> dq(x.size());
    dequantize<F>({dc.data(), a.codes_row_stride, ds.data(), a.scales_row_stride, rows, channels, dq.data(), channels});
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
    BOOST_TEST(dc.download() == io::copy_as<std::uint8_t>(f.tensor(prefix + "." + codes_name)));
    BOOST_TEST(ds.download() == io::copy_as<std::uint8_t>(f.tensor(prefix + "." + scales_name)));
    const auto q = dq.download();
    const auto want = io::copy_as<bf16>(f.tensor(prefix + ".qdq"));
    std::size_t bad = 0;
    for (std::size_t i = 0; i < q.size(); ++i) bad += q[i].bits != want[i].bits;
    BOOST_TEST(bad == 0u, prefix << ": " << bad << " QDQ values differ");
  };
  run(fp8_act_format{}, "act_quant", "q_e4m3", "scale_ue8m0");
  run(main_kv_format{}, "fp4_e4m3", "q_packed", "scale_e4m3");
  run(index_key_format{}, "fp4_ue8m0", "q_packed", "scale_ue8m0");
}

// Runs without a GPU: argument checks happen on the host, before any launch.
BOOST_AUTO_TEST_CASE(launch_rejects_bad_arguments_with_a_reason) {
  alignas(16) static bf16 x[64];
  alignas(16) static std::uint8_t codes[64], scales[4];
  quantize_args a{x, 1, 48, 48, codes, 24, scales, 1};
  BOOST_TEST(can_implement<index_key_format>(a).find("multiple of the block size 32") != std::string::npos);
  a = {x + 1, 1, 32, 32, codes, 16, scales, 1};
  BOOST_TEST(can_implement<index_key_format>(a).find("16-byte aligned") != std::string::npos);
  a = {x, 1, 32, 32, codes + 1, 16, scales, 1};
  BOOST_TEST(can_implement<index_key_format>(a).find("codes must be 4-byte aligned") != std::string::npos);
  BOOST_CHECK_EXCEPTION(quantize<index_key_format>(a), dsv4::error, [](const dsv4::error& e) {
    return std::string(e.what()).find("quantize<block_scaled<E2M1, UE8M0, 32>>") != std::string::npos;
  });
  a = {x, 0, 32, 32, nullptr, 16, nullptr, 1};
  BOOST_TEST(can_implement<index_key_format>(a).empty());  // zero rows: nothing to do, no pointers needed
  // The f16 copy of E4M3 codes: a row stride below the width (the default 0 too) would have the
  // rows write over each other.
  alignas(16) static std::uint16_t f16[128];
  quantize_args q{x, 2, 32, 32, codes, 32, scales, 1, f16, 0};
  BOOST_TEST(can_implement<fp8_act_format>(q).find("codes_f16_row_stride (0) is below the row width 32") !=
             std::string::npos);
  q.codes_f16_row_stride = 32;
  BOOST_TEST(can_implement<fp8_act_format>(q).empty());
}

BOOST_AUTO_TEST_SUITE_END()
