#pragma once
//! \file
//! Generation with DSpark drafts on the host: the speculative-decoding loop the official
//! reference leaves out (spec §13: "nothing calls forward_spec"), written down once so that every
//! backend's loop has a reference for what must come out and how drafts are counted.
//!
//! The rule: a token at position q is always `sample_reference(logits_q, sampling, sequence, q)`,
//! drawn from the backbone's logits for q, exactly as plain decoding draws it (`dsv4 run`). A
//! draft d for q is accepted when that draw equals d; the first draw that differs ends the round
//! and becomes the next round's input token. So the generated tokens equal plain decoding's for
//! any sampling parameters, by construction; the drafts decide only how many positions one round
//! verifies (on a GPU: how many rows one batched verify call carries, and where it rolls back).
//!
//! Here the verify runs position by position (one backbone decode call per verified token), so it
//! never feeds a rejected draft and needs no rollback: on the host the loop is a semantic
//! reference and an acceptance-rate meter, not a speedup.
//!
//! The drafter's bookkeeping (spec §14): after the prefill the DSpark rings are seeded with every
//! prompt position but the last; a round at backbone length q gives the drafter the main_hidden
//! rows it has not seen (positions st.length .. q - 1; the prompt's last row in the first round)
//! and the token t_q, and drafts d_1 .. d_block for q + 1 .. q + block. Holding the prompt's last
//! row back lets the first round draft right after the prefill; the rings end up as the
//! reference's step-by-step calls leave them (each slot holds the backbone's main_kv of its
//! position, dspark_decode writes a chunk's rows as row-by-row steps would).

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/kernels/sampling/reference.hpp"
#include "dsv4/model/dspark_reference.hpp"
#include "dsv4/model/model_reference.hpp"

namespace dsv4::model {

//! How the drafts fared over a generation.
struct speculative_stats {
  long long rounds = 0;    //!< draft blocks made
  long long drafted = 0;   //!< drafts that were checked (a round cut short by the token budget checks fewer)
  long long accepted = 0;  //!< drafts equal to the backbone's token
  std::vector<long long> accepted_at;  //!< [block]: rounds whose draft i was accepted
  double accepted_per_round() const { return rounds ? double(accepted) / double(rounds) : 0.0; }
  //! The counts since `earlier`, a copy of these taken before (a session's turn: its own rounds).
  speculative_stats since(const speculative_stats& earlier) const {
    speculative_stats d = *this;
    d.rounds -= earlier.rounds, d.drafted -= earlier.drafted, d.accepted -= earlier.accepted;
    for (std::size_t i = 0; i < d.accepted_at.size() && i < earlier.accepted_at.size(); ++i) d.accepted_at[i] -= earlier.accepted_at[i];
    return d;
  }
};

//! Prefill mode of the generation's prompt.
enum class prompt_prefill { exact, ced };

//! The host loop one round at a time, for a sequence that is stepped among others (a server's
//! batch): start() runs the prompt's prefill and draws the first token; each round() drafts a
//! block, verifies it position by position and returns the tokens it kept (1 .. block + 1, at most
//! the round's budget). A round with no main_hidden row the drafter has not seen (a one-token
//! prompt's first, unless a turn was appended first) is a plain decode step and returns one token;
//! it counts as no round.
//! resume() appends a turn between rounds (a server session), and the rounds go on after it; the
//! stats count every round since start(). generate_speculative below is start() and rounds until
//! the budget is spent.
template <class Model>
class speculative_decoder {
 public:
  //! (tests: an oracle drafter) may replace a round's drafts before they are checked; it receives
  //! the position of d_1 and the ids [t_q, d_1 .. d_block].
  using edit_fn = std::function<void(long long, std::vector<std::int32_t>&)>;

