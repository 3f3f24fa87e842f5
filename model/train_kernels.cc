// Fused kernels of the LLaMA train step, as MindSpore "aot" custom ops on CPU.
//
// Built and loaded by model/kernels.py, once per ISA level (model/simd.h: AVX-512, AVX2+FMA, NEON, and the
// scalar reference), the level chosen at load from what the CPU reports. Each op does in one pass over
// memory what MindSpore's CPU kernels do in several (see docs/MINDSPORE_CPU.md): the causal mask, the
// softmax and its backward; SwiGLU and its backward. fp32, contiguous.
//
// Threads: rows are split over std::threads started per call (~20 us, against ops of milliseconds) and
// joined before it returns: nothing spins afterwards. (OpenMP's idle workers spin-wait after each parallel
// region and took a core from MindSpore's next MatMul: the step got 1.3x slower. libgomp's wait policy is
// read once, when MindSpore loads it at import, so it cannot be set from here.) The count: the CPUs this
// process may use, capped by OMP_NUM_THREADS (msrun gives each rank its share) and MSLLM_KERNEL_THREADS, read from
// the C environment at every call. There MindSpore, once its graph scheduler starts, sets OMP_NUM_THREADS to its
// own choice where the process had none (1 on 2 cores): the trainer's kernels then run on the graph's thread alone,
// which measured best beside a background load (docs/KERNELS.md, "Threads": a second thread, started per call or
// kept in a pool, was up to 11% faster on a quiet 2-core Xeon but lost 7-21% beside a niced busy loop, one thread 4-6%).
// There a kernel's pieces are lent to MindSpore's waiting pool thread instead (`lend`, MsllmHelp below): 14% less
// step time quiet, 9-11% beside the busy loop.
// Every element is computed by exactly one thread in a fixed order: results do not depend on the count.
//
//   CausalSoftmax(scores [N, T, S]) -> probs [N, T, S]
//       row t of each [T, S] block attends keys j <= t + (S - T) (T <= S, else an error); later keys get
//       probability exactly 0
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
//   CrossEntropyWithGrad(logits, labels, dnll [N]) -> (nll, dlogits): both in one pass (the written-out head)
//       (one pass: MindSpore's LogSoftmax + gather backward write two [N, V] buffers and read three).
//   Transpose(x [R, C]) -> xᵀ [C, R] (the LM head's dlogits where MatMul runs oneDNN's AVX2 path)
//   RopeHeads(y [N, n·hd], cos [T, hd], sin [T, hd], scale [1]) -> [N / T, n, T, hd]; RopeTokens, its transpose
//       (both described with them, before the attention)
//   CausalAttention(q [B, nh, T, hd], k, v [B, nkv, S, hd]) -> (out [B, nh, T, hd], lse [B, nh, T])
//   CausalAttentionGrad(q, k, v, out, lse, dout) -> (dq, dk, dv)   (both described with them, at the end)
//   MsllmGradPut(dst, src, n, accumulate, square) -> Σ dst² (a host function, not an op: described at the end)
//   MsllmEmbedGrad(e, rows, h, dx, ids, n, zero, square, sumsq): the embedding's gradient rows (host, at the end)
//
// Every entry point checks its operands (count, dtypes, shapes) before touching memory and returns a
// non-zero code when they are wrong (1 count, 2 dtype, 3 shape; model/kernels.py names them).
// Every function follows MindSpore's aot signature: int f(int nparam, void **params, int *ndims,
// int64_t **shapes, const char **dtypes, void *stream, void *extra); inputs first, then outputs.

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "simd.h"

using simd::kVW;
#if MSLLM_VW > 0
using simd::vf;
using simd::loadu;
using simd::storeu;
using simd::set1;
#endif

