#include "server/jinja/value.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>

#include "server/jinja/limits.h"
#include "util/error.h"

namespace mtpx::jinja {

const Value* CallArgs::find(size_t position, std::string_view name) const {
  for (const auto& [key, value] : keyword)
    if (key == name) return &value;
  return position < positional.size() ? &positional[position] : nullptr;
}

Value Value::none() {
  Value v;
  v.kind_ = Kind::kNone;
  return v;
}

Value::Value(bool b) : kind_(Kind::kBool), bool_(b) {}
Value::Value(int64_t i) : kind_(Kind::kInt), int_(i) {}
Value::Value(double f) : kind_(Kind::kFloat), float_(f) {}
Value::Value(std::string s) : kind_(Kind::kString), string_(std::move(s)) {}
namespace {

// The depth of a new list or dict: one more than its deepest item. Past kMaxValueDepth it is refused, as
// printing, comparing and freeing values recurse once per level.
template <typename Items, typename ValueOf>
int container_depth(const Items& items, ValueOf value_of) {
  int deepest = 0;
  for (const auto& item : items) deepest = std::max(deepest, value_of(item).depth());
  if (deepest + 1 > kMaxValueDepth)
    throw Error(ErrorKind::kInvalidInput,
                fmt::format("a list or dict nested deeper than {} levels", kMaxValueDepth));
  return deepest + 1;
}

}  // namespace

Value::Value(List list)
    : kind_(Kind::kList),
      depth_(container_depth(list, [](const Value& v) -> const Value& { return v; })),
      list_(std::make_shared<List>(std::move(list))) {}
Value::Value(Dict dict)
    : kind_(Kind::kDict),
      depth_(container_depth(dict, [](const auto& item) -> const Value& { return item.second; })),
      dict_(std::make_shared<Dict>(std::move(dict))) {}

Value Value::function(std::string name, Function fn) {
  Value v;
  v.kind_ = Kind::kFunction;
  v.string_ = std::move(name);
  v.function_ = std::make_shared<Function>(std::move(fn));
  return v;
}

Value Value::tuple(List items) {
  Value v(std::move(items));
  v.tuple_ = true;
  return v;
}

Value Value::namespace_object(Dict attributes) {
  Value v(std::move(attributes));
  v.namespace_ = true;
  return v;
}

Value Value::from_json(const nlohmann::ordered_json& json) {
  switch (json.type()) {
    case nlohmann::ordered_json::value_t::null:
      return none();
    case nlohmann::ordered_json::value_t::boolean:
      return Value(json.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
      return Value(json.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      const uint64_t u = json.get<uint64_t>();
      return u <= static_cast<uint64_t>(INT64_MAX) ? Value(static_cast<int64_t>(u))
                                                   : Value(static_cast<double>(u));
    }
    case nlohmann::ordered_json::value_t::number_float:
      return Value(json.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return Value(json.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      List list;
      for (const auto& item : json) list.push_back(from_json(item));
      return Value(std::move(list));
    }
    case nlohmann::ordered_json::value_t::object: {
      Dict dict;
      for (const auto& [key, item] : json.items()) dict.emplace_back(key, from_json(item));
      return Value(std::move(dict));
    }
    default:
      return Value();  // binary / discarded: not produced by the JSON parser
  }
}

bool Value::truthy() const {
  switch (kind_) {
    case Kind::kUndefined:
    case Kind::kNone:
      return false;
    case Kind::kBool:
      return bool_;
    case Kind::kInt:
      return int_ != 0;
    case Kind::kFloat:
      return float_ != 0.0;
    case Kind::kString:
      return !string_.empty();
    case Kind::kList:
      return !list_->empty();
    case Kind::kDict:
      return !dict_->empty();
    case Kind::kFunction:
      return true;
  }
  return false;
}

Value Value::get(std::string_view key) const {
  if (kind_ != Kind::kDict) return Value();
  charge_work(dict_->size() / 16 + 1);  // a linear search (dicts keep their order in a vector)
  for (const auto& [k, v] : *dict_)
    if (k == key) return v;
  return Value();
}

std::string Value::type_name() const {
  switch (kind_) {
    case Kind::kUndefined:
      return "Undefined";
    case Kind::kNone:
      return "NoneType";
    case Kind::kBool:
      return "bool";
    case Kind::kInt:
      return "int";
    case Kind::kFloat:
      return "float";
    case Kind::kString:
      return "str";
    case Kind::kList:
      return "list";
    case Kind::kDict:
      return namespace_ ? "Namespace" : "dict";
    case Kind::kFunction:
      return "function";
  }
  return "?";
}

std::string python_float_repr(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  // Shortest round-trip digits, then Python's layout: exponent form when exp < -4 or exp >= 16.
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), value, std::chars_format::scientific);
  std::string sci(buf, end);  // "-1.2345e+02"
  const size_t e = sci.find('e');
  std::string mantissa = sci.substr(0, e);
  const int exponent = std::stoi(sci.substr(e + 1));
  std::string sign;
  if (mantissa[0] == '-') {
    sign = "-";
    mantissa.erase(0, 1);
  }
  std::string digits;
  for (char c : mantissa)
    if (c != '.') digits += c;
  if (exponent < -4 || exponent >= 16) {
    std::string out = sign + digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    return out + fmt::format("e{}{:02d}", exponent < 0 ? '-' : '+', std::abs(exponent));
  }
  std::string out;
  if (exponent < 0) {
    out = "0." + std::string(static_cast<size_t>(-exponent - 1), '0') + digits;
  } else {
    const size_t point = static_cast<size_t>(exponent) + 1;
    if (digits.size() <= point) {
      out = digits + std::string(point - digits.size(), '0') + ".0";
    } else {
      out = digits.substr(0, point) + "." + digits.substr(point);
    }
  }
  return sign + out;
}

std::vector<std::string> code_points(std::string_view text) {
  charge_work(text.size() / 32 + 1);
  std::vector<std::string> out;
  for (size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 1;
    n = std::min(n, text.size() - i);
    out.emplace_back(text.substr(i, n));
    i += n;
  }
  return out;
}

namespace {

std::string repr_string(const std::string& s) {
  const bool has_single = s.find('\'') != std::string::npos;
  const bool has_double = s.find('"') != std::string::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (ch == quote || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (ch == '\n') {
      out += "\\n";
    } else if (ch == '\r') {
      out += "\\r";
    } else if (ch == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7f) {
      out += fmt::format("\\x{:02x}", c);
    } else {
      out += ch;
    }
  }
  return out + quote;
}

void write_json_string(std::string& out, const std::string& s, bool ensure_ascii) {
  out += '"';
  for (size_t i = 0; i < s.size(); ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    switch (c) {
      case '"':
        out += "\\\"";
        continue;
      case '\\':
        out += "\\\\";
        continue;
      case '\n':
        out += "\\n";
        continue;
      case '\r':
        out += "\\r";
        continue;
      case '\t':
        out += "\\t";
        continue;
      case '\b':
        out += "\\b";
        continue;
      case '\f':
        out += "\\f";
        continue;
      default:
        break;
    }
    if (c < 0x20) {
      out += fmt::format("\\u{:04x}", c);
    } else if (c >= 0x80 && ensure_ascii) {
      // Decode one UTF-8 sequence and write it as \uXXXX (a surrogate pair above the BMP).
      const size_t n = (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : 4;
      uint32_t cp = c & (n == 2 ? 0x1f : n == 3 ? 0x0f : 0x07);
      for (size_t k = 1; k < n && i + k < s.size(); ++k)
        cp = (cp << 6) | (static_cast<uint8_t>(s[i + k]) & 0x3f);
      i += n - 1;
      if (cp >= 0x10000) {
        cp -= 0x10000;
        out += fmt::format("\\u{:04x}\\u{:04x}", 0xd800 + (cp >> 10), 0xdc00 + (cp & 0x3ff));
      } else {
        out += fmt::format("\\u{:04x}", cp);
      }
    } else {
      out += s[i];
    }
  }
  out += '"';
}

}  // namespace

std::string Value::str() const {
  switch (kind_) {
    case Kind::kUndefined:
      return "";
    case Kind::kNone:
      return "None";
    case Kind::kBool:
      return bool_ ? "True" : "False";
    case Kind::kInt:
      return std::to_string(int_);
    case Kind::kFloat:
      return python_float_repr(float_);
    case Kind::kString:
      return string_;
    case Kind::kFunction:
      return "<function " + string_ + ">";
    case Kind::kList:
    case Kind::kDict:
      return repr();
  }
  return "";
}

// repr() and to_json() charge the render as they go (limits.h): lists share their items, so a small value
// can print as gigabytes ([[s, s], [s, s]] nested thirty times holds one string a billion times).
std::string Value::repr() const {
  switch (kind_) {
    case Kind::kString:
      charge_bytes(string_.size() + 2);
      return repr_string(string_);
    case Kind::kList: {
      charge_work(list_->size());
      std::string out = tuple_ ? "(" : "[";
      for (size_t i = 0; i < list_->size(); ++i) out += (i ? ", " : "") + (*list_)[i].repr();
      if (tuple_) return out + (list_->size() == 1 ? ",)" : ")");
      return out + "]";
    }
    case Kind::kDict: {
      charge_work(dict_->size());
      std::string out = namespace_ ? "<Namespace {" : "{";
      for (size_t i = 0; i < dict_->size(); ++i)
        out += (i ? ", " : "") + repr_string((*dict_)[i].first) + ": " + (*dict_)[i].second.repr();
      return out + (namespace_ ? "}>" : "}");
    }
    default:
      return str();
  }
}

std::string Value::to_json(const JsonFormat& format) const {
  std::string out;
  write_json(out, format, 0);
  return out;
}

void Value::write_json(std::string& out, const JsonFormat& format, int depth) const {
  auto newline = [&](int level) {
    if (format.indent < 0) return;
    charge_bytes(1 + static_cast<size_t>(format.indent * level));
    out += '\n';
    out.append(static_cast<size_t>(format.indent * level), ' ');
  };
  const std::string& item_separator = format.item_separator;
  switch (kind_) {
    case Kind::kNone:
      out += "null";
      return;
    case Kind::kBool:
      out += bool_ ? "true" : "false";
      return;
    case Kind::kInt:
      out += std::to_string(int_);
      return;
    case Kind::kFloat:
      if (std::isnan(float_)) {
        out += "NaN";
      } else if (std::isinf(float_)) {
        out += float_ > 0 ? "Infinity" : "-Infinity";
      } else {
        out += python_float_repr(float_);
      }
      return;
    case Kind::kString:
      charge_bytes(string_.size() + 2);
      write_json_string(out, string_, format.ensure_ascii);
      return;
    case Kind::kList:
      charge_work(list_->size());
      if (list_->empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t i = 0; i < list_->size(); ++i) {
        if (i) out += item_separator;
        newline(depth + 1);
        (*list_)[i].write_json(out, format, depth + 1);
      }
      newline(depth);
      out += ']';
      return;
    case Kind::kDict: {
      if (dict_->empty()) {
        out += "{}";
        return;
      }
      charge_work(dict_->size());
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& item : *dict_) items.push_back(&item);
      if (format.sort_keys)
        std::stable_sort(items.begin(), items.end(), [](auto* a, auto* b) { return a->first < b->first; });
      out += '{';
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += item_separator;
        newline(depth + 1);
        write_json_string(out, items[i]->first, format.ensure_ascii);
        out += format.key_separator;
        items[i]->second.write_json(out, format, depth + 1);
      }
      newline(depth);
      out += '}';
      return;
    }
    case Kind::kUndefined:
    case Kind::kFunction:
      throw Error(ErrorKind::kInvalidInput,
                  fmt::format("Object of type {} is not JSON serializable", type_name()));
  }
}

