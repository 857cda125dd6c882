#pragma once
//! \file
//! A small HTTP/1.1 server for `dsv4 serve` (POSIX sockets, no dependencies): up to
//! `max_connections` connections at a time (a thread each; one, the default, answers them in
//! arrival order on the serving thread), one request per connection (`Connection: close`), bodies
//! by Content-Length only. It is a front end for a single-model inference process on a trusted
//! network, not a general-purpose web server: a slow client holds its connection's place for at
//! most the timeout twice over (the whole request must arrive within it, the whole response must
//! leave within it) plus a second of lingering close.
//!
//! The parser is a pure function (tested on its own); every malformed request gets a status
//! code and a message that says what was wrong, also when the client stops sending half-way;
//! only a connection that sends nothing gets no answer.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/core/utf8.hpp"

namespace dsv4::http {

struct request {
  std::string method, target;
  std::map<std::string, std::string> headers;  //!< names in lower case
  std::string body;
  //! Set by the server for its handler, valid during the handler's call and its response's stream
  //! only: true once the client
  //! has closed the connection or reset it (nobody will read the response, so long work may stop).
  //! A client that only shuts down its sending side after the request looks the same, as to nginx
  //! (HTTP/1.1 clients keep it open until the response has come; `ncat` without --no-shutdown
  //! and `nc -N` do not); the response is still sent.
  std::function<bool()> client_gone;
};

//! Sends one piece of a streamed body; false once the client cannot take it (gone, or not reading
//! within the timeout): the producer should stop.
using chunk_writer = std::function<bool(std::string_view)>;

struct response {
  int status = 200;
  std::string body;  //!< JSON
  std::string content_type = "application/json";
  //! A streamed body instead of `body` (chunked transfer encoding): called once, on the
  //! connection's thread, with a writer for each piece; the server ends the body when it returns.
  std::function<void(const chunk_writer&)> stream{};
};

inline const char* reason(int status) {
  switch (status) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 409: return "Conflict";
    case 411: return "Length Required";
    case 413: return "Content Too Large";
    case 431: return "Request Header Fields Too Large";
    case 499: return "Client Closed Request";  // (nginx's; read only by a client that half-closed)
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503:
      return "Service Unavailable";
    case 505: return "HTTP Version Not Supported";
    default: return "Status";
  }
}

inline std::string serialize(const response& r) {
  return "HTTP/1.1 " + std::to_string(r.status) + " " + reason(r.status) + "\r\nContent-Type: " + r.content_type +
         "\r\nContent-Length: " + std::to_string(r.body.size()) + "\r\nConnection: close\r\n\r\n" + r.body;
}

//! The head of a streamed response (its body follows in chunks).
inline std::string serialize_stream_head(const response& r) {
  return "HTTP/1.1 " + std::to_string(r.status) + " " + reason(r.status) +
         "\r\nContent-Type: " + r.content_type +
         "\r\nTransfer-Encoding: chunked\r\nCache-Control: no-cache\r\nConnection: close\r\n\r\n";
}

//! One chunk of a chunked body (an empty `data` would end the body: the caller never sends one).
inline std::string chunk(std::string_view data) {
  char size[24];
  std::snprintf(size, sizeof size, "%zx\r\n", data.size());
  return size + std::string(data) + "\r\n";
}

