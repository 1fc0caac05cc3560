// Unit tests of the shared DLLM_HD math (csrc/math/dllm_math.h), torch-free.
// Each check compares against an independent double-precision computation.
#include "math/dllm_math.h"

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

static int g_failures = 0;

#define EXPECT_NEAR(a, b, tol)                                                              \
  do {                                                                                      \
    const double a_ = (a), b_ = (b);                                                        \
    if (!(std::fabs(a_ - b_) <= (tol))) {                                                   \
      std::fprintf(stderr, "%s:%d: %s = %.9g, expected %.9g\n", __FILE__, __LINE__, #a, a_, \
                   b_);                                                                     \
      ++g_failures;                                                                         \
    }                                                                                       \
  } while (0)

namespace m = dllm::math;

static double cosine_drift_f64(const std::vector<float>& x, const std::vector<float>& y) {
  double dot = 0, nx = 0, ny = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    dot += double(x[i]) * y[i];
    nx += double(x[i]) * x[i];
    ny += double(y[i]) * y[i];
  }
  return 1.0 - dot / (std::max(std::sqrt(nx), 1e-8) * std::max(std::sqrt(ny), 1e-8));
}

static void test_cosine_random() {
  std::mt19937 rng(0);
  std::normal_distribution<float> n01;
  for (int D : {1, 7, 111, 4097}) {
    std::vector<float> x(D), y(D);
    for (int i = 0; i < D; ++i) x[i] = n01(rng), y[i] = n01(rng);
    // Accumulate in two halves and merge, as the parallel kernels do.
    m::CosineAcc lo = m::cosine_acc_zero(), hi = m::cosine_acc_zero();
    for (int i = 0; i < D; ++i) m::cosine_acc_add(i < D / 2 ? lo : hi, x[i], y[i]);
    EXPECT_NEAR(m::cosine_drift_finish(m::cosine_acc_merge(lo, hi)), cosine_drift_f64(x, y), 1e-5);
  }
}

static void test_cosine_edge_cases() {
  m::CosineAcc a = m::cosine_acc_zero();
  EXPECT_NEAR(m::cosine_drift_finish(a), 1.0, 0);  // both rows zero
  a = m::cosine_acc_zero();
  m::cosine_acc_add(a, 0.f, 3.f);
  EXPECT_NEAR(m::cosine_drift_finish(a), 1.0, 0);  // one zero row
  a = m::cosine_acc_zero();
  m::cosine_acc_add(a, 2.f, 2.f);
  EXPECT_NEAR(m::cosine_drift_finish(a), 0.0, 1e-7);  // identical
  a = m::cosine_acc_zero();
  m::cosine_acc_add(a, 2.f, -5.f);
  EXPECT_NEAR(m::cosine_drift_finish(a), 2.0, 1e-7);  // opposite
}

int main() {
  test_cosine_random();
  test_cosine_edge_cases();
  if (g_failures) {
    std::fprintf(stderr, "test_dllm_math: %d failure(s)\n", g_failures);
    return 1;
  }
  std::printf("test_dllm_math: all passed\n");
  return 0;
}
