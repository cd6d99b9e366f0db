#include "server/jinja/builtins.h"

#include <fmt/format.h>
#include <utf8proc.h>

#include <algorithm>
#include <charconv>
#include <climits>
#include <cmath>
#include <ctime>

#include "server/jinja/limits.h"
#include "util/error.h"

namespace mtpx::jinja {
namespace {

[[noreturn]] void type_error(const std::string& what) { throw Error(ErrorKind::kInvalidInput, what); }

const Value& required(const CallArgs& args, size_t position, const char* name, const char* function) {
  const Value* v = args.find(position, name);
  if (v == nullptr) type_error(fmt::format("{}() missing required argument '{}'", function, name));
  return *v;
}

Value optional(const CallArgs& args, size_t position, const char* name, Value fallback) {
  const Value* v = args.find(position, name);
  return v != nullptr ? *v : fallback;
}

const std::string& expect_string(const Value& v, const char* context) {
  if (!v.is_string()) type_error(fmt::format("{} expects a string, got {}", context, v.type_name()));
  return v.as_string();
}

// ---- strings (Python semantics, indexed by code point) ----

bool is_python_space(const std::string& ch) {
  if (ch.size() != 1) return ch == "\xc2\x85" || ch == "\xc2\xa0";  // NEL, NBSP; other Unicode spaces: no
  const char c = ch[0];
  return c == ' ' || (c >= '\t' && c <= '\r') || (c >= '\x1c' && c <= '\x1f');
}

std::string strip(const std::string& s, const Value& chars, bool left, bool right) {
  const std::vector<std::string> cps = code_points(s);
  std::vector<std::string> set;
  if (!chars.is_none() && !chars.is_undefined()) set = code_points(expect_string(chars, "strip"));
  auto strippable = [&](const std::string& ch) {
    return set.empty() && (chars.is_none() || chars.is_undefined())
               ? is_python_space(ch)
               : std::find(set.begin(), set.end(), ch) != set.end();
  };
  size_t b = 0, e = cps.size();
  if (left)
    while (b < e && strippable(cps[b])) ++b;
  if (right)
    while (e > b && strippable(cps[e - 1])) --e;
  std::string out;
  for (size_t i = b; i < e; ++i) out += cps[i];
  return out;
}

std::string map_case(const std::string& s, bool upper) {
  std::string out;
  for (const std::string& ch : code_points(s)) {
    utf8proc_int32_t cp;
    if (utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(ch.data()),
                         static_cast<utf8proc_ssize_t>(ch.size()), &cp) < 0) {
      out += ch;
      continue;
    }
    cp = upper ? utf8proc_toupper(cp) : utf8proc_tolower(cp);
    utf8proc_uint8_t buf[4];
    out.append(reinterpret_cast<char*>(buf), static_cast<size_t>(utf8proc_encode_char(cp, buf)));
  }
  return out;
}

bool is_letter(const std::string& ch) {
  utf8proc_int32_t cp;
  if (utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(ch.data()),
                       static_cast<utf8proc_ssize_t>(ch.size()), &cp) < 0)
    return false;
  const auto category = utf8proc_category(cp);
  return category >= UTF8PROC_CATEGORY_LU && category <= UTF8PROC_CATEGORY_LO;
}

// Python str.title(): a letter after a non-letter is upper-cased, every other letter lower-cased.
std::string title_case(const std::string& s) {
  std::string out;
  bool previous_letter = false;
  for (const std::string& ch : code_points(s)) {
    const bool letter = is_letter(ch);
    out += letter ? map_case(ch, !previous_letter) : ch;
    previous_letter = letter;
  }
  return out;
}

std::string capitalize(const std::string& s) {
  std::vector<std::string> cps = code_points(s);
  std::string out;
  for (size_t i = 0; i < cps.size(); ++i) out += map_case(cps[i], i == 0);
  return out;
}

