// Resuming a run with an edited spec. A change is accepted when it cannot alter the run's trajectory: where
// workers find the model (its fingerprint, over weights and tokenizer, still identifies it), comments and layout,
// and extending the schedule of a running run (more generations for the last stage, or stages after it). Anything
// else (optimizer, architecture, sampling, evaluation, past stages) is refused with a diff of what changed.
#pragma once

#include <string>
#include <vector>

#include "namm/coordinator/run_spec.h"
#include "namm/status.h"

namespace namm::coordinator {

struct SpecDifference {
  std::string key;             // e.g. "cmaes.sigma0", "stages[1].generations"
  std::string stored, given;   // values as JSON text; "(none)" where one side lacks the key
};

// Every key whose value differs, in spec order.
std::vector<SpecDifference> diff_run_specs(const RunSpec& stored, const RunSpec& given);

// Whether `given` may replace `stored` for a run that is (`finished`) or is not finished. The error lists every
// refused difference, one per line.
Status check_spec_revision(const RunSpec& stored, const RunSpec& given, bool finished);

}  // namespace namm::coordinator
