// Continuous batching (apps/batching.hpp): the scheduler decodes requests that arrive together in
// one step, each request still gets `dsv4 run`'s tokens (host engine), requests join and leave
// at any step, a cancelled one leaves at the next step, a full queue refuses at once, an engine
// failure fails the step's requests and not the scheduler; and `dsv4 serve` answering several
// clients at once over a real socket.

#include <boost/test/unit_test.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <future>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "dsv4/apps/batching.hpp"
#include "dsv4/apps/serve.hpp"
#include "dsv4/cli.hpp"
#include "support/builtin_tiny.hpp"
#include "support/errors.hpp"

using namespace dsv4;
using namespace std::chrono_literals;

namespace {

//! A host engine whose start() waits for `gate` the first time (so the test can queue requests
//! behind it), which counts its steps' sizes and can be told to fail a step.
class gated_engine final : public cli::sequence_engine {
 public:
  gated_engine(int capacity, std::shared_future<void> gate)
      : inner_(test::builtin_tiny(), {capacity, 64, 64}), gate_(std::move(gate)) {}
  std::string device() const override { return "gated host engine"; }
  int capacity() const override { return inner_.capacity(); }
  long long max_sequence_tokens() const override { return inner_.max_sequence_tokens(); }
  bool can_resume() const override { return inner_.can_resume(); }
  std::int32_t resume(int h, std::span<const std::int32_t> chunk, bool ced,
                      const kernels::sampling::sampling_params& sp) override {
    ++resumes;
    return inner_.resume(h, chunk, ced, sp);
  }
  started start(std::span<const std::int32_t> prompt, bool ced,
                const kernels::sampling::sampling_params& sp) override {
    ++entered;
    if (!opened_) gate_.wait(), opened_ = true;
    ++starts;
    return inner_.start(prompt, ced, sp);
  }
  std::vector<std::vector<std::int32_t>> step(std::span<const int> h, std::span<const std::int32_t> ids,
                                              std::span<const kernels::sampling::sampling_params> sp,
                                              std::span<const long long> budget) override {
    if (fail_next_step.exchange(false)) throw error("gated_engine: a failed step");
    step_sizes.push_back(int(h.size()));
    return inner_.step(h, ids, sp, budget);
  }
  void release(int h) override {
    ++releases;
    inner_.release(h);
  }
  std::atomic<int> entered{0}, starts{0}, releases{0}, resumes{0};
  std::atomic<bool> fail_next_step{false};
  std::vector<int> step_sizes;  // read only after the scheduler's work is done

 private:
  cli::host_engine inner_;
  std::shared_future<void> gate_;
  bool opened_ = false;
};

struct request_set {
  std::vector<std::vector<std::int32_t>> prompts;
  std::vector<cli::run_request> requests;
  explicit request_set(int n) : prompts(std::size_t(n)), requests(std::size_t(n)) {
    for (int i = 0; i < n; ++i) {
      for (int k = 0; k <= i % 4; ++k) prompts[std::size_t(i)].push_back(std::int32_t(3 + 17 * i + k));
      cli::run_request& r = requests[std::size_t(i)];
      r.prompt = prompts[std::size_t(i)];
      r.n_new = 3 + i % 5;  // sequences leave the batch at different steps
      r.sampling.seed = std::uint64_t(100 + i);
      r.sampling.temperature = i % 3 == 0 ? 0.0f : 0.9f;
      r.sampling.top_p = i % 2 ? 0.9f : 1.0f;
      r.ced = i % 4 == 3;
    }
  }
};

//! The engines' gate: opened once, by release() or, if a requirement fails first, by a
//! `gate::on_exit` declared after the futures (so it runs before they wait for their requests).
struct gate {
  std::promise<void> p;
  std::shared_future<void> f = p.get_future().share();
  bool opened = false;
  void release() {
    if (!opened) opened = true, p.set_value();
  }
  struct on_exit {
    gate& g;
    ~on_exit() { g.release(); }
  };
};

void wait_until(const std::function<bool()>& ready) {
  const auto end = std::chrono::steady_clock::now() + 20s;
  while (!ready() && std::chrono::steady_clock::now() < end) std::this_thread::sleep_for(1ms);
  BOOST_REQUIRE(ready());
}

}  // namespace

