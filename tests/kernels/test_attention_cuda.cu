// CUDA sparse attention against the host reference: on the official vectors, on random bf16
// problems (prefill-like and decode-like, empty rows, -1 slots), and reading packed FP8 / FP4 caches.

#include <boost/test/unit_test.hpp>

#include <cmath>
#include <random>
#include <span>
#include <type_traits>
#include <vector>

#include "dsv4/cache/paged_cache.hpp"
#include "dsv4/io/safetensors.hpp"
#include "dsv4/kernels/attention/reference.hpp"
#include "dsv4/kernels/attention/sparse_attention.cuh"
#include "dsv4/models/v41_flash.hpp"
#include "dsv4/numerics/formats.hpp"
#include "dsv4/numerics/quantize.hpp"
#include "dsv4/runtime/device_buffer.cuh"
#include "support/data.hpp"
#include "support/gpu.hpp"
#include "support/numerics.hpp"
#include "support/random.hpp"

namespace utf = boost::unit_test;
using namespace dsv4;
using namespace dsv4::kernels::attention;
using numerics::bf16;
using runtime::device_buffer;

namespace {

// Compares per (row, head) vector: NaN never passes; |got - want| <= 2^-7 |want| + 2^-9 max|want|.
// Expected differences: fp32 summation order and exp, and the bf16 rounding of a probability that
// lands on the other side of a rounding boundary (spec §3: about 1 bf16 ulp).
void compare(const std::vector<bf16>& got, const std::vector<bf16>& want, int dim, const std::string& what) {
  BOOST_REQUIRE_EQUAL(got.size(), want.size());
  int worst_ulp = 0;
  std::size_t bad = 0, nan = 0;
  for (std::size_t v0 = 0; v0 < got.size(); v0 += std::size_t(dim)) {
    float vmax = 0;
    for (int d = 0; d < dim; ++d) vmax = std::max(vmax, std::fabs(want[v0 + d].to_float()));
    for (int d = 0; d < dim; ++d) {
      const float g = got[v0 + d].to_float(), w = want[v0 + d].to_float();
      if (std::isnan(g) || std::isnan(w)) { ++nan; continue; }
      worst_ulp = std::max(worst_ulp, test::bf16_ulp_distance(got[v0 + d], want[v0 + d]));
      if (std::fabs(g - w) > std::fabs(w) / 128 + vmax / 512) ++bad;
    }
  }
  BOOST_TEST_MESSAGE(what << ": worst " << worst_ulp << " bf16 ulp over " << got.size() << " values");
  BOOST_TEST(nan == 0u, what << ": " << nan << " NaN values");
  BOOST_TEST(bad == 0u, what << ": " << bad << " values outside tolerance (worst " << worst_ulp << " ulp)");
}

struct problem {
  int batch, rows, heads, topk, entries;
  std::vector<bf16> q, kv;
  std::vector<float> sink;
  std::vector<std::int32_t> idx;
};

// Random problem: scores of realistic spread (kv ~ N(0, 1), q ~ N(0, 1.5^2)),
// index lists in random order with -1 slots, and some rows with no valid index at all.
problem make_problem(std::mt19937_64& rng, int batch, int rows, int heads, int dim, int topk, int entries) {
  problem p{batch, rows, heads, topk, entries, {}, {}, {}, {}};
  std::normal_distribution<float> n(0.0f, 1.0f);
  p.q.resize(std::size_t(batch) * rows * heads * dim);
  for (auto& x : p.q) x = bf16::from_float(1.5f * n(rng));  // q.k / sqrt(dim) ~ N(0, 1.5^2)
  p.kv.resize(std::size_t(batch) * entries * dim);
  for (auto& x : p.kv) x = bf16::from_float(n(rng));
  p.sink.resize(std::size_t(heads));
  for (auto& x : p.sink) x = n(rng);
  p.idx.resize(std::size_t(batch) * rows * topk);
  for (std::size_t r = 0; topk > 0 && r < p.idx.size() / std::size_t(topk); ++r) {
    const bool empty = rng() % 11 == 0;
    for (int k = 0; k < topk; ++k)
      p.idx[r * topk + k] = (empty || rng() % 9 == 0) ? -1 : std::int32_t(rng() % std::uint64_t(entries));
  }
  return p;
}

template <int Dim>
std::vector<bf16> host_reference(const problem& p, const std::vector<bf16>& kv, int entries, float scale) {
  std::vector<bf16> out(p.q.size());
  const sparse_attention_problem sp{p.rows, p.heads, Dim, entries, p.topk, scale};
  const std::size_t qn = std::size_t(p.rows) * p.heads * Dim;
  for (int b = 0; b < p.batch; ++b)
    sparse_attention_reference(sp, std::span(p.q).subspan(b * qn, qn),
                               std::span(kv).subspan(std::size_t(b) * entries * Dim, std::size_t(entries) * Dim),
                               p.sink, std::span(p.idx).subspan(std::size_t(b) * p.rows * p.topk, std::size_t(p.rows) * p.topk),
                               std::span(out).subspan(b * qn, qn));
  return out;
}

// With a workspace, few-row problems split the index list (the decode path); without, one pass.
// `q_offset` (elements) places q that far into its buffer: 4 gives an 8-byte but not 16-byte
// aligned q, the kernel's narrower query copy. `wgmma` false keeps 64-head CTAs on mma.sync.
template <int Dim, class KV>
std::vector<bf16> run_device(const problem& p, const KV& kv, float scale,
                             sparse_attention_workspace* ws = nullptr, int q_offset = 0, bool wgmma = true,
                             int head_tiles = 0) {
  device_buffer<bf16> dq(p.q.size() + std::size_t(q_offset)), dout(p.q.size());
  DSV4_CUDA_CHECK(cudaMemcpy(dq.data() + q_offset, p.q.data(), p.q.size() * sizeof(bf16), cudaMemcpyHostToDevice));
  device_buffer<float> dsink{std::span<const float>(p.sink)};
  device_buffer<std::int32_t> didx{std::span<const std::int32_t>(p.idx)};
  dout.fill_bytes(0xFF);  // NaN poison
  sparse_attention_args a;
  a.q = dq.data() + q_offset;
  a.idx = didx.data();
  a.sink = dsink.data();
  a.out = dout.data();
  a.batch = p.batch;
  a.rows = p.rows;
  a.heads = p.heads;
  a.topk = p.topk;
  a.scale = scale;
  a.allow_wgmma = wgmma;
  a.head_tiles = head_tiles;
  sparse_attention<Dim>(a, kv, nullptr, ws);
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  return dout.download();
}

std::size_t count_differing(const std::vector<bf16>& x, const std::vector<bf16>& y) {
  std::size_t differ = x.size() == y.size() ? 0 : x.size() + y.size();
  for (std::size_t i = 0; i < std::min(x.size(), y.size()); ++i) differ += x[i].bits != y[i].bits;
  return differ;
}

// Split against unsplit: the probabilities and running maxima are the same bits (the splits start
// from the chunk maxima before them), only fp32 sums differ, so every value is within a bf16 ulp
// (2^-7 relative) plus fp32 noise far below 2^-16 of the vector's largest value.
void compare_split(const std::vector<bf16>& split, const std::vector<bf16>& unsplit, int dim, const std::string& what) {
  std::size_t bad = 0, nan = 0, equal = 0;
  for (std::size_t v0 = 0; v0 < split.size(); v0 += std::size_t(dim)) {
    float vmax = 0;
    for (int d = 0; d < dim; ++d) vmax = std::max(vmax, std::fabs(unsplit[v0 + d].to_float()));
    for (int d = 0; d < dim; ++d) {
      const float s = split[v0 + d].to_float(), u = unsplit[v0 + d].to_float();
      if (std::isnan(s) || std::isnan(u)) { ++nan; continue; }
      equal += split[v0 + d].bits == unsplit[v0 + d].bits;
      if (std::fabs(s - u) > std::fabs(u) / 128 + vmax / 65536) ++bad;
    }
  }
  BOOST_TEST_MESSAGE(what << ": " << equal << " of " << split.size() << " values equal to unsplit");
  BOOST_TEST(nan == 0u, what << ": " << nan << " NaN values");
  BOOST_TEST(bad == 0u, what << ": " << bad << " values differ from unsplit beyond fp32 summation order");
}

// The device result unsplit and split (when the launcher splits this shape) against the host;
// returns the unsplit result. `head_tiles` as sparse_attention_args::head_tiles (0: the launcher's).
template <int Dim, class KV>
std::vector<bf16> compare_one_way(const problem& p, const KV& kv, float scale, const std::vector<bf16>& want,
                                  const std::string& what, bool wgmma, int head_tiles = 0) {
  const auto unsplit = run_device<Dim>(p, kv, scale, nullptr, 0, wgmma, head_tiles);
  compare(unsplit, want, Dim, what + " unsplit");
  auto ws = sparse_attention_workspace::for_device<Dim>();
  sparse_attention_args a;
  a.batch = p.batch, a.rows = p.rows, a.heads = p.heads, a.topk = p.topk, a.head_tiles = head_tiles;
  const auto sp = detail::choose_split<Dim>(a, &ws, runtime::sm_count());
  const int splits = sp.splits;
  const long long row_groups = static_cast<long long>(p.batch) * p.rows * detail::launch_head_groups(a);
  const bool single = detail::single_launch(sp, row_groups, &ws);
  BOOST_TEST_MESSAGE(what << ": " << splits << " splits" << (single ? ", one launch" : ""));
  if (splits < 2) return unsplit;
  const auto split = run_device<Dim>(p, kv, scale, &ws, 0, wgmma, head_tiles);
  compare(split, want, Dim, what + " split " + std::to_string(splits));
  compare_split(split, unsplit, Dim, what + " split " + std::to_string(splits));
  if (!single) return unsplit;
  // The single launch and the three launches do the same arithmetic: the same bits.
  ws.set_single_launch(false);
  const auto three = run_device<Dim>(p, kv, scale, &ws, 0, wgmma, head_tiles);
  ws.set_single_launch(true);
  BOOST_TEST(count_differing(split, three) == 0u, what << ": one launch and three launches differ");
  return unsplit;
}

// compare_one_way on every kernel the shape can run on: where CTAs of 64 heads at Dim 512 take
// the wgmma kernel (sm_90a), the mma.sync one as well; and with fewer head tiles per CTA than
// the heads fill (more CTAs, each of fewer heads), which must give the mma.sync kernel's bits
// (the heads' softmaxes are independent), unsplit, and split match the host.
template <int Dim, class KV>
void compare_both_ways(const problem& p, const KV& kv, float scale, const std::vector<bf16>& want,
                       const std::string& what) {
  const bool two_kernels = Dim == 512 && p.heads > 32 && kernels::wgmma::supported();
  // The CTAs the heads fill, forced: the launcher's own choice (fewer for small decode calls) is
  // among the counts the loop below runs.
  const int fill = detail::head_tiles_for(p.heads);
  const auto first = compare_one_way<Dim>(p, kv, scale, want, what + (two_kernels ? " [wgmma]" : ""), true, fill);
  const auto sync =
      two_kernels ? compare_one_way<Dim>(p, kv, scale, want, what + " [mma.sync]", false, fill) : first;
  for (int tiles : {1, 2}) {
    if (tiles >= detail::head_tiles_for(p.heads)) continue;
    const std::string label = what + " [" + std::to_string(16 * tiles) + " heads a CTA]";
    const auto fewer = compare_one_way<Dim>(p, kv, scale, want, label, false, tiles);
    BOOST_TEST(count_differing(fewer, sync) == 0u,
               label << ": differs from the CTAs the heads fill (unsplit)");
  }
}

template <int Dim>
void check_bf16_operand(int batch, int rows, int heads, int topk, int entries, std::uint64_t salt) {
  auto rng = test::make_rng(salt);
  const problem p = make_problem(rng, batch, rows, heads, Dim, topk, entries);
  const float scale = 1.0f / std::sqrt(float(Dim));
  device_buffer<bf16> dkv{std::span<const bf16>(p.kv)};
  bf16_kv<Dim> kv{dkv.data(), entries, Dim, static_cast<long long>(entries) * Dim};
  compare_both_ways<Dim>(p, kv, scale, host_reference<Dim>(p, p.kv, entries, scale),
                         "bf16 operand b" + std::to_string(batch) + " rows" + std::to_string(rows) + " topk" + std::to_string(topk));
}

// Window ring (FP8, 528 B at Dim 512) + global entries (FP4, 288 B), dequantized in the kernel. The
// host reference runs on the same caches dequantized to bf16 (exactly the reference's QDQ values).
// `pad` bytes (a multiple of 4) after every entry make the entries 4-byte but not 16-byte aligned:
// the kernel's staged copies then take their slow path.
template <int Dim>
void check_packed_operand(int batch, int rows, int heads, int window, int global, int topk,
                          std::uint64_t salt, int pad = 0) {
  using wf = numerics::fp8_act_format;
  using gf = numerics::main_kv_format;
  using wl = numerics::packed_vector<wf, Dim>;
  using gl = numerics::packed_vector<gf, Dim>;
  auto rng = test::make_rng(salt);
  const int entries = window + global;
  problem p = make_problem(rng, batch, rows, heads, Dim, topk, entries);
  const long long wstride = wl::bytes + pad, gstride = gl::bytes + pad;
  std::vector<std::uint8_t> wcache(std::size_t(batch * window * wstride)),
      gcache(std::size_t(batch * global * gstride));
  std::vector<bf16> qdq(p.kv.size());
  for (int b = 0; b < batch; ++b)
    for (int e = 0; e < entries; ++e) {
      const std::span<const bf16> x(p.kv.data() + (std::size_t(b) * entries + e) * Dim, Dim);
      const std::span<bf16> y(qdq.data() + (std::size_t(b) * entries + e) * Dim, Dim);
      if (e < window)
        test::pack_entry<wf, Dim>(x, wcache.data() + (std::size_t(b) * window + e) * wstride, y);
      else
        test::pack_entry<gf, Dim>(x, gcache.data() + (std::size_t(b) * global + (e - window)) * gstride, y);
    }
  const float scale = 1.0f / std::sqrt(float(Dim));
  device_buffer<std::uint8_t> dw{std::span<const std::uint8_t>(wcache)}, dg{std::span<const std::uint8_t>(gcache)};
  packed_kv<wf, gf, Dim> kv;
  kv.window.base = dw.data();
  kv.window.rows = window;
  kv.window.stride = wstride;
  kv.window.seq_stride = window * wstride;
  kv.global = dg.data();
  kv.global_rows = global;
  kv.global_stride = gstride;
  kv.global_seq_stride = global * gstride;
  compare_both_ways<Dim>(p, kv, scale, host_reference<Dim>(p, qdq, entries, scale),
                         "packed operand b" + std::to_string(batch) + " rows" + std::to_string(rows) +
                             (pad ? " pad" + std::to_string(pad) : ""));
}

// The V4.1 cache formats and a page geometry of 256 tokens, for the paged-cache cases.
namespace v41_paged {
using geo = cache::page_geometry<models::v41_flash, 256>;
using wf = numerics::fp8_act_format;
using gf = numerics::main_kv_format;
using wl = numerics::packed_vector<wf, 512>;
using gl = numerics::packed_vector<gf, 512>;
using region = std::remove_cvref_t<decltype(geo::regions[0])>;

//! Points an operand's window ring at `ring` (one ring of `window` rows per sequence) and its
//! global entries at the owner's region of the page pool, through `tables`.
template <class KV>
void point_at(KV& kv, const std::uint8_t* ring, int window, const std::uint8_t* pool, const std::int32_t* tables,
              int max_pages, const region& owner) {
  kv.window.base = ring;
  kv.window.rows = window;
  kv.window.seq_stride = static_cast<long long>(window) * wl::bytes;
  kv.pool = pool;
  kv.block_tables = tables;
  kv.max_pages = max_pages;
  kv.page_bytes = geo::page_bytes;
  kv.region_offset = owner.main_offset;
  kv.entries_per_page = owner.entries_per_page;
}
}  // namespace v41_paged

}  // namespace

