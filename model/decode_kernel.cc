// One LLaMA decode step (batch 1, one token) as one call with MindSpore's "aot" custom-op signature on CPU; and the
// prefill's causal attention of a prompt chunk over the same caches (ChunkAttention, at the end of this file: a
// MindSpore custom op in CachedDecoder's chunk graph).
//
// Built by model/kernel_build.py once per ISA level (model/simd.h), the level chosen at load from what the CPU
// reports. The whole-model steps are called through ctypes on the caller's thread (model/fused_decode.py
// FusedDecodeStep, which fills the operand tables an aot op would get): as a MindSpore op they ran on MindSpore's
// actor thread while the caller slept, and lost a third of their speed beside a niced process (docs/KERNELS.md).
// The step reads the net's own fp32 Parameters (no copies, so weights never go stale) and writes the
// new token's K/V rows into the decoder's cache Parameters in place, then returns the logits [1, V].
// Same math as CachedDecoder.construct with T = 1 (RMSNorm, rotate-half RoPE, scaled dot-product
// attention over slots 0..pos, SwiGLU MLP, final norm, LM head); only the order of float sums differs.
//
// Inputs, in order (n = number of layers):
//   0 token int32 [1, 1]      1 pos int32 []          2 consts float32 [3]: eps, attention scale, threads
//   3 embed [V, H]            4 final norm [H]        5 lm head [V, H] (the embedding when tied)
//   6 cos [S_rope, hd]        7 sin [S_rope, hd]
//   8 + 9 * l + (0..8): input norm, q [nh*hd, H], k [nkv*hd, H], v [nkv*hd, H], o [H, nh*hd],
//                       post norm, gate [F, H], up [F, H], down [H, F]
//   8 + 9 * n + l: k cache [nkv, S, hd]       8 + 10 * n + l: v cache [nkv, S, hd]
// Output: logits float32 [1, V].
//
// Parallel over rows of every projection (and over heads in attention) on a pool of threads started once
// (`Pool`, `on_pool`), a barrier between dependent phases (4 per layer). PrefillStep (a chunk, logits of one row) and
// ScoreStep (every row's logits) take the same operands with tokens [1, T] and [start, last]; the matrices may be
// float32, binary16 or Q8_0 blocks (uint8), all alike. Caches [NS, nkv, S, hd] hold NS sequences, one per slot:
// BatchDecodeStep decodes one token of each of B of them in one step (tokens [B], [B, 2] of slot and position,
// logits [B, V]), PrefillStep / ScoreStep take [start, last, slot].
//
// The operands are checked before anything is read (count, dtypes, every weight's shape against the
// embedding's [V, H] and the first layer's sizes, the caches' [nkv, S, hd]); a mismatch returns 2 (dtype)
// or 3 (shape), a token or position out of range 4 (model/kernels.py names the codes).

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <mutex>
#include <new>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <type_traits>
#include <vector>

#include "simd.h"
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <pthread.h>
#include <unistd.h>
#endif

namespace {

inline void split(int64_t n, int t, int nt, int64_t *b, int64_t *e) {
  int64_t chunk = n / nt, rem = n % nt;
  *b = t * chunk + (t < rem ? t : rem);
  *e = *b + chunk + (t < rem ? 1 : 0);
}

// fn(t, nt) on nt = threads std::threads (the caller is thread 0), joined before returning
template <typename F>
void on_threads(int threads, F fn) {
  std::vector<std::thread> workers;
  for (int t = 1; t < threads; ++t) workers.emplace_back(fn, t, threads);
  fn(0, threads > 1 ? threads : 1);
  for (auto &w : workers) w.join();
}

// How long a waiting thread spins before it sleeps (the pool's workers between calls, a barrier, the caller waiting
// for its workers). Any sleep on a shared CPU is costly under Linux's EEVDF scheduler (6.6+): the thread it woke
// waits for the slice of whatever took its core, a `nice -n 19` process included; two normal processes that slept
// 0.2 ms in every 2 ms kept only 0.54 of a core each beside one niced busy loop, which took 0.88
// (docs/MINDSPORE_CPU.md, "Threads"). And a thread that never sleeps still loses its core to a niced process for
// its fair share, a slice at a time, until the next scheduler tick (4 ms at HZ=250, 10 at HZ=100): a partner that
// stops spinning sooner sleeps, and its wake-up waits again. So the wait spins longer than a tick. Measured
// (SmolLM2-135M fp32, 2 threads, the Xeon VM, 6 alternated rounds beside one niced busy loop; docs/KERNELS.md):
// 2,000 pauses (21 us) 40-48% slower; 500 us 6-11% in one run, 62-64% in another (thousands of sleeps a sequence);
// 10 ms 4-7% (no sleep); spinning 0.5 ms and then yielding up to 10 ms, 6-7%. Quiet speed the same for all.
#ifndef MSLLM_SPIN_US
#define MSLLM_SPIN_US 10000
#endif

// Wait while `a` holds `v`: spin (a pause each) for up to MSLLM_SPIN_US, then sleep on it (a futex on Linux, woken
// by `wake_all`; elsewhere a yield loop). A nonzero `*stop` ends the spin at once (`Pool::park`).
inline void await_change(std::atomic<int> &a, int v, const std::atomic<int> *stop = nullptr) {
  for (int s = 0; s < 64; ++s) {  // most waits inside a step end here, before any clock read
    if (a.load(std::memory_order_acquire) != v) return;
    simd::cpu_relax();
  }
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(MSLLM_SPIN_US);
  for (int s = 0;; ++s) {
    if (a.load(std::memory_order_acquire) != v) return;
    simd::cpu_relax();
    if ((s & 63) == 63 && (std::chrono::steady_clock::now() >= until ||
                           (stop != nullptr && stop->load(std::memory_order_relaxed) != 0)))
      break;
  }
  while (a.load(std::memory_order_acquire) == v) {
#ifdef __linux__
    syscall(SYS_futex, reinterpret_cast<int *>(&a), FUTEX_WAIT_PRIVATE, v, nullptr, nullptr, 0);
#else
    std::this_thread::yield();
#endif
  }
}
inline void wake_all(std::atomic<int> &a) {
#ifdef __linux__
  syscall(SYS_futex, reinterpret_cast<int *>(&a), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
#else
  (void)a;
#endif
}

// A barrier for the pool's threads: the decode step's phases (4 a layer, ~10-100 us each on 2 threads) meet here;
// the last to arrive advances the generation and wakes any sleeper.
class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void wait() {
    if (n_ <= 1) return;
    const int gen = gen_.load(std::memory_order_acquire);
    if (count_.fetch_add(1, std::memory_order_acq_rel) == n_ - 1) {
      count_.store(0, std::memory_order_relaxed);
      gen_.fetch_add(1, std::memory_order_release);
      wake_all(gen_);
      return;
    }
    await_change(gen_, gen);
  }

 private:
  const int n_;
  std::atomic<int> count_{0}, gen_{0};
};

// The whole-model steps' threads: workers started once and kept (process-wide), the caller thread 0. A call wakes
// them, runs its share, and waits until every worker has finished (so the next call never overlaps a straggler);
// between tokens they spin (await_change: up to MSLLM_SPIN_US), then sleep; at a sequence's end the caller parks
// them (`park`: they sleep at once). What it replaced, measured on SmolLM2-135M
// in Q8_0, 2 threads, AMD EPYC (docs/KERNELS.md): OpenMP's parallel region (as a MindSpore op its threads slept a third
// of each token in the barriers: 130 tokens/s against ~180 through ctypes), then std::threads started per call with a
// spin-then-yield barrier (~220 quiet, but 100-121 beside one `nice -n 19` busy loop: a thread started per token, or
// yielding, waits behind the niced process).
class Pool {
 public:
  template <typename F>
  void run(int nt, F &fn) {
    if (nt <= 1) {
      fn(0, 1);
      return;
    }
    std::lock_guard<std::mutex> one(call_);
    while (workers_ < nt - 1) {
      const int t = ++workers_, start = job_.load(std::memory_order_acquire);
      std::thread([this, t, start] { loop(t, start); }).detach();
    }
    call_fn_ = [](void *f, int t, int n) { (*static_cast<F *>(f))(t, n); };
    ctx_ = &fn;
    nt_ = nt;
    park_.store(0, std::memory_order_relaxed);
    pending_.store(workers_, std::memory_order_relaxed);
    job_.fetch_add(1, std::memory_order_release);
    wake_all(job_);
    fn(0, nt);
    for (int p; (p = pending_.load(std::memory_order_acquire)) != 0;) await_change(pending_, p);
  }
  // The sequence is over (the caller knows; the pool does not): the workers waiting for the next call sleep now
  // instead of spinning MSLLM_SPIN_US. Measured beside one `nice -n 19` busy loop (the demo's `small` shape, 128
  // tokens, 2 threads, the Xeon VM): after the 10 ms spin that followed every sequence, the next sequence started
  // 0.3 s later lost 25-45% of its speed (the niced loop got 0.2-0.4 of a core during it, against 0-0.06 once
  // decoding steadily), one started at once 0-6%: Linux's EEVDF puts a thread that ran far past its fair share
  // before it slept (the spin, while the niced loop waited) as far behind when it wakes. A call in flight
  // (another thread's) is left alone.
  void park() {
    if (!call_.try_lock()) return;
    park_.store(1, std::memory_order_relaxed);
    call_.unlock();
  }
  // after fork(): the child has none of the workers (tasks/ forks data-pool workers), and a lock its parent's other
  // thread held stays held in it: start afresh
  void forget() {
    workers_ = 0;
    new (&call_) std::mutex();
    pending_.store(0);
  }

 private:
  void loop(int t, int seen) {  // `seen`: the job count when it was started (the job being set up is new to it)
    for (;;) {
      await_change(job_, seen, &park_);
      seen = job_.load(std::memory_order_acquire);
      if (t < nt_) call_fn_(ctx_, t, nt_);
      if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) wake_all(pending_);
    }
  }
  std::mutex call_;
  int workers_ = 0, nt_ = 1;
  void (*call_fn_)(void *, int, int) = nullptr;
  void *ctx_ = nullptr;
  std::atomic<int> job_{0}, pending_{0}, park_{0};
};

Pool &pool() {
  static Pool *p = [] {
    auto *q = new Pool();  // never destroyed: detached workers may still sleep in it at exit
#ifdef __linux__
    pthread_atfork(nullptr, nullptr, [] { pool().forget(); });
#endif
    return q;
  }();
  return *p;
}

// fn(t, nt) on `threads` pool threads (the caller is thread 0), all finished before returning
template <typename F>
void on_pool(int threads, F fn) {
  pool().run(threads > 1 ? threads : 1, fn);
}

// s + a * b for the dot products' scalar tails: in the SIMD bodies one explicit fused multiply-add, so every
// inlined copy of a tail (dot alone, the batched tiles below) rounds the same way whatever the compiler would
// contract or vectorize there; the scalar body keeps its plain expression
#if MSLLM_VW > 0
inline float mul_add(float a, float b, float s) { return std::fma(a, b, s); }
#else
inline float mul_add(float a, float b, float s) { return s + a * b; }
#endif

inline float dot(const float *a, const float *b, int64_t n) {
  int64_t j = 0;
  float s = 0.f;
#if MSLLM_VW > 0
  using simd::loadu;
  constexpr int64_t W = simd::kVW;
  simd::vf acc0 = simd::zero(), acc1 = simd::zero();
  for (; j + 2 * W <= n; j += 2 * W) {
    acc0 = simd::fma(loadu(a + j), loadu(b + j), acc0);
    acc1 = simd::fma(loadu(a + j + W), loadu(b + j + W), acc1);
  }
  for (; j + W <= n; j += W) acc0 = simd::fma(loadu(a + j), loadu(b + j), acc0);
  s = simd::hsum(acc0 + acc1);
#endif
  for (; j < n; ++j) s = mul_add(a[j], b[j], s);
  return s;
}