List split(const std::string& s, const Value& separator, int64_t max_split, bool from_right) {
  List parts;
  if (separator.is_none() || separator.is_undefined()) {  // runs of whitespace; no empty parts
    std::vector<std::string> cps = code_points(s);
    std::vector<std::string> words;
    std::string word;
    bool in_word = false;
    for (const std::string& ch : cps) {
      if (is_python_space(ch)) {
        if (in_word) words.push_back(word);
        word.clear();
        in_word = false;
      } else {
        word += ch;
        in_word = true;
      }
    }
    if (in_word) words.push_back(word);
    if (max_split >= 0 && static_cast<int64_t>(words.size()) > max_split + 1) {
      // Rare in templates: rejoining with single spaces is an approximation of Python's remainder.
      std::vector<std::string> kept;
      if (!from_right) {
        kept.assign(words.begin(), words.begin() + max_split);
        std::string rest;
        for (size_t i = static_cast<size_t>(max_split); i < words.size(); ++i)
          rest += (rest.empty() ? "" : " ") + words[i];
        kept.push_back(rest);
      } else {
        std::string rest;
        const size_t n_rest = words.size() - static_cast<size_t>(max_split);
        for (size_t i = 0; i < n_rest; ++i) rest += (rest.empty() ? "" : " ") + words[i];
        kept.push_back(rest);
        kept.insert(kept.end(), words.begin() + static_cast<std::ptrdiff_t>(n_rest), words.end());
      }
      words = kept;
    }
    for (auto& w : words) parts.emplace_back(w);
    return parts;
  }
  const std::string& sep = expect_string(separator, "split");
  if (sep.empty()) type_error("empty separator");
  std::vector<std::string> pieces;
  if (!from_right) {
    size_t pos = 0;
    int64_t splits = 0;
    while (max_split < 0 || splits < max_split) {
      const size_t hit = s.find(sep, pos);
      if (hit == std::string::npos) break;
      pieces.push_back(s.substr(pos, hit - pos));
      pos = hit + sep.size();
      ++splits;
    }
    pieces.push_back(s.substr(pos));
  } else {
    size_t end = s.size();
    int64_t splits = 0;
    while (max_split < 0 || splits < max_split) {
      if (end < sep.size()) break;
      const size_t hit = s.rfind(sep, end - sep.size());
      if (hit == std::string::npos) break;
      pieces.insert(pieces.begin(), s.substr(hit + sep.size(), end - hit - sep.size()));
      end = hit;
      ++splits;
    }
    pieces.insert(pieces.begin(), s.substr(0, end));
  }
  for (auto& p : pieces) parts.emplace_back(p);
  return parts;
}

std::string replace_all(const std::string& s, const std::string& old, const std::string& replacement,
                        int64_t count) {
  std::string out;
  int64_t done = 0;
  if (old.empty()) {  // Python inserts the replacement around every character
    std::vector<std::string> cps = code_points(s);
    for (const std::string& ch : cps) {
      if (count < 0 || done < count) {
        charge_bytes(replacement.size());
        out += replacement;
        ++done;
      }
      out += ch;
    }
    if (count < 0 || done < count) out += replacement;
    charge_bytes(s.size() + replacement.size());
    return out;
  }
  size_t pos = 0;
  while (count < 0 || done < count) {
    const size_t hit = s.find(old, pos);
    if (hit == std::string::npos) break;
    charge_bytes(hit - pos + replacement.size());  // as it grows: a replacement may multiply the size
    out += s.substr(pos, hit - pos) + replacement;
    pos = hit + old.size();
    ++done;
  }
  charge_bytes(s.size() - pos);
  return out + s.substr(pos);
}

int64_t code_point_index(const std::string& s, size_t byte_index) {
  return static_cast<int64_t>(code_points(s.substr(0, byte_index)).size());
}

bool starts_or_ends_with(const std::string& s, const Value& affix, bool start) {
  auto check = [&](const Value& a) {
    const std::string& x = expect_string(a, start ? "startswith" : "endswith");
    if (x.size() > s.size()) return false;
    return start ? s.compare(0, x.size(), x) == 0 : s.compare(s.size() - x.size(), x.size(), x) == 0;
  };
  if (affix.is_list()) return std::any_of(affix.as_list().begin(), affix.as_list().end(), check);
  return check(affix);
}

