// MindSpore's thread pool waits by calling sched_yield in a loop (idle kernel and actor threads, and a thread
// waiting for a parallel kernel's other tasks). On Linux's EEVDF scheduler (6.6+) every sched_yield pushes the
// caller's virtual deadline one slice later; a thread that yields in a loop soon has a deadline behind any other
// runnable task's, so a `nice -n 19` process on the same core is picked whenever it is eligible and runs a whole
// slice. Beside one niced busy loop the train step ran at half speed (tiny-llama-bench, 2 cores: 0.23 -> 0.47 s;
// PyTorch's step, whose OpenMP threads spin without yielding, lost 1.5%). docs/MINDSPORE_CPU.md, "Threads".
//
// msllm_patch_yield(needle) points every `sched_yield` import (the GOT slot of a JUMP_SLOT or GLOB_DAT
// relocation) of each loaded library whose path contains `needle` at msllm_spin_yield: a short run of the CPU's
// spin-wait hint, then return. The waiting loops are unchanged; they just stop handing the core away. Nothing
// else is touched (other libraries keep the real sched_yield). Linux with glibc, x86-64 and AArch64.
//
// msllm_patch_spin_min(needle, real) does the same for MindSpore's `ThreadPool::SetSpinCountMinValue` imports:
// after every graph run MindSpore's graph scheduler drops its pool's spin count to the minimum, so the pool's threads
// sleep as soon as the graph ends and the next graph call wakes them (a futex wake, and on a VM a halted vCPU). A
// caller that runs many small graphs back to back (the layer-at-a-time train step: ~2L + 3 a step) holds the drop
// (msllm_hold_spin(1)): the pool keeps the spin count the graph started with until msllm_hold_spin(0), which drops
// it then, once, as the last graph would have. Outside a hold every call goes straight to MindSpore's own.
#include <elf.h>
#include <link.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>

#include "simd.h"

namespace {

std::atomic<long> g_calls{0};

using SpinMin = void (*)(void *);  // ThreadPool::SetSpinCountMinValue(this): a non-virtual member, `this` first
std::atomic<SpinMin> g_spin_min{nullptr};  // MindSpore's own
std::atomic<int> g_hold{0};
std::atomic<void *> g_held_pool{nullptr};  // the pool whose drop a hold deferred
std::atomic<long> g_deferred{0};

using IdleHook = void (*)();  // run by a waiting thread before it pauses: the train kernels' MsllmHelp
std::atomic<IdleHook> g_idle_hook{nullptr};

constexpr int kPauses = 32;  // ~0.3-1.5 us by the CPU's pause latency: about one sched_yield syscall

struct PatchJob {
  const char *needle;
  const char *symbol;  // the import whose slots are written
  void *target;
  int slots;      // GOT slots now pointing at target
  int libraries;  // libraries whose path matched
  int failures;   // slots that could not be written
};

#if defined(__x86_64__)
constexpr unsigned kJumpSlot = R_X86_64_JUMP_SLOT, kGlobDat = R_X86_64_GLOB_DAT;
#elif defined(__aarch64__)
constexpr unsigned kJumpSlot = R_AARCH64_JUMP_SLOT, kGlobDat = R_AARCH64_GLOB_DAT;
#else
constexpr unsigned kJumpSlot = ~0u, kGlobDat = ~0u;
#endif

// A dynamic-section address: glibc rewrites most of them to absolute addresses in place; where it did not (a
// read-only dynamic section), the value is still an offset from the load address.
inline uintptr_t dyn_addr(uintptr_t value, uintptr_t base) { return value < base ? value + base : value; }

bool write_slot(void **slot, void *value) {
  if (*slot == value) return true;
  const long page = sysconf(_SC_PAGESIZE);
  uintptr_t start = reinterpret_cast<uintptr_t>(slot) & ~static_cast<uintptr_t>(page - 1);
  // The slot may sit in RELRO (read-only after relocation): open the page, write, and close it again. A slot on
  // an ordinary writable page is left writable (PROT_READ | PROT_WRITE is what it had).
  if (mprotect(reinterpret_cast<void *>(start), page, PROT_READ | PROT_WRITE) != 0) return false;
  __atomic_store_n(slot, value, __ATOMIC_RELEASE);
  return true;
}

void reprotect_relro(const dl_phdr_info *info) {
  const long page = sysconf(_SC_PAGESIZE);
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr) &ph = info->dlpi_phdr[i];
    if (ph.p_type != PT_GNU_RELRO) continue;
    uintptr_t start = (info->dlpi_addr + ph.p_vaddr) & ~static_cast<uintptr_t>(page - 1);
    uintptr_t end = info->dlpi_addr + ph.p_vaddr + ph.p_memsz;
    end &= ~static_cast<uintptr_t>(page - 1);  // the loader protects whole pages only
    if (end > start) mprotect(reinterpret_cast<void *>(start), end - start, PROT_READ);
  }
}

