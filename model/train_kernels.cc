// Fused element-wise kernels of the LLaMA train step, as MindSpore "aot" custom ops on CPU.
//
// Built and loaded by model/kernels.py (g++ -O3 -march=native -shared). Each op does in one pass over
// memory what MindSpore's CPU kernels do in several (see docs/MINDSPORE_CPU.md): the causal mask, the
// softmax and its backward; SwiGLU and its backward. fp32, contiguous.
//
// Threads: rows are split over std::threads started per call (~20 us, against ops of milliseconds) and
// joined before it returns: nothing spins afterwards. (OpenMP's idle workers spin-wait after each parallel
// region and took a core from MindSpore's next MatMul: the step got 1.3x slower. libgomp's wait policy is
// read once, when MindSpore loads it at import, so it cannot be set from here.) The count: the CPUs this
// process may use, capped by OMP_NUM_THREADS (msrun gives each rank its share) and MSLLM_KERNEL_THREADS.
// Every element is computed by exactly one thread in a fixed order: results do not depend on the count.
//
//   CausalSoftmax(scores [N, T, S]) -> probs [N, T, S]
//       row t of each [T, S] block attends keys j <= t + (S - T); later keys get probability exactly 0
//       (what adding -1e9 before a softmax gives in fp32).
//   SoftmaxGrad(probs [N, T, S], dprobs [N, T, S]) -> dscores = probs * (dprobs - sum_j dprobs * probs)
//       (causal: the zero probabilities give zero gradients; they are written, not computed).
//   SwiGLU(gate [n], up [n]) -> silu(gate) * up
//   SwiGLUGrad(gate [n], up [n], dout [n]) -> (dgate, dup)
//   ZeroAdamW(...): the AdamW update in place (described with it, at the end of this file)
//   RMSNorm(x [N, H], weight [H], eps [1]) -> x / sqrt(mean(x^2) + eps) * weight
//   RMSNormGrad(x [N, H], weight [H], eps [1], dy [N, H]) -> (dx [N, H], dweight [H])
//       dweight sums fixed blocks of rows, then the blocks in order: the same bits at any thread count.
//   CrossEntropy(logits [N, V], labels [N] int32) -> (nll [N], lse [N])
//       nll = logsumexp(row) - row[label]; a label < 0 (ignore_index) gives nll 0.
//   CrossEntropyGrad(logits [N, V], labels [N], lse [N], dnll [N]) -> dlogits = (softmax - onehot) * dnll
//       (one pass: MindSpore's LogSoftmax + gather backward write two [N, V] buffers and read three).
//
// Every function follows MindSpore's aot signature: int f(int nparam, void **params, int *ndims,
// int64_t **shapes, const char **dtypes, void *stream, void *extra); inputs first, then outputs.

#include <sched.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

int env_int(const char *name) {
  const char *v = std::getenv(name);
  return v ? std::atoi(v) : 0;
}

int num_threads() {
  cpu_set_t set;
  int n = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
  for (const char *name : {"OMP_NUM_THREADS", "MSLLM_KERNEL_THREADS"}) {
    const int cap = env_int(name);
    if (cap > 0 && cap < n) n = cap;
  }
  return n < 1 ? 1 : n;
}

// fn(begin, end) over [0, n) in contiguous pieces, one per thread; the calling thread takes the first.
template <typename F>
void parallel_for(int64_t n, int64_t min_per_thread, F fn) {
  int64_t t = num_threads();
  if (t > n / (min_per_thread > 0 ? min_per_thread : 1)) t = n / (min_per_thread > 0 ? min_per_thread : 1);
  if (t <= 1) {
    fn(int64_t(0), n);
    return;
  }
  std::vector<std::thread> workers;
  const int64_t chunk = n / t, rem = n % t;
  int64_t b = chunk + (rem > 0 ? 1 : 0);
  for (int64_t i = 1; i < t; ++i) {
    const int64_t e = b + chunk + (i < rem ? 1 : 0);
    workers.emplace_back(fn, b, e);
    b = e;
  }
  fn(int64_t(0), chunk + (rem > 0 ? 1 : 0));
  for (auto &w : workers) w.join();
}

