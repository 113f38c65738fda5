// libFuzzer target: the tokenizer files `trestle preprocess` reads. An input is tokenizer.json up to its first NUL
// byte and tokenizer_config.json after it (none without a NUL); load_hf_tokenizer takes a path, so both are written
// to a scratch directory first. Each input goes through
//  - the `tokenizers` package's engine (its parser in the venv's embedded Python, then the vocabulary size,
//    tokenizer_config.json's eos_token by Trestle's JSON reading and the EOD token Trestle asks for);
//  - Trestle's byte-level BPE reader (byte_level_bpe.h) on its own, whatever the package made of the file;
// and a batch is encoded with each that loads. Where both load, their vocabulary sizes and ids must be equal: a
// difference aborts, as a crash would. The Rust parser is not instrumented: coverage guides through Trestle's side.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "train/data/byte_level_bpe.h"
#include "train/data/tokenizer.h"

namespace {

std::string scratch_dir;  // holds tokenizer.json and tokenizer_config.json; made at start, removed at exit

void write_file(const std::string& name, std::string_view bytes) {
  std::ofstream out(scratch_dir + "/" + name, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) std::abort();  // the scratch directory failed, not the input
}

const std::vector<std::string_view> kTexts = {"In the beginning God created the heaven and the earth.", "",
                                              "caf\xc3\xa9 \xe2\x80\x94 <|endoftext|>",
                                              "  don't  3\xc2\xb2 \xe4\xb8\xad\xf0\x9f\x98\x80!!\n\n\t<s>x",
                                              "<|endof <|endoftext|><|endoftext|> \xc2\xa0\xc2\x85 Lordship"};

[[noreturn]] void differ(const char* what) {
  std::fprintf(stderr, "hf_tokenizer_fuzz: Trestle's byte-level BPE and the tokenizers package differ: %s\n", what);
  std::abort();
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

  auto package =
      trestle::data::load_hf_tokenizer(scratch_dir, /*workers=*/1, "", trestle::data::TokenizerEngine::kPackage);
  std::string declined;
  auto native = trestle::data::ByteLevelBpeTokenizer::load(scratch_dir + "/tokenizer.json", /*workers=*/1, declined);
  if (!package.ok()) {
    if (native) (void)native->encode_batch(kTexts);
    return 0;
  }
  auto theirs = (*package)->encode_batch(kTexts);
  if (!native) return 0;
  auto ours = native->encode_batch(kTexts);
  if (native->vocab_size() != (*package)->vocab_size()) differ("vocabulary size");
  if (ours.ok() != theirs.ok()) differ("one encoded the batch, the other did not");
  if (ours.ok() && *ours != *theirs) differ("ids");
  return 0;
}
