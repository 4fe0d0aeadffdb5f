// The reference's ckpt.pt both ways, against Debian's python3-torch (tests/coordinator/reference_checkpoint.py):
// what namm writes, torch.load reads entry for entry; what torch.save writes in the reference's layout, namm
// imports exactly. And what namm must refuse: classes outside a checkpoint's, damaged archives.
#include <gtest/gtest.h>

#include <fstream>
#include <initializer_list>
#include <nlohmann/json.hpp>

#include "namm/coordinator/reference_checkpoint.h"
#include "namm/file_util.h"
#include "namm/namm_file.h"
#include "namm/torch_archive.h"
#include "../process_util.h"
#include "../temp_path.h"

namespace namm::coordinator {
namespace {

using namm::testing::RunProcess;
using namm::testing::TempPath;

const std::string kPython = NAMM_SYSTEM_PYTHON;
const std::string kScript = std::string(NAMM_SOURCE_DIR) + "/tests/coordinator/reference_checkpoint.py";

bool TorchInstalled() { return RunProcess(kPython + " -c 'import torch'").exit_code == 0; }
#define SKIP_WITHOUT_TORCH()                                                                               \
  if (!TorchInstalled()) GTEST_SKIP() << "python3-torch is not installed (scripts/install-deps.sh installs it)"

// A full-covariance state a few generations in: C, its eigensystem and the paths all non-trivial.
std::pair<CmaesParams, CmaesState> EvolvedState() {
  CmaesOptions options;
  options.population = 8;
  options.eigen_schedule = EigenSchedule::kEveryGeneration;
  CmaesParams params = make_cmaes_params(40, options).value();
  CmaesState state = initial_cmaes_state(params, std::vector<double>(40, 0.1)).value();
  for (int g = 0; g < 3; ++g) {
    const Population population = ask(params, state, static_cast<uint64_t>(g));
    std::vector<double> fitness;
    for (int64_t k = 0; k < population.size; ++k) fitness.push_back(-population.candidate(k)[0] * population.candidate(k)[1]);
    EXPECT_TRUE(tell(params, state, population, fitness).ok());
  }
  return {params, state};
}

TEST(ReferenceCheckpoint, WhatNammWritesTorchLoadsEntryForEntry) {
  SKIP_WITHOUT_TORCH();
  const auto [params, state] = EvolvedState();
  NormStats stats;
  stats.count = 4096;
  for (int i = 0; i < kStftBins; ++i) {
    stats.mean[static_cast<std::size_t>(i)] = 0.01 * i;
    stats.var[static_cast<std::size_t>(i)] = 0.5 + 0.02 * i;
  }
  const std::string ckpt = TempPath("ours_ckpt.pt"), expected = TempPath("ours_expected.json");
  ASSERT_TRUE(write_reference_checkpoint(ckpt, params, state, stats, 3, 1.0625).ok());
  const auto n = static_cast<std::size_t>(params.dimension);
  std::vector<double> c(n * n);
  for (std::size_t i = 0; i < n; ++i) {
    for (std::size_t j = 0; j <= i; ++j) c[i * n + j] = c[j * n + i] = state.covariance[i * n + j];
  }
  const nlohmann::json e = {{"n", params.dimension}, {"lambda", params.population}, {"mu", params.mu},
                            {"mean", state.mean}, {"best_member", state.best_member}, {"evo_path_c", state.path_c},
                            {"evo_path_sigma", state.path_sigma}, {"weights", params.weights}, {"C", c},
                            {"sample_D", state.eigen.scales}, {"mu_eff", params.mu_eff}, {"sigma", state.sigma},
                            {"best_fitness", state.best_fitness}, {"g", state.generation}, {"iter_num", 3},
                            {"best_val_loss", 1.0625}, {"stats_mean", stats.mean}, {"stats_var", stats.var},
                            {"stats_num", stats.count}};
  std::ofstream(expected) << e.dump();
  const auto checked = RunProcess(kPython + " " + kScript + " check " + ckpt + " " + expected + " 2>&1");
  EXPECT_EQ(checked.exit_code, 0) << checked.output;
  EXPECT_NE(checked.output.find("checked 22 entries"), std::string::npos) << checked.output;

  // And namm reads its own back.
  const auto back = read_reference_checkpoint(ckpt);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  ASSERT_EQ(back->mean.size(), n);
  for (std::size_t i = 0; i < n; ++i) EXPECT_EQ(back->mean[i], static_cast<double>(static_cast<float>(state.mean[i])));
  EXPECT_EQ(back->generation, 3);
  EXPECT_EQ(back->iter_num, 3);
  ASSERT_TRUE(back->norm_stats.has_value());
  EXPECT_EQ(back->norm_stats->count, 4096);
}

TEST(ReferenceCheckpoint, ACheckpointTorchSavedInTheReferencesLayoutImportsExactly) {
  SKIP_WITHOUT_TORCH();
  const std::string ckpt = TempPath("theirs_ckpt.pt"), numbers = TempPath("theirs.json"),
                    namm = TempPath("imported.safetensors");
  const auto written = RunProcess(kPython + " " + kScript + " write " + ckpt + " " + numbers + " 2>&1");
  ASSERT_EQ(written.exit_code, 0) << written.output;
  const auto e = nlohmann::json::parse(read_file(numbers).value());
  const auto imported = RunProcess(std::string(NAMM_COORDINATOR_PATH) + " import-checkpoint --checkpoint " + ckpt +
                                   " --out " + namm + " --force 2>&1");
  ASSERT_EQ(imported.exit_code, 0) << imported.output;
  const auto model = read_namm_file(namm);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const auto mean = e["mean"].get<std::vector<double>>();
  ASSERT_EQ(model->params.size(), mean.size());
  for (std::size_t i = 0; i < mean.size(); ++i) ASSERT_EQ(model->params[i], static_cast<float>(mean[i])) << i;
  EXPECT_EQ(model->norm_state, NormState::kFrozen);
  EXPECT_EQ(model->norm_stats.count, 123456);
  const auto stats_mean = e["stats_mean"].get<std::vector<double>>();
  for (std::size_t i = 0; i < stats_mean.size(); ++i) {
    EXPECT_EQ(static_cast<float>(model->norm_stats.mean[i]), static_cast<float>(stats_mean[i]));
  }
  EXPECT_EQ(model->metadata.at("iter_num"), "12");

  // The best member on request; a file that exists is kept without --force.
  const auto best = RunProcess(std::string(NAMM_COORDINATOR_PATH) + " import-checkpoint --params best --checkpoint " +
                               ckpt + " --out " + namm + " 2>&1");
  EXPECT_NE(best.exit_code, 0);
  EXPECT_NE(best.output.find("exists; pass --force"), std::string::npos) << best.output;
}

TEST(ReferenceCheckpoint, ClassesOutsideACheckpointAndDamagedArchivesAreRefused) {
  SKIP_WITHOUT_TORCH();
  // A pickle that would run code on load in Python is only ever read by name, and refused.
  const std::string evil = TempPath("evil.pt");
  const auto made = RunProcess(kPython + " -c \"import torch, collections; torch.save({'evolution_state': "
                               "collections.Counter(a=1)}, '" + evil + "')\" 2>&1");
  ASSERT_EQ(made.exit_code, 0) << made.output;
  const auto refused = read_reference_checkpoint(evil);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), Status::Code::kCorruption);
  EXPECT_NE(refused.status().message().find("collections.Counter"), std::string::npos) << refused.status().ToString();