// The weight matrices are float32 or IEEE binary16 (`half`: GGUF's F16, half the bytes a token reads); every
// product and sum is float32 either way, each binary16 weight widened exactly as it is loaded.
using half = uint16_t;
inline float widen(float w) { return w; }
inline float widen(half w) { return simd::half_to_float(w); }
#if MSLLM_VW > 0
inline simd::vf loadw(const float *p) { return simd::loadu(p); }
inline simd::vf loadw(const half *p) { return simd::load_h(p); }
#endif

// a . b for binary16 a (dot's order: two vector accumulators, then the tail)
inline float dot(const half *a, const float *b, int64_t n) {
  int64_t j = 0;
  float s = 0.f;
#if MSLLM_VW > 0
  constexpr int64_t W = simd::kVW;
  simd::vf acc0 = simd::zero(), acc1 = simd::zero(), acc2 = simd::zero(), acc3 = simd::zero();
  for (; j + 4 * W <= n; j += 4 * W) {
    acc0 = simd::fma(loadw(a + j), simd::loadu(b + j), acc0);
    acc1 = simd::fma(loadw(a + j + W), simd::loadu(b + j + W), acc1);
    acc2 = simd::fma(loadw(a + j + 2 * W), simd::loadu(b + j + 2 * W), acc2);
    acc3 = simd::fma(loadw(a + j + 3 * W), simd::loadu(b + j + 3 * W), acc3);
  }
  acc0 = acc0 + acc2;
  acc1 = acc1 + acc3;
  for (; j + 2 * W <= n; j += 2 * W) {
    acc0 = simd::fma(loadw(a + j), simd::loadu(b + j), acc0);
    acc1 = simd::fma(loadw(a + j + W), simd::loadu(b + j + W), acc1);
  }
  for (; j + W <= n; j += W) acc0 = simd::fma(loadw(a + j), simd::loadu(b + j), acc0);
  s = simd::hsum(acc0 + acc1);
#endif
  for (; j < n; ++j) s = mul_add(widen(a[j]), b[j], s);
  return s;
}

// GGUF's Q8_0: 32 weights as int8 with one binary16 scale d (weight = d * q), 34 bytes, laid out as ggml's
// block_q8_0; a row of n weights is n / 32 blocks. Each block's 32 products are summed in float32, then added
// times d.
struct Q8Block {
  uint16_t d;
  int8_t qs[32];
};
static_assert(sizeof(Q8Block) == 34, "block_q8_0 is 34 bytes");
constexpr int64_t kQ8 = 32;

// row r of a row-major matrix of n weights per row (n / 32 blocks for Q8_0)
template <typename WT>
inline const WT *row_of(const WT *W, int64_t r, int64_t n) {
  if constexpr (std::is_same_v<WT, Q8Block>) return W + r * (n / kQ8);
  else return W + r * n;
}
// weight k of a row, as a float
inline float weight_at(const float *row, int64_t k) { return row[k]; }
inline float weight_at(const half *row, int64_t k) { return widen(row[k]); }
inline float weight_at(const Q8Block *row, int64_t k) {
  return simd::half_to_float(row[k / kQ8].d) * static_cast<float>(row[k / kQ8].qs[k % kQ8]);
}

// a . x for a row of Q8_0 blocks and float x: the scalar body's prompt GEMM (gemm_rows); the SIMD bodies pack the
// dequantized weights into panels instead, and every decode GEMV takes the int8 path below
inline float dot(const Q8Block *a, const float *x, int64_t n) {
  float s = 0.f;
  for (int64_t k = 0; k < n / kQ8; ++k) {
    const float *xb = x + k * kQ8;
    float b = 0.f;
    for (int64_t j = 0; j < kQ8; ++j) b += static_cast<float>(a[k].qs[j]) * xb[j];
    s += simd::half_to_float(a[k].d) * b;
  }
  return s;
}

// y[r] (+)= W[r, :] . x for r in [r0, r1); W row-major [rows, n]. Four rows at a time share each load of x.
// MindSpore's Parameters are only 16-byte aligned: a 64-byte load from them would straddle two cache lines
// (half the load throughput), so each row group first takes the floats up to W's next 64-byte boundary with
// a masked load, then loads W aligned (rows of n % 16 == 0 floats share one alignment).
// Binary16 W: four rows at a time as well, each vector of a row widened as it is loaded (no alignment step: a
// 64-byte line holds 32 halves, two AVX-512 vectors).
// a float buffer of at least n floats in v, from a 64-byte boundary (a row of a multiple of 16 floats then starts a
// cache line: unaligned vector loads that straddle two lines would halve a tile's load throughput)
inline float *aligned64(std::vector<float> &v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n + 16) v.resize(n + 16);
  return v.data() + (16 - reinterpret_cast<uintptr_t>(v.data()) / 4 % 16) % 16;
}

// y[0..4) = (or +=) four rows' sums
inline void store4(float *y, float s0, float s1, float s2, float s3, bool accumulate) {
  if (accumulate) {
    y[0] += s0; y[1] += s1; y[2] += s2; y[3] += s3;
  } else {
    y[0] = s0; y[1] = s1; y[2] = s2; y[3] = s3;
  }
}

// The next row group's bytes, read in order: the GEMVs below take four rows at a time, four interleaved streams a
// few hundred bytes apart that the hardware prefetchers follow poorly (a Q8_0 GEMV at SmolLM2's 576-weight rows
// read 12 GB/s on one Zen 4 core, 26 GB/s with this); the four rows after them are contiguous, so each step
// prefetches its share of them, `bytes` from `p` (a whole number of 64-byte lines, at least one).
inline void prefetch_span(const void *p, int64_t bytes) {
#if MSLLM_VW == 16 || MSLLM_VW == 8
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(static_cast<const char *>(p) + o, _MM_HINT_T0);
#else
  (void)p; (void)bytes;
#endif
}

#if MSLLM_VW == 16
// Four float rows from w0 (rows of n % 16 == 0 floats, w0's first `head` floats up to a 64-byte boundary) times NV
// vectors, s[i * NV + v]: gemv_rows' AVX-512 group (NV = 1: the rows are read from memory, the next four prefetched)
// and the batched step's (each loaded weight vector multiplies all NV; every (row, vector) the same sums as NV = 1)
template <int NV>
inline void rows4_many(const float *w0, int64_t n, int64_t head, const float *const *X, bool prefetch, float *s) {
  const float *w1 = w0 + n, *w2 = w1 + n, *w3 = w2 + n;
  const __mmask16 hm = static_cast<__mmask16>((1u << head) - 1), tm = static_cast<__mmask16>((1u << (16 - head)) - 1);
  __m512 a0[NV], a1[NV], a2[NV], a3[NV];
  {
    const __m512 h0 = _mm512_maskz_loadu_ps(hm, w0), h1 = _mm512_maskz_loadu_ps(hm, w1);
    const __m512 h2 = _mm512_maskz_loadu_ps(hm, w2), h3 = _mm512_maskz_loadu_ps(hm, w3);
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const __m512 xv = _mm512_maskz_loadu_ps(hm, X[v]);
      a0[v] = _mm512_mul_ps(h0, xv);
      a1[v] = _mm512_mul_ps(h1, xv);
      a2[v] = _mm512_mul_ps(h2, xv);
      a3[v] = _mm512_mul_ps(h3, xv);
    }
  }
  int64_t j = head;
  const float *next = w0 + 4 * n;
  for (; j + 16 <= n; j += 16) {
    if (prefetch) prefetch_span(next + 4 * j, 4 * 16 * sizeof(float));
    const __m512 v0 = _mm512_load_ps(w0 + j), v1 = _mm512_load_ps(w1 + j);
    const __m512 v2 = _mm512_load_ps(w2 + j), v3 = _mm512_load_ps(w3 + j);
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const __m512 xv = _mm512_loadu_ps(X[v] + j);
      a0[v] = _mm512_fmadd_ps(v0, xv, a0[v]);
      a1[v] = _mm512_fmadd_ps(v1, xv, a1[v]);
      a2[v] = _mm512_fmadd_ps(v2, xv, a2[v]);
      a3[v] = _mm512_fmadd_ps(v3, xv, a3[v]);
    }
  }
  if (head) {
    const __m512 v0 = _mm512_maskz_load_ps(tm, w0 + j), v1 = _mm512_maskz_load_ps(tm, w1 + j);
    const __m512 v2 = _mm512_maskz_load_ps(tm, w2 + j), v3 = _mm512_maskz_load_ps(tm, w3 + j);
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const __m512 xv = _mm512_maskz_loadu_ps(tm, X[v] + j);
      a0[v] = _mm512_fmadd_ps(v0, xv, a0[v]);
      a1[v] = _mm512_fmadd_ps(v1, xv, a1[v]);
      a2[v] = _mm512_fmadd_ps(v2, xv, a2[v]);
      a3[v] = _mm512_fmadd_ps(v3, xv, a3[v]);
    }
  }
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) {
    s[0 * NV + v] = _mm512_reduce_add_ps(a0[v]);
    s[1 * NV + v] = _mm512_reduce_add_ps(a1[v]);
    s[2 * NV + v] = _mm512_reduce_add_ps(a2[v]);
    s[3 * NV + v] = _mm512_reduce_add_ps(a3[v]);
  }
}
#endif

template <typename WT>
inline void gemv_rows(const WT *W, const float *x, float *y, int64_t n, int64_t r0, int64_t r1, bool accumulate) {
  int64_t r = r0;
#if MSLLM_VW == 16  // AVX-512: the masked loads have no portable spelling
  if (std::is_same_v<WT, float> && n % 16 == 0 && n >= 16 && reinterpret_cast<uintptr_t>(W) % 4 == 0) {
    for (; r + 4 <= r1; r += 4) {
      const float *w0 = reinterpret_cast<const float *>(W) + r * n;
      const int64_t head = ((64 - reinterpret_cast<uintptr_t>(w0) % 64) % 64) / 4;  // 0..15 floats
      float s[4];
      rows4_many<1>(w0, n, head, &x, true, s);
      store4(y + r, s[0], s[1], s[2], s[3], accumulate);
    }
  }
#endif
  for (; r < r1; ++r) {
    // rows one at a time through `dot` (binary16 rows in every body, float32 ones in AVX2's; the batched step's
    // `rows_dot` sums each row the same way: a sequence's logits are the same bits alone and in a batch), each
    // fetching the row two ahead as it starts. SmolLM2-135M decode, 2 threads, on the 2-core Xeon VM (2026-12-05):
    // fp16 45-51 -> 62-73 tokens/s (AVX2 and AVX-512 bodies alike), fp32 with the AVX2 body 29-31 -> 35-37
    if (r + 2 < r1) prefetch_span(W + (r + 2) * n, n * sizeof(WT) / 64 * 64);
    float s = dot(row_of(W, r, n), x, n);
    y[r] = accumulate ? y[r] + s : s;
  }
}

// Q8_0 weights times Q8_0 activations, as ggml computes a Q8_0 matrix-vector product (its vec_dot_type for Q8_0):
// x is quantized per 32-value block as ggml's quantize_row_q8_0 does it (amax over the block, id = 127 / amax,
// q = x * id rounded to nearest, ties to even, in [-127, 127]; the block's scale d = amax / 127 stored as binary16),
// then each block's 32 products are an exact int32 sum, times d_w * d_x in float32. A token's decode reads 34 bytes
// per 32 weights and does one float multiply-add per block; the activation's rounding (at most d_x / 2 a value) is
// the one error the float path does not have. The prefill's GEMM keeps float activations (it is compute-bound).
struct Q8Act {
  std::vector<int8_t> q;  // n values
  std::vector<float> d;   // n / 32 scales, each exactly a binary16 value
};

