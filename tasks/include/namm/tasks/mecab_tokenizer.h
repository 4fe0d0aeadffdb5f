// Japanese word segmentation with MeCab and UniDic, as the reference's ChouBun metrics use it (fugashi's
// Tagger('-Owakati'): the surfaces of MeCab's nodes). The dictionary is Debian's unidic-mecab, compiled into
// /var/lib/mecab/dic/unidic; $NAMM_MECAB_DICDIR overrides it. The reference used whatever UniDic fugashi found,
// so segmentations can differ from it where UniDic versions differ.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "namm/status.h"

namespace namm::tasks {

class MecabTokenizer {
 public:
  static Result<std::shared_ptr<const MecabTokenizer>> Open(const std::string& dicdir);
  // The process-wide tokenizer (thread-safe lazy initialization).
  static Result<std::shared_ptr<const MecabTokenizer>> Default();

  // The surface forms of MeCab's word nodes, in order. Thread-safe.
  std::vector<std::string> Surfaces(const std::string& text) const;

  ~MecabTokenizer();
  MecabTokenizer(const MecabTokenizer&) = delete;
  MecabTokenizer& operator=(const MecabTokenizer&) = delete;

 private:
  struct Impl;
  explicit MecabTokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace namm::tasks
