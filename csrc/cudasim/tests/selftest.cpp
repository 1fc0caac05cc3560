// Self-test of the CUDA CPU simulation (csrc/cudasim/cudasim.h), no torch.
//
//   g++ -std=c++20 -O1 -g -pthread -DCUDASIM -Icsrc/cudasim/shim_include
//       -Icsrc/cudasim -I$CUDA_HOME/include -Icsrc [-include cudasim/cuda_compat.cuh]
//       csrc/cudasim/tests/selftest.cpp      (+ -DCUDASIM_THREADS for the threads engine)
//   ./selftest            # all tests      ./selftest --list    ./selftest NAME...
//
// Exit status is nonzero if any check failed. Injected bugs the shim must
// catch by itself are here too; those that need a sanitizer to be caught are
// in sanitizer_bugs.cpp (scripts/sanitize_sim.sh expects those to fail).
#include "cudasim/cuda_compat.cuh"

#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <typeinfo>
#include <vector>

namespace cg = cooperative_groups;

// ---- tiny test harness -----------------------------------------------------------
static int g_failures = 0;  // failed checks of the current test
static long g_checks = 0;

#define CHECK(cond, ...)                                                              \
  do {                                                                                \
    ++g_checks;                                                                       \
    if (!(cond)) {                                                                    \
      if (++g_failures <= 12) {                                                       \
        std::printf("  CHECK failed at %s:%d: %s", __FILE__, __LINE__, #cond);        \
        std::printf(" " __VA_ARGS__);                                                 \
        std::printf("\n");                                                            \
      }                                                                               \
    }                                                                                 \
  } while (0)

static bool engine_is_threads() {
#if defined(CUDASIM_THREADS)
  return true;
#else
  return false;
#endif
}

// The threads engine costs an OS context switch per thread per barrier, so
// big grids shrink there (its job is to let TSan see races, not speed).
static int sized(int fibers, int threads) { return engine_is_threads() ? threads : fibers; }

// Runs `launch`, which must throw cudasim::Error of `kind` whose message
// contains every string in `needles`; then a correct kernel must still work.
static void check_recovery();
static void expect_error(cudasim::ErrorKind kind, std::vector<std::string> needles,
                         const std::function<void()>& launch) {
  bool thrown = false;
  try {
    launch();
  } catch (const cudasim::Error& e) {
    thrown = true;
    const std::string m = e.what();
    CHECK(e.kind() == kind, "kind %d, message:\n%s", static_cast<int>(e.kind()), m.c_str());
    for (const std::string& n : needles) CHECK(m.find(n) != std::string::npos, "'%s' not in:\n%s", n.c_str(), m.c_str());
    if (std::getenv("SELFTEST_SHOW_ERRORS")) std::printf("  (expected) %s\n", m.c_str());
  }
  CHECK(thrown, "no cudasim::Error thrown");
  check_recovery();
}

// Deterministic inputs in [-1, 1).
static std::vector<float> inputs(std::size_t n, unsigned seed) {
  std::vector<float> v(n);
  unsigned s = seed * 2654435761u + 12345u;
  for (float& x : v) {
    s = s * 1664525u + 1013904223u;
    x = static_cast<float>(s >> 8) / static_cast<float>(1u << 23) - 1.f;
  }
  return v;
}

static float to_f(float v) { return v; }
static float to_f(__half v) { return __half2float(v); }
static float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
template <class T> T from_f(float v);
template <> float from_f<float>(float v) { return v; }
template <> __half from_f<__half>(float v) { return __float2half_rn(v); }
template <> __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// ---- 1. row reduction: warp xor sums, static __shared__ partials -----------------
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <class T>
__global__ void __launch_bounds__(128) row_stats_kernel(const T* __restrict__ x, float* __restrict__ out, int D) {
  __shared__ float partial[2][32];
  const T* row = x + static_cast<long>(blockIdx.x) * D;
  float s = 0.f, q = 0.f;
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    const float v = to_f(row[i]);
    s += v;
    q += v * v;
  }
  s = warp_sum(s);
  q = warp_sum(q);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) partial[0][warp] = s, partial[1][warp] = q;
  __syncthreads();
  if (warp == 0) {
    const int nw = blockDim.x / 32;
    s = warp_sum(lane < nw ? partial[0][lane] : 0.f);
    q = warp_sum(lane < nw ? partial[1][lane] : 0.f);
    if (lane == 0) out[2 * blockIdx.x] = s, out[2 * blockIdx.x + 1] = q;
  }
}

template <class T>
static void run_row_stats(int D) {
  const int rows = 5;
  const std::vector<float> f = inputs(static_cast<std::size_t>(rows) * D, static_cast<unsigned>(D));
  std::vector<T> x(f.size(), from_f<T>(0.f));
  for (std::size_t i = 0; i < f.size(); ++i) x[i] = from_f<T>(f[i]);
  std::vector<float> out(2 * rows, -1.f);
  auto kernel = row_stats_kernel<T>;
  DLLM_LAUNCH(kernel, rows, 128, 0, nullptr, x.data(), out.data(), D);
  for (int r = 0; r < rows; ++r) {
    double s = 0, q = 0, a = 0;
    for (int i = 0; i < D; ++i) {
      const double v = to_f(x[static_cast<std::size_t>(r) * D + i]);
      s += v, q += v * v, a += std::fabs(v);
    }
    const double tol = 1e-5 * (a + 1) + 1e-6;
    CHECK(std::fabs(out[2 * r] - s) <= tol, "D=%d row %d sum %g vs %g", D, r, out[2 * r], s);
    CHECK(std::fabs(out[2 * r + 1] - q) <= 1e-5 * (q + 1), "D=%d row %d sumsq %g vs %g", D, r, out[2 * r + 1], q);
  }
}

