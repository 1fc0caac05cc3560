// cudasim.h: run our CUDA kernel headers, unchanged, on the CPU (g++ 12,
// -std=c++20 -DCUDASIM). Kernel headers include csrc/cudasim/cuda_compat.cuh,
// which pulls this in under -DCUDASIM; nvcc never sees it.
//
// Model. A launch runs its blocks one after another (x fastest, then y, z),
// one launch at a time. Each CUDA thread of a block is a fiber (default), or
// with -DCUDASIM_THREADS a std::thread, so ThreadSanitizer sees real races.
// Barriers and warp collectives synchronize exactly the threads they name:
// lanes run independently (as under Volta's independent thread scheduling), so
// code that relies on implicit warp lockstep gets wrong values here instead of
// appearing to work.
//
// API: cudasim::launch(kernel, grid, block, smem_bytes, args...) (grid and
// block take dim3 or integers); cudasim::named(kernel, "name") for messages;
// cudasim::dynamic_smem(); cudasim::Error (a std::runtime_error, with kind());
// cudasim::set_warn_only(), cudasim::warning_count(). Kernels normally use the
// DLLM_LAUNCH / DLLM_DYNAMIC_SMEM macros of cuda_compat.cuh.
//
// Checks. Deadlock (every live thread waits and no wait can finish: reported
// with file:line and thread ranges per wait site), divergent __syncthreads
// (two call sites meet at one barrier), a shuffle reading a lane outside its
// mask or one that exited, a caller outside its own mask, mismatched warp
// collectives, dynamic shared memory written past its ends (canaries), bad
// launch configurations, and exceptions thrown by kernels. launch() stops at
// the first error and throws cudasim::Error; it never aborts the process
// (we run inside pytest), and the next launch works normally.
//
// Environment: CUDASIM_WARN_ONLY=1 turns the reports that allow continuing
// (divergent barrier, bad shuffle source, smem canary) into stderr warnings;
// CUDASIM_STACK_KB sets the fiber stack size (default 256, read once).
//
// Differences from a GPU: static __shared__ is a function-local `static`, so it
// starts zeroed once and keeps its contents from block to block (kernels must
// not rely on either). Fast-math intrinsics are precise libm calls. Float
// atomics add in a fixed order (fibers) or a racy one (threads), so compare
// with tolerances. __activemask() returns every live lane of the warp.
// Unsupported: inline PTX, wmma/mma, cp.async/TMA, textures, grid sync,
// dynamic parallelism, `extern __shared__` (use DLLM_DYNAMIC_SMEM).
#pragma once

#if !defined(CUDASIM)
#error "cudasim.h is the CPU simulation of CUDA: compile with -DCUDASIM"
#endif
#if defined(__CUDACC__)
#error "cudasim.h must not be compiled by nvcc; include cuda_compat.cuh instead"
#endif

// ThreadSanitizer cannot follow fiber switches between our own stacks (and
// would see one OS thread anyway), so a TSan build always uses real threads.
#if defined(__SANITIZE_THREAD__) && !defined(CUDASIM_THREADS)
#define CUDASIM_THREADS 1
#endif
#if defined(__SANITIZE_ADDRESS__)
#define CUDASIM_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define CUDASIM_ASAN 1
#endif
#endif
// The hand-written context switch is x86-64 only; elsewhere use ucontext.
#if !defined(CUDASIM_THREADS) && !defined(CUDASIM_UCONTEXT) && !defined(__x86_64__)
#define CUDASIM_UCONTEXT 1
#endif

// The CUDA headers work on the host for the half/bf16 types, conversions and
// operators; they also bring dim3/uint3 and the qualifier macros, which expand
// to nothing (or to GNU attributes such as __align__) outside nvcc.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>  // before __noinline__ is defined: shared_ptr_base.h spells __attribute__((__noinline__))
#include <mutex>
#include <source_location>
#include <stdexcept>
#include <system_error>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
#if defined(CUDASIM_UCONTEXT)
#include <ucontext.h>
#endif
#if defined(CUDASIM_ASAN)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

// ---- qualifiers ------------------------------------------------------------
// Blocks of a launch run one after another and one launch runs at a time, so a
// function-local static is exactly "one array per block, shared by its
// threads".
#undef __shared__
#define __shared__ static
#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif
#ifndef __noinline__
#define __noinline__ __attribute__((noinline))
#endif

inline constexpr int warpSize = 32;

namespace cudasim {

enum class ErrorKind {
  InvalidLaunch,     // bad grid/block/smem, launch from inside a kernel
  Deadlock,          // no waiting thread can ever be released
  DivergentBarrier,  // __syncthreads reached from different call sites
  WarpLane,          // caller not in mask, shuffle source inactive, bad width
  WarpMismatch,      // lanes of one mask meet at different collectives
  SmemOverflow,      // dynamic shared memory canary overwritten
  KernelException,   // the kernel threw
  Trap,              // __trap()
  Usage,             // a device-only call made outside a kernel
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& msg) : std::runtime_error(msg), kind_(kind) {}
  ErrorKind kind() const noexcept { return kind_; }

 private:
  ErrorKind kind_;
};

