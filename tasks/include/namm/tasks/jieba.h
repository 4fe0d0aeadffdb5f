// Chinese word segmentation identical to jieba 0.42.1's precise mode with HMM (`jieba.cut(text,
// cut_all=False)`), which LongBench's Chinese metrics use. It reads jieba's own dictionary and HMM tables from
// a jieba installation (Debian's python3-jieba: /usr/lib/python3/dist-packages/jieba); nothing is copied.
//
// Algorithm (as jieba): split the text into runs of [\u4E00-\u9FD5a-zA-Z0-9+#&._%-]; other characters are
// single tokens except "\r\n" and whitespace, kept as they are. In each run, build the DAG of dictionary
// words, pick the route of maximum sum of log(freq / total) (ties to the longer word), and pass each stretch
// of consecutive single characters that is not itself a dictionary word to the BMES HMM (Viterbi).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "namm/status.h"

namespace namm::tasks {

class Jieba {
 public:
  // Loads `data_dir`/dict.txt and `data_dir`/finalseg/prob_{start,trans,emit}.py.
  static Result<std::shared_ptr<const Jieba>> Load(const std::string& data_dir);
  // The process-wide segmenter from $NAMM_JIEBA_DIR or Debian's location, loaded on first use (thread-safe).
  static Result<std::shared_ptr<const Jieba>> Default();

  // jieba.cut(text, cut_all=False, HMM=True) as a list of words (UTF-8). Thread-safe.
  std::vector<std::string> Cut(const std::string& text) const;

  ~Jieba();
  Jieba(const Jieba&) = delete;
  Jieba& operator=(const Jieba&) = delete;

 private:
  struct Data;
  explicit Jieba(std::unique_ptr<Data> data);
  std::unique_ptr<Data> data_;
};

}  // namespace namm::tasks
