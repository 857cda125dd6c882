#pragma once
//! \file
//! Serving several requests at once: a `batch_scheduler` owns a `sequence_engine` (generate.hpp)
//! and one thread that runs it, and callers on any thread `submit` a request and wait for its
//! tokens. Between decode steps the scheduler admits queued requests while the engine has room
//! (each one's prefill and first token), then runs one decode step of every sequence still
//! drawing, so requests that arrive together are decoded together (continuous batching: a request
//! joins or leaves the batch at any step). A request whose `cancelled` says stop leaves at the next
//! step; a full queue refuses new requests at once (`server_busy`). With a drafting engine a step
//! is a speculative round of every sequence and gives each 1 .. block + 1 tokens (never more than
//! it still wants); the request's answer carries the drafts' counts. `host_engine` is the host
//! reference as an engine (each sequence's logits computed on their own, so every request gets
//! `dsv4 run`'s tokens whatever else is in the batch, with or without drafts).

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "dsv4/apps/generate.hpp"
#include "dsv4/core/error.hpp"

namespace dsv4::cli {

//! A request refused because the scheduler's queue is full (a server answers 503).
struct server_busy : error {
  using error::error;
};

//! A session request that cannot be served as asked; `status` is the HTTP answer: 404 an unknown
//! session, 409 a session that is busy or a name that is taken, 400 a turn too long for it.
struct session_error : error {
  int status;
  session_error(int status_code, const std::string& message) : error(message), status(status_code) {}
};

//! The host reference backend as a sequence_engine: one host_sequence per handle; with DSpark
//! weights, each step is one speculative round of every sequence (model::speculative_decoder).
class host_engine final : public sequence_engine {
 public:
  //! `drafter` (may be null: plain decoding) must outlive the engine.
  host_engine(const model::host_model<models::tiny>& m, const engine_limits& lim,
              const model::dspark_weights* drafter = nullptr)
      : m_(m), drafter_(drafter), sequences_(std::size_t(std::max(lim.max_sequences, 0))),
        max_tokens_(std::min<long long>(lim.sequence_tokens(), models::tiny::dims.rope.max_position_embeddings)) {
    if (lim.max_sequences < 1) throw error("host_engine: max_sequences must be >= 1");
  }
  std::string device() const override { return drafter_ ? "host reference backend, DSpark drafts" : "host reference backend"; }
  int capacity() const override { return int(sequences_.size()); }
  int draft_block() const override { return drafter_ ? drafter_->block : 0; }
  long long max_sequence_tokens() const override { return max_tokens_; }
  bool can_resume() const override { return true; }
  //! A session's turn: the chunk fed exact or CED (with drafts: speculative_decoder::resume, which
  //! also gives the drafter the chunk's rows).
  std::int32_t resume(int handle, std::span<const std::int32_t> chunk, bool ced,
                      const kernels::sampling::sampling_params& sp) override {
    slot& s = sequence(handle);
    if (s.seq.length + static_cast<long long>(chunk.size()) > max_tokens_)
      throw error("host_engine: sequence " + std::to_string(handle) + " holds " + std::to_string(s.seq.length) + " tokens; " +
                  std::to_string(chunk.size()) + " more exceed its " + std::to_string(max_tokens_));
    if (s.drafts) return s.drafts->resume(chunk, ced ? model::prompt_prefill::ced : model::prompt_prefill::exact, sp);
    const auto logits = ced ? model::forward_ced(m_, s.seq, chunk) : model::forward(m_, s.seq, chunk);
    return kernels::sampling::sample_reference(logits, sp, 0, std::uint64_t(s.seq.length));
  }
  started start(std::span<const std::int32_t> prompt, bool ced,
                const kernels::sampling::sampling_params& sp) override {
    int h = 0;
    while (h < capacity() && sequences_[std::size_t(h)]) ++h;
    if (h == capacity())
      throw error("host_engine: all " + std::to_string(capacity()) + " sequences are in use");
    auto s = std::make_unique<slot>();
    std::int32_t first;
    if (drafter_) {
      s->drafts.emplace(m_, *drafter_, s->seq, sp);
      first = s->drafts->start(prompt, ced ? model::prompt_prefill::ced : model::prompt_prefill::exact);
    } else {
      const auto logits = ced ? model::forward_ced(m_, s->seq, prompt) : model::forward(m_, s->seq, prompt);
      first = kernels::sampling::sample_reference(logits, sp, 0, std::uint64_t(s->seq.length));
    }
    sequences_[std::size_t(h)] = std::move(s);
    return {h, first};
  }
  std::vector<std::vector<std::int32_t>> step(std::span<const int> handles, std::span<const std::int32_t> ids,
                                              std::span<const kernels::sampling::sampling_params> sp,
                                              std::span<const long long> budget) override {
    std::vector<std::vector<std::int32_t>> next(handles.size());
    for (std::size_t i = 0; i < handles.size(); ++i) {
      slot& s = sequence(handles[i]);
      if (s.drafts) {  // (the decoder feeds the last token it returned: ids[i])
        next[i] = s.drafts->round(budget[i]);
        continue;
      }
      const auto logits = model::forward(m_, s.seq, ids.subspan(i, 1));
      next[i] = {kernels::sampling::sample_reference(logits, sp[i], 0, std::uint64_t(s.seq.length))};
    }
    return next;
  }
  model::speculative_stats drafts(int handle) const override {
    const slot& s = sequence(handle);
    return s.drafts ? s.drafts->stats() : model::speculative_stats{};
  }
  void release(int handle) override {
    sequence(handle);  // (a clear error for a handle that is not live)
    sequences_[std::size_t(handle)].reset();
  }

