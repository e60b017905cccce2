/* The libFuzzer entry points of one target: built once per target with
 * -DFUZZ_ENTRY=fuzz_<target> (Makefile, `make fuzz`). The models and
 * sessions the target uses are made before the first input (an empty one),
 * so that the first input's run is not the one that pays for them. */
#include "fuzz.h"

#ifndef FUZZ_ENTRY
#error "build with -DFUZZ_ENTRY=fuzz_<target>"
#endif

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    static const uint8_t none[1];
    FUZZ_ENTRY(none, 0);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    return FUZZ_ENTRY(data, size);
}
