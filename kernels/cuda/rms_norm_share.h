// One CUDA thread's share of an RMSNorm row (cuda_kernels.cu), in a header the CPU tests run too: of a row's
// cols / V packs, thread t of n takes t, t + n, t + 2n, ...; the first kCached of them stay in registers between the
// two passes over the row (the rest are read again). Between the passes the kernel sums the threads' partial sums over
// the block. `E` converts elements: E::load(T) -> float, E::store(float) -> T (rounding to nearest). Rows (and the
// weight) start at a multiple of V elements' alignment.
#pragma once

#include <math.h>

#include <type_traits>

#include "kernels/cuda/host_device.h"

namespace trestle::kernels::cuda {

// RMSNorm a warp a row (the kernels' choice where a row fits): the 32 lanes of a warp share a row as the threads of a
// block do (lane t takes packs t, t + 32, ...), every pack of it held in registers: rms_norm_lane_packs(packs) of them
// a lane (1, 2, 4 or 8: what the kernel is compiled for), 0 where a row of `packs` packs does not fit.
// The kernels' blocks hold kRowWarps warps; a backward's warps take rows warp, warp + all warps, ... (warp =
// blockIdx.x · kRowWarps + the block's warp), and the block's warps add their weight-gradient sums one after another.
constexpr int kWarpLanes = 32, kWarpMaxLanePacks = 8, kRowWarps = 4;
TRESTLE_HOST_DEVICE inline int rms_norm_lane_packs(int packs) {
  for (int l = 1; l <= kWarpMaxLanePacks; l *= 2)
    if (packs <= kWarpLanes * l) return l;
  return 0;
}

// f(std::integral_constant<int, L>) for L = lane_packs, one of rms_norm_lane_packs's (the kernel compiled for it).
template <typename F>
void with_lane_packs(int lane_packs, F f) {
  switch (lane_packs) {
    case 1:
      f(std::integral_constant<int, 1>());
      break;
    case 2:
      f(std::integral_constant<int, 2>());
      break;
    case 4:
      f(std::integral_constant<int, 4>());
      break;
    default:
      f(std::integral_constant<int, kWarpMaxLanePacks>());
      break;
  }
}

// 1 / sqrt(mean of squares + eps), as every RMSNorm here computes it.
TRESTLE_HOST_DEVICE inline float rms_inverse(float squares, int cols, float eps) {
  return 1.0f / sqrtf(squares / static_cast<float>(cols) + eps);
}

// The weight's factor: w, or (1 + w) zero-centred (Gemma's form).
TRESTLE_HOST_DEVICE inline float rms_scale(float w, bool zero_centered) { return zero_centered ? w + 1.0f : w; }

template <typename T, typename E, int V, int kCached>
struct RmsNormForwardShare {
  using P = Pack<T, V>;
  float x[kCached][V];

  // Pass 1: Σ h² over the thread's packs (`packs` = cols / V), h the row, or with `residual` (not null) row + residual
  // rounded to T, which the thread writes to `sum_row` (then the row normalize() takes).
  TRESTLE_HOST_DEVICE float squares(const T* row, const T* residual, T* sum_row, int packs, int t, int n) {
    float sum = 0;
    TRESTLE_UNROLL
    for (int j = 0; j < kCached; ++j) {
      const int p = t + j * n;
      if (p >= packs) break;
      load(row, residual, sum_row, p, x[j]);
      TRESTLE_UNROLL
      for (int i = 0; i < V; ++i) sum += x[j][i] * x[j][i];
    }
    for (int p = t + kCached * n; p < packs; p += n) {
      float h[V];
      load(row, residual, sum_row, p, h);
      TRESTLE_UNROLL
      for (int i = 0; i < V; ++i) sum += h[i] * h[i];
    }
    return sum;
  }

