// Directories without std::filesystem (file_util.h says why): mkdir -p, rm -rf that does not follow links,
// listings, sizes, and errors that name the path.
#include "namm/file_util.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include "../temp_path.h"

namespace namm {
namespace {

TEST(FileUtil, MakesListsSizesAndRemovesDirectoryTrees) {
  const std::string root = testing::TempPath("file_util_tree");
  ASSERT_TRUE(remove_tree(root).ok());
  ASSERT_TRUE(make_directories(root + "/a/b/c/").ok());
  EXPECT_TRUE(make_directories(root + "/a/b").ok()) << "an existing directory is fine";
  ASSERT_TRUE(write_file_atomically(root + "/a/b/c/data", {"12345"}).ok());
  ASSERT_TRUE(write_file_atomically(root + "/a/z", {""}).ok());
  ASSERT_TRUE(make_directories(root + "/outside").ok());
  ASSERT_TRUE(write_file_atomically(root + "/outside/kept", {"x"}).ok());
  ASSERT_EQ(::symlink((root + "/outside").c_str(), (root + "/a/link").c_str()), 0);

  auto names = list_directory(root + "/a");
  ASSERT_TRUE(names.ok());
  EXPECT_EQ(*names, (std::vector<std::string>{"b", "link", "z"}));
  auto size = file_size(root + "/a/b/c/data");
  ASSERT_TRUE(size.ok());
  EXPECT_EQ(*size, 5);

  ASSERT_TRUE(remove_tree(root + "/a").ok());
  EXPECT_FALSE(path_exists(root + "/a"));
  EXPECT_TRUE(path_exists(root + "/outside/kept")) << "the link was removed, not followed";
  EXPECT_TRUE(remove_tree(root + "/a").ok()) << "nothing there is fine";
  EXPECT_TRUE(remove_path(root + "/missing").ok());
  EXPECT_FALSE(remove_path(root + "/outside").ok()) << "a directory that is not empty stays";
  ASSERT_TRUE(remove_tree(root).ok());
}

TEST(FileUtil, ErrorsNameThePath) {
  const std::string missing = testing::TempPath("file_util_missing/x");
  auto names = list_directory(missing);
  ASSERT_FALSE(names.ok());
  EXPECT_NE(names.status().message().find(missing), std::string::npos);
  auto size = file_size(missing);
  ASSERT_FALSE(size.ok());
  EXPECT_NE(size.status().message().find(missing), std::string::npos);
  const std::string file = testing::TempPath("file_util_plain");
  ASSERT_TRUE(write_file_atomically(file, {"x"}).ok());
  const Status under_a_file = make_directories(file + "/sub");
  ASSERT_FALSE(under_a_file.ok());
  EXPECT_NE(under_a_file.message().find("cannot create directory " + file), std::string::npos)
      << under_a_file.message();
  ASSERT_TRUE(remove_path(file).ok());
}

}  // namespace
}  // namespace namm