namespace detail {

constexpr unsigned kMaxBlockThreads = 1024;
constexpr std::size_t kMaxDynamicSmem = 227 * 1024;  // sm_90 opt-in maximum
constexpr std::size_t kSmemGuard = 1024;             // canary bytes on each side
constexpr unsigned char kSmemPoison = 0xFF;          // NaN as float, -1 as int

enum class Status : unsigned char { Runnable, Blocked, Exited };
enum class Op : unsigned char {
  None, Bar, BarCount, BarAnd, BarOr,                   // block barrier family
  Sync, Ballot, Any, All,                               // warp votes
  ShflIdx, ShflUp, ShflDown, ShflXor,                   // warp shuffles
  RedAdd, RedMin, RedMax, RedAnd, RedOr, RedXor,        // __reduce_*_sync
};
inline const char* op_name(Op op) {
  static const char* const names[] = {
      "?", "__syncthreads", "__syncthreads_count", "__syncthreads_and", "__syncthreads_or",
      "__syncwarp", "__ballot_sync", "__any_sync", "__all_sync",
      "__shfl_sync", "__shfl_up_sync", "__shfl_down_sync", "__shfl_xor_sync",
      "__reduce_add_sync", "__reduce_min_sync", "__reduce_max_sync", "__reduce_and_sync",
      "__reduce_or_sync", "__reduce_xor_sync"};
  return names[static_cast<int>(op)];
}
inline bool is_barrier(Op op) { return op >= Op::Bar && op <= Op::BarOr; }
inline bool is_shuffle(Op op) { return op >= Op::ShflIdx && op <= Op::ShflXor; }

struct Block;

// One CUDA thread. While it waits in a collective, its operands live in its
// own frame; the last arriver computes every participant's result, so no
// lane ever reads another lane's frame after that lane moved on.
struct Thread {
  Block* blk = nullptr;
  uint3 tid{};
  unsigned rank = 0, lane = 0, warp = 0;
  Status st = Status::Runnable;
  Op op = Op::None;
  std::source_location site;
  unsigned mask = 0, size = 0;
  int b = 0, width = 32, pred = 0, res = 0;
  const void* in = nullptr;
  void* out = nullptr;
  // Threads engine: bumped by whoever releases this thread from a wait, so the
  // released threads wake in parallel instead of queueing on the block mutex.
  std::atomic<unsigned> wake{0};
  // Fiber engine only.
  void* sp = nullptr;
  void* asan_fake = nullptr;
#if defined(CUDASIM_UCONTEXT)
  ucontext_t uc{};
#endif
};

// Collectives pending in one warp: one group per distinct mask.
struct Warp {
  unsigned live = 0;  // lanes that exist and have not exited
  unsigned ngroups = 0;
  unsigned gmask[32] = {}, garr[32] = {};
};

struct Launch {
  const char* name;
  std::source_location site;
  dim3 grid, block;
  std::size_t smem;
  unsigned char* smem_ptr;
  void (*body)(void*);
  void* arg;
  unsigned warnings = 0;
};

struct Block {
  Launch* L = nullptr;
  uint3 idx{};
  unsigned n = 0, nwarps = 0;
  std::vector<Thread> th;
  std::unique_ptr<Warp[]> warps;
  unsigned live = 0, blocked = 0, bar_arrived = 0;
  Thread* bar_first = nullptr;
  bool bar_diverged = false;
  bool abort = false;
  ErrorKind err_kind = ErrorKind::Usage;
  std::string err;
  // Threads engine only: the block's state is guarded by `mu`; workers start a
  // block when `epoch` changes and count themselves out in `finished`.
  std::mutex mu;
  std::atomic<unsigned> epoch{0}, finished{0};
  bool shutdown = false;
};

struct Abort {};  // threads engine: unwinds a CUDA thread after an error

struct Runtime {
  std::mutex launch_mu;
  std::atomic<int> warn_override{-1};
  std::atomic<unsigned long> warnings{0};
  // Fiber engine: reusable stacks (mmap'd, guard page below each).
  std::vector<char*> stacks;
  std::size_t stack_size = 0, page = 0;
  bool stacks_dirty = false;  // ASan: abandoned frames may have left poison
  void* sched_sp = nullptr;
  const void* sched_stack_lo = nullptr;
  std::size_t sched_stack_size = 0;
#if defined(CUDASIM_UCONTEXT)
  ucontext_t sched_uc{};
#endif
};
inline Runtime& rt() {
  static Runtime r;
  return r;
}

inline thread_local Thread* t_self = nullptr;

inline Thread& self(const char* what = "a CUDA device function") {
  Thread* t = t_self;
  if (!t) throw Error(ErrorKind::Usage, std::string("cudasim: ") + what + " called outside a kernel");
  return *t;
}

// ---- reports -----------------------------------------------------------------

inline std::string at(const std::source_location& s) {
  return std::string(s.file_name()) + ":" + std::to_string(s.line());
}
inline bool same_site(const std::source_location& a, const std::source_location& b) {
  return a.line() == b.line() && a.column() == b.column() &&
         (a.file_name() == b.file_name() || std::strcmp(a.file_name(), b.file_name()) == 0);
}
inline std::string hex(unsigned v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}
// Append-only string building: GCC 12 at -O3 gives a false -Wrestrict for
// `"literal" + std::string&&` (GCC PR 105329).
inline std::string dim_str(unsigned x, unsigned y, unsigned z) {
  std::string s("(");
  s.append(std::to_string(x)).append(",").append(std::to_string(y)).append(",").append(std::to_string(z));
  return s.append(")");
}
inline std::string thread_str(const Thread& t) {
  return "thread " + std::to_string(t.rank) + " " + dim_str(t.tid.x, t.tid.y, t.tid.z) + " lane " +
         std::to_string(t.lane);
}
// "threads 0-15, 32" from sorted thread ranks.
inline std::string ranges(const std::vector<unsigned>& r) {
  std::string s = r.size() == 1 ? "thread " : "threads ";
  for (std::size_t i = 0; i < r.size();) {
    std::size_t j = i;
    while (j + 1 < r.size() && r[j + 1] == r[j] + 1) ++j;
    if (i) s += ", ";
    s += std::to_string(r[i]);
    if (j > i) s.append("-").append(std::to_string(r[j]));
    i = j + 1;
  }
  return s;
}
inline std::string context(const Block& B) {
  const Launch& L = *B.L;
  return "kernel " + std::string(L.name) + " launched at " + at(L.site) + ", block " +
         dim_str(B.idx.x, B.idx.y, B.idx.z) + " of grid " + dim_str(L.grid.x, L.grid.y, L.grid.z) +
         ", block dim " + dim_str(L.block.x, L.block.y, L.block.z);
}

inline bool warn_only() {
  const int o = rt().warn_override.load();
  if (o >= 0) return o != 0;
  const char* e = std::getenv("CUDASIM_WARN_ONLY");
  return e && *e && std::strcmp(e, "0") != 0;
}

#if defined(CUDASIM_THREADS)
using Lock = std::unique_lock<std::mutex>;
inline Lock lock_block(Block& B) { return Lock(B.mu); }
// A bare futex rather than std::atomic::wait: libstdc++ spins and yields
// before sleeping, which with hundreds of threads on few cores (and under
// TSan) costs more than the wait itself. The atomic carries the ordering.
inline void futex_wait(std::atomic<unsigned>& a, unsigned seen) {
  static_assert(sizeof(std::atomic<unsigned>) == 4 && std::atomic<unsigned>::is_always_lock_free);
  while (a.load(std::memory_order_acquire) == seen)
    syscall(SYS_futex, reinterpret_cast<unsigned*>(&a), FUTEX_WAIT_PRIVATE, seen, nullptr, nullptr, 0);
}
inline void futex_wake(std::atomic<unsigned>& a, int n) {
  syscall(SYS_futex, reinterpret_cast<unsigned*>(&a), FUTEX_WAKE_PRIVATE, n, nullptr, nullptr, 0);
}
inline void wake(Thread& t) {
  t.wake.fetch_add(1, std::memory_order_release);
  futex_wake(t.wake, 1);
}
#else
struct Lock {  // fibers never run concurrently; non-trivial only to keep -Wunused quiet
  ~Lock() {}
};
inline Lock lock_block(Block&) { return {}; }
inline void wake(Thread&) {}
#endif

// Ends t's wait (the caller holds the block lock).
inline void release(Thread& t) {
  t.st = Status::Runnable;
  t.op = Op::None;
  wake(t);
}

// Records the block's first error and stops the block (the launch throws).
inline void set_error(Block& B, ErrorKind k, std::string msg) {
  if (B.abort) return;
  B.abort = true;
  B.err_kind = k;
  B.err = std::move(msg);
  for (Thread& t : B.th)  // still Blocked when they wake: they unwind (threads engine)
    if (t.st == Status::Blocked) wake(t);
}

[[noreturn]] inline void escape(Thread& t);
inline void thread_exit(Thread& t);

// Continuable errors become warnings under CUDASIM_WARN_ONLY; everything else
// stops the block and never returns to the caller. The message is built by
// `make` so that its temporaries are gone before an abandoned fiber escapes:
// nothing on its stack is ever destroyed (LeakSanitizer would see them).
template <class MakeMsg>
inline void report(Thread& t, ErrorKind k, MakeMsg&& make, bool continuable) {
  Block& B = *t.blk;
  std::string msg = make();
  if (continuable && warn_only()) {
    rt().warnings.fetch_add(1);
    if (B.L->warnings < 8)
      std::fprintf(stderr, "cudasim warning: %s\n  in %s\n", msg.c_str(), context(B).c_str());
    else if (B.L->warnings == 8)
      std::fprintf(stderr, "cudasim warning: further warnings of this launch suppressed\n");
    ++B.L->warnings;
    return;
  }
  set_error(B, k, std::move(msg));
  escape(t);
}

inline std::string describe_deadlock(const Block& B) {
  struct Site {
    const Thread* first;
    std::vector<unsigned> ranks;
  };
  std::vector<Site> sites;
  for (const Thread& t : B.th) {
    if (t.st != Status::Blocked) continue;
    Site* s = nullptr;
    for (Site& c : sites)
      if (c.first->op == t.op && c.first->mask == t.mask && same_site(c.first->site, t.site)) s = &c;
    if (!s) s = &sites.emplace_back(Site{&t, {}});
    s->ranks.push_back(t.rank);
  }
  std::string m = "deadlock: every live thread of the block waits and none of the waits can complete: ";
  for (std::size_t i = 0; i < sites.size(); ++i) {
    const Thread& f = *sites[i].first;
    m += (i ? ", " : "") + ranges(sites[i].ranks) + " at " + at(f.site) + " (" + op_name(f.op) +
         (is_barrier(f.op) ? "" : " mask " + hex(f.mask)) + ")";
  }
  const unsigned exited = B.n - B.live;
  if (exited) m += "; " + std::to_string(exited) + " thread(s) already exited";
  return m;
}

// Called after an event (arrival, exit) that completed nothing: if every live
// thread is now waiting, no future event can release any of them.
inline void check_deadlock(Thread& t) {
  Block& B = *t.blk;
  if (B.live > 0 && B.blocked == B.live) report(t, ErrorKind::Deadlock, [&] { return describe_deadlock(B); }, false);
}

// ---- fibers ------------------------------------------------------------------
#if !defined(CUDASIM_THREADS)

#if !defined(CUDASIM_UCONTEXT)
// Switch stacks: save the resume point on the current stack, store the stack
// pointer in *save and continue where `next` was saved. Callee-saved registers
// are spilled by the compiler because the asm clobbers them; rbp is pushed by
// hand since it may be the frame pointer. The 128-byte step protects the
// caller's red zone. Unlike swapcontext there is no signal-mask syscall, which
// makes a switch ~50x cheaper. No `ret` is used, so CET shadow stacks agree.
inline void switch_stack(void** save, void* next) {
  asm volatile(
      "subq $128, %%rsp\n\t"
      "pushq %%rbp\n\t"
      "leaq 1f(%%rip), %%rax\n\t"
      "pushq %%rax\n\t"
      "movq %%rsp, (%0)\n\t"
      "movq %1, %%rsp\n\t"
      "popq %%rax\n\t"
      "jmpq *%%rax\n"
      "1:\n\t"
      "popq %%rbp\n\t"
      "addq $128, %%rsp\n\t"
      : "+D"(save), "+S"(next)
      :
      : "rax", "rbx", "rcx", "rdx", "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15", "memory",
        "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
        "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15"
#if defined(__AVX512F__)
        , "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22", "xmm23", "xmm24", "xmm25",
        "xmm26", "xmm27", "xmm28", "xmm29", "xmm30", "xmm31"
#endif
  );
}
#endif

// ASan must be told which stack is current, or it reports false overflows.
inline void asan_start(void** fake, const void* lo, std::size_t size) {
#if defined(CUDASIM_ASAN)
  __sanitizer_start_switch_fiber(fake, lo, size);
#else
  (void)fake, (void)lo, (void)size;
#endif
}
inline void asan_finish(void* fake, const void** lo, std::size_t* size) {
#if defined(CUDASIM_ASAN)
  __sanitizer_finish_switch_fiber(fake, lo, size);
#else
  (void)fake, (void)lo, (void)size;
#endif
}

inline char* stack_of(const Thread& t) { return rt().stacks[t.rank]; }

// From a fiber back to the scheduler. `final` means this fiber is never
// resumed, so ASan may drop its fake stack.
inline void to_scheduler(Thread& t, bool final) {
  Runtime& R = rt();
  asan_start(final ? nullptr : &t.asan_fake, R.sched_stack_lo, R.sched_stack_size);
#if defined(CUDASIM_UCONTEXT)
  swapcontext(&t.uc, &R.sched_uc);
#else
  switch_stack(&t.sp, R.sched_sp);
#endif
  asan_finish(t.asan_fake, nullptr, nullptr);
}

[[noreturn]] inline void fiber_entry() {
  Thread& t = *t_self;
  Runtime& R = rt();
  asan_finish(nullptr, &R.sched_stack_lo, &R.sched_stack_size);
  {  // scoped: this frame is never unwound, so nothing may outlive the block
    std::string what;
    bool threw = false;
    try {
      t.blk->L->body(t.blk->L->arg);
    } catch (const std::exception& e) {
      threw = true, what = e.what();
    } catch (...) {
      threw = true, what = "an exception not derived from std::exception";
    }
    if (threw) set_error(*t.blk, ErrorKind::KernelException, "kernel threw in " + thread_str(t) + ": " + what);
  }
  if (!t.blk->abort) thread_exit(t);
  t.st = Status::Exited;
  for (;;) to_scheduler(t, true);
}

[[noreturn]] inline void escape(Thread& t) {
  // The scheduler never resumes a fiber of an aborted block: the remaining
  // fibers are abandoned without unwinding (their stacks are reused; objects
  // the kernel allocated on them leak).
  for (;;) to_scheduler(t, true);
}

inline void wait_released(Thread& t, Lock&) {
  while (t.st == Status::Blocked) to_scheduler(t, false);
}
inline void enter(Block&, Lock&) {}

inline void ensure_stacks(unsigned n) {
  Runtime& R = rt();
  if (!R.page) {
    R.page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    std::size_t kb = 256;
    if (const char* e = std::getenv("CUDASIM_STACK_KB"))
      if (long v = std::atol(e); v >= 16) kb = static_cast<std::size_t>(v);
    R.stack_size = (kb * 1024 + R.page - 1) / R.page * R.page;
  }
  while (R.stacks.size() < n) {
    void* p = mmap(nullptr, R.stack_size + R.page, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    mprotect(p, R.page, PROT_NONE);  // guard page: a stack overflow faults at once
    R.stacks.push_back(static_cast<char*>(p) + R.page);
  }
#if defined(CUDASIM_ASAN)
  if (R.stacks_dirty)
    for (char* s : R.stacks) __asan_unpoison_memory_region(s, R.stack_size);
  R.stacks_dirty = false;
#endif
}

inline void init_fiber(Thread& t) {
  Runtime& R = rt();
  char* lo = stack_of(t);
#if defined(CUDASIM_ASAN)
  // The previous fiber on this stack never left fiber_entry, so that frame's
  // shadow (scope poison) is stale; deeper frames returned and cleaned up.
  const std::size_t used = std::min<std::size_t>(R.stack_size, 16 * 1024);
  __asan_unpoison_memory_region(lo + R.stack_size - used, used);
#endif
#if defined(CUDASIM_UCONTEXT)
  getcontext(&t.uc);
  t.uc.uc_stack.ss_sp = lo;
  t.uc.uc_stack.ss_size = R.stack_size;
  t.uc.uc_link = nullptr;
  makecontext(&t.uc, reinterpret_cast<void (*)()>(&fiber_entry), 0);
#else
  // fiber_entry is "called" with a null return address (it never returns) and
  // the stack aligned as after a call instruction.
  auto top = (reinterpret_cast<std::uintptr_t>(lo) + R.stack_size) & ~std::uintptr_t{15};
  void** sp = reinterpret_cast<void**>(top);
  *--sp = nullptr;
  *--sp = reinterpret_cast<void*>(&fiber_entry);
  t.sp = sp;
#endif
  t.asan_fake = nullptr;
}

// Deterministic round robin: each pass runs every runnable fiber until it
// blocks or exits. Returns when all exited or the block was aborted.
inline void run_block(Block& B) {
  Runtime& R = rt();
  for (Thread& t : B.th) init_fiber(t);
  while (B.live > 0 && !B.abort) {
    bool ran = false;
    for (Thread& t : B.th) {
      if (t.st != Status::Runnable) continue;
      ran = true;
      t_self = &t;
      void* fake = nullptr;
      asan_start(&fake, stack_of(t), R.stack_size);
#if defined(CUDASIM_UCONTEXT)
      swapcontext(&R.sched_uc, &t.uc);
#else
      switch_stack(&R.sched_sp, t.sp);
#endif
      asan_finish(fake, nullptr, nullptr);
      t_self = nullptr;
      if (B.abort) break;
    }
    if (!ran && !B.abort) set_error(B, ErrorKind::Deadlock, "internal: no runnable fiber");
  }
  if (B.abort) R.stacks_dirty = true;
}

#else  // ---- threads engine ---------------------------------------------------

[[noreturn]] inline void escape(Thread&) { throw Abort{}; }

inline void enter(Block& B, Lock&) {
  if (B.abort) throw Abort{};
}
inline void wait_released(Thread& t, Lock& lk) {
  if (t.st != Status::Blocked) return;  // this thread completed the wait itself
  const unsigned seen = t.wake.load(std::memory_order_relaxed);
  lk.unlock();
  futex_wait(t.wake, seen);
  // The waker wrote t.st (and the results) before its release increment, and
  // nobody else writes them while t waits, so no lock is needed to read them.
  if (t.st == Status::Blocked) throw Abort{};  // woken by set_error
}

#endif

// ---- barriers and warp collectives (shared by both engines) -----------------

inline void complete_barrier(Block& B) {
  int count = 0;
  for (Thread& t : B.th)
    if (t.st == Status::Blocked && is_barrier(t.op)) count += t.pred != 0;
  const int arrived = static_cast<int>(B.bar_arrived);
  for (Thread& t : B.th) {
    if (t.st != Status::Blocked || !is_barrier(t.op)) continue;
    t.res = t.op == Op::BarCount ? count
            : t.op == Op::BarAnd ? count == arrived
            : t.op == Op::BarOr  ? count > 0
                                 : 0;
    release(t);
  }
  B.blocked -= B.bar_arrived;
  B.bar_arrived = 0;
  B.bar_first = nullptr;
  B.bar_diverged = false;
}

// Source lane of a shuffle, per the PTX shfl.sync pseudo-code: c packs the
// segment mask (32 - width) in bits 12:8 and the clamp lane in 4:0 (0x1f for
// idx/down/bfly, 0 for up), and only b[4:0] is used, so an offset of 33 acts
// as 1. Out of range means "read your own value".
inline unsigned shuffle_source(Op op, unsigned lane, int b, int width) {
  const unsigned c = (static_cast<unsigned>(32 - width) << 8) | (op == Op::ShflUp ? 0u : 0x1fu);
  const int seg = static_cast<int>((c >> 8) & 0x1f), clampv = static_cast<int>(c & 0x1f);
  const int bval = b & 0x1f, l = static_cast<int>(lane);
  const int max_lane = (l & seg) | (clampv & ~seg), min_lane = l & seg;
  int j = l;
  bool ok = false;
  switch (op) {
    case Op::ShflUp: j = l - bval, ok = j >= max_lane; break;
    case Op::ShflDown: j = l + bval, ok = j <= max_lane; break;
    case Op::ShflXor: j = l ^ bval, ok = j <= max_lane; break;
    default: j = min_lane | (bval & ~seg), ok = j <= max_lane; break;
  }
  return ok ? static_cast<unsigned>(j) : lane;
}

inline void complete_warp(Block& B, Warp& w, unsigned gi, Thread& caller) {
  const unsigned part = w.garr[gi], mask = w.gmask[gi], first_rank = caller.warp * 32;
  w.gmask[gi] = w.gmask[w.ngroups - 1];
  w.garr[gi] = w.garr[w.ngroups - 1];
  --w.ngroups;
  Thread* base = &B.th[first_rank];
  Thread* lead = base + std::countr_zero(part);
  for (unsigned p = part; p; p &= p - 1) {
    Thread& t = base[std::countr_zero(p)];
    if (t.op != lead->op || t.size != lead->size)
      report(caller, ErrorKind::WarpMismatch, [&] {
        return "mismatched warp collectives on mask " + hex(mask) + ": " + thread_str(*lead) + " in " +
               op_name(lead->op) + " at " + at(lead->site) + ", " + thread_str(t) + " in " + op_name(t.op) +
               " at " + at(t.site);
      }, t.size == lead->size);
  }
  unsigned vote = 0;
  std::uint32_t acc = 0;
  bool first = true;
  for (unsigned p = part; p; p &= p - 1) {
    const Thread& t = base[std::countr_zero(p)];
    if (t.in == nullptr || t.size != 4) continue;
    std::uint32_t v;
    std::memcpy(&v, t.in, 4);
    vote |= (v != 0 ? 1u : 0u) << t.lane;
    const bool sgn = t.b != 0;
    if (first) acc = v, first = false;
    else if (t.op == Op::RedAdd) acc += v;
    else if (t.op == Op::RedMin) acc = sgn ? (std::int32_t(v) < std::int32_t(acc) ? v : acc) : std::min(acc, v);
    else if (t.op == Op::RedMax) acc = sgn ? (std::int32_t(v) > std::int32_t(acc) ? v : acc) : std::max(acc, v);
    else if (t.op == Op::RedAnd) acc &= v;
    else if (t.op == Op::RedOr) acc |= v;
    else if (t.op == Op::RedXor) acc ^= v;
  }
  for (unsigned p = part; p; p &= p - 1) {
    Thread& t = base[std::countr_zero(p)];
    switch (t.op) {
      case Op::Ballot: std::memcpy(t.out, &vote, 4); break;
      case Op::Any: t.res = vote != 0; break;
      case Op::All: t.res = vote == part; break;
      case Op::RedAdd: case Op::RedMin: case Op::RedMax:
      case Op::RedAnd: case Op::RedOr: case Op::RedXor: std::memcpy(t.out, &acc, 4); break;
      case Op::ShflIdx: case Op::ShflUp: case Op::ShflDown: case Op::ShflXor: {
        const unsigned j = shuffle_source(t.op, t.lane, t.b, t.width);
        if (j != t.lane && !((part >> j) & 1u)) {
          const char* why = !((mask >> j) & 1u)  ? "is not in the mask"
                            : first_rank + j >= B.n ? "does not exist (partial warp)"
                                                    : "has exited";
          report(caller, ErrorKind::WarpLane, [&] {
            return thread_str(t) + " " + op_name(t.op) + " at " + at(t.site) + " (mask " + hex(mask) +
                   ", width " + std::to_string(t.width) + ", operand " + std::to_string(t.b) +
                   ") reads lane " + std::to_string(j) + ", which " + why;
          }, true);
          std::memcpy(t.out, t.in, t.size);  // warn-only: own value
        } else {
          std::memcpy(t.out, base[j].in, t.size);
        }
        break;
      }
      default: break;
    }
  }
  B.blocked -= static_cast<unsigned>(std::popcount(part));
  for (unsigned p = part; p; p &= p - 1) release(base[std::countr_zero(p)]);
}

inline bool try_complete_warp(Block& B, Warp& w, unsigned gi, Thread& caller) {
  if (w.garr[gi] != (w.gmask[gi] & w.live)) return false;
  complete_warp(B, w, gi, caller);
  return true;
}

// A warp collective: wait until every live lane of `mask` arrived, then the
// last arriver computes all results (see Thread).
inline void warp_collective(Op op, unsigned mask, const void* in, void* out, unsigned size, int b,
                            int width, const std::source_location& loc) {
  Thread& t = self(op_name(op));
  Block& B = *t.blk;
  Lock lk = lock_block(B);
  enter(B, lk);
  t.op = op, t.mask = mask, t.in = in, t.out = out, t.size = size, t.b = b, t.width = width;
  t.site = loc;
  if (!((mask >> t.lane) & 1u))
    report(t, ErrorKind::WarpLane, [&] {
      return thread_str(t) + " calls " + op_name(op) + " at " + at(loc) + " with mask " + hex(mask) +
             ", which does not contain its own lane";
    }, false);
  if (is_shuffle(op) && (width < 1 || width > 32 || (width & (width - 1)) != 0))
    report(t, ErrorKind::WarpLane, [&] {
      return thread_str(t) + " calls " + op_name(op) + " at " + at(loc) + " with width " +
             std::to_string(width) + " (must be a power of two <= 32)";
    }, true);
  Warp& w = B.warps[t.warp];
  unsigned gi = 0;
  while (gi < w.ngroups && w.gmask[gi] != mask) ++gi;
  if (gi == w.ngroups) w.gmask[gi] = mask, w.garr[gi] = 0, ++w.ngroups;
  w.garr[gi] |= 1u << t.lane;
  t.st = Status::Blocked;
  ++B.blocked;
  if (!try_complete_warp(B, w, gi, t)) check_deadlock(t);
  wait_released(t, lk);
}

inline int block_barrier(Op op, int pred, const std::source_location& loc) {
  Thread& t = self(op_name(op));
  Block& B = *t.blk;
  Lock lk = lock_block(B);
  enter(B, lk);
  t.op = op, t.pred = pred, t.site = loc, t.mask = 0;
  t.st = Status::Blocked;
  ++B.blocked;
  ++B.bar_arrived;
  if (!B.bar_first) {
    B.bar_first = &t;
  } else if (!B.bar_diverged && (B.bar_first->op != op || !same_site(B.bar_first->site, loc))) {
    B.bar_diverged = true;  // one report per barrier generation
    report(t, ErrorKind::DivergentBarrier, [&] {
      return "divergent barrier: " + thread_str(*B.bar_first) + " waits in " + op_name(B.bar_first->op) +
             " at " + at(B.bar_first->site) + " while " + thread_str(t) + " waits in " + op_name(op) +
             " at " + at(loc);
    }, true);
  }
  if (B.bar_arrived == B.live) complete_barrier(B);
  else check_deadlock(t);
  wait_released(t, lk);
  return t.res;
}

// A returning thread drops out of the block barrier and of its warp's masks,
// which may complete waits that were only missing it.
inline void thread_exit(Thread& t) {
  Block& B = *t.blk;
  Lock lk = lock_block(B);
  if (B.abort) return;
  t.st = Status::Exited;
  --B.live;
  Warp& w = B.warps[t.warp];
  w.live &= ~(1u << t.lane);
  bool progress = false;
  if (B.bar_arrived && B.bar_arrived == B.live) complete_barrier(B), progress = true;
  for (unsigned gi = 0; gi < w.ngroups;)
    if (try_complete_warp(B, w, gi, t)) progress = true;
    else ++gi;
  if (!progress) check_deadlock(t);
}

// ---- launch --------------------------------------------------------------------

inline void reset_block(Block& B, uint3 idx) {
  const dim3 bd = B.L->block;
  B.idx = idx;
  B.live = B.n;
  B.blocked = B.bar_arrived = 0;
  B.bar_first = nullptr;
  B.bar_diverged = false;
  for (unsigned i = 0; i < B.n; ++i) {
    Thread& t = B.th[i];
    t.blk = &B;
    t.rank = i, t.lane = i % 32, t.warp = i / 32;
    t.tid = uint3{i % bd.x, (i / bd.x) % bd.y, i / (bd.x * bd.y)};
    t.st = Status::Runnable;
    t.op = Op::None;
  }
  for (unsigned w = 0; w < B.nwarps; ++w) {
    const unsigned lanes = std::min(32u, B.n - w * 32);
    B.warps[w].live = lanes == 32 ? ~0u : (1u << lanes) - 1;
    B.warps[w].ngroups = 0;
  }
  if (unsigned char* s = B.L->smem_ptr) {
    for (std::size_t i = 0; i < kSmemGuard; ++i) s[-1 - static_cast<std::ptrdiff_t>(i)] = static_cast<unsigned char>(0x5A + 31 * i);
    const std::size_t end = (B.L->smem + 15) / 16 * 16;
    std::memset(s, kSmemPoison, end);
    for (std::size_t i = 0; i < kSmemGuard; ++i) s[end + i] = static_cast<unsigned char>(0xA5 + 29 * i);
  }
}

// Empty string if both canary regions are intact.
inline std::string check_canaries(const Block& B) {
  const unsigned char* s = B.L->smem_ptr;
  if (!s) return {};
  const std::size_t end = (B.L->smem + 15) / 16 * 16;
  std::size_t lo = kSmemGuard, hi = 0, blo = kSmemGuard, bhi = 0;
  for (std::size_t i = 0; i < kSmemGuard; ++i) {
    if (s[end + i] != static_cast<unsigned char>(0xA5 + 29 * i)) lo = std::min(lo, i), hi = i + 1;
    if (s[-1 - static_cast<std::ptrdiff_t>(i)] != static_cast<unsigned char>(0x5A + 31 * i))
      blo = std::min(blo, i), bhi = i + 1;
  }
  std::string m;
  if (hi)
    m = "dynamic shared memory written out of bounds: bytes [" + std::to_string(end + lo) + ", " +
        std::to_string(end + hi) + ") of a " + std::to_string(B.L->smem) + "-byte buffer";
  if (bhi)
    m += std::string(m.empty() ? "dynamic shared memory written out of bounds: " : "; ") + "bytes [-" +
         std::to_string(bhi) + ", -" + std::to_string(blo) + ") before its start";
  return m;
}

inline Error launch_error(const Block& B) {
  return Error(B.err_kind, "cudasim: " + B.err + "\n  in " + context(B));
}

inline void check_config(const Launch& L, bool grid_ok) {
  const dim3 g = L.grid, b = L.block;
  std::string m;
  const unsigned long long threads = 1ull * b.x * b.y * b.z;
  if (!grid_ok || g.x < 1 || g.x > 0x7fffffffu || g.y < 1 || g.y > 65535 || g.z < 1 || g.z > 65535)
    m = "invalid grid " + dim_str(g.x, g.y, g.z);
  else if (b.x < 1 || b.y < 1 || b.z < 1 || b.x > 1024 || b.y > 1024 || b.z > 64 || threads > kMaxBlockThreads)
    m = "invalid block " + dim_str(b.x, b.y, b.z) + " (at most 1024 threads, z <= 64)";
  else if (L.smem > kMaxDynamicSmem)
    m = "dynamic shared memory of " + std::to_string(L.smem) + " bytes exceeds " +
        std::to_string(kMaxDynamicSmem);
  if (t_self) m = "launch from inside a kernel (dynamic parallelism) is not supported";
  if (!m.empty())
    throw Error(ErrorKind::InvalidLaunch,
                "cudasim: " + m + "\n  for kernel " + L.name + " launched at " + at(L.site));
}

inline void run_launch(Launch& L, bool grid_ok) {
  check_config(L, grid_ok);  // first: a launch from a kernel would deadlock on the mutex
  std::lock_guard<std::mutex> serial(rt().launch_mu);  // one launch at a time
  // Dynamic shared memory: guard + payload (rounded to 16) + guard, 64-aligned.
  const std::size_t payload = (L.smem + 15) / 16 * 16;
  std::unique_ptr<unsigned char, void (*)(void*)> smem(nullptr, std::free);
  smem.reset(static_cast<unsigned char*>(std::aligned_alloc(64, 2 * kSmemGuard + payload)));
  if (!smem) throw std::bad_alloc();
  L.smem_ptr = smem.get() + kSmemGuard;
  Block B;
  B.L = &L;
  B.n = L.block.x * L.block.y * L.block.z;
  B.nwarps = (B.n + 31) / 32;
  B.th = std::vector<Thread>(B.n);  // not resize(): Thread holds an atomic
  B.warps.reset(new Warp[B.nwarps]);
  const auto blocks = [&](auto&& run_one) {
    for (unsigned z = 0; z < L.grid.z; ++z)
      for (unsigned y = 0; y < L.grid.y; ++y)
        for (unsigned x = 0; x < L.grid.x; ++x) {
          if (!run_one(uint3{x, y, z})) return;
          if (std::string m = check_canaries(B); !m.empty()) {
            if (!warn_only()) {
              B.err_kind = ErrorKind::SmemOverflow, B.err = m, B.abort = true;
              return;
            }
            rt().warnings.fetch_add(1);
            std::fprintf(stderr, "cudasim warning: %s\n  in %s\n", m.c_str(), context(B).c_str());
          }
        }
  };
#if !defined(CUDASIM_THREADS)
  ensure_stacks(B.n);
  blocks([&](uint3 idx) {
    reset_block(B, idx);
    run_block(B);
    return !B.abort;
  });
#else
  // One OS thread per CUDA thread, reused for every block of the launch.
  const auto worker = [&B](unsigned i) {
    for (unsigned seen = 0;;) {
      futex_wait(B.epoch, seen);
      seen = B.epoch.load(std::memory_order_acquire);
      if (B.shutdown) return;
      Thread& t = B.th[i];
      t_self = &t;
      try {
        B.L->body(B.L->arg);
        thread_exit(t);
      } catch (const Abort&) {
      } catch (const std::exception& e) {
        Lock lk(B.mu);
        set_error(B, ErrorKind::KernelException, "kernel threw in " + thread_str(t) + ": " + e.what());
      } catch (...) {
        Lock lk(B.mu);
        set_error(B, ErrorKind::KernelException,
                  "kernel threw in " + thread_str(t) + ": an exception not derived from std::exception");
      }
      t_self = nullptr;
      if (B.finished.fetch_add(1, std::memory_order_acq_rel) + 1 == B.n) futex_wake(B.finished, 1);
    }
  };
  // Between blocks every worker is parked on `epoch`, so the main thread may
  // reset the block state; the epoch increment publishes it.
  const auto start_block = [&B] {
    B.finished.store(0, std::memory_order_relaxed);
    B.epoch.fetch_add(1, std::memory_order_release);
    futex_wake(B.epoch, INT32_MAX);
  };
  struct Workers {  // joined on every path: a joinable std::thread must not be destroyed
    std::vector<std::thread> v;
    Block& B;
    decltype(start_block)& start;
    ~Workers() {
      B.shutdown = true;
      start();
      for (std::thread& w : v) w.join();
    }
  } workers{{}, B, start_block};
  workers.v.reserve(B.n);
  try {
    for (unsigned i = 0; i < B.n; ++i) workers.v.emplace_back(worker, i);
  } catch (const std::system_error& e) {
    throw Error(ErrorKind::InvalidLaunch,
                "cudasim: cannot start " + std::to_string(B.n) + " threads for the threads engine: " + e.what());
  }
  blocks([&](uint3 idx) {
    reset_block(B, idx);
    start_block();
    for (unsigned f; (f = B.finished.load(std::memory_order_acquire)) != B.n;) futex_wait(B.finished, f);
    return !B.abort;
  });
#endif
  if (B.abort) throw launch_error(B);
}

template <class F>
struct NamedKernel {
  F fn;
  const char* name;
};
template <class F>
struct is_named : std::false_type {};
template <class F>
struct is_named<NamedKernel<F>> : std::true_type {};

}  // namespace detail

// The grid argument of launch(): converting into it records the caller's
// source location (the DLLM_LAUNCH line) for error messages.
struct GridArg {
  dim3 dim;
  std::source_location loc;
  bool ok = true;
  GridArg(dim3 d, std::source_location l = std::source_location::current()) : dim(d), loc(l) {}
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
  GridArg(I x, std::source_location l = std::source_location::current())
      : dim(static_cast<unsigned>(x)), loc(l), ok(x >= 1 && static_cast<unsigned long long>(x) <= 0x7fffffffull) {}
};

// Attach a name for error messages (DLLM_LAUNCH passes the kernel's spelling).
template <class F>
detail::NamedKernel<F> named(F fn, const char* name) {
  return {fn, name};
}

// Run kernel(args...) on every thread of every block; returns when all
// finished. Throws cudasim::Error on an invalid configuration or any error
// detected while running (the launch is stopped at the first one).
template <class K, class... Args>
void launch(K kernel, GridArg grid, dim3 block, std::size_t smem_bytes, Args&&... args) {
  auto fn = [&] {
    if constexpr (detail::is_named<K>::value) return kernel.fn;
    else return kernel;
  }();
  const char* name = "(unnamed kernel)";
  if constexpr (detail::is_named<K>::value) name = kernel.name;
  // Kernel parameters are copied once per launch, as by cudaLaunchKernel, and
  // passed by value to each thread.
  using Tuple = std::tuple<std::decay_t<Args>...>;
  struct Body {
    decltype(fn) f;
    Tuple params;
    static void run(void* p) {
      Body& b = *static_cast<Body*>(p);
      std::apply([&](auto&... a) { b.f(a...); }, b.params);
    }
  } body{fn, Tuple(std::forward<Args>(args)...)};
  static_assert(std::is_void_v<decltype(std::apply(body.f, body.params))>, "a __global__ kernel returns void");
  detail::Launch L{name, grid.loc, grid.dim, block, smem_bytes, nullptr, &Body::run, &body};
  detail::run_launch(L, grid.ok);
}

// Dynamic shared memory of the running block (see DLLM_DYNAMIC_SMEM): 16-byte
// aligned, filled with 0xFF before each block, canaries on both sides.
inline unsigned char* dynamic_smem() { return detail::self("dynamic shared memory").blk->L->smem_ptr; }

// Tests: force warn-only on (1) / off (0), or back to the environment (-1).
inline void set_warn_only(int mode) { detail::rt().warn_override.store(mode); }
inline unsigned long warning_count() { return detail::rt().warnings.load(); }

}  // namespace cudasim

