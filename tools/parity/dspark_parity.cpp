//! \file
//! The host DSpark drafter (model/dspark_reference.hpp) against the official forward_spec, teacher
//! forced: the drafter gets the reference's main_hidden rows and input ids, and the reference's
//! draft ids for the Markov bias of each row, so that only the drafter is compared (not the
//! backbone's spread, docs/parity.md). The reference side comes from tools/parity/reference_dspark.py
//! (per case: <case>_dspark_hidden.npy, _ids.npy, _logits.npy, _confidence.npy).
//!
//! Prints, per case and decode step: the worst relative error of the 5 draft logit rows (relative
//! to the row's largest |logit|), whether each row's argmax (our draft, greedy) equals the
//! reference's draft, and the worst confidence error (relative to the largest |confidence|). Also
//! the backbone's own main_hidden against the reference's over the prefill (information only).
//! Exit 0 always when both sides ran: no tolerance is set yet (to be measured on the first run).
//!
//! `--write-ours DIR` instead writes dsv4's own side in the dump's format (its backbone's
//! main_hidden, greedy drafts): the tool run on that dump must report zero errors (a check of the
//! tool itself), and the two dumps can be compared file by file.
//!
//! usage: dsv4_dspark_parity --checkpoint DIR --cases cases.json (--dump-dir DIR | --write-ours DIR)

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/io/checkpoint.hpp"
#include "dsv4/io/json.hpp"
#include "dsv4/io/npy.hpp"
#include "dsv4/model/dspark_reference.hpp"
#include "dsv4/model/model_reference.hpp"
#include "dsv4/models/tiny.hpp"

namespace {
using namespace dsv4;
using tiny = models::tiny;
using numerics::bf16;

std::vector<std::int32_t> ids_of(const std::string& text) {
  std::vector<std::int32_t> ids;
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, ',');) ids.push_back(std::int32_t(std::stol(item)));
  return ids;
}

double max_rel(const float* ref, const float* ours, std::size_t n) {
  double scale = 0, err = 0;
  for (std::size_t i = 0; i < n; ++i)
    scale = std::max(scale, std::fabs(double(ref[i]))), err = std::max(err, std::fabs(double(ref[i]) - double(ours[i])));
  return scale > 0 ? err / scale : err;
}

