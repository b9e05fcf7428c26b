// Fused elementwise ops of the decoder layers for CPU: residual add + RMSNorm, and the rotary
// embedding of q and k. Each is one pass and one parallel region in place of the five to
// fifteen small ATen ops (each its own pass over memory and its own thread-pool round trip)
// of the torch path. The arithmetic follows the torch path step by step, rounding to the
// tensor dtype where it does (built with -ffp-contract=off, so no FMA changes a rounding);
// only the order of the RMS sum differs from ATen's reduction.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

// Rows per parallel chunk: about 32K elements, so a decode step's few rows run on the
// calling thread without a thread-pool round trip.
int64_t grain_rows(int64_t row_elems) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_elems));
}

template <typename T>
void add_rms_norm_impl(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                       double eps) {
  const int64_t rows = x.size(0), dim = x.size(1);
  T* xp = x.data_ptr<T>();
  T* rp = residual.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  at::parallel_for(0, rows, grain_rows(dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = xp + r * xs;
      T* rr = rp + r * rs;
      float lanes[16] = {0.f};  // 16 partial sums: a reduction the compiler vectorizes
      int64_t i = 0;
      for (; i + 16 <= dim; i += 16) {
        for (int j = 0; j < 16; ++j) {
          T s = static_cast<T>(static_cast<float>(xr[i + j]) + static_cast<float>(rr[i + j]));
          rr[i + j] = s;
          float f = static_cast<float>(s);
          lanes[j] += f * f;
        }
      }
      for (; i < dim; ++i) {
        T s = static_cast<T>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
        rr[i] = s;
        float f = static_cast<float>(s);
        lanes[0] += f * f;
      }
      float sum = 0.f;
      for (int j = 0; j < 16; ++j) sum += lanes[j];
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(dim) + static_cast<float>(eps));
      for (int64_t i = 0; i < dim; ++i) {
        T normed = static_cast<T>(static_cast<float>(rr[i]) * inv);
        xr[i] = static_cast<T>(static_cast<float>(wp[i]) * static_cast<float>(normed));
      }
    }
  });
}

// residual += x; x = weight * rms_norm(residual). x [T, D] and residual [T, D], row-major.
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight,
                        double eps) {
  TORCH_CHECK(x.dim() == 2 && residual.sizes() == x.sizes(), "x and residual: [T, D]");
  TORCH_CHECK(x.stride(1) == 1 && residual.stride(1) == 1 && weight.is_contiguous(),
              "rows must be contiguous");
  if (x.scalar_type() == at::kFloat) {
    add_rms_norm_impl<float>(x, residual, weight, eps);
  } else if (x.scalar_type() == at::kBFloat16) {
    add_rms_norm_impl<c10::BFloat16>(x, residual, weight, eps);
  } else {
    TORCH_CHECK(false, "fused_add_rms_norm: float32 or bfloat16");
  }
}

template <typename T>
void rotate_rows(const T* in, T* out, const T* cos, const T* sin, int64_t heads, int64_t in_hs,
                 int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const T* x = in + h * in_hs;
    T* y = out + h * dim;
    for (int64_t i = 0; i < half; ++i) {
      // x * cos + rotate_half(x) * sin, each product rounded to T as in the torch path
      T a = static_cast<T>(static_cast<float>(x[i]) * static_cast<float>(cos[i]));
      T b = static_cast<T>(-static_cast<float>(x[i + half]) * static_cast<float>(sin[i]));
      y[i] = static_cast<T>(static_cast<float>(a) + static_cast<float>(b));
      T c = static_cast<T>(static_cast<float>(x[i + half]) * static_cast<float>(cos[i + half]));
      T d = static_cast<T>(static_cast<float>(x[i]) * static_cast<float>(sin[i + half]));
      y[i + half] = static_cast<T>(static_cast<float>(c) + static_cast<float>(d));
    }
  }
}

