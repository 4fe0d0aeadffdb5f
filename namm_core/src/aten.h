// The ATen operator headers namm_core uses, gathered in one place so that they can be precompiled.
// (The full <ATen/ATen.h> costs ~10 s per translation unit; these cost ~4 s, and ~0 s precompiled.)
#pragma once

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