static void test_row_reduce() {
  for (int D : {1, 7, 33, 111, 4097}) {
    run_row_stats<float>(D);
    run_row_stats<__half>(D);
    run_row_stats<__nv_bfloat16>(D);
  }
}

// ---- 2. dynamic shared memory tree reduction + __shfl_down_sync ------------------
__global__ void tree_sum_kernel(const float* x, float* out, int per_block) {
  DLLM_DYNAMIC_SMEM(float, s);
  const unsigned t = threadIdx.x;
  const float* seg = x + static_cast<long>(blockIdx.x) * per_block;
  float v = 0.f;
  for (int i = t; i < per_block; i += blockDim.x) v += seg[i];
  s[t] = v;
  __syncthreads();
  for (unsigned stride = blockDim.x / 2; stride >= 32; stride /= 2) {
    if (t < stride) s[t] += s[t + stride];
    __syncthreads();
  }
  if (t < 32) {
    v = s[t];
    for (int o = 16; o > 0; o /= 2) v += __shfl_down_sync(0xffffffffu, v, o);
    if (t == 0) out[blockIdx.x] = v;
  }
}

static void test_dyn_smem_tree() {
  for (int threads : {64, 256, 1024}) {
    const int blocks = sized(37, 5), per = 1000;
    const std::vector<float> x = inputs(static_cast<std::size_t>(blocks) * per, 7);
    std::vector<float> out(blocks, 0.f);
    DLLM_LAUNCH(tree_sum_kernel, blocks, threads, threads * sizeof(float), nullptr, x.data(), out.data(), per);
    for (int b = 0; b < blocks; ++b) {
      double ref = 0, a = 0;
      for (int i = 0; i < per; ++i) ref += x[static_cast<std::size_t>(b) * per + i], a += std::fabs(x[b * per + i]);
      CHECK(std::fabs(out[b] - ref) <= 1e-5 * a, "threads %d block %d: %g vs %g", threads, b, out[b], ref);
    }
  }
}

__global__ void smem_poison_kernel(unsigned* out) {
  DLLM_DYNAMIC_SMEM(float, s);
  out[blockIdx.x * blockDim.x + threadIdx.x] = __float_as_uint(s[threadIdx.x]);  // read before any write
  s[threadIdx.x] = 1.f;  // must not leak into the next block
}

static void test_smem_poison() {
  std::vector<unsigned> out(2 * 64, 0);
  DLLM_LAUNCH(smem_poison_kernel, 2, 64, 64 * sizeof(float), nullptr, out.data());
  for (unsigned v : out) CHECK(v == 0xffffffffu, "0x%08x", v);
  CHECK(std::isnan(__uint_as_float(out[0])));
}

// ---- 3. atomics -------------------------------------------------------------------
struct AtomicOut {
  int count, imax, imin, sub;
  unsigned bits_and, bits_or, bits_xor, inc;
  unsigned long long ull;
  float fsum, fmax_cas;
  double dsum;
  __half hsum;
  int exch;
};

__global__ void atomics_kernel(AtomicOut* o) {
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  atomicAdd(&o->count, 1);
  atomicSub(&o->sub, 2);
  atomicMax(&o->imax, (g * 7919) % 10007);
  atomicMin(&o->imin, (g * 7919) % 10007 - 5000);
  atomicAnd(&o->bits_and, ~(1u << (g % 32)) | (g < 32 ? 0u : 0xffffffffu));
  atomicOr(&o->bits_or, 1u << (g % 32));
  atomicXor(&o->bits_xor, 1u << (g % 3));
  atomicInc(&o->inc, 9);
  atomicAdd(&o->ull, 1ull << 33);
  atomicAdd(&o->fsum, 0.5f);
  atomicAdd(&o->dsum, 0.25);
  atomicAdd(&o->hsum, __float2half(0.25f));
  atomicExch(&o->exch, g);
  __threadfence();
  // float max through an atomicCAS loop on the bits
  const float v = static_cast<float>((g * 31) % 997) * 0.5f;
  int* addr = reinterpret_cast<int*>(&o->fmax_cas);
  // Not `old = *addr`: that plain read races with other threads' atomicCAS
  // (TSan reports it on the threads engine), so read through an atomic.
  int old = atomicAdd(addr, 0), assumed;
  do {
    assumed = old;
    if (__int_as_float(assumed) >= v) break;
    old = atomicCAS(addr, assumed, __float_as_int(v));
  } while (old != assumed);
}

static void test_atomics() {
  const int blocks = 50, threads = 128, n = blocks * threads;
  AtomicOut o{};
  o.imax = -1, o.imin = 1 << 30, o.bits_and = 0xffffffffu, o.fmax_cas = -1.f;
  DLLM_LAUNCH(atomics_kernel, blocks, threads, 0, nullptr, &o);
  int imax = -1, imin = 1 << 30;
  float fmax = -1.f;
  for (int g = 0; g < n; ++g) {
    imax = std::max(imax, (g * 7919) % 10007);
    imin = std::min(imin, (g * 7919) % 10007 - 5000);
    fmax = std::max(fmax, static_cast<float>((g * 31) % 997) * 0.5f);
  }
  CHECK(o.count == n, "%d", o.count);
  CHECK(o.sub == -2 * n, "%d", o.sub);
  CHECK(o.imax == imax && o.imin == imin, "%d %d", o.imax, o.imin);
  CHECK(o.bits_and == 0u && o.bits_or == 0xffffffffu, "%08x %08x", o.bits_and, o.bits_or);
  CHECK(o.bits_xor == ((n / 3 + (n % 3 > 0)) % 2 ? 1u : 0u) + ((n / 3 + (n % 3 > 1)) % 2 ? 2u : 0u) +
                          ((n / 3) % 2 ? 4u : 0u), "%u", o.bits_xor);
  CHECK(o.inc == static_cast<unsigned>(n % 10), "%u", o.inc);
  CHECK(o.ull == (static_cast<unsigned long long>(n) << 33));
  CHECK(o.fsum == 0.5f * n && o.dsum == 0.25 * n, "%g %g", o.fsum, o.dsum);
  CHECK(__half2float(o.hsum) == 512.f || n * 0.25f > 2048.f, "%g", __half2float(o.hsum));
  CHECK(o.exch >= 0 && o.exch < n);
  CHECK(o.fmax_cas == fmax, "%g vs %g", o.fmax_cas, fmax);
}

