// Errors as values: Status (ok or a message) and Result<T> (a value or a failed Status).
// Messages name the file, tensor and what was expected; callers add context with with_context().
#pragma once

#include <string>
#include <utility>
#include <variant>

namespace trestle {

class [[nodiscard]] Status {
 public:
  Status() = default;
  static Status Error(std::string message) { return Status(std::move(message)); }

  bool ok() const { return !failed_; }
  const std::string& message() const { return message_; }
  // Prefixes the message ("file.safetensors: <message>"); an ok status stays ok.
  Status with_context(const std::string& context) const { return ok() ? *this : Status(context + ": " + message_); }

 private:
  explicit Status(std::string message) : failed_(true), message_(std::move(message)) {}
  bool failed_ = false;
  std::string message_;
};

inline Status OkStatus() { return Status(); }

template <class T>
class [[nodiscard]] Result {
 public:
  Result(T value) : state_(std::move(value)) {}      // NOLINT: implicit by design
  Result(Status error) : state_(std::move(error)) {  // NOLINT: implicit by design
    if (std::get<Status>(state_).ok()) state_ = Status::Error("internal: Result built from an ok Status");
  }

  bool ok() const { return std::holds_alternative<T>(state_); }
  Status status() const { return ok() ? OkStatus() : std::get<Status>(state_); }
  T& value() & { return std::get<T>(state_); }
  const T& value() const& { return std::get<T>(state_); }
  T&& value() && { return std::get<T>(std::move(state_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  std::variant<T, Status> state_;
};

}  // namespace trestle

#define TRESTLE_CONCAT_INNER(a, b) a##b
#define TRESTLE_CONCAT(a, b) TRESTLE_CONCAT_INNER(a, b)

// Returns the status from the enclosing function when it is an error.
#define TRESTLE_RETURN_IF_ERROR(expr)                  \
  do {                                                 \
    ::trestle::Status trestle_status_ = (expr);        \
    if (!trestle_status_.ok()) return trestle_status_; \
  } while (0)

// `TRESTLE_ASSIGN_OR_RETURN(auto x, make_x());` binds the value or returns the error. Expands to several
// statements: never use it as the body of an unbraced if/for.
#define TRESTLE_ASSIGN_OR_RETURN(lhs, expr) \
  TRESTLE_ASSIGN_OR_RETURN_IMPL(TRESTLE_CONCAT(trestle_result_, __LINE__), lhs, expr)
#define TRESTLE_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) return tmp.status();                 \
  lhs = std::move(tmp).value()
