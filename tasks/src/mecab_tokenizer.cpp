#include "namm/tasks/mecab_tokenizer.h"

#include <mecab.h>

#include <cstdlib>
#include <mutex>

#include "namm/file_util.h"

namespace namm::tasks {

namespace {
constexpr const char* kDebianUnidic = "/var/lib/mecab/dic/unidic";
}  // namespace

struct MecabTokenizer::Impl {
  mecab_model_t* model = nullptr;
  ~Impl() {
    if (model != nullptr) mecab_model_destroy(model);
  }
};

MecabTokenizer::MecabTokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
MecabTokenizer::~MecabTokenizer() = default;

Result<std::shared_ptr<const MecabTokenizer>> MecabTokenizer::Open(const std::string& dicdir) {
  if (!is_directory(dicdir)) {
    return Status::NotFound(dicdir + ": no MeCab dictionary (install unidic-mecab, or set NAMM_MECAB_DICDIR)");
  }
  // An empty resource file: every setting comes from the dictionary directory.
  const std::string args = "-r /dev/null -d " + dicdir;
  auto impl = std::make_unique<Impl>();
  impl->model = mecab_model_new2(args.c_str());
  if (impl->model == nullptr) {
    return Status::FailedPrecondition("MeCab cannot open the dictionary " + dicdir + ": " + mecab_strerror(nullptr));
  }
  return std::shared_ptr<const MecabTokenizer>(new MecabTokenizer(std::move(impl)));
}

Result<std::shared_ptr<const MecabTokenizer>> MecabTokenizer::Default() {
  static std::once_flag once;
  static Result<std::shared_ptr<const MecabTokenizer>> instance = Status::Internal("not opened");
  std::call_once(once, [] {
    const char* env = std::getenv("NAMM_MECAB_DICDIR");
    instance = Open(env != nullptr && *env != '\0' ? env : kDebianUnidic);
  });
  return instance;
}

std::vector<std::string> MecabTokenizer::Surfaces(const std::string& text) const {
  std::vector<std::string> out;
  // A tagger and a lattice per call: MeCab models are shareable between threads, taggers are not.
  mecab_t* tagger = mecab_model_new_tagger(impl_->model);
  mecab_lattice_t* lattice = mecab_model_new_lattice(impl_->model);
  mecab_lattice_set_sentence2(lattice, text.data(), text.size());
  if (mecab_parse_lattice(tagger, lattice)) {
    for (const mecab_node_t* node = mecab_lattice_get_bos_node(lattice); node != nullptr; node = node->next) {
      if (node->stat == MECAB_NOR_NODE || node->stat == MECAB_UNK_NODE) out.emplace_back(node->surface, node->length);
    }
  }
  mecab_lattice_destroy(lattice);
  mecab_destroy(tagger);
  return out;
}

}  // namespace namm::tasks