int64_t numel(int nd, const int64_t *shape) {
  int64_t n = 1;
  for (int i = 0; i < nd; ++i) n *= shape[i];
  return n;
}

#if defined(__AVX512F__)
// e^x for x <= 88.7 (below -87.3 it returns ~0): Cody-Waite range reduction to |r| <= ln2/2, degree-6
// Taylor polynomial (relative error ~1e-7, about 1 ulp), times 2^n by scalef.
inline __m512 exp512(__m512 x) {
  const __m512 hi = _mm512_set1_ps(88.7f), lo = _mm512_set1_ps(-87.3f);
  x = _mm512_max_ps(_mm512_min_ps(x, hi), lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
#endif

inline float exp1(float x) { return std::exp(x); }

// max of row[0..k) (the softmax and cross-entropy rows)
inline float row_max(const float *row, int64_t k) {
  float m = -INFINITY;
  int64_t j = 0;
#if defined(__AVX512F__)
  __m512 vm = _mm512_set1_ps(-INFINITY);
  for (; j + 16 <= k; j += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(row + j));
  m = _mm512_reduce_max_ps(vm);
#endif
  for (; j < k; ++j) m = row[j] > m ? row[j] : m;
  return m;
}

// softmax of row[0..k) in place into out[0..k), zeros in out[k..s)
void softmax_row(const float *row, float *out, int64_t k, int64_t s) {
  const float m = row_max(row, k);
  float sum = 0.f;
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 vmax = _mm512_set1_ps(m);
  __m512 vs = _mm512_setzero_ps();
  for (; j + 16 <= k; j += 16) {
    __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(row + j), vmax));
    _mm512_storeu_ps(out + j, e);
    vs = _mm512_add_ps(vs, e);
  }
  sum = _mm512_reduce_add_ps(vs);
#endif
  for (; j < k; ++j) {
    out[j] = exp1(row[j] - m);
    sum += out[j];
  }
  const float inv = 1.0f / sum;
  j = 0;
#if defined(__AVX512F__)
  const __m512 vinv = _mm512_set1_ps(inv);
  for (; j + 16 <= k; j += 16) _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_loadu_ps(out + j), vinv));
#endif
  for (; j < k; ++j) out[j] *= inv;
  if (k < s) std::memset(out + k, 0, sizeof(float) * (s - k));
}

void softmax_grad_row(const float *p, const float *dp, float *out, int64_t k, int64_t s) {
  float dot = 0.f;
  int64_t j = 0;
#if defined(__AVX512F__)
  __m512 vd = _mm512_setzero_ps();
  for (; j + 16 <= k; j += 16) vd = _mm512_fmadd_ps(_mm512_loadu_ps(p + j), _mm512_loadu_ps(dp + j), vd);
  dot = _mm512_reduce_add_ps(vd);
#endif
  for (; j < k; ++j) dot += p[j] * dp[j];
  j = 0;
#if defined(__AVX512F__)
  const __m512 vdot = _mm512_set1_ps(dot);
  for (; j + 16 <= k; j += 16)
    _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_loadu_ps(p + j), _mm512_sub_ps(_mm512_loadu_ps(dp + j), vdot)));
#endif
  for (; j < k; ++j) out[j] = p[j] * (dp[j] - dot);
  if (k < s) std::memset(out + k, 0, sizeof(float) * (s - k));
}

constexpr int64_t kRowBlock = 32;  // rows per partial sum of RMSNormGrad's dweight

// 1 / sqrt(mean(x^2) + eps) of one row
inline float inv_rms(const float *x, int64_t h, float eps) {
  float ss = 0.f;
  int64_t j = 0;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; j + 16 <= h; j += 16) {
    const __m512 v = _mm512_loadu_ps(x + j);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  ss = _mm512_reduce_add_ps(acc);
#endif
  for (; j < h; ++j) ss += x[j] * x[j];
  return 1.0f / std::sqrt(ss / static_cast<float>(h) + eps);
}

float scalar(void *p) { return *static_cast<const float *>(p); }

}  // namespace

