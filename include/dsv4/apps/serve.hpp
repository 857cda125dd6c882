#pragma once
//! \file
//! The routes of `dsv4 serve`: a JSON API over one loaded model and one backend.
//!
//!   GET  /health       {"status": "ok"}
//!   GET  /v1/model     the model's name, vocabulary, position limit, backend
//!   POST /v1/generate  {"prompt": [ids], "max_tokens": 16, "temperature": 1.0, "top_k": 0,
//!                       "top_p": 1.0, "seed": 0, "prefill": "exact" | "ced", "stream": false}
//!                      -> {"tokens": [...], "prompt_tokens", "generated_tokens",
//!                          "prefill_seconds", "decode_seconds", "backend"}, and where the server
//!                          drafts (--speculative dspark) "speculative": {"draft_block",
//!                          "rounds", "drafted", "accepted"}: the same tokens, the drafts' counts
//!                      "session": "name" keeps the conversation's sequence after the answer, and
//!                      "session": "name", "continue": true sends its next turn: "prompt" is then
//!                      only the new tokens, appended after the session's (no prefill of the
//!                      history); the answer adds "session": {"id", "tokens"} (tokens: the whole
//!                      conversation's so far). 404 for a session that is gone (never made,
//!                      closed, evicted for room, or its last turn failed), 409 for a taken name
//!                      or a session whose turn is still running.
//!   DELETE /v1/sessions/<name>  closes a session (its sequence goes back to the pool)
//!                      with "stream": true, server-sent events as the tokens are drawn:
//!                      data: {"token": id, "index": i} ... then data: {"done": true, <the above>}
//!
//! Only "prompt" is required. Every problem with a request body is a 400 whose message names the
//! field and what it must be; unknown fields are errors too (a misspelt "max_token" must not
//! silently generate 16 tokens). Tokens are drawn exactly as `dsv4 run` draws them. A client that
//! closes its connection while its tokens are drawn stops the generation at the next decode step.
//! Over a batch_scheduler (apps/batching.hpp) requests that arrive together are decoded together;
//! one that finds the scheduler's queue full gets a 503.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "dsv4/apps/batching.hpp"
#include "dsv4/apps/generate.hpp"
#include "dsv4/apps/http.hpp"
#include "dsv4/io/json.hpp"

namespace dsv4::serve {

struct service_limits {
  long long max_new_tokens = 4096;     //!< generated tokens per request (also caps the default of 16)
  long long max_prompt_tokens = 4096;  //!< prompt tokens per request (a request holds the only slot)
};

class generation_service {
 public:
  //! One generation at a time, each by `generate` on `m`; with `drafter` (which must outlive the
  //! service) every request drafts with it (run_request::dspark).
  generation_service(const model::host_model<models::tiny>& m, cli::generate_fn generate, std::string backend,
                     service_limits limits = {}, const model::dspark_weights* drafter = nullptr)
      : generate_([&m, g = std::move(generate), drafter](cli::run_request r) {
          r.dspark = drafter;
          return g(m, r);
        }),
        backend_(std::move(backend)),
        limits_(limits),
        draft_block_(drafter ? drafter->block : 0) {}
  //! Requests run by `scheduler` (which must outlive the service), decoded together (and drafted,
  //! where its engine drafts); sessions where its engine can continue a sequence.
  generation_service(cli::batch_scheduler& scheduler, std::string backend, service_limits limits = {})
      : generate_([&scheduler](const cli::run_request& r) { return scheduler.submit(r); }),
        backend_(std::move(backend)),
        limits_(limits),
        draft_block_(scheduler.draft_block()),
        scheduler_(&scheduler) {}

