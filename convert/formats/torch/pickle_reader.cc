#include "convert/formats/torch/pickle_reader.h"

#include <bit>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <unordered_map>

#include "ckpt/process_memory.h"

namespace trestle {
namespace {

class Parser {
 public:
  Parser(std::string_view data, const PickleLimits& limits) : data_(data), limits_(limits) {}

  Result<PickleDocument> run() {
    while (true) {
      if (pos_ >= data_.size()) return fail("input ends before the STOP opcode");
      op_pos_ = pos_;
      const auto op = static_cast<unsigned char>(data_[pos_++]);
      if (op == '.') break;
      TRESTLE_RETURN_IF_ERROR(step(op));
      if (stack_.size() > limits_.max_stack)
        return fail("more than " + std::to_string(limits_.max_stack) + " values on the stack");
      if (doc_.size() > limits_.max_values)
        return fail("more than " + std::to_string(limits_.max_values) +
                    " values, more than this machine's memory holds parsed");
    }
    if (!marks_.empty()) return fail("STOP with an unclosed MARK");
    if (stack_.size() != 1)
      return fail("STOP with " + std::to_string(stack_.size()) + " values on the stack (expected 1)");
    doc_.set_root(stack_.back());
    return std::move(doc_);
  }

 private:
  Status fail(const std::string& what) const {
    return Status::Error("pickle: " + what + " (opcode at byte " + std::to_string(op_pos_) + ")");
  }

  Result<std::string_view> take(std::uint64_t n) {
    if (n > data_.size() - pos_)
      return fail("length " + std::to_string(n) + " runs past the end of the input (" +
                  std::to_string(data_.size() - pos_) + " bytes left)");
    std::string_view out = data_.substr(pos_, static_cast<std::size_t>(n));
    pos_ += static_cast<std::size_t>(n);
    return out;
  }

  Result<std::uint64_t> le(int bytes) {
    TRESTLE_ASSIGN_OR_RETURN(std::string_view raw, take(bytes));
    std::uint64_t v = 0;
    for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(raw[i]);
    return v;
  }

  Result<std::string_view> line() {
    const std::size_t end = data_.find('\n', pos_);
    if (end == std::string_view::npos) return fail("text argument without a terminating newline");
    std::string_view out = data_.substr(pos_, end - pos_);
    pos_ = end + 1;
    return out;
  }

  void push(PickleValue* v) { stack_.push_back(v); }

  Result<PickleValue*> pop() {
    if (stack_.empty() || (!marks_.empty() && stack_.size() <= marks_.back())) return fail("pop from an empty stack");
    PickleValue* v = stack_.back();
    stack_.pop_back();
    return v;
  }

  Result<PickleValue*> top() {
    if (stack_.empty() || (!marks_.empty() && stack_.size() <= marks_.back())) return fail("stack is empty");
    return stack_.back();
  }

  Result<std::vector<PickleValue*>> pop_mark() {
    if (marks_.empty()) return fail("no MARK to pop to");
    const std::size_t at = marks_.back();
    marks_.pop_back();
    std::vector<PickleValue*> items(stack_.begin() + static_cast<std::ptrdiff_t>(at), stack_.end());
    stack_.resize(at);
    return items;
  }

  Status memo_put(std::uint64_t index) {
    TRESTLE_ASSIGN_OR_RETURN(PickleValue * v, top());
    memo_[index] = v;
    return OkStatus();
  }

  Status memo_get(std::uint64_t index) {
    auto it = memo_.find(index);
    if (it == memo_.end()) return fail("memo index " + std::to_string(index) + " was never stored");
    push(it->second);
    return OkStatus();
  }

  PickleValue* make_int(std::string_view little_endian) {
    if (little_endian.size() <= 8) {
      std::uint64_t v = 0;
      for (std::size_t i = little_endian.size(); i-- > 0;) v = (v << 8) | static_cast<unsigned char>(little_endian[i]);
      const std::size_t bits = little_endian.size() * 8;
      if (bits > 0 && bits < 64 && (v >> (bits - 1)) & 1) v |= ~std::uint64_t{0} << bits;  // sign-extend
      return doc_.integer(static_cast<std::int64_t>(v));
    }
    PickleValue* big = doc_.make(PickleKind::kBigInt);
    big->text = std::string(little_endian);
    return big;
  }