// ---- built-in variables ------------------------------------------------------
// Read-only, per CUDA thread; macros so that `threadIdx.x` works unchanged.
namespace cudasim::detail {
inline const uint3& cur_thread_idx() { return self("threadIdx").tid; }
inline const uint3& cur_block_idx() { return self("blockIdx").blk->idx; }
inline const dim3& cur_block_dim() { return self("blockDim").blk->L->block; }
inline const dim3& cur_grid_dim() { return self("gridDim").blk->L->grid; }
}  // namespace cudasim::detail
#define threadIdx (::cudasim::detail::cur_thread_idx())
#define blockIdx (::cudasim::detail::cur_block_idx())
#define blockDim (::cudasim::detail::cur_block_dim())
#define gridDim (::cudasim::detail::cur_grid_dim())

// ---- synchronization -----------------------------------------------------------
// std::source_location defaults record the kernel line for reports.
using cudasim_loc = std::source_location;

inline void __syncthreads(cudasim_loc l = cudasim_loc::current()) {
  ::cudasim::detail::block_barrier(::cudasim::detail::Op::Bar, 0, l);
}
inline int __syncthreads_count(int p, cudasim_loc l = cudasim_loc::current()) {
  return ::cudasim::detail::block_barrier(::cudasim::detail::Op::BarCount, p, l);
}
inline int __syncthreads_and(int p, cudasim_loc l = cudasim_loc::current()) {
  return ::cudasim::detail::block_barrier(::cudasim::detail::Op::BarAnd, p, l);
}
inline int __syncthreads_or(int p, cudasim_loc l = cudasim_loc::current()) {
  return ::cudasim::detail::block_barrier(::cudasim::detail::Op::BarOr, p, l);
}

