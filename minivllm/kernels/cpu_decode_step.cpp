// A whole decode step's decoder layers on the CPU in one call: for every layer, add the
// residual and RMSNorm, the q/k/v product, q/k norm (Qwen3), rotary, the new K/V stored into
// the paged pool, grouped attention over each sequence's context, the output product, the
// second norm, gate/up, SiLU * up and down (minivllm/engine/cpu_step.py: the wrapper, and
// why). fp32 activations and KV cache; each linear's weight is either fp32 [N, K] (MKL, the
// same call as F.linear) or a weight-only copy (lowp_linear, group_linear: with
// `int8_activations`, its q4_1 / q8_0 products quantize their inputs to int8 per group).
//
// Built after cpu_lowp_linear.cpp as one translation unit (one extension): it calls that
// file's `lowp_linear` / `group_linear` and adds its op to the same `minivllm_cpu` library.

#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

// One linear of a layer: an fp32 weight [N, K]; a packed bf16 / int8 one [blocks, K, L]
// with its per-channel fp32 scales (int8); or a Q8_0 / Q4_1 one with fp16 group scales
// (and mins).
struct Linear {
  const at::Tensor& weight;
  const std::optional<at::Tensor>& scales;
  const std::optional<at::Tensor>& mins;
  const std::optional<at::Tensor>& bias;
  bool int8_act;  // group formats: int8 activations (group_linear's VNNI path)

  at::Tensor operator()(const at::Tensor& x, int64_t n) const {
    if (weight.dim() != 3) return at::linear(x, weight, bias);
    if (scales.has_value() && scales->scalar_type() == at::kHalf)
      return group_linear(x, weight, *scales, mins, bias, n, int8_act);
    return lowp_linear(x, weight, scales, bias, n);
  }
};

// NOTE: the sums below say `omp simd reduction`: without it the compiler keeps a float sum in
// source order, one dependent add at a time (a 64-float dot product: ~256 cycles of latency;
// at 8 sequences that made attention most of the step).

// out = rms_norm(x) * w over `n` floats (x may alias out).
inline void rms_norm(const float* x, const float* w, float eps, int64_t n, float* out) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(sum / (float)n + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv * w[i];
}

// Rotate-half rotary on one head: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin);
// cos_sin = the position's row of the cache (cos in the first half, sin after).
inline void rotate(float* x, const float* cos_sin, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  const float* cos = cos_sin;
  const float* sin = cos_sin + half;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    x[i] = x1 * cos[i] - x2 * sin[i];
    x[i + half] = x2 * cos[i] + x1 * sin[i];
  }
}

// `rotate` with each product rounded before the sum, as torch's separate ops round them (the
// file is built with -ffp-contract=fast, which would fuse them into FMAs): the prefill's
// q/k are then the reference path's bits, so a prompt's K/V and its first token do not
// depend on which path computed them (a greedy near-tie would go either way).
#if defined(__clang__)
inline void rotate_unfused(float* x, const float* cos_sin, int64_t head_dim) {
#pragma clang fp contract(off)
#else
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
inline void rotate_unfused(float* x, const float* cos_sin, int64_t head_dim) {
#endif
  const int64_t half = head_dim / 2;
  const float* cos = cos_sin;
  const float* sin = cos_sin + half;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    x[i] = x1 * cos[i] - x2 * sin[i];
    x[i + half] = x2 * cos[i] + x1 * sin[i];
  }
}
#if !defined(__clang__)
#pragma GCC pop_options
#endif

// e^x for n floats in place, L at a time: Cephes' expf (range reduction by ln 2, a degree-7
// polynomial, the exponent added as bits), within ~2 ulp of std::exp for x in [-87.3, 88.7]
// (clamped there). std::exp is a call per float (~20 cycles): at 8 sequences the softmax
// and SiLU exponentials alone cost more than a millisecond a step.
inline void exp_inplace(float* x, int64_t n) {
  typedef int32_t vi32 __attribute__((vector_size(L * 4)));
  int64_t i = 0;
  for (; i + L <= n; i += L) {
    vf v;
    std::memcpy(&v, x + i, sizeof v);
    v = v < 88.7f ? v : 88.7f;
    v = v > -87.3f ? v : -87.3f;
    const float round = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
    const vf k = (v * 1.44269504088896341f + round) - round;
    const vf r = v - k * 0.693359375f + k * 2.12194440e-4f;
    vf p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const vi32 bits = (vi32)p + (__builtin_convertvector(k, vi32) << 23);
    std::memcpy(x + i, &bits, sizeof bits);
  }
  for (; i < n; ++i) x[i] = std::exp(x[i]);
}

