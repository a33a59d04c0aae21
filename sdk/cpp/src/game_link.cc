// GameLink over one bidirectional Connect stream (gRPC's synchronous API: the game loop is the
// only thread). A break of the stream is noticed where a reply is read: a failed Write leaves
// the request pending, and the next Read reports the end of the stream with its status. Then
// the link reconnects with the same session key and resends what the server had not answered.
//
// messages.cc has the per-tick values.
#include "rlfleet/game_link.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cstdlib>
#include <deque>
#include <iostream>
#include <random>
#include <sstream>
#include <thread>

#include "rlfleet/env/v1/game_link.grpc.pb.h"

namespace rlfleet {

namespace v1 = rlfleet::env::v1;
using Clock = std::chrono::steady_clock;

namespace {

std::string from_environment(const char* name) {
  const char* value = std::getenv(name);
  return value ? value : "";
}

std::string random_session_key() {
  std::random_device device;
  std::ostringstream key;
  key << std::hex;
  for (int i = 0; i < 4; ++i) key << device();
  return key.str();
}

std::string seconds_text(std::chrono::milliseconds duration) {
  std::ostringstream text;
  text << static_cast<double>(duration.count()) / 1000.0 << "s";
  return text.str();
}

// Codes after which connecting again cannot help: the server refused this client for good, or
// another connection took the link over.
bool is_permanent(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::ABORTED:
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::FAILED_PRECONDITION:
    case grpc::StatusCode::UNIMPLEMENTED:
    case grpc::StatusCode::PERMISSION_DENIED:
    case grpc::StatusCode::UNAUTHENTICATED:
      return true;
    default:
      return false;
  }
}

GameLinkError stream_error(const grpc::Status& status, const std::string& context) {
  std::string message = context + ": " + status.error_message();
  if (status.error_code() == grpc::StatusCode::ABORTED) {
    message = "the link was taken over by another connection with the same session key (" +
              status.error_message() + ")";
  } else if (status.error_code() == grpc::StatusCode::UNIMPLEMENTED) {
    message = "the server does not serve GameLinkService (is game_link enabled?): " +
              status.error_message();
  }
  return GameLinkError(static_cast<ErrorCode>(status.error_code()), message);
}

GameLinkError local_error(std::string message, std::string field) {
  return GameLinkError(ErrorCode::kInvalidArgument, std::move(message), std::move(field));
}

}  // namespace

// --- the link ----------------------------------------------------------------------------------

class GameLink::Impl {
 public:
  explicit Impl(GameLinkOptions options) : options_(std::move(options)) {
    address_ = options_.address.empty() ? from_environment(kAddressVariable) : options_.address;
    if (address_.empty()) {
      throw GameLinkError(ErrorCode::kInvalidArgument,
                          std::string("no env server address: set GameLinkOptions.address or $") +
                              kAddressVariable, "address");
    }
    session_key_ = options_.session_key.value_or(random_session_key());
    expected_run_ = options_.run.empty() ? from_environment(kRunVariable) : options_.run;
    if (!options_.log) {
      options_.log = [](const std::string& line) { std::cerr << "rlfleet gamelink: " << line << "\n"; };
    }
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(options_.max_message_bytes);
    args.SetMaxSendMessageSize(options_.max_message_bytes);
    // gRPC's default reconnect backoff grows to 2 minutes; a game waits for a server that is
    // starting or restarting, so keep retrying every second at most.
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    channel_ = grpc::CreateCustomChannel(address_, grpc::InsecureChannelCredentials(), args);
    stub_ = v1::GameLinkService::NewStub(channel_);
    connect(options_.connect_timeout);
  }

  ~Impl() { cancel(); }

  Actions act(const Observations& observations, const std::vector<float>& rewards,
              const std::vector<bool>& terminated, const std::vector<bool>& truncated,
              const std::vector<std::int64_t>& episode_ids) {
    if (!pending_.empty()) {
      throw GameLinkError(ErrorCode::kFailedPrecondition,
                          "act() with " + std::to_string(pending_.size()) +
                              " observations in flight: receive() them first", "tick");
    }
    submit(ticks_sent_ ? max_tick_sent_ + 1 : 1, observations, rewards, terminated, truncated,
           episode_ids);
    return receive();
  }

