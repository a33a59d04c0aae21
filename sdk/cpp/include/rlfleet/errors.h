// What GameLink throws: GameLinkError, carrying the gRPC status code, the offending field (from
// the server's google.rpc.BadRequest detail, e.g. "observations.observations.image") and the
// rlfleet error class name (from its google.rpc.ErrorInfo, e.g. "InvalidArgument").
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace google::rpc {
class Status;
}

namespace rlfleet {

// gRPC / google.rpc status codes, same numbers.
enum class ErrorCode : int {
  kOk = 0,
  kCancelled = 1,
  kUnknown = 2,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kNotFound = 5,
  kAlreadyExists = 6,
  kPermissionDenied = 7,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kAborted = 10,
  kOutOfRange = 11,
  kUnimplemented = 12,
  kInternal = 13,
  kUnavailable = 14,
  kDataLoss = 15,
  kUnauthenticated = 16,
};

// "INVALID_ARGUMENT", "UNAVAILABLE", ...
std::string code_name(ErrorCode code);

class GameLinkError : public std::runtime_error {
 public:
  GameLinkError(ErrorCode code, std::string message, std::string field = "",
                std::string reason = "");
  // From an in-band ConnectResponse.error.
  static GameLinkError from_status(const google::rpc::Status& status);

  ErrorCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // The request field the error is about ("" when it names none).
  const std::string& field() const { return field_; }
  // The server's error class (ErrorInfo.reason), "" when it sent none.
  const std::string& reason() const { return reason_; }

 private:
  ErrorCode code_;
  std::string message_;
  std::string field_;
  std::string reason_;
};

}  // namespace rlfleet
