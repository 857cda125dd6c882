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
//! A batch of sequences runs its rounds together: every sequence's drafts in one drafter pass
//! (device_dspark::decode over several slots), its verification in one backbone call
//! (append_all_on_device over several slots), every rejected sequence's re-append in a second.
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

//! One sequence of a speculative batch: an empty sequence slot of the backbone (and of the
//! drafter), its prompt, how many tokens to generate, and how they are drawn (`sequence`: the
//! sampler's stream id, kernels/sampling).
struct speculative_request {
  int slot = -1;
  std::span<const std::int32_t> prompt;
  long long n_new = 0;
  kernels::sampling::sampling_params sampling{};
  std::uint64_t sequence = 0;
};

//! Generates batch[b].n_new tokens after each prompt (see the file comment), drafting with `dd`;
//! returns them per sequence and fills stats[b] as generate_speculative (speculative_reference.hpp)
//! does. `dm` needs limits::max_rows and logit_rows >= batch.size() x (block + 1) (one round of
//! every sequence in one call). `edit_drafts` (tests: an oracle drafter) may replace sequence b's
//! drafts: it receives b, the position of d_1 and [t_q, d_1 .. d_block]. Turns dm's main_hidden
//! capture on.
template <class Model>
std::vector<std::vector<std::int32_t>> generate_speculative_batch(
    device_model<Model>& dm, device_dspark<Model>& dd, std::span<const speculative_request> batch,
    std::vector<speculative_stats>& stats, prompt_prefill mode = prompt_prefill::exact,
    const std::function<void(std::size_t, long long, std::vector<std::int32_t>&)>& edit_drafts = {}) {
  constexpr models::model_config c = Model::dims;
  constexpr int W = c.attn.window_size, block = c.dspark.dspark_block_size;
  static_assert(
      block + 1 <= W,
      "generate_speculative (CUDA): a round of block + 1 rows must fit the window (the drafter takes at "
      "most window main_hidden rows a step)");
  constexpr std::size_t row =
      std::size_t(c.dim) * std::size_t(models::model_traits<Model>::schedule::drafter::targets::size);
  const std::size_t N = batch.size();
  const std::string where = "generate_speculative (CUDA): ";
  // Every request is checked before the first prefill (the prefills run one sequence at a time;
  // after a failure part-way the batch's slots hold partial state: release them).
  for (std::size_t b = 0; b < N; ++b) {
    const speculative_request& r = batch[b];
    const std::string who = "sequence " + std::to_string(b) + " (slot " + std::to_string(r.slot) + "): ";
    if (r.slot < 0 || r.slot >= dm.max_seqs() || r.slot >= dd.max_seqs())
      throw error(where + who + "no such slot (the backbone has " + std::to_string(dm.max_seqs()) + ", the drafter " +
                  std::to_string(dd.max_seqs()) + ")");
    for (std::size_t e = 0; e < b; ++e)
      if (batch[e].slot == r.slot) throw error(where + who + "the slot appears twice in the batch");
    if (dm.length(r.slot) < 0) throw error(where + who + "no live sequence in the slot (add_sequence first)");
    if (dm.length(r.slot) != 0)
      throw error(where + who + "the slot must be empty (it holds " + std::to_string(dm.length(r.slot)) + " tokens)");
    if (r.prompt.empty()) throw error(where + who + "empty prompt");
    if (r.n_new < 0) throw error(where + who + "negative token count");
    const long long P = static_cast<long long>(r.prompt.size());
    if (P > dm.max_rows())
      throw error(where + who + "a prompt of " + std::to_string(P) + " tokens exceeds limits::max_rows (" +
                  std::to_string(dm.max_rows()) + "), the prefill's call");
    // The sequence's longest state: the prompt and every token but the last drawn (never fed).
    if (P + std::max(r.n_new - 1, 0LL) > dm.max_tokens())
      throw error(where + who + std::to_string(P) + " prompt tokens and " + std::to_string(r.n_new) +
                  " to generate exceed limits::max_tokens (" + std::to_string(dm.max_tokens()) + ")");
  }
  const long long round_rows = static_cast<long long>(N) * (block + 1);
  if (dm.max_rows() < round_rows || dm.logit_rows() < round_rows)
    throw error(where + "the backbone's limits::max_rows (" + std::to_string(dm.max_rows()) + ") and logit_rows (" +
                std::to_string(dm.logit_rows()) + ") must hold a round of every sequence: " + std::to_string(N) +
                " x (block + 1) = " + std::to_string(round_rows) + " tokens");
  stats.assign(N, speculative_stats{});
  for (auto& st : stats) st.accepted_at.assign(std::size_t(block), 0);
  std::vector<std::vector<std::int32_t>> out(N);
  auto active = [&](std::size_t b) { return static_cast<long long>(out[b].size()) < batch[b].n_new; };
  bool any = false;
  for (std::size_t b = 0; b < N; ++b) any |= active(b);
  if (!any) return out;

  dm.capture_main_hidden(true);
  // Per sequence, the main_hidden rows the drafter has not seen yet, kept apart from the capture
  // (which the next call overwrites): at most a round's block + 1, or the prompt's last row.
  runtime::device_buffer<bf16> pending(N * std::size_t(block + 1) * row);
  std::vector<long long> pending_rows(N, 0);
  auto keep_pending = [&](std::size_t b, long long first, long long rows) {
    DSV4_CUDA_CHECK(cudaMemcpyAsync(pending.data() + b * std::size_t(block + 1) * row,
                                    dm.main_hidden() + std::size_t(first) * row, std::size_t(rows) * row * sizeof(bf16),
                                    cudaMemcpyDeviceToDevice, dm.stream()));
    pending_rows[b] = rows;
  };
  // Tokens are drawn on the device from the last call's rows of logits (kernels/sampling: the host
  // sampler's draws, bit for bit), a row at position `position` of sequence b.
  std::vector<kernels::sampling::row_request> requests;
  auto request = [&](std::size_t b, long long position) {
    requests.push_back({batch[b].sampling, batch[b].sequence, std::uint64_t(position)});
  };
  auto draw = [&] {
    auto drawn = dm.sample(requests);
    requests.clear();
    return drawn;
  };

  // Prefills one sequence at a time (a prefill call holds one sequence), then one plain decode
  // step of every one-row prompt together (its rings were seeded with that row).
  std::vector<std::int32_t> t(N, 0);
  std::vector<int> step_slots;
  std::vector<std::size_t> stepped;
  for (std::size_t b = 0; b < N; ++b) {
    if (!active(b)) continue;
    const int slot = batch[b].slot;
    mode == prompt_prefill::ced ? dm.prefill_ced(slot, batch[b].prompt) : dm.prefill(slot, batch[b].prompt);
    const long long rows = dm.main_hidden_rows(), first = dm.length(slot) - rows;
    request(b, dm.length(slot));
    t[b] = draw()[0];
    out[b].push_back(t[b]);
    if (rows >= 2) {  // the drafter's rings from every captured row but the last, which the first round takes
      dd.prefill(slot, dm.main_hidden(), rows - 1, first);
      keep_pending(b, rows - 1, 1);
    } else {
      dd.prefill(slot, dm.main_hidden(), rows, first);
      if (active(b)) step_slots.push_back(slot), stepped.push_back(b);
    }
  }
  if (!stepped.empty()) {
    std::vector<std::int32_t> ids;
    for (std::size_t b : stepped) ids.push_back(t[b]);
    dm.decode_on_device(step_slots, ids);
    for (std::size_t i = 0; i < stepped.size(); ++i) keep_pending(stepped[i], (long long)i, 1), request(stepped[i], dm.length(step_slots[i]));
    const auto drawn = draw();
    for (std::size_t i = 0; i < stepped.size(); ++i) t[stepped[i]] = drawn[i], out[stepped[i]].push_back(drawn[i]);
  }

  std::vector<typename device_model<Model>::sequence_snapshot> snapshots(N);
  std::vector<dspark_draft> drafts(N);
  std::vector<int> fed(N, 0), kept(N, 0);
  std::vector<std::int32_t> next(N, 0);
  for (;;) {
    // Invariant, per active sequence b: the backbone holds positions < q_b, t[b] is the token for
    // q_b (in out[b], not yet fed), `pending` holds the main_hidden rows the drafter has not seen.
    std::vector<std::size_t> round;
    for (std::size_t b = 0; b < N; ++b)
      if (active(b)) round.push_back(b);
    if (round.empty()) break;
    std::vector<int> slots;
    std::vector<std::vector<std::int32_t>> chunks;
    std::vector<typename device_dspark<Model>::step> steps;
    for (std::size_t b : round)
      steps.push_back({batch[b].slot, t[b], pending.data() + b * std::size_t(block + 1) * row, pending_rows[b],
                       pending_rows[b], batch[b].sampling, batch[b].sequence});
    auto drafted = dd.decode(steps, false);  // (the loop needs the ids only)
    for (std::size_t i = 0; i < round.size(); ++i) {
      const std::size_t b = round[i];
      const int slot = batch[b].slot;
      const long long q = dm.length(slot);
      drafts[b] = std::move(drafted[i]);
      auto& ids = drafts[b].ids;
      if (edit_drafts) edit_drafts(b, q + 1, ids);
      if (ids.size() != std::size_t(block) + 1 || ids[0] != t[b])
        throw error(where + "a draft block must be block + 1 ids starting with the input token");
      ++stats[b].rounds;
      // Feed t and the first m drafts: their rows give every draw this round can still make (the
      // budget: n_new - |out| more tokens), so the sequence never runs past the tokens kept.
      fed[b] = int(std::min<long long>(block, batch[b].n_new - (long long)out[b].size() - 1));
      dm.save_sequence(slot, snapshots[b]);
      slots.push_back(slot);
      chunks.emplace_back(ids.begin(), ids.begin() + fed[b] + 1);  // positions q + 1 .. q + m + 1
    }
    dm.append_all_on_device(slots, chunks);
    // Every row's draw at once (a draw depends only on its row and position): the checks below
    // take them in order and stop at the first that differs from its draft.
    for (std::size_t i = 0; i < round.size(); ++i)
      for (int j = 0; j <= fed[round[i]]; ++j) request(round[i], dm.length(slots[i]) - fed[round[i]] + j);
    const std::vector<std::int32_t> drawn = draw();
    std::size_t offset = 0;
    std::vector<int> redo_slots;
    std::vector<std::vector<std::int32_t>> redo_chunks;
    std::vector<std::size_t> redo;
    for (std::size_t b : round) {  // the host loop's checks and counts
      const auto& ids = drafts[b].ids;
      auto& o = out[b];
      int accepted = 0;
      next[b] = drawn[offset];
      for (int i = 1; i <= block && (long long)o.size() < batch[b].n_new; ++i) {
        ++stats[b].drafted;
        if (next[b] != ids[std::size_t(i)]) break;
        ++stats[b].accepted, ++stats[b].accepted_at[std::size_t(i - 1)], ++accepted;
        o.push_back(next[b]);
        if ((long long)o.size() == batch[b].n_new) break;
        next[b] = drawn[offset + std::size_t(i)];  // (i <= fed here)
      }
      if ((long long)o.size() < batch[b].n_new) o.push_back(next[b]);
      kept[b] = std::min(accepted, fed[b]);  // fed drafts that stay
      if (kept[b] == fed[b]) {
        keep_pending(b, (long long)offset, kept[b] + 1);  // the capture of the kept positions q .. q + kept
      } else {  // a fed draft was rejected: back to q, then the kept tokens again
        redo_slots.push_back(batch[b].slot), redo.push_back(b);
        redo_chunks.emplace_back(ids.begin(), ids.begin() + kept[b] + 1);
      }
      offset += std::size_t(fed[b]) + 1;
    }
    if (!redo.empty()) {
      for (std::size_t b : redo) dm.restore_sequence(batch[b].slot, snapshots[b]);
      dm.append_all_on_device(redo_slots, redo_chunks);
      long long first = 0;
      for (std::size_t b : redo) keep_pending(b, first, kept[b] + 1), first += kept[b] + 1;
    }
    for (std::size_t b : round) t[b] = next[b];
  }
  return out;
}

