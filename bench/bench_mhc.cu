//! \brief The fused mHC sublayer boundary (hc_post + hc_pre + RMSNorm + next coefficients),
//! V4.1 widths (4 streams x 5120), at decode and prefill token counts.
//! Usage: bench_mhc [--json FILE]
//! From 4 to 128 tokens a row with one token a CTA (group 1; set_one_token_ctas_up_to), one per
//! small token group (2 and 4 tokens a CTA, set_small_token_groups) and one per prefill token
//! group (8 and 16 tokens a CTA, set_prefill_token_group); above, the prefill token groups only.
//!
//! Bytes = per token (X 4d + F d + Y 4d + h d) x 2 bytes (the article's (2n+2)d single pass)
//! plus the 24 x 4d fp32 projection weight once per launch. Times per call of back-to-back calls
//! replayed as a CUDA graph; ratio to the copy ceiling measured in the same run.
//! Then the decode shapes (1 to 16 tokens, one token a CTA) with the projection weight read from L2
//! (one weight, as above) and from HBM (48 copies in rotation, 96 MB: a model's boundaries read
//! theirs a step apart), each with the weight's slice bulk-copied into shared memory and loaded
//! into registers (set_decode_weights_in_registers).

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "bench_util.cuh"
#include "dsv4/kernels/mhc/mhc_step.cuh"

using namespace dsv4;
using namespace dsv4::kernels::mhc;
using numerics::bf16;

namespace {
//! One boundary call's inputs and outputs for `tokens` tokens of width `dim` (the shared weights,
//! base, scale and norm weight from the caller), and its workspace.
struct boundary_call {
  runtime::device_buffer<bf16> x, f, y, h;
  runtime::device_buffer<float> pre, post, comb, npre, npost, ncomb;
  mhc_workspace ws;
  mhc_step_args a;
  boundary_call(long long tokens, int dim, const float* fn, const float* base, const float* scale,
                const bf16* w)
      : x(std::size_t(tokens) * 4 * dim),
        f(std::size_t(tokens) * dim),
        y(x.size()),
        h(f.size()),
        pre(std::size_t(tokens) * 4),
        post(pre.size()),
        comb(std::size_t(tokens) * 16),
        npre(pre.size()),
        npost(pre.size()),
        ncomb(comb.size()),
        ws(tokens, dim) {
    x.fill_bytes(0x3e), f.fill_bytes(0x3e);
    pre.fill_bytes(0x3e), post.fill_bytes(0x3e), comb.fill_bytes(0x3e);
    a.x = x.data(), a.f = f.data(), a.post = post.data(), a.comb = comb.data(), a.pre = pre.data();
    a.norm_w = w, a.y = y.data(), a.h = h.data();
    a.fn = fn, a.base = base, a.scale = scale;
    a.next_pre = npre.data(), a.next_post = npost.data(), a.next_comb = ncomb.data();
    a.tokens = tokens, a.dim = dim;
  }
};
}  // namespace

