// Functions of a library opened at run time (dlopen), for the optional ones: cuBLASMp, which may
// not be installed, and NVML, which comes with the driver rather than the toolkit.
#pragma once

#include <dlfcn.h>

#include <cstdlib>

#include <string>

namespace meshla::detail {

// Looks `name` up in `library`. On failure, the first missing function is recorded in `why`
// ("<library_name> lacks <name>"), so that a caller can resolve all it needs and then report.
// Opens the library the environment variable `override_variable` names, else `default_name` on
// the loader's path (libmeshla's run path included), never to be closed. nullptr where it cannot,
// with `why` set: "cannot load <file>: <dlerror> (<install_hint>, or set <override_variable>)".
inline void* open_library(const char* override_variable, const char* default_name,
                          const char* install_hint, std::string* why) {
  const char* override_path = std::getenv(override_variable);
  const char* path = override_path != nullptr ? override_path : default_name;
  void* library = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* error = dlerror();
    *why = std::string("cannot load ") + path + ": " + (error ? error : "unknown error") + " (" +
           install_hint + ", or set " + override_variable + ")";
  }
  return library;
}

template <typename Function>
void resolve_symbol(void* library, const char* library_name, const char* name, Function* out,
                    std::string* why) {
  *out = reinterpret_cast<Function>(dlsym(library, name));
  if (*out == nullptr && why->empty()) *why = std::string(library_name) + " lacks " + name;
}

}  // namespace meshla::detail