  Result<PickleValue*> text_int(std::string_view text) {
    if (!text.empty() && text.back() == 'L') text.remove_suffix(1);
    std::string s(text);
    errno = 0;
    char* end = nullptr;
    const long long v = std::strtoll(s.c_str(), &end, 10);
    if (s.empty() || end != s.c_str() + s.size() || errno == ERANGE) return fail("bad integer literal '" + s + "'");
    return doc_.integer(v);
  }

  // REDUCE / NEWOBJ: a few classes are plain data and are turned into it; the rest stay generic objects.
  PickleValue* make_object(PickleValue* cls, PickleValue* args, PickleCall call) {
    if (cls->kind == PickleKind::kGlobal && args->kind == PickleKind::kTuple) {
      if (cls->text == "collections" && cls->name == "OrderedDict" && args->items.empty()) {
        PickleValue* d = doc_.dict();
        d->text = "collections";
        d->name = "OrderedDict";
        return d;
      }
      if (cls->text == "_codecs" && cls->name == "encode" && args->items.size() == 2 &&
          args->items[0]->kind == PickleKind::kString && args->items[1]->kind == PickleKind::kString &&
          args->items[1]->text == "latin1")
        return latin1_bytes(args->items[0]->text);
      if ((cls->text == "__builtin__" || cls->text == "builtins") && cls->name == "bytes" && args->items.empty())
        return doc_.bytes("");
    }
    return doc_.object(cls, args, nullptr, call);
  }

  // The str holds code points 0..255 in UTF-8; the bytes are those code points.
  PickleValue* latin1_bytes(const std::string& utf8) {
    std::string out;
    out.reserve(utf8.size());
    for (std::size_t i = 0; i < utf8.size(); ++i) {
      const auto c = static_cast<unsigned char>(utf8[i]);
      if (c >= 0xc0 && i + 1 < utf8.size()) {
        out += static_cast<char>(((c & 0x1f) << 6) | (static_cast<unsigned char>(utf8[i + 1]) & 0x3f));
        ++i;
      } else {
        out += static_cast<char>(c);
      }
    }
    return doc_.bytes(std::move(out));
  }

  Status set_items(PickleValue* target, const std::vector<PickleValue*>& kv) {
    if (kv.size() % 2) return fail("SETITEMS with an odd number of values");
    if (target->kind != PickleKind::kDict && target->kind != PickleKind::kObject)
      return fail("SETITEM(S) on a " + std::string(kind_name(target->kind)));
    // A repeated key is kept twice; lookups take the last one, as Python's dict would hold it.
    for (std::size_t i = 0; i < kv.size(); i += 2) target->entries.emplace_back(kv[i], kv[i + 1]);
    return OkStatus();
  }

  Status append(PickleValue* target, const std::vector<PickleValue*>& items) {
    if (target->kind != PickleKind::kList && target->kind != PickleKind::kObject && target->kind != PickleKind::kSet)
      return fail("APPEND(S)/ADDITEMS on a " + std::string(kind_name(target->kind)));
    target->items.insert(target->items.end(), items.begin(), items.end());
    return OkStatus();
  }

  Status push_string(std::string_view raw, bool is_bytes) {
    push(is_bytes ? doc_.bytes(std::string(raw)) : doc_.string(std::string(raw)));
    return OkStatus();
  }

