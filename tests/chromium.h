// Opening the project's HTML reports in headless Chromium (Debian's `chromium`, installed by
// scripts/install-deps.sh): the DOM after the page's scripts ran.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "process_util.h"
#include "temp_path.h"

namespace namm::testing {

inline bool ChromiumInstalled() { return RunProcess("command -v chromium").exit_code == 0; }

// The rendered DOM of a local HTML file. Flags as the machine notes prescribe for a closed network.
inline std::string RenderedDom(const std::string& html_path) {
  const std::string profile = TempPath("chromium-profile");
  const auto r = RunProcess(
      "timeout 120 chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run "
      "--disable-background-networking --disable-component-update --disable-sync "
      "--user-data-dir=" +
      profile + " --dump-dom 'file://" + html_path + "' 2>/dev/null");
  return r.exit_code == 0 ? r.output : "";
}

// Checks what every report page must show once rendered: its script ran without error, and at least
// `min_curves` curves with two points or more.
inline void ExpectRenderedWithCurves(const std::string& dom, int min_curves) {
  EXPECT_NE(dom.find("data-ready=\"1\""), std::string::npos) << "the page's script did not finish";
  EXPECT_EQ(dom.find("data-script-error"), std::string::npos) << "the page reported a script error";
  int curves = 0;
  for (std::size_t at = dom.find("<polyline class=\"curve\""); at != std::string::npos;
       at = dom.find("<polyline class=\"curve\"", at + 1)) {
    const std::size_t end = dom.find('>', at);
    const std::size_t points = dom.find(" points=\"", at);
    if (points == std::string::npos || points > end) continue;
    const std::size_t close = dom.find('"', points + 9);
    if (dom.substr(points + 9, close - points - 9).find(' ') != std::string::npos)
      ++curves;  // two points or more
  }
  EXPECT_GE(curves, min_curves) << "curves with at least two points";
}

}  // namespace namm::testing
