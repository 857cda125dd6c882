// Binding a checkpoint to the host attention sublayers: every layer of the tiny variant read from
// a random checkpoint (official names, dtypes, shapes), run as an attention-only stack in
// schedule order (owners before their Reuse / Reindex readers, the candidate source before the
// Reindex layers); decode reproduces prefill bit for bit once the window is full. Errors name the
// tensor and the file.

#include <boost/test/unit_test.hpp>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <vector>

#include "dsv4/io/random_checkpoint.hpp"
#include "dsv4/model/attention_weights.hpp"
#include "dsv4/models/checkpoint_schema.hpp"
#include "dsv4/models/tiny.hpp"
#include "support/checkpoints.hpp"
#include "support/errors.hpp"
#include "support/random.hpp"

using namespace dsv4;
using numerics::bf16;
using tiny = models::tiny;

namespace {

struct bound_stack {
  std::vector<kernels::attention::layer_wiring> wiring;
  std::vector<kernels::attention::layer_weights> weights;
  std::vector<std::vector<float>> freqs;
};

//! Each layer over rows [first, first + n) of x, in schedule order; the outputs of every layer.
std::vector<std::vector<bf16>> run(const bound_stack& st, const std::vector<bf16>& x, int first, int n,
                                   kernels::attention::sequence_state& state) {
  constexpr auto shape = model::attention_shape<tiny>();
  std::vector<std::vector<bf16>> outs;
  const auto rows = std::span<const bf16>(x).subspan(std::size_t(first) * shape.dim, std::size_t(n) * shape.dim);
  for (int l = 0; l < int(st.wiring.size()); ++l)
    outs.push_back(kernels::attention::attention_layer_reference(l, st.wiring[std::size_t(l)], st.weights[std::size_t(l)],
                                                                 shape, st.freqs[std::size_t(l)], rows, first, state));
  return outs;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(attention_weights)

BOOST_AUTO_TEST_CASE(tiny_checkpoint_runs_every_attention_layer) {
  const test::temp_checkpoint tmp("attn_bind", models::checkpoint_schema<tiny>(), 11);
  io::checkpoint ck(tmp.dir);
  using sched = models::model_traits<tiny>::schedule;
  bound_stack st;
  for (int l = 0; l < sched::num_layers; ++l) {
    st.wiring.push_back(model::attention_wiring<tiny>(l));
    st.weights.push_back(model::attention_weights<tiny>(ck, l));
    st.freqs.push_back(model::attention_rope_frequencies<tiny>(l));
  }
  constexpr auto shape = model::attention_shape<tiny>();
  const int window = shape.window, tokens = window + 3;
  auto rng = test::make_rng(80);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<bf16> x(std::size_t(tokens) * shape.dim);
  for (auto& v : x) v = bf16::from_float(n(rng));

  kernels::attention::sequence_state incremental, fresh;
  run(st, x, 0, tokens - 2, incremental);
  run(st, x, tokens - 2, 1, incremental);
  const auto step = run(st, x, tokens - 1, 1, incremental);  // position tokens - 1 >= window - 1
  const auto full = run(st, x, 0, tokens, fresh);
  std::size_t differ = 0, nonfinite = 0, nonzero = 0;
  for (std::size_t l = 0; l < step.size(); ++l)
    for (int d = 0; d < shape.dim; ++d) {
      const bf16 a = step[l][std::size_t(d)], b = full[l][std::size_t(tokens - 1) * shape.dim + d];
      differ += a.bits != b.bits;
      nonfinite += !std::isfinite(a.to_float());
      nonzero += a.to_float() != 0.0f;
    }
  BOOST_TEST(differ == 0u);
  BOOST_TEST(nonfinite == 0u);
  BOOST_TEST(nonzero > step.size() * shape.dim / 2);  // the random weights do produce signal
}

BOOST_AUTO_TEST_CASE(bad_tensors_are_named) {
  auto schema = models::checkpoint_schema<tiny>();
  for (auto& t : schema)
    if (t.name == "layers.3.attn.wq_a.weight") t.shape[1] += 32;  // a wrong width
  const test::temp_checkpoint tmp("attn_bad", schema, 12);
  io::checkpoint ck(tmp.dir);
  BOOST_TEST(test::throws_with([&] { model::attention_weights<tiny>(ck, 3); }, "tensor 'layers.3.attn.wq_a.weight'"));
  BOOST_TEST(test::throws_with([&] { model::attention_weights<tiny>(ck, 3); }, "expected [64, 256]"));
  BOOST_TEST(test::throws_with([&] { model::attention_weights<tiny>(ck, 99); }, "layer 99 outside [0, 40)"));
  // A tensor the schema lists but the file lacks:
  auto fewer = models::checkpoint_schema<tiny>();
  std::erase_if(fewer, [](const io::tensor_spec& t) { return t.name == "layers.1.attn.attn_sink"; });
  const test::temp_checkpoint tmp2("attn_missing", fewer, 13);
  io::checkpoint ck2(tmp2.dir);
  BOOST_TEST(test::throws_with([&] { model::attention_weights<tiny>(ck2, 1); }, "missing tensor 'layers.1.attn.attn_sink'"));
}

// A NaN weight code (E4M3 S.1111.111) or scale (UE8M0 0xFF) makes the reference compute NaN, and
// the CUDA kernels (which decode weights by bit placement) something else: the loader refuses
// the checkpoint, naming the tensor and the first such element.
BOOST_AUTO_TEST_CASE(nan_weight_codes_are_refused) {
  const auto schema = models::checkpoint_schema<tiny>();
  const test::temp_checkpoint tmp("attn_nan", schema, 14);
  io::checkpoint src(tmp.dir);
  auto poisoned = [&](const std::string& target, std::size_t at, std::uint8_t code) {
    auto ck = io::checkpoint::in_memory();
    for (const auto& t : schema) {
      if (!src.contains(t.name)) continue;
      const io::tensor_view& v = src.tensor(t.name);
      std::vector<std::uint8_t> b(v.bytes.size());
      std::memcpy(b.data(), v.bytes.data(), b.size());
      if (t.name == target) b.at(at) = code;
      ck.add(t.name, v.dtype, v.shape, std::move(b));
    }
    return ck;
  };
  auto clean = poisoned("", 0, 0);
  BOOST_CHECK_NO_THROW(model::attention_weights<tiny>(clean, 3));
  auto nan_code = poisoned("layers.3.attn.wq_a.weight", 5 * 256 + 7, 0x7F);
  BOOST_TEST(test::throws_with([&] { model::attention_weights<tiny>(nan_code, 3); },
                               "tensor 'layers.3.attn.wq_a.weight' in (in memory) holds 1 NaN E4M3 code(s)"));
  BOOST_TEST(test::throws_with([&] { model::attention_weights<tiny>(nan_code, 3); }, "the first at [5, 7]"));
  auto negative_nan = poisoned("layers.3.attn.wkv.weight", 3, 0xFF);
  BOOST_TEST(test::throws_with([&] { model::attention_weights<tiny>(negative_nan, 3); },
                               "'layers.3.attn.wkv.weight'"));
  auto nan_scale = poisoned("layers.3.attn.wq_a.scale", 9, 0xFF);
  BOOST_TEST(test::throws_with(
      [&] { model::attention_weights<tiny>(nan_scale, 3); },
      "'layers.3.attn.wq_a.scale' in (in memory) holds 1 NaN UE8M0 scale(s) (0xFF), the first at [1, 1]"));
  // The largest finite codes pass: 0x7E (448) and 0xFE (-448), and scale 0xFE (2^127).
  auto largest = poisoned("layers.3.attn.wq_a.weight", 0, 0x7E);
  BOOST_CHECK_NO_THROW(model::attention_weights<tiny>(largest, 3));
}

BOOST_AUTO_TEST_SUITE_END()
