// Torch-free driver that runs the CUDA kernels of csrc/cuda/*.cuh through the
// CUDA simulator against double-precision host references. pytest covers the
// same kernels through torch; this driver exists so the kernels can also run
// under ThreadSanitizer (threads engine) and ASan/UBSan (fiber engine), which
// cannot be loaded into a Python process. Exit status 0 = all passed.
#include "cuda/select.cuh"

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

static int g_failures = 0;

static void expect_close(double got, double want, double tol, const char* what, int i) {
  if (!(std::fabs(got - want) <= tol * (1.0 + std::fabs(want)))) {
    std::fprintf(stderr, "FAIL %s[%d]: got %.9g want %.9g\n", what, i, got, want);
    ++g_failures;
  }
}

template <typename T>
static T cast_from_float(float v) {
  return dllm::cuda::from_float<T>(v);
}

template <typename T>
static void test_cosine_drift(const char* name, int rows, int D, double tol) {
  std::mt19937 rng(rows * 131 + D);
  std::normal_distribution<float> n01;
  std::vector<T> x(size_t(rows) * D), y(size_t(rows) * D);
  std::vector<float> out(rows, -1.f);
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = cast_from_float<T>(n01(rng));
    y[i] = cast_from_float<T>(n01(rng));
  }
  if (rows > 1) std::fill(x.begin(), x.begin() + D, cast_from_float<T>(0.f));  // a zero row
  dllm::cuda::launch_cosine_drift(x.data(), y.data(), out.data(), rows, D, nullptr);
  for (int r = 0; r < rows; ++r) {
    double dot = 0, nx = 0, ny = 0;
    for (int i = 0; i < D; ++i) {
      const double a = dllm::cuda::to_float(x[size_t(r) * D + i]);
      const double b = dllm::cuda::to_float(y[size_t(r) * D + i]);
      dot += a * b, nx += a * a, ny += b * b;
    }
    const double want = 1.0 - dot / (std::max(std::sqrt(nx), 1e-8) * std::max(std::sqrt(ny), 1e-8));
    expect_close(out[r], want, tol, name, r);
  }
}

int main() {
  for (int D : {1, 7, 111, 1025}) {
    test_cosine_drift<float>("cosine_drift<float>", 3, D, 1e-5);
    test_cosine_drift<__half>("cosine_drift<half>", 2, D, 1e-4);
    test_cosine_drift<__nv_bfloat16>("cosine_drift<bf16>", 2, D, 1e-4);
  }
  if (g_failures) {
    std::fprintf(stderr, "sim_kernels: %d failure(s)\n", g_failures);
    return 1;
  }
  std::printf("sim_kernels: all passed\n");
  return 0;
}
