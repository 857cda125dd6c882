// The CUDA attention sublayer (kernels/attention/layer.cuh) against the host reference
// (layer_reference.hpp) on the five-layer stack with every role: three sequences of different
// lengths, each prefilled alone, then decoded together as one batch (prefill lengths below and
// above the window, the top-k and the candidate pool), then chunks appended in exact mode, one
// sequence per call and then several sequences in one call.

#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "dsv4/kernels/attention/layer.cuh"
#include "dsv4/runtime/device_buffer.cuh"
#include "support/attention_stack.hpp"
#include "support/gpu.hpp"
#include "support/random.hpp"

namespace utf = boost::unit_test;
using namespace dsv4;
using kernels::attention::attention_stack;
using numerics::bf16;
using runtime::device_buffer;

namespace {

constexpr auto shape = test::attention_stack_shape;

// Attention input of (sequence, layer, position): fixed random rows.
struct inputs {
  std::vector<std::vector<std::vector<bf16>>> x;  // [seq][layer] -> [positions, dim]
  inputs(int seqs, int layers, int positions, std::mt19937_64& rng) {
    std::normal_distribution<float> n(0.0f, 1.0f);
    x.resize(std::size_t(seqs));
    for (auto& s : x) {
      s.resize(std::size_t(layers));
      for (auto& l : s) {
        l.resize(std::size_t(positions) * shape.dim);
        for (auto& v : l) v = bf16::from_float(n(rng));
      }
    }
  }
  std::span<const bf16> rows(int seq, int layer, long long first, int n) const {
    return std::span<const bf16>(x[std::size_t(seq)][std::size_t(layer)]).subspan(std::size_t(first) * shape.dim, std::size_t(n) * shape.dim);
  }
};

// Error of one output row against the host: the largest difference relative to the row's peak.
struct row_stats {
  std::size_t rows = 0, exact_rows = 0, loose_rows = 0;
  double worst = 0;
  void add(std::span<const bf16> got, std::span<const bf16> want) {
    double d = 0, peak = 0;
    bool exact = true;
    for (std::size_t i = 0; i < got.size(); ++i) {
      BOOST_REQUIRE_MESSAGE(std::isfinite(got[i].to_float()), "non-finite device output");
      d = std::max(d, double(std::fabs(got[i].to_float() - want[i].to_float())));
      peak = std::max(peak, double(std::fabs(want[i].to_float())));
      exact &= got[i].bits == want[i].bits;
    }
    const double rel = peak > 0 ? d / peak : d;
    ++rows, exact_rows += exact, worst = std::max(worst, rel);
    loose_rows += rel > 0x1p-5;
  }
};

}  // namespace

BOOST_AUTO_TEST_SUITE(attention_stack_cuda)

