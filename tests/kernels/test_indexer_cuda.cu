// CUDA indexer scan and top-k against the host reference: scores bit for bit, selections equal.

#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <cmath>
#include <random>
#include <span>
#include <sstream>
#include <tuple>
#include <vector>

#include "dsv4/kernels/indexer/indexer.cuh"
#include "dsv4/kernels/indexer/reference.hpp"
#include "dsv4/numerics/formats.hpp"
#include "dsv4/numerics/quantize.hpp"
#include "dsv4/runtime/device_buffer.cuh"
#include "dsv4/runtime/device_info.cuh"
#include "support/gpu.hpp"
#include "support/numerics.hpp"
#include "support/random.hpp"

namespace utf = boost::unit_test;
using namespace dsv4;
using namespace dsv4::kernels::indexer;
using numerics::bf16;
using runtime::device_buffer;

namespace {

//! `spread` > 0 scales each 32-channel block by 2^u, u uniform in [-spread, spread]: blocks whose
//! MXFP4 scales lie far apart, so a dot product's partial sums span many binary orders.
std::vector<bf16> qdq_rows(std::mt19937_64& rng, std::size_t rows, int dim, float sigma, int spread = 0) {
  std::normal_distribution<float> n(0.0f, sigma);
  std::uniform_int_distribution<int> u(-spread, spread);
  std::vector<bf16> x(rows * std::size_t(dim));
  float block_scale = 1.0f;
  for (std::size_t i = 0; i < x.size(); ++i) {
    if (i % 32 == 0) block_scale = std::ldexp(1.0f, u(rng));
    x[i] = bf16::from_float(n(rng) * block_scale);
  }
  for (std::size_t r = 0; r < rows; ++r) numerics::qdq_vector<numerics::index_key_format>(std::span(x).subspan(r * dim, dim));
  return x;
}

//! select_topk's output: one CTA per row, or (split) several CTAs per row of topk_split_min_n
//! scores and more, through scratch (the same selection either way).
std::vector<std::int32_t> run_select(topk_args t, bool split) {
  device_buffer<std::int32_t> out(std::size_t(t.rows) * std::size_t(t.k));
  out.fill_bytes(0x7F);
  const std::size_t words = split ? topk_scratch_words(t.rows, t.n) : 0;
  device_buffer<unsigned> scratch(std::max<std::size_t>(1, words));
  scratch.fill_bytes(0xFF);  // every word the split path reads, it writes first
  t.out = out.data();
  if (split) t.scratch = scratch.data(), t.scratch_words = words;
  select_topk(t);
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  return out.download();
}

//! Both scan kernels: the tiled one and the streamed one (bit-equal to the host, so to each other).
constexpr scan_method scan_methods[] = {scan_method::tiled, scan_method::streamed};

const char* method_name(scan_method m) { return m == scan_method::tiled ? "tiled" : "streamed"; }

//! Key block scales at the ends of UE8M0's range, where an element times its scale leaves bf16's
//! normal range and the streamed scan takes its slow path: `low` (2^-127 .. 2^-118: bf16
//! subnormals; the queries scaled up by 2^12 so that every product stays a normal fp32), `high`
//! (2^122 .. 2^127 and NaN: values that overflow to inf; the queries scaled down by 2^12 so that
//! finite products stay finite, the infinite ones give inf or NaN dot products, as on the host).
enum class extreme_scales { none, low, high };

template <int dim>
void check_scan_and_select(scan_method method, int rows, int heads, long long n_keys, int topk, std::uint64_t salt,
                           int spread = 0, extreme_scales extreme = extreme_scales::none) {
  BOOST_TEST_CONTEXT(method_name(method) << " scan, " << rows << " rows x " << n_keys << " keys, " << heads << " heads"
                                      << (extreme == extreme_scales::low    ? ", low key scales"
                                          : extreme == extreme_scales::high ? ", high key scales"
                                                                            : "")) {
  using layout = numerics::packed_vector<numerics::index_key_format, dim>;
  auto rng = test::make_rng(salt);
  const float q_sigma = extreme == extreme_scales::low ? 0x1p12f : extreme == extreme_scales::high ? 0x1p-12f : 1.0f;
  const auto q = qdq_rows(rng, std::size_t(rows) * heads, dim, q_sigma, spread);
  std::normal_distribution<float> nw(0.0f, 1.0f);
  std::vector<bf16> w(std::size_t(rows) * heads);
  for (auto& v : w) v = bf16::from_float(numerics::round_to_bf16(nw(rng)) * 0.015625f);
  // Keys: quantized into the packed cache, and their QDQ values for the host.
  std::vector<bf16> kx(std::size_t(n_keys) * dim);
  std::normal_distribution<float> nk(0.0f, 1.0f);
  std::uniform_int_distribution<int> uk(-spread, spread);
  float block_scale = 1.0f;
  for (std::size_t i = 0; i < kx.size(); ++i) {
    if (i % 32 == 0) block_scale = std::ldexp(1.0f, uk(rng));
    kx[i] = bf16::from_float(nk(rng) * block_scale);
  }
  // Entries padded to a multiple of 4 bytes, as the attention stack stores them (tiny's 64-channel
  // key is 34 bytes; the scan reads keys 4 bytes at a time).
  const long long stride = (layout::bytes + 3) / 4 * 4;
  auto [cache, kq] = test::pack_index_keys<dim>(kx, std::size_t(stride));
  if (extreme != extreme_scales::none) {
    constexpr std::uint8_t low[] = {0, 1, 5, 7, 8, 9}, high[] = {249, 250, 251, 252, 253, 254, 255};
    for (long long t = 0; t < n_keys; ++t) {
      std::uint8_t* entry = cache.data() + std::size_t(t) * std::size_t(stride);
      bool changed = false;
      for (int b = 0; b < layout::blocks; ++b)
        if (rng() % 8 == 0)
          entry[layout::scale_offset + b] = extreme == extreme_scales::low ? low[rng() % std::size(low)] : high[rng() % std::size(high)],
          changed = true;
      if (changed)
        numerics::dequantize_vector<numerics::index_key_format>(
            {entry, std::size_t(layout::code_bytes)}, {entry + layout::scale_offset, std::size_t(layout::scale_bytes)},
            std::span(kq).subspan(std::size_t(t) * dim, dim));
    }
  }
  std::vector<long long> visible(static_cast<std::size_t>(rows));
  for (int r = 0; r < rows; ++r) visible[r] = r == 0 ? n_keys : (long long)(rng() % std::uint64_t(n_keys + 1));

  device_buffer<bf16> dq{std::span<const bf16>(q)}, dw{std::span<const bf16>(w)}, dscores(std::size_t(rows) * n_keys);
  device_buffer<std::uint8_t> dkeys{std::span<const std::uint8_t>(cache)};
  device_buffer<long long> dvis{std::span<const long long>(visible)};
  dscores.fill_bytes(0xFF);
  index_scan_args sa{dq.data(), dw.data(), dkeys.data(), stride, dscores.data(), dvis.data(), rows, heads, n_keys};
  sa.method = method;
  index_scan<dim>(sa);
  const int k = int(std::min<long long>(topk, n_keys));
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  const auto got_scores = dscores.download();
  const topk_args t{dscores.data(), n_keys, rows, k, dvis.data(), 128, nullptr};
  const auto got_idx = run_select(t, false);
  BOOST_TEST(run_select(t, true) == got_idx, "several CTAs per row select otherwise than one");

  std::size_t score_mismatch = 0;
  for (int r = 0; r < rows; ++r) {
    const auto want = index_scores_reference(std::span(q).subspan(std::size_t(r) * heads * dim, std::size_t(heads) * dim),
                                             std::span(w).subspan(std::size_t(r) * heads, heads), kq, heads, dim, visible[r]);
    std::vector<float> dev(static_cast<std::size_t>(n_keys));
    for (long long t = 0; t < n_keys; ++t) {
      dev[std::size_t(t)] = got_scores[std::size_t(r) * n_keys + t].to_float();
      const bf16 got_t = got_scores[std::size_t(r) * n_keys + t], want_t = bf16::from_float(want[std::size_t(t)]);
      if (want_t.bits != got_t.bits && ++score_mismatch <= 4) {
        std::ostringstream codes;  // the key's block scale codes: which path dequantized it
        for (int b = 0; b < layout::blocks; ++b)
          codes << ' ' << int(cache[std::size_t(t) * std::size_t(stride) + layout::scale_offset + b]);
        BOOST_TEST_MESSAGE("row " << r << " key " << t << ": host " << want_t.to_float() << " (0x" << std::hex
                                  << want_t.bits << "), device " << got_t.to_float() << " (0x" << got_t.bits << std::dec
                                  << "), key scale codes" << codes.str());
      }
    }
    // The selection must equal the reference's selection over the same (device) scores exactly.
    const auto want_idx = select_reference(dev, topk, visible[r], 128);
    const std::vector<std::int32_t> got(got_idx.begin() + std::ptrdiff_t(r) * k, got_idx.begin() + std::ptrdiff_t(r + 1) * k);
    BOOST_TEST(got == want_idx, "row " << r << " (visible " << visible[r] << ") selection differs");
  }
  BOOST_TEST_MESSAGE(method_name(method) << " index scan " << rows << "x" << n_keys << ": " << score_mismatch
                                        << " scores differ from the host");
  BOOST_TEST(score_mismatch == 0u);
  }
}

}  // namespace