namespace {

// Return codes (model/kernels.py KERNEL_ERRORS turns them into messages); every entry point checks its
// operands before it touches memory: a wrong count, dtype or shape returns, never reads or writes past a buffer.
constexpr int kOk = 0, kArity = 1, kDtype = 2, kShape = 3;

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

// Idle runtime threads lend a hand. Where the kernels have one thread (MindSpore's OMP_NUM_THREADS=1 on 2 cores),
// the graph's other pool thread spins in its wait loop while a kernel runs on the graph's thread: that loop's
// sched_yield is msllm_spin_yield (model/spin_wait.cc), which calls MsllmHelp here. A kernel publishes its pieces in
// one slot; the caller takes pieces in turn and a spinning thread that comes by takes others, so the core the pool
// already spins on does the work and no thread of ours is added. The caller waits only for pieces already taken.
// One kernel at a time uses the slot; another runs its pieces alone.
struct HelpSlot {
  std::atomic<int> state{0};   // 0 free, 1 open to helpers, 2 being filled or closed by its owner
  std::atomic<int> inside{0};  // helpers between their check of state and their exit
  void (*run)(void *, int64_t, int64_t) = nullptr;
  void *ctx = nullptr;
  int64_t n = 0, pieces = 0;
  std::atomic<int64_t> next{0}, done{0};
  unsigned mxcsr = 0;  // the owner's SSE control word (rounding, flush-to-zero): helpers compute as it does
};
HelpSlot g_help;
std::atomic<int> g_help_on{0};     // MsllmLendIdleThreads: set once a runtime's waits reach MsllmHelp
std::atomic<long> g_helped{0};     // pieces run by helpers (tests: the helpers do run)

inline unsigned get_mxcsr() {
#if defined(__x86_64__)
  return __builtin_ia32_stmxcsr();
#else
  return 0;
#endif
}
inline void set_mxcsr(unsigned v) {
#if defined(__x86_64__)
  __builtin_ia32_ldmxcsr(v);
#else
  (void)v;
#endif
}
// Piece p of n items in `pieces` contiguous pieces (the first n % pieces one item longer).
inline void piece_range(int64_t n, int64_t pieces, int64_t p, int64_t *b, int64_t *e) {
  const int64_t q = n / pieces, r = n % pieces;
  *b = p * q + std::min(p, r);
  *e = *b + q + (p < r ? 1 : 0);
}

// Take pieces of the open slot until none is left; returns how many this thread ran.
long take_pieces(HelpSlot &s) {
  long ran = 0;
  for (int64_t p; (p = s.next.fetch_add(1, std::memory_order_relaxed)) < s.pieces; ++ran) {
    int64_t b, e;
    piece_range(s.n, s.pieces, p, &b, &e);
    s.run(s.ctx, b, e);
    s.done.fetch_add(1, std::memory_order_release);
  }
  return ran;
}

// fn(begin, end) over [0, n) in pieces of at least min_per items, the caller and idle runtime threads taking them.
// Returns false (nothing run) where the slot is taken or helpers are off: the caller runs fn alone.
template <typename F>
bool lend(int64_t n, int64_t min_per, F &fn) {
  constexpr int64_t kPieces = 8;  // a straggler (a helper preempted mid-piece) holds the caller one piece at most
  const int64_t pieces = std::min<int64_t>(kPieces, n / (min_per > 0 ? min_per : 1));
  if (pieces < 2 || !g_help_on.load(std::memory_order_relaxed)) return false;
  int free_ = 0;
  if (!g_help.state.compare_exchange_strong(free_, 2, std::memory_order_acquire)) return false;
  g_help.run = [](void *c, int64_t b, int64_t e) { (*static_cast<F *>(c))(b, e); };
  g_help.ctx = &fn;
  g_help.n = n;
  g_help.pieces = pieces;
  g_help.mxcsr = get_mxcsr();
  g_help.next.store(0, std::memory_order_relaxed);
  g_help.done.store(0, std::memory_order_relaxed);
  g_help.state.store(1, std::memory_order_seq_cst);  // open: the fields above are visible to a helper that sees 1
  take_pieces(g_help);
  while (g_help.done.load(std::memory_order_acquire) < pieces) simd::cpu_relax();  // pieces helpers still run
  g_help.state.store(2, std::memory_order_seq_cst);  // closed: a helper arriving now leaves without reading
  while (g_help.inside.load(std::memory_order_seq_cst) != 0) simd::cpu_relax();
  g_help.state.store(0, std::memory_order_release);
  return true;
}

// fn(begin, end) over [0, n) in contiguous pieces, one per thread; the calling thread takes the first.
template <typename F>
void parallel_for(int64_t n, int64_t min_per_thread, F fn) {
  const int64_t threads = num_threads();
  int64_t t = threads;
  if (t > n / (min_per_thread > 0 ? min_per_thread : 1)) t = n / (min_per_thread > 0 ? min_per_thread : 1);
  if (t <= 1) {
    if (threads == 1 && lend(n, min_per_thread, fn)) return;  // lend itself needs 2 pieces at least
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

// operand checks
bool is(const char **dtypes, int i, const char *dt) { return dtypes[i] && std::strcmp(dtypes[i], dt) == 0; }
bool all_f32(const char **dtypes, int n) {
  for (int i = 0; i < n; ++i)
    if (!is(dtypes, i, "float32")) return false;
  return true;
}
bool same_shape(int *ndims, int64_t **shapes, int i, int j) {
  if (ndims[i] != ndims[j]) return false;
  for (int d = 0; d < ndims[i]; ++d)
    if (shapes[i][d] != shapes[j][d]) return false;
  return true;
}
bool nonneg(int *ndims, int64_t **shapes, int n) {
  for (int i = 0; i < n; ++i)
    for (int d = 0; d < ndims[i]; ++d)
      if (shapes[i][d] < 0) return false;
  return true;
}
// operand i is a vector of exactly n elements (any rank whose element count is n)
bool has_numel(int *ndims, int64_t **shapes, int i, int64_t n) { return numel(ndims[i], shapes[i]) == n; }

inline float exp1(float x) { return std::exp(x); }

// max of row[0..k) (the softmax and cross-entropy rows)
inline float row_max(const float *row, int64_t k) {
  float m = -INFINITY;
  int64_t j = 0;
#if MSLLM_VW > 0
  if (k >= kVW) {
    vf vm = loadu(row);
    for (j = kVW; j + kVW <= k; j += kVW) vm = simd::vmax(vm, loadu(row + j));
    m = simd::hmax(vm);
  }
#endif
  for (; j < k; ++j) m = row[j] > m ? row[j] : m;
  return m;
}

// exp(row[j] - m) into out[0..k) (out may be row); returns their sum (vector lanes, then the tail)
float exp_row(const float *row, float *out, int64_t k, float m) {
  float sum = 0.f;
  int64_t j = 0;
#if MSLLM_VW > 0
  const vf vmax = set1(m);
  vf vs = simd::zero();
  for (; j + kVW <= k; j += kVW) {
    const vf e = simd::exp_v(loadu(row + j) - vmax);
    storeu(out + j, e);
    vs = vs + e;
  }
  sum = simd::hsum(vs);
#endif
  for (; j < k; ++j) {
    out[j] = exp1(row[j] - m);
    sum += out[j];
  }
  return sum;
}

// softmax of row[0..k) into out[0..k) (out may be row), zeros in out[k..s); returns the log-sum-exp of row[0..k)
float softmax_row(const float *row, float *out, int64_t k, int64_t s) {
  const float m = row_max(row, k);
  const float sum = exp_row(row, out, k, m);
  const float inv = 1.0f / sum;
  int64_t j = 0;
#if MSLLM_VW > 0
  const vf vinv = set1(inv);
  for (; j + kVW <= k; j += kVW) storeu(out + j, loadu(out + j) * vinv);
#endif
  for (; j < k; ++j) out[j] *= inv;
  if (k < s) std::memset(out + k, 0, sizeof(float) * (s - k));
  return m + std::log(sum);
}

void softmax_grad_row(const float *p, const float *dp, float *out, int64_t k, int64_t s) {
  float dot = 0.f;
  int64_t j = 0;
#if MSLLM_VW > 0
  vf vd = simd::zero();
  for (; j + kVW <= k; j += kVW) vd = simd::fma(loadu(p + j), loadu(dp + j), vd);
  dot = simd::hsum(vd);
#endif
  for (; j < k; ++j) dot += p[j] * dp[j];
  j = 0;
#if MSLLM_VW > 0
  const vf vdot = set1(dot);
  for (; j + kVW <= k; j += kVW) storeu(out + j, loadu(p + j) * (loadu(dp + j) - vdot));
#endif
  for (; j < k; ++j) out[j] = p[j] * (dp[j] - dot);
  if (k < s) std::memset(out + k, 0, sizeof(float) * (s - k));
}

constexpr int64_t kRowBlock = 32;  // rows per partial sum of RMSNormGrad's dweight

// Σ x[j]² over [0, n) in float32 (vector lanes, then the tail)
inline float sum_squares(const float *x, int64_t n) {
  float ss = 0.f;
  int64_t j = 0;
#if MSLLM_VW > 0
  vf acc = simd::zero();
  for (; j + kVW <= n; j += kVW) {
    const vf v = loadu(x + j);
    acc = simd::fma(v, v, acc);
  }
  ss = simd::hsum(acc);
#endif
  for (; j < n; ++j) ss += x[j] * x[j];
  return ss;
}

// 1 / sqrt(mean(x^2) + eps) of one row
inline float inv_rms(const float *x, int64_t h, float eps) {
  return 1.0f / std::sqrt(sum_squares(x, h) / static_cast<float>(h) + eps);
}

float scalar(void *p) { return *static_cast<const float *>(p); }

// the causal softmax's operands: 3-D [N, T, S] with T <= S (the T queries are the last T of S positions)
bool causal_shape(int *ndims, int64_t **shapes, int i) {
  return ndims[i] == 3 && shapes[i][1] <= shapes[i][2];
}

}  // namespace

// Which body this library runs ("avx512", "avx2", "neon", "scalar"): model/kernels.py checks that a built
// library exports it (and the kernels) before caching it, and reports it.
extern "C" const char *MsllmKernelIsa() { return MSLLM_ISA; }

// The thread count the kernels would use now (num_threads: the environment as it is at this call).
extern "C" int MsllmKernelThreads() { return num_threads(); }

// What a runtime thread's wait loop calls (model/spin_wait.cc, msllm_spin_yield): runs pieces of the kernel now
// open, if any, with the kernel's SSE control word; returns at once otherwise (one load).
extern "C" void MsllmHelp() {
  if (g_help.state.load(std::memory_order_acquire) != 1) return;
  g_help.inside.fetch_add(1, std::memory_order_seq_cst);
  if (g_help.state.load(std::memory_order_seq_cst) == 1) {
    const unsigned own = get_mxcsr();
    set_mxcsr(g_help.mxcsr);
    const long ran = take_pieces(g_help);
    set_mxcsr(own);
    if (ran) g_helped.fetch_add(ran, std::memory_order_relaxed);
  }
  g_help.inside.fetch_sub(1, std::memory_order_seq_cst);
}

// Turn the helpers on (1) or off (0): on once msllm_spin_yield calls MsllmHelp (model/runtime.py), and only where
// the kernels run one thread (MindSpore's OMP_NUM_THREADS=1); MSLLM_KERNEL_HELPERS=0 keeps them off.
extern "C" void MsllmLendIdleThreads(int on) { g_help_on.store(on ? 1 : 0, std::memory_order_relaxed); }

// Pieces run by helpers in this process (tests, bench lines).
extern "C" long MsllmHelpedPieces() { return g_helped.load(std::memory_order_relaxed); }

// A helper as a runtime's waiting thread is one (tests: a thread of their own that helps): sets *flag to 1 once it
// runs, then helps until *flag is 2.
extern "C" void MsllmHelpUntil(int *flag) {
  __atomic_store_n(flag, 1, __ATOMIC_RELEASE);
  while (__atomic_load_n(flag, __ATOMIC_ACQUIRE) != 2) {
    MsllmHelp();
    simd::cpu_relax();
  }
}

extern "C" int RMSNorm(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                       void *extra) {
  (void)stream, (void)extra;
  if (nparam != 4) return kArity;
  if (!all_f32(dtypes, 4)) return kDtype;
  if (ndims[0] < 1 || !nonneg(ndims, shapes, 4) || !same_shape(ndims, shapes, 0, 3)) return kShape;
  const int64_t h = shapes[0][ndims[0] - 1];
  if (h == 0 || !has_numel(ndims, shapes, 1, h) || !has_numel(ndims, shapes, 2, 1)) return kShape;
  const float *x = static_cast<const float *>(params[0]);
  const float *w = static_cast<const float *>(params[1]);
  const float eps = static_cast<const float *>(params[2])[0];
  float *y = static_cast<float *>(params[3]);
  const int64_t n = numel(ndims[0], shapes[0]) / h;
  parallel_for(n, 64, [&](int64_t rb, int64_t re) {
    for (int64_t r = rb; r < re; ++r) {
      const float *xr = x + r * h;
      float *yr = y + r * h;
      const float inv = inv_rms(xr, h, eps);
      int64_t j = 0;
#if MSLLM_VW > 0
      const vf vinv = set1(inv);
      for (; j + kVW <= h; j += kVW) storeu(yr + j, loadu(xr + j) * vinv * loadu(w + j));
#endif
      for (; j < h; ++j) yr[j] = xr[j] * inv * w[j];
    }
  });
  return kOk;
}

extern "C" int RMSNormGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                           void *stream, void *extra) {
  (void)stream, (void)extra;
  if (nparam != 6) return kArity;
  if (!all_f32(dtypes, 6)) return kDtype;
  if (ndims[0] < 1 || !nonneg(ndims, shapes, 6)) return kShape;
  const int64_t h = shapes[0][ndims[0] - 1];
  if (h == 0 || !has_numel(ndims, shapes, 1, h) || !has_numel(ndims, shapes, 2, 1) || !same_shape(ndims, shapes, 0, 3) ||
      !same_shape(ndims, shapes, 0, 4) || !has_numel(ndims, shapes, 5, h))
    return kShape;
  const float *x = static_cast<const float *>(params[0]);
  const float *w = static_cast<const float *>(params[1]);
  const float eps = static_cast<const float *>(params[2])[0];
  const float *dy = static_cast<const float *>(params[3]);
  float *dx = static_cast<float *>(params[4]);
  float *dw = static_cast<float *>(params[5]);
  const int64_t n = numel(ndims[0], shapes[0]) / h;
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
#if MSLLM_VW > 0
        vf vdot = simd::zero();
        for (; k + kVW <= h; k += kVW) vdot = simd::fma(loadu(gr + k) * loadu(w + k), loadu(xr + k), vdot);
        dot = simd::hsum(vdot);
#endif
        for (; k < h; ++k) dot += gr[k] * w[k] * xr[k];
        const float c = dot * inv * inv / static_cast<float>(h);
        int64_t j = 0;
#if MSLLM_VW > 0
        const vf vinv = set1(inv), vc = set1(c);
        for (; j + kVW <= h; j += kVW) {
          const vf vx = loadu(xr + j), vg = loadu(gr + j);
          const vf vgw = vg * loadu(w + j);
          storeu(dxr + j, vinv * simd::fma(-vx, vc, vgw));
          storeu(pw + j, simd::fma(vg, vx * vinv, loadu(pw + j)));
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
  return kOk;
}

// logits [N, V] float32, labels [N] int32, then `nvec` more [N] float32 operands
static int check_ce(int *ndims, int64_t **shapes, const char **dtypes, int nparam, int nvec_from) {
  if (!is(dtypes, 0, "float32") || !is(dtypes, 1, "int32")) return kDtype;
  for (int i = 2; i < nparam; ++i)
    if (!is(dtypes, i, "float32")) return kDtype;
  if (ndims[0] != 2 || !nonneg(ndims, shapes, nparam)) return kShape;
  const int64_t n = shapes[0][0];
  if (!has_numel(ndims, shapes, 1, n)) return kShape;
  for (int i = nvec_from; i < nparam; ++i)
    if (!has_numel(ndims, shapes, i, n)) return kShape;
  return kOk;
}

extern "C" int CrossEntropy(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                            void *stream, void *extra) {
  (void)stream, (void)extra;
  if (nparam != 4) return kArity;
  if (const int rc = check_ce(ndims, shapes, dtypes, 4, 2)) return rc;
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
#if MSLLM_VW > 0
      const vf vmax = set1(m);
      vf vs = simd::zero();
      for (; j + kVW <= v; j += kVW) vs = vs + simd::exp_v(loadu(row + j) - vmax);
      sum = simd::hsum(vs);
#endif
      for (; j < v; ++j) sum += exp1(row[j] - m);
      lse[r] = m + std::log(sum);
      const int32_t y = label[r];
      nll[r] = (y >= 0 && y < v) ? lse[r] - row[y] : 0.f;
    }
  });
  return kOk;
}

