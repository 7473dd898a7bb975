// Everything public in meshla.
#pragma once

#include "meshla/collective_matmul.hpp"
#include "meshla/communicator.hpp"
#include "meshla/dense_solver.hpp"
#include "meshla/error.hpp"
#include "meshla/float8.hpp"
#include "meshla/grouped_matmul.hpp"
#include "meshla/matmul.hpp"
#include "meshla/process_solver.hpp"
#include "meshla/tensor.hpp"