int run(int argc, char** argv) {
  std::string checkpoint, cases_path, dump_dir, ours_dir;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--checkpoint") checkpoint = v;
    else if (k == "--cases") cases_path = v;
    else if (k == "--dump-dir") dump_dir = v;
    else if (k == "--write-ours") ours_dir = v;
    else throw error("unknown option " + k);
  }
  if (checkpoint.empty() || cases_path.empty() || dump_dir.empty() == ours_dir.empty() || argc % 2 == 0)
    throw error("usage: dsv4_dspark_parity --checkpoint DIR --cases cases.json (--dump-dir DIR | --write-ours DIR)");
  constexpr models::model_config c = tiny::dims;
  constexpr int T = models::model_traits<tiny>::schedule::drafter::targets::size, block = c.dspark.dspark_block_size;
  const std::size_t row = std::size_t(T) * std::size_t(c.dim), V = std::size_t(c.vocab_size);
  io::checkpoint ck(checkpoint);
  std::vector<std::int64_t> token_map(V);
  std::iota(token_map.begin(), token_map.end(), 0);
  const auto m = model::host_model<tiny>::load(ck, token_map);
  const auto w = model::dspark_weights_of<tiny>(ck);
  const auto cases = io::parse_json_file(cases_path);
  for (const auto& cs : cases.object().at("cases").array()) {
    const auto& o = cs.object();
    const std::string name = o.at("name").string();
    const auto prompt = ids_of(o.at("prompt").string()), decode = ids_of(o.at("decode").string());
    if (!ours_dir.empty()) {  // dsv4's own side, in the dump's format
      model::host_sequence seq;
      model::dspark_state st;
      std::vector<bf16> mh;
      io::npy_matrix h{0, row, {}}, di{0, std::size_t(block + 1), {}}, dl{0, V, {}}, dc{0, std::size_t(block), {}};
      auto logits = model::forward(m, seq, prompt, nullptr, &mh);
      for (bf16 v : mh) h.data.push_back(v.to_float());
      model::dspark_prefill<tiny>(w, st, mh);
      for (std::int32_t tok : decode) {
        logits = model::forward(m, seq, std::span<const std::int32_t>(&tok, 1), nullptr, &mh);
        for (bf16 v : mh) h.data.push_back(v.to_float());
        const auto next = std::int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
        const auto d = model::dspark_decode<tiny>(m, w, st, next, mh);
        for (std::int32_t id : d.ids) di.data.push_back(float(id));
        dl.data.insert(dl.data.end(), d.logits.begin(), d.logits.end());
        dc.data.insert(dc.data.end(), d.confidence.begin(), d.confidence.end());
      }
      h.rows = h.data.size() / row, di.rows = decode.size(), dl.rows = decode.size() * block, dc.rows = decode.size();
      io::write_npy_f32(ours_dir + "/" + name + "_dspark_hidden.npy", h);
      io::write_npy_f32(ours_dir + "/" + name + "_dspark_ids.npy", di);
      io::write_npy_f32(ours_dir + "/" + name + "_dspark_logits.npy", dl);
      io::write_npy_f32(ours_dir + "/" + name + "_dspark_confidence.npy", dc);
      std::printf("%s: wrote dsv4's side (%zu decode steps) to %s\n", name.c_str(), decode.size(), ours_dir.c_str());
      continue;
    }
    const auto file = [&](const char* what) { return io::read_npy_f32(dump_dir + "/" + name + "_dspark_" + what + ".npy"); };
    const auto hidden = file("hidden"), ids = file("ids"), logits = file("logits"), conf = file("confidence");
    if (hidden.rows != prompt.size() + decode.size() || hidden.cols != row || ids.rows != decode.size() ||
        ids.cols != std::size_t(block + 1) || logits.rows != decode.size() * block || logits.cols != V ||
        conf.rows != decode.size() || conf.cols != std::size_t(block))
      throw error(name + ": the dump's shapes do not match tiny and the case");
    std::vector<bf16> ref_hidden(hidden.data.size());
    for (std::size_t i = 0; i < ref_hidden.size(); ++i) ref_hidden[i] = bf16::from_float(hidden.data[i]);  // bf16 values: exact

    // Our backbone's capture over the prefill, for information.
    model::host_sequence seq;
    std::vector<bf16> mh;
    model::forward(m, seq, prompt, nullptr, &mh);
    std::vector<float> ours_h(mh.size());
    for (std::size_t i = 0; i < mh.size(); ++i) ours_h[i] = mh[i].to_float();
    double worst_h = 0;
    for (std::size_t r = 0; r < prompt.size(); ++r) worst_h = std::max(worst_h, max_rel(hidden.row(r), ours_h.data() + r * row, row));
    std::printf("%s: backbone main_hidden over the prefill: worst max relative error %.4g (information)\n", name.c_str(), worst_h);

    model::dspark_state st;
    model::dspark_prefill<tiny>(w, st, std::span<const bf16>(ref_hidden).first(prompt.size() * row));
    for (std::size_t k = 0; k < decode.size(); ++k) {
      std::vector<std::int32_t> forced(std::size_t(block + 1));
      for (int j = 0; j <= block; ++j) forced[std::size_t(j)] = std::int32_t(ids.row(k)[j]);
      const auto d = model::dspark_decode<tiny>(m, w, st, forced[0],
                                                std::span<const bf16>(ref_hidden).subspan((prompt.size() + k) * row, row),
                                                {0.0f}, 0, forced);
      double worst = 0;
      std::string argmax;
      for (int j = 0; j < block; ++j) {
        const float* ref = logits.row(k * block + std::size_t(j));
        const float* ours = d.logits.data() + std::size_t(j) * V;
        worst = std::max(worst, max_rel(ref, ours, V));
        const auto am = std::max_element(ours, ours + V) - ours;
        argmax += am == forced[std::size_t(j + 1)] ? '=' : 'x';
      }
      const double ce = max_rel(conf.row(k), d.confidence.data(), std::size_t(block));
      std::printf("%s step %zu (position %zu): logits worst max relative error %.4g, drafts %s, confidence %.4g\n", name.c_str(), k,
                  prompt.size() + k, worst, argmax.c_str(), ce);
    }
  }
  return 0;
}
}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "dsv4_dspark_parity: " << e.what() << "\n";
    return 2;
  }
}