 private:
  struct slot {  // (held by pointer: the decoder refers to seq)
    model::host_sequence seq;
    std::optional<model::speculative_decoder<models::tiny>> drafts;
  };
  const model::host_model<models::tiny>& m_;
  const model::dspark_weights* drafter_;
  std::vector<std::unique_ptr<slot>> sequences_;
  long long max_tokens_;
  const slot& sequence(int h) const {
    if (h < 0 || h >= capacity() || !sequences_[std::size_t(h)])
      throw error("host_engine: no sequence " + std::to_string(h));
    return *sequences_[std::size_t(h)];
  }
  slot& sequence(int h) { return const_cast<slot&>(std::as_const(*this).sequence(h)); }
};

//! How many requests a batch_scheduler lets wait.
struct batch_options {
  int max_queued = 64;  //!< requests waiting for room in the engine; more are refused (server_busy)
};

class batch_scheduler {
 public:
  using options = batch_options;
  //! What the scheduler has done so far.
  struct statistics {
    long long requests = 0;      //!< finished (answered, cancelled or failed)
    long long steps = 0;         //!< decode steps run
    long long stepped_rows = 0;  //!< sequences in them, summed
    long long stepped_tokens = 0;  //!< tokens they drew (more than stepped_rows where drafts were accepted)
    int largest_batch = 0;       //!< the most sequences one step ran
    long long sessions_evicted = 0;  //!< idle sessions released to make room for new requests
  };

  explicit batch_scheduler(std::unique_ptr<sequence_engine> engine, options o = {})
      : engine_(std::move(engine)), options_(o) {
    if (!engine_) throw error("batch_scheduler: no engine");
    if (engine_->capacity() < 1) throw error("batch_scheduler: the engine holds no sequence (capacity < 1)");
    if (o.max_queued < 0) throw error("batch_scheduler: max_queued must be >= 0");
    capacity_ = engine_->capacity();
    device_ = engine_->device();
    draft_block_ = engine_->draft_block();
    sessions_possible_ = engine_->can_resume();
    max_sequence_tokens_ = engine_->max_sequence_tokens();
    unheld_.reserve(std::size_t(capacity_));
    thread_ = std::thread([this] { loop(); });
  }
  //! Stops the thread; requests still queued or running get an error, and it waits until their
  //! callers have left submit() (the mutex they wake on lives here).
  ~batch_scheduler() {
    std::unique_lock lk(mu_);
    stopping_ = true;
    lk.unlock();
    work_.notify_all();
    thread_.join();
    lk.lock();
    done_.wait(lk, [&] { return submitters_ == 0; });
  }
  batch_scheduler(const batch_scheduler&) = delete;
  batch_scheduler& operator=(const batch_scheduler&) = delete;

