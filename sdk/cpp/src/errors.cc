#include "rlfleet/errors.h"

#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"

namespace rlfleet {

std::string code_name(ErrorCode code) {
  static const char* const names[] = {
      "OK",           "CANCELLED",          "UNKNOWN",           "INVALID_ARGUMENT",
      "DEADLINE_EXCEEDED", "NOT_FOUND",     "ALREADY_EXISTS",    "PERMISSION_DENIED",
      "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED",    "OUT_OF_RANGE",
      "UNIMPLEMENTED", "INTERNAL",          "UNAVAILABLE",       "DATA_LOSS",
      "UNAUTHENTICATED"};
  const int index = static_cast<int>(code);
  if (index < 0 || index > 16) return "CODE_" + std::to_string(index);
  return names[index];
}

namespace {

std::string what_text(ErrorCode code, const std::string& message, const std::string& field) {
  std::string text = code_name(code) + ": " + message;
  if (!field.empty()) text += " (field " + field + ")";
  return text;
}

}  // namespace

GameLinkError::GameLinkError(ErrorCode code, std::string message, std::string field,
                             std::string reason)
    : std::runtime_error(what_text(code, message, field)),
      code_(code),
      message_(std::move(message)),
      field_(std::move(field)),
      reason_(std::move(reason)) {}

GameLinkError GameLinkError::from_status(const google::rpc::Status& status) {
  std::string field;
  std::string reason;
  for (const auto& detail : status.details()) {
    google::rpc::BadRequest bad_request;
    google::rpc::ErrorInfo info;
    if (detail.UnpackTo(&bad_request) && bad_request.field_violations_size() > 0 && field.empty()) {
      field = bad_request.field_violations(0).field();
    } else if (detail.UnpackTo(&info) && reason.empty()) {
      reason = info.reason();
    }
  }
  return GameLinkError(static_cast<ErrorCode>(status.code()), status.message(), field, reason);
}

}  // namespace rlfleet