  void submit(std::uint64_t tick, const Observations& observations,
              const std::vector<float>& rewards, const std::vector<bool>& terminated,
              const std::vector<bool>& truncated, const std::vector<std::int64_t>& episode_ids) {
    check_usable();
    if (pending_.size() >= welcome_.max_in_flight()) {
      throw GameLinkError(ErrorCode::kFailedPrecondition,
                          std::to_string(pending_.size()) + " observations already in flight " +
                              "(max_in_flight " + std::to_string(welcome_.max_in_flight()) +
                              "): receive() first", "tick");
    }
    const std::size_t n = options_.num_agents;
    check_length(rewards.size(), n, "observations.rewards");
    check_length(terminated.size(), n, "observations.terminated");
    check_length(truncated.size(), n, "observations.truncated");
    check_length(episode_ids.size(), n, "observations.episode_ids");

    v1::ConnectRequest request;
    request.set_request_id(next_request_id_++);
    auto* batch = request.mutable_observations();
    batch->set_tick(tick);
    *batch->mutable_observations() =
        observations.to_tree(options_.observation_space, options_.num_agents);
    *batch->mutable_rewards() = Tensor::of(rewards, {static_cast<std::int64_t>(n)}).to_proto();
    *batch->mutable_terminated() = Tensor::of_bools(terminated).to_proto();
    *batch->mutable_truncated() = Tensor::of_bools(truncated).to_proto();
    *batch->mutable_episode_ids() =
        Tensor::of(episode_ids, {static_cast<std::int64_t>(n)}).to_proto();

    pending_.push_back({std::move(request), false});
    // A failed write leaves the stream to end; the next Read sees that, and the reconnect
    // resends this request.
    stream_->Write(pending_.back().request);
    max_tick_sent_ = ticks_sent_ ? std::max(max_tick_sent_, tick) : tick;
    ticks_sent_ = true;
  }

  Actions receive() {
    check_usable();
    if (pending_.empty()) {
      throw GameLinkError(ErrorCode::kFailedPrecondition, "receive() with nothing in flight",
                          "tick");
    }
    while (true) {
      if (pending_.front().lost) {
        const std::uint64_t tick = pending_.front().request.observations().tick();
        pending_.pop_front();
        throw GameLinkError(ErrorCode::kDataLoss,
                            "the server answered tick " + std::to_string(tick) +
                                " but the stream broke before its reply arrived; act on the "
                                "previous actions", "tick");
      }
      v1::ConnectResponse response;
      if (!stream_->Read(&response)) {
        recover(finish());
        continue;
      }
      const std::uint64_t expected_id = pending_.front().request.request_id();
      const std::uint64_t tick = pending_.front().request.observations().tick();
      pending_.pop_front();
      if (response.request_id() != expected_id) {
        fail(GameLinkError(ErrorCode::kInternal,
                           "protocol violation: expected the answer to request " +
                               std::to_string(expected_id) + ", got request " +
                               std::to_string(response.request_id())));
      }
      if (response.has_error()) throw GameLinkError::from_status(response.error());
      if (!response.has_actions()) {
        fail(GameLinkError(ErrorCode::kInternal,
                           "protocol violation: the answer to tick " + std::to_string(tick) +
                               " carries no actions"));
      }
      Actions actions;
      actions.tick = response.actions().tick();
      actions.policy_version = response.actions().policy_version();
      actions.actions = std::move(*response.mutable_actions()->mutable_actions());
      policy_version_ = actions.policy_version;
      return actions;
    }
  }

  Farewell close(const std::string& reason) {
    if (farewell_) return *farewell_;
    check_usable();
    // Outstanding replies still come before the Farewell; they are skipped, not resent.
    pending_.clear();
    const auto deadline = Clock::now() + options_.reconnect_timeout;
    while (true) {
      v1::ConnectRequest request;
      const std::uint64_t goodbye_id = next_request_id_++;
      request.set_request_id(goodbye_id);
      request.mutable_goodbye()->set_reason(reason);
      stream_->Write(request);
      v1::ConnectResponse response;
      bool answered = false;
      while (!answered && stream_->Read(&response)) answered = response.request_id() == goodbye_id;
      if (!answered) {
        // The stream broke before the Farewell: resume the link (its counts are kept for the
        // resume window) and say Goodbye again.
        if (Clock::now() > deadline) fail(stream_error(finish(), "closing the link"));
        recover(finish());
        continue;
      }
      if (response.has_error()) throw GameLinkError::from_status(response.error());
      if (!response.has_farewell()) {
        fail(GameLinkError(ErrorCode::kInternal, "protocol violation: Goodbye not answered "
                                                 "with Farewell"));
      }
      stream_->WritesDone();
      while (stream_->Read(&response)) {
      }
      const grpc::Status status = finish();
      farewell_ = Farewell{response.farewell().ticks(), response.farewell().episodes()};
      if (!status.ok()) {
        options_.log("the stream ended with " +
                     code_name(static_cast<ErrorCode>(status.error_code())) +
                     " after Farewell: " + status.error_message());
      }
      return *farewell_;
    }
  }

