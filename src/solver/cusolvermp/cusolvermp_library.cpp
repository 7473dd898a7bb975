#include "solver/cusolvermp/cusolvermp_library.hpp"

#include "core/shared_library.hpp"

namespace meshla::solver {
namespace {

struct Loaded {
  CusolverMpLibrary library{};
  std::string why;  // empty when the library is usable
};

template <typename Function>
void resolve(void* library, const char* name, Function* out, std::string* why) {
  detail::resolve_symbol(library, "cuSOLVERMp library", name, out, why);
}

Loaded load() {
  Loaded loaded;
  // Never closed: handles and grids may outlive any one solver until the process ends.
  void* handle = detail::open_library("MESHLA_CUSOLVERMP_LIBRARY", "libcusolverMp.so.0",
                                      "pip install nvidia-cusolvermp-cu13==0.8.*", &loaded.why);
  if (handle == nullptr) return loaded;
  CusolverMpLibrary& l = loaded.library;
  std::string& why = loaded.why;
  resolve(handle, "cusolverMpCreate", &l.create, &why);
  resolve(handle, "cusolverMpDestroy", &l.destroy, &why);
  resolve(handle, "cusolverMpGetVersion", &l.get_version, &why);
  resolve(handle, "cusolverMpCreateDeviceGrid", &l.create_grid, &why);
  resolve(handle, "cusolverMpDestroyGrid", &l.destroy_grid, &why);
  resolve(handle, "cusolverMpCreateMatrixDesc", &l.create_matrix, &why);
  resolve(handle, "cusolverMpDestroyMatrixDesc", &l.destroy_matrix, &why);
  resolve(handle, "cusolverMpPotrf_bufferSize", &l.potrf_buffer_size, &why);
  resolve(handle, "cusolverMpPotrf", &l.potrf, &why);
  resolve(handle, "cusolverMpPotrs_bufferSize", &l.potrs_buffer_size, &why);
  resolve(handle, "cusolverMpPotrs", &l.potrs, &why);
  resolve(handle, "cusolverMpGetrf_bufferSize", &l.getrf_buffer_size, &why);
  resolve(handle, "cusolverMpGetrf", &l.getrf, &why);
  resolve(handle, "cusolverMpGetrs_bufferSize", &l.getrs_buffer_size, &why);
  resolve(handle, "cusolverMpGetrs", &l.getrs, &why);
  return loaded;
}

}  // namespace

const CusolverMpLibrary* cusolvermp_library(std::string* why) {
  static const Loaded loaded = load();
  if (!loaded.why.empty()) {
    if (why != nullptr) *why = loaded.why;
    return nullptr;
  }
  return &loaded.library;
}

}  // namespace meshla::solver
