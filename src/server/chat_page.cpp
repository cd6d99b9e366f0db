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

}  // namespace mtpx::server