BOOST_AUTO_TEST_SUITE(indexer_cuda)

BOOST_AUTO_TEST_CASE(scan_and_select_match_host, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  for (const scan_method m : scan_methods) {
    check_scan_and_select<128>(m, 3, 32, 5000, 512, 1);   // decode-like, V4.1 heads and top-k
    check_scan_and_select<128>(m, 9, 32, 300, 512, 2);    // fewer keys than top-k: k = n, -1 tails
    check_scan_and_select<128>(m, 2, 4, 70001, 16, 3);    // tiny heads and top-k, many tiles
    check_scan_and_select<64>(m, 5, 4, 3001, 16, 4);      // tiny's index dim and heads
    check_scan_and_select<128>(m, 6, 64, 1500, 512, 5);   // the most heads: four MMA head tiles
    check_scan_and_select<128>(m, 7, 48, 999, 64, 6);     // three head tiles
    check_scan_and_select<64>(m, 1, 20, 200, 16, 7);      // a partial second head tile
    check_scan_and_select<128>(m, 1, 32, 200003, 512, 8); // one decode row over many tiles per warp
    check_scan_and_select<128>(m, 70, 32, 777, 512, 9);   // more rows than the streamed grid's groups
  }
}

// Block scales at the ends of UE8M0's range (an eighth of the key blocks): elements times scale
// in bf16's subnormals, or overflowing to inf, and NaN scales; the streamed scan's slow path must
// give the host's values, and both kernels the host's relu of a NaN dot product (NaN).
BOOST_AUTO_TEST_CASE(scan_matches_host_at_extreme_key_scales,
                     *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  for (const scan_method m : scan_methods)
    for (const extreme_scales e : {extreme_scales::low, extreme_scales::high}) {
      check_scan_and_select<128>(m, 3, 32, 3000, 512, 21, 0, e);
      check_scan_and_select<64>(m, 2, 4, 500, 16, 22, 0, e);
    }
}