extern "C" int RMSNorm(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                       void *extra) {
  if (nparam != 4) return 1;
  const float *x = static_cast<const float *>(params[0]);
  const float *w = static_cast<const float *>(params[1]);
  const float eps = static_cast<const float *>(params[2])[0];
  float *y = static_cast<float *>(params[3]);
  const int64_t h = shapes[0][ndims[0] - 1], n = numel(ndims[0], shapes[0]) / h;
  parallel_for(n, 64, [&](int64_t rb, int64_t re) {
    for (int64_t r = rb; r < re; ++r) {
      const float *xr = x + r * h;
      float *yr = y + r * h;
      const float inv = inv_rms(xr, h, eps);
      int64_t j = 0;
#if defined(__AVX512F__)
      const __m512 vinv = _mm512_set1_ps(inv);
      for (; j + 16 <= h; j += 16)
        _mm512_storeu_ps(yr + j, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(xr + j), vinv), _mm512_loadu_ps(w + j)));
#endif
      for (; j < h; ++j) yr[j] = xr[j] * inv * w[j];
    }
  });
  return 0;
}

extern "C" int RMSNormGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                           void *stream, void *extra) {
  if (nparam != 6) return 1;
  const float *x = static_cast<const float *>(params[0]);
  const float *w = static_cast<const float *>(params[1]);
  const float eps = static_cast<const float *>(params[2])[0];
  const float *dy = static_cast<const float *>(params[3]);
  float *dx = static_cast<float *>(params[4]);
  float *dw = static_cast<float *>(params[5]);
  const int64_t h = shapes[0][ndims[0] - 1], n = numel(ndims[0], shapes[0]) / h;
  const int64_t blocks = (n + kRowBlock - 1) / kRowBlock;
  std::vector<float> partial(static_cast<size_t>(blocks * h), 0.f);
  parallel_for(blocks, 2, [&](int64_t bb, int64_t be) {
    for (int64_t b = bb; b < be; ++b) {
      float *pw = partial.data() + b * h;
      const int64_t r_end = (b + 1) * kRowBlock < n ? (b + 1) * kRowBlock : n;
      for (int64_t r = b * kRowBlock; r < r_end; ++r) {
        const float *xr = x + r * h, *gr = dy + r * h;
        float *dxr = dx + r * h;
        const float inv = inv_rms(xr, h, eps);
        // dx = inv * (g - xhat * mean(g * xhat)), g = dy * w, xhat = x * inv;  dw += dy * xhat
        float dot = 0.f;
        int64_t k = 0;
#if defined(__AVX512F__)
        __m512 vdot = _mm512_setzero_ps();
        for (; k + 16 <= h; k += 16)
          vdot = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_loadu_ps(gr + k), _mm512_loadu_ps(w + k)), _mm512_loadu_ps(xr + k), vdot);
        dot = _mm512_reduce_add_ps(vdot);
#endif
        for (; k < h; ++k) dot += gr[k] * w[k] * xr[k];
        const float c = dot * inv * inv / static_cast<float>(h);
        int64_t j = 0;
#if defined(__AVX512F__)
        const __m512 vinv = _mm512_set1_ps(inv), vc = _mm512_set1_ps(c);
        for (; j + 16 <= h; j += 16) {
          const __m512 vx = _mm512_loadu_ps(xr + j), vg = _mm512_loadu_ps(gr + j);
          const __m512 vgw = _mm512_mul_ps(vg, _mm512_loadu_ps(w + j));
          _mm512_storeu_ps(dxr + j, _mm512_mul_ps(vinv, _mm512_fnmadd_ps(vx, vc, vgw)));
          _mm512_storeu_ps(pw + j, _mm512_fmadd_ps(vg, _mm512_mul_ps(vx, vinv), _mm512_loadu_ps(pw + j)));
        }
#endif
        for (; j < h; ++j) {
          dxr[j] = inv * (gr[j] * w[j] - xr[j] * c);
          pw[j] += gr[j] * xr[j] * inv;
        }
      }
    }
  });
  for (int64_t j = 0; j < h; ++j) dw[j] = 0.f;
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t j = 0; j < h; ++j) dw[j] += partial[b * h + j];
  return 0;
}

