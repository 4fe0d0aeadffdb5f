// A slow, independent implementation of the reference NAMM update (spec §3–§5), written the way the spec
// states it: buffered whole-update attention, explicit padding with the carried 16 samples, a direct DFT, the
// batch EMA formula with its strided causal mask, an explicit n x n backward mask, and the sort-based binary
// selection. Plain loops in float64 (float32 only where the reference rounds), no libtorch operators: it
// shares no code with namm_core, so agreement is evidence that both follow the spec.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

namespace namm::testing {

// Dense row-major array with a shape.
struct Array {
  std::vector<int64_t> shape;
  std::vector<double> data;

  Array() = default;
  explicit Array(std::vector<int64_t> s) : shape(std::move(s)) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    data.assign(static_cast<std::size_t>(n), 0.0);
  }
  double& at(std::initializer_list<int64_t> idx) { return data[Offset(idx)]; }
  double at(std::initializer_list<int64_t> idx) const { return data[Offset(idx)]; }
  std::size_t Offset(std::initializer_list<int64_t> idx) const {
    std::size_t off = 0, i = 0;
    for (int64_t v : idx) off = off * static_cast<std::size_t>(shape[i++]) + static_cast<std::size_t>(v);
    return off;
  }
};

// Round-to-nearest-even to bfloat16, by bit manipulation.
inline float RoundBf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  bits &= 0xffff0000u;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

// attention [q_heads, n_q, n] -> [kv_heads, n_q, n]: query head h belongs to KV head h / G.
inline Array RefGqaMean(const Array& a, int64_t kv_heads, bool bf16) {
  const int64_t q_heads = a.shape[0], nq = a.shape[1], n = a.shape[2], g = q_heads / kv_heads;
  Array out({kv_heads, nq, n});
  for (int64_t kv = 0; kv < kv_heads; ++kv)
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t j = 0; j < n; ++j) {
        float sum = 0.0f;  // bf16 values sum exactly in float32 here
        for (int64_t m = 0; m < g; ++m) {
          float v = static_cast<float>(a.at({kv * g + m, i, j}));
          sum += bf16 ? RoundBf16(v) : v;
        }
        float mean = sum / static_cast<float>(g);
        out.at({kv, i, j}) = bf16 ? RoundBf16(mean) : mean;
      }
  return out;
}

inline double Hann(int64_t n) { return 0.5 - 0.5 * std::cos(2.0 * M_PI * static_cast<double>(n) / 32.0); }

// |X[f]| of one 32-sample frame, f = 0..16, by the direct DFT sum.
inline std::vector<double> RefFrameMagnitudes(const double* s) {
  static const std::vector<double> table = [] {  // [n][f][cos, sin] with the window folded in
    std::vector<double> t(32 * 17 * 2);
    for (int64_t n = 0; n < 32; ++n)
      for (int64_t f = 0; f < 17; ++f) {
        const double angle = 2.0 * M_PI * static_cast<double>(f * n) / 32.0;
        t[static_cast<std::size_t>((n * 17 + f) * 2)] = Hann(n) * std::cos(angle);
        t[static_cast<std::size_t>((n * 17 + f) * 2 + 1)] = -Hann(n) * std::sin(angle);
      }
    return t;
  }();
  std::vector<double> mag(17);
  for (int64_t f = 0; f < 17; ++f) {
    double re = 0, im = 0;
    for (int64_t n = 0; n < 32; ++n) {
      re += s[n] * table[static_cast<std::size_t>((n * 17 + f) * 2)];
      im += s[n] * table[static_cast<std::size_t>((n * 17 + f) * 2 + 1)];
    }
    mag[static_cast<std::size_t>(f)] = std::sqrt(re * re + im * im);
  }
  return mag;
}

// Per-layer streaming state of the reference: previous update's transposed attention tail and EMA buffer.
struct RefLayerState {
  Array carry;      // [H, n, 16]
  Array ema;        // [H, n, 17]
  Array positions;  // [H, n]
  int64_t n() const { return positions.shape.empty() ? 0 : positions.shape[1]; }
};