inline void __syncwarp(unsigned mask = 0xffffffffu, cudasim_loc l = cudasim_loc::current()) {
  ::cudasim::detail::warp_collective(::cudasim::detail::Op::Sync, mask, nullptr, nullptr, 0, 0, 32, l);
}
inline unsigned __ballot_sync(unsigned mask, int pred, cudasim_loc l = cudasim_loc::current()) {
  unsigned r = 0;
  ::cudasim::detail::warp_collective(::cudasim::detail::Op::Ballot, mask, &pred, &r, 4, 0, 32, l);
  return r;
}
inline int __any_sync(unsigned mask, int pred, cudasim_loc l = cudasim_loc::current()) {
  ::cudasim::detail::warp_collective(::cudasim::detail::Op::Any, mask, &pred, nullptr, 4, 0, 32, l);
  return ::cudasim::detail::self().res;
}
inline int __all_sync(unsigned mask, int pred, cudasim_loc l = cudasim_loc::current()) {
  ::cudasim::detail::warp_collective(::cudasim::detail::Op::All, mask, &pred, nullptr, 4, 0, 32, l);
  return ::cudasim::detail::self().res;
}
// Lanes have no notion of convergence here: the "active" lanes are all live
// lanes of the warp. Code that uses __activemask() inside a divergent branch
// to pick shuffle partners will then deadlock (and be reported).
inline unsigned __activemask() {
  auto& t = ::cudasim::detail::self("__activemask");
  [[maybe_unused]] auto lk = ::cudasim::detail::lock_block(*t.blk);
  return t.blk->warps[t.warp].live;
}

