#pragma once
// <mpi.h> with only MPI's C API: the deprecated MPI-2 C++ bindings stay out
// (they do not compile cleanly under -Wextra -Werror), as HDF5's headers do.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>