// One update's spectrogram EMA (spec §3.2–3.4). attn_kv: [H, n_new, n_all] GQA-reduced attention of the n_new
// new queries over the n_all = n_old + n_new cache slots. Returns E_new [H, n_all, 17]; fills new_carry.
inline Array RefSpectrogramEma(const Array& attn_kv, const RefLayerState& old, Array* new_carry) {
  const int64_t h_kv = attn_kv.shape[0], n_new = attn_kv.shape[1], n_all = attn_kv.shape[2];
  const int64_t n_old = n_all - n_new, frames = n_new / 16;
  const double a = std::pow(0.99, 16.0);
  Array e({h_kv, n_all, 17});
  *new_carry = Array({h_kv, n_all, 16});
  std::vector<double> series(static_cast<std::size_t>(16 + n_new));
  for (int64_t h = 0; h < h_kv; ++h)
    for (int64_t k = 0; k < n_all; ++k) {
      // Padded series: 16 carried samples (old keys) or zeros (new keys), then the column of attention.
      for (int64_t t = 0; t < 16; ++t) series[static_cast<std::size_t>(t)] = k < n_old ? old.carry.at({h, k, t}) : 0.0;
      for (int64_t i = 0; i < n_new; ++i) series[static_cast<std::size_t>(16 + i)] = attn_kv.at({h, i, k});
      for (int64_t t = 0; t < 16; ++t) new_carry->at({h, k, t}) = attn_kv.at({h, n_new - 16 + t, k});
      for (int64_t t = 0; t < frames; ++t) {
        const bool masked = k >= n_old && (k - n_old) / 16 > t;  // strided causal mask
        if (masked) continue;
        std::vector<double> mag = RefFrameMagnitudes(&series[static_cast<std::size_t>(16 * t)]);
        const double w = (1.0 - a) * std::pow(a, static_cast<double>(frames - 1 - t));
        for (int64_t f = 0; f < 17; ++f) e.at({h, k, f}) += w * mag[static_cast<std::size_t>(f)];
      }
      if (k < n_old) {
        for (int64_t f = 0; f < 17; ++f) e.at({h, k, f}) += std::pow(a, frames) * old.ema.at({h, k, f});
      }
    }
  return e;
}

struct RefStats {
  double count = 0;
  std::vector<double> mean = std::vector<double>(17, 0.0), var = std::vector<double>(17, 0.0);
};

// Direct statistics over all [H, n] vectors.
inline RefStats RefStatsOf(const Array& e) {
  RefStats s;
  const int64_t rows = e.shape[0] * e.shape[1];
  s.count = static_cast<double>(rows);
  for (int64_t f = 0; f < 17; ++f) {
    double sum = 0;
    for (int64_t r = 0; r < rows; ++r) sum += e.data[static_cast<std::size_t>(r * 17 + f)];
    const double mean = sum / static_cast<double>(rows);
    double ss = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const double d = e.data[static_cast<std::size_t>(r * 17 + f)] - mean;
      ss += d * d;
    }
    s.mean[static_cast<std::size_t>(f)] = mean;
    s.var[static_cast<std::size_t>(f)] = ss / static_cast<double>(rows);
  }
  return s;
}

// Features [H, n, 25]: recency embedding, then z-scored EMA (statistics applied in float32).
inline Array RefFeatures(const Array& ema, const Array& positions, const RefStats& stats) {
  const int64_t h_kv = ema.shape[0], n = ema.shape[1];
  Array x({h_kv, n, 25});
  for (int64_t h = 0; h < h_kv; ++h)
    for (int64_t k = 0; k < n; ++k) {
      const double r = positions.at({h, n - 1}) - positions.at({h, k});
      for (int64_t i = 0; i < 4; ++i) {
        const double freq = 1.0 / std::pow(50000.0, static_cast<double>(i) / 4.0);
        x.at({h, k, i}) = static_cast<float>(std::sin(r * freq));
        x.at({h, k, 4 + i}) = static_cast<float>(std::cos(r * freq));
      }
      for (int64_t f = 0; f < 17; ++f) {
        const float mean = static_cast<float>(stats.mean[static_cast<std::size_t>(f)]);
        const float sd = std::max(std::sqrt(static_cast<float>(stats.var[static_cast<std::size_t>(f)])), 1e-7f);
        x.at({h, k, 8 + f}) = (static_cast<float>(ema.at({h, k, f})) - mean) / sd;
      }
    }
  return x;
}