inline void quantize_q8(const float *x, int64_t n, Q8Act &a) {
  a.q.resize(n);
  a.d.resize(n / kQ8);
  for (int64_t k = 0; k < n / kQ8; ++k) {
    const float *xb = x + k * kQ8;
    float amax = 0.f;
    for (int64_t j = 0; j < kQ8; ++j) amax = std::fabs(xb[j]) > amax ? std::fabs(xb[j]) : amax;
    const float id = amax != 0.f ? 127.f / amax : 0.f;
    a.d[k] = simd::half_to_float(simd::float_to_half(amax / 127.f));
    int8_t *q = a.q.data() + k * kQ8;
    for (int64_t j = 0; j < kQ8; ++j) q[j] = static_cast<int8_t>(std::nearbyint(xb[j] * id));
  }
}

// the int32 sum of 32 int8 products
inline int32_t block_dot(const int8_t *w, const int8_t *x) {
  int32_t s = 0;
  for (int64_t j = 0; j < kQ8; ++j) s += static_cast<int32_t>(w[j]) * static_cast<int32_t>(x[j]);
  return s;
}

#if MSLLM_VW == 16 || MSLLM_VW == 8
// 32 int8 products of one block, summed in pairs into 8 int32 lanes, as floats: maddubs multiplies unsigned by
// signed bytes, so x's signs move onto w (|x| <= 127 and |w| <= 128: each pair sum fits int16 exactly)
inline __m256 block_dot8(const int8_t *w, __m256i ax, __m256i sx) {
  const __m256i qw = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(w));
  const __m256i p16 = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(qw, sx));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}
inline float hsum8(__m256 v) {  // lane 0 first, as simd::hsum
  float s = v[0];
  for (int i = 1; i < 8; ++i) s += v[i];
  return s;
}
#endif

// y[r] (+)= W[r, :] . x for r in [r0, r1), W Q8_0 blocks [rows, n / 32], x given as its Q8_0 blocks `a`
// (quantize_q8). Four rows at a time share each block of x.
inline void gemv_rows_q(const Q8Block *W, const Q8Act &a, float *y, int64_t n, int64_t r0, int64_t r1, bool accumulate) {
  const int64_t nb = n / kQ8;
  int64_t r = r0;
#if MSLLM_VW == 16 || MSLLM_VW == 8
  for (; r + 4 <= r1; r += 4) {
    const Q8Block *b0 = W + r * nb, *b1 = b0 + nb, *b2 = b1 + nb, *b3 = b2 + nb;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t k = 0; k < nb; ++k) {
      const __m256i sx = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(a.q.data() + k * kQ8));
      const __m256i ax = _mm256_sign_epi8(sx, sx);
      const float dx = a.d[k];
      prefetch_span(reinterpret_cast<const char *>(b0 + 4 * nb) + k * 4 * sizeof(Q8Block), 192);  // 136 bytes a step
      a0 = _mm256_fmadd_ps(block_dot8(b0[k].qs, ax, sx), _mm256_set1_ps(simd::half_to_float(b0[k].d) * dx), a0);
      a1 = _mm256_fmadd_ps(block_dot8(b1[k].qs, ax, sx), _mm256_set1_ps(simd::half_to_float(b1[k].d) * dx), a1);
      a2 = _mm256_fmadd_ps(block_dot8(b2[k].qs, ax, sx), _mm256_set1_ps(simd::half_to_float(b2[k].d) * dx), a2);
      a3 = _mm256_fmadd_ps(block_dot8(b3[k].qs, ax, sx), _mm256_set1_ps(simd::half_to_float(b3[k].d) * dx), a3);
    }
    const float s0 = hsum8(a0), s1 = hsum8(a1), s2 = hsum8(a2), s3 = hsum8(a3);
    store4(y + r, s0, s1, s2, s3, accumulate);
  }
#endif
  for (; r < r1; ++r) {
    const Q8Block *b = W + r * nb;
    float s = 0.f;
    for (int64_t k = 0; k < nb; ++k)
      s += simd::half_to_float(b[k].d) * a.d[k] * static_cast<float>(block_dot(b[k].qs, a.q.data() + k * kQ8));
    y[r] = accumulate ? y[r] + s : s;
  }
}

// The same with x quantized once per call (this thread's copy: n values, negligible beside the rows' n bytes each).
inline void gemv_rows(const Q8Block *W, const float *x, float *y, int64_t n, int64_t r0, int64_t r1, bool accumulate) {
  thread_local Q8Act a;
  quantize_q8(x, n, a);
  gemv_rows_q(W, a, y, n, r0, r1, accumulate);
}

// Rows [r0, r1) of W times each of B vectors: Y[b] (+)= W[r0:r1] . X[b] (X rows of n, Y rows of `ys`). Register
// blocked: a group of rows is loaded once per step for up to kNV vectors (each loaded weight vector multiplies every
// one of them), and the group's rows stay in L1 while every vector passes over them, so the weights are read from
// memory once and from L1, not L2, for the B - 1 after the first. Each (row, vector) is still summed exactly as
// gemv_rows sums it over [r0, r1) (the same groups of 4 rows from r0 on AVX-512, the same accumulators, steps,
// masks, reduction and tail), so a sequence's logits do not depend on which others share the step.
#if MSLLM_VW > 0
constexpr int kNV = MSLLM_VW == 16 ? 4 : 2;  // vectors per pass of AVX-512's aligned 4-row groups (16 accumulators)
// rows x vectors per pass of the dot-product paths below (their accumulators must fit the registers: AVX-512 has 32)
constexpr int kDotRows = 2, kDotVecs = MSLLM_VW == 16 ? 4 : 2;
constexpr int kHalfRows = 1, kHalfVecs = MSLLM_VW == 16 ? 4 : 2;  // 4 accumulators a (row, vector)

// a[i] . X[v] for R rows and NV vectors (s[i * NV + v]), each exactly as dot(const float *, ...) computes it: two
// accumulators over steps of 2 vectors, one more step of one, hsum(acc0 + acc1), then the scalar tail
template <int R, int NV>
inline void dot_many(const float *const *a, const float *const *X, int64_t n, float *s) {
  constexpr int64_t W = simd::kVW;
  simd::vf acc0[R][NV], acc1[R][NV];
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc0[i][v] = acc1[i][v] = simd::zero();
  int64_t j = 0;
  for (; j + 2 * W <= n; j += 2 * W) {
    simd::vf w0[R], w1[R];
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) w0[i] = simd::loadu(a[i] + j), w1[i] = simd::loadu(a[i] + j + W);
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const simd::vf x0 = simd::loadu(X[v] + j), x1 = simd::loadu(X[v] + j + W);
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) {
        acc0[i][v] = simd::fma(w0[i], x0, acc0[i][v]);
        acc1[i][v] = simd::fma(w1[i], x1, acc1[i][v]);
      }
    }
  }
  for (; j + W <= n; j += W)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const simd::vf x0 = simd::loadu(X[v] + j);
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) acc0[i][v] = simd::fma(simd::loadu(a[i] + j), x0, acc0[i][v]);
    }
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      float t = simd::hsum(acc0[i][v] + acc1[i][v]);
      for (int64_t k = j; k < n; ++k) t = mul_add(a[i][k], X[v][k], t);
      s[i * NV + v] = t;
    }
}

// the same for binary16 rows, each exactly as dot(const half *, ...) computes it: four accumulators over steps of 4
// vectors, folded to two, steps of 2 and of 1, hsum(acc0 + acc1), the scalar tail. T = float: rows widened from
// binary16 beforehand (widening is exact, so the sums are the same bits), each weight converted once for all NV
template <int R, int NV, typename T>
inline void dot_many_h(const T *const *a, const float *const *X, int64_t n, float *s) {
  constexpr int64_t W = simd::kVW;
  simd::vf acc0[R][NV], acc1[R][NV], acc2[R][NV], acc3[R][NV];
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc0[i][v] = acc1[i][v] = acc2[i][v] = acc3[i][v] = simd::zero();
  int64_t j = 0;
  for (; j + 4 * W <= n; j += 4 * W) {
    simd::vf w0[R], w1[R], w2[R], w3[R];
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) {
      w0[i] = loadw(a[i] + j), w1[i] = loadw(a[i] + j + W);
      w2[i] = loadw(a[i] + j + 2 * W), w3[i] = loadw(a[i] + j + 3 * W);
    }
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) {
        acc0[i][v] = simd::fma(w0[i], simd::loadu(X[v] + j), acc0[i][v]);
        acc1[i][v] = simd::fma(w1[i], simd::loadu(X[v] + j + W), acc1[i][v]);
        acc2[i][v] = simd::fma(w2[i], simd::loadu(X[v] + j + 2 * W), acc2[i][v]);
        acc3[i][v] = simd::fma(w3[i], simd::loadu(X[v] + j + 3 * W), acc3[i][v]);
      }
  }
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      acc0[i][v] = acc0[i][v] + acc2[i][v];
      acc1[i][v] = acc1[i][v] + acc3[i][v];
    }
  for (; j + 2 * W <= n; j += 2 * W)
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) {
      const simd::vf w0 = loadw(a[i] + j), w1 = loadw(a[i] + j + W);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        acc0[i][v] = simd::fma(w0, simd::loadu(X[v] + j), acc0[i][v]);
        acc1[i][v] = simd::fma(w1, simd::loadu(X[v] + j + W), acc1[i][v]);
      }
    }
  for (; j + W <= n; j += W)
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) {
      const simd::vf w0 = loadw(a[i] + j);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc0[i][v] = simd::fma(w0, simd::loadu(X[v] + j), acc0[i][v]);
    }
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      float t = simd::hsum(acc0[i][v] + acc1[i][v]);
      for (int64_t k = j; k < n; ++k) t = mul_add(widen(a[i][k]), X[v][k], t);
      s[i * NV + v] = t;
    }
}


// y (+)= s
inline void put(float *y, float s, bool accumulate) { *y = accumulate ? *y + s : s; }

// R rows from r times NV vectors from b, each (row, vector) as dot computes it
template <typename WT, int R, int NV>
inline void dot_tile(const WT *W, const float *wide, const float *X, int64_t n, float *Y, int64_t ys, int64_t r,
                     int64_t b, bool accumulate) {
  const float *xs[NV];
  float s[R * NV];
  for (int v = 0; v < NV; ++v) xs[v] = X + (b + v) * n;
  if constexpr (std::is_same_v<WT, half>) {
    const float *rows[R];
    for (int i = 0; i < R; ++i) rows[i] = wide + i * n;
    dot_many_h<R, NV>(rows, xs, n, s);
  } else {
    const WT *rows[R];
    for (int i = 0; i < R; ++i) rows[i] = row_of(W, r + i, n);
    dot_many<R, NV>(rows, xs, n, s);
  }
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < NV; ++v) put(Y + (b + v) * ys + r + i, s[i * NV + v], accumulate);
}

// rows [r, r1) on the dot path (gemv_rows' rows outside its AVX-512 groups: dot per row), every vector: tiles of
// R rows x NV vectors, then the rows and vectors left over
template <typename WT, int R, int NV>
inline void rows_dot(const WT *W, const float *X, int64_t B, int64_t n, float *Y, int64_t ys, int64_t r, int64_t r1,
                     bool accumulate) {
  thread_local std::vector<float> scratch;  // binary16 rows widened once for all B vectors
  float *wide = nullptr;
  const auto widen_rows = [&](int64_t r, int k) {
    if constexpr (std::is_same_v<WT, half>) {
      wide = aligned64(scratch, R * n);
      if (r + 2 * k <= r1) prefetch_span(W + (r + 2 * k) * n, k * n * sizeof(half) / 64 * 64);  // the rows after next
      for (int i = 0; i < k; ++i) {
        const half *row = W + (r + i) * n;
        int64_t j = 0;
        for (; j + simd::kVW <= n; j += simd::kVW) simd::storeu(wide + i * n + j, loadw(row + j));
        for (; j < n; ++j) wide[i * n + j] = widen(row[j]);
      }
    }
  };
  for (; r + R <= r1; r += R) {
    widen_rows(r, R);
    int64_t b = 0;
    for (; b + NV <= B; b += NV) dot_tile<WT, R, NV>(W, wide, X, n, Y, ys, r, b, accumulate);
    for (; b < B; ++b) dot_tile<WT, R, 1>(W, wide, X, n, Y, ys, r, b, accumulate);
  }
  for (; r < r1; ++r) {
    widen_rows(r, 1);
    int64_t b = 0;
    for (; b + NV <= B; b += NV) dot_tile<WT, 1, NV>(W, wide, X, n, Y, ys, r, b, accumulate);
    for (; b < B; ++b) dot_tile<WT, 1, 1>(W, wide, X, n, Y, ys, r, b, accumulate);
  }
}
#endif