extern "C" int CrossEntropyGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                void *stream, void *extra) {
  (void)stream, (void)extra;
  if (nparam != 5) return kArity;
  if (const int rc = check_ce(ndims, shapes, dtypes, 4, 2)) return rc;
  if (!is(dtypes, 4, "float32")) return kDtype;
  if (!same_shape(ndims, shapes, 0, 4)) return kShape;
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
#if MSLLM_VW > 0
      const vf vl = set1(lse[r]), vd = set1(d);
      for (; j + kVW <= v; j += kVW) storeu(out + j, simd::exp_v(loadu(row + j) - vl) * vd);
#endif
      for (; j < v; ++j) out[j] = exp1(row[j] - lse[r]) * d;
      out[y] -= d;
    }
  });
  return kOk;
}

// The head's loss and its gradient in one pass where the gradient's scale is known before the loss (the layer-at-a-
// time step's written-out head): per row, the max, then exp(x - max) written into dlogits while summed, then scaled by
// dnll / sum (the row still in cache) and -dnll at the label. One exp per element and one read of the logits, where
// CrossEntropy then CrossEntropyGrad took two of each. nll and lse as CrossEntropy's; dlogits as CrossEntropyGrad's
// up to the rounding of exp(x - max) / sum against exp(x - lse) (a few ulp).
extern "C" int CrossEntropyWithGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                    void *stream, void *extra) {
  (void)stream, (void)extra;
  if (nparam != 5) return kArity;
  if (const int rc = check_ce(ndims, shapes, dtypes, 4, 2)) return rc;  // logits, labels, dnll, nll
  if (!is(dtypes, 4, "float32")) return kDtype;
  if (!same_shape(ndims, shapes, 0, 4)) return kShape;
  const float *x = static_cast<const float *>(params[0]);
  const int32_t *label = static_cast<const int32_t *>(params[1]);
  const float *dnll = static_cast<const float *>(params[2]);
  float *nll = static_cast<float *>(params[3]);
  float *dx = static_cast<float *>(params[4]);
  const int64_t n = shapes[0][0], v = shapes[0][1];
  parallel_for(n, 8, [&](int64_t rb, int64_t re) {
    for (int64_t r = rb; r < re; ++r) {
      const float *row = x + r * v;
      float *out = dx + r * v;
      const int32_t y = label[r];
      const bool counted = y >= 0 && y < v;
      const float m = row_max(row, v);
      const float sum = exp_row(row, out, v, m);
      const float lse = m + std::log(sum);
      nll[r] = counted ? lse - row[y] : 0.f;
      const float d = counted ? dnll[r] : 0.f;
      if (d == 0.f) {
        std::memset(out, 0, sizeof(float) * v);
        continue;
      }
      const float c = d / sum;
      int64_t j = 0;
#if MSLLM_VW > 0
      const vf vc = set1(c);
      for (; j + kVW <= v; j += kVW) storeu(out + j, loadu(out + j) * vc);
#endif
      for (; j < v; ++j) out[j] *= c;
      out[y] -= d;
    }
  });
  return kOk;
}

