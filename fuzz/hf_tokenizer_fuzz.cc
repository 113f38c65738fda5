// libFuzzer target: a tokenizer.json as `trestle preprocess` reads it: load_hf_tokenizer (the `tokenizers` package's
// parser in the venv's embedded Python, then the vocabulary size and the end-of-document token Trestle asks for) and a
// batch encoded with it. load_hf_tokenizer takes a path, so each input is written to tokenizer.json in a scratch
// directory first. The Rust parser is not instrumented: coverage guides only through Trestle's side, and the target
// checks that whatever the package makes of a file comes back as an error, not a crash or a leaked reference.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "train/data/tokenizer.h"

namespace {

std::string scratch_dir;  // holds tokenizer.json; made at start, removed at exit

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Python's own allocator keeps objects in arenas LeakSanitizer does not scan, so everything they point to would
  // look leaked; plain malloc keeps the interpreter's heap visible to it.
  ::setenv("PYTHONMALLOC", "malloc", 1);
  std::string pattern = (std::filesystem::temp_directory_path() / "trestle-fuzz-tokenizer-XXXXXX").string();
  if (::mkdtemp(pattern.data()) == nullptr) std::abort();
  scratch_dir = pattern;
  std::atexit([] {
    std::error_code ignored;
    std::filesystem::remove_all(scratch_dir, ignored);
  });
  return 0;
}

// pyo3 builds each Python class of the package on first use and keeps its type object for good, by design.
extern "C" const char* __lsan_default_suppressions() { return "leak:pyo3::pyclass::create_type_object\n"; }

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  {
    std::ofstream out(scratch_dir + "/tokenizer.json", std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
    if (!out) std::abort();  // the scratch directory failed, not the input
  }
  auto tokenizer = trestle::data::load_hf_tokenizer(scratch_dir, /*workers=*/1);
  if (!tokenizer.ok()) return 0;
  const std::vector<std::string_view> texts = {"In the beginning God created the heaven and the earth.", "",
                                               "caf\xc3\xa9 \xe2\x80\x94 <|endoftext|>"};
  (void)(*tokenizer)->encode_batch(texts);
  return 0;
}