BOOST_AUTO_TEST_SUITE(attention_cuda)

BOOST_AUTO_TEST_CASE(device_matches_the_official_vectors, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  io::safetensors_file f(test::data_path("reference/sparse_attn.safetensors"));
  problem p{2, 3, 8, 328, 700, io::copy_as<bf16>(f.tensor("q")), io::copy_as<bf16>(f.tensor("kv")),
            io::copy_as<float>(f.tensor("attn_sink")), io::copy_as<std::int32_t>(f.tensor("topk_idxs"))};
  const float scale = io::copy_as<float>(f.tensor("softmax_scale"))[0];
  device_buffer<bf16> dkv{std::span<const bf16>(p.kv)};
  bf16_kv<512> kv{dkv.data(), 700, 512, 700 * 512};
  const auto want = io::copy_as<bf16>(f.tensor("out"));
  auto ws = sparse_attention_workspace::for_device<512>();
  std::vector<bf16> unsplit;
  for (sparse_attention_workspace* w : {static_cast<sparse_attention_workspace*>(nullptr), &ws}) {
    const auto got = run_device<512>(p, kv, scale, w);
    compare(got, want, 512, w ? "official vectors, split" : "official vectors");
    int worst = 0;
    for (std::size_t i = 0; i < got.size(); ++i) worst = std::max(worst, test::bf16_ulp_distance(got[i], want[i]));
    BOOST_TEST(worst <= 2);
    if (w) compare_split(got, unsplit, 512, "official vectors, split");
    else unsplit = got;
  }
}