extern "C" int CausalSoftmax(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                             void *stream, void *extra) {
  (void)stream, (void)extra;
  if (nparam != 2) return kArity;
  if (!all_f32(dtypes, 2)) return kDtype;
  if (!causal_shape(ndims, shapes, 0) || !nonneg(ndims, shapes, 2) || !same_shape(ndims, shapes, 0, 1)) return kShape;
  const float *x = static_cast<const float *>(params[0]);
  float *y = static_cast<float *>(params[1]);
  const int64_t n = shapes[0][0], t = shapes[0][1], s = shapes[0][2], off = s - t;
  parallel_for(n * t, 16, [&](int64_t rb, int64_t re) {
    for (int64_t r = rb; r < re; ++r) {
      const int64_t k = (r % t) + off + 1;  // keys 0..t+off: 1 <= k <= s since t <= s
      softmax_row(x + r * s, y + r * s, k, s);
    }
  });
  return kOk;
}

extern "C" int SoftmaxGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                           void *stream, void *extra) {
  (void)stream, (void)extra;
  if (nparam != 3) return kArity;
  if (!all_f32(dtypes, 3)) return kDtype;
  if (!causal_shape(ndims, shapes, 0) || !nonneg(ndims, shapes, 3) || !same_shape(ndims, shapes, 0, 1) ||
      !same_shape(ndims, shapes, 0, 2))
    return kShape;
  const float *p = static_cast<const float *>(params[0]);
  const float *dp = static_cast<const float *>(params[1]);
  float *out = static_cast<float *>(params[2]);
  const int64_t n = shapes[0][0], t = shapes[0][1], s = shapes[0][2], off = s - t;
  parallel_for(n * t, 16, [&](int64_t rb, int64_t re) {
    for (int64_t r = rb; r < re; ++r) {
      const int64_t k = (r % t) + off + 1;
      softmax_grad_row(p + r * s, dp + r * s, out + r * s, k, s);
    }
  });
  return kOk;
}

// silu(g) = g * sigmoid(g) and sigmoid(g), by lanes
#if MSLLM_VW > 0
inline vf sigmoid_v(vf g) {
  const vf one = set1(1.0f);
  return one / (one + simd::exp_v(-g));
}
#endif

extern "C" int SwiGLU(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                      void *stream, void *extra) {
  (void)stream, (void)extra;
  if (nparam != 3) return kArity;
  if (!all_f32(dtypes, 3)) return kDtype;
  if (!nonneg(ndims, shapes, 3) || !same_shape(ndims, shapes, 0, 1) || !same_shape(ndims, shapes, 0, 2)) return kShape;
  const float *g = static_cast<const float *>(params[0]);
  const float *u = static_cast<const float *>(params[1]);
  float *out = static_cast<float *>(params[2]);
  const int64_t n = numel(ndims[0], shapes[0]);
  parallel_for(n, 16384, [&](int64_t j, int64_t e) {
#if MSLLM_VW > 0
    for (; j + kVW <= e; j += kVW) {
      const vf vg = loadu(g + j);
      storeu(out + j, vg * sigmoid_v(vg) * loadu(u + j));
    }
#endif
    for (; j < e; ++j) out[j] = g[j] / (1.0f + exp1(-g[j])) * u[j];
  });
  return kOk;
}

extern "C" int SwiGLUGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                          void *stream, void *extra) {
  (void)stream, (void)extra;
  if (nparam != 5) return kArity;
  if (!all_f32(dtypes, 5)) return kDtype;
  if (!nonneg(ndims, shapes, 5)) return kShape;
  for (int i = 1; i < 5; ++i)
    if (!same_shape(ndims, shapes, 0, i)) return kShape;
  const float *g = static_cast<const float *>(params[0]);
  const float *u = static_cast<const float *>(params[1]);
  const float *d = static_cast<const float *>(params[2]);
  float *dg = static_cast<float *>(params[3]);
  float *du = static_cast<float *>(params[4]);
  const int64_t n = numel(ndims[0], shapes[0]);
  parallel_for(n, 16384, [&](int64_t j, int64_t e) {
#if MSLLM_VW > 0
    const vf one = set1(1.0f);
    for (; j + kVW <= e; j += kVW) {
      const vf vg = loadu(g + j), vd = loadu(d + j);
      const vf s = sigmoid_v(vg);
      const vf a = vg * s;  // silu(g)
      // d silu(g) / dg = s * (1 + g - a)
      storeu(dg + j, vd * loadu(u + j) * (s * (one + vg - a)));
      storeu(du + j, vd * a);
    }
#endif
    for (; j < e; ++j) {
      const float s = 1.0f / (1.0f + exp1(-g[j])), a = g[j] * s;
      dg[j] = d[j] * u[j] * (s * (1.0f + g[j] - a));
      du[j] = d[j] * a;
    }
  });
  return kOk;
}