//! `text` as a JSON string literal (quotes, backslashes and control characters escaped; bytes
//! that are not well-formed UTF-8, as a client's target may hold, become \ufffd).
inline std::string json_string(std::string_view text) {
  std::string out = "\"";
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (static_cast<unsigned char>(c) >= 0x80) {
      const std::size_t n = dsv4::text::well_formed_length(text.substr(i));
      if (n == 0) {
        out += "\\ufffd";
      } else {
        out += text.substr(i, n);
        i += n - 1;
      }
      continue;
    }
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", unsigned(static_cast<unsigned char>(c)));
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

//! An error response: {"error": message}.
inline response error_response(int status, std::string_view message) {
  return {status, "{\"error\": " + json_string(message) + "}"};
}

inline constexpr std::size_t max_header_bytes = 16 * 1024;

struct parse_result {
  enum class state { incomplete, complete, bad } st = state::incomplete;
  request req;          //!< when complete
  response error;       //!< when bad
};

//! Parses one request from the bytes received so far.
inline parse_result parse_request(std::string_view data, std::size_t max_body) {
  parse_result out;
  auto bad = [&](int status, const std::string& why) {
    out.st = parse_result::state::bad;
    out.error = error_response(status, why);
    return out;
  };
  const std::size_t head_end = data.find("\r\n\r\n");
  // A bare LF (nc without -C, a hand-written client) would otherwise wait out the timeout.
  const std::string_view head_so_far = data.substr(0, head_end == std::string_view::npos ? data.size() : head_end);
  for (std::size_t lf = head_so_far.find('\n'); lf != std::string_view::npos; lf = head_so_far.find('\n', lf + 1))
    if (lf == 0 || head_so_far[lf - 1] != '\r') return bad(400, "the request line and header lines must end with CRLF");
  if (head_end == std::string_view::npos) {
    if (data.size() > max_header_bytes) return bad(431, "the request line and headers exceed 16 KB");
    return out;
  }
  if (head_end > max_header_bytes) return bad(431, "the request line and headers exceed 16 KB");
  const std::string_view head = data.substr(0, head_end);
  const std::size_t line_end = std::min(head.find("\r\n"), head.size());
  const std::string_view line = head.substr(0, line_end);
  const std::size_t sp1 = line.find(' '), sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
  if (sp1 == std::string_view::npos || sp2 == std::string_view::npos || sp1 == 0 || sp2 == sp1 + 1 ||
      line.find(' ', sp2 + 1) != std::string_view::npos)
    return bad(400, "malformed request line (expected 'METHOD /path HTTP/1.1')");
  out.req.method = std::string(line.substr(0, sp1));
  out.req.target = std::string(line.substr(sp1 + 1, sp2 - sp1 - 1));
  const std::string_view version = line.substr(sp2 + 1);
  if (version != "HTTP/1.1" && version != "HTTP/1.0") {
    if (version.rfind("HTTP/", 0) == 0) return bad(505, "only HTTP/1.0 and HTTP/1.1 are served");
    return bad(400, "malformed request line (expected 'METHOD /path HTTP/1.1')");
  }
  // RFC 9110 token characters: a header name with anything else (a space before the colon, a
  // folded continuation line) is refused rather than guessed at.
  auto token_char = [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) != 0 || std::string_view("!#$%&'*+-.^_`|~").find(c) != std::string_view::npos;
  };
  for (std::size_t at = line_end + 2; at <= head.size();) {
    const std::size_t e = std::min(head.find("\r\n", at), head.size());
    const std::string_view h = head.substr(at, e - at);
    const std::size_t colon = h.find(':');
    if (colon == std::string_view::npos || colon == 0) return bad(400, "malformed header line (expected 'Name: value')");
    if (!std::all_of(h.begin(), h.begin() + std::ptrdiff_t(colon), token_char))
      return bad(400, "malformed header name '" + std::string(h.substr(0, std::min<std::size_t>(colon, 64))) +
                          "' (no spaces before the colon; continuation lines are not accepted)");
    std::string name(h.substr(0, colon));
    for (auto& c : name) c = char(std::tolower(static_cast<unsigned char>(c)));
    std::string_view value = h.substr(colon + 1);
    while (!value.empty() && (value.front() == ' ' || value.front() == '\t')) value.remove_prefix(1);
    while (!value.empty() && (value.back() == ' ' || value.back() == '\t')) value.remove_suffix(1);
    const bool once = name == "content-length" || name == "transfer-encoding" || name == "host";
    if (once && out.req.headers.count(name)) return bad(400, "the header '" + name + "' appears more than once");
    out.req.headers[name] = std::string(value);
    at = e + 2;
  }
  if (out.req.headers.count("transfer-encoding"))
    return bad(501, "Transfer-Encoding is not supported: send the body with a Content-Length");
  std::size_t length = 0;
  if (const auto it = out.req.headers.find("content-length"); it != out.req.headers.end()) {
    const std::string& v = it->second;
    if (v.empty() || v.size() > 12 || v.find_first_not_of("0123456789") != std::string::npos)
      return bad(400, "Content-Length '" + v + "' is not a byte count");
    length = std::stoull(v);
    if (length > max_body)
      return bad(413, "the body has " + v + " bytes, the limit is " + std::to_string(max_body));
  } else if (out.req.method == "POST" || out.req.method == "PUT") {
    return bad(411, out.req.method + " needs a Content-Length header");
  }
  if (data.size() < head_end + 4 + length) return out;  // the body is still arriving
  out.req.body = std::string(data.substr(head_end + 4, length));
  out.st = parse_result::state::complete;
  return out;
}

