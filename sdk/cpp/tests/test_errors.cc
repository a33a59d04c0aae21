#include <gtest/gtest.h>

#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"
#include "rlfleet/errors.h"

using rlfleet::ErrorCode;
using rlfleet::GameLinkError;

TEST(Errors, FromStatusReadsCodeFieldAndReason) {
  // What the server's services/errors.py puts into ConnectResponse.error.
  google::rpc::Status status;
  status.set_code(3);
  status.set_message("rewards must be finite");
  google::rpc::BadRequest bad_request;
  auto* violation = bad_request.add_field_violations();
  violation->set_field("observations.rewards");
  violation->set_description("rewards must be finite");
  status.add_details()->PackFrom(bad_request);
  google::rpc::ErrorInfo info;
  info.set_reason("InvalidArgument");
  info.set_domain("rlfleet");
  status.add_details()->PackFrom(info);

  const GameLinkError error = GameLinkError::from_status(status);
  EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(error.message(), "rewards must be finite");
  EXPECT_EQ(error.field(), "observations.rewards");
  EXPECT_EQ(error.reason(), "InvalidArgument");
  EXPECT_STREQ(error.what(),
               "INVALID_ARGUMENT: rewards must be finite (field observations.rewards)");
}

TEST(Errors, WithoutDetails) {
  google::rpc::Status status;
  status.set_code(9);
  status.set_message("Hello first");
  const GameLinkError error = GameLinkError::from_status(status);
  EXPECT_EQ(error.code(), ErrorCode::kFailedPrecondition);
  EXPECT_EQ(error.field(), "");
  EXPECT_STREQ(error.what(), "FAILED_PRECONDITION: Hello first");
}

TEST(Errors, CodeNames) {
  EXPECT_EQ(rlfleet::code_name(ErrorCode::kResourceExhausted), "RESOURCE_EXHAUSTED");
  EXPECT_EQ(rlfleet::code_name(ErrorCode::kUnauthenticated), "UNAUTHENTICATED");
  EXPECT_EQ(rlfleet::code_name(static_cast<ErrorCode>(42)), "CODE_42");
}
