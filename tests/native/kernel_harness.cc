// Runs one ISA body of model/train_kernels.cc against the scalar body (the reference) on random data and
// prints "N passed, M failed" (exit status 1 when M > 0). Both are shared libraries built from the same
// source (model/kernels.py's flags: e.g. -march=armv8.2-a and -march=armv8-a -DMSLLM_SCALAR) and loaded
// with dlopen, so the harness runs wherever they do: natively, or an aarch64 build under qemu-aarch64
// (tests/test_kernel_harness.py). Bounds are derived from float32's unit roundoff u = 2^-24 and each
// kernel's reduction length, twice (both bodies err), as in tests/test_kernel_isa.py.
//
//   kernel_harness BODY.so SCALAR.so
#include <dlfcn.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

using Kernel = int (*)(int, void **, int *, int64_t **, const char **, void *, void *);
constexpr double U = 1.0 / (1 << 24);

struct Arg {
  std::vector<float> f;
  std::vector<int32_t> i;
  std::vector<int64_t> shape;
  bool is_int = false;
  void *data() { return is_int ? static_cast<void *>(i.data()) : static_cast<void *>(f.data()); }
};

Arg floats(std::vector<int64_t> shape, std::mt19937 *rng, float scale) {
  Arg a;
  a.shape = shape;
  int64_t n = 1;
  for (auto d : shape) n *= d;
  std::normal_distribution<float> nd(0.f, scale);
  a.f.resize(n);
  for (auto &x : a.f) x = rng ? nd(*rng) : 0.f;
  return a;
}

int call(void *lib, const char *name, std::vector<Arg> &args) {
  auto fn = reinterpret_cast<Kernel>(dlsym(lib, name));
  if (!fn) return -1;
  std::vector<void *> p;
  std::vector<int> nd;
  std::vector<int64_t *> sh;
  std::vector<const char *> dt;
  for (auto &a : args) {
    p.push_back(a.data());
    nd.push_back(static_cast<int>(a.shape.size()));
    sh.push_back(a.shape.data());
    dt.push_back(a.is_int ? "int32" : "float32");
  }
  return fn(static_cast<int>(args.size()), p.data(), nd.data(), sh.data(), dt.data(), nullptr, nullptr);
}

int passed = 0, failed = 0;

void check(const std::string &what, bool ok) {
  if (ok) {
    ++passed;
  } else {
    ++failed;
    std::printf("FAILED %s\n", what.c_str());
  }
}

// run `name` on copies of `inputs` in both libraries; compare output k element-wise within tol(k, j, body, ref)
template <typename Tol>
void compare(void *body, void *ref, const char *name, std::vector<Arg> inputs, std::vector<Arg> outputs, Tol tol) {
  std::vector<Arg> a = inputs, b = inputs;
  for (auto &o : outputs) a.push_back(o), b.push_back(o);
  const int ra = call(body, name, a), rb = call(ref, name, b);
  check(std::string(name) + " returns 0", ra == 0 && rb == 0);
  if (ra || rb) return;
  for (size_t k = inputs.size(); k < a.size(); ++k) {
    size_t bad = 0;
    for (size_t j = 0; j < a[k].f.size(); ++j) {
      const double x = a[k].f[j], y = b[k].f[j];
      if (!(std::fabs(x - y) <= tol(k - inputs.size(), j, y, b))) ++bad;
    }
    check(std::string(name) + " output " + std::to_string(k - inputs.size()) + " (" + std::to_string(bad) +
              " elements out of bounds)", bad == 0);
  }
}

