/* api_completions: request bodies of POST /v1/completions (OpenAI legacy text), parsed as the
 * server parses them (kvt_request_parse_opts) for the deepseek template
 * (ds4-tiny) and the plain one, with the default options and with volatile
 * lines kept and a replay hook; see fuzz_request (common.c) for what must
 * hold of a parse, of a refusal and of the responses to a parsed request.
 * (The legacy prompt is not rendered with a template.) */
#include "fuzz.h"

int fuzz_api_completions(const uint8_t *data, size_t size)
{
    fuzz_request(KVT_API_COMPLETIONS, data, size);
    return 0;
}
