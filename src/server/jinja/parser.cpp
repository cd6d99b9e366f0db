#include "server/jinja/parser.h"

#include <algorithm>

#include "server/jinja/limits.h"
#include "util/error.h"

namespace mtpx::jinja {
namespace {

template <typename T>
std::unique_ptr<T> make_node(int line) {
  auto node = std::make_unique<T>();
  node->line = line;
  return node;
}

class Parser {
 public:
  explicit Parser(const std::vector<Segment>& segments) : segments_(segments) {}

  Body parse_template() {
    std::string end;
    Body body = parse_body({}, end);
    return body;
  }

 private:
  // ---- statements ----

  // Parses segments until a statement whose keyword is in `ends` (returned in `found`, with the cursor
  // after the keyword), or the end of the template when `ends` is empty.
  Body parse_body(const std::vector<std::string>& ends, std::string& found) {
    const Nesting nesting(*this, segment_ < segments_.size() ? segments_[segment_].line : last_line());
    Body body;
    while (segment_ < segments_.size()) {
      const Segment& segment = segments_[segment_++];
      if (segment.kind == Segment::Kind::kText) {
        auto node = make_node<TextNode>(segment.line);
        node->text = segment.text;
        body.push_back(std::move(node));
        continue;
      }
      tokens_ = &segment.tokens;
      token_ = 0;
      if (segment.kind == Segment::Kind::kOutput) {
        auto node = make_node<OutputNode>(segment.line);
        node->expression = parse_expression();
        expect_end();
        body.push_back(std::move(node));
        continue;
      }
      const Token keyword = next();
      if (keyword.kind != Token::Kind::kName) error(keyword, "expected a statement name");
      if (std::find(ends.begin(), ends.end(), keyword.text) != ends.end()) {
        found = keyword.text;
        return body;
      }
      parse_statement(keyword, body);
    }
    if (!ends.empty()) error_at(last_line(), "missing {{% {} %}}", ends.back());
    return body;
  }

  void parse_statement(const Token& keyword, Body& body) {
    const std::string& k = keyword.text;
    std::string found;
    if (k == "if") {
      auto node = make_node<IfNode>(keyword.line);
      ExprPtr condition = parse_expression();
      expect_end();
      while (true) {
        Body branch = parse_body({"elif", "else", "endif"}, found);
        node->branches.emplace_back(std::move(condition), std::move(branch));
        if (found != "elif") break;
        condition = parse_expression();
        expect_end();
      }
      if (found == "else") {
        expect_end();
        node->otherwise = parse_body({"endif"}, found);
      }
      expect_end();
      body.push_back(std::move(node));
    } else if (k == "for") {
      auto node = make_node<ForNode>(keyword.line);
      do {
        node->targets.push_back(expect_name("a loop variable"));
      } while (accept_operator(","));
      if (!accept_name("in")) error(peek(), "expected 'in'");
      node->iterable = parse_or();
      if (accept_name("if")) node->filter = parse_expression();
      if (accept_name("recursive")) error(peek(), "recursive loops are not supported");
      expect_end();
      node->body = parse_body({"else", "endfor"}, found);
      if (found == "else") {
        expect_end();
        node->otherwise = parse_body({"endfor"}, found);
      }
      expect_end();
      body.push_back(std::move(node));
    } else if (k == "set") {
      const std::string name = expect_name("a variable name");
      if (accept_operator(".")) {
        auto node = make_node<SetNode>(keyword.line);
        auto object = make_node<NameExpr>(keyword.line);
        object->name = name;
        node->namespace_object = std::move(object);
        node->attribute = expect_name("an attribute name");
        expect_operator("=");
        node->value = parse_expression();
        expect_end();
        body.push_back(std::move(node));
      } else if (peek().kind == Token::Kind::kEnd) {
        expect_end();
        auto node = make_node<SetBlockNode>(keyword.line);
        node->target = name;
        node->body = parse_body({"endset"}, found);
        expect_end();
        body.push_back(std::move(node));
      } else {
        auto node = make_node<SetNode>(keyword.line);
        node->targets.push_back(name);
        while (accept_operator(",")) node->targets.push_back(expect_name("a variable name"));
        expect_operator("=");
        node->value = parse_tuple_or_expression();
        expect_end();
        body.push_back(std::move(node));
      }
    } else if (k == "macro") {
      auto node = make_node<MacroNode>(keyword.line);
      node->name = expect_name("a macro name");
      expect_operator("(");
      while (!accept_operator(")")) {
        std::string parameter = expect_name("a parameter name");
        ExprPtr default_value;
        if (accept_operator("=")) default_value = parse_expression();
        node->parameters.emplace_back(std::move(parameter), std::move(default_value));
        if (!accept_operator(",")) {
          expect_operator(")");
          break;
        }
      }
      expect_end();
      node->body = parse_body({"endmacro"}, found);
      expect_end();
      body.push_back(std::move(node));
    } else if (k == "filter") {
      auto node = make_node<FilterBlockNode>(keyword.line);
      node->filter = expect_name("a filter name");
      if (accept_operator("(")) node->arguments = parse_call_arguments();
      expect_end();
      node->body = parse_body({"endfilter"}, found);
      expect_end();
      body.push_back(std::move(node));
    } else if (k == "break" || k == "continue") {
      auto node = make_node<LoopControlNode>(keyword.line);
      node->flow = k == "break" ? Flow::kBreak : Flow::kContinue;
      expect_end();
      body.push_back(std::move(node));
    } else if (k == "generation") {
      // transformers' {% generation %} marks assistant text for training masks; it renders its body.
      expect_end();
      Body inner = parse_body({"endgeneration"}, found);
      expect_end();
      for (auto& node : inner) body.push_back(std::move(node));
    } else {
      error(keyword, "unsupported tag '" + k + "'");
    }
  }

