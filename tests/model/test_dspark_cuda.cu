// The DSpark drafter on CUDA (model/device_dspark.cuh) against the host drafter
// (model/dspark_reference.hpp) on tiny's random checkpoint:
// - with the same input (the host backbone's main_hidden uploaded), prefill and decode steps
//   teacher-forced with the host's drafts and the device's rings: the rings equal the host's up to
//   isolated FP8 code flips (the GEMMs' other summation order), and every row's logits and
//   confidence lie within summation-order bounds once the host continues from the device's rings.
//   Why the rings are handed over: on tiny's random weights one FP8 code of one ring value moves the
//   drafts by 5-20% of a row's range until its slot is overwritten (test_dspark's
//   a_ring_slot_reaches_the_drafts_until_it_is_overwritten; docs/decisions.md, "DSpark device
//   test"), which made this test fail on seeds whose 16-row prefill flipped one code;
// - the backbone's capture (device_model::capture_main_hidden) against the host's main_hidden, for
//   a prefill (its last window rows) and a decode batch (one row per sequence in slot order);
// - the whole device pipeline (drafts from the device backbone's own capture) against the host's,
//   within the backbone's bounds;
// - misuse: no prefill, bad ids and counts, too many rows.

#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <numeric>
#include <sstream>
#include <span>
#include <string>
#include <vector>

#include "dsv4/io/checkpoint.hpp"
#include "dsv4/model/device_dspark.cuh"
#include "dsv4/model/device_model.cuh"
#include "dsv4/model/device_speculative.cuh"
#include "dsv4/model/dspark_reference.hpp"
#include "dsv4/models/checkpoint_schema.hpp"
#include "dsv4/models/tiny.hpp"
#include "dsv4/runtime/device_buffer.cuh"
#include "support/checkpoints.hpp"
#include "support/errors.hpp"
#include "support/gpu.hpp"
#include "support/logit_stats.hpp"
#include "support/random.hpp"
#include "support/resume_plans.hpp"

namespace utf = boost::unit_test;
using namespace dsv4;
using tiny = models::tiny;
using numerics::bf16;

namespace {
constexpr models::model_config c = tiny::dims;
constexpr int W = c.attn.window_size, D = c.dim, V = c.vocab_size;
constexpr int T = models::model_traits<tiny>::schedule::drafter::targets::size;

std::vector<std::int64_t> identity_map() {
  std::vector<std::int64_t> m(static_cast<std::size_t>(V));
  std::iota(m.begin(), m.end(), 0);
  return m;
}
std::vector<std::int32_t> random_ids(int n, std::uint64_t seed) {
  auto rng = test::make_rng(seed);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(n));
  for (auto& id : ids) id = std::int32_t(rng() % std::uint64_t(V));
  return ids;
}

struct fixture {
  test::temp_checkpoint tmp{"dspark_cuda", models::checkpoint_schema<tiny>(), 67};
  io::checkpoint ck{tmp.dir};
  model::host_model<tiny> m = model::host_model<tiny>::load(ck, identity_map());
  model::dspark_weights w = model::dspark_weights_of<tiny>(ck);
};

model::device_model<tiny>::limits limits(int seqs) {
  model::device_model<tiny>::limits lim;
  lim.max_seqs = seqs, lim.max_rows = 64, lim.max_tokens = 256, lim.page_tokens = 16;
  return lim;
}

//! Plain decoding on the device (a fresh slot of `dm`, one decode step per token, greedy draws at
//! stream `sequence`) and where its first close call falls: the first token whose top two logits
//! lie within 5% of the row's largest magnitude (n if none). A speculative generation's
//! verification rows come from multi-row appends, not decode steps (docs/decisions.md: not
//! batch-invariant), so its tokens must equal these only before that token.
struct plain_run {
  std::vector<std::int32_t> tokens;
  long long clear = 0;
};
plain_run plain_decoding(model::device_model<tiny>& dm, const std::vector<std::int32_t>& prompt, long long n,
                         std::uint64_t sequence, bool ced = false) {
  const kernels::sampling::sampling_params greedy{0.0f};
  const int p = dm.add_sequence();
  auto logits = ced ? dm.prefill_ced(p, prompt) : dm.prefill(p, prompt);
  plain_run r;
  r.clear = n;
  for (long long i = 0; i < n; ++i) {
    const std::int32_t tok = kernels::sampling::sample_reference(logits, greedy, sequence, std::uint64_t(dm.length(p)));
    r.tokens.push_back(tok);
    std::vector<float> sorted(logits);
    std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
    float peak = 0;
    for (float v : logits) peak = std::max(peak, std::fabs(v));
    if (r.clear == n && sorted[0] - sorted[1] < 0.05f * peak) r.clear = i;
    if (i + 1 < n) logits = dm.decode({p}, std::span<const std::int32_t>(&tok, 1));
  }
  dm.release_sequence(p);
  return r;
}
//! How many leading tokens of `got` equal `want`'s.
long long matching(const std::vector<std::int32_t>& got, const plain_run& want) {
  long long k = 0;
  while (k < (long long)got.size() && k < (long long)want.tokens.size() && got[std::size_t(k)] == want.tokens[std::size_t(k)]) ++k;
  return k;
}

//! The last `rows` rows of a [*, T * D] capture.
std::span<const bf16> last_rows(const std::vector<bf16>& mh, std::size_t rows) {
  const std::size_t width = std::size_t(T) * D;
  return std::span<const bf16>(mh).last(rows * width);
}

//! Largest |got - want| over the largest |want| (bf16 rows).
double worst_relative(std::span<const bf16> got, std::span<const bf16> want) {
  double d = 0, peak = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    BOOST_REQUIRE_MESSAGE(std::isfinite(got[i].to_float()), "non-finite main_hidden value");
    d = std::max(d, double(std::fabs(got[i].to_float() - want[i].to_float())));
    peak = std::max(peak, double(std::fabs(want[i].to_float())));
  }
  return d / peak;
}

//! One draft block's device-vs-host differences: its rows' worst logits and confidence errors.
struct block_record {
  double logits_worst, conf_worst;
};