// out[i] = silu(gate[i]) * up[i] = gate[i] / (1 + e^-gate[i]) * up[i]; up = gate + inter.
inline void silu_mul(const float* gate, int64_t inter, float* out) {
  const float* up = gate + inter;
  for (int64_t i = 0; i < inter; ++i) out[i] = -gate[i];
  exp_inplace(out, inter);
  for (int64_t i = 0; i < inter; ++i) out[i] = gate[i] / (1.0f + out[i]) * up[i];
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

struct Shape {
  int64_t num_seqs, hidden, num_heads, num_kv_heads, head_dim, block_size, max_blocks;
};

// The cache slot of context position t of sequence s.
inline int64_t slot_of(const int64_t* block_tables, const Shape& d, int64_t s, int64_t t) {
  return block_tables[s * d.max_blocks + t / d.block_size] * d.block_size + t % d.block_size;
}

// The sum of a vector's lanes.
inline float hsum(vf v) {
#ifdef __AVX512F__
  return _mm512_reduce_add_ps((__m512)v);
#else
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  return _mm_cvtss_f32(_mm_add_ss(lo, _mm_movehdup_ps(lo)));
#endif
}

constexpr int64_t MAX_GROUP = 16;    // query heads per KV head that `attend_head` holds
constexpr int64_t PREFETCH_AHEAD = 8;  // positions: K/V rows are requested this far ahead

// Touch the `bytes` of a K or V row (a context position of one KV head) into the cache.
inline void prefetch_row(const float* row, int64_t bytes) {
  for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch((const char*)row + c);
}

// One sequence's attention for one KV head and its `group` query heads, head size NV * L
// (NV vectors a row): each K and V row is read once for the whole group, held in registers,
// and requested PREFETCH_AHEAD positions early (the rows of a paged context are scattered,
// and between two layers' attention the weights have pushed them out of the caches).
// scores: scratch, group * len floats.
template <int NV>
void attend_head(const float* qs, const float* k_rows, const float* v_rows, const int64_t* sl,
                 int64_t len, int64_t group, int64_t row_stride, float scale, float* os,
                 std::vector<float>& scores) {
  constexpr int64_t HD = NV * L;
  scores.resize(group * len);
  vf qv[MAX_GROUP][NV];
  float top[MAX_GROUP], inv[MAX_GROUP];
  for (int64_t j = 0; j < group; ++j) {
    std::memcpy(qv[j], qs + j * HD, sizeof qv[j]);
    for (int n = 0; n < NV; ++n) qv[j][n] *= scale;
    top[j] = -INFINITY;
  }
  for (int64_t t = 0; t < len; ++t) {
    if (t + PREFETCH_AHEAD < len) prefetch_row(k_rows + sl[t + PREFETCH_AHEAD] * row_stride, HD * 4);
    vf k[NV];
    std::memcpy(k, k_rows + sl[t] * row_stride, sizeof k);
    for (int64_t j = 0; j < group; ++j) {
      vf acc[NV];
      for (int n = 0; n < NV; ++n) acc[n] = qv[j][n] * k[n];
      for (int w = NV / 2; w >= 1; w /= 2)  // a tree: no chain of dependent adds
        for (int n = 0; n < w; ++n) acc[n] += acc[n + w];
      const float score = hsum(acc[0]);
      scores[j * len + t] = score;
      top[j] = std::max(top[j], score);
    }
  }
  for (int64_t j = 0; j < group; ++j) {
    float* row = scores.data() + j * len;
    for (int64_t t = 0; t < len; ++t) row[t] -= top[j];
    exp_inplace(row, len);
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < len; ++t) total += row[t];
    inv[j] = 1.0f / total;
  }
  vf acc[MAX_GROUP][NV] = {};
  for (int64_t t = 0; t < len; ++t) {
    if (t + PREFETCH_AHEAD < len) prefetch_row(v_rows + sl[t + PREFETCH_AHEAD] * row_stride, HD * 4);
    vf v[NV];
    std::memcpy(v, v_rows + sl[t] * row_stride, sizeof v);
    for (int64_t j = 0; j < group; ++j) {
      const float p = scores[j * len + t];
      for (int n = 0; n < NV; ++n) acc[j][n] += p * v[n];
    }
  }
  for (int64_t j = 0; j < group; ++j) {
    for (int n = 0; n < NV; ++n) acc[j][n] *= inv[j];
    std::memcpy(os + j * HD, acc[j], sizeof acc[j]);
  }
}