BOOST_AUTO_TEST_SUITE(batching)

// Six requests: the first one's prefill waits at the engine's gate while the other five queue
// behind it; they are admitted together after its first step, so the steps hold 1, 6, 5, 4, 3, 2, 1
// sequences as requests of 3 .. 7 tokens leave; every request's tokens are host_generate's.
BOOST_AUTO_TEST_CASE(requests_that_arrive_together_are_decoded_together) {
  gate g;
  auto engine = std::make_unique<gated_engine>(8, g.f);
  gated_engine& e = *engine;
  cli::batch_scheduler s(std::move(engine));
  constexpr int n = 6;
  request_set set(n);
  std::vector<std::future<cli::generation>> got;
  gate::on_exit open_anyway{g};
  auto submit = [&](int i) {
    got.push_back(std::async(std::launch::async, [&, i] { return s.submit(set.requests[std::size_t(i)]); }));
  };
  submit(0);
  wait_until([&] { return e.entered.load() == 1; });  // taken: waiting at the gate
  for (int i = 1; i < n; ++i) submit(i);
  wait_until([&] { return s.queued() == std::size_t(n - 1); });
  g.release();
  for (int i = 0; i < n; ++i) {
    const cli::generation g = got[std::size_t(i)].get();
    const cli::generation want = cli::host_generate(test::builtin_tiny(), set.requests[std::size_t(i)]);
    BOOST_TEST(g.tokens == want.tokens, "request " << i);
    BOOST_TEST(!g.cancelled);
    BOOST_TEST(g.device == "gated host engine");
  }
  const auto st = s.stats();
  BOOST_TEST(st.requests == n);
  BOOST_TEST(st.largest_batch == n);
  BOOST_TEST(st.steps == 7);
  BOOST_TEST(st.stepped_rows == 22);  // the requests' tokens after their first, 2 + 3 + 4 + 5 + 6 + 2
  BOOST_TEST(e.step_sizes == (std::vector<int>{1, 6, 5, 4, 3, 2, 1}));
  BOOST_TEST(e.releases.load() == n);  // every sequence went back to the pool
}

// A request joins a batch already decoding, and a cancelled request leaves at the next step while
// the others go on and still get their tokens.
BOOST_AUTO_TEST_CASE(requests_join_and_leave_at_any_step) {
  gate g;
  g.release();
  cli::batch_scheduler s(std::make_unique<gated_engine>(4, g.f));
  request_set set(3);
  set.requests[0].n_new = 14;
  std::atomic<bool> leave{false};
  set.requests[1].n_new = 14;
  set.requests[1].cancelled = [&] { return leave.load(); };  // gone once the late request is done
  auto long_one = std::async(std::launch::async, [&] { return s.submit(set.requests[0]); });
  auto cancelled = std::async(std::launch::async, [&] { return s.submit(set.requests[1]); });
  wait_until([&] { return s.stats().steps >= 3; });
  const cli::generation late = s.submit(set.requests[2]);  // joins mid-way
  leave = true;
  BOOST_TEST(late.tokens == cli::host_generate(test::builtin_tiny(), set.requests[2]).tokens);
  const cli::generation c = cancelled.get();
  BOOST_TEST(c.cancelled);
  BOOST_TEST(c.tokens.size() < 14u);
  cli::run_request uncancelled = set.requests[1];
  uncancelled.cancelled = {};
  const auto full = cli::host_generate(test::builtin_tiny(), uncancelled).tokens;
  BOOST_TEST(std::equal(c.tokens.begin(), c.tokens.end(), full.begin()));  // a prefix of the full run
  BOOST_TEST(long_one.get().tokens == cli::host_generate(test::builtin_tiny(), set.requests[0]).tokens);
  BOOST_TEST(s.stats().largest_batch == 3);  // the late request ran beside the other two
}

