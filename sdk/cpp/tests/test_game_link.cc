// GameLink against a real env server (GameLinkService with the random policy) that this binary
// starts: lock step, pipelining, in-band errors that leave the link usable, refused Hellos,
// resume after the stream is cut (through a TCP proxy), takeover and Goodbye.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <memory>
#include <optional>

#include "env_server.h"
#include "rlfleet/game_link.h"
#include "tcp_proxy.h"

namespace {

using rlfleet::ErrorCode;
using rlfleet::GameLink;
using rlfleet::GameLinkError;
using rlfleet::GameLinkOptions;
using rlfleet::testing::EnvServerProcess;
using rlfleet::testing::TcpProxy;

constexpr std::uint32_t kAgents = 4;
constexpr int kObs = 3;
constexpr std::uint32_t kServerMaxInFlight = 4;
constexpr std::uint32_t kServerMaxAgents = 64;

EnvServerProcess* server = nullptr;

GameLinkOptions options(const std::string& address = "") {
  GameLinkOptions o;
  o.address = address.empty() ? server->address() : address;
  o.game = "cpp-sdk-test";
  o.env_id = "CppSdkTest-v0";
  o.observation_space = rlfleet::spaces::box(-1.0f, 1.0f, {kObs});
  o.action_space = rlfleet::spaces::discrete(3);
  o.num_agents = kAgents;
  o.run = server->run();
  o.connect_timeout = std::chrono::seconds(20);
  o.reconnect_timeout = std::chrono::seconds(20);
  return o;
}

// The per-tick arrays of kAgents agents; agent 0's episode ends every `episode_length` ticks.
struct Agents {
  std::vector<std::int64_t> episode_ids = std::vector<std::int64_t>(kAgents, 0);
  std::vector<bool> terminated = std::vector<bool>(kAgents, false);
  std::vector<bool> truncated = std::vector<bool>(kAgents, false);
  std::vector<float> rewards = std::vector<float>(kAgents, 0.5f);
  int episodes_ended = 0;

  std::vector<float> observations(std::uint64_t tick) const {
    std::vector<float> obs(kAgents * kObs);
    for (std::size_t i = 0; i < obs.size(); ++i) obs[i] = std::sin(0.1f * tick + i) * 0.9f;
    return obs;
  }

  // Moves to tick `tick`: agent 0 starts a new episode after the one that ended.
  void advance(std::uint64_t tick, std::uint64_t episode_length) {
    if (terminated[0]) ++episode_ids[0];
    terminated[0] = tick % episode_length == 0;
    if (terminated[0]) ++episodes_ended;
  }

