//! \brief The whole model on CUDA (model::device_model): prefill tokens/s in exact and CED mode,
//! decode tokens/s at several batch sizes, global-cache bytes per token actually allocated.
//! Usage: bench_model [--v41-width] [--prompts N,N..] [--batches B,B..] [--decode-context N,N..]
//!                    [--checkpoint DIR] [--profile-decode] [--profile-prefill exact|ced] [--issue-time]
//!                    [--decode-graphs]
//!                    [--engram-host-tables] [--chunk N] [--gemm mma|wgmma] [--gemm-max-tokens N]
//!                    [--no-folded] [--[no-]fused-act-quant] [--no-wo-a-fp8] [--ab-act-quant] [--ab-mhc]
//!                    [--ab-decode-defaults] [--ab-early-stream]
//!                    [--dspark]
//!                    [--mhc-one-token-ctas N] [--mhc-small-groups N,M] [--config-json FILE]
//!                    [--checkpoint-only] [--clone-contexts] [--json FILE]
//!
//! Default: the tiny variant (seconds). `--v41-width`: V4.1 Flash's widths and schedule with the
//! routed experts cut to 16 (DSpark stages to 8) and small Engram tables, so that one H200 holds it
//! (the table says so); its random weights (scaled initialisation, 25 GB) are made in host memory
//! first, which takes a minute or two. Times are wall-clock per call (each call synchronizes:
//! prefill / decode as a serving loop would see them, launch overheads included).
//! `--chunk N`: prompts (and the decode batches' contexts) longer than N tokens go in as a prefill of
//! N tokens and appended chunks of N (exact: `append`, the same work as one call; CED: `append_ced`,
//! each chunk's decoder replaying the last window), so that max_rows, and the scratch that grows
//! with it (the index scores and lists: rows x keys), stays at N: how 64K prompts and 128K
//! contexts fit one GPU.
//! `--mhc-one-token-ctas N`: the mHC boundaries run one token a CTA up to N tokens a call
//! (kernels::mhc::set_one_token_ctas_up_to; default 16), token groups above.
//! `--mhc-small-groups N,M`: above that, two tokens a CTA up to N tokens a call, four up to M
//! (kernels::mhc::set_small_token_groups; default 48,64; 0: none).
//! `--decode-context N,N..`: the plain decode rows at each context length (every batch size at each;
//! default 8K, tiny 256); the profile and the DSpark rounds run at the first.
//! `--checkpoint DIR` writes the random checkpoint to DIR instead, or reuses the one DIR holds.
//! `--config-json FILE`: also write the variant's inference/config.json (models::config_json_text),
//! so that the official reference can build the same model (scripts/gpu-reference-speed.sh).
//! `--clone-contexts`: a decode batch's sequences are one prefilled context and copies of it
//! (device_model::copy_sequence) instead of a prefill each: the same work per step, without the
//! batch's prefills (64 contexts of 128K tokens would take minutes). Either way the contexts hold
//! the same ids; the rows of a decode step differ by their token (ids 5 + 7919 b), so that the MoE
//! routes them as distinct requests (before the thirty-third session every row took id 5: one
//! routing for the whole batch, fewer experts read than a real batch reads).
//! `--checkpoint-only` (with `--checkpoint DIR`): write the random checkpoint (and the config.json)
//! and stop, for a reference run on the same weights without timing ours again (they come from a
//! fixed seed: the same weights every time).
//! `--profile-decode`: prefill the first batch size's sequences, then run one decode step between
//! cudaProfilerStart and cudaProfilerStop and stop (for `ncu --profile-from-start off`: the kernels of one
//! step).
//! `--profile-prefill exact|ced`: one warm-up prefill of the first prompt length, then one more
//! between cudaProfilerStart and cudaProfilerStop, and stop (the kernels of one prefill).
//! `--engram-host-tables`: the Engram tables stay in host memory and each call's rows are fetched
//! ahead of the Engram layers (device_model::limits::engram_host_tables); the fetch statistics
//! (bytes, gather time, the time the launching thread waited for it) are printed at the end. With
//! `--checkpoint`, the tables are then read in place from the checkpoint's memory mapping.
//! `--gemm wgmma`: the few-token block-scaled GEMMs (the FP8 linears below the dequantize +
//! cuBLAS path) run on the wgmma kernel (gemm/wgmma_gemm.cuh) instead of mma.sync;
//! `--gemm-max-tokens N` (with wgmma): up to N tokens (default 63) before that path.
//! `--no-folded`: the wide FP8 linears of 32-128 tokens off the folded kernel (gemm/folded_gemm.cuh),
//! on the paths before it (mma.sync, dequantize + cuBLAS from 64 tokens), to compare.
//! `--fused-act-quant`: the norms that feed FP8 linears (the mHC boundaries, q_norm) write the
//! act_quant in the same launch (numerics::set_fused_act_quant; by default only q_norm does);
//! `--no-fused-act-quant`: neither does; `--no-wo-a-fp8`:
//! wo_a through cuBLAS bf16 at every size (output::set_wo_a_fp8), to compare. `--ab-act-quant`:
//! each decode batch is also timed with the act_quant fused at no site, in the plain norms only,
//! in the mHC boundaries only and at both, twice (rows decode-aq-none / -norms / -boundaries /
//! -both), in the same process on the same sequences. `--ab-mhc`: each decode
//! batch also timed with the mHC boundaries' projection rows bulk-copied into shared memory and
//! loaded into registers (kernels::mhc::set_decode_weights_in_registers), alternating, twice (rows
//! decode-mhc-shared / decode-mhc-regs). `--ab-decode-defaults`: each decode batch also timed with
//! the small-call defaults of the forty-fifth session off and on (attention's 64 heads as two CTAs
//! of 32, kernels::attention::set_decode_head_halves; the decode GEMM plans,
//! kernels::gemm::set_decode_plans), alternating, twice (rows decode-old-defaults / -new-defaults).
//! `--ab-early-stream`: the same with the MoE's w2 starting its weight stream after / before the
//! wait for SwiGLU (kernels::gemm::set_early_expert_stream; rows decode-w2-after-wait / -early).
//! `--issue-time`: each decode batch's steps again, each behind a 100 ms wait on the device's
//! stream, so that the step's launches queue before the device reaches them: row decode-queued is
//! the device's time for a step from the wait's end (events), printed with the host's time to
//! issue the step (device_model::last_issue_seconds). A step that takes much longer in the plain
//! row than queued is bound by the host's launches, which a captured graph would remove. Then
//! the launch logs (runtime/launch_log.hpp) of the last two of those steps are compared: every
//! launch whose grid, shared memory or argument bytes changed from one step to the next is
//! printed (what a graph captured from one step could not replay unchanged).
//! `--decode-graphs`: each decode batch's steps again through captured graphs
//! (device_model::set_decode_graphs): one round that warms up and captures, then row
//! decode-graphs, with the segments replayed, captured, diverged and plain.
//! `--dspark`: also the DSpark drafter on CUDA (model::device_dspark): one sequence at the decode
//! context, then per round one backbone decode step with the capture of main_hidden and one draft
//! block, timed apart (row `dspark-draft`: the block's drafts per second; its floor is the
//! drafter's weights, the head and the expected distinct DSpark experts of a block, over the copy
//! bandwidth). Then, per decode batch size N, batched speculative rounds
//! (model/device_speculative.cuh) in their parts: N draft blocks (one drafter pass over the
//! batch), the verification of N x (block + 1) rows in one backbone call (row `spec-verify`),
//! and the rollback of a round whose every draft was rejected (restore, re-append one row per
//! sequence: row `spec-redo`); with the decode step of the same batch, they bound what a round
//! yields: every draft accepted (block + 1 tokens per sequence, no rollback) and none (1 token
//! per sequence, with the rollback), printed against plain decoding. The drafter is untrained
//! (random weights): where a trained one lands between the bounds is its acceptance rate.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include <cuda_profiler_api.h>

