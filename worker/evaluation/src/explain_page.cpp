#include "namm/worker/explain_page.h"

#include <sstream>

#include "namm/html_report.h"

namespace namm::worker {

namespace {

// The page's script: shades every token for the chosen layer (or all) from the eviction times in R.
constexpr const char* kScript = R"JS(
(function () {
  var tokens = document.querySelectorAll('#tokens .t');
  var length = R.length;
  function paint(layer) {
    var first = layer < 0 ? 0 : layer, last = layer < 0 ? R.layers - 1 : layer;
    for (var p = 0; p < tokens.length; ++p) {
      var kept = 0, stayed = 0, lanes = 0, t = tokens[p];
      if (p >= R.cached) {  // the last generated token is never run through the model
        t.dataset.headsKept = 0;
        t.title = '#' + p + ': never cached (generation ended with it)';
        continue;
      }
      for (var l = first; l <= last; ++l) {
        for (var h = 0; h < R.heads; ++h) {
          var e = R.evicted[(l * R.heads + h) * R.positions + p];
          if (e < 0) { ++kept; e = length; }
          stayed += length > p ? (e - p) / (length - p) : 1;
          ++lanes;
        }
      }
      var share = stayed / lanes;
      t.dataset.headsKept = kept;
      t.style.background = 'rgba(31, 119, 180, ' + (0.06 + 0.84 * share).toFixed(3) + ')';
      t.style.color = share > 0.55 ? '#fff' : '#222';
      t.classList.toggle('kept', kept > 0);
      t.title = '#' + p + ': stayed ' + Math.round(100 * share) + '% of its possible time; still held by ' + kept +
                ' of ' + lanes + ' heads' + (layer < 0 ? ' (all layers)' : ' (layer ' + layer + ')');
    }
    document.getElementById('tokens').dataset.explained = layer;
  }
  var select = document.getElementById('layer');
  select.addEventListener('change', function () { paint(parseInt(select.value, 10)); });
  paint(parseInt(select.value, 10));
})();
)JS";

}  // namespace

std::string render_explain_page(const ExplainInput& in) {
  const GenerationResult& r = *in.result;
  const Retention& retention = r.retention;
  std::ostringstream body;
  body << "<h1>What " << html_escape(in.policy) << " kept</h1>\n<p class=\"meta\">" << html_escape(in.model) << " &middot; "
       << in.prompt_tokens << " prompt tokens, " << (static_cast<int64_t>(in.token_texts.size()) - in.prompt_tokens)
       << " answer tokens &middot; final cache per layer (tokens per KV head):";
  for (int64_t size : r.final_cache_sizes) body << ' ' << size;
  body << "</p>\n";

  // Cache size after every memory update, one curve per layer, and the full cache for scale.
  std::vector<ChartSeries> series;
  for (int64_t l = 0; l < retention.layers; ++l) {
    ChartSeries s{"layer " + std::to_string(l), {}, false};
    for (const MemoryUpdateRecord& u : r.updates) {
      s.points.emplace_back(static_cast<double>(u.sequence_length),
                            static_cast<double>(u.cache_sizes[static_cast<std::size_t>(l)]));
    }
    series.push_back(std::move(s));
  }
  ChartSeries full{"full cache", {{0.0, 0.0}, {static_cast<double>(retention.positions), static_cast<double>(retention.positions)}}, true};
  series.push_back(std::move(full));
  ChartOptions chart;
  chart.title = "Cache size after every memory update";
  chart.x_label = "tokens processed";
  chart.y_label = "tokens kept per KV head";
  chart.y_min = 0;
  body << "<div class=\"charts\">" << render_line_chart(series, chart) << "</div>\n";

  body << "<h2>Tokens</h2>\n<p class=\"meta\">Darker: stayed longer in the cache (share of the time it could have "
          "stayed, mean over KV heads); hover a token for its numbers. Answer tokens are underlined.</p>\n"
       << "<label>Layer <select id=\"layer\"><option value=\"-1\">all layers (mean)</option>";
  for (int64_t l = 0; l < retention.layers; ++l) body << "<option value=\"" << l << "\">layer " << l << "</option>";
  body << "</select></label>\n<div id=\"tokens\">";
  for (std::size_t p = 0; p < in.token_texts.size(); ++p) {
    const bool answer = static_cast<int64_t>(p) >= in.prompt_tokens;
    const std::string& text = in.token_texts[p];
    body << "<span class=\"t" << (answer ? " answer" : "") << "\">" << (text.empty() ? "&#183;" : html_escape(text))
         << "</span>";
  }
  body << "</div>\n<style>#tokens { white-space: pre-wrap; line-height: 1.7; font-family: ui-monospace, monospace; "
          "font-size: 13px; margin-top: 8px; overflow-wrap: anywhere; } #tokens .t { border-radius: 2px; } #tokens .answer { "
          "text-decoration: underline; }</style>\n";
  // The eviction times, then the script that shades the tokens from them.
  body << "<script>\nvar R = {layers: " << retention.layers << ", heads: " << retention.kv_heads
       << ", positions: " << retention.positions << ", cached: " << retention.cached << ", length: " << in.token_texts.size() << ", evicted: [";
  for (std::size_t i = 0; i < retention.evicted_at.size(); ++i) body << (i ? "," : "") << retention.evicted_at[i];
  body << "]};\n" << kScript << "</script>\n";
  return html_page("What " + in.policy + " kept", body.str());
}

std::vector<std::string> explain_token_texts(const Tokenizer& tokenizer, const std::vector<int64_t>& ids) {
  std::vector<std::string> texts;
  std::string previous;  // the previous token decoded alone
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const std::string alone = tokenizer.Decode({ids[i]});
    const std::string both = i == 0 ? alone : tokenizer.Decode({ids[i - 1], ids[i]});
    texts.push_back(i > 0 && both.rfind(previous, 0) == 0 ? both.substr(previous.size()) : alone);
    previous = alone;
  }
  return texts;
}

}  // namespace namm::worker
