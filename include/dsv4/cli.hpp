#pragma once
//! \file
//! The `dsv4` command line, as a library function: the app is a two-line main(), the tests
//! drive it exactly as a user does, and an embedding program can reuse it.

#include <chrono>
#include <fstream>
#include <functional>
#include <map>
#include <numeric>
#include <ostream>
#include <span>
#include <sstream>
#include <optional>
#include <string>
#include <vector>

#include "dsv4/apps/batching.hpp"
#include "dsv4/apps/generate.hpp"
#include "dsv4/apps/serve.hpp"
#include "dsv4/dsv4.hpp"
#include "dsv4/engram/token_map.hpp"
#include "dsv4/io/checkpoint.hpp"
#include "dsv4/io/npy.hpp"
#include "dsv4/io/random_checkpoint.hpp"
#include "dsv4/kernels/sampling/reference.hpp"
#include "dsv4/model/model_reference.hpp"
#include "dsv4/model/speculative_reference.hpp"
#include "dsv4/models/checkpoint_schema.hpp"
#include "dsv4/models/config_json.hpp"
#include "dsv4/schedule/prefill_work.hpp"

namespace dsv4::cli {

inline void usage(std::ostream& os) {
  os << "usage: dsv4 <command> [options]\n\n"
        "commands:\n"
        "  info --config NAME   print the layer schedule and the cache bytes per token of a\n"
        "                       built-in model (";
  std::string names;
  for (const auto& n : models::builtin_names()) names += (names.empty() ? "" : ", ") + n;
  os << names
     << "; default v41-flash)\n"
        "  check-checkpoint PATH [--config NAME] [--config-json FILE]\n"
        "                       check that a checkpoint (a .safetensors file, or a folder with\n"
        "                       model.safetensors.index.json) holds every tensor of the model\n"
        "                       with the right dtype and shape, and that an inference\n"
        "                       config.json, if given, has the model's values; lists every problem\n"
        "  run [--config tiny] [--checkpoint PATH] [--prompt IDS] [--tokens N]\n"
        "      [--temperature T] [--top-k K] [--top-p P] [--seed S] [--prefill exact|ced]\n"
        "      [--speculative off|dspark] [--backend host|cuda] [--engram-tables device|host]\n"
        "      [--gemm mma|wgmma] [--decode-graphs off|on]\n"
        "                       generate N tokens (default 8) after a prompt of comma-separated\n"
        "                       token ids (default 1,2,...,8) and print them with the prefill and\n"
        "                       decode throughput; without --checkpoint the built-in tiny model\n"
        "                       runs with random weights from a fixed seed. The default backend\n"
        "                       is the host reference; --backend cuda runs model::device_model on\n"
        "                       the GPU (when dsv4 was built with CUDA); with --engram-tables host\n"
        "                       its Engram tables stay in host memory, read in place from the\n"
        "                       checkpoint, and each call's rows are fetched to the GPU (the\n"
        "                       layout for V4.1's ~100 GB tables); --gemm wgmma runs its\n"
        "                       few-token GEMMs on Hopper's wgmma instead of mma.sync (not yet\n"
        "                       the default: see docs/perf.md); the CUDA backend replays the\n"
        "                       decode steps' fixed launches as captured CUDA graphs, checked\n"
        "                       launch by launch (the same tokens; --decode-graphs off issues\n"
        "                       every launch from the host). These run the tiny variant\n"
        "                       only (V4.1's weights need a multi-GPU or offloaded build, issues 5\n"
        "                       and 7). --prefill ced runs\n"
        "                       the encoder over the prompt and the decoder over its last window\n"
        "                       (an approximation; exact is the reference's semantics).\n"
        "                       --speculative dspark drafts with the DSpark stages and verifies\n"
        "                       the drafts against the backbone's tokens: the same tokens, plus\n"
        "                       the drafts' acceptance counts (host: position by position; cuda:\n"
        "                       a round verified in one call and rolled back)\n"
        "  serve [--config tiny] [--checkpoint PATH] [--host ADDR] [--port N] [--backend host|cuda]\n"
        "        [--max-tokens N] [--max-prompt-tokens N] [--max-requests N] [--max-batch N]\n"
        "        [--max-queued N] [--speculative off|dspark] [--max-session-tokens N]\n"
        "        [--decode-graphs off|on]\n"
        "                       an HTTP/1.1 JSON server over the model (default 127.0.0.1:8080;\n"
        "                       --port 0 picks a free port and prints it): GET /health, GET\n"
        "                       /v1/model, POST /v1/generate {\"prompt\": [ids], \"max_tokens\": N,\n"
        "                       \"temperature\", \"top_k\", \"top_p\", \"seed\", \"prefill\": "
        "\"exact\"|\"ced\"}\n"
        "                       answered with the tokens `run` would draw; requests that arrive\n"
        "                       together are decoded together, up to --max-batch N sequences\n"
        "                       (default 8; 1: one request at a time), and up to --max-queued N\n"
        "                       more wait for room (default 64; beyond, a 503); --max-tokens /\n"
        "                       --max-prompt-tokens cap a request's generated and prompt tokens\n"
        "                       (defaults 4096 / 4096); --max-requests N exits after N answers;\n"
        "                       --speculative dspark drafts with the DSpark stages: each step\n"
        "                       verifies every sequence's drafts and gives it 1 .. block + 1\n"
        "                       tokens (the same tokens; answers carry the drafts' counts).\n"
        "                       \"session\": \"name\" keeps a conversation's sequence after the\n"
        "                       answer; with \"continue\": true the next turn's prompt is appended\n"
        "                       to it (no prefill of the history); DELETE /v1/sessions/<name>\n"
        "                       closes one; idle sessions are evicted (least recently used) when\n"
        "                       a new request needs the room; --max-session-tokens N caps a\n"
        "                       conversation (default: --max-prompt-tokens + --max-tokens; the\n"
        "                       CUDA backend's cache pool grows with the larger of the two);\n"
        "                       the CUDA backend decodes through captured graphs, as `run` does\n"
        "                       (--decode-graphs off: every launch from the host)\n"
        "  logits --checkpoint PATH [--config tiny] --prompt IDS [--decode IDS] --out FILE\n"
        "         [--index-keys ownership|upstream]\n"
        "                       exact prefill of the prompt, then the decode ids fed one at a\n"
        "                       time (teacher forcing, no sampling); writes the fp32 logits of\n"
        "                       the last prompt position and after each decode token as a .npy\n"
        "                       array of shape (1 + decode tokens, vocabulary), row-major.\n"
        "                       --index-keys upstream reproduces the official reference's stale\n"
        "                       index keys at even decode positions (spec 7), for parity runs\n"
        "  random-checkpoint DIR [--config NAME] [--seed N] [--shard-mib M] [--init codes|scaled]\n"
        "                       write a checkpoint with random weights (default config tiny):\n"
        "                       any finite codes (codes, the default), or weights with a trained\n"
        "                       model's scales (scaled: the parity tests' checkpoints)\n"
        "  config-json [--config NAME] [--out FILE] [--multipliers FILE]\n"
        "                       write the inference/config.json of a built-in model (default\n"
        "                       tiny) in the official file's format, to FILE or stdout; with\n"
        "                       --multipliers, also its Engram hash multipliers as JSON\n"
        "  token-map --tokenizer FILE [--config NAME] [--out FILE]\n"
        "                       build the Engram compressed token map of a tokenizer.json as\n"
        "                       engram.py does (spec 10) and print its size; with --config, check\n"
        "                       it against the model's engram_compressed_vocab_size (v41-flash:\n"
        "                       99092); --out writes it as a map file (one compressed id a line)\n"
        "  version              print the dsv4 version\n"
        "  help                 print this text\n";
}

//! Run the CLI; returns the process exit code (0 ok, 2 usage error). Never throws.
namespace detail {
//! The schema of a built-in config, by name.
inline std::vector<std::string> config_problems(const std::string& config, const std::string& path) {
  const io::json j = io::parse_json_file(path);
  if (config == models::v41_flash::name) return models::compare_config_json<models::v41_flash>(j);
  if (config == models::tiny::name) return models::compare_config_json<models::tiny>(j);
  models::describe_builtin(config);
  return {};
}

inline std::vector<io::tensor_spec> schema_of(const std::string& config) {
  if (config == models::v41_flash::name) return models::checkpoint_schema<models::v41_flash>();
  if (config == models::tiny::name) return models::checkpoint_schema<models::tiny>();
  models::describe_builtin(config);  // throws the "unknown model config" error with the valid names
  return {};
}

//! Parses "--name value" / "--name=value" options after the positional arguments.
struct options {
  std::vector<std::string> positional;
  std::map<std::string, std::string> named;
};
inline options parse(const std::vector<std::string>& args, const std::string& cmd, const std::vector<std::string>& allowed) {
  options o;
  for (std::size_t i = 1; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a.rfind("--", 0) != 0) {
      o.positional.push_back(a);
      continue;
    }
    const auto eq = a.find('=');
    const std::string key = a.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
    bool ok = false;
    for (const auto& k : allowed) ok |= k == key;
    if (!ok) throw error(cmd + ": unknown option '" + a + "'");
    if (eq != std::string::npos) {
      o.named[key] = a.substr(eq + 1);
    } else {
      if (i + 1 >= args.size()) throw error(cmd + ": --" + key + " needs a value");
      o.named[key] = args[++i];
    }
  }
  return o;
}
//! The --config of a command that runs the host reference backend: tiny (the default) only.
inline std::string host_config(const std::string& cmd, const options& o) {
  const std::string config = o.named.count("config") ? o.named.at("config") : models::tiny::name;
  if (config != models::tiny::name) {
    models::describe_builtin(config);  // an unknown name gets the list of valid ones
    throw error(cmd + ": the CLI runs the tiny variant only; " + config +
                "'s weights do not fit one GPU (the multi-GPU model and Engram tables in host memory are issues 7 and 5)");
  }
  return config;
}
//! --decode-graphs off|on of `run` and `serve`: on by default with the CUDA backend (the same
//! tokens as plain steps, bit for bit; a decode step 1-5% faster at V4.1 width, 1.5x on tiny:
//! docs/perf.md), refused with the host backend, which launches nothing.
inline bool decode_graphs_option(const std::string& cmd, const options& o, const std::string& backend) {
  if (!o.named.count("decode-graphs")) return backend == "cuda";
  const std::string v = o.named.at("decode-graphs");
  if (v != "off" && v != "on") throw error(cmd + ": --decode-graphs must be 'off' or 'on', got '" + v + "'");
  if (v == "on" && backend != "cuda")
    throw error(cmd + ": --decode-graphs applies to --backend cuda (the host backend launches nothing)");
  return v == "on";
}
//! The tiny model's checkpoint: the file or folder at `path`, or (empty path) the built-in random
//! weights from seed 42; validated against the schema, with load progress on `err`.
inline io::checkpoint open_tiny_checkpoint(const std::string& path, std::ostream& err) {
  const auto schema = models::checkpoint_schema<models::tiny>();
  io::checkpoint ck = path.empty() ? io::random_checkpoint_in_memory(schema, 42) : io::checkpoint(path);
  ck.validate(schema);
  if (!path.empty()) ck.on_progress(io::load_progress_printer(err, "loading " + path));
  return ck;
}
//! tiny's compressed vocabulary is its vocabulary: the identity token map.
inline std::vector<std::int64_t> tiny_token_map() {
  std::vector<std::int64_t> token_map(std::size_t(models::tiny::dims.vocab_size));
  std::iota(token_map.begin(), token_map.end(), 0);
  return token_map;
}
inline double parse_number(const std::string& cmd, const std::string& key, const std::string& v) {
  try {
    std::size_t used = 0;
    const double x = std::stod(v, &used);
    if (used == v.size()) return x;
  } catch (const std::exception&) {
  }
  throw error(cmd + ": --" + key + " needs a number, got '" + v + "'");
}
inline long long parse_integer(const std::string& cmd, const std::string& key, const std::string& v) {
  try {
    std::size_t used = 0;
    const long long n = std::stoll(v, &used);
    if (used == v.size() && n >= 0) return n;
  } catch (const std::exception&) {
  }
  throw error(cmd + ": --" + key + " needs a non-negative integer, got '" + v + "'");
}
//! A comma-separated list of token ids ("" gives an empty list).
inline std::vector<std::int32_t> parse_ids(const std::string& cmd, const std::string& key, const std::string& v) {
  std::vector<std::int32_t> ids;
  std::stringstream ss(v);
  for (std::string item; std::getline(ss, item, ',');) {
    const long long id = parse_integer(cmd, key, item);
    if (id > 0x7fffffffLL) throw error(cmd + ": --" + key + ": token id " + item + " is too large");
    ids.push_back(std::int32_t(id));
  }
  return ids;
}

//! A built-in model's Engram hash multipliers as JSON: {"engram_layer_ids": [...],
//! "engram_hash_multipliers": [[k = 0, 1, ...], ...]} (one row per Engram layer).
template <class Model>
std::string multipliers_json() {
  using sched = typename models::model_traits<Model>::schedule;
  std::string s = "{\"engram_layer_ids\": " + models::detail::json_list(sched::engram::values) + ", \"engram_hash_multipliers\": [";
  for (std::size_t l = 0; l < Model::engram_multipliers.size(); ++l)
    s += (l ? ", " : "") + models::detail::json_list(Model::engram_multipliers[l]);
  return s + "]}\n";
}
}  // namespace detail