// Blocks of q and of the keys scaled by 2^-8 .. 2^8: a dot product's blocks then differ by up to
// 2^32, beyond fp32's 24 bits (within double's 53). The host sums in double; the scan must round
// the same exact dot product (each block on its own tensor-core accumulator, added in double;
// tiles whose scales lie close, in one fp32 accumulator: the smaller spreads below).
BOOST_AUTO_TEST_CASE(scan_is_exact_for_far_apart_block_scales,
                     *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  for (const scan_method m : scan_methods) {
    check_scan_and_select<128>(m, 5, 32, 2000, 512, 11, 8);
    check_scan_and_select<64>(m, 5, 4, 2000, 16, 12, 8);
    check_scan_and_select<128>(m, 3, 64, 700, 64, 13, 8);
    // 2^-1 .. 2^1 and 2^-2 .. 2^2: tiles on both sides of the streamed scan's one-accumulator bound
    check_scan_and_select<128>(m, 5, 32, 3000, 512, 16, 1);
    check_scan_and_select<128>(m, 5, 32, 3000, 512, 14, 2);
    check_scan_and_select<64>(m, 3, 4, 3000, 16, 15, 2);
  }
}

// The streamed scan sums a tile in one fp32 accumulator when the query's and the keys' block
// scales lie close enough for that sum to be exact (one_accumulator_exact: spreads adding up to 9
// binades at 128 channels), else a tensor-core accumulator per block. Here three blocks of large
// products sum to 54912 (a bf16 tie between 54784 and 55040) beside a fourth adding +-2^-7, the
// smallest unit, 2^9 below the large blocks' unit: the exact sum needs 23 bits and rounds up to
// 55040; an accumulator that kept fewer bits below its largest addend, or lost the small block,
// gives 54784. Keys at the bound (spreads 4 + 5: one accumulator) and one binade past it (4 + 6,
// 2^-8: per block), a tile (16 keys) of each in turn.
BOOST_AUTO_TEST_CASE(one_accumulator_scan_keeps_the_smallest_block_at_the_spread_bound,
                     *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  constexpr int dim = 128, heads = 16, n_keys = 96;
  auto b = [](float v) { return bf16::from_float(v); };
  // q: blocks 0-2 all 96 (scale 16, E2M1 6), block 3 at scale 1 (a 6 where the keys hold 0, and
  // 0.5 at channel 96).
  std::vector<bf16> q(std::size_t(heads) * dim, b(0));
  for (int h = 0; h < heads; ++h) {
    bf16* v = q.data() + std::size_t(h) * dim;
    for (int c = 0; c < 96; ++c) v[c] = b(96);
    v[126] = b(6), v[96] = b(0.5f);
  }
  std::vector<bf16> keys(std::size_t(n_keys) * dim, b(0));
  std::vector<int> eps_sign(n_keys);
  for (int t = 0; t < n_keys; ++t) {
    bf16* k = keys.data() + std::size_t(t) * dim;
    const int shift = (t / 16) % 2 ? 6 : 5;  // block 3's scale 2^-5 (spread 9) or 2^-6 (spread 10), per 16-key tile
    eps_sign[t] = t % 3 == 2 ? -1 : 1;
    for (int c = 0; c < 96; ++c) k[c] = b(6);  // 95 x 576 + 96 x 2 = 54912
    k[5] = b(2);
    k[127] = b(std::ldexp(6.0f, -shift));               // block 3's scale (q holds 0 there)
    k[96] = b(eps_sign[t] * std::ldexp(0.5f, -shift));  // q 0.5 x this: +-2^-7 or +-2^-8
  }
  const std::vector<bf16> w(heads, b(0x1p-6f));
  auto [cache, kq] = test::pack_index_keys<dim>(keys);
  for (std::size_t i = 0; i < keys.size(); ++i) BOOST_REQUIRE(kq[i].bits == keys[i].bits);  // exact MXFP4 values
  auto qq = q;
  for (int h = 0; h < heads; ++h) numerics::qdq_vector<numerics::index_key_format>(std::span(qq).subspan(std::size_t(h) * dim, dim));
  for (std::size_t i = 0; i < q.size(); ++i) BOOST_REQUIRE(qq[i].bits == q[i].bits);

  const auto want = index_scores_reference(q, w, kq, heads, dim, n_keys);
  for (int t = 0; t < n_keys; ++t)  // the exact sums: 16 heads x bf16(54912 +- eps) / 64
    BOOST_REQUIRE(want[std::size_t(t)] == (eps_sign[t] > 0 ? 13760.0f : 13696.0f));
  const std::vector<long long> visible{n_keys};
  device_buffer<bf16> dq{std::span<const bf16>(q)}, dw{std::span<const bf16>(w)}, dscores{std::size_t(n_keys)};
  device_buffer<std::uint8_t> dkeys{std::span<const std::uint8_t>(cache)};
  device_buffer<long long> dvis{std::span<const long long>(visible)};
  for (const scan_method m : scan_methods) {
    dscores.fill_bytes(0xFF);
    index_scan_args sa{dq.data(), dw.data(), dkeys.data(), numerics::packed_vector<numerics::index_key_format, dim>::bytes,
                       dscores.data(), dvis.data(), 1, heads, n_keys};
    sa.method = m;
    index_scan<dim>(sa);
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
    const auto got = dscores.download();
    for (int t = 0; t < n_keys; ++t)
      BOOST_TEST(got[std::size_t(t)].to_float() == want[std::size_t(t)],
                 method_name(m) << " scan, key " << t << " (block 3 at 2^-" << ((t / 16) % 2 ? 6 : 5) << ")");
  }
}

