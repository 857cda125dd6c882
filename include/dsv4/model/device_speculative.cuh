#pragma once
//! \file
//! Generation with DSpark drafts on CUDA: speculative_reference.hpp's loop with the device
//! backbone and drafter, where a round is verified in one backbone call and rolled back.
//!
//! The rule is the host loop's: the token at position q is sample_reference(logits_q, sampling,
//! sequence, q); a draft is accepted when that draw equals it; the first differing draw ends the
//! round. A round at backbone length q with input token t:
//!   drafts  d_1 .. d_B = device_dspark::decode(t, the main_hidden rows the drafter has not seen);
//!   verify  save_sequence, then append_all_on_device([t, d_1 .. d_B]): row i holds the logits of
//!           q + 1 + i, and every row is drawn on the device at once (the device sampler: the host
//!           sampler's draws); the draw of q + 1 (row 0) is taken, and while a draw equals d_{i+1}
//!           it is accepted and the next row's draw taken;
//!   keep    with a drafts accepted and a < B: restore_sequence and append [t, d_1 .. d_a] again
//!           (the same positions and history: the state plain decoding leaves); with a == B the
//!           verification already is that state. The last call's capture holds the main_hidden rows
//!           of the kept positions, which the next round's drafter step takes.
//! So a round costs one drafter step and one or two backbone calls of up to B + 1 rows, and emits
//! a + 1 tokens; the sequence ends as plain decoding leaves it (the last token drawn, not fed).
//! The rule is the host loop's, but the logits are not plain decoding's bits: the verification's
//! rows come from a multi-row append (other GEMM splits, the appended-chunk operand; docs/decisions.md:
//! not batch-invariant), so where plain decoding's top two logits are close a draw may differ from
//! plain decoding's, and the generations part there.

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/kernels/sampling/reference.hpp"
#include "dsv4/model/device_dspark.cuh"
#include "dsv4/model/device_model.cuh"
#include "dsv4/model/speculative_reference.hpp"
#include "dsv4/runtime/device_buffer.cuh"

