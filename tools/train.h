// trestle train's entry point, in the trestle-train program (see sibling_programs.cc): argv[0] is "train".
#pragma once

namespace trestle::cli {

int train_main(int argc, char** argv);

}  // namespace trestle::cli
