// The `tokenizers` package (Hugging Face's Rust tokenizers) driven through the CPython C API: no C++ build of it
// ships in Debian or PyPI that reads every tokenizer.json, and this is the very code the Python tools run, so ids
// match by construction. encode_batch_fast releases the GIL and spreads the batch over its Rayon threads.
#include <Python.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>

#include "train/data/tokenizer.h"
#include "train/data/tokenizer_eod.h"

#ifndef TRESTLE_PYTHON_SITE
#error "TRESTLE_PYTHON_SITE (the venv's site-packages) must be defined by the build"
#endif

namespace trestle::data {
namespace {

namespace fs = std::filesystem;

// Python's pending exception as text (and cleared).
std::string python_error() {
  PyObject *type = nullptr, *value = nullptr, *trace = nullptr;
  PyErr_Fetch(&type, &value, &trace);
  std::string message = "unknown Python error";
  if (value) {
    if (PyObject* text = PyObject_Str(value)) {
      if (const char* utf8 = PyUnicode_AsUTF8(text)) message = utf8;
      Py_DECREF(text);
    }
  }
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(trace);
  PyErr_Clear();
  return message;
}

// Starts the interpreter once, with the venv's packages importable; the GIL is released afterwards.
Status start_python(int workers) {
  static std::once_flag once;
  static Status status;
  std::call_once(once, [workers] {
    // Rayon reads its pool size once, when tokenizers first runs in parallel.
    ::setenv("RAYON_NUM_THREADS", std::to_string(workers < 1 ? 1 : workers).c_str(), 1);
    ::setenv("TOKENIZERS_PARALLELISM", "true", 1);
    Py_InitializeEx(0);
    PyObject* site = PyImport_ImportModule("site");
    PyObject* added = site ? PyObject_CallMethod(site, "addsitedir", "s", TRESTLE_PYTHON_SITE) : nullptr;
    if (!added)
      status = Status::Error(std::string("embedded Python: cannot add ") + TRESTLE_PYTHON_SITE + ": " + python_error());
    Py_XDECREF(added);
    Py_XDECREF(site);
    PyEval_SaveThread();
  });
  return status;
}

class Gil {
 public:
  Gil() : state_(PyGILState_Ensure()) {}
  ~Gil() { PyGILState_Release(state_); }
  Gil(const Gil&) = delete;
  Gil& operator=(const Gil&) = delete;

 private:
  PyGILState_STATE state_;
};

class HfTokenizer : public Tokenizer {
 public:
  HfTokenizer(PyObject* tokenizer, std::string path) : tokenizer_(tokenizer), path_(std::move(path)) {}
  ~HfTokenizer() override {
    Gil gil;
    Py_XDECREF(tokenizer_);
  }

  Status init(const std::string& eod_token, const fs::path& dir) {
    Gil gil;
    PyObject* size = PyObject_CallMethod(tokenizer_, "get_vocab_size", "O", Py_True);
    if (!size) return Status::Error(path_ + ": get_vocab_size: " + python_error());
    vocab_size_ = PyLong_AsLongLong(size);
    Py_DECREF(size);
    // --eod-token, else the eos_token the directory configures as transformers reads it (Megatron's preprocess_data.py
    // appends AutoTokenizer's eos_token_id), else a tokenizer without one: the usual end-of-text names.
    TRESTLE_ASSIGN_OR_RETURN(const auto configured, configured_eos_token(dir.string()));
    std::vector<std::string> candidates;
    if (!eod_token.empty()) candidates.push_back(eod_token);
    else if (configured) candidates.push_back(configured->token);
    else
      for (const char* name : {"<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>"}) candidates.emplace_back(name);
    for (const auto& name : candidates) {
      PyObject* id = PyObject_CallMethod(tokenizer_, "token_to_id", "s", name.c_str());
      if (!id) return Status::Error(path_ + ": token_to_id: " + python_error());
      if (id != Py_None) eod_ = PyLong_AsLongLong(id);
      Py_DECREF(id);
      if (eod_) break;
      if (!eod_token.empty())
        return Status::Error(path_ + ": the tokenizer has no token '" + eod_token + "' (--eod-token)");
      if (configured)  // transformers would add it as a new id, past the model's vocabulary
        return Status::Error(path_ + ": the eos_token '" + name + "' " + configured->file +
                             " names is not in the tokenizer's vocabulary (give --eod-token)");
    }
    return OkStatus();
  }