#include "bench_util.cuh"
#include "bench_variants.hpp"
#include "dsv4/io/random_checkpoint.hpp"
#include "dsv4/model/device_dspark.cuh"
#include "dsv4/model/device_model.cuh"
#include "dsv4/models/checkpoint_schema.hpp"
#include "dsv4/models/config_json.hpp"
#include "dsv4/models/tiny.hpp"
#include "dsv4/models/v41_flash.hpp"
#include "dsv4/schedule/prefill_work.hpp"

using namespace dsv4;


namespace {

//! Holds the stream for `ns` nanoseconds of the device's clock (one thread): the launches issued
//! behind it queue up, so the time from its end to the work's end is the device's alone.
__global__ void wait_on_device(unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}
using bench_variants::v41_width;

//! What one token costs in weights, from the checkpoint schema: the bytes a decode step must read
//! at least (every layer's weights and the head; of the routed experts the expected number of
//! distinct ones a batch selects under uniform routing, n (1 - (1 - k/n)^batch); not the
//! embeddings, the Engram tables' untouched rows, DSpark or the vision tower) and the matmul
//! FLOPs of one prefill token (2 per active weight; k of n routed experts; no head).
struct weight_traffic {
  double dense_bytes = 0, routed_bytes = 0, dense_weights = 0, routed_weights = 0;
  int experts = 0, topk = 0;