Value string_method(const std::string& s, const std::string& name) {
  auto bind = [&](auto fn) {
    return Value::function("str." + name, [s, fn](const CallArgs& args) -> Value { return fn(s, args); });
  };
  if (name == "startswith" || name == "endswith") {
    const bool start = name == "startswith";
    return bind([start](const std::string& self, const CallArgs& a) {
      return Value(
          starts_or_ends_with(self, required(a, 0, "prefix", start ? "startswith" : "endswith"), start));
    });
  }
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    const bool left = name != "rstrip", right = name != "lstrip";
    return bind([left, right](const std::string& self, const CallArgs& a) {
      return Value(strip(self, optional(a, 0, "chars", Value::none()), left, right));
    });
  }
  if (name == "split" || name == "rsplit") {
    const bool from_right = name == "rsplit";
    return bind([from_right](const std::string& self, const CallArgs& a) {
      return Value(split(self, optional(a, 0, "sep", Value::none()),
                         optional(a, 1, "maxsplit", Value(-1)).as_int(), from_right));
    });
  }
  if (name == "splitlines")
    return bind([](const std::string& self, const CallArgs&) {
      List lines;
      size_t pos = 0;
      while (pos < self.size()) {
        size_t nl = self.find_first_of("\r\n", pos);
        if (nl == std::string::npos) {
          lines.emplace_back(self.substr(pos));
          break;
        }
        lines.emplace_back(self.substr(pos, nl - pos));
        pos = nl + ((self[nl] == '\r' && nl + 1 < self.size() && self[nl + 1] == '\n') ? 2 : 1);
      }
      return Value(std::move(lines));
    });
  if (name == "upper" || name == "lower") {
    const bool upper = name == "upper";
    return bind([upper](const std::string& self, const CallArgs&) { return Value(map_case(self, upper)); });
  }
  if (name == "title")
    return bind([](const std::string& self, const CallArgs&) { return Value(title_case(self)); });
  if (name == "capitalize")
    return bind([](const std::string& self, const CallArgs&) { return Value(capitalize(self)); });
  if (name == "replace")
    return bind([](const std::string& self, const CallArgs& a) {
      return Value(replace_all(self, expect_string(required(a, 0, "old", "replace"), "replace"),
                               expect_string(required(a, 1, "new", "replace"), "replace"),
                               optional(a, 2, "count", Value(-1)).as_int()));
    });
  if (name == "find" || name == "rfind" || name == "index" || name == "rindex") {
    const bool reverse = name[0] == 'r', raises = name.find("index") != std::string::npos;
    return bind([reverse, raises](const std::string& self, const CallArgs& a) {
      const std::string& sub = expect_string(required(a, 0, "sub", "find"), "find");
      const size_t hit = reverse ? self.rfind(sub) : self.find(sub);
      if (hit == std::string::npos) {
        if (raises) type_error("substring not found");
        return Value(-1);
      }
      return Value(code_point_index(self, hit));
    });
  }
  if (name == "count")
    return bind([](const std::string& self, const CallArgs& a) {
      const std::string& sub = expect_string(required(a, 0, "sub", "count"), "count");
      if (sub.empty()) return Value(static_cast<int64_t>(code_points(self).size()) + 1);
      int64_t n = 0;
      for (size_t pos = self.find(sub); pos != std::string::npos; pos = self.find(sub, pos + sub.size())) ++n;
      return Value(n);
    });
  if (name == "join")
    return bind([](const std::string& self, const CallArgs& a) {
      std::string out;
      const List items = iterate(required(a, 0, "iterable", "join"));
      for (size_t i = 0; i < items.size(); ++i) {
        const std::string& item = expect_string(items[i], "join");
        charge_bytes((i ? self.size() : 0) + item.size());
        out += (i ? self : "") + item;
      }
      return Value(out);
    });
  if (name == "isdigit" || name == "isalpha" || name == "isalnum" || name == "isspace" || name == "islower" ||
      name == "isupper") {
    return bind([name](const std::string& self, const CallArgs&) {
      if (self.empty()) return Value(false);
      if (name == "islower") return Value(map_case(self, false) == self && map_case(self, true) != self);
      if (name == "isupper") return Value(map_case(self, true) == self && map_case(self, false) != self);
      for (const std::string& ch : code_points(self)) {
        const bool digit = ch.size() == 1 && std::isdigit(static_cast<unsigned char>(ch[0]));
        const bool ok = name == "isdigit"   ? digit
                        : name == "isalpha" ? is_letter(ch)
                        : name == "isalnum" ? digit || is_letter(ch)
                                            : is_python_space(ch);
        if (!ok) return Value(false);
      }
      return Value(true);
    });
  }
  return Value();
}