int main(int argc, char** argv) {
  std::string json;
  if (!bench::parse_json_option(argc, argv, "bench_mhc", json)) return 2;
  try {
    const double copy_bps = bench::copy_bandwidth(std::size_t(1) << 30);
    std::printf("ceiling: copy %.0f GB/s\n%8s %6s %10s %9s %9s %10s\n", copy_bps / 1e9, "tokens", "group",
                "median us", "GB/s", "vs copy", "floor us");
    FILE* jf = json.empty() ? nullptr : std::fopen(json.c_str(), "w");
    if (jf) std::fprintf(jf, "{\"copy_gbps\": %.1f, \"results\": [\n", copy_bps / 1e9);
    constexpr int dim = 5120;
    runtime::device_buffer<float> fn(std::size_t(24) * 4 * dim), base(24), scale(3);
    fn.fill_bytes(0);
    base.fill_bytes(0);
    scale.fill_bytes(0);
    runtime::device_buffer<bf16> w(dim);
    w.fill_bytes(0x3f);
    bool first = true;
    for (long long tokens : {1LL, 4LL, 8LL, 12LL, 16LL, 24LL, 32LL, 48LL, 64LL, 96LL, 128LL, 512LL, 4096LL}) {
      boundary_call call(tokens, dim, fn.data(), base.data(), scale.data(), w.data());
      auto& a = call.a;
      auto& ws = call.ws;
      // Every shape from 2 to 128 tokens: one token a CTA (set_one_token_ctas_up_to), the small
      // groups (set_small_token_groups) and the prefill groups (set_prefill_token_group); above,
      // the prefill groups.
      const std::vector<int> groups = tokens == 1     ? std::vector<int>{1}
                                      : tokens <= 128 ? std::vector<int>{8, 16, 1, 2, 4}
                                                      : std::vector<int>{8, 16};
      for (int group : groups) {
        if (group >= 8) set_prefill_token_group(group);
        set_one_token_ctas_up_to(group == 1 ? int(tokens) : int(tokens - 1));
        set_small_token_groups(group == 2 ? int(tokens) : 0, group == 4 ? int(tokens) : 0);
        const double ms = bench::median_ms_per_call([&](cudaStream_t s) { mhc_step(a, ws, s); }, 20);
        const double bytes = double(tokens) * 10.0 * dim * 2.0 + 24.0 * 4 * dim * 4;
        const double floor_us = bytes / copy_bps * 1e6;
        std::printf("%8lld %6d %10.1f %9.0f %8.1f%% %10.2f\n", tokens, group, ms * 1e3,
                    bytes / (ms * 1e-3) / 1e9, 100.0 * floor_us / (ms * 1e3), floor_us);
        if (jf)
          std::fprintf(jf, "%s  {\"tokens\": %lld, \"group\": %d, \"us\": %.2f, \"ratio\": %.4f}",
                       first ? "" : ",\n", tokens, group, ms * 1e3, floor_us / (ms * 1e3));
        first = false;
      }
      set_prefill_token_group(8);
      set_one_token_ctas_up_to(detail::default_one_token_ctas);
      set_small_token_groups(detail::default_twos_up_to, detail::default_fours_up_to);
    }
    // The decode shapes: the projection weight from L2 and from HBM, by each load path.
    constexpr int copies = 48;
    std::vector<runtime::device_buffer<float>> fns;
    for (int c = 0; c < copies; ++c) {
      fns.emplace_back(std::size_t(24) * 4 * dim);
      fns.back().fill_bytes(0);
    }
    std::printf("\ndecode weights: one token a CTA, us a call\n%8s %12s %12s %12s %12s\n", "tokens",
                "shared L2", "shared HBM", "registers L2", "registers HBM");
    const bool registers0 = decode_weights_in_registers();
    for (long long tokens : {1LL, 2LL, 8LL, 16LL}) {
      boundary_call call(tokens, dim, fn.data(), base.data(), scale.data(), w.data());
      double us[4];
      for (int v = 0; v < 4; ++v) {
        set_decode_weights_in_registers(v >= 2);
        const bool hbm = v % 2 == 1;
        int it = 0;
        const double ms = bench::median_ms_per_call(
            [&](cudaStream_t st) {
              call.a.fn = hbm ? fns[std::size_t(it++ % copies)].data() : fn.data();
              mhc_step(call.a, call.ws, st);
            },
            hbm ? 2 * copies : 20);
        us[v] = ms * 1e3;
        if (jf)
          std::fprintf(jf, ",\n  {\"tokens\": %lld, \"decode_weights\": \"%s %s\", \"us\": %.2f}", tokens,
                       v >= 2 ? "registers" : "shared", hbm ? "hbm" : "l2", us[v]);
      }
      set_decode_weights_in_registers(registers0);
      std::printf("%8lld %12.1f %12.1f %12.1f %12.1f\n", tokens, us[0], us[1], us[2], us[3]);
    }
    if (jf) {
      std::fprintf(jf, "\n]}\n");
      std::fclose(jf);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_mhc: %s\n", e.what());
    return 1;
  }
}