BOOST_AUTO_TEST_CASE(device_matches_host_on_bf16_operands, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  check_bf16_operand<512>(1, 37, 64, 328, 700, 1);   // prefill-like: many rows, topk not a multiple of 64
  check_bf16_operand<512>(8, 1, 64, 640, 2000, 2);   // decode: 8 sequences, window + 512 selected
  check_bf16_operand<512>(3, 6, 20, 100, 90, 3);     // 6 queries per sequence, heads not a multiple of 16
  check_bf16_operand<128>(4, 5, 4, 48, 64, 4);       // tiny widths
  check_bf16_operand<512>(1, 2, 80, 200, 300, 6);    // two head groups (64 + 16): the second CTA's dead tiles
  check_bf16_operand<512>(2, 1, 40, 130, 150, 7);    // 40 heads: a CTA of four tiles whose fourth is dead
  check_bf16_operand<512>(2, 3, 64, 0, 10, 5);       // no indices at all: zeros
  check_bf16_operand<512>(1, 1, 64, 1280, 1500, 8);  // a long list: 20 splits in one launch
}

// q 8-byte aligned only (allowed): the kernel copies the queries 8 bytes at a time instead of 16,
// which must give the same bits, unsplit and split, for every head-tile count and dead heads.
BOOST_AUTO_TEST_CASE(an_8_byte_aligned_query_gives_the_same_bits, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  auto check = [](auto dim_tag, int batch, int rows, int heads, int topk, int entries, std::uint64_t salt) {
    constexpr int Dim = decltype(dim_tag)::value;
    auto rng = test::make_rng(salt);
    const problem p = make_problem(rng, batch, rows, heads, Dim, topk, entries);
    const float scale = 1.0f / std::sqrt(float(Dim));
    device_buffer<bf16> dkv{std::span<const bf16>(p.kv)};
    bf16_kv<Dim> kv{dkv.data(), entries, Dim, static_cast<long long>(entries) * Dim};
    auto ws = sparse_attention_workspace::for_device<Dim>();
    for (sparse_attention_workspace* w : {static_cast<sparse_attention_workspace*>(nullptr), &ws}) {
      const auto aligned = run_device<Dim>(p, kv, scale, w), shifted = run_device<Dim>(p, kv, scale, w, 4);
      std::size_t differ = 0;
      for (std::size_t i = 0; i < aligned.size(); ++i) differ += aligned[i].bits != shifted[i].bits;
      BOOST_TEST(differ == 0u, "Dim " << Dim << " heads " << heads << (w ? " split" : " unsplit") << ": " << differ
                                      << " values differ with an 8-byte aligned q");
    }
  };
  check(std::integral_constant<int, 512>{}, 2, 1, 20, 200, 300, 31);  // two head tiles, 12 dead heads
  check(std::integral_constant<int, 512>{}, 1, 3, 40, 130, 150, 32);  // four tiles, the fourth dead
  check(std::integral_constant<int, 512>{}, 1, 2, 80, 200, 300, 33);  // two head groups
  check(std::integral_constant<int, 128>{}, 4, 5, 4, 48, 64, 34);     // one tile, tiny widths
}