  std::string device() const { return device_; }
  int capacity() const { return capacity_; }
  //! The engine's draft block (0: it decodes plainly).
  int draft_block() const { return draft_block_; }
  //! Requests waiting for room in the engine now.
  std::size_t queued() const {
    std::lock_guard lk(mu_);
    return queue_.size();
  }
  statistics stats() const {
    std::lock_guard lk(mu_);
    return stats_;
  }
  //! Whether requests may keep sessions (the engine can continue a sequence).
  bool sessions_possible() const { return sessions_possible_; }
  //! The most tokens a session holds over its turns.
  long long max_sequence_tokens() const { return max_sequence_tokens_; }
  //! Sessions alive now (idle or with a turn queued or running).
  std::size_t sessions() const {
    std::lock_guard lk(mu_);
    return sessions_.size();
  }
  //! The session_error submit(r) would throw for r.session now, if any (a server that streams its
  //! answer asks first, to answer with the error's status; submit() checks again).
  void check_session(const run_request& r) const {
    if (r.session.empty() && r.continue_session) throw session_error(400, "a request that continues a session must name it");
    if (r.session.empty()) return;
    std::lock_guard lk(mu_);
    check_session_locked(r);
  }
  //! Closes an idle session: its sequence goes back to the engine's pool. session_error 404 if
  //! there is none of that name, 409 while a turn of it is queued or running.
  void close_session(const std::string& name) {
    std::lock_guard lk(mu_);
    const auto it = sessions_.find(name);
    if (it == sessions_.end()) throw session_error(404, "no session '" + name + "' (never created, closed, or evicted)");
    if (it->second.busy) throw session_error(409, "session '" + name + "' has a turn queued or running; close it after its answer");
    if (it->second.handle >= 0) unheld_.push_back(it->second.handle);
    sessions_.erase(it);
    work_.notify_all();
  }

  //! Runs `r` among the others and returns its generation (tokens, times; `cancelled`, with no
  //! tokens if it had not started, if r.cancelled said stop first). Blocks until then. Throws
  //! server_busy when max_queued requests already wait beyond the engine's free room,
  //! session_error when r.session cannot be served as asked, and the engine's error if the
  //! request failed. `r` and what it refers to must stay valid until it returns; r.cancelled and
  //! r.on_token are called on the scheduler's thread (an exception from them fails this request
  //! only).
  //!
  //! Sessions (r.session): a new one keeps its sequence after the answer; a continued one appends
  //! its prompt to that sequence. A session's sequence holds an engine slot while idle, and the
  //! least recently used idle session is released (evicted) when a new request needs the slot; a
  //! turn that fails, or is cancelled after it started, closes its session (the sequence's state
  //! is not known then); one cancelled while queued leaves the session as it was.
  generation submit(const run_request& r) {
    job j{&r};
    std::unique_lock lk(mu_);
    if (stopping_) throw error("batch_scheduler: stopping");
    if (r.session.empty() && r.continue_session) throw session_error(400, "a request that continues a session must name it");
    if (!r.session.empty()) reserve_session(r);  // (a session's own problems before the server's load)
    const std::size_t room = std::size_t(capacity_ - running_);  // taken at the next admission
    if (queue_.size() >= room + std::size_t(options_.max_queued)) {
      if (!r.session.empty()) unreserve_session(r);
      throw server_busy("the server is busy: " + std::to_string(running_) + " requests running, " +
                        std::to_string(queue_.size()) + " waiting (at most " +
                        std::to_string(options_.max_queued) + " beyond the " + std::to_string(capacity_) +
                        " that run together)");
    }
    queue_.push_back(&j);
    ++submitters_;
    work_.notify_all();
    done_.wait(lk, [&] { return j.done; });
    --submitters_;
    if (submitters_ == 0) done_.notify_all();  // a destructor may wait for this
    if (j.failure) std::rethrow_exception(j.failure);
    return std::move(j.result);
  }

 private:
  using clock = std::chrono::steady_clock;
  struct job {
    const run_request* request;
    generation result{};
    std::exception_ptr failure{};
    bool done = false;
    bool admitted = false;  //!< counted in running_
    int handle = -1;
    clock::time_point decode_start{};
    bool session_untouched = false;  //!< a session's turn that ended before it appended anything
    model::speculative_stats drafts_before{};  //!< a session turn's: the sequence's counts before it
  };
  //! A session's sequence between and during its turns.
  struct session {
    int handle = -1;           //!< the engine's sequence (-1 until its first turn has started)
    bool busy = true;          //!< a turn is queued or running
    bool has_pending = false;  //!< the last token returned was never fed (the next turn feeds it first)
    std::int32_t pending = 0;
    long long tokens = 0;      //!< every prompt and generated token of its finished turns
    std::uint64_t used = 0;    //!< when its last turn finished (least recently used goes first)
  };

