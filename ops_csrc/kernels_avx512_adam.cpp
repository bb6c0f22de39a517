// The AVX-512 Adam kernels (isa_avx512.h).
#define ZO_ISA_ENTRY_POINTS(isa, I) ZO_DEFINE_ADAM_ENTRY_POINT(isa, I)
#include "isa_avx512.h"
