// agentflash::top1: each row's largest logit (its first index) and, if asked, the softmax
// probability there, 1 / sum_j exp(x_j - max), for the float32 logits [R, V] of a step's decode
// and verify rows.
//
// Why it exists (docs/performance.md): a greedy step needs each row's argmax and a drafted step
// the drafter's probability of each draft. torch's argmax over [6, 4096] costs ~28 us and its
// max plus logsumexp ~130 us warm, more in the decode loop; this pass takes ~1 us a row (~3
// with the probability) and opens no parallel region. Single-threaded, it stays faster than
// torch's two-thread reductions up to the 1024 rows measured (3.3 against 5.5 ms).
//
// Ties go to the first index, and a row holding NaN gives its first NaN, as torch.argmax does;
// the probability is NaN where the maximum is NaN or infinite (as exp(max - logsumexp)).
//
// agentflash::masked_top1: the same choice among the tokens a packed grammar mask allows
// (xgrammar's bitmask: token i at bit i % 32 of word i // 32; tokens past the mask are not
// allowed), the greedy token under a grammar without a masked copy of the row: the first of
// equal maxima, as torch.argmax over the row with -inf added elsewhere; the first allowed NaN
// where one is allowed (torch's masked row could give a refused one); where every allowed
// logit is -inf, the first allowed token; -1 where the mask allows nothing.

#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>

namespace {

using Vec = at::vec::Vectorized<float>;

// The row's maximum; NaN if it holds one (at::vec::maximum propagates NaN).
float row_max(const float* x, int64_t n) {
  int64_t j = 0;
  float best = -std::numeric_limits<float>::infinity();
  if (n >= Vec::size()) {
    Vec acc = Vec::loadu(x);
    for (j = Vec::size(); j + Vec::size() <= n; j += Vec::size())
      acc = at::vec::maximum(acc, Vec::loadu(x + j));
    alignas(64) float lanes[Vec::size()];
    acc.store(lanes);
    for (int i = 0; i < Vec::size(); ++i)
      best = std::isnan(lanes[i]) || lanes[i] > best ? lanes[i] : best;
    if (std::isnan(best)) return best;
  }
  for (; j < n; ++j)
    if (std::isnan(x[j]) || x[j] > best) {
      best = x[j];
      if (std::isnan(best)) return best;
    }
  return best;
}

// sum_j exp(x_j - max), with ATen's vectorised exp (its error is far below what a probability
// used to choose how many drafts to verify needs).
float sum_exp(const float* x, int64_t n, float max) {
  const Vec m(max);
  Vec acc(0.0f);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) acc = acc + (Vec::loadu(x + j) - m).exp_u20();
  float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
  for (; j < n; ++j) sum += std::exp(x[j] - max);
  return sum;
}

std::tuple<at::Tensor, at::Tensor> top1(const at::Tensor& logits, bool with_prob) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.device().is_cpu(),
              "top1: float32 CPU logits [R, V], got ", logits.sizes(), " ",
              logits.scalar_type());
  TORCH_CHECK(logits.size(1) > 0, "top1: rows of at least one logit");
  const at::Tensor x = logits.stride(1) == 1 ? logits : logits.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor index = at::empty({rows}, x.options().dtype(at::kLong));
  at::Tensor prob = at::empty({with_prob ? rows : 0}, x.options());
  int64_t* out = index.data_ptr<int64_t>();
  float* p = with_prob ? prob.data_ptr<float>() : nullptr;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x.data_ptr<float>() + r * x.stride(0);
    const float max = row_max(row, n);
    int64_t at = 0;
    if (std::isnan(max)) {
      while (!std::isnan(row[at])) ++at;
    } else {
      while (row[at] != max) ++at;
    }
    out[r] = at;
    if (p != nullptr)  // a NaN or infinite maximum: NaN, as exp(max - logsumexp) in torch
      p[r] = std::isfinite(max) ? 1.0f / sum_exp(row, n, max)
                                : std::numeric_limits<float>::quiet_NaN();
  }
  return {index, prob};
}

// The allowed token with the largest logit (see masked_top1); -1 if none is allowed.
int64_t allowed_max(const float* row, int64_t n, const int32_t* words, int64_t num_words) {
  int64_t at = -1;
  float best = 0.0f;
  for (int64_t w = 0; w < num_words && w * 32 < n; ++w) {
    uint32_t word = static_cast<uint32_t>(words[w]);
    while (word != 0) {
      const int64_t t = w * 32 + __builtin_ctz(word);
      word &= word - 1;
      if (t >= n) break;
      const float x = row[t];
      if (at < 0 || (std::isnan(x) && !std::isnan(best)) || x > best) {
        at = t;
        best = x;
      }
    }
  }
  return at;
}

at::Tensor masked_top1(const at::Tensor& logits, const at::Tensor& allowed) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.device().is_cpu(),
              "masked_top1: float32 CPU logits [R, V], got ", logits.sizes(), " ",
              logits.scalar_type());
  TORCH_CHECK(allowed.dim() == 2 && allowed.scalar_type() == at::kInt &&
                  allowed.device().is_cpu() && allowed.size(0) == logits.size(0),
              "masked_top1: int32 CPU masks [R, W] for logits [R, V], got ", allowed.sizes(),
              " ", allowed.scalar_type());
  const at::Tensor x = logits.stride(1) == 1 ? logits : logits.contiguous();
  const at::Tensor m = allowed.stride(1) == 1 ? allowed : allowed.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor index = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* out = index.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    out[r] = allowed_max(x.data_ptr<float>() + r * x.stride(0), n,
                         m.data_ptr<int32_t>() + r * m.stride(0), m.size(1));
  return index;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(agentflash, m) {
  m.def("top1(Tensor logits, bool with_prob) -> (Tensor, Tensor)");
  m.def("masked_top1(Tensor logits, Tensor allowed) -> Tensor");
}

TORCH_LIBRARY_IMPL(agentflash, CPU, m) {
  m.impl("top1", &top1);
  m.impl("masked_top1", &masked_top1);
}
