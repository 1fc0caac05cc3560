// Torch-free driver that runs the CUDA kernels of csrc/cuda/*.cuh through the
// CUDA simulator against double-precision host references. pytest covers the
// same kernels through torch; this driver exists so the kernels can also run
// under ThreadSanitizer (threads engine) and ASan/UBSan (fiber engine), which
// cannot be loaded into a Python process. Exit status 0 = all passed.
#include "cuda/select.cuh"
#include "cuda/rollout.cuh"
#include "cuda/sparse_kv.cuh"
#include "cuda/quant.cuh"
#include "cuda/layer.cuh"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
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
  dllm::cuda::launch_cosine_drift<T>(
      {.x = x.data(), .x_prev = y.data(), .out = out.data(), .rows = rows, .D = D}, nullptr);
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

// ---- family: rollout -------------------------------------------------------

// Dense d²Cache rollout on the host: R ← Ã_l·R over T×T double matrices.
template <typename T>
static std::vector<double> dense_rollout(const std::vector<T>& probs, const std::vector<int64_t>& idx,
                                         const std::vector<char>& valid, int L, int B, int Q, int Tn) {
  std::vector<double> g(size_t(B) * Tn, 0.0);
  for (int b = 0; b < B; ++b) {
    std::vector<double> R(size_t(Tn) * Tn, 0.0), At(size_t(Tn) * Tn), next(size_t(Tn) * Tn);
    for (int i = 0; i < Tn; ++i) R[size_t(i) * Tn + i] = 1.0;
    for (int l = 0; l < L; ++l) {
      std::fill(At.begin(), At.end(), 0.0);
      for (int i = 0; i < Tn; ++i) At[size_t(i) * Tn + i] = 1.0;
      for (int r = 0; r < Q; ++r) {
        const int64_t i = idx[(size_t(l) * B + b) * Q + r];
        if (i < 0 || !valid[size_t(b) * Tn + i]) continue;
        double s = 1.0;
        for (int j = 0; j < Tn; ++j) {
          const double a = valid[size_t(b) * Tn + j]
                               ? double(dllm::cuda::to_float(probs[((size_t(l) * B + b) * Q + r) * Tn + j]))
                               : 0.0;
          At[size_t(i) * Tn + j] = a + (j == i ? 1.0 : 0.0);
          s += a;
        }
        for (int j = 0; j < Tn; ++j) At[size_t(i) * Tn + j] /= s;
      }
      for (int i = 0; i < Tn; ++i)
        for (int j = 0; j < Tn; ++j) {
          double acc = 0.0;
          for (int k = 0; k < Tn; ++k) acc += At[size_t(i) * Tn + k] * R[size_t(k) * Tn + j];
          next[size_t(i) * Tn + j] = acc;
        }
      R.swap(next);
    }
    for (int j = 0; j < Tn; ++j) {
      double col = 0.0;
      for (int i = 0; i < Tn; ++i) col += R[size_t(i) * Tn + j];
      g[size_t(b) * Tn + j] = valid[size_t(b) * Tn + j] ? col : 0.0;
    }
  }
  return g;
}

// Random distinct rows per (layer, batch), one padding row, the first `pad`
// positions of batch row 1 invalid; `dup` plants a duplicate token.
template <typename T>
static void test_rollout_scores(const char* name, int L, int B, int Q, int Tn, int pad, bool dup) {
  std::mt19937 rng(L * 7919 + Q * 31 + Tn);
  std::uniform_real_distribution<float> u01;
  std::vector<T> probs(size_t(L) * B * Q * Tn);
  std::vector<int64_t> idx(size_t(L) * B * Q);
  std::vector<char> valid(size_t(B) * Tn, 1);
  for (int b = 1; b < B; ++b)
    for (int j = 0; j < pad && j < Tn; ++j) valid[size_t(b) * Tn + j] = 0;
  std::vector<int64_t> perm(Tn);
  for (int lb = 0; lb < L * B; ++lb) {
    for (int j = 0; j < Tn; ++j) perm[j] = j;
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int r = 0; r < Q; ++r) idx[size_t(lb) * Q + r] = (r == Q - 1 && Q > 2) ? -1 : perm[r];
    for (int r = 0; r < Q; ++r) {
      float sum = 0.f;
      std::vector<float> row(Tn);
      for (int j = 0; j < Tn; ++j) sum += row[j] = u01(rng) * u01(rng);
      for (int j = 0; j < Tn; ++j) probs[(size_t(lb) * Q + r) * Tn + j] = cast_from_float<T>(row[j] / sum);
    }
  }
  if (dup) idx[1] = idx[0];
  const auto sz = dllm::cuda::rollout_scratch_sizes(L, B, Q, Tn);
  std::vector<double> v(sz.v), row_sum(sz.row_sum), partial(sz.partial);
  std::vector<int> inv(sz.inv);
  int status = 0;
  std::vector<float> out(size_t(B) * Tn, -1.f);
  // std::vector<char> holds the bool mask: same size and values as bool.
  const bool* vp = reinterpret_cast<const bool*>(valid.data());
  dllm::cuda::launch_rollout_scores<T>(
      {.probs = probs.data(), .row_idx = idx.data(), .valid = vp, .out = out.data(), .L = L,
       .B = B, .Q = Q, .T = Tn,
       .scratch = {v.data(), row_sum.data(), inv.data(), partial.data()}, .status = &status},
      nullptr);
  if (dup) {
    if (status != dllm::math::kRolloutDuplicateRow) {
      std::fprintf(stderr, "FAIL %s: duplicate row gave status %d\n", name, status);
      ++g_failures;
    }
    return;
  }
  if (status != 0) {
    std::fprintf(stderr, "FAIL %s: status %d on valid input\n", name, status);
    ++g_failures;
  }
  const auto want = dense_rollout(probs, idx, valid, L, B, Q, Tn);
  for (size_t n = 0; n < out.size(); ++n) expect_close(out[n], want[n], 1e-5, name, int(n));
}

template <typename T>
static void test_nucleus_select(const char* name, int B, int Tn, double p, int min_k) {
  std::mt19937 rng(B * 131 + Tn);
  std::uniform_int_distribution<int> small(0, 5);  // many ties
  std::uniform_real_distribution<float> u01;
  std::vector<T> scores(size_t(B) * Tn);
  std::vector<char> cand(size_t(B) * Tn);
  for (size_t n = 0; n < scores.size(); ++n) {
    scores[n] = cast_from_float<T>(n % 2 ? float(small(rng)) : u01(rng) * 4.f);
    cand[n] = u01(rng) < 0.7f;
  }
  std::vector<char> out(size_t(B) * Tn, 2);
  std::vector<uint64_t> scratch(dllm::cuda::nucleus_scratch_elems(B, Tn));
  int status = 0;
  dllm::cuda::launch_nucleus_select<T>(
      {.scores = scores.data(), .candidate = reinterpret_cast<const bool*>(cand.data()),
       .out = reinterpret_cast<bool*>(out.data()), .B = B, .T = Tn, .p = p, .min_k = min_k,
       .scratch = scratch.empty() ? nullptr : scratch.data(), .status = &status},
      nullptr);
  for (int b = 0; b < B; ++b) {
    // Host: stable sort by score descending, sequential float64 prefix sums.
    std::vector<std::pair<double, int>> c;
    for (int j = 0; j < Tn; ++j)
      if (cand[size_t(b) * Tn + j]) c.push_back({double(dllm::cuda::to_float(scores[size_t(b) * Tn + j])), j});
    std::stable_sort(c.begin(), c.end(), [](auto& x, auto& y) { return x.first > y.first; });
    std::vector<double> cum(c.size());
    double acc = 0.0;
    for (size_t t = 0; t < c.size(); ++t) cum[t] = acc += c[t].first;
    size_t k = c.size();
    if (acc > 0.0) {
      k = 0;
      while (k < c.size() && cum[k] / acc <= p) ++k;
    }
    k = std::min(std::max(k, size_t(min_k)), c.size());
    std::vector<char> want(Tn, 0);
    for (size_t t = 0; t < k; ++t) want[c[t].second] = 1;
    for (int j = 0; j < Tn; ++j)
      if (out[size_t(b) * Tn + j] != want[j]) {
        std::fprintf(stderr, "FAIL %s[%d,%d]: got %d want %d\n", name, b, j, out[size_t(b) * Tn + j], want[j]);
        ++g_failures;
      }
  }
  if (status != 0) {
    std::fprintf(stderr, "FAIL %s: status %d on valid input\n", name, status);
    ++g_failures;
  }
}

static void test_rollout_family() {
  test_rollout_scores<float>("rollout_scores<float>", 3, 2, 5, 17, 3, false);
  test_rollout_scores<__half>("rollout_scores<half>", 2, 2, 1, 9, 2, false);
  test_rollout_scores<__nv_bfloat16>("rollout_scores<bf16>", 2, 1, 33, 40, 0, false);
  test_rollout_scores<float>("rollout_scores<float> Q=T, 2 row chunks", 2, 1, 130, 130, 0, false);
  test_rollout_scores<float>("rollout_scores<float> duplicate", 2, 1, 4, 10, 0, true);
  for (double p : {0.1, 0.5, 1.0}) {
    test_nucleus_select<float>("nucleus_select<float>", 2, 37, p, 1);
    test_nucleus_select<__nv_bfloat16>("nucleus_select<bf16>", 1, 300, p, 0);
  }
  test_nucleus_select<__half>("nucleus_select<half>", 3, 5, 0.3, 4);
}

// ---- family: sparse_kv -----------------------------------------------------