// The queue holds max_queued requests beyond the engine's free room, and refuses more at once with
// server_busy; a failed step fails its requests, not the scheduler, and the pool gets the
// sequences back; a request whose own callback throws fails alone.
BOOST_AUTO_TEST_CASE(a_full_queue_refuses_and_a_failed_step_fails_only_its_requests) {
  gate g;
  auto engine = std::make_unique<gated_engine>(2, g.f);
  gated_engine& e = *engine;
  cli::batch_scheduler s(std::move(engine), {.max_queued = 1});
  request_set set(5);
  std::vector<std::future<cli::generation>> got;
  gate::on_exit open_anyway{g};
  auto submit = [&](int i) {
    got.push_back(std::async(std::launch::async, [&, i] { return s.submit(set.requests[std::size_t(i)]); }));
  };
  submit(0);
  wait_until([&] { return e.entered.load() == 1; });  // running, at the gate: one free place
  submit(1);
  submit(2);  // the free place and max_queued
  wait_until([&] { return s.queued() == 2; });
  BOOST_TEST(test::throws_with(
      [&] { s.submit(set.requests[3]); },
      "the server is busy: 1 requests running, 2 waiting (at most 1 beyond the 2 that run together)"));
  e.fail_next_step = true;
  g.release();
  BOOST_TEST(test::throws_with([&] { got[0].get(); }, "gated_engine: a failed step"));
  // The two queued behind it were admitted after the failed step, together, and run.
  for (int i = 1; i <= 2; ++i)
    BOOST_TEST(got[std::size_t(i)].get().tokens ==
               cli::host_generate(test::builtin_tiny(), set.requests[std::size_t(i)]).tokens);
  cli::run_request bad = set.requests[4];
  bad.on_token = [](std::int32_t) { throw error("a client callback that throws"); };
  BOOST_TEST(test::throws_with([&] { s.submit(bad); }, "a client callback that throws"));
  BOOST_TEST(s.submit(set.requests[3]).tokens ==
             cli::host_generate(test::builtin_tiny(), set.requests[3]).tokens);
  BOOST_TEST(e.releases.load() == e.starts.load());
}

// The destructor fails what is queued or running and waits for its callers to leave submit().
BOOST_AUTO_TEST_CASE(destroying_the_scheduler_fails_its_waiting_requests) {
  gate g;
  std::future<cli::generation> running, queued;
  request_set set(2);
  {
    auto engine = std::make_unique<gated_engine>(1, g.f);
    gated_engine& e = *engine;
    cli::batch_scheduler s(std::move(engine));
    running = std::async(std::launch::async, [&] { return s.submit(set.requests[0]); });
    wait_until([&] { return e.entered.load() == 1; });
    queued = std::async(std::launch::async, [&] { return s.submit(set.requests[1]); });
    wait_until([&] { return s.queued() == 1; });
    std::thread opener([&] {
      std::this_thread::sleep_for(50ms);
      g.release();  // the running prefill finishes; the scheduler then sees it must stop
    });
    opener.detach();
  }  // ~batch_scheduler
  BOOST_TEST(test::throws_with([&] { queued.get(); }, "the server is stopping"));
  try {
    running.get();  // finished before the stop was seen, or failed by it
  } catch (const std::exception& ex) {
    BOOST_TEST(std::string(ex.what()).find("stopping") != std::string::npos, ex.what());
  }
  struct no_room final : cli::sequence_engine {
    std::string device() const override { return "none"; }
    int capacity() const override { return 0; }
    long long max_sequence_tokens() const override { return 0; }
    started start(std::span<const std::int32_t>, bool, const kernels::sampling::sampling_params&) override {
      return {};
    }
    std::vector<std::vector<std::int32_t>> step(std::span<const int>, std::span<const std::int32_t>,
                                                std::span<const kernels::sampling::sampling_params>,
                                                std::span<const long long>) override {
      return {};
    }
    void release(int) override {}
  };
  BOOST_TEST(test::throws_with([] { cli::batch_scheduler bad(std::make_unique<no_room>()); },
                               "the engine holds no sequence"));
}