  // ---- expressions ----

  ExprPtr parse_expression() {
    const Nesting nesting(*this, peek().line);
    ExprPtr then = parse_or();
    while (accept_name("if")) {
      auto node = make_node<ConditionalExpr>(then->line);
      node->then = std::move(then);
      node->condition = parse_or();
      if (accept_name("else")) node->otherwise = parse_expression();
      set_depth(*node, {node->then.get(), node->condition.get(), node->otherwise.get()});
      then = std::move(node);
    }
    return then;
  }

  // `a, b` on the right of a set becomes a list, as Python's tuple would.
  ExprPtr parse_tuple_or_expression() {
    ExprPtr first = parse_expression();
    if (!is_operator(",")) return first;
    auto list = make_node<ListExpr>(first->line);
    list->items.push_back(std::move(first));
    while (accept_operator(",")) {
      if (peek().kind == Token::Kind::kEnd) break;
      list->items.push_back(parse_expression());
    }
    set_depth(*list, list->items);
    return list;
  }

  ExprPtr binary(std::string op, ExprPtr left, ExprPtr right) {
    auto node = make_node<BinaryExpr>(left->line);
    node->op = std::move(op);
    node->left = std::move(left);
    node->right = std::move(right);
    set_depth(*node, {node->left.get(), node->right.get()});
    return node;
  }

  ExprPtr parse_or() {
    ExprPtr left = parse_and();
    while (accept_name("or")) left = binary("or", std::move(left), parse_and());
    return left;
  }

  ExprPtr parse_and() {
    ExprPtr left = parse_not();
    while (accept_name("and")) left = binary("and", std::move(left), parse_not());
    return left;
  }

  ExprPtr parse_not() {
    if (peek().kind == Token::Kind::kName && peek().text == "not") {
      const int line = next().line;
      const Nesting nesting(*this, line);
      auto node = make_node<UnaryExpr>(line);
      node->op = "not";
      node->operand = parse_not();
      set_depth(*node, {node->operand.get()});
      return node;
    }
    return parse_compare();
  }

  // Chained comparisons (a < b < c) are rare in templates; they evaluate left to right here.
  ExprPtr parse_compare() {
    ExprPtr left = parse_math1();
    while (true) {
      static const char* const kOps[] = {"==", "!=", "<", ">", "<=", ">="};
      std::string op;
      for (const char* candidate : kOps)
        if (is_operator(candidate)) op = candidate;
      if (!op.empty()) {
        next();
      } else if (accept_name("in")) {
        op = "in";
      } else if (peek().kind == Token::Kind::kName && peek().text == "not" &&
                 peek(1).kind == Token::Kind::kName && peek(1).text == "in") {
        next();
        next();
        op = "not in";
      } else {
        return left;
      }
      left = binary(op, std::move(left), parse_math1());
    }
  }