// Index validation: a clean row, then one planted error of each kind.
static void test_validate_indices() {
  struct Case {
    std::vector<int64_t> idx, pos;
    bool unique;
    long long code;
  };
  const int64_t T = 6, P = 10;
  const std::vector<Case> cases = {
      {{0, 5, -1, 2, 3, -7}, {1, 2, 99, 3, 4, 99}, true, dllm::math::kIndexOk},
      {{0, 6, -1, 2, 3, 1}, {1, 2, 3, 3, 4, 5}, true, dllm::math::kIdxOutOfRange},
      {{0, 4, -1, 2, 1, 2}, {1, 2, 3, 3, 4, 5}, true, dllm::math::kIdxDuplicate},
      {{0, 4, -1, 2, 1, 2}, {}, false, dllm::math::kIndexOk},  // gather: repeats are fine
      {{0, 4, -1, 2, 3, 1}, {1, 2, 3, 10, 4, 5}, true, dllm::math::kPositionOutOfRange},
  };
  for (const Case& c : cases) {
    const int64_t B = 2, Q = 3;
    std::vector<int> seen(size_t(B) * T, 0);
    std::vector<long long> err(dllm::cuda::kIndexErrorWords, 0);
    dllm::cuda::launch_validate_indices(
        {.idx = c.idx.data(), .positions = c.pos.empty() ? nullptr : c.pos.data(), .B = B, .Q = Q,
         .T = T, .n_positions = P, .seen = c.unique ? seen.data() : nullptr, .err = err.data()},
        nullptr);
    const long long code = (err[0] & 0xffffffff) ? err[1] : 0;
    if (code != c.code) {
      std::fprintf(stderr, "FAIL validate_indices: code %lld, want %lld\n", code, c.code);
      ++g_failures;
    }
  }
}

// RoPE + scatter on contiguous tensors against a double host loop.
template <typename T>
static void test_rope_scatter_kv(const char* name, int B, int Q, int H, int Hkv, int Tn, int d,
                                 double tol) {
  std::mt19937 rng(B * 131 + Q * 17 + d);
  std::normal_distribution<float> n01;
  const int P = 16, half = d / 2;
  auto fill = [&](size_t n) {
    std::vector<T> v(n);
    for (auto& x : v) x = cast_from_float<T>(n01(rng));
    return v;
  };
  std::vector<T> q = fill(size_t(B) * Q * H * d), k = fill(size_t(B) * Q * Hkv * d),
                 v = fill(size_t(B) * Q * Hkv * d), kc = fill(size_t(B) * Hkv * Tn * d),
                 vc = fill(size_t(B) * Hkv * Tn * d);
  const std::vector<T> q0 = q, kc0 = kc;
  std::vector<float> table(size_t(P) * d);
  for (int p = 0; p < P; ++p)
    for (int i = 0; i < half; ++i) {
      const double a = p * std::pow(10000.0, -2.0 * i / d);
      table[size_t(p) * d + i] = float(std::cos(a));
      table[size_t(p) * d + half + i] = float(std::sin(a));
    }
  std::vector<int64_t> idx(size_t(B) * Q), pos(size_t(B) * Q);
  for (int b = 0; b < B; ++b)
    for (int j = 0; j < Q; ++j) {
      idx[size_t(b) * Q + j] = (j == Q - 1 && b == 0) ? -1 : (j * 3 + b) % Tn;  // distinct: Q*3 <= Tn
      pos[size_t(b) * Q + j] = (j * 5 + 2 * b) % P;
    }
  using dllm::cuda::Strides4;
  const Strides4 qs{int64_t(Q) * H * d, int64_t(H) * d, d, 1}, ks{int64_t(Q) * Hkv * d, int64_t(Hkv) * d, d, 1},
      cs{int64_t(Hkv) * Tn * d, int64_t(Tn) * d, d, 1};
  dllm::cuda::launch_rope_scatter_kv<T>(
      {.q = q.data(), .k = k.data(), .v = v.data(), .positions = pos.data(), .cos_sin = table.data(),
       .k_cache = kc.data(), .v_cache = vc.data(), .idx = idx.data(), .B = B, .Q = Q, .H = H,
       .H_kv = Hkv, .d = d, .q_strides = qs, .k_strides = ks, .v_strides = ks,
       .k_cache_strides = cs, .v_cache_strides = cs, .fault = nullptr},
      nullptr);
  auto f = [](T x) { return double(dllm::cuda::to_float(x)); };
  for (int b = 0; b < B; ++b)
    for (int j = 0; j < Q; ++j) {
      const int64_t slot = idx[size_t(b) * Q + j], p = pos[size_t(b) * Q + j];
      for (int i = 0; i < half; ++i) {
        const double c = table[size_t(p) * d + i], s = table[size_t(p) * d + half + i];
        for (int h = 0; h < H; ++h) {
          const size_t o = ((size_t(b) * Q + j) * H + h) * d;
          const double lo = f(q0[o + i]), hi = f(q0[o + i + half]);
          expect_close(f(q[o + i]), slot < 0 ? lo : lo * c - hi * s, tol, name, int(o + i));
          expect_close(f(q[o + i + half]), slot < 0 ? hi : hi * c + lo * s, tol, name, int(o + i));
        }
        if (slot < 0) continue;
        for (int h = 0; h < Hkv; ++h) {
          const size_t o = ((size_t(b) * Q + j) * Hkv + h) * d, oc = ((size_t(b) * Hkv + h) * Tn + slot) * d;
          const double lo = f(k[o + i]), hi = f(k[o + i + half]);
          expect_close(f(kc[oc + i]), lo * c - hi * s, tol, name, int(oc + i));
          expect_close(f(kc[oc + i + half]), hi * c + lo * s, tol, name, int(oc + i));
          expect_close(f(vc[oc + i]), f(v[o + i]), 0.0, name, int(oc + i));
        }
      }
    }
}

// Attention (+ head-averaged probabilities) against a double host loop; batch
// row 1 has masked keys, batch row 2 (if any) none valid at all. key_splits > 1
// runs split-KV: the workspace starts as NaN, so a partial the combine reads
// but no chunk wrote shows up in out.
template <typename T>
static void test_sparse_attention(const char* name, int B, int Q, int H, int Hkv, int Tn, int d,
                                  double tol, int key_splits = 1) {
  std::mt19937 rng(B * 7 + Q * 13 + H * 3 + Tn + d);
  std::normal_distribution<float> n01;
  auto fill = [&](size_t n) {
    std::vector<T> v(n);
    for (auto& x : v) x = cast_from_float<T>(n01(rng));
    return v;
  };
  const std::vector<T> q = fill(size_t(B) * Q * H * d), kc = fill(size_t(B) * Hkv * Tn * d),
                       vc = fill(size_t(B) * Hkv * Tn * d);
  bool valid[64 * 64];
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < Tn; ++t) valid[b * Tn + t] = b == 0 || (b == 1 ? t % 3 != 1 : false);
  std::vector<T> out(q.size());
  std::vector<float> stats(size_t(B) * Q * H * 2), probs(size_t(B) * Q * Tn, -1.f);
  const float scale = 1.f / std::sqrt(float(d));
  std::vector<float> workspace(
      size_t(dllm::cuda::attention_split_workspace_floats(key_splits, int64_t(B) * Q * H, d)), NAN);
  dllm::cuda::launch_sparse_attention<T>(
      {.q = q.data(), .k_cache = kc.data(), .v_cache = vc.data(), .key_valid = valid,
       .scale = scale, .out = out.data(), .stats = stats.data(), .probs = probs.data(), .B = B,
       .Q = Q, .H = H, .H_kv = Hkv, .T = Tn, .d = d, .key_splits = key_splits,
       .split_workspace = key_splits > 1 ? workspace.data() : nullptr},
      nullptr);
  auto f = [](T x) { return double(dllm::cuda::to_float(x)); };
  const int G = H / Hkv;
  for (int b = 0; b < B; ++b)
    for (int j = 0; j < Q; ++j) {
      std::vector<double> pm(Tn, 0.0);
      for (int h = 0; h < H; ++h) {
        const size_t kb = (size_t(b) * Hkv + h / G) * Tn * d, qo = ((size_t(b) * Q + j) * H + h) * d;
        std::vector<double> s(Tn, -INFINITY);
        double mx = -INFINITY, sum = 0;
        for (int t = 0; t < Tn; ++t) {
          if (!valid[b * Tn + t]) continue;
          double dot = 0;
          for (int i = 0; i < d; ++i) dot += f(q[qo + i]) * f(kc[kb + size_t(t) * d + i]);
          s[t] = dot * scale;
          mx = std::max(mx, s[t]);
        }
        for (int t = 0; t < Tn; ++t) sum += valid[b * Tn + t] ? std::exp(s[t] - mx) : 0.0;
        for (int i = 0; i < d; ++i) {
          double o = 0;
          for (int t = 0; t < Tn; ++t)
            if (valid[b * Tn + t]) o += std::exp(s[t] - mx) / sum * f(vc[kb + size_t(t) * d + i]);
          expect_close(f(out[qo + i]), o, tol, name, int(qo + i));
        }
        for (int t = 0; t < Tn; ++t)
          if (valid[b * Tn + t]) pm[t] += std::exp(s[t] - mx) / sum / H;
      }
      for (int t = 0; t < Tn; ++t)
        expect_close(probs[(size_t(b) * Q + j) * Tn + t], pm[t], 1e-5, name, t);
    }
}

