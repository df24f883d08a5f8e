// The Python module of headroom's CPU kernels.
// pybind11 and its Tensor casters, without the C++ frontend that torch/extension.h adds.
#include <torch/python.h>

torch::Tensor q4_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, torch::Tensor mins);
torch::Tensor q8_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                        std::optional<torch::Tensor> mins);
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                                     std::optional<torch::Tensor> k_new, std::optional<torch::Tensor> v_new,
                                     std::optional<torch::Tensor> slots);
torch::Tensor paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                      torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_start_loc,
                                      double scale, int64_t dots);
bool paged_prefill_available(int64_t head_dim);
int64_t bf16_attention_form();
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor delta, torch::Tensor weight, double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
void rope_(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin);
torch::Tensor qdot_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, torch::Tensor mins,
                          int64_t bits);
bool qdot_available();
bool qgemm_available();
torch::Tensor qgemm_linear(torch::Tensor x, torch::Tensor tiles, torch::Tensor scales, torch::Tensor mins);
void lora_add_(torch::Tensor out, torch::Tensor x, torch::Tensor a, torch::Tensor b, torch::Tensor spans,
               torch::Tensor rows, torch::Tensor starts, torch::Tensor slots);

// Every kernel runs without the GIL, as PyTorch's own ops do: the engine thread spends most
// of a step in them, and the event loop must be able to stream tokens meanwhile.
constexpr auto no_gil = py::call_guard<py::gil_scoped_release>();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_linear", &q4_linear, "x @ W^T for 4-bit group-32 weights with a scale and a min per group", no_gil);
  m.def("q8_linear", &q8_linear, "x @ W^T for 8-bit group-32 weights with a scale (and a min) per group", no_gil,
        py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("mins") = py::none());
  m.def("paged_decode_attention", &paged_decode_attention,
        "one-token-per-sequence attention over a paged KV cache, read in place (this step's K/V written first)", no_gil,
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("scale"), py::arg("k_new") = py::none(), py::arg("v_new") = py::none(), py::arg("slots") = py::none());
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "causal attention of any number of query rows per sequence over a paged KV cache, read in place", no_gil,
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("query_start_loc"), py::arg("scale"), py::arg("dots") = 0);
  m.def("paged_prefill_available", &paged_prefill_available,
        "whether this build has the in-place prefill attention for this head_dim");
  m.def("bf16_attention_form", &bf16_attention_form,
        "the best bfloat16 dot products this build's prefill attention has: 0 none, 1 pairs (AVX-512 BF16), "
        "2 AMX tiles");
  m.def("rms_norm", &rms_norm, "RMSNorm of float32 rows", no_gil);
  m.def("add_rms_norm_", &add_rms_norm_, "x += delta in place, then RMSNorm of x", no_gil);
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused (M, 2I) gate/up projection", no_gil);
  m.def("rope_", &rope_, "rotate-half RoPE of q and k in place", no_gil);
  m.def("qdot_linear", &qdot_linear,
        "x @ W^T for unsigned 4- or 8-bit group-32 weights (scale and min), x quantised to int8 per group", no_gil,
        py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("mins"), py::arg("bits"));
  m.def("qgemm_linear", &qgemm_linear,
        "x @ W^T for batches of many rows: the same arithmetic as qdot_linear on weights laid out in 16-row tiles",
        no_gil, py::arg("x"), py::arg("tiles"), py::arg("scales"), py::arg("mins"));
  m.def("lora_add_", &lora_add_,
        "out[rows] += x[rows] @ A[slot] @ B[slot] in place, for groups of rows each under one slot's LoRA weights",
        no_gil, py::arg("out"), py::arg("x"), py::arg("a"), py::arg("b"), py::arg("spans"), py::arg("rows"),
        py::arg("starts"), py::arg("slots"));
  m.def("qdot_available", &qdot_available, "whether this build has the integer-dot linear (AVX2 or AVX-512 VNNI)");
  m.def("qgemm_available", &qgemm_available, "whether this build has the tiled integer linear (AVX-512 VNNI)");
}