// ---- 4. ballot, votes, __syncthreads_count/and/or, __reduce_*_sync ---------------
__global__ void vote_kernel(unsigned* ballots, int* counts, int* votes, int period) {
  const unsigned t = threadIdx.x, lane = t % 32, w = t / 32;
  const int pred = (t % period) == 0;
  const unsigned b = __ballot_sync(0xffffffffu, pred);
  if (lane == 0) ballots[blockIdx.x * 32 + w] = b;
  const int c = __syncthreads_count(pred);
  const int a = __syncthreads_and(t < 1000);
  const int o = __syncthreads_or(pred && t > 1);
  const int any = __any_sync(0xffffffffu, pred), all = __all_sync(0xffffffffu, lane < 40);
  const unsigned radd = __reduce_add_sync(0xffffffffu, lane);
  const int rmin = __reduce_min_sync(0xffffffffu, static_cast<int>(lane) - 5);
  const unsigned rmax = __reduce_max_sync(0xffffffffu, lane * 3u);
  const unsigned rxor = __reduce_xor_sync(0xffffffffu, 1u << (lane % 4));
  if (t == 0) {
    int* v = votes + blockIdx.x * 9;
    v[0] = c, v[1] = a, v[2] = o, v[3] = any, v[4] = all;
    v[5] = static_cast<int>(radd), v[6] = rmin, v[7] = static_cast<int>(rmax), v[8] = static_cast<int>(rxor);
  }
  if (t == 0) counts[blockIdx.x] = c;
}

static void test_votes() {
  for (int threads : {96, 80}) {  // 80: the last warp has 16 lanes (the rest do not exist)
    const int blocks = 2, period = 3;
    std::vector<unsigned> ballots(blocks * 32, 0);
    std::vector<int> counts(blocks, -1), votes(blocks * 9, -1);
    DLLM_LAUNCH(vote_kernel, blocks, threads, 0, nullptr, ballots.data(), counts.data(), votes.data(), period);
    int expect_count = 0;
    for (int t = 0; t < threads; ++t) expect_count += t % period == 0;
    for (int blk = 0; blk < blocks; ++blk) {
      for (int w = 0; w < (threads + 31) / 32; ++w) {
        unsigned e = 0;
        for (int l = 0; l < 32 && w * 32 + l < threads; ++l) e |= ((w * 32 + l) % period == 0 ? 1u : 0u) << l;
        CHECK(ballots[blk * 32 + w] == e, "threads %d warp %d: %08x vs %08x", threads, w, ballots[blk * 32 + w], e);
      }
      const int* v = &votes[blk * 9];
      CHECK(counts[blk] == expect_count && v[0] == expect_count);
      CHECK(v[1] == 1 && v[2] == 1 && v[3] == 1 && v[4] == 1);
      CHECK(v[5] == 496 && v[6] == -5 && v[7] == 93 && v[8] == 0, "%d %d %d %d", v[5], v[6], v[7], v[8]);
    }
  }
}

// ---- 5. cooperative groups -------------------------------------------------------
__global__ void cg_kernel(const int* x, int* out) {
  cg::thread_block block = cg::this_thread_block();
  cg::thread_block_tile<16> tile = cg::tiled_partition<16>(block);
  const int v = x[block.thread_rank()];
  const int sum = cg::reduce(tile, v, cg::plus<int>());
  const int mn = cg::reduce(tile, v, cg::less<int>());
  const int mx = cg::reduce(tile, v, cg::greater<int>());
  const int first = tile.shfl(v, 0);
  const int down = tile.shfl_down(v, 1);
  const unsigned bal = tile.ballot(v % 2 == 0);
  auto quad = cg::tiled_partition<4>(tile);
  const int qsum = cg::reduce(quad, v, cg::plus<int>());
  block.sync();
  int* o = out + block.thread_rank() * 10;
  o[0] = sum, o[1] = mn, o[2] = mx, o[3] = first, o[4] = down, o[5] = static_cast<int>(bal);
  o[6] = static_cast<int>(tile.meta_group_rank()), o[7] = static_cast<int>(tile.meta_group_size());
  o[8] = qsum, o[9] = static_cast<int>(quad.meta_group_rank() * 100 + quad.meta_group_size() * 10 + quad.thread_rank());
}

static void test_cg() {
  const int n = 64;
  std::vector<int> x(n), out(n * 10, -1);
  for (int i = 0; i < n; ++i) x[i] = (i * 37) % 101 - 50;
  DLLM_LAUNCH(cg_kernel, 1, n, 0, nullptr, x.data(), out.data());
  for (int i = 0; i < n; ++i) {
    const int base = i / 16 * 16;
    int sum = 0, mn = 1 << 30, mx = -(1 << 30), qsum = 0;
    unsigned bal = 0;
    for (int j = 0; j < 16; ++j) {
      sum += x[base + j], mn = std::min(mn, x[base + j]), mx = std::max(mx, x[base + j]);
      bal |= (x[base + j] % 2 == 0 ? 1u : 0u) << j;
    }
    for (int j = 0; j < 4; ++j) qsum += x[i / 4 * 4 + j];
    const int down = (i % 16) < 15 ? x[i + 1] : x[i];
    const int* o = &out[i * 10];
    CHECK(o[0] == sum && o[1] == mn && o[2] == mx, "thread %d: %d %d %d", i, o[0], o[1], o[2]);
    CHECK(o[3] == x[base] && o[4] == down && static_cast<unsigned>(o[5]) == bal, "thread %d", i);
    CHECK(o[6] == i / 16 && o[7] == n / 16, "thread %d: meta %d %d", i, o[6], o[7]);
    CHECK(o[8] == qsum && o[9] == (i % 16) / 4 * 100 + 40 + i % 4, "thread %d: %d %d", i, o[8], o[9]);
  }
}