//! Generates `n_new` tokens after `prompt` on the empty sequence `slot` of `dm` (built with
//! limits::logit_rows >= block + 1 and max_rows >= block + 1), drafting with `dd` (the same slot):
//! generate_speculative_batch of one sequence. Returns the tokens and fills `stats` as
//! generate_speculative (speculative_reference.hpp) does; `edit_drafts` likewise (tests: an
//! oracle drafter). Turns dm's main_hidden capture on.
template <class Model>
std::vector<std::int32_t> generate_speculative(
    device_model<Model>& dm, device_dspark<Model>& dd, int slot, std::span<const std::int32_t> prompt,
    long long n_new, const kernels::sampling::sampling_params& sampling, speculative_stats& stats,
    prompt_prefill mode = prompt_prefill::exact, std::uint64_t sequence = 0,
    const std::function<void(long long, std::vector<std::int32_t>&)>& edit_drafts = {}) {
  const speculative_request one{slot, prompt, n_new, sampling, sequence};
  std::vector<speculative_stats> st;
  std::function<void(std::size_t, long long, std::vector<std::int32_t>&)> edit;
  if (edit_drafts) edit = [&](std::size_t, long long first, std::vector<std::int32_t>& ids) { edit_drafts(first, ids); };
  auto out = generate_speculative_batch(dm, dd, std::span<const speculative_request>(&one, 1), st, mode, edit);
  stats = std::move(st[0]);
  return std::move(out[0]);
}

}  // namespace dsv4::model
