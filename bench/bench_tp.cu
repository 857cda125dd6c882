//! \brief Tensor parallelism over NCCL (issue 7): the model on W GPUs of one host
//! (parallel::tp_device_model, one thread per rank) against the same model on one GPU
//! (model::device_model), in the same process on the same random weights: prefill and decode
//! tokens/s of each, the speedup, and how close the W-GPU logits are to the one-GPU logits.
//! Usage: bench_tp [--v41-width] [--world W] [--prompts N,N..] [--batches B,B..]
//!                 [--decode-context N] [--json FILE]
//!
//! Default: the tiny variant on 2 GPUs (seconds). `--v41-width`: bench_model's V4.1-width variant
//! (V4.1 Flash's widths and schedule, 16 routed experts; random weights made in host memory first,
//! a minute or two; the host then holds the checkpoint, the one-GPU model's host copy and the W
//! shards: about 4 times the 25 GB of weights, freed as the device models are built). Times are
//! wall-clock per call (each call synchronizes and returns the logits to the host), the first call
//! of each shape a warm-up. The ceiling of a W-GPU run is W times the one-GPU rate; ratio =
//! measured speedup / W.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "bench_util.cuh"
#include "bench_variants.hpp"
#include "dsv4/io/random_checkpoint.hpp"
#include "dsv4/model/device_model.cuh"
#include "dsv4/models/checkpoint_schema.hpp"
#include "dsv4/models/tiny.hpp"
#include "dsv4/parallel/tp_device_model_nccl.cuh"

using namespace dsv4;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct options {
  int world = 2;
  std::vector<int> prompts, batches;
  int decode_context = 0;
};

//! Cosine similarity of two logit vectors.
double cosine(const std::vector<float>& a, const std::vector<float>& b) {
  double ab = 0, aa = 0, bb = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    ab += double(a[i]) * b[i], aa += double(a[i]) * a[i], bb += double(b[i]) * b[i];
  return ab / std::sqrt(aa * bb);
}