// Paged keys of two sequences in one call, their rows interleaved so that CTAs' groups of four
// rows switch sequence (the keys are dequantized again for each switch): pages shuffled in a
// pool, each row against its own sequence's keys on the host.
BOOST_AUTO_TEST_CASE(paged_scan_of_mixed_sequences_matches_host,
                     *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  constexpr int dim = 128, heads = 32, epp = 64;
  using layout = numerics::packed_vector<numerics::index_key_format, dim>;
  const long long page_bytes = epp * layout::bytes + 16;  // a page holds more than the keys
  auto rng = test::make_rng(70);
  const long long n = 333;  // keys per sequence (a partial last page)
  const int pages_per_seq = int((n + epp - 1) / epp), seqs = 2, rows = 7;
  std::vector<int> phys(std::size_t(seqs) * pages_per_seq);
  for (std::size_t i = 0; i < phys.size(); ++i) phys[i] = int(i);
  std::shuffle(phys.begin(), phys.end(), rng);
  std::vector<std::uint8_t> pool(phys.size() * std::size_t(page_bytes), 0xEE);
  std::vector<std::vector<bf16>> kq(seqs);
  for (int b = 0; b < seqs; ++b) {
    std::vector<bf16> kx(std::size_t(n) * dim);
    std::normal_distribution<float> nk(0.0f, 1.0f);
    for (auto& v : kx) v = bf16::from_float(nk(rng));
    const auto packed = test::pack_index_keys<dim>(kx);
    kq[std::size_t(b)] = packed.qdq;
    for (long long t = 0; t < n; ++t)
      std::copy_n(packed.cache.begin() + std::ptrdiff_t(t * layout::bytes), layout::bytes,
                  pool.begin() + std::ptrdiff_t(phys[std::size_t(b * pages_per_seq + t / epp)] * page_bytes +
                                                (t % epp) * layout::bytes));
  }
  const std::vector<std::int32_t> row_batch = {0, 1, 0, 0, 1, 1, 0};
  std::vector<long long> visible(rows);
  for (int r = 0; r < rows; ++r) visible[std::size_t(r)] = r == 0 ? n : (long long)(rng() % std::uint64_t(n + 1));
  const auto q = qdq_rows(rng, std::size_t(rows) * heads, dim, 1.0f);
  std::vector<bf16> w(std::size_t(rows) * heads);
  std::normal_distribution<float> nw(0.0f, 1.0f);
  for (auto& v : w) v = bf16::from_float(numerics::round_to_bf16(nw(rng)) * 0.015625f);

  device_buffer<bf16> dq{std::span<const bf16>(q)}, dw{std::span<const bf16>(w)}, dscores(std::size_t(rows) * n);
  device_buffer<std::uint8_t> dpool{std::span<const std::uint8_t>(pool)};
  device_buffer<std::int32_t> dtables{std::span<const std::int32_t>(phys)}, dbatch{std::span<const std::int32_t>(row_batch)};
  device_buffer<long long> dvis{std::span<const long long>(visible)};
  for (const scan_method m : scan_methods) {
  dscores.fill_bytes(0xFF);
  index_scan_args a{dq.data(), dw.data(), dpool.data(), layout::bytes, dscores.data(), dvis.data(), rows, heads, n};
  a.block_tables = dtables.data(), a.row_batch = dbatch.data(), a.max_pages = pages_per_seq, a.entries_per_page = epp;
  a.page_bytes = page_bytes, a.method = m;
  index_scan<dim>(a);
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  const auto got = dscores.download();
  std::size_t mismatch = 0;
  for (int r = 0; r < rows; ++r) {
    const auto want = index_scores_reference(std::span(q).subspan(std::size_t(r) * heads * dim, std::size_t(heads) * dim),
                                             std::span(w).subspan(std::size_t(r) * heads, heads),
                                             kq[std::size_t(row_batch[std::size_t(r)])], heads, dim, visible[std::size_t(r)]);
    for (long long t = 0; t < n; ++t)
      mismatch += bf16::from_float(want[std::size_t(t)]).bits != got[std::size_t(r) * n + t].bits;
  }
  BOOST_TEST(mismatch == 0u, method_name(m) << ": " << mismatch << " of " << rows * n << " paged scores differ from the host");
  }
}