template <typename WT>
inline void gemv_batch(const WT *W, const float *X, int64_t B, int64_t n, float *Y, int64_t ys, int64_t r0, int64_t r1,
                       bool accumulate) {
#if MSLLM_VW > 0
  int64_t r = r0;
#if MSLLM_VW == 16
  if (std::is_same_v<WT, float> && n % 16 == 0 && n >= 16 && reinterpret_cast<uintptr_t>(W) % 4 == 0) {
    for (; r + 4 <= r1; r += 4) {  // gemv_rows' groups of four rows from r0
      const float *w0 = reinterpret_cast<const float *>(W) + r * n;
      const int64_t head = ((64 - reinterpret_cast<uintptr_t>(w0) % 64) % 64) / 4;
      int64_t b = 0;
      for (; b + kNV <= B; b += kNV) {
        const float *xs[kNV];
        float s[4 * kNV];
        for (int v = 0; v < kNV; ++v) xs[v] = X + (b + v) * n;
        rows4_many<kNV>(w0, n, head, xs, b == 0, s);
        for (int v = 0; v < kNV; ++v) store4(Y + (b + v) * ys + r, s[v], s[kNV + v], s[2 * kNV + v], s[3 * kNV + v], accumulate);
      }
      for (; b < B; ++b) {
        const float *xs[1] = {X + b * n};
        float s[4];
        rows4_many<1>(w0, n, head, xs, b == 0, s);
        store4(Y + b * ys + r, s[0], s[1], s[2], s[3], accumulate);
      }
    }
  }
#endif
  if constexpr (std::is_same_v<WT, float>) {
    rows_dot<WT, kDotRows, kDotVecs>(W, X, B, n, Y, ys, r, r1, accumulate);
  } else if constexpr (std::is_same_v<WT, half>) {
    rows_dot<WT, kHalfRows, kHalfVecs>(W, X, B, n, Y, ys, r, r1, accumulate);
  } else {
    for (int64_t b = 0; b < B; ++b) gemv_rows(W, X + b * n, Y + b * ys, n, r, r1, accumulate);
  }
#else
  for (int64_t b = 0; b < B; ++b) gemv_rows(W, X + b * n, Y + b * ys, n, r0, r1, accumulate);
#endif
}

// Q8_0: rows [r0, r1) a block of kBatchRows rows at a time for every vector (a block of Q8_0 rows fits L1: read
// from memory once, from L1 B - 1 times), each (row, vector) exactly as gemv_rows_q computes it; the B vectors
// quantized once by the caller (qa[b]), as gemv_rows quantizes each.
constexpr int64_t kBatchRows = 32;
inline void gemv_batch(const Q8Block *W, const Q8Act *qa, int64_t B, int64_t n, float *Y, int64_t ys, int64_t r0,
                       int64_t r1, bool accumulate) {
  for (int64_t r = r0; r < r1; r += kBatchRows) {
    const int64_t e = r + kBatchRows < r1 ? r + kBatchRows : r1;
    for (int64_t b = 0; b < B; ++b) gemv_rows_q(W, qa[b], Y + b * ys, n, r, e, accumulate);
  }
}

#if MSLLM_VW > 0
constexpr int64_t kNR = 2 * simd::kVW;       // weight rows per packed panel: two vectors of outputs per token
constexpr int kMR = MSLLM_VW == 8 ? 6 : 12;  // tokens per micro-tile: 2 * kMR accumulators (AVX2 has 16 registers)

// Rows r0..r0+nr (nr <= kNR) of W [rows, n], k-major into P [n][kNR] (zero past nr): a panel the micro-tile reads
// as two vectors per k. Written in order, read from kNR rows at once (writing in order was 1.6x faster on the Xeon
// than reading in order: the packing is a fifth of a 64-token chunk's work, the GEMM itself 2 flops per element
// per token).
template <typename WT>
inline void pack_panel(const WT *W, int64_t n, int64_t r0, int64_t nr, float *P) {
  const WT *rows[kNR];
  for (int64_t c = 0; c < kNR; ++c) rows[c] = row_of(W, r0 + (c < nr ? c : 0), n);
  for (int64_t k = 0; k < n; ++k) {
    float *p = P + k * kNR;
    for (int64_t c = 0; c < kNR; ++c) p[c] = c < nr ? weight_at(rows[c], k) : 0.f;
  }
}

// Y[m, 0..nr) (+)= X[m, :] . panel rows, for M tokens: M x 2 vector accumulators, each k one token's value
// broadcast against two panel vectors (no horizontal sums; each output one sequential fp32 sum over n).
template <int M>
inline void micro_tile(const float *X, int64_t ldx, const float *P, int64_t n, float *Y, int64_t ldy, int64_t nr,
                       bool accumulate) {
  constexpr int64_t VW = simd::kVW;
  simd::vf acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = simd::zero();
  for (int64_t k = 0; k < n; ++k) {
    const simd::vf b0 = simd::loadu(P + k * kNR), b1 = simd::loadu(P + k * kNR + VW);
    for (int m = 0; m < M; ++m) {
      const simd::vf a = simd::set1(X[m * ldx + k]);
      acc[m][0] = simd::fma(a, b0, acc[m][0]);
      acc[m][1] = simd::fma(a, b1, acc[m][1]);
    }
  }
  for (int m = 0; m < M; ++m) {
    float *y = Y + m * ldy;
    if (nr == kNR) {
      if (accumulate) {
        acc[m][0] = acc[m][0] + simd::loadu(y);
        acc[m][1] = acc[m][1] + simd::loadu(y + VW);
      }
      simd::storeu(y, acc[m][0]);
      simd::storeu(y + VW, acc[m][1]);
    } else {
      float tmp[kNR];
      simd::storeu(tmp, acc[m][0]);
      simd::storeu(tmp + VW, acc[m][1]);
      for (int64_t c = 0; c < nr; ++c) y[c] = accumulate ? y[c] + tmp[c] : tmp[c];
    }
  }
}

template <int M = kMR>
inline void micro_rest(int rest, const float *X, int64_t ldx, const float *P, int64_t n, float *Y, int64_t ldy,
                       int64_t nr, bool accumulate) {
  if constexpr (M > 1) {
    if (rest == M - 1) return micro_tile<M - 1>(X, ldx, P, n, Y, ldy, nr, accumulate);
    return micro_rest<M - 1>(rest, X, ldx, P, n, Y, ldy, nr, accumulate);
  }
}
#endif

// Y[i, r] (+)= X[i, :] . W[r, :] for tokens i < T and weight rows r in [r0, r1) (W row-major [rows, n], X [T, ldx],
// Y [T, ldy]): a prompt chunk's projection. Each panel of kNR weight rows is packed k-major once (this thread's
// scratch, n * kNR floats: L2-resident) and serves every token of the chunk in kMR-token micro-tiles.
template <typename WT>
inline void gemm_rows(const float *X, int64_t ldx, int64_t T, const WT *W, int64_t n, int64_t r0, int64_t r1,
                      float *Y, int64_t ldy, bool accumulate) {
#if MSLLM_VW > 0
  thread_local std::vector<float> panel;
  if (static_cast<int64_t>(panel.size()) < n * kNR) panel.resize(n * kNR);
  for (int64_t r = r0; r < r1; r += kNR) {
    const int64_t nr = r1 - r < kNR ? r1 - r : kNR;
    pack_panel(W, n, r, nr, panel.data());
    int64_t i = 0;
    for (; i + kMR <= T; i += kMR) micro_tile<kMR>(X + i * ldx, ldx, panel.data(), n, Y + i * ldy + r, ldy, nr, accumulate);
    if (i < T)
      micro_rest(static_cast<int>(T - i), X + i * ldx, ldx, panel.data(), n, Y + i * ldy + r, ldy, nr, accumulate);
  }
#else
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t i = 0; i < T; ++i) {
      const float s = dot(row_of(W, r, n), X + i * ldx, n);
      float &y = Y[i * ldy + r];
      y = accumulate ? y + s : s;
    }
#endif
}

inline void rms_norm(const float *x, const float *w, float *out, int64_t n, float eps) {
  float ss = dot(x, x, n);
  float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv * w[i];
}

// rotate-half RoPE of one head in place: x * cos + rotate_half(x) * sin, then * scale
inline void rope(float *x, const float *cos, const float *sin, int64_t hd, float scale) {
  int64_t half = hd / 2;
  float tmp[1024];
  for (int64_t i = 0; i < hd; ++i) {
    float rot = i < half ? -x[i + half] : x[i - half];
    tmp[i] = (x[i] * cos[i] + rot * sin[i]) * scale;
  }
  std::memcpy(x, tmp, hd * sizeof(float));
}

// sc[r * P + j] = q_r . K[:, j] for four queries and slots j < len; Kt is one kv head's keys transposed [hd][P]
inline void scores4(const float *const *q, const float *Kt, int64_t P, int64_t len, int64_t hd, float *sc) {
  int64_t j = 0;
#if MSLLM_VW > 0
  constexpr int64_t W = simd::kVW;
#if MSLLM_VW == 8
  // AVX2: two vectors of keys a pass, so each broadcast query value serves 16 keys (one vector a pass was bound by
  // the broadcasts' loads: 4 for 4 FMAs); every score is the same FMA chain over d either way
  for (; j + 2 * W <= len; j += 2 * W) {
    simd::vf a[4][2];
    for (int r = 0; r < 4; ++r) a[r][0] = a[r][1] = simd::zero();
    for (int64_t d = 0; d < hd; ++d) {
      const simd::vf k0 = simd::loadu(Kt + d * P + j), k1 = simd::loadu(Kt + d * P + j + W);
      for (int r = 0; r < 4; ++r) {
        const simd::vf qv = simd::set1(q[r][d]);
        a[r][0] = simd::fma(qv, k0, a[r][0]);
        a[r][1] = simd::fma(qv, k1, a[r][1]);
      }
    }
    for (int r = 0; r < 4; ++r) {
      simd::storeu(sc + r * P + j, a[r][0]);
      simd::storeu(sc + r * P + j + W, a[r][1]);
    }
  }
#endif
  for (; j + W <= len; j += W) {
    simd::vf a0 = simd::zero(), a1 = simd::zero(), a2 = simd::zero(), a3 = simd::zero();
    for (int64_t d = 0; d < hd; ++d) {
      const simd::vf k = simd::loadu(Kt + d * P + j);
      a0 = simd::fma(simd::set1(q[0][d]), k, a0);
      a1 = simd::fma(simd::set1(q[1][d]), k, a1);
      a2 = simd::fma(simd::set1(q[2][d]), k, a2);
      a3 = simd::fma(simd::set1(q[3][d]), k, a3);
    }
    simd::storeu(sc + j, a0);
    simd::storeu(sc + P + j, a1);
    simd::storeu(sc + 2 * P + j, a2);
    simd::storeu(sc + 3 * P + j, a3);
  }
#endif
  for (; j < len; ++j)
    for (int r = 0; r < 4; ++r) {
      float s = 0.f;
      for (int64_t d = 0; d < hd; ++d) s += q[r][d] * Kt[d * P + j];
      sc[r * P + j] = s;
    }
}