  // Truncated, bit-flipped, and not a zip at all.
  const auto [params, state] = EvolvedState();
  const std::string good = TempPath("good_ckpt.pt");
  ASSERT_TRUE(write_reference_checkpoint(good, params, state, std::nullopt, 3, 0).ok());
  const std::string bytes = read_file(good).value();
  const auto damaged = [&](std::string content) { return parse_torch_archive(content, "damaged.pt").status(); };
  EXPECT_EQ(damaged(bytes.substr(0, bytes.size() / 2)).code(), Status::Code::kCorruption);
  std::string flipped = bytes;
  flipped[200] = static_cast<char>(flipped[200] ^ 0x40);  // inside data.pkl
  const Status crc = damaged(flipped);
  EXPECT_EQ(crc.code(), Status::Code::kCorruption);
  EXPECT_NE(crc.message().find("CRC"), std::string::npos) << crc.ToString();
  EXPECT_NE(damaged("{\"not\": \"a zip\"}").message().find("zip"), std::string::npos);
  // A checkpoint without normalization statistics imports without them.
  const auto back = read_reference_checkpoint(good);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_FALSE(back->norm_stats.has_value());
}

// A torch.save-shaped archive (stored zip, archive/data.pkl) around `pickle`, made with Python's zipfile.
std::string ArchiveWith(const std::string& pickle, const std::string& name) {
  const std::string pkl = TempPath(name + ".pkl"), out = TempPath(name + ".pt");
  EXPECT_TRUE(write_file_atomically(pkl, {pickle}).ok());
  const auto made = RunProcess(kPython + " -c \"import zipfile; z = zipfile.ZipFile('" + out +
                               "', 'w', zipfile.ZIP_STORED); z.writestr('archive/data.pkl', open('" + pkl +
                               "', 'rb').read()); z.writestr('archive/version', '3\\n'); z.close()\" 2>&1");
  EXPECT_EQ(made.exit_code, 0) << made.output;
  return read_file(out).value();
}