// ---------------------------------------------------------------------------------------------------
// The AdamW update in place (tasks/training/adamw.py AdamW with fused_kernels, and ZeRO-1's ShardedAdamW in tasks/training/zero.py).
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
// AdamWeightDecay (torch's bias correction folded in: tasks/training/adamw.py folded_adam_scalars), and
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
  if (nparam != 13) return kArity;
  if (!all_f32(dtypes, 4) || !is(dtypes, 4, "int32") || !is(dtypes, 12, "float32")) return kDtype;
  for (int i = 5; i < 12; ++i)
    if (!is(dtypes, i, "float32")) return kDtype;
  if (!nonneg(ndims, shapes, 13)) return kShape;
  for (int i = 4; i < 13; ++i)
    if (numel(ndims[i], shapes[i]) < 1) return kShape;
  const int64_t n = numel(ndims[0], shapes[0]), k = numel(ndims[2], shapes[2]);
  const int64_t a = *static_cast<const int32_t *>(params[4]);
  // the segment [a, a + k) lies inside the parameter, the gradient is the parameter's size, v is m's
  if (a < 0 || a + k > n || numel(ndims[1], shapes[1]) != n || numel(ndims[3], shapes[3]) != k) return kShape;
  float *p = static_cast<float *>(params[0]);
  const float *grad = static_cast<const float *>(params[1]);
  float *m = static_cast<float *>(params[2]);
  float *v = static_cast<float *>(params[3]);
  const float lr = scalar(params[5]), beta1 = scalar(params[6]), beta2 = scalar(params[7]);
  const float eps = scalar(params[8]), decay = scalar(params[9]), coef = scalar(params[10]);
  const float apply = scalar(params[11]);
  static_cast<float *>(params[12])[0] = apply;
  if (apply == 0.0f || !std::isfinite(coef)) return kOk;  // a skipped step: nothing written
  p += a;
  grad += a;
  const float b1m = 1.0f - beta1, b2m = 1.0f - beta2, nlr = -lr;
  parallel_for(k, 1 << 16, [=](int64_t begin, int64_t end) {
    int64_t i = begin;
#if MSLLM_VW > 0
    const vf vb1 = set1(beta1), vb2 = set1(beta2), vb1m = set1(b1m), vb2m = set1(b2m), vnlr = set1(nlr),
             veps = set1(eps), vdecay = set1(decay), vcoef = set1(coef);
    for (; i + kVW <= end; i += kVW) {
      const vf g = loadu(grad + i) * vcoef;
      vf pr = loadu(p + i);
      vf mr = loadu(m + i) * vb1;
      vf vr = loadu(v + i) * vb2;
      const vf g2 = g * g;
      mr = simd::fma(g, vb1m, mr);
      vr = simd::fma(g2, vb2m, vr);
      vf u = mr / (simd::sqrt(vr) + veps);
      u = simd::fma(pr, vdecay, u);
      pr = simd::fma(u, vnlr, pr);
      storeu(m + i, mr);
      storeu(v + i, vr);
      storeu(p + i, pr);
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
  return kOk;
}

// Transpose(x [R, C]) -> y [C, R]: 64 x 64 tiles (each a grid of 8 x 8 blocks transposed in registers where AVX2 is
// there), the output's rows split over threads; ~1.7x a memcpy of the same bytes. The LM head's weight gradient
// (model/fused_cells.py FusedHeadMatMul) runs as dlogitsᵀ · x, a plain MatMul, instead of oneDNN's transposed-A
// MatMul, which its AVX2 path runs at ~half speed at [N, V] = [2048, 8192] (docs/MINDSPORE_CPU.md).
namespace {
#if !defined(MSLLM_SCALAR) && defined(__AVX2__)  // simd.h includes immintrin.h then
inline void transpose8(const float *x, int64_t ldx, float *y, int64_t ldy) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(x + i * ldx);
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // rows 0-3 (h = 0) and 4-7 of the input, as quads
    r[4 * h + 0] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0x44);
    r[4 * h + 1] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0xEE);
    r[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0x44);
    r[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(y + i * ldy, _mm256_permute2f128_ps(r[i], r[4 + i], 0x20));
    _mm256_storeu_ps(y + (i + 4) * ldy, _mm256_permute2f128_ps(r[i], r[4 + i], 0x31));
  }
}
#endif

// y[j, i] = x[i, j] for i in [i0, i1), j in [j0, j1)
void transpose_tile(const float *x, float *y, int64_t r, int64_t c, int64_t i0, int64_t i1, int64_t j0, int64_t j1) {
#if !defined(MSLLM_SCALAR) && defined(__AVX2__)  // simd.h includes immintrin.h then
  if (i1 - i0 == 64 && j1 - j0 == 64) {
    for (int64_t i = i0; i < i1; i += 8)
      for (int64_t j = j0; j < j1; j += 8) transpose8(x + i * c + j, c, y + j * r + i, r);
    return;
  }
#endif
  for (int64_t j = j0; j < j1; ++j)
    for (int64_t i = i0; i < i1; ++i) y[j * r + i] = x[i * c + j];
}

constexpr int64_t kTransposeTile = 64;

// y[j, :] = x[:, j] for the columns j in [j0, j1) of x [r, c], in 64 x 64 tiles
void transpose_columns(const float *x, float *y, int64_t r, int64_t c, int64_t j0, int64_t j1) {
  for (int64_t i = 0; i < r; i += kTransposeTile)
    for (int64_t j = j0; j < j1; j += kTransposeTile)
      transpose_tile(x, y, r, c, i, std::min(r, i + kTransposeTile), j, std::min(j1, j + kTransposeTile));
}
}  // namespace

extern "C" int Transpose(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                         void *extra) {
  (void)stream, (void)extra;
  if (nparam != 2) return kArity;
  if (!all_f32(dtypes, 2)) return kDtype;
  if (ndims[0] != 2 || ndims[1] != 2 || !nonneg(ndims, shapes, 2) || shapes[1][0] != shapes[0][1] ||
      shapes[1][1] != shapes[0][0])
    return kShape;
  const float *x = static_cast<const float *>(params[0]);
  float *y = static_cast<float *>(params[1]);
  const int64_t r = shapes[0][0], c = shapes[0][1];
  parallel_for((c + kTransposeTile - 1) / kTransposeTile, 1, [&](int64_t tb, int64_t te) {
    transpose_columns(x, y, r, c, tb * kTransposeTile, std::min(c, te * kTransposeTile));
  });
  return kOk;
}

