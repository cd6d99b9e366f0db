// mtpx tokenize: text in, ids (and pieces) out.
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/commands.h"
#include "cli/common.h"
#include "util/error.h"

namespace mtpx::cli {
namespace {

struct TokenizeFlags {
  std::string model;
  std::string text;
  std::string file;
  bool text_given = false;
  bool json = false;
};

int run_tokenize(const TokenizeFlags& f) {
  if (f.text_given == !f.file.empty()) invalid_input("give exactly one of --text and --file");
  const auto dir = resolve_model_dir(f.model);
  auto tokenizer = load_tokenizer_if_present(dir);
  if (!tokenizer) fail(ErrorKind::kNotFound, "'{}' has no tokenizer.json", dir.string());
  std::string text = f.text;
  if (!f.file.empty()) {
    std::ifstream in(f.file, std::ios::binary);
    if (!in) fail(ErrorKind::kNotFound, "--file: cannot open '{}'", f.file);
    std::stringstream buffer;
    buffer << in.rdbuf();
    text = buffer.str();
  }
  const std::vector<int32_t> ids = tokenizer->encode(text);
  if (f.json) {
    nlohmann::json pieces = nlohmann::json::array();
    for (int32_t id : ids) pieces.push_back(tokenizer->token_piece(id));
    std::printf("%s\n", nlohmann::json({{"ids", ids}, {"pieces", pieces}})
                            .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)
                            .c_str());
  } else {
    for (size_t i = 0; i < ids.size(); ++i) std::printf("%s%d", i ? "," : "", ids[i]);
    std::printf("\n");
  }
  return 0;
}

}  // namespace

std::function<int()> add_tokenize_command(CLI::App& app) {
  auto f = std::make_shared<TokenizeFlags>();
  app.add_option("--model", f->model, "model directory (default: $MTPX_MODEL or the shipped model)");
  app.add_option("--text", f->text, "text to tokenize")->each([f](const std::string&) {
    f->text_given = true;
  });
  app.add_option("--file", f->file, "file whose contents to tokenize");
  app.add_flag("--json", f->json, "print {\"ids\": [...], \"pieces\": [...]}");
  return [f] { return run_tokenize(*f); };
}

}  // namespace mtpx::cli