// Calls visit(slot) for every GOT slot of `info`'s library that an import of `symbol` goes through (JUMP_SLOT and
// GLOB_DAT relocations, in DT_JMPREL and DT_RELA); stops early when visit returns false.
template <class Visit>
void for_each_import_slot(const dl_phdr_info *info, const char *symbol, Visit visit) {
  const ElfW(Dyn) *dyn = nullptr;
  for (int i = 0; i < info->dlpi_phnum; ++i)
    if (info->dlpi_phdr[i].p_type == PT_DYNAMIC)
      dyn = reinterpret_cast<const ElfW(Dyn) *>(info->dlpi_addr + info->dlpi_phdr[i].p_vaddr);
  if (dyn == nullptr) return;
  const uintptr_t base = info->dlpi_addr;
  const ElfW(Sym) *symtab = nullptr;
  const char *strtab = nullptr;
  const ElfW(Rela) *tables[2] = {nullptr, nullptr};
  size_t sizes[2] = {0, 0};
  bool plt_is_rela = true;
  for (const ElfW(Dyn) *d = dyn; d->d_tag != DT_NULL; ++d) {
    switch (d->d_tag) {
      case DT_SYMTAB: symtab = reinterpret_cast<const ElfW(Sym) *>(dyn_addr(d->d_un.d_ptr, base)); break;
      case DT_STRTAB: strtab = reinterpret_cast<const char *>(dyn_addr(d->d_un.d_ptr, base)); break;
      case DT_JMPREL: tables[0] = reinterpret_cast<const ElfW(Rela) *>(dyn_addr(d->d_un.d_ptr, base)); break;
      case DT_PLTRELSZ: sizes[0] = d->d_un.d_val; break;
      case DT_PLTREL: plt_is_rela = d->d_un.d_val == DT_RELA; break;
      case DT_RELA: tables[1] = reinterpret_cast<const ElfW(Rela) *>(dyn_addr(d->d_un.d_ptr, base)); break;
      case DT_RELASZ: sizes[1] = d->d_un.d_val; break;
      default: break;
    }
  }
  if (symtab == nullptr || strtab == nullptr || !plt_is_rela) return;  // x86-64 and AArch64 use RELA only
  for (int t = 0; t < 2; ++t) {
    if (tables[t] == nullptr) continue;
    for (size_t k = 0; k < sizes[t] / sizeof(ElfW(Rela)); ++k) {
      const ElfW(Rela) &r = tables[t][k];
#if defined(__LP64__)
      const unsigned type = ELF64_R_TYPE(r.r_info);
      const size_t sym = ELF64_R_SYM(r.r_info);
#else
      const unsigned type = ELF32_R_TYPE(r.r_info);
      const size_t sym = ELF32_R_SYM(r.r_info);
#endif
      if ((type != kJumpSlot && type != kGlobDat) || sym == 0) continue;
      if (strcmp(strtab + symtab[sym].st_name, symbol) != 0) continue;
      if (!visit(reinterpret_cast<void **>(base + r.r_offset))) return;
    }
  }
}

inline bool matches(const dl_phdr_info *info, const char *needle) {
  return info->dlpi_name != nullptr && strstr(info->dlpi_name, needle) != nullptr;
}

int patch_library(dl_phdr_info *info, size_t, void *data) {
  auto *job = static_cast<PatchJob *>(data);
  if (!matches(info, job->needle)) return 0;
  ++job->libraries;
  bool wrote = false;
  for_each_import_slot(info, job->symbol, [&](void **slot) {
    if (write_slot(slot, job->target)) {
      ++job->slots;
      wrote = true;
    } else {
      ++job->failures;
    }
    return true;
  });
  if (wrote) reprotect_relro(info);
  return 0;
}

