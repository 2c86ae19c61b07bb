// y = x @ W^T (+ bias) with W stored in bf16 or int8 (per-output-channel fp32 scales) and
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

#include <algorithm>
#include <cstdint>
#include <cstring>
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
    // The weights are one forward stream; asking for them 1 KB early measured 10-25% faster
    // at one row than the hardware prefetcher alone (AVX2 EPYC, PERF_NOTES.md).
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

template <typename WT>
void lowp_linear_impl(const float* x, int64_t ldx, int64_t M, int64_t K, const WT* packed,
                      const float* scales, const float* bias, float* y, int64_t N) {
  const int64_t num_blocks = (N + L - 1) / L;
  // Each thread takes a run of blocks (output channels); ~4 blocks at least per task, so
  // the small matrices are not cut finer than a thread's start-up is worth.
  at::parallel_for(0, num_blocks, 4, [&](int64_t b0, int64_t b1) {
    vf acc[MAX_ROWS];
    for (int64_t t = 0; t < M; t += ROW_TILE) {
      const int64_t t_end = std::min(M, t + ROW_TILE);
      for (int64_t b = b0; b < b1; ++b) {
        const WT* wb = packed + b * K * L;
        const int64_t n0 = b * L;
        const int width = (int)std::min<int64_t>(L, N - n0);
        vf scale, add;
        for (int j = 0; j < L; ++j) {
          scale[j] = scales && j < width ? scales[n0 + j] : 1.0f;
          add[j] = bias && j < width ? bias[n0 + j] : 0.0f;
        }
        for (int64_t r0 = t; r0 < t_end; r0 += MAX_ROWS) {
          const int rows = (int)std::min<int64_t>(MAX_ROWS, t_end - r0);
          block_rows<WT>(x + r0 * ldx, ldx, wb, K, rows, acc);
          for (int r = 0; r < rows; ++r) {
            const vf out = acc[r] * scale + add;
            float* dst = y + (r0 + r) * N + n0;
            if (width == L) {
              std::memcpy(dst, &out, sizeof out);
            } else {
              for (int j = 0; j < width; ++j) dst[j] = out[j];
            }
          }
        }
      }
    }
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

int64_t block_width() { return L; }

}  // namespace

TORCH_LIBRARY(minivllm_cpu, m) {
  m.set_python_module("minivllm.kernels.cpu_lowp_linear");
  m.def("lowp_linear(Tensor x, Tensor packed, Tensor? scales, Tensor? bias, int n) -> Tensor");
  m.def("block_width() -> int", &block_width);
}

TORCH_LIBRARY_IMPL(minivllm_cpu, CPU, m) { m.impl("lowp_linear", &lowp_linear); }