// Steps that give several tokens (a drafting engine's): an engine that hands each sequence the
// next min(3, budget) of its host_generate tokens per step. The scheduler passes each sequence's
// remaining count as its budget, keeps the tokens in order, streams each one to on_token, counts
// them (stepped_tokens), and fails the step's requests, naming the problem, when an engine returns
// more tokens than a sequence wants or none.
BOOST_AUTO_TEST_CASE(steps_may_give_several_tokens) {
  struct ahead_engine final : cli::sequence_engine {
    std::vector<std::vector<std::int32_t>> answers;  // per request (handle = its index)
    std::vector<std::size_t> given;
    std::vector<long long> budgets;
    int extra = 0;  // tokens returned beyond the budget (a faulty engine), or -1: none at all
    bool fed_last_token = true, budget_is_the_rest = true;
    std::string device() const override { return "ahead"; }
    int capacity() const override { return 4; }
    long long max_sequence_tokens() const override { return 1 << 20; }
    int draft_block() const override { return 2; }
    int next_handle = 0;
    started start(std::span<const std::int32_t>, bool, const kernels::sampling::sampling_params&) override {
      const int h = next_handle++;
      given[std::size_t(h)] = 1;
      return {h, answers[std::size_t(h)][0]};
    }
    std::vector<std::vector<std::int32_t>> step(std::span<const int> h, std::span<const std::int32_t> ids,
                                                std::span<const kernels::sampling::sampling_params>,
                                                std::span<const long long> budget) override {
      std::vector<std::vector<std::int32_t>> out(h.size());
      for (std::size_t i = 0; i < h.size(); ++i) {
        const auto& a = answers[std::size_t(h[i])];
        std::size_t& g = given[std::size_t(h[i])];
        // (checked on the test's thread: the scheduler's runs this)
        fed_last_token &= ids[i] == a[g - 1];
        budget_is_the_rest &= budget[i] == (long long)(a.size() - g);
        budgets.push_back(budget[i]);
        if (extra < 0) continue;
        const std::size_t k = std::min<std::size_t>(3, std::size_t(budget[i]) + std::size_t(extra));
        for (std::size_t j = 0; j < k; ++j) out[i].push_back(g + j < a.size() ? a[g + j] : 0);
        g += k;
      }
      return out;
    }
    model::speculative_stats drafts(int h) const override {
      model::speculative_stats st;
      st.rounds = h + 1;
      return st;
    }
    void release(int) override {}
  };
  request_set set(3);
  set.requests[0].n_new = 8, set.requests[1].n_new = 4, set.requests[2].n_new = 1;
  auto engine = std::make_unique<ahead_engine>();
  ahead_engine& e = *engine;
  for (const auto& r : set.requests) e.answers.push_back(cli::host_generate(test::builtin_tiny(), r).tokens);
  e.given.assign(8, 0);
  cli::batch_scheduler s(std::move(engine));
  std::vector<std::int32_t> streamed;
  set.requests[0].on_token = [&](std::int32_t t) { streamed.push_back(t); };
  for (std::size_t i = 0; i < 3; ++i) {  // one at a time: handle i is request i
    const cli::generation g = s.submit(set.requests[i]);
    BOOST_TEST(g.tokens == e.answers[i], "request " << i);
    BOOST_TEST(g.draft_block == 2);
    BOOST_TEST(g.speculative.rounds == (long long)i + 1);  // the engine's counts of that sequence
  }
  BOOST_TEST(streamed == e.answers[0]);
  BOOST_TEST(e.fed_last_token);      // each step fed the last token the sequence was given
  BOOST_TEST(e.budget_is_the_rest);  // and asked for at most the tokens it still wants
  BOOST_TEST(e.budgets == (std::vector<long long>{7, 4, 1, 3}));  // 8: 1 + 3 + 3 + 1; 4: 1 + 3; 1: no step
  BOOST_TEST(s.stats().steps == 4);
  BOOST_TEST(s.stats().stepped_rows == 4);
  BOOST_TEST(s.stats().stepped_tokens == 10);
  e.extra = 1;  // 3 tokens for a sequence that wants 2
  cli::run_request three = set.requests[1];
  three.n_new = 3;
  e.answers.push_back(cli::host_generate(test::builtin_tiny(), three).tokens);
  BOOST_TEST(test::throws_with([&] { s.submit(three); }, "the engine returned 3 tokens for a sequence that wants 2"));
  e.extra = -1;
  e.answers.push_back(e.answers.back());
  BOOST_TEST(test::throws_with([&] { s.submit(three); }, "the engine returned 0 tokens for a sequence that wants 2"));
}