Value dict_method(const Value& self, const std::string& name) {
  if (name == "items")
    return Value::function("dict.items", [self](const CallArgs&) {
      List items;
      for (const auto& [k, v] : self.as_dict()) items.push_back(Value::tuple(List{Value(k), v}));
      return Value(std::move(items));
    });
  if (name == "keys")
    return Value::function("dict.keys", [self](const CallArgs&) {
      List keys;
      for (const auto& item : self.as_dict()) keys.emplace_back(item.first);
      return Value(std::move(keys));
    });
  if (name == "values")
    return Value::function("dict.values", [self](const CallArgs&) {
      List values;
      for (const auto& item : self.as_dict()) values.push_back(item.second);
      return Value(std::move(values));
    });
  if (name == "get")
    return Value::function("dict.get", [self](const CallArgs& args) {
      const Value& key = required(args, 0, "key", "get");
      Value found = key.is_string() ? self.get(key.as_string()) : Value();
      return found.is_undefined() ? optional(args, 1, "default", Value::none()) : found;
    });
  return Value();
}

// ---- filters ----

Value tojson(const Value& operand, const CallArgs& args) {
  // transformers' signature: tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)
  Value::JsonFormat format;
  format.ensure_ascii = optional(args, 0, "ensure_ascii", Value(false)).truthy();
  const Value indent = optional(args, 1, "indent", Value::none());
  if (!indent.is_none()) {
    // Python indents by max(indent, 0) spaces; a few hundred is already unreadable.
    if (indent.as_int() > 1000) type_error(fmt::format("tojson indent {} is too large", indent.as_int()));
    format.indent = static_cast<int>(std::max<int64_t>(indent.as_int(), 0));
    format.item_separator = ",";
  }
  const Value separators = optional(args, 2, "separators", Value::none());
  if (separators.is_list() && separators.as_list().size() == 2) {
    format.item_separator = expect_string(separators.as_list()[0], "tojson separators");
    format.key_separator = expect_string(separators.as_list()[1], "tojson separators");
  }
  format.sort_keys = optional(args, 3, "sort_keys", Value(false)).truthy();
  std::string json = operand.to_json(format);
  charge_bytes(json.size());
  return Value(std::move(json));
}

Value attribute_path(const Value& object, const std::string& path) {
  Value v = object;
  size_t pos = 0;
  while (pos <= path.size()) {
    size_t dot = path.find('.', pos);
    if (dot == std::string::npos) dot = path.size();
    const std::string part = path.substr(pos, dot - pos);
    const bool numeric =
        !part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; });
    int64_t index = 0;
    if (numeric && std::from_chars(part.data(), part.data() + part.size(), index).ec != std::errc()) {
      return Value();  // an index beyond 64 bits is past the end of any list
    }
    v = numeric ? get_item(v, Value(index)) : get_item(v, Value(part));
    pos = dot + 1;
  }
  return v;
}

// select / reject / selectattr / rejectattr: keep the items whose (attribute's) test passes (or fails).
Value select_items(const Value& operand, const CallArgs& args, bool keep_if, bool by_attribute) {
  size_t next = 0;
  std::string attribute;
  if (by_attribute)
    attribute = expect_string(required(args, next++, "attribute", "selectattr"), "selectattr");
  std::string test;
  CallArgs test_args;
  if (next < args.positional.size()) {
    test = expect_string(args.positional[next++], "select");
    test_args.positional.assign(args.positional.begin() + static_cast<std::ptrdiff_t>(next),
                                args.positional.end());
  }
  List out;
  for (const Value& item : iterate(operand)) {
    const Value subject = by_attribute ? attribute_path(item, attribute) : item;
    const bool passed = test.empty() ? subject.truthy() : apply_test(test, subject, test_args);
    if (passed == keep_if) out.push_back(item);
  }
  return Value(std::move(out));
}

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

}  // namespace

List iterate(const Value& iterable) {
  switch (iterable.kind()) {
    case Value::Kind::kUndefined:
      return {};
    case Value::Kind::kList:
      charge_work(iterable.as_list().size());
      return iterable.as_list();
    case Value::Kind::kDict: {
      charge_work(iterable.as_dict().size());
      List keys;
      for (const auto& item : iterable.as_dict()) keys.emplace_back(item.first);
      return keys;
    }
    case Value::Kind::kString: {
      List chars;
      for (auto& ch : code_points(iterable.as_string())) chars.emplace_back(ch);
      return chars;
    }
    default:
      type_error(fmt::format("'{}' object is not iterable", iterable.type_name()));
  }
}

