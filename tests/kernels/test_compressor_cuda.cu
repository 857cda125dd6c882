// CUDA compressor pooling and cache-entry packing against the host reference
// (kernels/compressor/reference.hpp, the window path of attention/layer_reference.hpp).

#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "dsv4/cache/paged_cache.hpp"
#include "dsv4/kernels/compressor/compressor.cuh"
#include "dsv4/kernels/compressor/reference.hpp"
#include "dsv4/kernels/norm/reference.hpp"
#include "dsv4/kernels/rope/rope.hpp"
#include "dsv4/numerics/quantize.hpp"
#include "dsv4/runtime/device_buffer.cuh"
#include "support/gpu.hpp"
#include "support/numerics.hpp"
#include "support/random.hpp"

namespace utf = boost::unit_test;
using namespace dsv4;
using namespace dsv4::kernels::compressor;
using numerics::bf16;
using runtime::device_buffer;

namespace {

std::vector<bf16> random_bf16(std::size_t n, std::mt19937_64& rng, float sd, float mean = 0.0f) {
  std::normal_distribution<float> d(mean, sd);
  std::vector<bf16> v(n);
  for (auto& x : v) x = bf16::from_float(d(rng));
  return v;
}

std::vector<float> widen(const std::vector<bf16>& v) {
  std::vector<float> f(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) f[i] = v[i].to_float();
  return f;
}

// One sequence's token history: fp32 k and z of every position so far.
struct history {
  long long length = 0;
  std::vector<float> k, z;
};

// A batch of sequences advanced call by call (prefill from 0, single tokens, appended chunks,
// idle calls): the device pools with its state, the host pools each completed group from the
// whole history with the reference's pooling.
template <int Dim>
void pool_schedule(int ratio, int batch, std::mt19937_64& rng) {
  const std::vector<std::vector<int>> calls = {{7, 1, 0, 5}, {1, 1, 1, 1}, {0, 3, 2, 1}, {1, 0, 1, 9}, {4, 1, 6, 1}, {1, 2, 1, 1}};
  compressor_weights w;
  w.dim = 0, w.head_dim = Dim, w.ratio = ratio;
  w.norm = widen(random_bf16(Dim, rng, 0.2f, 1.0f));
  std::vector<bf16> norm_bf16(Dim);
  for (int c = 0; c < Dim; ++c) norm_bf16[std::size_t(c)] = bf16::from_float(w.norm[std::size_t(c)]);
  device_buffer<bf16> dnorm{std::span<const bf16>(norm_bf16)};
  // Unset state reads would show: NaN everywhere until written.
  std::vector<float> nan_state(std::size_t(batch) * ratio * Dim, std::nanf(""));
  device_buffer<float> sk{std::span<const float>(nan_state)}, sz{std::span<const float>(nan_state)};
  std::vector<history> hist(static_cast<std::size_t>(batch));
  std::normal_distribution<float> kd(0.0f, 1.5f), zd(0.0f, 3.0f);
  std::size_t compared = 0, equal = 0, beyond = 0;
  int worst = 0;
  for (const auto& call : calls) {
    std::vector<pool_sequence> seqs(static_cast<std::size_t>(batch));
    std::vector<float> k, z;
    int out_rows = 0, max_groups = 0;
    for (int b = 0; b < batch; ++b) {
      const int s = call[std::size_t(b) % call.size()];
      auto& h = hist[std::size_t(b)];
      seqs[std::size_t(b)] = {h.length, s, int(k.size() / Dim), b, out_rows};
      for (int t = 0; t < s * Dim; ++t) {
        const float kv = kd(rng), zv = zd(rng);
        k.push_back(kv), z.push_back(zv), h.k.push_back(kv), h.z.push_back(zv);
      }
      const int n = int(completed_groups(h.length, s, ratio));
      out_rows += n, max_groups = std::max(max_groups, n);
      h.length += s;
    }
    if (k.empty()) k.assign(Dim, 0.0f), z.assign(Dim, 0.0f);  // keep the pointers valid
    device_buffer<float> dk{std::span<const float>(k)}, dz{std::span<const float>(z)};
    device_buffer<pool_sequence> dseqs{std::span<const pool_sequence>(seqs)};
    std::vector<bf16> poison(std::size_t(std::max(out_rows, 1)) * Dim, bf16::from_bits(0x7fbf));
    device_buffer<bf16> dlat{std::span<const bf16>(poison)};
    std::vector<std::int64_t> pos_poison(std::size_t(std::max(out_rows, 1)), -7);
    device_buffer<std::int64_t> dpos{std::span<const std::int64_t>(pos_poison)};
    compress_pool<Dim, bf16>({dk.data(), dz.data(), dseqs.data(), batch, max_groups, sk.data(), sz.data(), dnorm.data(),
                              w.eps, dlat.data(), dpos.data(), ratio, Dim});
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
    const auto got = dlat.download();
    const auto got_pos = dpos.download();
    for (int b = 0; b < batch; ++b) {
      const auto& sq = seqs[std::size_t(b)];
      const auto& h = hist[std::size_t(b)];
      const long long g0 = first_completed_group(sq.start_pos, ratio);
      for (long long j = 0; j < completed_groups(sq.start_pos, sq.tokens, ratio); ++j) {
        const long long g = g0 + j;
        const auto span_k = std::span<const float>(h.k).subspan(std::size_t(g * ratio) * Dim, std::size_t(ratio) * Dim);
        const auto span_z = std::span<const float>(h.z).subspan(std::size_t(g * ratio) * Dim, std::size_t(ratio) * Dim);
        const auto want = kernels::compressor::detail::pool(w, span_k, span_z);
        const std::size_t row = std::size_t(sq.out_row + j);
        BOOST_TEST(got_pos[row] == g * ratio);
        float row_max = 0;
        for (int c = 0; c < Dim; ++c) row_max = std::max(row_max, std::fabs(want[std::size_t(c)].to_float()));
        for (int c = 0; c < Dim; ++c) {
          const bf16 gv = got[row * Dim + std::size_t(c)], wv = want[std::size_t(c)];
          BOOST_REQUIRE_MESSAGE(!std::isnan(gv.to_float()), "NaN latent: group " << g << " of sequence " << b);
          ++compared;
          if (gv.bits == wv.bits) ++equal;
          const int ulps = test::bf16_ulp_distance(gv, wv);
          worst = std::max(worst, ulps);
          // A pooled channel whose weighted terms cancel is small, and there an fp32-ulp
          // difference of one softmax weight moves it by several bf16 ulps (measured: 3 ulps
          // at a value far below the row's largest); such values are held to the row's scale.
          if (ulps > 1 && std::fabs(gv.to_float() - wv.to_float()) > row_max / 4096) ++beyond;
        }
      }
    }
  }
  BOOST_TEST_MESSAGE("compress_pool<" << Dim << "> ratio " << ratio << ": " << equal << " of " << compared
                                      << " latent values bit-equal, worst " << worst << " bf16 ulp");
  BOOST_TEST(compared > 0u);
  // expf on the device and the host's exp may differ by an fp32 ulp before the bf16 rounding:
  // 1 bf16 ulp, or 2^-12 of the row's largest value where terms cancel.
  BOOST_TEST(beyond == 0u, beyond << " latent values beyond 1 ulp and 2^-12 of their row's largest (worst " << worst << " ulp)");
  BOOST_TEST(equal * 1000 >= compared * 995);
}

// The host's view of what pack_entries stores: RMSNorm (optional), RoPE, then quantization.
std::vector<bf16> host_staged(const std::vector<bf16>& x, int dim, const std::vector<float>* norm,
                              std::int64_t position, const std::vector<float>& freqs) {
  std::vector<bf16> v = x;
  if (norm) v = kernels::norm::rmsnorm_bf16_reference(x, *norm, 1e-20f);
  const std::int64_t pos[1] = {position};
  if (!freqs.empty()) kernels::rope::apply_rope_reference(v, dim, 1, pos, freqs, false);
  return v;
}

template <class F, int Dim>
std::vector<std::uint8_t> host_entry(std::span<const bf16> staged) {
  std::vector<std::uint8_t> e(numerics::packed_vector<F, Dim>::bytes);
  test::quantize_entry<F, Dim>(staged, e.data());
  return e;
}

constexpr std::uint8_t poison_byte = 0xA5;

// Packs `rows` random vectors into `dst` (set up by the caller over `storage`), then checks the
// staged values against the host, every stored entry against the host quantizer applied to the
// staged values (bit for bit), and that no other byte of the storage changed.
template <class F, int Dim>
void check_pack(entry_destination dst, std::vector<std::uint8_t>& storage, const std::vector<std::int64_t>& positions,
                const std::vector<std::int32_t>& seq, bool with_norm, int rope_pairs, std::mt19937_64& rng,
                const std::vector<std::int32_t>& host_block_tables = {}) {
  const long long rows = static_cast<long long>(positions.size());
  const auto x = random_bf16(std::size_t(rows) * Dim, rng, 2.0f);
  const auto norm = widen(random_bf16(Dim, rng, 0.3f, 1.0f));
  std::vector<bf16> norm_bf16(Dim);
  for (int c = 0; c < Dim; ++c) norm_bf16[std::size_t(c)] = bf16::from_float(norm[std::size_t(c)]);
  const auto freqs = rope_pairs ? kernels::rope::frequencies({2 * rope_pairs, 160000.0f, 65536, 16.0f, 32.0f, 1.0f})
                                : std::vector<float>{};
  std::fill(storage.begin(), storage.end(), poison_byte);
  device_buffer<std::uint8_t> dstore{std::span<const std::uint8_t>(storage)};
  device_buffer<bf16> dx{std::span<const bf16>(x)}, dnorm{std::span<const bf16>(norm_bf16)};
  device_buffer<std::int64_t> dpos{std::span<const std::int64_t>(positions)};
  device_buffer<std::int32_t> dseq{std::span<const std::int32_t>(seq)};
  device_buffer<float> dfreqs(std::max<std::size_t>(freqs.size(), 1));
  if (!freqs.empty()) dfreqs.upload(freqs);
  device_buffer<std::int32_t> dtables(std::max<std::size_t>(host_block_tables.size(), 1));
  if (!host_block_tables.empty()) dtables.upload(host_block_tables);
  std::vector<bf16> staged_poison(std::size_t(rows) * Dim, bf16::from_bits(0x7fbf));
  device_buffer<bf16> dstaged{std::span<const bf16>(staged_poison)};
  entry_destination d = dst;
  const entry_destination host_dst = dst;
  d.base = dstore.data();
  if (d.mode == entry_store::pages) d.block_tables = dtables.data();
  pack_entries<F, Dim, bf16>({dx.data(), Dim, rows, with_norm ? dnorm.data() : nullptr, 1e-20f, dpos.data(),
                              seq.empty() ? nullptr : dseq.data(), dfreqs.data(), rope_pairs, d, dstaged.data()});
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  const auto got = dstore.download();
  const auto staged = dstaged.download();

  std::vector<std::uint8_t> expected(storage.size(), poison_byte);
  std::size_t differ = 0, far = 0;
  for (long long i = 0; i < rows; ++i) {
    const std::vector<bf16> xi(x.begin() + i * Dim, x.begin() + (i + 1) * Dim);
    const auto want = host_staged(xi, Dim, with_norm ? &norm : nullptr, positions[std::size_t(i)], freqs);
    const auto si = std::span<const bf16>(staged).subspan(std::size_t(i) * Dim, Dim);
    for (int c = 0; c < Dim; c += 2) {
      // RoPE: sincosf against the host's cos/sin, one bf16 ulp at the pair's norm (test_rope_cuda).
      const float nrm = std::hypot(want[std::size_t(c)].to_float(), want[std::size_t(c) + 1].to_float());
      for (int cc : {c, c + 1}) {
        if (si[std::size_t(cc)].bits == want[std::size_t(cc)].bits) continue;
        ++differ;
        const bool roped = cc >= Dim - 2 * rope_pairs;
        const float tol = roped ? nrm / 128 : std::fabs(want[std::size_t(cc)].to_float()) / 128;
        if (!(std::fabs(si[std::size_t(cc)].to_float() - want[std::size_t(cc)].to_float()) <= tol)) ++far;
      }
    }
    const auto entry = host_entry<F, Dim>(si);
    // Where the entry belongs, written out here rather than through entry_destination::address
    // (the code under test); pages through cache::paged_view, the cache's own addressing.
    const int sq = seq.empty() ? 0 : seq[std::size_t(i)];
    const long long pos = positions[std::size_t(i)];
    std::uint8_t* at = nullptr;
    if (host_dst.mode == entry_store::rows) {
      at = expected.data() + i * host_dst.entry_stride;
    } else if (host_dst.mode == entry_store::ring) {
      at = expected.data() + sq * host_dst.seq_stride + (pos % host_dst.ring_rows) * host_dst.entry_stride;
    } else {
      const cache::paged_view view{expected.data(), host_block_tables.data() + std::size_t(sq) * host_dst.max_pages,
                                   host_dst.page_bytes, host_dst.region_offset, int(host_dst.entry_stride),
                                   host_dst.entries_per_page};
      at = const_cast<std::uint8_t*>(view.entry(pos / host_dst.ratio));
    }
    std::memcpy(at, entry.data(), entry.size());
  }
  std::size_t wrong = 0;
  for (std::size_t b = 0; b < got.size(); ++b) wrong += got[b] != expected[b];
  BOOST_TEST_MESSAGE("pack_entries<" << numerics::detail::format_name<F>() << ", " << Dim << "> mode " << int(dst.mode)
                                     << ": " << rows << " entries, " << differ << " staged values differ by an ulp, "
                                     << wrong << " stored bytes wrong");
  BOOST_TEST(far == 0u);
  BOOST_TEST(differ * 500 <= std::size_t(rows) * Dim);
  BOOST_TEST(wrong == 0u);
}

}  // namespace

