// y = x @ W^T (+ bias) with W stored in bf16, int8 (per-output-channel fp32 scales), or
// llama.cpp's group formats Q8_0 / Q4_1 (further down), and
// x, y, the sums in fp32: weight-only low precision for the CPU's decode step, where the
// time is the weight bytes read per token (kernels/cpu_lowp_linear.py: the wrapper, the
// packing and the torch reference).
//
// Weight layout ("packed"): [num_blocks, K, L], L = the vector width in floats (8 with
// AVX2, 16 with AVX-512). Block b holds output channels b*L .. b*L+L-1 (zero rows pad the
// last block), and for each k the L channels' weights are adjacent. One vector load at k
// then gives L outputs' weights; it is widened to fp32 in registers and multiplied by x[r, k]
// broadcast, so a block is one forward stream of memory (no strided rows) and the sums need
// no horizontal reduction at the end.
//
// Written with GCC/Clang vector extensions, so the same source compiles to AVX2, AVX-512
// or NEON for the machine it is built on (-march=native; the build is per machine).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
constexpr int L = 16;
#else
constexpr int L = 8;
#endif

typedef float vf __attribute__((vector_size(L * 4)));
typedef uint32_t vu32 __attribute__((vector_size(L * 4)));
typedef uint16_t vu16 __attribute__((vector_size(L * 2)));
typedef int8_t vi8 __attribute__((vector_size(L)));

// Rows of x computed together: each weight vector, once widened, serves all of them.
constexpr int MAX_ROWS = 8;
// Rows of x kept hot (L2) while a thread's blocks of weights stream past them; a prefill
// of more rows reads each weight once per tile.
constexpr int ROW_TILE = 64;
constexpr int PREFETCH_BYTES = 1024;

// L weights -> L fp32 lanes. bf16's bits are fp32's top half; int8 is sign-extended and
// converted. Intrinsics where they exist (GCC's generic vector conversions split or
// scalarise these), plain vector code elsewhere.
#if defined(__AVX512F__)
inline vf widen(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
}
inline vf widen(const int8_t* p) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
}
#elif defined(__AVX2__)
inline vf widen(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
}
inline vf widen(const int8_t* p) {
  const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
}
#else
inline vf widen(const uint16_t* p) {
  vu16 h;
  std::memcpy(&h, p, sizeof h);
  return (vf)(__builtin_convertvector(h, vu32) << 16);
}
inline vf widen(const int8_t* p) {
  vi8 q;
  std::memcpy(&q, p, sizeof q);
  return __builtin_convertvector(q, vf);
}
#endif

// acc[r] = sum_k W_block[k, :] * x[r, k] for R rows of x (row stride ldx).
template <typename WT, int R>
inline void block_sums(const float* x, int64_t ldx, const WT* w, int64_t K, vf* acc) {
  // Independent sums over k (k mod S) keep enough FMAs in flight when R is small: one chain
  // of dependent FMAs would wait on its latency (~4 cycles) at every k.
  constexpr int S = R >= 4 ? 1 : (R >= 2 ? 2 : 4);
  vf a[S][R];
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < R; ++r) a[s][r] = vf{};
  int64_t k = 0;
  for (; k + S <= K; k += S) {
#if defined(__AVX2__) || defined(__AVX512F__)
    // The weights are one forward stream; asking for them 1 KB early was faster at one row
    // than the hardware prefetcher alone (AVX2).
    _mm_prefetch(reinterpret_cast<const char*>(w + k * L) + PREFETCH_BYTES, _MM_HINT_T0);
#endif
    for (int s = 0; s < S; ++s) {
      const vf wv = widen(w + (k + s) * L);
      for (int r = 0; r < R; ++r) a[s][r] += wv * x[r * ldx + k + s];
    }
  }
  for (; k < K; ++k) {
    const vf wv = widen(w + k * L);
    for (int r = 0; r < R; ++r) a[0][r] += wv * x[r * ldx + k];
  }
  for (int r = 0; r < R; ++r) {
    vf t = a[0][r];
    for (int s = 1; s < S; ++s) t += a[s][r];
    acc[r] = t;
  }
}