// Row gather / scatter over 4-byte elements with -1 padding and strided x.
static void test_gather_scatter_rows() {
  const int64_t B = 2, Tn = 5, C = 3, Q = 3;
  std::vector<uint32_t> x(size_t(B) * Tn * C * 2);  // x[b, t, c] at stride 2 in c
  for (size_t i = 0; i < x.size(); ++i) x[i] = uint32_t(i * 7 + 1);
  const std::vector<int64_t> idx = {4, -1, 0, 2, 3, 1};
  std::vector<uint32_t> out(size_t(B) * Q * C, 99);
  dllm::cuda::launch_gather_rows<uint32_t>(
      {.x = x.data(), .idx = idx.data(), .out = out.data(), .B = B, .Q = Q, .C = C,
       .x_strides = {Tn * C * 2, C * 2, 2}, .fault = nullptr},
      nullptr);
  std::vector<uint32_t> dst(size_t(B) * Tn * C, 0);
  dllm::cuda::launch_scatter_rows<uint32_t>(
      {.dst = dst.data(), .src = out.data(), .idx = idx.data(), .B = B, .Q = Q, .C = C,
       .dst_strides = {Tn * C, C, 1}, .src_strides = {Q * C, C, 1}, .fault = nullptr},
      nullptr);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < Q; ++j)
      for (int64_t c = 0; c < C; ++c) {
        const int64_t i = idx[b * Q + j];
        const double want = i < 0 ? 0 : x[size_t(b * Tn * C * 2 + i * C * 2 + c * 2)];
        expect_close(out[size_t((b * Q + j) * C + c)], want, 0.0, "gather_rows", int(j));
        if (i >= 0) expect_close(dst[size_t((b * Tn + i) * C + c)], want, 0.0, "scatter_rows", int(j));
      }
  // A fault the validation recorded stops the copy kernels: what keeps bad
  // indices from writing out of bounds when the glue cannot read the record
  // back (CUDA graph capture).
  const std::vector<int64_t> bad = {4, -1, 0, 2, Tn, 1};  // idx[1, 1] = T is out of range
  std::vector<long long> err(dllm::cuda::kIndexErrorWords, 0);
  std::vector<int> seen(size_t(B) * Tn, 0);
  dllm::cuda::launch_validate_indices({.idx = bad.data(), .positions = nullptr, .B = B, .Q = Q,
                                       .T = Tn, .n_positions = 0, .seen = seen.data(),
                                       .err = err.data()},
                                      nullptr);
  expect_close(double((err[0] & 0xffffffff) ? err[1] : 0), dllm::math::kIdxOutOfRange, 0.0,
               "validate_indices fault", 0);
  std::vector<uint32_t> kept_out(out.size(), 99), kept_dst(dst.size(), 7);
  dllm::cuda::launch_gather_rows<uint32_t>(
      {.x = x.data(), .idx = bad.data(), .out = kept_out.data(), .B = B, .Q = Q, .C = C,
       .x_strides = {Tn * C * 2, C * 2, 2}, .fault = err.data()},
      nullptr);
  dllm::cuda::launch_scatter_rows<uint32_t>(
      {.dst = kept_dst.data(), .src = out.data(), .idx = bad.data(), .B = B, .Q = Q, .C = C,
       .dst_strides = {Tn * C, C, 1}, .src_strides = {Q * C, C, 1}, .fault = err.data()},
      nullptr);
  for (size_t n = 0; n < kept_out.size(); ++n) expect_close(kept_out[n], 99, 0.0, "gather_rows fault", int(n));
  for (size_t n = 0; n < kept_dst.size(); ++n) expect_close(kept_dst[n], 7, 0.0, "scatter_rows fault", int(n));
}

// The split-KV combine on its own: hand-made chunk results (a chunk that saw
// no valid key: m = -inf, l = 0; a row where no chunk did) against a double
// log-sum-exp merge, stats included.
static void test_attention_combine() {
  const int rows = 5, splits = 3, d = 40;
  std::mt19937 rng(77);
  std::normal_distribution<float> n01;
  std::uniform_real_distribution<float> u(0.5f, 3.f);
  std::vector<float> acc(size_t(splits) * rows * d), state(size_t(splits) * rows * 2);
  for (auto& x : acc) x = n01(rng);
  for (int s = 0; s < splits; ++s)
    for (int r = 0; r < rows; ++r) {
      const bool empty = r == 4 || (r == 1 && s == 2);
      state[(size_t(s) * rows + r) * 2] = empty ? -INFINITY : 4.f * n01(rng);
      state[(size_t(s) * rows + r) * 2 + 1] = empty ? 0.f : u(rng);
      if (empty) std::fill_n(acc.begin() + (size_t(s) * rows + r) * d, d, 0.f);
    }
  std::vector<float> out(size_t(rows) * d, NAN), stats(size_t(rows) * 2, NAN);
  dllm::cuda::launch_attention_combine<float>(
      {.partial_acc = acc.data(), .partial_state = state.data(), .out = out.data(),
       .stats = stats.data(), .rows = rows, .splits = splits, .d = d},
      nullptr);
  for (int r = 0; r < rows; ++r) {
    double m = -INFINITY, l = 0;
    for (int s = 0; s < splits; ++s) m = std::max(m, double(state[(size_t(s) * rows + r) * 2]));
    const auto w = [&](int s) {
      const double ms = state[(size_t(s) * rows + r) * 2];
      return ms == -INFINITY ? 0.0 : std::exp(ms - m);
    };
    for (int s = 0; s < splits; ++s) l += state[(size_t(s) * rows + r) * 2 + 1] * w(s);
    for (int i = 0; i < d; ++i) {
      double o = 0;
      for (int s = 0; s < splits; ++s) o += acc[(size_t(s) * rows + r) * d + i] * w(s);
      expect_close(out[size_t(r) * d + i], l > 0 ? o / l : 0.0, 1e-6, "attention_combine", r);
    }
    expect_close(stats[size_t(r) * 2 + 1], l, 1e-6, "attention_combine l", r);
    if (l > 0) expect_close(stats[size_t(r) * 2], m, 0.0, "attention_combine m", r);
    else expect_close(stats[size_t(r) * 2] == -INFINITY, 1, 0.0, "attention_combine empty m", r);
  }
}

// The occupancy rule at the shapes dllm_ops/ops.py sparse_attention quotes
// (H200: 132 SMs; LLaDA-8B: H = H_kv = 32, d = 128; Dream-7B: H = 28, H_kv = 4).
// Per-row plans (sparse_attention's counts): one launch of ragged rows (two
// key chunks, none, one) equals launches of each row alone bit for bit, and
// leaves out zero past a row's queries. The workspace starts as NaN and the
// cache holds NaN past each row's keys, so a read beyond either shows.
static void test_sparse_attention_row_plans() {
  const char* name = "sparse_attention row plans";
  constexpr int B = 3, Q = 5, H = 4, Hkv = 2, Tn = 300, d = 32, sms = 132;
  const int qn[B] = {4, 0, 2}, kn[B] = {290, 40, 161};  // row 0: 2 chunks, the last short
  std::mt19937 rng(11);
  std::normal_distribution<float> n01;
  std::vector<float> q(size_t(B) * Q * H * d), kc(size_t(B) * Hkv * Tn * d), vc(kc.size());
  for (auto* v : {&q, &kc, &vc})
    for (auto& x : *v) x = n01(rng);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < Hkv; ++h)
      for (size_t i = (size_t(b * Hkv + h) * Tn + kn[b]) * d; i < size_t(b * Hkv + h + 1) * Tn * d; ++i)
        kc[i] = vc[i] = NAN;
  std::vector<dllm::cuda::RowPlan> plans;
  int most = 1;
  for (int b = 0; b < B; ++b) {
    plans.push_back(dllm::cuda::attention_row_plan(qn[b], H, Hkv, kn[b], d, sms));
    most = std::max(most, plans.back().chunks);
  }
  expect_close(plans[0].chunks, 2, 0.0, name, 0);  // the rows' own splits differ
  expect_close(plans[1].chunks, 0, 0.0, name, 1);
  expect_close(plans[2].chunks, 1, 0.0, name, 2);
  auto attend = [&](const float* qp, const float* kp, const float* vp, int b_rows, int q_rows,
                    int t_keys, int splits, const dllm::cuda::RowPlan* rp, std::vector<float>& out) {
    std::vector<float> ws(
        size_t(dllm::cuda::attention_split_workspace_floats(splits, int64_t(b_rows) * q_rows * H, d)),
        NAN);
    dllm::cuda::launch_sparse_attention<float>(
        {.q = qp, .k_cache = kp, .v_cache = vp, .key_valid = nullptr, .scale = 0.3f,
         .out = out.data(), .stats = nullptr, .probs = nullptr, .B = b_rows, .Q = q_rows, .H = H,
         .H_kv = Hkv, .T = t_keys, .d = d, .key_splits = splits,
         .split_workspace = splits > 1 ? ws.data() : nullptr, .row_plans = rp},
        nullptr);
  };
  std::vector<float> out(q.size(), 0.f);
  attend(q.data(), kc.data(), vc.data(), B, Q, Tn, most, plans.data(), out);
  for (int b = 0; b < B; ++b) {
    const size_t row0 = size_t(b) * Q * H * d;
    std::vector<float> alone(size_t(qn[b]) * H * d, 0.f), k1, v1;
    for (int h = 0; h < Hkv; ++h) {
      const size_t o = size_t(b * Hkv + h) * Tn * d;
      k1.insert(k1.end(), kc.begin() + o, kc.begin() + o + size_t(kn[b]) * d);
      v1.insert(v1.end(), vc.begin() + o, vc.begin() + o + size_t(kn[b]) * d);
    }
    if (qn[b] > 0)
      attend(q.data() + row0, k1.data(), v1.data(), 1, qn[b], kn[b],
             dllm::cuda::attention_key_splits_for(1, qn[b], H, Hkv, kn[b], d, sms), nullptr, alone);
    for (size_t i = 0; i < size_t(Q) * H * d; ++i)
      expect_close(out[row0 + i], i < alone.size() ? alone[i] : 0.0, 0.0, name, int(row0 + i));
  }
}

