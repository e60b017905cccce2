/* The architecture table: one row per architecture file, in the order
 * kvt_model_from_gguf asks them whether they run a file, and the only
 * place that names them. Adding an architecture is a file with its row
 * (arch.h says what a row provides) and a line here. */
#include "arch/arch.h"
#include "arch/ds4.h"
#include "arch/llama.h"

const kvt_arch *const kvt_arches[] = {&kvt_arch_llama, &kvt_arch_ds4, NULL};