extern "C" int CrossEntropy(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                            void *stream, void *extra) {
  if (nparam != 4 || ndims[0] != 2) return 1;
  const float *x = static_cast<const float *>(params[0]);
  const int32_t *label = static_cast<const int32_t *>(params[1]);
  float *nll = static_cast<float *>(params[2]);
  float *lse = static_cast<float *>(params[3]);
  const int64_t n = shapes[0][0], v = shapes[0][1];
  parallel_for(n, 8, [&](int64_t rb, int64_t re) {
    for (int64_t r = rb; r < re; ++r) {
      const float *row = x + r * v;
      const float m = row_max(row, v);
      float sum = 0.f;
      int64_t j = 0;
#if defined(__AVX512F__)
      const __m512 vmax = _mm512_set1_ps(m);
      __m512 vs = _mm512_setzero_ps();
      for (; j + 16 <= v; j += 16) vs = _mm512_add_ps(vs, exp512(_mm512_sub_ps(_mm512_loadu_ps(row + j), vmax)));
      sum = _mm512_reduce_add_ps(vs);
#endif
      for (; j < v; ++j) sum += exp1(row[j] - m);
      lse[r] = m + std::log(sum);
      const int32_t y = label[r];
      nll[r] = (y >= 0 && y < v) ? lse[r] - row[y] : 0.f;
    }
  });
  return 0;
}

extern "C" int CrossEntropyGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                void *stream, void *extra) {
  if (nparam != 5 || ndims[0] != 2) return 1;
  const float *x = static_cast<const float *>(params[0]);
  const int32_t *label = static_cast<const int32_t *>(params[1]);
  const float *lse = static_cast<const float *>(params[2]);
  const float *dnll = static_cast<const float *>(params[3]);
  float *dx = static_cast<float *>(params[4]);
  const int64_t n = shapes[0][0], v = shapes[0][1];
  parallel_for(n, 8, [&](int64_t rb, int64_t re) {
    for (int64_t r = rb; r < re; ++r) {
      const float *row = x + r * v;
      float *out = dx + r * v;
      const int32_t y = label[r];
      const float d = (y >= 0 && y < v) ? dnll[r] : 0.f;
      if (d == 0.f) {
        std::memset(out, 0, sizeof(float) * v);
        continue;
      }
      int64_t j = 0;
#if defined(__AVX512F__)
      const __m512 vl = _mm512_set1_ps(lse[r]), vd = _mm512_set1_ps(d);
      for (; j + 16 <= v; j += 16)
        _mm512_storeu_ps(out + j, _mm512_mul_ps(exp512(_mm512_sub_ps(_mm512_loadu_ps(row + j), vl)), vd));
#endif
      for (; j < v; ++j) out[j] = exp1(row[j] - lse[r]) * d;
      out[y] -= d;
    }
  });
  return 0;
}

extern "C" int CausalSoftmax(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                             void *stream, void *extra) {
  if (nparam != 2 || ndims[0] != 3) return 1;
  const float *x = static_cast<const float *>(params[0]);
  float *y = static_cast<float *>(params[1]);
  const int64_t n = shapes[0][0], t = shapes[0][1], s = shapes[0][2], off = s - t;
  parallel_for(n * t, 16, [&](int64_t rb, int64_t re) {
    for (int64_t r = rb; r < re; ++r) {
      const int64_t k = (r % t) + off + 1;  // keys 0..t+off
      softmax_row(x + r * s, y + r * s, k < s ? k : s, s);
    }
  });
  return 0;
}

extern "C" int SoftmaxGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                           void *stream, void *extra) {
  if (nparam != 3 || ndims[0] != 3) return 1;
  const float *p = static_cast<const float *>(params[0]);
  const float *dp = static_cast<const float *>(params[1]);
  float *out = static_cast<float *>(params[2]);
  const int64_t n = shapes[0][0], t = shapes[0][1], s = shapes[0][2], off = s - t;
  parallel_for(n * t, 16, [&](int64_t rb, int64_t re) {
    for (int64_t r = rb; r < re; ++r) {
      const int64_t k = (r % t) + off + 1;
      softmax_grad_row(p + r * s, dp + r * s, out + r * s, k < s ? k : s, s);
    }
  });
  return 0;
}