BOOST_AUTO_TEST_CASE(device_reads_packed_caches, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  check_packed_operand<512>(1, 1, 64, 128, 1000, 640, 10);   // one decode step, V4.1 widths
  check_packed_operand<512>(5, 2, 64, 128, 300, 640, 11);    // batched sequences
  check_packed_operand<128>(3, 7, 4, 16, 40, 32, 12);        // tiny widths
  // Tiny widths over several chunks (the staged pipeline with 4-byte copies of 132-byte window
  // entries) and a partly dead second head tile.
  check_packed_operand<128>(2, 3, 20, 16, 300, 200, 13);
  // V4.1 widths with entries 4 bytes apart from 16-byte alignment: the slow path of the staged
  // copies (plain loads and stores instead of bulk copies), unsplit and split.
  check_packed_operand<512>(2, 1, 64, 128, 600, 640, 14, 4);
}

// One decode row of 64 heads is one CTA unsplit (two of 32 heads in calls of up to 8 rows): the
// launcher must spread its ten chunks over the SMs, as long as three or more splits fit beside
// the (row, head group) grid; a prefill-sized grid must not split.
BOOST_AUTO_TEST_CASE(decode_rows_split_prefill_rows_do_not, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  auto ws = sparse_attention_workspace::for_device<512>();
  sparse_attention_args a;
  a.batch = 1, a.rows = 1, a.heads = 64, a.topk = 640;
  BOOST_TEST(detail::launch_heads_per_cta(a) == 32);
  const auto one = detail::choose_split<512>(a, &ws, 132);
  BOOST_TEST(one.splits == 10);
  BOOST_TEST(one.chunks_per_split == 1);
  a.batch = 4;  // 8 CTAs of 32 heads: still one chunk per split
  BOOST_TEST(detail::choose_split<512>(a, &ws, 132).splits == 10);
  a.batch = 8;  // 16 CTAs of 32 heads: at most 8 splits, so two chunks each: 5 splits
  BOOST_TEST(detail::launch_heads_per_cta(a) == 32);
  BOOST_TEST(detail::choose_split<512>(a, &ws, 132).splits == 5);
  a.batch = 4, a.rows = 3;  // 12 rows: 64-head CTAs again, 12 of them: one chunk per split
  BOOST_TEST(detail::launch_heads_per_cta(a) == 64);
  BOOST_TEST(detail::choose_split<512>(a, &ws, 132).splits == 10);
  a.rows = 1;
  a.batch = 16;  // 16 CTAs: at most 8 splits, so two chunks each: 5 splits
  BOOST_TEST(detail::choose_split<512>(a, &ws, 132).splits == 5);
  a.batch = 44;  // 44 CTAs: three splits fit (132 SMs), of four, four and two chunks
  BOOST_TEST(detail::choose_split<512>(a, &ws, 132).splits == 3);
  a.batch = 45;  // 45 CTAs: only two splits of five chunks would fit, slower than unsplit
  BOOST_TEST(detail::choose_split<512>(a, &ws, 132).splits == 1);
  a.batch = 64;
  BOOST_TEST(detail::choose_split<512>(a, &ws, 132).splits == 1);
  a.batch = 60, a.topk = 128;  // a list of two chunks still splits in two where two fit
  BOOST_TEST(detail::choose_split<512>(a, &ws, 132).splits == 2);
  a.topk = 640;
  a.batch = 128;  // 128 CTAs already
  BOOST_TEST(detail::choose_split<512>(a, &ws, 132).splits == 1);
  a.batch = 1, a.topk = 1280;  // 20 chunks: 20 splits of one chunk
  BOOST_TEST(detail::choose_split<512>(a, &ws, 132).splits == 20);
  a.topk = 640;
  a.batch = 1, a.rows = 4096;
  BOOST_TEST(detail::choose_split<512>(a, &ws, 132).splits == 1);
  BOOST_TEST(detail::choose_split<512>(a, nullptr, 132).splits == 1);
  a.rows = 1, a.heads = 20;  // heads that do not fill a CTA: two head tiles, one CTA per row
  BOOST_TEST(detail::heads_per_cta(a.heads) == 32);
  BOOST_TEST(detail::choose_split<512>(a, &ws, 132).splits == 10);
  // Fewer heads a CTA than the heads fill: more CTAs a row, so fewer splits fit one wave.
  a.heads = 64, a.head_tiles = 1;  // 4 CTAs a row
  BOOST_TEST(detail::launch_heads_per_cta(a) == 16);
  BOOST_TEST(detail::choose_split<512>(a, &ws, 132).splits == 10);
  a.batch = 8;  // 32 CTAs: at most 4 splits, of three chunks (the last of one)
  BOOST_TEST(detail::choose_split<512>(a, &ws, 132).splits == 4);
  BOOST_TEST(detail::choose_split<512>(a, &ws, 132).chunks_per_split == 3);
}