//! Listens on host:port (IPv4; port 0 picks a free one) and answers requests with `handler`,
//! up to `max_connections` connections at a time (the handler is then called from that many
//! threads at once). A handler's exception becomes a 500 with its message.
class server {
 public:
  using handler_fn = std::function<response(const request&)>;

  server(const std::string& host, int port, handler_fn handler, std::size_t max_body = std::size_t(1) << 20,
         int receive_timeout_s = 10, int max_connections = 1)
      : handler_(std::move(handler)),
        max_body_(max_body),
        timeout_s_(receive_timeout_s),
        max_connections_(max_connections) {
    if (max_connections < 1)
      throw error("serve: max_connections must be >= 1, got " + std::to_string(max_connections));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<std::uint16_t>(port));
    if (port < 0 || port > 65535) throw error("serve: port " + std::to_string(port) + " is outside 0..65535");
    if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1)
      throw error("serve: host '" + host + "' is not an IPv4 address (use 127.0.0.1 or 0.0.0.0)");
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd_ < 0) throw error(std::string("serve: socket: ") + std::strerror(errno));
    const int one = 1;
    ::setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(fd_, 16) != 0) {
      const std::string why = std::strerror(errno);
      ::close(fd_);
      throw error("serve: cannot listen on " + host + ":" + std::to_string(port) + ": " + why);
    }
    socklen_t len = sizeof addr;
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
  }
  ~server() {
    if (fd_ >= 0) ::close(fd_);
  }
  server(const server&) = delete;
  server& operator=(const server&) = delete;

  int port() const { return port_; }

  //! Serves until `max_requests` requests were answered (< 0: no limit) or stop() is called; with
  //! several connections at a time, returns once the last accepted one is answered.
  void serve(long long max_requests = -1) {
    if (max_connections_ > 1) return serve_concurrently(max_requests);
    for (long long answered = 0; max_requests < 0 || answered < max_requests; ++answered) {
      const int c = accept_one();
      if (c < 0) return;
      answer(c);
      ::close(c);
    }
  }
  //! Makes serve() return (from another thread or a signal handler's flag check).
  void stop() {
    stopping_ = true;
    ::shutdown(fd_, SHUT_RDWR);
  }

 private:
  handler_fn handler_;
  std::size_t max_body_;
  int timeout_s_, max_connections_;
  int fd_ = -1, port_ = 0;
  std::atomic<bool> stopping_{false};

  //! The next connection, or -1 when serving should end (stop(), or a socket that cannot accept).
  int accept_one() {
    for (;;) {
      const int c = ::accept(fd_, nullptr, nullptr);
      if (c >= 0) return c;
      if (stopping_ || errno == EINVAL || errno == EBADF) return -1;  // stop() shut the socket down
      // Out of descriptors or buffers: wait for some to come back. A connection that failed on its
      // way in (ECONNABORTED, EPROTO, network errors Linux passes on): the next one.
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        std::fprintf(stderr, "serve: accept: %s (retrying)\n", std::strerror(errno));
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    }
  }

  //! max_connections_ threads answer the accepted connections; the serving thread accepts one
  //! whenever a thread is free, so no accepted connection waits for a thread.
  void serve_concurrently(long long max_requests) {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<int> ready;
    int idle = max_connections_;
    bool closing = false;
    std::vector<std::thread> workers;
    workers.reserve(std::size_t(max_connections_));
    auto close_pool = [&] {
      {
        std::lock_guard lk(mu);
        closing = true;
      }
      cv.notify_all();
      for (auto& t : workers) t.join();
    };
    try {
      for (int w = 0; w < max_connections_; ++w)
        workers.emplace_back([&] {
          std::unique_lock lk(mu);
          for (;;) {
            cv.wait(lk, [&] { return closing || !ready.empty(); });
            if (ready.empty()) return;  // closing, and nothing left to answer
            const int c = ready.front();
            ready.pop_front();
            --idle;
            lk.unlock();
            try {
              answer(c);
            } catch (...) {  // out of memory in the parser or the response: this connection only
              std::fprintf(stderr, "serve: a connection failed and was closed\n");
            }
            ::close(c);
            lk.lock();
            ++idle;
            cv.notify_all();
          }
        });
    } catch (...) {  // a thread could not start: the started ones end, then the caller hears of it
      close_pool();
      throw;
    }
    for (long long accepted = 0; max_requests < 0 || accepted < max_requests; ++accepted) {
      {
        std::unique_lock lk(mu);  // stop() does not know this condition: look at its flag now and then
        while (idle <= int(ready.size()) && !stopping_) cv.wait_for(lk, std::chrono::milliseconds(100));
      }
      const int c = stopping_ ? -1 : accept_one();
      if (c < 0) break;
      std::lock_guard lk(mu);
      ready.push_back(c);
      cv.notify_all();
    }
    close_pool();
  }

  //! Waits until `c` is readable (POLLIN) or writable (POLLOUT) or `deadline` passes.
  static bool wait_for(int c, short events, std::chrono::steady_clock::time_point deadline) {
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return false;
      pollfd p{c, events, 0};
      const int n = ::poll(&p, 1, int(std::min<long long>(left.count(), 60'000)));
      if (n > 0) return true;
      if (n < 0 && errno != EINTR) return false;
    }
  }

  //! True when the peer has closed or reset the connection: its end of stream (Linux's POLLRDHUP
  //! sees it even behind bytes the client sent after its request; elsewhere a zero-byte peek),
  //! an error or a hang-up, without waiting.
  static bool peer_closed(int c) {
#ifdef POLLRDHUP
    pollfd p{c, POLLIN | POLLRDHUP, 0};
#else
    pollfd p{c, POLLIN, 0};
#endif
    if (::poll(&p, 1, 0) <= 0) return false;
    if (p.revents & (POLLERR | POLLHUP | POLLNVAL)) return true;
#ifdef POLLRDHUP
    if (p.revents & POLLRDHUP) return true;
#endif
    char byte;
    const ssize_t n = ::recv(c, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
    return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
  }

  //! Sends `out` within the timeout; false if the client did not take it all.
  bool send_all(int c, std::string_view out) const {
    const auto send_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s_);
    for (std::size_t sent = 0; sent < out.size();) {
      if (!wait_for(c, POLLOUT, send_deadline)) return false;
      const ssize_t n = ::send(c, out.data() + sent, out.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
      if (n <= 0) return false;
      sent += std::size_t(n);
    }
    return true;
  }

  void answer(int c) {
    // The whole request must arrive within the timeout, not each piece of it: a client that
    // trickles bytes cannot hold the (single) connection slot longer than that.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s_);
    std::string data;
    char buf[16384];
    response r;
    for (;;) {
      parse_result p = parse_request(data, max_body_);
      if (p.st == parse_result::state::bad) {
        r = p.error;
        break;
      }
      if (p.st == parse_result::state::complete) {
        request req = std::move(p.req);
        // A server told to stop counts every client as gone: generations end at their next step.
        req.client_gone = [this, c] { return stopping_.load() || peer_closed(c); };
        try {
          r = handler_(req);
        } catch (const std::exception& e) {
          r = error_response(500, e.what());
        }
        break;
      }
      if (!wait_for(c, POLLIN, deadline)) {
        r = error_response(408, "the request did not arrive in time");
        break;
      }
      const ssize_t n = ::recv(c, buf, sizeof buf, 0);
      if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
      if (n <= 0) {
        if (data.empty()) return;  // the client went away without a word: nobody to answer
        r = error_response(400, "the connection was closed after " + std::to_string(data.size()) +
                                     " bytes, before the request was complete");
        break;
      }
      data.append(buf, std::size_t(n));
    }
    // The response, within its own timeout: a client that stops reading cannot hold the slot. A
    // streamed one: the head, then each piece within a timeout of its own, then the last chunk.
    if (r.stream) {
      if (!send_all(c, serialize_stream_head(r))) return;
      bool open = true;
      try {
        r.stream([&](std::string_view piece) {
          if (open && !piece.empty()) open = send_all(c, chunk(piece));
          return open;
        });
      } catch (const std::exception& e) {  // the head is out: the body ends unfinished (no last chunk)
        std::fprintf(stderr, "serve: a streamed response failed: %s\n", e.what());
        open = false;
      }
      if (!open || !send_all(c, "0\r\n\r\n")) return;
    } else if (!send_all(c, serialize(r))) {
      return;
    }
    // A lingering close: closing with unread input (a refused body) would reset the connection
    // and could destroy the response before the client reads it. Signal the end of the response,
    // then read what the client still sends until it closes, for at most a second and 1 MiB.
    ::shutdown(c, SHUT_WR);
    const auto linger_end = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    for (std::size_t drained = 0; drained < (std::size_t(1) << 20) && wait_for(c, POLLIN, linger_end);) {
      const ssize_t n = ::recv(c, buf, sizeof buf, MSG_DONTWAIT);
      if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
      if (n <= 0) break;
      drained += std::size_t(n);
    }
  }
};

}  // namespace dsv4::http
