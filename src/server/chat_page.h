// The built-in chat page served at `/`: one self-contained HTML file (CSS and JavaScript inline, no build
// step), compiled into the binary from src/server/web/chat.html.
#pragma once

#include <string_view>

namespace mtpx::server {

std::string_view chat_page_html();
// The page's icon (served at /favicon.ico and /favicon.svg): an SVG.
std::string_view chat_page_icon_svg();

}  // namespace mtpx::server