  Result<std::vector<std::vector<std::int64_t>>> encode_batch(const std::vector<std::string_view>& texts) override {
    Gil gil;
    PyObject* list = PyList_New(static_cast<Py_ssize_t>(texts.size()));
    if (!list) return Status::Error(path_ + ": " + python_error());
    for (std::size_t i = 0; i < texts.size(); ++i) {
      PyObject* text = PyUnicode_DecodeUTF8(texts[i].data(), static_cast<Py_ssize_t>(texts[i].size()), "strict");
      if (!text) {
        Py_DECREF(list);
        return Status::Error("text " + std::to_string(i) + " of the batch is not valid UTF-8: " + python_error());
      }
      PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), text);
    }
    PyObject* encodings = PyObject_CallMethod(tokenizer_, "encode_batch_fast", "O", list);
    Py_DECREF(list);
    if (!encodings) return Status::Error(path_ + ": encode_batch_fast: " + python_error());
    std::vector<std::vector<std::int64_t>> out(texts.size());
    Status status;
    for (std::size_t i = 0; i < texts.size() && status.ok(); ++i) {
      PyObject* ids = PyObject_GetAttrString(PyList_GET_ITEM(encodings, static_cast<Py_ssize_t>(i)), "ids");
      if (!ids || !PyList_Check(ids)) {
        status = Status::Error(path_ + ": encoding without ids: " + python_error());
        Py_XDECREF(ids);
        break;
      }
      const Py_ssize_t n = PyList_GET_SIZE(ids);
      out[i].resize(static_cast<std::size_t>(n));
      for (Py_ssize_t k = 0; k < n; ++k)
        out[i][static_cast<std::size_t>(k)] = PyLong_AsLongLong(PyList_GET_ITEM(ids, k));
      Py_DECREF(ids);
    }
    Py_DECREF(encodings);
    if (!status.ok()) return status;
    return out;
  }

  std::int64_t vocab_size() const override { return vocab_size_; }
  std::optional<std::int64_t> eod() const override { return eod_; }
  std::string name() const override { return path_; }

 private:
  PyObject* tokenizer_;
  std::string path_;
  std::int64_t vocab_size_ = 0;
  std::optional<std::int64_t> eod_;
};

}  // namespace

Result<std::unique_ptr<Tokenizer>> load_hf_tokenizer(const std::string& path, int workers,
                                                     const std::string& eod_token) {
  fs::path file = path;
  if (fs::is_directory(file)) file /= "tokenizer.json";
  if (!fs::is_regular_file(file)) return Status::Error(file.string() + ": no tokenizer.json there");
  TRESTLE_RETURN_IF_ERROR(start_python(workers));
  PyObject* tokenizer = nullptr;
  {
    Gil gil;
    PyObject* module = PyImport_ImportModule("tokenizers");
    if (!module) return Status::Error("cannot import the tokenizers package (run scripts/setup): " + python_error());
    PyObject* cls = PyObject_GetAttrString(module, "Tokenizer");
    Py_DECREF(module);
    tokenizer = cls ? PyObject_CallMethod(cls, "from_file", "s", file.c_str()) : nullptr;
    Py_XDECREF(cls);
    if (!tokenizer) return Status::Error(file.string() + ": " + python_error());
  }
  auto out = std::make_unique<HfTokenizer>(tokenizer, file.string());
  TRESTLE_RETURN_IF_ERROR(out->init(eod_token, file.parent_path()));
  return std::unique_ptr<Tokenizer>(std::move(out));
}

}  // namespace trestle::data