template <typename WT>
void block_rows(const float* x, int64_t ldx, const WT* w, int64_t K, int rows, vf* acc) {
  switch (rows) {
    case 1: return block_sums<WT, 1>(x, ldx, w, K, acc);
    case 2: return block_sums<WT, 2>(x, ldx, w, K, acc);
    case 3: return block_sums<WT, 3>(x, ldx, w, K, acc);
    case 4: return block_sums<WT, 4>(x, ldx, w, K, acc);
    case 5: return block_sums<WT, 5>(x, ldx, w, K, acc);
    case 6: return block_sums<WT, 6>(x, ldx, w, K, acc);
    case 7: return block_sums<WT, 7>(x, ldx, w, K, acc);
    default: return block_sums<WT, 8>(x, ldx, w, K, acc);
  }
}

// Block b's per-output scale (1 where `scales` is null) and bias (0), and its width: L but
// for a last block cut at N.
inline int block_scale_add(int64_t b, int64_t N, const float* scales, const float* bias,
                           vf& scale, vf& add) {
  const int64_t n0 = b * L;
  const int width = (int)std::min<int64_t>(L, N - n0);
  for (int j = 0; j < L; ++j) {
    scale[j] = scales && j < width ? scales[n0 + j] : 1.0f;
    add[j] = bias && j < width ? bias[n0 + j] : 0.0f;
  }
  return width;
}

inline void write_block(const vf& out, int width, float* dst) {
  if (width == L) {
    std::memcpy(dst, &out, sizeof out);
  } else {
    for (int j = 0; j < width; ++j) dst[j] = out[j];
  }
}

// y[:, block b's L outputs] = (sums * scale + bias) for every block of outputs: each
// thread takes a run of blocks (~4 blocks at least per task, so the small matrices are
// not cut finer than a thread's start-up is worth), rows in tiles of ROW_TILE (kept hot
// while the blocks stream past) and of MAX_ROWS. `sums(b, r0, rows, acc)` fills
// acc[0..rows) with block b's sums for rows r0..; `scales` (per output, may be null: 1).
template <typename Sums>
void for_each_block(int64_t M, int64_t N, const float* scales, const float* bias, float* y,
                    const Sums& sums) {
  const int64_t num_blocks = (N + L - 1) / L;
  at::parallel_for(0, num_blocks, 4, [&](int64_t b0, int64_t b1) {
    vf acc[MAX_ROWS];
    for (int64_t t = 0; t < M; t += ROW_TILE) {
      const int64_t t_end = std::min(M, t + ROW_TILE);
      for (int64_t b = b0; b < b1; ++b) {
        vf scale, add;
        const int width = block_scale_add(b, N, scales, bias, scale, add);
        for (int64_t r0 = t; r0 < t_end; r0 += MAX_ROWS) {
          const int rows = (int)std::min<int64_t>(MAX_ROWS, t_end - r0);
          sums(b, r0, rows, acc);
          for (int r = 0; r < rows; ++r)
            write_block(acc[r] * scale + add, width, y + (r0 + r) * N + b * L);
        }
      }
    }
  });
}

// for_each_block for one row (a decode token), NB blocks at a time: `several(b, acc)` fills
// acc[0..NB) with blocks b .. b + NB - 1's sums, `one(b, acc)` acc[0] with block b's (the
// blocks left at the end). NB weight streams in flight a thread: on a 2-core AMX Xeon, bf16
// weights of SmolLM2's 30 layers read at ~16-17 GB/s a block at a time, ~19 two at a time
// and ~21-22 four at a time (the same sums each way).
template <int NB, typename Several, typename One>
void for_each_block_set(int64_t N, const float* scales, const float* bias, float* y,
                        const Several& several, const One& one) {
  const int64_t num_blocks = (N + L - 1) / L;
  const int64_t sets = (num_blocks + NB - 1) / NB;
  at::parallel_for(0, sets, std::max(1, 4 / NB), [&](int64_t p0, int64_t p1) {
    vf acc[NB];
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = p * NB;
      const int count = (int)std::min<int64_t>(NB, num_blocks - b);
      if (count == NB) {
        several(b, acc);
      } else {
        for (int i = 0; i < count; ++i) one(b + i, acc + i);
      }
      for (int i = 0; i < count; ++i) {
        vf scale, add;
        const int width = block_scale_add(b + i, N, scales, bias, scale, add);
        write_block(acc[i] * scale + add, width, y + (b + i) * L);
      }
    }
  });
}