//! Compares a device draft with the host's: the same ids (teacher forced), logits per row, and
//! confidences relative to the largest |confidence| of the block (plus one: they are raw scalars).
void compare(const model::dspark_draft& got, const model::dspark_draft& want, test::logit_stats& logits,
             double& conf_worst, std::vector<block_record>& blocks) {
  BOOST_REQUIRE(got.ids == want.ids);
  BOOST_REQUIRE_EQUAL(got.logits.size(), want.logits.size());
  test::logit_stats block;
  for (std::size_t i = 0; i < want.confidence.size(); ++i) {
    const auto g = std::span<const float>(got.logits).subspan(i * V, V);
    const auto w = std::span<const float>(want.logits).subspan(i * V, V);
    logits.add(g, w);  // the run's totals
    block.add(g, w);   // this block's record
  }
  double peak = 1, block_conf = 0;
  for (float v : want.confidence) peak = std::max(peak, double(std::fabs(v)));
  for (std::size_t i = 0; i < want.confidence.size(); ++i) {
    BOOST_REQUIRE(std::isfinite(got.confidence[i]));
    block_conf = std::max(block_conf, std::fabs(double(got.confidence[i]) - want.confidence[i]) / peak);
  }
  conf_worst = std::max(conf_worst, block_conf);
  blocks.push_back({block.worst, block_conf});
}

//! The device drafter's rings against the host's (dspark_state::rings) after a call.
struct ring_check {
  long long entries = 0, values = 0, differing = 0;  //!< over every stage and slot checked
  double worst_step = 0;     //!< largest |device - host| over the value's own FP8 code step
  std::ostringstream where;  //!< per call: stage:slot(differing values by code steps) of each differing entry
  int calls = 0;

  long long diverged_calls = 0;   //!< calls whose backbones diverged (backbones_agree)
  double diverged_worst_rel = 0;  //!< over those calls: largest |device - host| / |host| of an entry (L2)

  //! Compares the rings of `slot` with `st`'s, then (teacher forcing of the state) gives the host
  //! the device's rings, so that the next step of both starts from the same state. A call whose
  //! backbones diverged (`backbone_agrees` false) counts only its entries' relative L2 error (check).
  void compare_and_sync(model::device_dspark<tiny>& dd, int slot, model::dspark_state& st,
                        bool backbone_agrees = true) {
    const std::size_t hd = std::size_t(c.attn.head_dim);
    std::ostringstream call;  // this call's differing entries
    double call_worst_rel = 0;
    for (std::size_t s = 0; s < st.rings.size(); ++s) {
      auto got = dd.ring_values(int(s), slot);
      BOOST_REQUIRE_EQUAL(got.size(), st.rings[s].size());
      for (std::size_t r = 0; r < got.size() / hd; ++r) {
        int diff = 0;
        double entry_steps = 0, worst_g = 0, worst_h = 0, worst_peak = 0;  // the entry's worst value
        double diff2 = 0, want2 = 0;                                       // its squared L2 norms
        for (std::size_t b = r * hd; b < (r + 1) * hd; b += 32) {  // E4M3 blocks of 32, UE8M0 scales
          double peak = 0;
          for (std::size_t i = b; i < b + 32; ++i)
            peak = std::max(
                {peak, double(std::fabs(got[i].to_float())), double(std::fabs(st.rings[s][i].to_float()))});
          // What a GEMM ulp upstream can do to an entry: move a value across a rounding boundary of
          // its E4M3 codes (one code step at its binade, 2^-3 of it), or, where it moved a code of
          // main_x's act_quant (read by every stage's wkv), shift the entry's values by up to a few
          // percent of their block's peak, several codes for a small value (H100, seed 11: slot 7
          // of all three stages, 12-14 values each, the worst -0.00171 against -0.00293 in a block
          // of peak 0.0625, 2% of it). Allowance: the larger of one code step and 2^-5 of the peak.
          for (std::size_t i = b; i < b + 32; ++i) {
            const double g = got[i].to_float(), h = st.rings[s][i].to_float();
            BOOST_REQUIRE_MESSAGE(std::isfinite(g), "non-finite ring value, stage " << s << " slot " << r);
            diff2 += (g - h) * (g - h), want2 += h * h;
            if (g == h) continue;
            ++diff;
            const double high = std::max(std::fabs(g), std::fabs(h));
            const double allowed = std::max(std::exp2(std::floor(std::log2(high)) - 3), std::exp2(-5) * peak);
            if (std::fabs(g - h) / allowed > entry_steps)
              entry_steps = std::fabs(g - h) / allowed, worst_g = g, worst_h = h, worst_peak = peak;
          }
        }
        call_worst_rel = std::max(call_worst_rel, std::sqrt(diff2 / std::max(want2, 1e-30)));
        if (!backbone_agrees) continue;
        entries += 1, values += (long long)hd, differing += diff;
        worst_step = std::max(worst_step, entry_steps);
        if (diff)
          call << ' ' << s << ':' << r << '(' << diff << " by " << entry_steps << ": " << worst_g << " vs " << worst_h
               << " in a block of peak " << worst_peak << ')';
      }
      st.rings[s] = std::move(got);
    }
    where << " | call " << calls++ << ':';
    if (!backbone_agrees) {
      ++diverged_calls;
      diverged_worst_rel = std::max(diverged_worst_rel, call_worst_rel);
      where << " backbone diverged, worst entry " << call_worst_rel << " (L2, relative)";
    } else {
      where << (call.str().empty() ? std::string(" =") : call.str());
    }
  }
  //! The state agrees up to isolated FP8 code flips: an ulp of a GEMM sum that moved a value across
  //! a rounding boundary of the ring's E4M3 codes, or a code of main_x that moved a few values of
  //! an entry by a few percent of their block. A wrong slot, position, RoPE or norm moves most
  //! values of an entry, and by far more.
  //! A call whose backbone diverged (a resumed sequence against a fresh start: a row's bits depend
  //! on its call's shape, docs/decisions.md) only bounds each entry's relative error: a wrong slot
  //! or position gives unrelated entries (relative errors near 1 and above).
  void check(const char* what) const {
    BOOST_TEST_MESSAGE(what << " rings vs host: " << differing << " of " << values << " values in " << entries
                            << " entries differ, by at most " << worst_step << " of their allowance; "
                            << diverged_calls << " calls with diverged backbones, worst entry "
                            << diverged_worst_rel << ";" << where.str());
    BOOST_TEST(entries > 0);
    BOOST_TEST(worst_step <= 1.0 + 1e-9);
    BOOST_TEST(differing * 100 <= values);
    BOOST_TEST(diverged_worst_rel < 0.5);
  }
};