  rlfleet::Actions act(GameLink& link, std::uint64_t tick, std::uint64_t episode_length = 1000) {
    advance(tick, episode_length);
    rlfleet::Actions actions =
        link.act(observations(tick), rewards, terminated, truncated, episode_ids);
    EXPECT_EQ(actions.tick, tick);  // act() numbers ticks one past the highest sent
    return actions;
  }
};

void expect_valid_actions(const rlfleet::Actions& actions, std::uint64_t tick) {
  EXPECT_EQ(actions.tick, tick);
  EXPECT_EQ(actions.policy_version, 0);  // the random policy
  const auto values = actions.discrete();
  ASSERT_EQ(values.size(), kAgents);
  for (auto value : values) EXPECT_TRUE(value >= 0 && value < 3) << value;
}

template <class F>
GameLinkError error_of(F&& f) {
  try {
    f();
  } catch (const GameLinkError& error) {
    return error;
  }
  ADD_FAILURE() << "no GameLinkError";
  return GameLinkError(ErrorCode::kOk, "none");
}

TEST(GameLink, LockStepTicksAndFarewellCounts) {
  GameLink link(options());
  EXPECT_FALSE(link.link_id().empty());
  EXPECT_EQ(link.max_in_flight(), 1u);
  EXPECT_FALSE(link.resumed());
  EXPECT_EQ(link.run(), server->run());
  EXPECT_GT(link.resume_window_s(), 0.0);
  Agents agents;
  for (std::uint64_t tick = 1; tick <= 50; ++tick) {
    expect_valid_actions(agents.act(link, tick, 10), tick);
  }
  EXPECT_EQ(agents.episodes_ended, 5);
  const rlfleet::Farewell farewell = link.close("test over");
  EXPECT_EQ(farewell.ticks, 50);
  EXPECT_EQ(farewell.episodes, 5);
  EXPECT_EQ(link.close().ticks, 50);  // a second close answers the same
  EXPECT_EQ(error_of([&] { agents.act(link, 51); }).code(), ErrorCode::kFailedPrecondition);
}

TEST(GameLink, ActionsFollowTheActionSpace) {
  GameLinkOptions o = options();
  o.env_id = "CppSdkTestMulti-v0";  // one env id, one pair of spaces (one policy) per server
  o.action_space = rlfleet::spaces::multi_discrete({2, 5});
  GameLink link(o);
  Agents agents;
  const auto actions = agents.act(link, 1);
  const auto tensor = actions.tensor();
  EXPECT_EQ(tensor.shape(), (std::vector<std::int64_t>{kAgents, 2}));
  const auto values = actions.discrete();
  for (std::size_t i = 0; i < values.size(); ++i) EXPECT_LT(values[i], i % 2 ? 5 : 2);
  link.close();
}

TEST(GameLink, PipelinedTicksAnswerInOrder) {
  GameLinkOptions o = options();
  o.max_in_flight = 100;  // more than the server grants
  GameLink link(o);
  ASSERT_EQ(link.max_in_flight(), kServerMaxInFlight);
  Agents agents;
  // Fill the window (ticks with gaps: frame skipping), then keep it full.
  std::uint64_t sent = 0;
  std::uint64_t answered = 0;
  auto submit = [&] {
    sent += 3;
    agents.advance(sent, 1000);
    link.submit(sent, agents.observations(sent), agents.rewards, agents.terminated,
                agents.truncated, agents.episode_ids);
  };
  for (std::uint32_t i = 0; i < kServerMaxInFlight; ++i) submit();
  EXPECT_EQ(link.in_flight(), kServerMaxInFlight);
  EXPECT_EQ(error_of(submit).code(), ErrorCode::kFailedPrecondition);  // the window is full
  sent -= 3;
  EXPECT_EQ(error_of([&] { agents.act(link, sent + 1); }).code(),
            ErrorCode::kFailedPrecondition);  // lock step needs an empty pipeline
  for (int i = 0; i < 40; ++i) {
    answered += 3;
    expect_valid_actions(link.receive(), answered);
    submit();
  }
  while (link.in_flight() > 0) {
    answered += 3;
    expect_valid_actions(link.receive(), answered);
  }
  EXPECT_EQ(answered, sent);
  EXPECT_EQ(error_of([&] { link.receive(); }).code(), ErrorCode::kFailedPrecondition);
  EXPECT_EQ(link.close().ticks, 40 + kServerMaxInFlight);
}

TEST(GameLink, InBandErrorsKeepTheLinkUsable) {
  GameLink link(options());
  Agents agents;
  expect_valid_actions(agents.act(link, 1), 1);

  agents.rewards[2] = std::nanf("");
  GameLinkError nan = error_of([&] { agents.act(link, 2); });
  EXPECT_EQ(nan.code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(nan.field(), "observations.rewards");
  EXPECT_EQ(nan.reason(), "InvalidArgument");
  agents.rewards[2] = 0.0f;
  expect_valid_actions(agents.act(link, 3), 3);

  // A tick that does not increase.
  GameLinkError stale = error_of([&] {
    link.submit(3, agents.observations(3), agents.rewards, agents.terminated, agents.truncated,
                agents.episode_ids);
    link.receive();
  });
  EXPECT_EQ(stale.code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(stale.field(), "observations.tick");

  // Observations of the wrong shape, as a Tensor (sent as they are).
  const auto wrong = rlfleet::Tensor::of(std::vector<float>(kAgents * 5, 0.0f), {kAgents, 5});
  GameLinkError shape = error_of([&] {
    link.act(wrong, agents.rewards, agents.terminated, agents.truncated, agents.episode_ids);
  });
  EXPECT_EQ(shape.code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(shape.field(), "observations.observations");

  // Caught before sending: one reward per agent.
  GameLinkError local = error_of([&] {
    link.act(agents.observations(9), {1.0f}, agents.terminated, agents.truncated,
             agents.episode_ids);
  });
  EXPECT_EQ(local.field(), "observations.rewards");

  // act() numbers ticks one past the highest sent (1, 2 refused, 3, 3 refused, 4 refused).
  expect_valid_actions(agents.act(link, 5), 5);
  EXPECT_EQ(link.close().ticks, 3);  // ticks 1, 3 and 5 were answered
}

TEST(GameLink, AnErrorInThePipelineAnswersOnlyItsTick) {
  GameLinkOptions o = options();
  o.max_in_flight = 3;
  GameLink link(o);
  Agents agents;
  for (std::uint64_t tick = 1; tick <= 3; ++tick) {
    agents.rewards[0] = tick == 2 ? INFINITY : 1.0f;
    link.submit(tick, agents.observations(tick), agents.rewards, agents.terminated,
                agents.truncated, agents.episode_ids);
  }
  expect_valid_actions(link.receive(), 1);
  EXPECT_EQ(error_of([&] { link.receive(); }).field(), "observations.rewards");
  expect_valid_actions(link.receive(), 3);
  link.close();
}

TEST(GameLink, RefusedHellosNameTheField) {
  GameLinkOptions bad_id = options();
  bad_id.env_id = "not an id!";
  GameLinkError id = error_of([&] { GameLink link(bad_id); });
  EXPECT_EQ(id.code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(id.field(), "hello.env_id");

  GameLinkOptions many = options();
  many.num_agents = kServerMaxAgents + 1;
  GameLinkError limit = error_of([&] { GameLink link(many); });
  EXPECT_EQ(limit.code(), ErrorCode::kResourceExhausted);
  EXPECT_EQ(limit.field(), "hello.num_agents");

  GameLinkOptions discrete_obs = options();
  discrete_obs.env_id = "CppSdkTestDiscrete-v0";
  discrete_obs.observation_space = rlfleet::spaces::discrete(4);
  EXPECT_EQ(error_of([&] { GameLink link(discrete_obs); }).field(), "hello.observation_space");

  GameLinkOptions other_run = options();
  other_run.run = "some-other-run";
  GameLinkError run = error_of([&] { GameLink link(other_run); });
  EXPECT_EQ(run.code(), ErrorCode::kFailedPrecondition);
  EXPECT_EQ(run.field(), "run");
}

TEST(GameLink, NoServerIsUnavailableAfterTheConnectTimeout) {
  GameLinkOptions o = options("127.0.0.1:1");
  o.connect_timeout = std::chrono::milliseconds(700);
  const auto start = std::chrono::steady_clock::now();
  GameLinkError error = error_of([&] { GameLink link(o); });
  EXPECT_EQ(error.code(), ErrorCode::kUnavailable);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  GameLinkOptions nowhere = options();
  nowhere.address = "";
  unsetenv(rlfleet::kAddressVariable);
  EXPECT_EQ(error_of([&] { GameLink link(nowhere); }).field(), "address");
}

TEST(GameLink, ResumesAfterTheStreamIsCut) {
  TcpProxy proxy(server->address());
  GameLink link(options(proxy.address()));
  const std::string link_id = link.link_id();
  Agents agents;
  for (std::uint64_t tick = 1; tick <= 20; ++tick) agents.act(link, tick, 15);

  proxy.cut();
  // The next tick finds the stream broken, reconnects with the session key and resumes.
  expect_valid_actions(agents.act(link, 21, 15), 21);
  EXPECT_EQ(link.reconnects(), 1);
  EXPECT_TRUE(link.resumed());
  EXPECT_EQ(link.last_tick(), 20u);
  EXPECT_EQ(link.link_id(), link_id);
  EXPECT_EQ(proxy.accepted(), 2);
  for (std::uint64_t tick = 22; tick <= 40; ++tick) agents.act(link, tick, 15);
  // Agent 0's episodes ended at 15 and 30 on both sides of the cut: nothing was truncated.
  const auto farewell = link.close();
  EXPECT_EQ(farewell.ticks, 40);
  EXPECT_EQ(farewell.episodes, 2);
}

TEST(GameLink, ResumeResendsWhatWasInFlight) {
  TcpProxy proxy(server->address());
  GameLinkOptions o = options(proxy.address());
  o.max_in_flight = 3;
  GameLink link(o);
  Agents agents;
  std::uint64_t tick = 0;
  auto submit = [&] {
    ++tick;
    agents.advance(tick, 1000);
    link.submit(tick, agents.observations(tick), agents.rewards, agents.terminated,
                agents.truncated, agents.episode_ids);
  };
  submit();
  expect_valid_actions(link.receive(), 1);
  for (int i = 0; i < 3; ++i) submit();
  proxy.cut();
  // Each tick in flight is answered after the resume (resent) or, when the server had answered
  // it before the cut, reported lost; either way in order, and the link goes on.
  int answered = 1;
  for (std::uint64_t expected = 2; expected <= 4; ++expected) {
    try {
      expect_valid_actions(link.receive(), expected);
      ++answered;
    } catch (const GameLinkError& error) {
      EXPECT_EQ(error.code(), ErrorCode::kDataLoss) << error.what();
      ++answered;  // the server answered it: it counts in the Farewell
    }
  }
  submit();
  expect_valid_actions(link.receive(), 5);
  // Checked after tick 5: when every answer in flight had reached the client before the cut,
  // the receives above read them without touching the broken stream, and it is tick 5's send
  // that finds it broken and resumes.
  EXPECT_EQ(link.reconnects(), 1);
  EXPECT_TRUE(link.resumed());
  EXPECT_EQ(link.close().ticks, answered + 1);
}

TEST(GameLink, ASecondConnectionWithTheKeyTakesOver) {
  GameLinkOptions o = options();
  o.session_key = "takeover-" + std::to_string(getpid());
  GameLink first(o);
  Agents agents;
  agents.act(first, 1);
  GameLink second(o);
  EXPECT_TRUE(second.resumed());
  EXPECT_EQ(second.link_id(), first.link_id());
  EXPECT_EQ(second.last_tick(), 1u);
  Agents more = agents;
  expect_valid_actions(more.act(second, 2), 2);
  // The old stream was ended ABORTED; it does not reconnect and take the link back.
  GameLinkError aborted = error_of([&] { agents.act(first, 2); });
  EXPECT_EQ(aborted.code(), ErrorCode::kAborted);
  EXPECT_EQ(first.reconnects(), 0);
  EXPECT_EQ(second.close().ticks, 2);
}

TEST(GameLink, ARestartedGameResumesItsLink) {
  GameLinkOptions o = options();
  o.session_key = "restart-" + std::to_string(getpid());
  Agents agents;
  std::string link_id;
  {
    GameLink crashed(o);  // goes away without Goodbye, as a crashed game's link does
    link_id = crashed.link_id();
    for (std::uint64_t tick = 1; tick <= 5; ++tick) agents.act(crashed, tick);
  }
  GameLink restarted(o);
  EXPECT_TRUE(restarted.resumed());
  EXPECT_EQ(restarted.link_id(), link_id);
  EXPECT_EQ(restarted.last_tick(), 5u);
  expect_valid_actions(agents.act(restarted, 6), 6);  // act() continues after last_tick
  EXPECT_EQ(restarted.close().ticks, 6);
}

TEST(GameLink, GoodbyeReleasesTheSessionKey) {
  GameLinkOptions o = options();
  o.session_key = "goodbye-" + std::to_string(getpid());
  std::string first_id;
  {
    GameLink link(o);
    first_id = link.link_id();
    Agents agents;
    agents.act(link, 1);
    link.close("done");
  }
  GameLink again(o);
  EXPECT_FALSE(again.resumed());
  EXPECT_NE(again.link_id(), first_id);
  again.close();
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const std::string settings =
      "{enabled: true, policy: random, max_in_flight: " + std::to_string(kServerMaxInFlight) +
      ", max_agents_per_link: " + std::to_string(kServerMaxAgents) + ", resume_window_s: 30}";
  std::unique_ptr<EnvServerProcess> process;
  try {
    process = std::make_unique<EnvServerProcess>(settings);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "%s\n", error.what());
    return 1;
  }
  server = process.get();
  const int result = RUN_ALL_TESTS();
  if (result != 0) std::fprintf(stderr, "--- env server log:\n%s\n", process->log().c_str());
  return result;
}