bool contains(const Value& haystack, const Value& needle) {
  if (haystack.is_string()) {
    charge_work(haystack.as_string().size() / 32 + 1);
    return haystack.as_string().find(expect_string(needle, "'in <string>'")) != std::string::npos;
  }
  if (haystack.is_list()) charge_work(haystack.as_list().size());
  if (haystack.is_list())
    return std::any_of(haystack.as_list().begin(), haystack.as_list().end(),
                       [&](const Value& item) { return equal(item, needle); });
  if (haystack.is_dict()) return needle.is_string() && !haystack.get(needle.as_string()).is_undefined();
  if (haystack.is_undefined()) return false;
  type_error(fmt::format("argument of type '{}' is not iterable", haystack.type_name()));
}

Value get_item(const Value& object, const Value& key) {
  if (object.is_dict()) {
    if (!key.is_string()) return Value();
    Value found = object.get(key.as_string());
    return found.is_undefined() && !object.is_namespace() ? dict_method(object, key.as_string()) : found;
  }
  if ((object.is_list() || object.is_string()) && key.is_number() && key.kind() != Value::Kind::kFloat) {
    const int64_t size = object.is_list() ? static_cast<int64_t>(object.as_list().size())
                                          : static_cast<int64_t>(code_points(object.as_string()).size());
    int64_t i = key.as_int();
    if (i < 0) i += size;
    if (i < 0 || i >= size) return Value();
    if (object.is_list()) return object.as_list()[static_cast<size_t>(i)];
    return Value(code_points(object.as_string())[static_cast<size_t>(i)]);
  }
  if (key.is_string()) return get_attribute(object, key.as_string());
  return Value();
}

Value get_attribute(const Value& object, const std::string& name) {
  if (object.is_namespace()) return object.get(name);
  if (object.is_dict()) {
    Value method = dict_method(object, name);  // Python looks attributes up before keys
    return method.is_undefined() ? object.get(name) : method;
  }
  if (object.is_string()) return string_method(object.as_string(), name);
  if (object.is_list() && (name == "index" || name == "count")) {
    const bool index = name == "index";
    return Value::function("list." + name, [object, index](const CallArgs& args) {
      const Value& x = required(args, 0, "value", index ? "index" : "count");
      int64_t n = 0;
      const List& items = object.as_list();
      charge_work(items.size());
      for (size_t i = 0; i < items.size(); ++i) {
        if (!equal(items[i], x)) continue;
        if (index) return Value(static_cast<int64_t>(i));
        ++n;
      }
      if (index) type_error("value is not in list");
      return Value(n);
    });
  }
  return Value();
}

Value slice(const Value& object, const Value& start_v, const Value& stop_v, const Value& step_v) {
  List items;
  std::vector<std::string> chars;
  if (object.is_list()) {
    items = object.as_list();
  } else if (object.is_string()) {
    chars = code_points(object.as_string());
  } else {
    type_error(fmt::format("'{}' object is not subscriptable", object.type_name()));
  }
  const int64_t n =
      object.is_list() ? static_cast<int64_t>(items.size()) : static_cast<int64_t>(chars.size());
  const int64_t step = step_v.is_none() || step_v.is_undefined() ? 1 : step_v.as_int();
  if (step == 0) type_error("slice step cannot be zero");
  // Python's slice.indices().
  auto bound = [&](const Value& v, int64_t fallback) {
    if (v.is_none() || v.is_undefined()) return fallback;
    int64_t i = v.as_int();
    if (i < 0) i += n;
    if (step > 0) return std::clamp<int64_t>(i, 0, n);
    return std::clamp<int64_t>(i, -1, n - 1);
  };
  const int64_t start = bound(start_v, step > 0 ? 0 : n - 1);
  const int64_t stop = bound(stop_v, step > 0 ? n : -1);
  List out_items;
  std::string out_string;
  for (int64_t i = start; step > 0 ? i < stop : i > stop;) {
    if (object.is_list()) {
      out_items.push_back(items[static_cast<size_t>(i)]);
    } else {
      out_string += chars[static_cast<size_t>(i)];
    }
    if (__builtin_add_overflow(i, step, &i)) break;  // a huge step leaves the range at once
  }
  return object.is_list() ? Value(std::move(out_items)) : Value(std::move(out_string));
}