// The single cooperative launch leaves its barrier counters at zero: launches of different
// shapes (10, 5 and 2 splits; 1, 3 and 2 row groups) take turns on one workspace, each equal bit
// for bit to the three-launch form. A counter left over would make a later launch wait for
// members that never come (the barrier stops with an error after ten seconds) or pass too early.
BOOST_AUTO_TEST_CASE(single_launches_reuse_the_workspace, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  struct shape {
    int batch, rows, heads, topk, entries;
  };
  const shape shapes[] = {{1, 1, 64, 640, 900}, {3, 1, 64, 300, 400}, {1, 1, 64, 100, 150}, {2, 1, 20, 640, 700}};
  auto ws = sparse_attention_workspace::for_device<512>();
  for (int round = 0; round < 3; ++round)
    for (std::size_t k = 0; k < std::size(shapes); ++k) {
      const shape& sh = shapes[k];
      auto rng = test::make_rng(40 + k);
      const problem p = make_problem(rng, sh.batch, sh.rows, sh.heads, 512, sh.topk, sh.entries);
      device_buffer<bf16> dkv{std::span<const bf16>(p.kv)};
      bf16_kv<512> kv{dkv.data(), sh.entries, 512, static_cast<long long>(sh.entries) * 512};
      sparse_attention_args a;
      a.batch = p.batch, a.rows = p.rows, a.heads = p.heads, a.topk = p.topk;
      const auto sp = detail::choose_split<512>(a, &ws, runtime::sm_count());
      BOOST_TEST_REQUIRE(detail::single_launch(
          sp, static_cast<long long>(sh.batch) * sh.rows * detail::launch_head_groups(a), &ws));
      const auto one = run_device<512>(p, kv, 1.0f / std::sqrt(512.0f), &ws);
      ws.set_single_launch(false);
      const auto three = run_device<512>(p, kv, 1.0f / std::sqrt(512.0f), &ws);
      ws.set_single_launch(true);
      BOOST_TEST(count_differing(one, three) == 0u, "round " << round << " shape " << k << " (" << sp.splits << " splits)");
      if (round == 0) compare(one, host_reference<512>(p, p.kv, sh.entries, 1.0f / std::sqrt(512.0f)), 512, "single launch");
    }
}

