// libFuzzer target: Megatron's args (the argparse.Namespace in common.pt or a legacy mp_rank file's pickle) through
// parse_pickle and bridged_model_from_args, which derives the model from them.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "convert/bridge/megatron_args.h"
#include "convert/formats/torch/pickle_reader.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  auto pickle = trestle::parse_pickle(std::string_view(reinterpret_cast<const char*>(data), size));
  if (!pickle.ok() || pickle->root() == nullptr) return 0;
  const trestle::PickleValue* args = pickle->root()->get("args");
  if (args == nullptr) args = pickle->root();
  if (args->is(trestle::PickleKind::kObject)) (void)trestle::bridged_model_from_args(args, "common.pt");
  return 0;
}
