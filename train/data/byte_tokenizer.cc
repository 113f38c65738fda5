#include <algorithm>
#include <thread>

#include "train/data/tokenizer.h"

namespace trestle::data {
namespace {

class ByteTokenizer : public Tokenizer {
 public:
  explicit ByteTokenizer(int workers) : workers_(workers < 1 ? 1 : workers) {}

  Result<std::vector<std::vector<std::int64_t>>> encode_batch(const std::vector<std::string_view>& texts) override {
    std::vector<std::vector<std::int64_t>> out(texts.size());
    auto run = [&](std::size_t begin, std::size_t end) {
      for (std::size_t i = begin; i < end; ++i)
        out[i].assign(reinterpret_cast<const unsigned char*>(texts[i].data()),
                      reinterpret_cast<const unsigned char*>(texts[i].data()) + texts[i].size());
    };
    const auto workers = static_cast<std::size_t>(workers_);
    std::vector<std::thread> threads;
    const std::size_t per = (texts.size() + workers - 1) / workers;
    for (std::size_t w = 1; w < workers && w * per < texts.size(); ++w)
      threads.emplace_back(run, w * per, std::min(texts.size(), (w + 1) * per));
    run(0, std::min(texts.size(), per));
    for (auto& t : threads) t.join();
    return out;
  }
  std::int64_t vocab_size() const override { return 257; }
  std::optional<std::int64_t> eod() const override { return 256; }
  std::string name() const override { return "bytes"; }

 private:
  int workers_;
};

}  // namespace

std::unique_ptr<Tokenizer> make_byte_tokenizer(int workers) { return std::make_unique<ByteTokenizer>(workers); }

}  // namespace trestle::data
