#include "convert/formats/torch/pickle_writer.h"

#include <bit>
#include <deque>
#include <unordered_map>

namespace trestle {
namespace {

constexpr std::size_t kFrameSizeTarget = 64 * 1024;  // pickle._Framer._FRAME_SIZE_TARGET
constexpr std::size_t kFrameSizeMin = 4;
constexpr std::size_t kBatchSize = 1000;  // pickle._BATCHSIZE

class Writer {
 public:
  explicit Writer(int protocol) : protocol_(protocol) {}

  Result<std::string> run(const PickleValue* root) {
    out_ += '\x80';
    out_ += static_cast<char>(protocol_);
    TRESTLE_RETURN_IF_ERROR(save(root, 0));
    put('.');
    commit_frame(true);
    return std::move(out_);
  }

 private:
  bool framing() const { return protocol_ >= 4; }
  std::string& sink() { return framing() ? frame_ : out_; }
  void put(char c) { sink() += c; }
  void put(std::string_view s) { sink() += s; }
  void put_le(std::uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) sink() += static_cast<char>((v >> (8 * i)) & 0xff);
  }

  void commit_frame(bool force) {
    if (!framing() || frame_.empty() || (!force && frame_.size() < kFrameSizeTarget)) return;
    if (frame_.size() >= kFrameSizeMin) {
      out_ += '\x95';
      for (int i = 0; i < 8; ++i) out_ += static_cast<char>((frame_.size() >> (8 * i)) & 0xff);
    }
    out_ += frame_;
    frame_.clear();
  }

  // Large str/bytes payloads go outside frames, as pickle._Framer.write_large_bytes does.
  void put_payload(std::string_view header, std::string_view payload) {
    if (framing() && payload.size() >= kFrameSizeTarget) {
      commit_frame(true);
      out_ += header;
      out_ += payload;
      return;
    }
    put(header);
    put(payload);
  }

  void memoize(const void* key) {
    const std::size_t index = next_memo_++;
    memo_[key] = index;
    if (protocol_ >= 4) {
      put('\x94');
    } else if (index < 256) {
      put('q');
      put_le(index, 1);
    } else {
      put('r');
      put_le(index, 4);
    }
  }

  bool fetch(const void* key) {
    auto it = memo_.find(key);
    if (it == memo_.end()) return false;
    if (it->second < 256) {
      put('h');
      put_le(it->second, 1);
    } else {
      put('j');
      put_le(it->second, 4);
    }
    return true;
  }

  void save_int(std::int64_t v) {
    if (v >= 0 && v <= 0xff) {
      put('K');
      put_le(static_cast<std::uint64_t>(v), 1);
    } else if (v >= 0 && v <= 0xffff) {
      put('M');
      put_le(static_cast<std::uint64_t>(v), 2);
    } else if (v >= INT32_MIN && v <= INT32_MAX) {
      put('J');
      put_le(static_cast<std::uint32_t>(static_cast<std::int32_t>(v)), 4);
    } else {
      // pickle.encode_long: the shortest little-endian two's complement.
      std::string bytes;
      const auto u = static_cast<std::uint64_t>(v);
      for (int i = 0; i < 8; ++i) bytes += static_cast<char>((u >> (8 * i)) & 0xff);
      while (bytes.size() > 1) {
        const auto last = static_cast<unsigned char>(bytes.back());
        const auto prev = static_cast<unsigned char>(bytes[bytes.size() - 2]);
        if ((last == 0 && !(prev & 0x80)) || (last == 0xff && (prev & 0x80))) bytes.pop_back();
        else break;
      }
      put('\x8a');
      put_le(bytes.size(), 1);
      put(bytes);
    }
  }

  void save_str(const PickleValue* v) {
    const std::string& s = v->text;
    std::string header;
    auto le = [&](std::uint64_t n, int bytes) {
      for (int i = 0; i < bytes; ++i) header += static_cast<char>((n >> (8 * i)) & 0xff);
    };
    if (protocol_ >= 4 && s.size() < 256) {
      header += '\x8c';
      le(s.size(), 1);
    } else if (protocol_ >= 4 && s.size() > 0xffffffffull) {
      header += '\x8d';
      le(s.size(), 8);
    } else {
      header += 'X';
      le(s.size(), 4);
    }
    put_payload(header, s);
    memoize(v);
  }