// block_sums<WT, 1> over NB blocks `stride` elements apart at once: each block's four sums
// formed exactly as there (the same bits), x[k] read once for all.
template <typename WT, int NB>
inline void set_sums(const float* x, const WT* w, int64_t stride, int64_t K, vf* acc) {
  vf a[NB][4];
  for (int i = 0; i < NB; ++i)
    for (int s = 0; s < 4; ++s) a[i][s] = vf{};
  int64_t k = 0;
  for (; k + 4 <= K; k += 4) {
#if defined(__AVX2__) || defined(__AVX512F__)
    for (int i = 0; i < NB; ++i)
      _mm_prefetch(reinterpret_cast<const char*>(w + i * stride + k * L) + PREFETCH_BYTES,
                   _MM_HINT_T0);
#endif
    for (int s = 0; s < 4; ++s) {
      const float xs = x[k + s];
      for (int i = 0; i < NB; ++i) a[i][s] += widen(w + i * stride + (k + s) * L) * xs;
    }
  }
  for (; k < K; ++k)
    for (int i = 0; i < NB; ++i) a[i][0] += widen(w + i * stride + k * L) * x[k];
  for (int i = 0; i < NB; ++i) {
    vf t = a[i][0];
    for (int s = 1; s < 4; ++s) t += a[i][s];
    acc[i] = t;
  }
}

template <typename WT>
void lowp_linear_impl(const float* x, int64_t ldx, int64_t M, int64_t K, const WT* packed,
                      const float* scales, const float* bias, float* y, int64_t N) {
  if (M == 1) {
    for_each_block_set<4>(
        N, scales, bias, y,
        [&](int64_t b, vf* acc) { set_sums<WT, 4>(x, packed + b * K * L, K * L, K, acc); },
        [&](int64_t b, vf* acc) { block_rows<WT>(x, ldx, packed + b * K * L, K, 1, acc); });
    return;
  }
  for_each_block(M, N, scales, bias, y, [&](int64_t b, int64_t r0, int rows, vf* acc) {
    block_rows<WT>(x + r0 * ldx, ldx, packed + b * K * L, K, rows, acc);
  });
}

at::Tensor lowp_linear(const at::Tensor& x, const at::Tensor& packed,
                       const std::optional<at::Tensor>& scales,
                       const std::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "lowp_linear: x must be fp32 [M, K] with unit stride in K");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == L && packed.is_contiguous(),
              "lowp_linear: packed must be contiguous [blocks, K, ", L, "]");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(packed.size(1) == K, "lowp_linear: x has K=", K, ", the weight ", packed.size(1));
  TORCH_CHECK(packed.size(0) * L >= n && packed.size(0) * L < n + L,
              "lowp_linear: n=", n, " does not match the packed blocks");
  const float* s = nullptr;
  if (scales.has_value()) {
    TORCH_CHECK(scales->scalar_type() == at::kFloat && scales->is_contiguous() &&
                    scales->numel() >= n, "lowp_linear: scales must be fp32 [>= n]");
    s = scales->data_ptr<float>();
  }
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "lowp_linear: bias must be fp32 [n]");
    bp = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, n}, x.options());
  if (M == 0 || n == 0) return y;
  const float* xp = x.data_ptr<float>();
  if (packed.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(!s, "lowp_linear: bf16 weights take no scales");
    lowp_linear_impl<uint16_t>(xp, x.stride(0), M, K,
                               reinterpret_cast<const uint16_t*>(packed.data_ptr()), s, bp,
                               y.data_ptr<float>(), n);
  } else if (packed.scalar_type() == at::kChar) {
    TORCH_CHECK(s, "lowp_linear: int8 weights need their scales");
    lowp_linear_impl<int8_t>(xp, x.stride(0), M, K, packed.data_ptr<int8_t>(), s, bp,
                             y.data_ptr<float>(), n);
  } else {
    TORCH_CHECK(false, "lowp_linear: packed weights must be bf16 or int8, not ",
                packed.scalar_type());
  }
  return y;
}

