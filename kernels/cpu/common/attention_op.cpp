// agentflash::paged_attention_bf16: attention of a few new queries per sequence (decode rows,
// verify blocks, drafter blocks) over their sequences' keys in the paged KV pool, read in place.
//
// Why it exists (docs/performance.md): the torch path gathers every layer's whole context into
// a contiguous copy and runs small batched matmuls, each a library call of tens of
// microseconds; at agentflash-11m that is a third of a decode step, at Qwen3-0.6B's sizes the
// copies alone cost ~9 ms a step at 1000 tokens of context.
//
// Query t (of sequence token_seq[t]) sees keys 0 .. token_keys[t] - 1 of its sequence, key j in
// slot page_table[seq, j / page_size] * page_size + j % page_size of the caches [S, Hkv, D].
// With k_new / v_new [B * R, Hkv, D] and cached [B] (the DFlash drafter's blocks of R tokens,
// whose own K/V are not in the pool), key j >= cached[b] of sequence b is instead row
// b * R + j - cached[b] of k_new / v_new: the block's own rows. The queries may be any of a
// block's rows (all R, or only those whose drafts are verified). This file checks the arguments,
// finds the runs of consecutive queries of one sequence; the set's attention (kernels.h:
// attend_all, attend_all_float32 or attend_all_amx) splits them over threads and computes them
// (every output row depends on its query and keys alone).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <utility>
#include <vector>

#include "kernels.h"
#include "ops.h"