  Status save_bytes(const PickleValue* v, int depth) {
    const std::string& b = v->text;
    if (protocol_ < 3) {  // pickle.save_bytes for protocol 2: a call that rebuilds the bytes
      PickleDocument& scratch = scratch_.emplace_back();  // lives as long as the memo that holds its addresses
      PickleValue* call = nullptr;
      if (b.empty()) {
        call = scratch.object(scratch.global("__builtin__", "bytes"), scratch.tuple({}));
      } else {
        std::string latin1;  // each byte as the code point of the same value, in UTF-8
        for (unsigned char c : b) {
          if (c < 0x80) {
            latin1 += static_cast<char>(c);
          } else {
            latin1 += static_cast<char>(0xc0 | (c >> 6));
            latin1 += static_cast<char>(0x80 | (c & 0x3f));
          }
        }
        call = scratch.object(scratch.global("_codecs", "encode"),
                              scratch.tuple({scratch.string(std::move(latin1)), scratch.string("latin1")}));
      }
      TRESTLE_RETURN_IF_ERROR(save_call(call, depth));
      memo_[v] = next_memo_ - 1;  // the bytes object is the reduced value just memoized
      return OkStatus();
    }
    std::string header;
    auto le = [&](std::uint64_t n, int bytes) {
      for (int i = 0; i < bytes; ++i) header += static_cast<char>((n >> (8 * i)) & 0xff);
    };
    if (b.size() < 256) {
      header += 'C';
      le(b.size(), 1);
    } else if (b.size() > 0xffffffffull && protocol_ >= 4) {
      header += '\x8e';
      le(b.size(), 8);
    } else {
      header += 'B';
      le(b.size(), 4);
    }
    put_payload(header, b);
    memoize(v);
    return OkStatus();
  }

  void save_global(const std::string& module, const std::string& name) {
    const std::string key = module + "\n" + name;
    auto it = globals_.find(key);
    if (it != globals_.end()) {
      fetch(&it->second);
      return;
    }
    const int& slot = globals_[key];
    if (protocol_ >= 4) {
      save_interned(module);
      save_interned(name);
      put('\x93');
    } else {
      put('c');
      put(module);
      put('\n');
      put(name);
      put('\n');
    }
    memoize(&slot);
  }

  // Module and class names are shared str objects in Python, so the second use is a memo fetch.
  void save_interned(const std::string& s) {
    auto it = interned_.find(s);
    if (it != interned_.end()) {
      fetch(&it->second);
      return;
    }
    const int& slot = interned_[s];
    if (s.size() < 256) {
      put('\x8c');
      put_le(s.size(), 1);
    } else {
      put('X');
      put_le(s.size(), 4);
    }
    put(s);
    memoize(&slot);
  }

  Status save_items(const std::vector<PickleValue*>& items, char one, char many, int depth) {
    for (std::size_t start = 0; start < items.size(); start += kBatchSize) {
      const std::size_t n = std::min(kBatchSize, items.size() - start);
      if (n > 1) put('(');
      for (std::size_t i = start; i < start + n; ++i) TRESTLE_RETURN_IF_ERROR(save(items[i], depth + 1));
      put(n > 1 ? many : one);
    }
    return OkStatus();
  }

  Status save_entries(const std::vector<std::pair<PickleValue*, PickleValue*>>& entries, int depth) {
    for (std::size_t start = 0; start < entries.size(); start += kBatchSize) {
      const std::size_t n = std::min(kBatchSize, entries.size() - start);
      if (n > 1) put('(');
      for (std::size_t i = start; i < start + n; ++i) {
        TRESTLE_RETURN_IF_ERROR(save(entries[i].first, depth + 1));
        TRESTLE_RETURN_IF_ERROR(save(entries[i].second, depth + 1));
      }
      put(n > 1 ? 'u' : 's');
    }
    return OkStatus();
  }

  Status save_tuple(const PickleValue* v, int depth) {
    const auto& items = v->items;
    if (items.empty()) {
      put(')');
      return OkStatus();
    }
    if (items.size() > 3 || protocol_ < 2) put('(');
    for (const PickleValue* item : items) TRESTLE_RETURN_IF_ERROR(save(item, depth + 1));
    if (items.size() <= 3 && protocol_ >= 2) put(static_cast<char>(0x84 + items.size()));
    else put('t');
    memoize(v);
    return OkStatus();
  }

  // cls(*args) via REDUCE / NEWOBJ, then appended items, set items and the BUILD state (pickle.save_reduce).
  Status save_call(const PickleValue* v, int depth) {
    if (!v->cls || !v->args) return Status::Error("pickle writer: an object without a class or arguments");
    TRESTLE_RETURN_IF_ERROR(save(v->cls, depth + 1));
    TRESTLE_RETURN_IF_ERROR(save(v->args, depth + 1));
    if (v->call == PickleCall::kNewObjEx) {
      if (!v->kwargs) return Status::Error("pickle writer: NEWOBJ_EX without keyword arguments");
      TRESTLE_RETURN_IF_ERROR(save(v->kwargs, depth + 1));
      put('\x92');
    } else {
      put(v->call == PickleCall::kNewObj ? '\x81' : 'R');
    }
    memoize(v);
    return save_tail(v, depth);
  }