// The launcher's heads per CTA: as many as the heads fill, except 64 heads in calls of up to
// half_tiles_max_rows query rows, which run as two CTAs of 32 (bench_attention --head-tiles);
// the caller's choice wins.
BOOST_AUTO_TEST_CASE(small_decode_calls_take_32_head_ctas) {
  sparse_attention_args a;
  a.heads = 64, a.topk = 640;
  struct call {
    int batch, rows, heads_per_cta;
  };
  for (const call c : {call{1, 1, 32}, {2, 1, 32}, {8, 1, 32}, {4, 2, 32}, {9, 1, 64}, {3, 3, 64}, {16, 1, 64},
                       {1, 4096, 64}}) {
    a.batch = c.batch, a.rows = c.rows;
    BOOST_TEST(detail::launch_heads_per_cta(a) == c.heads_per_cta, c.batch << " x " << c.rows << " rows");
  }
  a.batch = 1, a.rows = 1;
  a.head_tiles = 4;
  BOOST_TEST(detail::launch_heads_per_cta(a) == 64);
  a.head_tiles = 0, a.heads = 20;  // heads that fill two tiles keep them
  BOOST_TEST(detail::launch_heads_per_cta(a) == 32);
  a.heads = 8;
  BOOST_TEST(detail::launch_heads_per_cta(a) == 16);
}