static void test_split_kv_rule() {
  using dllm::cuda::attention_key_splits_for;
  struct Case {
    int64_t B, Q, H, H_kv, T;
    int sms, want;
  };
  const Case cases[] = {
      {1, 32, 32, 32, 768, 132, 5},   // 64 blocks -> 5 chunks of 160 keys (320 blocks)
      {1, 32, 32, 32, 4096, 132, 5},  // 5 chunks of 832 keys
      {1, 8, 32, 32, 768, 132, 6},    // 32 blocks; 9 wanted, 6 chunks of 128 keys allowed
      {1, 8, 32, 32, 4096, 132, 9},   // 9 chunks of 480 keys (288 blocks)
      {1, 1, 32, 32, 4096, 132, 9},   // Q = 1: the same one row tile per head
      {1, 128, 32, 32, 4096, 132, 2}, // 256 blocks, just under the 264 target
      {1, 768, 32, 32, 768, 132, 1},  // block refresh: 1536 blocks
      {2, 96, 32, 32, 4096, 132, 1},  // 384 blocks
      {1, 32, 28, 4, 768, 132, 5},    // Dream-7B: 4 KV heads x 14 row tiles = 56 blocks
      {1, 32, 32, 32, 200, 132, 1},   // T < 2 x 128 keys: one chunk
      {1, 32, 32, 32, 4096, 0, 1},    // no SMs to fill (the simulator's default)
  };
  for (const Case& c : cases)
    expect_close(attention_key_splits_for(c.B, c.Q, c.H, c.H_kv, c.T, 128, c.sms), c.want, 0.0,
                 "attention_key_splits_for", int(c.Q * 10000 + c.T));
}

static void test_sparse_kv_family() {
  test_validate_indices();
  test_rope_scatter_kv<float>("rope_scatter_kv<float>", 2, 3, 4, 2, 11, 8, 1e-6);
  test_rope_scatter_kv<__nv_bfloat16>("rope_scatter_kv<bf16>", 1, 2, 2, 1, 7, 16, 8e-3);
  test_sparse_attention<float>("sparse_attention<float>", 3, 3, 4, 2, 37, 16, 1e-5);
  test_sparse_attention<float>("sparse_attention<float> GQA7 d=64", 2, 2, 7, 1, 20, 64, 1e-5);
  test_sparse_attention<__half>("sparse_attention<half> d=130", 1, 2, 2, 2, 19, 130, 3e-3);
  // Split-KV, chunks forced (the rule would not split so few keys): 2 chunks
  // of 32 + 5 keys with an all-masked batch row; 4 chunks, the last 4 keys; 4
  // chunks of 16-key tiles (d = 130), the last 2 keys.
  test_sparse_attention<float>("sparse_attention<float> split 2", 3, 3, 4, 2, 37, 16, 1e-5, 2);
  test_sparse_attention<float>("sparse_attention<float> GQA7 split 4", 2, 2, 7, 1, 100, 64, 1e-5, 4);
  test_sparse_attention<__half>("sparse_attention<half> d=130 split 4", 1, 2, 2, 2, 50, 130, 3e-3, 4);
  test_attention_combine();
  test_split_kv_rule();
  test_sparse_attention_row_plans();
  test_gather_scatter_rows();
}

// ---- family: select (selection kernels) ------------------------------------

// token_confidence against a double host loop (the same definitions as
// dllm_ops.reference.token_confidence): ties, -inf entries and suppressed ids.
template <typename T>
static void test_token_confidence(const char* name, int rows, int V, int mode, bool noisy) {
  std::mt19937 rng(rows * 7919 + V * 31 + mode * 3 + noisy);
  std::normal_distribution<float> n01;
  std::uniform_real_distribution<double> u01(1e-12, 1.0);
  std::vector<T> x(size_t(rows) * V);
  std::vector<float> g(noisy ? x.size() : 0);
  for (size_t i = 0; i < x.size(); ++i) x[i] = cast_from_float<T>(3.f * n01(rng));
  for (auto& v : g) v = static_cast<float>(-std::log(-std::log(u01(rng))));
  if (V > 4) {
    // Row 0: the max three times; the lowest index sits in a higher thread
    // than one of the others (id 600: thread 88 of 512; id 130: thread 2 of
    // 128), so the block merge must break the tie by index, not by thread.
    const float top = 40.f;
    x[V - 1] = cast_from_float<T>(top);
    x[std::min(V - 2, V > 2048 ? 600 : 130)] = cast_from_float<T>(top);
    x[std::min(V - 3, V > 2048 ? 100 : 5)] = cast_from_float<T>(top);
    if (rows > 1) x[size_t(V) + 1] = cast_from_float<T>(-INFINITY);  // a -inf logit
  }
  std::vector<int64_t> suppress;  // duplicates and id 0
  if (V > 4) suppress = {int64_t(V / 2), 0, int64_t(V / 2)};
  std::vector<unsigned> bits((V + 31) / 32, 0u);
  int status = 0;
  dllm::cuda::launch_suppress_bits({.ids = suppress.data(), .n = int64_t(suppress.size()), .V = V,
                                    .bits = bits.data(), .status = &status},
                                   nullptr);
  std::vector<int64_t> token(rows, -7);
  std::vector<float> score(rows, -7.f);
  const double temperature = 0.7;
  dllm::cuda::launch_token_confidence<T>(
      {.logits = x.data(), .logits_row_stride = V, .N = rows, .V = V, .mode = mode,
       .temperature = temperature, .noise = noisy ? g.data() : nullptr, .noise_row_stride = V,
       .suppress_bits = bits.data(), .token = token.data(), .score = score.data(),
       .status = &status},
      nullptr);
  if (status != 0) {
    std::fprintf(stderr, "FAIL %s: status %d\n", name, status);
    ++g_failures;
  }
  for (int r = 0; r < rows; ++r) {
    std::vector<double> xs(V);
    for (int i = 0; i < V; ++i) xs[i] = dllm::cuda::to_float(x[size_t(r) * V + i]);
    for (int64_t id : suppress) xs[id] = -INFINITY;
    int i1 = 0;
    for (int i = 1; i < V; ++i)
      if (xs[i] > xs[i1]) i1 = i;
    const double m = xs[i1];
    double rest = 0, v2 = -INFINITY;
    for (int i = 0; i < V; ++i)
      if (i != i1) rest += std::exp(xs[i] - m), v2 = std::max(v2, xs[i]);
    int tok = i1;
    if (noisy) {
      double best = -INFINITY;
      tok = 0;
      for (int i = 0; i < V; ++i) {
        const double y = xs[i] == -INFINITY ? -INFINITY : xs[i] / temperature + g[size_t(r) * V + i];
        if (y > best) best = y, tok = i;
      }
    }
    double want;
    if (mode == dllm::math::kConfProb) {
      want = std::exp(xs[tok] - m) / (1 + rest);
    } else if (mode == dllm::math::kConfMargin) {
      want = -std::expm1(v2 - m) / (1 + rest);
    } else {
      want = 0;
      for (int i = 0; i < V; ++i) {
        if (xs[i] == -INFINITY) continue;
        const double logp = (xs[i] - m) - std::log1p(rest), p = std::exp(logp);
        if (p > 0) want += p * (logp + std::log1p(1e-10 / p));
      }
    }
    if (token[r] != tok) {
      std::fprintf(stderr, "FAIL %s[%d]: token %lld want %d\n", name, r, (long long)token[r], tok);
      ++g_failures;
    }
    expect_close(score[r], want, 2e-6, name, r);
  }
}

// token_confidence_max_prob's pieces: launch_readmit_ids (ascending readmitted
// ids, the subset rule) and the row kernel's max_prob against a double host
// softmax; with nothing readmitted, the bits of the greedy "prob" score.
template <typename T>
static void test_token_confidence_max_prob(const char* name, int rows, int V, int mode) {
  std::mt19937 rng(rows * 31 + V * 7 + mode);
  std::normal_distribution<float> n01;
  std::vector<T> x(size_t(rows) * V);
  for (auto& v : x) v = cast_from_float<T>(3.f * n01(rng));
  x[7] = cast_from_float<T>(30.f);                            // row 0: a readmitted id above m
  if (rows > 1) x[size_t(V) + V - 1] = cast_from_float<T>(-INFINITY);  // row 1: a -inf one
  const std::vector<int64_t> suppress = {int64_t(V / 2), 0, 7, int64_t(V / 2), int64_t(V - 1)};
  const std::vector<int64_t> keep = {0, int64_t(V / 2), 0};
  const size_t words = (V + 31) / 32;
  auto bits_of = [&](const std::vector<int64_t>& ids, int bad, int* status) {
    std::vector<unsigned> bits(words, 0u);
    dllm::cuda::launch_suppress_bits({.ids = ids.data(), .n = int64_t(ids.size()), .V = V,
                                      .bits = bits.data(), .status = status, .bad_id_status = bad},
                                     nullptr);
    return bits;
  };
  int status = 0;
  const auto sbits = bits_of(suppress, dllm::math::kConfBadSuppressId, &status);
  auto run = [&](const std::vector<unsigned>* keep_bits, std::vector<float>* score,
                 std::vector<float>* max_prob, std::vector<int32_t>* readmit) {
    readmit->assign(suppress.size(), -1);
    int32_t count = -1;
    dllm::cuda::launch_readmit_ids({.suppress_bits = sbits.data(),
                                    .keep_bits = keep_bits ? keep_bits->data() : nullptr, .V = V,
                                    .ids = readmit->data(), .count = &count, .status = &status},
                                   nullptr);
    readmit->resize(count);
    std::vector<int64_t> token(rows);
    score->assign(rows, -7.f);
    max_prob->assign(rows, -7.f);
    dllm::cuda::launch_token_confidence<T>(
        {.logits = x.data(), .logits_row_stride = V, .N = rows, .V = V, .mode = mode,
         .temperature = 0.0, .noise = nullptr, .noise_row_stride = 0,
         .suppress_bits = sbits.data(), .token = token.data(), .score = score->data(),
         .status = &status, .readmit_ids = readmit->data(), .readmit_count = &count,
         .max_prob = max_prob->data()},
        nullptr);
  };
  const auto kbits = bits_of(keep, dllm::math::kConfBadMaxProbId, &status);
  std::vector<float> score, max_prob;
  std::vector<int32_t> readmit;
  run(&kbits, &score, &max_prob, &readmit);
  if (status != 0 || readmit != std::vector<int32_t>{7, V - 1}) {
    std::fprintf(stderr, "FAIL %s: status %d, %zu readmitted ids\n", name, status, readmit.size());
    ++g_failures;
  }
  for (int r = 0; r < rows; ++r) {
    std::vector<double> xs(V);
    for (int i = 0; i < V; ++i) xs[i] = dllm::cuda::to_float(x[size_t(r) * V + i]);
    for (int64_t id : keep) xs[id] = -INFINITY;
    const double m = *std::max_element(xs.begin(), xs.end());
    double s = 0;
    for (double v : xs) s += std::exp(v - m);
    expect_close(max_prob[r], 1.0 / s, 1e-6, name, r);
  }
  // Equal sets: nothing readmitted, the bits of the greedy prob score.
  std::vector<float> prob, unused;
  if (mode != dllm::math::kConfProb) {
    std::vector<int64_t> token(rows);
    prob.assign(rows, -7.f);
    dllm::cuda::launch_token_confidence<T>(
        {.logits = x.data(), .logits_row_stride = V, .N = rows, .V = V,
         .mode = dllm::math::kConfProb, .temperature = 0.0, .noise = nullptr,
         .noise_row_stride = 0, .suppress_bits = sbits.data(), .token = token.data(),
         .score = prob.data(), .status = &status},
        nullptr);
  }
  run(&sbits, &score, &max_prob, &readmit);
  if (mode == dllm::math::kConfProb) prob = score;
  for (int r = 0; r < rows; ++r)
    if (std::memcmp(&max_prob[r], &prob[r], sizeof(float)) != 0 || !readmit.empty()) {
      std::fprintf(stderr, "FAIL %s[%d] equal sets: max_prob %.9g, prob score %.9g\n", name, r,
                   max_prob[r], prob[r]);
      ++g_failures;
    }
  // Not a subset: id 3 is not suppressed.
  const auto bad = bits_of({3}, dllm::math::kConfBadMaxProbId, &status);
  run(&bad, &score, &unused, &readmit);
  if (status != dllm::math::kConfMaxProbNotSubset) {
    std::fprintf(stderr, "FAIL %s: subset rule: status %d\n", name, status);
    ++g_failures;
  }
}