Value apply_filter(const std::string& name, const Value& operand, const CallArgs& args) {
  if (name == "length" || name == "count") {
    if (operand.is_string()) return Value(static_cast<int64_t>(code_points(operand.as_string()).size()));
    if (operand.is_list()) return Value(static_cast<int64_t>(operand.as_list().size()));
    if (operand.is_dict()) return Value(static_cast<int64_t>(operand.as_dict().size()));
    if (operand.is_undefined()) return Value(0);
    type_error(fmt::format("object of type '{}' has no len()", operand.type_name()));
  }
  if (name == "string") return Value(operand.str());
  if (name == "safe") return operand;
  if (name == "trim")
    return Value(strip(operand.str(), optional(args, 0, "chars", Value::none()), true, true));
  if (name == "tojson") return tojson(operand, args);
  if (name == "upper" || name == "lower") return Value(map_case(operand.str(), name == "upper"));
  if (name == "capitalize") return Value(capitalize(operand.str()));
  if (name == "title") return Value(title_case(operand.str()));
  if (name == "default" || name == "d") {
    const bool boolean = optional(args, 1, "boolean", Value(false)).truthy();
    if (operand.is_undefined() || (boolean && !operand.truthy()))
      return optional(args, 0, "default_value", Value(std::string()));
    return operand;
  }
  if (name == "first" || name == "last") {
    const List items = iterate(operand);
    if (items.empty()) return Value();
    return name == "first" ? items.front() : items.back();
  }
  if (name == "join") {
    const std::string separator = optional(args, 0, "d", Value(std::string())).str();
    const Value attribute = optional(args, 1, "attribute", Value::none());
    std::string out;
    const List items = iterate(operand);
    for (size_t i = 0; i < items.size(); ++i) {
      const std::string item =
          (attribute.is_none() ? items[i] : attribute_path(items[i], attribute.str())).str();
      charge_bytes((i ? separator.size() : 0) + item.size());
      out += (i ? separator : "") + item;
    }
    return Value(out);
  }
  if (name == "list") return Value(iterate(operand));
  if (name == "items") {
    if (operand.is_undefined()) return Value(List{});
    if (!operand.is_dict())
      type_error(fmt::format("items filter expects a mapping, got {}", operand.type_name()));
    List items;
    for (const auto& [k, v] : operand.as_dict()) items.push_back(Value::tuple(List{Value(k), v}));
    return Value(std::move(items));
  }
  if (name == "reverse") {
    if (operand.is_string()) {
      std::vector<std::string> cps = code_points(operand.as_string());
      std::string out;
      for (auto it = cps.rbegin(); it != cps.rend(); ++it) out += *it;
      return Value(out);
    }
    List items = iterate(operand);
    std::reverse(items.begin(), items.end());
    return Value(std::move(items));
  }
  if (name == "map") {
    List out;
    const Value* attribute = args.find(SIZE_MAX, "attribute");
    for (const Value& item : iterate(operand)) {
      if (attribute != nullptr) {
        Value v = attribute_path(item, attribute->str());
        if (v.is_undefined()) v = optional(args, SIZE_MAX, "default", Value());
        out.push_back(v);
      } else {
        CallArgs rest;
        if (args.positional.empty()) type_error("map() needs a filter name or attribute=");
        rest.positional.assign(args.positional.begin() + 1, args.positional.end());
        rest.keyword = args.keyword;
        out.push_back(apply_filter(expect_string(args.positional[0], "map"), item, rest));
      }
    }
    return Value(std::move(out));
  }
  if (name == "select" || name == "reject") return select_items(operand, args, name == "select", false);
  if (name == "selectattr" || name == "rejectattr")
    return select_items(operand, args, name == "selectattr", true);
  if (name == "unique") {
    List out;
    for (const Value& item : iterate(operand)) {
      charge_work(out.size());  // quadratic: a long list is stopped by the budget
      if (std::none_of(out.begin(), out.end(), [&](const Value& x) { return equal(x, item); }))
        out.push_back(item);
    }
    return Value(std::move(out));
  }
  if (name == "int") {
    if (operand.kind() == Value::Kind::kFloat) {
      // Python's int() is unbounded; here a float outside 64 bits (or nan) has no integer value.
      const double truncated = std::trunc(operand.as_float());
      if (!(truncated >= -9.2233720368547758e18 && truncated < 9.2233720368547758e18))
        type_error(fmt::format("cannot convert float {} to a 64-bit integer", python_float_repr(truncated)));
      return Value(static_cast<int64_t>(truncated));
    }
    if (operand.is_number()) return Value(operand.as_int());
    if (operand.is_string()) {
      try {
        return Value(static_cast<int64_t>(std::stoll(operand.as_string())));
      } catch (const std::exception&) {
      }
    }
    return optional(args, 0, "default", Value(0));
  }
  if (name == "float") {
    if (operand.is_number()) return Value(operand.as_float());
    if (operand.is_string()) {
      try {
        return Value(std::stod(operand.as_string()));
      } catch (const std::exception&) {
      }
    }
    return optional(args, 0, "default", Value(0.0));
  }
  if (name == "abs") {
    if (operand.kind() == Value::Kind::kFloat) return Value(std::fabs(operand.as_float()));
    if (operand.is_number()) {
      if (operand.as_int() == INT64_MIN) type_error("integer overflow in abs()");
      return Value(std::abs(operand.as_int()));
    }
    type_error(fmt::format("bad operand type for abs(): '{}'", operand.type_name()));
  }
  if (name == "round") {
    const int64_t precision = optional(args, 0, "precision", Value(0)).as_int();
    const double scale = std::pow(10.0, static_cast<double>(precision));
    return Value(std::round(operand.as_float() * scale) / scale);
  }
  if (name == "replace") {
    const Value count = optional(args, 2, "count", Value::none());
    return Value(replace_all(operand.str(), required(args, 0, "old", "replace").str(),
                             required(args, 1, "new", "replace").str(),
                             count.is_none() ? -1 : count.as_int()));
  }
  if (name == "escape" || name == "e" || name == "forceescape") return Value(html_escape(operand.str()));
  if (name == "indent") {
    const Value width_v = optional(args, 0, "width", Value(4));
    if (!width_v.is_string() && (width_v.as_int() < 0 || width_v.as_int() > 1000))
      type_error(fmt::format("indent width {} is out of range [0, 1000]", width_v.as_int()));
    const std::string pad =
        width_v.is_string() ? width_v.as_string() : std::string(static_cast<size_t>(width_v.as_int()), ' ');
    const bool first = optional(args, 1, "first", Value(false)).truthy();
    const bool blank = optional(args, 2, "blank", Value(false)).truthy();
    const List lines = split(operand.str(), Value("\n"), -1, false);
    std::string out;
    for (size_t i = 0; i < lines.size(); ++i) {
      const std::string& line = lines[i].as_string();
      if (i) out += "\n";
      if ((i > 0 || first) && (blank || !line.empty())) out += pad;
      out += line;
      charge_bytes(pad.size() + line.size() + 1);
    }
    return Value(out);
  }
  type_error(fmt::format("no filter named '{}'", name));
}