BOOST_AUTO_TEST_CASE(launch_rejects_bad_arguments) {
  sparse_attention_args a;
  a.rows = 1;
  a.heads = 0;
  bf16_kv<512> kv;
  BOOST_TEST(can_implement<512>(a, kv).find("heads > 0") != std::string::npos);
  a.heads = 8;
  a.head_tiles = 3;
  BOOST_TEST(can_implement<512>(a, kv).find("head_tiles is 3") != std::string::npos);
  a.head_tiles = 0;
  BOOST_TEST(can_implement<512>(a, kv).find("null pointer") != std::string::npos);
  BOOST_CHECK_THROW(sparse_attention<512>(a, kv), dsv4::error);
}

// An appended chunk (exact mode) at V4.1 widths: index j < W reads the sequence's ring, j < W + C
// the chunk's own window entries (a separate buffer), the rest global entries through the
// block table of the owner's pages; every range's boundary is in the lists, with -1 slots. Then
// a local layer's call: no pool, indices below W + C only.
BOOST_AUTO_TEST_CASE(device_reads_appended_chunks, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  using namespace v41_paged;
  constexpr int dim = 512, window = 128, chunk = 40, rows = 3, heads = 64, topk = 300;
  auto rng = test::make_rng(90);
  const long long pages = 8;
  cache::page_allocator alloc(pages, geo::page_tokens, geo::page_bytes);
  const int other = alloc.add_sequence();
  alloc.append(other, 300);  // another sequence's pages first: the block table is not the identity
  const int seq = alloc.add_sequence();
  alloc.append(seq, 700);
  const int global = int(alloc.tokens(seq));
  const auto& owner = geo::regions[3];  // layer 20: ratio 1, one entry per token
  const auto& table = alloc.block_table(seq);
  const int max_pages = int(table.size());
  const std::vector<std::int32_t> tables(table.begin(), table.end());
  for (const bool with_pool : {true, false}) {
    const int entries = window + chunk + (with_pool ? global : 0);
    problem p = make_problem(rng, 1, rows, heads, dim, topk, entries);
    const int edges[] = {window - 1, window, window + chunk - 1, window + chunk, entries - 1};
    for (int r = 0; r < rows; ++r)
      for (int i = 0; i < 5; ++i)
        if (edges[i] < entries) p.idx[std::size_t(r) * topk + std::size_t(7 * i + r)] = edges[i];
    std::vector<std::uint8_t> pool(std::size_t(pages * geo::page_bytes), 0xCC), ring(std::size_t(window) * wl::bytes),
        own(std::size_t(chunk) * wl::bytes);
    std::vector<bf16> qdq(p.kv.size());
    cache::paged_view v{pool.data(), tables.data(), geo::page_bytes, owner.main_offset, gl::bytes, owner.entries_per_page};
    for (int e = 0; e < entries; ++e) {
      const std::span<const bf16> x(p.kv.data() + std::size_t(e) * dim, dim);
      const std::span<bf16> y(qdq.data() + std::size_t(e) * dim, dim);
      if (e < window) test::pack_entry<wf, dim>(x, ring.data() + std::size_t(e) * wl::bytes, y);
      else if (e < window + chunk) test::pack_entry<wf, dim>(x, own.data() + std::size_t(e - window) * wl::bytes, y);
      else test::pack_entry<gf, dim>(x, const_cast<std::uint8_t*>(v.entry(e - window - chunk)), y);
    }
    device_buffer<std::uint8_t> dpool{std::span<const std::uint8_t>(pool)}, dring{std::span<const std::uint8_t>(ring)},
        down{std::span<const std::uint8_t>(own)};
    device_buffer<std::int32_t> dtables{std::span<const std::int32_t>(tables)};
    appended_kv<wf, gf, dim> kv;
    point_at(kv, dring.data(), window, dpool.data(), dtables.data(), max_pages, owner);
    if (!with_pool) kv.pool = nullptr, kv.block_tables = nullptr;  // a local layer: ring and chunk only
    kv.chunk = down.data();
    kv.chunk_rows = chunk;
    const float scale = 1.0f / std::sqrt(float(dim));
    compare_both_ways<dim>(p, kv, scale, host_reference<dim>(p, qdq, entries, scale),
                           with_pool ? "appended chunk, paged global entries" : "appended chunk, local layer");
  }
}

