// The attention (attention.h) compiled for the avx512 path.
#define EAGLEX_NS avx512
#include "attention_impl.h"