// Group formats, llama.cpp's Q8_0 and Q4_1: each output channel's weights in groups of G
// along K, one fp16 scale d per group (and for Q4_1 a minimum m):
//   q8_0: w = d * q, q int8;           values [blocks, K, L] int8 (the int8 layout)
//   q4_1: w = d * q + m, q in 0..15;   values [blocks, K, L/2] bytes, byte j of a k holding
//         output j in its low nibble and output j + L/2 in its high nibble
// d (and m): [blocks, K/G, L] fp16. A group's sum is d * sum(q x) (+ m * sum(x)): the
// scale is applied once per group, not per weight.
constexpr int G = 32;

#if defined(__AVX512F__)
inline vf widen_halves(const uint16_t* p) {
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline vf widen_nibbles(const uint8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(lo, hi)));
}
#elif defined(__AVX2__) && defined(__F16C__)
inline vf widen_halves(const uint16_t* p) {
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline vf widen_nibbles(const uint8_t* p) {
  int32_t word;
  std::memcpy(&word, p, sizeof word);
  const __m128i b = _mm_cvtsi32_si128(word);
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpacklo_epi32(lo, hi)));
}
#else
inline vf widen_halves(const uint16_t* p) {
  vf out;
  for (int j = 0; j < L; ++j) out[j] = (float)c10::Half(p[j], c10::Half::from_bits());
  return out;
}
inline vf widen_nibbles(const uint8_t* p) {
  vf out;
  for (int j = 0; j < L / 2; ++j) {
    out[j] = (float)(p[j] & 0x0F);
    out[j + L / 2] = (float)(p[j] >> 4);
  }
  return out;
}
#endif

struct Q8_0 {
  static constexpr int bytes_per_k = L;
  static constexpr bool has_min = false;
  static vf widen(const uint8_t* p) { return ::widen(reinterpret_cast<const int8_t*>(p)); }
};
struct Q4_1 {
  static constexpr int bytes_per_k = L / 2;
  static constexpr bool has_min = true;
  static vf widen(const uint8_t* p) { return widen_nibbles(p); }
};

// acc[r] = sum over groups of d * sum_k q[k, :] x[r, k] (+ m * xsum[r, group]).
template <typename F, int R>
inline void group_block_sums(const float* x, int64_t ldx, const float* xsum, int64_t groups,
                             const uint8_t* q, const uint16_t* d, const uint16_t* m, vf* acc) {
  constexpr int S = R >= 4 ? 1 : (R >= 2 ? 2 : 4);
  for (int r = 0; r < R; ++r) acc[r] = vf{};
  for (int64_t g = 0; g < groups; ++g) {
    vf a[S][R];
    for (int s = 0; s < S; ++s)
      for (int r = 0; r < R; ++r) a[s][r] = vf{};
    const uint8_t* qg = q + g * G * F::bytes_per_k;
    const float* xg = x + g * G;
#if defined(__AVX2__) || defined(__AVX512F__)
    _mm_prefetch(reinterpret_cast<const char*>(qg) + PREFETCH_BYTES, _MM_HINT_T0);
#endif
    for (int k = 0; k < G; k += S) {
      for (int s = 0; s < S; ++s) {
        const vf wv = F::widen(qg + (k + s) * F::bytes_per_k);
        for (int r = 0; r < R; ++r) a[s][r] += wv * xg[r * ldx + k + s];
      }
    }
    const vf dv = widen_halves(d + g * L);
    vf mv{};
    if constexpr (F::has_min) mv = widen_halves(m + g * L);
    for (int r = 0; r < R; ++r) {
      vf t = a[0][r];
      for (int s = 1; s < S; ++s) t += a[s][r];
      acc[r] += dv * t;
      if constexpr (F::has_min) acc[r] += mv * xsum[r * groups + g];
    }
  }
}