// RopeHeads(y [N, n·hd], cos [T, hd], sin [T, hd], scale [1]) -> out [N / T, n, T, hd]
//     a projection's rows (token-major, N = B·T) to heads, RoPE applied and scaled, in one pass:
//     out[b, h, t] = scale · (z · cos[t] + rotate_half(z) · sin[t]) for z = y[b·T + t, h·hd : (h+1)·hd],
//     rotate_half(z) = (-z[hd/2:], z[:hd/2]) (LLaMA's layout: model/layers.py rotate_half_matrix).
// RopeTokens(d [B, n, T, hd], cos, sin, scale [1]) -> dy [B·T, n·hd]: its transpose (the backward):
//     dy[b·T + t, h] = scale · (d · cos[t] + rotate_halfᵀ(d · sin[t])), rotate_halfᵀ(z) = (z[hd/2:], -z[:hd/2]).
// What they replace in the layer-at-a-time step: a Transpose, two broadcasts of cos / sin, a MatMul by the ±1
// rotation, two Muls, an Add and the scale's Mul, each a pass over [B, n, T, hd].
namespace {
struct RopeShape {
  int64_t rows, n, t, hd;
};

// y / dy [N, n·hd] (token-major) against cos, sin [T, hd], scale [1] and the head-major [N / T, n, T, hd]
int check_rope(int *ndims, int64_t **shapes, const char **dtypes, bool tokens, RopeShape *r) {
  if (!all_f32(dtypes, 5)) return kDtype;
  if (!nonneg(ndims, shapes, 5) || ndims[1] != 2 || !same_shape(ndims, shapes, 1, 2) || numel(ndims[3], shapes[3]) != 1)
    return kShape;
  const int64_t t = shapes[1][0], hd = shapes[1][1];
  if (t <= 0 || hd <= 0 || hd % 2 != 0) return kShape;
  const int tok = tokens ? 4 : 0, heads = tokens ? 0 : 4;  // RopeHeads: y in, heads out; RopeTokens: the reverse
  if (ndims[tok] != 2 || ndims[heads] != 4) return kShape;
  const int64_t *y = shapes[tok], *h = shapes[heads];
  if (y[1] % hd != 0 || y[0] % t != 0) return kShape;
  *r = {y[0], y[1] / hd, t, hd};
  if (h[0] != y[0] / t || h[1] != r->n || h[2] != t || h[3] != hd) return kShape;
  return kOk;
}

// one head-row: out = s · (z · c + rotate_half(z) · sn), or (transpose) s · (z · c + rotate_halfᵀ(z · sn))
inline void rope_row(const float *z, const float *c, const float *sn, float s, int64_t hd, bool transpose, float *out) {
  const int64_t half = hd / 2;
  if (!transpose) {
    for (int64_t i = 0; i < half; ++i) {
      out[i] = s * (z[i] * c[i] - z[i + half] * sn[i]);
      out[i + half] = s * (z[i + half] * c[i + half] + z[i] * sn[i + half]);
    }
  } else {
    for (int64_t i = 0; i < half; ++i) {
      out[i] = s * (z[i] * c[i] + z[i + half] * sn[i + half]);
      out[i + half] = s * (z[i + half] * c[i + half] - z[i] * sn[i]);
    }
  }
}

int rope(void **params, int *ndims, int64_t **shapes, const char **dtypes, bool tokens) {
  RopeShape r;
  if (const int rc = check_rope(ndims, shapes, dtypes, tokens, &r)) return rc;
  const float *x = static_cast<const float *>(params[0]), *c = static_cast<const float *>(params[1]),
              *sn = static_cast<const float *>(params[2]);
  const float s = *static_cast<const float *>(params[3]);
  float *y = static_cast<float *>(params[4]);
  const int64_t width = r.n * r.hd;
  parallel_for(r.rows, 64, [&](int64_t b, int64_t e) {
    for (int64_t row = b; row < e; ++row) {
      const int64_t bt = row / r.t, t = row % r.t;
      for (int64_t h = 0; h < r.n; ++h) {
        const int64_t tok = row * width + h * r.hd, head = ((bt * r.n + h) * r.t + t) * r.hd;
        if (tokens)  // RopeTokens: head-major in, token-major out
          rope_row(x + head, c + t * r.hd, sn + t * r.hd, s, r.hd, true, y + tok);
        else
          rope_row(x + tok, c + t * r.hd, sn + t * r.hd, s, r.hd, false, y + head);
      }
    }
  });
  return kOk;
}
}  // namespace

extern "C" int RopeHeads(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                         void *extra) {
  (void)stream, (void)extra;
  if (nparam != 5) return kArity;
  return rope(params, ndims, shapes, dtypes, false);
}

extern "C" int RopeTokens(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                          void *extra) {
  (void)stream, (void)extra;
  if (nparam != 5) return kArity;
  return rope(params, ndims, shapes, dtypes, true);
}

