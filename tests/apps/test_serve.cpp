// `dsv4 serve`: the HTTP request parser on its own, then the server end to end over a real
// socket on 127.0.0.1 (a free port), answering with the tokens the host backend draws.

#include <boost/test/unit_test.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <sstream>
#include <string>
#include <thread>

#include "dsv4/apps/serve.hpp"
#include "dsv4/cli.hpp"
#include "support/builtin_tiny.hpp"

using namespace dsv4;
using http::parse_request;
using state = http::parse_result::state;

namespace {

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// A connection to 127.0.0.1:port; -1 if it failed.
int connect_to(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) return fd;
  ::close(fd);
  return -1;
}

// One request on a fresh connection; the whole response (the server closes the connection).
// `close_write`: the client then closes its sending side (it will send nothing more).
std::string exchange(int port, const std::string& raw, bool close_write = false) {
  const int fd = connect_to(port);
  if (fd < 0) return "connect failed";
  for (std::size_t sent = 0; sent < raw.size();) {
    const ssize_t n = ::send(fd, raw.data() + sent, raw.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;
    sent += std::size_t(n);
  }
  if (close_write) ::shutdown(fd, SHUT_WR);
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::recv(fd, buf, sizeof buf, 0)) > 0;) out.append(buf, std::size_t(n));
  ::close(fd);
  return out;
}