  //! `prefix`: the blocks counted ("layers." the backbone's, "mtp." the DSpark stages').
  static weight_traffic of(const std::vector<io::tensor_spec>& schema, int n_experts, int topk, const std::string& prefix = "layers.") {
    weight_traffic w;
    w.experts = n_experts, w.topk = topk;
    const auto shapes = io::written_shapes(schema);
    for (std::size_t i = 0; i < schema.size(); ++i) {
      const std::string& name = schema[i].name;
      const bool layer = name.rfind(prefix, 0) == 0, head = name == "head.weight";
      if ((!layer && !head) || name.find(".engram.embed.") != std::string::npos) continue;
      const io::st_dtype d = schema[i].dtypes.front();
      double elements = 1;
      for (long long x : shapes[i]) elements *= double(x);
      const double bytes = elements * io::dtype_bytes(d);
      const bool scale = d == io::st_dtype::F8_E8M0;
      const double weights = scale ? 0.0 : d == io::st_dtype::I8 ? 2 * elements : elements;  // I8: two FP4 codes
      const bool routed = name.find(".ffn.experts.") != std::string::npos;
      (routed ? w.routed_bytes : w.dense_bytes) += bytes;
      if (!head) (routed ? w.routed_weights : w.dense_weights) += weights;
    }
    return w;
  }
  double decode_bytes(int batch) const {
    const double distinct = experts * (1 - std::pow(1 - double(topk) / experts, batch));
    return dense_bytes + routed_bytes * distinct / experts;
  }
  double prefill_flops_per_token() const { return 2 * (dense_weights + routed_weights * topk / experts); }
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct options {
  std::vector<int> prompts, batches;  // empty: the variant's defaults
  std::vector<int> decode_contexts;   // empty: the variant's default; decode is timed at each
  std::string checkpoint;             // empty: a temporary folder, removed at the end
  bool profile_decode = false;        // one decode step between cudaProfilerStart / Stop, nothing else
  std::string profile_prefill;        // "exact" / "ced": one prefill between cudaProfilerStart / Stop, nothing else
  bool engram_host_tables = false;    // Engram tables in host memory, rows fetched per call (issue 5)
  int chunk = 0;                      // > 0: longer prompts as a prefill of `chunk` tokens + appended chunks
  bool dspark = false;                // also time the DSpark drafter on CUDA
  bool checkpoint_only = false;       // write the checkpoint to `checkpoint` and stop
  bool issue_time = false;            // decode: a step's host issue time, and its device time queued
  bool ab_act_quant = false;          // decode: also the act_quant fused at neither / each / both sites
  bool ab_mhc = false;                // decode: also the mHC projection rows in shared memory / registers
  bool ab_decode_defaults = false;    // decode: also the small-call attention CTAs and GEMM plans off / on
  bool ab_early_stream = false;       // decode: also the MoE's w2 stream after / before SwiGLU's end
  bool decode_graphs = false;         // decode: each batch also timed through captured graphs
  bool clone_contexts = false;        // decode batches: one prefill, the other sequences copies of it
};

//! `--checkpoint DIR`: the random checkpoint of `Model` (scaled initialisation, seed 1) written to
//! DIR, or the one DIR holds reused.
template <class Model>
void ensure_random_checkpoint(const std::filesystem::path& dir) {
  if (std::filesystem::exists(dir / "model.safetensors.index.json")) {
    std::printf("model %s: reusing the random checkpoint in %s\n", Model::name, dir.c_str());
    return;
  }
  const auto t0 = std::chrono::steady_clock::now();
  io::write_random_checkpoint(models::checkpoint_schema<Model>(), dir.string(), std::size_t(4) << 30, 1,
                              io::random_init::scaled);
  std::printf("model %s: random checkpoint written to %s in %.1f s\n", Model::name, dir.c_str(), seconds_since(t0));
}

template <class Model>
int run(FILE* jf, const options& opt) {
  using clock = std::chrono::steady_clock;
  constexpr auto c = Model::dims;
  using sched = typename models::model_traits<Model>::schedule;
  std::vector<std::int64_t> token_map(std::size_t(c.vocab_size));
  for (std::size_t i = 0; i < token_map.size(); ++i) token_map[i] = std::int64_t(i % std::size_t(c.engram.engram_compressed_vocab_size));
  const auto schema = models::checkpoint_schema<Model>();
  auto t0 = clock::now();
  // The random weights: in memory (default), or in a folder kept between runs. From a folder with
  // --engram-host-tables, the Engram tables are read in place from the checkpoint's mapping
  // (model::engram_tables::mapped), so `file_ck` lives as long as the models.
  // (The in-memory checkpoint is kept only for --dspark, which reads the drafter's tensors after.)
  std::optional<io::checkpoint> file_ck, memory_ck;
  const auto hm = [&] {
    if (opt.checkpoint.empty()) {
      io::checkpoint& ck = memory_ck.emplace(io::random_checkpoint_in_memory(schema, 1, io::random_init::scaled));
      std::printf("model %s: random checkpoint made in memory in %.1f s\n", Model::name, seconds_since(t0));
      t0 = clock::now();
      auto m = model::host_model<Model>::load(ck, token_map);
      if (!opt.dspark) memory_ck.reset();
      return m;
    }
    const std::filesystem::path dir(opt.checkpoint);
    ensure_random_checkpoint<Model>(dir);
    t0 = clock::now();
    io::checkpoint& ck = file_ck.emplace(dir.string());
    ck.on_progress(io::load_progress_printer(std::cout, "loading " + dir.string()));
    return model::host_model<Model>::load(ck, token_map,
                                          opt.engram_host_tables ? model::engram_tables::mapped : model::engram_tables::copied);
  }();
  std::printf("host model loaded in %.1f s\n", seconds_since(t0));

  const bool tiny = std::string(Model::name) == models::tiny::name;
  const std::vector<int> prompt_lengths =
      !opt.prompts.empty() ? opt.prompts : tiny ? std::vector<int>{64, 512} : std::vector<int>{8192, 65535};
  const std::vector<int> batches = !opt.batches.empty() ? opt.batches : std::vector<int>{1, 8, 64};
  const std::vector<int> decode_contexts =
      !opt.decode_contexts.empty() ? opt.decode_contexts : std::vector<int>{tiny ? 256 : 8192};
  // The profile and the DSpark rounds run at the first context; the plain decode rows at each.
  const int decode_context = decode_contexts.front(), steps = tiny ? 8 : 16;
  const int longest_context = *std::max_element(decode_contexts.begin(), decode_contexts.end());
  typename model::device_model<Model>::limits lim;
  lim.max_seqs = *std::max_element(batches.begin(), batches.end()) + 2;
  const int longest = std::max(*std::max_element(prompt_lengths.begin(), prompt_lengths.end()), longest_context);
  lim.max_rows = opt.chunk > 0 ? std::min(longest, opt.chunk) : longest;
  // (--ab-act-quant: eight more rounds of steps on the same sequences; --ab-mhc,
  // --ab-decode-defaults and --ab-early-stream: four more each.)
  // (--issue-time: one more.)
  // (--decode-graphs: two more, the first capturing.)
  const int step_rounds = 1 + (opt.ab_act_quant ? 8 : 0) + (opt.ab_mhc ? 4 : 0) + (opt.ab_decode_defaults ? 4 : 0) + (opt.ab_early_stream ? 4 : 0) +
                          (opt.issue_time ? 1 : 0) +
                          (opt.decode_graphs ? 2 : 0);
  lim.max_tokens = std::max<long long>(longest, longest_context + step_rounds * steps + 1), lim.page_tokens = 256;
  lim.ced_appends = opt.chunk > 0 && opt.chunk < longest;  // chunked CED prompts append in CED mode
  lim.engram_host_tables = opt.engram_host_tables;
  // --dspark: a speculative round of every sequence of the largest batch in one call, and room
  // for the rounds (block + 1 tokens each, the warm-up's too) after the decode context.
  if (opt.dspark) {
    lim.logit_rows = std::min(lim.max_rows, (lim.max_seqs - 2) * (c.dspark.dspark_block_size + 1));
    lim.max_tokens = std::max<long long>(lim.max_tokens, decode_context + 1 + (steps + 1LL) * (c.dspark.dspark_block_size + 1));
  }
  t0 = clock::now();
  model::device_model<Model> dm(hm, lim);
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  std::printf("device model built in %.1f s\n", seconds_since(t0));
  const auto traffic = weight_traffic::of(models::checkpoint_schema<Model>(), c.moe.n_routed_experts, c.moe.n_activated_experts);
  const auto ceiling = bench::ceilings::measure();
  std::printf("weights: a decode step reads >= %.2f GB at batch 1; a prefill token is %.2f GFLOP of matmuls\n",
              traffic.decode_bytes(1) / 1e9, traffic.prefill_flops_per_token() / 1e9);
  std::printf("floor: decode = weight bytes / copy bandwidth; prefill = matmul FLOPs / cuBLAS bf16 rate\n");
  if (kernels::gemm::current_decode_gemm() == kernels::gemm::decode_gemm::wgmma)
    std::printf("few-token block-scaled GEMMs: wgmma, up to %d tokens\n\n", kernels::gemm::wgmma_max_tokens());
  else
    std::printf("few-token block-scaled GEMMs: mma.sync\n\n");
  std::printf("%-12s %8s %6s %11s %12s %11s %7s\n", "what", "tokens", "batch", "seconds", "tokens/s", "floor s", "ratio");
  bool first_row = true;
  auto row = [&](const char* what, long long tokens, int batch, double s, double tps, double floor_s) {
    std::printf("%-12s %8lld %6d %11.4f %12.1f %11.4f %6.1f%%\n", what, tokens, batch, s, tps, floor_s, 100 * floor_s / s);
    if (jf)
      std::fprintf(jf,
                   "%s{\"model\": \"%s\", \"what\": \"%s\", \"tokens\": %lld, \"batch\": %d, \"seconds\": %.6f, "
                   "\"tokens_per_s\": %.3f, \"floor_seconds\": %.6f, \"copy_GBps\": %.1f, \"bf16_TFLOPs\": %.1f}",
                   first_row ? "" : ",\n", Model::name, what, tokens, batch, s, tps, floor_s, ceiling.copy_bps / 1e9,
                   ceiling.gemm_fps / 1e12);
    first_row = false;
  };
  std::vector<std::int32_t> ids(std::size_t(lim.max_tokens));
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = std::int32_t((i * 7919 + 13) % std::size_t(c.vocab_size));
  // A prompt of n tokens into `slot`: one call, or with --chunk a prefill and appended chunks.
  // Returns its layer-token work (schedule/prefill_work.hpp).
  auto put_prompt = [&](int slot, int n, bool ced) {
    const int step = opt.chunk > 0 ? opt.chunk : n;
    const auto mode = ced ? schedule::prefill_mode::ced : schedule::prefill_mode::exact;
    long long work = 0;
    for (int at = 0; at < n; at += step) {
      const auto part = std::span<const std::int32_t>(ids).subspan(std::size_t(at), std::size_t(std::min(step, n - at)));
      if (at == 0) ced ? (void)dm.prefill_ced(slot, part) : (void)dm.prefill(slot, part);
      else ced ? (void)dm.append_ced(slot, part) : (void)dm.append(slot, part);
      work += schedule::prefill_layer_tokens<sched>((long long)part.size(), mode, c.attn.window_size, at).total();
    }
    return work;
  };
  // `batch` sequences prefilled (CED) to `context` tokens, and one warm-up decode step.
  // A decode step's ids: one per row, distinct, so that the rows route as distinct requests.
  const long long vocab = c.vocab_size;
  auto step_ids = [vocab](int batch) {
    std::vector<std::int32_t> row_ids;
    for (long long b = 0; b < batch; ++b) row_ids.push_back(std::int32_t((5 + 7919 * b) % vocab));
    return row_ids;
  };
  auto decode_batch = [&](int batch, int context) {
    std::vector<int> slots;
    for (int b = 0; b < batch; ++b) {
      if (opt.clone_contexts && b > 0) {
        slots.push_back(dm.copy_sequence(slots.front()));
        continue;
      }
      slots.push_back(dm.add_sequence());
      put_prompt(slots.back(), context, true);
    }
    dm.decode(slots, step_ids(batch));
    return slots;
  };
  if (!opt.profile_prefill.empty()) {  // for `ncu --profile-from-start off`: the kernels of one prefill
    const bool ced = opt.profile_prefill == "ced";
    for (int rep = 0; rep < 2; ++rep) {
      const int slot = dm.add_sequence();
      if (rep == 1) DSV4_CUDA_CHECK(cudaProfilerStart());
      put_prompt(slot, prompt_lengths.front(), ced);
      if (rep == 1) DSV4_CUDA_CHECK(cudaProfilerStop());
      dm.release_sequence(slot);
    }
    std::printf("profiled one %s prefill of %d tokens\n", ced ? "CED" : "exact", prompt_lengths.front());
    return 0;
  }
  if (opt.profile_decode) {  // for `ncu --profile-from-start off`: the kernels of one decode step
    const int batch = batches.front();
    const auto slots = decode_batch(batch, decode_context);
    const auto tok = step_ids(batch);
    DSV4_CUDA_CHECK(cudaProfilerStart());
    dm.decode(slots, tok);
    DSV4_CUDA_CHECK(cudaProfilerStop());
    std::printf("profiled one decode step: batch %d at %d tokens of context\n", batch, decode_context);
    return 0;
  }
  // Prefill, exact and CED, one sequence at a time (the first call of each warms up).
  for (int n : prompt_lengths)
    for (bool ced : {false, true}) {
      for (int rep = 0; rep < 2; ++rep) {
        const int slot = dm.add_sequence();
        const auto t = clock::now();
        const long long work = put_prompt(slot, n, ced);
        const double s = seconds_since(t);
        // CED's floor: the exact floor times its share of the layer-token work (with chunks, every
        // chunk's decoder replays up to a window).
        const double share =
            double(work) / double(schedule::prefill_layer_tokens<sched>(n, schedule::prefill_mode::exact, c.attn.window_size).total());
        if (rep == 1)
          row(ced ? "prefill-ced" : "prefill", n, 1, s, n / s, share * n * traffic.prefill_flops_per_token() / ceiling.gemm_fps);
        if (rep == 1 && opt.chunk > 0 && n > opt.chunk)
          std::printf("           (a prefill of %d tokens and %d appended chunks)\n", opt.chunk, (n - 1) / opt.chunk);
        if (rep == 1 && !ced) {
          const auto u = dm.attention().usage();
          std::printf("           global cache: %.1f bytes per token allocated (page tails included)\n", u.bytes_per_token());
        }
        dm.release_sequence(slot);
      }
    }
  // Decode: `batch` sequences at each context, `steps` steps each.
  std::vector<double> decode_s;  // per batch size at the first context, for the speculative rounds' comparison
  for (std::size_t ci = 0; ci < decode_contexts.size(); ++ci)
    for (int batch : batches) {
      const int context = decode_contexts[ci];
      const auto slots = decode_batch(batch, context);
      const auto tok = step_ids(batch);
      auto time_steps = [&] {
        const auto t = clock::now();
        for (int i = 0; i < steps; ++i) dm.decode(slots, tok);
        return seconds_since(t) / steps;
      };
      const double s = time_steps();
      if (ci == 0) decode_s.push_back(s);
      row("decode", context, batch, s, batch / s, traffic.decode_bytes(batch) / ceiling.copy_bps);
      if (opt.issue_time) {  // the same steps behind a wait on the device, so that every launch queues first
        constexpr unsigned long long wait_ns = 100'000'000;
        cudaEvent_t began, ended;
        DSV4_CUDA_CHECK(cudaEventCreate(&began));
        DSV4_CUDA_CHECK(cudaEventCreate(&ended));
        std::vector<double> issue, queued;
        runtime::launch_counts per_step{};
        std::vector<runtime::launch_record> last_logs[2];  // the last two steps' launches
        for (int i = 0; i < steps; ++i) {
          wait_on_device<<<1, 1, 0, dm.stream()>>>(wait_ns);
          DSV4_CUDA_CHECK(cudaEventRecord(began, dm.stream()));
          const auto before = runtime::thread_launch_counts();
          std::optional<runtime::launch_log> log;
          if (i + 2 >= steps) log.emplace();
          dm.decode(slots, tok);
          per_step = {runtime::thread_launch_counts().kernels - before.kernels,
                      runtime::thread_launch_counts().blas_calls - before.blas_calls};
          if (log) last_logs[(i + 2 - steps) & 1] = log->records();
          issue.push_back(dm.last_issue_seconds());
          DSV4_CUDA_CHECK(cudaEventRecord(ended, dm.stream()));
          DSV4_CUDA_CHECK(cudaEventSynchronize(ended));
          float ms = 0;
          DSV4_CUDA_CHECK(cudaEventElapsedTime(&ms, began, ended));
          queued.push_back(ms / 1e3);
        }
        DSV4_CUDA_CHECK(cudaEventDestroy(began));
        DSV4_CUDA_CHECK(cudaEventDestroy(ended));
        std::sort(issue.begin(), issue.end()), std::sort(queued.begin(), queued.end());
        const double issue_s = issue[issue.size() / 2], queued_s = queued[queued.size() / 2];
        row("decode-queued", context, batch, queued_s, batch / queued_s,
            traffic.decode_bytes(batch) / ceiling.copy_bps);
        const char* drained =
            issue_s * 1e9 > double(wait_ns) ? ", longer than the wait: the queue drained" : "";
        std::printf(
            "           (the host issues a step, %llu kernel launches and %llu cuBLAS calls, in %.2f ms%s;\n"
            "            behind a wait, its launches queued, the device takes %.2f ms of the %.2f ms step)\n",
            per_step.kernels, per_step.blas_calls, issue_s * 1e3, drained, queued_s * 1e3, s * 1e3);
        // What a graph captured from one step would replay wrongly on the next: every launch
        // whose shape or arguments changed between the last two steps (docs/decode-graph.md).
        const auto changed = runtime::compare_launch_logs(
            last_logs[0], last_logs[1],
            [](const runtime::launch_record& r) { return runtime::launch_name(r); }, 40);
        std::printf("           launch log of the last two steps (%zu / %zu launches): %s\n",
                    last_logs[0].size(), last_logs[1].size(),
                    changed.empty() ? "identical (a graph of one step replays the next)" : "");
        for (const std::string& line : changed) std::printf("             %s\n", line.c_str());
      }
      if (opt.decode_graphs) {  // the same sequences through captured graphs (warm-up and capture first)
        dm.set_decode_graphs(true);
        (void)time_steps();
        const double g = time_steps();
        const auto n = dm.decode_graph_counts();
        dm.set_decode_graphs(false);
        row("decode-graphs", context, batch, g, batch / g, traffic.decode_bytes(batch) / ceiling.copy_bps);
        std::printf(
            "           (segments over %d steps: %lld replayed, %lld captured, %lld diverged, %lld plain)\n",
            2 * steps, n.replayed, n.captured, n.diverged, n.eager);
      }
      if (opt.ab_act_quant) {  // the same sequences, alternating: no site fused, each alone, both, twice
        using numerics::act_quant_site;
        const bool norms0 = numerics::fused_act_quant(act_quant_site::norms),
                   boundaries0 = numerics::fused_act_quant(act_quant_site::boundaries);
        for (int round = 0; round < 2; ++round)
          for (const int v : {0, 1, 2, 3}) {
            numerics::set_fused_act_quant(act_quant_site::norms, v & 1);
            numerics::set_fused_act_quant(act_quant_site::boundaries, v & 2);
            const double t = time_steps();
            const char* names[] = {"decode-aq-none", "decode-aq-norms", "decode-aq-boundaries",
                                   "decode-aq-both"};
            row(names[v], context, batch, t, batch / t, traffic.decode_bytes(batch) / ceiling.copy_bps);
          }
        numerics::set_fused_act_quant(act_quant_site::norms, norms0);
        numerics::set_fused_act_quant(act_quant_site::boundaries, boundaries0);
      }
      // A switch off and on, alternating, twice, on the same sequences; then its value before.
      auto ab_rows = [&](const char* off_row, const char* on_row, bool was, auto set) {
        for (int round = 0; round < 2; ++round)
          for (const bool on : {false, true}) {
            set(on);
            const double t = time_steps();
            row(on ? on_row : off_row, context, batch, t, batch / t, traffic.decode_bytes(batch) / ceiling.copy_bps);
          }
        set(was);
      };
      if (opt.ab_mhc)  // projection rows in shared memory, in registers
        ab_rows("decode-mhc-shared", "decode-mhc-regs", kernels::mhc::decode_weights_in_registers(),
                [](bool on) { kernels::mhc::set_decode_weights_in_registers(on); });
      if (opt.ab_decode_defaults)  // the small-call attention CTAs and decode GEMM plans
        ab_rows("decode-old-defaults", "decode-new-defaults", kernels::gemm::decode_plans(), [](bool on) {
          kernels::attention::set_decode_head_halves(on);
          kernels::gemm::set_decode_plans(on);
        });
      if (opt.ab_early_stream)  // the MoE's w2 starting its weights after / before the wait for SwiGLU
        ab_rows("decode-w2-after-wait", "decode-w2-early", kernels::gemm::early_expert_stream(),
                [](bool on) { kernels::gemm::set_early_expert_stream(on); });
      for (int sl : slots) dm.release_sequence(sl);
    }
  // The DSpark drafter: one sequence at the decode context (CED prompt: the capture then holds its
  // replayed rows, the last window positions), then rounds of one backbone step + one draft block.
  if constexpr (sched::drafter::stages > 0) {
    if (opt.dspark) {
      io::checkpoint& ck = file_ck ? *file_ck : *memory_ck;
      model::device_dspark<Model> dd(dm, model::dspark_weights_of<Model>(ck), lim.max_seqs);
      dm.capture_main_hidden(true);
      const int slot = dm.add_sequence();
      put_prompt(slot, decode_context, true);
      const long long rows = dm.main_hidden_rows();
      dd.prefill(slot, dm.main_hidden(), rows, dm.length(slot) - rows);
      const std::int32_t tok[1] = {5};
      double backbone_s = 0, draft_s = 0;
      for (int i = -1; i < steps; ++i) {  // (round -1 warms up)
        auto t = clock::now();
        dm.decode({slot}, tok);
        const double b = seconds_since(t);
        t = clock::now();
        dd.decode(slot, tok[0], dm.main_hidden(), 1);
        const double d = seconds_since(t);
        if (i >= 0) backbone_s += b, draft_s += d;
      }
      backbone_s /= steps, draft_s /= steps;
      const int block = c.dspark.dspark_block_size;
      const auto drafter = weight_traffic::of(models::checkpoint_schema<Model>(), c.dspark.dspark_n_routed_experts,
                                              c.dspark.dspark_n_activated_experts, "mtp.");
      row("dspark-draft", block, 1, draft_s, block / draft_s, drafter.decode_bytes(block) / ceiling.copy_bps);
      std::printf("           (%d drafts a round; the backbone's decode step with the capture: %.4f s, so a round of drafts "
                  "costs %.2f backbone steps)\n",
                  block, backbone_s, draft_s / backbone_s);
      dm.release_sequence(slot);
      // Batched speculative rounds in their parts (see the file comment).
      const std::size_t hidden_row = std::size_t(sched::drafter::targets::size) * std::size_t(c.dim);
      for (std::size_t bi = 0; bi < batches.size(); ++bi) {
        const int N = batches[bi];
        if (N * (block + 1) > dm.logit_rows()) {
          std::printf("           batch %d: no speculative rounds (a round's %d rows exceed logit_rows %d)\n", N,
                      N * (block + 1), dm.logit_rows());
          continue;
        }
        std::vector<int> slots;
        for (int b = 0; b < N; ++b) {
          slots.push_back(dm.add_sequence());
          put_prompt(slots.back(), decode_context, true);
          const long long r = dm.main_hidden_rows();
          dd.prefill(slots.back(), dm.main_hidden(), r, dm.length(slots.back()) - r);
        }
        dm.decode(slots, std::vector<std::int32_t>(std::size_t(N), 5));  // every sequence's first pending row
        long long pending = 1;
        std::vector<std::vector<std::int32_t>> chunks(static_cast<std::size_t>(N));
        std::vector<typename model::device_model<Model>::sequence_snapshot> snaps(static_cast<std::size_t>(N));
        double draft_total = 0, verify_total = 0, redo_total = 0;
        for (int i = -1; i < steps; ++i) {  // (round -1 warms up)
          auto t = clock::now();
          std::vector<typename model::device_dspark<Model>::step> draft_steps;
          for (int b = 0; b < N; ++b) {  // the drafter reads the last call's capture in place
            const numerics::bf16* rows = dm.main_hidden();
            rows += std::size_t(b) * std::size_t(pending) * hidden_row;
            draft_steps.push_back({slots[std::size_t(b)], 5, rows, pending});
          }
          auto drafts = dd.decode(draft_steps, false);  // one pass for the batch, ids only
          for (int b = 0; b < N; ++b) chunks[std::size_t(b)] = std::move(drafts[std::size_t(b)].ids);
          const double d = seconds_since(t);
          for (int b = 0; b < N; ++b) dm.save_sequence(slots[std::size_t(b)], snaps[std::size_t(b)]);
          t = clock::now();
          dm.append_all_on_device(slots, chunks);
          DSV4_CUDA_CHECK(cudaStreamSynchronize(dm.stream()));
          const double v = seconds_since(t);
          // The rollback of a round with every draft rejected, timed, then the round again so that
          // every sequence holds all block + 1 rows (the next drafts read their capture).
          t = clock::now();
          std::vector<std::vector<std::int32_t>> firsts;
          for (int b = 0; b < N; ++b) {
            dm.restore_sequence(slots[std::size_t(b)], snaps[std::size_t(b)]);
            firsts.push_back({chunks[std::size_t(b)][0]});
          }
          dm.append_all_on_device(slots, firsts);
          DSV4_CUDA_CHECK(cudaStreamSynchronize(dm.stream()));
          const double r = seconds_since(t);
          for (int b = 0; b < N; ++b) dm.restore_sequence(slots[std::size_t(b)], snaps[std::size_t(b)]);
          dm.append_all_on_device(slots, chunks);
          DSV4_CUDA_CHECK(cudaStreamSynchronize(dm.stream()));  // (not in the next round's draft time)
          pending = block + 1;
          if (i >= 0) draft_total += d, verify_total += v, redo_total += r;
        }
        const double draft = draft_total / steps, verify = verify_total / steps, redo = redo_total / steps;
        row("spec-verify", block + 1, N, verify, N * (block + 1) / verify,
            traffic.decode_bytes(N * (block + 1)) / ceiling.copy_bps);
        row("spec-redo", 1, N, redo, N / redo, traffic.decode_bytes(N) / ceiling.copy_bps);
        const double all = N * (block + 1) / (draft + verify), none = N / (draft + verify + redo), plain = N / decode_s[bi];
        std::printf("           batch %d: drafts %.4f s a round (one pass over %d sequences); tokens/s with every draft accepted %.1f "
                    "(%.2fx plain decoding's %.1f), with none %.1f (%.2fx)\n",
                    N, draft, N, all, all / plain, plain, none, none / plain);
        for (int sl : slots) dm.release_sequence(sl);
      }
      dm.capture_main_hidden(false);
    }
  } else if (opt.dspark) {
    throw error(std::string("--dspark: ") + Model::name + " has no DSpark stages");
  }
  // Host tables: what the fetches moved and how much of them the launching thread waited for
  // (the part the layers before each Engram layer did not hide), over every call above.
  const auto fetches = dm.engram_fetch_stats();
  for (std::size_t j = 0; j < fetches.size(); ++j) {
    const auto& f = fetches[j];
    std::printf("engram module %zu (host table): %lld calls, %.0f bytes per row fetched, gather %.1f ms, waited %.1f ms "
                "(%.0f%% of the gather hidden)\n",
                j, f.calls, f.rows ? f.bytes / double(f.rows) : 0.0, f.gather_s * 1e3, f.waited_s * 1e3,
                f.gather_s > 0 ? 100 * std::max(0.0, 1 - f.waited_s / f.gather_s) : 100.0);
    if (jf)
      std::fprintf(jf, ",\n{\"model\": \"%s\", \"what\": \"engram-host-fetch\", \"module\": %zu, \"calls\": %lld, \"rows\": %lld, "
                       "\"bytes\": %.0f, \"gather_seconds\": %.6f, \"waited_seconds\": %.6f}",
                   Model::name, j, f.calls, f.rows, f.bytes, f.gather_s, f.waited_s);
  }
  if (kernels::gemm::current_decode_gemm() == kernels::gemm::decode_gemm::wgmma)
    std::printf("wgmma GEMM launches: %llu\n", kernels::gemm::wgmma_gemm_calls());
  std::printf("\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // rows appear as they are measured, also through a pipe
  std::string json, config_json;
  bool v41 = false;
  options opt;
  std::vector<int> gemm_max_tokens;  // --gemm-max-tokens: one value, with --gemm wgmma
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      const bool has_value = i + 1 < argc;
      if (a == "--json" && has_value) json = argv[++i];
      else if (a == "--config-json" && has_value) config_json = argv[++i];
      else if (a == "--v41-width") v41 = true;
      else if (a == "--prompts" && has_value) opt.prompts = bench::int_list(a, argv[++i]);
      else if (a == "--batches" && has_value) opt.batches = bench::int_list(a, argv[++i]);
      else if (a == "--decode-context" && has_value) opt.decode_contexts = bench::int_list(a, argv[++i]);
      else if (a == "--checkpoint" && has_value) opt.checkpoint = argv[++i];
      else if (a == "--profile-decode") opt.profile_decode = true;
      else if (a == "--profile-prefill" && has_value && (std::string(argv[i + 1]) == "exact" || std::string(argv[i + 1]) == "ced"))
        opt.profile_prefill = argv[++i];
      else if (a == "--engram-host-tables") opt.engram_host_tables = true;
      else if (a == "--dspark") opt.dspark = true;
      else if (a == "--checkpoint-only") opt.checkpoint_only = true;
      else if (a == "--clone-contexts") opt.clone_contexts = true;
      else if (a == "--chunk" && has_value) opt.chunk = bench::int_list(a, argv[++i]).at(0);
      else if (a == "--gemm" && has_value && (std::string(argv[i + 1]) == "mma" || std::string(argv[i + 1]) == "wgmma"))
        kernels::gemm::set_decode_gemm(std::string(argv[++i]) == "wgmma" ? kernels::gemm::decode_gemm::wgmma
                                                                        : kernels::gemm::decode_gemm::mma_sync);
      else if (a == "--mhc-one-token-ctas" && has_value)
        kernels::mhc::set_one_token_ctas_up_to(bench::int_list(a, argv[++i]).at(0));
      else if (a == "--mhc-small-groups" && has_value) {
        const std::string v = argv[++i];
        const auto comma = v.find(',');
        auto whole = [](const std::string& text) {  // a whole non-negative number, else -1
          std::size_t used = 0;
          int n = -1;
          try {
            n = std::stoi(text, &used);
          } catch (const std::exception&) {
            return -1;
          }
          return used == text.size() ? n : -1;
        };
        int twos = -1, fours = -1;
        if (comma != std::string::npos) twos = whole(v.substr(0, comma)), fours = whole(v.substr(comma + 1));
        if (twos < 0 || fours < 0)
          throw error("--mhc-small-groups: '" + v + "' is not N,M (two numbers of 0 and up)");
        kernels::mhc::set_small_token_groups(twos, fours);
      } else if (a == "--no-folded")
        kernels::gemm::set_folded_linears(false);
      else if (a == "--fused-act-quant")
        numerics::set_fused_act_quant(true);
      else if (a == "--no-fused-act-quant")
        numerics::set_fused_act_quant(false);
      else if (a == "--no-wo-a-fp8")
        kernels::output::set_wo_a_fp8(false);
      else if (a == "--ab-act-quant")
        opt.ab_act_quant = true;
      else if (a == "--ab-mhc")
        opt.ab_mhc = true;
      else if (a == "--ab-decode-defaults")
        opt.ab_decode_defaults = true;
      else if (a == "--ab-early-stream")
        opt.ab_early_stream = true;
      else if (a == "--issue-time")
        opt.issue_time = true;
      else if (a == "--decode-graphs")
        opt.decode_graphs = true;
      else if (a == "--gemm-max-tokens" && has_value)
        gemm_max_tokens = bench::int_list(a, argv[++i]);
      else {
        std::fprintf(
            stderr,
            "usage: bench_model [--v41-width] [--prompts N,N..] [--batches B,B..] [--decode-context N,N..] "
            "[--checkpoint DIR] [--profile-decode] [--profile-prefill exact|ced] [--engram-host-tables] "
            "[--chunk N] "
            "[--gemm mma|wgmma] [--gemm-max-tokens N] [--no-folded] [--[no-]fused-act-quant] "
            "[--no-wo-a-fp8] [--ab-act-quant] [--ab-mhc] [--ab-decode-defaults] [--ab-early-stream] [--issue-time] [--decode-graphs] "
            "[--dspark] [--mhc-one-token-ctas N] "
            "[--mhc-small-groups N,M] [--config-json FILE] "
            "[--checkpoint-only] [--clone-contexts] [--json FILE]\n");
        return 2;
      }
    }
    if (!gemm_max_tokens.empty()) {
      if (gemm_max_tokens.size() != 1 || kernels::gemm::current_decode_gemm() != kernels::gemm::decode_gemm::wgmma)
        throw error("--gemm-max-tokens takes one value and goes with --gemm wgmma");
      kernels::gemm::set_wgmma_max_tokens(gemm_max_tokens[0]);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_model: %s\n", e.what());
    return 2;
  }
  try {
    if (!config_json.empty()) {
      std::ofstream f(config_json);
      f << (v41 ? models::config_json_text<v41_width>() : models::config_json_text<models::tiny>());
      if (!f.flush()) throw error("--config-json: cannot write " + config_json);
    }
    if (opt.checkpoint_only) {
      if (opt.checkpoint.empty()) throw error("--checkpoint-only needs --checkpoint DIR");
      v41 ? ensure_random_checkpoint<v41_width>(opt.checkpoint) : ensure_random_checkpoint<models::tiny>(opt.checkpoint);
      return 0;
    }
    FILE* jf = json.empty() ? nullptr : std::fopen(json.c_str(), "w");
    if (jf) std::fprintf(jf, "{\"results\": [\n");
    const int rc = v41 ? run<v41_width>(jf, opt) : run<models::tiny>(jf, opt);
    if (jf) std::fprintf(jf, "\n]}\n"), std::fclose(jf);
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_model: %s\n", e.what());
    return 1;
  }
}