template <typename F>
void group_rows(const float* x, int64_t ldx, const float* xsum, int64_t groups,
                const uint8_t* q, const uint16_t* d, const uint16_t* m, int rows, vf* acc) {
  switch (rows) {
    case 1: return group_block_sums<F, 1>(x, ldx, xsum, groups, q, d, m, acc);
    case 2: return group_block_sums<F, 2>(x, ldx, xsum, groups, q, d, m, acc);
    case 3: return group_block_sums<F, 3>(x, ldx, xsum, groups, q, d, m, acc);
    case 4: return group_block_sums<F, 4>(x, ldx, xsum, groups, q, d, m, acc);
    case 5: return group_block_sums<F, 5>(x, ldx, xsum, groups, q, d, m, acc);
    case 6: return group_block_sums<F, 6>(x, ldx, xsum, groups, q, d, m, acc);
    case 7: return group_block_sums<F, 7>(x, ldx, xsum, groups, q, d, m, acc);
    default: return group_block_sums<F, 8>(x, ldx, xsum, groups, q, d, m, acc);
  }
}

template <typename F>
void group_linear_impl(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* q,
                       const uint16_t* d, const uint16_t* m, const float* bias, float* y,
                       int64_t N) {
  const int64_t groups = K / G;
  // Q4_1's minimum multiplies each group's sum of x: computed once per row and group.
  std::vector<float> xsum;
  if (F::has_min) {
    xsum.resize(M * groups);
    for (int64_t r = 0; r < M; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        float t = 0.0f;
        for (int k = 0; k < G; ++k) t += x[r * ldx + g * G + k];
        xsum[r * groups + g] = t;
      }
  }
  for_each_block(M, N, nullptr, bias, y, [&](int64_t b, int64_t r0, int rows, vf* acc) {
    const float* xs = F::has_min ? xsum.data() + r0 * groups : nullptr;
    group_rows<F>(x + r0 * ldx, ldx, xs, groups, q + b * K * F::bytes_per_k, d + b * groups * L,
                  m ? m + b * groups * L : nullptr, rows, acc);
  });
}

// Int8 activations for the group formats (`group_linear_i8`), llama.cpp's arithmetic: each
// row of x is quantized per group of G, s = max|x| / 127 and xq = round(x / s), and a
// group's sum is d * s * sum(q * xq) (+ m * sum(x) for Q4_1, with the exact fp32 sum), the
// inner sums in int32 by AVX512-VNNI's 4-way byte dot products (vpdpbusd: 64 products an
// instruction where fp32 takes 16 a multiply-add). At 8 rows the fp32 kernel above is
// bound by multiply-adds, not by the bytes it reads; at 1 row either kernel streams.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && \
    defined(__AVX512VBMI__)
#define MINIVLLM_INT8_ACTIVATIONS 1

struct QuantizedRows {
  std::vector<int8_t> q;     // [M, K]
  std::vector<float> scale;  // [M, K / G]
  std::vector<float> sum;    // [M, K / G]: fp32 sums of x (Q4_1's minimum term)
};

void quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t K, QuantizedRows& out) {
  const int64_t groups = K / G;
  out.q.resize(M * K);
  out.scale.resize(M * groups);
  out.sum.resize(M * groups);
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = x + r * ldx + g * G;
      const __m512 a0 = _mm512_loadu_ps(xg), a1 = _mm512_loadu_ps(xg + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a0), _mm512_abs_ps(a1)));
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      // Rounded to nearest, ties to even (the default rounding mode), as torch.round.
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(a0, _mm512_set1_ps(inv)));
      const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(a1, _mm512_set1_ps(inv)));
      int8_t* dst = out.q.data() + r * K + g * G;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(q1));
      out.scale[r * groups + g] = amax / 127.0f;
      out.sum[r * groups + g] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    }
  }
}

