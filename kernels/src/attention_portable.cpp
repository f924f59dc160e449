// The attention (attention.h) compiled for the portable path.
#define EAGLEX_NS portable
#include "attention_impl.h"