namespace dsv4::model {

//! Generates `n_new` tokens after `prompt` on the empty sequence `slot` of `dm` (built with
//! limits::logit_rows >= block + 1 and max_rows >= block + 1), drafting with `dd` (the same slot).
//! Returns the tokens and fills `stats` as generate_speculative (speculative_reference.hpp) does;
//! `edit_drafts` likewise (tests: an oracle drafter). Turns dm's main_hidden capture on.
template <class Model>
std::vector<std::int32_t> generate_speculative(
    device_model<Model>& dm, device_dspark<Model>& dd, int slot, std::span<const std::int32_t> prompt,
    long long n_new, const kernels::sampling::sampling_params& sampling, speculative_stats& stats,
    prompt_prefill mode = prompt_prefill::exact, std::uint64_t sequence = 0,
    const std::function<void(long long, std::vector<std::int32_t>&)>& edit_drafts = {}) {
  constexpr models::model_config c = Model::dims;
  constexpr int W = c.attn.window_size, block = c.dspark.dspark_block_size;
  static_assert(
      block + 1 <= W,
      "generate_speculative (CUDA): a round of block + 1 rows must fit the window (the drafter takes at "
      "most window main_hidden rows a step)");
  constexpr std::size_t row =
      std::size_t(c.dim) * std::size_t(models::model_traits<Model>::schedule::drafter::targets::size);
  if (dm.length(slot) != 0)
    throw error("generate_speculative (CUDA): sequence slot " + std::to_string(slot) +
                " must be empty (it holds " + std::to_string(dm.length(slot)) + " tokens)");
  if (prompt.empty()) throw error("generate_speculative (CUDA): empty prompt");
  if (n_new < 0) throw error("generate_speculative (CUDA): negative token count");
  if (dm.max_rows() < block + 1 || dm.logit_rows() < block + 1)
    throw error("generate_speculative (CUDA): the backbone's limits::max_rows (" +
                std::to_string(dm.max_rows()) + ") and logit_rows (" + std::to_string(dm.logit_rows()) +
                ") must hold a round of block + 1 = " + std::to_string(block + 1) + " tokens");
  stats = speculative_stats{};
  stats.accepted_at.assign(std::size_t(block), 0);
  std::vector<std::int32_t> out;
  if (n_new == 0) return out;

  dm.capture_main_hidden(true);
  // The rows the drafter has not seen yet, kept apart from the capture (which the next call
  // overwrites): at most a round's block + 1, or the prompt's last row.
  runtime::device_buffer<bf16> pending(std::size_t(block + 1) * row);
  long long pending_rows = 0;
  auto keep_pending = [&](long long first, long long rows) {
    DSV4_CUDA_CHECK(cudaMemcpyAsync(pending.data(), dm.main_hidden() + std::size_t(first) * row,
                                    std::size_t(rows) * row * sizeof(bf16), cudaMemcpyDeviceToDevice,
                                    dm.stream()));
    pending_rows = rows;
  };
  // Tokens are drawn on the device from the last call's rows of logits (kernels/sampling: the host
  // sampler's draws, bit for bit), row i at position `position + i`.
  auto draw_rows = [&](long long rows, long long position) {
    std::vector<kernels::sampling::row_request> req(static_cast<std::size_t>(rows));
    for (long long i = 0; i < rows; ++i)
      req[std::size_t(i)] = {sampling, sequence, std::uint64_t(position + i)};
    return dm.sample(req);
  };

  mode == prompt_prefill::ced ? dm.prefill_ced(slot, prompt) : dm.prefill(slot, prompt);
  const long long rows = dm.main_hidden_rows(), first = dm.length(slot) - rows;
  std::int32_t t = draw_rows(1, dm.length(slot))[0];
  out.push_back(t);
  if (rows >= 2) {  // the drafter's rings from every captured row but the last, which the first round takes
    dd.prefill(slot, dm.main_hidden(), rows - 1, first);
    keep_pending(rows - 1, 1);
  } else {  // a one-row prompt: seed with it, then one plain step gives the first pending row
    dd.prefill(slot, dm.main_hidden(), rows, first);
    if ((long long)out.size() == n_new) return out;
    dm.decode_on_device({slot}, std::span<const std::int32_t>(&t, 1));
    keep_pending(0, 1);
    t = draw_rows(1, dm.length(slot))[0];
    out.push_back(t);
  }
  typename device_model<Model>::sequence_snapshot snapshot;
  while ((long long)out.size() < n_new) {
    // Invariant: the backbone holds positions < q, t is the token for q (in `out`, not yet fed),
    // `pending` holds the main_hidden rows of the positions the drafter has not seen.
    const long long q = dm.length(slot);
    dspark_draft d = dd.decode(slot, t, pending.data(), pending_rows, pending_rows, sampling, sequence);
    if (edit_drafts) edit_drafts(q + 1, d.ids);
    if (d.ids.size() != std::size_t(block) + 1 || d.ids[0] != t)
      throw error(
          "generate_speculative (CUDA): a draft block must be block + 1 ids starting with the input token");
    ++stats.rounds;
    // Feed t and the first m drafts: their rows give every draw this round can still make (the
    // budget: n_new - |out| more tokens), so the sequence never runs past the tokens kept.
    const int m = int(std::min<long long>(block, n_new - (long long)out.size() - 1));
    dm.save_sequence(slot, snapshot);
    dm.append_all_on_device(
        slot,
        std::span<const std::int32_t>(d.ids).first(std::size_t(m) + 1));  // q + 1 .. q + m + 1
    // Every row's draw at once (a draw depends only on its row and position): the checks below
    // take them in order and stop at the first that differs from its draft.
    const std::vector<std::int32_t> drawn = draw_rows(m + 1, q + 1);
    int accepted = 0;
    std::int32_t next = drawn[0];
    for (int i = 1; i <= block && (long long)out.size() < n_new; ++i) {  // the host loop's checks and counts
      ++stats.drafted;
      if (next != d.ids[std::size_t(i)]) break;
      ++stats.accepted, ++stats.accepted_at[std::size_t(i - 1)], ++accepted;
      out.push_back(next);
      if ((long long)out.size() == n_new) break;
      next = drawn[std::size_t(i)];  // (i <= m here)
    }
    if ((long long)out.size() < n_new) out.push_back(next);
    const int kept = std::min(accepted, m);  // fed drafts that stay
    if (kept < m) {  // a fed draft was rejected: back to q, then the kept tokens again
      dm.restore_sequence(slot, snapshot);
      dm.append(slot, std::span<const std::int32_t>(d.ids).first(std::size_t(kept) + 1));
    }
    keep_pending(0, kept + 1);  // the capture of the kept positions q .. q + kept
    t = next;
  }
  return out;
}

}  // namespace dsv4::model
