// The Pong rules: what earns a point, what ends an episode, and that following the ball scores
// far more than random play (what training has to discover).
#include <gtest/gtest.h>

#include <random>

#include "pong.h"

using pong::Table;

namespace {

double mean_score(int episodes, bool tracker, pong::Rules rules = {}) {
  Table table(rules, 3);
  std::mt19937 random(5);
  long total = 0;
  for (int e = 0; e < episodes; ++e) {
    table.reset();
    pong::StepResult result;
    while (!result.terminated && !result.truncated) {
      result = table.step(tracker ? pong::tracker_action(table)
                                  : static_cast<int>(random() % pong::kNumActions));
    }
    total += table.points();
  }
  return static_cast<double>(total) / episodes;
}

}  // namespace

TEST(Pong, ObservationsAreScaledToTheBox) {
  Table table({}, 1);
  float obs[pong::kObservationSize];
  for (int t = 0; t < 500; ++t) {
    table.observe(obs);
    for (float v : obs) EXPECT_TRUE(v >= -1.0f && v <= 1.0f) << v;
    if (table.step(pong::tracker_action(table)).terminated) table.reset();
  }
}

TEST(Pong, TheServeComesTowardTheAgentAndAMissEndsTheEpisode) {
  Table table({}, 2);
  float obs[pong::kObservationSize];
  table.observe(obs);
  EXPECT_LT(obs[2], 0.0f);  // vx toward the agent at x = 0
  pong::StepResult result;
  int ticks = 0;
  // Running the paddle into the far corner from the ball misses it.
  const int away = table.ball_y() > 0.5f ? pong::kDown : pong::kUp;
  while (!result.terminated && ticks < 200) {
    result = table.step(away);
    ++ticks;
    EXPECT_EQ(result.reward, 0.0f);
  }
  EXPECT_TRUE(result.terminated);
  EXPECT_EQ(table.points(), 0);
}

TEST(Pong, PointLimitEndsTheMatch) {
  pong::Rules rules;
  rules.point_limit = 3;
  Table table(rules, 4);
  pong::StepResult result;
  float total = 0.0f;
  while (!result.terminated && !result.truncated) {
    result = table.step(pong::tracker_action(table));
    total += result.reward;
  }
  EXPECT_TRUE(result.terminated);
  EXPECT_EQ(table.points(), 3);
  EXPECT_EQ(total, 3.0f);
}

TEST(Pong, MaxTicksTruncates) {
  pong::Rules rules;
  rules.max_ticks = 40;
  Table table(rules, 5);
  pong::StepResult result;
  while (!result.terminated && !result.truncated) result = table.step(pong::tracker_action(table));
  EXPECT_TRUE(result.truncated);
  EXPECT_EQ(table.ticks(), 40);
}

TEST(Pong, FollowingTheBallBeatsRandomPlay) {
  const double random_score = mean_score(300, false);
  const double tracker_score = mean_score(50, true);
  std::printf("mean score: random %.2f, tracker %.2f\n", random_score, tracker_score);
  EXPECT_LT(random_score, 1.5);
  EXPECT_GT(tracker_score, 15.0);
}
