// Python's repr() of a float, for output that has to match what the reference's Python printed (task metrics'
// str() of JSON values, chat templates' tojson and string conversions).
#pragma once

#include <string>

namespace namm {

// The shortest decimal that reads back to the same double, laid out as CPython does ("1.0", "0.0001", "1e-05",
// "1e+16", "inf", "nan").
std::string py_repr_float(double value);

}  // namespace namm