namespace agentflash_cpu {

namespace {

// Whether the avx512-bf16 and amx sets compute attention in float32 (attend_all_float32) rather
// than by their bfloat16 dot products: set once when the library loads (cpu_ops.load), by what
// this CPU is faster at; the other sets have one attention each.
std::atomic<bool> g_float32_attention{false};

void attend(const AttentionCall& call) {
#if defined(__AVX512BF16__)
  if (g_float32_attention.load(std::memory_order_relaxed)) return attend_all_float32(call);
  attend_all(call);
#elif defined(__AVX512F__)
  attend_all_float32(call);
#else
  attend_all(call);
#endif
}

}  // namespace

at::Tensor paged_attention_bf16(const at::Tensor& q, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, const at::Tensor& page_table,
                                int64_t page_size, const at::Tensor& token_seq,
                                const at::Tensor& token_keys, double scale,
                                const std::optional<at::Tensor>& k_new,
                                const std::optional<at::Tensor>& v_new,
                                const std::optional<at::Tensor>& cached) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(),
              "paged_attention_bf16: q [T, Hq, D], caches [S, Hkv, D]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16,
              "paged_attention_bf16: bfloat16 q and caches");
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == D && D % 32 == 0 && D <= kMaxHeadDim,
              "paged_attention_bf16: head_dim a multiple of 32 up to 256, got ", D);
  TORCH_CHECK(Hq % Hkv == 0, "paged_attention_bf16: query heads a multiple of KV heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_attention_bf16: contiguous caches");
  TORCH_CHECK(page_table.dim() == 2 && page_table.scalar_type() == at::kLong &&
                  token_seq.scalar_type() == at::kLong && token_keys.scalar_type() == at::kLong &&
                  token_seq.numel() == T && token_keys.numel() == T && page_size >= 1 &&
                  k_cache.size(0) % page_size == 0,
              "paged_attention_bf16: int64 page_table [B, P], token_seq [T], token_keys [T], "
              "caches of whole pages");
  const at::Tensor qc = q.contiguous();
  const at::Tensor table_c = page_table.contiguous();
  const at::Tensor seq_c = token_seq.contiguous(), keys_c = token_keys.contiguous();
  const int64_t* seq = seq_c.data_ptr<int64_t>();
  const int64_t* keys = keys_c.data_ptr<int64_t>();
  const int64_t B = table_c.size(0), P = table_c.size(1), L = P * page_size;
  const int64_t num_pages = k_cache.size(0) / page_size;
  const int64_t* table = table_c.data_ptr<int64_t>();
  const bool with_new = k_new.has_value() && k_new->defined();
  TORCH_CHECK(with_new == (v_new.has_value() && v_new->defined()) &&
                  with_new == (cached.has_value() && cached->defined()),
              "paged_attention_bf16: k_new, v_new and cached go together");
  at::Tensor kn_c, vn_c, cached_c;
  if (with_new) {
    TORCH_CHECK(k_new->dim() == 3 && B >= 1 && k_new->size(0) % B == 0 &&
                    k_new->size(1) == Hkv && k_new->size(2) == D &&
                    v_new->sizes() == k_new->sizes() && k_new->scalar_type() == at::kBFloat16 &&
                    v_new->scalar_type() == at::kBFloat16 && cached->dim() == 1 &&
                    cached->size(0) == B && cached->scalar_type() == at::kLong,
                "paged_attention_bf16: bfloat16 k_new, v_new [B * R, Hkv, D] and int64 cached "
                "[B]");
    kn_c = k_new->contiguous();
    vn_c = v_new->contiguous();
    cached_c = cached->contiguous();
  }
  const int64_t* pooled = with_new ? cached_c.data_ptr<int64_t>() : nullptr;
  const int64_t new_rows = with_new ? k_new->size(0) / B : 0;  // each sequence's own rows
  // runs of consecutive queries of one sequence (a decode row, a verify block, a draft block)
  std::vector<std::pair<int64_t, int64_t>> runs;
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(seq[t] >= 0 && seq[t] < B, "paged_attention_bf16: query ", t, " of sequence ",
                seq[t], " (", B, " sequences)");
    if (runs.empty() || seq[t] != seq[runs.back().first] || t != runs.back().second)
      runs.emplace_back(t, t + 1);
    else
      runs.back().second = t + 1;
  }
  for (const auto& [t0, t1] : runs) {
    const int64_t b = seq[t0];
    const int64_t in_pool = with_new ? pooled[b] : L;
    TORCH_CHECK(in_pool >= 0 && in_pool <= L, "paged_attention_bf16: ", in_pool,
                " cached keys of sequence ", b, " (up to ", L, ")");
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t most = with_new ? in_pool + new_rows : L;
      TORCH_CHECK(keys[t] >= 1 && keys[t] <= most, "paged_attention_bf16: query ", t,
                  " sees ", keys[t], " keys of sequence ", b, " (it has ", most, ")");
      const int64_t from_pool = std::min(keys[t], in_pool);
      for (int64_t p = 0; p < (from_pool + page_size - 1) / page_size; ++p)
        TORCH_CHECK(table[b * P + p] >= 0 && table[b * P + p] < num_pages,
                    "paged_attention_bf16: page ", table[b * P + p], " of sequence ", b,
                    " is not in the cache (", num_pages, " pages)");
    }
  }
  at::Tensor out = at::empty({T, Hq, D}, qc.options());
  const auto bf16 = [](const at::Tensor& t) {
    return reinterpret_cast<const uint16_t*>(t.data_ptr());
  };
  const AttentionCall call{bf16(qc), bf16(k_cache), bf16(v_cache), table, P, page_size, seq,
                           keys, Hq, Hkv, D, static_cast<float>(scale),
                           with_new ? bf16(kn_c) : nullptr, with_new ? bf16(vn_c) : nullptr,
                           pooled, new_rows, reinterpret_cast<uint16_t*>(out.data_ptr()), &runs};
#ifdef __AMX_BF16__
  if (!g_float32_attention.load(std::memory_order_relaxed) && attend_all_amx(call)) return out;
#endif
  attend(call);
  return out;
}

}  // namespace agentflash_cpu

TORCH_LIBRARY_FRAGMENT(agentflash, m) {
  m.def(
      "paged_attention_bf16(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, "
      "int page_size, Tensor token_seq, Tensor token_keys, float scale, Tensor? k_new=None, "
      "Tensor? v_new=None, Tensor? cached=None) -> Tensor");
  m.def("set_float32_attention(bool on) -> ()",
        [](bool on) { agentflash_cpu::g_float32_attention.store(on); });
}

TORCH_LIBRARY_IMPL(agentflash, CPU, m) {
  m.impl("paged_attention_bf16", &agentflash_cpu::paged_attention_bf16);
}
