// The ATen operator headers namm_core uses, gathered in one place so that they can be precompiled.
// (The full <ATen/ATen.h> costs ~10 s per translation unit; these cost ~4 s, and ~0 s precompiled.)
// The precompiled header is shared by every torch-using target (the worker's, tests, benchmarks), so it also
// holds the worker's operators (worker/engine/src/aten.h): one precompilation instead of two in a cold build.
#pragma once

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/full.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mv.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/rsqrt.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
