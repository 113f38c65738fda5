// Slurm's compressed host lists (SLURM_JOB_NODELIST, SLURM_STEP_NODELIST): "gpu[03-05,9],cpu1" names gpu03, gpu04,
// gpu05, gpu9 and cpu1. A Slurm job's rank 0 runs on the list's first host, which serves the job's c10d store.
#pragma once

#include <string>
#include <string_view>

#include "ckpt/status.h"

namespace trestle::parallel {

// The first host of a Slurm host list: each bracket replaced by the first number it lists, zero padding kept
// ("gpu[03-05,9],cpu1" -> "gpu03", "rack[2-3]-n[07]" -> "rack2-n07"). The whole list is checked, so a malformed
// one fails naming the list and what is wrong with it, never yields a half-read host.
Result<std::string> first_host_of_hostlist(std::string_view hostlist);

}  // namespace trestle::parallel
