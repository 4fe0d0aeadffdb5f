// namm-tool score: run a NAMM on recorded attention of one layer, update by update.
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <sys/stat.h>

#include <cstring>
#include <iostream>

#include "commands.h"
#include "namm/kv_cache.h"
#include "namm/dtype.h"
#include "namm/namm_file.h"
#include "namm/policies/namm_policy.h"
#include "namm/npy.h"

namespace namm::tool {

namespace {

struct ScoreOptions {
  std::string namm_path;
  std::vector<std::string> attention_paths;
  int64_t kv_heads = 0;  // 0: one KV head per query head
  std::string positions_path;
  std::string out_dir;
};

Status MakeDirectory(const std::string& path) {
  if (::mkdir(path.c_str(), 0755) != 0 && errno != EEXIST) {
    return Status::IOError("cannot create directory " + path + ": " + std::strerror(errno));
  }
  return Status::Ok();
}

// Positions of update `u`'s n_new tokens: a row of --positions, or continuing after `last`.
Result<at::Tensor> UpdatePositions(const at::Tensor& given, const std::string& path, std::size_t u, int64_t n_new,
                                   int64_t last) {
  at::Tensor positions;
  if (given.defined() && given.dim() == 2) {
    positions = given[static_cast<int64_t>(u)];
  } else if (given.defined() && u == 0) {
    positions = given;
  } else {
    return at::arange(last + 1, last + 1 + n_new, at::TensorOptions().dtype(at::kLong));
  }
  if (positions.size(0) != n_new) {
    return Status::InvalidArgument(path + ": update " + std::to_string(u) + " has " + std::to_string(n_new) +
                                   " new tokens but " + std::to_string(positions.size(0)) + " positions");
  }
  if (positions[0].item<int64_t>() <= last ||
      (n_new > 1 && !positions.diff().gt(0).all().item<bool>())) {
    return Status::InvalidArgument(path + ": positions of update " + std::to_string(u) +
                                   " must be strictly increasing and after every earlier position (" +
                                   std::to_string(last) + ")");
  }
  return positions;
}

Result<at::Tensor> ReadAttention(const std::string& path) {
  NAMM_ASSIGN_OR_RETURN(at::Tensor a, read_npy(path));
  if (a.dim() != 3) {
    return Status::InvalidArgument(path + ": attention must be [q_heads, n_new, n_keys], got shape " +
                                   shape_to_string(a.sizes().vec()));
  }
  if (!at::isFloatingType(a.scalar_type())) {
    return Status::InvalidArgument(path + ": attention must be float32, got " + at::toString(a.scalar_type()));
  }
  if (a.size(0) == 0) return Status::InvalidArgument(path + ": attention has no query heads (shape [0, ...])");
  a = a.to(at::kFloat);
  if (!a.isfinite().all().item<bool>()) return Status::InvalidArgument(path + ": attention has non-finite values");
  if (a.numel() > 0 && (a.min().item<float>() < 0.0f || a.max().item<float>() > 1.0f)) {
    return Status::InvalidArgument(path + ": attention probabilities must lie in [0, 1]");
  }
  return a;
}

Status RunScoreImpl(const ScoreOptions& o) {
  NAMM_ASSIGN_OR_RETURN(NammModel model, read_namm_file(o.namm_path));
  NAMM_ASSIGN_OR_RETURN(std::unique_ptr<NammPolicy> policy, NammPolicy::Create(model));
  policy->set_tracing(true);
  at::Tensor given_positions;
  if (!o.positions_path.empty()) {
    NAMM_ASSIGN_OR_RETURN(given_positions, read_npy(o.positions_path));
    if ((given_positions.dim() != 1 && given_positions.dim() != 2) ||
        (given_positions.scalar_type() != at::kLong && given_positions.scalar_type() != at::kInt)) {
      return Status::InvalidArgument(o.positions_path + ": positions must be int64 [n_new] (first update) or [" +
                                     "n_updates, n_new], got " + at::toString(given_positions.scalar_type()) + " " +
                                     shape_to_string(given_positions.sizes().vec()));
    }
    given_positions = given_positions.to(at::kLong);
    const auto updates = static_cast<int64_t>(o.attention_paths.size());
    if (given_positions.dim() == 2 && given_positions.size(0) != updates) {
      return Status::InvalidArgument(o.positions_path + ": has positions for " +
                                     std::to_string(given_positions.size(0)) + " updates, but " +
                                     std::to_string(updates) + " attention files were given");
    }
  }
  NAMM_RETURN_IF_ERROR(MakeDirectory(o.out_dir));

  std::unique_ptr<LayerKVCache> cache;
  int64_t q_heads = 0, last_position = -1;
  for (std::size_t u = 0; u < o.attention_paths.size(); ++u) {
    const std::string& path = o.attention_paths[u];
    NAMM_ASSIGN_OR_RETURN(at::Tensor attention, ReadAttention(path));
    if (!cache) {
      q_heads = attention.size(0);
      const int64_t kv_heads = o.kv_heads > 0 ? o.kv_heads : q_heads;
      if (q_heads % kv_heads != 0) {
        return Status::InvalidArgument(path + ": " + std::to_string(q_heads) + " query heads are not a multiple of " +
                                       "--kv-heads " + std::to_string(kv_heads));
      }
      cache = std::make_unique<LayerKVCache>(kv_heads, 0, at::TensorOptions().dtype(at::kFloat),
                                             policy->token_state());
    }
    const int64_t n_new = attention.size(1);
    if (attention.size(0) != q_heads) {
      return Status::InvalidArgument(path + ": " + std::to_string(attention.size(0)) + " query heads, but " +
                                     o.attention_paths[0] + " has " + std::to_string(q_heads));
    }
    if (n_new <= 0 || n_new % kStftHop != 0) {
      return Status::InvalidArgument(path + ": n_new = " + std::to_string(n_new) + " new queries; an update needs a " +
                                     "positive multiple of " + std::to_string(kStftHop) + " (the reference uses 512)");
    }
    if (attention.size(2) != cache->size() + n_new) {
      return Status::InvalidArgument(
          path + ": n_keys = " + std::to_string(attention.size(2)) + ", expected " +
          std::to_string(cache->size() + n_new) + " (" + std::to_string(cache->size()) + " tokens retained " +
          (u == 0 ? "(a fresh sequence)" : "by the previous update") + " + " + std::to_string(n_new) + " new)");
    }
    NAMM_ASSIGN_OR_RETURN(at::Tensor positions,
                          UpdatePositions(given_positions, o.positions_path, u, n_new, last_position));
    last_position = positions[n_new - 1].item<int64_t>();

    NAMM_RETURN_IF_ERROR(cache->Append(at::Tensor(), at::Tensor(), positions));
    NAMM_RETURN_IF_ERROR(observe_newest(*policy, 0, attention, *cache).WithContext(path));
    NAMM_ASSIGN_OR_RETURN(at::Tensor keep, policy->Select(0, *cache));
    const NammPolicy::Trace& trace = policy->last_trace();

    const std::string dir = o.out_dir + "/update_" + std::to_string(u);
    NAMM_RETURN_IF_ERROR(MakeDirectory(dir));
    NAMM_RETURN_IF_ERROR(write_npy(dir + "/features.npy", trace.features));
    NAMM_RETURN_IF_ERROR(write_npy(dir + "/scores.npy", trace.scores));
    NAMM_RETURN_IF_ERROR(write_npy(dir + "/keep.npy", keep));
    const int64_t n_keys = cache->size();
    NAMM_RETURN_IF_ERROR(cache->Gather(keep));
    std::cout << "update " << u << ": " << n_keys << " keys -> " << cache->size() << " kept per head (scores in ["
              << trace.scores.min().item<float>() << ", " << trace.scores.max().item<float>() << "]) -> " << dir
              << "\n";
  }
  if (model.norm_state == NormState::kCollecting) {
    std::cout << "normalization statistics were collecting: gathered " << policy->normalizer().stats().count
              << " samples\n";
  }
  return Status::Ok();
}

}  // namespace

void AddScoreCommand(CLI::App& app, Action& run) {
  auto options = std::make_shared<ScoreOptions>();
  CLI::App* cmd = app.add_subcommand(
      "score",
      "Run a NAMM on recorded attention of one layer. Each --attention file is float32 [q_heads, n_new, n_keys]:\n"
      "the attention probabilities of one update's n_new new queries (512 in the reference) over the layer's\n"
      "cache: the tokens retained by the previous update, in order, then the n_new new ones. The first file is a\n"
      "fresh sequence (n_keys = n_new). Writes DIR/update_<i>/{features,scores,keep}.npy for i = 0, 1, ...");
  cmd->add_option("--namm", options->namm_path, "NAMM file")->required()->check(CLI::ExistingFile);
  cmd->add_option("--attention", options->attention_paths, "Attention .npy of one update (repeat, in order)")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--kv-heads", options->kv_heads,
                  "KV heads; query head h belongs to KV head h / (q_heads / kv_heads) (default: q_heads)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--positions", options->positions_path,
                  "int64 absolute positions of the new tokens: [n_new] for the first update (later ones follow on)"
                  " or [n_updates, n_new]; default 0, 1, 2, ...")
      ->check(CLI::ExistingFile);
  cmd->add_option("--out", options->out_dir, "Output directory")->required();
  cmd->callback([options, &run] {
    run = [options] {
      Status s = RunScoreImpl(*options);
      return s.ok() ? 0 : Fail(s.message());
    };
  });
}

}  // namespace namm::tool