// One query's scores sc[0..len) -> unnormalised softmax weights: exp(sc[j] - max) for j <= p, 0 for p < j < len
// (slots a later query of the block sees); returns 1 / their sum.
inline float softmax_weights(float *sc, int64_t p, int64_t len) {
  float mx = -INFINITY;
  int64_t j = 0;
#if MSLLM_VW > 0
  {  // the max a vector at a time (a scalar chain of maxss was ~10% of a long prompt's attention); any order gives
     // the same max
    simd::vf vm = simd::set1(-INFINITY);
    for (; j + simd::kVW <= p + 1; j += simd::kVW) vm = simd::vmax(vm, simd::loadu(sc + j));
    mx = simd::hmax(vm);
  }
#endif
  for (; j <= p; ++j) mx = sc[j] > mx ? sc[j] : mx;
  float sum = 0.f;
  j = 0;
#if MSLLM_VW > 0
  const simd::vf m = simd::set1(mx);
  simd::vf acc = simd::zero();
  for (; j + simd::kVW <= p + 1; j += simd::kVW) {
    const simd::vf e = simd::exp_v(simd::loadu(sc + j) - m);
    simd::storeu(sc + j, e);
    acc = acc + e;
  }
  sum = simd::hsum(acc);
#endif
  for (; j <= p; ++j) {
    sc[j] = std::exp(sc[j] - mx);
    sum += sc[j];
  }
  for (j = p + 1; j < len; ++j) sc[j] = 0.f;
  return 1.0f / sum;
}

#if MSLLM_VW > 0
// out[r] = inv[r] * sum_{j < len} w[r * P + j] V[j] for four queries (rows r >= nq are computed and dropped):
// every V row is loaded once for the four; with NV vectors per head the accumulators stay in registers.
template <int NV>
inline void values4(const float *w, int64_t P, int64_t len, const float *V, int64_t hd, const float *inv, int nq,
                    float *const *out) {
  constexpr int64_t W = simd::kVW;
  simd::vf acc[4][NV];
  for (int r = 0; r < 4; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = simd::zero();
  for (int64_t j = 0; j < len; ++j) {
    const float *vr = V + j * hd;
    const simd::vf w0 = simd::set1(w[j]), w1 = simd::set1(w[P + j]), w2 = simd::set1(w[2 * P + j]),
                   w3 = simd::set1(w[3 * P + j]);
    for (int v = 0; v < NV; ++v) {
      const simd::vf x = simd::loadu(vr + v * W);
      acc[0][v] = simd::fma(w0, x, acc[0][v]);
      acc[1][v] = simd::fma(w1, x, acc[1][v]);
      acc[2][v] = simd::fma(w2, x, acc[2][v]);
      acc[3][v] = simd::fma(w3, x, acc[3][v]);
    }
  }
  for (int r = 0; r < nq; ++r)
    for (int v = 0; v < NV; ++v) simd::storeu(out[r] + v * W, acc[r][v] * simd::set1(inv[r]));
}
#endif

// the same for any hd (the scalar body, and head sizes that are not 1..8 whole vectors)
inline void values4_any(const float *w, int64_t P, int64_t len, const float *V, int64_t hd, const float *inv, int nq,
                        float *const *out) {
  for (int r = 0; r < nq; ++r) {
    for (int64_t i = 0; i < hd; ++i) out[r][i] = 0.f;
    for (int64_t j = 0; j < len; ++j) {
      const float x = w[r * P + j];
      const float *vr = V + j * hd;
      for (int64_t i = 0; i < hd; ++i) out[r][i] += x * vr[i];
    }
    for (int64_t i = 0; i < hd; ++i) out[r][i] *= inv[r];
  }
}

inline void values4_dispatch(const float *w, int64_t P, int64_t len, const float *V, int64_t hd, const float *inv,
                             int nq, float *const *out) {
#if MSLLM_VW > 0
  if (hd % simd::kVW == 0) {
    switch (hd / simd::kVW) {
      case 1: return values4<1>(w, P, len, V, hd, inv, nq, out);
      case 2: return values4<2>(w, P, len, V, hd, inv, nq, out);
      case 4: return values4<4>(w, P, len, V, hd, inv, nq, out);
      case 8: return values4<8>(w, P, len, V, hd, inv, nq, out);
      default: break;
    }
  }
#endif
  values4_any(w, P, len, V, hd, inv, nq, out);
}

// out = softmax(q . K[0..p]) V[0..p] for one head: q [hd] (RoPE'd and scaled), K and V one kv head's cache
// rows [S, hd], sc scratch of at least p + 1 floats.
inline void attend(const float *q, const float *K, const float *V, int64_t p, int64_t hd, float *sc, float *out) {
  float mx = -INFINITY;
  for (int64_t j = 0; j <= p; ++j) {
    sc[j] = dot(q, K + j * hd, hd);
    mx = sc[j] > mx ? sc[j] : mx;
  }
  float sum = 0.f;
  for (int64_t j = 0; j <= p; ++j) {
    sc[j] = std::exp(sc[j] - mx);
    sum += sc[j];
  }
  const float inv = 1.0f / sum;
  for (int64_t i = 0; i < hd; ++i) out[i] = 0.f;
  for (int64_t j = 0; j <= p; ++j) {
    const float w = sc[j] * inv;
    const float *vr = V + j * hd;
    for (int64_t i = 0; i < hd; ++i) out[i] += w * vr[i];
  }
}

}  // namespace

namespace {
// A chunk of T queries' causal attention over the in-place caches, in three phases that each split over (t, nt)
// threads and must run in order (a barrier or a join between them): write (RoPE on the chunk's k rows, written
// with its v rows into the caches at slots start..start+T-1; RoPE and the scale on its q rows, into qr), transpose
// (each kv head's keys for slots 0..P-1 into kt [nkv][hd][P]: a query's scores over a vector of slots are then hd
// broadcast FMAs with no horizontal sum per slot, and four queries share every load) and attend (query i over
// slots 0..start+i, into out [T, nh*hd]). q [T, nh*hd], k and v [T, nkv*hd]: the projections before RoPE.
struct ChunkAttn {
  const float *q, *k, *v;
  int64_t T, nh, nkv, hd, n_rep, S, start;
  const float *cos_t, *sin_t;
  float scale;
  float *kc, *vc, *qr, *kt, *out;
  int64_t P = start + T;  // slots any query of the chunk may see

  void write(int t, int nt) const {
    const int64_t qdim = nh * hd, kvdim = nkv * hd;
    for (int64_t w = t; w < T * nkv; w += nt) {
      const int64_t i = w / nkv, g = w % nkv, slot = start + i;
      float *kr = kc + (g * S + slot) * hd;
      std::memcpy(kr, k + i * kvdim + g * hd, hd * sizeof(float));
      rope(kr, cos_t + slot * hd, sin_t + slot * hd, hd, 1.0f);
      std::memcpy(vc + (g * S + slot) * hd, v + i * kvdim + g * hd, hd * sizeof(float));
    }
    for (int64_t w = t; w < T * nh; w += nt) {
      const int64_t slot = start + w / nh;
      float *qh = qr + w * hd;
      std::memcpy(qh, q + w * hd, hd * sizeof(float));
      rope(qh, cos_t + slot * hd, sin_t + slot * hd, hd, scale);
    }
    (void)qdim;
  }

  void transpose(int t, int nt) const {
    // a contiguous range of (kv head, slot) per thread: the threads dealt alternate slots would write alternate
    // floats of the same cache lines of kt (each line bouncing between the cores)
    int64_t b, e;
    split(nkv * P, t, nt, &b, &e);
    for (int64_t gj = b; gj < e; ++gj) {
      const int64_t g = gj / P, j = gj % P;
      const float *kr = kc + (g * S + j) * hd;
      float *dst = kt + g * hd * P + j;
      for (int64_t d = 0; d < hd; ++d) dst[d * P] = kr[d];
    }
  }

  // sc: this thread's scratch of 4 * P floats
  void attend(int t, int nt, float *sc) const {
    const int64_t qdim = nh * hd, blocks = (T + 3) / 4;
    // (head, block of 4 queries), dealt round-robin: later queries attend more slots
    for (int64_t w = t; w < nh * blocks; w += nt) {
      const int64_t hh = w / blocks, i0 = (w % blocks) * 4, g = hh / n_rep;
      const int64_t nq = T - i0 < 4 ? T - i0 : 4;
      const float *qs[4];
      for (int64_t r = 0; r < 4; ++r) qs[r] = qr + (i0 + (r < nq ? r : 0)) * qdim + hh * hd;
      const int64_t len = start + i0 + nq;  // slots the block's last query sees
      scores4(qs, kt + g * hd * P, P, len, hd, sc);
      float inv[4] = {0.f, 0.f, 0.f, 0.f};
      float *outs[4];
      for (int64_t r = 0; r < 4; ++r) {
        if (r < nq) {
          inv[r] = softmax_weights(sc + r * P, start + i0 + r, len);
        } else {
          for (int64_t j = 0; j < len; ++j) sc[r * P + j] = 0.f;
        }
        outs[r] = out + (i0 + (r < nq ? r : 0)) * qdim + hh * hd;
      }
      values4_dispatch(sc, P, len, vc + g * S * hd, hd, inv, static_cast<int>(nq), outs);
    }
  }
};
}  // namespace

namespace {
bool is_dt(const char **dtypes, int i, const char *dt) { return dtypes[i] && std::strcmp(dtypes[i], dt) == 0; }
int64_t count(int *ndims, int64_t **shapes, int i) {
  int64_t n = 1;
  for (int d = 0; d < ndims[i]; ++d) n *= shapes[i][d];
  return n;
}
bool mat(int *ndims, int64_t **shapes, int i, int64_t rows, int64_t cols) {
  return ndims[i] == 2 && shapes[i][0] == rows && shapes[i][1] == cols;
}
}  // namespace

// Which body this library runs ("avx512", "avx2", "neon", "scalar"); see model/kernels.py.
extern "C" const char *MsllmKernelIsa() { return MSLLM_ISA; }

// The caller's sequences are over for now: the pool's idle workers sleep at once (`Pool::park`).
extern "C" void DecodePoolPark() { pool().park(); }