  std::unique_ptr<sequence_engine> engine_;
  options options_;
  int capacity_ = 0;
  int draft_block_ = 0;
  std::string device_;
  int running_ = 0;     //!< admitted and not finished (under mu_)
  int submitters_ = 0;  //!< callers inside submit() (under mu_)
  bool sessions_possible_ = false;
  long long max_sequence_tokens_ = 0;
  int held_ = 0;                              //!< engine sequences alive (under mu_)
  std::map<std::string, session> sessions_;   //!< under mu_
  std::vector<int> unheld_;                   //!< closed or evicted sessions' sequences to release (under mu_)
  std::uint64_t turns_ = 0;                   //!< finished session turns, the LRU clock (under mu_)
  mutable std::mutex mu_;
  std::condition_variable work_, done_;
  std::deque<job*> queue_;
  bool stopping_ = false;
  statistics stats_;
  std::thread thread_;

  //! Under mu_: the session_error r.session has now, if any.
  void check_session_locked(const run_request& r) const {
    const std::string& name = r.session;
    if (!sessions_possible_)
      throw session_error(400, "this server keeps no sessions: " + device_ + " cannot continue a sequence");
    const long long turn = static_cast<long long>(r.prompt.size()) + std::max(r.n_new, 0LL);
    const auto it = sessions_.find(name);
    if (r.continue_session) {
      if (it == sessions_.end())
        throw session_error(404, "no session '" + name + "' (never created, closed, or evicted to make room for other "
                                 "requests): send the whole conversation as a new session");
      const session& s = it->second;
      if (s.busy) throw session_error(409, "session '" + name + "' has a turn queued or running; send the next after its answer");
      if (r.prompt.empty() && !s.has_pending)
        throw session_error(400, "session '" + name + "': a turn with no prompt after a turn that drew no token has nothing to append");
      if (s.tokens + turn > max_sequence_tokens_)
        throw session_error(400, "session '" + name + "' holds " + std::to_string(s.tokens) + " tokens; this turn's " +
                                     std::to_string(r.prompt.size()) + " prompt and " + std::to_string(r.n_new) +
                                     " generated tokens would exceed the " + std::to_string(max_sequence_tokens_) +
                                     " a session holds");
      return;
    }
    if (it != sessions_.end())
      throw session_error(409, "session '" + name + "' exists: continue it (\"continue\": true) or close it first");
    if (turn > max_sequence_tokens_)
      throw session_error(400, "a session holds at most " + std::to_string(max_sequence_tokens_) + " tokens; this turn has " +
                                   std::to_string(turn));
  }
  //! Under mu_: checks r.session and marks it busy (a new one: created).
  void reserve_session(const run_request& r) {
    check_session_locked(r);
    if (r.continue_session) sessions_.at(r.session).busy = true;
    else sessions_.emplace(r.session, session{});
  }
  //! Under mu_: undoes reserve_session(r) for a request that was not queued after all.
  void unreserve_session(const run_request& r) {
    const auto it = sessions_.find(r.session);
    if (it == sessions_.end()) return;
    if (r.continue_session) it->second.busy = false;
    else sessions_.erase(it);
  }

  //! Releases an engine sequence (on the scheduler's thread).
  void release(int handle) {
    try {
      engine_->release(handle);
    } catch (...) {  // a sequence that cannot be released leaves the engine short of one slot
    }
    std::lock_guard lk(mu_);
    --held_;
  }

  void finish(job* j) {
    const run_request& r = *j->request;
    // A session keeps its sequence after a turn that ended well; one that failed or was cancelled
    // leaves the sequence in a state nobody knows, so it goes.
    const bool keep = !r.session.empty() && !j->failure && !j->result.cancelled && j->handle >= 0;
    // (a session's turn cancelled while queued never touched its sequence: the session stays)
    if (j->session_untouched) j->handle = -1;
    if (j->handle >= 0) {
      try {
        if (const int block = engine_->draft_block(); block > 0)
          j->result.draft_block = block, j->result.speculative = engine_->drafts(j->handle).since(j->drafts_before);
      } catch (...) {  // (the counts are a report; the tokens stand without them)
      }
      if (!keep) release(j->handle);
    }
    if (j->decode_start != clock::time_point{})
      j->result.decode_s = std::chrono::duration<double>(clock::now() - j->decode_start).count();
    {
      std::lock_guard lk(mu_);
      if (!r.session.empty()) {
        if (const auto it = sessions_.find(r.session); it != sessions_.end()) {
          session& s = it->second;
          if (j->session_untouched) {
            s.busy = false;
          } else if (keep) {
            s.handle = j->handle, s.busy = false, s.used = ++turns_;
            s.has_pending = !j->result.tokens.empty();
            if (s.has_pending) s.pending = j->result.tokens.back();
            s.tokens += static_cast<long long>(r.prompt.size() + j->result.tokens.size());
            j->result.session_tokens = s.tokens;
          } else {
            if (s.handle >= 0 && s.handle != j->handle) unheld_.push_back(s.handle);  // (a turn that never resumed)
            sessions_.erase(it);
          }
        }
      }
      j->handle = -1;
      if (j->admitted) --running_;
      j->done = true;
      ++stats_.requests;
    }
    done_.notify_all();
  }
  void fail(job* j, std::exception_ptr e) {
    j->failure = e;
    finish(j);
  }