// Hostile pickles cost what their file is worth: a 286-byte memo bomb (a list appended to itself 40 times, 2^40
// values by copying) and deep nesting are refused at once, naming the limit and the pickle's offset.
TEST(TorchArchive, MemoBombsAndDeepNestingAreRefusedNamingTheLimit) {
  // Pickle bytes by value (string literals would end at the memo indices' zero bytes).
  const auto bytes = [](std::initializer_list<int> b) {
    std::string out;
    for (int c : b) out += static_cast<char>(c);
    return out;
  };
  const std::string proto = bytes({0x80, 0x02});
  std::string bomb = proto + bytes({']', 'q', 0});
  for (int i = 0; i < 40; ++i) bomb += bytes({'h', 0, 'h', 0, 'a', 'q', 0});  // APPEND the list to itself, memoize
  bomb += ".";
  const std::string archive = ArchiveWith(bomb, "memo_bomb");
  EXPECT_LT(archive.size(), 600u);
  const Status refused = parse_torch_archive(archive, "bomb.pt").status();
  EXPECT_EQ(refused.code(), Status::Code::kCorruption);
  EXPECT_NE(refused.message().find("limit for an archive of this size"), std::string::npos) << refused.ToString();
  EXPECT_NE(refused.message().find("at byte"), std::string::npos) << refused.ToString();

  const std::string deep = proto + std::string(20000, ']') + std::string(19999, 'a') + ".";
  const Status nested = parse_torch_archive(ArchiveWith(deep, "deep"), "deep.pt").status();
  EXPECT_EQ(nested.code(), Status::Code::kCorruption);
  EXPECT_NE(nested.message().find("deeper than 256 levels"), std::string::npos) << nested.ToString();

  // Within the limits the same constructs still read: a memoized list referenced twice, 200 levels of nesting.
  const std::string twice = proto + bytes({'(', ']', 'q', 0, 'h', 0, 't', '.'});
  const auto shared = parse_torch_archive(ArchiveWith(twice, "shared"), "shared.pt");
  ASSERT_TRUE(shared.ok()) << shared.status().ToString();
  EXPECT_EQ(shared->items.size(), 2u);
  const auto nested_ok = parse_torch_archive(
      ArchiveWith(proto + std::string(200, ']') + std::string(199, 'a') + ".", "nested_ok"), "ok.pt");
  ASSERT_TRUE(nested_ok.ok()) << nested_ok.status().ToString();
}