namespace {
// The sizes of a whole-model op's operands (DecodeStep, PrefillStep: the layout in this file's header).
struct Model {
  int n_layers;
  int64_t V, H, hd, S_rope, qdim, kvdim, F, nh, nkv, n_rep, S;
  float eps, scale;  // consts[0], consts[1]
  int threads;       // consts[2], at least 1
  const void *embed, *head;  // float32, binary16 (`half`) or Q8_0 blocks, as every weight matrix
  const float *final_norm, *cos_t, *sin_t;
  float *logits;     // the output [1, V]
  int wtype;         // the weight matrices: 0 float32, 1 binary16, 2 Q8_0 (uint8 [rows, n / 32 * 34])
  int64_t NS;        // cache slots: caches [nkv, S, hd] hold one sequence (1), [NS, nkv, S, hd] one per slot
};

// The operands that are weight matrices (embedding, LM head, each layer's q k v o gate up down): all float32, all
// float16, or all uint8 holding Q8_0 blocks; every other operand but the token(s) and position(s) is float32.
bool is_matrix(int i, int n_layers) {
  if (i == 3 || i == 5) return true;
  if (i < 8 || i >= 8 + 9 * n_layers) return false;
  const int k = (i - 8) % 9;
  return k != 0 && k != 5;
}

// Checks every operand of a whole-model op but the first two (token(s), position(s)): the count, dtypes, every
// weight's shape against the embedding's [V, H] and the first layer's sizes, the caches' [nkv, S, hd] and the
// output [1, V]. 0 when they hold; else 1 (count), 2 (dtype) or 3 (shape).
int check_model(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, Model *m,
                int64_t out_rows = 1) {
  const int n_layers = (nparam - 9) / 11;
  if (n_layers < 1 || 9 + 11 * n_layers != nparam) return 1;
  if (!is_dt(dtypes, 0, "int32") || !is_dt(dtypes, 1, "int32")) return 2;
  const int wtype = is_dt(dtypes, 3, "float16") ? 1 : is_dt(dtypes, 3, "uint8") ? 2 : 0;
  const char *wdt = wtype == 1 ? "float16" : wtype == 2 ? "uint8" : "float32";
  for (int i = 2; i < nparam; ++i)
    if (!is_dt(dtypes, i, is_matrix(i, n_layers) ? wdt : "float32")) return 2;
  for (int i = 0; i < nparam; ++i)
    for (int d = 0; d < ndims[i]; ++d)
      if (shapes[i][d] < 0) return 3;
  if (count(ndims, shapes, 2) != 3 || ndims[3] != 2 || ndims[6] != 2 || ndims[9] != 2 || ndims[10] != 2 ||
      ndims[14] != 2)
    return 3;
  // a matrix of `cols` weights per row: Q8_0 holds cols / 32 blocks of 34 bytes (cols a multiple of 32)
  const auto wmat = [&](int i, int64_t rows, int64_t cols) {
    return wtype == 2 ? cols % kQ8 == 0 && mat(ndims, shapes, i, rows, cols / kQ8 * 34) : mat(ndims, shapes, i, rows, cols);
  };
  if (wtype == 2 && shapes[3][1] % 34) return 3;
  const int64_t V = shapes[3][0], H = wtype == 2 ? shapes[3][1] / 34 * kQ8 : shapes[3][1];
  const int64_t hd = shapes[6][1], S_rope = shapes[6][0];
  const int64_t qdim = shapes[9][0], kvdim = shapes[10][0], F = shapes[14][0];
  if (V < 1 || H < 1 || hd < 2 || hd > 1024 || hd % 2 || qdim < hd || qdim % hd || kvdim < hd || kvdim % hd ||
      (qdim / hd) % (kvdim / hd) || F < 1)
    return 3;
  const int kc0 = 8 + 9 * n_layers;
  const int cd = ndims[kc0], o = cd - 3;  // caches [nkv, S, hd], or [NS, nkv, S, hd]: a sequence per slot
  if (cd != 3 && cd != 4) return 3;
  const int64_t S = shapes[kc0][o + 1], nkv = kvdim / hd, NS = o ? shapes[kc0][0] : 1;
  if (NS < 1) return 3;
  if (count(ndims, shapes, 4) != H || !wmat(5, V, H) || !mat(ndims, shapes, 7, S_rope, hd) ||
      count(ndims, shapes, nparam - 1) != V * out_rows)
    return 3;
  for (int l = 0; l < n_layers; ++l) {
    const int w = 8 + 9 * l;
    if (count(ndims, shapes, w) != H || !wmat(w + 1, qdim, H) || !wmat(w + 2, kvdim, H) || !wmat(w + 3, kvdim, H) ||
        !wmat(w + 4, H, qdim) || count(ndims, shapes, w + 5) != H || !wmat(w + 6, F, H) || !wmat(w + 7, F, H) ||
        !wmat(w + 8, H, F))
      return 3;
    for (const int c : {kc0 + l, kc0 + n_layers + l})
      if (ndims[c] != cd || (o && shapes[c][0] != NS) || shapes[c][o] != nkv || shapes[c][o + 1] != S ||
          shapes[c][o + 2] != hd)
        return 3;
  }
  const float *consts = static_cast<const float *>(params[2]);
  const auto f = [&](int i) { return static_cast<const float *>(params[i]); };
  *m = Model{n_layers, V, H, hd, S_rope, qdim, kvdim, F, qdim / hd, nkv, (qdim / hd) / nkv, S, consts[0], consts[1],
             consts[2] >= 1.f ? static_cast<int>(consts[2]) : 1, params[3], params[5], f(4), f(6), f(7),
             static_cast<float *>(params[nparam - 1]), wtype, NS};
  return 0;
}
}  // namespace

// One token through the whole model, the weight matrices of type WT (float or half); `m` checked by check_model.
template <typename WT>
int decode_step(void **params, const Model &m) {
  const int n_layers = m.n_layers;
  const int64_t V = m.V, H = m.H, hd = m.hd, S_rope = m.S_rope, qdim = m.qdim, kvdim = m.kvdim, F = m.F;
  const int64_t nh = m.nh, nkv = m.nkv, n_rep = m.n_rep, S = m.S;
  const int32_t tok = *static_cast<const int32_t *>(params[0]);
  const int64_t pos = *static_cast<const int32_t *>(params[1]);
  const float eps = m.eps, scale = m.scale, *final_norm = m.final_norm;
  const WT *embed = static_cast<const WT *>(m.embed), *head = static_cast<const WT *>(m.head);
  const float *cos_t = m.cos_t, *sin_t = m.sin_t;
  const int threads = m.threads;
  float *logits = m.logits;
  if (tok < 0 || tok >= V || pos < 0 || pos >= S || pos >= S_rope) return 4;
  const float *cos_p = cos_t + pos * hd, *sin_p = sin_t + pos * hd;

  std::vector<float> x(H);
  for (int64_t i = 0; i < H; ++i) x[i] = weight_at(row_of(embed, tok, H), i);
  std::vector<float> q(qdim), kv(2 * kvdim), attn(qdim), act(F), up(F), hn(H * threads), scores(S * threads);

  Barrier barrier(threads);
  on_pool(threads, [&](int t, int nt) {
    float *h = hn.data() + H * t;       // this thread's copy of the normed activations
    float *sc = scores.data() + S * t;  // this thread's attention scores
    int64_t b, e;
    for (int l = 0; l < n_layers; ++l) {
      const auto w = [&](int i) { return static_cast<const float *>(params[8 + 9 * l + i]); };  // the norms
      const auto wm = [&](int i) { return static_cast<const WT *>(params[8 + 9 * l + i]); };  // the matrices
      float *kc = static_cast<float *>(params[8 + 9 * n_layers + l]);
      float *vc = static_cast<float *>(params[8 + 10 * n_layers + l]);
      rms_norm(x.data(), w(0), h, H, eps);
      // q | k | v rows, one range per thread over the three matrices
      split(qdim + 2 * kvdim, t, nt, &b, &e);
      if (b < qdim) gemv_rows(wm(1), h, q.data(), H, b, e < qdim ? e : qdim, false);
      if (e > qdim && b < qdim + kvdim)
        gemv_rows(wm(2), h, kv.data(), H, (b > qdim ? b : qdim) - qdim, (e < qdim + kvdim ? e : qdim + kvdim) - qdim, false);
      if (e > qdim + kvdim)
        gemv_rows(wm(3), h, kv.data() + kvdim, H, (b > qdim + kvdim ? b : qdim + kvdim) - qdim - kvdim, e - qdim - kvdim, false);
      barrier.wait();
      // RoPE and the cache write: kv heads split over threads; then attention, q heads split over threads
      split(nkv, t, nt, &b, &e);
      for (int64_t g = b; g < e; ++g) {
        rope(kv.data() + g * hd, cos_p, sin_p, hd, 1.0f);
        std::memcpy(kc + (g * S + pos) * hd, kv.data() + g * hd, hd * sizeof(float));
        std::memcpy(vc + (g * S + pos) * hd, kv.data() + kvdim + g * hd, hd * sizeof(float));
      }
      barrier.wait();
      split(nh, t, nt, &b, &e);
      for (int64_t hh = b; hh < e; ++hh) {
        float *qh = q.data() + hh * hd;
        rope(qh, cos_p, sin_p, hd, scale);
        const int64_t g = hh / n_rep;
        attend(qh, kc + g * S * hd, vc + g * S * hd, pos, hd, sc, attn.data() + hh * hd);
      }
      barrier.wait();
      split(H, t, nt, &b, &e);
      gemv_rows(wm(4), attn.data(), x.data(), qdim, b, e, true);  // x += o(attn), rows of x split
      barrier.wait();
      rms_norm(x.data(), w(5), h, H, eps);
      split(F, t, nt, &b, &e);
      gemv_rows(wm(6), h, act.data(), H, b, e, false);  // gate
      gemv_rows(wm(7), h, up.data(), H, b, e, false);   // up
      for (int64_t r = b; r < e; ++r) act[r] = act[r] / (1.0f + std::exp(-act[r])) * up[r];  // silu(gate) * up
      barrier.wait();
      split(H, t, nt, &b, &e);
      gemv_rows(wm(8), act.data(), x.data(), F, b, e, true);  // x += down(act)
      barrier.wait();
    }
    rms_norm(x.data(), final_norm, h, H, eps);
    split(V, t, nt, &b, &e);
    gemv_rows(head, h, logits, H, b, e, false);
  });
  return 0;
}

extern "C" int DecodeStep(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                          void *extra) {
  (void)stream; (void)extra;
  Model m;
  if (const int rc = check_model(nparam, params, ndims, shapes, dtypes, &m)) return rc;
  if (count(ndims, shapes, 0) != 1 || count(ndims, shapes, 1) != 1 || m.NS != 1) return 3;
  if (m.wtype == 2) return decode_step<Q8Block>(params, m);
  return m.wtype == 1 ? decode_step<half>(params, m) : decode_step<float>(params, m);
}

// n floats, zeroed, from a 64-byte boundary (aligned64)
struct AlignedFloats {
  std::vector<float> v;
  float *p;
  explicit AlignedFloats(int64_t n) : p(aligned64(v, n)) {}
  float *data() { return p; }
  float &operator[](int64_t i) { return p[i]; }
};

