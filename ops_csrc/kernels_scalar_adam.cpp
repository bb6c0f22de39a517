// The portable Adam kernels (isa_scalar.h).
#define ZO_ISA_ENTRY_POINTS(isa, I) ZO_DEFINE_ADAM_ENTRY_POINT(isa, I)
#include "isa_scalar.h"
