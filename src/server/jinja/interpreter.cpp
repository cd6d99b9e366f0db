// Evaluation of the syntax tree: expressions to Values, statements to text, with Jinja's scoping (a for
// loop body is a new scope, an if is not; macros see the template's globals, not their caller's locals).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "server/jinja/ast.h"
#include "server/jinja/builtins.h"
#include "server/jinja/lexer.h"
#include "server/jinja/limits.h"
#include "server/jinja/parser.h"
#include "server/jinja/template.h"
#include "util/error.h"

namespace mtpx::jinja {

class Scope {
 public:
  explicit Scope(const Scope* parent) : parent_(parent) {}

  const Value* find(const std::string& name) const {
    for (const Scope* s = this; s != nullptr; s = s->parent_)
      for (const auto& [key, value] : s->variables_)
        if (key == name) return &value;
    return nullptr;
  }
  void set(const std::string& name, Value value) {
    for (auto& [key, existing] : variables_)
      if (key == name) {
        existing = std::move(value);
        return;
      }
    variables_.emplace_back(name, std::move(value));
  }

 private:
  const Scope* parent_;
  std::vector<std::pair<std::string, Value>> variables_;
};

// State shared by one render call (including the macros it calls).
struct RenderState {
  Scope* globals = nullptr;
  int line = 0;  // of the statement being rendered, for error messages
  int macro_depth = 0;
};

class Context {
 public:
  Context(Scope& variables, RenderState& render_state) : scope(variables), state(render_state) {}
  Scope& scope;
  RenderState& state;
};

namespace {

[[noreturn]] void runtime_error(const std::string& what) { throw Error(ErrorKind::kInvalidInput, what); }

CallArgs evaluate(const Arguments& arguments, Context& context) {
  CallArgs args;
  for (const auto& e : arguments.positional) args.positional.push_back(e->eval(context));
  for (const auto& [name, e] : arguments.keyword) args.keyword.emplace_back(name, e->eval(context));
  return args;
}

std::string describe(const Expr& e) {
  if (const auto* name = dynamic_cast<const NameExpr*>(&e)) return "'" + name->name + "'";
  if (const auto* attribute = dynamic_cast<const AttributeExpr*>(&e))
    return describe(*attribute->object).substr(0, 60) + "." + attribute->name;
  return "a value";
}

// Bytes a copy of a list's items takes, for the render's size budget: strings are copied with their
// Value, nested lists and dicts are shared.
size_t list_bytes(const List& items) {
  charge_work(items.size());
  size_t bytes = items.size() * sizeof(Value);
  for (const Value& item : items)
    if (item.is_string()) bytes += item.as_string().size();
  return bytes;
}

[[noreturn]] void integer_overflow(const std::string& op) {
  runtime_error(fmt::format("integer overflow in '{}' (templates compute with 64-bit integers)", op));
}

// a ** b for b >= 0, by squaring (O(log b) whatever b is), refusing results beyond 64 bits.
int64_t integer_power(int64_t base, int64_t exponent) {
  int64_t result = 1;
  while (exponent > 0) {
    if ((exponent & 1) != 0 && __builtin_mul_overflow(result, base, &result)) integer_overflow("**");
    exponent >>= 1;
    if (exponent > 0 && __builtin_mul_overflow(base, base, &base)) integer_overflow("**");
  }
  return result;
}

Value arithmetic(const std::string& op, const Value& a, const Value& b) {
  if (a.is_undefined() || b.is_undefined()) runtime_error(fmt::format("'{}' with an undefined value", op));
  if (op == "+") {
    if (a.is_string() && b.is_string()) {
      charge_bytes(a.as_string().size() + b.as_string().size());
      return Value(a.as_string() + b.as_string());
    }
    if (a.is_list() && b.is_list()) {
      charge_bytes(list_bytes(a.as_list()) + list_bytes(b.as_list()));
      List joined = a.as_list();
      joined.insert(joined.end(), b.as_list().begin(), b.as_list().end());
      return Value(std::move(joined));
    }
  }
  if (op == "*" && (a.is_string() || a.is_list()) && b.is_number() && b.kind() != Value::Kind::kFloat) {
    // Sized and charged before anything is built: "x" * 10**12 is refused, not attempted.
    const size_t unit = a.is_string() ? a.as_string().size() : list_bytes(a.as_list());
    const size_t count = unit == 0 ? 0 : static_cast<size_t>(std::max<int64_t>(b.as_int(), 0));
    size_t total = 0;
    if (__builtin_mul_overflow(unit, count, &total)) total = SIZE_MAX;
    charge_bytes(total);
    if (a.is_string()) {
      std::string out;
      out.reserve(total);
      for (size_t i = 0; i < count; ++i) out += a.as_string();
      return Value(out);
    }
    List out;
    out.reserve(count * a.as_list().size());
    for (size_t i = 0; i < count; ++i) out.insert(out.end(), a.as_list().begin(), a.as_list().end());
    return Value(std::move(out));
  }
  if (!a.is_number() || !b.is_number())
    runtime_error(
        fmt::format("unsupported operand type(s) for {}: '{}' and '{}'", op, a.type_name(), b.type_name()));
  const bool floats = a.kind() == Value::Kind::kFloat || b.kind() == Value::Kind::kFloat;
  if (op == "/") {
    if (b.as_float() == 0.0) runtime_error("division by zero");
    return Value(a.as_float() / b.as_float());
  }
  if (op == "**") {
    if (!floats && b.as_int() >= 0) return Value(integer_power(a.as_int(), b.as_int()));
    return Value(std::pow(a.as_float(), b.as_float()));
  }
  if (floats) {
    const double x = a.as_float(), y = b.as_float();
    if (op == "+") return Value(x + y);
    if (op == "-") return Value(x - y);
    if (op == "*") return Value(x * y);
    if (y == 0.0) runtime_error("division by zero");
    if (op == "//") return Value(std::floor(x / y));
    const double r = std::fmod(x, y);  // Python's % takes the divisor's sign
    return Value(r != 0.0 && ((r < 0) != (y < 0)) ? r + y : r);
  }
  const int64_t x = a.as_int(), y = b.as_int();
  int64_t result = 0;
  bool overflow = false;
  if (op == "+") {
    overflow = __builtin_add_overflow(x, y, &result);
  } else if (op == "-") {
    overflow = __builtin_sub_overflow(x, y, &result);
  } else if (op == "*") {
    overflow = __builtin_mul_overflow(x, y, &result);
  } else if (y == 0) {
    runtime_error("division by zero");
  } else if (y == -1) {  // x / -1 overflows for the smallest x (and traps on x86); x % -1 is 0
    overflow = op != "%" && __builtin_sub_overflow(int64_t{0}, x, &result);
  } else {
    const int64_t q = x / y, r = x % y;
    const bool adjust = r != 0 && ((r < 0) != (y < 0));
    result = op == "//" ? (adjust ? q - 1 : q) : (adjust ? r + y : r);  // Python floors
  }
  if (overflow) integer_overflow(op);
  return Value(result);
}

}  // namespace

// ---- expressions ----

Value LiteralExpr::eval(Context&) const { return value; }

Value ListExpr::eval(Context& context) const {
  List out;
  for (const auto& item : items) out.push_back(item->eval(context));
  return tuple ? Value::tuple(std::move(out)) : Value(std::move(out));
}

Value DictExpr::eval(Context& context) const {
  Dict out;
  for (const auto& [key_expr, value_expr] : items) {
    const Value key = key_expr->eval(context);
    if (!key.is_string()) runtime_error("dict keys in templates must be strings");
    Value value = value_expr->eval(context);
    auto it =
        std::find_if(out.begin(), out.end(), [&](const auto& item) { return item.first == key.as_string(); });
    if (it != out.end()) {
      it->second = std::move(value);
    } else {
      out.emplace_back(key.as_string(), std::move(value));
    }
  }
  return Value(std::move(out));
}

Value NameExpr::eval(Context& context) const {
  const Value* v = context.scope.find(name);
  return v != nullptr ? *v : Value();
}

Value AttributeExpr::eval(Context& context) const {
  const Value o = object->eval(context);
  if (o.is_undefined()) runtime_error(fmt::format("{} is undefined (reading .{})", describe(*object), name));
  return get_attribute(o, name);
}

Value SubscriptExpr::eval(Context& context) const {
  const Value o = object->eval(context);
  if (o.is_undefined()) runtime_error(fmt::format("{} is undefined (subscripted)", describe(*object)));
  return get_item(o, index->eval(context));
}

Value SliceExpr::eval(Context& context) const {
  auto part = [&](const ExprPtr& e) { return e ? e->eval(context) : Value::none(); };
  return slice(object->eval(context), part(start), part(stop), part(step));
}

Value CallExpr::eval(Context& context) const {
  const Value f = callee->eval(context);
  if (!f.is_function()) runtime_error(fmt::format("{} is not callable", describe(*callee)));
  charge_work(1);
  return f.as_function()(evaluate(arguments, context));
}

Value FilterExpr::eval(Context& context) const {
  return apply_filter(name, operand->eval(context), evaluate(arguments, context));
}

Value TestExpr::eval(Context& context) const {
  return Value(apply_test(name, operand->eval(context), evaluate(arguments, context)) != negated);
}

Value UnaryExpr::eval(Context& context) const {
  const Value v = operand->eval(context);
  if (op == "not") return Value(!v.truthy());
  if (!v.is_number()) runtime_error(fmt::format("bad operand type for unary {}: '{}'", op, v.type_name()));
  if (op == "+") return v.kind() == Value::Kind::kFloat ? v : Value(v.as_int());
  if (v.kind() == Value::Kind::kFloat) return Value(-v.as_float());
  int64_t negated = 0;
  if (__builtin_sub_overflow(int64_t{0}, v.as_int(), &negated)) integer_overflow("-");
  return Value(negated);
}

Value BinaryExpr::eval(Context& context) const {
  if (op == "and") {
    Value l = left->eval(context);
    return l.truthy() ? right->eval(context) : l;
  }
  if (op == "or") {
    Value l = left->eval(context);
    return l.truthy() ? l : right->eval(context);
  }
  const Value l = left->eval(context);
  const Value r = right->eval(context);
  if (op == "~") {
    std::string joined = l.str() + r.str();
    charge_bytes(joined.size());
    return Value(std::move(joined));
  }
  if (op == "==") return Value(equal(l, r));
  if (op == "!=") return Value(!equal(l, r));
  if (op == "<") return Value(less(l, r));
  if (op == ">") return Value(less(r, l));
  if (op == "<=") return Value(!less(r, l));
  if (op == ">=") return Value(!less(l, r));
  if (op == "in") return Value(contains(r, l));
  if (op == "not in") return Value(!contains(r, l));
  return arithmetic(op, l, r);
}

Value ConditionalExpr::eval(Context& context) const {
  if (condition->eval(context).truthy()) return then->eval(context);
  return otherwise ? otherwise->eval(context) : Value();
}

// ---- statements ----

Flow render_body(const Body& body, Context& context, std::string& out) {
  for (const auto& node : body) {
    context.state.line = node->line;
    charge_work(1);
    const Flow flow = node->render(context, out);
    if (flow != Flow::kNormal) return flow;
  }
  return Flow::kNormal;
}

Flow TextNode::render(Context&, std::string& out) const {
  charge_bytes(text.size());
  out += text;
  return Flow::kNormal;
}

Flow OutputNode::render(Context& context, std::string& out) const {
  const std::string text = expression->eval(context).str();
  charge_bytes(text.size());
  out += text;
  return Flow::kNormal;
}

Flow IfNode::render(Context& context, std::string& out) const {
  for (const auto& [condition, body] : branches)
    if (condition->eval(context).truthy()) return render_body(body, context, out);
  return render_body(otherwise, context, out);
}

namespace {

// Namespaces are the only values a template can change after making them. Holding a namespace or a
// function (which may hold values itself) could make a cycle: a value that prints forever and is never
// freed. Without them, a namespace holds plain data, and depths recorded when lists and dicts are made
// (kMaxValueDepth) stay within twice the limit.
bool holds_reference(const Value& v) {
  if (v.is_namespace() || v.is_function()) return true;
  if (v.is_list()) {
    charge_work(v.as_list().size());
    return std::any_of(v.as_list().begin(), v.as_list().end(), holds_reference);
  }
  if (v.is_dict()) {
    charge_work(v.as_dict().size());
    return std::any_of(v.as_dict().begin(), v.as_dict().end(),
                       [](const auto& item) { return holds_reference(item.second); });
  }
  return false;
}

void check_namespace_attribute(const Value& v, const std::string& attribute) {
  if (holds_reference(v))
    runtime_error(fmt::format("namespace attribute '{}' may not hold a namespace or a function", attribute));
}

void assign_targets(Scope& scope, const std::vector<std::string>& targets, const Value& value) {
  if (targets.size() == 1) {
    scope.set(targets[0], value);
    return;
  }
  const List items = iterate(value);
  if (items.size() != targets.size())
    runtime_error(fmt::format("cannot unpack {} values into {} names", items.size(), targets.size()));
  for (size_t i = 0; i < targets.size(); ++i) scope.set(targets[i], items[i]);
}

}  // namespace

Flow ForNode::render(Context& context, std::string& out) const {
  List items = iterate(iterable->eval(context));
  if (filter) {
    List kept;
    for (const Value& item : items) {
      Scope probe(&context.scope);
      assign_targets(probe, targets, item);
      Context probe_context(probe, context.state);
      if (filter->eval(probe_context).truthy()) kept.push_back(item);
    }
    items = std::move(kept);
  }
  if (items.empty()) return render_body(otherwise, context, out);
  const auto n = static_cast<int64_t>(items.size());
  for (int64_t i = 0; i < n; ++i) {
    charge_work(kLoopIterationWork);
    Scope iteration(&context.scope);
    assign_targets(iteration, targets, items[static_cast<size_t>(i)]);
    Dict loop = {{"index", Value(i + 1)},
                 {"index0", Value(i)},
                 {"revindex", Value(n - i)},
                 {"revindex0", Value(n - i - 1)},
                 {"first", Value(i == 0)},
                 {"last", Value(i == n - 1)},
                 {"length", Value(n)},
                 {"depth", Value(1)},
                 {"depth0", Value(0)},
                 {"previtem", i > 0 ? items[static_cast<size_t>(i - 1)] : Value()},
                 {"nextitem", i + 1 < n ? items[static_cast<size_t>(i + 1)] : Value()}};
    loop.emplace_back("cycle", Value::function("loop.cycle", [i](const CallArgs& args) {
                        if (args.positional.empty()) runtime_error("loop.cycle() needs at least one value");
                        return args.positional[static_cast<size_t>(i) % args.positional.size()];
                      }));
    iteration.set("loop", Value(std::move(loop)));
    Context inner(iteration, context.state);
    if (render_body(body, inner, out) == Flow::kBreak) break;
  }
  return Flow::kNormal;
}

Flow SetNode::render(Context& context, std::string&) const {
  Value v = value->eval(context);
  if (namespace_object) {
    const Value ns = namespace_object->eval(context);
    if (!ns.is_namespace()) runtime_error("only namespace() objects take attribute assignment");
    check_namespace_attribute(v, attribute);
    Dict& attributes = ns.mutable_dict();
    for (auto& [key, existing] : attributes)
      if (key == attribute) {
        existing = std::move(v);
        return Flow::kNormal;
      }
    attributes.emplace_back(attribute, std::move(v));
    return Flow::kNormal;
  }
  assign_targets(context.scope, targets, v);
  return Flow::kNormal;
}

Flow SetBlockNode::render(Context& context, std::string&) const {
  std::string captured;
  render_body(body, context, captured);
  context.scope.set(target, Value(std::move(captured)));
  return Flow::kNormal;
}

Flow MacroNode::render(Context& context, std::string&) const {
  RenderState* state = &context.state;
  const MacroNode* macro = this;
  context.scope.set(name, Value::function(name, [macro, state](const CallArgs& args) {
                      if (state->macro_depth >= 64) runtime_error("macro calls nested too deeply");
                      Scope scope(state->globals);
                      if (args.positional.size() > macro->parameters.size())
                        runtime_error(fmt::format("macro '{}' takes {} arguments, {} given", macro->name,
                                                  macro->parameters.size(), args.positional.size()));
                      for (size_t i = 0; i < macro->parameters.size(); ++i) {
                        const auto& [parameter, default_value] = macro->parameters[i];
                        const Value* given = args.find(i, parameter);
                        Context default_context(scope, *state);
                        scope.set(parameter, given != nullptr ? *given
                                             : default_value  ? default_value->eval(default_context)
                                                              : Value());
                      }
                      ++state->macro_depth;
                      std::string out;
                      Context inner(scope, *state);
                      const int caller_line = state->line;
                      render_body(macro->body, inner, out);
                      state->line = caller_line;
                      --state->macro_depth;
                      return Value(std::move(out));
                    }));
  return Flow::kNormal;
}

Flow FilterBlockNode::render(Context& context, std::string& out) const {
  std::string captured;
  render_body(body, context, captured);
  out += apply_filter(filter, Value(std::move(captured)), evaluate(arguments, context)).str();
  return Flow::kNormal;
}

Flow LoopControlNode::render(Context&, std::string&) const { return flow; }

// ---- the public API ----

struct ParsedTemplate {
  Body body;
};

Template Template::parse(std::string_view source) {
  Template t;
  auto parsed = std::make_shared<ParsedTemplate>();
  parsed->body = jinja::parse(lex(source));
  t.parsed_ = std::move(parsed);
  return t;
}

std::string Template::render(const Dict& variables) const {
  Scope builtins(nullptr);
  for (auto& [name, value] : global_functions()) builtins.set(name, value);
  Scope globals(&builtins);
  for (const auto& [name, value] : variables) globals.set(name, value);
  RenderState state;
  state.globals = &globals;
  Context context(globals, state);
  std::string out;
  try {
    RenderBudget budget;
    render_body(parsed_->body, context, out);
  } catch (const Error& e) {
    throw Error(ErrorKind::kInvalidInput, fmt::format("chat template line {}: {}", state.line, e.what()));
  }
  return out;
}

}  // namespace mtpx::jinja
