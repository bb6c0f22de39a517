// The portable Adagrad kernels (isa_scalar.h).
#define ZO_ISA_ENTRY_POINTS(isa, I) ZO_DEFINE_ADAGRAD_ENTRY_POINT(isa, I)
#include "isa_scalar.h"