// Heavy ties: scores from a handful of values; lowest indices must win at the threshold.
BOOST_AUTO_TEST_CASE(select_breaks_ties_toward_lowest_index, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  auto rng = test::make_rng(60);
  for (long long n : {1000ll, 4097ll, 300000ll}) {
    const int rows = 4, k = 512;
    std::vector<bf16> s(std::size_t(rows) * n);
    for (auto& v : s) v = bf16::from_float(float(int(rng() % 7)) - 3.0f);
    for (long long t = 0; t < n; t += 5) s[std::size_t(t)] = bf16::from_bits(0xFF80);  // some -inf
    std::vector<long long> visible(rows, n);
    visible[1] = n / 3;
    device_buffer<bf16> ds{std::span<const bf16>(s)};
    device_buffer<long long> dv{std::span<const long long>(visible)};
    for (const bool split : {false, true}) {
      const auto got = run_select({ds.data(), n, rows, k, dv.data(), 0, nullptr}, split);
      for (int r = 0; r < rows; ++r) {
        std::vector<float> row(static_cast<std::size_t>(n));
        for (long long t = 0; t < n; ++t) row[std::size_t(t)] = s[std::size_t(r) * n + t].to_float();
        const auto want = select_reference(row, k, visible[r], 0);
        BOOST_TEST(std::vector<std::int32_t>(got.begin() + std::ptrdiff_t(r) * k, got.begin() + std::ptrdiff_t(r + 1) * k) == want,
                   "n " << n << " row " << r << (split ? " (several CTAs per row)" : ""));
      }
    }
  }
}