bool apply_test(const std::string& name, const Value& operand, const CallArgs& args) {
  using K = Value::Kind;
  if (name == "defined") return !operand.is_undefined();
  if (name == "undefined") return operand.is_undefined();
  if (name == "none") return operand.is_none();
  if (name == "true") return operand.kind() == K::kBool && operand.as_bool();
  if (name == "false") return operand.kind() == K::kBool && !operand.as_bool();
  if (name == "boolean") return operand.kind() == K::kBool;
  if (name == "string") return operand.is_string();
  if (name == "number") return operand.is_number();
  if (name == "integer") return operand.kind() == K::kInt;
  if (name == "float") return operand.kind() == K::kFloat;
  if (name == "mapping") return operand.is_dict();
  if (name == "iterable")
    return operand.is_list() || operand.is_dict() || operand.is_string() || operand.is_undefined();
  if (name == "sequence") return operand.is_list() || operand.is_dict() || operand.is_string();
  if (name == "callable") return operand.is_function();
  if (name == "odd" || name == "even") {
    if (!operand.is_number()) type_error(fmt::format("test '{}' needs a number", name));
    const int64_t r = ((operand.as_int() % 2) + 2) % 2;
    return name == "odd" ? r == 1 : r == 0;
  }
  if (name == "divisibleby") {
    const int64_t d = required(args, 0, "num", "divisibleby").as_int();
    if (d == 0) type_error("division by zero");
    return d == -1 || operand.as_int() % d == 0;  // x % -1 overflows for the smallest x
  }
  if (name == "lower")
    return operand.is_string() && map_case(operand.as_string(), false) == operand.as_string();
  if (name == "upper")
    return operand.is_string() && map_case(operand.as_string(), true) == operand.as_string();
  if (name == "escaped") return false;
  const Value& other = [&]() -> const Value& {
    static const Value kMissing;
    const Value* v = args.find(0, "other");
    return v != nullptr ? *v : kMissing;
  }();
  if (name == "eq" || name == "equalto" || name == "==") return equal(operand, other);
  if (name == "ne" || name == "!=") return !equal(operand, other);
  if (name == "lt" || name == "lessthan" || name == "<") return less(operand, other);
  if (name == "gt" || name == "greaterthan" || name == ">") return less(other, operand);
  if (name == "le" || name == "<=") return !less(other, operand);
  if (name == "ge" || name == ">=") return !less(operand, other);
  if (name == "in") return contains(other, operand);
  if (name == "sameas") {
    // Python identity: only meaningful for None, True and False in templates.
    if (operand.kind() != other.kind()) return false;
    return operand.kind() == K::kNone ||
           (operand.kind() == K::kBool && operand.as_bool() == other.as_bool()) || (operand.is_undefined());
  }
  type_error(fmt::format("no test named '{}'", name));
}

