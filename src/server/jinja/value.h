// The values of the Jinja subset (chat templates): Python's objects as Jinja sees them. Lists and dicts
// have reference semantics like Python's (templates share them; only namespaces are ever mutated).
// Rendering follows Python: str(), repr() and transformers' tojson (json.dumps) byte for byte.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace mtpx::jinja {

class Value;
using List = std::vector<Value>;
// Python dict with string keys, in insertion order (JSON objects keep their order, as with json.loads).
using Dict = std::vector<std::pair<std::string, Value>>;

// Arguments of a call: f(a, b, key=c).
struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;

  // The argument at `position` or named `name`; nullptr when absent.
  const Value* find(size_t position, std::string_view name) const;
};

using Function = std::function<Value(const CallArgs&)>;

class Value {
 public:
  enum class Kind { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kDict, kFunction };

  Value() = default;  // undefined
  static Value none();
  Value(bool b);  // NOLINT: implicit, like the literals they stand for
  Value(int64_t i);
  Value(int i) : Value(static_cast<int64_t>(i)) {}
  Value(double f);
  Value(std::string s);
  Value(const char* s) : Value(std::string(s)) {}
  Value(List list);
  Value(Dict dict);
  static Value function(std::string name, Function fn);
  // A tuple: a list that prints as Python's tuple, (1, 2) (what dict.items() yields).
  static Value tuple(List items);
  // A namespace(): a dict whose attributes templates may assign ({% set ns.x = ... %}).
  static Value namespace_object(Dict attributes);
  static Value from_json(const nlohmann::ordered_json& json);

  Kind kind() const { return kind_; }
  // Nesting of lists and dicts: 0 for a scalar, 1 + the deepest item for a container (recorded when it is
  // made; at most kMaxValueDepth, see limits.h).
  int depth() const { return depth_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_number() const { return kind_ == Kind::kInt || kind_ == Kind::kFloat || kind_ == Kind::kBool; }
  bool is_list() const { return kind_ == Kind::kList; }
  bool is_dict() const { return kind_ == Kind::kDict; }
  bool is_function() const { return kind_ == Kind::kFunction; }
  bool is_namespace() const { return kind_ == Kind::kDict && namespace_; }

  bool as_bool() const { return bool_; }
  int64_t as_int() const { return kind_ == Kind::kBool ? (bool_ ? 1 : 0) : int_; }
  double as_float() const { return kind_ == Kind::kFloat ? float_ : static_cast<double>(as_int()); }
  const std::string& as_string() const { return string_; }
  const List& as_list() const { return *list_; }
  const Dict& as_dict() const { return *dict_; }
  Dict& mutable_dict() const { return *dict_; }  // namespaces only
  const Function& as_function() const { return *function_; }
  const std::string& function_name() const { return string_; }

  // Python truthiness.
  bool truthy() const;
  // Dict lookup by key; undefined when missing.
  Value get(std::string_view key) const;
  // Python's type name, for error messages ("str", "list", ...).
  std::string type_name() const;

  // Python str() (undefined renders as ""), repr(), and json.dumps as transformers' tojson filter calls it.
  std::string str() const;
  std::string repr() const;
  struct JsonFormat {
    int indent = -1;  // < 0: None (one line)
    std::string item_separator = ", ";
    std::string key_separator = ": ";
    bool ensure_ascii = false;
    bool sort_keys = false;
  };
  std::string to_json(const JsonFormat& format) const;

 private:
  void write_json(std::string& out, const JsonFormat& format, int depth) const;

  Kind kind_ = Kind::kUndefined;
  bool bool_ = false;
  bool namespace_ = false;
  bool tuple_ = false;
  int depth_ = 0;
  int64_t int_ = 0;
  double float_ = 0.0;
  std::string string_;  // the string, or a function's name
  std::shared_ptr<List> list_;
  std::shared_ptr<Dict> dict_;
  std::shared_ptr<Function> function_;
};

// Python ==.
bool equal(const Value& a, const Value& b);
// Python <, for numbers, strings and lists; throws for other types.
bool less(const Value& a, const Value& b);
// Python's float repr (shortest round-trip digits: 0.1, 1.0, 1e-05, 1e+16).
std::string python_float_repr(double value);

// UTF-8 helpers: Python strings index by code point.
std::vector<std::string> code_points(std::string_view text);

}  // namespace mtpx::jinja
