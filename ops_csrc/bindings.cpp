// pybind11 face of the CPU optimizer kernels: raw addresses and dtype codes in, a finite flag out.
// The torch-aware checks (device, layout, contiguity, sizes) are done by offload/ops in Python; this
// layer only re-checks what it needs to stay memory safe with the arguments it is given.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "cpu_optim.h"
#include "dispatch.h"
#include "qmatmul.h"

namespace py = pybind11;
using namespace zo_optim;

namespace {

Arrays make_arrays(uintptr_t param, uintptr_t grad, uintptr_t state_a, uintptr_t state_b, uintptr_t copy,
                   int param_dtype, int grad_dtype, int state_dtype, int copy_dtype) {
    Arrays a;
    a.param = reinterpret_cast<void*>(param);
    a.grad = reinterpret_cast<const void*>(grad);
    a.state_a = reinterpret_cast<void*>(state_a);
    a.state_b = reinterpret_cast<void*>(state_b);
    a.copy = reinterpret_cast<void*>(copy);
    a.param_dtype = param_dtype;
    a.grad_dtype = grad_dtype;
    a.state_dtype = state_dtype;
    a.copy_dtype = copy_dtype;
    return a;
}

// The low-bit extras of the single-tensor steps: absmax addresses of 8-bit states (0: none), stochastic
// rounding of bf16 states and its two hash keys.
void set_lowbit(Arrays& a, uintptr_t absmax_a, uintptr_t absmax_b, bool stochastic, uint32_t k0,
                uint32_t k1) {
    a.absmax_a = reinterpret_cast<float*>(absmax_a);
    a.absmax_b = reinterpret_cast<float*>(absmax_b);
    a.stochastic = stochastic;
    a.sr_k0 = k0;
    a.sr_k1 = k1;
}

#define LOWBIT_TAIL py::arg("stochastic") = false, py::arg("sr_k0") = 0u, py::arg("sr_k1") = 0u
#define LOWBIT_ARGS1 py::arg("state_absmax") = uintptr_t{0}, LOWBIT_TAIL
#define LOWBIT_ARGS2 \
    py::arg("exp_avg_absmax") = uintptr_t{0}, py::arg("exp_avg_sq_absmax") = uintptr_t{0}, LOWBIT_TAIL

// (param, grad, state_a, state_b, copy, n, param_dtype, grad_dtype, state_dtype, copy_dtype, step, lr,
//  stochastic, sr_k0, sr_k1)
using SegmentTuple = std::tuple<uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, size_t, int, int, int,
                                int, int64_t, double, bool, uint32_t, uint32_t>;

std::vector<Segment> make_segments(const std::vector<SegmentTuple>& tuples) {
    std::vector<Segment> out;
    out.reserve(tuples.size());
    for (const auto& t : tuples) {
        Segment s;
        s.arrays = make_arrays(std::get<0>(t), std::get<1>(t), std::get<2>(t), std::get<3>(t), std::get<4>(t),
                               std::get<6>(t), std::get<7>(t), std::get<8>(t), std::get<9>(t));
        s.n = std::get<5>(t);
        s.step = std::get<10>(t);
        s.lr = std::get<11>(t);
        s.arrays.stochastic = std::get<12>(t);
        s.arrays.sr_k0 = std::get<13>(t);
        s.arrays.sr_k1 = std::get<14>(t);
        out.push_back(s);
    }
    return out;
}

QuantMatrix make_quant(uintptr_t codes, uintptr_t scale, uintptr_t offset, int bits, size_t group,
                       int round_to = kF32) {
    QuantMatrix w;
    w.codes = reinterpret_cast<const uint8_t*>(codes);
    w.scale = reinterpret_cast<const uint16_t*>(scale);
    w.offset = reinterpret_cast<const uint16_t*>(offset);  // 0: symmetric
    w.bits = bits;
    w.group = group;
    w.round_to = round_to;
    return w;
}

}  // namespace

