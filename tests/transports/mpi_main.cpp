// main() of the MPI test programs: MPI_Init, GoogleTest with failures gathered
// from every rank, MPI_Finalize (see tests/common/mpi_gtest.hpp).
#include "../common/mpi_gtest.hpp"

int main(int argc, char** argv) { return cpdispatch::testing::mpi_gtest_main(argc, argv); }