  ExprPtr parse_math1() {
    ExprPtr left = parse_concat();
    while (is_operator("+") || is_operator("-")) {
      const std::string op = next().text;
      left = binary(op, std::move(left), parse_concat());
    }
    return left;
  }

  ExprPtr parse_concat() {
    ExprPtr left = parse_math2();
    while (accept_operator("~")) left = binary("~", std::move(left), parse_math2());
    return left;
  }

  ExprPtr parse_math2() {
    ExprPtr left = parse_pow();
    while (is_operator("*") || is_operator("/") || is_operator("//") || is_operator("%")) {
      const std::string op = next().text;
      left = binary(op, std::move(left), parse_pow());
    }
    return left;
  }

  ExprPtr parse_pow() {
    ExprPtr left = parse_unary(true);
    while (accept_operator("**")) left = binary("**", std::move(left), parse_unary(true));
    return left;
  }

  ExprPtr parse_unary(bool with_filter) {
    ExprPtr node;
    if (is_operator("-") || is_operator("+")) {
      const Token op = next();
      const Nesting nesting(*this, op.line);
      auto unary = make_node<UnaryExpr>(op.line);
      unary->op = op.text;
      unary->operand = parse_unary(false);
      set_depth(*unary, {unary->operand.get()});
      node = std::move(unary);
    } else {
      node = parse_primary();
    }
    node = parse_postfix(std::move(node));
    if (with_filter) node = parse_filter_and_test(std::move(node));
    return node;
  }

  ExprPtr parse_primary() {
    const Token token = next();
    switch (token.kind) {
      case Token::Kind::kName: {
        if (token.text == "true" || token.text == "True") return literal(Value(true), token.line);
        if (token.text == "false" || token.text == "False") return literal(Value(false), token.line);
        if (token.text == "none" || token.text == "None") return literal(Value::none(), token.line);
        auto node = make_node<NameExpr>(token.line);
        node->name = token.text;
        return node;
      }
      case Token::Kind::kString: {
        std::string text = token.text;
        while (peek().kind == Token::Kind::kString) text += next().text;  // adjacent literals concatenate
        return literal(Value(std::move(text)), token.line);
      }
      case Token::Kind::kInt:
        return literal(Value(token.int_value), token.line);
      case Token::Kind::kFloat:
        return literal(Value(token.float_value), token.line);
      case Token::Kind::kOperator:
        if (token.text == "(") {
          if (accept_operator(")")) {  // ()
            auto empty = make_node<ListExpr>(token.line);
            empty->tuple = true;
            return empty;
          }
          ExprPtr inner = parse_expression();
          if (accept_operator(")")) return inner;
          auto tuple = make_node<ListExpr>(token.line);
          tuple->tuple = true;
          tuple->items.push_back(std::move(inner));
          while (accept_operator(",")) {
            if (is_operator(")")) break;
            tuple->items.push_back(parse_expression());
          }
          expect_operator(")");
          set_depth(*tuple, tuple->items);
          return tuple;
        }
        if (token.text == "[") {
          auto list = make_node<ListExpr>(token.line);
          while (!accept_operator("]")) {
            list->items.push_back(parse_expression());
            if (!accept_operator(",")) {
              expect_operator("]");
              break;
            }
          }
          set_depth(*list, list->items);
          return list;
        }
        if (token.text == "{") {
          auto dict = make_node<DictExpr>(token.line);
          while (!accept_operator("}")) {
            ExprPtr key = parse_expression();
            expect_operator(":");
            dict->items.emplace_back(std::move(key), parse_expression());
            if (!accept_operator(",")) {
              expect_operator("}");
              break;
            }
          }
          int deepest = 0;
          for (const auto& [key, value] : dict->items)
            deepest = std::max({deepest, key->depth, value->depth});
          set_depth(*dict, deepest);
          return dict;
        }
        break;
      case Token::Kind::kEnd:
        error(token, "unexpected end of expression");
    }
    error(token, "unexpected '" + token.text + "'");
  }

  ExprPtr literal(Value value, int line) {
    auto node = make_node<LiteralExpr>(line);
    node->value = std::move(value);
    return node;
  }