extern "C" int SwiGLU(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                      void *stream, void *extra) {
  if (nparam != 3) return 1;
  const float *g = static_cast<const float *>(params[0]);
  const float *u = static_cast<const float *>(params[1]);
  float *out = static_cast<float *>(params[2]);
  const int64_t n = numel(ndims[0], shapes[0]);
  parallel_for(n, 16384, [&](int64_t j, int64_t e) {
#if defined(__AVX512F__)
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; j + 16 <= e; j += 16) {
      const __m512 vg = _mm512_loadu_ps(g + j);
      const __m512 sg = _mm512_div_ps(one, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), vg))));
      _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_mul_ps(vg, sg), _mm512_loadu_ps(u + j)));
    }
#endif
    for (; j < e; ++j) out[j] = g[j] / (1.0f + exp1(-g[j])) * u[j];
  });
  return 0;
}

extern "C" int SwiGLUGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                          void *stream, void *extra) {
  if (nparam != 5) return 1;
  const float *g = static_cast<const float *>(params[0]);
  const float *u = static_cast<const float *>(params[1]);
  const float *d = static_cast<const float *>(params[2]);
  float *dg = static_cast<float *>(params[3]);
  float *du = static_cast<float *>(params[4]);
  const int64_t n = numel(ndims[0], shapes[0]);
  parallel_for(n, 16384, [&](int64_t j, int64_t e) {
#if defined(__AVX512F__)
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; j + 16 <= e; j += 16) {
      const __m512 vg = _mm512_loadu_ps(g + j), vd = _mm512_loadu_ps(d + j);
      const __m512 s = _mm512_div_ps(one, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), vg))));
      const __m512 a = _mm512_mul_ps(vg, s);  // silu(g)
      // d silu(g) / dg = s * (1 + g - a)
      const __m512 ds = _mm512_mul_ps(s, _mm512_sub_ps(_mm512_add_ps(one, vg), a));
      _mm512_storeu_ps(dg + j, _mm512_mul_ps(_mm512_mul_ps(vd, _mm512_loadu_ps(u + j)), ds));
      _mm512_storeu_ps(du + j, _mm512_mul_ps(vd, a));
    }
#endif
    for (; j < e; ++j) {
      const float s = 1.0f / (1.0f + exp1(-g[j])), a = g[j] * s;
      dg[j] = d[j] * u[j] * (s * (1.0f + g[j] - a));
      du[j] = d[j] * a;
    }
  });
  return 0;
}

// ---------------------------------------------------------------------------------------------------
// The AdamW update in place (tasks/training/optim.py AdamW with fused_kernels, and ZeRO-1's ShardedAdamW).
//
// Loaded by model/kernels.py zero_ops(). One call updates one "segment": the range [a, a + k) of one
// flattened parameter (under ZeRO-1 the range this data-parallel rank owns; for AdamW the whole parameter).
//
//   ZeroAdamW(param [n], grad [n], m [k], v [k], offset [1] int32,
//             lr [], beta1 [], beta2 [], eps [], decay [], coef [], apply []) -> done [1]
//
// It reads the FULL gradient and the FULL parameter by pointer at offset a (no slice copy, no
// `grad * coef` temporary), updates the moment shares m, v and the parameter's [a, a + k) IN PLACE, and
// returns a one-element dummy the graph keeps (ops.depend) so the op is not pruned. `apply` == 0 (a
// non-finite or refused step) writes nothing. The scalars are those the repo's AdamW feeds MindSpore's
// AdamWeightDecay (torch's bias correction folded in: tasks/training/optim.py folded_adam_scalars), and
// per element the arithmetic is that kernel's AVX-512 block (nnacl AdamWeightDecayFp32):
//
//   g = grad * coef
//   m = fma(g, 1 - b1, m * b1);  v = fma(g * g, 1 - b2, v * b2)
//   u = fma(p, decay, m / (sqrt(v) + eps));  p = fma(u, -lr, p)
//
// (MindSpore's own kernel runs its last < 16 elements per thread through a scalar double-precision tail:
// those may differ by an ulp.) Here every element, vector body or tail, takes exactly these float
// operations (fma, sqrt and division are correctly rounded), so the result does not depend on the thread
// count or on where a segment starts.
//
// MindSpore passes a Parameter input's own memory to the kernel in graph mode (checked by
// tests/test_zero.py::test_zero_kernel_updates_parameters_in_place); the ordering is the caller's: its
// inputs (coef, from the global gradient norm) depend on every gradient, so every read of the old
// parameters in the step is done before it runs.