//! Whether sequences a and b of `dm` hold the same backbone state, as one decode step shows it:
//! copies of both (device_model::copy_sequence; two free slots needed) decode one token in one
//! call, and their logits must be equal bit for bit. (Rows of one call at the same position with
//! the same caches compute alike; two calls of different shapes need not: docs/decisions.md.)
bool backbones_agree(model::device_model<tiny>& dm, int a, int b, std::ostringstream& report) {
  const int ca = dm.copy_sequence(a), cb = dm.copy_sequence(b);
  const std::vector<std::int32_t> token{7, 7};
  const auto logits = dm.decode({ca, cb}, token);
  dm.release_sequence(ca), dm.release_sequence(cb);
  double worst = 0, peak = 0;
  for (std::size_t i = 0; i < std::size_t(V); ++i) {
    worst = std::max(worst, double(std::fabs(logits[i] - logits[V + i])));
    peak = std::max(peak, double(std::fabs(logits[V + i])));
  }
  if (worst > 0)
    report << " (the backbones differ: a probe step's logits by " << worst / peak << " of their peak)";
  return worst == 0;
}

std::string describe(const std::vector<block_record>& blocks) {
  std::ostringstream os;
  os << "blocks (logits worst / confidence worst):";
  for (const auto& b : blocks) os << " [" << b.logits_worst << " " << b.conf_worst << "]";
  return os.str();
}
}  // namespace

BOOST_AUTO_TEST_SUITE(dspark_cuda)

// The same main_hidden on both sides: the drafter alone. A prompt longer than the window (its
// prefill seeds the rings with the last W rows at positions 30 - W ..), then 6 decode steps of one
// row and an appended chunk of 5 rows, each teacher-forced with the host's drafts; after every
// call the rings are compared and the host takes the device's (ring_check).
BOOST_AUTO_TEST_CASE(drafter_matches_host_on_the_same_input,
                     *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  fixture f;
  model::device_model<tiny> dm(f.m, limits(2));
  model::device_dspark<tiny> dd(dm, f.w, 2);
  const auto prompt = random_ids(30, 5);
  model::host_sequence seq;
  std::vector<bf16> mh;
  auto logits = model::forward(f.m, seq, prompt, nullptr, &mh);
  model::dspark_state st;
  model::dspark_prefill<tiny>(f.w, st, mh);
  const std::size_t rows = std::min<std::size_t>(prompt.size(), W);
  runtime::device_buffer<bf16> dmh(last_rows(mh, rows));
  dd.prefill(0, dmh.data(), (long long)rows, (long long)(prompt.size() - rows));
  BOOST_TEST(dd.length(0) == (long long)prompt.size());
  ring_check rings;
  rings.compare_and_sync(dd, 0, st);

  test::logit_stats stats;
  double conf_worst = 0;
  std::vector<block_record> blocks;
  for (int step = 0; step < 7; ++step) {
    const std::int32_t next = std::int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    // Step 6 appends a chunk of 5 tokens (the next, then 4 random ones) instead of one.
    std::vector<std::int32_t> call = {next};
    if (step == 6) {
      const auto more = random_ids(4, 9);
      call.insert(call.end(), more.begin(), more.end());
    }
    logits = model::forward(f.m, seq, call, nullptr, &mh);
    const std::int32_t input = std::int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    const auto want = model::dspark_decode<tiny>(f.m, f.w, st, input, mh);
    runtime::device_buffer<bf16> step_mh{std::span<const bf16>(mh)};
    const auto got = dd.decode(0, input, step_mh.data(), (long long)call.size(), (long long)call.size(),
                               {0.0f}, 0, want.ids);
    compare(got, want, stats, conf_worst, blocks);
    BOOST_TEST(dd.length(0) == st.length);
    rings.compare_and_sync(dd, 0, st);
  }
  BOOST_TEST_MESSAGE("DSpark on CUDA vs host, same input: "
                     << stats.rows << " draft rows, logits worst " << stats.worst
                     << ", cosine >= " << stats.min_cosine << ", argmax " << stats.argmax_same << "/"
                     << stats.rows << "; confidence worst " << conf_worst << "; " << describe(blocks));
  rings.check("same input:");
  // The drafter's pieces agree with the host's to rounding (the GEMMs' MMA sums, cuBLAS's head
  // and Markov GEMV); through the stages an ulp can move an FP8 code or a MoE routing near-tie,
  // as in the backbone (test_device_model_cuda). Bounds: a wrong composition is uncorrelated.
  BOOST_TEST(stats.worst < 0.1);
  BOOST_TEST(stats.min_cosine > 0.99);
  BOOST_TEST(stats.argmax_same * 10 >= stats.rows * 8);
  // The confidence is one raw dot product of the stages' output: where a near-tie (an FP8 code, a
  // MoE route) moved the stages, it carries that drift undiluted, as the logits' worst shows for
  // the same rows (seed 12579890409632215566 on the H200: logits worst 0.058, confidence 0.204;
  // other seeds 1e-7 .. 2e-4 for both). Bound: 0.05, or four times the logits' worst.
  BOOST_TEST(conf_worst < std::max(0.05, 4.0 * stats.worst),
             "confidence worst " << conf_worst << ", logits worst " << stats.worst);

  // Unforced (greedy, the sampling path): each draft is the argmax of its row's returned logits,
  // the Markov bias of the draft before it included. (Against the host's own unforced drafts only
  // reported: a near-tie may go either way, and the rows after it then differ.)
  {
    const std::int32_t next = std::int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    logits = model::forward(f.m, seq, std::span<const std::int32_t>(&next, 1), nullptr, &mh);
    const std::int32_t input = std::int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    const auto want = model::dspark_decode<tiny>(f.m, f.w, st, input, mh);
    runtime::device_buffer<bf16> step_mh{std::span<const bf16>(mh)};
    const auto got = dd.decode(0, input, step_mh.data(), 1);
    BOOST_REQUIRE_EQUAL(got.ids.size(), want.ids.size());
    BOOST_TEST(got.ids[0] == input);
    std::size_t same = 0;
    for (std::size_t i = 0; i + 1 < got.ids.size(); ++i) {
      const auto row = std::span<const float>(got.logits).subspan(i * V, V);
      BOOST_TEST(got.ids[i + 1] == std::int32_t(std::max_element(row.begin(), row.end()) - row.begin()),
                 "draft " << i);
      same += got.ids[i + 1] == want.ids[i + 1];
    }
    BOOST_TEST_MESSAGE("unforced greedy drafts equal to the host's: " << same << " of "
                                                                      << got.ids.size() - 1);
  }

  // Misuse.
  BOOST_TEST(test::throws_with([&] { dd.decode(1, 1, dmh.data(), 1); }, "no DSpark prefill"));
  BOOST_TEST(test::throws_with([&] { dd.decode(0, V, dmh.data(), 1); }, "outside the vocabulary"));
  BOOST_TEST(test::throws_with([&] { dd.decode(2, 1, dmh.data(), 1); }, "no sequence slot 2"));
  BOOST_TEST(test::throws_with([&] { dd.prefill(0, dmh.data(), W + 1); }, "main_hidden rows"));
  BOOST_TEST(test::throws_with([&] { dd.decode(0, 1, dmh.data(), 2, 1); }, "added 1 positions"));
  BOOST_TEST(test::throws_with([&] { dd.decode(0, 1, dmh.data(), 1, 3); },
                               "expected its last min(positions, window) = 3"));
  const std::int32_t short_forced[2] = {1, 2};
  BOOST_TEST(
      test::throws_with([&] { dd.decode(0, 1, dmh.data(), 1, 1, {0.0f}, 0, short_forced); }, "forced ids"));
  BOOST_TEST(test::throws_with([&] { dd.prefill(0, nullptr, 1); }, "null main_hidden"));
}