// A drafting host engine (host_engine with the DSpark weights; `dsv4 serve --speculative
// dspark`): requests batched together get plain decoding's tokens (host_generate without drafts)
// and host_generate's draft counts with the same drafter, whatever else is in the batch.
BOOST_AUTO_TEST_CASE(a_drafting_engine_gives_plain_decodings_tokens) {
  std::ostringstream quiet;
  io::checkpoint ck = cli::detail::open_tiny_checkpoint("", quiet);
  const model::dspark_weights w = model::dspark_weights_of<models::tiny>(ck);
  cli::batch_scheduler s(
      std::make_unique<cli::host_engine>(test::builtin_tiny(), cli::engine_limits{3, 64, 64}, &w));
  BOOST_TEST(s.draft_block() == w.block);
  request_set set(5);
  for (auto& r : set.requests) r.n_new += 4;  // several rounds each
  std::vector<std::future<cli::generation>> got;
  for (const auto& r : set.requests) got.push_back(std::async(std::launch::async, [&] { return s.submit(r); }));
  long long accepted = 0, tokens = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const cli::generation g = got[i].get();
    cli::run_request drafted = set.requests[i];
    drafted.dspark = &w;
    const cli::generation alone = cli::host_generate(test::builtin_tiny(), drafted);
    BOOST_TEST(g.tokens == cli::host_generate(test::builtin_tiny(), set.requests[i]).tokens, "request " << i);
    BOOST_TEST(alone.tokens == g.tokens, "request " << i);
    BOOST_TEST(g.draft_block == w.block);
    BOOST_TEST(g.speculative.rounds == alone.speculative.rounds);
    BOOST_TEST(g.speculative.drafted == alone.speculative.drafted);
    BOOST_TEST(g.speculative.accepted == alone.speculative.accepted);
    BOOST_TEST(g.speculative.rounds > 0);
    accepted += g.speculative.accepted, tokens += (long long)g.tokens.size();
  }
  const auto st = s.stats();
  BOOST_TEST_MESSAGE("drafting host engine: " << st.steps << " steps, " << st.stepped_rows << " sequence-steps, "
                                               << st.stepped_tokens << " tokens, " << accepted << " drafts accepted");
  // The first token of each comes from its prefill, the rest from steps; a step's tokens beyond
  // one per sequence are accepted drafts (a round cut short by the budget may end on one).
  BOOST_TEST(st.stepped_tokens == tokens - (long long)got.size());
  BOOST_TEST(st.stepped_tokens <= st.stepped_rows + accepted);
}

// A conversation on the host model by hand: turn 1's prefill and n1 draws, then turn 2's chunk
// (turn 1's last token, never fed, and p2) appended, exact or CED, and n2 draws; every draw at the
// sampler's position counter, as the engines draw.
std::vector<std::int32_t> by_hand(const std::vector<std::int32_t>& p1, long long n1, const std::vector<std::int32_t>& p2,
                                  long long n2, bool ced2, const kernels::sampling::sampling_params& sp) {
  model::host_sequence seq;
  auto draws = [&](std::vector<float> logits, long long n, std::vector<std::int32_t>& out) {
    for (long long i = 0; i < n; ++i) {
      out.push_back(kernels::sampling::sample_reference(logits, sp, 0, std::uint64_t(seq.length)));
      if (i + 1 < n)
        logits = model::forward(test::builtin_tiny(), seq, std::span<const std::int32_t>(&out.back(), 1));
    }
  };
  std::vector<std::int32_t> first, second;
  draws(model::forward(test::builtin_tiny(), seq, p1), n1, first);
  std::vector<std::int32_t> chunk;
  if (!first.empty()) chunk.push_back(first.back());
  chunk.insert(chunk.end(), p2.begin(), p2.end());
  draws(ced2 ? model::forward_ced(test::builtin_tiny(), seq, chunk)
             : model::forward(test::builtin_tiny(), seq, chunk),
        n2, second);
  return second;
}