template <typename T>
void rotary_impl(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                 at::Tensor& q_out, at::Tensor& k_out, const at::Tensor& cos,
                 const at::Tensor& sin) {
  const int64_t tokens = q.size(0), hq = q.size(1), hk = k.size(1), dim = q.size(2);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>();
  const T *cp = cos.data_ptr<T>(), *sp = sin.data_ptr<T>();
  T *qo = q_out.data_ptr<T>(), *ko = k_out.data_ptr<T>();
  const int64_t max_pos = cos.size(0);
  at::parallel_for(0, tokens, grain_rows((hq + hk) * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t p = pos[t];
      TORCH_CHECK(p >= 0 && p < max_pos, "position out of the rotary table");
      const T* c = cp + p * dim;
      const T* s = sp + p * dim;
      rotate_rows(qp + t * q.stride(0), qo + t * hq * dim, c, s, hq, q.stride(1), dim);
      rotate_rows(kp + t * k.stride(0), ko + t * hk * dim, c, s, hk, k.stride(1), dim);
    }
  });
}

// Neox-layout rotary embedding of q [T, Hq, D] and k [T, Hk, D] (rows may be strided views
// of a fused qkv projection) into new contiguous tensors, with cos / sin tables [P, D].
std::tuple<at::Tensor, at::Tensor> rotary_neox(const at::Tensor& positions, const at::Tensor& q,
                                               const at::Tensor& k, const at::Tensor& cos,
                                               const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(2) == k.size(2), "q, k: [T, H, D]");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1, "head rows must be contiguous");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == q.size(2),
              "cos / sin: [P, D]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "positions");
  at::Tensor q_out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  at::Tensor k_out = at::empty({k.size(0), k.size(1), k.size(2)}, k.options());
  if (q.scalar_type() == at::kFloat) {
    rotary_impl<float>(positions, q, k, q_out, k_out, cos, sin);
  } else if (q.scalar_type() == at::kBFloat16) {
    rotary_impl<c10::BFloat16>(positions, q, k, q_out, k_out, cos, sin);
  } else {
    TORCH_CHECK(false, "rotary_neox: float32 or bfloat16");
  }
  return {q_out, k_out};
}

// exp(x) for float: range reduction x = n ln2 + r, a degree-6 polynomial for exp(r), 2^n
// through the exponent bits. Branch- and call-free, so the loop below vectorizes; about
// 2 ulp from std::exp over the range silu needs (inputs are clamped to [-87, 88]).
inline float fast_exp(float x) {
  x = std::min(88.f, std::max(-87.f, x));
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

template <typename T>
void silu_and_mul_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = out.size(0), dim = out.size(1);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, rows, grain_rows(2 * dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = xp + r * xs;
      const T* up = gate + dim;
      T* y = op + r * dim;
      for (int64_t i = 0; i < dim; ++i) {
        const float g = static_cast<float>(gate[i]);
        const T act = static_cast<T>(g / (1.f + fast_exp(-g)));  // rounded as F.silu's output
        y[i] = static_cast<T>(static_cast<float>(act) * static_cast<float>(up[i]));
      }
    }
  });
}

// silu(gate) * up of a merged [T, 2 * d] projection -> [T, d].
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0 && x.stride(1) == 1, "x: [T, 2 * d]");
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  if (x.scalar_type() == at::kFloat) {
    silu_and_mul_impl<float>(x, out);
  } else if (x.scalar_type() == at::kBFloat16) {
    silu_and_mul_impl<c10::BFloat16>(x, out);
  } else {
    TORCH_CHECK(false, "silu_and_mul: float32 or bfloat16");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(pagedllm_fused, m) {
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rotary_neox(Tensor positions, Tensor q, Tensor k, Tensor cos, Tensor sin) -> "
        "(Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm_fused, CPU, m) {
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rotary_neox", &rotary_neox);
  m.impl("silu_and_mul", &silu_and_mul);
}
