#include "convert/formats/torch/pickle_value.h"

#include <cstdio>

namespace trestle {

std::string_view kind_name(PickleKind kind) {
  switch (kind) {
    case PickleKind::kNone:
      return "None";
    case PickleKind::kBool:
      return "bool";
    case PickleKind::kInt:
      return "int";
    case PickleKind::kBigInt:
      return "int (beyond 64 bits)";
    case PickleKind::kFloat:
      return "float";
    case PickleKind::kString:
      return "str";
    case PickleKind::kBytes:
      return "bytes";
    case PickleKind::kList:
      return "list";
    case PickleKind::kTuple:
      return "tuple";
    case PickleKind::kDict:
      return "dict";
    case PickleKind::kSet:
      return "set";
    case PickleKind::kFrozenSet:
      return "frozenset";
    case PickleKind::kGlobal:
      return "class reference";
    case PickleKind::kObject:
      return "object";
    case PickleKind::kPersistentId:
      return "persistent id";
  }
  return "?";
}

std::string PickleValue::class_name() const {
  if (kind == PickleKind::kGlobal) return text + "." + name;
  if (kind == PickleKind::kObject && cls) return cls->class_name();
  if (kind == PickleKind::kDict && !text.empty()) return text + "." + name;
  return {};
}

const PickleValue* PickleValue::get(std::string_view key) const {
  if (kind != PickleKind::kDict) return nullptr;
  for (auto it = entries.rbegin(); it != entries.rend(); ++it)  // the last of repeated keys wins, as in Python
    if (it->first->kind == PickleKind::kString && it->first->text == key) return it->second;
  return nullptr;
}

const PickleValue* PickleValue::attr(std::string_view key) const {
  if (!state) return nullptr;
  if (state->kind == PickleKind::kDict) return state->get(key);
  if (state->kind == PickleKind::kTuple)  // (instance dict or None, slots dict)
    for (const PickleValue* part : state->items)
      if (const PickleValue* found = part->get(key)) return found;
  return nullptr;
}

PickleValue* PickleDocument::make(PickleKind kind) {
  values_.emplace_back();
  values_.back().kind = kind;
  return &values_.back();
}

PickleValue* PickleDocument::boolean(bool b) {
  PickleValue* v = make(PickleKind::kBool);
  v->boolean = b;
  return v;
}

PickleValue* PickleDocument::integer(std::int64_t i) {
  PickleValue* v = make(PickleKind::kInt);
  v->integer = i;
  return v;
}

PickleValue* PickleDocument::real(double d) {
  PickleValue* v = make(PickleKind::kFloat);
  v->real = d;
  return v;
}

PickleValue* PickleDocument::string(std::string s) {
  PickleValue* v = make(PickleKind::kString);
  v->text = std::move(s);
  return v;
}

PickleValue* PickleDocument::bytes(std::string b) {
  PickleValue* v = make(PickleKind::kBytes);
  v->text = std::move(b);
  return v;
}

PickleValue* PickleDocument::global(std::string module, std::string name) {
  PickleValue* v = make(PickleKind::kGlobal);
  v->text = std::move(module);
  v->name = std::move(name);
  return v;
}

PickleValue* PickleDocument::tuple(std::vector<PickleValue*> items) {
  PickleValue* v = make(PickleKind::kTuple);
  v->items = std::move(items);
  return v;
}

PickleValue* PickleDocument::list(std::vector<PickleValue*> items) {
  PickleValue* v = make(PickleKind::kList);
  v->items = std::move(items);
  return v;
}

PickleValue* PickleDocument::dict(std::vector<std::pair<PickleValue*, PickleValue*>> entries) {
  PickleValue* v = make(PickleKind::kDict);
  v->entries = std::move(entries);
  return v;
}

PickleValue* PickleDocument::object(PickleValue* cls, PickleValue* args, PickleValue* state, PickleCall call) {
  PickleValue* v = make(PickleKind::kObject);
  v->cls = cls;
  v->args = args;
  v->state = state;
  v->call = call;
  return v;
}

PickleValue* PickleDocument::persistent_id(PickleValue* pid) {
  PickleValue* v = make(PickleKind::kPersistentId);
  v->pid = pid;
  return v;
}

Result<std::int64_t> pickle_int(const PickleValue* v, std::string_view what) {
  if (v && v->kind == PickleKind::kInt) return v->integer;
  if (v && v->kind == PickleKind::kBool) return static_cast<std::int64_t>(v->boolean);
  return Status::Error(std::string(what) + ": expected an int, found " +
                       (v ? std::string(kind_name(v->kind)) : std::string("nothing")));
}

Result<std::string> pickle_string(const PickleValue* v, std::string_view what) {
  if (v && v->kind == PickleKind::kString) return v->text;
  return Status::Error(std::string(what) + ": expected a str, found " +
                       (v ? std::string(kind_name(v->kind)) : std::string("nothing")));
}

Result<std::vector<std::int64_t>> pickle_int_tuple(const PickleValue* v, std::string_view what) {
  if (v && v->kind == PickleKind::kObject && v->class_name() == "torch.Size" && v->args &&
      v->args->kind == PickleKind::kTuple && v->args->items.size() == 1)
    v = v->args->items[0];
  if (!v || !v->is_sequence())
    return Status::Error(std::string(what) + ": expected a tuple of ints, found " +
                         (v ? std::string(kind_name(v->kind)) : std::string("nothing")));
  std::vector<std::int64_t> out;
  out.reserve(v->items.size());
  for (const PickleValue* item : v->items) {
    TRESTLE_ASSIGN_OR_RETURN(std::int64_t i, pickle_int(item, what));
    out.push_back(i);
  }
  return out;
}

namespace {

void quote(std::string& out, const std::string& s, char prefix) {
  if (prefix) out += prefix;
  out += '\'';
  for (unsigned char c : s) {
    if (c == '\'' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20 || c == 0x7f || (prefix && c >= 0x80)) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  out += '\'';
}

void repr(std::string& out, const PickleValue* v, int depth, std::size_t max_chars) {
  if (out.size() > max_chars) return;
  if (!v) {
    out += "<null>";
    return;
  }
  if (depth > kPickleMaxDepth) {
    out += "...";
    return;
  }
  auto join = [&](const std::vector<PickleValue*>& items) {
    for (std::size_t i = 0; i < items.size() && out.size() <= max_chars; ++i) {
      if (i) out += ", ";
      repr(out, items[i], depth + 1, max_chars);
    }
  };
  switch (v->kind) {
    case PickleKind::kNone:
      out += "None";
      break;
    case PickleKind::kBool:
      out += v->boolean ? "True" : "False";
      break;
    case PickleKind::kInt:
      out += std::to_string(v->integer);
      break;
    case PickleKind::kBigInt:
      out += "<int of " + std::to_string(v->text.size()) + " bytes>";
      break;
    case PickleKind::kFloat: {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.17g", v->real);
      out += buf;
      break;
    }
    case PickleKind::kString:
      quote(out, v->text, 0);
      break;
    case PickleKind::kBytes:
      quote(out, v->text.substr(0, 64), 'b');
      break;
    case PickleKind::kList:
      out += "[";
      join(v->items);
      out += "]";
      break;
    case PickleKind::kTuple:
      out += "(";
      join(v->items);
      out += v->items.size() == 1 ? ",)" : ")";
      break;
    case PickleKind::kSet:
    case PickleKind::kFrozenSet:
      out += "{";
      join(v->items);
      out += "}";
      break;
    case PickleKind::kDict:
      if (!v->text.empty()) out += v->class_name() + "(";
      out += "{";
      for (std::size_t i = 0; i < v->entries.size() && out.size() <= max_chars; ++i) {
        if (i) out += ", ";
        repr(out, v->entries[i].first, depth + 1, max_chars);
        out += ": ";
        repr(out, v->entries[i].second, depth + 1, max_chars);
      }
      out += "}";
      if (!v->text.empty()) out += ")";
      break;
    case PickleKind::kGlobal:
      out += v->class_name();
      break;
    case PickleKind::kObject:
      out += v->class_name().empty() ? "<callable>" : v->class_name();
      out += "(";
      if (v->args && v->args->kind == PickleKind::kTuple) join(v->args->items);
      if (v->state) {
        if (v->args && !v->args->items.empty()) out += ", ";
        out += "state=";
        repr(out, v->state, depth + 1, max_chars);
      }
      out += ")";
      break;
    case PickleKind::kPersistentId:
      out += "persistent_id(";
      repr(out, v->pid, depth + 1, max_chars);
      out += ")";
      break;
  }
}

}  // namespace

std::string pickle_repr(const PickleValue* v, std::size_t max_chars) {
  std::string out;
  repr(out, v, 0, max_chars);
  if (out.size() > max_chars) out = out.substr(0, max_chars) + "...";
  return out;
}

nlohmann::ordered_json pickle_to_json(const PickleValue* v, int depth) {
  using json = nlohmann::ordered_json;
  if (!v || depth > kPickleMaxDepth) return "...";
  switch (v->kind) {
    case PickleKind::kNone:
      return nullptr;
    case PickleKind::kBool:
      return v->boolean;
    case PickleKind::kInt:
      return v->integer;
    case PickleKind::kFloat:
      return v->real;
    case PickleKind::kString:
      return v->text;
    case PickleKind::kList:
    case PickleKind::kTuple: {
      json out = json::array();
      for (const PickleValue* item : v->items) out.push_back(pickle_to_json(item, depth + 1));
      return out;
    }
    case PickleKind::kDict: {
      json out = json::object();
      for (const auto& [k, item] : v->entries) {
        if (k->kind != PickleKind::kString) return pickle_repr(v);
        out[k->text] = pickle_to_json(item, depth + 1);
      }
      return out;
    }
    default:
      return pickle_repr(v);
  }
}

}  // namespace trestle