// The backbone's capture against the host's main_hidden: a prefill (the last W rows of a longer
// prompt, and a prompt shorter than the window), then decode batches of the two sequences (one
// row each, in the order given); then drafts from the device's own capture against the host's.
BOOST_AUTO_TEST_CASE(capture_and_pipeline_follow_the_host,
                     *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  fixture f;
  model::device_model<tiny> dm(f.m, limits(2));
  model::device_dspark<tiny> dd(dm, f.w, 2);
  dm.capture_main_hidden(true);
  const std::vector<std::vector<std::int32_t>> prompts = {random_ids(40, 11), random_ids(9, 12)};
  std::vector<model::host_sequence> host(2);
  // states: the host drafter on the host backbone's main_hidden; mirror: the host drafter on the
  // device's capture (the same input as the device drafter: its own error, without the backbone's).
  std::vector<model::dspark_state> states(2), mirror(2);
  ring_check mirror_rings;  // the device's rings against the mirror's (then the mirror takes them)
  std::vector<int> slots;
  double capture_worst = 0;
  const std::size_t width = std::size_t(T) * D;
  for (std::size_t s = 0; s < 2; ++s) {
    slots.push_back(dm.add_sequence());
    dm.prefill(slots.back(), prompts[s]);
    std::vector<bf16> mh;
    model::forward(f.m, host[s], prompts[s], nullptr, &mh);
    const std::size_t rows = std::min<std::size_t>(prompts[s].size(), W);
    BOOST_REQUIRE_EQUAL(dm.main_hidden_rows(), (long long)rows);
    runtime::device_buffer<bf16> copy(rows * width);
    DSV4_CUDA_CHECK(
        cudaMemcpy(copy.data(), dm.main_hidden(), rows * width * sizeof(bf16), cudaMemcpyDeviceToDevice));
    const auto captured = copy.download();
    capture_worst = std::max(capture_worst, worst_relative(captured, last_rows(mh, rows)));
    model::dspark_prefill<tiny>(f.w, states[s], mh);
    model::dspark_prefill<tiny>(f.w, mirror[s], captured, (long long)(prompts[s].size() - rows));
    dd.prefill(slots[s], dm.main_hidden(), (long long)rows, (long long)(prompts[s].size() - rows));
    mirror_rings.compare_and_sync(dd, slots[s], mirror[s]);
  }
  test::logit_stats stats, mirror_stats;
  double conf_worst = 0, mirror_conf_worst = 0;
  std::vector<block_record> blocks, mirror_blocks;
  for (int step = 0; step < 4; ++step) {
    const auto tok = random_ids(2, 100 + std::uint64_t(step));
    dm.decode(slots, tok);
    BOOST_REQUIRE_EQUAL(dm.main_hidden_rows(), 2);
    for (std::size_t s = 0; s < 2; ++s) {
      std::vector<bf16> mh;
      const auto logits =
          model::forward(f.m, host[s], std::span<const std::int32_t>(&tok[s], 1), nullptr, &mh);
      runtime::device_buffer<bf16> row(width);
      DSV4_CUDA_CHECK(cudaMemcpy(row.data(), dm.main_hidden() + s * width, width * sizeof(bf16),
                                 cudaMemcpyDeviceToDevice));
      const auto captured = row.download();
      capture_worst = std::max(capture_worst, worst_relative(captured, mh));
      const std::int32_t input =
          std::int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
      const auto want = model::dspark_decode<tiny>(f.m, f.w, states[s], input, mh);
      const auto got = dd.decode(slots[s], input, dm.main_hidden() + s * width, 1, 1, {0.0f}, 0, want.ids);
      compare(got, want, stats, conf_worst, blocks);
      const auto same_input =
          model::dspark_decode<tiny>(f.m, f.w, mirror[s], input, captured, {0.0f}, 0, want.ids);
      compare(got, same_input, mirror_stats, mirror_conf_worst, mirror_blocks);
      mirror_rings.compare_and_sync(dd, slots[s], mirror[s]);
    }
  }
  BOOST_TEST_MESSAGE(
      "main_hidden capture vs host: worst "
      << capture_worst << "; DSpark pipeline on CUDA vs host: logits worst " << stats.worst
      << ", cosine >= " << stats.min_cosine << ", argmax " << stats.argmax_same << "/" << stats.rows
      << "; confidence worst " << conf_worst << "; against the host drafter on the capture: logits worst "
      << mirror_stats.worst << ", argmax " << mirror_stats.argmax_same << "/" << mirror_stats.rows
      << ", confidence worst " << mirror_conf_worst << " (" << mirror_stats.worst_rows(4, 0.05) << "); mirror "
      << describe(mirror_blocks));
  mirror_rings.check("capture:");
  // The capture carries the backbone's device-vs-host differences (test_device_model_cuda: worst
  // 6-17% of the logit range on tiny's random layers), the drafts those and the drafter's own
  // (seeds 0, 12579890409632215566 and 777 on the H200: 0.226, 0.244 and 0.320).
  BOOST_TEST(capture_worst < 0.3);
  // The cosine follows the same drift: 0.962 and up on those seeds, 0.912 on
  // DSV4_TEST_SEED=8524484361282894606 (logits worst 0.390, argmax 32 of 40; identical at ef37c97,
  // so not a regression), while the drafter fed the capture stayed within 0.002 (below).
  BOOST_TEST(stats.worst < 0.4);
  BOOST_TEST(stats.min_cosine > 0.9);
  // The confidence is one raw scalar per row, a projection of the un-normalized hc_pre output:
  // the backbone's drift reaches it undiluted (0.33 and 1.74 of the block's largest |confidence|
  // were seen on the H200, sixteenth session), so against the host pipeline it is only reported.
  // Against the host drafter fed the device's own capture the drafter alone is measured: the
  // same-input case's bounds (its confidence bound following the logits' drift: seed 0 on the H200
  // gave 0.095).
  BOOST_TEST(mirror_stats.worst < 0.1);
  BOOST_TEST(mirror_stats.min_cosine > 0.99);
  BOOST_TEST(mirror_conf_worst < std::max(0.05, 4.0 * mirror_stats.worst),
             "confidence worst " << mirror_conf_worst << ", logits worst " << mirror_stats.worst);
  dm.capture_main_hidden(false);
  dm.decode(slots, random_ids(2, 200));
  BOOST_TEST(dm.main_hidden_rows() == 0);
}

