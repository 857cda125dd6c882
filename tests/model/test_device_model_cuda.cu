// The whole tiny model on CUDA (model/device_model.cuh) against the host model
// (model_reference.hpp) on one random checkpoint: two sequences (prompts shorter and longer than
// the window, the top-k and the candidate pool), each prefilled, then 32 decode steps taken as one
// batch, teacher-forced with the same token ids on both sides. Logits must agree within bf16
// tolerance and pick the same argmax nearly always.

#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <map>
#include <sstream>
#include <string>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "dsv4/io/checkpoint.hpp"
#include "dsv4/io/json.hpp"
#include "dsv4/io/npy.hpp"
#include "dsv4/io/random_checkpoint.hpp"
#include "dsv4/kernels/gemm/wgmma_gemm.cuh"
#include "dsv4/model/device_model.cuh"
#include "dsv4/models/checkpoint_schema.hpp"
#include "dsv4/models/tiny.hpp"
#include "support/checkpoints.hpp"
#include "support/data.hpp"
#include "support/errors.hpp"
#include "support/gpu.hpp"
#include "support/wgmma.cuh"
#include "support/logit_stats.hpp"
#include "support/parity.hpp"
#include "support/random.hpp"

namespace utf = boost::unit_test;
using namespace dsv4;
using tiny = models::tiny;
using numerics::bf16;

