#include "namm/worker/model_fingerprint.h"

#include <openssl/evp.h>

#include <sys/stat.h>

#include <algorithm>
#include <fstream>
#include <memory>
#include <vector>

#include "namm/file_util.h"

namespace namm::worker {

namespace {

bool IsRegularFile(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string FileName(const std::string& path) { return path.substr(path.find_last_of('/') + 1); }

// The files that define the model's behaviour, sorted by name.
Result<std::vector<std::string>> ModelFiles(const std::string& model_path) {
  if (!is_directory(model_path)) return std::vector<std::string>{model_path};
  NAMM_ASSIGN_OR_RETURN(std::vector<std::string> names, list_directory(model_path));
  const std::string prefix = model_path.back() == '/' ? model_path : model_path + "/";
  std::vector<std::string> files;
  const std::string extension = ".safetensors";
  for (const std::string& name : names) {
    const bool safetensors = name.size() > extension.size() &&
                             name.compare(name.size() - extension.size(), extension.size(), extension) == 0;
    if ((name == "config.json" || safetensors) && IsRegularFile(prefix + name)) files.push_back(prefix + name);
  }
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
  if (!tokenizer_path.empty() && !is_directory(tokenizer_path) &&
      std::find(files.begin(), files.end(), tokenizer_path) == files.end()) {
    files.emplace_back(tokenizer_path);
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
