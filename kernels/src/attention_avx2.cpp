// The attention (attention.h) compiled for the avx2 path.
#define EAGLEX_NS avx2
#include "attention_impl.h"