  // Pass 2: y = x · inv · w (x · inv rounded to T first, as the CPU versions), or x · inv · (1 + w) zero-centred.
  TRESTLE_HOST_DEVICE void normalize(const T* row, const T* weight, T* out, int packs, int t, int n, float inv,
                                     bool zero_centered) {
    TRESTLE_UNROLL
    for (int j = 0; j < kCached; ++j) {
      const int p = t + j * n;
      if (p >= packs) break;
      write(x[j], weight, out, p, inv, zero_centered);
    }
    for (int p = t + kCached * n; p < packs; p += n) {
      const P v = reinterpret_cast<const P*>(row)[p];
      float values[V];
      TRESTLE_UNROLL
      for (int i = 0; i < V; ++i) values[i] = E::load(v.v[i]);
      write(values, weight, out, p, inv, zero_centered);
    }
  }

 private:
  // Pack p of the row normed: the row's, or row + residual rounded to T (written to sum_row).
  TRESTLE_HOST_DEVICE static void load(const T* row, const T* residual, T* sum_row, int p, float (&h)[V]) {
    const P v = reinterpret_cast<const P*>(row)[p];
    if (!residual) {
      TRESTLE_UNROLL
      for (int i = 0; i < V; ++i) h[i] = E::load(v.v[i]);
      return;
    }
    const P r = reinterpret_cast<const P*>(residual)[p];
    P s;
    TRESTLE_UNROLL
    for (int i = 0; i < V; ++i) {
      s.v[i] = E::store(E::load(v.v[i]) + E::load(r.v[i]));
      h[i] = E::load(s.v[i]);
    }
    reinterpret_cast<P*>(sum_row)[p] = s;
  }

  TRESTLE_HOST_DEVICE static void write(const float (&values)[V], const T* weight, T* out, int p, float inv,
                                        bool zero_centered) {
    const P w = reinterpret_cast<const P*>(weight)[p];
    P y;
    TRESTLE_UNROLL
    for (int i = 0; i < V; ++i) {
      const float normed = values[i] * inv, wi = E::load(w.v[i]);
      y.v[i] = E::store(zero_centered ? normed * (1.0f + wi) : E::load(E::store(normed)) * wi);
    }
    reinterpret_cast<P*>(out)[p] = y;
  }
};

// A block's rows one after another; each row's cached packs (of x and dy) are read ahead, while the block still
// reduces and writes the row before (read_ahead, then advance at the next row), so that the block has loads in flight
// through its reduction and writes.
template <typename T, typename E, int V, int kCached>
struct RmsNormBackwardShare {
  using P = Pack<T, V>;
  P x[kCached] = {}, dy[kCached] = {};              // the current row's cached packs, as read
  P x_ahead[kCached] = {}, dy_ahead[kCached] = {};  // the next row's
  // The weight's gradient over the rows so far for the cached packs' columns, which stay the thread's for every row
  // (a row's packs are split the same way each time): summed in registers, added to dw by add_weight_sums.
  float dw_cached[kCached][V] = {};

  // Reads a row's cached packs, for the row after the current one.
  TRESTLE_HOST_DEVICE void read_ahead(const T* x_row, const T* dy_row, int packs, int t, int n) {
    TRESTLE_UNROLL
    for (int j = 0; j < kCached; ++j) {
      const int p = t + j * n;
      if (p >= packs) break;
      x_ahead[j] = reinterpret_cast<const P*>(x_row)[p];
      dy_ahead[j] = reinterpret_cast<const P*>(dy_row)[p];
    }
  }

  // The row read ahead becomes the current row.
  TRESTLE_HOST_DEVICE void advance() {
    TRESTLE_UNROLL
    for (int j = 0; j < kCached; ++j) {
      x[j] = x_ahead[j];
      dy[j] = dy_ahead[j];
    }
  }

  // Pass 1 over the current row (its cached packs read ahead; the rest read from x_row, dy_row): Σ dy · w' · x · inv
  // over the thread's packs.
  TRESTLE_HOST_DEVICE float dot(const T* x_row, const T* dy_row, const T* weight, int packs, int t, int n, float inv,
                                bool zero_centered) const {
    float sum = 0;
    TRESTLE_UNROLL
    for (int j = 0; j < kCached; ++j) {
      const int p = t + j * n;
      if (p >= packs) break;
      float xs[V], ds[V];
      unpack(x[j], xs);
      unpack(dy[j], ds);
      sum += pack_dot(xs, ds, weight, p, inv, zero_centered);
    }
    for (int p = t + kCached * n; p < packs; p += n) {
      float xs[V], ds[V];
      unpack(reinterpret_cast<const P*>(x_row)[p], xs);
      unpack(reinterpret_cast<const P*>(dy_row)[p], ds);
      sum += pack_dot(xs, ds, weight, p, inv, zero_centered);
    }
    return sum;
  }

