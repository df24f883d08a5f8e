// The Python module of headroom's CPU kernels.
#include <torch/extension.h>

torch::Tensor q4_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, torch::Tensor mins);
torch::Tensor q8_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                        std::optional<torch::Tensor> mins);
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_linear", &q4_linear, "x @ W^T for 4-bit group-32 weights with a scale and a min per group");
  m.def("q8_linear", &q8_linear, "x @ W^T for 8-bit group-32 weights with a scale (and a min) per group",
        py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("mins") = py::none());
  m.def("paged_decode_attention", &paged_decode_attention,
        "one-token-per-sequence attention over a paged KV cache, read in place");
}