inline int run(const std::vector<std::string>& args, std::ostream& out, std::ostream& err, const backends& extra = {}) {
  try {
    if (args.empty() || args[0] == "help" || args[0] == "--help" || args[0] == "-h") {
      usage(args.empty() ? err : out);
      return args.empty() ? 2 : 0;
    }
    const std::string& cmd = args[0];
    if (cmd == "version" || cmd == "--version") {
      out << "dsv4 " << DSV4_VERSION_MAJOR << "." << DSV4_VERSION_MINOR << "." << DSV4_VERSION_PATCH << "\n";
      return 0;
    }
    if (cmd == "info") {
      std::string config = models::v41_flash::name;
      for (std::size_t i = 1; i < args.size(); ++i) {
        if (args[i] == "--config") {
          if (i + 1 >= args.size()) throw error("info: --config needs a value");
          config = args[++i];
        } else if (args[i].rfind("--config=", 0) == 0) {
          config = args[i].substr(9);
        } else {
          throw error("info: unknown option '" + args[i] + "'");
        }
      }
      models::print_info(out, models::describe_builtin(config));
      return 0;
    }
    if (cmd == "check-checkpoint") {
      const auto o = detail::parse(args, cmd, {"config", "config-json"});
      if (o.positional.size() != 1) throw error("check-checkpoint: give exactly one checkpoint path");
      const std::string config = o.named.count("config") ? o.named.at("config") : models::v41_flash::name;
      if (o.named.count("config-json")) {
        const auto problems = detail::config_problems(config, o.named.at("config-json"));
        if (!problems.empty()) {
          std::string msg = o.named.at("config-json") + " does not match " + config + ": " + std::to_string(problems.size()) + " problem(s)";
          for (const auto& p : problems) msg += "\n  " + p;
          throw error(msg);
        }
        out << o.named.at("config-json") << ": every key matches " << config << "\n";
      }
      const auto schema = detail::schema_of(config);
      io::checkpoint ck(o.positional[0]);
      ck.validate(schema);
      out << o.positional[0] << ": all " << schema.size() << " tensors of " << config << " present with the right dtype and shape ("
          << ck.size() << " tensors in the checkpoint)\n";
      return 0;
    }
    if (cmd == "serve") {
      const auto o = detail::parse(args, cmd,
                                   {"config", "checkpoint", "host", "port", "backend", "max-requests",
                                    "max-tokens", "max-prompt-tokens", "max-batch", "max-queued",
                                    "speculative", "max-session-tokens", "decode-graphs"});
      if (!o.positional.empty()) throw error("serve: unexpected argument '" + o.positional[0] + "'");
      const std::string config = detail::host_config(cmd, o);
      const std::string backend = o.named.count("backend") ? o.named.at("backend") : "host";
      if (backend != "host" && backend != "cuda")
        throw error("serve: --backend must be 'host' or 'cuda', got '" + backend + "'");
      if (backend == "cuda" && !extra.cuda)
        throw error("serve: this dsv4 was built without CUDA (no nvcc at configure time); use --backend host");
      const bool graphs = detail::decode_graphs_option(cmd, o, backend);
      const std::string speculative = o.named.count("speculative") ? o.named.at("speculative") : "off";
      if (speculative != "off" && speculative != "dspark")
        throw error("serve: --speculative must be 'off' or 'dspark', got '" + speculative + "'");
      const std::string host = o.named.count("host") ? o.named.at("host") : "127.0.0.1";
      const long long port = o.named.count("port") ? detail::parse_integer(cmd, "port", o.named.at("port")) : 8080;
      const long long max_requests =
          o.named.count("max-requests") ? detail::parse_integer(cmd, "max-requests", o.named.at("max-requests")) : -1;
      if (port < 0 || port > 65535) throw error("serve: --port " + std::to_string(port) + " is outside 0..65535");
      if (in_addr probe{}; inet_pton(AF_INET, host.c_str(), &probe) != 1)
        throw error("serve: --host '" + host + "' is not an IPv4 address (use 127.0.0.1 or 0.0.0.0)");
      serve::service_limits limits;
      if (o.named.count("max-tokens")) limits.max_new_tokens = detail::parse_integer(cmd, "max-tokens", o.named.at("max-tokens"));
      if (o.named.count("max-prompt-tokens"))
        limits.max_prompt_tokens = detail::parse_integer(cmd, "max-prompt-tokens", o.named.at("max-prompt-tokens"));
      if (limits.max_prompt_tokens < 1)
        throw error("serve: --max-prompt-tokens must be >= 1, got " + std::to_string(limits.max_prompt_tokens));
      const long long max_batch =
          o.named.count("max-batch") ? detail::parse_integer(cmd, "max-batch", o.named.at("max-batch")) : 8;
      const long long max_queued = o.named.count("max-queued")
                                       ? detail::parse_integer(cmd, "max-queued", o.named.at("max-queued"))
                                       : 64;
      if (max_batch < 1 || max_batch > 256)
        throw error("serve: --max-batch must be in 1..256, got " + std::to_string(max_batch));
      if (max_queued < 0 || max_queued > 1024)
        throw error("serve: --max-queued must be in 0..1024, got " + std::to_string(max_queued));
      constexpr long long positions = models::tiny::dims.rope.max_position_embeddings;
      const long long max_session_tokens =
          o.named.count("max-session-tokens")
              ? detail::parse_integer(cmd, "max-session-tokens", o.named.at("max-session-tokens"))
              : std::min(positions, limits.max_prompt_tokens + limits.max_new_tokens);
      if (max_session_tokens < 1 || max_session_tokens > positions)
        throw error("serve: --max-session-tokens must be in 1.." + std::to_string(positions) + " (the model's positions), got " +
                    std::to_string(max_session_tokens));
      if (o.named.count("max-session-tokens") && max_batch == 1)
        throw error("serve: --max-session-tokens applies to the batching server (sessions need --max-batch 2 or more)");
      if (backend == "cuda" && max_batch > 1 && !extra.cuda_engine)
        throw error("serve: this dsv4's CUDA backend cannot batch (no engine linked in); use --max-batch 1");
      const std::string path = o.named.count("checkpoint") ? o.named.at("checkpoint") : "";
      io::checkpoint ck = detail::open_tiny_checkpoint(path, err);
      const auto m = model::host_model<models::tiny>::load(ck, detail::tiny_token_map());
      std::optional<model::dspark_weights> drafter;  // --speculative dspark: every request drafts
      if (speculative == "dspark") drafter.emplace(model::dspark_weights_of<models::tiny>(ck));
      const model::dspark_weights* drafts = drafter ? &*drafter : nullptr;
      // --max-batch 1: one generation at a time, answered in arrival order (a fresh sequence each);
      // otherwise a scheduler whose engine holds max_batch sequences and decodes them together,
      // with a connection thread for every request it can hold (running or queued) and a few more
      // (so /health and the 503s of a full queue are answered while every request thread is busy).
      std::optional<batch_scheduler> scheduler;
      if (max_batch > 1) {
        const engine_limits el{int(max_batch), limits.max_prompt_tokens, limits.max_new_tokens,
                               max_session_tokens, graphs};
        scheduler.emplace(backend == "cuda" ? extra.cuda_engine(m, el, drafts) : std::make_unique<host_engine>(m, el, drafts),
                          batch_scheduler::options{int(max_queued)});
      }
      const serve::generation_service service =
          scheduler ? serve::generation_service(*scheduler, backend, limits)
                    : serve::generation_service(
                          m,
                          backend == "cuda"
                              ? generate_fn([g = extra.cuda, graphs](
                                                const model::host_model<models::tiny>& hm, run_request r) {
                                  r.decode_graphs = graphs;
                                  return g(hm, r);
                                })
                              : generate_fn(host_generate),
                          backend, limits, drafts);
      http::server srv(
          host, int(port), [&](const http::request& r) { return service(r); }, std::size_t(1) << 20, 10,
          scheduler ? int(max_batch + max_queued + 4) : 1);
      out << "dsv4 serve: model " << config
          << (!path.empty() ? " from " + path : std::string(" (built-in random weights, seed 42)")) << ", "
          << backend << " backend, "
          << (drafter ? "DSpark drafts of " + std::to_string(drafter->block) + " tokens verified in every step, " : std::string())
          << (scheduler ? "up to " + std::to_string(max_batch) + " requests decoded together"
                        : std::string("one request at a time"))
          << ", listening on http://" << host << ":" << srv.port()
          << " (GET /health, GET /v1/model, POST /v1/generate)" << std::endl;
      srv.serve(max_requests);
      return 0;
    }
    if (cmd == "run") {
      const auto o =
          detail::parse(args, cmd,
                        {"config", "checkpoint", "prompt", "tokens", "temperature", "top-k", "top-p", "seed",
                         "prefill", "speculative", "backend", "engram-tables", "gemm", "decode-graphs"});
      const std::string prefill_mode = o.named.count("prefill") ? o.named.at("prefill") : "exact";
      if (prefill_mode != "exact" && prefill_mode != "ced")
        throw error("run: --prefill must be 'exact' or 'ced', got '" + prefill_mode + "'");
      const std::string speculative = o.named.count("speculative") ? o.named.at("speculative") : "off";
      if (speculative != "off" && speculative != "dspark")
        throw error("run: --speculative must be 'off' or 'dspark', got '" + speculative + "'");
      const std::string backend = o.named.count("backend") ? o.named.at("backend") : "host";
      if (backend != "host" && backend != "cuda")
        throw error("run: --backend must be 'host' or 'cuda', got '" + backend + "'");
      if (backend == "cuda" && !extra.cuda)
        throw error("run: this dsv4 was built without CUDA (no nvcc at configure time); rebuild with a CUDA 13 toolkit "
                    "(cmake -DDSV4_CUDA=ON) or use --backend host");
      const std::string engram_tables = o.named.count("engram-tables") ? o.named.at("engram-tables") : "device";
      if (engram_tables != "device" && engram_tables != "host")
        throw error("run: --engram-tables must be 'device' or 'host', got '" + engram_tables + "'");
      if (engram_tables == "host" && backend != "cuda")
        throw error("run: --engram-tables applies to --backend cuda (the host backend always reads its tables in host memory)");
      const std::string gemm = o.named.count("gemm") ? o.named.at("gemm") : "mma";
      if (gemm != "mma" && gemm != "wgmma") throw error("run: --gemm must be 'mma' or 'wgmma', got '" + gemm + "'");
      if (gemm == "wgmma" && backend != "cuda") throw error("run: --gemm applies to --backend cuda (the host backend has no GPU GEMMs)");
      const bool graphs = detail::decode_graphs_option(cmd, o, backend);
      if (!o.positional.empty()) throw error("run: unexpected argument '" + o.positional[0] + "'");
      const std::string config = detail::host_config(cmd, o);
      using tiny = models::tiny;
      std::vector<std::int32_t> prompt;
      if (o.named.count("prompt")) {
        prompt = detail::parse_ids(cmd, "prompt", o.named.at("prompt"));
        if (prompt.empty()) throw error("run: --prompt needs at least one token id");
      } else {
        prompt.resize(8);
        std::iota(prompt.begin(), prompt.end(), 1);
      }
      const long long n_new = o.named.count("tokens") ? detail::parse_integer(cmd, "tokens", o.named.at("tokens")) : 8;
      kernels::sampling::sampling_params sp;
      if (o.named.count("temperature")) sp.temperature = float(detail::parse_number(cmd, "temperature", o.named.at("temperature")));
      if (o.named.count("top-k")) sp.top_k = int(detail::parse_integer(cmd, "top-k", o.named.at("top-k")));
      if (o.named.count("top-p")) sp.top_p = float(detail::parse_number(cmd, "top-p", o.named.at("top-p")));
      if (o.named.count("seed")) sp.seed = std::uint64_t(detail::parse_integer(cmd, "seed", o.named.at("seed")));
      // The built-in model: a random checkpoint from a fixed seed, held in memory.
      const std::string path = o.named.count("checkpoint") ? o.named.at("checkpoint") : "";
      io::checkpoint ck = detail::open_tiny_checkpoint(path, err);
      // --engram-tables host: the tables are read in place from `ck`, which outlives `m` here.
      const auto m = model::host_model<tiny>::load(ck, detail::tiny_token_map(),
                                                   engram_tables == "host" ? model::engram_tables::mapped : model::engram_tables::copied);
      run_request req;  // what the host and CUDA backends are asked
      req.prompt = prompt, req.n_new = n_new, req.sampling = sp, req.ced = prefill_mode == "ced";
      req.engram_host_tables = engram_tables == "host";
      req.wgmma_gemms = gemm == "wgmma";
      req.decode_graphs = graphs;
      std::optional<model::dspark_weights> drafter;
      if (speculative == "dspark") {
        drafter.emplace(model::dspark_weights_of<tiny>(ck));
        req.dspark = &*drafter;
      }
      // Timed by the backend (the CUDA backend's device set-up and weight upload excluded).
      const generation g = backend == "cuda" ? extra.cuda(m, req) : host_generate(m, req);
      out << "model: " << config << (!path.empty() ? " from " + path : std::string(" (built-in random weights, seed 42)"))
          << ", " << g.device << "\nprompt:";
      for (auto id : prompt) out << " " << id;
      out << "\ngenerated:";
      for (auto id : g.tokens) out << " " << id;
      char line[160];
      // The first token comes from the prefill's logits; each later one costs a decode step (with
      // drafts: a share of a round).
      const long long steps = g.tokens.size() > 1 ? (long long)g.tokens.size() - 1 : 0;
      std::snprintf(line, sizeof line,
                    "\nprefill: %zu tokens in %.3f s (%.1f tokens/s); decode: %lld %s in %.3f s (%.2f tokens/s)\n",
                    prompt.size(), g.prefill_s, g.prefill_s > 0 ? double(prompt.size()) / g.prefill_s : 0.0, steps,
                    drafter ? "tokens" : "steps", g.decode_s, steps > 0 && g.decode_s > 0 ? double(steps) / g.decode_s : 0.0);
      out << line;
      if (drafter)
        out << "speculative: DSpark drafts of " << drafter->block << " tokens, " << g.speculative.rounds << " rounds, "
            << g.speculative.accepted << " of " << g.speculative.drafted
            << " checked drafts accepted (the tokens are plain decoding's)\n";
      using sched = models::model_traits<tiny>::schedule;
      const long long n = (long long)prompt.size();
      const auto work = schedule::prefill_layer_tokens<sched>(n, prefill_mode == "ced" ? schedule::prefill_mode::ced
                                                                                      : schedule::prefill_mode::exact,
                                                            tiny::dims.attn.window_size);
      const auto exact = schedule::prefill_layer_tokens<sched>(n, schedule::prefill_mode::exact, tiny::dims.attn.window_size);
      out << "prefill mode: " << prefill_mode << ", " << work.total() << " layer-tokens (exact: " << exact.total() << ")\n";
      return 0;
    }
    if (cmd == "logits") {
      const auto o = detail::parse(args, cmd, {"config", "checkpoint", "prompt", "decode", "out", "index-keys"});
      if (!o.positional.empty()) throw error("logits: unexpected argument '" + o.positional[0] + "'");
      const std::string config = detail::host_config(cmd, o);
      using tiny = models::tiny;
      for (const char* key : {"checkpoint", "prompt", "out"})
        if (!o.named.count(key)) throw error(std::string("logits: --") + key + " is required");
      const auto prompt = detail::parse_ids(cmd, "prompt", o.named.at("prompt"));
      if (prompt.empty()) throw error("logits: --prompt needs at least one token id");
      const auto decode = o.named.count("decode") ? detail::parse_ids(cmd, "decode", o.named.at("decode")) : std::vector<std::int32_t>{};
      for (const auto* list : {&prompt, &decode})
        for (std::int32_t id : *list)
          if (id >= tiny::dims.vocab_size)
            throw error("logits: token id " + std::to_string(id) + " is outside the vocabulary of " + config + " (" +
                        std::to_string(tiny::dims.vocab_size) + " ids)");
      const long long total = (long long)(prompt.size() + decode.size());
      if (total > tiny::dims.rope.max_position_embeddings)
        throw error("logits: " + std::to_string(total) + " positions exceed the model's " +
                    std::to_string(tiny::dims.rope.max_position_embeddings));
      auto policy = schedule::index_key_policy::follow_ownership;
      if (o.named.count("index-keys")) {
        const std::string& v = o.named.at("index-keys");
        if (v == "upstream") policy = schedule::index_key_policy::upstream_quirk;
        else if (v != "ownership") throw error("logits: --index-keys is 'ownership' or 'upstream', got '" + v + "'");
      }
      const std::string out_path = o.named.at("out");
      if (!std::ofstream(out_path, std::ios::binary))  // fail now, not after the model ran
        throw error(out_path + ": cannot open for writing");
      std::vector<std::int64_t> token_map(std::size_t(tiny::dims.vocab_size));
      std::iota(token_map.begin(), token_map.end(), 0);  // tiny: compressed vocabulary = vocabulary
      io::checkpoint ck(o.named.at("checkpoint"));
      ck.validate(models::checkpoint_schema<tiny>());
      ck.on_progress(io::load_progress_printer(err, "loading " + o.named.at("checkpoint")));
      const auto m = model::host_model<tiny>::load(ck, token_map);
      io::npy_matrix logits{.rows = 1 + decode.size(), .cols = std::size_t(tiny::dims.vocab_size), .data = {}};
      logits.data.reserve(logits.rows * logits.cols);
      model::host_sequence seq;
      seq.index_keys = policy;
      auto row = model::forward(m, seq, prompt);
      logits.data.insert(logits.data.end(), row.begin(), row.end());
      for (std::int32_t id : decode) {
        row = model::forward(m, seq, std::span<const std::int32_t>(&id, 1));
        logits.data.insert(logits.data.end(), row.begin(), row.end());
      }
      io::write_npy_f32(out_path, logits);
      out << "wrote " << logits.rows << " x " << logits.cols << " fp32 logits (prefill of " << prompt.size() << " tokens, "
          << decode.size() << " decode steps) to " << out_path << "\n";
      return 0;
    }
    if (cmd == "config-json") {
      const auto o = detail::parse(args, cmd, {"config", "out", "multipliers"});
      if (!o.positional.empty()) throw error("config-json: unexpected argument '" + o.positional[0] + "'");
      const std::string config = o.named.count("config") ? o.named.at("config") : models::tiny::name;
      std::string text, mult;
      if (config == models::tiny::name) {
        text = models::config_json_text<models::tiny>();
        mult = detail::multipliers_json<models::tiny>();
      } else if (config == models::v41_flash::name) {
        text = models::config_json_text<models::v41_flash>();
        mult = detail::multipliers_json<models::v41_flash>();
      } else {
        models::describe_builtin(config);  // throws the "unknown model config" error
      }
      auto write = [](const std::string& path, const std::string& body) {
        std::ofstream f(path);
        f << body;
        if (!f) throw error("config-json: cannot write " + path);
      };
      if (o.named.count("out")) {
        write(o.named.at("out"), text);
        out << "wrote the config.json of " << config << " to " << o.named.at("out") << "\n";
      } else {
        out << text;
      }
      if (o.named.count("multipliers")) write(o.named.at("multipliers"), mult);
      return 0;
    }
    if (cmd == "token-map") {
      const auto o = detail::parse(args, cmd, {"tokenizer", "config", "out"});
      if (!o.positional.empty()) throw error("token-map: unexpected argument '" + o.positional[0] + "'");
      if (!o.named.count("tokenizer"))
        throw error("token-map: --tokenizer FILE (a tokenizer.json) is required");
      const std::string& path = o.named.at("tokenizer");
      const engram::token_map m = engram::build_token_map(engram::read_tokenizer_vocabulary(path));
      out << path << ": " << m.ids.size() << " tokens, " << m.compressed_vocab_size << " compressed ids\n";
      if (o.named.count("config")) {
        const std::string& config = o.named.at("config");
        if (config == models::v41_flash::name)
          engram::check_token_map<models::v41_flash>(m);
        else if (config == models::tiny::name)
          engram::check_token_map<models::tiny>(m);
        else
          models::describe_builtin(config);  // throws the "unknown model config" error
        out << "matches " << config << "'s engram_compressed_vocab_size\n";
      }
      if (o.named.count("out")) {
        engram::save_token_map(o.named.at("out"), m);
        out << "wrote the map to " << o.named.at("out") << "\n";
      }
      return 0;
    }
    if (cmd == "random-checkpoint") {
      const auto o = detail::parse(args, cmd, {"config", "seed", "shard-mib", "init"});
      if (o.positional.size() != 1) throw error("random-checkpoint: give exactly one output folder");
      const std::string config = o.named.count("config") ? o.named.at("config") : models::tiny::name;
      const long long seed = o.named.count("seed") ? detail::parse_integer(cmd, "seed", o.named.at("seed")) : 0;
      const long long mib = o.named.count("shard-mib") ? detail::parse_integer(cmd, "shard-mib", o.named.at("shard-mib")) : 1024;
      if (mib == 0) throw error("random-checkpoint: --shard-mib must be at least 1");
      const auto init = io::parse_random_init(o.named.count("init") ? o.named.at("init") : "codes");
      const auto schema = detail::schema_of(config);
      io::write_random_checkpoint(schema, o.positional[0], std::size_t(mib) << 20, std::uint64_t(seed), init);
      out << "wrote " << schema.size() << " random tensors of " << config << " to " << o.positional[0]
          << (init == io::random_init::scaled ? " (scaled init)" : "") << "\n";
      return 0;
    }
    throw error("unknown command '" + cmd + "' (try: dsv4 help)");
  } catch (const std::exception& e) {
    err << "dsv4: " << e.what() << "\n";
    return 2;
  }
}

}  // namespace dsv4::cli