// Sessions: a conversation's turns append to one sequence instead of prefilling it again. Turn 2
// of a session gives what a fresh request for the whole conversation (turn 1's prompt and tokens,
// then turn 2's prompt) gives, and what the host model gives by hand, exact and CED; a turn of no
// tokens; the session's token count. Refused at once, naming the session: continuing an unknown
// one (404), a taken name (409), a session whose turn is running (409), a turn beyond the
// session's tokens (400). An idle session is evicted, least recently used first, when a new
// request needs its slot; a failed turn closes its session; close_session releases one.
BOOST_AUTO_TEST_CASE(sessions_append_turns_to_one_sequence) {
  gate g;
  g.release();
  auto engine = std::make_unique<gated_engine>(2, g.f);
  gated_engine& e = *engine;
  cli::batch_scheduler s(std::move(engine));
  BOOST_TEST(s.sessions_possible());
  BOOST_TEST(s.max_sequence_tokens() == 128);  // gated_engine's limits: 64 prompt + 64 new
  const std::vector<std::int32_t> p1{3, 14, 15, 92}, p2{65, 35, 89};
  cli::run_request t1;
  t1.prompt = p1, t1.n_new = 5, t1.sampling = {0.8f, 40, 0.95f, 21}, t1.session = "chat";
  const cli::generation g1 = s.submit(t1);
  BOOST_TEST(g1.session_tokens == 9);
  cli::run_request t2 = t1;
  t2.prompt = p2, t2.n_new = 4, t2.continue_session = true;
  const cli::generation g2 = s.submit(t2);
  BOOST_TEST(g2.session_tokens == 16);
  BOOST_TEST(e.resumes.load() == 1);
  std::vector<std::int32_t> whole(p1);
  whole.insert(whole.end(), g1.tokens.begin(), g1.tokens.end());
  whole.insert(whole.end(), p2.begin(), p2.end());
  cli::run_request fresh = t1;
  fresh.prompt = whole, fresh.n_new = 4, fresh.session.clear();
  BOOST_TEST(
      g2.tokens ==
      cli::host_generate(test::builtin_tiny(), fresh).tokens);  // the append = the prefill, bit for bit
  BOOST_TEST(g2.tokens == by_hand(p1, 5, p2, 4, false, t1.sampling));
  // A CED turn, and a turn of no tokens (its prompt fed, nothing drawn), then one more.
  cli::run_request c1 = t1;
  c1.session = "ced";
  const cli::generation gc1 = s.submit(c1);
  cli::run_request c2 = c1;
  c2.prompt = p2, c2.n_new = 3, c2.ced = true, c2.continue_session = true;
  BOOST_TEST(s.submit(c2).tokens == by_hand(p1, 5, p2, 3, true, c1.sampling));
  cli::run_request quiet = t2;
  quiet.session = "chat", quiet.n_new = 0;
  BOOST_TEST(s.submit(quiet).session_tokens == 19);
  cli::run_request after = t2;
  after.prompt = p1, after.n_new = 2;
  std::vector<std::int32_t> whole2(whole);
  whole2.insert(whole2.end(), g2.tokens.begin(), g2.tokens.end());
  whole2.insert(whole2.end(), p2.begin(), p2.end());  // the quiet turn's prompt
  whole2.insert(whole2.end(), p1.begin(), p1.end());
  fresh.prompt = whole2, fresh.n_new = 2;
  const cli::generation g4 = s.submit(after);
  BOOST_TEST(g4.tokens == cli::host_generate(test::builtin_tiny(), fresh).tokens);
  BOOST_TEST(g4.session_tokens == 25);
  BOOST_TEST(s.sessions() == 2u);
  // Refusals, each naming the session.
  auto status_of = [&](const cli::run_request& r, const std::string& text) {
    try {
      s.submit(r);
    } catch (const cli::session_error& ex) {
      BOOST_TEST(std::string(ex.what()).find(text) != std::string::npos, ex.what());
      return ex.status;
    }
    return 200;
  };
  cli::run_request unknown = t2;
  unknown.session = "nobody";
  BOOST_TEST(status_of(unknown, "no session 'nobody'") == 404);
  BOOST_TEST(status_of(t1, "session 'chat' exists") == 409);
  cli::run_request too_long = t2;
  too_long.n_new = 200;
  BOOST_TEST(status_of(too_long, "session 'chat' holds 25 tokens") == 400);
  cli::run_request unnamed = t2;
  unnamed.session.clear();
  BOOST_TEST(test::throws_with([&] { s.submit(unnamed); }, "must name it"));
  // A running turn makes its session busy: its own on_token asks for another turn of it.
  // (Recorded on the scheduler's thread, checked on the test's.)
  cli::run_request busy = t2;
  int busy_status = 0;
  std::string busy_message;
  busy.on_token = [&](std::int32_t) {
    if (busy_status) return;
    try {
      s.submit(t2);
      busy_status = 200;
    } catch (const cli::session_error& ex) {
      busy_status = ex.status, busy_message = ex.what();
    }
  };
  s.submit(busy);
  BOOST_TEST(busy_status == 409);
  BOOST_TEST(busy_message.find("session 'chat' has a turn queued or running") != std::string::npos, busy_message);
  // Eviction: both slots hold idle sessions ("ced" used least recently); a request without a
  // session takes "ced"'s slot, and "chat" goes on.
  const int releases_before = e.releases.load();
  cli::run_request plain = t1;
  plain.session.clear();
  BOOST_TEST(s.submit(plain).tokens == cli::host_generate(test::builtin_tiny(), plain).tokens);
  BOOST_TEST(s.stats().sessions_evicted == 1);
  BOOST_TEST(e.releases.load() == releases_before + 2);  // "ced", then the plain request's own
  cli::run_request ced_again = c2;
  BOOST_TEST(status_of(ced_again, "evicted") == 404);
  BOOST_TEST(status_of(t2, "") == 200);
  // A failed turn closes its session; close_session releases an idle one.
  e.fail_next_step = true;
  BOOST_TEST(test::throws_with([&] { s.submit(t2); }, "gated_engine: a failed step"));
  BOOST_TEST(status_of(t2, "no session 'chat'") == 404);
  cli::run_request other = t1;
  other.session = "other";
  s.submit(other);
  BOOST_TEST(s.sessions() == 1u);
  BOOST_TEST(test::throws_with([&] { s.close_session("nobody"); }, "no session 'nobody'"));
  s.close_session("other");
  BOOST_TEST(s.sessions() == 0u);
  wait_until([&] { return e.releases.load() == e.starts.load(); });  // every sequence back in the pool
}

