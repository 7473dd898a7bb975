// MESHLA_API marks what libmeshla exports: the public API of include/meshla, and the few internal
// declarations that the bindings use (each says so where it is declared). Everything else is
// built with hidden visibility, so that a binding or program can reach the library only through
// what is marked.
#pragma once

#define MESHLA_API __attribute__((visibility("default")))
