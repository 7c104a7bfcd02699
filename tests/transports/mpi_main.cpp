// main() of the MPI test programs: MPI_Init, GoogleTest with failures gathered
// from every rank, MPI_Finalize (see cpdispatch/testing/mpi_gtest.hpp).
#include <cpdispatch/testing/mpi_gtest.hpp>

int main(int argc, char** argv) { return cpdispatch::testing::mpi_gtest_main(argc, argv); }