// The same for any head size and group (the plain loops; no model the engine runs needs it
// today with AVX-512 or AVX2: head sizes 64 and 128, groups up to 16).
void attend_head_any(const float* qs, const float* k_rows, const float* v_rows,
                     const int64_t* sl, int64_t len, int64_t group, int64_t row_stride,
                     int64_t hd, float scale, float* os, std::vector<float>& scores) {
  scores.assign(group * len, 0.0f);
  for (int64_t t = 0; t < len; ++t) {
    const float* k = k_rows + sl[t] * row_stride;
    for (int64_t j = 0; j < group; ++j) scores[j * len + t] = dot(qs + j * hd, k, hd) * scale;
  }
  for (int64_t j = 0; j < group; ++j) {
    float* row = scores.data() + j * len;
    const float top = *std::max_element(row, row + len);
    for (int64_t t = 0; t < len; ++t) row[t] -= top;
    exp_inplace(row, len);
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < len; ++t) total += row[t];
    for (int64_t t = 0; t < len; ++t) row[t] /= total;
  }
  std::fill(os, os + group * hd, 0.0f);
  for (int64_t t = 0; t < len; ++t) {
    const float* v = v_rows + sl[t] * row_stride;
    for (int64_t j = 0; j < group; ++j) {
      const float p = scores[j * len + t];
      for (int64_t i = 0; i < hd; ++i) os[j * hd + i] += p * v[i];
    }
  }
}

// out[s, head] = softmax(q . K_context * scale) V_context for each sequence over its
// seq_lens[s] cached positions (the new token's included: it is stored first), one job per
// (sequence, KV head).
// slots: [num_seqs, max_len], each position's cache slot (computed once a step: a division
// per position per head and layer measured as much as the attention's arithmetic).
void attend(const float* q, const float* k_cache, const float* v_cache, const int64_t* slots,
            int64_t max_len, const int64_t* seq_lens, const Shape& d, float scale, float* out) {
  const int64_t group = d.num_heads / d.num_kv_heads, hd = d.head_dim;
  const int64_t row_stride = d.num_kv_heads * hd;
  at::parallel_for(0, d.num_seqs * d.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t job = begin; job < end; ++job) {
      const int64_t s = job / d.num_kv_heads, g = job % d.num_kv_heads;
      const float* qs = q + (s * d.num_heads + g * group) * hd;
      const float *k_rows = k_cache + g * hd, *v_rows = v_cache + g * hd;
      const int64_t *sl = slots + s * max_len, len = seq_lens[s];
      float* os = out + (s * d.num_heads + g * group) * hd;
      if (group <= MAX_GROUP && hd == 4 * L)
        attend_head<4>(qs, k_rows, v_rows, sl, len, group, row_stride, scale, os, scores);
      else if (group <= MAX_GROUP && hd == 8 * L)
        attend_head<8>(qs, k_rows, v_rows, sl, len, group, row_stride, scale, os, scores);
      else if (group <= MAX_GROUP && hd == 16 * L)
        attend_head<16>(qs, k_rows, v_rows, sl, len, group, row_stride, scale, os, scores);
      else
        attend_head_any(qs, k_rows, v_rows, sl, len, group, row_stride, hd, scale, os, scores);
    }
  });
}

