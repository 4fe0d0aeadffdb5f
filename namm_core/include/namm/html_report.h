// Self-contained HTML reports: line charts as inline SVG and a page with its style and a small script inline,
// so a report opens anywhere without a network (no CDN, no external file). Shared by `namm-worker eval`
// (results.html) and `namm-coordinator report` (report.html).
//
// The page's script adds hover read-outs to the charts' points and, once it has run, marks the page
// <body data-ready="1">; a script error marks it data-script-error instead. Tests open pages in headless
// Chromium and check both.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace namm {

struct ChartSeries {
  std::string name;
  std::vector<std::pair<double, double>>
      points;  // (x, y), drawn in the given order; non-finite points skipped
  bool dashed = false;
};

struct ChartOptions {
  std::string title, x_label, y_label;
  int width = 640, height = 320;
  std::optional<double> x_min, x_max, y_min, y_max;  // default: the data's range, padded
  // Vertical markers (e.g. stage boundaries): (x, label).
  std::vector<std::pair<double, std::string>> x_markers;
};

// An <svg> element, styled by its own attributes so that it also stands alone as an .svg file: axes with
// ticks, one polyline per series (class "curve", with data-series), a marker per point (class "point", with
// data-x / data-y / data-series for the read-out), and a legend. A series of more than 2,000 points is drawn
// through the first, lowest, highest and last points of each of 500 spans (its envelope; callers keep the data).
std::string render_line_chart(const std::vector<ChartSeries>& series, const ChartOptions& options);

// Text escaped for HTML element content and attribute values.
std::string html_escape(const std::string& text);

// A whole page: <!DOCTYPE html>, the title, the inline style and script, and `body_html`.
std::string html_page(const std::string& title, const std::string& body_html);

// A <table> with a header row; cells are escaped, except in `raw_html_columns` (cells the caller built as HTML,
// e.g. links).
std::string html_table(const std::vector<std::string>& header, const std::vector<std::vector<std::string>>& rows,
                       const std::vector<std::size_t>& raw_html_columns = {});

// A number with `digits` decimals (at most 20), from 1e15 on in 17 significant digits with an exponent, or "" for
// NaN.
std::string format_number(double value, int digits);

// A CSV field (RFC 4180), for the reports' CSV files: quoted when it holds a comma, a quote or a line break.
std::string csv_field(const std::string& text);

}  // namespace namm