// The split top-k's bookkeeping across slices: T's high byte is shared by values above T (2.5,
// 3.0, 5.0: counted through the earlier slices' low-byte bins) and one above it (8.0: through
// their high-byte counts), and the equal keys taken (2.0) start past the first slices, so ranks
// among equal keys carry over slices. Two shapes run through one scratch buffer, one after the
// other. Every selection must equal the host's and the one-CTA kernel's.
BOOST_AUTO_TEST_CASE(split_select_carries_counts_across_slices,
                     *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  auto rng = test::make_rng(66);
  const std::size_t words = std::max(topk_scratch_words(3, 200000), topk_scratch_words(1, 65536));
  device_buffer<unsigned> scratch(words);
  scratch.fill_bytes(0xFF);
  for (const auto& [rows, n, k] : {std::tuple{3, 200000LL, 512}, std::tuple{1, 65536LL, 2048}, std::tuple{3, 200000LL, 64}}) {
    BOOST_TEST_MESSAGE("split top-k: " << rows << " rows of " << n << ", k " << k << ", "
                                       << detail::plan_topk_split(rows, n, runtime::sm_count()).slices << " slices");
    std::vector<bf16> s(std::size_t(rows) * std::size_t(n));
    for (int r = 0; r < rows; ++r)
      for (long long t = 0; t < n; ++t) {
        const unsigned u = unsigned(rng() % 1000);
        float v = t < n * 2 / 5 ? 1.0f : 2.0f;  // the 2.0s (T) begin past the first slices
        if (u < 2) v = 8.0f;
        else if (u < 4) v = 5.0f;
        else if (u < 6) v = 3.0f;
        else if (u < 8) v = 2.5f;
        s[std::size_t(r) * std::size_t(n) + std::size_t(t)] = bf16::from_float(v);
      }
    std::vector<long long> visible(std::size_t(rows), n);
    visible[0] = n - 1000;
    device_buffer<bf16> ds{std::span<const bf16>(s)};
    device_buffer<long long> dv{std::span<const long long>(visible)};
    device_buffer<std::int32_t> dout(std::size_t(rows) * std::size_t(k));
    dout.fill_bytes(0x7F);
    topk_args t{ds.data(), n, rows, k, dv.data(), 128, dout.data()};
    t.scratch = scratch.data(), t.scratch_words = words;
    select_topk(t);
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
    const auto got = dout.download();
    const auto one_cta = run_select({ds.data(), n, rows, k, dv.data(), 128, nullptr}, false);
    BOOST_TEST(got == one_cta, "rows " << rows << " n " << n << " k " << k << ": split and one-CTA selections differ");
    for (int r = 0; r < rows; ++r) {
      std::vector<float> row(static_cast<std::size_t>(n));
      for (long long i = 0; i < n; ++i) row[std::size_t(i)] = s[std::size_t(r) * std::size_t(n) + std::size_t(i)].to_float();
      const auto want = select_reference(row, k, visible[std::size_t(r)], 128);
      BOOST_TEST(std::vector<std::int32_t>(got.begin() + std::ptrdiff_t(r) * k, got.begin() + std::ptrdiff_t(r + 1) * k) == want,
                 "rows " << rows << " n " << n << " k " << k << " row " << r);
    }
  }
}