// Global entries in the shared page pool, pages handed out out of order (sequences released and
// re-added), read through block tables: same results as the host reference in logical order.
BOOST_AUTO_TEST_CASE(device_reads_paged_caches, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  using namespace v41_paged;
  constexpr int dim = 512, window = 128, batch = 3, rows = 1, heads = 64, topk = 640;
  auto rng = test::make_rng(80);
  const long long pages = 40;
  cache::page_allocator alloc(pages, geo::page_tokens, geo::page_bytes);
  std::vector<int> ids;
  for (int s = 0; s < 5; ++s) {
    ids.push_back(alloc.add_sequence());
    alloc.append(ids.back(), 600 + 300 * s);
  }
  alloc.release(ids[1]);
  alloc.release(ids[3]);
  const int seqs[batch] = {ids[0], alloc.add_sequence(), ids[4]};
  alloc.append(seqs[1], 1500);
  const auto& owner = geo::regions[3];  // layer 20: ratio 1, one entry per token
  std::vector<std::uint8_t> pool(std::size_t(pages * geo::page_bytes), 0xCC);
  int max_pages = 0;
  for (int s : seqs) max_pages = std::max<int>(max_pages, int(alloc.block_table(s).size()));
  std::vector<std::int32_t> tables(std::size_t(batch) * max_pages, 0);
  int global = 1 << 30;
  for (int b = 0; b < batch; ++b) {
    const auto& t = alloc.block_table(seqs[b]);
    std::copy(t.begin(), t.end(), tables.begin() + std::ptrdiff_t(b) * max_pages);
    global = std::min<int>(global, int(alloc.tokens(seqs[b])));
  }
  problem p = make_problem(rng, batch, rows, heads, dim, topk, window + global);
  std::vector<std::uint8_t> wcache(std::size_t(batch) * window * wl::bytes);
  std::vector<bf16> qdq(p.kv.size());
  for (int b = 0; b < batch; ++b) {
    cache::paged_view v{pool.data(), tables.data() + std::ptrdiff_t(b) * max_pages, geo::page_bytes, owner.main_offset,
                        gl::bytes, owner.entries_per_page};
    for (int e = 0; e < window + global; ++e) {
      const std::span<const bf16> x(p.kv.data() + (std::size_t(b) * (window + global) + e) * dim, dim);
      const std::span<bf16> y(qdq.data() + (std::size_t(b) * (window + global) + e) * dim, dim);
      std::uint8_t* ent = e < window ? wcache.data() + (std::size_t(b) * window + e) * wl::bytes
                                     : const_cast<std::uint8_t*>(v.entry(e - window));
      if (e < window) test::pack_entry<wf, dim>(x, ent, y);
      else test::pack_entry<gf, dim>(x, ent, y);
    }
  }
  device_buffer<std::uint8_t> dpool{std::span<const std::uint8_t>(pool)}, dw{std::span<const std::uint8_t>(wcache)};
  device_buffer<std::int32_t> dtables{std::span<const std::int32_t>(tables)};
  paged_kv<wf, gf, dim> kv;
  point_at(kv, dw.data(), window, dpool.data(), dtables.data(), max_pages, owner);
  const float scale = 1.0f / std::sqrt(float(dim));
  compare_both_ways<dim>(p, kv, scale, host_reference<dim>(p, qdq, window + global, scale), "paged operand");
}

BOOST_AUTO_TEST_SUITE_END()