inline int64_t longest(const int64_t* seq_lens, int64_t num_seqs) {
  int64_t max_len = 1;
  for (int64_t s = 0; s < num_seqs; ++s) max_len = std::max(max_len, seq_lens[s]);
  return max_len;
}

// [num_seqs, max_len]: the cache slot of each context position, every block checked to be
// in the pool (of `num_slots` slots) before anything reads or writes it.
std::vector<int64_t> slot_table(const int64_t* bt, const int64_t* lens, const Shape& d,
                                int64_t num_slots, int64_t max_len) {
  std::vector<int64_t> slots(d.num_seqs * max_len, 0);
  for (int64_t s = 0; s < d.num_seqs; ++s) {
    TORCH_CHECK(lens[s] >= 1 && lens[s] <= d.max_blocks * d.block_size,
                "decode attention: seq_len ", lens[s], " does not fit the block table");
    for (int64_t b = 0; b * d.block_size < lens[s]; ++b)
      TORCH_CHECK(bt[s * d.max_blocks + b] >= 0 &&
                      bt[s * d.max_blocks + b] * d.block_size < num_slots,
                  "decode attention: block ", bt[s * d.max_blocks + b], " is outside the pool");
    for (int64_t t = 0; t < lens[s]; ++t) slots[s * max_len + t] = slot_of(bt, d, s, t);
  }
  return slots;
}

// Decode attention alone (tests; the step calls `attend`): q [num_seqs, num_heads,
// head_dim], caches [blocks, block_size, kv_heads, head_dim] fp32; one token a sequence.
at::Tensor paged_decode_attention(const at::Tensor& q_in, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables_in,
                                  const at::Tensor& seq_lens_in, double scale) {
  TORCH_CHECK(q_in.dim() == 3 && q_in.scalar_type() == at::kFloat && k_cache.dim() == 4 &&
                  k_cache.scalar_type() == at::kFloat && k_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.is_contiguous() &&
                  v_cache.scalar_type() == at::kFloat && q_in.size(2) == k_cache.size(3),
              "paged_decode_attention: fp32 q [seqs, heads, head_dim] and contiguous fp32 "
              "caches [blocks, block_size, kv_heads, head_dim]");
  const at::Tensor q = q_in.contiguous();
  const at::Tensor block_tables = block_tables_in.to(at::kLong).contiguous();
  const at::Tensor seq_lens = seq_lens_in.to(at::kLong).contiguous();
  Shape d{q.size(0), 0, q.size(1), k_cache.size(2), k_cache.size(3), k_cache.size(1),
          block_tables.size(1)};
  TORCH_CHECK(block_tables.size(0) == d.num_seqs && seq_lens.numel() == d.num_seqs &&
                  d.num_heads % d.num_kv_heads == 0,
              "paged_decode_attention: one block table row and seq_len per sequence; "
              "heads a multiple of KV heads");
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t max_len = longest(lens, d.num_seqs);
  const std::vector<int64_t> slots = slot_table(block_tables.data_ptr<int64_t>(), lens, d,
                                                k_cache.size(0) * d.block_size, max_len);
  at::Tensor out = at::empty_like(q);
  attend(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
         slots.data(), max_len, lens, d, (float)scale, out.data_ptr<float>());
  return out;
}