std::string post(const std::string& path, const std::string& body) {
  return "POST " + path + " HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: " +
         std::to_string(body.size()) + "\r\n\r\n" + body;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(serve_http)

BOOST_AUTO_TEST_CASE(parser_reads_requests_and_names_what_is_wrong) {
  auto r = parse_request("GET /health HTTP/1.1\r\nHost: a\r\nX-Thing:  v  \r\n\r\n", 100);
  BOOST_TEST((r.st == state::complete));
  BOOST_TEST(r.req.method == "GET");
  BOOST_TEST(r.req.target == "/health");
  BOOST_TEST(r.req.headers["x-thing"] == "v");
  r = parse_request("POST /v1/generate HTTP/1.1\r\nContent-Length: 5\r\n\r\nabc", 100);
  BOOST_TEST((r.st == state::incomplete));  // the body is still arriving
  r = parse_request("POST /v1/generate HTTP/1.1\r\nContent-Length: 5\r\n\r\nabcde", 100);
  BOOST_TEST((r.st == state::complete && r.req.body == "abcde"));
  BOOST_TEST((parse_request("GET /health HTTP/1.1\r\nHost: a\r\n", 100).st == state::incomplete));
  auto bad = [](std::string_view text, int status, const std::string& why) {
    const auto p = parse_request(text, 100);
    BOOST_TEST((p.st == state::bad), text);
    BOOST_TEST(p.error.status == status, text);
    BOOST_TEST(has(p.error.body, why), p.error.body);
  };
  bad("GARBAGE\r\n\r\n", 400, "malformed request line");
  bad("GET /x HTTP/2\r\n\r\n", 505, "HTTP/1.0 and HTTP/1.1");
  bad("GET /x HTTP/1.zzz\r\n\r\n", 505, "HTTP/1.0 and HTTP/1.1");
  bad("GET /x HTTP/1.1\nHost: a\n\n", 400, "must end with CRLF");  // bare LF: answered at once, no timeout
  bad("GET /x HTTP/1.1\r\nContent-Length : 5\r\n\r\n", 400, "malformed header name 'Content-Length '");
  bad("GET /x HTTP/1.1\r\nX-A: 1\r\n folded: on\r\n\r\n", 400, "continuation lines are not accepted");
  bad("POST /x HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 5\r\n\r\nabcde", 400,
      "'content-length' appears more than once");
  bad("GET /x HTTP/1.1\r\nno colon here\r\n\r\n", 400, "malformed header line");
  bad("POST /x HTTP/1.1\r\n\r\n", 411, "POST needs a Content-Length");
  bad("POST /x HTTP/1.1\r\nContent-Length: 12x\r\n\r\n", 400, "Content-Length '12x' is not a byte count");
  bad("POST /x HTTP/1.1\r\nContent-Length: 101\r\n\r\n", 413, "the body has 101 bytes, the limit is 100");
  bad("POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", 501, "send the body with a Content-Length");
  bad(std::string(20000, 'a'), 431, "exceed 16 KB");
  BOOST_TEST(http::json_string("a\"b\\c\n\x01") == "\"a\\\"b\\\\c\\n\\u0001\"");
  // Bytes that are not UTF-8 (a client's target, echoed in an error) become U+FFFD escapes.
  BOOST_TEST(http::json_string("/\xff\xc3\xa9/") == "\"/\\ufffd\xc3\xa9/\"");
}

// The service over a socket: health, model, a generation equal to the host backend's, and the
// errors a client can make, each with a message that names the problem.
BOOST_AUTO_TEST_CASE(server_answers_over_a_socket) {
  const auto& m = test::builtin_tiny();
  const serve::generation_service service(m, cli::host_generate, "host", {.max_new_tokens = 8, .max_prompt_tokens = 6});
  http::server srv("127.0.0.1", 0, [&](const http::request& r) { return service(r); }, 4096);
  BOOST_REQUIRE(srv.port() > 0);
  constexpr int requests = 15;
  std::thread th([&] { srv.serve(requests); });

  std::string r = exchange(srv.port(), "GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
  BOOST_TEST(has(r, "HTTP/1.1 200 OK"), r);
  BOOST_TEST(has(r, "{\"status\": \"ok\"}"), r);
  r = exchange(srv.port(), "GET /v1/model HTTP/1.1\r\n\r\n");
  BOOST_TEST(has(r, "\"vocab_size\": 1024"), r);

  // The tokens are the host backend's for the same request.
  const std::vector<std::int32_t> prompt{5, 6, 7, 8};
  kernels::sampling::sampling_params sp;
  sp.seed = 11;
  cli::run_request want_req;
  want_req.prompt = prompt, want_req.n_new = 3, want_req.sampling = sp, want_req.ced = true;
  const cli::generation want = cli::host_generate(m, want_req);
  std::string want_tokens = "\"tokens\": [";
  for (std::size_t i = 0; i < want.tokens.size(); ++i) want_tokens += (i ? ", " : "") + std::to_string(want.tokens[i]);
  r = exchange(srv.port(), post("/v1/generate", R"({"prompt": [5, 6, 7, 8], "max_tokens": 3, "seed": 11, "prefill": "ced"})"));
  BOOST_TEST(has(r, "HTTP/1.1 200 OK"), r);
  BOOST_TEST(has(r, want_tokens + "]"), r);
  BOOST_TEST(has(r, "\"prompt_tokens\": 4, \"generated_tokens\": 3"), r);

  // Every other request: its status and a message that names the problem.
  auto expect = [&](const std::string& raw, const std::string& status, const std::string& message,
                    bool close_write = false) {
    const std::string got = exchange(srv.port(), raw, close_write);
    BOOST_TEST((has(got, "HTTP/1.1 " + status) && has(got, message)), got);
  };
  expect(post("/v1/generate", R"({"prompt": [1, 2], "max_tokens": 9})"), "400",
         "field 'max_tokens' must be an integer in [0, 8]");
  expect(post("/v1/generate", R"({"prompt": [1, 5000]})"), "400", "field 'prompt[1]' must be an integer in [0, 1023]");
  expect(post("/v1/generate", R"({"prompt": [1], "temprature": 0.5})"), "400", "unknown field 'temprature'");
  expect(post("/v1/generate", "{\"prompt\": [1,"), "400", "request body: invalid JSON");
  expect("DELETE /v1/generate HTTP/1.1\r\n\r\n", "405", "this route takes POST");
  expect(post("/v1/generate", std::string(5000, ' ')), "413", "the limit is 4096");
  // Without max_tokens a request gets the default of 16 only within the server's limit (8).
  expect(post("/v1/generate", R"({"prompt": [1, 2], "temperature": 0})"), "200", "\"generated_tokens\": 8");
  expect(post("/v1/generate", R"({"prompt": [1, 2, 3, 4, 5, 6, 7]})"), "400",
         "field 'prompt' has 7 tokens, this server takes at most 6");
  // Numbers that JSON allows but the fields cannot hold: named 400s, before any work.
  expect(post("/v1/generate", R"({"prompt": [1], "temperature": 1e39})"), "400", "field 'temperature' is too large");
  expect(post("/v1/generate", R"({"prompt": [1], "top_p": 1e-50})"), "400", "field 'top_p' must be in (0, 1]");
  expect(post("/v1/generate", R"({"prompt": [1], "temperature": 1e999})"), "400", "number 1e999 is out of range");
  // A client that stops sending half-way (closes its side) still gets an answer.
  expect("POST /v1/generate HTTP/1.1\r\nContent-Length: 100\r\n\r\n{\"prompt\": [1]}", "400",
         "closed after 66 bytes, before the request was complete", true);
  th.join();  // fifteen requests answered: serve() returned
}

BOOST_AUTO_TEST_CASE(serve_command_rejects_bad_options_before_loading) {
  auto run = [](std::vector<std::string> args) {
    std::ostringstream out, err;
    const int code = cli::run(args, out, err);
    return std::pair{code, err.str()};
  };
  auto [code, err] = run({"serve", "--host", "localhost"});
  BOOST_TEST((code == 2 && has(err, "--host 'localhost' is not an IPv4 address")), err);
  std::tie(code, err) = run({"serve", "--port", "70000"});
  BOOST_TEST((code == 2 && has(err, "--port 70000 is outside 0..65535")), err);
  std::tie(code, err) = run({"serve", "--max-tokens", "-1"});
  BOOST_TEST((code == 2 && has(err, "--max-tokens needs a non-negative integer")), err);
  std::tie(code, err) = run({"serve", "--max-prompt-tokens", "0"});
  BOOST_TEST((code == 2 && has(err, "--max-prompt-tokens must be >= 1")), err);
  std::tie(code, err) = run({"serve", "--backend", "cuda"});
  BOOST_TEST((code == 2 && has(err, "built without CUDA")), err);
  std::tie(code, err) = run({"serve", "--max-batch", "0"});
  BOOST_TEST((code == 2 && has(err, "--max-batch must be in 1..256, got 0")), err);
  std::tie(code, err) = run({"serve", "--max-queued", "-1"});
  BOOST_TEST((code == 2 && has(err, "--max-queued")), err);
  std::tie(code, err) = run({"serve", "--max-queued", "5000"});
  BOOST_TEST((code == 2 && has(err, "--max-queued must be in 0..1024, got 5000")), err);
  std::tie(code, err) = run({"serve", "--max-session-tokens", "9000"});
  BOOST_TEST((code == 2 && has(err, "--max-session-tokens must be in 1..8192")), err);
  std::tie(code, err) = run({"serve", "--speculative", "medusa"});
  BOOST_TEST((code == 2 && has(err, "--speculative must be 'off' or 'dspark', got 'medusa'")), err);
  std::tie(code, err) = run({"serve", "--decode-graphs", "on"});
  BOOST_TEST((code == 2 && has(err, "serve: --decode-graphs applies to --backend cuda")), err);
  std::tie(code, err) = run({"serve", "--decode-graphs", "maybe"});
  BOOST_TEST((code == 2 && has(err, "serve: --decode-graphs must be 'off' or 'on', got 'maybe'")), err);
}

// Half a request and then silence: the server answers 408 when its (here 1 s) timeout ends.
BOOST_AUTO_TEST_CASE(a_request_that_does_not_arrive_in_time_gets_408) {
  http::server srv("127.0.0.1", 0, [](const http::request&) { return http::response{200, "{}"}; }, 1024, 1);
  std::thread th([&] { srv.serve(1); });
  const std::string r = exchange(srv.port(), "GET /health HTTP/1.1\r\nHo");
  BOOST_TEST((has(r, "HTTP/1.1 408") && has(r, "did not arrive in time")), r);
  th.join();
}

// A client that trickles a byte now and then cannot stretch the timeout (2 s here): each wait
// for input ends at the request's deadline, not a full timeout after the last byte. (Waits of a
// full timeout per read would answer at about 3 s; the bound below leaves room for a slow host.)
BOOST_AUTO_TEST_CASE(a_trickling_client_gets_408_at_the_deadline) {
  http::server srv("127.0.0.1", 0, [](const http::request&) { return http::response{200, "{}"}; }, 1024, 2);
  std::thread th([&] { srv.serve(1); });
  const int fd = connect_to(srv.port());
  BOOST_REQUIRE(fd >= 0);
  const auto start = std::chrono::steady_clock::now();
  std::atomic<bool> done{false};
  std::thread trickle([&] {
    const std::string text = "GET /health HTTP/1.1\r\nHost: x";
    for (std::size_t i = 0; i < text.size() && !done; ++i) {
      ::send(fd, text.data() + i, 1, MSG_NOSIGNAL);
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    }
  });
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::recv(fd, buf, sizeof buf, 0)) > 0;) out.append(buf, std::size_t(n));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  done = true;
  trickle.join();
  ::close(fd);
  th.join();
  BOOST_TEST((has(out, "HTTP/1.1 408") && has(out, "did not arrive in time")), out);
  BOOST_TEST(seconds < 2.7, "answered after " << seconds << " s");
}

