#include "server/chat_page.h"

namespace mtpx::server {

std::string_view chat_page_html() {
  // chat.html.inc is the page wrapped in a raw string literal, so the page stays an ordinary HTML file
  // to edit while the binary needs no files at run time.
  static constexpr std::string_view kPage =
#include "server/web/chat.html.inc"
      ;
  return kPage;
}

std::string_view chat_page_icon_svg() {
  // Two stacked chevrons (a draft running ahead of the verified text) on the page's accent blue.
  return R"(<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 32 32">)"
         R"(<rect width="32" height="32" rx="7" fill="#2563eb"/>)"
         R"(<path d="M8 9l7 7-7 7M17 9l7 7-7 7" fill="none" stroke="#fff" stroke-width="3.2" )"
         R"(stroke-linecap="round" stroke-linejoin="round"/></svg>)";
}

}  // namespace mtpx::server