// Half-precision scalars read as numbers (they read past a vector's end), and counts that are not whole numbers
// within a double's exact range are refused.
TEST(ReferenceCheckpoint, HalfPrecisionScalarsAndOutOfRangeCountsAreHandled) {
  SKIP_WITHOUT_TORCH();
  const auto [params, state] = EvolvedState();
  const std::string good = TempPath("half_ckpt.pt"), half = TempPath("half_loss.pt"), huge = TempPath("huge_g.pt");
  ASSERT_TRUE(write_reference_checkpoint(good, params, state, std::nullopt, 3, 0.5).ok());
  const auto made = RunProcess(kPython + " -c \"import torch; c = torch.load('" + good +
                               "'); c['best_val_loss'] = torch.tensor(1.5, dtype=torch.bfloat16); torch.save(c, '" +
                               half + "'); c['best_val_loss'] = torch.tensor(-2.25, dtype=torch.float16); "
                               "c['evolution_state']['g'] = torch.tensor([1e30], dtype=torch.float64); torch.save(c, '" +
                               huge + "')\" 2>&1");
  ASSERT_EQ(made.exit_code, 0) << made.output;
  const auto read = read_reference_checkpoint(half);
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  EXPECT_EQ(read->best_val_loss, 1.5);
  const auto refused = read_reference_checkpoint(huge);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("not a whole number"), std::string::npos) << refused.status().ToString();
}

// What torch.load would read differently is refused or read its way: an archive written big-endian (its numbers
// read as little-endian gave sigma -3.8e-05 and parameters of 1e-42, imported without a word), a step size that is
// not positive, and a key a hand-made pickle sets twice (Python keeps the last; we took the first).
TEST(ReferenceCheckpoint, BigEndianArchivesNonPositiveStepSizesAndKeysSetTwiceReadAsTorchWould) {
  SKIP_WITHOUT_TORCH();
  const auto [params, state] = EvolvedState();
  const std::string good = TempPath("order_ckpt.pt"), big = TempPath("order_big.pt"), negative = TempPath("neg_sigma.pt");
  ASSERT_TRUE(write_reference_checkpoint(good, params, state, std::nullopt, 3, 0.5).ok());
  const auto made = RunProcess(
      kPython + " -c \"import zipfile, torch; i = zipfile.ZipFile('" + good + "'); o = zipfile.ZipFile('" + big +
      "', 'w', zipfile.ZIP_STORED)\nfor n in i.namelist(): o.writestr(n, b'big' if n.endswith('/byteorder') else "
      "i.read(n))\no.close(); c = torch.load('" + good + "'); c['evolution_state']['sigma'] = torch.tensor(-0.5); "
      "torch.save(c, '" + negative + "')\" 2>&1");
  ASSERT_EQ(made.exit_code, 0) << made.output;
  ASSERT_TRUE(read_reference_checkpoint(good).ok());
  const Status order = read_reference_checkpoint(big).status();
  EXPECT_EQ(order.code(), Status::Code::kInvalidArgument) << order.ToString();
  EXPECT_NE(order.message().find("byte order 'big'"), std::string::npos) << order.ToString();
  const Status sigma = read_reference_checkpoint(negative).status();
  EXPECT_EQ(sigma.code(), Status::Code::kCorruption) << sigma.ToString();
  EXPECT_NE(sigma.message().find("evolution_state['sigma'] is -0.5"), std::string::npos) << sigma.ToString();

  // {'a': 1, 'a': 2} by SETITEM twice: the second.
  std::string pickle = "\x80\x02}";
  for (const char value : {'\x01', '\x02'}) pickle += std::string("X\x01\0\0\0a", 6) + "K" + value + "s";
  pickle += ".";
  const auto twice = parse_torch_archive(ArchiveWith(pickle, "key_twice"), "twice.pt");
  ASSERT_TRUE(twice.ok()) << twice.status().ToString();
  ASSERT_NE(twice->Find("a"), nullptr);
  EXPECT_EQ(twice->Find("a")->integer, 2);
}

}  // namespace
}  // namespace namm::coordinator