// Sessions on a drafting engine: each turn's tokens and draft counts are those of a fresh drafted
// request for the whole conversation so far (an exact turn, a CED turn, a turn of no tokens, and
// one after it). That the counts match, round for round, says the drafter's state after the
// append is the fresh prefill's (its rings, and the rows it has not yet seen); each answer counts
// its own turn's rounds only.
BOOST_AUTO_TEST_CASE(drafting_sessions_give_a_fresh_drafted_requests_tokens_and_counts) {
  std::ostringstream quiet;
  io::checkpoint ck = cli::detail::open_tiny_checkpoint("", quiet);
  const model::dspark_weights w = model::dspark_weights_of<models::tiny>(ck);
  cli::batch_scheduler s(
      std::make_unique<cli::host_engine>(test::builtin_tiny(), cli::engine_limits{2, 64, 64}, &w));
  BOOST_TEST(s.sessions_possible());
  const std::vector<std::int32_t> p1{3, 14}, p2{65, 35, 89}, p3{79, 32, 38, 46};
  std::vector<std::int32_t> conversation;
  auto turn = [&](const std::vector<std::int32_t>& prompt, long long n_new, bool ced, bool first, const std::string& what) {
    cli::run_request r;
    r.prompt = prompt, r.n_new = n_new, r.ced = ced, r.sampling = {0.8f, 40, 0.95f, 21}, r.session = "d";
    r.continue_session = !first;
    const cli::generation g = s.submit(r);
    conversation.insert(conversation.end(), prompt.begin(), prompt.end());
    cli::run_request fresh = r;
    fresh.prompt = conversation, fresh.session.clear(), fresh.continue_session = false, fresh.ced = false, fresh.dspark = &w;
    const cli::generation alone = cli::host_generate(test::builtin_tiny(), fresh);
    BOOST_TEST(g.tokens == alone.tokens, what);
    BOOST_TEST(g.speculative.rounds == alone.speculative.rounds, what);
    BOOST_TEST(g.speculative.drafted == alone.speculative.drafted, what);
    BOOST_TEST(g.speculative.accepted == alone.speculative.accepted, what);
    BOOST_TEST(g.speculative.accepted_at == alone.speculative.accepted_at, what);
    BOOST_TEST(g.session_tokens == (long long)conversation.size() + n_new, what);
    conversation.insert(conversation.end(), g.tokens.begin(), g.tokens.end());
    return g;
  };
  BOOST_TEST(turn(p1, 3, false, true, "turn 1").speculative.rounds > 0);
  BOOST_TEST(turn(p2, 4, false, false, "turn 2 (exact)").speculative.rounds > 0);
  // The CED turn's append ends at 16 tokens, tiny's window: within it a CED append is the exact one
  // bit for bit (beyond it the decoder's replay differs from exact decoding by design).
  BOOST_REQUIRE(conversation.size() + p3.size() <= std::size_t(models::tiny::dims.attn.window_size));
  BOOST_TEST(turn(p3, 7, true, false, "turn 3 (CED)").speculative.rounds > 0);
  turn(p2, 0, false, false, "turn 4 (no tokens)");
  BOOST_TEST(turn(p1, 6, false, false, "turn 5").speculative.rounds > 0);
}