template <class T>
inline T cudasim_shuffle(::cudasim::detail::Op op, unsigned mask, const T& v, int b, int width,
                         const cudasim_loc& l) {
  // Values are moved as bytes. __half2 and __nv_bfloat162 are not trivially
  // copyable (user-provided copy constructors) but are plain bits.
  static_assert(std::is_trivially_destructible_v<T>, "shuffled types must be plain values");
  T r = v;
  ::cudasim::detail::warp_collective(op, mask, &v, &r, sizeof(T), b, width, l);
  return r;
}
template <class T>
inline T __shfl_sync(unsigned mask, T var, int srcLane, int width = warpSize,
                     cudasim_loc l = cudasim_loc::current()) {
  return cudasim_shuffle(::cudasim::detail::Op::ShflIdx, mask, var, srcLane, width, l);
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize,
                        cudasim_loc l = cudasim_loc::current()) {
  return cudasim_shuffle(::cudasim::detail::Op::ShflUp, mask, var, static_cast<int>(delta), width, l);
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize,
                          cudasim_loc l = cudasim_loc::current()) {
  return cudasim_shuffle(::cudasim::detail::Op::ShflDown, mask, var, static_cast<int>(delta), width, l);
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T var, int laneMask, int width = warpSize,
                         cudasim_loc l = cudasim_loc::current()) {
  return cudasim_shuffle(::cudasim::detail::Op::ShflXor, mask, var, laneMask, width, l);
}