  Status step(unsigned char op) {
    switch (op) {
      case 0x80: {  // PROTO
        TRESTLE_ASSIGN_OR_RETURN(std::uint64_t proto, le(1));
        if (proto > 5) return fail("unsupported pickle protocol " + std::to_string(proto));
        return OkStatus();
      }
      case 0x95: {  // FRAME: a length hint; the frame's bytes follow inline
        TRESTLE_ASSIGN_OR_RETURN(std::uint64_t n, le(8));
        if (n > data_.size() - pos_)
          return fail("frame of " + std::to_string(n) + " bytes runs past the end of the input");
        return OkStatus();
      }
      case '(':
        if (static_cast<int>(marks_.size()) >= limits_.max_mark_depth)
          return fail("nesting deeper than " + std::to_string(limits_.max_mark_depth) + " MARKs");
        marks_.push_back(stack_.size());
        return OkStatus();
      case '0':
        return pop().status();
      case '1':
        return pop_mark().status();
      case '2': {
        TRESTLE_ASSIGN_OR_RETURN(PickleValue * v, top());
        push(v);
        return OkStatus();
      }
      case 'N':
        push(doc_.none());
        return OkStatus();
      case 0x88:
        push(doc_.boolean(true));
        return OkStatus();
      case 0x89:
        push(doc_.boolean(false));
        return OkStatus();
      case 'K': {
        TRESTLE_ASSIGN_OR_RETURN(std::uint64_t v, le(1));
        push(doc_.integer(static_cast<std::int64_t>(v)));
        return OkStatus();
      }
      case 'M': {
        TRESTLE_ASSIGN_OR_RETURN(std::uint64_t v, le(2));
        push(doc_.integer(static_cast<std::int64_t>(v)));
        return OkStatus();
      }
      case 'J': {
        TRESTLE_ASSIGN_OR_RETURN(std::uint64_t v, le(4));
        push(doc_.integer(static_cast<std::int32_t>(static_cast<std::uint32_t>(v))));
        return OkStatus();
      }
      case 0x8a:    // LONG1
      case 0x8b: {  // LONG4
        TRESTLE_ASSIGN_OR_RETURN(std::uint64_t n, le(op == 0x8a ? 1 : 4));
        TRESTLE_ASSIGN_OR_RETURN(std::string_view raw, take(n));
        push(make_int(raw));
        return OkStatus();
      }
      case 'I': {
        TRESTLE_ASSIGN_OR_RETURN(std::string_view text, line());
        if (text == "00" || text == "01") {
          push(doc_.boolean(text == "01"));
          return OkStatus();
        }
        TRESTLE_ASSIGN_OR_RETURN(PickleValue * v, text_int(text));
        push(v);
        return OkStatus();
      }
      case 'L': {
        TRESTLE_ASSIGN_OR_RETURN(std::string_view text, line());
        TRESTLE_ASSIGN_OR_RETURN(PickleValue * v, text_int(text));
        push(v);
        return OkStatus();
      }
      case 'G': {
        TRESTLE_ASSIGN_OR_RETURN(std::string_view raw, take(8));
        std::uint64_t bits = 0;
        for (char c : raw) bits = (bits << 8) | static_cast<unsigned char>(c);  // big-endian
        push(doc_.real(std::bit_cast<double>(bits)));
        return OkStatus();
      }
      case 'F': {
        TRESTLE_ASSIGN_OR_RETURN(std::string_view text, line());
        std::string s(text);
        char* end = nullptr;
        const double d = std::strtod(s.c_str(), &end);
        if (s.empty() || end != s.c_str() + s.size()) return fail("bad float literal '" + s + "'");
        push(doc_.real(d));
        return OkStatus();
      }
      case 'X':    // BINUNICODE
      case 0x8c:   // SHORT_BINUNICODE
      case 0x8d:   // BINUNICODE8
      case 'B':    // BINBYTES
      case 'C':    // SHORT_BINBYTES
      case 0x8e:   // BINBYTES8
      case 0x96:   // BYTEARRAY8
      case 'T':    // BINSTRING (py2 str: bytes)
      case 'U': {  // SHORT_BINSTRING
        const int width = (op == 0x8c || op == 'C' || op == 'U') ? 1 : (op == 'X' || op == 'B' || op == 'T') ? 4 : 8;
        TRESTLE_ASSIGN_OR_RETURN(std::uint64_t n, le(width));
        TRESTLE_ASSIGN_OR_RETURN(std::string_view raw, take(n));
        const bool is_bytes = !(op == 'X' || op == 0x8c || op == 0x8d);
        return push_string(raw, is_bytes);
      }
      case ')':
        push(doc_.tuple({}));
        return OkStatus();
      case ']':
        push(doc_.list({}));
        return OkStatus();
      case '}':
        push(doc_.dict());
        return OkStatus();
      case 0x8f:
        push(doc_.make(PickleKind::kSet));
        return OkStatus();
      case 't': {
        TRESTLE_ASSIGN_OR_RETURN(auto items, pop_mark());
        push(doc_.tuple(std::move(items)));
        return OkStatus();
      }
      case 0x85:
      case 0x86:
      case 0x87: {  // TUPLE1..3
        std::vector<PickleValue*> items(op - 0x84);
        for (std::size_t i = items.size(); i-- > 0;) {
          TRESTLE_ASSIGN_OR_RETURN(items[i], pop());
        }
        push(doc_.tuple(std::move(items)));
        return OkStatus();
      }
      case 'l': {
        TRESTLE_ASSIGN_OR_RETURN(auto items, pop_mark());
        push(doc_.list(std::move(items)));
        return OkStatus();
      }
      case 'd': {
        TRESTLE_ASSIGN_OR_RETURN(auto kv, pop_mark());
        PickleValue* d = doc_.dict();
        TRESTLE_RETURN_IF_ERROR(set_items(d, kv));
        push(d);
        return OkStatus();
      }
      case 0x91: {  // FROZENSET
        TRESTLE_ASSIGN_OR_RETURN(auto items, pop_mark());
        PickleValue* s = doc_.make(PickleKind::kFrozenSet);
        s->items = std::move(items);
        push(s);
        return OkStatus();
      }
      case 'a': {
        TRESTLE_ASSIGN_OR_RETURN(PickleValue * item, pop());
        TRESTLE_ASSIGN_OR_RETURN(PickleValue * target, top());
        return append(target, {item});
      }
      case 'e':
      case 0x90: {  // APPENDS, ADDITEMS
        TRESTLE_ASSIGN_OR_RETURN(auto items, pop_mark());
        TRESTLE_ASSIGN_OR_RETURN(PickleValue * target, top());
        return append(target, items);
      }
      case 's': {
        TRESTLE_ASSIGN_OR_RETURN(PickleValue * value, pop());
        TRESTLE_ASSIGN_OR_RETURN(PickleValue * key, pop());
        TRESTLE_ASSIGN_OR_RETURN(PickleValue * target, top());
        return set_items(target, {key, value});
      }
      case 'u': {
        TRESTLE_ASSIGN_OR_RETURN(auto kv, pop_mark());
        TRESTLE_ASSIGN_OR_RETURN(PickleValue * target, top());
        return set_items(target, kv);
      }
      case 'p': {
        TRESTLE_ASSIGN_OR_RETURN(std::string_view text, line());
        TRESTLE_ASSIGN_OR_RETURN(PickleValue * index, text_int(text));
        if (index->integer < 0) return fail("negative memo index");
        return memo_put(static_cast<std::uint64_t>(index->integer));
      }
      case 'q': {
        TRESTLE_ASSIGN_OR_RETURN(std::uint64_t index, le(1));
        return memo_put(index);
      }
      case 'r': {
        TRESTLE_ASSIGN_OR_RETURN(std::uint64_t index, le(4));
        return memo_put(index);
      }
      case 0x94:
        return memo_put(memo_.size());  // MEMOIZE
      case 'g': {
        TRESTLE_ASSIGN_OR_RETURN(std::string_view text, line());
        TRESTLE_ASSIGN_OR_RETURN(PickleValue * index, text_int(text));
        return memo_get(static_cast<std::uint64_t>(index->integer));
      }
      case 'h': {
        TRESTLE_ASSIGN_OR_RETURN(std::uint64_t index, le(1));
        return memo_get(index);
      }
      case 'j': {
        TRESTLE_ASSIGN_OR_RETURN(std::uint64_t index, le(4));
        return memo_get(index);
      }
      case 'c': {  // GLOBAL "module\nname\n"
        TRESTLE_ASSIGN_OR_RETURN(std::string_view module, line());
        TRESTLE_ASSIGN_OR_RETURN(std::string_view name, line());
        push(doc_.global(std::string(module), std::string(name)));
        return OkStatus();
      }
      case 0x93: {  // STACK_GLOBAL
        TRESTLE_ASSIGN_OR_RETURN(PickleValue * name, pop());
        TRESTLE_ASSIGN_OR_RETURN(PickleValue * module, pop());
        if (name->kind != PickleKind::kString || module->kind != PickleKind::kString)
          return fail("STACK_GLOBAL needs two str values");
        push(doc_.global(module->text, name->text));
        return OkStatus();
      }
      case 'R':
      case 0x81: {  // REDUCE, NEWOBJ
        TRESTLE_ASSIGN_OR_RETURN(PickleValue * args, pop());
        TRESTLE_ASSIGN_OR_RETURN(PickleValue * cls, pop());
        if (args->kind != PickleKind::kTuple)
          return fail(std::string(op == 'R' ? "REDUCE" : "NEWOBJ") + " arguments are a " +
                      std::string(kind_name(args->kind)) + ", not a tuple");
        push(make_object(cls, args, op == 'R' ? PickleCall::kReduce : PickleCall::kNewObj));
        return OkStatus();
      }
      case 0x92: {  // NEWOBJ_EX
        TRESTLE_ASSIGN_OR_RETURN(PickleValue * kwargs, pop());
        TRESTLE_ASSIGN_OR_RETURN(PickleValue * args, pop());
        TRESTLE_ASSIGN_OR_RETURN(PickleValue * cls, pop());
        if (args->kind != PickleKind::kTuple || kwargs->kind != PickleKind::kDict)
          return fail("NEWOBJ_EX needs a tuple and a dict");
        PickleValue* obj = doc_.object(cls, args, nullptr, PickleCall::kNewObjEx);
        obj->kwargs = kwargs;
        push(obj);
        return OkStatus();
      }
      case 'b': {  // BUILD
        TRESTLE_ASSIGN_OR_RETURN(PickleValue * state, pop());
        TRESTLE_ASSIGN_OR_RETURN(PickleValue * target, top());
        if (target->kind != PickleKind::kObject && target->kind != PickleKind::kDict)
          return fail("BUILD on a " + std::string(kind_name(target->kind)));
        target->state = state;
        return OkStatus();
      }
      case 'Q': {  // BINPERSID
        TRESTLE_ASSIGN_OR_RETURN(PickleValue * pid, pop());
        push(doc_.persistent_id(pid));
        return OkStatus();
      }
      case 'P': {  // PERSID
        TRESTLE_ASSIGN_OR_RETURN(std::string_view text, line());
        push(doc_.persistent_id(doc_.string(std::string(text))));
        return OkStatus();
      }
      case 0x98:
        return top().status();  // READONLY_BUFFER: no effect on our model
      case 0x97:
        return fail("out-of-band buffers (NEXT_BUFFER) are not supported");
      case 0x82:
      case 0x83:
      case 0x84:
        return fail("extension-registry codes (EXT1/2/4) are not supported");
      default: {
        char buf[48];
        std::snprintf(buf, sizeof buf, "unknown or unsupported opcode 0x%02x", op);
        return fail(buf);
      }
    }
  }

  std::string_view data_;
  PickleLimits limits_;
  std::size_t pos_ = 0;
  std::size_t op_pos_ = 0;
  PickleDocument doc_;
  std::vector<PickleValue*> stack_;
  std::vector<std::size_t> marks_;
  std::unordered_map<std::uint64_t, PickleValue*> memo_;
};

}  // namespace

std::size_t default_max_pickle_values() {
  const auto memory = static_cast<double>(physical_memory_bytes());
  // A value costs its PickleValue, the deque's bookkeeping and a slot in a container that holds it: about twice its
  // size, as measured (400 bytes a value in `trestle inspect` of a list of small integers).
  const double per_value = 2.0 * static_cast<double>(sizeof(PickleValue));
  return memory > 0 ? static_cast<std::size_t>(memory / 4 / per_value) : std::size_t{1} << 26;
}

Result<PickleDocument> parse_pickle(std::string_view data, const PickleLimits& limits) {
  try {
    return Parser(data, limits).run();
  } catch (const std::bad_alloc&) {
    return Status::Error("pickle: out of memory while parsing " + std::to_string(data.size()) + " bytes");
  }
}

}  // namespace trestle