  Status save_tail(const PickleValue* v, int depth) {
    TRESTLE_RETURN_IF_ERROR(
        save_items(v->kind == PickleKind::kObject ? v->items : std::vector<PickleValue*>{}, 'a', 'e', depth));
    TRESTLE_RETURN_IF_ERROR(save_entries(v->entries, depth));
    if (v->state) {
      TRESTLE_RETURN_IF_ERROR(save(v->state, depth + 1));
      put('b');
    }
    return OkStatus();
  }

  Status save(const PickleValue* v, int depth) {
    if (!v) return Status::Error("pickle writer: null value");
    if (depth > kPickleMaxDepth)
      return Status::Error("pickle writer: values nested deeper than " + std::to_string(kPickleMaxDepth));
    commit_frame(false);
    switch (v->kind) {
      case PickleKind::kNone:
        put('N');
        return OkStatus();
      case PickleKind::kBool:
        put(v->boolean ? '\x88' : '\x89');
        return OkStatus();
      case PickleKind::kInt:
        save_int(v->integer);
        return OkStatus();
      case PickleKind::kBigInt:
        put(v->text.size() < 256 ? '\x8a' : '\x8b');
        put_le(v->text.size(), v->text.size() < 256 ? 1 : 4);
        put(v->text);
        return OkStatus();
      case PickleKind::kFloat: {
        put('G');
        const auto bits = std::bit_cast<std::uint64_t>(v->real);
        for (int i = 7; i >= 0; --i) put(static_cast<char>((bits >> (8 * i)) & 0xff));
        return OkStatus();
      }
      case PickleKind::kGlobal:
        save_global(v->text, v->name);
        return OkStatus();
      case PickleKind::kPersistentId:
        if (!v->pid) return Status::Error("pickle writer: persistent id without a value");
        TRESTLE_RETURN_IF_ERROR(save(v->pid, depth + 1));
        put('Q');
        return OkStatus();
      default:
        break;
    }
    if (fetch(v)) return OkStatus();
    switch (v->kind) {
      case PickleKind::kString:
        save_str(v);
        return OkStatus();
      case PickleKind::kBytes:
        return save_bytes(v, depth);
      case PickleKind::kTuple:
        return save_tuple(v, depth);
      case PickleKind::kList:
        put(']');
        memoize(v);
        return save_items(v->items, 'a', 'e', depth);
      case PickleKind::kDict:
        if (!v->text.empty()) {  // a dict subclass (OrderedDict): cls(), then its items and state
          save_global(v->text, v->name);
          put(')');
          put('R');
          memoize(v);
        } else {
          put('}');
          memoize(v);
        }
        return save_tail(v, depth);
      case PickleKind::kSet:
      case PickleKind::kFrozenSet:
        if (protocol_ < 4) return Status::Error("pickle writer: sets need protocol 4 here");
        if (v->kind == PickleKind::kFrozenSet) {
          put('(');
          for (const PickleValue* item : v->items) TRESTLE_RETURN_IF_ERROR(save(item, depth + 1));
          put('\x91');
          memoize(v);
          return OkStatus();
        }
        put('\x8f');
        memoize(v);
        for (std::size_t start = 0; start < v->items.size(); start += kBatchSize) {  // ADDITEMS always has a MARK
          put('(');
          for (std::size_t i = start; i < std::min(v->items.size(), start + kBatchSize); ++i)
            TRESTLE_RETURN_IF_ERROR(save(v->items[i], depth + 1));
          put('\x90');
        }
        return OkStatus();
      case PickleKind::kObject:
        return save_call(v, depth);
      default:
        return Status::Error("pickle writer: unexpected value kind");
    }
  }

  int protocol_;
  std::string out_;
  std::string frame_;
  std::unordered_map<const void*, std::size_t> memo_;
  std::size_t next_memo_ = 0;
  std::deque<PickleDocument> scratch_;
  std::unordered_map<std::string, int> globals_;  // slots whose addresses key the memo
  std::unordered_map<std::string, int> interned_;
};

}  // namespace

Result<std::string> write_pickle(const PickleValue* root, int protocol) {
  if (protocol < 2 || protocol > 5)
    return Status::Error("pickle writer: protocol " + std::to_string(protocol) + " is not supported (2 to 5)");
  return Writer(protocol).run(root);
}

}  // namespace trestle