// torch.topk's order on inputs the scan never produces (numerics::topk_order_key): -0 below +0,
// every NaN (either sign, any payload) ranks above +inf and NaNs tie, -inf lowest; ties to the
// lowest index. Rows mix these with small integers (many ties), from all-special to a sprinkle,
// with NaN counts below and above k; the kernel's selection and the candidate pool's block maxima
// must equal the host's.
BOOST_AUTO_TEST_CASE(select_follows_torch_order_for_signed_zeros_nan_and_inf,
                     *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  auto rng = test::make_rng(64);
  const std::uint16_t specials[] = {0x0000, 0x8000, 0x7FC0, 0xFFC0, 0x7F81, 0xFFFF, 0x7F80, 0xFF80, 0x8000, 0x0000};
  const double special_share[] = {1.0, 0.5, 0.1, 0.01, 0.9};
  constexpr int rows = 5;
  for (long long n : {37ll, 1000ll, 4097ll, 70001ll}) {
    std::vector<bf16> s(std::size_t(rows) * n);
    for (int r = 0; r < rows; ++r)
      for (long long t = 0; t < n; ++t) {
        const bool special = double(rng() % 1000000) < special_share[r] * 1e6;
        s[std::size_t(r) * n + t] = special ? bf16::from_bits(specials[rng() % std::size(specials)])
                                            : bf16::from_float(float(int(rng() % 5)) - 2.0f);
      }
    std::vector<long long> visible(rows, n);
    visible[2] = n / 3;
    visible[4] = 1;
    std::vector<std::vector<float>> host_rows(rows);
    for (int r = 0; r < rows; ++r)
      for (long long t = 0; t < n; ++t) host_rows[r].push_back(s[std::size_t(r) * n + t].to_float());
    device_buffer<bf16> ds{std::span<const bf16>(s)};
    device_buffer<long long> dv{std::span<const long long>(visible)};
    for (int topk : {1, 16, 512}) {
      const int k = int(std::min<long long>(topk, n));
      for (const bool split : {false, true}) {
        const auto got = run_select({ds.data(), n, rows, k, dv.data(), 128, nullptr}, split);
        for (int r = 0; r < rows; ++r) {
          const auto want = select_reference(host_rows[r], topk, visible[r], 128);
          BOOST_TEST(std::vector<std::int32_t>(got.begin() + std::ptrdiff_t(r) * k, got.begin() + std::ptrdiff_t(r + 1) * k) == want,
                     "n " << n << " k " << k << " row " << r << " selection differs" << (split ? " (several CTAs per row)" : ""));
        }
      }
    }
    // Candidate pool over the same scores: block maxima in the same order (a NaN block first).
    const int block = 4, topk_blocks = 6;
    const long long blocks = (n + block - 1) / block;
    const int kb = int(std::min<long long>(topk_blocks, blocks));
    device_buffer<bf16> dblock(std::size_t(rows) * blocks);
    device_buffer<std::int32_t> dids(std::size_t(rows) * kb), dpos(std::size_t(rows) * kb * block);
    const long long cols = candidate_pool({ds.data(), n, rows, block, topk_blocks, dv.data(), dblock.data(), dids.data(), dpos.data()});
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
    const auto positions = dpos.download();
    for (int r = 0; r < rows; ++r) {
      const auto mask = candidate_mask_reference(host_rows[r], visible[r], topk_blocks, block);
      std::vector<std::int32_t> want_pos, got_pos;
      for (long long i = 0; i < n; ++i)
        if (mask[std::size_t(i)]) want_pos.push_back(std::int32_t(i));
      for (long long c = 0; c < cols; ++c)
        if (positions[std::size_t(r) * cols + c] >= 0) got_pos.push_back(positions[std::size_t(r) * cols + c]);
      BOOST_TEST(got_pos == want_pos, "n " << n << " row " << r << ": candidate pool differs");
    }
  }
}

