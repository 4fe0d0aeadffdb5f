// The few dense linear-algebra kernels CMA-ES needs, on row-major float64 buffers, backed by BLAS/LAPACK
// (OpenBLAS on Debian). Results are deterministic for a given BLAS build and thread count.
#pragma once

#include <cstdint>
#include <vector>

#include "namm/status.h"

namespace namm::coordinator::linalg {

// out[m x n] = alpha * op(a) * op(b) + beta * out, where op(a) is [m x k] (a stored [k x m] when transpose_a)
// and op(b) is [k x n] (b stored [n x k] when transpose_b).
void matmul(int64_t m, int64_t n, int64_t k, double alpha, const double* a, bool transpose_a, const double* b,
            bool transpose_b, double beta, double* out);

// Lower triangle (row >= column) of c[n x n] := beta * c + alpha * sum_r a_r a_r^T over the rows of a[rows x n].
void symmetric_rank_k(int64_t n, int64_t rows, double alpha, const double* a, double beta, double* c);

// Lower triangle of c[n x n] += alpha * x x^T.
void symmetric_rank_1(int64_t n, double alpha, const double* x, double* c);


// Eigendecomposition of the symmetric matrix whose lower triangle `lower` holds (n x n row-major): eigenvalues
// ascending, basis row k = the unit eigenvector of eigenvalue k. LAPACK dsyevd (divide and conquer).
Status symmetric_eigen(int64_t n, const std::vector<double>& lower, std::vector<double>* eigenvalues,
                       std::vector<double>* basis);

}  // namespace namm::coordinator::linalg