#define CUDASIM_WARP_REDUCE(fn, OP, T, SIGNED)                                                    \
  inline T fn(unsigned mask, T value, cudasim_loc l = cudasim_loc::current()) {                   \
    T r = value;                                                                                  \
    ::cudasim::detail::warp_collective(::cudasim::detail::Op::OP, mask, &value, &r, 4, SIGNED, 32, l); \
    return r;                                                                                     \
  }
CUDASIM_WARP_REDUCE(__reduce_add_sync, RedAdd, unsigned, 0)
CUDASIM_WARP_REDUCE(__reduce_add_sync, RedAdd, int, 1)
CUDASIM_WARP_REDUCE(__reduce_min_sync, RedMin, unsigned, 0)
CUDASIM_WARP_REDUCE(__reduce_min_sync, RedMin, int, 1)
CUDASIM_WARP_REDUCE(__reduce_max_sync, RedMax, unsigned, 0)
CUDASIM_WARP_REDUCE(__reduce_max_sync, RedMax, int, 1)
CUDASIM_WARP_REDUCE(__reduce_and_sync, RedAnd, unsigned, 0)
CUDASIM_WARP_REDUCE(__reduce_or_sync, RedOr, unsigned, 0)
CUDASIM_WARP_REDUCE(__reduce_xor_sync, RedXor, unsigned, 0)
#undef CUDASIM_WARP_REDUCE

inline void __threadfence() {
#if defined(CUDASIM_THREADS) && defined(__SANITIZE_THREAD__)
  // GCC's TSan does not model atomic_thread_fence (it warns at compile time);
  // an RMW on one shared atomic gives the same ordering in a form it follows.
  static std::atomic<int> fence{0};
  fence.fetch_add(0, std::memory_order_seq_cst);
#else
  std::atomic_thread_fence(std::memory_order_seq_cst);
#endif
}
inline void __threadfence_block() { __threadfence(); }
inline void __threadfence_system() { __threadfence(); }

[[noreturn]] inline void __trap() {
  auto& t = ::cudasim::detail::self("__trap");
  {
    auto lk = ::cudasim::detail::lock_block(*t.blk);
    ::cudasim::detail::set_error(*t.blk, ::cudasim::ErrorKind::Trap,
                                 "__trap() in " + ::cudasim::detail::thread_str(t));
  }
  ::cudasim::detail::escape(t);
}
inline void __nanosleep(unsigned) { std::this_thread::yield(); }
inline long long clock64() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