  ExprPtr parse_postfix(ExprPtr node) {
    while (true) {
      if (accept_operator(".")) {
        const Token name = next();
        if (name.kind == Token::Kind::kInt) {  // x.0 is x[0]
          auto subscript = make_node<SubscriptExpr>(name.line);
          subscript->object = std::move(node);
          subscript->index = literal(Value(name.int_value), name.line);
          set_depth(*subscript, {subscript->object.get()});
          node = std::move(subscript);
          continue;
        }
        if (name.kind != Token::Kind::kName) error(name, "expected an attribute name after '.'");
        auto attribute = make_node<AttributeExpr>(name.line);
        attribute->object = std::move(node);
        attribute->name = name.text;
        set_depth(*attribute, {attribute->object.get()});
        node = std::move(attribute);
      } else if (is_operator("[")) {
        node = parse_subscript(std::move(node));
      } else if (accept_operator("(")) {
        auto call = make_node<CallExpr>(node->line);
        call->callee = std::move(node);
        call->arguments = parse_call_arguments();
        set_depth(*call, std::max(call->callee->depth, depth_of(call->arguments)));
        node = std::move(call);
      } else {
        return node;
      }
    }
  }

  ExprPtr parse_subscript(ExprPtr object) {
    const int line = next().line;  // '['
    ExprPtr parts[3];
    int colons = 0;
    while (!accept_operator("]")) {
      if (accept_operator(":")) {
        if (++colons > 2) error(peek(), "too many ':' in a slice");
        continue;
      }
      if (parts[colons]) error(peek(), "expected ']'");
      parts[colons] = parse_expression();
    }
    if (colons == 0) {
      if (!parts[0]) error_at(line, "empty subscript");
      auto node = make_node<SubscriptExpr>(line);
      node->object = std::move(object);
      node->index = std::move(parts[0]);
      set_depth(*node, {node->object.get(), node->index.get()});
      return node;
    }
    auto node = make_node<SliceExpr>(line);
    node->object = std::move(object);
    node->start = std::move(parts[0]);
    node->stop = std::move(parts[1]);
    node->step = std::move(parts[2]);
    set_depth(*node, {node->object.get(), node->start.get(), node->stop.get(), node->step.get()});
    return node;
  }

  // After '(' up to and including ')'.
  Arguments parse_call_arguments() {
    Arguments arguments;
    while (!accept_operator(")")) {
      if (peek().kind == Token::Kind::kName && peek(1).kind == Token::Kind::kOperator &&
          peek(1).text == "=") {
        std::string name = next().text;
        next();
        arguments.keyword.emplace_back(std::move(name), parse_expression());
      } else {
        if (!arguments.keyword.empty()) error(peek(), "positional argument after a keyword argument");
        arguments.positional.push_back(parse_expression());
      }
      if (!accept_operator(",")) {
        expect_operator(")");
        break;
      }
    }
    return arguments;
  }

  ExprPtr parse_filter_and_test(ExprPtr node) {
    while (true) {
      if (accept_operator("|")) {
        auto filter = make_node<FilterExpr>(node->line);
        filter->operand = std::move(node);
        filter->name = expect_name("a filter name");
        while (accept_operator(".")) {
          filter->name += '.';
          filter->name += expect_name("a filter name");
        }
        if (accept_operator("(")) filter->arguments = parse_call_arguments();
        set_depth(*filter, std::max(filter->operand->depth, depth_of(filter->arguments)));
        node = std::move(filter);
      } else if (accept_name("is")) {
        auto test = make_node<TestExpr>(node->line);
        test->operand = std::move(node);
        test->negated = accept_name("not");
        test->name = expect_name("a test name");
        if (accept_operator("(")) {
          test->arguments = parse_call_arguments();
        } else if (starts_test_argument()) {
          test->arguments.positional.push_back(parse_postfix(parse_primary()));
        }
        set_depth(*test, std::max(test->operand->depth, depth_of(test->arguments)));
        node = std::move(test);
      } else if (accept_operator("(")) {
        auto call = make_node<CallExpr>(node->line);
        call->callee = std::move(node);
        call->arguments = parse_call_arguments();
        set_depth(*call, std::max(call->callee->depth, depth_of(call->arguments)));
        node = std::move(call);
      } else {
        return node;
      }
    }
  }