int main(int argc, char **argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s BODY.so SCALAR.so\n", argv[0]);
    return 2;
  }
  void *body = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL), *ref = dlopen(argv[2], RTLD_NOW | RTLD_LOCAL);
  if (!body || !ref) {
    std::fprintf(stderr, "dlopen: %s\n", dlerror());
    return 2;
  }
  auto isa = reinterpret_cast<const char *(*)()>(dlsym(body, "MsllmKernelIsa"));
  auto risa = reinterpret_cast<const char *(*)()>(dlsym(ref, "MsllmKernelIsa"));
  std::printf("body %s vs %s\n", isa ? isa() : "?", risa ? risa() : "?");
  check("reference is the scalar body", risa && std::strcmp(risa(), "scalar") == 0);
  std::mt19937 rng(7);

  const int64_t N = 3, T = 13, S = 45;
  Arg x = floats({N, T, S}, &rng, 4.f);
  compare(body, ref, "CausalSoftmax", {x}, {floats({N, T, S}, nullptr, 0)},
          [&](size_t, size_t, double y, std::vector<Arg> &) { return (2 * S + 8) * 2 * U * std::fabs(y); });
  std::vector<Arg> sm = {x, floats({N, T, S}, nullptr, 0)};
  call(ref, "CausalSoftmax", sm);
  Arg dp = floats({N, T, S}, &rng, 1.f);
  compare(body, ref, "SoftmaxGrad", {sm[1], dp}, {floats({N, T, S}, nullptr, 0)},
          [&](size_t, size_t j, double, std::vector<Arg> &) {
            const double p = sm[1].f[j];  // |dp| < 6 and |sum p dp| < 6 here
            return (2 * S + 4) * 2 * U * p * 12 + 1e-37;
          });

  const int64_t n = 3 * 1037;
  Arg g = floats({n}, &rng, 6.f), u = floats({n}, &rng, 1.f), d = floats({n}, &rng, 1.f);
  compare(body, ref, "SwiGLU", {g, u}, {floats({n}, nullptr, 0)},
          [&](size_t, size_t, double y, std::vector<Arg> &) { return 16 * U * std::fabs(y) + 1e-30; });
  compare(body, ref, "SwiGLUGrad", {g, u, d}, {floats({n}, nullptr, 0), floats({n}, nullptr, 0)},
          [&](size_t k, size_t j, double y, std::vector<Arg> &) {
            const double gj = g.f[j], s = 1 / (1 + std::exp(-gj));
            const double cancel = (std::fabs(1 + gj) + std::fabs(gj * s)) / std::fmax(std::fabs(1 + gj - gj * s), 1e-30);
            return (16 + (k == 0 ? 4 * cancel : 0)) * U * std::fabs(y) + 1e-30;
          });

  const int64_t R = 70, H = 77;
  Arg xs = floats({R, H}, &rng, 3.f), w = floats({H}, &rng, 0.1f), eps = floats({1}, nullptr, 0), dy = floats({R, H}, &rng, 1.f);
  for (auto &v : w.f) v += 1.f;
  eps.f[0] = 1e-6f;
  compare(body, ref, "RMSNorm", {xs, w, eps}, {floats({R, H}, nullptr, 0)},
          [&](size_t, size_t, double y, std::vector<Arg> &) { return 2 * (H + 6) * U * std::fabs(y); });
  std::vector<double> inv(R), terms(R * H), dwmag(H, 0.0);
  for (int64_t r = 0; r < R; ++r) {
    double ss = 0, dot = 0;
    for (int64_t j = 0; j < H; ++j) ss += double(xs.f[r * H + j]) * xs.f[r * H + j], dot += std::fabs(double(dy.f[r * H + j]) * w.f[j] * xs.f[r * H + j]);
    inv[r] = 1 / std::sqrt(ss / H);
    for (int64_t j = 0; j < H; ++j) {
      terms[r * H + j] = inv[r] * std::fabs(dy.f[r * H + j] * w.f[j]) + inv[r] * inv[r] * inv[r] * std::fabs(xs.f[r * H + j]) * dot / H;
      dwmag[j] += std::fabs(double(dy.f[r * H + j]) * xs.f[r * H + j]) * inv[r];
    }
  }
  compare(body, ref, "RMSNormGrad", {xs, w, eps, dy}, {floats({R, H}, nullptr, 0), floats({H}, nullptr, 0)},
          [&](size_t k, size_t j, double, std::vector<Arg> &) {
            return k == 0 ? 2 * (2 * H + 10) * U * terms[j] : 2 * (R + H + 10) * U * dwmag[j];
          });

  const int64_t B = 9, V = 301;
  Arg lg = floats({B, V}, &rng, 5.f), lab;
  lab.is_int = true, lab.shape = {B};
  for (int64_t r = 0; r < B; ++r) lab.i.push_back(static_cast<int32_t>((r * 37) % V));
  lab.i[4] = -100;
  std::vector<Arg> ce = {lg, lab, floats({B}, nullptr, 0), floats({B}, nullptr, 0)};
  call(ref, "CrossEntropy", ce);
  compare(body, ref, "CrossEntropy", {lg, lab}, {floats({B}, nullptr, 0), floats({B}, nullptr, 0)},
          [&](size_t, size_t j, double y, std::vector<Arg> &) {
            return 2 * (V + 4) * U + 4 * U * (std::fabs(ce[3].f[j]) + std::fabs(y));
          });
  Arg dn = floats({B}, &rng, 1.f);
  compare(body, ref, "CrossEntropyGrad", {lg, lab, ce[3], dn}, {floats({B, V}, nullptr, 0)},
          [&](size_t, size_t j, double y, std::vector<Arg> &) {
            const int64_t r = j / V;
            const double mag = std::fabs(lg.f[j]) + std::fabs(ce[3].f[r]);
            return (8 + 2 * mag) * 2 * U * (std::fabs(y) + std::fabs(dn.f[r]));
          });

  // the AdamW update: the same correctly rounded operations in every body, so the same bits
  const int64_t K = 1001;
  Arg p = floats({K}, &rng, 1.f), gr = floats({K}, &rng, 1.f), m = floats({K}, &rng, 1.f), v = floats({K}, &rng, 1.f);
  for (auto &e : v.f) e = std::fabs(e);
  Arg off;
  off.is_int = true, off.shape = {1}, off.i = {0};
  std::vector<Arg> sc;
  for (float s : {1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.5f, 1.0f}) {
    Arg a = floats({1}, nullptr, 0);
    a.f[0] = s;
    sc.push_back(a);
  }
  std::vector<Arg> za = {p, gr, m, v, off}, zb;
  za.insert(za.end(), sc.begin(), sc.end());
  za.push_back(floats({1}, nullptr, 0));
  zb = za;
  check("ZeroAdamW returns 0", call(body, "ZeroAdamW", za) == 0 && call(ref, "ZeroAdamW", zb) == 0);
  for (int k : {0, 2, 3}) check("ZeroAdamW operand " + std::to_string(k) + " bit-identical", za[k].f == zb[k].f);

  // operand checks: T > S is refused before any write
  std::vector<Arg> bad = {floats({2, 9, 5}, nullptr, 0), floats({2, 9, 5}, nullptr, 0)};
  check("CausalSoftmax refuses T > S", call(body, "CausalSoftmax", bad) == 3);

  std::printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