namespace {


// The tiny host model from a random checkpoint (written to a temporary folder, then removed).
model::host_model<tiny> load_tiny(const std::string& name, std::uint64_t seed) {
  const test::temp_checkpoint tmp(name, models::checkpoint_schema<tiny>(), seed);
  io::checkpoint ck(tmp.dir);
  std::vector<std::int64_t> token_map(std::size_t(tiny::dims.vocab_size));
  std::iota(token_map.begin(), token_map.end(), 0);
  return model::host_model<tiny>::load(ck, token_map);
}

//! `n` token ids of tiny's vocabulary from `rng`.
template <class Rng>
std::vector<std::int32_t> tiny_ids(Rng& rng, int n) {
  std::vector<std::int32_t> v(static_cast<std::size_t>(n));
  for (auto& id : v) id = std::int32_t(rng() % std::uint64_t(tiny::dims.vocab_size));
  return v;
}

model::device_model<tiny>::limits tiny_limits(int seqs, int rows, long long tokens) {
  model::device_model<tiny>::limits lim;
  lim.max_seqs = seqs, lim.max_rows = rows, lim.max_tokens = tokens, lim.page_tokens = 16;
  return lim;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(device_model_cuda)

BOOST_AUTO_TEST_CASE(tiny_logits_match_host, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  const auto hm = load_tiny("device_model", 43);
  model::device_model<tiny> dm(hm, tiny_limits(3, 64, 128));

  auto rng = test::make_rng(96);
  const std::vector<int> prompt = {45, 10};  // pool 8 x 4 = 32 positions, top-k 16, window 16
  const int steps = 32, V = tiny::dims.vocab_size;
  std::vector<std::vector<std::int32_t>> ids(prompt.size());
  for (std::size_t s = 0; s < prompt.size(); ++s) {
    ids[s].resize(std::size_t(prompt[s] + steps));
    for (auto& id : ids[s]) id = std::int32_t(rng() % std::uint64_t(V));
  }
  std::vector<model::host_sequence> host(prompt.size());
  std::vector<int> slots;
  test::logit_stats prefill_stats, decode_stats;
  for (std::size_t s = 0; s < prompt.size(); ++s) {
    const auto p = std::span<const std::int32_t>(ids[s]).first(std::size_t(prompt[s]));
    slots.push_back(dm.add_sequence());
    const auto got = dm.prefill(slots.back(), p);
    const auto want = model::forward(hm, host[s], p);
    prefill_stats.add(got, want);
  }
  for (int step = 0; step < steps; ++step) {
    std::vector<std::int32_t> tok;
    for (std::size_t s = 0; s < prompt.size(); ++s) tok.push_back(ids[s][std::size_t(prompt[s] + step)]);
    const auto got = dm.decode(slots, tok);
    for (std::size_t s = 0; s < prompt.size(); ++s) {
      const auto want = model::forward(hm, host[s], std::span<const std::int32_t>(&tok[s], 1));
      decode_stats.add(std::span<const float>(got).subspan(s * std::size_t(V), std::size_t(V)), want);
    }
  }
  for (std::size_t s = 0; s < prompt.size(); ++s) BOOST_TEST(dm.length(slots[s]) == prompt[s] + steps);
  // An appended chunk (exact mode) on the shorter sequence.
  std::vector<std::int32_t> chunk(20);
  for (auto& id : chunk) id = std::int32_t(rng() % std::uint64_t(V));
  test::logit_stats append_stats;
  append_stats.add(dm.append(slots[1], chunk), model::forward(hm, host[1], chunk));
  BOOST_TEST(dm.length(slots[1]) == prompt[1] + steps + 20);
  BOOST_TEST_MESSAGE("appended chunk: worst " << append_stats.worst << ", cosine " << append_stats.min_cosine);
  BOOST_TEST(append_stats.worst < 0.3);
  BOOST_TEST(append_stats.min_cosine > 0.95);
  BOOST_TEST_MESSAGE("tiny model, device vs host logits: prefill worst " << prefill_stats.worst << ", cosine >= "
                                                                          << prefill_stats.min_cosine << ", argmax "
                                                                          << prefill_stats.argmax_same << "/" << prefill_stats.rows
                                                                          << "; decode worst " << decode_stats.worst << ", cosine >= "
                                                                          << decode_stats.min_cosine << ", argmax "
                                                                          << decode_stats.argmax_same << "/" << decode_stats.rows);
  // Not a bf16-level agreement, and it cannot be on random weights: the components agree bit for
  // bit or nearly (their own tests), but a value that lands on the other side of an FP4 / FP8
  // rounding boundary, a near-tie in the indexer's top-k or in MoE routing, changes a discrete
  // choice, and 40 random layers carry that on (layer_by_layer_prefill shows the growth). First
  // H200 runs: worst 6-10% of the logit range at prefill, 17% over 64 decode rows, argmax 53/64.
  // The bounds catch a wrong composition (which is uncorrelated), not rounding.
  BOOST_TEST(prefill_stats.worst < 0.3);
  BOOST_TEST(decode_stats.worst < 0.3);
  BOOST_TEST(prefill_stats.min_cosine > 0.95);
  BOOST_TEST(decode_stats.min_cosine > 0.95);
  BOOST_TEST(decode_stats.argmax_same * 10 >= decode_stats.rows * 6);

  // Misuse: bad ids, a wrong count, a slot without a prefill.
  const std::int32_t bad[1] = {V};
  BOOST_TEST(test::throws_with([&] { dm.decode({slots[0]}, bad); }, "outside the vocabulary"));
  const std::int32_t two[2] = {1, 2};
  BOOST_TEST(test::throws_with([&] { dm.decode({slots[0]}, two); }, "one token id per sequence"));
  const int fresh = dm.add_sequence();
  const std::int32_t one[1] = {5};
  BOOST_TEST(test::throws_with([&] { dm.decode({fresh}, one); }, "no prefill"));
}

// The tiny model with its few-token GEMMs on wgmma (gemm::set_decode_gemm): the FP8 linears below
// the dequantize + cuBLAS path and the MoE's grouped expert GEMMs. A prefill of 45 tokens (under
// dequant_min_tokens, so the linears take the few-token kernel too) and 8 decode steps of two
// sequences, against the host model within the bounds above.
BOOST_AUTO_TEST_CASE(tiny_logits_match_host_with_wgmma_gemms, *utf::label("gpu") * utf::precondition(test::has_wgmma_device{})) {
  struct use_wgmma {
    use_wgmma() { kernels::gemm::set_decode_gemm(kernels::gemm::decode_gemm::wgmma); }
    ~use_wgmma() { kernels::gemm::set_decode_gemm(kernels::gemm::decode_gemm::mma_sync); }
  } scope;
  const unsigned long long before = kernels::gemm::wgmma_gemm_calls();
  const auto hm = load_tiny("device_model_wgmma", 44);
  model::device_model<tiny> dm(hm, tiny_limits(2, 64, 96));
  auto rng = test::make_rng(97);
  const std::vector<int> prompt = {45, 10};
  const int steps = 8, V = tiny::dims.vocab_size;
  std::vector<model::host_sequence> host(prompt.size());
  std::vector<std::vector<std::int32_t>> ids(prompt.size());
  std::vector<int> slots;
  test::logit_stats prefill_stats, decode_stats;
  for (std::size_t s = 0; s < prompt.size(); ++s) {
    ids[s].resize(std::size_t(prompt[s] + steps));
    for (auto& id : ids[s]) id = std::int32_t(rng() % std::uint64_t(V));
    const auto p = std::span<const std::int32_t>(ids[s]).first(std::size_t(prompt[s]));
    slots.push_back(dm.add_sequence());
    prefill_stats.add(dm.prefill(slots.back(), p), model::forward(hm, host[s], p));
  }
  for (int step = 0; step < steps; ++step) {
    std::vector<std::int32_t> tok;
    for (std::size_t s = 0; s < prompt.size(); ++s) tok.push_back(ids[s][std::size_t(prompt[s] + step)]);
    const auto got = dm.decode(slots, tok);
    for (std::size_t s = 0; s < prompt.size(); ++s)
      decode_stats.add(std::span<const float>(got).subspan(s * std::size_t(V), std::size_t(V)),
                       model::forward(hm, host[s], std::span<const std::int32_t>(&tok[s], 1)));
  }
  BOOST_TEST_MESSAGE("tiny model on wgmma GEMMs, device vs host logits: prefill worst " << prefill_stats.worst
                     << ", cosine >= " << prefill_stats.min_cosine << "; decode worst " << decode_stats.worst
                     << ", cosine >= " << decode_stats.min_cosine << ", argmax " << decode_stats.argmax_same << "/"
                     << decode_stats.rows << "; " << kernels::gemm::wgmma_gemm_calls() - before << " wgmma launches");
  BOOST_TEST(kernels::gemm::wgmma_gemm_calls() > before);  // the path was taken
  BOOST_TEST(prefill_stats.worst < 0.3);
  BOOST_TEST(decode_stats.worst < 0.3);
  BOOST_TEST(prefill_stats.min_cosine > 0.95);
  BOOST_TEST(decode_stats.min_cosine > 0.95);
}

// The CUDA model against the official reference (issue 6's parity, docs/parity.md): the golden
// logits of tests/data/parity (the reference's fp32 logits on the scaled random tiny checkpoint of
// seed 7, prefill then teacher-forced decode steps) against the device model on the same
// checkpoint and ids, with the cases' tolerances (about 1.2x the reference's own CUDA-vs-CPU
// spread). The goldens come from the reference's stale index keys (cases.json "index_keys":
// upstream, spec 7's quirk), which change tiny's selection at even decode positions above 32;
// the device model follows the schedule's ownership. From the first such row on, the layers after
// the changed selection see other inputs and write other caches, so the rows from there are
// reported, not bounded (the short case has none; the long case's first decode row is one, so
// only its prefill is bounded). Every row must be finite.
BOOST_AUTO_TEST_CASE(cuda_model_matches_the_reference_logits, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  const auto cases = io::parse_json_file(test::data_path("parity/cases.json"));
  const auto& top = cases.object();
  BOOST_TEST_REQUIRE(top.at("config").string() == std::string(tiny::name));
  const bool upstream_goldens = top.at("index_keys").string() == "upstream";
  io::checkpoint ck = io::random_checkpoint_in_memory(models::checkpoint_schema<tiny>(),
                                                      std::uint64_t(top.at("checkpoint_seed").integer),
                                                      io::parse_random_init(top.at("checkpoint_init").string()));
  std::vector<std::int64_t> token_map(std::size_t(tiny::dims.vocab_size));
  std::iota(token_map.begin(), token_map.end(), 0);
  const auto hm = model::host_model<tiny>::load(ck, token_map);
  model::device_model<tiny> dm(hm, tiny_limits(1, 128, 160));
  for (const auto& c : top.at("cases").array()) {
    const auto& o = c.object();
    const std::string name = o.at("name").string();
    const auto& tol = o.at("tolerance").object();
    const double tol_max = tol.at("max_rel").number(), tol_rms = tol.at("rms_rel").number();
    const double tol_mean_rms = tol.at("mean_rms_rel").number();
    const auto prompt = test::ids_of(o.at("prompt").string()), decode = test::ids_of(o.at("decode").string());
    const auto golden = io::read_npy_f32(test::data_path("parity/" + name + ".npy"));
    BOOST_TEST_REQUIRE(golden.rows == 1 + decode.size());
    BOOST_TEST_REQUIRE(golden.cols == std::size_t(tiny::dims.vocab_size));
    const int slot = dm.add_sequence();
    double worst_max = 0, worst_rms = 0, sum_rms = 0, after_rms = 0;
    int bounded = 0;
    bool diverged = false;  // past the first row where the reference's stale index keys matter
    for (std::size_t r = 0; r < golden.rows; ++r) {
      const auto logits = r == 0 ? dm.prefill(slot, prompt) : dm.decode({slot}, std::span<const std::int32_t>(&decode[r - 1], 1));
      const long long pos = (long long)prompt.size() + (long long)r - 1;
      const std::string where = name + " row " + std::to_string(r) + " (position " + std::to_string(pos) + ")";
      BOOST_TEST(std::all_of(logits.begin(), logits.end(), [](float v) { return std::isfinite(v); }), where << ": non-finite logits");
      diverged = diverged || (upstream_goldens && r > 0 && pos % 2 == 0 && pos > 2 * tiny::dims.indexer.index_topk);
      const auto e = test::compare_row(golden.row(r), logits, tol_max);
      if (diverged) {
        after_rms = std::max(after_rms, e.rms_rel);
        continue;
      }
      ++bounded;
      worst_max = std::max(worst_max, e.max_rel), worst_rms = std::max(worst_rms, e.rms_rel), sum_rms += e.rms_rel;
      BOOST_TEST(e.max_rel <= tol_max, where << ": max relative error " << e.max_rel << " > " << tol_max);
      BOOST_TEST(e.rms_rel <= tol_rms, where << ": rms relative error " << e.rms_rel << " > " << tol_rms);
      BOOST_TEST((e.argmax_same || !e.decisive), where << ": argmax differs where the reference's top two are apart");
    }
    dm.release_sequence(slot);
    BOOST_TEST(bounded > 0);
    BOOST_TEST(sum_rms / std::max(bounded, 1) <= tol_mean_rms, name << ": mean rms relative error over the bounded rows");
    BOOST_TEST_MESSAGE("CUDA model vs reference, " << name << ": " << bounded << " rows bounded, worst max relative error "
                                                   << worst_max << " (tolerance " << tol_max << "), worst rms relative "
                                                   << worst_rms << " (" << tol_rms << "); after the reference's stale index "
                                                   << "keys changed a selection: worst rms relative " << after_rms);
  }
}

// The CED prefill on the device: up to the window it is the device's exact prefill bit for bit
// (the same kernels on the same rows); beyond it, against the host's forward_ced.
// A speculative round rolled back (save_sequence, append_all, restore_sequence) leaves no trace:
// after it, appending the accepted tokens and decoding gives the same bits as a sequence that never
// saw the round. The prompt is longer than the window (the round overwrites ring slots the later
// steps read) and odd, the round even: the round completes the prompt's open ratio-2 group from
// the compressor state and leaves its own last position there, so the append after the rollback
// reads a state that only the restore puts back; with Engram histories; the pages the round took
// go back to the pool. The verification's rows are the logits of the positions (its last row
// against a plain append of the same chunk).
BOOST_AUTO_TEST_CASE(rolled_back_rounds_leave_no_trace, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  const auto hm = load_tiny("device_model_rollback", 47);
  auto lim = tiny_limits(3, 64, 128);
  lim.logit_rows = 8;
  model::device_model<tiny> dm(hm, lim);
  auto rng = test::make_rng(77);
  const int V = tiny::dims.vocab_size;
  auto random_ids = [&](int n) { return tiny_ids(rng, n); };
  const auto prompt = random_ids(31), round = random_ids(8), accepted = random_ids(3);
  const int a = dm.add_sequence(), b = dm.add_sequence(), plain = dm.add_sequence();
  for (int s : {a, b, plain}) dm.prefill(s, prompt);
  const long long pages_before = dm.attention().usage().pages_used;
  model::device_model<tiny>::sequence_snapshot snap;
  dm.save_sequence(a, snap);
  const auto verify = dm.append_all(a, round);
  BOOST_REQUIRE_EQUAL(verify.size(), round.size() * std::size_t(V));
  BOOST_TEST(dm.length(a) == 39);
  BOOST_TEST(dm.attention().usage().pages_used > pages_before);  // (16-token pages: the round takes one)
  dm.restore_sequence(a, snap);
  BOOST_TEST(dm.length(a) == 31);
  BOOST_TEST(dm.attention().usage().pages_used == pages_before);  // the round's page is back in the pool
  test::logit_stats last;
  last.add(std::span<const float>(verify).last(std::size_t(V)), dm.append(plain, round));
  BOOST_TEST_MESSAGE("append_all's last row vs a plain append: worst " << last.worst);
  BOOST_TEST(last.worst < 1e-4);  // the same rows; only the head GEMM's row count differs
  auto same_bits = [](const std::vector<float>& x, const std::vector<float>& y) {
    return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
  };
  BOOST_TEST(same_bits(dm.append(a, accepted), dm.append(b, accepted)), "the append after the rollback differs");
  for (int step = 0; step < 4; ++step) {
    const auto tok = random_ids(1);
    BOOST_TEST(same_bits(dm.decode({a}, tok), dm.decode({b}, tok)), "decode step " << step << " after the rollback differs");
  }
  // Misuse: a snapshot from a longer state, too many rows for append_all.
  model::device_model<tiny>::sequence_snapshot later;
  dm.save_sequence(b, later);
  dm.restore_sequence(a, snap);  // back to 31 tokens
  BOOST_TEST(test::throws_with([&] { dm.restore_sequence(a, later); }, "is not from sequence slot"));
  BOOST_TEST(test::throws_with([&] { dm.append_all(a, random_ids(9)); }, "limits::logit_rows"));
}

// copy_sequence: a copy continues exactly as its original would (the same kernels on the same
// state: bit for bit), and the two are independent: after the copy the original and the copy take
// different chunks and tokens, and each matches a twin prefilled with the same prompt and fed the
// same input (a copy that shared pages, rings or states with its original would differ). In exact
// mode and with CED appends (the tail rows copied too); the copy's pages come from the pool and go
// back on release; misuse refused.
BOOST_AUTO_TEST_CASE(copied_sequences_continue_as_their_original, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  const auto hm = load_tiny("device_model_copy", 53);
  auto rng = test::make_rng(79);
  auto random_ids = [&](int n) { return tiny_ids(rng, n); };
  auto same_bits = [](const std::vector<float>& x, const std::vector<float>& y) {
    return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
  };
  for (const bool ced : {false, true}) {
    BOOST_TEST_CONTEXT((ced ? "CED appends" : "exact mode")) {
      auto lim = tiny_limits(4, 96, 192);
      lim.ced_appends = ced;
      model::device_model<tiny> dm(hm, lim);
      // Past the window (16) and the pool; 83: a ratio-2 group left half full.
      const auto prompt = random_ids(83), chunk_a = random_ids(21), chunk_b = random_ids(13);
      const auto x = random_ids(1), y = random_ids(1);
      const int a = dm.add_sequence(), twin_a = dm.add_sequence(), twin_b = dm.add_sequence();
      for (int s : {a, twin_a, twin_b}) (void)(ced ? dm.prefill_ced(s, prompt) : dm.prefill(s, prompt));
      auto pages_of = [&](int s) { return (dm.length(s) + lim.page_tokens - 1) / lim.page_tokens; };
      const long long pages = dm.attention().usage().pages_used;
      const int b = dm.copy_sequence(a);
      BOOST_TEST(dm.length(b) == dm.length(a));
      BOOST_TEST(dm.attention().usage().pages_used == pages + pages_of(a));  // a's pages, once more
      BOOST_TEST(test::throws_with([&] { dm.copy_sequence(a); }, "slots are in use"));
      auto append = [&](int s, const std::vector<std::int32_t>& ids) { return ced ? dm.append_ced(s, ids) : dm.append(s, ids); };
      // The copy first, then the original, each with its own input; then the twins.
      const auto b1 = append(b, chunk_b), b2 = dm.decode({b}, y);
      const auto a1 = append(a, chunk_a), a2 = dm.decode({a}, x);
      const auto ta1 = append(twin_a, chunk_a), ta2 = dm.decode({twin_a}, x);
      const auto tb1 = append(twin_b, chunk_b), tb2 = dm.decode({twin_b}, y);
      BOOST_TEST(same_bits(b1, tb1), "the copy's chunk differs from its twin's");
      BOOST_TEST(same_bits(b2, tb2), "the copy's decode step differs from its twin's");
      BOOST_TEST(same_bits(a1, ta1), "the original's chunk after the copy differs from its twin's");
      BOOST_TEST(same_bits(a2, ta2), "the original's decode step after the copy differs from its twin's");
      const long long used = dm.attention().usage().pages_used, b_pages = pages_of(b);
      dm.release_sequence(b);
      BOOST_TEST(dm.attention().usage().pages_used == used - b_pages);
      BOOST_TEST(test::throws_with([&] { dm.copy_sequence(b); }, "no live sequence"));
    }
  }
}

// Chunks appended to several sequences in one call (append_all over slots: a batch of
// speculative rounds' verifications) give each sequence what its own append_all gives: three
// prompts (longer than the window and the pool, odd and even, one shorter than the window) and
// chunks of 5, 1 and 8 tokens in a call whose order is not the slot order, against twin
// sequences appended one by one; then one decode step of all six, which reads the caches, rings
// and compressor states the appends left. Not bit for bit by construction: the GEMMs may split
// and tile by the call's row count (docs/decisions.md, not batch-invariant), and 40 random layers
// amplify a rounding step (the host-vs-device bound of tiny_logits_match_host applies). Measured on
// the H200: 17 of 17 rows bit-equal (tiny's GEMMs keep their split between these row counts).
BOOST_AUTO_TEST_CASE(appends_to_several_sequences_in_one_call, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  const auto hm = load_tiny("device_model_appends", 49);
  auto lim = tiny_limits(6, 64, 128);
  lim.logit_rows = 24;
  model::device_model<tiny> dm(hm, lim);
  auto rng = test::make_rng(78);
  const int V = tiny::dims.vocab_size;
  auto random_ids = [&](int n) { return tiny_ids(rng, n); };
  const std::vector<int> prompt_len = {37, 10, 50}, chunk_len = {5, 1, 8};
  const std::vector<std::size_t> order = {2, 0, 1};
  std::vector<int> batched, alone;
  std::vector<std::vector<std::int32_t>> chunks;
  for (std::size_t s = 0; s < prompt_len.size(); ++s) {
    const auto prompt = random_ids(prompt_len[s]);
    batched.push_back(dm.add_sequence()), alone.push_back(dm.add_sequence());
    dm.prefill(batched.back(), prompt), dm.prefill(alone.back(), prompt);
    chunks.push_back(random_ids(chunk_len[s]));
  }
  std::vector<int> call_slots;
  std::vector<std::vector<std::int32_t>> call_chunks;
  for (std::size_t s : order) call_slots.push_back(batched[s]), call_chunks.push_back(chunks[s]);
  const auto together = dm.append_all(call_slots, call_chunks);
  BOOST_REQUIRE_EQUAL(together.size(), std::size_t(5 + 1 + 8) * std::size_t(V));
  test::logit_stats rows;
  std::size_t row = 0;
  for (std::size_t s : order) {
    const auto one = dm.append_all(alone[s], chunks[s]);
    for (int r = 0; r < chunk_len[s]; ++r, ++row)
      rows.add(std::span<const float>(together).subspan(row * std::size_t(V), std::size_t(V)),
               std::span<const float>(one).subspan(std::size_t(r) * std::size_t(V), std::size_t(V)));
  }
  for (std::size_t s = 0; s < prompt_len.size(); ++s) {
    BOOST_TEST(dm.length(batched[s]) == prompt_len[s] + chunk_len[s]);
    BOOST_TEST(dm.length(alone[s]) == prompt_len[s] + chunk_len[s]);
  }
  const auto tok = random_ids(3);
  const auto step_batched = dm.decode(batched, tok), step_alone = dm.decode(alone, tok);
  for (std::size_t s = 0; s < prompt_len.size(); ++s)
    rows.add(std::span<const float>(step_batched).subspan(s * std::size_t(V), std::size_t(V)),
             std::span<const float>(step_alone).subspan(s * std::size_t(V), std::size_t(V)));
  BOOST_TEST_MESSAGE("appends to several sequences in one call vs one by one (" << rows.rows << " rows with the decode step "
                     "after): worst " << rows.worst << ", min cosine " << rows.min_cosine << ", argmax equal "
                     << rows.argmax_same << "; " << rows.worst_rows(3, 0.05));
  BOOST_TEST(rows.min_cosine > 0.98);
  BOOST_TEST(rows.argmax_same * 10 >= rows.rows * 9);
  // Refused before anything changes: a slot twice, a chunk past the window among several
  // sequences, more rows than limits::logit_rows, a chunk count that does not match.
  BOOST_TEST(test::throws_with([&] { dm.append_all({batched[0], batched[0]}, {random_ids(1), random_ids(1)}); }, "appears twice"));
  BOOST_TEST(test::throws_with([&] { dm.append_all({batched[0], batched[1]}, {random_ids(17), random_ids(1)}); }, "at most the window"));
  BOOST_TEST(test::throws_with([&] { dm.append_all({batched[0], batched[1]}, {random_ids(12), random_ids(13)}); }, "limits::logit_rows"));
  BOOST_TEST(test::throws_with([&] { dm.append_all({batched[0], batched[1]}, {random_ids(1)}); }, "2 sequences and 1 chunks"));
  for (std::size_t s = 0; s < prompt_len.size(); ++s) BOOST_TEST(dm.length(batched[s]) == prompt_len[s] + chunk_len[s] + 1);
}

// Draws on the device (decode_on_device + sample) are the host sampler's draws from the same
// logits: two sequences decoded together with different parameters, and a prefill's last row.
BOOST_AUTO_TEST_CASE(device_draws_follow_the_host_sampler, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  const auto hm = load_tiny("device_model_sampling", 48);
  model::device_model<tiny> dm(hm, tiny_limits(2, 64, 96));
  const int a = dm.add_sequence(), b = dm.add_sequence();
  const std::vector<std::int32_t> prompt = {5, 17, 3, 99, 42, 7};
  const auto first = dm.prefill(a, prompt);
  dm.prefill(b, prompt);
  using kernels::sampling::row_request;
  const row_request warm{{0.9f, 0, 0.8f, 21}, 1, 6};
  BOOST_TEST(dm.sample(std::span(&warm, 1))[0] == kernels::sampling::sample_reference(first, warm.params, 1, 6));
  std::vector<std::int32_t> tok = {dm.sample(std::span(&warm, 1))[0], 11};
  for (int step = 0; step < 6; ++step) {
    const std::vector<row_request> req = {{{0.7f, 20, 1.0f, 5}, 0, std::uint64_t(7 + step)},
                                          {{1.0f, 0, 0.9f, 6}, 1, std::uint64_t(7 + step)}};
    const auto logits = dm.decode({a, b}, tok);  // the host's copy of the step's logits
    const auto got = dm.sample(req);
    const std::size_t V = std::size_t(tiny::dims.vocab_size);
    for (std::size_t r = 0; r < 2; ++r)
      BOOST_TEST(got[r] == kernels::sampling::sample_reference(std::span<const float>(logits).subspan(r * V, V), req[r].params,
                                                               req[r].sequence, req[r].step),
                 "step " << step << " row " << r);
    tok = got;
  }
  dm.decode_on_device({a, b}, tok);  // nothing comes back; the draws read the device's logits
  BOOST_TEST(dm.sample(std::vector<row_request>(2)).size() == 2u);
  BOOST_TEST(test::throws_with([&] { dm.sample(std::vector<row_request>(1)); }, "1 requests for 2 rows of logits"));
  BOOST_TEST_MESSAGE("rows drawn on the host: " << dm.sampler_fallback_rows());
}

BOOST_AUTO_TEST_CASE(ced_prefill, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  const auto hm = load_tiny("device_model_ced", 45);
  model::device_model<tiny> dm(hm, tiny_limits(4, 64, 64));
  auto rng = test::make_rng(99);
  const int V = tiny::dims.vocab_size, W = tiny::dims.attn.window_size;
  std::vector<std::int32_t> ids(47);
  for (auto& id : ids) id = std::int32_t(rng() % std::uint64_t(V));
  const auto short_prompt = std::span<const std::int32_t>(ids).first(std::size_t(W - 2));
  const int a = dm.add_sequence(), b = dm.add_sequence();
  const auto exact = dm.prefill(a, short_prompt);
  const auto ced = dm.prefill_ced(b, short_prompt);
  BOOST_TEST(std::memcmp(exact.data(), ced.data(), exact.size() * sizeof(float)) == 0);
  const auto next = dm.decode({a, b}, std::vector<std::int32_t>{ids[20], ids[20]});
  BOOST_TEST(std::memcmp(next.data(), next.data() + V, std::size_t(V) * sizeof(float)) == 0);
  // Beyond the window: the decoder layers see `window` rows only (the article's layer-token work),
  // the result differs from the device's exact prefill, and stays close to the host's CED.
  const auto prompt = std::span<const std::int32_t>(ids).first(45);
  using sched = models::model_traits<tiny>::schedule;
  std::map<int, long long> rows_seen;
  dm.set_observer([&](int l, std::string_view stage, std::span<const bf16> v) {
    if (stage == "attn_in") rows_seen[l] += (long long)(v.size() / std::size_t(tiny::dims.dim));
  });
  const int c = dm.add_sequence();
  model::host_sequence hs;
  test::logit_stats st;
  const auto device_ced = dm.prefill_ced(c, prompt);
  dm.set_observer({});
  for (int l = 0; l < sched::num_layers; ++l)
    BOOST_TEST(rows_seen[l] == (l < sched::encoder_layers ? 45 : W), "layer " << l << " saw " << rows_seen[l] << " rows");
  const int d = dm.add_sequence();
  const auto device_exact = dm.prefill(d, prompt);
  BOOST_TEST(std::memcmp(device_exact.data(), device_ced.data(), device_ced.size() * sizeof(float)) != 0);
  st.add(device_ced, model::forward_ced(hm, hs, prompt));
  st.add(dm.decode({c}, std::vector<std::int32_t>{ids[45]}), model::forward(hm, hs, std::span<const std::int32_t>(ids).subspan(45, 1)));
  BOOST_TEST_MESSAGE("CED prefill of 45 tokens and one decode step, device vs host: worst " << st.worst << ", cosine >= " << st.min_cosine);
  BOOST_TEST(st.worst < 0.3);
  BOOST_TEST(st.min_cosine > 0.95);
  BOOST_TEST(dm.length(c) == 46);
  // A model built without limits::ced_appends keeps no tail: a CED append is refused before any
  // work, and the sequence stays as it was.
  BOOST_TEST(test::throws_with([&] { dm.append_ced(c, std::span<const std::int32_t>(ids).first(3)); }, "limits::ced_appends"));
  BOOST_TEST(dm.length(c) == 46);
  BOOST_TEST(dm.decode({c}, std::vector<std::int32_t>{ids[46]}).size() == std::size_t(V));
}

// CED appends on the device (issue 6): the encoder over the chunk, the owner's cache grown by it,
// the decoder replaying the sequence's last `window` positions from the tail that every call keeps
// (prefill, exact or CED; batched decode; appends). Against the host's forward_ced / forward on
// the same calls: chunks shorter than the window (the replay starts before the chunk) and longer,
// on a sequence past the window and on one inside it, decode steps batched across both between.
BOOST_AUTO_TEST_CASE(ced_appends_follow_the_host, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  const auto hm = load_tiny("device_model_ced_append", 47);
  auto lim = tiny_limits(3, 64, 160);
  lim.ced_appends = true;
  model::device_model<tiny> dm(hm, lim);
  auto rng = test::make_rng(103);
  const int V = tiny::dims.vocab_size, W = tiny::dims.attn.window_size, D = tiny::dims.dim;
  using sched = models::model_traits<tiny>::schedule;
  constexpr int E = sched::encoder_layers;
  auto draw = [&](std::size_t n) {
    std::vector<std::int32_t> v(n);
    for (auto& id : v) id = std::int32_t(rng() % std::uint64_t(V));
    return v;
  };
  // The ring's exact check: the first decoder layer's attention input of every (sequence,
  // position) the first time the device computes it; a replay must read those rows back bit for
  // bit from the tail. `rows_of_call` names the rows of the next call's layer-E input.
  std::map<std::pair<int, long long>, std::vector<bf16>> first_seen;
  std::vector<std::pair<int, long long>> rows_of_call;
  std::map<int, long long> rows_seen;
  std::size_t replayed = 0, replayed_differ = 0;
  dm.set_observer([&](int l, std::string_view stage, std::span<const bf16> v) {
    if (stage != "attn_in") return;
    rows_seen[l] += (long long)(v.size() / std::size_t(D));
    if (l != E) return;
    BOOST_TEST_REQUIRE(v.size() == rows_of_call.size() * std::size_t(D));
    for (std::size_t i = 0; i < rows_of_call.size(); ++i) {
      const auto row = v.subspan(i * std::size_t(D), std::size_t(D));
      const auto [it, fresh] = first_seen.try_emplace(rows_of_call[i], row.begin(), row.end());
      if (fresh) continue;
      ++replayed;
      replayed_differ += !std::equal(row.begin(), row.end(), it->second.begin(), [](bf16 x, bf16 y) { return x.bits == y.bits; });
    }
  });
  auto positions = [&](int slot, long long from, long long to) {
    rows_of_call.clear();
    for (long long p = from; p < to; ++p) rows_of_call.emplace_back(slot, p);
  };
  const int a = dm.add_sequence(), b = dm.add_sequence();
  model::host_sequence ha, hb;
  test::logit_stats st;
  auto row = [&](const std::vector<float>& v, int r) { return std::vector<float>(v.begin() + std::ptrdiff_t(r) * V, v.begin() + std::ptrdiff_t(r + 1) * V); };
  auto decode_both = [&] {
    const auto ids = draw(2);
    rows_of_call = {{a, dm.length(a)}, {b, dm.length(b)}};
    const auto got = dm.decode({a, b}, ids);
    st.add(row(got, 0), model::forward(hm, ha, std::span<const std::int32_t>(ids).first(1)));
    st.add(row(got, 1), model::forward(hm, hb, std::span<const std::int32_t>(ids).subspan(1, 1)));
  };
  auto ced_append = [&](int slot, model::host_sequence& hs, std::size_t n) {
    const auto chunk = draw(n);
    const long long len = dm.length(slot) + (long long)n;
    positions(slot, len - std::min<long long>(len, W), len);  // the replay's rows
    rows_seen.clear();
    st.add(dm.append_ced(slot, chunk), model::forward_ced(hm, hs, chunk));
    for (int l = 0; l < sched::num_layers; ++l)
      BOOST_TEST(rows_seen[l] == (l < E ? (long long)n : std::min<long long>(len, W)), "layer " << l << " saw " << rows_seen[l] << " rows");
  };
  const auto pa = draw(std::size_t(W + 4)), pb = draw(9);
  positions(a, 4, W + 4);  // a CED prefill: the decoder sees the last W rows only
  st.add(dm.prefill_ced(a, pa), model::forward_ced(hm, ha, pa));  // past the window
  positions(b, 0, 9);
  st.add(dm.prefill(b, pb), model::forward(hm, hb, pb));  // inside it (exact prefill)
  decode_both();
  decode_both();
  ced_append(a, ha, 5);  // shorter than the window on a sequence past it: most replayed rows come from before the chunk
  ced_append(b, hb, 3);  // inside the window (9 + 2 + 3 = 14 positions): the replay covers the whole sequence
  decode_both();
  const auto exact_chunk = draw(std::size_t(W + 2));  // an exact append longer than the window (its last W rows go to the tail)
  positions(b, dm.length(b), dm.length(b) + W + 2);
  st.add(dm.append(b, exact_chunk), model::forward(hm, hb, exact_chunk));
  ced_append(a, ha, std::size_t(W + 3));  // longer than the window: the replay is the chunk's last W rows
  ced_append(b, hb, 4);                   // b's replay: rows of the exact append, a decode step and the chunk
  decode_both();
  ced_append(a, ha, 2);  // a's replay reads the rows the previous CED append and a decode step left
  dm.set_observer({});
  BOOST_TEST(dm.length(a) == ha.length);
  BOOST_TEST(dm.length(b) == hb.length);
  // Rows a replay reads back, call by call: a's first CED append W - 5 (its window starts 5 rows
  // past the prefill's), b's 11 (the whole sequence so far), b's second W - 4, a's last W - 2 (a's
  // long append replays none: its window lies inside the chunk). The device run of cdcb5f5
  // counted 48 = 3 * W, which a first '> 3 * W' wrongly refused.
  static_assert(W >= 14, "b's first CED append must stay inside the window");
  BOOST_TEST(replayed == std::size_t((W - 5) + 11 + (W - 4) + (W - 2)), replayed << " replayed rows compared");
  BOOST_TEST(replayed_differ == 0u, replayed_differ << " of " << replayed << " replayed rows differ from their first computation");
  BOOST_TEST_MESSAGE("CED appends, device vs host over " << st.rows << " logit rows: worst " << st.worst << ", cosine >= "
                                                        << st.min_cosine << ", argmax " << st.argmax_same << "/" << st.rows);
  // The bounds of the other model tests: random weights carry a rounding difference on (see
  // tiny_logits_match_host); a wrong replay (rows, positions, mixes) is uncorrelated.
  BOOST_TEST(st.worst < 0.3);
  BOOST_TEST(st.min_cosine > 0.95);
  // Refused before any work when the replay cannot fit one call (max_rows below the window).
  auto small = tiny_limits(1, 8, 64);
  small.ced_appends = true;
  model::device_model<tiny> narrow(hm, small);
  const int n = narrow.add_sequence();
  const auto p = draw(8);
  narrow.prefill(n, p);
  BOOST_TEST(test::throws_with([&] { narrow.append_ced(n, std::span<const std::int32_t>(p).first(4)); }, "beyond limits::max_rows"));
  BOOST_TEST(narrow.length(n) == 8);
}

// Engram tables in host memory (issue 5, item 5): the rows gathered on the host and shipped ahead
// of the Engram layers give the same logits, bit for bit, as tables in device memory (the same
// kernels read the same bytes), over a batched prefill + decode, a CED prefill and an append.
BOOST_AUTO_TEST_CASE(engram_host_tables_equal_device_tables, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  const auto hm = load_tiny("device_model_engram_host", 46);
  auto lim = tiny_limits(3, 64, 128);
  model::device_model<tiny> dev(hm, lim);
  lim.engram_host_tables = true;
  model::device_model<tiny> host(hm, lim);
  auto rng = test::make_rng(101);
  const int V = tiny::dims.vocab_size;
  std::vector<std::int32_t> ids(60);
  for (auto& id : ids) id = std::int32_t(rng() % std::uint64_t(V));
  auto same = [](const std::vector<float>& a, const std::vector<float>& b, const char* what) {
    BOOST_TEST_REQUIRE(a.size() == b.size());
    BOOST_TEST(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0, what);
  };
  const auto p1 = std::span<const std::int32_t>(ids).first(37), p2 = std::span<const std::int32_t>(ids).subspan(37, 9);
  std::vector<int> sd, sh;
  for (int i = 0; i < 2; ++i) sd.push_back(dev.add_sequence()), sh.push_back(host.add_sequence());
  same(dev.prefill(sd[0], p1), host.prefill(sh[0], p1), "prefill");
  same(dev.prefill_ced(sd[1], p2), host.prefill_ced(sh[1], p2), "CED prefill");
  for (int step = 0; step < 4; ++step) {
    const std::vector<std::int32_t> next{ids[std::size_t(46 + 2 * step)], ids[std::size_t(47 + 2 * step)]};
    same(dev.decode(sd, next), host.decode(sh, next), "batched decode");
  }
  const auto chunk = std::span<const std::int32_t>(ids).subspan(54, 6);
  same(dev.append(sd[0], chunk), host.append(sh[0], chunk), "appended chunk");
  const auto stats = host.engram_fetch_stats();
  BOOST_TEST(stats.size() == std::size_t(models::model_traits<tiny>::schedule::engram::values.size()));
  BOOST_TEST(dev.engram_fetch_stats().empty());
  for (const auto& st : stats) {
    BOOST_TEST(st.calls == 7);  // two prefills, four decode steps, one append
    BOOST_TEST(st.rows == (37 + 9 + 4 * 2 + 6) * (hm.engrams.at(0).columns));
    BOOST_TEST_MESSAGE("Engram host fetch: " << st.bytes / double(st.rows) * hm.engrams.at(0).columns << " bytes per token, gather "
                                             << st.gather_s * 1e3 << " ms, launch thread waited " << st.waited_s * 1e3 << " ms");
  }
}

// Where device and host part ways: every block's intermediates on a prefill, each stage compared
// with the host's (free running: the error a stage shows includes what earlier layers passed on).
BOOST_AUTO_TEST_CASE(layer_by_layer_prefill, *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  const auto hm = load_tiny("device_model_layers", 44);
  model::device_model<tiny> dm(hm, tiny_limits(1, 64, 64));
  auto rng = test::make_rng(97);
  std::vector<std::int32_t> ids(45);
  for (auto& id : ids) id = std::int32_t(rng() % std::uint64_t(tiny::dims.vocab_size));
  std::map<std::pair<int, std::string>, std::vector<bf16>> host_stages, device_stages;
  const model::layer_observer on_host = [&](int l, std::string_view st, std::span<const bf16> v) {
    host_stages[{l, std::string(st)}].assign(v.begin(), v.end());
  };
  dm.set_observer([&](int l, std::string_view st, std::span<const bf16> v) { device_stages[{l, std::string(st)}].assign(v.begin(), v.end()); });
  model::host_sequence hs;
  const auto want = model::forward(hm, hs, ids, &on_host);
  const auto got = dm.prefill(dm.add_sequence(), ids);
  BOOST_REQUIRE_EQUAL(host_stages.size(), device_stages.size());
  std::ostringstream table;
  double first_bad = -1;
  for (int l = 0; l < 40; ++l) {
    table << "layer " << l << ":";
    for (const char* st : {"attn_in", "attn_out", "ffn_in", "ffn_out"}) {
      const auto& h = host_stages[{l, st}];
      const auto& d = device_stages[{l, st}];
      BOOST_REQUIRE_EQUAL(h.size(), d.size());
      double diff = 0, peak = 0;
      std::size_t same = 0;
      for (std::size_t i = 0; i < h.size(); ++i) {
        diff = std::max(diff, double(std::fabs(h[i].to_float() - d[i].to_float())));
        peak = std::max(peak, double(std::fabs(h[i].to_float())));
        same += h[i].bits == d[i].bits;
      }
      table << " " << st << " " << diff / peak << " (" << same * 100 / h.size() << "% equal)";
      // The first block, before anything is carried on. Its input is bit-equal; the attention sums
      // in another order than the host (tensor cores), so some values round the other way and the
      // FFN (routing included) carries that on. Seen on an H200 (2026-11-30): attn_out 84-93%
      // equal, ffn_out 70-81%, at most 2.2% of the stage's peak apart (seeds 6311496072820088410,
      // 3218828488569035150); the closeness bound is the real check, the shares catch wholesale
      // disagreement.
      if (l == 0) {
        const int min_share = std::string_view(st) == "attn_in" ? 99 : std::string_view(st) == "attn_out" ? 75 : 50;
        BOOST_TEST(same * 100 >= h.size() * min_share, "layer 0 " << st << ": " << same << " of " << h.size() << " equal");
        BOOST_TEST(diff / peak < 0.05, "layer 0 " << st << ": " << diff / peak);
      }
      if (first_bad < 0 && diff / peak > 0.01) first_bad = l;
    }
    table << "\n";
  }
  BOOST_TEST_MESSAGE(table.str());
  BOOST_TEST_MESSAGE("first layer with a stage beyond 1% of its peak: " << first_bad);
  test::logit_stats ls;
  ls.add(got, want);
  BOOST_TEST_MESSAGE("logits: worst " << ls.worst << ", cosine " << ls.min_cosine);
}

// Decode steps through captured graphs (set_decode_graphs, runtime/segment_graph.cuh) give the
// plain steps' logits bit for bit: a model with graphs beside one without, on the same checkpoint,
// prompts and teacher-forced tokens. Three sequences (past the window and the pool with a
// ratio-2 group left half full, inside the pool, shorter than the window), decode batches of 3
// and 1 interleaved (two keys), every step's widths changing (the attention cores stay plain);
// halfway the fused act_quant is switched off (a process switch: the launches the graphs hold
// are no longer the host's, so each segment diverges once, is issued from its records and
// captured again). With Engram tables in device and in host memory (the host fetch's wait
// splits the segments).
BOOST_AUTO_TEST_CASE(decode_graphs_replay_plain_steps_bit_for_bit,
                     *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  const auto hm = load_tiny("device_model_graphs", 61);
  struct restore_switch {  // the process-wide switches back as found, whatever a check does
    bool norms = numerics::fused_act_quant(numerics::act_quant_site::norms),
         boundaries = numerics::fused_act_quant(numerics::act_quant_site::boundaries);
    ~restore_switch() {
      numerics::set_fused_act_quant(numerics::act_quant_site::norms, norms);
      numerics::set_fused_act_quant(numerics::act_quant_site::boundaries, boundaries);
    }
  } fused;
  const bool fused0 = fused.boundaries;
  for (const bool host_tables : {false, true}) {
    BOOST_TEST_CONTEXT((host_tables ? "Engram tables in host memory" : "Engram tables in device memory")) {
      auto lim = tiny_limits(3, 96, 192);
      lim.engram_host_tables = host_tables;
      model::device_model<tiny> plain(hm, lim), graphed(hm, lim);
      graphed.set_decode_graphs(true);
      BOOST_TEST(graphed.decode_graphs());
      auto rng = test::make_rng(113);
      std::vector<int> ps, gs;
      for (const int n : {83, 40, 5}) {
        const auto prompt = tiny_ids(rng, n);
        ps.push_back(plain.add_sequence()), gs.push_back(graphed.add_sequence());
        (void)plain.prefill(ps.back(), prompt), (void)graphed.prefill(gs.back(), prompt);
      }
      int differing = 0;
      for (int step = 0; step < 24; ++step) {
        if (step == 12) numerics::set_fused_act_quant(!fused0);
        const bool one = step % 4 == 3;  // every fourth step: the first sequence alone
        const std::vector<int> p_slots = one ? std::vector<int>{ps[0]} : ps,
                               g_slots = one ? std::vector<int>{gs[0]} : gs;
        const auto ids = tiny_ids(rng, int(p_slots.size()));
        const auto a = plain.decode(p_slots, ids), b = graphed.decode(g_slots, ids);
        BOOST_TEST_REQUIRE(a.size() == b.size());
        differing += std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) != 0;
      }
      numerics::set_fused_act_quant(fused0);
      BOOST_TEST(differing == 0, differing << " of 24 steps' logits differ from the plain model's");
      const auto n = graphed.decode_graph_counts();
      BOOST_TEST_MESSAGE("decode graphs: " << n.replayed << " segments replayed, " << n.captured
                                           << " captured, " << n.diverged << " diverged, " << n.eager
                                           << " plain");
      BOOST_TEST(n.captured > 0);
      BOOST_TEST(n.replayed > 2 * n.captured,
                 "too few replays: the segments' launches change from step to step");
      BOOST_TEST(n.diverged > 0, "the switched act_quant left every graph valid");
      BOOST_TEST(plain.decode_graph_counts().replayed == 0);
    }
  }
}

BOOST_AUTO_TEST_SUITE_END()
