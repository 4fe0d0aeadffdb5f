#include "namm/html_report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <sstream>

namespace namm {

namespace {

// Colour-blind-safe palette (Okabe-Ito), then greys.
constexpr const char* kPalette[] = {"#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00",
                                    "#56B4E9", "#000000", "#B8A000", "#666666", "#999999"};
constexpr int kLegendColumns = 2;
constexpr std::size_t kLegendChars =
    44;  // longer names are cut with an ellipsis (the full one is the tooltip)

std::string Num(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f", v);
  return text;
}

// A "nice" tick step (1, 2 or 5 times a power of ten) giving about `count` ticks over `span` (> 0).
double TickStep(double span, int count) {
  const double raw = span / std::max(1, count);
  if (!(raw > 0) || !std::isfinite(raw)) return 1;
  const double power = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    if (m * power >= raw) return m * power;
  }
  return 10 * power;
}

std::string TickLabel(double v, double step) {
  const int digits = std::max(0, static_cast<int>(-std::floor(std::log10(step) + 1e-9)));
  return format_number(std::abs(v) < step * 1e-6 ? 0.0 : v, digits);
}

struct Range {
  double lo = std::numeric_limits<double>::infinity(), hi = -std::numeric_limits<double>::infinity();
  void Add(double v) {
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  // Pads an empty or zero-width range, and adds 5% on each side.
  void Finish(std::optional<double> fixed_lo, std::optional<double> fixed_hi) {
    if (!std::isfinite(lo)) lo = 0, hi = 1;
    // A flat range gets a width relative to its magnitude, so that lo + width > lo in floating point.
    if (hi - lo <= 1e-9 * std::max(1.0, std::abs(hi))) {
      const double half = 0.5 * std::max(1.0, std::abs(hi));
      lo -= half, hi += half;
    }
    const double pad = 0.05 * (hi - lo);
    lo = fixed_lo ? *fixed_lo : lo - pad;
    hi = fixed_hi ? *fixed_hi : hi + pad;
    if (!(hi > lo)) hi = lo + std::max(1.0, std::abs(lo));
  }
};

// A long series is drawn through each of kSpans spans' first, lowest, highest and last points (in order): the
// curve's envelope, which is all a chart a few hundred pixels wide can show. Drawing every point of a 100,000-
// generation run made a 137 MB page; the reports' CSVs keep every point.
constexpr std::size_t kSpans = 500;
constexpr std::size_t kMaxDrawnPoints = 4 * kSpans;

std::vector<std::pair<double, double>> DrawnPoints(const std::vector<std::pair<double, double>>& points) {
  std::vector<std::pair<double, double>> finite;
  for (const auto& [px, py] : points) {
    if (std::isfinite(px) && std::isfinite(py)) finite.emplace_back(px, py);
  }
  if (finite.size() <= kMaxDrawnPoints) return finite;
  std::vector<std::pair<double, double>> drawn;
  const std::size_t n = finite.size();
  for (std::size_t span = 0; span < kSpans; ++span) {
    const std::size_t begin = span * n / kSpans, end = (span + 1) * n / kSpans;
    if (begin == end) continue;
    const auto by_y = [](const auto& a, const auto& b) { return a.second < b.second; };
    const auto low = static_cast<std::size_t>(std::min_element(finite.begin() + begin, finite.begin() + end, by_y) - finite.begin());
    const auto high = static_cast<std::size_t>(std::max_element(finite.begin() + begin, finite.begin() + end, by_y) - finite.begin());
    std::size_t kept[] = {begin, low, high, end - 1};
    std::sort(std::begin(kept), std::end(kept));
    for (std::size_t k = 0; k < std::size(kept); ++k) {
      if (k == 0 || kept[k] != kept[k - 1]) drawn.push_back(finite[kept[k]]);
    }
  }
  return drawn;
}

}  // namespace

std::string format_number(double value, int digits) {
  if (std::isnan(value)) return "";
  char text[64];
  // From 1e15 on, every digit that a double holds and an exponent: fixed notation would run past the buffer (1e300
  // came out as 63 digits, cut short) and its decimals would mean nothing.
  if (std::abs(value) >= 1e15 && std::isfinite(value)) {
    std::snprintf(text, sizeof text, "%.17g", value);
  } else {
    std::snprintf(text, sizeof text, "%.*f", std::clamp(digits, 0, 20), value);
  }
  return text;
}

std::string csv_field(const std::string& text) {
  if (text.find_first_of(",\"\n\r") == std::string::npos) return text;
  std::string out = "\"";
  for (char c : text) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

std::string html_escape(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string render_line_chart(const std::vector<ChartSeries>& series, const ChartOptions& o) {
  const double left = 64, right = 16, top = o.title.empty() ? 16 : 36, bottom = 48;
  const double legend_row = 18;
  const auto legend_rows = static_cast<double>((series.size() + kLegendColumns - 1) / kLegendColumns);
  const double plot_w = o.width - left - right, plot_h = o.height - top - bottom;
  const double total_h = o.height + legend_rows * legend_row + 8;

  Range x, y;
  for (const auto& s : series) {
    for (const auto& [px, py] : s.points) {
      if (std::isfinite(px) && std::isfinite(py)) x.Add(px), y.Add(py);
    }
  }
  for (const auto& marker : o.x_markers) x.Add(marker.first);
  x.Finish(o.x_min, o.x_max);
  y.Finish(o.y_min, o.y_max);
  const auto sx = [&](double v) { return left + (v - x.lo) / (x.hi - x.lo) * plot_w; };
  const auto sy = [&](double v) { return top + plot_h - (v - y.lo) / (y.hi - y.lo) * plot_h; };

  std::ostringstream svg;
  svg << "<svg class=\"chart\" xmlns=\"http://www.w3.org/2000/svg\" font-family=\"sans-serif\" width=\""
      << o.width << "\" height=\"" << Num(total_h) << "\" viewBox=\"0 0 " << o.width << " " << Num(total_h)
      << "\" role=\"img\" aria-label=\"" << html_escape(o.title) << "\">\n";
  svg << "<rect width=\"100%\" height=\"100%\" fill=\"#fff\"/>\n";
  if (!o.title.empty()) {
    svg << "<text class=\"title\" font-size=\"14\" font-weight=\"600\" x=\"" << Num(left) << "\" y=\"20\">"
        << html_escape(o.title) << "</text>\n";
  }
  svg << "<rect class=\"frame\" fill=\"none\" stroke=\"#888\" x=\"" << Num(left) << "\" y=\"" << Num(top)
      << "\" width=\"" << Num(plot_w) << "\" height=\"" << Num(plot_h) << "\"/>\n";
  // Grid and ticks.
  const double x_step = TickStep(x.hi - x.lo, 6), y_step = TickStep(y.hi - y.lo, 5);
  // Ticks by integer index, at most 50 per axis, so that no step can fail to advance.
  const auto ticks = [](const Range& r, double step) {
    std::vector<double> at;
    const double first = std::ceil(r.lo / step);
    for (int i = 0; i < 50; ++i) {
      const double v = (first + i) * step;
      if (v > r.hi + 1e-9 * step) break;
      at.push_back(v);
    }
    return at;
  };
  for (double v : ticks(x, x_step)) {
    svg << "<line class=\"grid\" stroke=\"#eee\" x1=\"" << Num(sx(v)) << "\" y1=\"" << Num(top) << "\" x2=\""
        << Num(sx(v)) << "\" y2=\"" << Num(top + plot_h)
        << "\"/><text class=\"tick\" font-size=\"11\" fill=\"#444\" x=\"" << Num(sx(v)) << "\" y=\""
        << Num(top + plot_h + 16) << "\" text-anchor=\"middle\">" << TickLabel(v, x_step) << "</text>\n";
  }
  for (double v : ticks(y, y_step)) {
    svg << "<line class=\"grid\" stroke=\"#eee\" x1=\"" << Num(left) << "\" y1=\"" << Num(sy(v)) << "\" x2=\""
        << Num(left + plot_w) << "\" y2=\"" << Num(sy(v))
        << "\"/><text class=\"tick\" font-size=\"11\" fill=\"#444\" x=\"" << Num(left - 6) << "\" y=\""
        << Num(sy(v) + 4) << "\" text-anchor=\"end\">" << TickLabel(v, y_step) << "</text>\n";
  }
  svg << "<text class=\"label\" font-size=\"12\" x=\"" << Num(left + plot_w / 2) << "\" y=\""
      << Num(top + plot_h + 36) << "\" text-anchor=\"middle\">" << html_escape(o.x_label) << "</text>\n";
  svg << "<text class=\"label\" font-size=\"12\" transform=\"translate(14," << Num(top + plot_h / 2)
      << ") rotate(-90)\" text-anchor=\"middle\">" << html_escape(o.y_label) << "</text>\n";
  for (const auto& [mx, label] : o.x_markers) {
    svg << "<line class=\"marker\" stroke=\"#999\" stroke-dasharray=\"3 3\" x1=\"" << Num(sx(mx))
        << "\" y1=\"" << Num(top) << "\" x2=\"" << Num(sx(mx)) << "\" y2=\"" << Num(top + plot_h)
        << "\"/><text class=\"marker-label\" font-size=\"11\" fill=\"#444\" x=\"" << Num(sx(mx) + 3)
        << "\" y=\"" << Num(top + 12) << "\">" << html_escape(label) << "</text>\n";
  }
  // Series, the first drawn last so that it stays visible where others cover it.
  for (std::size_t i = series.size(); i-- > 0;) {
    const ChartSeries& s = series[i];
    const char* colour = kPalette[i % std::size(kPalette)];
    const std::vector<std::pair<double, double>> drawn = DrawnPoints(s.points);
    std::ostringstream points;
    for (std::size_t k = 0; k < drawn.size(); ++k) {
      points << (k ? " " : "") << Num(sx(drawn[k].first)) << "," << Num(sy(drawn[k].second));
    }
    svg << "<polyline class=\"curve\" data-series=\"" << html_escape(s.name) << "\" fill=\"none\" stroke=\""
        << colour << "\" stroke-width=\"2\"" << (s.dashed ? " stroke-dasharray=\"6 4\"" : "") << " points=\""
        << points.str() << "\"/>\n";
    for (const auto& [px, py] : drawn) {
      svg << "<circle class=\"point\" cx=\"" << Num(sx(px)) << "\" cy=\"" << Num(sy(py))
          << "\" r=\"3.5\" fill=\"" << colour << "\" data-series=\"" << html_escape(s.name) << "\" data-x=\""
          << format_number(px, 4) << "\" data-y=\"" << format_number(py, 4) << "\"/>\n";
    }
    const double lx = left + static_cast<double>(i % kLegendColumns) * (plot_w / kLegendColumns);
    const double ly = o.height + static_cast<double>(i / kLegendColumns) * legend_row;
    std::string label = s.name;
    if (label.size() > kLegendChars) {
      std::size_t cut = kLegendChars - 1;
      while (cut > 0 && (static_cast<unsigned char>(label[cut]) & 0xC0) == 0x80) --cut;  // a UTF-8 boundary
      label = label.substr(0, cut) + "…";
    }
    svg << "<line x1=\"" << Num(lx) << "\" y1=\"" << Num(ly) << "\" x2=\"" << Num(lx + 18) << "\" y2=\""
        << Num(ly) << "\" stroke=\"" << colour << "\" stroke-width=\"3\""
        << (s.dashed ? " stroke-dasharray=\"6 4\"" : "")
        << "/><text class=\"legend\" font-size=\"11\" fill=\"#444\" x=\"" << Num(lx + 24) << "\" y=\""
        << Num(ly + 4) << "\">"
        << "<title>" << html_escape(s.name) << "</title>" << html_escape(label) << "</text>\n";
  }
  svg << "</svg>\n";
  return svg.str();
}

std::string html_table(const std::vector<std::string>& header, const std::vector<std::vector<std::string>>& rows,
                       const std::vector<std::size_t>& raw_html_columns) {
  std::ostringstream out;
  out << "<table>\n<thead><tr>";
  for (const auto& h : header) out << "<th>" << html_escape(h) << "</th>";
  out << "</tr></thead>\n<tbody>\n";
  for (const auto& row : rows) {
    out << "<tr>";
    for (std::size_t c = 0; c < row.size(); ++c) {
      const bool raw = std::find(raw_html_columns.begin(), raw_html_columns.end(), c) != raw_html_columns.end();
      out << "<td>" << (raw ? row[c] : html_escape(row[c])) << "</td>";
    }
    out << "</tr>\n";
  }
  out << "</tbody>\n</table>\n";
  return out.str();
}

std::string html_page(const std::string& title, const std::string& body_html) {
  std::ostringstream out;
  out << "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>"
      << html_escape(title)
      << "</title>\n<style>\n"
         "body { font-family: system-ui, sans-serif; margin: 24px; color: #222; max-width: 1400px; }\n"
         "h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }\n"
         "table { border-collapse: collapse; margin: 8px 0; font-size: 0.9em; }\n"
         "th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: right; }\n"
         "th:first-child, td:first-child { text-align: left; }\n"
         ".charts { display: flex; flex-wrap: wrap; gap: 16px; }\n"
         "svg.chart { border: 1px solid #ddd; }\n"
         "#readout { position: fixed; pointer-events: none; background: #222; color: #fff; padding: 2px "
         "6px;\n"
         "  font-size: 12px; border-radius: 3px; display: none; }\n"
         ".meta { color: #555; font-size: 0.9em; } code { background: #f3f3f3; padding: 0 3px; }\n"
         "</style>\n</head>\n<body>\n"
      << body_html
      << "<div id=\"readout\"></div>\n<script>\n"
         "window.addEventListener('error', function () { document.body.dataset.scriptError = '1'; });\n"
         "(function () {\n"
         "  var readout = document.getElementById('readout');\n"
         "  document.querySelectorAll('circle.point').forEach(function (p) {\n"
         "    p.addEventListener('mouseenter', function (e) {\n"
         "      readout.textContent = p.dataset.series + ': (' + p.dataset.x + ', ' + p.dataset.y + ')';\n"
         "      readout.style.left = (e.clientX + 12) + 'px'; readout.style.top = (e.clientY + 12) + 'px';\n"
         "      readout.style.display = 'block';\n"
         "    });\n"
         "    p.addEventListener('mouseleave', function () { readout.style.display = 'none'; });\n"
         "  });\n"
         "  document.body.dataset.ready = '1';\n"
         "})();\n"
         "</script>\n</body>\n</html>\n";
  return out.str();
}

}  // namespace namm