  http::response operator()(const http::request& r) const {
    const std::string path = r.target.substr(0, r.target.find('?'));
    if (path == "/health") {
      if (r.method != "GET") return wrong_method(r, "GET");
      return {200, "{\"status\": \"ok\"}"};
    }
    if (path == "/v1/model") {
      if (r.method != "GET") return wrong_method(r, "GET");
      constexpr auto c = models::tiny::dims;
      return {200, "{\"model\": " + http::json_string(models::tiny::name) + ", \"vocab_size\": " + std::to_string(c.vocab_size) +
                       ", \"max_positions\": " + std::to_string(c.rope.max_position_embeddings) +
                       ", \"backend\": " + http::json_string(backend_) + ", \"speculative\": " +
                       (draft_block_ > 0 ? "{\"drafter\": \"dspark\", \"draft_block\": " + std::to_string(draft_block_) + "}"
                                         : std::string("null")) +
                       ", \"sessions\": " +
                       (sessions_possible() ? "{\"max_tokens\": " + std::to_string(scheduler_->max_sequence_tokens()) +
                                                  ", \"open\": " + std::to_string(scheduler_->sessions()) + "}"
                                            : std::string("null")) +
                       "}"};
    }
    if (path == "/v1/generate") {
      if (r.method != "POST") return wrong_method(r, "POST");
      return generate(r.body, r.client_gone);
    }
    if (const std::string prefix = "/v1/sessions/"; path.compare(0, prefix.size(), prefix) == 0) {
      if (r.method != "DELETE") return wrong_method(r, "DELETE");
      const std::string name = path.substr(prefix.size());
      if (!sessions_possible()) return http::error_response(400, no_sessions());
      if (const std::string bad = bad_session_name(name); !bad.empty()) return http::error_response(400, bad);
      try {
        scheduler_->close_session(name);
      } catch (const cli::session_error& e) {
        return http::error_response(e.status, e.what());
      }
      return {200, "{\"closed\": " + http::json_string(name) + "}"};
    }
    return http::error_response(404, "no route " + r.method + " " + path +
                                         " (routes: GET /health, GET /v1/model, POST /v1/generate, DELETE /v1/sessions/<name>)");
  }

 private:
  std::function<cli::generation(const cli::run_request&)> generate_;
  std::string backend_;
  service_limits limits_;
  int draft_block_ = 0;  //!< the drafter's block where requests are drafted (0: plain decoding)
  cli::batch_scheduler* scheduler_ = nullptr;  //!< the batching service's (sessions live there)

  bool sessions_possible() const { return scheduler_ && scheduler_->sessions_possible(); }
  std::string no_sessions() const {
    return scheduler_ ? "this server keeps no sessions: its engine (" + scheduler_->device() +
                            ") cannot continue a sequence"
                      : std::string("this server keeps no sessions: they need the batching server (--max-batch 2 or more)");
  }
  //! Why `name` cannot name a session ("" if it can): 1 to 64 of A-Z a-z 0-9 . _ - (it goes in a URL path).
  static std::string bad_session_name(const std::string& name) {
    const bool ok = !name.empty() && name.size() <= 64 && std::all_of(name.begin(), name.end(), [](char ch) {
      return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '.' || ch == '_' || ch == '-';
    });
    return ok ? std::string() : "a session name is 1 to 64 of the characters A-Z a-z 0-9 . _ -, got " + http::json_string(name);
  }

  static http::response wrong_method(const http::request& r, const char* allowed) {
    return http::error_response(405, r.method + " " + r.target + ": this route takes " + allowed);
  }