  // Pass 2, with mean = the row's Σ dy · w' · x̂ / cols: dx = inv · (dy · w' − x̂ · mean) (+ residual_row's gradient,
  // where not null, before the one rounding), and the weight's gradient dy · x̂ (x̂ rounded to T, unless zero-centred)
  // added to the thread's own columns: the cached packs' in dw_cached, the rest in dw (fp32).
  TRESTLE_HOST_DEVICE void gradients(const T* x_row, const T* dy_row, const T* weight, const T* residual_row, T* dx_row,
                                     float* dw, int packs, int t, int n, float inv, float mean, bool zero_centered) {
    TRESTLE_UNROLL
    for (int j = 0; j < kCached; ++j) {
      const int p = t + j * n;
      if (p >= packs) break;
      float xs[V], ds[V];
      unpack(x[j], xs);
      unpack(dy[j], ds);
      write(xs, ds, weight, residual_row, dx_row, dw_cached[j], p, inv, mean, zero_centered);
    }
    for (int p = t + kCached * n; p < packs; p += n) {
      float xs[V], ds[V];
      unpack(reinterpret_cast<const P*>(x_row)[p], xs);
      unpack(reinterpret_cast<const P*>(dy_row)[p], ds);
      write(xs, ds, weight, residual_row, dx_row, dw + p * V, p, inv, mean, zero_centered);
    }
  }

  // After the thread's last row: the cached packs' weight-gradient sums added to dw.
  TRESTLE_HOST_DEVICE void add_weight_sums(float* dw, int packs, int t, int n) const {
    TRESTLE_UNROLL
    for (int j = 0; j < kCached; ++j) {
      const int p = t + j * n;
      if (p >= packs) break;
      TRESTLE_UNROLL
      for (int i = 0; i < V; ++i) dw[p * V + i] += dw_cached[j][i];
    }
  }

 private:
  TRESTLE_HOST_DEVICE static void unpack(const P& v, float (&values)[V]) {
    TRESTLE_UNROLL
    for (int i = 0; i < V; ++i) values[i] = E::load(v.v[i]);
  }

  TRESTLE_HOST_DEVICE static float pack_dot(const float (&xs)[V], const float (&ds)[V], const T* weight, int p,
                                            float inv, bool zero_centered) {
    const P w = reinterpret_cast<const P*>(weight)[p];
    float sum = 0;
    TRESTLE_UNROLL
    for (int i = 0; i < V; ++i) sum += ds[i] * rms_scale(E::load(w.v[i]), zero_centered) * xs[i] * inv;
    return sum;
  }

  // dx's pack p, and the pack's weight-gradient terms added to dw_pack[0..V).
  TRESTLE_HOST_DEVICE static void write(const float (&xs)[V], const float (&ds)[V], const T* weight,
                                        const T* residual_row, T* dx_row, float* dw_pack, int p, float inv, float mean,
                                        bool zero_centered) {
    const P w = reinterpret_cast<const P*>(weight)[p];
    P residual = {};
    if (residual_row) residual = reinterpret_cast<const P*>(residual_row)[p];
    P dx;
    TRESTLE_UNROLL
    for (int i = 0; i < V; ++i) {
      const float normed = xs[i] * inv;
      dx.v[i] =
          E::store(E::load(residual.v[i]) + inv * (ds[i] * rms_scale(E::load(w.v[i]), zero_centered) - normed * mean));
      dw_pack[i] += ds[i] * (zero_centered ? normed : E::load(E::store(normed)));
    }
    reinterpret_cast<P*>(dx_row)[p] = dx;
  }
};

}  // namespace trestle::kernels::cuda
