// libFuzzer target: the tokenizer files `trestle preprocess` reads, as load_hf_tokenizer reads them (tokenizer.json by
// the `tokenizers` package's parser in the venv's embedded Python, then the vocabulary size, tokenizer_config.json's
// eos_token by Trestle's own JSON reading, and the end-of-document token Trestle asks for) and a batch encoded with
// the result. An input is tokenizer.json up to its first NUL byte and tokenizer_config.json after it (none without
// a NUL); load_hf_tokenizer takes a path, so both are written to a scratch directory first. The Rust parser is not
// instrumented: coverage guides only through Trestle's side, and the target checks that whatever the package makes of a
// file comes back as an error, not a crash or a leaked reference.
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

std::string scratch_dir;  // holds tokenizer.json and tokenizer_config.json; made at start, removed at exit

void write_file(const std::string& name, std::string_view bytes) {
  std::ofstream out(scratch_dir + "/" + name, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) std::abort();  // the scratch directory failed, not the input
}

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
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const std::size_t nul = input.find('\0');
  write_file("tokenizer.json", input.substr(0, nul));
  const std::string config = scratch_dir + "/tokenizer_config.json";
  if (nul == std::string_view::npos) std::filesystem::remove(config);
  else write_file("tokenizer_config.json", input.substr(nul + 1));
  auto tokenizer = trestle::data::load_hf_tokenizer(scratch_dir, /*workers=*/1);
  if (!tokenizer.ok()) return 0;
  const std::vector<std::string_view> texts = {"In the beginning God created the heaven and the earth.", "",
                                               "caf\xc3\xa9 \xe2\x80\x94 <|endoftext|>"};
  (void)(*tokenizer)->encode_batch(texts);
  return 0;
}
