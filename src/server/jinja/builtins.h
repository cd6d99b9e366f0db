// What templates can call: filters (x | name), tests (x is name), attributes and methods of values
// (str.startswith, dict.items, ...) and global functions (namespace, range, raise_exception, ...). The set
// covers what Qwen's and similar chat templates use; anything else is an error that names it.
#pragma once

#include <string>

#include "server/jinja/value.h"

namespace mtpx::jinja {

Value apply_filter(const std::string& name, const Value& operand, const CallArgs& args);
bool apply_test(const std::string& name, const Value& operand, const CallArgs& args);
// object.name: a method bound to the object, a dict's key or a namespace's attribute (undefined if none).
Value get_attribute(const Value& object, const std::string& name);
// object[key]: list or string index (negative from the end), dict key (undefined if missing).
Value get_item(const Value& object, const Value& key);
// object[start:stop:step] on a list or string.
Value slice(const Value& object, const Value& start, const Value& stop, const Value& step);
// Python `needle in haystack`.
bool contains(const Value& haystack, const Value& needle);
// The items a for loop visits: list elements, dict keys, string characters; nothing for undefined.
List iterate(const Value& iterable);
// range, namespace, dict, raise_exception, strftime_now.
Dict global_functions();

}  // namespace mtpx::jinja