// The hierarchical path (spec §7): the candidate source's scores give the pool; a Reindex layer
// scores only the pool's positions and selects among them. Equal to the reference, which scores
// every position, masks the non-candidates and selects. `fixed_visible` (one count per row) gives
// prefill-like rows; without it, rows see nearly all n keys (decode-like).
void check_candidate_path(scan_method method, int rows, int heads, long long n, int topk, int block, int topk_blocks,
                          std::uint64_t salt, const std::vector<long long>& fixed_visible = {}) {
  BOOST_TEST_CONTEXT(method_name(method) << " scans, n " << n) {
  if (!fixed_visible.empty()) rows = int(fixed_visible.size());
  constexpr int dim = 128;
  using layout = numerics::packed_vector<numerics::index_key_format, dim>;
  auto rng = test::make_rng(salt);
  std::normal_distribution<float> nk(0.0f, 1.0f);
  std::vector<bf16> kx(std::size_t(n) * dim);
  for (auto& v : kx) v = bf16::from_float(nk(rng));
  const auto [cache, kq] = test::pack_index_keys<dim>(kx);
  std::vector<long long> visible(static_cast<std::size_t>(rows));
  for (int r = 0; r < rows; ++r) visible[r] = fixed_visible.empty() ? n - (long long)(rng() % 50) : fixed_visible[r];
  auto make_queries = [&] {
    std::vector<bf16> q = qdq_rows(rng, std::size_t(rows) * heads, dim, 1.0f), w(std::size_t(rows) * heads);
    for (auto& v : w) v = bf16::from_float(numerics::round_to_bf16(nk(rng)) * 0.015625f);
    return std::pair{q, w};
  };
  const auto [q_src, w_src] = make_queries();  // the candidate source (layer 20)
  const auto [q_re, w_re] = make_queries();    // a Reindex layer (24, 28, ...)

  device_buffer<std::uint8_t> dkeys{std::span<const std::uint8_t>(cache)};
  device_buffer<long long> dvis{std::span<const long long>(visible)};
  device_buffer<bf16> dqs{std::span<const bf16>(q_src)}, dws{std::span<const bf16>(w_src)}, dscores(std::size_t(rows) * n);
  index_scan_args src{dqs.data(), dws.data(), dkeys.data(), layout::bytes, dscores.data(), dvis.data(), rows, heads, n};
  src.method = method;
  index_scan<dim>(src);
  const long long blocks = (n + block - 1) / block;
  const int kb = int(std::min<long long>(topk_blocks, blocks));
  device_buffer<bf16> dblock(std::size_t(rows) * blocks);
  device_buffer<std::int32_t> dids(std::size_t(rows) * kb), dpos(std::size_t(rows) * kb * block);
  const long long cols = candidate_pool({dscores.data(), n, rows, block, topk_blocks, dvis.data(), dblock.data(), dids.data(), dpos.data()});
  BOOST_REQUIRE(cols == static_cast<long long>(kb) * block);
  device_buffer<bf16> dqr{std::span<const bf16>(q_re)}, dwr{std::span<const bf16>(w_re)}, dcand(std::size_t(rows) * cols);
  index_scan_args re_args{dqr.data(), dwr.data(), dkeys.data(), layout::bytes, dcand.data(), dvis.data(), rows, heads, cols};
  re_args.method = method;
  index_scan_gathered<dim>({re_args, dpos.data()});
  const int k = int(std::min<long long>(topk, n));
  device_buffer<std::int32_t> dsel(std::size_t(rows) * k);
  topk_args t{dcand.data(), cols, rows, k, dvis.data(), 128, dsel.data(), dpos.data()};
  select_topk(t);
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  const auto src_scores = dscores.download();
  const auto positions = dpos.download();
  const auto sel = dsel.download();
  for (int r = 0; r < rows; ++r) {
    std::vector<float> s(static_cast<std::size_t>(n));
    for (long long i = 0; i < n; ++i) s[std::size_t(i)] = src_scores[std::size_t(r) * n + i].to_float();
    const auto mask = candidate_mask_reference(s, visible[r], topk_blocks, block);
    std::vector<std::int32_t> want_pos, got_pos;
    for (long long i = 0; i < n; ++i)
      if (mask[std::size_t(i)]) want_pos.push_back(std::int32_t(i));
    for (long long c = 0; c < cols; ++c)
      if (positions[std::size_t(r) * cols + c] >= 0) got_pos.push_back(positions[std::size_t(r) * cols + c]);
    BOOST_TEST(got_pos == want_pos, "row " << r << ": candidate pool differs");
    auto re = index_scores_reference(std::span(q_re).subspan(std::size_t(r) * heads * dim, std::size_t(heads) * dim),
                                     std::span(w_re).subspan(std::size_t(r) * heads, heads), kq, heads, dim, visible[r]);
    apply_candidate_mask(re, mask);
    const auto want_sel = select_reference(re, topk, visible[r], 128);
    BOOST_TEST(std::vector<std::int32_t>(sel.begin() + std::ptrdiff_t(r) * k, sel.begin() + std::ptrdiff_t(r + 1) * k) == want_sel,
               "row " << r << ": Reindex selection differs");
  }
  }
}

BOOST_AUTO_TEST_CASE(candidate_pool_and_reindex_match_host, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  for (const scan_method m : scan_methods) {
    check_candidate_path(m, 3, 4, 300, 16, 4, 8, 61);         // tiny sizes: the 32-entry pool binds
    check_candidate_path(m, 2, 32, 20000, 512, 8, 2048, 62);  // V4.1 sizes: 16,384 candidates of 20,000
    check_candidate_path(m, 2, 32, 9000, 512, 8, 2048, 63);   // below the pool size: every visible block kept
  }
}

// Prefill-like rows (row i sees few keys): the pool holds every visible block and then blocks with
// no visible key, which expand to -1 holes; rows with fewer visible keys than k select all of them
// and fill the rest with -1 (positions past the visible count, then holes), at the row's end. Rows
// around the block, k and pool boundaries, with a few long rows where the pool binds.
BOOST_AUTO_TEST_CASE(reindex_prefill_rows_match_host, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  for (const scan_method m : scan_methods) {
    check_candidate_path(m, 0, 4, 300, 16, 4, 8, 65, {1, 2, 3, 4, 5, 15, 16, 17, 31, 32, 33, 37, 150, 300});
    check_candidate_path(m, 0, 32, 20000, 512, 8, 2048, 66,
                         {1, 7, 8, 9, 100, 511, 512, 513, 4000, 16383, 16384, 16385, 16392, 20000});
  }
}

BOOST_AUTO_TEST_CASE(bad_arguments_are_errors) {
  BOOST_CHECK_THROW(select_topk({nullptr, 10, 1, 11, nullptr, 0, nullptr}), dsv4::error);  // k > n
  BOOST_CHECK_THROW(index_scan<128>({nullptr, nullptr, nullptr, 68, nullptr, nullptr, 1, 65, 10}), dsv4::error);
}

BOOST_AUTO_TEST_SUITE_END()
