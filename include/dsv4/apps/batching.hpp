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

//! The host reference backend as a sequence_engine: one host_sequence per handle; with DSpark
//! weights, each step is one speculative round of every sequence (model::speculative_decoder).
class host_engine final : public sequence_engine {
 public:
  //! `drafter` (may be null: plain decoding) must outlive the engine.
  host_engine(const model::host_model<models::tiny>& m, const engine_limits& lim,
              const model::dspark_weights* drafter = nullptr)
      : m_(m), drafter_(drafter), sequences_(std::size_t(std::max(lim.max_sequences, 0))) {
    if (lim.max_sequences < 1) throw error("host_engine: max_sequences must be >= 1");
  }
  std::string device() const override { return drafter_ ? "host reference backend, DSpark drafts" : "host reference backend"; }
  int capacity() const override { return int(sequences_.size()); }
  int draft_block() const override { return drafter_ ? drafter_->block : 0; }
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
  };

  explicit batch_scheduler(std::unique_ptr<sequence_engine> engine, options o = {})
      : engine_(std::move(engine)), options_(o) {
    if (!engine_) throw error("batch_scheduler: no engine");
    if (engine_->capacity() < 1) throw error("batch_scheduler: the engine holds no sequence (capacity < 1)");
    if (o.max_queued < 0) throw error("batch_scheduler: max_queued must be >= 0");
    capacity_ = engine_->capacity();
    device_ = engine_->device();
    draft_block_ = engine_->draft_block();
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

  //! Runs `r` among the others and returns its generation (tokens, times; `cancelled`, with no
  //! tokens if it had not started, if r.cancelled said stop first). Blocks until then. Throws
  //! server_busy when max_queued requests already wait beyond the engine's free room, and the
  //! engine's error if the request failed. `r` and what it refers to must stay valid until it
  //! returns; r.cancelled and r.on_token are called on the scheduler's thread (an exception from
  //! them fails this request only).
  generation submit(const run_request& r) {
    job j{&r};
    std::unique_lock lk(mu_);
    if (stopping_) throw error("batch_scheduler: stopping");
    const std::size_t room = std::size_t(capacity_ - running_);  // taken at the next admission
    if (queue_.size() >= room + std::size_t(options_.max_queued))
      throw server_busy("the server is busy: " + std::to_string(running_) + " requests running, " +
                        std::to_string(queue_.size()) + " waiting (at most " +
                        std::to_string(options_.max_queued) + " beyond the " + std::to_string(capacity_) +
                        " that run together)");
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
  };

  std::unique_ptr<sequence_engine> engine_;
  options options_;
  int capacity_ = 0;
  int draft_block_ = 0;
  std::string device_;
  int running_ = 0;     //!< admitted and not finished (under mu_)
  int submitters_ = 0;  //!< callers inside submit() (under mu_)
  mutable std::mutex mu_;
  std::condition_variable work_, done_;
  std::deque<job*> queue_;
  bool stopping_ = false;
  statistics stats_;
  std::thread thread_;

  void finish(job* j) {
    if (j->handle >= 0) {
      try {
        if (const int block = engine_->draft_block(); block > 0)
          j->result.draft_block = block, j->result.speculative = engine_->drafts(j->handle);
      } catch (...) {  // (the counts are a report; the tokens stand without them)
      }
      try {
        engine_->release(j->handle);
      } catch (...) {  // a sequence that cannot be released leaves the engine short of one slot
      }
      j->handle = -1;
    }
    if (j->decode_start != clock::time_point{})
      j->result.decode_s = std::chrono::duration<double>(clock::now() - j->decode_start).count();
    {
      std::lock_guard lk(mu_);
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

  //! Prefill and first token; false if the job is finished already.
  bool admit(job* j) {
    const run_request& r = *j->request;
    j->result.device = device_;
    try {
      j->result.tokens.reserve(std::size_t(std::max<long long>(r.n_new, 0)));
      if (stop_requested(r)) {  // gave up while queued: no prefill, no tokens
        j->result.cancelled = true;
        finish(j);
        return false;
      }
      const auto t0 = clock::now();
      const sequence_engine::started s = engine_->start(r.prompt, r.ced, r.sampling);
      j->handle = s.handle;
      j->decode_start = clock::now();
      j->result.prefill_s = std::chrono::duration<double>(j->decode_start - t0).count();
      if (r.n_new > 0) {
        j->result.tokens.push_back(s.token);
        if (r.on_token) r.on_token(s.token);
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
    for (;;) {
      arrivals.clear();
      {
        std::unique_lock lk(mu_);
        work_.wait(lk, [&] { return stopping_ || !queue_.empty() || !active.empty(); });
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
        while (int(active.size() + arrivals.size()) < capacity_ && !queue_.empty()) {
          arrivals.push_back(queue_.front());
          queue_.pop_front();
          arrivals.back()->admitted = true;
          ++running_;
        }
      }
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