// A client that closes its connection while its tokens are drawn stops the generation at the
// next decode step: the backend sees run_request::cancelled turn true and returns early, and the
// server is free for the next request at once (here a stand-in backend that would draw for 20 s).
BOOST_AUTO_TEST_CASE(a_client_that_leaves_stops_its_generation) {
  const auto& m = test::builtin_tiny();
  std::atomic<int> steps{0};
  std::atomic<bool> saw_stop{false};
  const cli::generate_fn slow = [&](const model::host_model<models::tiny>&, const cli::run_request& r) {
    cli::generation g;
    for (int i = 0; i < 2000; ++i) {
      g.tokens.push_back(1);
      ++steps;
      if (cli::stop_requested(r)) {
        g.cancelled = true;
        saw_stop = true;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return g;
  };
  const serve::generation_service service(m, slow, "stand-in");
  http::server srv("127.0.0.1", 0, [&](const http::request& r) { return service(r); });
  std::thread th([&] { srv.serve(3); });
  // A failed requirement below must not leave the server thread joinable (std::terminate).
  struct stop_and_join {
    http::server& srv;
    std::thread& th;
    ~stop_and_join() {
      if (th.joinable()) srv.stop(), th.join();
    }
  } guard{srv, th};
  const auto start = std::chrono::steady_clock::now();
  {
    const int fd = connect_to(srv.port());
    BOOST_REQUIRE(fd >= 0);
    const std::string raw = post("/v1/generate", R"({"prompt": [1, 2], "max_tokens": 100})");
    BOOST_REQUIRE(::send(fd, raw.data(), raw.size(), MSG_NOSIGNAL) == ssize_t(raw.size()));
    const auto wait_end = std::chrono::steady_clock::now() + std::chrono::seconds(20);  // generation under way
    while (steps.load() < 3 && std::chrono::steady_clock::now() < wait_end) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    ::close(fd);
    BOOST_REQUIRE_MESSAGE(steps.load() >= 3, "the generation did not get under way (" << steps.load() << " steps)");
  }
  // The next request is answered (the slot came free), long before the stand-in's 20 s.
  const std::string r = exchange(srv.port(), "GET /health HTTP/1.1\r\n\r\n");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // A client that shuts down its sending side after the request counts as gone: before the
  // prefill when its end of stream came with the request (the usual case on loopback), else at
  // the next step; it still reads the 499 that says so.
  const int steps_before = steps.load();
  const std::string half = exchange(srv.port(), post("/v1/generate", R"({"prompt": [3]})"), true);
  BOOST_TEST((has(half, "HTTP/1.1 499") && has(half, "generation stopped after")), half);
  BOOST_TEST(steps.load() - steps_before <= 2);
  th.join();
  BOOST_TEST(has(r, "HTTP/1.1 200 OK"), r);
  BOOST_TEST(saw_stop.load());
  BOOST_TEST(steps.load() < 300, steps.load() << " steps drawn");
  BOOST_TEST(seconds < 5.0, "the next request waited " << seconds << " s");
}

// The host backend stops before the decode step after which it was asked to: the tokens drawn by
// then are those of the uncancelled run.
BOOST_AUTO_TEST_CASE(host_generation_stops_when_asked) {
  const auto& m = test::builtin_tiny();
  const std::vector<std::int32_t> prompt{3, 4, 5};
  kernels::sampling::sampling_params sp;
  sp.seed = 5;
  cli::run_request r;
  r.prompt = prompt, r.n_new = 6, r.sampling = sp;
  const cli::generation full = cli::host_generate(m, r);
  int asked = 0;
  r.cancelled = [&] { return ++asked == 3; };
  const cli::generation part = cli::host_generate(m, r);
  BOOST_TEST(part.cancelled);
  BOOST_TEST(!full.cancelled);
  BOOST_TEST(asked == 3);
  BOOST_REQUIRE(part.tokens.size() == 3u);
  BOOST_TEST(std::equal(part.tokens.begin(), part.tokens.end(), full.tokens.begin()));
}

// Several clients at once over a batching service (apps/batching.hpp): every answer holds the
// tokens host_generate draws for its request, whatever else was decoded beside it.
BOOST_AUTO_TEST_CASE(concurrent_clients_get_their_own_tokens) {
  const auto& m = test::builtin_tiny();
  cli::batch_scheduler scheduler(std::make_unique<cli::host_engine>(m, cli::engine_limits{4, 8, 8}));
  const serve::generation_service service(scheduler, "host", {.max_new_tokens = 8, .max_prompt_tokens = 8});
  constexpr int clients = 5;
  http::server srv(
      "127.0.0.1", 0, [&](const http::request& r) { return service(r); }, 4096, 10, clients);
  std::thread th([&] { srv.serve(clients); });
  std::vector<std::string> answers(clients);
  std::vector<std::thread> threads;
  for (int i = 0; i < clients; ++i)
    threads.emplace_back([&, i] {
      answers[std::size_t(i)] =
          exchange(srv.port(), post("/v1/generate", "{\"prompt\": [" + std::to_string(10 + i) +
                                                        ", 3], \"max_tokens\": " + std::to_string(2 + i) +
                                                        ", \"seed\": " + std::to_string(i) + "}"));
    });
  for (auto& t : threads) t.join();
  th.join();
  for (int i = 0; i < clients; ++i) {
    const std::vector<std::int32_t> prompt{10 + i, 3};
    cli::run_request req;
    req.prompt = prompt, req.n_new = 2 + i, req.sampling.seed = std::uint64_t(i);
    const cli::generation want = cli::host_generate(m, req);
    std::string tokens = "\"tokens\": [";
    for (std::size_t k = 0; k < want.tokens.size(); ++k)
      tokens += (k ? ", " : "") + std::to_string(want.tokens[k]);
    BOOST_TEST(has(answers[std::size_t(i)], "HTTP/1.1 200 OK"), answers[std::size_t(i)]);
    BOOST_TEST(has(answers[std::size_t(i)], tokens + "]"), "client " << i << ": " << answers[std::size_t(i)]);
  }
  BOOST_TEST(scheduler.stats().requests == clients);
}

// "stream": true: a chunked text/event-stream with one event per token as it is drawn, then the
// whole answer in a "done" event; over the one-at-a-time service and over the batching one.
BOOST_AUTO_TEST_CASE(streamed_answers_send_each_token_as_it_is_drawn) {
  const auto& m = test::builtin_tiny();
  const std::vector<std::int32_t> prompt{4, 9};
  cli::run_request req;
  req.prompt = prompt, req.n_new = 4, req.sampling.seed = 3;
  const cli::generation want = cli::host_generate(m, req);
  const std::string body = R"({"prompt": [4, 9], "max_tokens": 4, "seed": 3, "stream": true})";
  auto check = [&](const std::string& got, const std::string& which) {
    BOOST_TEST(has(got, "HTTP/1.1 200 OK"), which << ": " << got);
    BOOST_TEST(has(got, "Content-Type: text/event-stream\r\nTransfer-Encoding: chunked"),
               which << ": " << got);
    std::size_t at = 0;
    for (std::size_t i = 0; i < want.tokens.size(); ++i) {
      const std::string event = "data: {\"token\": " + std::to_string(want.tokens[i]) +
                                ", \"index\": " + std::to_string(i) + "}\n\n";
      const std::size_t found = got.find(event, at);
      BOOST_TEST(found != std::string::npos, which << ": event " << i << " missing or out of order: " << got);
      if (found != std::string::npos) at = found;
    }
    std::string tokens = "\"tokens\": [";
    for (std::size_t k = 0; k < want.tokens.size(); ++k)
      tokens += (k ? ", " : "") + std::to_string(want.tokens[k]);
    BOOST_TEST(
        has(got, "data: {\"done\": true, " + tokens + "], \"prompt_tokens\": 2, \"generated_tokens\": 4"),
        which << ": " << got);
    BOOST_TEST(got.size() >= 5u);
    BOOST_TEST(got.substr(got.size() - 5) == "0\r\n\r\n", which << ": the body ends with the last chunk");
  };
  {
    const serve::generation_service service(m, cli::host_generate, "host");
    http::server srv("127.0.0.1", 0, [&](const http::request& r) { return service(r); });
    std::thread th([&] { srv.serve(2); });
    check(exchange(srv.port(), post("/v1/generate", body)), "one at a time");
    const std::string bad = exchange(srv.port(), post("/v1/generate", R"({"prompt": [1], "stream": 1})"));
    BOOST_TEST((has(bad, "HTTP/1.1 400") && has(bad, "field 'stream' must be true or false")), bad);
    th.join();
  }
  cli::batch_scheduler scheduler(std::make_unique<cli::host_engine>(m, cli::engine_limits{2, 8, 8}));
  const serve::generation_service service(scheduler, "host");
  http::server srv(
      "127.0.0.1", 0, [&](const http::request& r) { return service(r); }, 4096, 10, 3);
  std::thread th([&] { srv.serve(1); });
  check(exchange(srv.port(), post("/v1/generate", body)), "batched");
  th.join();
}

// `dsv4 serve --speculative dspark`: every request drafts; the answers hold plain decoding's
// tokens and the drafts' counts (those host_generate reports with the same drafter), streamed or
// not, over the one-at-a-time service and the batching one; /v1/model says the server drafts.
BOOST_AUTO_TEST_CASE(drafted_answers_carry_the_drafts_counts) {
  std::ostringstream quiet;
  io::checkpoint ck = cli::detail::open_tiny_checkpoint("", quiet);
  const auto m = model::host_model<models::tiny>::load(ck, cli::detail::tiny_token_map());
  const model::dspark_weights w = model::dspark_weights_of<models::tiny>(ck);
  const std::vector<std::int32_t> prompt{4, 9, 2};
  cli::run_request req;
  req.prompt = prompt, req.n_new = 9, req.sampling.seed = 5;
  const cli::generation plain = cli::host_generate(m, req);
  req.dspark = &w;
  const cli::generation drafted = cli::host_generate(m, req);
  BOOST_TEST(drafted.tokens == plain.tokens);
  BOOST_TEST(drafted.speculative.rounds > 0);
  auto tokens_text = [](const cli::generation& g) {
    std::string t = "\"tokens\": [";
    for (std::size_t k = 0; k < g.tokens.size(); ++k) t += (k ? ", " : "") + std::to_string(g.tokens[k]);
    return t + "]";
  };
  auto counts_text = [&](const cli::generation& g) {
    return "\"speculative\": {\"draft_block\": " + std::to_string(w.block) + ", \"rounds\": " + std::to_string(g.speculative.rounds) +
           ", \"drafted\": " + std::to_string(g.speculative.drafted) + ", \"accepted\": " + std::to_string(g.speculative.accepted) + "}";
  };
  const std::string tokens = tokens_text(plain), counts = counts_text(drafted);
  const std::string body = R"({"prompt": [4, 9, 2], "max_tokens": 9, "seed": 5)";
  auto check = [&](const serve::generation_service& service, const std::string& which) {
    http::server srv(
        "127.0.0.1", 0, [&](const http::request& r) { return service(r); }, 4096, 10, 3);
    std::thread th([&] { srv.serve(3); });
    std::string got = exchange(srv.port(), "GET /v1/model HTTP/1.1\r\n\r\n");
    BOOST_TEST(has(got, "\"speculative\": {\"drafter\": \"dspark\", \"draft_block\": " + std::to_string(w.block) + "}"),
               which << ": " << got);
    got = exchange(srv.port(), post("/v1/generate", body + "}"));
    BOOST_TEST(has(got, "HTTP/1.1 200 OK"), which << ": " << got);
    BOOST_TEST(has(got, tokens), which << ": " << got);
    BOOST_TEST(has(got, counts), which << ": " << got);
    got = exchange(srv.port(), post("/v1/generate", body + ", \"stream\": true}"));
    for (std::size_t i = 0; i < plain.tokens.size(); ++i)
      BOOST_TEST(has(got, "data: {\"token\": " + std::to_string(plain.tokens[i]) + ", \"index\": " + std::to_string(i) + "}"),
                 which << ", streamed: " << got);
    BOOST_TEST(has(got, "data: {\"done\": true, " + tokens), which << ", streamed: " << got);
    BOOST_TEST(has(got, counts), which << ", streamed: " << got);
    th.join();
  };
  check(serve::generation_service(m, cli::host_generate, "host", {}, &w), "one at a time");
  cli::batch_scheduler scheduler(std::make_unique<cli::host_engine>(m, cli::engine_limits{2, 8, 16}, &w));
  check(serve::generation_service(scheduler, "host"), "batched");
  {  // The drafting server keeps sessions: a continued turn answers as a fresh drafted request for the
     // whole conversation, its counts those of its own rounds.
    const serve::generation_service service(scheduler, "host");
    http::server srv("127.0.0.1", 0, [&](const http::request& r) { return service(r); });
    std::thread th([&] { srv.serve(2); });
    std::string got = exchange(srv.port(), post("/v1/generate", body + R"(, "session": "d"})"));
    BOOST_TEST((has(got, tokens) && has(got, counts)), "session turn 1: " << got);
    got = exchange(srv.port(), post("/v1/generate", R"({"prompt": [6, 1], "max_tokens": 5, "seed": 5, "session": "d", "continue": true})"));
    std::vector<std::int32_t> conversation(prompt);
    conversation.insert(conversation.end(), plain.tokens.begin(), plain.tokens.end());
    conversation.push_back(6), conversation.push_back(1);
    cli::run_request whole = req;
    whole.prompt = conversation, whole.n_new = 5;
    const cli::generation fresh = cli::host_generate(m, whole);
    BOOST_TEST(fresh.speculative.rounds > 0);
    BOOST_TEST((has(got, tokens_text(fresh)) && has(got, counts_text(fresh))), "session turn 2: " << got);
    th.join();
  }
  // A server that does not draft says so, and its answers carry no counts.
  const serve::generation_service plain_service(m, cli::host_generate, "host");
  http::server srv("127.0.0.1", 0, [&](const http::request& r) { return plain_service(r); });
  std::thread th([&] { srv.serve(2); });
  BOOST_TEST(has(exchange(srv.port(), "GET /v1/model HTTP/1.1\r\n\r\n"), "\"speculative\": null"));
  BOOST_TEST(!has(exchange(srv.port(), post("/v1/generate", body + "}")), "speculative"));
  th.join();
}

// Sessions over HTTP: a first turn keeps the conversation ("session"), the next one sends only its
// new tokens ("continue": true) and gets what a request for the whole conversation gets; the
// answers say how many tokens the session holds; DELETE closes it; every misuse is a 4xx that
// names the session or field. The one-at-a-time service (--max-batch 1) refuses sessions.
BOOST_AUTO_TEST_CASE(sessions_continue_a_conversation) {
  const auto& m = test::builtin_tiny();
  cli::batch_scheduler scheduler(std::make_unique<cli::host_engine>(m, cli::engine_limits{2, 16, 8, 30}));
  const serve::generation_service service(scheduler, "host", {.max_new_tokens = 8, .max_prompt_tokens = 16});
  constexpr int requests = 14;
  http::server srv(
      "127.0.0.1", 0, [&](const http::request& r) { return service(r); }, 4096, 10, 4);
  std::thread th([&] { srv.serve(requests); });
  auto tokens_of = [](const std::string& answer) {
    std::vector<std::int32_t> t;
    const auto at = answer.find("\"tokens\": [");
    if (at == std::string::npos) return t;
    std::istringstream in(answer.substr(at + 11, answer.find(']', at) - at - 11));
    for (std::string v; std::getline(in, v, ',');) t.push_back(std::int32_t(std::stol(v)));
    return t;
  };
  std::string r = exchange(srv.port(), "GET /v1/model HTTP/1.1\r\n\r\n");
  BOOST_TEST(has(r, "\"sessions\": {\"max_tokens\": 30, \"open\": 0}"), r);
  r = exchange(srv.port(), post("/v1/generate", R"({"prompt": [7, 8, 9], "max_tokens": 4, "seed": 2, "session": "s-1"})"));
  BOOST_TEST(has(r, "HTTP/1.1 200 OK"), r);
  BOOST_TEST(has(r, "\"session\": {\"id\": \"s-1\", \"tokens\": 7}"), r);
  const auto turn1 = tokens_of(r);
  BOOST_REQUIRE_EQUAL(turn1.size(), 4u);
  r = exchange(srv.port(), post("/v1/generate", R"({"prompt": [5, 6], "max_tokens": 3, "seed": 2, "session": "s-1", "continue": true})"));
  BOOST_TEST(has(r, "\"session\": {\"id\": \"s-1\", \"tokens\": 12}"), r);
  std::vector<std::int32_t> whole{7, 8, 9};
  whole.insert(whole.end(), turn1.begin(), turn1.end());
  whole.push_back(5), whole.push_back(6);
  cli::run_request req;
  req.prompt = whole, req.n_new = 3, req.sampling.seed = 2;
  BOOST_TEST(tokens_of(r) == cli::host_generate(m, req).tokens, r);
  auto expect = [&](const std::string& raw, const std::string& status, const std::string& message) {
    const std::string got = exchange(srv.port(), raw);
    BOOST_TEST((has(got, "HTTP/1.1 " + status) && has(got, message)), got);
  };
  expect(post("/v1/generate", R"({"prompt": [1], "session": "s-1"})"), "409 Conflict", "session 's-1' exists");
  expect(post("/v1/generate", R"({"prompt": [1], "session": "s-2", "continue": true})"), "404", "no session 's-2'");
  expect(post("/v1/generate", R"({"prompt": [1], "session": "s-2", "continue": true, "stream": true})"), "404",
         "no session 's-2'");  // (the status line, not an event after a 200)
  expect(post("/v1/generate", R"({"prompt": [1], "continue": true})"), "400", "field 'continue' needs field 'session'");
  expect(post("/v1/generate", R"({"prompt": [1], "session": "a b"})"), "400", "a session name is 1 to 64 of the characters");
  expect(post("/v1/generate", R"({"prompt": [1], "session": 5})"), "400", "field 'session' must be a string");
  expect(post("/v1/generate", R"({"prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], "max_tokens": 8, "session": "s-1", "continue": true})"),
         "400", "session 's-1' holds 12 tokens");
  expect("DELETE /v1/sessions/s-1 HTTP/1.1\r\n\r\n", "200", "{\"closed\": \"s-1\"}");
  expect("DELETE /v1/sessions/s-1 HTTP/1.1\r\n\r\n", "404", "no session 's-1'");
  expect("GET /v1/sessions/s-1 HTTP/1.1\r\n\r\n", "405", "this route takes DELETE");
  expect(post("/v1/generate", R"({"prompt": [5, 6], "session": "s-1", "continue": true})"), "404", "no session 's-1'");
  th.join();
  BOOST_TEST(scheduler.sessions() == 0u);
  // One request at a time: no sessions.
  const serve::generation_service single(m, cli::host_generate, "host");
  http::server one("127.0.0.1", 0, [&](const http::request& rq) { return single(rq); });
  std::thread th1([&] { one.serve(3); });
  BOOST_TEST(has(exchange(one.port(), "GET /v1/model HTTP/1.1\r\n\r\n"), "\"sessions\": null"));
  r = exchange(one.port(), post("/v1/generate", R"({"prompt": [1], "session": "x"})"));
  BOOST_TEST((has(r, "HTTP/1.1 400") && has(r, "--max-batch 2 or more")), r);
  r = exchange(one.port(), "DELETE /v1/sessions/x HTTP/1.1\r\n\r\n");
  BOOST_TEST((has(r, "HTTP/1.1 400") && has(r, "keeps no sessions")), r);
  th1.join();
}

BOOST_AUTO_TEST_CASE(stop_ends_serving) {
  http::server srv("127.0.0.1", 0, [](const http::request&) { return http::response{200, "{}"}; });
  std::thread th([&] { srv.serve(); });
  BOOST_TEST(has(exchange(srv.port(), "GET / HTTP/1.1\r\n\r\n"), "HTTP/1.1 200 OK"));
  srv.stop();
  th.join();  // serve() without a request limit returned
}

BOOST_AUTO_TEST_SUITE_END()
