// The trestle CLI's subcommands: each takes the arguments after its name and returns the process exit code.
#pragma once

namespace trestle::cli {

int bench_main(int argc, char** argv);
int convert_main(int argc, char** argv);
int diff_main(int argc, char** argv);
int export_main(int argc, char** argv);
int import_main(int argc, char** argv);
int inspect_main(int argc, char** argv);
int reshard_main(int argc, char** argv);
int train_main(int argc, char** argv);
int verify_main(int argc, char** argv);

}  // namespace trestle::cli