  std::size_t in_flight() const { return pending_.size(); }
  const v1::Welcome& welcome() const { return welcome_; }
  const std::string& session_key() const { return session_key_; }
  std::int64_t policy_version() const { return policy_version_; }
  int reconnects() const { return reconnects_; }

 private:
  struct Pending {
    v1::ConnectRequest request;
    bool lost;  // answered by the server before a break, reply never received
  };

  static void check_length(std::size_t got, std::size_t agents, const char* field) {
    if (got != agents) {
      throw local_error(std::string(field) + " holds " + std::to_string(got) + " values, one per "
                        "agent needs " + std::to_string(agents), field);
    }
  }

  void check_usable() const {
    if (farewell_) throw GameLinkError(ErrorCode::kFailedPrecondition, "the link is closed");
    if (dead_) throw GameLinkError(dead_->code(), "the link is down: " + dead_->message());
  }

  // Marks the link unusable and throws `error`.
  [[noreturn]] void fail(GameLinkError error) {
    cancel();
    dead_ = error;
    throw error;
  }

  // Opens a stream and says Hello until Welcome; throws when the server refuses the Hello or
  // cannot be reached within `timeout`.
  void connect(std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    auto backoff = std::chrono::milliseconds(100);
    std::string last_problem = "no connection";
    while (true) {
      // gRPC takes deadlines on the system clock only.
      const auto wait = std::chrono::system_clock::now() + (deadline - Clock::now());
      if (!channel_->WaitForConnected(wait)) {
        fail(GameLinkError(ErrorCode::kUnavailable,
                           "no env server answered at " + address_ + " within " +
                               seconds_text(timeout) + " (" + last_problem + ")"));
      }
      context_ = std::make_unique<grpc::ClientContext>();
      stream_ = stub_->Connect(context_.get());
      const grpc::Status status = hello();
      if (status.ok()) return;
      if (is_permanent(status.error_code())) fail(stream_error(status, "connecting"));
      last_problem = status.error_message();
      if (Clock::now() + backoff > deadline) {
        fail(GameLinkError(ErrorCode::kUnavailable, "could not open a link at " + address_ +
                                                        " within " + seconds_text(timeout) +
                                                        ": " + last_problem));
      }
      std::this_thread::sleep_for(backoff);
      backoff = std::min(backoff * 2, std::chrono::milliseconds(2000));
    }
  }

  // Hello -> Welcome on the fresh stream. OK: welcome_ is set; an error status: the stream
  // ended before a Welcome. An in-band refusal (a bad space, too many agents) is thrown.
  grpc::Status hello() {
    v1::ConnectRequest request;
    request.set_request_id(next_request_id_++);
    auto* hello = request.mutable_hello();
    hello->set_game(options_.game);
    hello->set_env_id(options_.env_id);
    *hello->mutable_observation_space() = options_.observation_space;
    *hello->mutable_action_space() = options_.action_space;
    hello->set_num_agents(options_.num_agents);
    hello->set_protocol_version(kProtocolVersion);
    hello->set_session_key(session_key_);
    hello->set_max_in_flight(options_.max_in_flight);
    for (const auto& [key, value] : options_.labels) (*hello->mutable_labels())[key] = value;

    v1::ConnectResponse response;
    if (!stream_->Write(request) || !stream_->Read(&response)) return finish();
    if (response.has_error()) fail(GameLinkError::from_status(response.error()));
    if (!response.has_welcome()) {
      fail(GameLinkError(ErrorCode::kInternal, "protocol violation: Hello not answered with "
                                               "Welcome"));
    }
    if (!expected_run_.empty() && !response.welcome().run().empty() &&
        response.welcome().run() != expected_run_) {
      say_goodbye("wrong run");  // release the link this Hello opened
      fail(GameLinkError(ErrorCode::kFailedPrecondition,
                         "the env server at " + address_ + " serves run '" +
                             response.welcome().run() + "', not '" + expected_run_ + "'", "run"));
    }
    welcome_ = response.welcome();
    policy_version_ = welcome_.policy_version();
    if (welcome_.resumed() && (!ticks_sent_ || max_tick_sent_ < welcome_.last_tick())) {
      // A new GameLink (a restarted game) resuming its key: act() continues after last_tick.
      max_tick_sent_ = welcome_.last_tick();
      ticks_sent_ = true;
    }
    return grpc::Status::OK;
  }