BOOST_AUTO_TEST_SUITE(compressor_cuda)

BOOST_AUTO_TEST_CASE(pool_matches_host_over_prefill_decode_and_appended_chunks,
                     *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  auto rng = test::make_rng(61);
  pool_schedule<512>(2, 4, rng);  // V4.1 encoder layers
  pool_schedule<512>(4, 3, rng);
  pool_schedule<128>(2, 5, rng);  // tiny
  pool_schedule<64>(3, 2, rng);
}

BOOST_AUTO_TEST_CASE(pool_of_extreme_gates_has_no_nan, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  // Gates of +-1e30 and equal gates: the softmax stays finite (max subtracted first).
  constexpr int Dim = 128;
  const int ratio = 2;
  std::vector<float> k(2 * Dim), z(2 * Dim);
  for (int c = 0; c < Dim; ++c) {
    k[std::size_t(c)] = float(c), k[std::size_t(Dim + c)] = -float(c);
    z[std::size_t(c)] = c % 3 == 0 ? 1e30f : c % 3 == 1 ? -1e30f : 5.0f;
    z[std::size_t(Dim + c)] = c % 3 == 0 ? -1e30f : c % 3 == 1 ? 1e30f : 5.0f;
  }
  std::vector<bf16> norm(Dim, bf16::from_float(1.0f));
  const pool_sequence sq{0, 2, 0, 0, 0};
  device_buffer<float> dk{std::span<const float>(k)}, dz{std::span<const float>(z)}, sk(2 * Dim), sz(2 * Dim);
  device_buffer<pool_sequence> dseq{std::span<const pool_sequence>(&sq, 1)};
  device_buffer<bf16> dnorm{std::span<const bf16>(norm)}, dlat(Dim);
  compress_pool<Dim, bf16>({dk.data(), dz.data(), dseq.data(), 1, 1, sk.data(), sz.data(), dnorm.data(), 1e-20f,
                            dlat.data(), nullptr, ratio, Dim});
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  compressor_weights w;
  w.head_dim = Dim, w.ratio = ratio, w.norm.assign(Dim, 1.0f);
  const auto want = kernels::compressor::detail::pool(w, k, z);
  const auto got = dlat.download();
  for (int c = 0; c < Dim; ++c) {
    BOOST_TEST(!std::isnan(got[std::size_t(c)].to_float()));
    BOOST_TEST(test::bf16_ulp_distance(got[std::size_t(c)], want[std::size_t(c)]) <= 1);
  }
}