  //! Prefill (or a session's append) and first token; false if the job is finished already.
  bool admit(job* j) {
    const run_request& r = *j->request;
    j->result.device = device_;
    try {
      j->result.tokens.reserve(std::size_t(std::max<long long>(r.n_new, 0)));
      if (stop_requested(r)) {  // gave up while queued: no prefill, no tokens
        j->result.cancelled = true;
        j->session_untouched = r.continue_session;  // (its session goes on as it was)
        finish(j);
        return false;
      }
      const auto t0 = clock::now();
      std::int32_t first;
      if (j->handle >= 0) {  // a session's next turn: its last token (never fed), then the prompt
        std::vector<std::int32_t> chunk;
        {
          std::lock_guard lk(mu_);
          const session& s = sessions_.at(r.session);
          if (s.has_pending) chunk.push_back(s.pending);
        }
        chunk.insert(chunk.end(), r.prompt.begin(), r.prompt.end());
        if (draft_block_ > 0) j->drafts_before = engine_->drafts(j->handle);  // (the answer counts this turn's)
        first = engine_->resume(j->handle, chunk, r.ced, r.sampling);
      } else {
        const sequence_engine::started s = engine_->start(r.prompt, r.ced, r.sampling);
        {
          std::lock_guard lk(mu_);
          ++held_;
        }
        j->handle = s.handle, first = s.token;
      }
      j->decode_start = clock::now();
      j->result.prefill_s = std::chrono::duration<double>(j->decode_start - t0).count();
      if (r.n_new > 0) {
        j->result.tokens.push_back(first);
        if (r.on_token) r.on_token(first);
      }
    } catch (...) {  // the engine's start, or the request's own callbacks
      fail(j, std::current_exception());
      return false;
    }
    if ((long long)j->result.tokens.size() >= r.n_new) {
      finish(j);
      return false;
    }
    return true;
  }

  //! A request's client went away (its cancel callback, which must not block, says so or throws).
  static bool gone(const run_request& r) {
    try {
      return stop_requested(r);
    } catch (...) {
      return true;  // (admit() asks again and fails the request with the callback's error)
    }
  }

  //! Under mu_: a queued request can be admitted now (see loop()).
  bool admissible() const {
    int free = capacity_ - held_ + int(unheld_.size()), idle = 0;
    for (const auto& [name, s] : sessions_) idle += !s.busy && s.handle >= 0;
    for (const job* j : queue_) {
      if (j->request->continue_session) return true;
      if (free > 0 || idle > 0) return true;
    }
    return false;
  }
  //! Under mu_: the least recently used idle session is closed and its sequence returned for
  //! release (-1 if every session is busy).
  int evict_one() {
    auto victim = sessions_.end();
    for (auto it = sessions_.begin(); it != sessions_.end(); ++it)
      if (!it->second.busy && it->second.handle >= 0 && (victim == sessions_.end() || it->second.used < victim->second.used))
        victim = it;
    if (victim == sessions_.end()) return -1;
    const int h = victim->second.handle;
    sessions_.erase(victim);
    ++stats_.sessions_evicted;
    return h;
  }

