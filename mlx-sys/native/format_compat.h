// GCC 12 ships no <format>. mlx-c only formats error messages with plain
// "{}" placeholders, so a minimal std::format covering that is enough.
#pragma once
#if defined(__cplusplus)
#if __has_include(<format>) && !defined(__GLIBCXX__)
#include <format>
#elif __has_include(<format>) && defined(__GLIBCXX__) && __GNUC__ >= 13
#include <format>
#else
#include <sstream>
#include <string>
#include <string_view>

namespace std {
namespace mlx_format_compat {
inline void append(std::ostringstream& out, std::string_view& fmt) {
  out << fmt;
  fmt = {};
}
template <typename T, typename... Rest>
void append(std::ostringstream& out, std::string_view& fmt, const T& value,
            const Rest&... rest) {
  auto pos = fmt.find("{}");
  if (pos == std::string_view::npos) {
    append(out, fmt);
    return;
  }
  out << fmt.substr(0, pos) << value;
  fmt = fmt.substr(pos + 2);
  append(out, fmt, rest...);
}
}  // namespace mlx_format_compat

template <typename... Args>
std::string format(std::string_view fmt, const Args&... args) {
  std::ostringstream out;
  mlx_format_compat::append(out, fmt, args...);
  return out.str();
}
}  // namespace std
#endif
#endif