bool equal(const Value& a, const Value& b) {
  using K = Value::Kind;
  if (a.is_number() && b.is_number()) {
    if (a.kind() == K::kFloat || b.kind() == K::kFloat) return a.as_float() == b.as_float();
    return a.as_int() == b.as_int();
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case K::kUndefined:
    case K::kNone:
      return true;
    case K::kString:
      return a.as_string() == b.as_string();
    case K::kList: {
      const List &x = a.as_list(), &y = b.as_list();
      if (x.size() != y.size()) return false;
      charge_work(x.size());
      for (size_t i = 0; i < x.size(); ++i)
        if (!equal(x[i], y[i])) return false;
      return true;
    }
    case K::kDict: {
      const Dict &x = a.as_dict(), &y = b.as_dict();
      if (x.size() != y.size()) return false;
      charge_work(x.size() * x.size() / 16 + 1);  // a key lookup per entry
      for (const auto& entry : x) {               // not a structured binding: clang 14 cannot capture one
        auto it =
            std::find_if(y.begin(), y.end(), [&](const auto& item) { return item.first == entry.first; });
        if (it == y.end() || !equal(entry.second, it->second)) return false;
      }
      return true;
    }
    case K::kFunction:
      return &a.as_function() == &b.as_function();
    default:
      return false;
  }
}

bool less(const Value& a, const Value& b) {
  using K = Value::Kind;
  if (a.is_number() && b.is_number()) {
    if (a.kind() == K::kFloat || b.kind() == K::kFloat) return a.as_float() < b.as_float();
    return a.as_int() < b.as_int();
  }
  if (a.is_string() && b.is_string()) return a.as_string() < b.as_string();  // UTF-8: code point order
  if (a.is_list() && b.is_list()) {
    const List &x = a.as_list(), &y = b.as_list();
    charge_work(std::min(x.size(), y.size()));
    for (size_t i = 0; i < std::min(x.size(), y.size()); ++i) {
      if (less(x[i], y[i])) return true;
      if (less(y[i], x[i])) return false;
    }
    return x.size() < y.size();
  }
  throw Error(ErrorKind::kInvalidInput, fmt::format("'<' not supported between instances of '{}' and '{}'",
                                                    a.type_name(), b.type_name()));
}

}  // namespace mtpx::jinja