BOOST_AUTO_TEST_CASE(prefill_and_batched_decode_match_host, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  auto rng = test::make_rng(80);
  const auto st = test::make_attention_stack(rng);
  const int layers = int(st.wiring.size());
  const std::vector<int> prefill = {21, 6, 37};  // around the window (16), top-k (8 entries) and pool (12 positions)
  const int decode_steps = 14, seqs = int(prefill.size());
  const int max_len = *std::max_element(prefill.begin(), prefill.end()) + decode_steps + 30;  // + appended chunks
  const inputs in(seqs, layers, max_len, rng);

  attention_stack<128, 64>::limits lim;
  lim.max_seqs = 4, lim.max_rows = 64, lim.max_tokens = max_len, lim.page_tokens = 8;
  attention_stack<128, 64> dev(shape, st.wiring, st.weights, st.freqs_local, st.freqs_compressed, lim);
  std::vector<kernels::attention::sequence_state> host(static_cast<std::size_t>(seqs));
  std::vector<int> slot(static_cast<std::size_t>(seqs));
  device_buffer<bf16> dx(std::size_t(lim.max_rows) * shape.dim), dout(std::size_t(lim.max_rows) * shape.dim);
  row_stats prefill_stats, decode_stats;

  auto host_layer = [&](int s, int l, long long first, int n) {
    const auto& f = st.wiring[std::size_t(l)].ratio > 0 ? st.freqs_compressed : st.freqs_local;
    return kernels::attention::attention_layer_reference(l, st.wiring[std::size_t(l)], st.weights[std::size_t(l)], shape, f,
                                                         in.rows(s, l, first, n), first, host[std::size_t(s)]);
  };

  for (int s = 0; s < seqs; ++s) {
    slot[std::size_t(s)] = dev.add_sequence();
    const int n = prefill[std::size_t(s)];
    dev.begin_prefill(slot[std::size_t(s)], n);
    for (int l = 0; l < layers; ++l) {
      const auto x = in.rows(s, l, 0, n);
      DSV4_CUDA_CHECK(cudaMemcpy(dx.data(), x.data(), x.size_bytes(), cudaMemcpyHostToDevice));
      dev.forward(l, dx.data(), dout.data());
      std::vector<bf16> got(x.size());
      DSV4_CUDA_CHECK(cudaMemcpy(got.data(), dout.data(), x.size_bytes(), cudaMemcpyDeviceToHost));
      const auto want = host_layer(s, l, 0, n);
      for (int r = 0; r < n; ++r)
        prefill_stats.add(std::span<const bf16>(got).subspan(std::size_t(r) * shape.dim, shape.dim),
                          std::span<const bf16>(want).subspan(std::size_t(r) * shape.dim, shape.dim));
    }
    dev.end_call();
  }
  // Decode: all sequences together, in a batch order that is not the slot order.
  const std::vector<int> order = {2, 0, 1};
  std::vector<int> batch_slots;
  for (int s : order) batch_slots.push_back(slot[std::size_t(s)]);
  for (int step = 0; step < decode_steps; ++step) {
    dev.begin_decode(batch_slots);
    for (int l = 0; l < layers; ++l) {
      std::vector<bf16> x;
      for (int s : order) {
        const auto r = in.rows(s, l, prefill[std::size_t(s)] + step, 1);
        x.insert(x.end(), r.begin(), r.end());
      }
      DSV4_CUDA_CHECK(cudaMemcpy(dx.data(), x.data(), x.size() * sizeof(bf16), cudaMemcpyHostToDevice));
      dev.forward(l, dx.data(), dout.data());
      std::vector<bf16> got(x.size());
      DSV4_CUDA_CHECK(cudaMemcpy(got.data(), dout.data(), x.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
      for (std::size_t b = 0; b < order.size(); ++b) {
        const int s = order[b];
        const auto want = host_layer(s, l, prefill[std::size_t(s)] + step, 1);
        decode_stats.add(std::span<const bf16>(got).subspan(b * shape.dim, shape.dim), want);
      }
    }
    dev.end_call();
  }
  // Appended chunks (exact mode), shorter and longer than the window, one sequence per call, then
  // chunks of three sequences in one call (begin_appends: a batch of speculative rounds'
  // verifications; odd and even lengths, so ratio-2 groups complete inside the chunk and across
  // its start), then one more batched decode step, which reads the rings the chunks left.
  row_stats append_stats;
  std::vector<long long> len(static_cast<std::size_t>(seqs));
  for (int s = 0; s < seqs; ++s) len[std::size_t(s)] = prefill[std::size_t(s)] + decode_steps;
  for (const auto& [s, n] : std::vector<std::pair<int, int>>{{0, 5}, {2, 20}, {1, 1}}) {
    dev.begin_append(slot[std::size_t(s)], n);
    for (int l = 0; l < layers; ++l) {
      const auto x = in.rows(s, l, len[std::size_t(s)], n);
      DSV4_CUDA_CHECK(cudaMemcpy(dx.data(), x.data(), x.size_bytes(), cudaMemcpyHostToDevice));
      dev.forward(l, dx.data(), dout.data());
      std::vector<bf16> got(x.size());
      DSV4_CUDA_CHECK(cudaMemcpy(got.data(), dout.data(), x.size_bytes(), cudaMemcpyDeviceToHost));
      const auto want = host_layer(s, l, len[std::size_t(s)], n);
      for (int r = 0; r < n; ++r)
        append_stats.add(std::span<const bf16>(got).subspan(std::size_t(r) * shape.dim, shape.dim),
                         std::span<const bf16>(want).subspan(std::size_t(r) * shape.dim, shape.dim));
    }
    dev.end_call();
    len[std::size_t(s)] += n;
  }
  {
    const std::vector<std::pair<int, int>> chunks = {{2, 3}, {0, 7}, {1, 1}};  // (sequence, tokens), not slot order
    std::vector<int> call_slots, call_tokens;
    for (const auto& [s, n] : chunks) call_slots.push_back(slot[std::size_t(s)]), call_tokens.push_back(n);
    dev.begin_appends(call_slots, call_tokens);
    for (int l = 0; l < layers; ++l) {
      std::vector<bf16> x;
      for (const auto& [s, n] : chunks) {
        const auto r = in.rows(s, l, len[std::size_t(s)], n);
        x.insert(x.end(), r.begin(), r.end());
      }
      DSV4_CUDA_CHECK(cudaMemcpy(dx.data(), x.data(), x.size() * sizeof(bf16), cudaMemcpyHostToDevice));
      dev.forward(l, dx.data(), dout.data());
      std::vector<bf16> got(x.size());
      DSV4_CUDA_CHECK(cudaMemcpy(got.data(), dout.data(), x.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
      std::size_t row = 0;
      for (const auto& [s, n] : chunks) {
        const auto want = host_layer(s, l, len[std::size_t(s)], n);
        for (int r = 0; r < n; ++r, ++row)
          append_stats.add(std::span<const bf16>(got).subspan(row * shape.dim, shape.dim),
                           std::span<const bf16>(want).subspan(std::size_t(r) * shape.dim, shape.dim));
      }
    }
    dev.end_call();
    for (const auto& [s, n] : chunks) len[std::size_t(s)] += n;
    // Refused before anything changes: a slot twice, a count missing, a chunk beyond the window
    // among several sequences.
    BOOST_CHECK_THROW(dev.begin_appends({slot[0], slot[0]}, {1, 1}), dsv4::error);
    BOOST_CHECK_THROW(dev.begin_appends({slot[0], slot[1]}, {1}), dsv4::error);
    BOOST_CHECK_THROW(dev.begin_appends({slot[0], slot[1]}, {shape.window + 1, 1}), dsv4::error);
  }
  dev.begin_decode(batch_slots);
  for (int l = 0; l < layers; ++l) {
    std::vector<bf16> x;
    for (int s : order) {
      const auto r = in.rows(s, l, len[std::size_t(s)], 1);
      x.insert(x.end(), r.begin(), r.end());
    }
    DSV4_CUDA_CHECK(cudaMemcpy(dx.data(), x.data(), x.size() * sizeof(bf16), cudaMemcpyHostToDevice));
    dev.forward(l, dx.data(), dout.data());
    std::vector<bf16> got(x.size());
    DSV4_CUDA_CHECK(cudaMemcpy(got.data(), dout.data(), x.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
    for (std::size_t b = 0; b < order.size(); ++b)
      append_stats.add(std::span<const bf16>(got).subspan(b * shape.dim, shape.dim), host_layer(order[b], l, len[std::size_t(order[b])], 1));
  }
  dev.end_call();
  for (int s = 0; s < seqs; ++s) len[std::size_t(s)] += 1;
  for (int s = 0; s < seqs; ++s) BOOST_TEST(dev.length(slot[std::size_t(s)]) == len[std::size_t(s)]);
  BOOST_TEST_MESSAGE("attention stack, appended chunks and the decode after them: " << append_stats.rows << " rows, "
                                                                                    << append_stats.exact_rows << " bit-equal, "
                                                                                    << append_stats.loose_rows << " beyond 2^-5, worst "
                                                                                    << append_stats.worst);
  // The appended rows write cache entries that every later row of the sequence reads, so one
  // rounding-boundary crossing or top-k near-tie in a chunk reaches many rows: measured on the
  // H200 over seeds, 127 to 145 of the 145 rows bit-equal (127: DSV4_TEST_SEED=1465402800403392140,
  // the same with programmatic launch off). A systematic error leaves few rows bit-equal.
  // Rows beyond 2^-5: up to 3 of 145 (DSV4_TEST_SEED=7699141831781524810: 128 bit-equal, 3 beyond,
  // worst 0.041; the same at ef37c97, before the session that met it), so at most 1 in 25.
  BOOST_TEST(append_stats.exact_rows * 4 >= append_stats.rows * 3);
  BOOST_TEST(append_stats.loose_rows * 25 <= append_stats.rows);
  BOOST_TEST_MESSAGE("attention stack, prefill: " << prefill_stats.rows << " rows, " << prefill_stats.exact_rows
                                                  << " bit-equal, " << prefill_stats.loose_rows
                                                  << " beyond 2^-5 of the row peak, worst " << prefill_stats.worst);
  BOOST_TEST_MESSAGE("attention stack, decode: " << decode_stats.rows << " rows, " << decode_stats.exact_rows
                                                 << " bit-equal, " << decode_stats.loose_rows
                                                 << " beyond 2^-5 of the row peak, worst " << decode_stats.worst);
  // Different summation orders (cuBLAS vs the host) move a value across an FP4 / FP8 rounding
  // boundary now and then, and a near-tie in the indexer can select another entry; both stay rare.
  // (First run on the H200: 319 of 320 prefill rows and 208 of 210 decode rows bit-equal, worst
  // 9.5e-7 of the row peak.)
  // A cache entry that crosses a rounding boundary is read by every later row of its sequence,
  // so loose rows come in clusters: DSV4_TEST_SEED=6059448828980009469 gives 8 of 320 prefill
  // and 5 of 210 decode rows beyond 2^-5 (worst 0.056 of the row peak; 305 and 193 bit-equal),
  // the same bits before and after the single-launch attention (H200, 2026-12-01). Hence 1 in 25.
  BOOST_TEST(prefill_stats.exact_rows * 10 >= prefill_stats.rows * 9);
  BOOST_TEST(decode_stats.exact_rows * 10 >= decode_stats.rows * 9);
  BOOST_TEST(prefill_stats.loose_rows * 25 <= prefill_stats.rows);
  BOOST_TEST(decode_stats.loose_rows * 25 <= decode_stats.rows);
  // One near-tie choosing another entry moves its row far: DSV4_TEST_SEED=5921128798381231698
  // gives a decode row 0.42 of its peak apart (203 of 210 rows bit-equal) with the CUDA-core index
  // scan and the tensor-core one alike; the shares above are the check, the worst row only has to
  // stay within its peak (a non-finite output fails in row_stats::add).
  BOOST_TEST(prefill_stats.worst < 1.0);
  BOOST_TEST(decode_stats.worst < 1.0);
}

// CED on the stack: the encoder layers (0-2) over the prompt, the decoder's owner (layer 3) fills
// its cache over every token, then layers 3-4 replay the last `window` positions; against the
// host's owner_cache_only + replay calls, and decode steps after. Four rounds (fresh weights,
// prompts of different lengths) pooled: a near-tie in the indexer's top-k (host and device sum
// in different orders) changes a whole row now and then (one in ~40 rows when measured: 40 seeds
// on the H200, 2026-11-29), so a single round's handful of decode rows cannot carry a ratio; a
// replay or ring mistake shows in most rows of every round.
BOOST_AUTO_TEST_CASE(ced_replay_matches_host, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  auto rng = test::make_rng(82);
  row_stats encoder_stats, replay_stats, decode_stats;
  constexpr int decode_steps = 4;
  for (const int N : {40, 33, 64, 21}) {
    const auto st = test::make_attention_stack(rng);
    const int layers = int(st.wiring.size()), decoder = 3, first = N - shape.window;
    const inputs in(1, layers, N + decode_steps, rng);
    attention_stack<128, 64>::limits lim;
    lim.max_seqs = 1, lim.max_rows = 64, lim.max_tokens = N + decode_steps, lim.page_tokens = 8;
    attention_stack<128, 64> dev(shape, st.wiring, st.weights, st.freqs_local, st.freqs_compressed, lim);
    kernels::attention::sequence_state host;
    device_buffer<bf16> dx(std::size_t(lim.max_rows) * shape.dim), dout(std::size_t(lim.max_rows) * shape.dim);
    auto freqs = [&](int l) { return st.wiring[std::size_t(l)].ratio > 0 ? st.freqs_compressed : st.freqs_local; };
    auto device_layer = [&](int l, std::span<const bf16> x) {
      DSV4_CUDA_CHECK(cudaMemcpy(dx.data(), x.data(), x.size_bytes(), cudaMemcpyHostToDevice));
      dev.forward(l, dx.data(), dout.data());
      std::vector<bf16> got(x.size());
      DSV4_CUDA_CHECK(cudaMemcpy(got.data(), dout.data(), x.size_bytes(), cudaMemcpyDeviceToHost));
      return got;
    };
    auto host_layer = [&](int l, long long pos, int n, kernels::attention::layer_call call) {
      return kernels::attention::attention_layer_reference(l, st.wiring[std::size_t(l)], st.weights[std::size_t(l)], shape, freqs(l),
                                                           in.rows(0, l, pos, n), pos, host, call);
    };
    auto compare = [&](row_stats& stats, const std::vector<bf16>& got, const std::vector<bf16>& want) {
      BOOST_REQUIRE_EQUAL(got.size(), want.size());
      for (std::size_t r = 0; r < got.size() / shape.dim; ++r)
        stats.add(std::span<const bf16>(got).subspan(r * shape.dim, shape.dim), std::span<const bf16>(want).subspan(r * shape.dim, shape.dim));
    };
    using kernels::attention::layer_call;
    const int slot = dev.add_sequence();
    dev.begin_prefill(slot, N);
    for (int l = 0; l < decoder; ++l) compare(encoder_stats, device_layer(l, in.rows(0, l, 0, N)), host_layer(l, 0, N, layer_call::normal));
    {
      const auto x = in.rows(0, decoder, 0, N);
      DSV4_CUDA_CHECK(cudaMemcpy(dx.data(), x.data(), x.size_bytes(), cudaMemcpyHostToDevice));
      dev.fill_owner_cache(decoder, dx.data());
      host_layer(decoder, 0, N, layer_call::owner_cache_only);
    }
    dev.end_call();
    BOOST_TEST(dev.length(slot) == N);
    BOOST_CHECK_THROW(dev.begin_decode({slot}), dsv4::error);  // the replay must come first
    dev.begin_replay(slot, first, shape.window, decoder);
    for (int l = decoder; l < layers; ++l)
      compare(replay_stats, device_layer(l, in.rows(0, l, first, shape.window)), host_layer(l, first, shape.window, layer_call::replay));
    dev.end_call();
    BOOST_TEST(dev.length(slot) == N);  // a replay does not grow the sequence
    for (int step = 0; step < decode_steps; ++step) {
      dev.begin_decode({slot});
      for (int l = 0; l < layers; ++l) compare(decode_stats, device_layer(l, in.rows(0, l, N + step, 1)), host_layer(l, N + step, 1, layer_call::normal));
      dev.end_call();
    }
    BOOST_TEST(dev.length(slot) == N + decode_steps);
    BOOST_CHECK_THROW(dev.begin_replay(slot, 3, 4, decoder), dsv4::error);  // not the sequence's last tokens
  }
  for (const auto& [name, st] : {std::pair{"encoder prefill", &encoder_stats}, {"replay", &replay_stats}, {"decode", &decode_stats}}) {
    BOOST_TEST_MESSAGE("attention stack, CED " << name << ": " << st->rows << " rows, " << st->exact_rows << " bit-equal, "
                                               << st->loose_rows << " beyond 2^-5 of the row peak, worst " << st->worst);
    BOOST_TEST(st->exact_rows * 100 >= st->rows * 85, name);
    BOOST_TEST(st->loose_rows * 20 <= st->rows, name);
  }
  BOOST_TEST(replay_stats.rows == std::size_t(4 * 2 * shape.window));
  BOOST_TEST(decode_stats.rows == std::size_t(4 * decode_steps * 5));
}

BOOST_AUTO_TEST_CASE(misuse_is_an_error, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  auto rng = test::make_rng(81);
  const auto st = test::make_attention_stack(rng);
  attention_stack<128, 64>::limits lim;
  lim.max_seqs = 1, lim.max_rows = 8, lim.max_tokens = 16, lim.page_tokens = 8;
  attention_stack<128, 64> dev(shape, st.wiring, st.weights, st.freqs_local, st.freqs_compressed, lim);
  device_buffer<bf16> dx(8 * shape.dim), dout(8 * shape.dim);
  BOOST_CHECK_THROW(dev.forward(0, dx.data(), dout.data()), dsv4::error);  // no call
  const int s = dev.add_sequence();
  BOOST_CHECK_THROW(dev.add_sequence(), dsv4::error);                      // slots exhausted
  BOOST_CHECK_THROW(dev.begin_decode({s}), dsv4::error);                   // decode before prefill
  BOOST_CHECK_THROW(dev.begin_prefill(s, 9), dsv4::error);                 // more rows than the limit
  dev.begin_prefill(s, 4);
  BOOST_CHECK_THROW(dev.forward(1, dx.data(), dout.data()), dsv4::error);  // layers out of order
  BOOST_CHECK_THROW(dev.begin_prefill(s, 4), dsv4::error);                 // a call in progress
  BOOST_CHECK_THROW(dev.release_sequence(s), dsv4::error);                 // part of the call in progress
  BOOST_CHECK_THROW(dev.end_call(), dsv4::error);                          // no layer ran
}

BOOST_AUTO_TEST_SUITE_END()