// Byte permutations that turn 4 consecutive k's of a block (as packed) into one 32-bit lane
// per output holding its 4 weights in k order, the operand layout of vpdpbusd.
inline __m512i quad_index(bool q4) {
  alignas(64) uint8_t idx[64];
  for (int o = 0; o < 16; ++o)
    for (int t = 0; t < 4; ++t)
      idx[4 * o + t] = q4 ? (o < 8 ? t * 8 + o : 32 + t * 8 + (o - 8)) : t * 16 + o;
  return _mm512_load_si512(idx);
}

// Group g of a block's weights in vpdpbusd's operand layout (w[0 .. G/4)), the next group's
// bytes asked for; returns, for Q8_0, each output's sum of the group's weights (its weights
// are signed: x + 128 is the unsigned operand, and 128 * sum(w) comes off), else zeros.
template <bool Q4>
inline __m512i i8_group_weights(const uint8_t* q, int64_t g, const __m512i index, __m512i* w) {
  for (int t = 0; t < G / 4; ++t) {
    __m512i z;
    if constexpr (Q4) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (g * G + 4 * t) * (L / 2)));
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1);
      z = _mm512_and_si512(both, _mm512_set1_epi8(0x0F));
    } else {
      z = _mm512_loadu_si512(q + (g * G + 4 * t) * L);
    }
    w[t] = _mm512_permutexvar_epi8(index, z);
  }
  _mm_prefetch(reinterpret_cast<const char*>(q + (g + 1) * G * (Q4 ? L / 2 : L)) + PREFETCH_BYTES,
               _MM_HINT_T0);
  __m512i wsum = _mm512_setzero_si512();
  if constexpr (!Q4)
    for (int t = 0; t < G / 4; ++t) wsum = _mm512_dpbusd_epi32(wsum, _mm512_set1_epi8(1), w[t]);
  return wsum;
}

// One row's group (its G int8 values at x) against the group's weights in vpdpbusd's
// layout (i8_group_weights, whose Q8_0 weight sums are wsum): each output's int32 dot
// product, Q8_0's 128 * sum(w) taken off.
template <bool Q4>
inline __m512i i8_group_dot(const int8_t* x, const __m512i* w, const __m512i wsum) {
  __m512i s = _mm512_setzero_si512();
  for (int t = 0; t < G / 4; ++t) {
    int32_t quad;
    std::memcpy(&quad, x + 4 * t, sizeof quad);
    if constexpr (Q4)
      s = _mm512_dpbusd_epi32(s, w[t], _mm512_set1_epi32(quad));
    else
      s = _mm512_dpbusd_epi32(s, _mm512_set1_epi32(quad ^ (int32_t)0x80808080), w[t]);
  }
  if constexpr (!Q4) s = _mm512_sub_epi32(s, _mm512_slli_epi32(wsum, 7));
  return s;
}

template <bool Q4, int R>
inline void i8_block_sums(const QuantizedRows& xq, int64_t r0, int64_t K, int64_t groups,
                          const uint8_t* q, const uint16_t* d, const uint16_t* m,
                          const __m512i index, vf* acc) {
  for (int r = 0; r < R; ++r) acc[r] = vf{};
  for (int64_t g = 0; g < groups; ++g) {
    __m512i w[G / 4];
    const __m512i wsum = i8_group_weights<Q4>(q, g, index, w);
    const vf dv = widen_halves(d + g * L);
    vf mv{};
    if constexpr (Q4) mv = widen_halves(m + g * L);
    for (int r = 0; r < R; ++r) {
      const __m512i s = i8_group_dot<Q4>(xq.q.data() + (r0 + r) * K + g * G, w, wsum);
      const int64_t rg = (r0 + r) * groups + g;
      acc[r] += dv * ((vf)_mm512_cvtepi32_ps(s) * xq.scale[rg]);
      if constexpr (Q4) acc[r] += mv * xq.sum[rg];
    }
  }
}