PYBIND11_MODULE(_cpu_optim, m) {
    m.doc() = "CPU SIMD optimizer kernels (Adam/AdamW, Adagrad, Lion) over raw arrays";

    m.attr("F32") = static_cast<int>(kF32);
    m.attr("BF16") = static_cast<int>(kBF16);
    m.attr("F16") = static_cast<int>(kF16);
    m.attr("NONE") = static_cast<int>(kNone);
    m.attr("U8") = static_cast<int>(kU8);
    m.attr("QUANT_BLOCK") = kQuantBlock;

    m.def("simd_level", [] { return std::string(simd_level_name(simd_level())); });
    m.def("best_simd_level", [] { return std::string(simd_level_name(best_simd_level())); });
    m.def("set_simd_level", &set_simd_level, py::arg("name"));
    m.def("stream_policy", [] { return std::string(stream_policy_name()); });
    m.def("set_stream_policy", &set_stream_policy, py::arg("name"));
    m.def("get_num_threads", &num_threads);
    m.def("set_num_threads", &set_num_threads, py::arg("threads"), py::call_guard<py::gil_scoped_release>());

    m.def(
        "adam",
        [](uintptr_t param, uintptr_t grad, uintptr_t exp_avg, uintptr_t exp_avg_sq, uintptr_t copy, size_t n,
           int param_dtype, int grad_dtype, int state_dtype, int copy_dtype, int64_t step, double lr,
           double beta1, double beta2, double eps, double weight_decay, bool adamw_mode, bool bias_correction,
           double grad_scale, bool check_finite, uintptr_t exp_avg_absmax, uintptr_t exp_avg_sq_absmax,
           bool stochastic, uint32_t sr_k0, uint32_t sr_k1) {
            Arrays a = make_arrays(param, grad, exp_avg, exp_avg_sq, copy, param_dtype, grad_dtype,
                                   state_dtype, copy_dtype);
            set_lowbit(a, exp_avg_absmax, exp_avg_sq_absmax, stochastic, sr_k0, sr_k1);
            const AdamHyper h{step, lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction};
            return adam_step(a, n, h, grad_scale, check_finite);
        },
        py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("copy"),
        py::arg("n"), py::arg("param_dtype"), py::arg("grad_dtype"), py::arg("state_dtype"),
        py::arg("copy_dtype"), py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
        py::arg("eps"), py::arg("weight_decay"), py::arg("adamw_mode"), py::arg("bias_correction"),
        py::arg("grad_scale"), py::arg("check_finite"), LOWBIT_ARGS2,
        py::call_guard<py::gil_scoped_release>());

    m.def(
        "adagrad",
        [](uintptr_t param, uintptr_t grad, uintptr_t state_sum, uintptr_t copy, size_t n, int param_dtype,
           int grad_dtype, int state_dtype, int copy_dtype, double lr, double eps, double weight_decay,
           double grad_scale, bool check_finite, uintptr_t state_sum_absmax, bool stochastic, uint32_t sr_k0,
           uint32_t sr_k1) {
            Arrays a = make_arrays(param, grad, state_sum, 0, copy, param_dtype, grad_dtype, state_dtype,
                                   copy_dtype);
            set_lowbit(a, state_sum_absmax, 0, stochastic, sr_k0, sr_k1);
            return adagrad_step(a, n, AdagradHyper{lr, eps, weight_decay}, grad_scale, check_finite);
        },
        py::arg("param"), py::arg("grad"), py::arg("state_sum"), py::arg("copy"), py::arg("n"),
        py::arg("param_dtype"), py::arg("grad_dtype"), py::arg("state_dtype"), py::arg("copy_dtype"),
        py::arg("lr"), py::arg("eps"), py::arg("weight_decay"), py::arg("grad_scale"),
        py::arg("check_finite"), LOWBIT_ARGS1, py::call_guard<py::gil_scoped_release>());

    m.def(
        "lion",
        [](uintptr_t param, uintptr_t grad, uintptr_t exp_avg, uintptr_t copy, size_t n, int param_dtype,
           int grad_dtype, int state_dtype, int copy_dtype, double lr, double beta1, double beta2,
           double weight_decay, double grad_scale, bool check_finite, uintptr_t exp_avg_absmax,
           bool stochastic, uint32_t sr_k0, uint32_t sr_k1) {
            Arrays a =
                make_arrays(param, grad, exp_avg, 0, copy, param_dtype, grad_dtype, state_dtype, copy_dtype);
            set_lowbit(a, exp_avg_absmax, 0, stochastic, sr_k0, sr_k1);
            return lion_step(a, n, LionHyper{lr, beta1, beta2, weight_decay}, grad_scale, check_finite);
        },
        py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("copy"), py::arg("n"),
        py::arg("param_dtype"), py::arg("grad_dtype"), py::arg("state_dtype"), py::arg("copy_dtype"),
        py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("weight_decay"), py::arg("grad_scale"),
        py::arg("check_finite"), LOWBIT_ARGS1, py::call_guard<py::gil_scoped_release>());

    // Multi-tensor steps: the segment list is converted with the GIL held, the step runs without it.
    m.def(
        "adam_multi",
        [](const std::vector<SegmentTuple>& segments, double beta1, double beta2, double eps,
           double weight_decay, double lr, bool adamw_mode, bool bias_correction) {
            const std::vector<Segment> segs = make_segments(segments);
            py::gil_scoped_release release;
            return adam_step_multi(
                segs, AdamHyper{1, lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction});
        },
        py::arg("segments"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("lr"), py::arg("adamw_mode"), py::arg("bias_correction"));
    m.def(
        "adagrad_multi",
        [](const std::vector<SegmentTuple>& segments, double eps, double weight_decay) {
            const std::vector<Segment> segs = make_segments(segments);
            py::gil_scoped_release release;
            return adagrad_step_multi(segs, AdagradHyper{0.0, eps, weight_decay});
        },
        py::arg("segments"), py::arg("eps"), py::arg("weight_decay"));
    m.def(
        "lion_multi",
        [](const std::vector<SegmentTuple>& segments, double lr, double beta1, double beta2,
           double weight_decay) {
            const std::vector<Segment> segs = make_segments(segments);
            py::gil_scoped_release release;
            return lion_step_multi(segs, LionHyper{lr, beta1, beta2, weight_decay});
        },
        py::arg("segments"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("weight_decay"));

    m.def(
        "bandwidth_probe",
        [](const std::string& kind, uintptr_t dst, uintptr_t a, uintptr_t b, size_t n) {
            return bandwidth_probe(kind, reinterpret_cast<float*>(dst), reinterpret_cast<const float*>(a),
                                   reinterpret_cast<const float*>(b), n);
        },
        py::arg("kind"), py::arg("dst"), py::arg("a"), py::arg("b"), py::arg("n"),
        py::call_guard<py::gil_scoped_release>());
    m.def(
        "all_finite",
        [](uintptr_t data, size_t n, int dtype) {
            return all_finite(reinterpret_cast<const void*>(data), dtype, n);
        },
        py::arg("data"), py::arg("n"), py::arg("dtype"), py::call_guard<py::gil_scoped_release>());

    // Group-wise quantized weights (qmatmul.h): addresses of the codes, fp16 scales and offsets (0 when
    // symmetric) and of fp32 inputs/outputs; offload/ops/qmatmul.py checks the tensors behind them.
    m.def(
        "dequantize_f32",
        [](uintptr_t codes, uintptr_t scale, uintptr_t offset, int bits, size_t group, size_t n,
           uintptr_t out) {
            dequantize_f32(make_quant(codes, scale, offset, bits, group), n, reinterpret_cast<float*>(out));
        },
        py::arg("codes"), py::arg("scale"), py::arg("offset"), py::arg("bits"), py::arg("group"),
        py::arg("n"), py::arg("out"), py::call_guard<py::gil_scoped_release>());
    m.def(
        "quantized_matmul_f32",
        [](uintptr_t codes, uintptr_t scale, uintptr_t offset, int bits, size_t group, size_t rows,
           size_t cols, uintptr_t x, size_t batch, uintptr_t y, int round_to) {
            quantized_matmul_f32(make_quant(codes, scale, offset, bits, group, round_to), rows, cols,
                                 reinterpret_cast<const float*>(x), batch, reinterpret_cast<float*>(y));
        },
        py::arg("codes"), py::arg("scale"), py::arg("offset"), py::arg("bits"), py::arg("group"),
        py::arg("rows"), py::arg("cols"), py::arg("x"), py::arg("batch"), py::arg("y"),
        py::arg("round_to") = static_cast<int>(kF32), py::call_guard<py::gil_scoped_release>());
    m.def(
        "quantized_matmul_int8_activations",
        [](uintptr_t codes, uintptr_t scale, uintptr_t offset, int bits, size_t group, size_t rows,
           size_t cols, uintptr_t x, size_t batch, uintptr_t y) {
            quantized_matmul_int8_activations(make_quant(codes, scale, offset, bits, group), rows, cols,
                                              reinterpret_cast<const float*>(x), batch,
                                              reinterpret_cast<float*>(y));
        },
        py::arg("codes"), py::arg("scale"), py::arg("offset"), py::arg("bits"), py::arg("group"),
        py::arg("rows"), py::arg("cols"), py::arg("x"), py::arg("batch"), py::arg("y"),
        py::call_guard<py::gil_scoped_release>());
}