// Generation with drafts on the GPU (model/device_speculative.cuh): rounds verified in one call and
// rolled back give plain decoding's tokens, with the untrained drafter (few accepted: a rollback
// nearly every round) and with an oracle that drafts plain decoding's tokens (every draft
// accepted: no rollback, fewer rounds). Greedy, so the tokens are the argmax of the logits; the
// verification's rows come from multi-row appends, not decode steps (docs/decisions.md: not
// batch-invariant), so the tokens must agree only up to plain decoding's first close call (top
// two logits within 5% of the row's largest magnitude), and the matching length is reported.
BOOST_AUTO_TEST_CASE(speculative_generation_matches_plain_decoding,
                     *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  fixture f;
  constexpr int B = c.dspark.dspark_block_size;
  auto lim = limits(3);
  lim.logit_rows = B + 1;
  model::device_model<tiny> dm(f.m, lim);
  model::device_dspark<tiny> dd(dm, f.w, 3);
  const auto prompt = random_ids(25, 31);
  const long long n = 20, P = (long long)prompt.size();
  const kernels::sampling::sampling_params greedy{0.0f};
  const plain_run want = plain_decoding(dm, prompt, n, 0);
  const auto& plain = want.tokens;
  const long long clear = want.clear;  // tokens before plain decoding's first close call
  model::speculative_stats untrained, oracle;
  const auto got = model::generate_speculative(dm, dd, dm.add_sequence(), prompt, n, greedy, untrained);
  const auto got_oracle = model::generate_speculative(dm, dd, dm.add_sequence(), prompt, n, greedy, oracle,
                                                      model::prompt_prefill::exact, 0,
                                                      [&](long long first, std::vector<std::int32_t>& ids) {
                                                        for (std::size_t i = 1; i < ids.size(); ++i) {
                                                          const long long k = first + (long long)i - 1 - P;
                                                          if (k >= 0 && k < n) ids[i] = plain[std::size_t(k)];
                                                        }
                                                      });
  BOOST_TEST_MESSAGE("speculative on CUDA: untrained drafter "
                     << untrained.rounds << " rounds, " << untrained.accepted << " of " << untrained.drafted
                     << " accepted; oracle " << oracle.rounds << " rounds, " << oracle.accepted << " of "
                     << oracle.drafted);
  BOOST_TEST_MESSAGE("plain decoding's first close call at token "
                     << clear << " of " << n << "; tokens equal to plain decoding's: " << matching(got, want)
                     << " (untrained), " << matching(got_oracle, want) << " (oracle)");
  BOOST_TEST(got.size() == std::size_t(n));
  BOOST_TEST(got_oracle.size() == std::size_t(n));
  BOOST_TEST(matching(got, want) >= clear,
             "untrained drafter: a token differs from plain decoding's before its first close call");
  BOOST_TEST(matching(got_oracle, want) >= clear,
             "oracle drafter: a token differs from plain decoding's before its first close call");
  BOOST_TEST(untrained.rounds > 0);
  if (clear > B + 1) {  // at least the first round's drafts are plain decoding's clear tokens
    BOOST_TEST(oracle.accepted_at[0] > 0);
    BOOST_TEST(oracle.accepted > untrained.accepted);
  }
  if (clear == n) {
    BOOST_TEST(oracle.accepted == oracle.drafted);
    BOOST_TEST(oracle.rounds < untrained.rounds);
  }
}