  // Best effort: ends the link at once instead of leaving it for the resume window.
  void say_goodbye(const std::string& reason) {
    v1::ConnectRequest request;
    request.set_request_id(next_request_id_++);
    request.mutable_goodbye()->set_reason(reason);
    v1::ConnectResponse response;
    if (stream_->Write(request)) {
      while (stream_->Read(&response) && response.request_id() != request.request_id()) {
      }
    }
  }

  // After the stream ended without Goodbye: connect again with the same session key, then
  // resend what the server has not answered (a resumed link continues right after last_tick).
  void recover(const grpc::Status& status) {
    if (is_permanent(status.error_code())) fail(stream_error(status, "the link broke"));
    options_.log("stream to " + address_ + " broke (" +
                 code_name(static_cast<ErrorCode>(status.error_code())) + ": " +
                 status.error_message() + "); reconnecting");
    const std::string old_link = welcome_.link_id();
    connect(options_.reconnect_timeout);
    ++reconnects_;
    for (Pending& pending : pending_) {
      if (pending.lost) continue;
      if (welcome_.resumed() && pending.request.observations().tick() <= welcome_.last_tick()) {
        pending.lost = true;
        continue;
      }
      stream_->Write(pending.request);
    }
    if (welcome_.resumed()) {
      options_.log("resumed link " + welcome_.link_id() + " after tick " +
                   std::to_string(welcome_.last_tick()));
    } else {
      options_.log("link " + old_link + " was not resumed; continuing as link " +
                   welcome_.link_id() + " (the server truncated the open episodes)");
    }
  }

  // The status the stream ended with; the stream is gone afterwards (Finish runs only once).
  grpc::Status finish() {
    grpc::Status status = stream_->Finish();
    stream_.reset();
    context_.reset();
    return status;
  }

  void cancel() {
    if (stream_ && context_) {
      context_->TryCancel();
      stream_->Finish();
    }
    stream_.reset();
    context_.reset();
  }

  GameLinkOptions options_;
  std::string address_;
  std::string session_key_;
  std::string expected_run_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::GameLinkService::Stub> stub_;
  std::unique_ptr<grpc::ClientContext> context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::ConnectRequest, v1::ConnectResponse>> stream_;
  std::deque<Pending> pending_;
  v1::Welcome welcome_;
  std::uint64_t next_request_id_ = 1;
  std::uint64_t max_tick_sent_ = 0;
  bool ticks_sent_ = false;
  std::int64_t policy_version_ = 0;
  int reconnects_ = 0;
  std::optional<Farewell> farewell_;
  std::optional<GameLinkError> dead_;
};

GameLink::GameLink(GameLinkOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {}
GameLink::~GameLink() = default;
GameLink::GameLink(GameLink&&) noexcept = default;
GameLink& GameLink::operator=(GameLink&&) noexcept = default;

Actions GameLink::act(const Observations& observations, const std::vector<float>& rewards,
                      const std::vector<bool>& terminated, const std::vector<bool>& truncated,
                      const std::vector<std::int64_t>& episode_ids) {
  return impl_->act(observations, rewards, terminated, truncated, episode_ids);
}

void GameLink::submit(std::uint64_t tick, const Observations& observations,
                      const std::vector<float>& rewards, const std::vector<bool>& terminated,
                      const std::vector<bool>& truncated,
                      const std::vector<std::int64_t>& episode_ids) {
  impl_->submit(tick, observations, rewards, terminated, truncated, episode_ids);
}

Actions GameLink::receive() { return impl_->receive(); }
Farewell GameLink::close(const std::string& reason) { return impl_->close(reason); }
std::size_t GameLink::in_flight() const { return impl_->in_flight(); }
const std::string& GameLink::link_id() const { return impl_->welcome().link_id(); }
const std::string& GameLink::session_key() const { return impl_->session_key(); }
const std::string& GameLink::run() const { return impl_->welcome().run(); }
std::uint32_t GameLink::max_in_flight() const { return impl_->welcome().max_in_flight(); }
bool GameLink::resumed() const { return impl_->welcome().resumed(); }
std::uint64_t GameLink::last_tick() const { return impl_->welcome().last_tick(); }
double GameLink::resume_window_s() const { return impl_->welcome().resume_window_s(); }
std::int64_t GameLink::policy_version() const { return impl_->policy_version(); }
int GameLink::reconnects() const { return impl_->reconnects(); }

}  // namespace rlfleet
