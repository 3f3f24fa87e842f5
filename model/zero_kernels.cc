// ZeRO-1 AdamW update in place, as a MindSpore "aot" custom op on CPU (tasks/training/optim.py ShardedAdamW).
//
// Built and loaded by model/kernels.py zero_ops() (g++ -O3 -march=native -shared). One call updates one
// "segment": the range [a, a + k) of one flattened parameter that this data-parallel rank owns.
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

// fn(begin, end) over [0, n) in contiguous pieces, one per thread (joined before returning).
template <typename F>
void parallel_for(int64_t n, int64_t min_per_thread, F fn) {
  int64_t t = num_threads();
  if (t > n / min_per_thread) t = n / min_per_thread;
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

float scalar(void *p) { return *static_cast<const float *>(p); }

}  // namespace

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