Dict global_functions() {
  Dict globals;
  globals.emplace_back("range", Value::function("range", [](const CallArgs& args) {
                         int64_t start = 0, stop = 0, step = 1;
                         if (args.positional.size() == 1) {
                           stop = args.positional[0].as_int();
                         } else if (args.positional.size() >= 2) {
                           start = args.positional[0].as_int();
                           stop = args.positional[1].as_int();
                           if (args.positional.size() > 2) step = args.positional[2].as_int();
                         }
                         if (step == 0) type_error("range() arg 3 must not be zero");
                         List out;
                         for (int64_t i = start; step > 0 ? i < stop : i > stop;) {
                           if (out.size() >= 100000) type_error("range() too long for a template");
                           out.emplace_back(i);
                           if (__builtin_add_overflow(i, step, &i)) break;  // past the end at once
                         }
                         charge_work(out.size());
                         return Value(std::move(out));
                       }));
  auto make_dict = [](const CallArgs& args) {
    Dict attributes;
    if (!args.positional.empty() && args.positional[0].is_dict()) attributes = args.positional[0].as_dict();
    for (const auto& keyword : args.keyword) {  // not a structured binding: clang 14 cannot capture one
      auto it = std::find_if(attributes.begin(), attributes.end(),
                             [&](const auto& item) { return item.first == keyword.first; });
      if (it != attributes.end()) {
        it->second = keyword.second;
      } else {
        attributes.push_back(keyword);
      }
    }
    return attributes;
  };
  globals.emplace_back("namespace", Value::function("namespace", [make_dict](const CallArgs& args) {
                         return Value::namespace_object(make_dict(args));
                       }));
  globals.emplace_back(
      "dict", Value::function("dict", [make_dict](const CallArgs& args) { return Value(make_dict(args)); }));
  globals.emplace_back(
      "raise_exception", Value::function("raise_exception", [](const CallArgs& args) -> Value {
        throw Error(ErrorKind::kInvalidInput, required(args, 0, "message", "raise_exception").str());
      }));
  globals.emplace_back("strftime_now", Value::function("strftime_now", [](const CallArgs& args) {
                         const std::string format = required(args, 0, "format", "strftime_now").str();
                         const std::time_t now = std::time(nullptr);
                         std::tm local{};
                         localtime_r(&now, &local);
                         char buf[256];
                         const size_t n = std::strftime(buf, sizeof(buf), format.c_str(), &local);
                         return Value(std::string(buf, n));
                       }));
  return globals;
}

}  // namespace mtpx::jinja