// ---- 6. shuffle rules, brute force ------------------------------------------------
// Expected values from the CUDA Programming Guide's wording (segments of
// `width` lanes), written independently of the shim's PTX-formula code. The
// offset operand is used modulo 32 (PTX shfl.sync takes b[4:0]).
enum Mode { kIdx, kUp, kDown, kXor };
static int expected_source(Mode m, int lane, int off, int width) {
  const int seg = lane / width, in_seg = lane % width;
  switch (m) {
    case kIdx: return seg * width + ((off % width) + width) % width;
    case kUp: { const int d = off & 31; return in_seg - d < 0 ? lane : lane - d; }
    case kDown: { const int d = off & 31; return in_seg + d >= width ? lane : lane + d; }
    case kXor: { const int t = lane ^ (off & 31); return t / width > seg ? lane : t; }  // later group: own value
  }
  return -1;
}

constexpr int kOffLo = -8, kOffHi = 39;
__global__ void shuffle_rules_kernel(int mode, int width, int* out) {
  const int lane = threadIdx.x;
  const int v = lane * 100 + 7;
  for (int off = kOffLo; off <= kOffHi; ++off) {
    if (off < 0 && mode != kIdx) continue;
    int r = -1;
    switch (mode) {
      case kIdx: r = __shfl_sync(0xffffffffu, v, off, width); break;
      case kUp: r = __shfl_up_sync(0xffffffffu, v, static_cast<unsigned>(off), width); break;
      case kDown: r = __shfl_down_sync(0xffffffffu, v, static_cast<unsigned>(off), width); break;
      case kXor: r = __shfl_xor_sync(0xffffffffu, v, off, width); break;
    }
    out[(off - kOffLo) * 32 + lane] = r;
  }
}

static void test_shuffle_rules() {
  long checks = 0;
  for (int mode = kIdx; mode <= kXor; ++mode)
    for (int width = 1; width <= 32; width *= 2) {
      std::vector<int> out((kOffHi - kOffLo + 1) * 32, -1);
      DLLM_LAUNCH(shuffle_rules_kernel, 1, 32, 0, nullptr, mode, width, out.data());
      for (int off = kOffLo; off <= kOffHi; ++off) {
        if (off < 0 && mode != kIdx) continue;
        for (int lane = 0; lane < 32; ++lane) {
          const int e = expected_source(static_cast<Mode>(mode), lane, off, width) * 100 + 7;
          const int got = out[(off - kOffLo) * 32 + lane];
          CHECK(got == e, "mode %d width %d offset %d lane %d: %d vs %d", mode, width, off, lane, got, e);
          ++checks;
        }
      }
    }
  std::printf("  %ld shuffle results checked\n", checks);
}

struct Pair {
  int a;
  float b;
};
template <class T>
__global__ void shuffle_type_kernel(const T* in, T* out) {
  const unsigned l = threadIdx.x;
  out[l] = __shfl_xor_sync(0xffffffffu, in[l], 5);
  out[32 + l] = __shfl_sync(0xffffffffu, in[l], 31 - static_cast<int>(l));
  out[64 + l] = __shfl_down_sync(0xffffffffu, in[l], 3, 8);
}
template <class T>
static void run_shuffle_type(T (*make)(int)) {
  std::vector<T> in, out;
  for (int i = 0; i < 32; ++i) in.push_back(make(i));
  for (int i = 0; i < 96; ++i) out.push_back(make(-1));
  auto kernel = shuffle_type_kernel<T>;
  DLLM_LAUNCH(kernel, 1, 32, 0, nullptr, in.data(), out.data());
  for (int l = 0; l < 32; ++l) {
    const int down = (l % 8) + 3 < 8 ? l + 3 : l;
    CHECK(std::memcmp(&out[l], &in[l ^ 5], sizeof(T)) == 0, "%s lane %d xor", typeid(T).name(), l);
    CHECK(std::memcmp(&out[32 + l], &in[31 - l], sizeof(T)) == 0, "%s lane %d idx", typeid(T).name(), l);
    CHECK(std::memcmp(&out[64 + l], &in[down], sizeof(T)) == 0, "%s lane %d down", typeid(T).name(), l);
  }
}

static void test_shuffle_types() {
  run_shuffle_type<double>([](int i) { return i * 1.0000001 + 1e-300; });
  run_shuffle_type<long long>([](int i) { return (1ll << 40) * i + i; });
  run_shuffle_type<unsigned long long>([](int i) { return ~0ull - static_cast<unsigned long long>(i); });
  run_shuffle_type<unsigned>([](int i) { return 0x80000000u | static_cast<unsigned>(i); });
  run_shuffle_type<float>([](int i) { return -1.5f * static_cast<float>(i); });
  run_shuffle_type<__half>([](int i) { return __float2half(0.125f * static_cast<float>(i)); });
  run_shuffle_type<__half2>([](int i) { return __floats2half2_rn(static_cast<float>(i), -static_cast<float>(i)); });
  run_shuffle_type<__nv_bfloat16>([](int i) { return __float2bfloat16(3.f * static_cast<float>(i)); });
  run_shuffle_type<__nv_bfloat162>([](int i) { return __floats2bfloat162_rn(static_cast<float>(i), 2.f); });
  run_shuffle_type<Pair>([](int i) { return Pair{i, -0.5f * static_cast<float>(i)}; });
}