// norms: ln1, ln2 per layer. qk_norms: q_norm, k_norm per layer (None without them).
// weights / scales / mins / biases: qkv, o, gate_up, down per layer (`Linear`).
// kv_cache: [2, num_layers, num_blocks, block_size, num_kv_heads, head_dim], written at each
// sequence's new slot.
// Returns (last layer's output, residual): the model's final norm adds them.
std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& x_in, at::TensorList norms,
    const c10::List<std::optional<at::Tensor>>& qk_norms,
    at::TensorList weights, const c10::List<std::optional<at::Tensor>>& scales,
    const c10::List<std::optional<at::Tensor>>& mins,
    const c10::List<std::optional<at::Tensor>>& biases, at::Tensor& kv_cache,
    const at::Tensor& block_tables_in, const at::Tensor& seq_lens_in,
    const at::Tensor& positions_in, const at::Tensor& cos_sin_cache, int64_t num_heads,
    double scale, double eps, double qk_eps, bool int8_act) {
  const int64_t num_layers = (int64_t)norms.size() / 2;
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat,
              "decode_layers: x must be fp32 [num_seqs, hidden]");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.scalar_type() == at::kFloat &&
                  kv_cache.is_contiguous() && kv_cache.size(1) == num_layers,
              "decode_layers: kv_cache must be a contiguous fp32 [2, ", num_layers,
              ", blocks, block_size, kv_heads, head_dim] pool");
  TORCH_CHECK((int64_t)qk_norms.size() == 2 * num_layers &&
                  (int64_t)weights.size() == 4 * num_layers &&
                  (int64_t)scales.size() == 4 * num_layers &&
                  (int64_t)mins.size() == 4 * num_layers &&
                  (int64_t)biases.size() == 4 * num_layers,
              "decode_layers: 2 norms, 2 q/k norms and 4 linears per layer");
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.is_contiguous(),
              "decode_layers: cos_sin_cache must be contiguous fp32");
  const at::Tensor block_tables = block_tables_in.to(at::kLong).contiguous();
  const at::Tensor seq_lens = seq_lens_in.to(at::kLong).contiguous();
  const at::Tensor positions = positions_in.to(at::kLong).contiguous();
  Shape d{x_in.size(0), x_in.size(1), num_heads, kv_cache.size(4), kv_cache.size(5),
          kv_cache.size(3), block_tables.size(1)};
  const int64_t hd = d.head_dim, num_slots = kv_cache.size(2) * d.block_size;
  const int64_t q_size = num_heads * hd, kv_size = d.num_kv_heads * hd;
  const int64_t qkv_size = q_size + 2 * kv_size;
  const at::Tensor& down0 = weights[3];
  const int64_t inter = down0.size(1);  // [hidden, inter] or [blocks, inter, L]
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  TORCH_CHECK(seq_lens.numel() == d.num_seqs && positions.numel() == d.num_seqs &&
                  block_tables.size(0) == d.num_seqs,
              "decode_layers: one seq_len, position and block table row per sequence");
  for (int64_t s = 0; s < d.num_seqs; ++s)
    TORCH_CHECK(pos[s] >= 0 && pos[s] < cos_sin_cache.size(0),
                "decode_layers: position ", pos[s], " is past the rotary cache");
  const int64_t max_len = longest(lens, d.num_seqs);
  const std::vector<int64_t> slots = slot_table(bt, lens, d, num_slots, max_len);
  std::vector<int64_t> new_slots(d.num_seqs);
  for (int64_t s = 0; s < d.num_seqs; ++s) new_slots[s] = slots[s * max_len + lens[s] - 1];

  at::Tensor x = x_in.contiguous();
  at::Tensor residual = at::empty_like(x);
  at::Tensor h = at::empty_like(x);
  at::Tensor attn = at::empty({d.num_seqs, q_size}, x.options());
  float* kv = kv_cache.data_ptr<float>();
  const int64_t layer_stride = kv_cache.stride(1), kv_stride = kv_cache.stride(0);
  const float feps = (float)eps, fqk_eps = (float)qk_eps, fscale = (float)scale;

  for (int64_t l = 0; l < num_layers; ++l) {
    const float* ln1 = norms[2 * l].data_ptr<float>();
    const float* ln2 = norms[2 * l + 1].data_ptr<float>();
    // c10::List hands out copies: keep them alive for the Linears' references.
    std::optional<at::Tensor> sc[4], mn[4], bs[4];
    for (int i = 0; i < 4; ++i) {
      sc[i] = scales.get(4 * l + i);
      mn[i] = mins.get(4 * l + i);
      bs[i] = biases.get(4 * l + i);
    }
    const Linear qkv{weights[4 * l], sc[0], mn[0], bs[0], int8_act};
    const Linear o_proj{weights[4 * l + 1], sc[1], mn[1], bs[1], int8_act};
    const Linear gate_up{weights[4 * l + 2], sc[2], mn[2], bs[2], int8_act};
    const Linear down{weights[4 * l + 3], sc[3], mn[3], bs[3], int8_act};

    // residual += x (layer 0: residual = x); h = rms_norm(residual) * ln1
    float* xp = x.data_ptr<float>();
    float* rp = residual.data_ptr<float>();
    float* hp = h.data_ptr<float>();
    for (int64_t i = 0; i < d.num_seqs * d.hidden; ++i) rp[i] = l == 0 ? xp[i] : rp[i] + xp[i];
    for (int64_t s = 0; s < d.num_seqs; ++s)
      rms_norm(rp + s * d.hidden, ln1, feps, d.hidden, hp + s * d.hidden);

    at::Tensor qkv_out = qkv(h, qkv_size);  // [num_seqs, q | k | v]
    float* qkvp = qkv_out.data_ptr<float>();
    const std::optional<at::Tensor> q_norm = qk_norms.get(2 * l);
    const std::optional<at::Tensor> k_norm = qk_norms.get(2 * l + 1);
    float* k_layer = kv + l * layer_stride;
    float* v_layer = kv + kv_stride + l * layer_stride;
    for (int64_t s = 0; s < d.num_seqs; ++s) {
      float* q = qkvp + s * qkv_size;
      float* k = q + q_size;
      const float* v = k + kv_size;
      if (q_norm.has_value()) {
        const float* qw = q_norm->data_ptr<float>();
        const float* kw = k_norm->data_ptr<float>();
        for (int64_t head = 0; head < num_heads; ++head)
          rms_norm(q + head * hd, qw, fqk_eps, hd, q + head * hd);
        for (int64_t head = 0; head < d.num_kv_heads; ++head)
          rms_norm(k + head * hd, kw, fqk_eps, hd, k + head * hd);
      }
      const float* cs = cos_sin_cache.data_ptr<float>() + pos[s] * cos_sin_cache.size(1);
      for (int64_t head = 0; head < num_heads; ++head) rotate(q + head * hd, cs, hd);
      for (int64_t head = 0; head < d.num_kv_heads; ++head) rotate(k + head * hd, cs, hd);
      std::copy(k, k + kv_size, k_layer + new_slots[s] * kv_size);
      std::copy(v, v + kv_size, v_layer + new_slots[s] * kv_size);
    }
    // q rows sit qkv_size apart: gather them into one [num_seqs, q_size] block.
    at::Tensor q_all = qkv_out.narrow(1, 0, q_size).contiguous();
    attend(q_all.data_ptr<float>(), k_layer, v_layer, slots.data(), max_len, lens, d, fscale,
           attn.data_ptr<float>());
    x = o_proj(attn, d.hidden);

    xp = x.data_ptr<float>();
    for (int64_t i = 0; i < d.num_seqs * d.hidden; ++i) rp[i] += xp[i];
    for (int64_t s = 0; s < d.num_seqs; ++s)
      rms_norm(rp + s * d.hidden, ln2, feps, d.hidden, hp + s * d.hidden);
    at::Tensor gu = gate_up(h, 2 * inter);  // [num_seqs, gate | up]
    at::Tensor act = at::empty({d.num_seqs, inter}, x.options());
    const float* gup = gu.data_ptr<float>();
    float* ap = act.data_ptr<float>();
    for (int64_t s = 0; s < d.num_seqs; ++s) silu_mul(gup + s * 2 * inter, inter, ap + s * inter);
    x = down(act, d.hidden);
  }
  return {x, residual};
}