template <class Model>
int run(FILE* jf, const options& opt) {
  using clock = std::chrono::steady_clock;
  constexpr auto c = Model::dims;
  const int W = opt.world;
  parallel::check_world_size<Model>(W);
  const int visible = runtime::cuda_device_count();
  if (visible < W) {
    std::printf("bench_tp: world size %d needs %d GPUs, %d visible\n", W, W, visible);
    return 2;
  }
  std::vector<std::int64_t> token_map(std::size_t(c.vocab_size));
  for (std::size_t i = 0; i < token_map.size(); ++i)
    token_map[i] = std::int64_t(i % std::size_t(c.engram.engram_compressed_vocab_size));
  const bool tiny = std::string(Model::name) == models::tiny::name;
  const std::vector<int> prompts = !opt.prompts.empty() ? opt.prompts
                                   : tiny               ? std::vector<int>{64, 512}
                                                        : std::vector<int>{8192};
  const std::vector<int> batches = !opt.batches.empty() ? opt.batches : std::vector<int>{1, 8, 32};
  const int context = opt.decode_context > 0 ? opt.decode_context : tiny ? 256 : 4096, steps = tiny ? 8 : 16;
  typename model::device_model<Model>::limits lim;
  lim.max_seqs = *std::max_element(batches.begin(), batches.end()) + 1;
  lim.max_rows = std::max(*std::max_element(prompts.begin(), prompts.end()), context);
  lim.max_tokens = std::max<long long>(lim.max_rows, context + steps + 1), lim.page_tokens = 256;

  auto t0 = clock::now();
  io::checkpoint ck =
      io::random_checkpoint_in_memory(models::checkpoint_schema<Model>(), 1, io::random_init::scaled);
  std::printf("model %s: random checkpoint made in memory in %.1f s\n", Model::name, seconds_since(t0));
  t0 = clock::now();
  std::optional<model::device_model<Model>> one;
  {
    const auto hm = model::host_model<Model>::load(ck, token_map);
    DSV4_CUDA_CHECK(cudaSetDevice(0));
    one.emplace(hm, lim);
  }
  std::printf("one-GPU model built in %.1f s\n", seconds_since(t0));
  t0 = clock::now();
  std::vector<int> devices(static_cast<std::size_t>(W));
  std::iota(devices.begin(), devices.end(), 0);
  std::optional<parallel::tp_device_model<Model>> tp;
  {
    const auto shards = parallel::tp_model<Model>::load(ck, token_map, W);
    tp.emplace(parallel::make_nccl_tp_device_model(shards, lim, devices));
  }
  std::printf("%d-GPU model built in %.1f s (NCCL, NVLS off)\n", W, seconds_since(t0));
  DSV4_CUDA_CHECK(cudaSetDevice(0));
  bench::ceilings::measure();  // printed for the record; this benchmark's ceiling is W x one GPU

  std::vector<std::int32_t> ids(std::size_t(lim.max_tokens));
  for (std::size_t i = 0; i < ids.size(); ++i)
    ids[i] = std::int32_t((i * 7919 + 13) % std::size_t(c.vocab_size));
  std::printf("\n%-10s %7s %6s %12s %12s %9s %7s %9s\n", "what", "tokens", "batch", "1 GPU tok/s",
              "W GPUs tok/s", "speedup", "ratio", "cosine");
  bool first_row = true;
  auto row = [&](const char* what, long long tokens, int batch, double s1, double sw, long long work,
                 double cos) {
    const double speedup = s1 / sw;
    std::printf("%-10s %7lld %6d %12.1f %12.1f %8.2fx %6.1f%% %9.6f\n", what, tokens, batch, work / s1,
                work / sw, speedup, 100 * speedup / W, cos);
    if (jf)
      std::fprintf(
          jf,
          "%s{\"model\": \"%s\", \"what\": \"%s\", \"world\": %d, \"tokens\": %lld, \"batch\": %d, "
          "\"one_gpu_seconds\": %.6f, \"tp_seconds\": %.6f, \"speedup\": %.4f, \"logits_cosine\": %.6f}",
          first_row ? "" : ",\n", Model::name, what, W, tokens, batch, s1, sw, speedup, cos);
    first_row = false;
  };
  // Prefill (exact), one sequence; the first call of each model warms up.
  for (int n : prompts) {
    const auto span = std::span<const std::int32_t>(ids).first(std::size_t(n));
    double s1 = 0, sw = 0;
    std::vector<float> l1, lw;
    for (int rep = 0; rep < 2; ++rep) {
      const int a = one->add_sequence();
      auto t = clock::now();
      l1 = one->prefill(a, span);
      s1 = seconds_since(t);
      one->release_sequence(a);
      const int b = tp->add_sequence();
      t = clock::now();
      lw = tp->prefill(b, span);
      sw = seconds_since(t);
      tp->release_sequence(b);
    }
    row("prefill", n, 1, s1, sw, n, cosine(l1, lw));
  }
  // Decode: `batch` sequences CED-prefilled to `context` tokens, `steps` steps each.
  for (int batch : batches) {
    std::vector<int> s1l, swl;
    for (int b = 0; b < batch; ++b) {
      s1l.push_back(one->add_sequence()), swl.push_back(tp->add_sequence());
      const auto span = std::span<const std::int32_t>(ids).first(std::size_t(context));
      one->prefill_ced(s1l.back(), span), tp->prefill_ced(swl.back(), span);
    }
    const std::vector<std::int32_t> tok(std::size_t(batch), 5);
    std::vector<float> l1 = one->decode(s1l, tok), lw = tp->decode(swl, tok);  // warm-up
    auto t = clock::now();
    for (int i = 0; i < steps; ++i) l1 = one->decode(s1l, tok);
    const double s1 = seconds_since(t) / steps;
    t = clock::now();
    for (int i = 0; i < steps; ++i) lw = tp->decode(swl, tok);
    const double sw = seconds_since(t) / steps;
    row("decode", context, batch, s1, sw, batch, cosine(l1, lw));
    for (int s : s1l) one->release_sequence(s);
    for (int s : swl) tp->release_sequence(s);
  }
  std::printf("\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // rows appear as they are measured, also through a pipe
  try {
    options opt;
    bool v41 = false;
    const char* json = nullptr;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      const bool has_value = i + 1 < argc;
      if (a == "--json" && has_value)
        json = argv[++i];
      else if (a == "--v41-width")
        v41 = true;
      else if (a == "--world" && has_value)
        opt.world = bench::int_list(a, argv[++i]).at(0);
      else if (a == "--prompts" && has_value)
        opt.prompts = bench::int_list(a, argv[++i]);
      else if (a == "--batches" && has_value)
        opt.batches = bench::int_list(a, argv[++i]);
      else if (a == "--decode-context" && has_value)
        opt.decode_context = bench::int_list(a, argv[++i]).at(0);
      else {
        std::fprintf(stderr,
                     "usage: bench_tp [--v41-width] [--world W] [--prompts N,N..] [--batches B,B..] "
                     "[--decode-context N] [--json FILE]\n");
        return 2;
      }
    }
    FILE* jf = json ? std::fopen(json, "w") : nullptr;
    if (json && !jf) {
      std::fprintf(stderr, "bench_tp: cannot write %s\n", json);
      return 1;
    }
    if (jf) std::fprintf(jf, "[\n");
    const int rc = v41 ? run<bench_variants::v41_width>(jf, opt) : run<models::tiny>(jf, opt);
    if (jf) std::fprintf(jf, "\n]\n"), std::fclose(jf);
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_tp: %s\n", e.what());
    return 1;
  }
}