// ---- 7. launch geometry, block order, exits, partial masks -----------------------
__global__ void geometry_kernel(int* ids, int* order, int* counter) {
  const int bx = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const int tx = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const int nt = blockDim.x * blockDim.y * blockDim.z;
  ids[bx * nt + tx] = (threadIdx.z * 100 + threadIdx.y) * 100 + threadIdx.x;
  if (tx == 0) order[bx] = atomicAdd(counter, 1);
}

static void test_geometry() {
  const dim3 grid(3, 2, 2), block(4, 3, 2);
  const int nb = 12, nt = 24;
  std::vector<int> ids(nb * nt, -1), order(nb, -1);
  int counter = 0;
  DLLM_LAUNCH(geometry_kernel, grid, block, 0, nullptr, ids.data(), order.data(), &counter);
  for (int b = 0; b < nb; ++b) {
    CHECK(order[b] == b, "block %d ran %d-th", b, order[b]);
    for (int t = 0; t < nt; ++t) {
      const int x = t % 4, y = (t / 4) % 3, z = t / 12;
      CHECK(ids[b * nt + t] == (z * 100 + y) * 100 + x, "block %d thread %d", b, t);
    }
  }
}

__global__ void early_exit_kernel(int* out, int live) {
  __shared__ int s[256];
  const int t = threadIdx.x;
  if (t >= live) return;  // exited threads drop out of barriers and masks
  s[t] = t;
  __syncthreads();
  int v = s[(t + 1) % live];
  __syncthreads();
  s[t] = v * 2;
  __syncthreads();
  // Full-mask votes: the exited lanes drop out instead of being waited for.
  const unsigned b = __ballot_sync(0xffffffffu, 1);
  __syncwarp();
  const int nl = min(32, live - (t / 32) * 32);
  out[t] = v + (b == (nl == 32 ? ~0u : (1u << nl) - 1) ? 0 : 100000);
}

__global__ void exited_lanes_kernel(int* out) {
  const int lane = threadIdx.x % 32;
  if (lane >= 16) return;
  int v = lane + 1;
  for (int o = 8; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);  // reads lanes 0-15 only
  out[threadIdx.x] = v;
}

__global__ void split_warp_kernel(int* out) {
  const int lane = threadIdx.x % 32;
  int v = lane;
  if (lane < 16) {
    v = __shfl_down_sync(0x0000ffffu, v, 1, 16);
  } else {
    __syncwarp(0xffff0000u);
    v = __shfl_up_sync(0xffff0000u, v, 2, 16) + 1000;
  }
  out[threadIdx.x] = v;
}

static void test_exits_and_masks() {
  for (int live : {1, 40, 64, 100}) {
    std::vector<int> out(256, -1);
    DLLM_LAUNCH(early_exit_kernel, 2, 128, 0, nullptr, out.data(), live);
    for (int t = 0; t < live; ++t) CHECK(out[t] == (t + 1) % live, "live %d thread %d: %d", live, t, out[t]);
  }
  std::vector<int> out(64, -1);
  DLLM_LAUNCH(exited_lanes_kernel, 1, 64, 0, nullptr, out.data());
  for (int t = 0; t < 64; ++t) CHECK(out[t] == (t % 32 < 16 ? 136 : -1), "thread %d: %d", t, out[t]);
  DLLM_LAUNCH(split_warp_kernel, 1, 32, 0, nullptr, out.data());
  for (int l = 0; l < 32; ++l) {
    const int e = l < 16 ? (l < 15 ? l + 1 : l) : (l - 16 >= 2 ? l - 2 : l) + 1000;
    CHECK(out[l] == e, "lane %d: %d vs %d", l, out[l], e);
  }
}