// Row b of a selection kernel's bool output against the host's choice; the
// first wrong position is reported.
static void expect_selection(const char* name, int b, const bool* got, const std::vector<char>& want) {
  for (size_t i = 0; i < want.size(); ++i)
    if (got[i] != bool(want[i])) {
      std::fprintf(stderr, "FAIL %s[row %d, pos %zu]: got %d want %d\n", name, b, i, int(got[i]),
                   int(want[i]));
      ++g_failures;
      return;
    }
}

// D(i) of one row of G by the full (unwindowed) double sum: `decoded(j)` the
// row's own positions, `left` / `right` its pads (right already resolved).
template <typename Decoded>
static std::vector<double> host_density(int G, double sigma, bool left, bool right, Decoded decoded) {
  double z = 0;
  for (int dd = -3 * G; dd < 3 * G; ++dd) z += std::exp(-double(dd) * dd / (2 * sigma * sigma));
  std::vector<double> D(G);
  for (int i = 0; i < G; ++i) {
    double acc = 0;
    for (int j = -G; j < 2 * G; ++j)
      if (j < 0 ? left : (j >= G ? right : decoded(j)))
        acc += std::exp(-double(i - j) * (i - j) / (2 * sigma * sigma));
    D[i] = acc / z;
  }
  return D;
}

// select_transfer against a host sort by (score desc, index asc).
template <typename T>
static void test_select_transfer(const char* name, int B, int L, int rule, double factor) {
  std::mt19937 rng(B * 131 + L * 7 + rule);
  std::uniform_real_distribution<float> u01(0.f, 1.f);
  std::vector<T> score(size_t(B) * L);
  std::vector<uint8_t> cand_bytes(size_t(B) * L);
  for (size_t i = 0; i < score.size(); ++i) {
    score[i] = cast_from_float<T>(std::round(u01(rng) * 8.f) / 8.f);  // many ties
    cand_bytes[i] = u01(rng) < 0.6f;
  }
  std::unique_ptr<bool[]> cand(new bool[score.size()]), out(new bool[score.size()]);
  for (size_t i = 0; i < score.size(); ++i) cand[i] = cand_bytes[i];
  std::vector<int64_t> k(B);
  std::vector<int> n(B, 0);
  for (int b = 0; b < B; ++b) {
    for (int i = 0; i < L; ++i) n[b] += cand[size_t(b) * L + i];
    k[b] = n[b] / 3;
  }
  std::vector<int32_t> ranks(score.size());
  int status = 0;
  const double threshold = 0.6;
  dllm::cuda::launch_select_transfer<T>(
      {.score = {score.data(), cand.get(), B, L}, .rule = rule,
       .k = k.data(), .threshold = threshold, .factor = factor, .out = out.get(),
       .rank_scratch = ranks.data(), .status = &status},
      nullptr);
  if (status != 0) {
    std::fprintf(stderr, "FAIL %s: status %d\n", name, status);
    ++g_failures;
  }
  for (int b = 0; b < B; ++b) {
    std::vector<int> order;
    for (int i = 0; i < L; ++i)
      if (cand[size_t(b) * L + i]) order.push_back(i);
    auto s = [&](int i) { return double(dllm::cuda::to_float(score[size_t(b) * L + i])); };
    std::stable_sort(order.begin(), order.end(), [&](int a, int c) { return s(a) > s(c); });
    std::vector<char> want(L, 0);
    int take = 0;
    if (rule == dllm::math::kRuleTopk) take = int(k[b]);
    if (rule == dllm::math::kRuleFactor && !order.empty()) {
      int t = int(order.size());
      for (int r = 0; r < int(order.size()); ++r)
        if (s(order[r]) < (r == 0 ? -1.0 : 1.0 - factor / (r + 2))) {
          t = r;
          break;
        }
      const int N = int(order.size());
      take = t >= N - 1 ? N : (t == 0 ? 1 : t);
    }
    for (int r = 0; r < take; ++r) want[order[r]] = 1;
    if (rule == dllm::math::kRuleThreshold) {
      for (int i : order) want[i] = s(i) >= threshold;
      if (!order.empty()) want[order[0]] = 1;
    }
    expect_selection(name, b, out.get() + size_t(b) * L, want);
  }
}

// certainty_density against the full (unwindowed) double sum.
static void test_certainty_density(const char* name, int B, int G, double sigma, bool left,
                                   bool right) {
  std::mt19937 rng(B * 17 + G);
  std::unique_ptr<bool[]> d(new bool[size_t(B) * G]);
  for (int i = 0; i < B * G; ++i) d[i] = rng() % 2;
  std::vector<float> out(size_t(B) * G, -1.f);
  dllm::cuda::launch_certainty_density({.decoded = d.get(), .B = B, .G = G, .sigma = sigma,
                                        .left_known = left, .right_known = right,
                                        .out = out.data()},
                                       nullptr);
  for (int b = 0; b < B; ++b) {
    const bool* row = d.get() + size_t(b) * G;
    const std::vector<double> want =
        host_density(G, sigma, left, right || row[G - 1], [row](int j) { return row[j]; });
    for (int i = 0; i < G; ++i)
      if (!(std::fabs(out[size_t(b) * G + i] - want[i]) <= 1e-6)) {
        std::fprintf(stderr, "FAIL %s[%d,%d]: got %.9g want %.9g\n", name, b, i,
                     out[size_t(b) * G + i], want[i]);
        ++g_failures;
      }
  }
}

// certainty_select against a host sort of the window's masks by (outside the
// block, score desc, index asc), D from the full double sum; then a negative
// confidence at a mask must raise the status bit.
static void check_certainty_select(const char* name, int B, int G, std::unique_ptr<bool[]>& masked,
                                   std::vector<float>& conf, int b0, int b1, int L, int k,
                                   double sigma) {
  std::unique_ptr<bool[]> out(new bool[size_t(B) * G]);
  std::vector<float> score(size_t(B) * G);
  int status = 0;
  auto run = [&] {
    dllm::cuda::launch_certainty_select(
        {.masked = masked.get(), .m_ld = G, .conf = conf.data(), .c_ld = G, .B = B, .G = G,
         .b0 = b0, .b1 = b1, .L = L, .k = k, .sigma = sigma, .score = score.data(),
         .out = out.get(), .status = &status},
        nullptr);
  };
  run();
  if (status != 0) {
    std::fprintf(stderr, "FAIL %s: status %d\n", name, status);
    ++g_failures;
  }
  for (int b = 0; b < B; ++b) {
    const bool* m = masked.get() + size_t(b) * G;
    const std::vector<double> D = host_density(G, sigma, true, !m[G - 1], [m](int j) { return !m[j]; });
    std::vector<float> sc(G);
    std::vector<int> masks;
    for (int i = 0; i < G; ++i) {
      sc[i] = conf[size_t(b) * G + i] * float(D[i]);
      if (m[i]) masks.push_back(i);
    }
    const int kth = int(masks.size()) >= k ? masks[k - 1] : G - 1;
    const int end = (kth / L + 1) * L;
    std::vector<int> window;
    for (int i : masks)
      if (i >= b0 && i < end) window.push_back(i);
    std::stable_sort(window.begin(), window.end(), [&](int a, int c) {
      if ((a >= b1) != (c >= b1)) return a < b1;
      return sc[a] > sc[c];
    });
    std::vector<char> want(G, 0);
    for (int r = 0; r < std::min(k, int(window.size())); ++r) want[window[r]] = 1;
    expect_selection(name, b, out.get() + size_t(b) * G, want);
  }
  for (int i = 0; i < G; ++i)
    if (masked[i]) {
      const float keep = conf[i];
      conf[i] = -1.f;
      run();
      conf[i] = keep;
      if (status != dllm::math::kCertaintyBadConfidence) {
        std::fprintf(stderr, "FAIL %s: a negative confidence gave status %d\n", name, status);
        ++g_failures;
      }
      break;
    }
}