// The same norm and activation over the rows of a prefill (the CPU kernel set's rms_norm and
// silu_and_mul, layers/ops.py) in one pass each, where torch's versions are 5-7 ops a call
// over [tokens, hidden]. Rows are split between threads.

// (normed x + residual, x + residual), or (normed x, x) without a residual.
std::tuple<at::Tensor, at::Tensor> rms_norm_rows(const at::Tensor& x_in, const at::Tensor& weight,
                                                 double eps,
                                                 const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat,
              "rms_norm_rows: x must be fp32 [rows, n]");
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == n,
              "rms_norm_rows: weight must be contiguous fp32 [", n, "]");
  at::Tensor out = at::empty_like(x);
  at::Tensor sum = x;
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == at::kFloat,
                "rms_norm_rows: residual must be fp32 like x");
    const at::Tensor r = residual->contiguous();
    sum = at::empty_like(x);
    const float *xp = x.data_ptr<float>(), *rp = r.data_ptr<float>();
    float* sp = sum.data_ptr<float>();
    at::parallel_for(0, rows * n, 16384, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) sp[i] = xp[i] + rp[i];
    });
  }
  const float* sp = sum.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) rms_norm(sp + r * n, w, (float)eps, n, op + r * n);
  });
  return {out, sum};
}

// [rows, 2 * inter] -> [rows, inter]: silu(gate) * up, fp32 or bf16 rows (a bf16 row is
// widened, computed in fp32 and rounded once, to nearest even).
at::Tensor silu_and_mul_rows(const at::Tensor& x_in) {
  const bool bf16 = x_in.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x_in.dim() == 2 && (bf16 || x_in.scalar_type() == at::kFloat) &&
                  x_in.size(1) % 2 == 0,
              "silu_and_mul_rows: x must be fp32 or bf16 [rows, 2 * inter]");
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, x.options());
  if (!bf16) {
    const float* xp = x.data_ptr<float>();
    float* op = out.data_ptr<float>();
    at::parallel_for(0, rows, 8, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) silu_mul(xp + r * 2 * inter, inter, op + r * inter);
    });
    return out;
  }
  // bf16's bits are fp32's top half.
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, rows, 8, [&](int64_t b, int64_t e) {
    std::vector<uint32_t> row(2 * inter);
    std::vector<float> y(inter);
    for (int64_t r = b; r < e; ++r) {
      const uint16_t* src = xp + r * 2 * inter;
      for (int64_t i = 0; i < 2 * inter; ++i) row[i] = (uint32_t)src[i] << 16;
      silu_mul(reinterpret_cast<const float*>(row.data()), inter, y.data());
      uint16_t* dst = op + r * inter;
      for (int64_t i = 0; i < inter; ++i) {
        uint32_t bits;
        std::memcpy(&bits, &y[i], sizeof bits);
        const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
        dst[i] = nan ? (uint16_t)((bits >> 16) | 0x40u)
                     : (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
      }
    }
  });
  return out;
}