// ---- atomics -------------------------------------------------------------------
namespace cudasim::detail {
// CAS loop on the bits: __half2 and friends are not trivially copyable (they
// have user-provided copy constructors), so std::atomic_ref refuses them.
template <class T, class F>
inline T atomic_update(T* p, F f) {
  using U = std::conditional_t<sizeof(T) == 2, std::uint16_t,
                               std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>>;
  static_assert(sizeof(T) == sizeof(U), "atomic_update: 2, 4 or 8 byte types");
  U* bits = reinterpret_cast<U*>(static_cast<void*>(p));
  U old_bits = __atomic_load_n(bits, __ATOMIC_SEQ_CST);
  for (;;) {
    T old{};  // not `= *p`: a plain read would race with other threads' atomics
    std::memcpy(static_cast<void*>(&old), &old_bits, sizeof(T));
    const T next = f(old);
    U next_bits;
    std::memcpy(&next_bits, static_cast<const void*>(&next), sizeof(T));
    if (__atomic_compare_exchange_n(bits, &old_bits, next_bits, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
      return old;
  }
}
}  // namespace cudasim::detail

#define CUDASIM_ATOMIC_ARITH(T)                                                                         \
  inline T atomicAdd(T* p, T v) { return std::atomic_ref<T>(*p).fetch_add(v); }                       \
  inline T atomicExch(T* p, T v) { return std::atomic_ref<T>(*p).exchange(v); }
#define CUDASIM_ATOMIC_INT(T)                                                                           \
  CUDASIM_ATOMIC_ARITH(T)                                                                               \
  inline T atomicSub(T* p, T v) { return std::atomic_ref<T>(*p).fetch_sub(v); }                       \
  inline T atomicAnd(T* p, T v) { return std::atomic_ref<T>(*p).fetch_and(v); }                       \
  inline T atomicOr(T* p, T v) { return std::atomic_ref<T>(*p).fetch_or(v); }                         \
  inline T atomicXor(T* p, T v) { return std::atomic_ref<T>(*p).fetch_xor(v); }                       \
  inline T atomicMax(T* p, T v) { return ::cudasim::detail::atomic_update(p, [v](T o) { return o < v ? v : o; }); } \
  inline T atomicMin(T* p, T v) { return ::cudasim::detail::atomic_update(p, [v](T o) { return v < o ? v : o; }); } \
  inline T atomicCAS(T* p, T cmp, T v) {                                                              \
    std::atomic_ref<T>(*p).compare_exchange_strong(cmp, v);                                           \
    return cmp;                                                                                       \
  }
CUDASIM_ATOMIC_INT(int)
CUDASIM_ATOMIC_INT(unsigned)
CUDASIM_ATOMIC_INT(unsigned long long)
CUDASIM_ATOMIC_INT(long long)
CUDASIM_ATOMIC_ARITH(float)
CUDASIM_ATOMIC_ARITH(double)
#undef CUDASIM_ATOMIC_INT
#undef CUDASIM_ATOMIC_ARITH
inline unsigned short atomicCAS(unsigned short* p, unsigned short cmp, unsigned short v) {
  std::atomic_ref<unsigned short>(*p).compare_exchange_strong(cmp, v);
  return cmp;
}
inline unsigned atomicInc(unsigned* p, unsigned v) {
  return ::cudasim::detail::atomic_update(p, [v](unsigned o) { return o >= v ? 0u : o + 1; });
}
inline unsigned atomicDec(unsigned* p, unsigned v) {
  return ::cudasim::detail::atomic_update(p, [v](unsigned o) { return (o == 0 || o > v) ? v : o - 1; });
}
inline __half atomicAdd(__half* p, __half v) {
  return ::cudasim::detail::atomic_update(p, [v](__half o) { return __hadd(o, v); });
}
inline __half2 atomicAdd(__half2* p, __half2 v) {
  return ::cudasim::detail::atomic_update(p, [v](__half2 o) { return __hadd2(o, v); });
}
inline __nv_bfloat16 atomicAdd(__nv_bfloat16* p, __nv_bfloat16 v) {
  return ::cudasim::detail::atomic_update(p, [v](__nv_bfloat16 o) { return __hadd(o, v); });
}

// ---- math and bit intrinsics ---------------------------------------------------
// Fast-math intrinsics map to the precise libm function: results differ from
// the GPU's approximations in the last bits, so compare with tolerances.
inline float __expf(float x) { return std::exp(x); }
inline float __exp10f(float x) { return std::pow(10.f, x); }
inline float __logf(float x) { return std::log(x); }
inline float __log2f(float x) { return std::log2(x); }
inline float __log10f(float x) { return std::log10(x); }
inline float __powf(float x, float y) { return std::pow(x, y); }
inline float __sinf(float x) { return std::sin(x); }
inline float __cosf(float x) { return std::cos(x); }
inline float __tanf(float x) { return std::tan(x); }
inline float __tanhf(float x) { return std::tanh(x); }
inline void __sincosf(float x, float* s, float* c) { *s = std::sin(x), *c = std::cos(x); }
inline float __fdividef(float x, float y) { return x / y; }
inline float fdividef(float x, float y) { return x / y; }
inline float __frcp_rn(float x) { return 1.f / x; }
inline float __fsqrt_rn(float x) { return std::sqrt(x); }
inline float __frsqrt_rn(float x) { return 1.f / std::sqrt(x); }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float __saturatef(float x) { return x > 0.f ? (x < 1.f ? x : 1.f) : 0.f; }  // NaN -> 0
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __fma_rn(double a, double b, double c) { return std::fma(a, b, c); }
inline double __drcp_rn(double x) { return 1.0 / x; }
inline double __dsqrt_rn(double x) { return std::sqrt(x); }
// Only round-to-nearest (_rn) variants: directed rounding would need fesetround.

namespace cudasim::detail {
// PTX cvt to an integer saturates and maps NaN to 0. `rnd` is applied first.
template <class I>
inline I to_int_sat(double x) {
  if (std::isnan(x)) return 0;
  if (x <= static_cast<double>(std::numeric_limits<I>::min())) return std::numeric_limits<I>::min();
  if (x >= static_cast<double>(std::numeric_limits<I>::max())) return std::numeric_limits<I>::max();
  return static_cast<I>(x);
}
}  // namespace cudasim::detail
#define CUDASIM_CVT(name, FROM, I, RND) \
  inline I name(FROM x) { return ::cudasim::detail::to_int_sat<I>(RND(static_cast<double>(x))); }
#define CUDASIM_CVT4(prefix, FROM, I)                    \
  CUDASIM_CVT(prefix##_rn, FROM, I, std::nearbyint)      \
  CUDASIM_CVT(prefix##_rz, FROM, I, std::trunc)          \
  CUDASIM_CVT(prefix##_rd, FROM, I, std::floor)          \
  CUDASIM_CVT(prefix##_ru, FROM, I, std::ceil)
CUDASIM_CVT4(__float2int, float, int)  // _rn rounds half to even (default FP environment)
CUDASIM_CVT4(__float2uint, float, unsigned)
CUDASIM_CVT4(__float2ll, float, long long)
CUDASIM_CVT4(__float2ull, float, unsigned long long)
CUDASIM_CVT4(__double2int, double, int)
CUDASIM_CVT4(__double2uint, double, unsigned)
CUDASIM_CVT4(__double2ll, double, long long)
CUDASIM_CVT4(__double2ull, double, unsigned long long)
// Half/bf16 -> integer with rn/rd/ru are device-only in cuda_fp16.h (rz exists).
#define CUDASIM_CVT3(prefix, FROM, I)                    \
  CUDASIM_CVT(prefix##_rn, FROM, I, std::nearbyint)      \
  CUDASIM_CVT(prefix##_rd, FROM, I, std::floor)          \
  CUDASIM_CVT(prefix##_ru, FROM, I, std::ceil)
CUDASIM_CVT3(__half2int, __half, int)
CUDASIM_CVT3(__half2uint, __half, unsigned)
CUDASIM_CVT3(__half2ll, __half, long long)
CUDASIM_CVT3(__half2ull, __half, unsigned long long)
CUDASIM_CVT3(__half2short, __half, short)
CUDASIM_CVT3(__half2ushort, __half, unsigned short)
CUDASIM_CVT3(__bfloat162int, __nv_bfloat16, int)
CUDASIM_CVT3(__bfloat162uint, __nv_bfloat16, unsigned)
CUDASIM_CVT3(__bfloat162ll, __nv_bfloat16, long long)
CUDASIM_CVT3(__bfloat162ull, __nv_bfloat16, unsigned long long)
CUDASIM_CVT3(__bfloat162short, __nv_bfloat16, short)
CUDASIM_CVT3(__bfloat162ushort, __nv_bfloat16, unsigned short)
#undef CUDASIM_CVT3
#undef CUDASIM_CVT4
#undef CUDASIM_CVT
inline float __int2float_rn(int x) { return static_cast<float>(x); }
inline float __uint2float_rn(unsigned x) { return static_cast<float>(x); }
inline float __ll2float_rn(long long x) { return static_cast<float>(x); }
inline float __ull2float_rn(unsigned long long x) { return static_cast<float>(x); }
inline double __int2double_rn(int x) { return x; }

inline int __float_as_int(float x) { return std::bit_cast<int>(x); }
inline float __int_as_float(int x) { return std::bit_cast<float>(x); }
inline unsigned __float_as_uint(float x) { return std::bit_cast<unsigned>(x); }
inline float __uint_as_float(unsigned x) { return std::bit_cast<float>(x); }
inline long long __double_as_longlong(double x) { return std::bit_cast<long long>(x); }
inline double __longlong_as_double(long long x) { return std::bit_cast<double>(x); }

inline int __popc(unsigned x) { return std::popcount(x); }
inline int __popcll(unsigned long long x) { return std::popcount(x); }
inline int __clz(int x) { return std::countl_zero(static_cast<unsigned>(x)); }
inline int __clzll(long long x) { return std::countl_zero(static_cast<unsigned long long>(x)); }
inline int __ffs(int x) { return x ? std::countr_zero(static_cast<unsigned>(x)) + 1 : 0; }
inline int __ffsll(long long x) { return x ? std::countr_zero(static_cast<unsigned long long>(x)) + 1 : 0; }
inline unsigned __brev(unsigned x) {
  x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
  x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
  x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
  return __builtin_bswap32(x);
}
inline unsigned long long __brevll(unsigned long long x) {
  return (static_cast<unsigned long long>(__brev(static_cast<unsigned>(x))) << 32) | __brev(static_cast<unsigned>(x >> 32));
}
// Bytes 0-3 of x then 4-7 of y; result byte n is input byte s[4n+2:4n].
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const unsigned long long in = (static_cast<unsigned long long>(y) << 32) | x;
  unsigned r = 0;
  for (int n = 0; n < 4; ++n) r |= static_cast<unsigned>((in >> (8 * ((s >> (4 * n)) & 7))) & 0xff) << (8 * n);
  return r;
}
inline int __mul24(int a, int b) {  // low 32 bits of the product of the sign-extended low 24 bits
  const auto lo24 = [](int v) {  // C++20: >> of a negative int is arithmetic
    return static_cast<long long>(static_cast<int>(static_cast<unsigned>(v) << 8) >> 8);
  };
  return static_cast<int>(static_cast<unsigned long long>(lo24(a) * lo24(b)));
}
inline unsigned __umul24(unsigned a, unsigned b) { return (a & 0xffffffu) * (b & 0xffffffu); }
inline unsigned __sad(int x, int y, unsigned z) {
  return z + static_cast<unsigned>(x > y ? static_cast<long long>(x) - y : static_cast<long long>(y) - x);
}
inline unsigned __usad(unsigned x, unsigned y, unsigned z) { return z + (x > y ? x - y : y - x); }
inline unsigned __umulhi(unsigned a, unsigned b) { return static_cast<unsigned>((1ull * a * b) >> 32); }
inline int __mulhi(int a, int b) { return static_cast<int>((1ll * a * b) >> 32); }
__extension__ typedef unsigned __int128 cudasim_u128;  // __extension__: quiet under -Wpedantic
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
  return static_cast<unsigned long long>((static_cast<cudasim_u128>(a) * b) >> 64);
}
inline long long __mul64hi(long long a, long long b) {
  __extension__ typedef __int128 s128;
  return static_cast<long long>((static_cast<s128>(a) * b) >> 64);
}

// CUDA's global min/max overloads (device code calls them unqualified). Same
// types resolve to the exact overloads, mixed types to the common type.
#define CUDASIM_MINMAX(T)                                  \
  inline T min(T a, T b) { return b < a ? b : a; }         \
  inline T max(T a, T b) { return a < b ? b : a; }
CUDASIM_MINMAX(int)
CUDASIM_MINMAX(unsigned)
CUDASIM_MINMAX(long)
CUDASIM_MINMAX(unsigned long)
CUDASIM_MINMAX(long long)
CUDASIM_MINMAX(unsigned long long)
CUDASIM_MINMAX(float)
CUDASIM_MINMAX(double)
#undef CUDASIM_MINMAX
template <class A, class B, std::enable_if_t<std::is_arithmetic_v<A> && std::is_arithmetic_v<B> && !std::is_same_v<A, B>, int> = 0>
inline std::common_type_t<A, B> min(A a, B b) {
  using C = std::common_type_t<A, B>;
  return static_cast<C>(b) < static_cast<C>(a) ? static_cast<C>(b) : static_cast<C>(a);
}
template <class A, class B, std::enable_if_t<std::is_arithmetic_v<A> && std::is_arithmetic_v<B> && !std::is_same_v<A, B>, int> = 0>
inline std::common_type_t<A, B> max(A a, B b) {
  using C = std::common_type_t<A, B>;
  return static_cast<C>(a) < static_cast<C>(b) ? static_cast<C>(b) : static_cast<C>(a);
}

// Cache-hinted loads/stores are plain memory accesses here.
template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T __ldca(const T* p) { return *p; }
template <class T> inline T __ldcg(const T* p) { return *p; }
template <class T> inline T __ldcs(const T* p) { return *p; }
template <class T> inline T __ldlu(const T* p) { return *p; }
template <class T> inline T __ldcv(const T* p) { return *p; }
template <class T> inline void __stcg(T* p, T v) { *p = v; }
template <class T> inline void __stcs(T* p, T v) { *p = v; }
template <class T> inline void __stwb(T* p, T v) { *p = v; }
template <class T> inline void __stwt(T* p, T v) { *p = v; }

// ---- half / bf16 host fallbacks ------------------------------------------------
// cuda_fp16.h/cuda_bf16.h declare these for device code only. Computed in
// float (double for fma) and rounded once: at least as accurate as the GPU.
#define CUDASIM_HALF_UNARY(sfx, EXPR)                                                              \
  inline __half h##sfx(const __half a) { const float x = __half2float(a); return __float2half_rn(EXPR); } \
  inline __nv_bfloat16 h##sfx(const __nv_bfloat16 a) {                                             \
    const float x = __bfloat162float(a);                                                           \
    return __float2bfloat16_rn(EXPR);                                                              \
  }                                                                                                \
  inline __half2 h2##sfx(const __half2 a) { return __halves2half2(h##sfx(__low2half(a)), h##sfx(__high2half(a))); } \
  inline __nv_bfloat162 h2##sfx(const __nv_bfloat162 a) {                                          \
    return __halves2bfloat162(h##sfx(__low2bfloat16(a)), h##sfx(__high2bfloat16(a)));             \
  }
CUDASIM_HALF_UNARY(exp, std::exp(x))
CUDASIM_HALF_UNARY(exp2, std::exp2(x))
CUDASIM_HALF_UNARY(exp10, std::pow(10.f, x))
CUDASIM_HALF_UNARY(log, std::log(x))
CUDASIM_HALF_UNARY(log2, std::log2(x))
CUDASIM_HALF_UNARY(log10, std::log10(x))
CUDASIM_HALF_UNARY(sqrt, std::sqrt(x))
CUDASIM_HALF_UNARY(rsqrt, 1.f / std::sqrt(x))
CUDASIM_HALF_UNARY(rcp, 1.f / x)
CUDASIM_HALF_UNARY(sin, std::sin(x))
CUDASIM_HALF_UNARY(cos, std::cos(x))
CUDASIM_HALF_UNARY(tanh, std::tanh(x))
CUDASIM_HALF_UNARY(tanh_approx, std::tanh(x))
CUDASIM_HALF_UNARY(ceil, std::ceil(x))
CUDASIM_HALF_UNARY(floor, std::floor(x))
CUDASIM_HALF_UNARY(rint, std::nearbyint(x))
CUDASIM_HALF_UNARY(trunc, std::trunc(x))
#undef CUDASIM_HALF_UNARY

namespace cudasim::detail {
inline double fma_d(double a, double b, double c) { return a * b + c; }  // product exact in double
inline double sat01(double x) { return x > 0 ? (x < 1 ? x : 1) : 0; }   // NaN -> 0
inline double relu(double x) { return std::isnan(x) ? x : (x > 0 ? x : 0); }
}  // namespace cudasim::detail
#define CUDASIM_HALF_FMA(name, name2, WRAP)                                                        \
  inline __half name(__half a, __half b, __half c) {                                              \
    return __double2half(WRAP(::cudasim::detail::fma_d(__half2float(a), __half2float(b), __half2float(c)))); \
  }                                                                                               \
  inline __nv_bfloat16 name(__nv_bfloat16 a, __nv_bfloat16 b, __nv_bfloat16 c) {                  \
    return __double2bfloat16(                                                                     \
        WRAP(::cudasim::detail::fma_d(__bfloat162float(a), __bfloat162float(b), __bfloat162float(c)))); \
  }                                                                                               \
  inline __half2 name2(__half2 a, __half2 b, __half2 c) {                                         \
    return __halves2half2(name(__low2half(a), __low2half(b), __low2half(c)),                      \
                          name(__high2half(a), __high2half(b), __high2half(c)));                  \
  }                                                                                               \
  inline __nv_bfloat162 name2(__nv_bfloat162 a, __nv_bfloat162 b, __nv_bfloat162 c) {             \
    return __halves2bfloat162(name(__low2bfloat16(a), __low2bfloat16(b), __low2bfloat16(c)),      \
                              name(__high2bfloat16(a), __high2bfloat16(b), __high2bfloat16(c)));  \
  }
#define CUDASIM_ID(x) (x)
CUDASIM_HALF_FMA(__hfma, __hfma2, CUDASIM_ID)
CUDASIM_HALF_FMA(__hfma_sat, __hfma2_sat, ::cudasim::detail::sat01)
CUDASIM_HALF_FMA(__hfma_relu, __hfma2_relu, ::cudasim::detail::relu)
#undef CUDASIM_ID
#undef CUDASIM_HALF_FMA
