#include "namm/worker/model_fingerprint.h"

#include <openssl/evp.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <memory>
#include <vector>

#include "namm/file_util.h"

namespace namm::worker {

namespace {

namespace fs = std::filesystem;

// The files that define the model's behaviour, sorted.
std::vector<fs::path> ModelFiles(const std::string& model_path) {
  if (!is_directory(model_path)) return {fs::path(model_path)};
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(model_path)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_regular_file() && (name == "config.json" || entry.path().extension() == ".safetensors")) {
      files.push_back(entry.path());
    }
  }
  std::sort(files.begin(), files.end());
  return files;
}

// "sha256:<hex>" over `files`, each as its name, size and bytes, in the given order.
Result<std::string> Digest(const std::vector<fs::path>& files) {
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  if (!ctx || EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) != 1) return Status::Internal("SHA-256 unavailable");
  std::vector<char> buffer(1 << 20);
  for (const fs::path& file : files) {
    std::ifstream in(file, std::ios::binary);
    if (!in) return Status::IOError(file.string() + ": cannot open for reading");
    const std::string header = file.filename().string() + '\0' + std::to_string(fs::file_size(file)) + '\0';
    EVP_DigestUpdate(ctx.get(), header.data(), header.size());
    while (in) {
      in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
      EVP_DigestUpdate(ctx.get(), buffer.data(), static_cast<std::size_t>(in.gcount()));
    }
    if (in.bad()) return Status::IOError(file.string() + ": read failed");
  }
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  EVP_DigestFinal_ex(ctx.get(), digest, &length);
  static const char* hex = "0123456789abcdef";
  std::string out = "sha256:";
  for (unsigned int i = 0; i < length; ++i) {
    out += hex[digest[i] >> 4];
    out += hex[digest[i] & 15];
  }
  return out;
}

}  // namespace

Result<std::string> model_fingerprint(const std::string& model_path, const std::string& tokenizer_path) {
  if (!path_exists(model_path)) return Status::NotFound(model_path + ": no such model");
  std::vector<fs::path> files = ModelFiles(model_path);
  if (files.empty()) return Status::NotFound(model_path + ": no config.json or *.safetensors to fingerprint");
  if (!tokenizer_path.empty() && !is_directory(tokenizer_path) &&
      std::find(files.begin(), files.end(), fs::path(tokenizer_path)) == files.end()) {
    files.emplace_back(tokenizer_path);
  }
  return Digest(files);
}

Result<std::string> file_fingerprint(const std::string& path) {
  if (!path_exists(path) || is_directory(path)) return Status::NotFound(path + ": no such file");
  return Digest({fs::path(path)});
}

}  // namespace namm::worker