// i8_block_sums<Q4, 1> over two blocks at once, block i's weights at q[i], d[i], m[i]: each
// block's sums formed exactly as there (the same bits).
template <bool Q4>
inline void i8_pair_sums(const QuantizedRows& xq, int64_t K, int64_t groups,
                         const uint8_t* const* q, const uint16_t* const* d,
                         const uint16_t* const* m, const __m512i index, vf* acc) {
  acc[0] = acc[1] = vf{};
  for (int64_t g = 0; g < groups; ++g) {
    for (int i = 0; i < 2; ++i) {
      __m512i w[G / 4];
      const __m512i wsum = i8_group_weights<Q4>(q[i], g, index, w);
      const vf dv = widen_halves(d[i] + g * L);
      vf mv{};
      if constexpr (Q4) mv = widen_halves(m[i] + g * L);
      const __m512i s = i8_group_dot<Q4>(xq.q.data() + g * G, w, wsum);
      acc[i] += dv * ((vf)_mm512_cvtepi32_ps(s) * xq.scale[g]);
      if constexpr (Q4) acc[i] += mv * xq.sum[g];
    }
  }
}

template <bool Q4>
void i8_rows(const QuantizedRows& xq, int64_t r0, int64_t K, int64_t groups, const uint8_t* q,
             const uint16_t* d, const uint16_t* m, const __m512i index, int rows, vf* acc) {
  switch (rows) {
    case 1: return i8_block_sums<Q4, 1>(xq, r0, K, groups, q, d, m, index, acc);
    case 2: return i8_block_sums<Q4, 2>(xq, r0, K, groups, q, d, m, index, acc);
    case 3: return i8_block_sums<Q4, 3>(xq, r0, K, groups, q, d, m, index, acc);
    case 4: return i8_block_sums<Q4, 4>(xq, r0, K, groups, q, d, m, index, acc);
    case 5: return i8_block_sums<Q4, 5>(xq, r0, K, groups, q, d, m, index, acc);
    case 6: return i8_block_sums<Q4, 6>(xq, r0, K, groups, q, d, m, index, acc);
    case 7: return i8_block_sums<Q4, 7>(xq, r0, K, groups, q, d, m, index, acc);
    default: return i8_block_sums<Q4, 8>(xq, r0, K, groups, q, d, m, index, acc);
  }
}

template <bool Q4>
void group_linear_i8_impl(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* q,
                          const uint16_t* d, const uint16_t* m, const float* bias, float* y,
                          int64_t N) {
  const int64_t groups = K / G, bytes_per_k = Q4 ? L / 2 : L;
  QuantizedRows xq;
  quantize_rows(x, ldx, M, K, xq);
  const __m512i index = quad_index(Q4);
  if (M == 1) {
    for_each_block_set<2>(
        N, nullptr, bias, y,
        [&](int64_t b, vf* acc) {
          const uint8_t* qs[2] = {q + b * K * bytes_per_k, q + (b + 1) * K * bytes_per_k};
          const uint16_t* ds[2] = {d + b * groups * L, d + (b + 1) * groups * L};
          const uint16_t* ms[2] = {m ? m + b * groups * L : nullptr,
                                   m ? m + (b + 1) * groups * L : nullptr};
          i8_pair_sums<Q4>(xq, K, groups, qs, ds, ms, index, acc);
        },
        [&](int64_t b, vf* acc) {
          i8_rows<Q4>(xq, 0, K, groups, q + b * K * bytes_per_k, d + b * groups * L,
                      m ? m + b * groups * L : nullptr, index, 1, acc);
        });
    return;
  }
  for_each_block(M, N, nullptr, bias, y, [&](int64_t b, int64_t r0, int rows, vf* acc) {
    i8_rows<Q4>(xq, r0, K, groups, q + b * K * bytes_per_k, d + b * groups * L,
                m ? m + b * groups * L : nullptr, index, rows, acc);
  });
}
#endif