// The drafter over several sequences in one pass (device_dspark::decode(steps)) against the same
// steps one sequence at a time, on twin drafter slots fed the same backbone rows: prompts of 5, 30
// and 12 tokens (so the sequences see 6, 16 and 13 ring slots: the batch pads the shorter index
// lists), then a decode step of the backbone (one row each) and a chunk of 3 appended to all three
// in one call (three rows each), a drafter step after each, teacher forced; then one free step
// (greedy draws). The rings must be equal bit for bit (the ring writes are the same per sequence);
// the drafts' logits differ only by summation order (the attention's longer index list, the Markov
// GEMM's rows).
BOOST_AUTO_TEST_CASE(batched_drafter_matches_one_sequence_at_a_time,
                     *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  fixture f;
  constexpr int B = c.dspark.dspark_block_size;
  auto lim = limits(3);
  lim.logit_rows = 9;
  model::device_model<tiny> dm(f.m, lim);
  model::device_dspark<tiny> dd(dm, f.w, 6);
  BOOST_TEST(dd.max_batch() == 6);
  dm.capture_main_hidden(true);
  const std::vector<int> prompt_len = {5, 30, 12};
  std::vector<int> slots;
  for (std::size_t n = 0; n < prompt_len.size(); ++n) {
    slots.push_back(dm.add_sequence());
    dm.prefill(slots.back(), random_ids(prompt_len[n], 90 + n));
    const long long rows = dm.main_hidden_rows(), first = dm.length(slots.back()) - rows;
    dd.prefill(int(n), dm.main_hidden(), rows, first), dd.prefill(int(n) + 3, dm.main_hidden(), rows, first);
  }
  constexpr std::size_t row = std::size_t(T) * D;
  test::logit_stats logits;
  double conf_worst = 0;
  long long ids_equal = 0, ids_total = 0;
  auto step = [&](long long rows_each, bool forced) {
    const auto forced_ids = random_ids(3 * (B + 1), 95 + rows_each);
    std::vector<std::vector<std::int32_t>> force(3);
    std::vector<model::device_dspark<tiny>::step> batch;
    for (int n = 0; n < 3; ++n) {
      const std::int32_t input = forced_ids[std::size_t(n) * (B + 1)];
      if (forced) force[std::size_t(n)].assign(forced_ids.begin() + n * (B + 1), forced_ids.begin() + (n + 1) * (B + 1));
      batch.push_back({n, input, dm.main_hidden() + std::size_t(n) * std::size_t(rows_each) * row, rows_each, rows_each,
                       kernels::sampling::sampling_params{0.0f}, std::uint64_t(n), force[std::size_t(n)]});
    }
    const auto together = dd.decode(batch);
    for (int n = 0; n < 3; ++n) {
      auto one = batch[std::size_t(n)];
      one.slot = n + 3;
      const auto alone = dd.decode(one.slot, one.input_id, one.main_hidden, one.rows, one.positions, one.sampling,
                                   one.sequence, one.forced);
      const auto& got = together[std::size_t(n)];
      BOOST_REQUIRE_EQUAL(got.logits.size(), alone.logits.size());
      for (std::size_t i = 0; i < std::size_t(B); ++i) {
        logits.add(std::span<const float>(got.logits).subspan(i * V, V), std::span<const float>(alone.logits).subspan(i * V, V));
        conf_worst = std::max(conf_worst, std::fabs(double(got.confidence[i]) - alone.confidence[i]) /
                                              std::max(1.0, double(std::fabs(alone.confidence[i]))));
      }
      for (std::size_t i = 0; i <= std::size_t(B); ++i) ids_equal += got.ids[i] == alone.ids[i], ++ids_total;
      for (int st = 0; st < int(f.w.stages.size()); ++st)
      {
        const auto a = dd.ring_values(st, n), b = dd.ring_values(st, n + 3);
        BOOST_TEST((a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(bf16)) == 0),
                   "stage " << st << " ring of sequence " << n);
      }
    }
  };
  dm.decode(slots, random_ids(3, 96));  // one row each
  step(1, true);
  dm.append_all(slots, {random_ids(3, 97), random_ids(3, 98), random_ids(3, 99)});  // three rows each
  step(3, true);
  dm.decode(slots, random_ids(3, 100));
  step(1, false);  // drawn: greedy
  BOOST_TEST_MESSAGE("batched drafter vs one sequence at a time: logits worst " << logits.worst << ", cosine >= "
                     << logits.min_cosine << ", confidence worst " << conf_worst << ", ids equal " << ids_equal
                     << " of " << ids_total);
  BOOST_TEST(logits.rows == std::size_t(3 * 3 * B));
  BOOST_TEST(logits.worst < 1e-3);
  BOOST_TEST(conf_worst < 1e-3);
  BOOST_TEST(ids_equal == ids_total);  // (forced in two steps; the free step's greedy draws agree unless a tie is within 1e-3)
  // Refused: a slot twice in one batch.
  std::vector<model::device_dspark<tiny>::step> twice(2, {0, 1, dm.main_hidden(), 1});
  BOOST_CHECK_THROW(dd.decode(twice), dsv4::error);
}

// A batch of speculative generations (generate_speculative_batch: every sequence's round verified
// in one backbone call, the rejected ones re-appended in a second): three sequences with prompts
// longer than the window, of one token (the prefill's extra decode step) and shorter than the
// window, and different token budgets, with the untrained drafter (rollbacks nearly every round)
// and with an oracle drafter per sequence. Each sequence's tokens must be its plain decoding's up
// to that decoding's first close call, as in the test above.
BOOST_AUTO_TEST_CASE(batched_speculative_generation_matches_plain_decoding,
                     *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  fixture f;
  constexpr int B = c.dspark.dspark_block_size;
  const std::vector<std::vector<std::int32_t>> prompts = {random_ids(25, 41), random_ids(1, 42), random_ids(9, 43)};
  const std::vector<long long> n = {20, 13, 17};
  const std::size_t N = prompts.size();
  auto lim = limits(3 * int(N) + 1);
  lim.logit_rows = int(N) * (B + 1);
  model::device_model<tiny> dm(f.m, lim);
  model::device_dspark<tiny> dd(dm, f.w, lim.max_seqs);
  const kernels::sampling::sampling_params greedy{0.0f};
  std::vector<plain_run> want;
  for (std::size_t b = 0; b < N; ++b) want.push_back(plain_decoding(dm, prompts[b], n[b], b));
  auto requests = [&] {
    std::vector<model::speculative_request> r;
    for (std::size_t b = 0; b < N; ++b) r.push_back({dm.add_sequence(), prompts[b], n[b], greedy, b});
    return r;
  };
  std::vector<model::speculative_stats> untrained, oracle;
  const auto got = model::generate_speculative_batch(dm, dd, requests(), untrained);
  const auto got_oracle = model::generate_speculative_batch(
      dm, dd, requests(), oracle, model::prompt_prefill::exact,
      [&](std::size_t b, long long first, std::vector<std::int32_t>& ids) {
        const long long P = (long long)prompts[b].size();
        for (std::size_t i = 1; i < ids.size(); ++i) {
          const long long k = first + (long long)i - 1 - P;
          if (k >= 0 && k < n[b]) ids[i] = want[b].tokens[std::size_t(k)];
        }
      });
  BOOST_REQUIRE_EQUAL(got.size(), N);
  BOOST_REQUIRE_EQUAL(got_oracle.size(), N);
  for (std::size_t b = 0; b < N; ++b) {
    const long long clear = want[b].clear;
    BOOST_TEST_MESSAGE("batched speculative, sequence " << b << ": untrained drafter " << untrained[b].rounds << " rounds, "
                       << untrained[b].accepted << " of " << untrained[b].drafted << " accepted; oracle " << oracle[b].rounds
                       << " rounds, " << oracle[b].accepted << " of " << oracle[b].drafted << "; plain decoding's first close call at "
                       << clear << " of " << n[b] << ", tokens equal: " << matching(got[b], want[b]) << " (untrained), "
                       << matching(got_oracle[b], want[b]) << " (oracle)");
    BOOST_TEST(got[b].size() == std::size_t(n[b]));
    BOOST_TEST(got_oracle[b].size() == std::size_t(n[b]));
    BOOST_TEST(matching(got[b], want[b]) >= clear, "sequence " << b << ", untrained drafter: a token differs before the first close call");
    BOOST_TEST(matching(got_oracle[b], want[b]) >= clear, "sequence " << b << ", oracle drafter: a token differs before the first close call");
    BOOST_TEST(untrained[b].rounds > 0);
    if (clear > B + 1) BOOST_TEST(oracle[b].accepted > untrained[b].accepted);
    if (clear == n[b]) {
      BOOST_TEST(oracle[b].accepted == oracle[b].drafted);
      BOOST_TEST(oracle[b].rounds < untrained[b].rounds);
    }
  }
  // Refused: a slot twice, a batch whose round exceeds limits::logit_rows.
  const int s = dm.add_sequence();
  const std::vector<model::speculative_request> twice = {{s, prompts[2], 4, greedy, 0}, {s, prompts[2], 4, greedy, 1}};
  std::vector<model::speculative_stats> st;
  BOOST_CHECK_THROW(model::generate_speculative_batch(dm, dd, twice, st), dsv4::error);
  // Refused before any prefill: a slot the models do not have, more tokens than limits::max_tokens.
  const std::vector<model::speculative_request> no_slot = {{s, prompts[2], 4, greedy, 0}, {lim.max_seqs, prompts[2], 4, greedy, 1}};
  BOOST_TEST(test::throws_with([&] { model::generate_speculative_batch(dm, dd, no_slot, st); }, "no such slot"));
  const std::vector<model::speculative_request> too_long = {{s, prompts[0], 1000, greedy, 0}};
  BOOST_TEST(test::throws_with([&] { model::generate_speculative_batch(dm, dd, too_long, st); }, "limits::max_tokens"));
  BOOST_TEST(dm.length(s) == 0);  // (nothing was prefilled)
}

