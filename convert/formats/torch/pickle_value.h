// The object model of the pickle subset: plain data (None, bool, int, float, str, bytes, list, tuple, dict, set),
// class references (GLOBAL / STACK_GLOBAL), objects built by REDUCE / NEWOBJ with their BUILD state, and persistent
// ids (how torch.save refers to storages). Nothing is ever executed: an object is only "class name, args, state".
// A PickleDocument owns every value; values point at each other (shared and even cyclic references are allowed, as in
// Python), so anything that walks a document bounds its depth (kPickleMaxDepth) instead of trusting the input.
#pragma once

#include <cstdint>
#include <deque>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ckpt/status.h"

namespace trestle {

inline constexpr int kPickleMaxDepth = 512;

enum class PickleKind : std::uint8_t {
  kNone,
  kBool,
  kInt,
  kBigInt,
  kFloat,
  kString,
  kBytes,
  kList,
  kTuple,
  kDict,
  kSet,
  kFrozenSet,
  kGlobal,        // a class or function reference: module + name
  kObject,        // cls applied to args (REDUCE / NEWOBJ / NEWOBJ_EX), then BUILD state, APPENDs and SETITEMs
  kPersistentId,  // BINPERSID / PERSID: `pid` is the persistent id (torch: ('storage', type, key, location, numel))
};

// How an object was made, so the writer emits the same opcode Python would.
enum class PickleCall : std::uint8_t { kReduce, kNewObj, kNewObjEx };

struct PickleValue {
  PickleKind kind = PickleKind::kNone;
  bool boolean = false;
  std::int64_t integer = 0;
  double real = 0;
  // kString: UTF-8; kBytes: raw bytes; kBigInt: little-endian two's complement; kGlobal: module;
  // kDict: the module of its class when not a plain dict ("collections" for OrderedDict), else empty.
  std::string text;
  std::string name;                 // kGlobal: qualified name; kDict: the class name ("OrderedDict") when text is set
  std::vector<PickleValue*> items;  // list, tuple, set; object: appended items
  std::vector<std::pair<PickleValue*, PickleValue*>> entries;  // dict; object: set items
  PickleValue* cls = nullptr;                                  // kObject: the callable (usually a kGlobal)
  PickleValue* args = nullptr;                                 // kObject: a tuple
  PickleValue* kwargs = nullptr;                               // kObject via NEWOBJ_EX
  PickleValue* state = nullptr;                                // kObject (or kDict): the BUILD argument, when any
  PickleValue* pid = nullptr;                                  // kPersistentId
  PickleCall call = PickleCall::kReduce;

  bool is(PickleKind k) const { return kind == k; }
  bool is_sequence() const { return kind == PickleKind::kList || kind == PickleKind::kTuple; }
  // "module.name" of a global, of an object's class, or of a dict subclass; empty otherwise.
  std::string class_name() const;
  // Dict lookup by string key (nullptr when absent or not a dict).
  const PickleValue* get(std::string_view key) const;
  // An object's attribute: looked up in its BUILD state (a dict, or the dict parts of a (dict, slots) tuple).
  const PickleValue* attr(std::string_view key) const;
};

// Python's name for a kind ("int", "tuple", ...), for error messages.
std::string_view kind_name(PickleKind kind);

class PickleDocument {
 public:
  PickleDocument() = default;
  PickleDocument(PickleDocument&&) = default;
  PickleDocument& operator=(PickleDocument&&) = default;
  PickleDocument(const PickleDocument&) = delete;
  PickleDocument& operator=(const PickleDocument&) = delete;

  const PickleValue* root() const { return root_; }
  void set_root(PickleValue* root) { root_ = root; }
  std::size_t size() const { return values_.size(); }

  // Builders (values live as long as the document).
  PickleValue* make(PickleKind kind);
  PickleValue* none() { return make(PickleKind::kNone); }
  PickleValue* boolean(bool b);
  PickleValue* integer(std::int64_t i);
  PickleValue* real(double d);
  PickleValue* string(std::string s);
  PickleValue* bytes(std::string b);
  PickleValue* global(std::string module, std::string name);
  PickleValue* tuple(std::vector<PickleValue*> items);
  PickleValue* list(std::vector<PickleValue*> items);
  PickleValue* dict(std::vector<std::pair<PickleValue*, PickleValue*>> entries = {});
  // cls(*args) via REDUCE, or cls.__new__(cls, *args) via NEWOBJ; state (optional) is BUILD's argument.
  PickleValue* object(PickleValue* cls, PickleValue* args, PickleValue* state = nullptr,
                      PickleCall call = PickleCall::kReduce);
  PickleValue* persistent_id(PickleValue* pid);

 private:
  std::deque<PickleValue> values_;
  PickleValue* root_ = nullptr;
};

// Typed access for callers that need a particular shape; errors say what was found instead.
Result<std::int64_t> pickle_int(const PickleValue* v, std::string_view what);
Result<std::string> pickle_string(const PickleValue* v, std::string_view what);
// A tuple or list of ints, or a torch.Size (an object of class torch.Size whose args hold one such tuple).
Result<std::vector<std::int64_t>> pickle_int_tuple(const PickleValue* v, std::string_view what);

// A short Python-like rendering for messages and `trestle inspect` ("{'a': 1, 'b': torch.Size((3, 4))}"); stops at
// max_chars and at kPickleMaxDepth.
std::string pickle_repr(const PickleValue* v, std::size_t max_chars = 200);

// Plain data as JSON (dicts with str keys as objects, lists and tuples as arrays); anything else (objects, tensors,
// bytes, dicts with other keys) as its pickle_repr string. Bounded by kPickleMaxDepth.
nlohmann::ordered_json pickle_to_json(const PickleValue* v, int depth = 0);

}  // namespace trestle
