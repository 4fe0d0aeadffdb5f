// Expected segmentations were produced with Debian's python3-jieba 0.42.1 (`list(jieba.cut(s, cut_all=False))`)
// while writing this test, independently of namm's implementation.
#include "namm/tasks/jieba.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "../namm_core/test_util.h"
#include "../process_util.h"
#include "../worker/shared_data.h"
#include "namm/file_util.h"

namespace namm::tasks {
namespace {

using Words = std::vector<std::string>;

std::shared_ptr<const Jieba> Segmenter() {
  auto jieba = Jieba::Default();
  if (!jieba.ok()) return nullptr;
  return *jieba;
}

#define REQUIRE_JIEBA(j)                                                                               \
  auto j = Segmenter();                                                                                \
  if (!j) GTEST_SKIP() << "jieba's data is not installed (python3-jieba; scripts/install-deps.sh installs it)"

TEST(Jieba, DictionaryRoutes) {
  REQUIRE_JIEBA(jieba);
  EXPECT_EQ(jieba->Cut("我来到北京清华大学"), (Words{"我", "来到", "北京", "清华大学"}));
  EXPECT_EQ(jieba->Cut("结婚的和尚未结婚的"), (Words{"结婚", "的", "和", "尚未", "结婚", "的"}));
  EXPECT_EQ(jieba->Cut("永和服装饰品有限公司"), (Words{"永和", "服装", "饰品", "有限公司"}));
  EXPECT_EQ(jieba->Cut("小明硕士毕业于中国科学院计算所，后在日本京都大学深造"),
            (Words{"小明", "硕士", "毕业", "于", "中国科学院", "计算所", "，", "后", "在", "日本京都大学", "深造"}));
}

TEST(Jieba, HiddenMarkovModelFindsUnknownWords) {
  REQUIRE_JIEBA(jieba);
  EXPECT_EQ(jieba->Cut("他来到了网易杭研大厦"), (Words{"他", "来到", "了", "网易", "杭研", "大厦"}));
  EXPECT_EQ(jieba->Cut("李小福是创新办主任也是云计算方面的专家; 什么是八一双鹿"),
            (Words{"李小福", "是", "创新", "办", "主任", "也", "是", "云", "计算", "方面", "的", "专家", ";", " ", "什么",
                   "是", "八", "一双", "鹿"}));
  EXPECT_EQ(jieba->Cut("隐马尔可夫模型识别未登录词：韩冰雪在苏州玩"),
            (Words{"隐", "马尔可夫", "模型", "识别", "未", "登录", "词", "：", "韩", "冰雪", "在", "苏州", "玩"}));
}

TEST(Jieba, MixedScriptsNumbersAndWhitespace) {
  REQUIRE_JIEBA(jieba);
  EXPECT_EQ(jieba->Cut("我爱Python3.8和C++编程, 价格是12.5%左右\r\n第二行　全角空格"),
            (Words{"我", "爱", "Python3.8", "和", "C++", "编程", ",", " ", "价格", "是", "12.5%", "左右", "\r\n", "第二行",
                   "\xE3\x80\x80", "全角", "空格"}));
  EXPECT_EQ(jieba->Cut("２０２４年营收增长了３.５％，约为1,234万元。"),
            (Words{"２", "０", "２", "４", "年", "营收", "增长", "了", "３", ".", "５", "％", "，", "约", "为", "1", ",", "234",
                   "万元", "。"}));
  EXPECT_EQ(jieba->Cut("abc-def_g#h&i"), (Words{"abc", "-", "def", "_", "g", "#", "h", "&", "i"}));
  EXPECT_TRUE(jieba->Cut("").empty());
}

// Debian's python3-jieba as a live oracle on real LongBench Chinese text (skipped when it is not installed).
TEST(Jieba, MatchesPythonJiebaOnLongBenchText) {
  REQUIRE_JIEBA(jieba);
  NAMM_REQUIRE_SHARED("data/longbench/vcsum.jsonl");
  const std::string script = testing::TempPath("jieba_oracle.py");
  const std::string expected = testing::TempPath("jieba_oracle.json");
  ASSERT_TRUE(write_file_atomically(script, {
      "import jieba, json, sys\n"
      "jieba.setLogLevel(60)\n"
      "out = []\n"
      "for f in ['dureader', 'vcsum', 'lsht']:\n"
      "    for i, line in enumerate(open(sys.argv[1] + '/' + f + '.jsonl')):\n"
      "        if i >= 2: break\n"
      "        text = json.loads(line)['context'][:8000]\n"
      "        out.append([text, list(jieba.cut(text, cut_all=False))])\n"
      "json.dump(out, open(sys.argv[2], 'w'), ensure_ascii=False)\n"}).ok());
  const auto run = testing::RunProcess("/usr/bin/python3 " + script + " " + testing::SharedPath("data/longbench") + " " + expected);
  if (run.exit_code != 0) GTEST_SKIP() << "no python3 with jieba to compare against: " << run.output;
  auto text = read_file(expected);
  ASSERT_TRUE(text.ok());
  const auto cases = nlohmann::json::parse(*text);
  ASSERT_EQ(cases.size(), 6u);
  for (const auto& c : cases) EXPECT_EQ(jieba->Cut(c[0].get<std::string>()), c[1].get<Words>());
}

TEST(Jieba, MissingDataIsAClearError) {
  auto jieba = Jieba::Load("/nonexistent/jieba");
  ASSERT_FALSE(jieba.ok());
  EXPECT_NE(jieba.status().message().find("dict.txt"), std::string::npos);
}

}  // namespace
}  // namespace namm::tasks