// ---- 8. math intrinsics and half/bf16 fallbacks -----------------------------------
static void test_math() {
  CHECK(__float2int_rn(0.5f) == 0 && __float2int_rn(1.5f) == 2 && __float2int_rn(2.5f) == 2);
  CHECK(__float2int_rn(-0.5f) == 0 && __float2int_rn(-1.5f) == -2 && __float2int_rn(-2.6f) == -3);
  CHECK(__float2int_rn(NAN) == 0 && __float2int_rn(1e10f) == 2147483647 && __float2int_rn(-1e10f) == -2147483647 - 1);
  CHECK(__float2int_rz(-2.7f) == -2 && __float2int_rd(-2.1f) == -3 && __float2int_ru(2.1f) == 3);
  CHECK(__float2uint_rn(-3.f) == 0u && __float2ll_rn(3e9f) == 3000000000ll);
  CHECK(__saturatef(-1.f) == 0.f && __saturatef(2.f) == 1.f && __saturatef(NAN) == 0.f && __saturatef(0.25f) == 0.25f);
  CHECK(__float_as_uint(1.f) == 0x3f800000u && __uint_as_float(0x40000000u) == 2.f && __int_as_float(__float_as_int(-3.5f)) == -3.5f);
  CHECK(__popc(0xf0f0u) == 8 && __ffs(0) == 0 && __ffs(8) == 4 && __clz(1) == 31 && __clz(0) == 32);
  CHECK(__brev(1u) == 0x80000000u && __brev(0x12345678u) == 0x1e6a2c48u && __brevll(1ull) == (1ull << 63));
  CHECK(__umulhi(0x80000000u, 4u) == 2u && __popcll(~0ull) == 64);
  CHECK(__byte_perm(0x33221100u, 0x77665544u, 0x7531u) == 0x77553311u && __byte_perm(0x33221100u, 0u, 0x0123u) == 0x00112233u);
  CHECK(__mul24(-3, 5) == -15 && __mul24(0x00ffffff, 2) == -2 && __umul24(0x01000003u, 2u) == 6u);
  CHECK(__sad(-3, 4, 10u) == 17u && __usad(2u, 9u, 1u) == 8u);
  CHECK(std::fabs(__expf(1.f) - 2.7182817f) < 1e-6f && __fdividef(1.f, 4.f) == 0.25f && rsqrtf(4.f) == 0.5f);
  CHECK(__frcp_rn(8.f) == 0.125f && __fsqrt_rn(9.f) == 3.f && __fmaf_rn(2.f, 3.f, 1.f) == 7.f);
  CHECK(min(3, 5) == 3 && max(3u, 5u) == 5u && min(-1, 2u) == 2u && max(2.5f, 1.0) == 2.5 && min(int64_t{7}, 3) == 3);
  const __half h = __float2half(4.f);
  CHECK(__half2float(hsqrt(h)) == 2.f && __half2float(hrsqrt(h)) == 0.5f && __half2float(hrcp(h)) == 0.25f);
  CHECK(std::fabs(__half2float(hexp(__float2half(1.f))) - 2.71875f) < 2e-3f);
  CHECK(__half2float(__hfma(h, h, __float2half(-1.f))) == 15.f && __half2float(__hmax(h, __float2half(5.f))) == 5.f);
  CHECK(__half2float(__hmin(h, __float2half(5.f))) == 4.f && __half2float(__hfma_relu(h, __float2half(-1.f), h)) == 0.f);
  CHECK(__half2float(__hfma_sat(h, h, h)) == 1.f);
  const __half2 h2 = h2sqrt(__floats2half2_rn(16.f, 25.f));
  CHECK(__low2float(h2) == 4.f && __high2float(h2) == 5.f);
  const __nv_bfloat16 b = __float2bfloat16(9.f);
  CHECK(__bfloat162float(hsqrt(b)) == 3.f && __bfloat162float(__hfma(b, b, b)) == 90.f);
  CHECK(std::fabs(__bfloat162float(hexp(__float2bfloat16(0.f))) - 1.f) == 0.f && __bfloat162float(hfloor(__float2bfloat16(-1.5f))) == -2.f);
  CHECK(__half2int_rn(__float2half(2.5f)) == 2 && __bfloat162int_ru(__float2bfloat16(1.25f)) == 2);
}

// ---- 9. concurrency of callers --------------------------------------------------
__global__ void scale_kernel(float* x, float f, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  __syncthreads();
  if (i < n) x[i] *= f;
}

static void test_concurrent_callers() {
  std::vector<float> a(1000, 1.f), b(1000, 1.f);
  auto work = [](std::vector<float>* v, float f) {
    for (int r = 0; r < 5; ++r) DLLM_LAUNCH(scale_kernel, 8, 128, 0, nullptr, v->data(), f, 1000);
  };
  std::thread t1(work, &a, 2.f), t2(work, &b, 3.f);
  t1.join();
  t2.join();
  for (int i = 0; i < 1000; ++i) CHECK(a[i] == 32.f && b[i] == 243.f, "%d: %g %g", i, a[i], b[i]);
}

// ---- 10. injected bugs the shim must catch ---------------------------------------
__global__ void ok_kernel(int* out) {
  __shared__ int s[64];
  s[threadIdx.x] = static_cast<int>(threadIdx.x);
  __syncthreads();
  out[threadIdx.x] = s[63 - threadIdx.x] + __shfl_xor_sync(0xffffffffu, 1, 1);
}
static void check_recovery() {
  std::vector<int> out(64, -1);
  DLLM_LAUNCH(ok_kernel, 1, 64, 0, nullptr, out.data());
  for (int t = 0; t < 64; ++t) CHECK(out[t] == 64 - t, "engine unusable after an error: %d", out[t]);
}

// Missing __syncthreads between the write and another thread's read.
__global__ void missing_sync_kernel(int* out) {
  DLLM_DYNAMIC_SMEM(int, s);
  const int t = threadIdx.x, n = blockDim.x;
  s[t] = t + 1;
  // __syncthreads();   <- the bug
  out[t] = s[(t + 1) % n];
}
static void test_bug_missing_sync() {
  if (engine_is_threads()) {  // racy by construction: the TSan run covers it (sanitizer_bugs race)
    std::printf("  skipped on the threads engine\n");
    return;
  }
  const int n = 64;
  std::vector<int> out(n, 0);
  DLLM_LAUNCH(missing_sync_kernel, 1, n, n * sizeof(int), nullptr, out.data());
  // Fibers run thread 0 to completion first: every read but the last sees the
  // 0xFF poison, deterministically.
  for (int t = 0; t < n - 1; ++t) CHECK(out[t] == -1, "thread %d read %d", t, out[t]);
  CHECK(out[n - 1] == 1);
}

__global__ void smem_oob_kernel() {
  DLLM_DYNAMIC_SMEM(float, s);
  s[threadIdx.x + 1] = 1.f;  // thread 127 writes s[128]: one past the end
}
static void test_bug_smem_oob() {
  expect_error(cudasim::ErrorKind::SmemOverflow, {"out of bounds", "bytes [512, 516)", "smem_oob_kernel", "block (0,0,0)"},
               [] { DLLM_LAUNCH(smem_oob_kernel, 3, 128, 128 * sizeof(float), nullptr); });
}

static int g_line_a = 0, g_line_b = 0;
// One thread records the line, so the host can look for it in the report.
__device__ void note_line(int& dst, unsigned who, int line) {
  if (threadIdx.x == who) dst = line;
}
__global__ void divergent_kernel(int* out) {
  if (threadIdx.x < 64) {
    note_line(g_line_a, 0, __LINE__), __syncthreads();
  } else {
    note_line(g_line_b, 64, __LINE__), __syncthreads();
  }
  out[threadIdx.x] = 1;
}
static void test_bug_divergent() {
  std::vector<int> out(128, 0);
  expect_error(cudasim::ErrorKind::DivergentBarrier, {"divergent"},
               [&] { DLLM_LAUNCH(divergent_kernel, 1, 128, 0, nullptr, out.data()); });
  const std::string a = "selftest.cpp:" + std::to_string(g_line_a), b = "selftest.cpp:" + std::to_string(g_line_b);
  expect_error(cudasim::ErrorKind::DivergentBarrier, {a, b},
               [&] { DLLM_LAUNCH(divergent_kernel, 1, 128, 0, nullptr, out.data()); });
}

