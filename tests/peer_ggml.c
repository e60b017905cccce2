/* libggml-base of the peer's llama.cpp (peer_ggml.h). */
#include "fixture.h"
#include "peer_ggml.h"

#include <dlfcn.h>
#include <stdio.h>

struct fx_ggml ggml;

/* Load libggml-base.so once (it stays loaded); NULL, or why it cannot be. */
const char *ggml_load(void)
{
    static char why[600];
    if (ggml.lib) return NULL;
    const char *r = fx_peer_skip_reason();
    if (r) return r;
    double install_s;
    if (!fx_peer_ensure(&install_s))
        return "npm ci --prefix " FX_PEER_DIR " failed (offline?): no libggml-base.so";
    if (install_s >= 0) printf("    npm ci took %.1f s\n", install_s);
    void *lib = dlopen(GGML_LIB, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        snprintf(why, sizeof why, "dlopen %s: %s", GGML_LIB, dlerror());
        return why;
    }
    ggml.traits = (const struct ggml_type_traits *(*)(int))dlsym(lib, "ggml_get_type_traits");
    ggml.quantize_chunk = (size_t (*)(int, const float *, void *, int64_t, int64_t, int64_t,
                                      const float *))dlsym(lib, "ggml_quantize_chunk");
    /* the newest type of the declared version: GGML_TYPE_COUNT holds */
    if (!ggml.traits || !ggml.quantize_chunk || !dlsym(lib, "dequantize_row_q2_0")) {
        snprintf(why, sizeof why, "%s lacks ggml_get_type_traits, ggml_quantize_chunk or q2_0: not "
                 "the llama.cpp of node-llama-cpp " FX_PEER_VERSION, GGML_LIB);
        dlclose(lib);
        return why;
    }
    ggml.lib = lib;
    return NULL;
}