BOOST_AUTO_TEST_CASE(pack_main_entries_into_pages, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  auto rng = test::make_rng(62);
  using F = numerics::main_kv_format;
  for (int ratio : {1, 2}) {
    // Two sequences in a pool of 9 pages of 16 tokens; the owner's region sits after another one.
    constexpr int Dim = 512;
    const int page_tokens = 16, epp = page_tokens / ratio;
    const long long region = 4 * 68, page_bytes = region + epp * 288 + 96;
    cache::page_allocator alloc(9, page_tokens, page_bytes);
    const int a = alloc.add_sequence(), b = alloc.add_sequence();
    alloc.append(a, 20), alloc.append(b, 50), alloc.append(a, 40);  // interleaved pages
    const int max_pages = 5;
    std::vector<std::int32_t> tables(2 * max_pages, -1);
    for (int s : {a, b})
      for (std::size_t p = 0; p < alloc.block_table(s).size(); ++p) tables[std::size_t(s) * max_pages + p] = alloc.block_table(s)[p];
    std::vector<std::int64_t> pos;
    std::vector<std::int32_t> seq;
    for (long long t = 0; t + ratio <= 60; t += ratio) pos.push_back(t), seq.push_back(a);
    for (long long t = 0; t + ratio <= 50; t += ratio) pos.push_back(t), seq.push_back(b);
    std::vector<std::uint8_t> storage(std::size_t(9 * page_bytes));
    entry_destination d;
    d.mode = entry_store::pages, d.entry_stride = 288, d.max_pages = max_pages, d.page_bytes = page_bytes;
    d.region_offset = region, d.entries_per_page = epp, d.ratio = ratio;
    check_pack<F, Dim>(d, storage, pos, seq, false, 32, rng, tables);
  }
  // tiny widths, plain rows
  std::vector<std::int64_t> pos(37);
  for (auto& p : pos) p = std::int64_t(rng() % (1u << 20));
  std::vector<std::uint8_t> storage(37 * 80);
  entry_destination d;
  d.mode = entry_store::rows, d.entry_stride = 80;
  check_pack<F, 128>(d, storage, pos, {}, false, 16, rng);
}