// One token of each of B sequences (continuous batching: the server's running requests) in one step, each in its
// own cache slot: operands as DecodeStep's but 0 tokens int32 [B], 1 int32 [B, 2] (slot, position) per row, the
// caches [NS, nkv, S, hd], the output logits [B, V]. Every matrix is read from memory once for the B rows
// (gemv_batch), and each row is computed exactly as DecodeStep computes it alone (the same thread split, the same
// order of every sum): a sequence's tokens do not depend on the others in the step. The slots must differ.
template <typename WT>
int batch_step(void **params, const Model &m, int64_t B) {
  const int n_layers = m.n_layers;
  const int64_t V = m.V, H = m.H, hd = m.hd, qdim = m.qdim, kvdim = m.kvdim, F = m.F;
  const int64_t nh = m.nh, nkv = m.nkv, n_rep = m.n_rep, S = m.S;
  const int32_t *tok = static_cast<const int32_t *>(params[0]), *sp = static_cast<const int32_t *>(params[1]);
  std::vector<int64_t> slot(B), pos(B);
  std::vector<char> taken(m.NS, 0);
  for (int64_t b = 0; b < B; ++b) {
    slot[b] = sp[2 * b], pos[b] = sp[2 * b + 1];
    if (tok[b] < 0 || tok[b] >= V || slot[b] < 0 || slot[b] >= m.NS || taken[slot[b]] || pos[b] < 0 || pos[b] >= S ||
        pos[b] >= m.S_rope)
      return 4;
    taken[slot[b]] = 1;
  }
  const float eps = m.eps, scale = m.scale;
  const WT *embed = static_cast<const WT *>(m.embed), *head = static_cast<const WT *>(m.head);
  const int threads = m.threads;
  const int64_t stride = nkv * S * hd;  // one slot of a cache
  // the B vectors each projection reads, 64-byte aligned (aligned64)
  AlignedFloats x(B * H), attn(B * qdim), act(B * F), hn(B * H * threads);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < H; ++i) x[b * H + i] = weight_at(row_of(embed, tok[b], H), i);
  std::vector<float> q(B * qdim), kv(B * 2 * kvdim), up(B * F), scores(S * threads);
  constexpr bool q8 = std::is_same_v<WT, Q8Block>;
  std::vector<Q8Act> qa(q8 ? B * threads : 0);

  Barrier barrier(threads);
  on_pool(threads, [&](int t, int nt) {
    float *h = hn.data() + B * H * t;  // this thread's copy of the B normed rows
    float *sc = scores.data() + S * t;
    Q8Act *qt = q8 ? qa.data() + B * t : nullptr;
    int64_t b0, e0;
    // Y[b] (+)= W[r0:r1] . X[b] for every row b: X quantized first where the weights are Q8_0 (gemv_rows does it
    // per call, on the same values)
    auto gemv = [&](const WT *W, const float *X, int64_t n, float *Y, int64_t ys, int64_t r0, int64_t r1, bool acc) {
      if (r0 >= r1) return;
      if constexpr (q8) {
        for (int64_t b = 0; b < B; ++b) quantize_q8(X + b * n, n, qt[b]);
        gemv_batch(W, qt, B, n, Y, ys, r0, r1, acc);
      } else {
        gemv_batch(W, X, B, n, Y, ys, r0, r1, acc);
      }
    };
    for (int l = 0; l < n_layers; ++l) {
      const auto w = [&](int i) { return static_cast<const float *>(params[8 + 9 * l + i]); };
      const auto wm = [&](int i) { return static_cast<const WT *>(params[8 + 9 * l + i]); };
      float *kc = static_cast<float *>(params[8 + 9 * n_layers + l]);
      float *vc = static_cast<float *>(params[8 + 10 * n_layers + l]);
      for (int64_t b = 0; b < B; ++b) rms_norm(x.data() + b * H, w(0), h + b * H, H, eps);
      split(qdim + 2 * kvdim, t, nt, &b0, &e0);  // q | k | v rows, one range per thread over the three matrices
      gemv(wm(1), h, H, q.data(), qdim, b0, e0 < qdim ? e0 : qdim, false);
      gemv(wm(2), h, H, kv.data(), 2 * kvdim, (b0 > qdim ? b0 : qdim) - qdim,
           (e0 < qdim + kvdim ? e0 : qdim + kvdim) - qdim, false);
      gemv(wm(3), h, H, kv.data() + kvdim, 2 * kvdim, (b0 > qdim + kvdim ? b0 : qdim + kvdim) - qdim - kvdim,
           e0 - qdim - kvdim, false);
      barrier.wait();
      split(B * nkv, t, nt, &b0, &e0);  // RoPE and the cache write: (row, kv head) pairs over the threads
      for (int64_t i = b0; i < e0; ++i) {
        const int64_t b = i / nkv, g = i % nkv;
        float *k = kv.data() + b * 2 * kvdim + g * hd, *v = kv.data() + b * 2 * kvdim + kvdim + g * hd;
        rope(k, m.cos_t + pos[b] * hd, m.sin_t + pos[b] * hd, hd, 1.0f);
        std::memcpy(kc + slot[b] * stride + (g * S + pos[b]) * hd, k, hd * sizeof(float));
        std::memcpy(vc + slot[b] * stride + (g * S + pos[b]) * hd, v, hd * sizeof(float));
      }
      barrier.wait();
      split(B * nh, t, nt, &b0, &e0);  // attention: (row, q head) pairs over the threads
      for (int64_t i = b0; i < e0; ++i) {
        const int64_t b = i / nh, hh = i % nh, g = hh / n_rep;
        float *qh = q.data() + b * qdim + hh * hd;
        rope(qh, m.cos_t + pos[b] * hd, m.sin_t + pos[b] * hd, hd, scale);
        attend(qh, kc + slot[b] * stride + g * S * hd, vc + slot[b] * stride + g * S * hd, pos[b], hd, sc,
               attn.data() + b * qdim + hh * hd);
      }
      barrier.wait();
      split(H, t, nt, &b0, &e0);
      gemv(wm(4), attn.data(), qdim, x.data(), H, b0, e0, true);  // x += o(attn)
      barrier.wait();
      for (int64_t b = 0; b < B; ++b) rms_norm(x.data() + b * H, w(5), h + b * H, H, eps);
      split(F, t, nt, &b0, &e0);
      gemv(wm(6), h, H, act.data(), F, b0, e0, false);  // gate
      gemv(wm(7), h, H, up.data(), F, b0, e0, false);   // up
      for (int64_t b = 0; b < B; ++b)
        for (int64_t r = b0; r < e0; ++r) {
          float &a = act[b * F + r];
          a = a / (1.0f + std::exp(-a)) * up[b * F + r];  // silu(gate) * up
        }
      barrier.wait();
      split(H, t, nt, &b0, &e0);
      gemv(wm(8), act.data(), F, x.data(), H, b0, e0, true);  // x += down(act)
      barrier.wait();
    }
    for (int64_t b = 0; b < B; ++b) rms_norm(x.data() + b * H, m.final_norm, h + b * H, H, eps);
    split(V, t, nt, &b0, &e0);
    gemv(head, h, H, m.logits, V, b0, e0, false);
  });
  return 0;
}

extern "C" int BatchDecodeStep(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                               void *stream, void *extra) {
  (void)stream; (void)extra;
  Model m;
  if (nparam < 1) return 1;
  const int64_t B = count(ndims, shapes, 0);
  if (const int rc = check_model(nparam, params, ndims, shapes, dtypes, &m, B)) return rc;
  if (B < 1 || B > m.NS || count(ndims, shapes, 1) != 2 * B) return 3;
  if (m.wtype == 2) return batch_step<Q8Block>(params, m, B);
  return m.wtype == 1 ? batch_step<half>(params, m, B) : batch_step<float>(params, m, B);
}

// One prompt (chunk) of a chunk step: its cache slot, its first position, its rows (tokens) in the packed chunk.
struct Seg {
  int64_t slot, start, n;
};

// Prompt chunks through the whole model in one pass, the weight matrices of type WT; `m` checked by check_model.
// `segs` are consecutive rows of the chunk `tokens` (each row a token at its own position of its own slot): every
// projection is one GEMM over all of them (each weight row read once for all the prompts), attention is each
// segment's own (ChunkAttn over its slot). Each row's sums are its own, in the same order whatever else is in the
// chunk, so a prompt's K/V and logits are the same bits alone or packed with others. all_rows: every row's logits
// [T, V] (ScoreStep); else each segment's last row's, [segments, V].
template <typename WT>
int chunk_step(void **params, const Model &m, const int32_t *tokens, const std::vector<Seg> &segs, bool all_rows) {
  const int n_layers = m.n_layers;
  const int64_t V = m.V, H = m.H, hd = m.hd, qdim = m.qdim, kvdim = m.kvdim, F = m.F, NQ = segs.size();
  int64_t T = 0, kt_all = 0, P_max = 0;
  std::vector<int64_t> off(NQ), kt_off(NQ);
  for (int64_t i = 0; i < NQ; ++i) {
    off[i] = T, kt_off[i] = kt_all;
    T += segs[i].n, kt_all += m.nkv * hd * (segs[i].start + segs[i].n);
    P_max = std::max(P_max, segs[i].start + segs[i].n);
  }
  const float eps = m.eps, scale = m.scale, *final_norm = m.final_norm;
  const WT *embed = static_cast<const WT *>(m.embed), *head = static_cast<const WT *>(m.head);
  const int threads = m.threads;
  float *logits = m.logits;

  std::vector<float> x(T * H), h(T * H), q(T * qdim), k(T * kvdim), v(T * kvdim), attn(T * qdim), act(T * F),
      up(T * F), qr(T * qdim), kt(kt_all), scores(4 * P_max * threads);
  AlignedFloats hl(NQ * H);
  for (int64_t i = 0; i < T; ++i)
    for (int64_t j = 0; j < H; ++j) x[i * H + j] = weight_at(row_of(embed, tokens[i], H), j);
  std::vector<ChunkAttn> att;  // each segment's attention, over its rows and its slot
  for (int64_t i = 0; i < NQ; ++i)
    att.push_back({q.data() + off[i] * qdim, k.data() + off[i] * kvdim, v.data() + off[i] * kvdim, segs[i].n, m.nh,
                   m.nkv, hd, m.n_rep, m.S, segs[i].start, m.cos_t, m.sin_t, scale, nullptr, nullptr,
                   qr.data() + off[i] * qdim, kt.data() + kt_off[i], attn.data() + off[i] * qdim});

  Barrier barrier(threads);
  on_pool(threads, [&](int t, int nt) {
    float *sc = scores.data() + 4 * P_max * t;
    int64_t b, e;
    // rows [b, e) of a projection with `rows` rows, split over the threads in whole panels (gemm_rows)
#if MSLLM_VW > 0
    constexpr int64_t blk = kNR;
#else
    constexpr int64_t blk = 1;
#endif
    auto rows_of = [&](int64_t rows) {
      split((rows + blk - 1) / blk, t, nt, &b, &e);
      b *= blk;
      e = e * blk < rows ? e * blk : rows;
    };
    for (int l = 0; l < n_layers; ++l) {
      const auto w = [&](int i) { return static_cast<const float *>(params[8 + 9 * l + i]); };  // the norms
      const auto wm = [&](int i) { return static_cast<const WT *>(params[8 + 9 * l + i]); };  // the matrices
      const auto seg_attn = [&](int64_t i) {  // segment i's attention over layer l's caches of its slot
        ChunkAttn a = att[i];
        const int64_t slot_off = segs[i].slot * m.nkv * m.S * hd;  // the slot's caches within [NS, nkv, S, hd]
        a.kc = static_cast<float *>(params[8 + 9 * n_layers + l]) + slot_off;
        a.vc = static_cast<float *>(params[8 + 10 * n_layers + l]) + slot_off;
        return a;
      };
      split(T, t, nt, &b, &e);
      for (int64_t i = b; i < e; ++i) rms_norm(x.data() + i * H, w(0), h.data() + i * H, H, eps);
      barrier.wait();
      rows_of(qdim + 2 * kvdim);  // q | k | v rows, one range per thread over the three matrices
      if (b < qdim) gemm_rows(h.data(), H, T, wm(1), H, b, e < qdim ? e : qdim, q.data(), qdim, false);
      if (e > qdim && b < qdim + kvdim)
        gemm_rows(h.data(), H, T, wm(2), H, (b > qdim ? b : qdim) - qdim, (e < qdim + kvdim ? e : qdim + kvdim) - qdim,
                  k.data(), kvdim, false);
      if (e > qdim + kvdim)
        gemm_rows(h.data(), H, T, wm(3), H, (b > qdim + kvdim ? b : qdim + kvdim) - qdim - kvdim, e - qdim - kvdim,
                  v.data(), kvdim, false);
      barrier.wait();
      for (int64_t i = 0; i < NQ; ++i) seg_attn(i).write(t, nt);  // the slots differ: no cache row written twice
      barrier.wait();
      for (int64_t i = 0; i < NQ; ++i) seg_attn(i).transpose(t, nt);
      barrier.wait();
      for (int64_t i = 0; i < NQ; ++i) seg_attn(i).attend(t, nt, sc);
      barrier.wait();
      rows_of(H);
      gemm_rows(attn.data(), qdim, T, wm(4), qdim, b, e, x.data(), H, true);  // x += o(attn), columns of x split
      barrier.wait();
      split(T, t, nt, &b, &e);
      for (int64_t i = b; i < e; ++i) rms_norm(x.data() + i * H, w(5), h.data() + i * H, H, eps);
      barrier.wait();
      rows_of(F);
      gemm_rows(h.data(), H, T, wm(6), H, b, e, act.data(), F, false);  // gate
      gemm_rows(h.data(), H, T, wm(7), H, b, e, up.data(), F, false);   // up
      for (int64_t i = 0; i < T; ++i)
        for (int64_t r = b; r < e; ++r) {
          float &a = act[i * F + r];
          a = a / (1.0f + std::exp(-a)) * up[i * F + r];  // silu(gate) * up
        }
      barrier.wait();
      rows_of(H);
      gemm_rows(act.data(), F, T, wm(8), F, b, e, x.data(), H, true);  // x += down(act)
      barrier.wait();
    }
    if (all_rows) {  // every row's logits [T, V]: the final norm of each row, then the head as a GEMM over the chunk
      split(T, t, nt, &b, &e);
      for (int64_t i = b; i < e; ++i) rms_norm(x.data() + i * H, final_norm, h.data() + i * H, H, eps);
      barrier.wait();
      rows_of(V);
      gemm_rows(h.data(), H, T, head, H, b, e, logits, V, false);
      return;
    }
    if (t == 0)
      for (int64_t i = 0; i < NQ; ++i)
        rms_norm(x.data() + (off[i] + segs[i].n - 1) * H, final_norm, hl.data() + i * H, H, eps);
    barrier.wait();
    split(V, t, nt, &b, &e);
    gemv_batch(head, hl.data(), NQ, H, logits, V, b, e, false);  // each row as gemv_rows computes it
  });
  return 0;
}

