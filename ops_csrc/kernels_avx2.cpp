// The AVX2 kernels of every optimizer and the finiteness check (isa_avx2.h).
#define ZO_ISA_ENTRY_POINTS(isa, I)       \
    ZO_DEFINE_ADAM_ENTRY_POINT(isa, I)    \
    ZO_DEFINE_ADAGRAD_ENTRY_POINT(isa, I) \
    ZO_DEFINE_LION_ENTRY_POINT(isa, I) ZO_DEFINE_ALL_FINITE_ENTRY_POINT(isa, I)
#include "isa_avx2.h"