// Random rows decoded before the block (as a decode's are), 70% masked after.
static void test_certainty_select(const char* name, int B, int G, int b0, int b1, int L, int k,
                                  double sigma) {
  std::mt19937 rng(B * 29 + G * 3 + k);
  std::uniform_real_distribution<float> u01(0.f, 1.f);
  std::unique_ptr<bool[]> masked(new bool[size_t(B) * G]);
  std::vector<float> conf(size_t(B) * G);
  for (int i = 0; i < B * G; ++i) {
    masked[i] = i % G >= b0 && u01(rng) < 0.7f;
    conf[i] = std::round(u01(rng) * 6.f) / 6.f;  // ties in the confidence
  }
  check_certainty_select(name, B, G, masked, conf, b0, b1, L, k, sigma);
}

// Two hand-made rows (blocks of 16, the block [16, 32), k 7) where the rules
// decide: row 0's window [16, 48) holds 8 masks, its 5 in-block ones the least
// confident (in-block first keeps them); row 1's 7th mask is the last of
// block [32, 48) and the 8th opens [48, 64), whose masks are the most
// confident (the window ends with the k-th mask's block).
static void test_certainty_select_rules() {
  const int G = 80;
  std::unique_ptr<bool[]> masked(new bool[2 * G]());
  std::vector<float> conf(2 * G, 0.f);
  auto mask = [&](int row, std::initializer_list<int> cols, float c) {
    for (int i : cols) masked[size_t(row) * G + i] = true, conf[size_t(row) * G + i] = c;
  };
  mask(0, {17, 20, 25, 30, 31}, 0.1f);
  mask(0, {33, 40, 47}, 0.8f);
  mask(0, {50, 55, 60}, 0.99f);
  mask(1, {17, 20, 25, 30, 31}, 0.1f);
  mask(1, {33, 47}, 0.5f);
  mask(1, {50, 55, 60}, 0.99f);
  check_certainty_select("certainty_select rules", 2, G, masked, conf, 16, 32, 16, 7, 10.0);
}

// drift_select(_threshold) against a host sort by (drift asc, index asc).
template <typename T>
static void test_drift_select(const char* name, int B, int Tn, bool by_fraction, double param,
                              int max_recompute) {
  std::mt19937 rng(B * 101 + Tn + by_fraction);
  std::uniform_real_distribution<float> u01(0.f, 1.f);
  std::vector<T> drift(size_t(B) * Tn);
  std::unique_ptr<bool[]> region(new bool[drift.size()]), reuse(new bool[drift.size()]);
  for (size_t i = 0; i < drift.size(); ++i) {
    drift[i] = cast_from_float<T>(std::round(u01(rng) * 6.f) / 6.f);
    region[i] = u01(rng) < 0.8f;
  }
  std::vector<int32_t> idx(size_t(B) * max_recompute, -7), count(B, -7);
  int status = 0;
  dllm::cuda::launch_drift_select<T>(
      {.drift = {drift.data(), region.get(), B, Tn}, .by_fraction = by_fraction, .param = param,
       .max_recompute = max_recompute,
       .reuse = reuse.get(), .recompute_idx = idx.data(), .count = count.data(),
       .status = &status},
      nullptr);
  for (int b = 0; b < B; ++b) {
    auto d = [&](int i) { return double(dllm::cuda::to_float(drift[size_t(b) * Tn + i])); };
    std::vector<int> order;
    for (int i = 0; i < Tn; ++i)
      if (region[size_t(b) * Tn + i]) order.push_back(i);
    std::stable_sort(order.begin(), order.end(), [&](int a, int c) { return d(a) < d(c); });
    std::vector<char> want_reuse(Tn, 0);
    if (by_fraction) {
      const int keep = int(std::floor(param * double(order.size())));
      for (int r = 0; r < keep; ++r) want_reuse[order[r]] = 1;
    } else {
      for (int i : order) want_reuse[i] = !(d(i) >= param);
    }
    std::vector<int32_t> want_idx;
    for (int i = 0; i < Tn; ++i)
      if (region[size_t(b) * Tn + i] && !want_reuse[i]) want_idx.push_back(i);
    bool ok = count[b] == int32_t(want_idx.size());
    for (int i = 0; i < Tn; ++i) ok = ok && reuse[size_t(b) * Tn + i] == bool(want_reuse[i]);
    for (int p = 0; p < max_recompute; ++p)
      ok = ok && idx[size_t(b) * max_recompute + p] == (p < int(want_idx.size()) ? want_idx[p] : -1);
    if (!ok) {
      std::fprintf(stderr, "FAIL %s[row %d]\n", name, b);
      ++g_failures;
    }
    if ((count[b] > max_recompute) != bool(status & 2)) {
      std::fprintf(stderr, "FAIL %s[row %d]: overflow status %d\n", name, b, status);
      ++g_failures;
    }
  }
}

static void test_select_family() {
  using namespace dllm::math;
  for (int mode : {kConfProb, kConfMargin, kConfNegEntropy}) {
    test_token_confidence<float>("token_confidence<float>", 3, 1000, mode, false);
    test_token_confidence<__nv_bfloat16>("token_confidence<bf16> V=4099", 2, 4099, mode, false);
    test_token_confidence<__half>("token_confidence<half> noisy", 2, 333, mode, true);
  }
  test_token_confidence<float>("token_confidence<float> V=1", 2, 1, kConfMargin, false);
  for (int mode : {kConfProb, kConfMargin, kConfNegEntropy}) {
    test_token_confidence_max_prob<float>("token_confidence_max_prob<float>", 3, 1000, mode);
    test_token_confidence_max_prob<__nv_bfloat16>("token_confidence_max_prob<bf16> V=4099", 2,
                                                  4099, mode);
  }
  for (int rule : {kRuleTopk, kRuleThreshold, kRuleFactor}) {
    test_select_transfer<float>("select_transfer<float>", 3, 77, rule, 1.0);
    test_select_transfer<__nv_bfloat16>("select_transfer<bf16> L=1500", 2, 1500, rule, 0.5);
  }
  test_certainty_density("certainty_density sigma=10", 2, 70, 10.0, true, false);
  test_certainty_density("certainty_density sigma=0.7 right", 2, 33, 0.7, false, true);
  test_certainty_density("certainty_density sigma=1e3", 1, 40, 1e3, true, false);
  test_certainty_select("certainty_select one block of 64", 2, 64, 0, 64, 64, 32, 10.0);
  test_certainty_select("certainty_select block mid-region", 3, 70, 16, 32, 16, 9, 10.0);
  test_certainty_select("certainty_select few masks G=300", 2, 300, 40, 60, 20, 250, 37.5);
  test_certainty_select("certainty_select empty block", 1, 45, 20, 20, 10, 7, 5.0);
  test_certainty_select("certainty_select window past the block", 3, 96, 32, 48, 16, 14, 10.0);
  test_certainty_select_rules();
  test_drift_select<float>("drift_select<float>", 3, 90, true, 0.6, 90);
  test_drift_select<__half>("drift_select<half> T=1300", 1, 1300, true, 0.87, 1300);
  test_drift_select<float>("drift_select_threshold<float>", 3, 90, false, 0.5, 90);
  test_drift_select<__nv_bfloat16>("drift_select<bf16> overflow", 2, 50, true, 0.1, 5);
}

// ---- family: quant ---------------------------------------------------------

// Host model of one K/V group: stored scale / min in T from the fp32 range,
// codes from the stored values (round half to even via nearbyint in double of
// the fp32 quotient).
template <typename T>
struct HostGroupQuant {
  T scale, mn;
  float sf, mf;
};

template <typename T>
static HostGroupQuant<T> host_group_quant(const std::vector<float>& vals, int bits) {
  float lo = INFINITY, hi = -INFINITY;
  for (float v : vals) lo = std::min(lo, v), hi = std::max(hi, v);
  if (vals.empty()) lo = hi = 0.f;
  HostGroupQuant<T> q;
  q.scale = cast_from_float<T>((hi - lo) / float((1 << bits) - 1));
  q.mn = cast_from_float<T>(lo);
  q.sf = dllm::cuda::to_float(q.scale);
  q.mf = dllm::cuda::to_float(q.mn);
  return q;
}

static int host_code(float x, float sf, float mf, int bits) {
  if (!(sf > 0.f)) return 0;
  const double r = std::nearbyint(double((x - mf) / sf));
  return int(std::min(std::max(r, 0.0), double((1 << bits) - 1)));
}

