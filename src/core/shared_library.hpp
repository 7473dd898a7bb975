// Functions of a library opened at run time (dlopen), for the optional ones: cuBLASMp, which may
// not be installed, and NVML, which comes with the driver rather than the toolkit.
#pragma once

#include <dlfcn.h>

#include <string>

namespace meshla::detail {

// Looks `name` up in `library`. On failure, the first missing function is recorded in `why`
// ("<library_name> lacks <name>"), so that a caller can resolve all it needs and then report.
template <typename Function>
void resolve_symbol(void* library, const char* library_name, const char* name, Function* out,
                    std::string* why) {
  *out = reinterpret_cast<Function>(dlsym(library, name));
  if (*out == nullptr && why->empty()) *why = std::string(library_name) + " lacks " + name;
}

}  // namespace meshla::detail