  //! `seq` must be fresh and outlive the decoder; `sequence` is the sampler's stream id.
  speculative_decoder(const host_model<Model>& m, const dspark_weights& w, host_sequence& seq,
                      const kernels::sampling::sampling_params& sampling, std::uint64_t sequence = 0, edit_fn edit = {})
      : m_(m), w_(w), seq_(seq), sampling_(sampling), sequence_(sequence), edit_(std::move(edit)) {
    if (w.block <= 0) throw error("speculative_decoder: the drafter has no draft block");
    stats_.accepted_at.assign(std::size_t(w.block), 0);
  }

  //! The prefill of `prompt` and the first token (drawn from its last row, not fed).
  std::int32_t start(std::span<const std::int32_t> prompt, prompt_prefill mode = prompt_prefill::exact) {
    if (started_) throw error("speculative_decoder: start() was called already");
    if (seq_.length != 0)
      throw error("speculative_decoder: the sequence must be fresh (it holds " + std::to_string(seq_.length) + " tokens)");
    if (prompt.empty()) throw error("speculative_decoder: empty prompt");
    const auto logits = mode == prompt_prefill::ced ? forward_ced(m_, seq_, prompt, nullptr, &mh_) : forward(m_, seq_, prompt, nullptr, &mh_);
    seed_from_capture();
    started_ = true;
    return t_ = draw(logits);
  }

  //! An appended turn (a server session's next turn): `chunk` (the last token returned first, as
  //! a session appends it; any ids will do) fed after the tokens so far, exact or CED, and the
  //! turn's first token, drawn with `sampling` (which the turn's rounds then use). Exact: the
  //! chunk's main_hidden rows join those the drafter has not seen, and the next round's drafter
  //! step takes them all (dspark_decode over an appended chunk). CED: the drafter's rings are
  //! seeded again from the replayed rows, as after a CED prefill (the replay recomputed them).
  std::int32_t resume(std::span<const std::int32_t> chunk, prompt_prefill mode, const kernels::sampling::sampling_params& sampling) {
    if (!started_) throw error("speculative_decoder: resume() before start()");
    if (chunk.empty()) throw error("speculative_decoder: resume() with an empty chunk");
    kernels::sampling::check_sampling_params(sampling, "speculative_decoder: resume(): ");
    const auto logits = mode == prompt_prefill::ced ? forward_ced(m_, seq_, chunk, nullptr, &mh_) : forward(m_, seq_, chunk, nullptr, &mh_);
    if (mode == prompt_prefill::ced) {
      seed_from_capture();
    } else {
      pending_.insert(pending_.end(), mh_.begin(), mh_.end());
    }
    sampling_ = sampling;
    return t_ = draw(logits);
  }

  //! One round: at most `budget` (>= 1) tokens, the first of which follows the last one returned.
  std::vector<std::int32_t> round(long long budget) {
    if (!started_) throw error("speculative_decoder: round() before start()");
    if (budget < 1) throw error("speculative_decoder: a round's budget must be >= 1, got " + std::to_string(budget));
    std::vector<std::int32_t> out;
    if (pending_.empty()) {  // a one-row prompt: one plain step gives the first row the drafter takes
      t_ = draw(step(t_));
      out.push_back(t_);
      return out;
    }
    // Invariant: the backbone holds positions < q = seq.length, t_ is the token for q (returned,
    // not yet fed), the drafter has seen positions < q - rows(pending_).
    const long long q = seq_.length;
    dspark_draft d = dspark_decode<Model>(m_, w_, st_, t_, pending_, sampling_, sequence_);
    pending_.clear();
    if (edit_) edit_(q + 1, d.ids);
    if (d.ids.size() != std::size_t(w_.block) + 1 || d.ids[0] != t_)
      throw error("speculative_decoder: a draft block must be block + 1 ids starting with the input token");
    ++stats_.rounds;
    std::int32_t next = draw(step(t_));  // t at q: the token for q + 1
    for (int i = 1; i <= w_.block && (long long)out.size() < budget; ++i) {
      ++stats_.drafted;
      if (next != d.ids[std::size_t(i)]) break;
      ++stats_.accepted, ++stats_.accepted_at[std::size_t(i - 1)];
      out.push_back(next);
      if ((long long)out.size() == budget) break;
      next = draw(step(next));
    }
    if ((long long)out.size() < budget) out.push_back(next);
    t_ = next;
    return out;
  }