struct FindJob {
  const char *needle;
  void *found;
};

int find_target(dl_phdr_info *info, size_t, void *data) {
  auto *job = static_cast<FindJob *>(data);
  if (!matches(info, job->needle)) return 0;
  for_each_import_slot(info, "sched_yield", [&](void **slot) {
    job->found = *slot;
    return false;
  });
  return job->found != nullptr;  // the first matching library that imports sched_yield
}

}  // namespace

extern "C" {

const char *MsllmKernelIsa() { return MSLLM_ISA; }

// What the patched libraries call instead of sched_yield: the spin-wait hint, then back to their loop (which
// checks its flag and calls again, or sleeps on its condition variable after its own spin count).
int msllm_spin_yield() {
  g_calls.fetch_add(1, std::memory_order_relaxed);
  if (IdleHook hook = g_idle_hook.load(std::memory_order_relaxed)) hook();
  for (int i = 0; i < kPauses; ++i) simd::cpu_relax();
  return 0;
}

// Have every wait of the patched loops call `hook` first (a waiting thread lends itself to a kernel that has work
// open: model/train_kernels.cc MsllmHelp); null removes it.
void msllm_set_idle_hook(void *hook) {
  g_idle_hook.store(reinterpret_cast<IdleHook>(hook), std::memory_order_release);
}

// How many times msllm_spin_yield has run in this process (tests: the patched loops do call it).
long msllm_spin_yield_calls() { return g_calls.load(std::memory_order_relaxed); }

// What the patched SetSpinCountMinValue imports call: MindSpore's own, or under a hold, nothing yet (the pool kept).
void msllm_spin_count_min(void *pool) {
  if (g_hold.load(std::memory_order_acquire)) {
    g_held_pool.store(pool, std::memory_order_release);
    g_deferred.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  if (SpinMin real = g_spin_min.load(std::memory_order_acquire)) real(pool);
}

// Hold (1) or release (0) the pool's spin-count drop; a release drops it for the pool a hold deferred, if any.
void msllm_hold_spin(int on) {
  g_hold.store(on ? 1 : 0, std::memory_order_release);
  if (on) return;
  void *pool = g_held_pool.exchange(nullptr, std::memory_order_acq_rel);
  SpinMin real = g_spin_min.load(std::memory_order_acquire);
  if (pool != nullptr && real != nullptr) real(pool);
}

// How many drops holds have deferred in this process (tests: the graphs' drops did come through here).
long msllm_spin_min_deferred() { return g_deferred.load(std::memory_order_relaxed); }

// Point the SetSpinCountMinValue imports (`symbol`, mangled) of every loaded library whose path contains `needle`
// at msllm_spin_count_min; `real` is MindSpore's own function (the caller resolves it: its library exports it).
// Returns the slots written, or -1 when one could not be.
int msllm_patch_spin_min(const char *needle, const char *symbol, void *real) {
  if (real == nullptr) return 0;
  g_spin_min.store(reinterpret_cast<SpinMin>(real), std::memory_order_release);
  PatchJob job{needle, symbol, reinterpret_cast<void *>(&msllm_spin_count_min), 0, 0, 0};
  dl_iterate_phdr(patch_library, &job);
  return job.failures ? -1 : job.slots;
}

// Patch the sched_yield imports of every loaded library whose path contains `needle`. Returns the number of GOT
// slots now pointing at msllm_spin_yield (0: no such library, or none imports sched_yield), or -1 when a slot
// could not be written. `libraries`, when not null, receives how many libraries matched.
int msllm_patch_yield(const char *needle, int *libraries) {
  PatchJob job{needle, "sched_yield", reinterpret_cast<void *>(&msllm_spin_yield), 0, 0, 0};
  dl_iterate_phdr(patch_library, &job);
  if (libraries != nullptr) *libraries = job.libraries;
  return job.failures ? -1 : job.slots;
}

// The address a library's `sched_yield` import resolves to now (its first such slot, in the first library whose
// path contains `needle` and imports it), or null: tests compare it with msllm_spin_yield's.
void *msllm_yield_target(const char *needle) {
  FindJob job{needle, nullptr};
  dl_iterate_phdr(find_target, &job);
  return job.found;
}

}  // extern "C"