// speculative_batch a round at a time over sequences that join and leave (a server's batch, `dsv4
// serve --speculative dspark`): A (25-token prompt) starts and runs a round alone; B (a one-token
// prompt: its first round is a plain step, one token, no round counted) joins; A and B run rounds
// together with budgets cycling 1 .. 4; when A has its tokens it leaves (forget, release) and C
// (9 tokens) starts, maybe in A's slot, beside B. Every round gives 1 .. min(budget, block + 1)
// tokens; each sequence's tokens are its plain decoding's up to that decoding's first close call;
// misuse is refused before any work.
BOOST_AUTO_TEST_CASE(speculative_rounds_over_sequences_that_join_and_leave,
                     *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  fixture f;
  constexpr int B = c.dspark.dspark_block_size;
  auto lim = limits(6);
  lim.logit_rows = 2 * (B + 1);
  model::device_model<tiny> dm(f.m, lim);
  model::device_dspark<tiny> dd(dm, f.w, lim.max_seqs);
  const kernels::sampling::sampling_params greedy{0.0f};
  struct member {
    std::vector<std::int32_t> prompt;
    long long n;
    plain_run want;
    int slot = -1;
    std::vector<std::int32_t> got{};
    bool done() const { return (long long)got.size() >= n; }
  };
  member a{random_ids(25, 51), 14, {}}, b{random_ids(1, 52), 12, {}}, cc{random_ids(9, 53), 10, {}};
  for (member* m : {&a, &b, &cc}) m->want = plain_decoding(dm, m->prompt, m->n, 0);
  model::speculative_batch<tiny> sb(dm, dd);
  long long r = 0;
  auto start = [&](member& m) {
    m.slot = dm.add_sequence();
    m.got.push_back(sb.start(m.slot, m.prompt, model::prompt_prefill::exact, greedy));
  };
  auto round = [&](std::vector<member*> ms) {
    std::vector<model::speculative_batch<tiny>::request> req;
    for (member* m : ms) req.push_back({m->slot, std::min(1 + r % 4, m->n - (long long)m->got.size())});
    const auto kept = sb.round(req);
    BOOST_REQUIRE_EQUAL(kept.size(), ms.size());
    for (std::size_t i = 0; i < ms.size(); ++i) {
      BOOST_TEST((!kept[i].empty() && (long long)kept[i].size() <= std::min<long long>(req[i].budget, B + 1)),
                 "round " << r << ", slot " << req[i].slot << ": " << kept[i].size() << " tokens for a budget of " << req[i].budget);
      ms[i]->got.insert(ms[i]->got.end(), kept[i].begin(), kept[i].end());
    }
    ++r;
  };
  start(a);
  round({&a});
  start(b);
  round({&a, &b});
  BOOST_TEST(sb.stats(b.slot).rounds == 0);  // B's plain step
  BOOST_TEST(b.got.size() == 2u);
  while (!a.done()) {  // (B may finish first: a round takes only the sequences that want more)
    std::vector<member*> ms;
    for (member* m : {&a, &b})
      if (!m->done()) ms.push_back(m);
    round(ms);
  }
  const model::speculative_stats a_stats = sb.stats(a.slot);
  sb.forget(a.slot);
  dm.release_sequence(a.slot);
  start(cc);
  for (;;) {
    std::vector<member*> ms;
    for (member* m : {&b, &cc})
      if (!m->done()) ms.push_back(m);
    if (ms.empty()) break;
    round(ms);
  }
  for (const member* m : {&a, &b, &cc}) {
    BOOST_TEST_MESSAGE("speculative_batch, prompt of " << m->prompt.size() << ": " << m->got.size() << " tokens, "
                       << matching(m->got, m->want) << " equal to plain decoding's (first close call at " << m->want.clear << ")");
    BOOST_TEST(m->got.size() == std::size_t(m->n));
    BOOST_TEST(matching(m->got, m->want) >= m->want.clear, "prompt of " << m->prompt.size() << ": a token differs before the first close call");
  }
  BOOST_TEST(a_stats.rounds > 0);
  BOOST_TEST(sb.stats(b.slot).rounds > 0);
  BOOST_TEST(sb.stats(cc.slot).accepted <= sb.stats(cc.slot).drafted);
  // Refused before any work: a slot not started, a slot twice, a budget of 0, a second start.
  const int idle = dm.add_sequence();
  const std::vector<model::speculative_batch<tiny>::request> not_started = {{b.slot, 1}, {idle, 1}},
                                                               twice = {{b.slot, 1}, {b.slot, 1}}, none = {{b.slot, 0}};
  const long long b_length = dm.length(b.slot);
  BOOST_TEST(test::throws_with([&] { sb.round(not_started); }, "not started"));
  BOOST_TEST(test::throws_with([&] { sb.round(twice); }, "appears twice"));
  BOOST_TEST(test::throws_with([&] { sb.round(none); }, "budget must be >= 1"));
  BOOST_TEST(test::throws_with([&] { sb.start(b.slot, b.prompt, model::prompt_prefill::exact, greedy); }, "already started"));
  BOOST_TEST(dm.length(b.slot) == b_length);
}