  // `x is divisibleby 3`: a test takes one argument without parentheses, as Jinja's parser decides.
  bool starts_test_argument() {
    const Token& t = peek();
    if (t.kind == Token::Kind::kString || t.kind == Token::Kind::kInt || t.kind == Token::Kind::kFloat)
      return true;
    if (t.kind == Token::Kind::kName)
      return t.text != "else" && t.text != "or" && t.text != "and" && t.text != "if" && t.text != "is";
    return t.kind == Token::Kind::kOperator && (t.text == "[" || t.text == "{");
  }

  // ---- nesting ----

  // The parser's own recursion (nested blocks, parentheses, `not not x`): at most kMaxNesting deep.
  class Nesting {
   public:
    Nesting(Parser& parser, int line) : parser_(parser) {
      if (++parser_.nesting_ > kMaxNesting)
        parser_.error_at(line, "blocks and expressions nested deeper than {} levels", kMaxNesting);
    }
    ~Nesting() { --parser_.nesting_; }
    Nesting(const Nesting&) = delete;
    Nesting& operator=(const Nesting&) = delete;

   private:
    Parser& parser_;
  };

  // A new node's depth is one more than its deepest child's. The interpreter evaluates (and frees) an
  // expression recursively, so a tree deeper than kMaxNesting is refused here.
  void set_depth(Expr& node, int deepest_child) const {
    node.depth = deepest_child + 1;
    if (node.depth > kMaxNesting)
      error_at(node.line, "an expression nested deeper than {} levels", kMaxNesting);
  }
  void set_depth(Expr& node, std::initializer_list<const Expr*> children) const {
    int deepest = 0;
    for (const Expr* child : children) deepest = std::max(deepest, child != nullptr ? child->depth : 0);
    set_depth(node, deepest);
  }
  void set_depth(Expr& node, const std::vector<ExprPtr>& children) const {
    int deepest = 0;
    for (const auto& child : children) deepest = std::max(deepest, child->depth);
    set_depth(node, deepest);
  }
  static int depth_of(const Arguments& arguments) {
    int deepest = 0;
    for (const auto& e : arguments.positional) deepest = std::max(deepest, e->depth);
    for (const auto& [name, e] : arguments.keyword) deepest = std::max(deepest, e->depth);
    return deepest;
  }

  // ---- token cursor ----

  const Token& peek(size_t ahead = 0) const {
    const size_t i = std::min(token_ + ahead, tokens_->size() - 1);
    return (*tokens_)[i];
  }
  Token next() {
    const Token& t = peek();
    if (t.kind != Token::Kind::kEnd) ++token_;
    return t;
  }
  bool is_operator(const char* op) const {
    return peek().kind == Token::Kind::kOperator && peek().text == op;
  }
  bool accept_operator(const char* op) {
    if (!is_operator(op)) return false;
    next();
    return true;
  }
  bool accept_name(const char* name) {
    if (peek().kind != Token::Kind::kName || peek().text != name) return false;
    next();
    return true;
  }
  void expect_operator(const char* op) {
    if (!accept_operator(op)) error(peek(), std::string("expected '") + op + "'");
  }
  std::string expect_name(const char* what) {
    const Token t = next();
    if (t.kind != Token::Kind::kName) error(t, std::string("expected ") + what);
    return t.text;
  }
  void expect_end() {
    if (peek().kind != Token::Kind::kEnd)
      error(peek(), "unexpected '" + peek().text + "' at the end of the tag");
  }
  int last_line() const { return segments_.empty() ? 1 : segments_.back().line; }

  [[noreturn]] void error(const Token& token, const std::string& what) const {
    error_at(token.line, "{}", what);
  }
  template <typename... Args>
  [[noreturn]] void error_at(int line, fmt::format_string<Args...> format, Args&&... args) const {
    invalid_input("chat template line {}: {}", line, fmt::format(format, std::forward<Args>(args)...));
  }

  const std::vector<Segment>& segments_;
  size_t segment_ = 0;
  const std::vector<Token>* tokens_ = nullptr;
  size_t token_ = 0;
  int nesting_ = 0;
};

}  // namespace

Body parse(const std::vector<Segment>& segments) { return Parser(segments).parse_template(); }

}  // namespace mtpx::jinja
