// The benchmarks of trestle-bench (`trestle bench <name>`): each takes the arguments after its name and returns the
// exit code.
#pragma once

namespace trestle::cli {

int bench_convert_main(int argc, char** argv);
int bench_kernels_main(int argc, char** argv);
int bench_load_main(int argc, char** argv);
int bench_preprocess_main(int argc, char** argv);
int bench_reshard_main(int argc, char** argv);
int bench_safetensors_main(int argc, char** argv);
int bench_save_main(int argc, char** argv);
int bench_train_main(int argc, char** argv);

}  // namespace trestle::cli
