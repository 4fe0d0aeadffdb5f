#include "namm/worker/model_fingerprint.h"

#include <openssl/evp.h>

#include <sys/stat.h>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <memory>
#include <vector>

#include "namm/file_util.h"

namespace namm::worker {

namespace {

bool IsRegularFile(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// Whether two paths name one file (however spelled: "dir/" and "dir", a link).
bool SameFile(const std::string& a, const std::string& b) {
  struct stat sa {}, sb {};
  return ::stat(a.c_str(), &sa) == 0 && ::stat(b.c_str(), &sb) == 0 && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

std::string FileName(const std::string& path) { return path.substr(path.find_last_of('/') + 1); }

bool EndsWith(const std::string& s, const std::string& suffix) {
  return s.size() > suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// A Hugging Face tokenizer's files: what HfTokenizer::Load reads (tokenizer.json, tokenizer_config.json) and what
// a chat prompt is made with (the template and the special tokens that override the config's).
constexpr const char* kTokenizerFiles[] = {"chat_template.jinja", "special_tokens_map.json", "tokenizer.json",
                                           "tokenizer_config.json"};

// The files of `dir` among `wanted` or, with `safetensors`, named *.safetensors: their paths, in name order.
Result<std::vector<std::string>> FilesOf(const std::string& dir, const std::vector<std::string>& wanted,
                                         bool safetensors) {
  NAMM_ASSIGN_OR_RETURN(std::vector<std::string> names, list_directory(dir));
  const std::string prefix = dir.back() == '/' ? dir : dir + "/";
  std::vector<std::string> files;
  for (const std::string& name : names) {
    const bool listed = std::find(wanted.begin(), wanted.end(), name) != wanted.end();
    if ((listed || (safetensors && EndsWith(name, ".safetensors"))) && IsRegularFile(prefix + name)) {
      files.push_back(prefix + name);
    }
  }
  return files;
}

// The files that define the model's behaviour: a llama2.c checkpoint; or a Hugging Face directory's weights, its
// architecture and generation settings (generation_config.json's end-of-sequence ids end answers) and the
// tokenizer files beside them (the tokenizer a directory's model is run with by default), in name order.
Result<std::vector<std::string>> ModelFiles(const std::string& model_path) {
  if (!is_directory(model_path)) return std::vector<std::string>{model_path};
  std::vector<std::string> wanted = {"config.json", "generation_config.json"};
  wanted.insert(wanted.end(), std::begin(kTokenizerFiles), std::end(kTokenizerFiles));
  NAMM_ASSIGN_OR_RETURN(std::vector<std::string> files, FilesOf(model_path, wanted, /*safetensors=*/true));
  const bool weights_or_config = std::any_of(files.begin(), files.end(), [](const std::string& f) {
    return EndsWith(f, "/config.json") || EndsWith(f, ".safetensors");
  });
  if (!weights_or_config) return std::vector<std::string>{};
  return files;
}

// The files of the tokenizer given apart from the model: a directory's tokenizer files; a tokenizer file (a
// tokenizer.json or a llama2.c one) with the settings beside it (`--chat` reads its template from there).
Result<std::vector<std::string>> TokenizerFiles(const std::string& tokenizer_path) {
  const std::vector<std::string> wanted(std::begin(kTokenizerFiles), std::end(kTokenizerFiles));
  if (is_directory(tokenizer_path)) return FilesOf(tokenizer_path, wanted, /*safetensors=*/false);
  NAMM_ASSIGN_OR_RETURN(std::vector<std::string> files, FilesOf(parent_directory(tokenizer_path), wanted, false));
  files.erase(std::remove_if(files.begin(), files.end(), [](const std::string& f) { return EndsWith(f, "/tokenizer.json"); }),
              files.end());
  files.push_back(tokenizer_path);
  std::sort(files.begin(), files.end(), [](const std::string& a, const std::string& b) { return FileName(a) < FileName(b); });
  return files;
}

std::string Printed(const unsigned char* digest, unsigned int length) {
  static const char* hex = "0123456789abcdef";
  std::string out = "sha256:";
  for (unsigned int i = 0; i < length; ++i) {
    out += hex[digest[i] >> 4];
    out += hex[digest[i] & 15];
  }
  return out;
}

// "sha256:<hex>" over `files`, each as its name, size and bytes, in the given order.
Result<std::string> Digest(const std::vector<std::string>& files) {
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  if (!ctx || EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) != 1) return Status::Internal("SHA-256 unavailable");
  std::vector<char> buffer(1 << 20);
  for (const std::string& file : files) {
    std::ifstream in(file, std::ios::binary);
    if (!in) return Status::IOError(file + ": cannot open for reading");
    NAMM_ASSIGN_OR_RETURN(const int64_t size, file_size(file));
    const std::string header = FileName(file) + '\0' + std::to_string(size) + '\0';
    EVP_DigestUpdate(ctx.get(), header.data(), header.size());
    while (in) {
      in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
      EVP_DigestUpdate(ctx.get(), buffer.data(), static_cast<std::size_t>(in.gcount()));
    }
    if (in.bad()) return Status::IOError(file + ": read failed");
  }
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  EVP_DigestFinal_ex(ctx.get(), digest, &length);
  return Printed(digest, length);
}

}  // namespace

Result<std::string> model_fingerprint(const std::string& model_path, const std::string& tokenizer_path) {
  if (!path_exists(model_path)) return Status::NotFound(model_path + ": no such model");
  NAMM_ASSIGN_OR_RETURN(std::vector<std::string> files, ModelFiles(model_path));
  if (files.empty()) return Status::NotFound(model_path + ": no config.json or *.safetensors to fingerprint");
  if (!tokenizer_path.empty()) {
    if (!path_exists(tokenizer_path)) return Status::NotFound(tokenizer_path + ": no such tokenizer");
    NAMM_ASSIGN_OR_RETURN(const std::vector<std::string> tokenizer_files, TokenizerFiles(tokenizer_path));
    // A file already covered (the tokenizer given is the model directory's own) counts once.
    for (const std::string& file : tokenizer_files) {
      const bool covered =
          std::any_of(files.begin(), files.end(), [&](const std::string& f) { return SameFile(f, file); });
      if (!covered) files.push_back(file);
    }
  }
  return Digest(files);
}

Result<std::string> text_fingerprint(const std::string& text) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  if (EVP_Digest(text.data(), text.size(), digest, &length, EVP_sha256(), nullptr) != 1) {
    return Status::Internal("SHA-256 unavailable");
  }
  return Printed(digest, length);
}

Result<std::string> file_fingerprint(const std::string& path) {
  if (!path_exists(path) || is_directory(path)) return Status::NotFound(path + ": no such file");
  return Digest({path});
}

}  // namespace namm::worker