  // No allocation outside a try in the loop: its vectors are reserved to the engine's capacity and
  // a job's tokens to its count at admission, so an exception can only come from the engine or a
  // request's callbacks, and fails those requests instead of ending the thread.
  void loop() {
    std::vector<job*> active, arrivals;
    std::vector<int> handles;
    std::vector<std::int32_t> ids;
    std::vector<kernels::sampling::sampling_params> sampling;
    std::vector<long long> budget;
    for (auto* v : {&active, &arrivals}) v->reserve(std::size_t(capacity_));
    handles.reserve(std::size_t(capacity_)), ids.reserve(std::size_t(capacity_)),
        sampling.reserve(std::size_t(capacity_)), budget.reserve(std::size_t(capacity_));
    std::vector<int> releases;  // (evicted and closed sessions: at most every slot twice over)
    releases.reserve(2 * std::size_t(capacity_));
    for (;;) {
      arrivals.clear();
      releases.clear();
      {
        std::unique_lock lk(mu_);
        work_.wait(lk, [&] { return stopping_ || !unheld_.empty() || admissible() || !active.empty(); });
        if (stopping_) {
          arrivals.assign(queue_.begin(), queue_.end());
          queue_.clear();
          lk.unlock();
          for (job* j : active)
            fail(j, std::make_exception_ptr(error("batch_scheduler: the server is stopping")));
          for (job* j : arrivals)
            fail(j, std::make_exception_ptr(error("batch_scheduler: the server is stopping")));
          return;
        }
        // In arrival order, each request that can run now: a session's next turn always (its
        // sequence is held), a new sequence where the engine has a free slot or an idle session
        // can be evicted for it. One that cannot waits without holding up those behind it.
        int free = capacity_ - held_ + int(unheld_.size());  // (closed sessions' sequences are released below)
        for (auto it = queue_.begin(); it != queue_.end() && int(active.size() + arrivals.size()) < capacity_;) {
          job* j = *it;
          if (j->request->continue_session) {
            j->handle = sessions_.at(j->request->session).handle;
          } else if (free > 0) {
            --free;
          } else if (gone(*j->request)) {
            // admitted without a slot: admit() finishes it as cancelled before it needs one (and
            // an idle session is not evicted for a client that went away)
          } else if (const int h = evict_one(); h >= 0) {
            releases.push_back(h);
          } else {
            ++it;
            continue;
          }
          it = queue_.erase(it);
          arrivals.push_back(j);
          j->admitted = true;
          ++running_;
        }
        releases.insert(releases.end(), unheld_.begin(), unheld_.end());
        unheld_.clear();
      }
      for (const int h : releases) release(h);
      for (job* j : arrivals)
        if (admit(j)) active.push_back(j);
      // Requests whose client went away leave before the step (as run_generation_drawing stops).
      std::erase_if(active, [&](job* j) {
        try {
          if (!stop_requested(*j->request)) return false;
          j->result.cancelled = true;
          finish(j);
        } catch (...) {
          fail(j, std::current_exception());
        }
        return true;
      });
      if (active.empty()) continue;
      handles.clear(), ids.clear(), sampling.clear(), budget.clear();
      for (job* j : active) {
        handles.push_back(j->handle);
        ids.push_back(j->result.tokens.back());
        sampling.push_back(j->request->sampling);
        budget.push_back(j->request->n_new - (long long)j->result.tokens.size());
      }
      std::vector<std::vector<std::int32_t>> next;
      long long drawn = 0;
      try {
        next = engine_->step(handles, ids, sampling, budget);
        if (next.size() != active.size())
          throw error("batch_scheduler: the engine returned tokens for " + std::to_string(next.size()) + " sequences of " +
                      std::to_string(active.size()));
        for (std::size_t i = 0; i < next.size(); ++i) {
          if (next[i].empty() || (long long)next[i].size() > budget[i])
            throw error("batch_scheduler: the engine returned " + std::to_string(next[i].size()) + " tokens for a sequence that wants " +
                        std::to_string(budget[i]) + " (1 .. that many)");
          drawn += (long long)next[i].size();
        }
      } catch (...) {  // the step's sequences cannot go on
        const auto e = std::current_exception();
        for (job* j : active) fail(j, e);
        active.clear();
        continue;
      }
      {
        std::lock_guard lk(mu_);
        ++stats_.steps;
        stats_.stepped_rows += (long long)active.size();
        stats_.stepped_tokens += drawn;
        stats_.largest_batch = std::max(stats_.largest_batch, int(active.size()));
      }
      for (std::size_t i = 0; i < active.size(); ++i) {
        job* j = active[i];
        for (const std::int32_t t : next[i]) {
          j->result.tokens.push_back(t);
          try {
            if (j->request->on_token && !j->failure) j->request->on_token(t);
          } catch (...) {
            j->failure = std::current_exception();
          }
        }
      }
      std::erase_if(active, [&](job* j) {
        if (!j->failure && (long long)j->result.tokens.size() < j->request->n_new) return false;
        finish(j);
        return true;
      });
    }
  }
};

}  // namespace dsv4::cli