BOOST_AUTO_TEST_CASE(pack_index_keys_with_norm, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  auto rng = test::make_rng(63);
  using F = numerics::index_key_format;
  const int ratio = 2, page_tokens = 8, epp = page_tokens / ratio;
  const long long page_bytes = epp * 68 + 12;
  cache::page_allocator alloc(6, page_tokens, page_bytes);
  const int s0 = alloc.add_sequence();
  alloc.append(s0, 44);
  std::vector<std::int32_t> tables = alloc.block_table(s0);
  std::vector<std::int64_t> pos;
  for (long long t = 0; t + ratio <= 44; t += ratio) pos.push_back(t);
  std::vector<std::uint8_t> storage(std::size_t(6 * page_bytes));
  entry_destination d;
  d.mode = entry_store::pages, d.entry_stride = 68, d.max_pages = int(tables.size()), d.page_bytes = page_bytes;
  d.region_offset = 0, d.entries_per_page = epp, d.ratio = ratio;
  check_pack<F, 128>(d, storage, pos, {}, true, 32, rng, tables);
  // tiny index keys (64 channels: two per lane, a block over 16 lanes), rows
  std::vector<std::int64_t> p2(50);
  for (auto& p : p2) p = std::int64_t(rng() % 100000);
  std::vector<std::uint8_t> st2(50 * 36);
  entry_destination d2;
  d2.mode = entry_store::rows, d2.entry_stride = 36;
  check_pack<F, 64>(d2, st2, p2, {}, true, 16, rng);
}