__global__ void shuffle_outside_mask_kernel(int* out) {
  const int lane = threadIdx.x % 32;
  if (lane < 16) out[lane] = __shfl_sync(0x0000ffffu, lane, 20);  // lane 20 is not in the mask
}
__global__ void caller_outside_mask_kernel(int* out) {
  out[threadIdx.x] = __shfl_sync(0x0000ffffu, 1, 0);  // lanes 16-31 call with a mask without them
}
__global__ void shuffle_exited_kernel(int* out) {
  const int lane = threadIdx.x % 32;
  if (lane >= 16) return;
  out[lane] = __shfl_down_sync(0xffffffffu, lane, 16);  // reads lanes 16-31, which exited
}
__global__ void warp_mismatch_kernel(int* out) {
  const int lane = threadIdx.x % 32;
  if (lane % 2) out[lane] = static_cast<int>(__ballot_sync(0xffffffffu, 1));
  else out[lane] = __shfl_xor_sync(0xffffffffu, lane, 1);
}
static void test_bug_shuffles() {
  std::vector<int> out(64, 0);
  expect_error(cudasim::ErrorKind::WarpLane, {"reads lane 20", "is not in the mask", "__shfl_sync"},
               [&] { DLLM_LAUNCH(shuffle_outside_mask_kernel, 1, 32, 0, nullptr, out.data()); });
  expect_error(cudasim::ErrorKind::WarpLane, {"does not contain its own lane"},
               [&] { DLLM_LAUNCH(caller_outside_mask_kernel, 1, 32, 0, nullptr, out.data()); });
  expect_error(cudasim::ErrorKind::WarpLane, {"has exited"},
               [&] { DLLM_LAUNCH(shuffle_exited_kernel, 1, 32, 0, nullptr, out.data()); });
  expect_error(cudasim::ErrorKind::WarpLane, {"does not exist"},
               [&] { DLLM_LAUNCH(shuffle_exited_kernel, 1, 16, 0, nullptr, out.data()); });
  expect_error(cudasim::ErrorKind::WarpMismatch, {"__ballot_sync", "__shfl_xor_sync"},
               [&] { DLLM_LAUNCH(warp_mismatch_kernel, 1, 32, 0, nullptr, out.data()); });
}

static int g_line_shfl = 0, g_line_sync = 0;
__global__ void deadlock_kernel(float* out) {
  float v = static_cast<float>(threadIdx.x);
  const int lane = threadIdx.x % 32;
  if (threadIdx.x == 0) g_line_shfl = __LINE__ + 1;
  if (lane < 16) v += __shfl_down_sync(0xffffffffu, v, 1);  // waits for lanes 16-31...
  if (threadIdx.x == 16) g_line_sync = __LINE__ + 1;
  __syncthreads();  // ...which wait here
  out[threadIdx.x] = v;
}
static void test_bug_deadlock() {
  std::vector<float> out(128, 0.f);
  expect_error(cudasim::ErrorKind::Deadlock, {"deadlock"},
               [&] { DLLM_LAUNCH(deadlock_kernel, 2, 128, 0, nullptr, out.data()); });
  const std::string at_shfl = "threads 0-15, 32-47, 64-79, 96-111 at ", at_sync = "threads 16-31, 48-63, 80-95, 112-127 at ";
  expect_error(cudasim::ErrorKind::Deadlock,
               {at_shfl, at_sync, "selftest.cpp:" + std::to_string(g_line_shfl) + " (__shfl_down_sync mask 0xffffffff)",
                "selftest.cpp:" + std::to_string(g_line_sync) + " (__syncthreads)"},
               [&] { DLLM_LAUNCH(deadlock_kernel, 2, 128, 0, nullptr, out.data()); });
}

__global__ void throwing_kernel(int* out) {
  if (threadIdx.x == 5 && blockIdx.x == 1) throw std::runtime_error("boom from the kernel");
  __syncthreads();
  out[threadIdx.x] = 1;
}
__global__ void trap_kernel() {
  if (threadIdx.x == 3) __trap();
  __syncthreads();
}
static void test_bug_throw_and_trap() {
  std::vector<int> out(64, 0);
  expect_error(cudasim::ErrorKind::KernelException, {"boom from the kernel", "thread 5", "block (1,0,0)"},
               [&] { DLLM_LAUNCH(throwing_kernel, 3, 64, 0, nullptr, out.data()); });
  expect_error(cudasim::ErrorKind::Trap, {"__trap"}, [&] { DLLM_LAUNCH(trap_kernel, 1, 64, 0, nullptr); });
}

static void test_bug_invalid_launch() {
  std::vector<int> out(64, 0);
  expect_error(cudasim::ErrorKind::InvalidLaunch, {"invalid block"},
               [&] { DLLM_LAUNCH(ok_kernel, 1, 2048, 0, nullptr, out.data()); });
  expect_error(cudasim::ErrorKind::InvalidLaunch, {"invalid grid"},
               [&] { DLLM_LAUNCH(ok_kernel, 0, 64, 0, nullptr, out.data()); });
  expect_error(cudasim::ErrorKind::InvalidLaunch, {"invalid block"},
               [&] { DLLM_LAUNCH(ok_kernel, 1, dim3(8, 8, 65), 0, nullptr, out.data()); });
  expect_error(cudasim::ErrorKind::InvalidLaunch, {"exceeds"},
               [&] { DLLM_LAUNCH(ok_kernel, 1, 64, 300 * 1024, nullptr, out.data()); });
  expect_error(cudasim::ErrorKind::Usage, {"outside a kernel"}, [] { (void)threadIdx.x; });
}