  const speculative_stats& stats() const { return stats_; }
  //! The drafter's rings and length (tests: the state a resume leaves against a fresh start's).
  const dspark_state& drafter_state() const { return st_; }

 private:
  static constexpr std::size_t row =
      std::size_t(Model::dims.dim) * std::size_t(models::model_traits<Model>::schedule::drafter::targets::size);
  const host_model<Model>& m_;
  const dspark_weights& w_;
  host_sequence& seq_;
  kernels::sampling::sampling_params sampling_;
  std::uint64_t sequence_;
  edit_fn edit_;
  speculative_stats stats_;
  dspark_state st_;
  std::vector<bf16> mh_;       // main_hidden of the last backbone call
  std::vector<bf16> pending_;  // main_hidden rows the drafter has not seen
  std::int32_t t_ = 0;         // the last token returned (not fed)
  bool started_ = false;

  //! After a prefill or a CED append: the rows main_hidden covers (all of an exact prefill, the
  //! replayed tail of a CED call) seed the drafter's rings from zero, every one but the last, which
  //! the next round takes (one row: the rings take it, and the next round is a plain step). Rows
  //! the drafter had not yet seen before are dropped: the capture covers them.
  void seed_from_capture() {
    pending_.clear();
    const long long rows = (long long)(mh_.size() / row), first = seq_.length - rows;
    if (rows >= 2) {
      dspark_prefill<Model>(w_, st_, std::span<const bf16>(mh_).first(std::size_t(rows - 1) * row), first);
      pending_.assign(mh_.end() - std::ptrdiff_t(row), mh_.end());
    } else {
      dspark_prefill<Model>(w_, st_, mh_, first);
    }
  }
  std::int32_t draw(const std::vector<float>& logits) const {
    return kernels::sampling::sample_reference(logits, sampling_, sequence_, std::uint64_t(seq_.length));
  }
  //! Feeds `id`: the logits of the next position; its main_hidden row goes to pending_.
  std::vector<float> step(std::int32_t id) {
    auto logits = forward(m_, seq_, std::span<const std::int32_t>(&id, 1), nullptr, &mh_);
    pending_.insert(pending_.end(), mh_.begin(), mh_.end());
    return logits;
  }
};

//! Generates `n_new` tokens after `prompt` on a fresh sequence `seq`, drafting with `w`. Returns
//! the tokens (equal to plain decoding's, see the file comment) and fills `stats`. `edit_drafts`,
//! if set, may replace a round's drafts before they are checked (tests: an oracle drafter);
//! it receives the position of d_1 and the ids [t_q, d_1 .. d_block].
template <class Model>
std::vector<std::int32_t> generate_speculative(
    const host_model<Model>& m, const dspark_weights& w, host_sequence& seq, std::span<const std::int32_t> prompt, long long n_new,
    const kernels::sampling::sampling_params& sampling, speculative_stats& stats,
    prompt_prefill mode = prompt_prefill::exact, std::uint64_t sequence = 0,
    const std::function<void(long long, std::vector<std::int32_t>&)>& edit_drafts = {}) {
  if (n_new < 0) throw error("generate_speculative: negative token count");
  speculative_decoder<Model> d(m, w, seq, sampling, sequence, edit_drafts);
  stats = d.stats();
  if (n_new == 0) {  // (the misuse checks still apply)
    if (seq.length != 0) throw error("generate_speculative: the sequence must be fresh (it holds " + std::to_string(seq.length) + " tokens)");
    if (prompt.empty()) throw error("generate_speculative: empty prompt");
    return {};
  }
  std::vector<std::int32_t> out{d.start(prompt, mode)};
  while ((long long)out.size() < n_new) {
    const auto kept = d.round(n_new - (long long)out.size());
    out.insert(out.end(), kept.begin(), kept.end());
  }
  stats = d.stats();
  return out;
}

}  // namespace dsv4::model