  //! `client_gone` (may be empty): asked before the prefill and between decode steps; a client
  //! that went away (or shut down its sending side) stops the generation, freeing the slot for
  //! the next request, and is sent a 499.
  http::response generate(const std::string& body, const std::function<bool()>& client_gone) const {
    constexpr auto c = models::tiny::dims;
    io::json j;
    try {
      j = io::parse_json(body, "request body");
    } catch (const std::exception& e) {
      return http::error_response(400, e.what());
    }
    if (!j.is_object()) return http::error_response(400, "the request body must be a JSON object");
    std::vector<std::int32_t> prompt;
    cli::run_request req;
    long long max_tokens = std::min<long long>(16, limits_.max_new_tokens);  // the default, within the limit
    std::string prefill = "exact";
    bool stream = false;
    auto integer = [](const io::json& v, const std::string& field, long long lo, long long hi) {
      if (!v.is_number() || !v.integral || v.integer < lo || v.integer > hi)
        throw error("field '" + field + "' must be an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
      return v.integer;
    };
    auto number = [](const io::json& v, const std::string& field) {
      if (!v.is_number() || !std::isfinite(v.number())) throw error("field '" + field + "' must be a finite number");
      return v.number();
    };
    try {
      for (const auto& [key, v] : j.object()) {
        if (key == "prompt") {
          if (!v.is_array() || v.array().empty())
            throw error("field 'prompt' must be a non-empty array of token ids");
          for (std::size_t i = 0; i < v.array().size(); ++i)
            prompt.push_back(std::int32_t(integer(v.array()[i], "prompt[" + std::to_string(i) + "]", 0, c.vocab_size - 1)));
        } else if (key == "max_tokens") {
          max_tokens = integer(v, key, 0, limits_.max_new_tokens);
        } else if (key == "temperature") {
          const double t = number(v, key);
          if (t < 0) throw error("field 'temperature' must be >= 0 (0: greedy)");
          if (!std::isfinite(float(t))) throw error("field 'temperature' is too large (beyond float's range)");
          req.sampling.temperature = float(t);
        } else if (key == "top_k") {
          req.sampling.top_k = int(integer(v, key, 0, c.vocab_size));
        } else if (key == "top_p") {
          const double p = number(v, key);
          if (!(p > 0 && p <= 1) || !(float(p) > 0)) throw error("field 'top_p' must be in (0, 1] (and at least float's smallest value)");
          req.sampling.top_p = float(p);
        } else if (key == "seed") {
          req.sampling.seed = std::uint64_t(integer(v, key, 0, (1LL << 53)));
        } else if (key == "stream") {
          if (!std::holds_alternative<bool>(v.value)) throw error("field 'stream' must be true or false");
          stream = std::get<bool>(v.value);
        } else if (key == "session") {
          if (!v.is_string()) throw error("field 'session' must be a string (a session's name)");
          if (const std::string bad = bad_session_name(v.string()); !bad.empty()) throw error("field 'session': " + bad);
          req.session = v.string();
        } else if (key == "continue") {
          if (!std::holds_alternative<bool>(v.value)) throw error("field 'continue' must be true or false");
          req.continue_session = std::get<bool>(v.value);
        } else if (key == "prefill") {
          if (!v.is_string() || (v.string() != "exact" && v.string() != "ced"))
            throw error("field 'prefill' must be \"exact\" or \"ced\"");
          prefill = v.string();
        } else {
          throw error("unknown field '" + key +
                      "' (fields: prompt, max_tokens, temperature, top_k, top_p, seed, prefill, stream, session, continue)");
        }
      }
      if (prompt.empty()) throw error("field 'prompt' is required (an array of token ids)");
      if (req.continue_session && req.session.empty()) throw error("field 'continue' needs field 'session' (the session to continue)");
      if (!req.session.empty() && !sessions_possible()) throw error(no_sessions());
      if (static_cast<long long>(prompt.size()) > limits_.max_prompt_tokens)
        throw error("field 'prompt' has " + std::to_string(prompt.size()) + " tokens, this server takes at most " +
                    std::to_string(limits_.max_prompt_tokens));
      if (static_cast<long long>(prompt.size()) + max_tokens > c.rope.max_position_embeddings)
        throw error("prompt (" + std::to_string(prompt.size()) + " tokens) plus max_tokens (" + std::to_string(max_tokens) +
                    ") exceed the model's " + std::to_string(c.rope.max_position_embeddings) + " positions");
    } catch (const std::exception& e) {
      return http::error_response(400, e.what());
    }
    req.prompt = prompt;
    req.n_new = max_tokens;
    req.ced = prefill == "ced";
    req.cancelled = client_gone;
    auto gone = [&](std::size_t drawn) {
      std::fprintf(stderr, "serve: the client closed its connection (or its sending side); generation stopped after %zu of %lld tokens\n",
                   drawn, max_tokens);
      return http::error_response(499, "the client closed the connection (or its sending side); generation stopped after " +
                                           std::to_string(drawn) + " tokens");
    };
    if (client_gone && client_gone()) return gone(0);  // gave up while waiting for the slot: no prefill
    if (stream) {
      if (scheduler_) try {  // (a session's 404 / 409 / 400 as the answer's status, not an event after a 200)
          scheduler_->check_session(req);
        } catch (const cli::session_error& e) {
          return http::error_response(e.status, e.what());
        }
      return streamed(std::move(prompt), req, client_gone);
    }
    cli::generation g;
    try {
      g = generate_(req);
    } catch (const cli::server_busy& e) {
      return http::error_response(503, e.what());
    } catch (const cli::session_error& e) {
      return http::error_response(e.status, e.what());
    }
    if (g.cancelled) return gone(g.tokens.size());
    return {200, summary(g, prompt.size(), "", req.session)};
  }

  //! The answer's JSON object; `first` goes before its fields (the stream's last event: "done").
  static std::string summary(const cli::generation& g, std::size_t prompt_tokens, const std::string& first,
                             const std::string& session) {
    std::string out = "{" + first + "\"tokens\": [";
    for (std::size_t i = 0; i < g.tokens.size(); ++i) out += (i ? ", " : "") + std::to_string(g.tokens[i]);
    char tail[256];
    std::snprintf(tail, sizeof tail,
                  "], \"prompt_tokens\": %zu, \"generated_tokens\": %zu, \"prefill_seconds\": %.6f, "
                  "\"decode_seconds\": %.6f, \"backend\": ",
                  prompt_tokens, g.tokens.size(), g.prefill_s, g.decode_s);
    out += tail + http::json_string(g.device);
    if (g.draft_block > 0)
      out += ", \"speculative\": {\"draft_block\": " + std::to_string(g.draft_block) + ", \"rounds\": " +
             std::to_string(g.speculative.rounds) + ", \"drafted\": " + std::to_string(g.speculative.drafted) +
             ", \"accepted\": " + std::to_string(g.speculative.accepted) + "}";
    if (!session.empty())
      out += ", \"session\": {\"id\": " + http::json_string(session) + ", \"tokens\": " + std::to_string(g.session_tokens) + "}";
    return out + "}";
  }

  //! "stream": true: a text/event-stream whose events are `{"token": id, "index": i}` as each token
  //! is drawn, then `{"done": true, ...}` with the whole answer (or `{"error": ..., "status": n}`).
  //! The generation runs on a helper thread and hands its tokens over through a queue, so a slow
  //! client never holds the batch; a client that stops reading (or leaves) cancels it.
  http::response streamed(std::vector<std::int32_t> prompt, const cli::run_request& base,
                          const std::function<bool()>& client_gone) const {
    http::response r;
    r.content_type = "text/event-stream";
    r.stream = [this, prompt = std::move(prompt), base, client_gone](const http::chunk_writer& write) {
      std::mutex mu;
      std::condition_variable cv;
      std::deque<std::int32_t> ready;
      bool finished = false;
      std::atomic<bool> write_failed{false};
      cli::generation g;
      std::string failure;
      int failure_status = 500;
      cli::run_request req = base;
      req.prompt = prompt;
      req.cancelled = [&] { return write_failed.load() || (client_gone && client_gone()); };
      req.on_token = [&](std::int32_t t) {
        {
          std::lock_guard lk(mu);
          ready.push_back(t);
        }
        cv.notify_one();
      };
      std::thread worker([&] {
        try {
          g = generate_(req);
        } catch (const cli::server_busy& e) {
          failure = e.what(), failure_status = 503;
        } catch (const cli::session_error& e) {
          failure = e.what(), failure_status = e.status;
        } catch (const std::exception& e) {
          failure = e.what();
        }
        {
          std::lock_guard lk(mu);
          finished = true;
        }
        cv.notify_one();
      });
      std::size_t index = 0;
      for (;;) {
        std::unique_lock lk(mu);
        cv.wait(lk, [&] { return finished || !ready.empty(); });
        if (ready.empty()) break;  // finished, every token sent
        const std::int32_t t = ready.front();
        ready.pop_front();
        lk.unlock();
        if (!write_failed && !write("data: {\"token\": " + std::to_string(t) +
                                    ", \"index\": " + std::to_string(index++) + "}\n\n"))
          write_failed = true;  // the generation stops at its next step
      }
      worker.join();
      if (write_failed || g.cancelled) return;  // nobody is reading
      if (!failure.empty())
        write("data: {\"error\": " + http::json_string(failure) +
              ", \"status\": " + std::to_string(failure_status) + "}\n\n");
      else
        write("data: " + summary(g, prompt.size(), "\"done\": true, ", req.session) + "\n\n");
    };
    return r;
  }
};

}  // namespace dsv4::serve