// What never reached a session leaves it as it was: a turn whose client went away while it was
// queued (the session goes on, and its next turn gives what it would have without that one); a
// request without a session whose client went away does not evict an idle session for nothing; a
// turn with nothing to append is refused, and the session stays.
BOOST_AUTO_TEST_CASE(sessions_survive_what_never_reached_them) {
  gate g;
  g.release();
  auto engine = std::make_unique<gated_engine>(2, g.f);
  gated_engine& e = *engine;
  cli::batch_scheduler s(std::move(engine), {.max_queued = 0});
  const std::vector<std::int32_t> p1{11, 12, 13}, p2{21, 22};
  cli::run_request a1;
  a1.prompt = p1, a1.n_new = 3, a1.sampling.seed = 4, a1.session = "a";
  cli::run_request b1 = a1;
  b1.session = "b";
  s.submit(a1), s.submit(b1);  // both slots hold idle sessions
  cli::run_request gone = a1;
  gone.prompt = p2, gone.continue_session = true, gone.cancelled = [] { return true; };
  const cli::generation cancelled = s.submit(gone);
  BOOST_TEST(cancelled.cancelled);
  BOOST_TEST(cancelled.tokens.empty());
  cli::run_request plain_gone = a1;
  plain_gone.session.clear(), plain_gone.cancelled = [] { return true; };
  BOOST_TEST(s.submit(plain_gone).cancelled);
  BOOST_TEST(s.stats().sessions_evicted == 0);
  BOOST_TEST(s.sessions() == 2u);
  cli::run_request a2 = gone;
  a2.cancelled = {};
  BOOST_TEST(s.submit(a2).tokens == by_hand(p1, 3, p2, 3, false, a1.sampling));  // as if the cancelled turn never was
  // Nothing to append: a turn of no tokens, then an empty one.
  cli::run_request quiet = a2;
  quiet.n_new = 0;
  s.submit(quiet);
  cli::run_request empty = a2;
  empty.prompt = {};
  BOOST_TEST(test::throws_with([&] { s.submit(empty); }, "session 'a': a turn with no prompt after a turn that drew no token"));
  BOOST_TEST(s.sessions() == 2u);
  cli::run_request unknown = a2;
  unknown.session = "c";
  BOOST_TEST(test::throws_with([&] { s.submit(unknown); }, "no session 'c'"));
  BOOST_TEST(e.releases.load() + 2 == e.starts.load());  // (the plain request never started)
}

BOOST_AUTO_TEST_SUITE_END()