// Warn-only: continuable reports become warnings and the launch completes.
static void test_warn_only() {
  const unsigned long before = cudasim::warning_count();
  cudasim::set_warn_only(1);
  std::vector<int> out(128, 0);
  bool threw = false;
  try {
    DLLM_LAUNCH(divergent_kernel, 1, 128, 0, nullptr, out.data());
    DLLM_LAUNCH(smem_oob_kernel, 1, 128, 128 * sizeof(float), nullptr);
  } catch (const cudasim::Error& e) {
    threw = true;
    std::printf("  unexpected: %s\n", e.what());
  }
  cudasim::set_warn_only(-1);
  CHECK(!threw);
  CHECK(cudasim::warning_count() >= before + 2, "%lu -> %lu", before, cudasim::warning_count());
  for (int t = 0; t < 128; ++t) CHECK(out[t] == 1);
  // A deadlock cannot continue: it throws even in warn-only mode.
  cudasim::set_warn_only(1);
  std::vector<float> o3(128);
  expect_error(cudasim::ErrorKind::Deadlock, {"deadlock"}, [&] { DLLM_LAUNCH(deadlock_kernel, 1, 128, 0, nullptr, o3.data()); });
  cudasim::set_warn_only(-1);
}

// Follows the environment: CUDASIM_WARN_ONLY=1 -> warning, else an error.
static void test_env_warn_only() {
  const char* e = std::getenv("CUDASIM_WARN_ONLY");
  std::vector<int> out(128, 0);
  if (e && std::strcmp(e, "1") == 0) {
    const unsigned long before = cudasim::warning_count();
    DLLM_LAUNCH(divergent_kernel, 1, 128, 0, nullptr, out.data());
    CHECK(cudasim::warning_count() > before);
  } else {
    expect_error(cudasim::ErrorKind::DivergentBarrier, {"divergent"},
                 [&] { DLLM_LAUNCH(divergent_kernel, 1, 128, 0, nullptr, out.data()); });
  }
}

// ---- 11. throughput: a few hundred 256-thread blocks with many barriers -----------
static void test_throughput() {
  const int rows = sized(300, 8), D = 4096;
  const std::vector<float> x = inputs(static_cast<std::size_t>(rows) * D, 3);
  std::vector<float> out(2 * rows);
  const auto t0 = std::chrono::steady_clock::now();
  DLLM_LAUNCH(row_stats_kernel<float>, rows, 256, 0, nullptr, x.data(), out.data(), D);
  std::vector<float> tree(rows);
  DLLM_LAUNCH(tree_sum_kernel, rows, 256, 256 * sizeof(float), nullptr, x.data(), tree.data(), D);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  std::printf("  2 launches x %d blocks x 256 threads: %.1f ms (%.3f ms/block)\n", rows, ms, ms / (2 * rows));
  for (int r = 0; r < rows; ++r) CHECK(std::fabs(out[2 * r] - tree[r]) <= 1e-3f, "row %d", r);
}

// ---- driver ------------------------------------------------------------------------
struct Test {
  const char* name;
  void (*fn)();
};
static const Test kTests[] = {
    {"row_reduce", test_row_reduce},
    {"dyn_smem_tree", test_dyn_smem_tree},
    {"smem_poison", test_smem_poison},
    {"atomics", test_atomics},
    {"votes", test_votes},
    {"cooperative_groups", test_cg},
    {"shuffle_rules", test_shuffle_rules},
    {"shuffle_types", test_shuffle_types},
    {"geometry", test_geometry},
    {"exits_and_masks", test_exits_and_masks},
    {"math", test_math},
    {"concurrent_callers", test_concurrent_callers},
    {"bug_missing_sync", test_bug_missing_sync},
    {"bug_smem_oob", test_bug_smem_oob},
    {"bug_divergent", test_bug_divergent},
    {"bug_shuffles", test_bug_shuffles},
    {"bug_deadlock", test_bug_deadlock},
    {"bug_throw_and_trap", test_bug_throw_and_trap},
    {"bug_invalid_launch", test_bug_invalid_launch},
    {"warn_only", test_warn_only},
    {"env_warn_only", test_env_warn_only},
    {"throughput", test_throughput},
};

int main(int argc, char** argv) {
  std::vector<const Test*> run;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--list") == 0) {
      for (const Test& t : kTests) std::printf("%s\n", t.name);
      return 0;
    }
    const Test* found = nullptr;
    for (const Test& t : kTests)
      if (std::strcmp(argv[i], t.name) == 0) found = &t;
    if (!found) {
      std::fprintf(stderr, "unknown test %s (see --list)\n", argv[i]);
      return 2;
    }
    run.push_back(found);
  }
  if (run.empty())
    for (const Test& t : kTests) run.push_back(&t);
  const char* engine = engine_is_threads() ? "threads" : "fibers";
  int failed = 0;
  const auto start = std::chrono::steady_clock::now();
  for (const Test* t : run) {
    g_failures = 0;
    const auto t0 = std::chrono::steady_clock::now();
    try {
      t->fn();
    } catch (const std::exception& e) {
      std::printf("  unexpected exception: %s\n", e.what());
      ++g_failures;
    }
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    std::printf("%-4s %-20s %8.1f ms\n", g_failures ? "FAIL" : "ok", t->name, ms);
    std::fflush(stdout);
    failed += g_failures != 0;
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("cudasim selftest (%s engine): %zu/%zu tests passed, %ld checks, %.2f s\n", engine,
              run.size() - failed, run.size(), g_checks, s);
  return failed ? 1 : 0;
}