bool int8_activations() {
#if defined(MINIVLLM_INT8_ACTIVATIONS)
  return true;
#else
  return false;
#endif
}

// y = x @ W^T (+ bias) for a Q8_0 (int8 values, no mins) or Q4_1 (byte values, mins) weight.
at::Tensor group_linear(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                        const std::optional<at::Tensor>& mins,
                        const std::optional<at::Tensor>& bias, int64_t n,
                        bool int8_act = false) {
  TORCH_CHECK(!int8_act || int8_activations(),
              "group_linear: int8 activations need AVX512-VNNI and AVX512-VBMI");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "group_linear: x must be fp32 [M, K] with unit stride in K");
  const int64_t M = x.size(0), K = x.size(1);
  const bool q4 = values.scalar_type() == at::kByte;
  TORCH_CHECK(q4 || values.scalar_type() == at::kChar,
              "group_linear: values must be int8 (q8_0) or uint8 (q4_1), not ",
              values.scalar_type());
  TORCH_CHECK(values.dim() == 3 && values.is_contiguous() && values.size(1) == K &&
                  values.size(2) == (q4 ? L / 2 : L),
              "group_linear: values must be contiguous [blocks, K=", K, ", ", q4 ? L / 2 : L, "]");
  TORCH_CHECK(K % G == 0, "group_linear: K=", K, " is not a multiple of the group size ", G);
  const int64_t blocks = values.size(0);
  TORCH_CHECK(blocks * L >= n && blocks * L < n + L,
              "group_linear: n=", n, " does not match the packed blocks");
  for (const at::Tensor* t : {&scales, mins.has_value() ? &*mins : nullptr}) {
    if (t == nullptr) continue;
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 3 &&
                    t->size(0) == blocks && t->size(1) == K / G && t->size(2) == L,
                "group_linear: scales and mins must be contiguous fp16 [", blocks, ", ", K / G,
                ", ", L, "]");
  }
  TORCH_CHECK(q4 == mins.has_value(), "group_linear: q4_1 needs its mins, q8_0 takes none");
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "group_linear: bias must be fp32 [n]");
    bp = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, n}, x.options());
  if (M == 0 || n == 0) return y;
  const auto* q = reinterpret_cast<const uint8_t*>(values.data_ptr());
  const auto* d = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  const uint16_t* m = q4 ? reinterpret_cast<const uint16_t*>(mins->data_ptr()) : nullptr;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#if defined(MINIVLLM_INT8_ACTIVATIONS)
  if (int8_act) {
    if (q4)
      group_linear_i8_impl<true>(xp, x.stride(0), M, K, q, d, m, bp, yp, n);
    else
      group_linear_i8_impl<false>(xp, x.stride(0), M, K, q, d, m, bp, yp, n);
    return y;
  }
#endif
  if (q4)
    group_linear_impl<Q4_1>(xp, x.stride(0), M, K, q, d, m, bp, yp, n);
  else
    group_linear_impl<Q8_0>(xp, x.stride(0), M, K, q, d, m, bp, yp, n);
  return y;
}

int64_t block_width() { return L; }

}  // namespace

TORCH_LIBRARY(minivllm_cpu, m) {
  m.set_python_module("minivllm.kernels.cpu_lowp_linear");
  m.def("lowp_linear(Tensor x, Tensor packed, Tensor? scales, Tensor? bias, int n) -> Tensor");
  m.def("group_linear(Tensor x, Tensor values, Tensor scales, Tensor? mins, Tensor? bias, "
        "int n, bool int8_activations=False) -> Tensor");
  m.def("block_width() -> int", &block_width);
  m.def("int8_activations() -> bool", &int8_activations);
}

TORCH_LIBRARY_IMPL(minivllm_cpu, CPU, m) {
  m.impl("lowp_linear", &lowp_linear);
  m.impl("group_linear", &group_linear);
}