extern "C" int ZeroAdamW(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                         void *extra) {
  (void)stream, (void)extra;
  if (nparam != 13) return 1;
  for (int i : {0, 1, 2, 3}) {
    if (std::strcmp(dtypes[i], "float32") != 0) return 2;
  }
  float *p = static_cast<float *>(params[0]);
  const float *grad = static_cast<const float *>(params[1]);
  float *m = static_cast<float *>(params[2]);
  float *v = static_cast<float *>(params[3]);
  const int64_t a = *static_cast<const int32_t *>(params[4]);
  const float lr = scalar(params[5]), beta1 = scalar(params[6]), beta2 = scalar(params[7]);
  const float eps = scalar(params[8]), decay = scalar(params[9]), coef = scalar(params[10]);
  const float apply = scalar(params[11]);
  static_cast<float *>(params[12])[0] = apply;
  const int64_t n = numel(ndims[0], shapes[0]), k = numel(ndims[2], shapes[2]);
  if (apply == 0.0f || !std::isfinite(coef) || a < 0 || a + k > n || numel(ndims[1], shapes[1]) != n) return 0;
  p += a;
  grad += a;
  const float b1m = 1.0f - beta1, b2m = 1.0f - beta2, nlr = -lr;
  parallel_for(k, 1 << 16, [=](int64_t begin, int64_t end) {
    int64_t i = begin;
#if defined(__AVX512F__)
    const __m512 vb1 = _mm512_set1_ps(beta1), vb2 = _mm512_set1_ps(beta2), vb1m = _mm512_set1_ps(b1m),
                 vb2m = _mm512_set1_ps(b2m), vnlr = _mm512_set1_ps(nlr), veps = _mm512_set1_ps(eps),
                 vdecay = _mm512_set1_ps(decay), vcoef = _mm512_set1_ps(coef);
    for (; i + 16 <= end; i += 16) {
      const __m512 g = _mm512_mul_ps(_mm512_loadu_ps(grad + i), vcoef);
      __m512 pr = _mm512_loadu_ps(p + i);
      __m512 mr = _mm512_mul_ps(_mm512_loadu_ps(m + i), vb1);
      __m512 vr = _mm512_mul_ps(_mm512_loadu_ps(v + i), vb2);
      const __m512 g2 = _mm512_mul_ps(g, g);
      mr = _mm512_fmadd_ps(g, vb1m, mr);
      vr = _mm512_fmadd_ps(g2, vb2m, vr);
      __m512 u = _mm512_div_ps(mr, _mm512_add_ps(_mm512_sqrt_ps(vr), veps));
      u = _mm512_fmadd_ps(pr, vdecay, u);
      pr = _mm512_fmadd_ps(u, vnlr, pr);
      _mm512_storeu_ps(m + i, mr);
      _mm512_storeu_ps(v + i, vr);
      _mm512_storeu_ps(p + i, pr);
    }
#endif
    for (; i < end; ++i) {
      const float g = grad[i] * coef;
      const float mr = std::fma(g, b1m, m[i] * beta1);
      const float vr = std::fma(g * g, b2m, v[i] * beta2);
      const float u = std::fma(p[i], decay, mr / (std::sqrt(vr) + eps));
      p[i] = std::fma(u, nlr, p[i]);
      m[i] = mr;
      v[i] = vr;
    }
  });
  return 0;
}