BOOST_AUTO_TEST_CASE(pack_window_entries_into_rings, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  auto rng = test::make_rng(64);
  using F = numerics::fp8_act_format;
  // Batched decode: one token per sequence, each at its own position, into its ring of 128.
  const int batch = 11, window = 128;
  std::vector<std::int64_t> pos(batch);
  std::vector<std::int32_t> seq(batch);
  for (int b = 0; b < batch; ++b) pos[std::size_t(b)] = std::int64_t(rng() % 300000), seq[std::size_t(b)] = (b * 7) % batch;
  std::vector<std::uint8_t> storage(std::size_t(batch) * window * 528 + 64);
  entry_destination d;
  d.mode = entry_store::ring, d.entry_stride = 528, d.seq_stride = 528LL * window, d.ring_rows = window;
  check_pack<F, 512>(d, storage, pos, seq, true, 32, rng);
  // A prefill's last 128 tokens of one sequence fill its whole ring (tiny widths).
  std::vector<std::int64_t> p2;
  for (int t = 300 - window; t < 300; ++t) p2.push_back(t);
  std::vector<std::uint8_t> st2(std::size_t(window) * 132);
  entry_destination d2;
  d2.mode = entry_store::ring, d2.entry_stride = 132, d2.seq_stride = 0, d2.ring_rows = window;
  check_pack<F, 128>(d2, st2, p2, {}, true, 16, rng);
}

BOOST_AUTO_TEST_CASE(bad_arguments_are_errors) {
  pack_args<bf16> p;
  p.rows = 1;
  BOOST_CHECK_THROW((pack_entries<numerics::main_kv_format, 512>(p)), dsv4::error);  // null pointers
  p.rows = -1;
  BOOST_CHECK_THROW((pack_entries<numerics::main_kv_format, 512>(p)), dsv4::error);
  p.rows = 0, p.rope_pairs = 300;
  BOOST_CHECK_THROW((pack_entries<numerics::main_kv_format, 512>(p)), dsv4::error);  // rope wider than the vector
  pool_args<bf16> q;
  q.batch = 1, q.ratio = 2, q.head_dim = 512;
  BOOST_CHECK_THROW((compress_pool<512, bf16>(q)), dsv4::error);  // null pointers
  q.ratio = 1;
  BOOST_CHECK_THROW((compress_pool<512, bf16>(q)), dsv4::error);  // ratio 1 has no pooling
  q.ratio = 2, q.head_dim = 128;
  BOOST_CHECK_THROW((compress_pool<512, bf16>(q)), dsv4::error);  // width mismatch
}

BOOST_AUTO_TEST_SUITE_END()