// speculative_batch::resume (a server session's next turn) between rounds: after the turn's first
// round the drafter's rings are those of a fresh start on the whole conversation in the same mode
// (up to the FP8 code flips of ring_check where a probe step finds the two backbones equal; where
// it does not, the calls' shapes moved a sum of the backbone's, which 20 random decoder layers
// amplify, and only each ring entry's relative error is bounded: H100, seed 1919460011733219210,
// the CED plan's 36-row append against the 46-row prefill, first apart at encoder layer 17's
// attention output by 1% of its peak, the caches equal), both have seen the same positions, and the
// turn's tokens are plain decoding's of the whole conversation up to its first close call. Plans:
// exact and CED turns shorter and longer than the window; two turns with no round between them, the
// second moving the rows the drafter has not seen down its buffer (a W - 1 turn after one of 3: the
// old rows but the newest dropped); a turn right after a one-token prompt's start. Misuse is
// refused before any work.
BOOST_AUTO_TEST_CASE(an_appended_turn_leaves_a_fresh_starts_drafter_state,
                     *utf::label("gpu") * utf::precondition(test::has_cuda_device{})) {
  fixture f;
  constexpr int B = c.dspark.dspark_block_size;
  auto lim = limits(4);
  lim.logit_rows = B + 1, lim.ced_appends = true;
  model::device_model<tiny> dm(f.m, lim);
  model::device_dspark<tiny> dd(dm, f.w, lim.max_seqs);
  model::speculative_batch<tiny> sb(dm, dd);
  const kernels::sampling::sampling_params greedy{0.0f};
  const auto exact = model::prompt_prefill::exact, ced = model::prompt_prefill::ced;
  const std::vector<test::resume_plan> plans = test::resume_plans(W);
  ring_check rings;
  std::uint64_t seed = 300;
  int id = 0;
  for (const test::resume_plan& pl : plans) {
    const model::prompt_prefill mode = pl.turns.back().mode;
    const std::string what = "plan " + std::to_string(id++) + " (" + (mode == ced ? "CED" : "exact") + ")";
    const int a = dm.add_sequence();
    const auto p1 = random_ids(pl.prompt, seed++);
    std::vector<std::int32_t> got{sb.start(a, p1, exact, greedy)};
    while ((long long)got.size() < pl.before) {
      const model::speculative_batch<tiny>::request r{a, pl.before - (long long)got.size()};
      const auto kept = sb.round(std::span(&r, 1))[0];
      got.insert(got.end(), kept.begin(), kept.end());
    }
    const model::speculative_stats before = sb.stats(a);
    std::vector<std::int32_t> conversation(p1);
    conversation.insert(conversation.end(), got.begin(), got.end());
    std::int32_t first = got.back();
    for (const test::resume_turn& t : pl.turns) {
      std::vector<std::int32_t> chunk{first};  // (the last token returned, never fed)
      for (const std::int32_t tok : random_ids(t.length - 1, seed++)) chunk.push_back(tok);
      conversation.insert(conversation.end(), chunk.begin() + 1, chunk.end());
      first = sb.resume(a, chunk, t.mode, greedy);
      BOOST_TEST(dm.length(a) == (long long)conversation.size(), what);
      conversation.push_back(first);
    }
    conversation.pop_back();  // (drawn, not fed)
    const long long n = 10;
    const plain_run want = plain_decoding(dm, conversation, n, 0, mode == ced);
    std::vector<std::int32_t> turn_tokens{first};
    const int b = dm.add_sequence();
    sb.start(b, conversation, mode, greedy);
    for (const int slot : {a, b}) {  // one round each (budget 1: the drafter's step, no draft fed)
      const model::speculative_batch<tiny>::request r{slot, 1};
      const auto kept = sb.round(std::span(&r, 1))[0];
      if (slot == a) turn_tokens.insert(turn_tokens.end(), kept.begin(), kept.end());
    }
    BOOST_TEST(dd.length(a) == dd.length(b), what);
    BOOST_TEST(sb.stats(a).since(before).rounds == 1, what << ": the turn's first round drafted");
    model::dspark_state fresh;
    for (int s = 0; s < int(f.w.stages.size()); ++s) fresh.rings.push_back(dd.ring_values(s, b));
    std::ostringstream backbone;
    const bool agree = backbones_agree(dm, a, b, backbone);
    if (!agree) BOOST_TEST_MESSAGE(what << backbone.str());
    rings.compare_and_sync(dd, a, fresh, agree);
    while ((long long)turn_tokens.size() < n) {
      const model::speculative_batch<tiny>::request r{a, n - (long long)turn_tokens.size()};
      const auto kept = sb.round(std::span(&r, 1))[0];
      turn_tokens.insert(turn_tokens.end(), kept.begin(), kept.end());
    }
    BOOST_TEST_MESSAGE(what << ": " << matching(turn_tokens, want) << " of " << n << " tokens equal to plain decoding's of the "
                            << "whole conversation (first close call at " << want.clear << ")");
    BOOST_TEST(matching(turn_tokens, want) >= want.clear, what << ": a token differs before the first close call");
    for (const int slot : {a, b}) sb.forget(slot), dm.release_sequence(slot);
  }
  rings.check("resumed against fresh:");
  // Refused before any work (the slot stays started): a slot not started, an empty chunk, a chunk
  // beyond limits::max_rows, a sequence beyond limits::max_tokens, bad sampling parameters.
  const int idle = dm.add_sequence();
  const std::vector<std::int32_t> one{7};
  BOOST_TEST(test::throws_with([&] { sb.resume(idle, one, exact, greedy); }, "not started"));
  sb.start(idle, one, exact, greedy);
  BOOST_TEST(test::throws_with([&] { sb.resume(idle, {}, exact, greedy); }, "empty chunk"));
  const auto wide = random_ids(lim.max_rows + 1, 900);
  BOOST_TEST(test::throws_with([&] { sb.resume(idle, wide, exact, greedy); }, "limits::max_rows"));
  const auto row = random_ids(lim.max_rows, 901);
  for (int k = 0; k < 3; ++k) sb.resume(idle, row, exact, greedy);  // 1 + 3 x 64 = 193 of 256
  BOOST_TEST(test::throws_with([&] { sb.resume(idle, row, exact, greedy); }, "limits::max_tokens"));
  BOOST_TEST(test::throws_with([&] { sb.resume(idle, one, exact, {-1.0f}); }, "temperature"));
  const model::speculative_batch<tiny>::request r{idle, 1};
  BOOST_TEST(sb.round(std::span(&r, 1))[0].size() == 1u);  // still started
}

BOOST_AUTO_TEST_SUITE_END()
