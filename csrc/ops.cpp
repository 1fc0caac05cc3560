// The one place where every dllm op schema is defined. Kernels register their
// implementations from csrc/cpu/<family>.cpp (CPU) and csrc/cuda/<family>.cu
// (CUDA); a CPU-only build simply does not compile the .cu files.
#include <Python.h>
#include <torch/library.h>

// `import dllm_ops._C` only needs to run the static registrars below; the
// module itself exposes nothing (no pybind11, so the ABI stays small).
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}

// Defaults equal the typed wrappers' in dllm_ops/ops.py (python_tests/test_schemas.py
// compares them), so torch.ops.dllm.<op> takes the same optional arguments.
TORCH_LIBRARY(dllm, m) {
  // ---- family: select -------------------------------------------------------
  m.def("cosine_drift(Tensor x, Tensor x_prev) -> Tensor");
  m.def("token_confidence(Tensor logits, str mode=\"prob\", float temperature=0.0, "
        "Tensor? suppress=None, Tensor? noise=None) -> (Tensor token, Tensor score)");
  m.def("token_confidence_max_prob(Tensor logits, str mode=\"prob\", float temperature=0.0, "
        "Tensor? suppress=None, Tensor? noise=None, Tensor? max_prob_suppress=None) -> "
        "(Tensor token, Tensor score, Tensor max_prob)");
  m.def("select_transfer(Tensor score, Tensor candidate, str rule, Tensor? k=None, "
        "float threshold=0.9, float factor=1.0) -> Tensor");
  m.def("certainty_density(Tensor decoded, float sigma=10.0, bool left_known=True, "
        "bool right_known=False) -> Tensor");
  m.def("certainty_select(Tensor masked, Tensor confidence, int block_start, int block_end, "
        "int block_length, int k, float sigma=10.0) -> Tensor");
  m.def("drift_select(Tensor drift, Tensor region, float reuse_fraction, int max_recompute) "
        "-> (Tensor reuse, Tensor recompute_idx, Tensor recompute_count)");
  m.def("drift_select_threshold(Tensor drift, Tensor region, float threshold, "
        "int max_recompute) -> (Tensor reuse, Tensor recompute_idx, Tensor recompute_count)");
  // ---- family: sparse_kv ----------------------------------------------------
  m.def("rope_scatter_kv(Tensor(a!) q, Tensor k, Tensor v, Tensor positions, Tensor cos_sin, "
        "Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor idx) -> ()");
  m.def("sparse_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? key_valid, "
        "float scale, bool return_probs=False, int[]? query_counts=None, "
        "int[]? key_counts=None) -> (Tensor out, Tensor probs_mean)");
  m.def("gather_rows(Tensor x, Tensor idx) -> Tensor");
  m.def("scatter_rows(Tensor(a!) dst, Tensor src, Tensor idx) -> ()");
  // ---- family: rollout ------------------------------------------------------
  m.def("rollout_scores(Tensor probs_rows, Tensor row_idx, Tensor valid) -> Tensor");
  m.def("nucleus_select(Tensor scores, Tensor candidate, float p, int min_k=1) -> Tensor");
  // ---- family: quant --------------------------------------------------------
  m.def("quantize_k(Tensor k, int bits=4, int group=32, int protect_p=0, "
        "Tensor? importance=None) -> "
        "(Tensor codes, Tensor scale, Tensor min, Tensor prot_idx, Tensor prot_val)");
  m.def("dequantize_k(Tensor codes, Tensor scale, Tensor min, Tensor prot_idx, Tensor prot_val, "
        "int bits, int group, int length) -> Tensor");
  m.def("k_quant_error(Tensor k, int bits=4, int group=32) -> Tensor");
  m.def("quantize_v(Tensor v, int bits=4, int group=32) -> (Tensor codes, Tensor scale, Tensor min)");
  m.def("dequantize_v(Tensor codes, Tensor scale, Tensor min, int bits, int group) -> Tensor");
  m.def("quant_attention(Tensor q, Tensor k_codes, Tensor k_scale, Tensor k_min, "
        "Tensor k_prot_idx, Tensor k_prot_val, int k_bits, int k_group, Tensor v_codes, "
        "Tensor v_scale, Tensor v_min, int v_bits, int v_group, Tensor? key_valid, float scale) "
        "-> Tensor");
  m.def("two_source_attention(Tensor q, Tensor k_codes, Tensor k_scale, Tensor k_min, "
        "Tensor k_prot_idx, Tensor k_prot_val, int k_bits, int k_group, Tensor v_codes, "
        "Tensor v_scale, Tensor v_min, int v_bits, int v_group, Tensor? packed_valid, "
        "Tensor k_full, Tensor v_full, Tensor? full_valid, float scale, bool return_probs=False) "
        "-> (Tensor out, Tensor probs_mean)");
  // ---- family: layer --------------------------------------------------------
  m.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
}
