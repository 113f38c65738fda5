// libFuzzer target: a tokenizer.json as Trestle's byte-level BPE reads it (ByteLevelBpeTokenizer::parse: the JSON,
// the pre-tokenizer, the model's vocabulary and merges, the added tokens, the post-processor), then a batch encoded
// with it when it takes the file (added-token splitting, GPT-2's pre-tokenizer, the merges). No Python: the
// comparison with the `tokenizers` package on the same files is fuzz_hf_tokenizer's.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "train/data/byte_level_bpe.h"

namespace {

const std::vector<std::string_view> kTexts = {"In the beginning God created the heaven and the earth.",
                                              "",
                                              "caf\xc3\xa9 \xe2\x80\x94 <|endoftext|>",
                                              "  don't  3\xc2\xb2 \xe4\xb8\xad\xf0\x9f\x98\x80!!\n\n\t<s>x",
                                              "<|endof <|endoftext|><|endoftext|> \xc2\xa0\xc2\x85 Lordship",
                                              "not UTF-8: \xff"};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::string declined;
  auto tokenizer = trestle::data::ByteLevelBpeTokenizer::parse(
      std::string_view(reinterpret_cast<const char*>(data), size), "tokenizer.json", /*workers=*/1, declined);
  if (!tokenizer) return 0;
  (void)tokenizer->encode_batch({kTexts.begin(), kTexts.end() - 1});
  (void)tokenizer->encode_batch(kTexts);  // refused: the last is not UTF-8
  (void)tokenizer->token_to_id("<|endoftext|>");
  return 0;
}