// A prompt chunk (batch 1, T tokens at slots start..start+T-1) through the whole model, as DecodeStep does one
// token: the operands are DecodeStep's but 0 tokens int32 [1, T] and 1 int32 [start, last(, slot)] (`last` the row
// whose logits are returned, 0 <= last < T). PrefillStep writes the K/V rows of tokens 0..last into the caches and
// returns the logits [1, V] of row `last`; the rows after it (a short prompt's padding) cannot change it (attention is
// causal, each row's sums its own), so they are checked, not computed: a 33-token prompt in a 64-token chunk costs
// 33 rows, and the cache slots past `last` keep what they held. ScoreStep computes every row. Every buffer is the
// chunk's own (chunk_step): nothing a static MindSpore graph would keep per kernel (~0.5 GB of the 64-token chunk
// graph at SmolLM2-135M). The projections are GEMMs over the chunk, split by rows over the threads.
template <typename WT>
int prefill_step(void **params, const Model &m, int64_t T, bool all_rows, int64_t slot = 0) {
  const int32_t *tokens = static_cast<const int32_t *>(params[0]);
  const int64_t start = static_cast<const int32_t *>(params[1])[0], last = static_cast<const int32_t *>(params[1])[1];
  const int64_t rows = all_rows ? T : last + 1;  // the rows computed and written: a prompt's padding may pass the cache
  if (start < 0 || start + rows > m.S || start + rows > m.S_rope || last < 0 || last >= T || slot < 0 || slot >= m.NS)
    return 4;
  for (int64_t i = 0; i < T; ++i)
    if (tokens[i] < 0 || tokens[i] >= m.V) return 4;
  return chunk_step<WT>(params, m, tokens, {Seg{slot, start, rows}}, all_rows);
}

// Several prompts' chunks in one pass (the server's newly admitted requests, `BatchDecoder.prefill_many`): the
// operands are PrefillStep's over slot caches [NS, nkv, S, hd] but 0 tokens int32 [1, P] (the prompts one after
// another, then padding) and 1 int32 [K, 3], per prompt (slot, start, n): its n tokens are the next n of operand 0,
// at positions start..start+n-1 of its slot; a row with n = 0 ends the list. The output [K, V]: row i the logits
// after prompt i's last token (rows past the list untouched). Each prompt's K/V and logits are PrefillStep's on it
// alone, bit for bit. Refused (4) before anything is written: two prompts in one slot, a slot or position outside
// the caches, more tokens than P, a token outside the vocabulary, no prompt.
template <typename WT>
int packed_prefill(void **params, const Model &m, int64_t P, int64_t K) {
  const int32_t *tokens = static_cast<const int32_t *>(params[0]), *sp = static_cast<const int32_t *>(params[1]);
  std::vector<Seg> segs;
  std::vector<char> taken(m.NS, 0);
  int64_t T = 0;
  for (int64_t i = 0; i < K && sp[3 * i + 2] != 0; ++i) {
    const int64_t slot = sp[3 * i], start = sp[3 * i + 1], n = sp[3 * i + 2];
    if (n < 0 || slot < 0 || slot >= m.NS || taken[slot] || start < 0 || start + n > m.S || start + n > m.S_rope ||
        T + n > P)
      return 4;
    taken[slot] = 1;
    segs.push_back({slot, start, n});
    T += n;
  }
  if (segs.empty()) return 4;
  for (int64_t i = 0; i < T; ++i)
    if (tokens[i] < 0 || tokens[i] >= m.V) return 4;
  return chunk_step<WT>(params, m, tokens, segs, false);
}

extern "C" int PrefillStep(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                           void *extra) {
  (void)stream; (void)extra;
  Model m;
  if (const int rc = check_model(nparam, params, ndims, shapes, dtypes, &m)) return rc;
  const int64_t T = count(ndims, shapes, 0), np1 = count(ndims, shapes, 1);
  if (T < 1 || (np1 != 2 && np1 != 3) || (np1 == 2 && m.NS != 1)) return 3;
  const int64_t slot = np1 == 3 ? static_cast<const int32_t *>(params[1])[2] : 0;
  if (m.wtype == 2) return prefill_step<Q8Block>(params, m, T, false, slot);
  return m.wtype == 1 ? prefill_step<half>(params, m, T, false, slot) : prefill_step<float>(params, m, T, false, slot);
}

extern "C" int PackedPrefillStep(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                 void *stream, void *extra) {
  (void)stream; (void)extra;
  Model m;
  if (nparam < 2 || ndims[1] != 2 || shapes[1][1] != 3) return 3;
  const int64_t P = count(ndims, shapes, 0), K = shapes[1][0];
  if (const int rc = check_model(nparam, params, ndims, shapes, dtypes, &m, K)) return rc;
  if (P < 1 || K < 1 || K > m.NS) return 3;
  if (m.wtype == 2) return packed_prefill<Q8Block>(params, m, P, K);
  return m.wtype == 1 ? packed_prefill<half>(params, m, P, K) : packed_prefill<float>(params, m, P, K);
}

// ScoreStep: PrefillStep with every row's logits, [T, V] (the eval scorer's log-probabilities of a sequence in the
// stored weight formats): the same operands, its output [T, V]; `last` is checked and unused.
extern "C" int ScoreStep(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                         void *extra) {
  (void)stream; (void)extra;
  Model m;
  if (nparam < 1) return 1;
  const int64_t T = count(ndims, shapes, 0);
  if (const int rc = check_model(nparam, params, ndims, shapes, dtypes, &m, T)) return rc;
  const int64_t np1 = count(ndims, shapes, 1);
  if (T < 1 || (np1 != 2 && np1 != 3) || (np1 == 2 && m.NS != 1)) return 3;
  const int64_t slot = np1 == 3 ? static_cast<const int32_t *>(params[1])[2] : 0;
  if (m.wtype == 2) return prefill_step<Q8Block>(params, m, T, true, slot);
  return m.wtype == 1 ? prefill_step<half>(params, m, T, true, slot) : prefill_step<float>(params, m, T, true, slot);
}

// A prompt chunk's attention over the in-place cache (CachedDecoder's prefill, one op per layer): RoPE on the
// chunk's q and k, its k and v rows written into the caches at slots start..start+T-1, then query i attends
// slots 0..start+i. Inputs:
//   0 q [T, nh*hd]   1 k [T, nkv*hd]   2 v [T, nkv*hd] (the projections, before RoPE)   3 start int32 []
//   4 cos [S_rope, hd]   5 sin [S_rope, hd]   6 k cache [nkv, S, hd]   7 v cache [nkv, S, hd] (both written)
//   8 consts float32 [2]: attention scale, threads
// Output [T, nh*hd]. Neither the work nor any buffer grows with S: MindSpore's [heads, T, S] scores, mask and
// softmax did, per layer, and a static graph keeps every one of them (with the RoPE and cache-write kernels).
extern "C" int ChunkAttention(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                              void *extra) {
  (void)stream; (void)extra;
  if (nparam != 10) return 1;
  if (!is_dt(dtypes, 3, "int32")) return 2;
  for (const int i : {0, 1, 2, 4, 5, 6, 7, 8, 9})
    if (!is_dt(dtypes, i, "float32")) return 2;
  for (const int i : {0, 1, 2, 4, 5, 9})
    if (ndims[i] != 2) return 3;
  if (ndims[6] != 3 || ndims[7] != 3 || count(ndims, shapes, 3) != 1 || count(ndims, shapes, 8) != 2) return 3;
  const int64_t T = shapes[0][0], qdim = shapes[0][1], kvdim = shapes[1][1];
  const int64_t nkv = shapes[6][0], S = shapes[6][1], hd = shapes[6][2], S_rope = shapes[4][0];
  if (T < 1 || nkv < 1 || S < 1 || hd < 2 || hd > 1024 || hd % 2 || kvdim != nkv * hd || qdim < hd || qdim % hd ||
      (qdim / hd) % nkv || shapes[1][0] != T || !mat(ndims, shapes, 2, T, kvdim) || !mat(ndims, shapes, 4, S_rope, hd) ||
      !mat(ndims, shapes, 5, S_rope, hd) || shapes[7][0] != nkv || shapes[7][1] != S || shapes[7][2] != hd ||
      !mat(ndims, shapes, 9, T, qdim))
    return 3;
  const int64_t start = *static_cast<const int32_t *>(params[3]);
  if (start < 0 || start + T > S || start + T > S_rope) return 4;
  const int64_t nh = qdim / hd, n_rep = nh / nkv;
  const float *q = static_cast<const float *>(params[0]), *k = static_cast<const float *>(params[1]);
  const float *v = static_cast<const float *>(params[2]);
  const float *cos_t = static_cast<const float *>(params[4]), *sin_t = static_cast<const float *>(params[5]);
  float *kc = static_cast<float *>(params[6]), *vc = static_cast<float *>(params[7]);
  const float *consts = static_cast<const float *>(params[8]);
  const float scale = consts[0];
  const int threads = consts[1] >= 1.f ? static_cast<int>(consts[1]) : 1;
  float *out = static_cast<float *>(params[9]);
  std::vector<float> qr(T * qdim), kt(nkv * hd * (start + T));
  ChunkAttn c{q, k, v, T, nh, nkv, hd, n_rep, S, start, cos_t, sin_t, scale, kc, vc, qr.data(), kt.data(), out};
  // std::threads, not OpenMP: this op runs between MindSpore's kernels, and OpenMP's idle workers spin after a
  // parallel region, taking a core from the next MatMul (the chunk graph ran 1.5x slower with 2 OpenMP threads
  // than with 1)
  on_threads(threads, [&](int t, int nt) { c.write(t, nt); });
  on_threads(threads, [&](int t, int nt) { c.transpose(t, nt); });  // after every row is written
  on_threads(threads, [&](int t, int nt) {
    std::vector<float> sc(4 * c.P);
    c.attend(t, nt, sc.data());
  });
  return 0;
}

// y = W x for W [rows, n] (float32, or Q8_0 blocks [rows, n / 32]): the decode step's GEMV alone, on the same pool
// of `threads` threads. For measuring this machine's read bandwidth the way decoding uses it
// (scripts/bench/generate.py, through ctypes) and for testing each body's GEMV (tests/test_kernel_isa.py).
template <typename WT>
int gemv_entry(const WT *W, const float *x, float *y, int64_t rows, int64_t n, int threads) {
  on_pool(threads, [&](int t, int nt) {
    int64_t b, e;
    split(rows, t, nt, &b, &e);
    gemv_rows(W, x, y, n, b, e, false);
  });
  return 0;
}

extern "C" int Gemv(const float *W, const float *x, float *y, int64_t rows, int64_t n, int threads) {
  return gemv_entry(W, x, y, rows, n, threads);
}

extern "C" int GemvQ8(const void *W, const float *x, float *y, int64_t rows, int64_t n, int threads) {
  if (n % kQ8) return 3;
  return gemv_entry(static_cast<const Q8Block *>(W), x, y, rows, n, threads);
}
