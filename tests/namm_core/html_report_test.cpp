// Charts of the HTML reports: every point of a short series, the envelope of a long one.
#include "namm/html_report.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>

namespace namm {
namespace {

std::size_t Count(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (std::size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(HtmlReport, AShortSeriesDrawsEveryFinitePoint) {
  ChartSeries s{"fitness", {}, false};
  for (int g = 0; g < 10; ++g) s.points.emplace_back(g, g == 4 ? std::nan("") : 0.1 * g);
  const std::string svg = render_line_chart({s}, ChartOptions{});
  EXPECT_EQ(Count(svg, "<circle class=\"point\""), 9u);
  EXPECT_NE(svg.find("data-x=\"9.0000\" data-y=\"0.9000\""), std::string::npos);
  EXPECT_EQ(svg.find("data-x=\"4.0000\""), std::string::npos);
}

// A run of 100,000 generations: the page stays small, and what a reader looks for is still drawn — the first and
// last generations, and a one-generation spike and dip.
TEST(HtmlReport, ALongSeriesIsDrawnThroughItsEnvelope) {
  ChartSeries s{"fitness", {}, false};
  for (int g = 0; g < 100000; ++g) {
    const double y = g == 54321 ? 10.0 : g == 777 ? -10.0 : std::sin(g * 0.01);
    s.points.emplace_back(g, y);
  }
  const std::string svg = render_line_chart({s}, ChartOptions{});
  const std::size_t circles = Count(svg, "<circle class=\"point\"");
  EXPECT_LE(circles, 2000u);
  EXPECT_GE(circles, 1000u);
  EXPECT_LT(svg.size(), 400u * 1000u);
  for (const char* point : {"data-x=\"0.0000\"", "data-x=\"99999.0000\"", "data-x=\"54321.0000\" data-y=\"10.0000\"",
                            "data-x=\"777.0000\" data-y=\"-10.0000\""}) {
    EXPECT_NE(svg.find(point), std::string::npos) << point;
  }
  // Drawn in order of x.
  double last = -1;
  for (std::size_t at = svg.find("data-x=\""); at != std::string::npos; at = svg.find("data-x=\"", at + 1)) {
    const double x = std::stod(svg.substr(at + 8));
    EXPECT_GT(x, last);
    last = x;
  }
}

}  // namespace
}  // namespace namm