// CausalAttention(q [B, nh, T, hd], k [B, nkv, S, hd], v [B, nkv, S, hd]) -> (out [B, nh, T, hd], lse [B, nh, T])
//     softmax(q kᵀ) v per head, q already scaled, query t at position t + S - T attending keys j <= that position;
//     query head h reads kv head h / (nh / nkv) (GQA); lse = the log-sum-exp of each query's scores, for the backward.
// CausalAttentionGrad(q, k, v, out, lse, dout) -> (dq, dk, dv): the probabilities recomputed from q, k and lse
//     (nothing of size T x S is kept between forward and backward), dS = P (dP - rowsum(dout * out)).
// Each (batch, kv head) is one thread's unit, its query heads and 64-row query blocks in a fixed order, so dk and
// dv sum in the same order at any thread count. Within a block the products are small GEMMs on registers
// (`gemm`), keys up to the block's last query only (the causal half).
namespace {
constexpr int64_t kQueryBlock = 64;

// C[R rows, n] (+)= A[R, k] B[k, n]: A(i, kk) = a[i * ars + kk * aks], B and C row-major (ldb, ldc)
template <int R>
void gemm_rows(const float *a, int64_t ars, int64_t aks, const float *b, int64_t ldb, float *c, int64_t ldc,
               int64_t n, int64_t k, bool acc) {
  int64_t j = 0;
#if MSLLM_VW > 0
  for (; j + 2 * kVW <= n; j += 2 * kVW) {
    vf c0[R], c1[R];
    for (int r = 0; r < R; ++r) {
      c0[r] = acc ? loadu(c + r * ldc + j) : simd::zero();
      c1[r] = acc ? loadu(c + r * ldc + j + kVW) : simd::zero();
    }
    for (int64_t kk = 0; kk < k; ++kk) {
      const vf b0 = loadu(b + kk * ldb + j), b1 = loadu(b + kk * ldb + j + kVW);
      for (int r = 0; r < R; ++r) {
        const vf av = set1(a[r * ars + kk * aks]);
        c0[r] = simd::fma(av, b0, c0[r]);
        c1[r] = simd::fma(av, b1, c1[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      storeu(c + r * ldc + j, c0[r]);
      storeu(c + r * ldc + j + kVW, c1[r]);
    }
  }
  for (; j + kVW <= n; j += kVW) {
    vf c0[R];
    for (int r = 0; r < R; ++r) c0[r] = acc ? loadu(c + r * ldc + j) : simd::zero();
    for (int64_t kk = 0; kk < k; ++kk) {
      const vf b0 = loadu(b + kk * ldb + j);
      for (int r = 0; r < R; ++r) c0[r] = simd::fma(set1(a[r * ars + kk * aks]), b0, c0[r]);
    }
    for (int r = 0; r < R; ++r) storeu(c + r * ldc + j, c0[r]);
  }
#endif
  for (; j < n; ++j)
    for (int r = 0; r < R; ++r) {
      float s = acc ? c[r * ldc + j] : 0.f;
      for (int64_t kk = 0; kk < k; ++kk) s += a[r * ars + kk * aks] * b[kk * ldb + j];
      c[r * ldc + j] = s;
    }
}

void gemm(const float *a, int64_t ars, int64_t aks, const float *b, int64_t ldb, float *c, int64_t ldc, int64_t m,
          int64_t n, int64_t k, bool acc) {
  int64_t i = 0;
  for (; i + 4 <= m; i += 4) gemm_rows<4>(a + i * ars, ars, aks, b, ldb, c + i * ldc, ldc, n, k, acc);
  for (; i < m; ++i) gemm_rows<1>(a + i * ars, ars, aks, b, ldb, c + i * ldc, ldc, n, k, acc);
}

struct AttnShape {
  int64_t b, nh, nkv, t, s, hd;
};

// q [B, nh, T, hd], k and v [B, nkv, S, hd], then `extra` operands of q's shape and one [B, nh, T] (lse)
int check_attention(int nparam, int *ndims, int64_t **shapes, const char **dtypes, AttnShape *a) {
  if (!all_f32(dtypes, nparam)) return kDtype;
  if (!nonneg(ndims, shapes, nparam) || ndims[0] != 4 || ndims[1] != 4 || !same_shape(ndims, shapes, 1, 2))
    return kShape;
  const int64_t *q = shapes[0], *k = shapes[1];
  *a = {q[0], q[1], k[1], q[2], k[2], q[3]};
  if (k[0] != a->b || k[3] != a->hd || a->nkv <= 0 || a->nh % a->nkv != 0 || a->t > a->s) return kShape;
  return kOk;
}

// the scores of query rows [i0, i0 + m) of one head against keys [0, n): p[ii, j] (ld S)
inline void block_scores(const float *q, const float *kt, const AttnShape &a, int64_t i0, int64_t m, int64_t n,
                         float *p) {
  gemm(q + i0 * a.hd, a.hd, 1, kt, a.s, p, a.s, m, n, a.hd, false);
}
}  // namespace

extern "C" int CausalAttention(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                               void *stream, void *extra) {
  (void)stream, (void)extra;
  if (nparam != 5) return kArity;
  AttnShape a;
  if (const int rc = check_attention(5, ndims, shapes, dtypes, &a)) return rc;
  if (!same_shape(ndims, shapes, 0, 3) || numel(ndims[4], shapes[4]) != a.b * a.nh * a.t) return kShape;
  const float *q = static_cast<const float *>(params[0]), *k = static_cast<const float *>(params[1]),
              *v = static_cast<const float *>(params[2]);
  float *out = static_cast<float *>(params[3]), *lse = static_cast<float *>(params[4]);
  const int64_t rep = a.nh / a.nkv, off = a.s - a.t;
  parallel_for(a.b * a.nkv, 1, [&](int64_t ub, int64_t ue) {
    std::vector<float> kt(a.hd * a.s), p(kQueryBlock * a.s);
    for (int64_t u = ub; u < ue; ++u) {
      const float *ku = k + u * a.s * a.hd, *vu = v + u * a.s * a.hd;
      transpose_columns(ku, kt.data(), a.s, a.hd, 0, a.hd);  // kᵀ [hd, S]
      for (int64_t r = 0; r < rep; ++r) {
        const int64_t head = (u / a.nkv) * a.nh + (u % a.nkv) * rep + r;  // [B, nh] index of this query head
        const float *qh = q + head * a.t * a.hd;
        float *oh = out + head * a.t * a.hd, *lh = lse + head * a.t;
        for (int64_t i0 = 0; i0 < a.t; i0 += kQueryBlock) {
          const int64_t m = std::min(kQueryBlock, a.t - i0), n = i0 + m + off;  // keys the block's last row sees
          block_scores(qh, kt.data(), a, i0, m, n, p.data());
          for (int64_t ii = 0; ii < m; ++ii) {
            float *row = p.data() + ii * a.s;
            lh[i0 + ii] = softmax_row(row, row, i0 + ii + off + 1, n);  // the query's keys, in place
          }
          gemm(p.data(), a.s, 1, vu, a.hd, oh + i0 * a.hd, a.hd, m, a.hd, n, false);
        }
      }
    }
  });
  return kOk;
}

extern "C" int CausalAttentionGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                   void *stream, void *extra) {
  (void)stream, (void)extra;
  if (nparam != 9) return kArity;
  AttnShape a;
  if (const int rc = check_attention(9, ndims, shapes, dtypes, &a)) return rc;
  if (!same_shape(ndims, shapes, 0, 3) || numel(ndims[4], shapes[4]) != a.b * a.nh * a.t ||
      !same_shape(ndims, shapes, 0, 5) || !same_shape(ndims, shapes, 0, 6) || !same_shape(ndims, shapes, 1, 7) ||
      !same_shape(ndims, shapes, 1, 8))
    return kShape;
  const float *q = static_cast<const float *>(params[0]), *k = static_cast<const float *>(params[1]),
              *v = static_cast<const float *>(params[2]), *out = static_cast<const float *>(params[3]),
              *lse = static_cast<const float *>(params[4]), *dout = static_cast<const float *>(params[5]);
  float *dq = static_cast<float *>(params[6]), *dk = static_cast<float *>(params[7]),
        *dv = static_cast<float *>(params[8]);
  const int64_t rep = a.nh / a.nkv, off = a.s - a.t;
  parallel_for(a.b * a.nkv, 1, [&](int64_t ub, int64_t ue) {
    std::vector<float> kt(a.hd * a.s), vt(a.hd * a.s), p(kQueryBlock * a.s), ds(kQueryBlock * a.s);
    for (int64_t u = ub; u < ue; ++u) {
      const float *ku = k + u * a.s * a.hd, *vu = v + u * a.s * a.hd;
      float *dku = dk + u * a.s * a.hd, *dvu = dv + u * a.s * a.hd;
      std::memset(dku, 0, sizeof(float) * a.s * a.hd);
      std::memset(dvu, 0, sizeof(float) * a.s * a.hd);
      transpose_columns(ku, kt.data(), a.s, a.hd, 0, a.hd);  // kᵀ [hd, S]
      transpose_columns(vu, vt.data(), a.s, a.hd, 0, a.hd);  // vᵀ [hd, S]
      for (int64_t r = 0; r < rep; ++r) {
        const int64_t head = (u / a.nkv) * a.nh + (u % a.nkv) * rep + r;
        const float *qh = q + head * a.t * a.hd, *oh = out + head * a.t * a.hd, *doh = dout + head * a.t * a.hd,
                    *lh = lse + head * a.t;
        float *dqh = dq + head * a.t * a.hd;
        for (int64_t i0 = 0; i0 < a.t; i0 += kQueryBlock) {
          const int64_t m = std::min(kQueryBlock, a.t - i0), n = i0 + m + off;
          block_scores(qh, kt.data(), a, i0, m, n, p.data());                              // scores
          gemm(doh + i0 * a.hd, a.hd, 1, vt.data(), a.s, ds.data(), a.s, m, n, a.hd, false);  // dP = dout vᵀ
          for (int64_t ii = 0; ii < m; ++ii) {
            float *prow = p.data() + ii * a.s, *drow = ds.data() + ii * a.s;
            const int64_t lim = i0 + ii + off + 1;
            const float *o = oh + (i0 + ii) * a.hd, *d = doh + (i0 + ii) * a.hd;
            float dot = 0.f;
            for (int64_t e = 0; e < a.hd; ++e) dot += o[e] * d[e];
            const float l = lh[i0 + ii];
            int64_t j = 0;
#if MSLLM_VW > 0
            const vf vl = set1(l), vd = set1(dot);
            for (; j + kVW <= lim; j += kVW) {
              const vf e = simd::exp_v(loadu(prow + j) - vl);
              storeu(prow + j, e);
              storeu(drow + j, e * (loadu(drow + j) - vd));
            }
#endif
            for (; j < lim; ++j) {
              prow[j] = exp1(prow[j] - l);
              drow[j] = prow[j] * (drow[j] - dot);
            }
            for (j = lim; j < n; ++j) prow[j] = drow[j] = 0.f;
          }
          gemm(ds.data(), a.s, 1, ku, a.hd, dqh + i0 * a.hd, a.hd, m, a.hd, n, false);      // dq = dS k
          gemm(ds.data(), 1, a.s, qh + i0 * a.hd, a.hd, dku, a.hd, n, a.hd, m, true);       // dk += dSᵀ q
          gemm(p.data(), 1, a.s, doh + i0 * a.hd, a.hd, dvu, a.hd, n, a.hd, m, true);      // dv += Pᵀ dout
        }
      }
    }
  });
  return kOk;
}

// The layer-at-a-time train step's host side (tasks/training/layerwise.py, called through ctypes, not a MindSpore op):
// a graph's gradient output `src` written (or, `accumulate`, added) into the step's gradient array `dst`, n floats,
// returning Σ dst² in float64 when `square` (0 otherwise): one pass over the gradient where NumPy took a copy and,
// before the update, a second pass for the global norm (135M parameters: ~165 ms of a 2 s step on one thread while
// both cores' pool waited, 2-core Xeon). Fixed blocks of kPutBlock floats; in each, runs of kPutRun floats summed in
// float32 vector lanes (1024 / the vector width terms a lane), each run's sum added in float64, in order; the blocks
// summed in order: the same bits at any thread count (not across ISA bodies: their lanes differ).
namespace {
constexpr int64_t kPutBlock = 1 << 14, kPutRun = 1024;

// block(b, e) over n floats in fixed blocks of kPutBlock, 8 blocks a thread at least; the blocks' results summed in
// block order (the same bits at any thread count)
template <typename F>
double over_blocks(int64_t n, F block) {
  const int64_t blocks = (n + kPutBlock - 1) / kPutBlock;
  std::vector<double> sums(blocks, 0.0);
  parallel_for(blocks, 8, [&](int64_t bb, int64_t be) {  // 8 blocks (512 KiB) a thread at least
    for (int64_t k = bb; k < be; ++k) sums[k] = block(k * kPutBlock, std::min(n, (k + 1) * kPutBlock));
  });
  double total = 0.0;
  for (double v : sums) total += v;
  return total;
}

double put_block(float *dst, const float *src, int64_t b, int64_t e, bool accumulate, bool square) {
  double total = 0.0;
  for (int64_t c = b; c < e; c += kPutRun) {  // runs of kPutRun floats: squares summed in float, runs in float64
    const int64_t ce = std::min(e, c + kPutRun);
    int64_t j = c;
    float run = 0.f;
#if MSLLM_VW > 0
    vf acc = simd::zero();
    for (; j + kVW <= ce; j += kVW) {
      vf v = loadu(src + j);
      if (accumulate) v = v + loadu(dst + j);
      storeu(dst + j, v);
      if (square) acc = simd::fma(v, v, acc);
    }
    run = simd::hsum(acc);
#endif
    for (; j < ce; ++j) {
      const float v = accumulate ? dst[j] + src[j] : src[j];
      dst[j] = v;
      if (square) run += v * v;
    }
    total += run;
  }
  return square ? total : 0.0;
}
}  // namespace

extern "C" double MsllmGradPut(float *dst, const float *src, int64_t n, int accumulate, int square) {
  if (dst == nullptr || src == nullptr || n <= 0) return 0.0;
  return over_blocks(n, [&](int64_t b, int64_t e) { return put_block(dst, src, b, e, accumulate != 0, square != 0); });
}

// The layer-at-a-time step's embedding gradient (host side, through ctypes): e [rows, h] (zeroed first when `zero`)
// += dx [n, h] row i onto row ids[i], the tokens in order; Σ e² in float64 into *sumsq when `square` (the whole
// array: a tied head's gradient is in it too). NumPy's argsort / unique / reduceat / fancy add and a separate norm
// pass took ~8 ms of a ~0.3 s tiny-llama-bench step. Columns split in fixed blocks of kEmbedCols (each element sums
// its tokens in token order) and the squares as MsllmGradPut's (fixed blocks and runs): the same bits at any thread
// count. Returns kOk, or kShape (nothing written) where an id is outside [0, rows) or a size is not positive.
namespace {
constexpr int64_t kEmbedCols = 64;

double square_block(const float *a, int64_t b, int64_t e) {
  double total = 0.0;
  for (int64_t c = b; c < e; c += kPutRun) total += sum_squares(a + c, std::min(e, c + kPutRun) - c);
  return total;
}
}  // namespace

extern "C" int MsllmEmbedGrad(float *e, int64_t rows, int64_t h, const float *dx, const int32_t *ids, int64_t n,
                              int zero, int square, double *sumsq) {
  if (e == nullptr || dx == nullptr || ids == nullptr || rows <= 0 || h <= 0 || n < 0) return kShape;
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= rows) return kShape;
  const int64_t total = rows * h;
  if (zero)
    over_blocks(total, [&](int64_t b, int64_t end) {
      std::memset(e + b, 0, static_cast<size_t>(end - b) * sizeof(float));
      return 0.0;
    });
  const int64_t cols = (h + kEmbedCols - 1) / kEmbedCols;
  parallel_for(cols, 1, [&](int64_t cb, int64_t ce) {
    const int64_t c0 = cb * kEmbedCols, c1 = std::min(h, ce * kEmbedCols);
    for (int64_t i = 0; i < n; ++i) {
      float *dst = e + static_cast<int64_t>(ids[i]) * h;
      const float *src = dx + i * h;
      int64_t j = c0;
#if MSLLM_VW > 0
      for (; j + kVW <= c1; j += kVW) storeu(dst + j, loadu(dst + j) + loadu(src + j));
#endif
      for (; j < c1; ++j) dst[j] += src[j];
    }
  });
  if (sumsq != nullptr)
    *sumsq = square ? over_blocks(total, [&](int64_t b, int64_t end) { return square_block(e, b, end); }) : 0.0;
  return kOk;
}