// A prefill's q/k norm (Qwen3) + rotary + K/V store over its rows in one pass (the CPU
// kernel set's `qkv_rotary_store`, kernels/qkv_rotary_store.py's contract): q rows into a
// new [tokens, num_heads, head_dim] tensor, each token's K/V rows into its cache slot (-1:
// not stored). The same per-head steps as `decode_layers`; torch's version is ~12 ops a
// layer over [tokens, heads, head_dim]. Tokens are split between threads.
at::Tensor qkv_rotary_store_rows(const at::Tensor& positions_in, const at::Tensor& qkv_in,
                                 int64_t num_heads, const at::Tensor& cos_sin_cache,
                                 at::Tensor& k_cache, at::Tensor& v_cache,
                                 const at::Tensor& slot_mapping_in,
                                 const std::optional<at::Tensor>& q_norm,
                                 const std::optional<at::Tensor>& k_norm, double eps) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.scalar_type() == at::kFloat &&
                  k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == at::kFloat && v_cache.is_contiguous(),
              "qkv_rotary_store_rows: contiguous fp32 caches [blocks, block_size, kv_heads, "
              "head_dim]");
  const int64_t kv_heads = k_cache.size(2), hd = k_cache.size(3);
  const int64_t q_size = num_heads * hd, kv_size = kv_heads * hd;
  const int64_t qkv_size = q_size + 2 * kv_size;
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  TORCH_CHECK(qkv_in.dim() == 2 && qkv_in.scalar_type() == at::kFloat &&
                  qkv_in.size(1) == qkv_size,
              "qkv_rotary_store_rows: qkv must be fp32 [tokens, ", qkv_size, "]");
  TORCH_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.scalar_type() == at::kFloat &&
                  cos_sin_cache.is_contiguous() && cos_sin_cache.size(1) == hd,
              "qkv_rotary_store_rows: cos_sin_cache must be contiguous fp32 [positions, ", hd,
              "]");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(),
              "qkv_rotary_store_rows: q_norm and k_norm come together");
  const at::Tensor qkv = qkv_in.contiguous();
  const at::Tensor positions = positions_in.to(at::kLong).contiguous();
  const at::Tensor slot_mapping = slot_mapping_in.to(at::kLong).contiguous();
  const int64_t tokens = qkv.size(0);
  TORCH_CHECK(positions.numel() == tokens && slot_mapping.numel() == tokens,
              "qkv_rotary_store_rows: one position and slot per token");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos_sin_cache.size(0), "qkv_rotary_store_rows: ",
                "position ", pos[t], " is past the rotary cache");
    TORCH_CHECK(slots[t] < num_slots, "qkv_rotary_store_rows: slot ", slots[t],
                " is outside the pool");
  }
  at::Tensor q_weight, k_weight;  // the norms' weights, held while their pointers are used
  if (q_norm.has_value()) {
    q_weight = q_norm->to(at::kFloat).contiguous();
    k_weight = k_norm->to(at::kFloat).contiguous();
    TORCH_CHECK(q_weight.numel() == hd && k_weight.numel() == hd,
                "qkv_rotary_store_rows: q/k norm weights must have ", hd, " elements");
  }
  const float* qw = q_norm.has_value() ? q_weight.data_ptr<float>() : nullptr;
  const float* kw = k_norm.has_value() ? k_weight.data_ptr<float>() : nullptr;
  at::Tensor q_out = at::empty({tokens, num_heads, hd}, qkv.options());
  const float* src = qkv.data_ptr<float>();
  const float* cos_sin = cos_sin_cache.data_ptr<float>();
  float* qp = q_out.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const float feps = (float)eps;
  at::parallel_for(0, tokens, 16, [&](int64_t b, int64_t e) {
    std::vector<float> k(kv_size);
    for (int64_t t = b; t < e; ++t) {
      const float* row = src + t * qkv_size;
      const float* cs = cos_sin + pos[t] * hd;
      float* q = qp + t * q_size;
      std::copy(row, row + q_size, q);
      for (int64_t head = 0; head < num_heads; ++head) {
        if (qw) rms_norm(q + head * hd, qw, feps, hd, q + head * hd);
        rotate_unfused(q + head * hd, cs, hd);
      }
      if (slots[t] < 0) continue;
      std::copy(row + q_size, row + q_size + kv_size, k.data());
      for (int64_t head = 0; head < kv_heads; ++head) {
        if (kw) rms_norm(k.data() + head * hd, kw, feps, hd, k.data() + head * hd);
        rotate_unfused(k.data() + head * hd, cs, hd);
      }
      std::copy(k.begin(), k.end(), kc + slots[t] * kv_size);
      std::copy(row + q_size + kv_size, row + qkv_size, vc + slots[t] * kv_size);
    }
  });
  return q_out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minivllm_cpu, m) {
  m.def(
      "decode_layers(Tensor x, Tensor[] norms, Tensor?[] qk_norms, Tensor[] weights, "
      "Tensor?[] scales, Tensor?[] mins, Tensor?[] biases, Tensor(a!) kv_cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor positions, Tensor cos_sin_cache, int num_heads, float scale, "
      "float eps, float qk_eps, bool int8_activations=False) -> (Tensor, Tensor)");
  m.def("rms_norm_rows(Tensor x, Tensor weight, float eps, Tensor? residual) -> (Tensor, Tensor)");
  m.def("silu_and_mul_rows(Tensor x) -> Tensor");
  m.def("qkv_rotary_store_rows(Tensor positions, Tensor qkv, int num_heads, Tensor cos_sin_cache, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, Tensor? q_norm, "
        "Tensor? k_norm, float eps) -> Tensor");
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(minivllm_cpu, CPU, m) {
  m.impl("decode_layers", &decode_layers);
  m.impl("rms_norm_rows", &rms_norm_rows);
  m.impl("silu_and_mul_rows", &silu_and_mul_rows);
  m.impl("qkv_rotary_store_rows", &qkv_rotary_store_rows);
  m.impl("paged_decode_attention", &paged_decode_attention);
}
