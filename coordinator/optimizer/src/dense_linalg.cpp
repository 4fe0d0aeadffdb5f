#include "dense_linalg.h"

#include <string>

// Fortran BLAS/LAPACK entry points (column-major). A row-major matrix is the column-major view of its
// transpose, which is how the wrappers below map one onto the other.
extern "C" {
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc);
void dsyrk_(const char* uplo, const char* trans, const int* n, const int* k, const double* alpha, const double* a,
            const int* lda, const double* beta, double* c, const int* ldc);
void dsyr_(const char* uplo, const int* n, const double* alpha, const double* x, const int* incx, double* a,
           const int* lda);
void dsyevd_(const char* jobz, const char* uplo, const int* n, double* a, const int* lda, double* w, double* work,
             const int* lwork, int* iwork, const int* liwork, int* info);
}

namespace namm::coordinator::linalg {

namespace {
int Int(int64_t v) { return static_cast<int>(v); }
}  // namespace

void matmul(int64_t m, int64_t n, int64_t k, double alpha, const double* a, bool transpose_a, const double* b,
            bool transpose_b, double beta, double* out) {
  // Row-major out = op(a) op(b) is column-major out^T = op(b)^T op(a)^T.
  const char tb = transpose_b ? 'T' : 'N', ta = transpose_a ? 'T' : 'N';
  const int M = Int(n), N = Int(m), K = Int(k);
  const int ldb = transpose_b ? K : M, lda = transpose_a ? N : K, ldc = M;
  dgemm_(&tb, &ta, &M, &N, &K, &alpha, b, &ldb, a, &lda, &beta, out, &ldc);
}

void symmetric_rank_k(int64_t n, int64_t rows, double alpha, const double* a, double beta, double* c) {
  // The row-major lower triangle is the column-major upper one; a's buffer is the column-major a^T.
  const char uplo = 'U', trans = 'N';
  const int N = Int(n), K = Int(rows);
  dsyrk_(&uplo, &trans, &N, &K, &alpha, a, &N, &beta, c, &N);
}

void symmetric_rank_1(int64_t n, double alpha, const double* x, double* c) {
  const char uplo = 'U';
  const int N = Int(n), one = 1;
  dsyr_(&uplo, &N, &alpha, x, &one, c, &N);
}

Status symmetric_eigen(int64_t n, const std::vector<double>& lower, std::vector<double>* eigenvalues,
                       std::vector<double>* basis) {
  const char jobz = 'V', uplo = 'U';
  const int N = Int(n);
  *basis = lower;  // dsyevd overwrites its input with the eigenvectors (columns = row-major rows)
  eigenvalues->assign(static_cast<std::size_t>(n), 0.0);
  int info = 0, lwork = -1, liwork = -1, iwork_size = 0;
  double work_size = 0;
  dsyevd_(&jobz, &uplo, &N, basis->data(), &N, eigenvalues->data(), &work_size, &lwork, &iwork_size, &liwork, &info);
  if (info != 0) return Status::Internal("LAPACK dsyevd workspace query failed (info " + std::to_string(info) + ")");
  lwork = static_cast<int>(work_size);
  liwork = iwork_size;
  std::vector<double> work(static_cast<std::size_t>(lwork));
  std::vector<int> iwork(static_cast<std::size_t>(liwork));
  dsyevd_(&jobz, &uplo, &N, basis->data(), &N, eigenvalues->data(), work.data(), &lwork, iwork.data(), &liwork,
          &info);
  if (info != 0) {
    return Status::Internal("LAPACK dsyevd failed to converge on the " + std::to_string(n) + "x" + std::to_string(n) +
                            " covariance (info " + std::to_string(info) + ")");
  }
  return Status::Ok();
}

}  // namespace namm::coordinator::linalg