// quantize_k (protect_p = 2, a 5-token last group), dequantize_k, k_quant_error
// and quant_attention over the packed cache (GQA 2, masked keys) against host
// loops; then a corrupt prot_idx must raise the status bit.
template <typename T>
static void test_quant_family(const char* name, int bits, double attn_tol) {
  using dllm::cuda::to_float;
  namespace q = dllm::cuda::quant;
  const int B = 1, H = 2, Tn = 37, d = 16, G = 8, p = 2, n = 8 / bits, Hq = 4, Q = 3;
  const int n_groups = int(dllm::math::packed_k_groups(Tn, G));
  const int64_t rows = dllm::math::packed_k_rows(Tn, G, bits);
  const q::CacheDims dims{.B = B, .H = H, .T = Tn, .d = d};
  std::mt19937 rng(bits * 101 + d);
  std::normal_distribution<float> n01;
  std::vector<T> k(size_t(B) * H * Tn * d), v(k.size()), qv(size_t(B) * Q * Hq * d);
  for (auto& x : k) x = cast_from_float<T>(n01(rng) * 2.f);
  for (auto& x : v) x = cast_from_float<T>(n01(rng));
  for (auto& x : qv) x = cast_from_float<T>(n01(rng));
  std::vector<float> imp(size_t(B) * H * Tn);
  for (auto& x : imp) x = float(rng() % 5);  // ties resolved by the lower index
  std::vector<uint8_t> codes(size_t(B) * H * rows * d, 0xAB), pidx(size_t(B) * H * n_groups * p);
  std::vector<T> scale(size_t(B) * H * n_groups * d), mn(scale.size()),
      pval(size_t(B) * H * n_groups * p * d);
  int status = 0;
  q::launch_quantize_k<T>(
      {.k = k.data(), .importance = imp.data(), .importance_per_head = true,
       .out = {codes.data(), scale.data(), mn.data(), pidx.data(), pval.data(), bits, G, p,
               n_groups, rows},
       .status = &status, .dims = dims},
      nullptr);
  expect_close(status, 0, 0.0, name, 0);
  for (int h = 0; h < H; ++h)
    for (int g = 0; g < n_groups; ++g) {
      const int n_real = std::min(G, Tn - g * G);
      // Host top-p: importance descending, ties to the lower index.
      std::vector<int> order(n_real);
      for (int j = 0; j < n_real; ++j) order[j] = j;
      const float* ig = imp.data() + size_t(h) * Tn + g * G;
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return ig[a] > ig[b]; });
      const size_t u = size_t(h) * n_groups + g;
      std::vector<bool> prot(G, false);
      for (int s = 0; s < p; ++s) {
        const int want = s < n_real ? order[s] : 255;
        expect_close(pidx[u * p + s], want, 0.0, name, int(u * p + s));
        if (s < n_real) prot[order[s]] = true;
      }
      for (int c = 0; c < d; ++c) {
        std::vector<float> vals;
        for (int j = 0; j < n_real; ++j)
          if (!prot[j]) vals.push_back(to_float(k[(size_t(h) * Tn + g * G + j) * d + c]));
        const auto hq = host_group_quant<T>(vals, bits);
        expect_close(to_float(scale[u * d + c]), hq.sf, 0.0, name, int(u * d + c));
        expect_close(to_float(mn[u * d + c]), hq.mf, 0.0, name, int(u * d + c));
        for (int j = 0; j < G; ++j) {
          const int t = g * G + j;
          const int code = (codes[(size_t(h) * rows + t / n) * d + c] >> (bits * (t % n))) & ((1 << bits) - 1);
          const int want =
              (j < n_real && !prot[j]) ? host_code(to_float(k[(size_t(h) * Tn + t) * d + c]), hq.sf, hq.mf, bits) : 0;
          expect_close(code, want, 0.0, name, t);
        }
      }
    }
  // dequantize_k: protected tokens exact, the rest within half a step.
  const q::PackedK<T> pk{codes.data(), scale.data(), mn.data(), pidx.data(), pval.data(), bits, G, p,
                         n_groups, rows};
  std::vector<T> kd(k.size());
  q::launch_dequantize_k<T>({.packed = pk, .out = kd.data(), .status = &status, .dims = dims},
                            nullptr);
  expect_close(status, 0, 0.0, name, 1);
  for (size_t i = 0; i < k.size(); ++i) {
    const size_t t = (i / d) % Tn, hh = i / (size_t(d) * Tn), c = i % d;
    const double step = to_float(scale[(hh * n_groups + t / G) * d + c]);
    const double err = std::fabs(double(to_float(kd[i])) - to_float(k[i]));
    if (!(err <= step / 2 + 1e-2 * std::fabs(to_float(k[i])) + 1e-6)) {
      std::fprintf(stderr, "FAIL %s dequantize_k[%zu]: err %g, step %g\n", name, i, err, step);
      ++g_failures;
    }
  }
  // k_quant_error: squared error of the p = 0 round trip.
  std::vector<uint8_t> codes0(codes.size()), pidx0;
  std::vector<T> scale0(scale.size()), mn0(mn.size()), pval0, kd0(k.size());
  q::launch_quantize_k<T>(
      {.k = k.data(), .importance = nullptr, .importance_per_head = false,
       .out = {codes0.data(), scale0.data(), mn0.data(), pidx0.data(), pval0.data(), bits, G, 0,
               n_groups, rows},
       .status = &status, .dims = dims},
      nullptr);
  const q::PackedK<T> pk0{codes0.data(), scale0.data(), mn0.data(), pidx0.data(), pval0.data(), bits, G, 0,
                          n_groups, rows};
  q::launch_dequantize_k<T>({.packed = pk0, .out = kd0.data(), .status = &status, .dims = dims},
                            nullptr);
  std::vector<float> err(size_t(B) * H * Tn, -1.f);
  q::launch_k_quant_error<T>(
      {.k = k.data(), .err = err.data(), .status = &status, .dims = dims, .G = G, .bits = bits},
      nullptr);
  for (size_t r = 0; r < err.size(); ++r) {
    double e = 0;
    for (int c = 0; c < d; ++c) {
      const double diff = double(to_float(k[r * d + c])) - to_float(kd0[r * d + c]);
      e += diff * diff;
    }
    expect_close(err[r], e, 1e-5, name, int(r));
  }
  // quantize_v (groups of 8 channels) + dequantize_v.
  const int Gv = 8, ngv = int(dllm::math::packed_v_groups(d, Gv));
  const int rb = int(dllm::math::packed_v_row_bytes(d, bits));
  std::vector<uint8_t> vcodes(size_t(B) * H * Tn * rb);
  std::vector<T> vscale(size_t(B) * H * Tn * ngv), vmn(vscale.size()), vd(v.size());
  q::launch_quantize_v<T>({.v = v.data(),
                           .out = {vcodes.data(), vscale.data(), vmn.data(), bits, Gv, ngv, rb},
                           .status = &status, .n_rows = int64_t(B) * H * Tn, .d = d},
                          nullptr);
  expect_close(status, 0, 0.0, name, 2);
  for (int r = 0; r < B * H * Tn; ++r)
    for (int gv = 0; gv < ngv; ++gv) {
      std::vector<float> vals;
      for (int c = 0; c < Gv; ++c) vals.push_back(to_float(v[size_t(r) * d + gv * Gv + c]));
      const auto hq = host_group_quant<T>(vals, bits);
      expect_close(to_float(vscale[size_t(r) * ngv + gv]), hq.sf, 0.0, name, r);
      for (int c = gv * Gv; c < gv * Gv + Gv; ++c) {
        const int code = (vcodes[size_t(r) * rb + c / n] >> (bits * (c % n))) & ((1 << bits) - 1);
        expect_close(code, host_code(to_float(v[size_t(r) * d + c]), hq.sf, hq.mf, bits), 0.0, name, c);
      }
    }
  const q::PackedV<T> pvv{vcodes.data(), vscale.data(), vmn.data(), bits, Gv, ngv, rb};
  q::launch_dequantize_v<T>({.packed = pvv, .out = vd.data(), .n_rows = int64_t(B) * H * Tn, .d = d},
                            nullptr);
  // quant_attention against a double host loop over the dequantized caches:
  // one pass, and split-KV into 2 chunks (32 + 5 keys; the chunks forced).
  bool valid[64];
  for (int t = 0; t < Tn; ++t) valid[t] = t % 4 != 1;
  std::vector<T> out(qv.size());
  const float sc = 1.f / std::sqrt(float(d));
  std::vector<float> workspace(
      size_t(dllm::cuda::attention_split_workspace_floats(2, int64_t(B) * Q * Hq, d)), NAN);
  const q::QuantAttentionParams<T> attn{.q = qv.data(), .k = pk, .v = pvv, .key_valid = valid,
                                         .scale = sc, .out = out.data(), .status = &status,
                                         .B = B, .Q = Q, .H = Hq, .H_kv = H, .T = Tn, .d = d,
                                         .key_splits = 1, .split_workspace = nullptr};
  const q::QuantAttentionParams<T> split_attn = [&] {
    q::QuantAttentionParams<T> p2 = attn;
    p2.key_splits = 2;
    p2.split_workspace = workspace.data();
    return p2;
  }();
  for (const auto* run : {&attn, &split_attn}) {
    std::fill(out.begin(), out.end(), cast_from_float<T>(NAN));
    q::launch_quant_attention(*run, nullptr);
    expect_close(status, 0, 0.0, name, 3);
    for (int j = 0; j < Q; ++j)
      for (int hq = 0; hq < Hq; ++hq) {
        const int h = hq / (Hq / H);
        std::vector<double> s(Tn, 0.0);
        double mx = -INFINITY, sum = 0.0;
        for (int t = 0; t < Tn; ++t) {
          if (!valid[t]) continue;
          double dot = 0;
          for (int c = 0; c < d; ++c)
            dot += double(to_float(qv[(size_t(j) * Hq + hq) * d + c])) * to_float(kd[(size_t(h) * Tn + t) * d + c]);
          s[t] = dot * sc;
          mx = std::max(mx, s[t]);
        }
        for (int t = 0; t < Tn; ++t) sum += valid[t] ? std::exp(s[t] - mx) : 0.0;
        for (int c = 0; c < d; ++c) {
          double o = 0;
          for (int t = 0; t < Tn; ++t)
            if (valid[t]) o += std::exp(s[t] - mx) / sum * to_float(vd[(size_t(h) * Tn + t) * d + c]);
          expect_close(to_float(out[(size_t(j) * Hq + hq) * d + c]), o, attn_tol, name, c);
        }
      }
  }
  // two_source_attention: the same packed cache (Tp = 37 keys, mask above)
  // followed by Tf = 6 full-precision keys (key Tp + 2 masked), with the
  // head-averaged probabilities, against a double host loop over the
  // concatenation; one pass, and split-KV into 2 chunks (32 + 11 keys: the
  // second straddles the two sources).
  const int Tf = 6, Tt = Tn + Tf;
  std::vector<T> kf(size_t(B) * H * Tf * d), vf(kf.size());
  for (auto& x : kf) x = cast_from_float<T>(n01(rng) * 2.f);
  for (auto& x : vf) x = cast_from_float<T>(n01(rng));
  bool fvalid[Tf];
  for (int t = 0; t < Tf; ++t) fvalid[t] = t != 2;
  auto key_at = [&](int h, int t, int c) {
    return t < Tn ? double(to_float(kd[(size_t(h) * Tn + t) * d + c]))
                  : double(to_float(kf[(size_t(h) * Tf + t - Tn) * d + c]));
  };
  auto value_at = [&](int h, int t, int c) {
    return t < Tn ? double(to_float(vd[(size_t(h) * Tn + t) * d + c]))
                  : double(to_float(vf[(size_t(h) * Tf + t - Tn) * d + c]));
  };
  auto valid_at = [&](int t) { return t < Tn ? valid[t] : fvalid[t - Tn]; };
  std::vector<float> stats(size_t(B) * Q * Hq * 2), probs(size_t(B) * Q * Tt);
  std::vector<float> workspace2(
      size_t(dllm::cuda::attention_split_workspace_floats(2, int64_t(B) * Q * Hq, d)), NAN);
  const q::TwoSourceAttentionParams<T> two{
      .q = qv.data(), .k = pk, .v = pvv, .packed_valid = valid,
      .full = {.k = kf.data(), .v = vf.data(), .valid = fvalid, .Tf = Tf}, .scale = sc,
      .out = out.data(), .stats = stats.data(), .probs = probs.data(), .status = &status,
      .B = B, .Q = Q, .H = Hq, .H_kv = H, .Tp = Tn, .d = d, .key_splits = 1,
      .split_workspace = nullptr};
  const q::TwoSourceAttentionParams<T> split_two = [&] {
    q::TwoSourceAttentionParams<T> p2 = two;
    p2.key_splits = 2;
    p2.split_workspace = workspace2.data();
    return p2;
  }();
  for (const auto* run : {&two, &split_two}) {
    std::fill(out.begin(), out.end(), cast_from_float<T>(NAN));
    std::fill(probs.begin(), probs.end(), NAN);
    q::launch_two_source_attention(*run, nullptr);
    expect_close(status, 0, 0.0, name, 6);
    std::vector<double> pm(size_t(Q) * Tt, 0.0);
    for (int j = 0; j < Q; ++j)
      for (int hq = 0; hq < Hq; ++hq) {
        const int h = hq / (Hq / H);
        std::vector<double> s(Tt, 0.0);
        double mx = -INFINITY, sum = 0.0;
        for (int t = 0; t < Tt; ++t) {
          if (!valid_at(t)) continue;
          double dot = 0;
          for (int c = 0; c < d; ++c)
            dot += double(to_float(qv[(size_t(j) * Hq + hq) * d + c])) * key_at(h, t, c);
          s[t] = dot * sc;
          mx = std::max(mx, s[t]);
        }
        for (int t = 0; t < Tt; ++t) sum += valid_at(t) ? std::exp(s[t] - mx) : 0.0;
        for (int t = 0; t < Tt; ++t)
          if (valid_at(t)) pm[size_t(j) * Tt + t] += std::exp(s[t] - mx) / sum / Hq;
        for (int c = 0; c < d; ++c) {
          double o = 0;
          for (int t = 0; t < Tt; ++t)
            if (valid_at(t)) o += std::exp(s[t] - mx) / sum * value_at(h, t, c);
          expect_close(to_float(out[(size_t(j) * Hq + hq) * d + c]), o, attn_tol, name, c);
        }
      }
    for (size_t i = 0; i < pm.size(); ++i) expect_close(probs[i], pm[i], 1e-5, name, int(i));
  }
  // A prot_idx entry past the last group's 5 real tokens is reported.
  pidx[(size_t(1) * n_groups + n_groups - 1) * p] = 6;
  status = 0;
  q::launch_dequantize_k<T>({.packed = pk, .out = kd.data(), .status = &status, .dims = dims},
                            nullptr);
  expect_close(status, dllm::math::kQuantBadProtIdx, 0.0, name, 4);
  for (const auto* run : {&attn, &split_attn}) {
    status = 0;
    q::launch_quant_attention(*run, nullptr);
    expect_close(status, dllm::math::kQuantBadProtIdx, 0.0, name, 5);
  }
  for (const auto* run : {&two, &split_two}) {
    status = 0;
    q::launch_two_source_attention(*run, nullptr);
    expect_close(status, dllm::math::kQuantBadProtIdx, 0.0, name, 7);
  }
}