// BAM with an explicit n x n mask (spec §4.1-4.2), parameters at the offsets of the spec's table.
inline std::vector<double> RefBamScores(const std::vector<float>& p, int64_t hidden, const Array& x, int64_t head) {
  const int64_t n = x.shape[1], d = 25, h3 = 3 * hidden;
  const int64_t off_bqkv = d * h3, off_wo = off_bqkv + h3, off_bo = off_wo + hidden * 50, off_wf = off_bo + 50,
                off_bf = off_wf + 25;
  auto P = [&](int64_t i) { return static_cast<double>(p[static_cast<std::size_t>(i)]); };
  std::vector<double> q(static_cast<std::size_t>(n * hidden)), k(q.size()), v(q.size());
  for (int64_t t = 0; t < n; ++t)
    for (int64_t o = 0; o < h3; ++o) {
      double acc = P(off_bqkv + o);
      for (int64_t i = 0; i < d; ++i) acc += x.at({head, t, i}) * P(i * h3 + o);
      auto& dst = o < hidden ? q : (o < 2 * hidden ? k : v);
      dst[static_cast<std::size_t>(t * hidden + o % hidden)] = acc;
    }
  std::vector<double> scores(static_cast<std::size_t>(n));
  const double lowest = -std::numeric_limits<float>::max();
  for (int64_t i = 0; i < n; ++i) {
    std::vector<double> logits(static_cast<std::size_t>(n));
    double mx = -1e300;
    for (int64_t j = 0; j < n; ++j) {
      double dot = 0;
      for (int64_t c = 0; c < hidden; ++c) {
        dot += q[static_cast<std::size_t>(i * hidden + c)] * k[static_cast<std::size_t>(j * hidden + c)];
      }
      logits[static_cast<std::size_t>(j)] = dot / std::sqrt(static_cast<double>(hidden)) + (j < i ? lowest : 0.0);
      mx = std::max(mx, logits[static_cast<std::size_t>(j)]);
    }
    double z = 0;
    for (auto& l : logits) z += (l = std::exp(l - mx));
    std::vector<double> o(static_cast<std::size_t>(hidden), 0.0);
    for (int64_t j = 0; j < n; ++j)
      for (int64_t c = 0; c < hidden; ++c) {
        o[static_cast<std::size_t>(c)] += logits[static_cast<std::size_t>(j)] / z * v[static_cast<std::size_t>(j * hidden + c)];
      }
    double s = P(off_bf);
    for (int64_t f = 0; f < d; ++f) {
      double r = P(off_bo + f), m = P(off_bo + d + f);
      for (int64_t c = 0; c < hidden; ++c) {
        r += o[static_cast<std::size_t>(c)] * P(off_wo + c * 50 + f);
        m += o[static_cast<std::size_t>(c)] * P(off_wo + c * 50 + d + f);
      }
      const double y = x.at({head, i, f}) * (1.0 + m) + r;
      s += y * P(off_wf + f);
    }
    scores[static_cast<std::size_t>(i)] = s;
  }
  return scores;
}

// Binary selection as the reference writes it: newest forced to +max, per head stable ascending sort,
// discard = min over heads of #(s < 0), keep the rest, re-sorted by index.
inline std::vector<std::vector<int64_t>> RefBinarySelect(std::vector<std::vector<double>> scores) {
  std::size_t discard = std::numeric_limits<std::size_t>::max();
  std::vector<std::vector<int64_t>> order(scores.size());
  for (std::size_t h = 0; h < scores.size(); ++h) {
    scores[h].back() = std::numeric_limits<float>::max();
    order[h].resize(scores[h].size());
    std::iota(order[h].begin(), order[h].end(), 0);
    std::stable_sort(order[h].begin(), order[h].end(),
                     [&](int64_t a, int64_t b) { return scores[h][static_cast<std::size_t>(a)] < scores[h][static_cast<std::size_t>(b)]; });
    std::size_t below = 0;
    for (double s : scores[h]) below += s < 0;
    discard = std::min(discard, below);
  }
  for (auto& o : order) {
    o.erase(o.begin(), o.begin() + static_cast<std::ptrdiff_t>(discard));
    std::sort(o.begin(), o.end());
  }
  return order;
}

// Keeps rows `keep[h]` of every per-token array of the state.
inline RefLayerState RefGather(const RefLayerState& s, const std::vector<std::vector<int64_t>>& keep) {
  const int64_t h_kv = static_cast<int64_t>(keep.size()), k = static_cast<int64_t>(keep[0].size());
  RefLayerState out{Array({h_kv, k, 16}), Array({h_kv, k, 17}), Array({h_kv, k})};
  for (int64_t h = 0; h < h_kv; ++h)
    for (int64_t i = 0; i < k; ++i) {
      const int64_t src = keep[static_cast<std::size_t>(h)][static_cast<std::size_t>(i)];
      for (int64_t t = 0; t < 16; ++t) out.carry.at({h, i, t}) = s.carry.at({h, src, t});
      for (int64_t f = 0; f < 17; ++f) out.ema.at({h, i, f}) = s.ema.at({h, src, f});
      out.positions.at({h, i}) = s.positions.at({h, src});
    }
  return out;
}

}  // namespace namm::testing
