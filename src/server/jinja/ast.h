// The syntax tree of a parsed template. Expressions evaluate to Values; statements render text. Both are
// evaluated by interpreter.cpp against a Context (the variable scopes of one render call).
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "server/jinja/value.h"

namespace mtpx::jinja {

class Context;

struct Expr {
  int line = 0;
  int depth = 1;  // levels of this subtree; the parser keeps it within kMaxNesting (limits.h)
  virtual ~Expr() = default;
  virtual Value eval(Context& context) const = 0;
};
using ExprPtr = std::unique_ptr<Expr>;

struct Arguments {
  std::vector<ExprPtr> positional;
  std::vector<std::pair<std::string, ExprPtr>> keyword;
};

struct LiteralExpr : Expr {
  Value value;
  Value eval(Context& context) const override;
};
struct ListExpr : Expr {  // [a, b] and tuples (a, b)
  std::vector<ExprPtr> items;
  bool tuple = false;
  Value eval(Context& context) const override;
};
struct DictExpr : Expr {
  std::vector<std::pair<ExprPtr, ExprPtr>> items;
  Value eval(Context& context) const override;
};
struct NameExpr : Expr {
  std::string name;
  Value eval(Context& context) const override;
};
struct AttributeExpr : Expr {  // object.name
  ExprPtr object;
  std::string name;
  Value eval(Context& context) const override;
};
struct SubscriptExpr : Expr {  // object[index]
  ExprPtr object, index;
  Value eval(Context& context) const override;
};
struct SliceExpr : Expr {  // object[start:stop:step], any part may be missing
  ExprPtr object, start, stop, step;
  Value eval(Context& context) const override;
};
struct CallExpr : Expr {
  ExprPtr callee;
  Arguments arguments;
  Value eval(Context& context) const override;
};
struct FilterExpr : Expr {  // operand | name(arguments)
  ExprPtr operand;
  std::string name;
  Arguments arguments;
  Value eval(Context& context) const override;
};
struct TestExpr : Expr {  // operand is [not] name(arguments)
  ExprPtr operand;
  std::string name;
  bool negated = false;
  Arguments arguments;
  Value eval(Context& context) const override;
};
struct UnaryExpr : Expr {  // "not", "-", "+"
  std::string op;
  ExprPtr operand;
  Value eval(Context& context) const override;
};
struct BinaryExpr : Expr {  // arithmetic, ~, comparisons, in, not in, and, or
  std::string op;
  ExprPtr left, right;
  Value eval(Context& context) const override;
};
struct ConditionalExpr : Expr {        // then if condition else otherwise
  ExprPtr condition, then, otherwise;  // otherwise may be null (undefined)
  Value eval(Context& context) const override;
};

// How a statement list ended: normally, or by {% break %} / {% continue %} inside a loop.
enum class Flow { kNormal, kBreak, kContinue };

struct Node {
  int line = 0;
  virtual ~Node() = default;
  virtual Flow render(Context& context, std::string& out) const = 0;
};
using NodePtr = std::unique_ptr<Node>;
using Body = std::vector<NodePtr>;

struct TextNode : Node {
  std::string text;
  Flow render(Context& context, std::string& out) const override;
};
struct OutputNode : Node {  // {{ expression }}
  ExprPtr expression;
  Flow render(Context& context, std::string& out) const override;
};
struct IfNode : Node {
  std::vector<std::pair<ExprPtr, Body>> branches;  // if / elif
  Body otherwise;
  Flow render(Context& context, std::string& out) const override;
};
struct ForNode : Node {
  std::vector<std::string> targets;  // one name, or several to unpack
  ExprPtr iterable;
  ExprPtr filter;  // `for x in xs if condition`; may be null
  Body body;
  Body otherwise;  // rendered when nothing was iterated
  Flow render(Context& context, std::string& out) const override;
};
struct SetNode : Node {
  std::vector<std::string> targets;  // names; or one namespace attribute:
  ExprPtr namespace_object;          // set ns.attribute = value
  std::string attribute;
  ExprPtr value;
  Flow render(Context& context, std::string& out) const override;
};
struct SetBlockNode : Node {  // {% set name %}...{% endset %}
  std::string target;
  Body body;
  Flow render(Context& context, std::string& out) const override;
};
struct MacroNode : Node {
  std::string name;
  std::vector<std::pair<std::string, ExprPtr>> parameters;  // default may be null
  Body body;
  Flow render(Context& context, std::string& out) const override;
};
struct FilterBlockNode : Node {  // {% filter name %}...{% endfilter %}
  std::string filter;
  Arguments arguments;
  Body body;
  Flow render(Context& context, std::string& out) const override;
};
struct LoopControlNode : Node {
  Flow flow = Flow::kBreak;
  Flow render(Context& context, std::string& out) const override;
};

// Renders a statement list, stopping at break/continue.
Flow render_body(const Body& body, Context& context, std::string& out);

}  // namespace mtpx::jinja