static void test_quant_family_all() {
  test_quant_family<float>("quant<float> 4-bit", 4, 1e-5);
  test_quant_family<__nv_bfloat16>("quant<bf16> 2-bit", 2, 2e-2);
  test_quant_family<__half>("quant<half> 4-bit", 4, 5e-3);
}

// ---- family: layer ---------------------------------------------------------

// T(v): v rounded to the element type and back, as the kernels store.
template <typename T>
static double rounded(double v) {
  return dllm::cuda::to_float(cast_from_float<T>(static_cast<float>(v)));
}

// add_rms_norm_ against a host loop in double: the residual update bit for
// bit, the normed rows within `tol` (the fp32 sum's error, then the
// roundings of the element type). `scale` multiplies the inputs: small rows
// make eps matter, large fp16 rows overflow a sum of squares kept in fp16.
template <typename T>
static void test_add_rms_norm(const char* name, int rows, int C, float eps, double tol,
                              float scale = 1.f) {
  using dllm::cuda::to_float;
  std::mt19937 rng(rows * 97 + C);
  std::normal_distribution<float> n01;
  std::vector<T> x(size_t(rows) * C), res(size_t(rows) * C), w(C);
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = cast_from_float<T>(scale * n01(rng));
    res[i] = cast_from_float<T>(3.f * scale * n01(rng));
  }
  for (int c = 0; c < C; ++c) w[c] = cast_from_float<T>(1.f + 0.25f * n01(rng));
  if (rows > 1)  // a zero row: normed to exact zeros (eps > 0)
    for (int c = 0; c < C; ++c) x[c] = res[c] = cast_from_float<T>(0.f);
  const std::vector<T> x0 = x, r0 = res;
  dllm::cuda::launch_add_rms_norm<T>(
      {.x = x.data(), .residual = res.data(), .weight = w.data(), .rows = rows, .C = C, .eps = eps},
      nullptr);
  for (int r = 0; r < rows; ++r) {
    double ss = 0.0;
    std::vector<double> rv(C);
    for (int c = 0; c < C; ++c) {
      const size_t i = size_t(r) * C + c;
      rv[c] = rounded<T>(double(to_float(r0[i])) + double(to_float(x0[i])));
      if (double(to_float(res[i])) != rv[c]) {
        std::fprintf(stderr, "FAIL %s residual[%d,%d]: got %.9g want %.9g\n", name, r, c,
                     double(to_float(res[i])), rv[c]);
        ++g_failures;
      }
      ss += rv[c] * rv[c];
    }
    const double inv = 1.0 / std::sqrt(ss / C + eps);
    for (int c = 0; c < C; ++c) {
      const double want = rounded<T>(rounded<T>(rv[c] * inv) * double(to_float(w[c])));
      expect_close(to_float(x[size_t(r) * C + c]), want, tol, name, r * C + c);
    }
  }
}

// silu_mul against a host loop in double, gate and up as strided rows.
template <typename T>
static void test_silu_mul(const char* name, int rows, int I, double tol) {
  using dllm::cuda::to_float;
  std::mt19937 rng(rows * 89 + I);
  std::normal_distribution<float> n01;
  const int64_t stride = 2 * I + 3;  // rows of a wider tensor: gate | up | pad
  std::vector<T> buf(size_t(rows) * stride), out(size_t(rows) * I);
  for (auto& v : buf) v = cast_from_float<T>(4.f * n01(rng));
  if (I > 2) buf[0] = cast_from_float<T>(-100.f), buf[1] = cast_from_float<T>(100.f);
  dllm::cuda::launch_silu_mul<T>({.gate = buf.data(), .up = buf.data() + I, .out = out.data(),
                                  .rows = rows, .I = I, .gate_stride = stride, .up_stride = stride},
                                 nullptr);
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < I; ++i) {
      const double g = to_float(buf[size_t(r) * stride + i]);
      const double u = to_float(buf[size_t(r) * stride + I + i]);
      const double want = rounded<T>(rounded<T>(g / (1.0 + std::exp(-g))) * u);
      expect_close(to_float(out[size_t(r) * I + i]), want, tol, name, r * I + i);
    }
}

static void test_layer_family() {
  for (int C : {1, 7, 128, 1000, 1027}) {
    test_add_rms_norm<float>("add_rms_norm_<float>", 3, C, 1e-6f, 5e-6);
    test_add_rms_norm<__nv_bfloat16>("add_rms_norm_<bf16>", 2, C, 1e-5f, 1e-2);
    test_add_rms_norm<__half>("add_rms_norm_<half>", 2, C, 1e-5f, 2e-3);
    test_add_rms_norm<float>("add_rms_norm_<float> small rows", 2, C, 1e-5f, 5e-6, 1e-3f);
    test_add_rms_norm<__half>("add_rms_norm_<half> large rows", 2, C, 1e-5f, 2e-3, 30.f);
  }
  for (int I : {1, 5, 128, 2819}) {
    test_silu_mul<float>("silu_mul<float>", 3, I, 1e-6);
    test_silu_mul<__nv_bfloat16>("silu_mul<bf16>", 2, I, 1e-2);
    test_silu_mul<__half>("silu_mul<half>", 2, I, 2e-3);
  }
}

int main() {
  test_layer_family();
  test_sparse_kv_family();
  test_quant_family_all();
  test_rollout_family();
  test_select_family();
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
